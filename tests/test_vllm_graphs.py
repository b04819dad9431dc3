"""The vLLM setting ``decode_graphs``: each request's decode step replays one graph per layer (kvdex's per-layer
step graphs, :mod:`kvdex.engine.graphs.layer_graphs`, over the request's :class:`~kvdex.vllm.store.PagedStore`
under static sizing). On the CPU the graphs are the tests' stand-in (``tests/step_graph_stand_in.py``), which
fails on a device value read on the host inside a capture and replays the recorded operations on the same
tensors, as a CUDA graph would. The simulated engine's scenario (joins, chunked prefill, reordered rows, page
joins, a preemption with recompute, freed blocks reused) must give the outputs it gives without graphs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from step_graph_stand_in import StepGraphStandIn, failing_captures
from vllm_sim import ATOL, run_scenario

import kvdex.engine.graphs.capture as graphs_mod
from kvdex.vllm import SUPPORTED, settings_from

SMALL = dict(budget=96, page_size=16, sink=16, window=32, dense_layers=1)
VARIANTS = {"prkv": "prkv:static_ratio=0.5:refresh=8", "chess": "chess:interval=8"}
SPECS = [VARIANTS.get(p, p) for p in SUPPORTED] + ["quest:select_every=4", "prkv"]
SPECS += ["chess:trigger=interval:interval=8:refine=digest", "chess:trigger=interval:interval=8:refine=exact"]


@pytest.mark.parametrize("policy", SPECS)
def test_decode_graphs_give_the_eager_outputs(policy, monkeypatch):
    eager, _ = run_scenario(settings_from({"kvdex": {"policy": policy, **SMALL}}))
    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    graphed, _ = run_scenario(settings_from({"kvdex": {"policy": policy, **SMALL, "decode_graphs": True}}))
    assert graphed.out.keys() == eager.out.keys()
    for key, o in eager.out.items():
        assert torch.allclose(graphed.out[key], o, atol=ATOL, rtol=1e-4), (policy, key)
    states = set(graphed.state_of.values())
    counts = {k: sum(s.step_graphs.counts[k] for s in states) for k in ("eager", "captures", "replays")}
    assert all(s.step_graphs.reason is None for s in states if s.step_graphs.counts["replays"]), policy
    assert counts["replays"] > counts["eager"], (policy, counts)  # most decode steps replay


@pytest.mark.parametrize("policy", ["full", "quest"])
def test_decode_graphs_with_the_dense_decode_on_the_blocks(policy, monkeypatch):
    """The dense layers' decode over the blocks in place (a request state's ``decode``; here its PyTorch form,
    paged.decode_attention_reference) inside the step graphs: captured with no host read, the eager outputs."""
    from kvdex.vllm.paged import decode_attention_reference

    st = {"policy": policy, **SMALL}
    eager, _ = run_scenario(settings_from({"kvdex": st}), decode=decode_attention_reference)
    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    graphed, _ = run_scenario(
        settings_from({"kvdex": {**st, "decode_graphs": True}}), decode=decode_attention_reference
    )
    for key, o in eager.out.items():
        assert torch.allclose(graphed.out[key], o, atol=ATOL, rtol=1e-4), (policy, key)
    states = set(graphed.state_of.values())
    assert sum(s.step_graphs.counts["replays"] for s in states) > sum(s.step_graphs.counts["eager"] for s in states)


def test_a_request_that_decodes_once_holds_no_graphs(monkeypatch):
    """vLLM's start-up warm-up prefills as many short requests as one step takes and decodes each once. Under
    ``decode_graphs`` such a request runs its one decode step eagerly and sets nothing up for graphs (no plan, its
    stores not under static sizing, no capture); a request that goes on decoding replays from its third step."""
    from vllm_sim import Req, Sim

    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    sim = Sim(settings_from({"kvdex": {"policy": "quest", **SMALL, "decode_graphs": True}}))
    short = [Req(f"w{i}", 8, 10 + i) for i in range(12)]
    sim.step([(r, 2) for r in short])  # the warm-up's prompts
    sim.step([(r, 1) for r in short])  # and its one decode step each
    states = [sim.state_of[(r.name, 0)] for r in short]
    assert all(s.adopted and s.step == 1 for s in states)
    for s in states:
        assert s.step_graphs.plan is None and s.step_graphs.counts == {"eager": 0, "captures": 0, "replays": 0}
        assert not any(st.static for st in s.stores)
    long = Req("long", 140, 99)
    sim.step([(long, 100)])
    for _ in range(6):
        sim.step([(long, 1)])
    counts = sim.state_of[("long", 0)].step_graphs.counts
    assert counts["replays"] > 0 and counts["eager"] < 5, counts  # steps 2-6 under the plan: most replay


def test_a_capture_that_cannot_begin_leaves_the_request_eager(monkeypatch):
    """Under vLLM a refused capture must not stop the server: the request's decode goes on eagerly, the same
    outputs, its other requests' graphs untouched."""
    policy = "prkv:static_ratio=0.5:refresh=8"
    eager, _ = run_scenario(settings_from({"kvdex": {"policy": policy, **SMALL}}))
    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    failing_captures(monkeypatch, 4)
    with pytest.warns(UserWarning, match="capture failed"):
        graphed, _ = run_scenario(settings_from({"kvdex": {"policy": policy, **SMALL, "decode_graphs": True}}))
    for key, o in eager.out.items():
        assert torch.allclose(graphed.out[key], o, atol=ATOL, rtol=1e-4), key
    reasons = [s.step_graphs.reason for s in set(graphed.state_of.values())]
    assert any(r is not None and "capture failed" in r for r in reasons)


def test_a_refresh_keeps_the_request_graphs(monkeypatch):
    """PRKV's refresh (every 8 steps here) rewrites the paged store's relocation map in place: the request's graphs
    stay valid, so a refresh step costs at most its own variant's warm-up, not a warm-up and capture of every
    variant (which a replaced map forced: 17 eager steps in this scenario, against its 8 refreshes)."""
    from vllm_sim import Req, Sim

    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    sim = Sim(settings_from({"kvdex": {"policy": VARIANTS["prkv"], **SMALL, "decode_graphs": True}}))
    a = Req("a", 400, 1)
    sim.step([(a, 120)])
    maps = set()
    for _ in range(70):
        sim.step([(a, 1)])
        store = sim.state_of[("a", 0)].engines[1].store
        if store is not None and store.order is not None:
            maps.add(id(store.order))
    st = sim.state_of[("a", 0)]
    refreshes = st.policy.schedule.refreshes[1]
    assert len(refreshes) == 8 and len(maps) == 1, (refreshes, maps)
    assert st.step_graphs.counts["eager"] <= len(refreshes), st.step_graphs.counts


def test_the_first_select_under_the_graphs_keeps_the_request_graphs(monkeypatch):
    """``prkv`` at its defaults (``select_every=16``): the static region a select reads under static sizing and the
    held selection have their static widths before the first capture, so the request's first select under the
    graphs (its first page join) changes no graph key. Each variant of its step -- the reuse step, the select step
    with its page join -- runs eagerly once and is captured once; a select that re-sized them (the region built at
    that select, the held selection's token tail appearing) warmed up and captured the reuse step again and the
    join step once more (4 eager steps and 3 captures per layer in this scenario)."""
    from vllm_sim import NUM_BLOCKS, Req, Sim

    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    sim = Sim(
        settings_from({"kvdex": {"policy": "prkv", **SMALL, "budget": 160, "decode_graphs": True}}),
        table_width=NUM_BLOCKS,
    )  # a static part of 16 tokens (a quarter of the retrieval budget)
    a = Req("a", 400, 1)  # (a block table of vLLM's full width: no row buffer grows)
    sim.step([(a, 200)])
    for _ in range(60):  # page joins at decode steps 8, 24, 40, 56 (200 + 8 = 13 pages of 16)
        sim.step([(a, 1)])
    st = sim.state_of[("a", 0)]
    layers = len(st.layers)
    counts = st.step_graphs.counts
    assert counts["eager"] == 2 and counts["captures"] == 2 * layers, (counts, layers)


def test_a_block_row_growing_a_block_at_a_time_keeps_its_buffer():
    """A block table cut to the batch's longest row grows a block every page: the persistent buffer the captured
    steps read (and key on) is re-allocated by a quarter at a time, not at every page; its front is the row."""
    from kvdex.vllm.store import BlockRow

    row = BlockRow(torch.zeros(0, dtype=torch.long), persistent=True)
    buffers = []
    for width in range(8, 60):
        table = torch.arange(100, 100 + width)
        row.assign(table, width - 1)
        assert torch.equal(row.buffer[:width], table) and torch.equal(row.blocks, table[: width - 1])
        buffers.append(id(row.buffer))
    assert len(set(buffers)) <= 10 and row.buffer.shape[0] >= 59  # 52 widths
    row.assign(torch.arange(5), 5)  # a narrower table: copied into the same buffer
    assert id(row.buffer) == buffers[-1] and torch.equal(row.buffer[:5], torch.arange(5))


def test_decode_graphs_setting():
    assert settings_from({"kvdex": {"decode_graphs": True}}).decode_graphs
    assert not settings_from({"kvdex": {}}).decode_graphs
    with pytest.raises(ValueError, match="decode_graphs must be true or false"):
        settings_from({"kvdex": {"decode_graphs": "yes"}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_graphs_on_cuda():
    """This file's scenarios on a GPU (``KVDEX_SIM_DEVICE=cuda``), where every capture is a real CUDA graph in the
    request's memory pool: page joins, index growth and refreshes drop a request's graphs and capture anew many
    times (the pool then changes, see ``StepGraphs.begin``), with kvdex's Triton kernels on both paths."""
    env = {**os.environ, "KVDEX_SIM_DEVICE": "cuda"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
