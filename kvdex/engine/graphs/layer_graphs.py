"""Per-layer CUDA graphs of kvdex's decode step (:class:`StepGraphs`): what makes a plain
``model.generate(..., cache=kvdex.Cache(...))`` decode without kvdex's Python per kernel.

Outside :class:`~kvdex.hf.graph.GraphDecoder` (which captures the whole model step) and the compile backend's
whole steps, every single-token decode step of a prefilled cache goes through here. The step-level decisions
are the decoder's own (:class:`~kvdex.engine.graphs.plan.StepPlan`: static sizing, page joins, the policy's
``graph_key``, one eager warm-up step per new key), taken once per step at the first layer's ``update``; then
each layer's kvdex work -- append -> select -> fetch -> attend -- is one replay of that layer's graph:

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
from typing import Any, NamedTuple

import torch

from kvdex.engine.graphs.capture import as_current, capture_step, free_deferred, free_with
from kvdex.engine.graphs.plan import HostCounts, StepHost, StepLayer, StepPlan, replay_unsupported
from kvdex.view import CaptureError


class LayerGraph(NamedTuple):
    """One layer's captured step: the graph, its static inputs (q, k, v), its output and what its host side
    adds to the counters on every replay."""

    graph: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    delta: HostCounts


class StepGraphs:
    """The per-layer step graphs of one :class:`kvdex.Cache` (``cache.step_graphs``); ``counts``: eager
    steps, layer captures, layer replays; ``reason``: why steps run eagerly (None: they don't)."""

    def __init__(self, cache: StepHost, enabled: bool = True) -> None:
        self._cache = weakref.ref(cache)
        self.enabled = enabled
        self.reason: str | None = None if enabled else "disabled (step_graphs=False)"
        self.plan: StepPlan | None = None  # the step decisions (as GraphDecoder's and WholeStep's)
        self._checked = False
        self.mode = "eager"  # this step: eager / capture / replay
        self.key: tuple | None = None
        self._captured: set[tuple] = set()  # keys whose every layer holds a graph
        self.graphs: dict[tuple, dict[int, LayerGraph]] = {}  # key -> layer -> its graph
        free_with(self, self.graphs)  # never destroyed inside a capture
        self._now: dict[int, LayerGraph] = {}  # this step's key's graphs (the key is hashed once a step)
        self._pool: Any = None
        self._last_layer = -1
        self.in_step = False  # between begin() and end() of a step whose decisions were taken here
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._count: torch.Tensor | None = None
        self.counts = {"eager": 0, "captures": 0, "replays": 0}

    @property
    def cache(self) -> StepHost:
        c = self._cache()
        if c is None:
            raise RuntimeError("the kvdex.Cache of these step graphs was garbage-collected")
        return c

    # ---- the step's decisions (first layer's update) ----------------------------------------------
    def _prepare(self) -> None:
        self._checked = True
        c = self.cache
        dev = c.layers[0].store.device
        if self.reason is None and c.model is None:
            self.reason = "the model was garbage-collected"
        if self.reason is None:
            self.reason = replay_unsupported(c)
        if self.reason is not None:
            if self.enabled and c.graphs.usable(dev):
                warnings.warn(f"kvdex: per-layer step graphs are off, kvdex's decode step runs eagerly: "
                              f"{self.reason}", stacklevel=6)  # fmt: skip
            return
        self.plan = StepPlan(c, weak=True)
        self.plan.arm()
        self._last_layer = len(c.layers) - 1

    def begin(self) -> None:
        """Before the first layer's update of a single-token decode step: pick eager, capture or replay."""
        if not self._checked:
            self._prepare()
        free_deferred()  # graphs of caches collected during a capture
        self.mode = "eager"
        if self.reason is not None:
            self.counts["eager"] += 1
            return
        c, plan = self.cache, self.plan
        assert plan is not None  # made by _prepare where reason is None
        self.in_step = True
        c.joins_external = plan.joins
        decision = plan.decide(self._captured)
        self.key = key = decision.key
        # a replay's host side: the pages that joined (an offloaded store counts the bytes it wrote out)
        self._count = plan.replay_joins(decision)
        if decision.mode == "eager":
            self.counts["eager"] += 1
            return
        assert key is not None
        if decision.mode == "capture":
            base = plan.base(key)
            for k in [k for k in self.graphs if plan.base(k) != base]:
                del self.graphs[k]  # over buffers re-allocated since: never replayed again
            if not self.graphs:  # a pool no graph holds may still hold tensors (a held selection allocated in a
                self._pool = None  # capture); PyTorch refuses to capture into it again: new graphs take a new pool
            self._captured = {k for k in self._captured if plan.base(k) == base}
            c.counters.count_in_place(c.layers[0].store.device)
            self.mode = "capture"
        else:
            self.mode = "replay"
        self._now = self.graphs.setdefault(key, {})

    def end(self) -> None:
        """After the last layer's attention: the step's host side, and page joins decided by the cache again."""
        c = self.cache
        if self.mode == "capture":
            assert self.key is not None
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

    def stash(self, layer: StepLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """``update`` of a graph step: the new k/v (any strides) into the layer's static inputs."""
        ent = self._now.get(layer.layer_idx)
        if ent is None:
            self._pending = (k.clone(memory_format=torch.contiguous_format),
                             v.clone(memory_format=torch.contiguous_format))  # fmt: skip
        else:
            ent.k.copy_(k)
            ent.v.copy_(v)

    def attend(self, layer: StepLayer, q: torch.Tensor, scale: float, clone: bool = True) -> torch.Tensor:
        """q [B, Hq, 1, D] (any strides) -> [B, 1, Hq, D] through the layer's graph (captured first where it has
        none). ``clone=False``: the graph's own output buffer, which the layer's next replay overwrites (for a
        caller that copies it out at once)."""
        i = layer.layer_idx
        ent = self._now.get(i)
        if ent is None:
            out = self._capture(layer, q, scale)
        else:
            ent.q.copy_(q)
            self._replay(ent)
            self._host_side(layer, ent.delta)
            out = ent.out
        out = out.clone() if clone else out
        if i == self._last_layer:
            self.end()
        return out

    def _replay(self, ent: LayerGraph) -> None:
        with as_current(ent.q.device):
            ent.graph.replay()
        self.counts["replays"] += 1

    def _host_side(self, layer: StepLayer, delta: HostCounts) -> None:
        store = layer.store
        store.advance_host(1)
        if self._count is not None:
            store.count_join(self._count)
        delta.add_to(self.cache)

    def _capture(self, layer: StepLayer, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Capture the layer's append + decode (its Python runs once, here: this step's host side), then
        replay the graph for this step's device work; its output. A capture that fails to begin (nothing of the
        layer ran) gives up the graphs: this layer and every later step run eagerly, with one warning."""
        c = self.cache
        eng = layer.engine
        sq = q.clone(memory_format=torch.contiguous_format)
        assert self._pending is not None  # stash() of this layer's update
        sk, sv = self._pending
        self._pending = None
        before = HostCounts.of(c)
        cuda = sq.device.type == "cuda"
        if cuda and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every layer's graphs
        host = [lay.store.lengths_host for lay in c.layers]
        begun = False
        try:
            with capture_step(sq.device, sq, host, pool=self._pool) as g:
                begun = True
                eng.append(sk, sv)
                out = eng.decode(sq[:, :, 0], scale).unsqueeze(1)
        except RuntimeError as e:
            if begun:  # the layer's work ran in part, under capture: its state cannot be trusted
                raise CaptureError(f"layer {layer.layer_idx}: {e}") from e
            return self._give_up(layer, sk, sv, sq, scale, e)
        ent = LayerGraph(g, sq, sk, sv, out, before.since(c))
        self._now[layer.layer_idx] = ent
        self.counts["captures"] += 1
        if cuda:  # a CUDA capture launches nothing (the stand-in ran the ops while recording them)
            self._replay(ent)
        return out

    def _give_up(self, layer: StepLayer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, scale: float,
                 err: Exception) -> torch.Tensor:  # fmt: skip
        """A capture that could not begin: no graph from now on (the later layers of this step and every later
        step run eagerly, as a step the plan keeps eager does); this layer's append + decode, eagerly."""
        self.reason = f"a capture failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        warnings.warn(f"kvdex: per-layer step graphs are off from here on, kvdex's decode step runs eagerly: "
                      f"{self.reason}", stacklevel=5)  # fmt: skip
        self.graphs.clear()
        self._now = {}
        self._captured.clear()
        self.mode = "eager"
        eng = layer.engine
        eng.append(k, v)
        return eng.decode(q[:, :, 0], scale).unsqueeze(1)
