"""Chunked prefill: a long prompt through the model in pieces, so memory does not grow with it.

One forward over a whole prompt keeps every layer's activations for every prompt token at once
(and, with an offloaded cache, hands the whole prompt's K/V of a layer to the store at once).
:func:`chunked_prefill` feeds ``chunk`` tokens per forward instead. The first chunk is an ordinary
prefill; each later chunk is a multi-token forward on a filled cache: the store appends the chunk
(an offloaded store writes the pages that leave its window to pinned host memory as it goes, in
one write per sequence), and the chunk's queries attend to the layer's whole context, rebuilt on
the device for that layer only (``OffloadStore.dense``: one DMA per (sequence, kv head)) and freed
before the next layer. So device memory holds at most one sparse layer's dense K/V (plus the
dense layers' resident K/V and one chunk's activations), whatever the context length; the KV of
the middle lives on the host. Without padding the chunk's attention is one fused lower-right
causal SDPA per group of kv heads (``kvdex.kernels.attention.causal_chunk_attention``).

Equivalent to one forward over the whole prompt (tests/test_chunked_prefill.py): same stored K/V
and last-position logits up to floating-point summation order.
"""

from __future__ import annotations

import torch

from kvdex.hf.cache import Cache
from kvdex.hf.compat import cache_kwargs


@torch.no_grad()
def chunked_prefill(
    model,
    cache,
    input_ids: torch.Tensor,
    chunk: int,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 1,
) -> torch.Tensor:
    """Prefill ``cache`` with ``input_ids`` [B, L] in forwards of ``chunk`` tokens; returns the logits
    of the last ``logits_to_keep`` positions of the last chunk, [B, logits_to_keep, vocab].

    ``attention_mask`` (left padding only) gives positions as ``generate`` does (the cumulative
    count of real tokens); the first chunk is widened to include every sequence's first real token
    (kvdex needs each sequence to have a token in its first forward). Works with any transformers
    cache; a kvdex cache is what keeps device memory flat.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (tokens per forward), got {chunk!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length] with length >= 1, got {tuple(input_ids.shape)}")
    b, n = input_ids.shape
    policy = cache.policy if isinstance(cache, Cache) else None
    if policy is not None and policy.obs_window and n > chunk:
        # such a policy scores the prompt with its last queries at ingest, which a first chunk does not have
        raise ValueError(
            f"policy {policy.name!r} reads an observation window of the prompt's last {policy.obs_window} queries "
            "when the prompt is ingested; chunked prefill ingests only the first chunk. Prefill it in one forward."
        )
    position_ids = None
    first = chunk
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (b, n):
            raise ValueError(f"attention_mask must be {(b, n)}, got {tuple(attention_mask.shape)}")
        m = attention_mask.long()
        position_ids = (m.cumsum(-1) - 1).clamp(min=0)
        pads = int((m.cumsum(-1) == 0).sum(-1).max())
        first = max(chunk, pads + 1)
    out = None
    start = 0
    reserved = False
    while start < n:
        end = min(n, start + (first if start == 0 else chunk))
        kw = {}
        if attention_mask is not None:
            kw = dict(attention_mask=attention_mask[:, :end], position_ids=position_ids[:, start:end])
        out = model(
            input_ids=input_ids[:, start:end],
            **cache_kwargs(cache),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kw,
        )
        start = end
        if not reserved and start < n:
            _reserve(cache, n)
            reserved = True
    if isinstance(cache, Cache):  # the whole prompt is its step 0
        cache.step = 0
    return out.logits


def _reserve(cache, n: int) -> None:
    """Size a kvdex cache's buffers for the whole prompt (plus decode slack) after its first chunk, so
    they do not grow by copying chunk after chunk (a growth needs old + new at once: near the host
    memory limit at 512k, and slow for pinned memory)."""
    if isinstance(cache, Cache):
        for lay in cache.layers:
            if lay.store is not None:
                lay.store.reserve_prompt(n)
