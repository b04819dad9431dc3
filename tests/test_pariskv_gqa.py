"""``pariskv`` options ``group="heads"`` and ``coarse="scores"`` (kvdex extensions, the defaults; the paper's
configuration is ``group="mean"`` and ``coarse="tiers"``).

The vote table of quantised centroid scores is an order-preserving quantisation on one scale per row;
a key's vote with G tables is its best head's sum; the per-head rerank equals G single-head reranks;
the heads' combination does not depend on the pool's width; with the whole middle as pool the
selection is exactly the top-k of the combined score (of the 4-bit estimates, and of the exact inner
products when the rerank is exact); a head that alone looks at a needle is not averaged away; a ragged
batch decodes each sequence as alone; bad values raise ``ValueError``. Triton == twin for the new
kernel paths lives in tests/test_pariskv.py (its interpreter suite).
"""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, left_padded, prompt, shared_pair

import kvdex
from kvdex.config import CacheConfig
from kvdex.kernels import pariskv as K
from kvdex.policies import PolicyInfo, make_policy
from kvdex.policies.pariskv import PAPER_SPEC, recall_at_k
from kvdex.storage.joins import MiddleUpdate

PAGE = 16


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "opts,match",
    [
        ({"group": "max"}, "group must be one of"),
        ({"group": 2}, "group"),
        ({"coarse": "ranks"}, "coarse must be one of"),
    ],
)
def test_bad_values_raise(opts, match):
    with pytest.raises(ValueError, match=match):
        make_policy("pariskv", **opts).bind(PolicyInfo(CacheConfig(), 4, (2, 3), 4, 2, 64))


def test_text_options():
    p = make_policy("pariskv:group=mean:coarse=tiers:pool_factor=4")
    assert (p.group, p.coarse, p.pool_factor) == ("mean", "tiers", 4)
    assert (make_policy("pariskv").group, make_policy("pariskv").coarse) == ("heads", "scores")  # kvdex's default
    assert (make_policy(PAPER_SPEC).group, make_policy(PAPER_SPEC).coarse) == ("mean", "tiers")  # the paper's


def test_score_votes_quantise_on_one_scale_per_row():
    s = torch.randn(3, 4, 8, 256, generator=gen(0))
    s[1, 2] *= 5  # one head with a larger query norm: its votes spread wider, on the row's common scale
    s[2] = 0.0  # a zero query: every centroid gets the same vote
    v = K.score_votes(s)
    assert v.dtype == torch.int32 and int(v.min()) >= 0 and int(v.max()) <= K.SCORE_LEVELS
    m = s.abs().amax(dim=(1, 2, 3), keepdim=True).clamp(min=1e-30)
    assert torch.equal(v, torch.round((s + m) * K.SCORE_LEVELS / (2 * m)).int())
    for r in range(2):  # order-preserving within a row, across its heads and subspaces
        a, b = s[r].flatten(), v[r].flatten()
        o = a.argsort()
        assert bool((b[o][1:] >= b[o][:-1]).all())
    assert int(v[2].unique().numel()) == 1
    spread = (v[1].amax(dim=(1, 2)) - v[1].amin(dim=(1, 2))).tolist()
    assert spread[2] == max(spread) and spread[2] > 2 * min(spread)


def test_collision_votes_with_head_tables_is_the_best_heads_sum():
    g = gen(1)
    ids = torch.randint(0, 256, (2, 300, 8), generator=g).to(torch.uint8)
    votes = torch.randint(0, 33, (2, 5, 8, 256), generator=g).int()
    live = torch.tensor([300, 120])
    got = K.collision_votes(ids, votes, live)
    per = torch.stack([K.collision_votes(ids, votes[:, j]) for j in range(5)], 1)  # one table at a time
    want = torch.where(torch.arange(300)[None] < live[:, None], per.amax(1), -1)
    assert torch.equal(got, want)


def test_rerank_per_head_equals_one_rerank_per_head():
    d, m = 64, 8
    g = gen(2)
    signs = K.srht_signs(d, 1)
    t, cen = K.magnitude_levels(m)
    _, codes, w = K.encode_keys(torch.randn(2, 200, d, generator=g), signs, m, t, cen)
    qb, qn = K.encode_query(torch.randn(2, 3, d, generator=g), signs, m)  # [2, 3, nsub, m], [2, 3]
    cand = torch.randint(-1, 200, (2, 50), generator=g)
    got = K.rerank_scores(cand, codes, w, qb, qn, cen, m)
    assert got.shape == (2, 3, 50)
    for j in range(3):
        want = K.rerank_scores(cand, codes, w, qb[:, j], qn[:, j], cen, m)
        assert torch.equal(torch.isinf(got[:, j]), torch.isinf(want))
        torch.testing.assert_close(got[:, j], want, atol=1e-5, rtol=1e-5)


def test_combine_heads_is_the_summed_relative_weight_and_ignores_padding_width():
    g = gen(3)
    est = torch.randn(4, 3, 40, generator=g) * 5
    est[:, :, 30:] = float("-inf")  # no candidate
    est[3] = float("-inf")  # a row without candidates
    scale = 0.3
    got = K.combine_heads(est, scale)
    top = est[:3].amax(-1, keepdim=True)
    want = torch.exp((est[:3] - top) * scale).sum(1)
    torch.testing.assert_close(got[:3, :30], want[:, :30], atol=1e-6, rtol=1e-6)
    assert bool(torch.isinf(got[:, 30:]).all()) and bool(torch.isinf(got[3]).all())
    wide = torch.cat([est, torch.full((4, 3, 100), float("-inf"))], -1)  # a static pool width
    assert torch.equal(K.combine_heads(wide, scale)[:, :40], got)  # bit for bit: no width-dependent sum


def _indexed(opts, h=2, group=4, n=2048, d=64, k=40, seed=4, keys=None):
    info = PolicyInfo(CacheConfig(budget=k + 48), 4, (2, 3), h * group, h, d)
    p = make_policy("pariskv", kernels="torch", **opts)
    p.bind(info)
    if keys is None:
        keys = torch.randn(1, h, n, d, generator=gen(seed)) * torch.linspace(0.3, 2.0, d) + 0.5
    p.index(2, MiddleUpdate(torch.tensor([0]), torch.tensor([n // PAGE]), keys.view(1, h, n // PAGE, PAGE, d)))
    return p, keys


@pytest.mark.parametrize("coarse", ["tiers", "scores"])
def test_whole_pool_selects_the_top_k_of_the_combined_estimate(coarse):
    """candidate_ratio=1: every middle key is a candidate, so the selection is exactly the top-k of
    combine_heads over the 4-bit estimates of every key (computed here independently)."""
    h, group, n, k, scale = 2, 4, 2048, 40, 0.125
    p, keys = _indexed({"group": "heads", "coarse": coarse, "candidate_ratio": 1.0}, h, group, n, k=k)
    q = torch.randn(1, h * group, 64, generator=gen(5)) * 2
    final, pool = p.search(2, q, n, torch.tensor([n]), k, scale=scale)
    assert bool((pool.sort(-1).values == torch.arange(n)).all())
    qb, qn = K.encode_query(q.view(h, group, 64), p.signs, p.m)
    idx = p.summary[2]
    everything = torch.arange(n).expand(h, n)
    est = K.rerank_scores(everything, idx.codes[0, :, :n], idx.weight[0, :, :n], qb, qn, p.centers, p.m)
    want = K.combine_heads(est, scale).topk(k, -1).indices
    assert torch.equal(final[0].sort(-1).values, want.sort(-1).values)


def test_whole_pool_and_an_exact_rerank_select_the_true_top_k_of_the_combined_score(monkeypatch):
    """With the rerank replaced by the exact <q_h, k>, group="heads" selects exactly the top-k of
    sum_h exp(scale (<q_h, k> - max_k' <q_h, k'>)): the combined target, not the mean query's."""
    h, group, n, k, scale = 2, 4, 2048, 40, 0.125
    p, keys = _indexed({"group": "heads", "coarse": "scores", "candidate_ratio": 1.0}, h, group, n, k=k)
    q = torch.randn(1, h * group, 64, generator=gen(6)) * 3
    qg = q.view(h, group, 64)

    def exact(cand, codes, weight, qb, qn, centers, m):
        est = torch.einsum("hgd,hnd->hgn", qg, keys[0])  # rows == kv heads here (batch 1)
        return est.gather(2, cand.clamp(min=0)[:, None].expand(-1, group, -1)).masked_fill(
            (cand < 0)[:, None], float("-inf")
        )

    monkeypatch.setattr(K, "rerank_scores", exact)
    final, _ = p.search(2, q, n, torch.tensor([n]), k, scale=scale)
    logits = torch.einsum("hgd,hnd->hgn", qg, keys[0])
    target = torch.exp((logits - logits.amax(-1, keepdim=True)) * scale).sum(1)
    assert torch.equal(final[0].sort(-1).values, target.topk(k, -1).indices.sort(-1).values)
    mean_top = torch.einsum("hd,hnd->hn", qg.mean(1), keys[0]).topk(k, -1).indices
    assert not torch.equal(final[0].sort(-1).values, mean_top.sort(-1).values)  # a different target


@pytest.mark.parametrize("coarse", ["tiers", "scores"])
def test_a_needle_one_head_looks_at_is_not_averaged_away(coarse):
    """One kv head, four query heads: head 0 points at a planted key, the other three (larger norms)
    at random directions. The mean query's pool misses the needle; every head voting keeps it."""
    n, d, k = 4096, 64, 32
    g = gen(7)
    keys = torch.randn(1, 1, n, d, generator=g)
    u = torch.randn(d, generator=g)
    u /= u.norm()
    needle = 2345
    keys[0, 0, needle] = 4 * u
    q = torch.cat([6 * u[None], 12 * torch.nn.functional.normalize(torch.randn(3, d, generator=g), dim=-1)])[None]
    found = {}
    for group in ("mean", "heads"):  # the paper's beta pool (no pool_factor floor), so the pool is 5 %
        opts = {"group": group, "coarse": coarse, "candidate_ratio": 0.05, "collision_ratio": 0.2, "pool_factor": None}
        p, _ = _indexed(opts, h=1, group=4, n=n, k=k, keys=keys)
        final, pool = p.search(2, q, n, torch.tensor([n]), k, scale=0.125)
        found[group] = (needle in pool.flatten().tolist(), needle in final.flatten().tolist())
    assert found["heads"] == (True, True) and found["mean"] == (False, False), found


@pytest.mark.parametrize("spec", ["pariskv:pool_factor=2", "pariskv:coarse=tiers", "pariskv-kmeans:group=heads"])
def test_ragged_batch_equals_each_sequence_alone(spec):

    model, _ = shared_pair("llama_gqa")
    lengths, new = [200, 130, 300], 20
    ids, mask, prompts = left_padded(lengths, seed=10)
    cache = kvdex.Cache(model, spec, budget=96, dense_layers=1)
    tokens, logits = greedy(model, ids, mask, cache, new=new)
    for i, pr in enumerate(prompts):
        alone = kvdex.Cache(model, spec, budget=96, dense_layers=1)
        t1, l1 = greedy(model, pr[None], None, alone, new=new)
        assert torch.equal(tokens[i, ids.shape[1] :], t1[0, len(pr) :])
        torch.testing.assert_close(logits[:, i], l1[:, 0], atol=1e-4, rtol=0)


def test_recall_at_k_of_the_heads_mode_with_the_whole_pool():

    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "pariskv", budget=96, candidate_ratio=1.0)  # the default: group="heads", scores
    out = {}

    def observer(layer, q, store, aset, scale):
        out[layer] = recall_at_k(cache.policy, layer, q, store, k=16, scale=scale)

    cache.observer = observer
    greedy(model, prompt(400, seed=2), cache=cache, new=2)
    assert out and all(r["pool"] == 1.0 and r["e2e"] == r["rerank"] and r["e2e"] >= 0.5 for r in out.values())
