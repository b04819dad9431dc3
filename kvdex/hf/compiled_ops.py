"""kvdex's two entry points from the model as opaque ``torch.library`` custom ops, for ``torch.compile``.

``kvdex.Cache`` is ``is_compileable``, so transformers' ``generate`` compiles the model's decode step
(``torch.compile(model.__call__, **generation_config.compile_config)``). Under that compilation a
single-token ``Cache.update`` of a prefilled layer is the op ``kvdex::append`` and the ``"kvdex"``
attention function is ``kvdex::attend``: dynamo traces the whole model as one graph (no graph break per
layer, so no recompilation per layer). With kvdex's backend (:mod:`kvdex.hf.step_backend`, the compile
config :func:`kvdex.enable` sets) the whole step, these ops included, is captured in one CUDA graph. Both
ops carry the ``cudagraph_unsafe`` tag, so that under inductor's own CUDA graphs (another compile config)
they run outside those graphs, as ordinary Python calls: the eager ``update`` / attention of
:class:`~kvdex.hf.layer.KVDexLayer`, where kvdex's per-layer step graphs (:mod:`kvdex.engine.graphs.layer_graphs`)
replay the layer's append -> select -> fetch -> attend.

``kvdex::append`` returns an empty key ``[B, H, 0, D]``: the token that tells the attention function (at
trace time, by its shape) that the layer's keys are in a kvdex cache, and that orders the two ops. The
cache is found through its handle, a CPU integer tensor (a graph input, read by value at run time: one
compiled graph serves every cache). The layer's attention finds what ``append`` stored by layer index.
Importing this module registers the ops (``kvdex.hf.cache`` does); the attention function calls them as
``torch.ops.kvdex.attend``.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

_CACHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> kvdex.Cache
_IDS = itertools.count(1)
# .pending: layer index -> a weak reference to the KVDexLayer whose append ran, until its attention. Weak: a step
# interrupted between the two ops (an exception, Ctrl-C) leaves its entry behind, and a strong one would keep
# that layer's store (its device memory) alive after its cache was dropped, until the layer's next append
_local = threading.local()
_TAGS = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()


def register(cache) -> torch.Tensor:
    """A handle for ``cache`` (a CPU int64 scalar tensor)."""
    i = next(_IDS)
    _CACHES[i] = cache
    return torch.tensor(i, dtype=torch.long)


def cache_of(handle: torch.Tensor):
    """The kvdex.Cache behind ``handle`` (None: collected)."""
    return _CACHES.get(int(handle))


def _pending() -> dict:
    p = getattr(_local, "pending", None)
    if p is None:
        p = _local.pending = {}
    return p


@torch.library.custom_op("kvdex::append", mutates_args=(), tags=_TAGS)
def append(k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """``cache.update(k, v, layer_idx)`` of the cache behind ``handle``; returns an empty key [B, H, 0, D]."""
    cache = _CACHES.get(int(handle))
    if cache is None:
        raise RuntimeError("kvdex::append: the kvdex.Cache of this handle was garbage-collected")
    cache.update_eager(k, v, layer_idx)
    _pending()[layer_idx] = weakref.ref(cache.layers[layer_idx])
    return k.new_empty(k.shape[0], k.shape[1], 0, k.shape[3])


@append.register_fake
def _(k, v, handle, layer_idx):
    return k.new_empty(k.shape[0], k.shape[1], 0, k.shape[3])


@torch.library.custom_op("kvdex::attend", mutates_args=(), tags=_TAGS)
def attend(q: torch.Tensor, token: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    """The decode attention of layer ``layer_idx`` (appended by ``kvdex::append``): q [B, Hq, T, D] -> [B, T, Hq, D]."""
    ref = _pending().pop(layer_idx, None)
    layer = None if ref is None else ref()
    if layer is None:
        raise RuntimeError(f"kvdex::attend: layer {layer_idx} has no kvdex::append before it in this step")
    return layer.attend(q, scale).contiguous()


@attend.register_fake
def _(q, token, layer_idx, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
