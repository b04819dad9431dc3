"""ParisKV under CUDA-graph decoding: static sizing selects exactly what dynamic sizing
selects, and a replayable step honours the capture contract of tests/test_graph.py (no host read of a
device value, no host bookkeeping in device work, the same device work for every step of a graph key).

CPU tests run the PyTorch twins; the Triton kernels are checked against them in the interpreter suite
of tests/test_pariskv.py and, on a GPU (``gpu`` marker), graph == eager below.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import test_graph as G
import torch
from conftest import left_padded, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.bench import runner, shapes
from kvdex.hf.graph import graph_policies
from kvdex.kernels import pariskv as PK
from kvdex.policies.pariskv import ADAPTIVE_RATIOS, PAPER_OPTIONS, PAPER_SPEC, ParisKVPolicy
from kvdex.view import LayerView

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


class _DynamicView(LayerView):
    """A view whose policy sizes dynamically whatever its store does (the lockstep check below)."""

    @property
    def static(self) -> bool:
        return False


def _sets(sel, view):
    """The attended middle positions of every (sequence, kv head) as sets, or "everything" / "empty"."""
    if sel.everything or sel.empty:
        return "everything" if sel.everything else "empty"
    pos = sel.token_positions(view.sink, view.page_size)
    return [[frozenset(p[p >= 0].tolist()) for p in ph] for ph in pos]


class _StaticVsDynamic:
    """Static sizing selects exactly what dynamic sizing selects, checked two ways while a dynamic run and then
    a static run (teacher-forced with the same tokens) decode:

    * lockstep: every static select call is repeated with dynamic sizing on the same query and index; both
      must attend the same positions, up to a tie that the two paths' sums (over other widths: the CPU's BLAS
      may pick other kernels) round apart, accepted as below;
    * across the runs: each call attends what the dynamic run's call attended. The runs' queries are not bit
      identical (static sizing attends a fixed-width buffer, so the attention sums run in another order: logits
      agree to ~1e-7), so a token whose fine-stage score ties the k-th score may swap places with another. A
      differing row is accepted only as such a tie: the swapped tokens' scores in both runs within ``tol`` of
      that run's k-th score, where ``tol`` is twice the largest difference between the two runs' scores of the
      row's common candidates (itself asserted to be float noise). The static run then attends the dynamic
      run's tokens, so the runs stay comparable (the logits) for the remaining steps.

    The fine stage's candidates and scores are read from ``kernels.pariskv.rerank_scores`` /
    ``rerank_combined`` (the twins every CPU run uses)."""

    def __init__(self, monkeypatch):
        self.dyn, self.calls, self.ties, self.last = [], 0, 0, None
        for name in ("rerank_scores", "rerank_combined"):
            monkeypatch.setattr(PK, name, self._recorded(getattr(PK, name)))

    def _recorded(self, fn):
        def rerank(cand, *args):
            est = fn(cand, *args)
            if est.dim() == 2:  # one score per candidate (rerank_combined's per-head call gives [R, G, C])
                self.last = (cand.clone(), est.clone())
            return est

        return rerank

    def _select(self, policy, q, view):
        self.last = None
        sel = type(policy).select(policy, q, view)
        return sel, _sets(sel, view), self.last

    def record(self, policy):
        """The dynamic run: remember every call's selection and fine-stage scores."""

        def select(q, view):
            sel, sets, scores = self._select(policy, q, view)
            self.dyn.append((view.layer, sets, scores))
            return sel

        policy.select = select

    def check(self, policy):
        """The static run: check every call against dynamic sizing on its own inputs and against the dynamic run."""

        def select(q, view):
            i = self.calls
            self.calls += 1
            layer, want, dyn_scores = self.dyn[i]
            _, same_inputs, same_scores = self._select(
                policy, q, _DynamicView(**{f.name: getattr(view, f.name) for f in fields(view)})
            )
            sel, have, scores = self._select(policy, q, view)
            where = f"step {i // 2} layer {layer}"
            assert layer == view.layer, where
            if have != same_inputs:  # the paths sum over other widths: a CPU's BLAS may round a tie apart
                msg = f"{where}: static selection differs from dynamic on the same inputs"
                assert isinstance(have, list) and isinstance(same_inputs, list), msg
                self._adopt_ties(sel, view, same_inputs, have, same_scores, scores, f"{where} (same inputs)")
                have = _sets(sel, view)
            if have != want:
                assert isinstance(have, list) and isinstance(want, list), f"{where}: static selection differs"
                self._adopt_ties(sel, view, want, have, dyn_scores, scores, where)
            return sel

        policy.select = select

    def _adopt_ties(self, sel, view, want, have, dyn_scores, sta_scores, where):
        assert dyn_scores is not None and sta_scores is not None, f"{where}: static selection differs"
        h = view.kv_heads
        for b, (rows_w, rows_h) in enumerate(zip(want, have, strict=True)):
            for hh, (a, s) in enumerate(zip(rows_w, rows_h, strict=True)):
                if a == s:
                    continue
                r, sink = b * h + hh, view.sink
                d_est, s_est = ({int(c) + sink: float(e) for c, e in zip(*(x[r] for x in sc), strict=True) if c >= 0}
                                for sc in (dyn_scores, sta_scores))  # fmt: skip
                common = d_est.keys() & s_est.keys()
                scale = max(abs(v) for v in (*d_est.values(), *s_est.values()) if math.isfinite(v))
                dev = max(abs(d_est[c] - s_est[c]) for c in common)
                assert dev <= 1e-5 * scale, f"{where} row {r}: the runs' scores differ by {dev} (scale {scale})"
                tol = 2 * dev
                lost, won = sorted(a - s), sorted(s - a)  # what the static run dropped / took instead
                msg = f"{where} row {r}: static selection differs beyond a tie (dynamic only {lost}, static only {won})"
                assert len(lost) == len(won), msg
                for est, chosen, dropped in ((d_est, a, won), (s_est, s, lost)):
                    kth = min(est[x] for x in chosen)
                    assert all(x in est and abs(est[x] - kth) <= tol for x in dropped), (msg, est, kth, tol)
                    assert all(abs(est[x] - kth) <= tol for x in chosen - (a & s)), (msg, est, kth, tol)
                row = sel.tokens[b, hh]
                for x, y in zip(won, lost, strict=True):  # attend what the dynamic run attended
                    row[row == x] = y
                self.ties += 1


def _decode_static_vs_dynamic(model, spec, ids, steps, monkeypatch):
    """Decode ``steps`` steps with dynamic sizing, then teacher-forced with static sizing, checking every select
    call (:class:`_StaticVsDynamic`). Returns the logits of both runs and the checker."""
    pair, fed, logits = _StaticVsDynamic(monkeypatch), [], []
    for static in (False, True):
        cache = G._cache(model, spec)
        nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
        if static:
            for lay in cache.layers:
                lay.store.static = True
        (pair.check if static else pair.record)(cache.policy)
        out = []
        for i in range(steps):
            tok = fed[i] if static else nxt
            if not static:
                fed.append(tok)
            nxt, lg = runner._step(model, cache, tok)
            out.append(lg)
        logits.append(out)
    assert pair.calls == len(pair.dyn)
    return logits, pair


@pytest.mark.parametrize("budget", [80, 200], ids=["search", "all-then-search"])
@pytest.mark.parametrize("spec", SPECS)
def test_static_selection_equals_dynamic(tiny, spec, budget, monkeypatch):
    """60 decode steps (4 page boundaries) after a 150-token prompt, batch 2: the same attended positions
    per step, layer, sequence and kv head (exactly on the same inputs; across the two runs up to swaps of
    tokens whose scores tie, see :class:`_StaticVsDynamic`), and the same logits. Budget 200 (152 retrieved
    tokens) starts with the whole middle fitting the budget and crosses into the two-stage search mid-decode."""
    monkeypatch.setattr(G, "BUDGET", budget)
    (ref, got), pair = _decode_static_vs_dynamic(tiny, spec, G._prompt(tiny), 60, monkeypatch)
    assert len(pair.dyn) == 60 * 2
    assert any(rows != "empty" and any(len(s) for r in rows for s in r) for _, rows, _ in pair.dyn)
    assert pair.ties <= 4, f"{pair.ties} tied rows: not float noise"
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["pariskv", PAPER_SPEC, "pariskv-kmeans"])
def test_static_selection_equals_dynamic_on_a_ragged_batch(spec, monkeypatch):
    """Left-padded prompts of 200, 130 and 300 tokens: every sequence has its own middle length, pool
    size and vote quotas (device buffers under static sizing); 40 steps cross page boundaries. Selections
    checked as in :class:`_StaticVsDynamic` (the static run teacher-forced with the dynamic run's tokens)."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([200, 130, 300], seed=10)
    pair, fed, logs = _StaticVsDynamic(monkeypatch), [], []
    for static in (False, True):
        cache = kvdex.Cache(model, spec, budget=96, dense_layers=1)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
        if static:
            for lay in cache.layers:
                lay.store.static = True
        (pair.check if static else pair.record)(cache.policy)
        m, tok, logits = mask, out.logits[:, -1:].argmax(-1), []
        for i in range(40):
            tok = fed[i] if static else tok
            if not static:
                fed.append(tok)
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            pos = m.sum(-1, keepdim=True) - 1
            with torch.no_grad():
                o = model(input_ids=tok, attention_mask=m, position_ids=pos, **cache_kwargs(cache), use_cache=True)
            logits.append(o.logits[:, -1])
            tok = o.logits[:, -1:].argmax(-1)
        logs.append(torch.stack(logits))
    assert pair.calls == len(pair.dyn) and pair.ties <= 4, (pair.calls, len(pair.dyn), pair.ties)
    torch.testing.assert_close(logs[1], logs[0], atol=1e-5, rtol=1e-5)


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
            pools = pol.sizes.pool_sizes(torch.arange(40_961), k)  # brute force: the pool of every length
            for cap in (1, 50, 4096, 4999, 5000, 9999, 12_000, 31_000, 40_960):
                for lo in (0, 40, 4999, 5000, 29_999, 30_000, 32_000):
                    want = max(pools[min(lo, cap) : cap + 1])
                    assert pol.sizes.pool_width(cap, k, lo) == want, (opts, cap, lo, k)
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
