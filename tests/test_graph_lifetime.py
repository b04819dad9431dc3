"""When kvdex's CUDA graphs may be destroyed, and that no collection runs inside a kvdex capture.

Destroying a CUDA graph (``cudaGraphExecDestroy``) while any capture is underway only warns, but it
invalidates that capture: its next launch fails ("operation failed due to a previous error during
capture"). Python's cyclic collector picks an arbitrary allocation to run at, so kvdex (1) pauses it during
its own captures (``kvdex.engine.graphs.capture.gc_paused``), (2) keeps no reference cycle through a cache (a
dropped cache and its graphs go at once, by reference counting) and (3) holds back the graphs of an owner
collected during someone else's capture (inductor's, between kvdex's ops) until the next decode step.
On the CPU: the graph stand-ins, and the capture state patched where CUDA would report it.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from step_graph_stand_in import StepGraphStandIn

import kvdex
from kvdex.engine.graphs import GraphService
from kvdex.engine.graphs import capture as graphs_mod
from kvdex.hf.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=3)


@pytest.fixture
def collector_off():
    """Only reference counting frees objects here (the collector as if it had not come round yet)."""
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


class _RecordingStandIn(StepGraphStandIn):
    """The stand-in, noting whether the collector was enabled when each capture began."""

    gc_at_capture: list = []

    def capture_begin(self, *a, **kw):
        _RecordingStandIn.gc_at_capture.append(gc.isenabled())
        return super().capture_begin(*a, **kw)


def _generate(model, monkeypatch, stand_in=StepGraphStandIn, new=24):
    monkeypatch.setattr(graphs_mod, "STAND_IN", stand_in)
    cache = kvdex.Cache(model, "quest", budget=64, dense_layers=1)
    ids = torch.randint(0, 250, (1, 200), generator=torch.Generator().manual_seed(0))
    model.generate(
        ids, attention_mask=torch.ones_like(ids), **kvdex.cache_kwargs(cache), max_new_tokens=new,
        min_new_tokens=new, do_sample=False, disable_compile=True,
    )  # fmt: skip
    assert cache.step_graphs.counts["captures"] > 0 and cache.step_graphs.counts["replays"] > 0
    return cache


def test_a_dropped_cache_and_its_step_graphs_go_by_reference_counting(model, monkeypatch, collector_off):
    cache = _generate(model, monkeypatch)
    refs = [weakref.ref(cache), weakref.ref(cache.step_graphs), weakref.ref(cache.step_graphs.plan)]
    del cache
    assert [r() for r in refs] == [None, None, None], "a reference cycle: only the cyclic collector frees the cache"


def test_kvdex_captures_run_with_the_collector_paused(model, monkeypatch):
    _RecordingStandIn.gc_at_capture = []
    assert gc.isenabled()
    _generate(model, monkeypatch, _RecordingStandIn)
    assert _RecordingStandIn.gc_at_capture and not any(_RecordingStandIn.gc_at_capture)
    assert gc.isenabled()  # restored
    # the policy-side graph service too (IceCache's search graphs)
    _RecordingStandIn.gc_at_capture = []
    svc = GraphService()
    q = torch.randn(1, 2, 4)
    (out,) = svc.run("layer 1", "sig", lambda x: (x * 2,), q)
    assert torch.equal(out, q * 2) and _RecordingStandIn.gc_at_capture == [False] and gc.isenabled()


def test_gc_paused_keeps_a_disabled_collector_disabled(collector_off):
    with graphs_mod.gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


class _Graph:
    """Stands for a CUDA graph: whether it is still alive is what matters."""


def test_graphs_of_an_owner_collected_during_a_capture_wait_for_the_next_step(monkeypatch):
    capturing = [True]
    monkeypatch.setattr(graphs_mod, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(graphs_mod, "_DEFERRED", [])
    svc = GraphService()
    g = _Graph()
    svc.graphs["k"] = (None, g)
    svc.cycle = svc  # freed only by the collector, which here runs "inside a capture"
    ref = weakref.ref(g)
    del svc, g
    gc.collect()
    assert ref() is not None, "a graph destroyed inside a capture invalidates it"
    graphs_mod.free_deferred()  # still capturing: nothing is freed
    assert ref() is not None
    capturing[0] = False
    graphs_mod.free_deferred()
    assert ref() is None
    # outside a capture an owner's graphs go with it
    svc = GraphService()
    svc.graphs["k"] = (None, _Graph())
    ref = weakref.ref(svc.graphs["k"][1])
    del svc
    assert ref() is None and graphs_mod._DEFERRED == []
