"""Per-layer CUDA graphs of kvdex's decode step (:class:`StepGraphs`): what makes a plain
``model.generate(..., cache=kvdex.Cache(...))`` decode without kvdex's Python per kernel.

Outside :class:`~kvdex.hf.graph_decoder.GraphDecoder` (which captures the whole model step), every
single-token decode step of a prefilled cache goes through here. The step-level decisions are the
decoder's own (:mod:`kvdex.hf.graph`: static sizing, page joins, the policy's ``graph_key``, one eager
warm-up step per new key), taken once per step at the first layer's ``update``; then each layer's kvdex
work -- append -> select -> fetch -> attend -- is one replay of that layer's graph:

* ``update`` copies the new k/v into the layer's static inputs (the append itself is deferred);
* ``attention`` copies q in and replays the layer's graph (captured on the step after the warm-up, by
  running the layer's eager append + decode once under capture, then replaying it for its device work),
  then does the host side of the replayed work (``advance_host``, ``count_join``, transfer and counter
  deltas); after the last layer, the policy's ``graph_replayed``.

The model's own work is left to the caller: eager, or compiled by transformers' ``generate`` (the cache is
``is_compileable``; kvdex's entry points are opaque custom ops there, :mod:`kvdex.hf.compiled_ops`).
A cache that cannot be captured (no CUDA device, ``timing=True``, an observer, a store or policy without
graph support, a capture that fails) decodes eagerly, with one warning saying why.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from kvdex.engine import graphs as graphs_mod
from kvdex.storage import host_joins
from kvdex.view import CaptureError

# Page joins of a capturable_index policy: the stores and the index are grown this many pages ahead of
# the longest sequence (half of it used up -> grown again), so that a re-allocation (a new graph key, an
# eager warm-up step and a capture) happens once every JOIN_HEADROOM_PAGES / 2 pages at most, and rarely
# in practice (the buffers grow by a quarter of their size at a time).
JOIN_HEADROOM_PAGES = 16


def capture_unsupported(cache) -> str | None:
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


def replay_unsupported(cache) -> str | None:
    """Why decode steps of ``cache`` (prefilled) cannot replay CUDA graphs outside
    :class:`~kvdex.hf.graph_decoder.GraphDecoder` (per layer or whole under kvdex's compile backend), or None."""
    dev = cache.layers[0].store.device
    if not cache.graphs.usable(dev):
        return "it needs a CUDA device"
    if len({lay.store.device for lay in cache.layers}) > 1:
        return "the layers sit on several devices"
    return capture_unsupported(cache)


class StepPlan:
    """The decisions of a decode step that replays graphs, before it runs (:mod:`kvdex.hf.graph`): room and
    host side of page joins, whether the step must run eagerly, its graph key. Shared by
    :class:`~kvdex.hf.graph_decoder.GraphDecoder` (whole steps) and :class:`StepGraphs` (per layer).
    Needs ``cache``; ``_joins``: the policy indexes joins inside captured steps (``capturable_index``).
    ``weak``: hold the cache by a weak reference (the cache's own :class:`StepGraphs`: no reference cycle,
    so that a dropped cache and its CUDA graphs are freed at once by reference counting, never later by
    the cyclic collector at an arbitrary point, which can be inside another capture)."""

    def __init__(self, cache, weak: bool = False) -> None:
        self._cache_ref = weakref.ref(cache) if weak else (lambda: cache)
        self._joins = False
        self._every = 1  # the policy's select_every: a reuse step is its own graph variant (kvdex.engine.reuse)
        self._join_count = None  # [B] (CPU) pages joining in this step (capturable_index)
        self._reserved = 0  # tokens per sequence the stores and the index have room for (page joins)
        self._warmed: set = set()  # keys run eagerly once (the next step with that key captures)

    @property
    def cache(self):
        c = self._cache_ref()
        if c is None:
            raise RuntimeError("the kvdex.Cache of this decode plan was garbage-collected")
        return c

    def _stores(self):
        return [lay.store for lay in self.cache.layers]

    def _join_host(self) -> bool:
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
        self._join_count = count
        if not bool((count > 0).any()):
            return False
        for lay in lays:
            p.joined(lay.layer_idx, start, count)
        return True

    def _needs_eager(self) -> bool:
        st = self._stores()[0]
        g, L = st.grid, st.lengths_host
        if not self._joins and bool((g.num_middle_pages(L + 1) != g.num_middle_pages(L)).any()):
            return True  # a page joins the middle: store/policy index work with data-dependent shapes
        if any(s.grows_on_append(1) for s in self._stores()):
            return True  # a device buffer grows
        return False

    def _key(self):
        stores = self._stores()
        key = []
        for s in stores:
            key.extend(s.graph_buffers())  # an offloaded store: also the host buffer the UVA gather reads
        pk = self.cache.policy.graph_key(stores)
        if pk is None:
            return None
        key.append(pk)
        return tuple(key)

    def _bookkeeping(self, join_count, delta) -> None:
        """The host side of one replayed whole step, as the captured step's Python did it: step and
        lengths, the pages a join wrote out (``join_count``: this step's joins, or None), the transfer and
        call counters (``delta``: what the capture added)."""
        c = self.cache
        c.step += 1
        join = join_count is not None and bool((join_count > 0).any())
        for lay in c.layers:
            lay.seen += 1
            lay.store.advance_host(1)
            if join:
                lay.store.count_join(join_count)  # an offloaded store: the pages it wrote to host memory
        c.transfer.h2d_bytes += delta[0]
        c.transfer.h2d_calls += delta[1]
        c.counters.calls += delta[2]
        c.warn_if_long(c.layers[0].seen, stacklevel=4)

    def _arm(self) -> None:
        """Switch the stores to static sizing and note whether the policy indexes page joins in captured steps."""
        c = self.cache
        for lay in c.layers:
            lay.store.use_static_sizing()
        self._joins = bool(c.policy.capturable_index)
        self._every = c.policy.reuse_steps()

    def _decide(self, captured, extra=None):
        """This step's graph key, whether a page joins, and what to do: ``"eager"`` (a boundary, a step the
        policy keeps eager, or a new key run once eagerly first, so that every kernel variant is compiled and
        loaded before a capture), ``"capture"`` or ``"replay"``. ``captured``: the keys that hold graphs;
        ``extra``: what the step's graphs depend on besides the policy and the stores (part of the key).
        Sets the cache's ``join_step`` for this step."""
        c = self.cache
        c.policy.before_step(self._stores())  # periodic index work (PRKV's refresh): the step then replays
        joining = self._join_host() if self._joins else False
        first = c.layers[0]
        reuse = c.reuse.decide(self._every, first.seen, first.store, c.policy.must_select)
        key = None if self._needs_eager() else self._key()
        if key is not None and extra is not None:
            key = (key, extra)
        if key is not None and self._every > 1:
            key = (key, reuse)  # select_every: the step that attends each layer's last selection is another graph
        if key is not None and self._joins:
            # the join variant of the step (page-join path, masked per sequence on the device) is right on
            # any step: it is warmed up and captured on the first steps after the plain one, not at a boundary
            # (never a reuse step's: a step in which a page joins selects)
            early = not joining and not reuse and (key, False) in captured and (key, True) not in captured
            key = (key, joining or early)
        if self._joins:
            c.join_step = joining if key is None else key[1]
        if key is None or (key not in captured and key not in self._warmed):
            if key is not None:
                self._warmed = {k for k in self._warmed if self._base(k) == self._base(key)} | {key}
            return key, joining, "eager"
        return key, joining, "replay" if key in captured else "capture"

    def _base(self, key):
        """The key without the page-join and reuse flags (the policy's buffers and shapes)."""
        key = key[0] if self._joins else key
        return key[0] if self._every > 1 else key


class StepGraphs:
    """The per-layer step graphs of one :class:`kvdex.Cache` (``cache.step_graphs``); ``counts``: eager
    steps, layer captures, layer replays; ``reason``: why steps run eagerly (None: they don't)."""

    def __init__(self, cache, enabled: bool = True):
        self._cache = weakref.ref(cache)
        self.enabled = enabled
        self.reason: str | None = None if enabled else "disabled (step_graphs=False)"
        self._dec: StepPlan | None = None  # the step decisions (shared with GraphDecoder)
        self._checked = False
        self.mode = "eager"  # this step: eager / capture / replay
        self.key = None
        self._captured: set = set()  # keys whose every layer holds a graph
        self.graphs: dict = {}  # (key, layer) -> (graph, static q, k, v, out, deltas)
        graphs_mod.free_with(self, self.graphs)  # never destroyed inside a capture
        self._pool = None
        self._last_layer = -1
        self.in_step = False  # between begin() and end() of a step whose decisions were taken here
        self._pending = None
        self._count = None
        self.counts = {"eager": 0, "captures": 0, "replays": 0}

    @property
    def cache(self):
        c = self._cache()
        if c is None:
            raise RuntimeError("the kvdex.Cache of these step graphs was garbage-collected")
        return c

    # ---- the step's decisions (first layer's update) ----------------------------------------------
    def _prepare(self) -> None:
        self._checked = True
        c = self.cache
        dev = c.layers[0].store.device
        if self.reason is None and c._model() is None:
            self.reason = "the model was garbage-collected"
        if self.reason is None:
            self.reason = replay_unsupported(c)
        if self.reason is not None:
            if self.enabled and c.graphs.usable(dev):
                warnings.warn(f"kvdex: per-layer step graphs are off, kvdex's decode step runs eagerly: "
                              f"{self.reason}", stacklevel=6)  # fmt: skip
            return
        self._dec = StepPlan(c, weak=True)
        self._dec._arm()
        self._last_layer = len(c.layers) - 1

    def begin(self) -> None:
        """Before the first layer's update of a single-token decode step: pick eager, capture or replay."""
        if not self._checked:
            self._prepare()
        graphs_mod.free_deferred()  # graphs of caches collected during a capture
        self.mode = "eager"
        if self.reason is not None:
            self.counts["eager"] += 1
            return
        c, dec = self.cache, self._dec
        self.in_step = True
        joins = dec._joins
        c.joins_external = joins
        key, joining, mode = dec._decide(self._captured)
        self.key = key
        # a replay's host side: the pages that joined (an offloaded store counts the bytes it wrote out)
        self._count = dec._join_count if joins and key is not None and key[1] and joining else None
        if mode == "eager":
            self.counts["eager"] += 1
            return
        if mode == "capture":
            base = dec._base(key)
            for k in [k for k in self.graphs if dec._base(k[0]) != base]:
                del self.graphs[k]  # over buffers re-allocated since: never replayed again
            self._captured = {k for k in self._captured if dec._base(k) == base}
            c.counters.count_in_place(c.layers[0].store.device)
            self.mode = "capture"
        else:
            self.mode = "replay"

    def end(self) -> None:
        """After the last layer's attention: the step's host side, and page joins decided by the cache again."""
        c = self.cache
        if self.mode == "capture":
            self._captured.add(self.key)
        elif self.mode == "replay":
            c.policy.graph_replayed()
            c.warn_if_long(c.layers[0].seen, stacklevel=4)
        self.mode, self.in_step = "eager", False
        c.join_step, c.joins_external = None, False

    # ---- one layer -------------------------------------------------------------------------------
    def deferred(self) -> bool:
        """Whether this step's layers run through graphs (update defers its append to :meth:`attend`)."""
        return self.mode != "eager"

    def stash(self, layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """``update`` of a graph step: the new k/v into the layer's static inputs."""
        ent = self.graphs.get((self.key, layer.layer_idx))
        if ent is None:
            self._pending = (k.clone(), v.clone())
        else:
            ent[2].copy_(k)
            ent[3].copy_(v)

    def attend(self, layer, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, 1, D] -> [B, 1, Hq, D] through the layer's graph (captured first where it has none)."""
        i = layer.layer_idx
        ent = self.graphs.get((self.key, i))
        if ent is None:
            ent = self._capture(layer, q, scale)
        else:
            ent[1].copy_(q)
            self._replay(ent)
            self._host_side(layer, ent[5])
        out = ent[4].clone()
        if i == self._last_layer:
            self.end()
        return out

    def _replay(self, ent) -> None:
        with graphs_mod.as_current(ent[1].device):
            ent[0].replay()
        self.counts["replays"] += 1

    def _host_side(self, layer, delta) -> None:
        c = self.cache
        store = layer.store
        store.advance_host(1)
        if self._count is not None:
            store.count_join(self._count)
        c.transfer.h2d_bytes += delta[0]
        c.transfer.h2d_calls += delta[1]
        c.counters.calls += delta[2]

    def _capture(self, layer, q: torch.Tensor, scale: float):
        """Capture the layer's append + decode (its Python runs once, here: this step's host side), then
        replay the graph for this step's device work."""
        c = self.cache
        eng = layer.engine
        sq = q.clone()
        sk, sv = self._pending
        self._pending = None
        t = c.transfer
        before = (t.h2d_bytes, t.h2d_calls, c.counters.calls)
        cuda = sq.device.type == "cuda"
        if cuda:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(sq.device)
        else:
            g = graphs_mod.STAND_IN(sq)
        try:
            # no finalizer inside the capture (kvdex.engine.graphs.gc_paused); the capture on the layers' device
            with graphs_mod.as_current(sq.device), graphs_mod.gc_paused():
                ctx = torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local") if cuda else None
                with ctx or _StandInCapture(g, c):
                    eng.append(sk, sv)
                    out = eng.decode(sq[:, :, 0], scale).unsqueeze(1)
        except RuntimeError as e:
            raise CaptureError(f"layer {layer.layer_idx}: {e}") from e
        delta = (t.h2d_bytes - before[0], t.h2d_calls - before[1], c.counters.calls - before[2])
        ent = (g, sq, sk, sv, out, delta)
        self.graphs[(self.key, layer.layer_idx)] = ent
        self.counts["captures"] += 1
        if cuda:  # a CUDA capture launches nothing (the stand-in ran the ops while recording them)
            self._replay(ent)
        return ent


class _StandInCapture:
    """CPU tests: a stand-in graph (``kvdex.engine.graphs.STAND_IN``) told which tensors are host-side."""

    def __init__(self, graph, cache):
        self.graph, self.cache = graph, cache

    def __enter__(self):
        host = [lay.store.lengths_host for lay in self.cache.layers]
        self.graph.capture_begin(host=host)

    def __exit__(self, *exc):
        self.graph.capture_end()
