"""ParisKV under CUDA-graph decoding: static sizing selects exactly what dynamic sizing
selects, and a replayable step honours the capture contract of tests/test_graph.py (no host read of a
device value, no host bookkeeping in device work, the same device work for every step of a graph key).

CPU tests run the PyTorch twins; the Triton kernels are checked against them in the interpreter suite
of tests/test_pariskv.py and, on a GPU (``gpu`` marker), graph == eager below.
"""

from __future__ import annotations

import pytest
import test_graph as G
import torch
from conftest import left_padded, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.bench import runner, shapes
from kvdex.hf.graph import graph_policies
from kvdex.policies.pariskv import ADAPTIVE_RATIOS, PAPER_OPTIONS, PAPER_SPEC, ParisKVPolicy

SPECS = [
    "pariskv",  # kvdex's default: group=heads, coarse=scores, pool_factor=8, candidate_ratio=0.2
    PAPER_SPEC,  # the paper's configuration
    "pariskv-kmeans",  # the paper's configuration, learned centroids
    "pariskv:center=True",
    PAPER_SPEC.replace("pool_factor=None", "pool_factor=3"),  # the paper's adaptive beta with a pool floor
    "pariskv:candidate_ratio=None:pool_factor=3",  # the default's votes, the adaptive beta
    "pariskv:coarse=tiers:candidate_ratio=0.3",
    "pariskv-kmeans:group=heads",
]
tiny = G.tiny


def test_pariskv_is_a_graph_policy():
    assert {"pariskv", "pariskv-kmeans"} <= set(graph_policies())


@pytest.mark.parametrize("budget", [80, 200], ids=["search", "all-then-search"])
@pytest.mark.parametrize("spec", SPECS)
def test_static_selection_equals_dynamic(tiny, spec, budget, monkeypatch):
    """60 decode steps (4 page boundaries) after a 150-token prompt, batch 2: the same attended positions
    per step, layer, sequence and kv head, and the same logits. Budget 200 (152 retrieved tokens) starts
    with the whole middle fitting the budget and crosses into the two-stage search mid-decode."""
    monkeypatch.setattr(G, "BUDGET", budget)
    ids = G._prompt(tiny)
    fed, ref, sel_dyn, _ = G._decode(tiny, spec, ids, 60, static=False)
    _, got, sel_sta, _ = G._decode(tiny, spec, ids, 60, static=True, feed=fed)
    assert len(sel_dyn) == len(sel_sta) == 60 * 2
    assert any(rows != "empty" and any(len(s) for r in rows for s in r) for _, rows in sel_dyn)
    for i, (a, b) in enumerate(zip(sel_dyn, sel_sta, strict=True)):
        assert a == b, f"step {i // 2} layer {a[0]}: static selection differs"
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["pariskv", PAPER_SPEC, "pariskv-kmeans"])
def test_static_selection_equals_dynamic_on_a_ragged_batch(spec):
    """Left-padded prompts of 200, 130 and 300 tokens: every sequence has its own middle length, pool
    size and vote quotas (device buffers under static sizing); 40 steps cross page boundaries."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([200, 130, 300], seed=10)
    logs = []
    for static in (False, True):
        cache = kvdex.Cache(model, spec, budget=96, dense_layers=1)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
        if static:
            for lay in cache.layers:
                lay.store.static = True
        log = G._SelectionLog(cache.policy)
        m, tok, logits = mask, out.logits[:, -1:].argmax(-1), []
        for _ in range(40):
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            pos = m.sum(-1, keepdim=True) - 1
            with torch.no_grad():
                o = model(input_ids=tok, attention_mask=m, position_ids=pos, **cache_kwargs(cache), use_cache=True)
            logits.append(o.logits[:, -1])
            tok = o.logits[:, -1:].argmax(-1)
        logs.append((log.log, torch.stack(logits)))
    (dyn, l_dyn), (sta, l_sta) = logs
    assert dyn == sta
    torch.testing.assert_close(l_sta, l_dyn, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_replayable_steps_issue_identical_device_work(tiny, spec):
    replayable, keys, problems = G._replay_contract(tiny, spec)
    assert not problems, problems[:5]
    assert replayable >= 30, f"only {replayable} of 60 steps replayable"
    assert keys <= 3, f"{keys} graph keys in 60 steps: a capture per page"


def test_whole_cache_side_of_a_replayable_step(tiny):
    replayable, keys, problems = G._replay_contract(tiny, "pariskv", whole=True)
    assert not problems, problems[:5]
    assert replayable >= 30 and keys <= 3


def test_contract_check_catches_dynamic_sizing(tiny):
    """Not vacuous: with dynamic sizing ParisKV bakes the middle length into the step (vote width, pool
    width), which differs between steps of one graph key."""
    _, _, problems = G._replay_contract(tiny, "pariskv", static=False)
    assert any("different device work" in p for p in problems), problems[:5]


def test_pool_width_bounds_every_pool_from_the_shortest_middle_to_the_capacity():
    paper = dict(PAPER_OPTIONS)  # the adaptive beta table: the pool width has a maximum inside [lo, cap]
    for opts in (paper, {**paper, "pool_factor": 3.0}, {**paper, "candidate_ratio": 0.3}, {}):
        pol = ParisKVPolicy(**opts)
        for k in (32, 2048):
            pools = pol.pool_sizes(torch.arange(40_961), k)  # brute force: the pool of every length
            for cap in (1, 50, 4096, 4999, 5000, 9999, 12_000, 31_000, 40_960):
                for lo in (0, 40, 4999, 5000, 29_999, 30_000, 32_000):
                    want = max(pools[min(lo, cap) : cap + 1])
                    assert pol.pool_width(cap, k, lo) == want, (opts, cap, lo, k)
    assert ADAPTIVE_RATIOS[-1][0] == float("inf")


GPU_SPECS = ["pariskv", PAPER_SPEC, "pariskv-kmeans", "pariskv:center=True"]


@pytest.mark.parametrize("storage", ["device", "offload"])
@pytest.mark.parametrize("spec", GPU_SPECS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_matches_eager_on_gpu(spec, storage):
    """The bench's check: 40 teacher-forced steps, graph vs eager logits within 1e-3 of max |logit|."""
    model = shapes.build_model("tiny", torch.float32, "cuda")
    cfg = runner.BenchConfig(shape="tiny", dtype="float32", device="cuda", budget=G.BUDGET, check_context=150,
                             dense_layers=1, storages=(storage,))  # fmt: skip
    res = runner.check_graph(model, cfg, [f"{spec}/{storage}+graph"], steps=40)
    assert res[0]["ok"], res
    c = res[0]["counts"]
    assert c["replays"] >= 20 and c["captures"] >= 1, c
