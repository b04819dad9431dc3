"""The page policies' token rerank (``rerank=N``, kvdex/policies/rerank.py): quest, arkvale, prkv, chess.

On the tiny random GQA model (fp32, CPU), every selection a policy returns while decoding is checked
against a reference computed here in float64 from the store's keys:

* with every middle page a candidate (``rerank`` x the budget's pages >= the middle), the selected
  tokens are the exact top-k of the middle by the group's max ``q.k`` (``rerank_group="max"``) or by
  the group's summed softmax weights over the whole context (``"weight"``, the oracle's criterion);
* at a budget that selects, a selection never holds a token twice, never more than the retrieval
  budget, only middle tokens; PRKV keeps its static tokens;
* ``rerank=1`` attends exactly the tokens of the pages ``rerank=0`` attends;
* bad values raise ``ValueError`` naming the fix.

Full budget == dense, offload == device, fork independence (tests/test_contract.py) and captured ==
eager (tests/test_graph.py) cover the rerank specs with the other policies.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SINK, greedy, left_padded, shared_pair

import kvdex
from kvdex.policies import make_policy

FAMILY = "llama_gqa"
BUDGET = 80  # sink 16 + window 32 + 32 retrieved tokens (2 pages of 16)
T = BUDGET - SINK - 32
LENGTHS = [150, 97]
NEW = 16


class Log:
    """Wraps ``policy.select``: keeps (q, view, selection) of every call; ``check`` runs on each."""

    def __init__(self, policy, check=None):
        self.calls, self._select, self.check = [], policy.select, check
        policy.select = self._wrapped

    def _wrapped(self, q, view):
        sel = self._select(q, view)
        if self.check is not None:
            self.check(q, view, sel)
        self.calls.append(sel.token_positions(view.sink, view.page_size))
        return sel


def _run(spec: str, check=None, budget: int = BUDGET, device: str = "cpu"):
    model, _ = shared_pair(FAMILY)
    ids, mask, _ = left_padded(LENGTHS, seed=11)
    model = model.to(device)
    try:
        # eager steps: the check reads the selection on the host, which a captured step graph cannot
        cache = kvdex.Cache(model, spec, budget, dense_layers=1, step_graphs=False)
        log = Log(cache.policy, check)
        greedy(model, ids.to(device), mask.to(device), cache, new=NEW)
    finally:
        model.cpu()
    return log.calls


def _truth(q, view, group: str) -> list[list[torch.Tensor]]:
    """Per (sequence, kv head): float64 scores of the middle tokens (index j: position sink + j)."""
    k, _ = view.store.dense()
    b, hq, d = q.shape
    h = view.kv_heads
    out = []
    for i in range(b):
        n, ws = int(view.lengths_host[i]), int(view.grid.window_start(view.lengths_host)[i])
        row = []
        for j in range(h):
            s = q[i, j * (hq // h) : (j + 1) * (hq // h)].double() @ k[i, j, :n].double().T  # [G, n]
            if group == "max":
                score = s.amax(0)
            else:
                score = torch.softmax(s * view.scale, dim=-1).sum(0)
            row.append(score[SINK:ws].cpu())
        out.append(row)
    return out


def _is_topk(selected: list[int], mid: torch.Tensor, k: int, where: str) -> None:
    """``selected`` (positions) are k of the middle's best by ``mid`` (up to fp32 rounding at the k-th)."""
    assert len(selected) == len(set(selected)), f"{where}: a token twice"
    k = min(k, mid.numel())
    assert len(selected) == k, f"{where}: {len(selected)} tokens, expected {k}"
    if k == 0 or k == mid.numel():
        return
    idx = torch.tensor(selected) - SINK
    assert bool((idx >= 0).all()) and bool((idx < mid.numel()).all()), f"{where}: a token outside the middle"
    chosen = torch.zeros_like(mid, dtype=torch.bool)
    chosen[idx] = True
    worst, best_left = mid[chosen].min(), mid[~chosen].max()
    assert worst >= best_left - 1e-5 * best_left.abs().clamp(min=1e-3), f"{where}: not the top {k}"


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ALL_CANDIDATES = ["quest:rerank=8", "arkvale:rerank=8", "prkv:static_ratio=0:rerank=8", "chess:rerank=8",
                  "chess:anchor_from=window:scope=shared:rerank=8",
                  "quest:rerank=1:rerank_share=1.0", "prkv:static_ratio=0:rerank=1:rerank_share=1.0",
                  "arkvale:rerank=1:rerank_share=1.0",
                  "icecache:search=summary:build=device:rerank=1:rerank_unit=token:rerank_share=1.0"]  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("group", ["max", "weight"])
@pytest.mark.parametrize("spec", ALL_CANDIDATES)
def test_every_page_a_candidate_selects_the_exact_topk(spec, group, device):
    """On the GPU the candidates' scores come from kvdex.kernels.rerank_triton (``"weight"``: its logits,
    tile statistics and weights kernels), the top-k from kvdex.kernels.topk: the same exact top-k."""
    seen = []

    def check(q, view, sel):
        pos = sel.token_positions(view.sink, view.page_size)
        truth = _truth(q, view, group)
        for i, row in enumerate(truth):
            assert view.grid.num_middle_pages(view.lengths_host)[i] <= 16  # 8 x 2 candidate pages: all of them
            for j, mid in enumerate(row):
                p = pos[i, j]
                _is_topk(sorted(p[p >= 0].tolist()), mid, T, f"{spec} layer {view.layer} seq {i} head {j}")
                seen.append(mid.numel() > T)

    _run(f"{spec}:rerank_group={group}", check, device=device)
    assert sum(seen) > len(seen) // 2  # most checks were real selections (middle > budget)


PAGE_UNIT = ["quest:rerank=8:rerank_unit=page", "arkvale:rerank=8:rerank_unit=page",
             "prkv:static_ratio=0:rerank=1:rerank_share=1.0:rerank_unit=page"]  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("group", ["max", "weight"])
@pytest.mark.parametrize("spec", PAGE_UNIT)
def test_page_unit_with_every_page_a_candidate_selects_the_best_pages(spec, group, device):
    """``rerank_unit="page"``: the budget's pages with the best exact page score -- the group's largest
    ``q.k`` over the page's tokens, or the softmax weight the page's tokens hold (the page's mass)."""
    seen = []

    def check(q, view, sel):
        assert sel.tokens is None and sel.pages is not None  # a page selection
        truth = _truth(q, view, group)
        ps = view.page_size
        for i, row in enumerate(truth):
            for j, mid in enumerate(row):
                n = mid.numel() // ps * ps  # whole middle pages
                per = mid[:n].view(-1, ps)
                score = per.amax(-1) if group == "max" else per.sum(-1)
                got = sel.pages[i, j][sel.pages[i, j] >= 0].tolist()
                k = min(T // ps, score.numel())
                where = f"{spec} layer {view.layer} seq {i} head {j}"
                assert len(got) == len(set(got)) == k, f"{where}: {got}"
                if k < score.numel():
                    chosen = torch.zeros_like(score, dtype=torch.bool)
                    chosen[got] = True
                    worst, best_left = score[chosen].min(), score[~chosen].max()
                    assert worst >= best_left - 1e-5 * best_left.abs().clamp(min=1e-3), f"{where}: not the best pages"
                    seen.append(True)

    _run(f"{spec}:rerank_group={group}", check, device=device)
    assert make_policy(spec).granularity == "page" and len(seen) > 10


SELECTIVE = ["quest:rerank=2", "arkvale:rerank=2", "prkv:static_ratio=0.5:refresh=6:rerank=2",
             "prkv:rerank=2:rerank_group=weight", "chess:rerank=2", "chess:rerank=3:trigger=always",
             "quest:rerank=1:rerank_share=0.5",
             "prkv:static_ratio=0.5:refresh=6:rerank=1:rerank_share=0.5"]  # fmt: skip


@pytest.mark.parametrize("spec", SELECTIVE)
def test_selection_within_budget_middle_and_unique(spec):
    def check(q, view, sel):
        assert sel.pages is None and sel.tokens is not None  # a token selection (granularity "token")
        pos = sel.tokens
        ws = view.grid.window_start(view.lengths_host)
        for i in range(pos.shape[0]):
            for j in range(pos.shape[1]):
                p = pos[i, j][pos[i, j] >= 0].tolist()
                where = f"{spec} layer {view.layer} seq {i} head {j}"
                assert len(p) == len(set(p)), f"{where}: a token twice"
                assert len(p) <= T, f"{where}: {len(p)} tokens > {T}"
                assert all(SINK <= x < int(ws[i]) for x in p), f"{where}: a token outside the middle"

    calls = _run(spec, check)
    assert make_policy(spec).granularity == "token"
    assert any(int((c >= 0).sum(-1).max()) == T for c in calls)  # the budget is used


@pytest.mark.parametrize(
    "spec",
    ["quest", "arkvale", "prkv:static_ratio=0.5:refresh=6:select_every=1", "chess:units=mean", "chess:scope=shared"],
)
def test_rerank_one_attends_the_pages_tokens(spec):
    """Candidates = the pages the policy chooses without rerank, and the budget holds all their tokens."""
    a, b = _run(spec), _run(f"{spec}:rerank=1")
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        sx = [[set(r[r >= 0].tolist()) for r in hh] for hh in x]
        sy = [[set(r[r >= 0].tolist()) for r in hh] for hh in y]
        assert sx == sy, f"{spec}: selection {i} differs with rerank=1"


def test_rerank_keeps_the_paper_configuration():
    assert make_policy("quest").rerank == 0 and make_policy("quest").granularity == "page"
    for name in ("arkvale", "prkv:rerank=0", "chess:rerank=0", "chess:anchor_from=window:scope=shared"):
        assert make_policy(name).rerank == 0 and make_policy(name).granularity == "page", name
    # prkv's and chess's defaults rerank (kvdex's selections, docs/policies/prkv.md, chess.md) and attend pages
    for name in ("prkv", "chess"):
        assert make_policy(name).rerank == 4 and make_policy(name).granularity == "page", name


@pytest.mark.parametrize(
    "spec,match",
    [
        ("quest:rerank=-1", "rerank must be an int >= 0"),
        ("arkvale:rerank=1.5", "rerank"),
        ("prkv:rerank=True", "option rerank=True: expected int"),
        ("chess:rerank=-2", "rerank must be an int >= 0"),
        ("quest:rerank=2:rerank_group=sum", "rerank_group must be one of max, weight"),
        ("chess:rerank=2:rerank_group=heads", "rerank_group must be one of max, weight"),
        ("chess:preset=moderate:rerank=2", "rerank > 0 needs budget mode"),
        ("quest:rerank_share=0.25", "it needs rerank >= 1"),
        ("arkvale:rerank=2:rerank_share=1.5", "rerank_share must be a number in"),
        ("prkv:rerank=2:rerank_share='all'", "option rerank_share='all': expected float"),
        ("quest:rerank=2:rerank_share=0.25:group=heads", "use group='max' or 'sum' with rerank_share"),
        ("chess:rerank=2:rerank_share=0.25", "rerank_share needs rerank_unit='page'"),
        ("quest:rerank_unit=page", "it needs rerank >= 1"),
        ("prkv:rerank=2:rerank_unit=pages", "rerank_unit must be one of token, page"),
        ("chess:scope=shared:rerank=2:rerank_unit=page", "rerank_unit='page' picks each layer's pages at its build"),
    ],
)
def test_bad_values_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        make_policy(spec)


def test_bad_values_raise_from_the_constructor():
    from kvdex.policies.prkv import PRKVPolicy
    from kvdex.policies.quest import QuestPolicy

    for bad in (True, -1, 2.0):
        with pytest.raises(ValueError, match="rerank must be an int >= 0"):
            QuestPolicy(rerank=bad)
    with pytest.raises(ValueError, match="rerank_group must be one of"):
        PRKVPolicy(rerank=2, rerank_group="mean")


def _scores(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random page scores [B, 2, width] with -inf past each row's middle (``lengths`` pages)."""
    g = torch.Generator().manual_seed(seed)
    mid = torch.tensor(lengths)
    score = torch.randn(len(lengths), 2, width, generator=g)
    return score.masked_fill(torch.arange(width) >= mid[:, None, None], float("-inf")), mid


def test_share_candidates_per_row_count_and_best_pages():
    from kvdex.kernels.scoring import share_candidates

    score, mid = _scores([40, 9, 0], 48)
    ids = share_candidates(score, 4, 0.25, mid)
    for b, n in enumerate(mid.tolist()):
        quota = min(n, max(4, -(-n // 4)))  # max(k, ceil(share * middle)), at most the middle
        for h in range(2):
            row = ids[b, h]
            got = set(row[row >= 0].tolist())
            assert len(got) == quota, (b, h, got)
            assert got == set(torch.topk(score[b, h, :n], quota).indices.tolist()) if quota else not got


def test_share_candidates_do_not_follow_the_width():
    """A captured step scores the index capacity (wider, -inf past each middle): the same candidates."""
    from kvdex.kernels.scoring import share_candidates

    score, mid = _scores([40, 23], 40, seed=3)
    wide = torch.cat([score, torch.full((2, 2, 24), float("-inf"))], dim=-1)
    a, b = share_candidates(score, 3, 0.3, mid), share_candidates(wide, 3, 0.3, mid)
    assert a.shape[-1] == 12 and b.shape[-1] == 20  # ceil(0.3 x 40), ceil(0.3 x 64)
    for i in range(2):
        for h in range(2):
            assert set(a[i, h][a[i, h] >= 0].tolist()) == set(b[i, h][b[i, h] >= 0].tolist())


def test_share_widens_the_pool_past_rerank():
    """``rerank_share`` adds candidates where ``rerank`` x the budget's pages is the smaller pool, so some
    selection differs from the pool of ``rerank`` alone (that the wider pool's choice is the exact top-k
    is checked above, with every page a candidate)."""
    spec = "quest:rerank=1:rerank_group=weight"
    plain, shared = _run(spec), _run(f"{spec}:rerank_share=1.0")
    assert len(plain) == len(shared)
    assert any(not torch.equal(x, y) for x, y in zip(plain, shared, strict=True))  # a wider pool chose otherwise


@pytest.mark.parametrize("name", ["prkv", "chess", "icecache"])
def test_declared_defaults_are_the_default_selection(name):
    """A policy whose selection options resolve by what a spec names (resolve_selection) declares kvdex's default
    selection as its fields' defaults too, so the class, its option listing and an unnamed spec agree."""
    import dataclasses
    import importlib

    from kvdex.policies.registry import make_policy

    module = importlib.import_module(f"kvdex.policies.{name}")
    default = module.DEFAULT_SELECTION if hasattr(module, "DEFAULT_SELECTION") else module.policy.DEFAULT_SELECTION
    policy = make_policy(name)
    declared = {f.name: f.default for f in dataclasses.fields(policy) if f.name in default}
    assert declared == default
    assert {key: getattr(policy, key) for key in default} == default
