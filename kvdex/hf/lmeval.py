"""The ``kvdex`` model of lm-evaluation-harness 0.4.x: Hugging Face's ``hf`` model decoding through kvdex.

:class:`KVDexLM` subclasses lm-eval's ``HFLM`` and overrides one hook, ``_model_generate``: every
``generate`` call (one batch of ``generate_until`` requests, left-padded) gets a fresh
``kvdex.Cache`` for that batch. Everything else (batching, stop sequences, chat templates,
loglikelihood scoring) is ``HFLM``'s own code.

Loglikelihood requests (multiple-choice tasks, ``loglikelihood_rolling`` perplexity) run HFLM's
single forward pass over context + continuation with no kvdex cache, i.e. dense attention (through
kvdex's dense path, which the model keeps without a cache). A kvdex cache would not change them:
kvdex prefills densely, and a continuation scored in one pass is prefill. Sparse selection only
applies to tokens decoded one at a time.

lm-eval 0.4.13 finds models in its own registry only (no entry points, and ``--include_path``
is for tasks), so the registration runs when this module is imported: use ``python -m
kvdex.lmeval`` (which hands its arguments to lm-eval's CLI) or ``import kvdex.lmeval`` before
``lm_eval.simple_evaluate(model="kvdex", ...)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        'the kvdex model for lm-evaluation-harness needs lm-eval 0.4.x: pip install "kvdex[lmeval]"'
    ) from exc

import torch

from kvdex.config import DEFAULT_BUDGET, CacheConfig
from kvdex.hf.cache import Cache
from kvdex.hf.compat import cache_kwargs
from kvdex.hf.loading import enable
from kvdex.models import resolve_model
from kvdex.policies import make_policy, policies
from kvdex.policies.registry import policy_class
from kvdex.policies.spec import parse_policy_spec

# kvdex.Cache's keyword arguments (sizes, offload, page_cache, ...): the CacheConfig fields besides budget
CACHE_ARGS = tuple(f.name for f in dataclasses.fields(CacheConfig) if f.name != "budget")
HFLM_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}
# HFLM arguments kvdex cannot honour: kvdex needs its own attention, and decoder-only models
REFUSED = {
    "attn_implementation": "kvdex sets the model's attention implementation itself (kvdex.enable)",
    "backend": "kvdex supports decoder-only (causal) models only; drop backend=",
    "parallelize": "a kvdex cache keeps each layer's KV on one device; drop parallelize=",
    "tp_plan": "use kvdex's own tensor-parallel support, not HFLM's tp_plan",
}


def _policy_fields(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(policy_class(name))}


def split_model_args(policy, kwargs: dict) -> tuple[str, dict, dict, dict]:
    """``(policy name, policy options, kvdex.Cache keyword arguments, HFLM arguments)`` from model_args.

    ``policy`` may carry options (``"chess:preset=moderate"``); a model arg named after a field of
    the chosen policy is a policy option too (it overrides the spec). Arguments that name a kvdex
    size, an option of another policy, or look like a misspelt kvdex argument raise ``ValueError``;
    the rest go to HFLM (and from there to ``from_pretrained``).
    """
    if not isinstance(policy, str) or not policy:
        raise ValueError(f"policy must be a policy name such as 'quest' (kvdex.policies()), got {policy!r}")
    name, options = parse_policy_spec(policy)
    if name not in policies():
        raise ValueError(f"unknown kvdex policy {name!r}; valid policies: {', '.join(policies())}")
    fields = _policy_fields(name)
    other = set().union(*(_policy_fields(p) for p in policies())) - fields
    cache_args, hf_args = {}, {}
    for key, value in kwargs.items():
        if key in CACHE_ARGS:
            cache_args[key] = value
        elif key in fields:
            options[key] = value
        elif key in REFUSED:
            raise ValueError(f"model arg {key}={value!r} is not supported by the kvdex model: {REFUSED[key]}")
        elif key in other:
            raise ValueError(
                f"model arg {key!r} is not an option of policy {name!r} (another policy has it); "
                f"{name}'s options are: {', '.join(sorted(fields)) or '(none)'}"
            )
        elif key in HFLM_ARGS:
            hf_args[key] = value
        else:
            names = ["budget", *CACHE_ARGS, *fields, "policy", "gguf_file"]
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
            if close:
                raise ValueError(f"unknown model arg {key!r} for the kvdex model; did you mean {close[0]!r}?")
            hf_args[key] = value  # e.g. device_map, low_cpu_mem_usage: HFLM passes them to from_pretrained
    return name, options, cache_args, hf_args


def validate(name: str, options: dict, budget, cache_args: dict) -> dict:
    """Everything that can be checked without the model: the policy's options (returned, typed, defaults
    included) and the cache sizes."""
    try:
        effective = make_policy(name, **options).options()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kvdex policy {name!r}: {exc}") from exc
    try:
        CacheConfig(budget=budget, **cache_args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kvdex cache sizes: {exc}") from exc
    return effective


@register_model("kvdex")
class KVDexLM(HFLM):
    """lm-eval's ``hf`` model generating through a fresh ``kvdex.Cache`` per batch.

    Model args: everything ``hf`` takes, plus ``policy`` (a name, optionally with options,
    ``chess:preset=moderate``), ``budget`` and ``kvdex.Cache``'s keyword arguments (``page_size``,
    ``sink``, ``window``, ``offload``, ``dense_layers``, ``page_cache``, ...); a model arg named
    after an option of the chosen policy sets it. ``pretrained`` also takes kvdex's model aliases
    (``smollm2``, ``qwen05b``) and a ``.gguf`` file path (:func:`kvdex.models.resolve_model`).
    """

    def __init__(
        self,
        pretrained="smollm2",
        policy: str = "quest",
        budget: int = DEFAULT_BUDGET,
        gguf_file: str | None = None,
        device: str | None = None,
        **kwargs,
    ) -> None:
        name, options, cache_args, hf_args = split_model_args(policy, kwargs)
        effective = validate(name, options, budget, cache_args)
        if isinstance(pretrained, str):
            try:
                pretrained, gguf_file = resolve_model(pretrained, gguf_file)
            except ValueError as exc:
                raise ValueError(f"kvdex model args pretrained={pretrained!r}, gguf_file={gguf_file!r}: {exc}") from exc
            if device is None:  # HFLM needs a string; kvdex.load's choice
                device = "cuda" if torch.cuda.is_available() else "cpu"
        elif gguf_file is not None:
            raise ValueError("gguf_file names a file to load; drop it when pretrained is an already-loaded model")
        if gguf_file is not None:
            hf_args["gguf_file"] = gguf_file
        if device is not None:
            hf_args["device"] = device
        super().__init__(pretrained=pretrained, **hf_args)
        if getattr(self, "backend", "causal") != "causal":
            raise ValueError("the kvdex model supports decoder-only (causal) language models only")
        enable(self.model)  # ValueError for models kvdex cannot serve (e.g. sliding-window layers)
        self.kvdex_policy, self.kvdex_options = name, options
        self.kvdex_policy_options = effective  # every option of the policy, as it runs
        self.kvdex_cache_args = {"budget": budget, **cache_args}
        self.make_cache()  # checks the sizes against the model (budget vs heads, page_cache, ...)
        self.kvdex_usage = {
            "generate_calls": 0,
            "sequences": 0,
            "decode_steps": 0,
            "attended_tokens_per_step": None,
            "context_tokens_max": 0,
        }
        self.last_cache_stats: dict | None = None
        self._attended_sum, self._attended_steps = 0.0, 0

    def make_cache(self) -> Cache:
        """A fresh cache with this model's policy and sizes."""
        try:
            return Cache(self.model, self.kvdex_policy, **self.kvdex_cache_args, **self.kvdex_options)
        except TypeError as exc:
            raise ValueError(f"kvdex model args: {exc}") from exc

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        for key, why in (("num_beams", "beam search"), ("num_return_sequences", "several sequences per prompt")):
            if int(generation_kwargs.get(key) or 1) > 1:
                raise ValueError(f"kvdex caches do not support {why}; remove {key} from the task's generation_kwargs")
        cache = self.make_cache()
        out = super()._model_generate(context, max_length, stop, **generation_kwargs, **cache_kwargs(cache))
        self._record(cache.stats())
        return out

    def _record(self, stats: dict) -> None:
        u = self.kvdex_usage
        steps, per_step = stats["decode_steps"], stats["attended_tokens_per_step"]
        if per_step is not None and steps:  # mean over the decode steps of every call
            self._attended_sum += per_step * steps
            self._attended_steps += steps
            u["attended_tokens_per_step"] = self._attended_sum / self._attended_steps
        u["generate_calls"] += 1
        u["sequences"] += len(stats["context_tokens"])
        u["decode_steps"] += steps
        u["context_tokens_max"] = max([u["context_tokens_max"], *stats["context_tokens"]])
        self.last_cache_stats = stats

    def get_model_info(self) -> dict:
        """HFLM's model info plus the kvdex configuration and usage (lands in results["config"]["kvdex"])."""
        info = super().get_model_info()
        info["kvdex"] = {
            "policy": self.kvdex_policy,
            "policy_options": dict(self.kvdex_policy_options),
            **self.kvdex_cache_args,
            "usage": dict(self.kvdex_usage),
        }
        return info


def main(argv: list[str] | None = None) -> None:
    """``python -m kvdex.lmeval ARGS``: lm-eval's own command line, with the ``kvdex`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
