"""The step plan of CUDA-graph decoding (:class:`StepPlan`): what a decode step does before it runs.

One plan per user, each deciding the same way: :class:`~kvdex.hf.graph.GraphDecoder` (whole model
steps), :class:`~kvdex.engine.graphs.layer_graphs.StepGraphs` (one graph per layer) and the compile
backend's ``WholeStep`` (whole compiled steps). Per step, on the host: the policy's periodic index work
(``before_step``), room and host side of page joins, whether the step runs eagerly, and its graph key;
then :meth:`StepPlan.decide` says *eager* (a boundary, a step the policy keeps eager, a new key run once
eagerly first), *capture* or *replay*. After a replay of a whole step, :meth:`StepPlan.replayed` does the
host side the captured step's Python did. The contract behind it: :mod:`kvdex.engine.graphs`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

import torch

from kvdex.storage import host_joins

if TYPE_CHECKING:  # kvdex.engine.step imports this package
    from kvdex.config import CacheConfig
    from kvdex.engine.counters import StepCounters
    from kvdex.engine.graphs.service import GraphService
    from kvdex.engine.reuse import SelectionReuse
    from kvdex.engine.step import LayerEngine
    from kvdex.policies.base import Policy
    from kvdex.storage import LayerStore, TransferStats

# Page joins of a capturable_index policy: the stores and the index are grown this many pages ahead of
# the longest sequence (half of it used up -> grown again), so that a re-allocation (a new graph key, an
# eager warm-up step and a capture) happens once every JOIN_HEADROOM_PAGES / 2 pages at most, and rarely
# in practice (the buffers grow by a quarter of their size at a time).
JOIN_HEADROOM_PAGES = 16


class StepLayer(Protocol):
    """One layer of a :class:`StepHost` as a plan reads it."""

    layer_idx: int
    seen: int  # tokens seen, padding included

    @property
    def store(self) -> LayerStore: ...

    @property
    def engine(self) -> LayerEngine: ...


class StepHost(Protocol):
    """What CUDA-graph decoding reads and sets on the cache it decodes (``kvdex.Cache`` for transformers)."""

    layers: Sequence[StepLayer]
    policy: Policy
    config: CacheConfig
    observer: object
    graphs: GraphService
    reuse: SelectionReuse
    counters: StepCounters
    transfer: TransferStats
    step: int
    # whether this step appends through the page-join path (None: the cache decides where a page joins);
    # joins_external: the plan runs the policy's host side of a join (Policy.joined) before the step;
    # decoder_active: a whole step is planned here (the per-layer step graphs stay out)
    join_step: bool | None
    joins_external: bool
    decoder_active: bool

    @property
    def model(self) -> object | None: ...

    def warn_if_long(self, total: int, stacklevel: int = 2) -> None: ...


Mode = Literal["eager", "capture", "replay"]


class StepDecision(NamedTuple):
    """:meth:`StepPlan.decide`'s answer: the step's graph ``key`` (None: the step must run eagerly),
    whether a page ``joining`` the middle in it, and what to do (``mode``)."""

    key: tuple | None
    joining: bool
    mode: Mode


@dataclasses.dataclass(frozen=True)
class HostCounts:
    """The host counters a step adds to (transfer bytes and calls, attended-token calls): taken before a
    capture, :meth:`since` gives what the captured step added, which :meth:`add_to` adds again after
    every replay (a replay runs no Python)."""

    h2d_bytes: int = 0
    h2d_calls: int = 0
    calls: int = 0

    @classmethod
    def of(cls, cache: StepHost) -> HostCounts:
        t = cache.transfer
        return cls(t.h2d_bytes, t.h2d_calls, cache.counters.calls)

    def since(self, cache: StepHost) -> HostCounts:
        now = HostCounts.of(cache)
        return HostCounts(now.h2d_bytes - self.h2d_bytes, now.h2d_calls - self.h2d_calls, now.calls - self.calls)

    def add_to(self, cache: StepHost) -> None:
        cache.transfer.h2d_bytes += self.h2d_bytes
        cache.transfer.h2d_calls += self.h2d_calls
        cache.counters.calls += self.calls


def capture_unsupported(cache: StepHost) -> str | None:
    """Why a decode step of ``cache`` (prefilled) cannot be captured in a CUDA graph, device aside, or None:
    the cache's options, then every store's and the policy's own reason."""
    if cache.config.timing:
        return "timing=True synchronises inside the step"
    if cache.observer is not None:
        return "an observer runs Python inside the step"
    stores = [lay.store for lay in cache.layers]
    for st in stores:
        why = st.graph_unsupported()
        if why is not None:
            return why
    return cache.policy.graph_unsupported(stores)


def replay_unsupported(cache: StepHost) -> str | None:
    """Why decode steps of ``cache`` (prefilled) cannot replay CUDA graphs outside
    :class:`~kvdex.hf.graph.GraphDecoder` (per layer or whole under kvdex's compile backend), or None."""
    dev = cache.layers[0].store.device
    if not cache.graphs.usable(dev):
        return "it needs a CUDA device"
    if len({lay.store.device for lay in cache.layers}) > 1:
        return "the layers sit on several devices"
    return capture_unsupported(cache)


class StepPlan:
    """The decisions of a decode step that replays graphs, before it runs (see the module).

    ``joins``: the policy indexes page joins inside captured steps (``capturable_index``; set by :meth:`arm`);
    ``every``: the policy's ``select_every`` (a reuse step is a graph of its own, :mod:`kvdex.engine.reuse`);
    ``join_count``: [B] (CPU) the pages joining in this step. ``weak``: hold the cache by a weak reference
    (the cache's own plans: no reference cycle, so that a dropped cache and its CUDA graphs are freed at once
    by reference counting, never later by the cyclic collector at an arbitrary point, which can be inside
    another capture)."""

    def __init__(self, cache: StepHost, weak: bool = False) -> None:
        self._cache_ref: Callable[[], StepHost | None] = weakref.ref(cache) if weak else (lambda: cache)
        self.joins = False
        self.every = 1
        self.join_count: torch.Tensor | None = None
        self._reserved = 0  # tokens per sequence the stores and the index have room for (page joins)
        self._warmed: set = set()  # keys run eagerly once (the next step with that key captures)

    @property
    def cache(self) -> StepHost:
        c = self._cache_ref()
        if c is None:
            raise RuntimeError("the kvdex.Cache of this decode plan was garbage-collected")
        return c

    def stores(self) -> list[LayerStore]:
        return [lay.store for lay in self.cache.layers]

    def arm(self) -> None:
        """Switch the stores to static sizing and note whether the policy indexes page joins in captured steps."""
        c = self.cache
        for lay in c.layers:
            lay.store.use_static_sizing()
        self.joins = bool(c.policy.capturable_index)
        self.every = c.policy.reuse_steps()

    def join_host(self) -> bool:
        """Before a step of a ``capturable_index`` policy: room for the pages to come (stores and index,
        :data:`JOIN_HEADROOM_PAGES` ahead, re-allocating -- a new graph key -- only every so many pages),
        then the host side of this step's joins (``Policy.joined``). True when a page joins."""
        c, p = self.cache, self.cache.policy
        lays = [c.layers[i] for i in p.info.sparse_layers]
        if not lays:
            return False
        st = lays[0].store
        g = st.grid
        top = int(st.lengths_host.max()) + 1
        if top + JOIN_HEADROOM_PAGES * g.page_size // 2 > self._reserved:
            self._reserved = top + JOIN_HEADROOM_PAGES * g.page_size
            pages = g.middle_pages_of(self._reserved)
            for lay in c.layers:
                lay.store.reserve_join(self._reserved)
            for lay in lays:
                p.reserve_index(lay.layer_idx, pages, lay.store)
        start, count = host_joins(g, st.lengths_host)
        self.join_count = count
        if not bool((count > 0).any()):
            return False
        for lay in lays:
            p.joined(lay.layer_idx, start, count)
        return True

    def needs_eager(self) -> bool:
        """Whether this step must run eagerly whatever the policy says: a page joins without the page-join
        path, or a device buffer grows."""
        stores = self.stores()
        st = stores[0]
        g, L = st.grid, st.lengths_host
        if not self.joins and bool((g.num_middle_pages(L + 1) != g.num_middle_pages(L)).any()):
            return True  # a page joins the middle: store/policy index work with data-dependent shapes
        if any(s.grows_on_append(1) for s in stores):
            return True  # a device buffer grows
        return False

    def key(self) -> tuple | None:
        """The graph key of this step from the stores and the policy (None: the policy keeps it eager)."""
        stores = self.stores()
        key: list = []
        for s in stores:
            key.extend(s.graph_buffers())  # an offloaded store: also the host buffer the UVA gather reads
        for lay in self.cache.layers:
            key.extend(lay.engine.held_buffers())  # select_every: the held selections a reuse step attends
        pk = self.cache.policy.graph_key(stores)
        if pk is None:
            return None
        key.append(pk)
        return tuple(key)

    def decide(self, captured: Collection, extra: Hashable | None = None) -> StepDecision:
        """This step's graph key, whether a page joins, and what to do: ``"eager"`` (a boundary, a step the
        policy keeps eager, or a new key run once eagerly first, so that every kernel variant is compiled and
        loaded before a capture), ``"capture"`` or ``"replay"``. ``captured``: the keys that hold graphs;
        ``extra``: what the step's graphs depend on besides the policy and the stores (part of the key).
        Sets the cache's ``join_step`` for this step."""
        c = self.cache
        c.policy.before_step(self.stores())  # periodic index work (PRKV's refresh): the step then replays
        joining = self.join_host() if self.joins else False
        first = c.layers[0]
        reuse = c.reuse.decide(self.every, first.seen, first.store, c.policy.must_select)
        key = None if self.needs_eager() else self.key()
        if key is not None and extra is not None:
            key = (key, extra)
        if key is not None and self.every > 1:
            key = (key, reuse)  # select_every: the step that attends each layer's last selection is another graph
        if key is not None and self.joins:
            # the join variant of the step (page-join path, masked per sequence on the device) is right on
            # any step: it is warmed up and captured on the first steps after the plain one, not at a boundary
            # (never a reuse step's: a step in which a page joins selects)
            early = not joining and not reuse and (key, False) in captured and (key, True) not in captured
            key = (key, joining or early)
        if self.joins:
            c.join_step = joining if key is None else key[1]
        if key is None or (key not in captured and key not in self._warmed):
            if key is not None:
                self._warmed = {k for k in self._warmed if self.base(k) == self.base(key)} | {key}
            return StepDecision(key, joining, "eager")
        return StepDecision(key, joining, "replay" if key in captured else "capture")

    def base(self, key: tuple) -> tuple:
        """The key without the page-join and reuse flags (the policy's buffers and shapes)."""
        key = key[0] if self.joins else key
        return key[0] if self.every > 1 else key

    def replay_joins(self, decision: StepDecision) -> torch.Tensor | None:
        """The pages joining per sequence that the replay of ``decision``'s graph writes (its host side counts
        them), or None where it writes none."""
        joined = self.joins and decision.key is not None and decision.key[1] and decision.joining
        return self.join_count if joined else None

    def replayed(self, joins: torch.Tensor | None, delta: HostCounts) -> None:
        """The host side of one replayed whole step, as the captured step's Python did it: step and
        lengths, the pages a join wrote out (``joins``: :meth:`replay_joins`), the transfer and call
        counters (``delta``: what the capture added)."""
        c = self.cache
        c.step += 1
        join = joins is not None and bool((joins > 0).any())
        for lay in c.layers:
            lay.seen += 1
            lay.store.advance_host(1)
            if join:
                assert joins is not None
                lay.store.count_join(joins)  # an offloaded store: the pages it wrote to host memory
        delta.add_to(c)
        c.warn_if_long(c.layers[0].seen, stacklevel=4)
