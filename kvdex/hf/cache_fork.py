"""A prefilled prompt taken into a new ``kvdex.Cache`` without running the model (:meth:`kvdex.Cache.adopt_prefill`,
through which :meth:`~kvdex.Cache.fork`, ``copy.deepcopy(cache)`` and ``kvdex bench --kv random`` go)."""

from __future__ import annotations

from typing import Any

import torch


def adopt_prefill(cache: Any, layers, lengths: torch.Tensor, pads: torch.Tensor | None = None) -> None:
    """:meth:`kvdex.Cache.adopt_prefill` of ``cache`` (which says what the arguments are)."""
    if cache.step != -1 or any(lay.store is not None or lay.seen for lay in cache.layers):
        raise ValueError("adopt_prefill() needs a new cache (no prompt, no decoded token)")
    lengths = torch.as_tensor(lengths).cpu()
    pads = torch.zeros_like(lengths) if pads is None else torch.as_tensor(pads).cpu()
    seen = int((lengths + pads).max())  # columns of the padded prompt (transformers' sequence length)
    layers = iter(layers)  # not zip(): its reused result tuple would keep a layer alive into the next
    for dst in cache.layers:
        k, v, obs_q = next(layers, (None,) * 3)
        if k is None:
            n = len(cache.layers)
            raise ValueError(f"adopt_prefill(): layers gave {dst.layer_idx} layers, the model has {n}")
        dst.lazy_initialization(k, v)
        dst.seen = seen
        dst.engine.adopt(k, v, lengths, pads, obs_q)
        dst.prefilled = True
        del k, v, obs_q  # before the next layer is made: one layer's prompt alive at a time
    if next(layers, None) is not None:
        raise ValueError(f"adopt_prefill(): layers gave more than the model's {len(cache.layers)} layers")
    cache.step = 0
