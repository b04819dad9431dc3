"""CUDA-graph decoding of a kvdex cache, without a model framework: the contract a decode step meets to be
captured, the decisions taken before each step, the capture path and the graphs' lifetime.

Eager decoding of a 32-layer model launches thousands of small kernels per token from Python;
the GPU waits on the CPU. A CUDA graph records one step's kernels once and replays them with one
launch. A kvdex step is replayable when nothing in it depends on values the CPU must look at:

* between page boundaries nothing joins the middle region, so ``policy.index`` (Python over
  data-dependent shapes) does not run and every shape is fixed. A step in which a new page starts
  (the oldest window page joins the middle, once every ``page_size`` tokens) is replayed from a
  second graph when the policy declares ``capturable_index`` (*page joins*, below), else it runs
  eagerly; a step in which a policy does data-dependent work in ``select`` (PRKV's restructuring
  every ``refresh`` steps, SnapKV's first step and refreshes, H2O's prefill scores) runs eagerly;
* stores and policies are switched to *static sizing* (``LayerStore.static``, switched on by
  ``use_static_sizing``): the dense layers
  read the whole slot buffer (rows past each length are masked by the kernel using the device
  lengths), Quest / ArkVale / PRKV score their whole index capacity (pages past the middle masked),
  H2O its whole score buffer, and every selection has a width fixed by the budget (``-1`` padding)
  instead of the largest count of this step. No host-side length is baked into the captured step;
* positions are fed from a device buffer (``position_ids``, per row: left padding is honoured);
* offloaded stores are replayable only with the UVA gather (page ids never leave the device).

**The store contract.** The step plan asks each store (``LayerStore``) instead of testing its class:
``graph_unsupported()`` (why it cannot be captured: no graph support, or an offloaded store without
the UVA gather), ``graph_buffers()`` (the buffers a captured step reads by address: part of the graph
key) and ``grows_on_append(1)`` (a device buffer re-allocates: that step runs eagerly).

**The policy protocol.** A ``capturable`` policy overrides (``Policy`` declares the defaults):

* ``graph_unsupported(stores) -> str | None``: why its decode step cannot be captured with these
  stores (e.g. ``oracle`` with ``offload=True``: it copies the whole middle through host memory);
* ``graph_key(stores) -> tuple | None`` before each step (default ``()``): ``None`` when this step
  must run eagerly, else the identity and shape of every tensor its ``select`` / ``observe`` read plus
  every host value they bake into the step. A changed key captures again (after one eager step, so every
  kernel is loaded before capturing);
* ``graph_replayed()`` after each replay: the Python-side effects of ``select`` / ``observe`` that
  the replay skipped (step counters, lookup counts). Device-side effects (H2O's score accumulation,
  ArkVale's cache bookkeeping) are inside the graph, written in place into persistent buffers.

**Page joins** (``Policy.capturable_index``: quest, pariskv, chess, arkvale, prkv, icecache with
``search="summary"``; full, oracle, streaming, snapkv and h2o, which have nothing to index at a join).
In a decode step at most one page per sequence joins the middle, and the host knows which from its
lengths. The step is
then made of fixed-shape device work over device-side indices: ``LayerStore.append_join`` appends the
token and returns a :class:`~kvdex.storage.PageJoin` (device ``joins`` mask and page ``start`` from the
device lengths, the page's keys gathered there; an offloaded store first writes the page leaving its
window ring to pinned host memory with one UVA kernel), and ``Policy.index_join`` writes the page's
index entries in place under the mask. Everything data-dependent stays on the host, outside the
graph: before every step (eager, captured or replayed) the step plan grows the stores and the policy's
index ``JOIN_HEADROOM_PAGES`` ahead (``reserve_join`` / ``reserve_index``; a re-allocation is a new
graph key, so it happens once every so many pages) and runs the policy's host side of the join
(``Policy.joined``: CPU counters, CHESS's host-held selection); after a replay the stores' host
side (``advance_host``, ``count_join``: lengths, the bytes written out). The cache takes this path
under static sizing for every single-token step that ``Cache.join_step`` marks (without a step plan:
every step in which a page joins). A step plan keys its graphs by (the policy's key, join step): two
graphs per key. The join graph is right on a step in which nothing joins (an empty mask), so it is
warmed up and captured on the first steps after the plain one and never at a boundary: steady
decoding runs no eager step.
``joined`` + ``index_join`` leave the index exactly as ``index`` would (tests/test_graph_joins.py).

A policy that is not ``capturable`` (``icecache`` with a tree search: it runs on CPU threads) is
decoded eagerly, with a warning that says so once (``kvdex.hf.graph.graph_policies()`` lists the capturable
ones).

**CPU bookkeeping after a replay** (what the eager step's Python would have done): the step counter,
every layer's sequence length and host lengths (``advance_host``; ``count_join`` in a join step), the
transfer counters (the captured step's counts), the attended-token count
(``Cache.stats()["attended_tokens_per_step"]``: accumulated on the device inside the graph, its call
count here), the policy's :meth:`graph_replayed`, then ``policy.on_step``
with the replayed logits (CHESS's trigger and rebuild, PRKV's refresh clock run outside the graph).
A capture runs the step's Python once (its CPU-side effects are those of the captured step; the
``on_step`` hook is held back and called after the first replay, when the logits exist).

**The modules.** Three users replay decode steps, all through one :class:`~kvdex.engine.graphs.plan.StepPlan`
(the decisions above: page joins, the graph key, eager warm-up steps) and one capture path
(:func:`~kvdex.engine.graphs.capture.capture_step`): :class:`~kvdex.hf.graph.GraphDecoder` (whole model steps,
``kvdex.generate``), the compile backend's ``WholeStep`` (whole compiled steps of a plain ``model.generate``,
:mod:`kvdex.hf.step_backend`) and :class:`~kvdex.engine.graphs.layer_graphs.StepGraphs` (one graph per layer
where neither captures the step). :class:`~kvdex.engine.graphs.service.GraphService` replays work inside a
policy's selection (``view.graphs``).

* :mod:`~kvdex.engine.graphs.capture`: :func:`capture_step`; :func:`gc_paused`, :func:`free_with`,
  :func:`free_deferred` (no CUDA graph destroyed inside a capture); :func:`as_current`;
* :mod:`~kvdex.engine.graphs.plan`: :class:`StepPlan`, :class:`HostCounts`, :func:`capture_unsupported`,
  :func:`replay_unsupported`, :data:`JOIN_HEADROOM_PAGES`;
* :mod:`~kvdex.engine.graphs.layer_graphs`: :class:`StepGraphs`;
* :mod:`~kvdex.engine.graphs.service`: :class:`GraphService`.
"""

from kvdex.engine.graphs.capture import as_current, capture_step, free_deferred, free_with, gc_paused
from kvdex.engine.graphs.layer_graphs import StepGraphs
from kvdex.engine.graphs.plan import (
    JOIN_HEADROOM_PAGES,
    HostCounts,
    StepDecision,
    StepHost,
    StepPlan,
    capture_unsupported,
    replay_unsupported,
)
from kvdex.engine.graphs.service import GraphService

__all__ = [
    "JOIN_HEADROOM_PAGES",
    "GraphService",
    "HostCounts",
    "StepDecision",
    "StepGraphs",
    "StepHost",
    "StepPlan",
    "as_current",
    "capture_step",
    "capture_unsupported",
    "free_deferred",
    "free_with",
    "gc_paused",
    "replay_unsupported",
]
