"""The pieces of one benchmark decode: a method's cache, the prompt, the prefill (or a random fill of the
cache) and one greedy step."""

from __future__ import annotations

import torch

import kvdex
from kvdex.bench.config import HF_METHODS, BenchConfig, base_method
from kvdex.hf.cache import dynamic_cache
from kvdex.hf.compat import cache_kwargs


def kvdex_cache(cache) -> kvdex.Cache | None:
    """``cache`` where it is a :class:`kvdex.Cache`, else None (a transformers baseline's cache): the one
    place the benchmark tells the two apart."""
    return cache if isinstance(cache, kvdex.Cache) else None


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_attention(model, name: str) -> None:
    if getattr(model.config, "_attn_implementation", None) == name:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def make_cache(model, method: str, cfg: BenchConfig, budget: int | None = None):
    """The cache object of ``method`` for ``model`` (kvdex methods switch the model to kvdex attention)."""
    if method == "hf/dynamic":
        set_attention(model, "sdpa")
        return dynamic_cache(model)
    if method == "hf/offloaded":
        if next(model.parameters()).device.type != "cuda":
            raise RuntimeError("transformers' offloaded cache needs a CUDA device")
        set_attention(model, "sdpa")
        return dynamic_cache(model, offloading=True)
    policy, _, storage = base_method(method).partition("/")
    if storage not in ("device", "offload"):
        raise ValueError(f"method {method!r}: expected POLICY/device, POLICY/offload or one of {HF_METHODS}")
    return kvdex.Cache(
        model,
        policy,
        cfg.budget if budget is None else budget,
        page_size=cfg.page_size,
        sink=cfg.sink,
        window=cfg.window,
        offload=storage == "offload",
        dense_layers=cfg.dense_layers,
        page_cache=cfg.page_cache if storage == "offload" else 0,
        **cfg.policy_options.get(policy, {}),
    )


@torch.no_grad()
def prefill(model, cache, ids, chunk: int = 0):
    if chunk and ids.shape[1] > chunk:
        from kvdex.hf.prefill import chunked_prefill

        return chunked_prefill(model, cache, ids, chunk)[:, -1]
    out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


@torch.no_grad()
def fill_random(model, cache, context: int, batch: int, seed: int) -> None:
    """Fill ``cache`` as a prefill of ``context`` tokens would, with random keys and values instead of a forward.

    Every layer gets keys and values [batch, kv heads, context, head dim], N(0, 1) in the model's dtype,
    made on the model's device one layer at a time from a generator seeded by ``seed`` and the layer
    (every method sees the same numbers). A :class:`kvdex.Cache` adopts each layer through the ingest
    of a prefill (:meth:`kvdex.Cache.adopt_prefill`: store, offloaded host copy, page cache, the
    policy's index) with random observation queries; a transformers cache takes each layer through its
    ``update``. The next step decodes at position ``context``. Decode time does not depend on what the
    keys hold, so this times decoding at long contexts without the prefill's compute."""
    from kvdex.hf.cache import OBS_KEEP
    from kvdex.hf.distributed import tensor_parallel
    from kvdex.hf.model_parts import head_geometry, text_config

    p = next(model.parameters())
    ranks = tensor_parallel(model).size  # tensor parallelism: this rank's share of the heads
    q_heads, kv_heads, head_dim = head_geometry(model)
    q_heads, kv_heads = q_heads // ranks, kv_heads // ranks
    g = torch.Generator(device=p.device)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=p.device, dtype=p.dtype)

    def layer(i):  # k, v [B, H, L, D] and the last min(L, OBS_KEEP) queries [B, Hq, W, D]
        g.manual_seed(seed * 4096 + i)
        kv = (batch, kv_heads, context, head_dim)
        return randn(*kv), randn(*kv), randn(batch, q_heads, min(context, OBS_KEEP), head_dim)

    n = text_config(model).num_hidden_layers
    kc = kvdex_cache(cache)
    if kc is not None:
        kc.adopt_prefill((layer(i) for i in range(n)), torch.full((batch,), context))
        return
    for i in range(n):
        k, v, _ = layer(i)
        cache.update(k, v, i)
        del k, v


@torch.no_grad()
def decode_step(model, cache, ids):
    out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


def make_prompt(
    batch: int, length: int, vocab: int, seed: int, device, text_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Random token ids, or (``text_ids``: a tokenized text) windows of that text, one per row at
    different offsets, the text repeated as often as the length needs."""
    g = torch.Generator().manual_seed(seed)
    if text_ids is None or text_ids.numel() == 0:
        return torch.randint(1, vocab, (batch, length), generator=g).to(device)
    reps = -(-(length + text_ids.numel()) // text_ids.numel())
    long = text_ids.repeat(reps)
    starts = torch.randint(0, text_ids.numel(), (batch,), generator=g).tolist()
    return torch.stack([long[s : s + length] for s in starts]).to(device)


def load_text_ids(path: str, tokenizer) -> torch.Tensor:
    """Token ids of a text file (.txt, or .json with a "text" field) for real-model prompts."""
    import json
    from pathlib import Path

    raw = Path(path).read_text(errors="replace")
    if path.endswith(".json"):
        data = json.loads(raw)
        raw = data["text"] if isinstance(data, dict) else "\n\n".join(x["text"] for x in data)
    return torch.tensor(tokenizer(raw, add_special_tokens=False)["input_ids"], dtype=torch.long)
