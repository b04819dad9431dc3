"""``KVDexLayer``: the cache of one transformer layer inside a :class:`kvdex.Cache` (its store plus the glue
to the policy): transformers' layer protocol (``update``), the attention of one layer at prefill and at
decode (``attention``: ``policy.select`` -> ``store.attend`` -> the decode kernel), page joins.

The data flow of one decoding step is described in :mod:`kvdex.integration.cache`; the owning cache is
held by a weak reference (``parent``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import CacheLayerMixin

from kvdex.integration.attention import TAG
from kvdex.kernels import dense_attention, dense_decode_attention, paged_decode_attention, sparse_decode_attention
from kvdex.kernels.attention import causal_chunk_attention
from kvdex.kernels.dispatch import triton_kernel
from kvdex.storage import host_joins, left_padding, strip_left_padding

# Prompt queries kept per layer after prefill so a fork can serve observation-window policies.
OBS_KEEP = 128


class KVDexLayer(CacheLayerMixin):
    """The cache of one transformer layer: a store plus the glue to the policy."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, parent: HFCache, layer_idx: int, dense: bool):
        super().__init__()
        self._parent = weakref.ref(parent)
        self.layer_idx = layer_idx
        self.dense = dense
        self.store = None
        self.seen = 0  # columns seen, padding included (transformers' sequence length)
        self.pads: torch.Tensor | None = None  # [B] (CPU) left padding of the prompt (set at prefill)

    @property
    def parent(self) -> HFCache:
        p = self._parent()
        if p is None:
            raise RuntimeError("the kvdex.Cache owning this layer was garbage-collected")
        return p

    # ---- transformers' layer protocol ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        parent = self.parent
        if self.store is None and self.seen:
            raise ValueError(
                "this kvdex.Cache never received its prompt through kvdex attention: the model generating "
                "with it does not use attn_implementation='kvdex'. Create the cache with "
                "kvdex.Cache(model, ...) for the model you generate with (it calls kvdex.enable(model))"
            )
        if self.store is not None:
            _check_shape(parent, self.store, key_states)
        parent._on_update(self.layer_idx, key_states)
        if self.store is not None:
            if key_states.shape[2] > 1:  # read only by attention() over several new tokens (a kernel saved)
                self._lengths_before = self.store.lengths.clone()
            if self._joins_static(key_states):
                self._append_join(key_states, value_states)
            else:
                update = self.store.append(key_states, value_states)
                update.store = self.store
                if not self.dense and not update.empty:
                    parent.policy.index(self.layer_idx, update)
        self.seen += key_states.shape[2]
        tagged = key_states.view(key_states.shape)
        setattr(tagged, TAG, self)
        return tagged, value_states

    def _joins_static(self, key_states: torch.Tensor) -> bool:
        """Whether this append takes the capturable page-join path (CUDA-graph decoding: static sizing, one
        token, a policy with ``capturable_index``) -- on a step that the decoder marks as a join step, or,
        without a decoder (``Cache.join_step`` None), on a step in which a page joins the middle."""
        parent = self.parent
        if key_states.shape[2] != 1 or not self.store.static or not parent.policy.capturable_index:
            return False
        if parent.join_step is None:
            return bool((host_joins(self.store.grid, self.store.lengths_host)[1] > 0).any())
        if not parent.join_step and bool((host_joins(self.store.grid, self.store.lengths_host)[1] > 0).any()):
            raise RuntimeError("a page joins the middle in a step the decoder did not mark as a join step")
        return parent.join_step

    def _append_join(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token through ``store.append_join`` and, for a sparse layer, ``policy.index_join`` (device work
        with fixed shapes). The policy's host side (``joined``) runs here unless a decoder runs it before
        the step (``Cache.joins_external``: a replay skips this Python)."""
        parent = self.parent
        join = self.store.append_join(k, v)
        if self.dense:
            return
        policy = parent.policy
        policy.reserve_index(self.layer_idx, int(self.store.grid.num_middle_pages(self.store.lengths_host).max()),
                             self.store)  # fmt: skip
        if not parent.joins_external and bool((join.host_count > 0).any()):
            policy.joined(self.layer_idx, join.host_start, join.host_count)
        policy.index_join(self.layer_idx, join)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        if query_length == 0 and self.seen == 0:  # the model would fail on an empty reshape
            raise ValueError("the prompt is empty (0 tokens): pass at least one token (check the tokenized input)")
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store, self.seen = None, 0

    @property
    def batch_size(self) -> int:
        return -1 if self.store is None else self.store.batch

    # ---- attention -------------------------------------------------------------------------------
    def attention(
        self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q [B, Hq, T, D]; k/v as returned by ``update``. Returns [B, T, Hq, D]."""
        parent = self.parent
        parent._check_module(module, self.layer_idx)
        b, t = q.shape[0], q.shape[2]
        if self.store is None:  # prefill: dense attention, then ingest the prompt
            L = k.shape[2]
            q_pos = None if key_mask is None else torch.arange(L, device=q.device).expand(b, L)
            out = dense_attention(q, k, v, q_pos, key_mask, scale, parent.config.prefill_chunk)
            self._ingest(k, v, left_padding(key_mask, b, L), q)
            return out
        if t == 1:
            return self._decode(q[:, :, 0], scale).unsqueeze(1)
        # several new tokens on top of a filled cache (e.g. a second turn): dense over everything
        kd, vd = self.store.dense()
        if bool((self.store.lengths_host == kd.shape[2]).all()):  # no ragged lengths: fused lower-right causal
            return causal_chunk_attention(q, kd, vd, scale)
        q_pos = self._lengths_before[:, None] + torch.arange(t, device=q.device)[None, :]
        key_mask = torch.arange(kd.shape[2], device=q.device)[None, :] < self.store.lengths[:, None]
        return dense_attention(q, kd, vd, q_pos, key_mask, scale, parent.config.prefill_chunk)

    def _ingest(self, k, v, pads, q) -> None:
        self._adopt(strip_left_padding(k, pads), strip_left_padding(v, pads), k.shape[2] - pads, pads, q)

    def _adopt(self, k, v, lengths, pads, q) -> None:
        """Store left-aligned prompt k/v [B, H, L, D] and index it; q: the prompt's last queries."""
        parent = self.parent
        self.store = parent._new_store(self, k)
        update = self.store.ingest(k, v, lengths)
        update.store = self.store
        # kept for fork(): policies with an observation window (a copy: a view would keep the whole prompt's q)
        self._obs_q = q[:, :, -OBS_KEEP:].clone()
        self.pads = pads
        if self.dense:
            return
        w = min(parent.policy.obs_window, q.shape[2])
        if w:
            update.obs_queries = q[:, :, -w:]  # left padding: the last rows are the newest real tokens
            j = torch.arange(w)
            update.obs_valid = (j[None, :] >= (w - lengths)[:, None]).to(q.device)
        parent.policy.index(self.layer_idx, update)

    def _decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        parent, store = self.parent, self.store
        if self.dense:
            return self._dense_decode(q, scale)
        with parent._timed("selection"):
            sel = _on_device(parent.policy.select(self.layer_idx, q, store, scale), store.device)
        if sel.everything and store.positional_slots and parent.observer is None:
            return self._dense_decode(q, scale)  # exact and faster; observed runs take the slot path
        fused = store.positional_slots and parent.observer is None and not parent.policy.observes
        if fused and sel.pages is not None and sel.tokens is None:
            out = self._paged_decode(q, sel.pages, scale)  # CUDA: slot list built inside the kernel
            if out is not None:
                return out
        with parent._timed("transfer"):
            aset = store.attend(sel)
        with parent._timed("attention"):
            out = sparse_decode_attention(q, aset.k, aset.v, aset.idx, aset.valid, scale)
        parent._count_attended(aset.valid.sum())
        if parent.policy.observes:  # e.g. H2O accumulates the attention of the attended tokens
            with parent._timed("selection"):
                parent.policy.observe(self.layer_idx, q, aset, scale)
        if parent.observer is not None:
            parent.observer(self.layer_idx, q, store, aset, scale)
        return out

    def _paged_decode(self, q: torch.Tensor, pages: torch.Tensor, scale: float) -> torch.Tensor | None:
        """DeviceStore + page selection on CUDA: one kernel instead of attend() + the slot kernel."""
        parent, store = self.parent, self.store
        g = store.grid
        with parent._timed("attention"):
            out = paged_decode_attention(
                q, store.k, store.v, pages, store.lengths, g.sink, g.page_size, g.window_pages, scale
            )
        if out is not None:  # attended tokens: sink + window rows below each length, plus the pages
            static = store.static  # CUDA-graph decode: device lengths (no host value baked in)
            fast = _fast_paged_count() if static and parent._attended_inplace else None
            if fast is not None and parent._attended is not None:  # the same count in one launch, in place
                fast(parent._attended, pages, store.lengths, g.sink, g.page_size, g.window_pages)
                parent.attended_calls += 1
                return out
            L = store.lengths if static else store.lengths_host
            fixed = (L.clamp(max=g.sink) + (L - g.window_start(L)).clamp(min=0)).sum() * store.kv_heads
            parent._count_attended((pages >= 0).sum() * g.page_size + (fixed if static else int(fixed)))
        return out

    def _dense_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        parent, store = self.parent, self.store
        with parent._timed("attention"):
            k, v = store.dense()
            # Triton on CUDA (slot == position, ragged lengths), else dense_attention at lengths - 1
            n = None if store.static else int(store.lengths_host.max())  # static: graph capture
            out = dense_decode_attention(q, k, v, store.lengths, scale, max_len=n)
        if not self.dense:
            parent._count_attended(store.lengths.sum() * store.kv_heads)
        return out


def _check_shape(parent, store, key_states: torch.Tensor) -> None:
    """New keys must fit the keys already stored (batch, kv heads, head dim); else another model or batch."""
    b, h, _, d = key_states.shape
    if (b, h, d) != (store.batch, store.kv_heads, store.head_dim):
        raise ValueError(
            f"this kvdex.Cache holds a prompt of batch {store.batch} with {store.kv_heads} kv heads of dim "
            f"{store.head_dim} (model {parent._model_name}); the new tokens have batch {b}, {h} kv heads of dim {d}. "
            "A cache serves one model and one batch: create a new kvdex.Cache(model, ...) for this model or batch"
        )


def _on_device(sel, device: torch.device):
    """``sel`` with its indices on ``device`` (device_map: a selection shared across layers on other devices)."""
    moved = {n: t.to(device) for n in ("pages", "tokens") if (t := getattr(sel, n)) is not None and t.device != device}
    return dataclasses.replace(sel, **moved) if moved else sel


def _fast_paged_count():
    """kvdex.kernels.step_triton.paged_attended_count_ (the attended-token counter of a CUDA-graph paged
    decode: one launch instead of ~19 elementwise kernels) when triton imports, else None."""
    return triton_kernel("step_triton", "paged_attended_count_")
