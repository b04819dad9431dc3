"""``quest``: the page bound is a true upper bound, the index tracks the real keys, and the
selected pages are the top-k by (group-max) bound."""

from __future__ import annotations

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, left_padded, positions, shared_pair, window_start

import kvdex
from kvdex import cache_kwargs
from kvdex.policies.quest import page_bounds

BUDGET = 96
RETRIEVAL_PAGES = (BUDGET - SINK - WINDOW) // PAGE


def true_page_max(q, keys):
    """q [B, Hq, D], keys [B, H, P, ps, D] -> exact max_t q.k per (query head, page), float64."""
    b, hq, d = q.shape
    h = keys.shape[1]
    qg = q.double().view(b, h, hq // h, d)
    s = torch.einsum("bhgd,bhptd->bhgpt", qg, keys.double())
    return s.amax(-1).reshape(b, hq, -1)


@pytest.mark.parametrize("kv_heads,q_heads", [(1, 1), (2, 4), (2, 8), (4, 4)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_bounds_is_upper_bound_random(kv_heads, q_heads, page_size):
    g = torch.Generator().manual_seed(kv_heads * 100 + q_heads * 10 + page_size)
    for trial in range(5):
        b, p, d = 3, 7, 16
        # mixed signs, shifted means and scales: negative keys and queries everywhere
        keys = torch.randn(b, kv_heads, p, page_size, d, generator=g) * (1 + 3 * trial) - trial
        q = torch.randn(b, q_heads, d, generator=g) * 2 - 0.5 * (trial % 2)
        kmin, kmax = keys.amin(3), keys.amax(3)
        ub = page_bounds(q, kmin, kmax)
        assert ub.shape == (b, q_heads, p) and ub.dtype == torch.float32
        truth = true_page_max(q, keys)
        slack = 1e-5 * (1 + truth.abs())
        assert bool((ub.double() >= truth - slack).all()), (ub.double() - truth).min()
        if page_size == 1:  # a one-token page: min == max == k, the bound is exact
            torch.testing.assert_close(ub.double(), truth, atol=1e-4, rtol=1e-5)
        else:  # and it is not trivially huge: at most sum_d |q_d| (max_d - min_d) above the truth
            spread = torch.einsum(
                "bhgd,bhpd->bhgp", q.abs().double().view(b, kv_heads, -1, d), (kmax - kmin).double()
            ).reshape(b, q_heads, p)
            assert bool((ub.double() <= truth + spread + slack).all())


def test_page_bounds_reference_formula():
    """sum_d max(q_d min_d, q_d max_d), computed elementwise, equals page_bounds."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 8, generator=g)
    lo = torch.randn(2, 2, 5, 8, generator=g)
    hi = lo + torch.rand(2, 2, 5, 8, generator=g)
    qg = q.view(2, 2, 2, 1, 8)
    ref = torch.maximum(qg * lo[:, :, None], qg * hi[:, :, None]).sum(-1).reshape(2, 4, 5)
    torch.testing.assert_close(page_bounds(q, lo, hi), ref, atol=1e-5, rtol=1e-5)


def _check_index_and_bounds(policy, layer, q, store, where):
    """The index holds exact per-page key min/max; bounds >= the true max of every page."""
    k, _ = store.dense()
    nmid = [(window_start(n) - SINK) // PAGE for n in store.lengths_host.tolist()]
    if max(nmid) == 0:
        return 0
    p = max(nmid)
    kmin, kmax = policy.kmin[layer], policy.kmax[layer]
    assert kmin.shape[2] >= p
    b, h, _, d = k.shape
    keys = k[:, :, SINK : SINK + p * PAGE].reshape(b, h, p, PAGE, d)
    for bi, m in enumerate(nmid):
        assert torch.equal(kmin[bi, :, :m], keys[bi, :, :m].amin(2)), f"{where}: stale kmin, seq {bi}"
        assert torch.equal(kmax[bi, :, :m], keys[bi, :, :m].amax(2)), f"{where}: stale kmax, seq {bi}"
    ub = page_bounds(q, kmin[:, :, :p], kmax[:, :, :p]).double()
    truth = true_page_max(q, keys)
    for bi, m in enumerate(nmid):
        assert bool((ub[bi, :, :m] >= truth[bi, :, :m] - 1e-5 * (1 + truth[bi, :, :m].abs())).all()), where
    return sum(nmid)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
def test_quest_index_and_selection_during_decode(family, offload):
    """Index updated incrementally as window pages are evicted (ragged batch: at different steps),
    bounds >= true max at every step, selection == top-k pages by group-max bound."""
    model, _ = shared_pair(family)
    lengths = [75, 40, 100]
    ids, mask, _ = left_padded(lengths, seed=31)
    cache = kvdex.Cache(model, "quest", budget=BUDGET, offload=offload, dense_layers=1)
    policy = cache.policy
    kvh = model.config.num_key_value_heads
    seen = {"pages": 0, "steps": 0, "selected": 0}

    def observer(layer, q, store, aset, scale):
        where = f"layer {layer} step {seen['steps']}"
        seen["steps"] += 1
        seen["pages"] += _check_index_and_bounds(policy, layer, q, store, where)
        # selection: the retrieved middle pages are the top-k by max-over-group bound
        lens = store.lengths_host.tolist()
        p = max((window_start(n) - SINK) // PAGE for n in lens)
        score = None
        if p:
            ub = page_bounds(q, policy.kmin[layer][:, :, :p], policy.kmax[layer][:, :, :p])
            score = ub.view(q.shape[0], kvh, -1, p).amax(2)
        for b, n in enumerate(lens):
            ws = window_start(n)
            m = (ws - SINK) // PAGE
            for h in range(kvh):
                pos = aset.positions[b, h][aset.valid[b, h]].tolist()
                mid = sorted(x for x in pos if SINK <= x < ws)
                pages = sorted({(x - SINK) // PAGE for x in mid})
                # whole pages only, each page once
                assert mid == sorted(SINK + pg * PAGE + t for pg in pages for t in range(PAGE)), where
                k = min(RETRIEVAL_PAGES, m)
                assert len(pages) == k, where
                if k:
                    seen["selected"] += 1
                    s = score[b, h, :m]
                    kth = torch.sort(s, descending=True).values[k - 1]
                    # every selected page scores >= the k-th best, every dropped one <= it
                    assert bool((s[pages] >= kth).all()), where
                    dropped = [pg for pg in range(m) if pg not in pages]
                    assert bool((s[dropped] <= kth).all()), where

    cache.observer = observer
    model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=60, do_sample=False)
    assert seen["steps"] == 59 * (model.config.num_hidden_layers - 1)
    assert seen["pages"] > 0 and seen["selected"] > 0
    # the short sequence (40 tokens) had no middle at prefill; it gained pages while decoding
    assert cache.layers[1].store.lengths_host.tolist() == [n + 59 for n in lengths]
    final = [(window_start(n + 59) - SINK) // PAGE for n in lengths]
    assert final[1] >= 2


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_quest_index_after_prefill_matches_keys(offload):
    model, _ = shared_pair("qwen3")
    lengths = [120, 33, 64]
    ids, mask, _ = left_padded(lengths, seed=8)
    cache = kvdex.Cache(model, "quest", budget=BUDGET, offload=offload, dense_layers=1)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(cache))
    g = torch.Generator().manual_seed(1)
    for layer in (1, 2):
        store = cache.layers[layer].store
        q = 3 * torch.randn(3, 4, 16, generator=g)
        assert _check_index_and_bounds(cache.policy, layer, q, store, f"layer {layer}") == sum(
            (window_start(n) - SINK) // PAGE for n in lengths
        )
