"""What ``kvdex bench`` measures: :class:`BenchConfig` and the method names (``POLICY/STORAGE[+graph][+compile]``
for kvdex policies, ``hf/dynamic`` / ``hf/offloaded`` for transformers' caches)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdex.config import DEFAULT_DENSE_LAYERS, DEFAULT_PAGE_SIZE, DEFAULT_SINK, DEFAULT_WINDOW

HF_METHODS = ("hf/dynamic", "hf/offloaded")
# where the cache's prompt comes from: "prompt" = a prefill forward over the prompt's token ids;
# "random" = random keys / values put straight into the cache (decode timings only)
KV_SOURCES = ("prompt", "random")


@dataclass
class BenchConfig:
    shape: str = "llama3-8b"
    dtype: str = "bfloat16"
    device: str = "cuda"
    contexts: tuple[int, ...] = (32768, 131072)
    batches: tuple[int, ...] = (1,)
    policies: tuple[str, ...] = ("quest",)
    storages: tuple[str, ...] = ("device", "offload")
    baselines: tuple[str, ...] = HF_METHODS
    budget: int = 2048
    page_size: int = DEFAULT_PAGE_SIZE
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    dense_layers: int = DEFAULT_DENSE_LAYERS
    steps: int = 100
    warmup: int = 10
    split_steps: int = 10
    check_context: int = 2048
    check: bool = True
    # True: also run every kvdex method through kvdex.hf.graph (CUDA graphs) as "POLICY/STORAGE+graph";
    # "only": just the graph variants
    graph: bool | str = False
    # True: also the graph variants with the model's decoder layers through torch.compile (inductor, no
    # inductor cudagraphs), as "POLICY/STORAGE+graph+compile" (kvdex.hf.compiled_layers.CompiledLayers)
    compile: bool = False
    seed: int = 0
    policy_options: dict = field(default_factory=dict)
    # offloaded kvdex methods: device page-cache slots per (sequence, kv head); 0 = off
    page_cache: int = 0
    # prefill in forwards of this many tokens (kvdex.hf.prefill.chunked_prefill); 0 = one forward
    prefill_chunk: int = 0
    # a real model (path or .gguf, loaded by kvdex.load) instead of random weights of ``shape``
    model: str | None = None
    # prompt text for a real model (a .txt file, or .json with a "text" field); else random token ids
    text: str | None = None
    # "prompt": each method prefills its prompt through the model (timed: prefill_s); "random": each
    # method's cache is filled with N(0, 1) keys / values of the context length per layer, seeded, through
    # the ingest of a prefill (kvdex.bench.decoding.fill_random; timed: fill_s). Decode is the same either way.
    kv: str = "prompt"

    def __post_init__(self):
        if self.kv not in KV_SOURCES:
            raise ValueError(
                f"--kv {self.kv!r}: use 'prompt' (prefill a prompt through the model) or 'random' (fill the cache "
                "with random keys/values; decode timings only)"
            )
        if self.kv == "random" and (self.text or self.prefill_chunk):
            raise ValueError(
                "--kv random fills the cache without a prompt: drop --text and --prefill-chunk (they shape the "
                "prefill of --kv prompt)"
            )

    def methods(self) -> list[str]:
        out = [f"{p}/{s}" for p in self.policies for s in self.storages]
        if self.graph == "only":
            out = [f"{m}+graph" for m in out]
        elif self.graph:
            out += [f"{m}+graph" for m in out]
        if self.compile:
            out += [f"{m}+compile" for m in out if m.endswith("+graph")]
        return out + list(self.baselines)


def base_method(method: str) -> str:
    """'quest/device+graph+compile' -> 'quest/device' (the cache; the suffixes say how it is decoded)."""
    return method.split("+", 1)[0]


def is_graph(method: str) -> bool:
    return "+graph" in method


def is_compiled(method: str) -> bool:
    return method.endswith("+compile")


def parse_dtype(name: str):
    try:
        return {
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
            "float32": torch.float32,
            "fp32": torch.float32,
        }[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use bfloat16, float16 or float32") from None
