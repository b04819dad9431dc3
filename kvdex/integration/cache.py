"""``kvdex.Cache``: a transformers ``Cache`` that stores KV in pages and attends to a budget.

Data flow of one decoding step through one sparse layer (docs/architecture.md draws it):

1. the model computes q, k, v and calls ``cache.update(k, v, layer)`` ->
   :meth:`KVDexLayer.update` appends k/v to the layer's store; pages leaving the window join the
   middle and the policy indexes them (``policy.index``);
2. the model calls the attention function registered as ``"kvdex"``, which finds this layer
   through the tag on ``k`` and calls :meth:`KVDexLayer.attention` ->
   ``policy.select`` -> ``store.attend`` (fetching offloaded pages) -> the decode kernel;
3. after the forward, the logits hook calls ``policy.on_step`` (CHESS's trigger, PRKV's refresh).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import CacheLayerMixin

from kvdex.config import (
    DEFAULT_BUDGET,
    DEFAULT_DENSE_LAYERS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    CacheConfig,
)
from kvdex.integration.attention import TAG
from kvdex.integration.distributed import tensor_parallel
from kvdex.kernels import dense_attention, dense_decode_attention, paged_decode_attention, sparse_decode_attention
from kvdex.kernels.attention import causal_chunk_attention
from kvdex.kernels.dispatch import triton_kernel
from kvdex.policies import PolicyInfo, make_policy
from kvdex.storage import (
    DeviceStore,
    Grid,
    OffloadStore,
    TransferStats,
    host_joins,
    left_padding,
    strip_left_padding,
)

# Prompt queries kept per layer after prefill so a fork can serve observation-window policies.
OBS_KEEP = 128


class KVDexLayer(CacheLayerMixin):
    """The cache of one transformer layer: a store plus the glue to the policy."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, parent: Cache, layer_idx: int, dense: bool):
        super().__init__()
        self._parent = weakref.ref(parent)
        self.layer_idx = layer_idx
        self.dense = dense
        self.store = None
        self.seen = 0  # columns seen, padding included (transformers' sequence length)

    @property
    def parent(self) -> Cache:
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
        if key_states.shape[2] != 1 or not getattr(self.store, "static", False) or not parent.policy.capturable_index:
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
        self._pads = pads
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
        if sel.everything and isinstance(store, DeviceStore) and parent.observer is None:
            return self._dense_decode(q, scale)  # exact and faster; observed runs take the slot path
        fused = type(store) is DeviceStore and parent.observer is None and not getattr(parent.policy, "observes", False)
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
            static = getattr(store, "static", False)  # CUDA-graph decode: device lengths (no host value baked in)
            fast = _fast_paged_count() if static and getattr(parent, "_attended_inplace", False) else None
            if fast is not None and parent._attended is not None:  # the same count in one launch, in place
                fast(parent._attended, pages, store.lengths, g.sink, g.page_size, g.window_pages)
                parent._attended_calls += 1
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
            n = None if getattr(store, "static", False) else int(store.lengths_host.max())  # static: graph capture
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


class Cache(HFCache):
    """A kvdex cache for one model. Pass it to ``model.generate(cache=...)`` (``past_key_values=`` before
    transformers 5.24).

    ``policy`` is a registered name (``kvdex.policies()``) or a Policy instance; ``**policy_options``
    are that policy's dataclass fields. Sizes are described in :class:`kvdex.config.CacheConfig`.
    ``page_cache``: with ``offload=True``, page slots per sequence and kv head that keep recently
    selected pages on the device, so a step transfers only the others (>= the pages selected per
    step; 0 = off). See ``kvdex.storage.offload``. Long prompts: ``kvdex.integration.prefill``.
    """

    def __init__(
        self,
        model,
        policy="quest",
        budget: int = DEFAULT_BUDGET,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        sink: int = DEFAULT_SINK,
        window: int = DEFAULT_WINDOW,
        offload: bool = False,
        dense_layers: int = DEFAULT_DENSE_LAYERS,
        timing: bool = False,
        prefill_chunk: int = 2048,
        page_cache: int = 0,
        **policy_options,
    ):
        from kvdex.integration.loading import attention_modules, enable, text_config

        self.config = CacheConfig(
            budget=budget,
            page_size=page_size,
            sink=sink,
            window=window,
            offload=offload,
            dense_layers=dense_layers,
            prefill_chunk=prefill_chunk,
            timing=timing,
        )
        enable(model)
        if not isinstance(page_cache, int) or isinstance(page_cache, bool) or page_cache < 0:
            raise ValueError(f"page_cache must be an int >= 0 (page slots per sequence, kv head), got {page_cache!r}")
        self.page_cache = page_cache  # offloaded stores: device cache of recently selected pages (0 = off)
        cfg = text_config(model)
        self._modules = attention_modules(model)
        n = cfg.num_hidden_layers
        self.policy = make_policy(policy, **policy_options)
        q_heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
        # tensor parallelism: this rank holds kv heads offset ... offset + kv_heads / size - 1 (distributed.py)
        self.tp = tensor_parallel(model)
        q_heads, kv_heads = q_heads // self.tp.size, kv_heads // self.tp.size
        dense = [i < dense_layers for i in range(n)]
        sparse = tuple(i for i in range(n) if not dense[i])
        offset = self.tp.rank * kv_heads
        self.policy.bind(PolicyInfo(self.config, n, sparse, q_heads, kv_heads, head_dim, offset, self.tp))
        self.grid = Grid(sink, page_size, self.config.window_pages)
        self.transfer = TransferStats()
        self.step = -1
        self._timing: dict[str, float] = {}
        self._attended = None
        self._attended_calls = 0
        self._attended_inplace = False  # CUDA-graph decoding: one counter, added to in place (GraphDecoder)
        # CUDA-graph decoding (kvdex.integration.graph) of a policy with capturable_index: join_step says
        # whether this step appends through the page-join path (None: where a page joins);
        # joins_external: the decoder runs the policy's host side of a join (Policy.joined) itself
        self.join_step: bool | None = None
        self.joins_external = False
        self._hook = None
        # observer(layer, q [B,Hq,D], store, attend_set, scale): called after every sparse decode
        # attention; the evaluation harness uses it to measure recall against the dense truth.
        self.observer = None
        self._max_positions = getattr(cfg, "max_position_embeddings", None)
        self._warned_long = False
        self._model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._model = weakref.ref(model)
        super().__init__(layers=[KVDexLayer(self, i, dense[i]) for i in range(n)])
        self._install_logits_hook(model)

    # ---- construction helpers --------------------------------------------------------------------
    def _new_store(self, layer: KVDexLayer, k: torch.Tensor):
        b, h, _, d = k.shape
        if h != self.policy.info.kv_heads:  # the store is sized from the keys; the policy was bound to the config
            raise ValueError(
                f"layer {layer.layer_idx} received keys with {h} kv heads, but the model's config gives "
                f"{self.policy.info.kv_heads} per process ({self.tp.size} tensor-parallel rank(s)); kvdex supports "
                "transformers' own tensor parallelism (tp_plan) and models whose config matches their weights"
            )
        args = (self.grid, b, h, d, k.dtype, k.device, self.transfer)
        if not layer.dense:  # a policy may bring its own store (IceCache's semantic pages)
            work = self.config.retrieval_tokens if self.policy.uses_budget else self.grid.page_size
            custom = self.policy.make_store(layer.layer_idx, self.config.offload, args, work)
            if custom is not None:
                return custom
        if self.config.offload and not layer.dense:
            work = self.config.retrieval_tokens if self.policy.uses_budget else self.grid.page_size
            return OffloadStore(*args, work_tokens=work, page_cache=self.page_cache)
        return DeviceStore(*args)

    def _install_logits_hook(self, model) -> None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            return
        ref = weakref.ref(self)

        def hook(_module, _inputs, output):
            cache = ref()
            if cache is not None and cache._in_forward:
                cache._in_forward = False
                logits = output[:, -1] if isinstance(output, torch.Tensor) else None
                cache.policy.on_step(cache.step, logits)

        self._hook = head.register_forward_hook(hook)
        weakref.finalize(self, self._hook.remove)
        self._in_forward = False

    def _check_module(self, module, layer_idx: int) -> None:
        if self._modules.get(layer_idx) is not module:
            raise ValueError(
                f"this kvdex.Cache was made for another model ({self._model_name}); "
                "create a new kvdex.Cache(model, ...) for each model"
            )

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``, kept out of ``torch.compile`` graphs (a graph break): the store,
        the policy's index and their Python bookkeeping always run eagerly (``GraphDecoder(compile=True)``
        compiles the model's layers around them)."""
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _on_update(self, layer_idx: int, key_states: torch.Tensor) -> None:
        if layer_idx == 0:
            self.step += 1
            self._in_forward = True
            total = self.layers[0].seen + key_states.shape[2]
            if self._max_positions and total > self._max_positions and not self._warned_long:
                self._warned_long = True
                warnings.warn(
                    f"the sequence ({total} tokens) is longer than the model's max_position_embeddings "
                    f"({self._max_positions}); quality past the trained context is not guaranteed",
                    stacklevel=4,
                )

    # ---- bookkeeping ------------------------------------------------------------------------------
    @contextmanager
    def _timed(self, name: str):
        if not self.config.timing:
            yield
            return
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        yield
        sync()
        self._timing[name] = self._timing.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def _count_attended(self, total: torch.Tensor) -> None:
        # one counter for all layers, on the device of the first sparse layer that counts (device_map:
        # the other layers' counts move there explicitly)
        if self._attended is not None and total.device != self._attended.device:
            total = total.to(self._attended.device)
        if self._attended is not None and getattr(self, "_attended_inplace", False):
            self._attended.add_(total)  # CUDA-graph decode: one buffer that replayed steps accumulate into
        else:
            self._attended = total if self._attended is None else self._attended + total
        self._attended_calls += 1

    # ---- prefill once, decode many ----------------------------------------------------------------
    def fork(self, policy=None, budget: int | None = None, **overrides) -> Cache:
        """A new cache holding this cache's prefill, for another policy / budget / storage.

        Only a cache that has prefilled and not decoded can be forked; the fork indexes the
        prompt with its own policy (and observation window), so policies never share mutable
        state. An index that is expensive to build and immutable once built (IceCache's trees)
        is shared between forks of one prefill through ``Policy.share_index``; a fork's later
        insertions make new snapshots, never touching the shared ones.
        This is how the evaluation harness prefills once per sample and decodes per policy.
        """
        if self.step != 0 or self.layers[0].store is None:
            raise ValueError("fork() needs a cache that has prefilled a prompt and not decoded yet")
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this cache was garbage-collected")
        sizes = {k: v for k, v in self.config.to_dict().items() if k != "budget"}
        args = {"page_cache": self.page_cache, **sizes, **overrides}
        policy = self.policy if policy is None else policy
        budget = self.config.budget if budget is None else budget
        new = Cache(model, policy, budget, **args)
        # every fork of this prefill shares one memo of immutable index state (Policy.share_index)
        memo = self.__dict__.setdefault("_index_memo", {})
        new._index_memo = memo
        self.policy.share_index(memo)
        new.policy.share_index(memo)
        for src, dst in zip(self.layers, new.layers, strict=True):
            k, v = src.store.dense()
            dst.lazy_initialization(k, v)
            dst.seen = src.seen
            dst._adopt(k, v, src.store.lengths_host, src._pads, src._obs_q)
        new.step = 0
        return new

    # ---- transformers' cache protocol that kvdex does not support --------------------------------
    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvdex caches do not support beam search; use greedy or sampling (num_beams=1)")

    def crop(self, max_length: int):
        raise NotImplementedError("kvdex caches cannot be cropped (assisted / speculative decoding is not supported)")

    def batch_select_indices(self, indices):
        raise NotImplementedError("kvdex caches do not support selecting batch rows after prefill")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError(
            "kvdex caches do not support num_return_sequences > 1; repeat the prompt in the batch instead"
        )

    # ---- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Sizes, memory, transfers, attended tokens and (with ``timing=True``) time per phase.

        Under tensor parallelism bytes, transfers and page-cache counts are totals over the ranks
        (one all-reduce: call ``stats()`` on every rank); timings are this rank's."""
        layers = [lay for lay in self.layers if lay.store is not None]
        dev = sum(lay.store.device_bytes() for lay in layers)
        host = sum(lay.store.host_bytes() for lay in layers)
        lengths = layers[0].store.lengths_host.tolist() if layers else []
        sparse = [lay for lay in layers if not lay.dense]
        t = self.transfer
        pcs = [lay.store.page_cache_stats() for lay in sparse if getattr(lay.store, "page_cache", 0)]
        pc = [sum(p[k] for p in pcs) for k in ("hits", "misses", "bytes_moved")]
        attended = float(self._attended) if self._attended is not None else 0.0
        counts = self.tp.sum_values(dev, host, t.h2d_bytes, t.d2h_bytes, t.h2d_calls, attended, *pc)
        dev, host, h2d, d2h, calls, hits, misses, moved = (int(v) for v in counts[:5] + counts[6:])
        per_head = None
        if self._attended is not None and sparse:
            b, h = sparse[0].store.batch, sparse[0].store.kv_heads * self.tp.size
            per_head = counts[5] / (self._attended_calls * b * h)
        c = self.config
        out = {
            "policy": self.policy.name,
            "policy_options": self.policy.options(),
            "budget": c.budget if self.policy.uses_budget else None,
            "page_size": c.page_size,
            "sink": c.sink,
            "window": c.window,
            "retrieval_tokens": c.retrieval_tokens if self.policy.uses_budget else None,
            "dense_layers": c.dense_layers,
            "sparse_layers": len(self.policy.info.sparse_layers),
            "offload": c.offload,
            "context_tokens": lengths,
            "decode_steps": max(self.step, 0),
            "kv_bytes_device": dev,
            "kv_bytes_host": host,
            "bytes_host_to_device": h2d,
            "bytes_device_to_host": d2h,
            "host_to_device_transfers": calls,
            "attended_tokens_per_step": per_head,
            "tensor_parallel_ranks": self.tp.size,
            "policy_stats": self.policy.stats(),
        }
        if pcs:  # offloaded with a device page cache: its hits, and the bytes it moved (not in the line above)
            out["page_cache"] = {
                "slots": self.page_cache,
                "hits": hits,
                "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                "bytes_moved": moved,
            }
        if c.timing:
            steps = max(self.step, 1)
            out["time_ms_per_step"] = {k: v / steps for k, v in sorted(self._timing.items())}
        return out
