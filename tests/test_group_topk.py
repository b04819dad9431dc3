"""How a GQA group's query heads choose a kv head's pages (``kvdex.kernels.scoring.group_topk``) and
the options that use it: ``quest:group``, ``prkv:group`` (dynamic pages) and ``prkv:static_group``.

Invariants: ``"heads"`` is the round-robin union of the heads' own rankings (checked against a plain
Python reference), never over the budget, no page twice, every head's top ``j`` pages in when the
budget holds ``G * j``; ``"max"`` / ``"sum"`` are the top-k of the group reduction; in a model the
attended pages contain every query head's best page by its own bound / estimate; a covering budget
reproduces dense attention; bad values raise ValueError naming the choices.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PAGE, SINK, greedy, prompt, reference_greedy, shared_pair, window_start

import kvdex
from kvdex.kernels.scoring import GROUPS, group_reduce, group_topk, page_bounds, topk_ids
from kvdex.policies.digest import digest_scores

BUDGET = 96


def round_robin(score: torch.Tensor, kv_heads: int, k: int) -> list:
    """Reference: per kv head, the heads' rankings (descending score, finite only) interleaved rank
    by rank, head by head, first occurrences kept, cut at k."""
    b, hq, n = score.shape
    g = hq // kv_heads
    out = []
    for i in range(b):
        row = []
        for h in range(kv_heads):
            ranks = []
            for j in range(g):
                s = score[i, h * g + j]
                order = sorted(range(n), key=lambda x: (-float(s[x]), x))
                ranks.append([x for x in order if s[x] > float("-inf")])
            picked = []
            for r in range(n):
                for j in range(g):
                    if r < len(ranks[j]) and ranks[j][r] not in picked and len(picked) < k:
                        picked.append(ranks[j][r])
            row.append(picked)
        out.append(row)
    return out


@pytest.mark.parametrize("kv_heads,g", [(1, 1), (2, 2), (2, 7), (3, 3)])
@pytest.mark.parametrize("k", [1, 3, 8, 40])
def test_heads_is_round_robin_union(kv_heads, g, k):
    gen = torch.Generator().manual_seed(kv_heads * 100 + g * 10 + k)
    b, n = 3, 24
    score = torch.randn(b, kv_heads * g, n, generator=gen)
    score[1, :, 20:] = float("-inf")  # a shorter middle
    score[2] = float("-inf")  # no middle
    got = group_topk(score, kv_heads, k, "heads")
    assert got.shape == (b, kv_heads, min(k, n))
    want = round_robin(score, kv_heads, k)
    for i in range(b):
        for h in range(kv_heads):
            row = got[i, h].tolist()
            taken = [x for x in row if x >= 0]
            assert taken == want[i][h]  # same pages, same order
            assert row == taken + [-1] * (len(row) - len(taken))  # -1 padding at the end only
            assert len(set(taken)) == len(taken) <= k
            for j in range(g):  # every head's top k // g are in
                s = score[i, h * g + j]
                top = torch.topk(s, min(k // g, int(torch.isfinite(s).sum()))).indices.tolist()
                assert set(top) <= set(taken)


@pytest.mark.parametrize("group", ["max", "sum"])
def test_reductions_are_topk_of_group_reduce(group):
    score = torch.randn(2, 6, 30, generator=torch.Generator().manual_seed(3))
    assert torch.equal(group_topk(score, 2, 5, group), topk_ids(group_reduce(score, 2, group), 5))


def test_bad_group_names_the_choices():
    for call in (
        lambda: group_topk(torch.zeros(1, 2, 4), 1, 2, "min"),
        lambda: kvdex.make_policy("quest", group="mean"),
        lambda: kvdex.make_policy("prkv", group="union"),
        lambda: kvdex.make_policy("prkv", static_group="max"),
    ):
        with pytest.raises(ValueError, match="heads"):
            call()
    assert GROUPS == ("max", "sum", "heads")


def _check_best_page_of_every_head(cache, scores_of):
    """Observer: each kv head's attended middle pages are within the budget and hold every query
    head's best page (by ``scores_of(layer, q, store, p)`` [B, Hq, p]) when the budget holds G pages."""
    seen = {"checked": 0}
    pages_k = (BUDGET - SINK - cache.policy.cfg.window) // PAGE

    def observer(layer, q, store, aset, scale):
        lens = store.lengths_host.tolist()
        p = max((window_start(n) - SINK) // PAGE for n in lens)
        if not p:
            return
        s = scores_of(layer, q, store, p)
        kvh = store.kv_heads
        g = q.shape[1] // kvh
        for b, n in enumerate(lens):
            m = (window_start(n) - SINK) // PAGE
            for h in range(kvh):
                pos = aset.positions[b, h][aset.valid[b, h]].tolist()
                pages = {(x - SINK) // PAGE for x in pos if SINK <= x < window_start(n)}
                assert len(pages) == min(pages_k, m)
                if m and pages_k >= g:
                    for j in range(g):
                        row = s[b, h * g + j, :m]
                        best = set(torch.nonzero(row == row.max()).flatten().tolist())
                        assert best & pages, (layer, b, h, j)
                    seen["checked"] += 1

    return observer, seen


@pytest.mark.parametrize("spec", ["quest", "prkv"])
def test_heads_attends_every_query_heads_best_page(spec):
    model, _ = shared_pair("llama_gqa")
    opts = {"group": "heads"} if spec == "quest" else {"group": "heads", "static_ratio": 0.0}
    cache = kvdex.Cache(model, spec, budget=BUDGET, dense_layers=1, **opts)
    pol = cache.policy

    def scores_of(layer, q, store, p):
        if spec == "quest":
            return page_bounds(q, pol.kmin[layer][:, :, :p], pol.kmax[layer][:, :, :p])
        return digest_scores(q, pol.digests.centre[layer][:, :, :p], pol.digests.radius[layer][:, :, :p])

    cache.observer, seen = _check_best_page_of_every_head(cache, scores_of)
    greedy(model, prompt(150, seed=5), cache=cache, new=20)
    assert seen["checked"] > 0


def test_prkv_static_heads_holds_every_heads_top_tokens():
    """static_group="heads": after a refresh (Algorithm 1), the static front holds every query head's
    top ``k_s // G`` tokens by its own window score (keys in position order) -- the scores of the ring
    the refresh read (after the step before it) over the middle it restructured."""
    from test_prkv import _ring_copy, _window_scores

    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "prkv", budget=BUDGET, dense_layers=1, static_ratio=0.5, refresh=5, obs=8,
                         static_group="heads")  # fmt: skip
    pol = cache.policy
    checked, before = [], {}

    def observer(layer, q, store, aset, scale):
        step = pol.schedule.steps[layer] - 1
        if (step + 1) % 5 == 0:
            before[layer] = _ring_copy(pol, layer)
        if step == 0 or step % 5:
            return
        s, org = _window_scores(pol, layer, store, scale, per_query_head=True, ring=before.pop(layer))
        s = s[..., : org.shape[2]]
        ns = int(pol.static_set.counts[layer][0])
        g = q.shape[1] // store.kv_heads
        assert ns >= g
        for h in range(store.kv_heads):
            front = set(org[0, h, :ns].tolist())
            for j in range(g):  # every head's top ns // g tokens (the ones above its next score)
                row = s[0, h * g + j]
                top = torch.sort(row, descending=True).values
                above = set(torch.nonzero(row > top[ns // g]).flatten().tolist())
                assert above <= front, (layer, h, j)
        checked.append(layer)

    cache.observer = observer
    greedy(model, prompt(140, seed=1), cache=cache, new=12)
    assert checked


COVERING = [
    ("quest", {"group": "heads"}),
    ("quest", {"group": "sum"}),
    ("prkv", {"group": "heads"}),
    ("prkv", {"group": "heads", "static_group": "heads", "static_ratio": 0.5, "refresh": 8}),
]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("spec,opts", COVERING, ids=[f"{s}:{o}" for s, o in COVERING])
def test_covering_budget_matches_sdpa(spec, opts, offload):
    family, n, new = "llama_gqa", 70, 40
    model, _ = shared_pair(family)
    ref_tokens, ref_logits = reference_greedy(family, n, n, new)
    cache = kvdex.Cache(model, spec, budget=256, offload=offload, dense_layers=1, **opts)
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=new)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
