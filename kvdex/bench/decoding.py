"""The pieces of one benchmark decode: a method's cache, the prompt, the prefill and one greedy step."""

from __future__ import annotations

import torch

import kvdex
from kvdex.bench.config import HF_METHODS, BenchConfig, base_method
from kvdex.hf.cache import dynamic_cache
from kvdex.hf.compat import cache_kwargs


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
