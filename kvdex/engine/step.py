"""``LayerEngine``: one transformer layer's cache and its step, without a model framework.

A sparse layer's decoding step, top to bottom:

1. :meth:`LayerEngine.append` stores the new token's k/v; a window page that leaves joins the middle and
   the policy indexes it (``policy.index``; graph decoding with ``capturable_index``: ``append_join`` +
   ``policy.index_join``);
2. :meth:`LayerEngine.attention` -> :meth:`LayerEngine.decode`: **select** (``policy.select(q, view)``, the
   layer's :class:`~kvdex.view.LayerView` built here) ->
   **fetch** (``store.attend``: slot ids, or offloaded pages copied from host) -> **attend**
   (``kernels.sparse_decode_attention``; on CUDA a page selection of a device store runs in one paged
   kernel). A dense layer, or a selection of everything, attends densely. With a policy's
   ``select_every=N > 1`` a step that the host's :class:`~kvdex.engine.reuse.SelectionReuse` marks as a
   reuse step attends the layer's last selection instead (held in buffers that a select step rewrites in
   place, so that captured select and reuse steps read the same memory).

At prefill :meth:`LayerEngine.attention` attends densely and :meth:`LayerEngine.ingest` stores and
indexes the prompt. The engine reads the policy, the configuration, the counters and the graph service
(:class:`~kvdex.engine.graphs.service.GraphService`, handed to the policy as ``view.graphs``) from its
:class:`EngineHost` (``kvdex.Cache`` for transformers), held by a weak reference.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from kvdex.config import CacheConfig
from kvdex.engine.counters import StepCounters
from kvdex.engine.graphs.capture import as_current
from kvdex.engine.graphs.service import GraphService
from kvdex.engine.reuse import SelectionReuse
from kvdex.kernels import dense_attention, dense_decode_attention, sparse_decode_attention
from kvdex.kernels.attention import causal_chunk_attention
from kvdex.kernels.reference import paged_attended_count_reference as paged_attended_count
from kvdex.policies.base import Policy
from kvdex.selection import Selection
from kvdex.storage import LayerStore, left_padding, page_joins, strip_left_padding
from kvdex.view import LayerView

# Prompt queries kept per layer after prefill so a fork can serve observation-window policies.
OBS_KEEP = 128


class EngineHost(Protocol):
    """What a layer's engine reads from the cache that owns it (shared by all its layers)."""

    policy: Policy
    config: CacheConfig
    counters: StepCounters
    graphs: GraphService  # CUDA graphs of work inside a policy's selection (one service per cache)
    reuse: SelectionReuse  # select_every: whether this step attends each layer's last selection
    # observer(layer, q [B,Hq,D], store, attend_set, scale): called after every sparse decode attention
    observer: Callable[..., None] | None
    # on_select(view, selection): called after every sparse layer's selection (e.g. kvdex bench's reuse meter);
    # unlike ``observer`` it keeps the fused fast paths
    on_select: Callable[..., None] | None
    # CUDA-graph decoding: whether this step appends through the page-join path (None: where a page
    # joins); joins_external: the decoder runs the policy's host side of a join (Policy.joined) itself
    join_step: bool | None
    joins_external: bool

    def new_store(self, layer_idx: int, dense: bool, k: torch.Tensor) -> LayerStore: ...


class LayerEngine:
    """One layer's store and its step: prefill ingest, append, decode attention."""

    def __init__(self, host: EngineHost, layer_idx: int, dense: bool):
        self._host = weakref.ref(host)
        self.layer_idx = layer_idx
        self.dense = dense
        self.store: LayerStore | None = None  # made at prefill (adopt)
        self.pads: torch.Tensor | None = None  # [B] (CPU) left padding of the prompt (set at prefill)
        self.obs_q: torch.Tensor | None = None  # the prompt's last OBS_KEEP queries (for fork)
        self._lengths_before: torch.Tensor | None = None
        self._held: Selection | None = None  # select_every > 1: the last selection (buffers reused in place)

    @property
    def host(self) -> EngineHost:
        h = self._host()
        if h is None:
            raise RuntimeError("the kvdex.Cache owning this layer was garbage-collected")
        return h

    # ---- append ----------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new k/v [B, H, T, D] after the prompt; pages joining the middle are indexed."""
        with as_current(k.device):
            self._append(k, v)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        store = self.store
        assert store is not None, "append after the prompt"
        if k.shape[2] > 1:  # read only by attention() over several new tokens (a kernel saved)
            self._lengths_before = store.lengths.clone()
        if self._joins_static(k):
            self._append_join(k, v)
            return
        update = store.append(k, v)
        update.store = store
        if not self.dense and not update.empty:
            self.host.policy.index(self.layer_idx, update)

    def _joins_static(self, k: torch.Tensor) -> bool:
        """Whether this append takes the capturable page-join path (CUDA-graph decoding: static sizing, one
        token, a policy with ``capturable_index``) -- on a step that the decoder marks as a join step, or,
        without a decoder (``join_step`` None), on a step in which a page joins the middle."""
        host, store = self.host, self.store
        assert store is not None
        if k.shape[2] != 1 or not store.static or not host.policy.capturable_index:
            return False
        if host.join_step is None:
            return page_joins(store)
        if not host.join_step and page_joins(store):
            raise RuntimeError("a page joins the middle in a step the decoder did not mark as a join step")
        return host.join_step

    def _append_join(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token through ``store.append_join`` and, for a sparse layer, ``policy.index_join`` (device work
        with fixed shapes). The policy's host side (``joined``) runs here unless a decoder runs it before
        the step (``joins_external``: a replay skips this Python)."""
        host, store = self.host, self.store
        assert store is not None
        join = store.append_join(k, v)
        if self.dense:
            return
        policy = host.policy
        policy.reserve_index(self.layer_idx, int(store.grid.num_middle_pages(store.lengths_host).max()), store)
        if not host.joins_external and bool((join.host_count > 0).any()):
            policy.joined(self.layer_idx, join.host_start, join.host_count)
        policy.index_join(self.layer_idx, join)

    # ---- prefill ---------------------------------------------------------------------------------
    def ingest(self, k, v, pads, q) -> None:
        """The prompt: k/v [B, H, L, D] left-padded by ``pads`` [B]; q: its queries."""
        self.adopt(strip_left_padding(k, pads), strip_left_padding(v, pads), k.shape[2] - pads, pads, q)

    def adopt(self, k, v, lengths, pads, q) -> None:
        """Store left-aligned prompt k/v [B, H, L, D] and index it; q: the prompt's last queries."""
        host = self.host
        self.store = store = host.new_store(self.layer_idx, self.dense, k)
        update = store.ingest(k, v, lengths)
        update.store = store
        # kept for fork(): policies with an observation window (a copy: a view would keep the whole prompt's q)
        self.obs_q = q[:, :, -OBS_KEEP:].clone()
        self.pads = pads
        self._held = None
        if self.dense:
            return
        w = min(host.policy.obs_window, q.shape[2])
        if w:
            update.obs_queries = q[:, :, -w:]  # left padding: the last rows are the newest real tokens
            j = torch.arange(w)
            update.obs_valid = (j[None, :] >= (w - lengths)[:, None]).to(q.device)
        host.policy.index(self.layer_idx, update)

    # ---- attention -------------------------------------------------------------------------------
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q [B, Hq, T, D]; k/v the new keys/values [B, H, T, D]; key_mask [B, L] (prefill). Returns [B, T, Hq, D]."""
        with as_current(q.device):
            return self._attention(q, k, v, key_mask, scale)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        b, t = q.shape[0], q.shape[2]
        chunk = self.host.config.prefill_chunk
        if self.store is None:  # prefill: dense attention, then ingest the prompt
            L = k.shape[2]
            q_pos = None if key_mask is None else torch.arange(L, device=q.device).expand(b, L)
            out = dense_attention(q, k, v, q_pos, key_mask, scale, chunk)
            self.ingest(k, v, left_padding(key_mask, b, L), q)
            return out
        if t == 1:
            return self.decode(q[:, :, 0], scale).unsqueeze(1)
        # several new tokens on top of a filled cache (e.g. a second turn): dense over everything
        kd, vd = self.store.dense()
        if bool((self.store.lengths_host == kd.shape[2]).all()):  # no ragged lengths: fused lower-right causal
            return causal_chunk_attention(q, kd, vd, scale)
        assert self._lengths_before is not None  # set by the append of these tokens
        q_pos = self._lengths_before[:, None] + torch.arange(t, device=q.device)[None, :]
        key_mask = torch.arange(kd.shape[2], device=q.device)[None, :] < self.store.lengths[:, None]
        return dense_attention(q, kd, vd, q_pos, key_mask, scale, chunk)

    def decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """One token's attention, q [B, Hq, D] -> [B, Hq, D]: select -> fetch -> attend."""
        host, store = self.host, self.store
        assert store is not None, "decode after the prompt"
        if self.dense:
            return self._dense_decode(q, scale)
        policy, counters, timing = host.policy, host.counters, host.config.timing
        every = policy.reuse_steps()
        with counters.timed("selection", timing):
            view = LayerView.of(self.layer_idx, store, scale, host.config, host.graphs)
            if every > 1 and host.reuse.reuse and self._held is not None:  # attend the last selection
                fresh = policy.reused(q, view)  # or a selection the policy made from what it held (pool_every)
                sel = self._held if fresh is None else on_device(fresh, store.device)
            else:
                sel = on_device(policy.select(q, view), store.device)
                if host.on_select is not None:
                    host.on_select(view, sel)
                if every > 1:
                    sel = self._hold(sel)
        if sel.everything and store.positional_slots and host.observer is None:
            return self._dense_decode(q, scale)  # exact and faster; observed runs take the slot path
        fused = host.observer is None and not policy.observes
        # CUDA: the slot list (sink, window, the pages' tokens, the selected tokens) built inside the kernel, where
        # the store has one (LayerStore.selection_decode: the resident store's slots, vLLM's blocks)
        if fused and not sel.empty and not sel.everything:
            out = self._paged_decode(q, sel, scale)
            if out is not None:
                return out
        with counters.timed("transfer", timing):
            aset = store.attend(sel)
        with counters.timed("attention", timing):
            out = sparse_decode_attention(q, aset.k, aset.v, aset.idx, aset.valid, scale)
        counters.count(aset.valid.sum())
        if policy.observes:  # e.g. H2O accumulates the attention of the attended tokens
            with counters.timed("selection", timing):
                policy.observe(self.layer_idx, q, aset, scale)
        if host.observer is not None:
            host.observer(self.layer_idx, q, store, aset, scale)
        return out

    def held_buffers(self) -> tuple:
        """(id, shape) of the held selection's buffers (``select_every``): a captured reuse step reads them by
        address, so a step plan's graph key holds them (:meth:`_hold` allocates new ones when a selection's shape
        changes, e.g. a middle's first page)."""
        held = self._held
        if held is None:
            return ()
        return tuple((id(t), tuple(t.shape)) for t in (held.pages, held.tokens) if t is not None)

    def _hold(self, sel: Selection) -> Selection:
        """``sel`` copied into the layer's held selection: into its buffers when they have its shapes (a
        captured select step writes where a captured reuse step reads), else into new ones."""
        held = self._held
        names = ("pages", "tokens")
        fits = held is not None and held.everything == sel.everything
        if held is not None and fits and all(_same(getattr(held, n), getattr(sel, n)) for n in names):
            for n in names:
                if getattr(sel, n) is not None:
                    getattr(held, n).copy_(getattr(sel, n))
            return held
        pages, tokens = (None if getattr(sel, n) is None else getattr(sel, n).clone() for n in names)
        self._held = held = Selection(pages, tokens, everything=sel.everything)
        return held

    def _paged_decode(self, q: torch.Tensor, sel: Selection, scale: float) -> torch.Tensor | None:
        """A page and / or token selection through the store's fused kernel (``LayerStore.selection_decode``: the
        resident store, vLLM's blocks; CUDA): one kernel instead of attend() + the slot kernel (the tokens listed
        after the pages, as ``Selection.token_positions`` lists them); None where the store has none."""
        host, store = self.host, self.store
        assert store is not None
        counters, timing, g = host.counters, host.config.timing, store.grid
        tokens = sel.tokens
        if sel.pages is not None:
            pages = sel.pages
        else:  # no pages: an empty view (a selection that is not empty holds pages or tokens)
            assert tokens is not None
            pages = tokens[..., :0]
        static = store.static  # CUDA-graph decode: device lengths (no host value baked in)
        acc = counters.attended if static and counters.inplace else None
        acc = acc if acc is not None and acc.device == q.device else None  # counted by the kernel, in place
        with counters.timed("attention", timing):
            out = store.selection_decode(q, pages, tokens, scale, acc)
        if out is not None:  # attended tokens: sink + window rows below each length, the pages, the tokens
            if acc is not None:
                counters.calls += 1
                return out
            L = store.lengths if static else store.lengths_host  # host lengths: a CPU scalar, no sync
            counters.count(paged_attended_count(pages, L, g.sink, g.page_size, g.window_pages, tokens))
        return out

    def _dense_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        host, store = self.host, self.store
        assert store is not None
        counters, timing = host.counters, host.config.timing
        with counters.timed("attention", timing):
            out = store.dense_decode(q, scale)  # the store's own way over its tokens in place, where it has one
            if out is None:
                k, v = store.dense()
                # Triton on CUDA (slot == position, ragged lengths), else dense_attention at lengths - 1
                n = None if store.static else int(store.lengths_host.max())  # static: graph capture
                out = dense_decode_attention(q, k, v, store.lengths, scale, max_len=n)
        if not self.dense:
            counters.count(store.lengths.sum() * store.kv_heads)
        return out


def on_device(sel, device: torch.device):
    """``sel`` with its indices on ``device`` (device_map: a selection shared across layers on other devices)."""
    moved = {n: t.to(device) for n in ("pages", "tokens") if (t := getattr(sel, n)) is not None and t.device != device}
    return dataclasses.replace(sel, **moved) if moved else sel


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both None, or tensors of one shape, dtype and device."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
