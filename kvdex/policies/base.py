"""The policy interface and the mechanics every policy shares.

A policy is one dataclass, in a module or in a package of components (its fields are its options, so
``str(policy)`` records its settings). One instance serves one cache, all layers; it keeps per-layer index state itself,
which lets a policy share work across layers (IceCache's reuse, CHESS's one selection per step).

Life cycle, driven by :class:`kvdex.Cache`:

* ``bind(info)``                     once, with the cache's sizes;
* ``index(layer, update)``           pages joined the middle region: all of them at prefill
                                     (with the observation-window queries when ``obs_window``),
                                     then one page at a time as the window moves on;
                                     A ``capturable_index`` policy indexes decode-time joins
                                     through ``index_join`` instead (below);
* ``select(q, view)``                every decode step, per sparse layer -> :class:`Selection`; ``view``:
                                     the layer at this step (:class:`kvdex.view.LayerView`: layer index,
                                     store, scale, lengths, page grid, budget, the engine's graph service);
* ``on_step(step, logits)``          after every decode step, with the last-position logits.

**Capturable page joins** (``capturable_index = True``; CUDA-graph decoding, kvdex.engine.graphs).
Under static sizing, a single-token decode step in which pages join the middle (at most one per
sequence) does not call ``index``; instead, per sparse layer:

* ``reserve_index(layer, pages, store)`` outside any captured step: capacity for ``pages`` middle pages
  per sequence (re-allocating changes ``graph_key``);
* ``joined(layer, start, count)`` the host side of the join (CPU counters, host-held selections):
                                     start / count [B] (CPU) as a :class:`MiddleUpdate`'s. Runs once per
                                     step, before the step's device work -- by the decoder before a
                                     replay, since a replay runs no Python;
* ``index_join(layer, join)``        the device side: a :class:`~kvdex.storage.PageJoin` (device
                                     ``joins`` mask and ``start`` ids, keys [B, H, 1, ps, D]); fixed
                                     shapes, no host read of a device value, writes in place into
                                     buffers ``reserve_index`` made. ``joined`` + ``index_join`` leave
                                     the index exactly as ``index`` does for the same pages.

Sink and window are always attended and are never part of a selection. GQA: ``select`` gets the
queries of all heads, ``q`` [B, Hq, D]; it returns one selection per kv head. ``group_reduce`` is
the one place where query-head scores become kv-head scores, and ``kvdex.kernels.scoring.group_topk``
the one place where query heads choose a kv head's pages (``"max"`` / ``"sum"`` of the scores, or
``"heads"``: the union of every head's own ranking).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from kvdex.config import CacheConfig
from kvdex.selection import Selection
from kvdex.storage import AttendSet, LayerStore, MiddleUpdate, PageJoin
from kvdex.view import LayerView


@dataclass(frozen=True)
class PolicyInfo:
    """What a policy knows about its cache. ``q_heads`` / ``kv_heads``: the heads this process holds
    (under tensor parallelism a rank's share); its kv head ``h`` is the model's head ``head_offset + h``;
    ``tp``: the tensor-parallel group (:class:`kvdex.hf.distributed.TensorParallel`, None: one process or a
    serving engine's rank, which shares nothing); ``model_kv_heads``: the model's kv heads (0: from ``tp``)."""

    config: CacheConfig
    num_layers: int
    sparse_layers: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    head_offset: int = 0
    tp: Any = None
    model_kv_heads: int = 0

    @property
    def all_kv_heads(self) -> int:
        """The model's kv heads, every rank's."""
        return self.model_kv_heads or self.kv_heads * (self.tp.size if self.tp else 1)

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


@dataclass
class Policy:
    name: ClassVar[str] = ""
    uses_budget: ClassVar[bool] = True  # False: attends everything (``full``)
    observes: ClassVar[bool] = False  # True: ``observe`` is called after every sparse decode attention
    # Class defaults that an instance may refine from its options (icecache: its search), so not ClassVars (and,
    # unannotated, not dataclass fields either):
    capturable = False  # True: its decode step can be replayed from a CUDA graph (graph_key)
    # True: a page joining the middle is indexed inside a captured step (reserve_index / joined / index_join)
    capturable_index = False
    # True: it reorders its store's middle slots (``LayerStore.permute_middle``); ``positions`` undoes that
    relocates: ClassVar[bool] = False

    def __post_init__(self) -> None:
        """The options' checks: every option annotated with a ``Literal`` (or one or None) holds one of its
        values (:func:`check_choices`). A subclass with its own ``__post_init__`` calls ``super().__post_init__()``."""
        check_choices(self)

    @property
    def granularity(self) -> str:
        """What the selections name: ``"page"``, middle pages (``Selection.pages``; a page policy may add single
        tokens, as PRKV's static ones) or everything; ``"token"``, tokens only (``Selection.tokens``). A policy
        declares it as a class attribute (``granularity = "token"``), or as a property where its options decide
        (``rerank``: :class:`~kvdex.policies.rerank.RerankOption`). tests/test_selection_golden.py holds every
        registered policy to it. Default: ``"page"``."""
        return "page"

    @property
    def obs_window(self) -> int:
        """Prompt queries (the last ones) kept for ``index`` at prefill (``MiddleUpdate.obs_queries``); 0: none."""
        return 0

    def bind(self, info: PolicyInfo) -> None:
        self.info = info
        self.cfg = info.config

    def smallest_retrieval(self, page_size: int) -> int:
        """The fewest retrieval tokens (budget - sink - window) with which this policy retrieves anything from
        the middle: one token for token policies, one page for page policies. A cache refuses a smaller budget."""
        return 1 if self.granularity == "token" else page_size

    def index(self, layer: int, update: MiddleUpdate) -> None:
        """Pages joined the middle region of ``layer``. Default: nothing to index."""

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        """The middle tokens each kv head of ``view.layer`` attends this step; q [B, Hq, D]."""
        raise NotImplementedError

    # ---- capturable page joins (capturable_index = True; see the module docstring) ----------------
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        """Capacity for ``pages`` middle pages per sequence of ``layer``'s index (outside a captured step).
        Nothing to do for ``pages == 0``."""
        if self.capturable_index:
            raise NotImplementedError(f"{type(self).__name__} declares capturable_index without reserve_index")

    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        """The host side of pages joining ``layer``'s middle in a step indexed by ``index_join``:
        start / count [B] (CPU). Default: nothing."""

    def index_join(self, layer: int, join: PageJoin) -> None:
        """Index the page that joins the middle of each sequence with ``join.joins`` (device work only,
        fixed shapes whatever joins)."""
        raise NotImplementedError(f"{type(self).__name__} does not index page joins with static shapes")

    def reuse_steps(self) -> int:
        """Decode steps one selection serves (``select_every``; :mod:`kvdex.engine.reuse`). Default 1."""
        return 1

    def rebuild_period(self) -> int:
        """Decode steps between the policy's periodic rebuilds, run before the step (:meth:`before_step`;
        PRKV's and SnapKV+'s ``refresh``; steps ``T, 2T, ...``): a benchmark's timed steps must span one to
        count its cost (``kvdex bench`` records how many they span). 0 (the default): none."""
        return 0

    def must_select(self) -> bool:
        """Before a step (host): select although the step could reuse the last selection. Default False."""
        return False

    def before_step(self, stores: Sequence[LayerStore]) -> None:
        """Before each decode step, on the host, before its first layer runs (an eager step, per-layer and
        whole-step CUDA graphs alike; called again for the same step it does nothing): periodic index work
        with data-dependent shapes, done here so that the step itself can replay its graph (PRKV's and
        SnapKV+'s ``refresh``). ``stores``: every layer's store, by layer index. Default: nothing."""

    def reused(self, q: torch.Tensor, view: LayerView) -> Selection | None:
        """A step of ``view.layer`` that the schedule marks as a reuse step (:mod:`kvdex.engine.reuse`):
        ``select``'s per-step bookkeeping. None (the default): the layer attends its last selection; a
        :class:`~kvdex.selection.Selection` (fixed shapes, made from what the last select step kept, such as
        IceCache's ``pool_every`` candidates): the layer attends that instead."""
        return None

    def on_step(self, step: int, logits: torch.Tensor | None) -> None:
        """After decode step ``step`` (0-based); ``logits`` [B, vocab] of the last position."""

    def observe(self, layer: int, q: torch.Tensor, attend_set: AttendSet, scale: float) -> None:
        """After the sparse decode attention of ``layer``, for policies with ``observes = True`` only
        (H2O accumulates the attention weights of the attended tokens). ``attend_set``: the
        :class:`~kvdex.storage.AttendSet` the kernel read; q [B, Hq, D]."""

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def stats(self) -> dict[str, Any]:
        """Run-time counters a policy reports in ``Cache.stats()["policy_stats"]`` (e.g. CHESS rebuilds)."""
        return {}

    def share_index(self, memo: dict[Any, Any]) -> None:
        """``Cache.fork`` hands the cache it forks and every fork of that prefill the same ``memo``
        dict. A policy may keep *immutable* index state built from the prefill there (keyed by
        everything it depends on), so that forks with equal settings reuse it instead of
        rebuilding it (IceCache's DCI trees). Default: nothing is shared."""

    def graph_unsupported(self, stores: Sequence[LayerStore]) -> str | None:
        """Why this policy's decode step cannot be captured in a CUDA graph with these ``stores``, or None
        (``kvdex.engine.graphs``). Default: None for a ``capturable`` policy."""
        if self.capturable:
            return None
        return f"policy {self.name!r} does not support graph capture (its selection touches the CPU)"

    def graph_key(self, stores: Sequence[LayerStore]) -> tuple[Any, ...] | None:
        """Before each step of a captured decode: what the step's captured work depends on beyond the
        stores' buffers (ids and shapes of the policy's device buffers, widths baked into the step), or
        None when this step must run eagerly (``kvdex.engine.graphs``). Asked only where
        :meth:`graph_unsupported` is None. Default: ``()``, a step that reads no policy buffer."""
        return ()

    def graph_replayed(self) -> None:
        """After a replayed step (which runs no Python): the host-side bookkeeping the captured step's
        ``select`` did (counters). Default: nothing."""

    def positions(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Token positions of the store slots ``slots`` of ``layer`` (a ``relocates`` policy undoes its
        reordering; -1 stays). Default: slot == position."""
        return slots

    def make_store(self, layer: int, offload: bool, args: tuple, work_tokens: int) -> LayerStore | None:
        """A policy-specific store for sparse ``layer`` (IceCache keeps its offloaded middle in
        semantic pages), or None for the default. ``args``: the positional arguments of
        :class:`~kvdex.storage.LayerStore`; ``work_tokens``: the default working-set size."""
        return None


# ---- option choices ------------------------------------------------------------------------------


_CHOICES: dict[type, dict[str, tuple[Any, ...]]] = {}  # option_choices, per class


def option_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The options of the dataclass ``cls`` annotated with a ``Literal`` (``Literal[...] | None`` too): option ->
    its allowed values (None among them where the annotation allows it), in the annotation's order."""
    if cls in _CHOICES:
        return _CHOICES[cls]
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[Any, ...]] = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        values: tuple[Any, ...] = ()
        for part in parts:
            if typing.get_origin(part) is Literal:
                values += typing.get_args(part)
            elif part is type(None):
                values += (None,)
        if any(v is not None for v in values):
            out[f.name] = values
    _CHOICES[cls] = out
    return out


def check_choices(policy: Policy) -> None:
    """ValueError naming the option, its allowed values and the value given, for the first ``Literal``
    option of ``policy`` that holds none of its values (the one place option choices are checked)."""
    for name, allowed in option_choices(type(policy)).items():
        value = getattr(policy, name)
        if value not in allowed:
            shown = ", ".join(repr(v) if v == "" else str(v) for v in allowed if v is not None)
            raise ValueError(f"{name} must be one of {shown}, got {value!r}")


# ---- shared mechanics: group_reduce, topk_ids and mask_pages are imported from kvdex.kernels.scoring


class JoinFreePolicy(Policy):
    """A policy with nothing to index when a page joins the middle during decoding (the index-free
    policies below; SnapKV, whose prompt choice is fixed; H2O, whose score buffers cover every position):
    CUDA-graph decoding replays those steps too (``capturable_index``) instead of running them eagerly."""

    capturable_index = True

    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        """Nothing to reserve (buffers that grow with the lengths are sized in ``graph_key`` / ``select``)."""

    def index_join(self, layer: int, join: PageJoin) -> None:
        """Nothing to index."""


class IndexFreePolicy(JoinFreePolicy):
    """A policy that keeps no index of the middle (its selection reads only the store: ``full``,
    ``oracle``, ``streaming``)."""
