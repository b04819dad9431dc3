"""``pool_every=N`` of the page policies' token rerank (quest, arkvale, prkv; kvdex/policies/rerank.py,
``PoolOption``): a refresh step (every N steps, and whenever a page joins) chooses the candidate pages by the
policy's page scores and holds them; every step ranks the held candidates' tokens by its own query.

Full budget == dense; candidates that hold every page select what selecting every step selects; a step between
refreshes attends the exact best tokens of the held candidates (brute force); captured == eager (CPU stand-in
here and in tests/test_user_path.py, CUDA graphs on the GPU); bad options."""

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

SHARE = "rerank=1:rerank_share=0.5:pool_every=4"
SPECS = [f"quest:{SHARE}", f"prkv:{SHARE}:rerank_group=weight", f"arkvale:{SHARE}"]


def _cache(model, spec, budget):
    return kvdex.Cache(model, spec, budget=budget, dense_layers=1, page_size=PAGE, sink=SINK, window=WINDOW)


@pytest.mark.parametrize("spec", SPECS)
def test_full_budget_equals_dense(spec):
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", 70, 70, 40)
    cache = _cache(model, spec, 256)
    tokens, logits = greedy(model, prompt(70, seed=70), cache=cache, new=40)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)


def _decode(spec: str, budget: int, steps: int = 40, log=None):
    """Teacher-forced logits [steps, V] of a 300-token prompt; ``log`` gets (layer, reuse, q, keys, held pool,
    attended positions, the window's first position) after every sparse attention."""
    model, _ = shared_pair("llama_gqa")
    cache = _cache(model, spec, budget)
    if log is not None:

        def observe(layer, q, store, aset, scale):
            held = cache.policy.pools.get(layer)
            pos = torch.where(aset.valid, aset.positions, -1)
            ws = store.grid.window_start(store.lengths_host)  # [B] the middle's end
            log.append((layer, cache.reuse.reuse, q.clone(), store.k.clone(), None if held is None else held.clone(),
                        pos.clone(), ws))  # fmt: skip

        cache.observer = observe
    return teacher_forced(model, cache, steps), cache


@pytest.mark.parametrize("policy", ["quest", "prkv:rerank_group=weight", "arkvale"])
def test_candidates_of_every_page_select_what_every_step_selects(policy):
    """rerank_share=1: every middle page is a candidate, so each step between refreshes ranks every middle token, as
    selecting every step does: the same logits at every step (and different ones where the held candidates are
    not reranked: the test can fail)."""
    spec = f"{policy}:rerank=1:rerank_share=1.0"
    every, _ = _decode(spec, 96)
    pooled, cache = _decode(spec + ":pool_every=4", 96)
    assert cache.stats()["selection_steps"]["reused"] > 10
    torch.testing.assert_close(pooled, every, atol=1e-5, rtol=0)
    stale, _ = _decode(spec + ":select_every=4", 96)  # the held selection attended as it is
    assert not torch.allclose(stale, every, atol=1e-3, rtol=0)


def test_steps_between_refreshes_take_the_best_tokens_of_the_held_candidates():
    """quest (slot == position), the group's max q.k: a step between refreshes attends the ``room`` best tokens of
    the held candidate pages (brute force over their live middle keys), which are fewer than the middle's."""
    log: list = []
    _, cache = _decode("quest:rerank=1:rerank_share=0.25:pool_every=4", 96, log=log)
    policy = cache.policy
    reused = cache.stats()["selection_steps"]["reused"]
    assert reused > 10
    assert sum(reuse for _, reuse, *_ in log) == reused * len(policy.info.sparse_layers)
    room = 96 - SINK - WINDOW
    checked = 0
    for layer, reuse, q, k, pool, pos, ws in log:
        if not reuse:
            continue
        B, H, S, D = k.shape
        G = q.shape[1] // H
        for b in range(B):
            for h in range(H):
                got = pos[b, h][pos[b, h] >= 0]
                window = int(ws[b])
                middle = got[(got >= SINK) & (got < window)]
                pages = pool[b, h][pool[b, h] >= 0]
                assert 0 < pages.numel() < (window - SINK) // PAGE
                slots = (SINK + pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
                slots = slots[slots < window]
                s = torch.einsum("gd,nd->gn", q[b, h * G : (h + 1) * G].float(), k[b, h, slots].float()).amax(0)
                want = slots[torch.topk(s, min(room, slots.numel())).indices]
                assert set(middle.tolist()) == set(want.tolist()), (layer, b, h)
                checked += 1
    assert checked > 10


@pytest.mark.parametrize("spec", [f"quest:{SHARE}", f"prkv:refresh=8:{SHARE}:rerank_group=weight"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_matches_eager_on_gpu(spec):
    assert_refresh_graphs_match_eager(spec)


def test_bad_pool_every():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pool_every"):
            kvdex.make_policy("quest", rerank=1, pool_every=bad)
    with pytest.raises(ValueError, match="rerank=N"):
        kvdex.make_policy("prkv:pool_every=4")  # no candidates to hold
    with pytest.raises(ValueError, match="rerank_unit=token"):
        kvdex.make_policy("quest:rerank=4:rerank_unit=page:pool_every=4")
    with pytest.raises(ValueError, match="replaces select_every"):
        kvdex.make_policy("quest:rerank=4:pool_every=4:select_every=4")
    assert kvdex.make_policy("arkvale:rerank=4:pool_every=8").reuse_steps() == 8
    assert kvdex.make_policy("quest:select_every=3").reuse_steps() == 3
