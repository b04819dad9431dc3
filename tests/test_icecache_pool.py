"""IceCache ``pool_every=N`` (kvdex/policies/icecache/policy.py, ``SemanticPages.candidates`` / ``rerank_tokens`` /
``narrow``): a refresh step (every N steps, and whenever a page joins) chooses the rerank's candidates and
keeps the ``rerank x max_pages`` best of them by its own token scores; every step between ranks the held
pool's tokens by its own query.

Full budget == dense; a pool that holds every page selects what selecting every step selects; a step between
refreshes attends the exact best tokens of the held pool (brute force) and the pool is the refresh step's
best candidate pages; captured == eager on the GPU (refresh steps and the steps between: two graph variants); bad
options."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    PAGE,
    SINK,
    WINDOW,
    assert_refresh_graphs_match_eager,
    greedy,
    prompt,
    reference_greedy,
    shared_pair,
    span_pages,
    teacher_forced,
)

import kvdex

BASE = "icecache:search=summary:build=device:rerank=1:rerank_unit=token"
POOL = BASE + ":rerank_share=0.5:pool_every=4"


def _cache(model, spec, budget, offload=False):
    return kvdex.Cache(model, spec, budget=budget, offload=offload, dense_layers=1, page_size=PAGE, sink=SINK,
                       window=WINDOW)  # fmt: skip


@pytest.mark.parametrize(
    "spec", [POOL, POOL + ":rerank_group=weight", BASE + ":pool_every=3", POOL + ":pool_pages=all"]
)
def test_full_budget_equals_dense(spec):
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", 70, 70, 40)
    cache = _cache(model, spec, 256)
    tokens, logits = greedy(model, prompt(70, seed=70), cache=cache, new=40)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.stats()["selection_steps"]["reused"] > 0  # the steps between refreshes ran
    want = greedy(model, prompt(120, seed=1), cache=_cache(model, spec, 96), new=6)  # offloaded: the same tokens
    got = greedy(model, prompt(120, seed=1), cache=_cache(model, spec, 96, offload=True), new=6)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)


def _decode(spec: str, budget: int, steps: int = 40, log=None):
    """Teacher-forced logits [steps, V] of a 300-token prompt; ``log`` gets (layer, q, store, policy state)."""
    model, _ = shared_pair("llama_gqa")
    cache = _cache(model, spec, budget)
    if log is not None:
        cache.observer = lambda layer, q, store, aset, scale: log.append(_state(cache, layer, q, store))
    return teacher_forced(model, cache, steps), cache


def _state(cache, layer, q, store):
    policy = cache.policy
    pool = policy._pools.get(layer)
    held = None if pool is None else pool.clone()
    return layer, cache.reuse.reuse, q.clone(), store.k.clone(), held, policy._last[layer].tokens.clone()


def test_a_pool_of_every_page_selects_what_every_step_selects():
    """rerank=64: the pool (rerank x max_pages pages) holds every page of the row, so each step between refreshes
    ranks every middle token, as selecting every step does: the same logits at every step."""
    spec = "icecache:search=summary:build=device:rerank=64:rerank_unit=token"
    every, every_cache = _decode(spec, 96)
    pooled, cache = _decode(spec + ":pool_every=4", 96)
    assert cache.stats()["selection_steps"]["reused"] > 10
    torch.testing.assert_close(pooled, every, atol=1e-5, rtol=0)


@pytest.mark.parametrize("group", ["max", "weight", "max:pool_pages=all"])
def test_steps_between_refreshes_take_the_best_tokens_of_the_held_pool(group):
    """A step between refreshes attends the ``room`` tokens of the held pool with the group's best q.k (``max``;
    brute force), or a subset of the pool (``weight``: its own softmax criterion, tested with the rerank); the
    pool is ``rerank x max_pages`` pages, fewer than the middle holds (the share makes more candidates)."""
    log: list = []
    _, cache = _decode(POOL + f":rerank_group={group}", 96, log=log)
    policy = cache.policy
    cap = policy.rerank * policy._max_pages()
    if policy.pool_pages == "all":  # every candidate: the share's count of the capacity (static width)
        cap = None
    reused = cache.stats()["selection_steps"]["reused"]
    assert reused > 10
    checked = 0
    assert sum(reuse for _, reuse, *_ in log) == reused * len(policy.info.sparse_layers)
    for layer, reuse, q, k, pool, tokens in log:
        B, H, S, D = k.shape
        if not reuse:  # a refresh step ranks the whole candidate set (the share's), then holds its best pages
            continue
        middle = policy.summary_pages.pages[layer].npages.view(-1)
        if cap is None:  # every candidate of the share: more pages than the narrowed pool, fewer than the middle
            live = (pool.view(B * H, -1, PAGE) >= 0).any(-1).sum(-1)
            assert bool((live > policy.rerank * policy._max_pages()).all()) and bool((live < middle).all())
        else:
            assert pool is not None and pool.shape == (B * H, cap * PAGE)
            assert bool((middle > cap).all())  # the pool is a strict part of the middle's pages
        for r in range(B * H):
            slots = pool[r][pool[r] >= 0].long()
            chosen = tokens.view(B * H, -1)[r]
            chosen = chosen[chosen >= 0]
            assert set(chosen.tolist()) <= set(slots.tolist())  # every step picks among the held pool
            if group.startswith("max"):
                b, h = divmod(r, H)
                G = q.shape[1] // H
                s = torch.einsum("gd,nd->gn", q[b, h * G : (h + 1) * G].float(), k[b, h, slots].float()).amax(0)
                want = slots[torch.topk(s, min(chosen.numel(), s.numel())).indices]
                assert chosen.numel() == min(slots.numel(), tokens.shape[-1])
                assert set(chosen.tolist()) == set(want.tolist()), (layer, r)
                checked += 1
    assert checked > 0 or group == "weight"


def test_the_pool_is_the_refresh_steps_best_candidate_pages():
    """``SemanticPages.narrow``: the k candidate pages whose best token scores highest, page-aligned."""
    g = torch.Generator().manual_seed(3)
    B, H, G, D, ps, n = 1, 2, 2, 8, 4, 96
    keys = torch.randn(B, H, n, D, generator=g)
    pages = span_pages(keys, ps, 32)
    q = torch.randn(B, H * G, D, generator=g)
    cand, slots = pages.candidates(q, pages.bound, 20)
    got: list = []
    pages.rerank_tokens(q, slots, 8, keys, scores_out=got)
    pool = pages.narrow(slots, got[0], 5)
    assert pool.shape == (B * H, 5 * ps) and pool.dtype == torch.int32
    for h in range(H):
        s = torch.einsum("gd,nd->gn", q[0, h * G : (h + 1) * G], keys[0, h]).amax(0)  # [n] the group's max
        live = slots[h][slots[h] >= 0].long().view(-1, ps)  # the candidates' pages, one row each
        best = live[torch.topk(s[live].amax(1), 5).indices]
        assert sorted(pool[h].view(-1, ps)[:, 0].tolist()) == sorted(best[:, 0].tolist())
        assert torch.equal(torch.sort(pool[h]).values, torch.sort(best.flatten().int()).values)


@pytest.mark.parametrize("spec", [POOL, POOL + ":rerank_group=weight"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_matches_eager_on_gpu(spec):
    assert_refresh_graphs_match_eager(spec)


def test_bad_pool_every():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pool_every"):
            kvdex.make_policy("icecache", search="summary", rerank=1, rerank_unit="token", pool_every=bad)
    with pytest.raises(ValueError, match="rerank_unit=token"):
        kvdex.make_policy("icecache:search=summary:rerank=4:pool_every=4")  # the page unit holds no pool
    with pytest.raises(ValueError, match="replaces select_every"):
        kvdex.make_policy(BASE + ":pool_every=4:select_every=4")
    assert kvdex.make_policy(BASE + ":pool_every=8").reuse_steps() == 8
    assert kvdex.make_policy(BASE).reuse_steps() == 1
