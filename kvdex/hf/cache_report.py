"""``kvdex.Cache.stats()``: what a cache holds, moved and attended, summed over the layers (and the ranks
under tensor parallelism), with the policy's own counters."""

from __future__ import annotations

from typing import Any


def cache_stats(cache: Any) -> dict:
    """The report of :meth:`kvdex.Cache.stats` for the cache ``cache``."""
    layers = [lay for lay in cache.layers if lay.store is not None]
    dev = sum(lay.store.device_bytes() for lay in layers)
    host = sum(lay.store.host_bytes() for lay in layers)
    lengths = layers[0].store.lengths_host.tolist() if layers else []
    sparse = [lay for lay in layers if not lay.dense]
    t = cache.transfer
    pcs = [lay.store.page_cache_stats() for lay in sparse if lay.store.page_cache]
    pc = [sum(p[k] for p in pcs) for k in ("hits", "misses", "bytes_moved")]
    cnt = cache.counters
    attended = float(cnt.attended) if cnt.attended is not None else 0.0
    counts = cache.tp.sum_values(dev, host, t.h2d_bytes, t.d2h_bytes, t.h2d_calls, attended, *pc)
    dev, host, h2d, d2h, calls, hits, misses, moved = (int(v) for v in counts[:5] + counts[6:])
    per_head = None
    if cnt.attended is not None and sparse:
        b, h = sparse[0].store.batch, sparse[0].store.kv_heads * cache.tp.size
        per_head = counts[5] / (cnt.calls * b * h)
    c = cache.config
    out = {
        "policy": cache.policy.name,
        "policy_options": cache.policy.options(),
        "budget": c.budget if cache.policy.uses_budget else None,
        "page_size": c.page_size,
        "sink": c.sink,
        "window": c.window,
        "retrieval_tokens": c.retrieval_tokens if cache.policy.uses_budget else None,
        "dense_layers": c.dense_layers,
        "sparse_layers": len(cache.policy.info.sparse_layers),
        "offload": c.offload,
        "context_tokens": lengths,
        "decode_steps": max(cache.step, 0),
        "kv_bytes_device": dev,
        "kv_bytes_host": host,
        "bytes_host_to_device": h2d,
        "bytes_device_to_host": d2h,
        "host_to_device_transfers": calls,
        "attended_tokens_per_step": per_head,
        "tensor_parallel_ranks": cache.tp.size,
        "policy_stats": cache.policy.stats(),
    }
    # the decode steps that selected anew and those that attended the last selection (select_every > 1)
    every = cache.policy.reuse_steps()
    selected, reused = (cache.reuse.selected, cache.reuse.reused) if every > 1 else (out["decode_steps"], 0)
    out["selection_steps"] = {"select_every": every, "selected": selected, "reused": reused}
    if pcs:  # offloaded with a device page cache: its hits, and the bytes it moved (not in the line above)
        out["page_cache"] = {
            "slots": cache.page_cache,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "bytes_moved": moved,
        }
    if c.timing:
        steps = max(cache.step, 1)
        out["time_ms_per_step"] = {k: v / steps for k, v in sorted(cache.counters.timing.items())}
    return out
