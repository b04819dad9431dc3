"""``pariskv:pool_every=N`` (kvdex option, not the paper's): a refresh step (every N steps, and whenever a page
joins) runs the coarse stage (the centroids' votes, the pool's bucket top-k) and holds the pool; every step,
refresh or not, reranks the held pool by its own query's 4-bit estimates.

Full budget == dense; a pool of the whole middle selects what selecting every step selects (and the held
selection of ``select_every`` does not: the test can fail); a step between refreshes ranks the pool held by the
last refresh; captured == eager on the GPU; bad options."""

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
    teacher_forced,
)

import kvdex
from kvdex.kernels import pariskv as K


def _cache(model, spec, budget):
    return kvdex.Cache(model, spec, budget=budget, dense_layers=1, page_size=PAGE, sink=SINK, window=WINDOW)


def test_full_budget_equals_dense():
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", 70, 70, 40)
    tokens, logits = greedy(model, prompt(70, seed=70), cache=_cache(model, "pariskv:pool_every=4", 256), new=40)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)


def _decode(spec: str, budget: int = 96, log=None):
    model, _ = shared_pair("llama_gqa")
    cache = _cache(model, spec, budget)
    if log is not None:

        def observe(layer, q, store, aset, scale):
            held = cache.policy.pools.get(layer)
            pos = torch.where(aset.valid, aset.positions, -1)
            ws = store.grid.window_start(store.lengths_host)  # [B] the middle's end
            log.append((layer, cache.reuse.reuse, q.clone(), None if held is None else held.clone(), pos.clone(), ws))

        cache.observer = observe
    return teacher_forced(model, cache, 40), cache


def test_a_pool_of_the_whole_middle_selects_what_every_step_selects():
    """candidate_ratio=1: the pool holds every middle key, so a step between refreshes reranks all of them with its
    own query, as a step that selects does: the same logits at every step; the held selection of select_every
    differs (so the comparison can fail)."""
    spec = "pariskv:candidate_ratio=1.0"
    every, _ = _decode(spec)
    pooled, cache = _decode(spec + ":pool_every=4")
    assert cache.stats()["selection_steps"]["reused"] > 10
    torch.testing.assert_close(pooled, every, atol=1e-5, rtol=0)
    stale, _ = _decode(spec + ":select_every=4")
    assert not torch.allclose(stale, every, atol=1e-3, rtol=0)


def test_steps_between_refreshes_rerank_the_held_pool_by_their_own_query():
    """A step between refreshes attends the best ``room`` of the held pool by the twins' 4-bit estimate of its own
    query (the heads' weights combined), and the pool is a strict part of the middle."""
    log: list = []
    _, cache = _decode("pariskv:candidate_ratio=0.3:pool_factor=1:pool_every=4", log=log)
    policy = cache.policy
    room = 96 - SINK - WINDOW
    checked = 0
    for layer, reuse, q, pool, pos, ws in log:
        if not reuse:
            continue
        idx = policy.summary[layer]
        b, h = idx.ids.shape[:2]
        qb, qn = policy.query_blocks(q, h)
        est = K.rerank_combined(pool, idx.codes.flatten(0, 1), idx.weight.flatten(0, 1), qb, qn,
                                policy.centers, policy.m, policy.info.head_dim**-0.5)  # fmt: skip
        for r in range(b * h):
            live = pool[r] >= 0
            window = int(ws[r // h])
            assert 0 < int(live.sum()) < window - SINK
            want = pool[r][live][torch.topk(est[r][live], min(room, int(live.sum()))).indices] + SINK
            got = pos[r // h, r % h]
            got = got[(got >= SINK) & (got < window)]
            assert set(got.tolist()) == set(want.tolist()), (layer, r)
            checked += 1
    assert checked > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["pariskv:pool_every=4", "pariskv:group=mean:coarse=tiers:pool_every=4"])
def test_graph_decoding_matches_eager_on_gpu(spec):
    assert_refresh_graphs_match_eager(spec)


def test_bad_pool_every():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pool_every"):
            kvdex.make_policy("pariskv", pool_every=bad)
    with pytest.raises(ValueError, match="replaces select_every"):
        kvdex.make_policy("pariskv:pool_every=4:select_every=4")
    assert kvdex.make_policy("pariskv:pool_every=8").reuse_steps() == 8
    assert kvdex.make_policy("pariskv:select_every=3").reuse_steps() == 3
