"""``KVDexLayer``: the cache of one transformer layer inside a :class:`kvdex.Cache` -- transformers'
layer protocol (``update``, sequence lengths, mask sizes) around a :class:`kvdex.engine.LayerEngine`,
which owns the layer's store and its step (append, prefill ingest, decode attention).

The data flow of one decoding step is described in :mod:`kvdex.engine.step`; the owning cache is
held by a weak reference (``parent``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import CacheLayerMixin

from kvdex.engine.step import OBS_KEEP, LayerEngine, on_device
from kvdex.hf.attention import TAG

_on_device = on_device  # the former name (kvdex.hf.cache re-exports it)
__all__ = ["OBS_KEEP", "KVDexLayer"]


class KVDexLayer(CacheLayerMixin):
    """The cache of one transformer layer: transformers' layer protocol around a :class:`LayerEngine`."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, parent: HFCache, layer_idx: int, dense: bool):
        super().__init__()
        self.engine = LayerEngine(parent, layer_idx, dense)
        self.layer_idx = layer_idx
        self.dense = dense
        self.seen = 0  # columns seen, padding included (transformers' sequence length)
        # the store holds a prompt (a plain bool: what torch.compile's trace of Cache.update reads, so that
        # caches of any store type share one compiled graph)
        self.prefilled = False

    @property
    def parent(self) -> HFCache:
        return self.engine.host

    @property
    def store(self):
        return self.engine.store

    @store.setter
    def store(self, store) -> None:
        self.engine.store = store

    @property
    def pads(self) -> torch.Tensor | None:
        """[B] (CPU) left padding of the prompt (set at prefill)."""
        return self.engine.pads

    @property
    def _obs_q(self) -> torch.Tensor | None:
        return self.engine.obs_q

    # ---- transformers' layer protocol ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        parent, store = self.parent, self.engine.store
        if store is None and self.seen:
            raise ValueError(
                "this kvdex.Cache never received its prompt through kvdex attention: the model generating "
                "with it does not use attn_implementation='kvdex'. Create the cache with "
                "kvdex.Cache(model, ...) for the model you generate with (it calls kvdex.enable(model))"
            )
        steps = parent.step_graphs
        if store is not None:
            _check_shape(parent, store, key_states)
            if self.layer_idx == 0 and key_states.shape[2] == 1 and not parent.decoder_active:
                steps.begin()  # a decode step outside GraphDecoder: per-layer graphs (kvdex.engine.graphs.layer_graphs)
        parent.begin_update(self.layer_idx, key_states)
        if store is not None:
            if steps.deferred():
                steps.stash(self, key_states, value_states)  # appended inside the layer's graph
            else:
                self.engine.append(key_states, value_states)
        self.seen += key_states.shape[2]
        tagged = key_states.view(key_states.shape)
        setattr(tagged, TAG, self)
        return tagged, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        if query_length == 0 and self.seen == 0:  # the model would fail on an empty reshape
            raise ValueError("the prompt is empty (0 tokens): pass at least one token (check the tokenized input)")
        if query_length == 1 and self.engine.store is not None:
            # a decode step: kvdex attends from its store (padding known since the prefill), so the mask
            # covers the new token only -- always real, hence no mask: nothing that grows with the sequence
            # reaches the model (no mask kernels per step, and one shape for torch.compile)
            # (under torch.compile the offset is not read: no guard on the sequence length)
            return 1, 0 if torch.compiler.is_compiling() else self.seen
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.engine.store, self.seen, self.prefilled = None, 0, False

    @property
    def batch_size(self) -> int:
        return -1 if self.engine.store is None else self.engine.store.batch

    # ---- attention -------------------------------------------------------------------------------
    def attention(
        self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q [B, Hq, T, D]; k/v as returned by ``update``. Returns [B, T, Hq, D]."""
        self.parent.check_module(module, self.layer_idx)
        return self.attend(q, scale, k, v, key_mask)

    def attend(self, q: torch.Tensor, scale: float, k=None, v=None, key_mask=None) -> torch.Tensor:
        """:meth:`attention` after the module check (``kvdex::attend`` under torch.compile: a decode step,
        no k/v needed)."""
        parent = self.parent
        steps = parent.step_graphs
        if steps.deferred():
            return steps.attend(self, q, scale)
        out = self.engine.attention(q, k, v, key_mask, scale)
        self.prefilled = self.engine.store is not None
        if steps.in_step and self.layer_idx == len(parent.layers) - 1:
            steps.end()
        return out


def _check_shape(parent, store, key_states: torch.Tensor) -> None:
    """New keys must fit the keys already stored (batch, kv heads, head dim); else another model or batch."""
    b, h, _, d = key_states.shape
    if (b, h, d) != (store.batch, store.kv_heads, store.head_dim):
        raise ValueError(
            f"this kvdex.Cache holds a prompt of batch {store.batch} with {store.kv_heads} kv heads of dim "
            f"{store.head_dim} (model {parent.model_name}); the new tokens have batch {b}, {h} kv heads of dim {d}. "
            "A cache serves one model and one batch: create a new kvdex.Cache(model, ...) for this model or batch"
        )
