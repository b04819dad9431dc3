"""kvdex's settings inside a vLLM engine: ``additional_config["kvdex"]`` (``vllm serve ... --additional-config
'{"kvdex": {"policy": "quest", "budget": 2048}}'`` or ``LLM(..., additional_config={"kvdex": {...}})``), parsed
and checked once, with a ``ValueError`` naming the fix for every mistake.

Keys: ``policy`` (a policy spec, ``"name:KEY=VALUE:..."``, as everywhere in kvdex; default ``quest``), the
:class:`~kvdex.config.CacheConfig` sizes ``budget``, ``page_size``, ``sink``, ``window``, ``dense_layers``,
``prefill_chunk``, ``max_idle_steps`` (engine steps a request's state is kept while the request is not in the
batch, :mod:`kvdex.vllm.requests`), ``prefill_attention`` (:data:`PREFILL_ATTENTION`) and ``decode_graphs``
(each request's decode step replays one CUDA graph per layer, kvdex's per-layer step graphs over the request's
blocks; off by default). ``offload`` / ``page_cache`` are refused: the KV lives in vLLM's blocks.

Policies: every registered policy but those in :data:`REFUSED` (none) runs (:data:`SUPPORTED`). CHESS's default trigger
(``uncertainty``) measures the next-token distribution, which an attention backend never sees: under vLLM a plain
``chess`` rebuilds its selection on a fixed interval (``trigger=interval``, Appendix C of the paper) and
``trigger=uncertainty`` named explicitly is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdex.config import DEFAULT_BUDGET, CacheConfig
from kvdex.policies import make_policy, policies
from kvdex.policies.base import Policy
from kvdex.policies.spec import parse_policy_spec

#: Policies that cannot run on vLLM's paged layout, and why (none at present: IceCache's semantic re-layout belongs
#: to its offloaded store, and offload is refused; on vLLM's blocks it reads keys through the store's fetch path).
REFUSED: dict[str, str] = {}

DEFAULT_POLICY = "quest"
DEFAULT_MAX_IDLE_STEPS = 32
_CACHE_KEYS = ("budget", "page_size", "sink", "window", "dense_layers", "prefill_chunk")
_KEYS = ("policy", *_CACHE_KEYS, "max_idle_steps", "prefill_attention", "decode_graphs")
#: how prompt chunks attend: kvdex's PyTorch path (``torch``: the request's keys gathered from the blocks, then
#: SDPA), or vLLM's FlashAttention kernel straight on the paged cache (``flash``, CUDA)
PREFILL_ATTENTION = ("torch", "flash")


def supported() -> tuple[str, ...]:
    """The registered policies that run under vLLM (all but :data:`REFUSED`)."""
    return tuple(p for p in policies() if p not in REFUSED)


SUPPORTED = supported()


@dataclass(frozen=True)
class VllmSettings:
    """The policy spec, the cache sizes and the request-state lifetime of one vLLM engine."""

    policy: str = DEFAULT_POLICY
    config: CacheConfig = field(default_factory=lambda: CacheConfig(budget=DEFAULT_BUDGET))
    max_idle_steps: int = DEFAULT_MAX_IDLE_STEPS
    prefill_attention: str = "torch"
    decode_graphs: bool = False

    def make_policy(self) -> Policy:
        """A fresh policy instance (one per request)."""
        name, options = parse_policy_spec(self.policy)
        if name == "chess":
            options.setdefault("trigger", "interval")
        return make_policy(name, **options)


def check_policy(spec: str) -> None:
    """ValueError for a policy spec that does not parse, names an unknown or refused policy, or asks for
    something an attention backend cannot give."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f'kvdex policy must be a policy spec string such as "quest", got {spec!r}')
    name, options = parse_policy_spec(spec)
    if name in REFUSED:
        raise ValueError(
            f"policy {name!r} does not run inside vLLM: {REFUSED[name]}. Policies that run: {', '.join(supported())}"
        )
    if name not in policies():
        raise ValueError(f"unknown policy {name!r}; policies that run inside vLLM: {', '.join(supported())}")
    if name == "chess" and options.get("trigger") == "uncertainty":
        raise ValueError(
            "chess:trigger=uncertainty measures the next-token logits, which a vLLM attention backend never sees: "
            "use chess:trigger=interval (the default under vLLM; interval=N steps), always or never"
        )
    VllmSettings(policy=spec).make_policy()  # the policy's own option checks (TypeError / ValueError)


def settings_from(additional_config: Mapping[str, Any] | None) -> VllmSettings:
    """The settings of ``vllm_config.additional_config`` (its ``"kvdex"`` entry; none: the defaults)."""
    raw = (additional_config or {}).get("kvdex", {})
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(
            f'additional_config["kvdex"] must be a JSON object such as {{"policy": "quest", "budget": 2048}}, '
            f"got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        hint = " (the KV stays in vLLM's GPU blocks: no offload)" if {"offload", "page_cache"} & set(unknown) else ""
        raise ValueError(f"unknown kvdex setting(s) {', '.join(unknown)}{hint}; the settings are: {', '.join(_KEYS)}")
    for key in (*_CACHE_KEYS, "max_idle_steps"):
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
            raise ValueError(f"kvdex setting {key} must be an integer, got {raw[key]!r}")
    spec = raw.get("policy", DEFAULT_POLICY)
    check_policy(spec)
    sizes = {k: raw[k] for k in _CACHE_KEYS if k in raw}
    config = CacheConfig(**{"budget": DEFAULT_BUDGET, **sizes})
    if config.sink % config.page_size:
        raise ValueError(
            f"sink ({config.sink}) must be a multiple of page_size ({config.page_size}) under vLLM, so that every "
            f"middle page is one vLLM block: pass sink={config.page_size * (config.sink // config.page_size)}"
        )
    policy = VllmSettings(policy=spec).make_policy()
    unit = policy.smallest_retrieval(config.page_size)
    if policy.uses_budget and config.retrieval_tokens < unit:
        raise ValueError(
            f"budget {config.budget} leaves {config.retrieval_tokens} tokens for retrieval after sink {config.sink} + "
            f"window {config.window}: {policy.name} would retrieve nothing; pass budget >= "
            f"{config.sink + config.window + unit}"
        )
    idle = raw.get("max_idle_steps", DEFAULT_MAX_IDLE_STEPS)
    if idle < 0:
        raise ValueError(f"max_idle_steps must be >= 0, got {idle}")
    prefill = raw.get("prefill_attention", "torch")
    if prefill not in PREFILL_ATTENTION:
        allowed = ", ".join(PREFILL_ATTENTION)
        raise ValueError(f"kvdex setting prefill_attention must be one of {allowed}, got {prefill!r}")
    graphs = raw.get("decode_graphs", False)
    if not isinstance(graphs, bool):
        raise ValueError(f"kvdex setting decode_graphs must be true or false, got {graphs!r}")
    return VllmSettings(policy=spec, config=config, max_idle_steps=idle, prefill_attention=prefill,
                        decode_graphs=graphs)  # fmt: skip


def describe(settings: VllmSettings) -> dict[str, Any]:
    """The settings as a plain dict (logs, the check command's report)."""
    return {"policy": settings.policy, **dataclasses.asdict(settings.config), "max_idle_steps": settings.max_idle_steps,
            "prefill_attention": settings.prefill_attention, "decode_graphs": settings.decode_graphs}  # fmt: skip
