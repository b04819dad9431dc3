"""``kvdex.Cache``: a transformers ``Cache`` that stores KV in pages and attends to a budget.

Data flow of one decoding step through one sparse layer (docs/architecture.md draws it):

1. the model computes q, k, v and calls ``cache.update(k, v, layer)`` ->
   :meth:`KVDexLayer.update` -> :meth:`LayerEngine.append` appends k/v to the layer's store; pages
   leaving the window join the middle and the policy indexes them (``policy.index``);
2. the model calls the attention function registered as ``"kvdex"``, which finds this layer
   through the tag on ``k`` and calls :meth:`KVDexLayer.attention` -> :meth:`LayerEngine.attention`:
   ``policy.select`` -> ``store.attend`` (fetching offloaded pages) -> the decode kernel;
3. after the forward, the logits hook calls ``policy.on_step`` (CHESS's trigger, PRKV's refresh).

:class:`KVDexLayer` lives in :mod:`kvdex.hf.layer` (re-exported here); steps 1-2 themselves
in :mod:`kvdex.engine.step` and the choice of store in :mod:`kvdex.engine.stores`, without transformers.
:func:`dynamic_cache` builds transformers' own dense cache, the reference kvdex is measured against.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache as HFCache

from kvdex.config import (
    DEFAULT_BUDGET,
    DEFAULT_DENSE_LAYERS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    CacheConfig,
)
from kvdex.engine import GraphService, SelectionReuse, StepCounters, make_store
from kvdex.engine.graphs import StepGraphs
from kvdex.hf import cache_fork, compiled_ops
from kvdex.hf.cache_checks import check_continues, check_retrieves
from kvdex.hf.cache_report import cache_stats
from kvdex.hf.distributed import tensor_parallel
from kvdex.hf.layer import OBS_KEEP, KVDexLayer, _on_device  # noqa: F401 (re-exported)
from kvdex.hf.step_backend import WholeStep
from kvdex.policies import PolicyInfo, make_policy
from kvdex.storage import Grid, TransferStats


class Cache(HFCache):
    """A kvdex cache for one model. Pass it to ``model.generate(cache=...)`` (``past_key_values=`` before
    transformers 5.24).

    ``policy`` is a registered name (``kvdex.policies()``) or a Policy instance; ``**policy_options``
    are that policy's dataclass fields. ``budget`` and the keyword-only arguments but ``step_graphs``
    are the fields of :class:`kvdex.config.CacheConfig` (``cache.config``), validated there;
    ``page_cache``: with ``offload=True``, a device cache of recently selected pages
    (``kvdex.storage.offload``); ``step_graphs``: decode steps outside ``kvdex.generate`` replay CUDA
    graphs, whole steps under kvdex's compile backend (:mod:`kvdex.hf.step_backend`), else one per layer
    (:mod:`kvdex.engine.graphs.layer_graphs`); False: eager. Long prompts: ``kvdex.hf.prefill``.
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
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        page_cache: int = 0,
        step_graphs: bool = True,
        **policy_options,
    ):
        from kvdex.hf.loading import attention_modules, enable, text_config
        from kvdex.hf.model_parts import head_geometry

        self.config = CacheConfig(
            budget=budget,
            page_size=page_size,
            sink=sink,
            window=window,
            offload=offload,
            dense_layers=dense_layers,
            prefill_chunk=prefill_chunk,
            timing=timing,
            page_cache=page_cache,
        )
        enable(model)
        cfg = text_config(model)
        self._modules = attention_modules(model)
        n = cfg.num_hidden_layers
        self.policy = make_policy(policy, **policy_options)
        q_heads, kv_heads, head_dim = head_geometry(model)
        # tensor parallelism: this rank holds kv heads offset ... offset + kv_heads / size - 1 (distributed.py)
        self.tp = tensor_parallel(model)
        q_heads, kv_heads = q_heads // self.tp.size, kv_heads // self.tp.size
        dense = [i < dense_layers for i in range(n)]
        sparse = tuple(i for i in range(n) if not dense[i])
        offset = self.tp.rank * kv_heads
        check_retrieves(self.config, self.policy)
        self.policy.bind(PolicyInfo(self.config, n, sparse, q_heads, kv_heads, head_dim, offset, self.tp))
        self.grid = Grid(sink, page_size, self.config.window_pages)
        self._hook = None
        # observer(layer, q [B,Hq,D], store, attend_set, scale): called after every sparse decode
        # attention; the evaluation harness uses it to measure recall against the dense truth.
        self.observer = None
        self.on_select = None  # EngineHost.on_select
        if not isinstance(step_graphs, bool):
            raise ValueError(f"step_graphs must be True or False, got {step_graphs!r}")
        self._step_graphs_enabled = step_graphs
        self._init_sequence_state()
        self._handle = compiled_ops.register(self)  # how kvdex's ops find this cache under torch.compile
        self._max_positions = getattr(cfg, "max_position_embeddings", None)
        self.model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._model = weakref.ref(model)
        super().__init__(layers=[KVDexLayer(self, i, dense[i]) for i in range(n)])
        self._install_logits_hook(model)
        self._install_input_hook(model)

    def _init_sequence_state(self) -> None:
        """Everything that belongs to the sequences a cache holds (set up by ``__init__``, cleared by
        :meth:`reset`): step counters, transfer totals, graphs captured for the current stores."""
        self.transfer = TransferStats()
        self.step = -1
        self.counters = StepCounters()  # attended tokens, time per phase (every layer adds into them)
        self.graphs = GraphService()  # CUDA graphs a policy's selection replays (view.graphs; IceCache's search)
        self.reuse = SelectionReuse()  # select_every: this step selects or attends each layer's last selection
        # CUDA-graph decoding (kvdex.engine.graphs) of a policy with capturable_index: join_step says
        # whether this step appends through the page-join path (None: where a page joins);
        # joins_external: the decoder runs the policy's host side of a join (Policy.joined) itself
        self.join_step: bool | None = None
        self.joins_external = False
        self.on_step_held = False  # the CUDA-graph decoder holds policy.on_step back while it captures a step
        self.decoder_active = False  # a GraphDecoder runs this step (it captures the whole step itself)
        # decode steps outside GraphDecoder (plain model.generate / forward): one CUDA graph per layer
        self.step_graphs = StepGraphs(self, enabled=self._step_graphs_enabled)
        self.whole_step = WholeStep(self)  # whole decode steps under kvdex's torch.compile backend
        self._warned_long = False

    def reset(self) -> None:
        """Empty the cache so that it can take a new prompt: the same model, policy, budget and sizes, as
        a new ``kvdex.Cache`` would be (the policy's index is rebuilt from the next prompt)."""
        for layer in self.layers:
            layer.reset()
        self.policy.bind(self.policy.info)
        self.__dict__.pop("_index_memo", None)  # a fork family's shared index belongs to the old prompt
        self._init_sequence_state()

    # ---- construction helpers --------------------------------------------------------------------
    def new_store(self, layer_idx: int, dense: bool, k: torch.Tensor):
        """The store of a layer whose prompt keys are ``k`` [B, H, L, D] (:func:`kvdex.engine.make_store`)."""
        b, h, _, d = k.shape
        if h != self.policy.info.kv_heads:  # the store is sized from the keys; the policy was bound to the config
            raise ValueError(
                f"layer {layer_idx} received keys with {h} kv heads, but the model's config gives "
                f"{self.policy.info.kv_heads} per process ({self.tp.size} tensor-parallel rank(s)); kvdex supports "
                "transformers' own tensor parallelism (tp_plan) and models whose config matches their weights"
            )
        args = (self.grid, b, h, d, k.dtype, k.device, self.transfer)
        return make_store(self.config, self.policy, layer_idx, dense, args)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model this cache was made for (held by a weak reference; None once it was garbage-collected)."""
        return self._model()

    @property
    def page_cache(self) -> int:
        """Device page-cache slots per sequence and kv head of offloaded stores (0 = off): ``config.page_cache``."""
        return self.config.page_cache

    def _install_logits_hook(self, model) -> None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            return
        ref = weakref.ref(self)

        @torch.compiler.disable  # host-side policy work (CHESS's trigger, PRKV's clock): never traced
        def hook(_module, _inputs, output):
            cache = ref()
            if cache is not None and cache.in_forward:
                cache.in_forward = False
                if not cache.on_step_held:
                    logits = output[:, -1] if isinstance(output, torch.Tensor) else None
                    cache.policy.on_step(cache.step, logits)

        self._hook = head.register_forward_hook(hook)
        weakref.finalize(self, self._hook.remove)
        self.in_forward = False  # a forward pass is under way: the logits hook runs the policy's on_step after it

    def _install_input_hook(self, model) -> None:
        """Check every input the model gets with this cache against the tokens the cache holds
        (:meth:`check_input`). A forward pre-hook: PyTorch's public module hook, the model is not changed."""
        ref = weakref.ref(self)

        def hook(_module, args, kwargs):
            if torch.compiler.is_compiling():  # a compiled decode step: one new token, checked by generate's prefill
                return None
            cache = ref()
            if cache is None or cache is not kwargs.get("cache", kwargs.get("past_key_values")):
                return None
            ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = kwargs.get("inputs_embeds")
            width = ids.shape[1] if isinstance(ids, torch.Tensor) else embeds.shape[1] if embeds is not None else None
            if width is not None:
                ids = ids if isinstance(ids, torch.Tensor) else None
                cache.check_input(ids, width, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            return None

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        weakref.finalize(self, handle.remove)

    def check_input(
        self,
        input_ids: torch.Tensor | None,
        width: int,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> None:
        """Refuse an input that cannot continue the tokens this cache holds (a cache reused for a new prompt
        would otherwise answer from the old one). ``input_ids`` [B, T] (None: embeddings were passed),
        ``width`` = T, ``attention_mask`` [B, M] and ``position_ids`` [B, T] as the model receives them.

        transformers' ``generate`` passes the model only the tokens past those the cache holds, with the
        attention mask of its whole input (or, when that mask is all ones, the positions it gives): a
        continuation's mask covers the held columns plus the new ones, and its first new token's position
        is the number of real tokens held. Refused: an input that breaks either (a new prompt no longer
        than what the cache holds), a different batch size. A new prompt longer than what the cache holds
        reaches the model as its tail only, with the positions of a continuation, and cannot be told from
        one here: create a cache per prompt or call :meth:`reset` (docs/usage.md)."""
        check_continues(self, input_ids, width, attention_mask, position_ids)

    def check_module(self, module: torch.nn.Module, layer_idx: int) -> None:
        """The layer protocol (:class:`~kvdex.hf.layer.KVDexLayer`): ValueError unless ``module`` is the attention
        module of ``layer_idx`` this cache was made for."""
        if self._modules.get(layer_idx) is not module:
            raise ValueError(
                f"this kvdex.Cache was made for another model ({self.model_name}); "
                "create a new kvdex.Cache(model, ...) for each model"
            )

    @property
    def is_compileable(self) -> bool:
        """transformers' ``generate`` compiles the decode step of a compileable cache on CUDA (its
        ``compile_config``; off with ``disable_compile=True``): kvdex's work is the custom ops of
        :mod:`kvdex.hf.compiled_ops` there, replayed with the whole step by kvdex's backend
        (:mod:`kvdex.hf.step_backend`); not under tensor parallelism."""
        return self.tp.size == 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``. Under ``torch.compile`` a decode step of a prefilled layer is the opaque
        op ``kvdex::append`` (:mod:`kvdex.hf.compiled_ops`); anything else is kept out of the graph (a graph
        break): the store, the policy's index and their Python bookkeeping always run eagerly."""
        if torch.compiler.is_compiling() and key_states.shape[2] == 1 and self.layers[layer_idx].prefilled:
            return compiled_ops.append(key_states, value_states, self._handle, layer_idx), value_states
        return self.update_eager(key_states, value_states, layer_idx, *args, **kwargs)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """transformers' mask creation asks it; kvdex's mask function ignores it. Under ``torch.compile`` 0: no
        guard on the sequence length (it would recompile the decode step once, then pass it as an input)."""
        if torch.compiler.is_compiling():
            return 0
        return self.layers[layer_idx].seen

    @torch.compiler.disable
    def update_eager(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def begin_update(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """The layer protocol: called by each layer's ``update`` before its store; layer 0 starts a step (the
        step count, the policy's ``before_step``, the reuse decision) and arms the logits hook (``on_step``)."""
        if layer_idx == 0:
            self.step += 1
            self.in_forward = True
            first = self.layers[0]
            if key_states.shape[2] == 1 and first.store is not None:  # a decode step (the step plans may have decided)
                self.policy.before_step([lay.store for lay in self.layers])
                self.reuse.decide(self.policy.reuse_steps(), first.seen, first.store, self.policy.must_select)
            else:  # a prefill or several tokens at once: the middle may have changed
                self.reuse.reset()
            self.warn_if_long(self.layers[0].seen + key_states.shape[2], stacklevel=4)

    def warn_if_long(self, total: int, stacklevel: int = 2) -> None:
        """Warn once when the sequence (``total`` tokens) passes the model's max_position_embeddings
        (the eager step and the CUDA-graph decoder's bookkeeping after a replay both ask); ``stacklevel``
        as ``warnings.warn`` would take it at the caller."""
        if self._max_positions and total > self._max_positions and not self._warned_long:
            self._warned_long = True
            warnings.warn(
                f"the sequence ({total} tokens) is longer than the model's max_position_embeddings "
                f"({self._max_positions}); quality past the trained context is not guaranteed",
                stacklevel=stacklevel + 1,
            )

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
        new = self._sibling(policy, budget, **overrides)
        # every fork of this prefill shares one memo of immutable index state (Policy.share_index)
        memo = self.__dict__.setdefault("_index_memo", {})
        new._index_memo = memo
        self.policy.share_index(memo)
        new.policy.share_index(memo)
        first = self.layers[0]
        new.adopt_prefill(
            ((*src.store.dense(), src.engine.obs_q) for src in self.layers), first.store.lengths_host, first.pads
        )
        return new

    def __deepcopy__(self, memo: dict) -> Cache:
        """``copy.deepcopy(cache)``, transformers' recipe for reusing a prompt's cache: right after the prefill it is
        :meth:`fork` (the same policy, budget and sizes: the copy decodes exactly as the original would); a cache
        that has not prefilled copies to a new empty one. A cache that has decoded cannot be copied: its policy's
        state (selection history, buffers a captured step reads) does not survive a generic copy, and a wrong copy
        would decode silently differently."""
        if self.step > 0:
            raise TypeError(
                f"a kvdex.Cache that has decoded ({self.step} steps) cannot be deep-copied: copy it right after the "
                "prefill (copy.deepcopy(cache) then is cache.fork()), or prefill the prompt again"
            )
        new = self.fork() if self.layers[0].store is not None else self._sibling()  # prefilled, or empty
        memo[id(self)] = new
        return new

    def _sibling(self, policy=None, budget: int | None = None, **overrides) -> Cache:
        """A new empty cache on this cache's model, with its policy, budget and sizes unless given others."""
        model = self.model
        if model is None:
            raise RuntimeError("the model of this cache was garbage-collected")
        sizes = {k: v for k, v in self.config.to_dict().items() if k != "budget"}
        args = {"step_graphs": self._step_graphs_enabled, **sizes, **overrides}
        policy = self.policy if policy is None else policy
        return Cache(model, policy, self.config.budget if budget is None else budget, **args)

    def adopt_prefill(self, layers, lengths: torch.Tensor, pads: torch.Tensor | None = None) -> None:
        """Take a prefilled prompt's keys and values without running the model, as a prefill leaves them.

        ``layers`` yields, for every layer in order, ``(k, v, obs_q)``: the prompt's keys and values
        [B, H, L, D] left-aligned (row ``b`` holds ``lengths[b]`` tokens), and its last queries
        [B, Hq, W, D] (W >= the policy's ``obs_window``; up to :data:`OBS_KEEP` are kept for ``fork``).
        Each layer goes through the ingest of a prefill (:meth:`kvdex.engine.LayerEngine.adopt`): the
        store (offloaded host copy, page cache), the policy's index and observation queries are built
        as after ``model(prompt, past_key_values=cache)``, and the cache is at step 0 (positions
        continue at the prompt's length). ``layers`` may be a generator making one layer at a time:
        only that layer's tensors are alive besides the cache. ``lengths`` [B] and ``pads`` [B] (the
        prompt's left padding, default none) are CPU integer tensors. :meth:`fork` and ``kvdex bench
        --kv random`` adopt their prompts through here.
        """
        cache_fork.adopt_prefill(self, layers, lengths, pads)

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
        """Sizes, memory, transfers, attended tokens and (with ``timing=True``) time per phase
        (:func:`kvdex.hf.cache_report.cache_stats`).

        Under tensor parallelism bytes, transfers and page-cache counts are totals over the ranks
        (one all-reduce: call ``stats()`` on every rank); timings are this rank's."""
        return cache_stats(self)


def dynamic_cache(model, offloading: bool = False) -> DynamicCache:
    """transformers' own dense ``DynamicCache`` for ``model`` (``offloading=True``: its variant that keeps
    the KV of all but the current layer on the host): the baseline of ``kvdex bench`` and its checks."""
    return DynamicCache(config=model.config, offloading=offloading)
