"""IceCache ``search="summary"``: semantic pages scored from device summaries (kvdex.index.summary).

Full budget == dense, the min/max bound (and the centroid bound) never below a page's true max q.k,
every middle token in exactly one page after decoding, the static (CUDA-graph) sizing selects what
the dynamic one does, a ragged batch equals each sequence alone, offloaded == resident, the
insertion rule, the graph protocol and bad options."""

from __future__ import annotations

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, greedy, left_padded, prompt, reference_greedy, shared_pair, span_pages

import kvdex
from kvdex import cache_kwargs
from kvdex.index.leaf_pages import promoted
from kvdex.index.summary import SemanticPages

NEW = 56
SPECS = ["icecache:search=summary", "icecache:search=summary:summary=centroid:group_merge=max"]
DEVICE = "icecache:search=summary:build=device"  # the leaf pages built on the device at prefill (no tree)


def _cache(model, spec, budget, offload=False, **kw):
    return kvdex.Cache(model, spec, budget=budget, offload=offload, dense_layers=1, **kw)


def _observe(cache, log):
    def obs(layer, q, store, aset, scale):
        log.append((layer, aset.positions.clone(), aset.valid.clone()))

    cache.observer = obs


@pytest.mark.parametrize("n", [70, 30], ids=["prompt70", "prompt30"])  # 30: the middle appears while decoding
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("spec", SPECS + ["icecache:search=summary:group_merge=nsa:reuse=True", DEVICE])
def test_full_budget_equals_dense(spec, offload, n):
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", n, n, NEW)
    cache = _cache(model, spec, 256, offload, page_size=PAGE, sink=SINK, window=WINDOW)
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=NEW)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.stats()["attended_tokens_per_step"] == pytest.approx(n + NEW / 2)


@pytest.mark.parametrize(
    "spec",
    [
        "icecache:search=summary:rerank=2",
        "icecache:search=summary:rerank=1:group_merge=max",
        DEVICE + ":rerank=4",
        DEVICE + ":rerank=4:rerank_unit=token",
        DEVICE + ":rerank=1:rerank_share=0.5",
        DEVICE + ":rerank=1:rerank_unit=token:rerank_share=0.5",
        DEVICE + ":rerank=1:rerank_unit=token:rerank_share=0.5:rerank_group=weight",
    ],
)
def test_rerank_full_budget_equals_dense_and_offloaded_equals_resident(spec):
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", 70, 70, NEW)
    cache = _cache(model, spec, 256, page_size=PAGE, sink=SINK, window=WINDOW)
    tokens, logits = greedy(model, prompt(70, seed=70), cache=cache, new=NEW)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    if "rerank_unit=token" in spec:  # offloaded, the candidates' keys cross from the host: the same selection
        want = greedy(model, prompt(120, seed=1), cache=_cache(model, spec, 96), new=4)
        got = greedy(model, prompt(120, seed=1), cache=_cache(model, spec, 96, offload=True), new=4)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)
    else:  # the page unit reads the candidate pages' keys in place
        with pytest.raises(ValueError, match="rerank_unit=token"):
            greedy(model, prompt(120, seed=1), cache=_cache(model, spec, 96, offload=True), new=2)


def test_rerank_ranks_the_candidate_pages_by_their_exact_max():
    """With every page a candidate, rerank picks the pages holding the group's best keys (the oracle's pages)."""
    g = torch.Generator().manual_seed(0)
    B, H, G, D, ps, n = 1, 1, 2, 8, 4, 64
    keys = torch.randn(B, H, n, D, generator=g)
    pages = span_pages(keys, ps, 16)  # consecutive positions, one page each
    q = torch.randn(B, H * G, D, generator=g)
    got = pages.select(q, pages.bound, 2 * ps, 2, "max", 1.0, keys, rerank=8)
    page_max = torch.einsum("gd,nd->gn", q[0], keys[0, 0]).view(G, -1, ps).amax(-1).amax(0)
    best = torch.topk(page_max, 2).indices
    want = (best[:, None] * ps + torch.arange(ps)).flatten()
    assert torch.equal(torch.sort(got[0, 0]).values, torch.sort(want).values)


def test_token_rerank_takes_the_best_tokens_of_every_candidate():
    """rerank_unit="token" with every page a candidate: the ``room`` tokens with the group's best q.k (the
    oracle's choice under the max over the group), whatever their pages."""
    g = torch.Generator().manual_seed(1)
    B, H, G, D, ps, n, room = 1, 1, 2, 8, 4, 64, 10
    keys = torch.randn(B, H, n, D, generator=g)
    pages = span_pages(keys, ps, 16)
    q = torch.randn(B, H * G, D, generator=g)
    got = pages.select(q, pages.bound, room, 2, "max", 1.0, keys, rerank=8, unit="token")
    want = torch.topk(torch.einsum("gd,nd->gn", q[0], keys[0, 0]).amax(0), room).indices
    assert got.shape == (1, 1, room)
    assert torch.equal(torch.sort(got[0, 0]).values, torch.sort(want).values)
    page_only = pages.select(q, pages.bound, room, 2, "max", 1.0, keys, rerank=8)
    assert not torch.equal(torch.sort(got[0, 0]).values, torch.sort(page_only[0, 0]).values)


def test_rerank_share_makes_every_page_a_candidate():
    """``share=1``: every page of the row is a candidate whatever ``rerank x cap`` is (here 2 of 16 pages), so the
    token unit takes the exact best tokens; without the share the 2 candidates miss some of them."""
    g = torch.Generator().manual_seed(2)
    B, H, G, D, ps, n, room = 2, 1, 2, 8, 4, 64, 10
    keys = torch.randn(B, H, n, D, generator=g)
    pages = span_pages(keys, ps, 16, rows=lambda j: torch.tensor([True, j < 10]))  # row 1 holds 10 pages
    q = torch.randn(B, H * G, D, generator=g)
    got = pages.select(q, pages.bound, room, 1, "max", 1.0, keys, rerank=2, unit="token", share=1.0)
    small = pages.select(q, pages.bound, room, 1, "max", 1.0, keys, rerank=2, unit="token")
    missed = 0
    for b, held in ((0, n), (1, 10 * ps)):
        exact = torch.einsum("gd,nd->gn", q[b], keys[b, 0, :held]).amax(0)
        want = torch.sort(torch.topk(exact, room).indices).values
        assert torch.equal(torch.sort(got[b, 0]).values, want), b
        missed += not torch.equal(torch.sort(small[b, 0][small[b, 0] >= 0]).values, want)
    assert missed  # 2 candidate pages (8 tokens) cannot hold 10 tokens: the share is what found them


@pytest.mark.parametrize("build", ["tree", "device"])
@pytest.mark.parametrize("summary", ["minmax", "centroid"])
def test_bounds_never_below_a_pages_true_max_and_every_token_in_one_page(summary, build):
    """After a prefill build and many insertions (a ragged batch, one sequence without a prefill middle)."""
    model, _ = shared_pair("qwen2")
    ids, mask, _ = left_padded([150, 40, 95], seed=3)
    cache = _cache(model, f"icecache:search=summary:summary={summary}:build={build}", 80)
    greedy(model, ids, mask, cache, new=70)
    pol, g = cache.policy, torch.Generator().manual_seed(0)
    for layer, pages in pol.summary_pages.pages.items():
        store = cache.layers[layer].store
        nmid = store.grid.num_middle_pages(store.lengths_host)
        C = pages.capacity
        pos, fill = pages.pos[:, :, :C].long(), pages.fill[:, :, :C].long()
        assert int(fill.max()) <= PAGE and torch.equal(fill, (pos >= 0).sum(-1))
        assert torch.equal(pages.npages, (fill > 0).sum(-1))
        q = torch.randn(store.batch, 4 * store.kv_heads, store.head_dim, generator=g) * 3
        bound = pages.scores(q, C).view(store.batch, store.kv_heads, 4, C)
        for b in range(store.batch):
            expect = torch.arange(SINK, SINK + int(nmid[b]) * PAGE)
            for h in range(store.kv_heads):
                held = pos[b, h][pos[b, h] >= 0]
                assert torch.equal(torch.sort(held).values, expect)  # every middle token in exactly one page
                k = store.k[b, h][pos[b, h].clamp(min=0)].float()  # [C, ps, D] (slot == position)
                qk = torch.einsum("gd,cpd->gcp", q[b, h * 4 : h * 4 + 4], k).masked_fill(pos[b, h] < 0, -torch.inf)
                true = qk.amax(-1)  # [4, C]
                live = fill[b, h] > 0
                assert bool((bound[b, h][:, ~live] == -torch.inf).all())
                # minmax: exact but for float32 rounding (the bound sums its terms in another order than q.k:
                # 3.8e-6 under a true max of 85 seen); centroid: a relative 1e-4
                slack = (1e-6 if summary == "minmax" else 1e-4) * float(true[:, live].abs().max())
                assert bool((bound[b, h][:, live] >= true[:, live] - slack).all()), (layer, b, h)


@pytest.mark.parametrize(
    "spec",
    SPECS
    + ["icecache:search=summary:group_merge=nsa", "icecache:search=summary:rerank=2", DEVICE]
    + [DEVICE + ":rerank=2:rerank_unit=token", DEVICE + ":rerank=1:rerank_share=0.5"],
)
def test_static_sizing_selects_what_dynamic_sizing_selects(spec):
    """store.static (CUDA-graph decoding: the whole page capacity scored, fixed width) == dynamic."""
    model, _ = shared_pair("llama_gqa")
    out = {}
    for static in (False, True):
        cache = _cache(model, spec, 96)
        log = []
        _observe(cache, log)
        ids = prompt(300, seed=2)
        with torch.no_grad():
            model(ids, **cache_kwargs(cache), use_cache=True)
        for lay in cache.layers:
            lay.store.static = static
        toks = torch.randint(2, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
        logits = []
        with torch.no_grad():
            for i in range(toks.shape[1]):
                logits.append(model(toks[:, i : i + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
        sets = [[torch.sort(p[0, h][v[0, h]]).values for h in range(p.shape[1])] for _, p, v in log]
        out[static] = (sets, torch.stack(logits))
    assert len(out[True][0]) == len(out[False][0])
    for a, b in zip(out[True][0], out[False][0], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", [SPECS[0], DEVICE])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_batch_equals_alone(offload, spec):
    model, _ = shared_pair("llama_gqa")
    ids, mask, prompts = left_padded([90, 60, 120], seed=10)
    cache = _cache(model, spec, 96, offload)
    tokens, logits = greedy(model, ids, mask, cache, new=50)
    assert cache.stats()["attended_tokens_per_step"] <= 96
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        t1, l1 = greedy(model, p[None], None, _cache(model, spec, 96, offload), new=50)
        assert torch.equal(tokens[i, width:], t1[0, len(p) :]), f"sequence {i} differs in the batch"
        torch.testing.assert_close(logits[:, i], l1[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", SPECS + [DEVICE])
def test_offload_equals_resident(spec):
    model, _ = shared_pair("qwen3")
    ids, mask, _ = left_padded([120, 5, 33], seed=8)
    out = {off: greedy(model, ids, mask, _cache(model, spec, 96, off), new=40) for off in (False, True)}
    assert torch.equal(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-4, rtol=0)


def test_a_joining_key_goes_to_its_nearest_page_if_it_has_room_else_one_new_page():
    ps, D = 4, 3
    e = torch.eye(D)
    one = torch.tensor([True])
    fresh = SemanticPages(1, 1, D, ps, 4, "centroid", torch.float32, "cpu")
    fresh.insert(torch.stack([e[0], e[0], e[1], e[1]])[None, None], torch.tensor([[20, 21, 22, 23]]), one)
    assert fresh.pos[0, 0, 0].tolist() == [20, 21, 22, 23] and int(fresh.npages) == 1  # no page yet: one new page
    fresh.insert(torch.zeros(1, 1, ps, D), torch.tensor([[40, 41, 42, 43]]), torch.tensor([False]))
    assert int(fresh.npages) == 1  # a sequence that got no page: nothing changes

    pages = SemanticPages(1, 1, D, ps, 4, "minmax", torch.float32, "cpu")
    pages.pos[0, 0, 0], pages.pos[0, 0, 1] = torch.tensor([0, 1, -1, -1]), torch.tensor([2, -1, -1, -1])
    pages.fill[0, 0, :2] = torch.tensor([2, 1])
    pages.a[0, 0, 0] = pages.b[0, 0, 0] = e[0]
    pages.a[0, 0, 1] = pages.b[0, 0, 1] = e[1]
    pages.npages.fill_(2)
    pages.rows.fill_(2)
    keys = torch.stack([e[1], e[0], e[0], e[0] * 0.9 + e[2] * 0.1])
    pages.insert(keys[None, None], torch.tensor([[5, 6, 7, 8]]), one)
    assert pages.pos[0, 0, 0].tolist() == [0, 1, 6, 7]  # the first two keys near e0 fill page 0's room
    assert pages.pos[0, 0, 1].tolist() == [2, 5, -1, -1]  # the key near e1 joins page 1
    assert pages.pos[0, 0, 2].tolist() == [8, -1, -1, -1]  # the one that did not fit: a new page
    assert pages.fill[0, 0, :4].tolist() == [4, 2, 1, 0] and int(pages.npages) == 3
    torch.testing.assert_close(pages.a[0, 0, 2], keys[3])
    torch.testing.assert_close(pages.b[0, 0, 0], e[0])
    torch.testing.assert_close(pages.b[0, 0, 1], e[1])


def test_graph_protocol():
    model, _ = shared_pair("llama_gqa")
    cache = _cache(model, SPECS[0], 96)
    pol = cache.policy
    assert pol.capturable and pol.graph_unsupported([]) is None
    ids = prompt(300, seed=2)
    with torch.no_grad():
        out = model(ids, **cache_kwargs(cache), use_cache=True)
    assert pol.graph_key([]) is None  # the prefill build is pending: the first step runs eagerly
    nxt = out.logits[:, -1:].argmax(-1)
    keys = []
    with torch.no_grad():
        for _ in range(20):
            nxt = model(nxt, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
            keys.append(pol.graph_key([]))
    assert keys[0] is not None and keys[0] == keys[-1]  # no growth in 20 steps: one capture serves them all
    host = kvdex.Cache(model, "icecache:search=host", budget=96).policy
    assert not host.capturable and "search=summary" in host.graph_unsupported([])


def test_bad_options_raise():
    for bad in (
        dict(search="summary", summary="box"),
        dict(search="summary", budget_rule="keys"),
        dict(search="host", group_merge="max"),
        dict(search="tree"),
        dict(search="summary", rerank=-1),
        dict(search="summary", rerank_unit="token"),  # no candidates to rank without rerank > 0
        dict(search="summary", rerank=4, rerank_unit="tokens"),
        dict(search="summary", rerank_share=0.5),  # a share of no rerank's candidates
        dict(search="summary", rerank=2, rerank_share=1.5),
        dict(search="host", rerank=2, rerank_share=0.5),  # the share sizes search="summary"'s candidates
        dict(build="device"),  # the device build makes search="summary"'s pages only
        dict(search="host", build="device"),
        dict(search="summary", build="gpu"),
        dict(search="summary", rerank=2, rerank_unit="token", rerank_group="sum"),
    ):
        with pytest.raises(ValueError):
            kvdex.make_policy("icecache", **bad)
    with pytest.raises(ValueError, match="add rerank_unit=token"):  # the weights rank tokens, not pages
        kvdex.make_policy("icecache", search="summary", rerank=2, rerank_group="weight")


@pytest.mark.parametrize("spec", SPECS)
def test_forks_share_the_page_table_and_decode_like_a_fresh_cache(spec):
    """A fork of a prefill whose table another fork made (Cache.fork's memo) copies that table instead of the
    prefill keys and trees, and decodes what a fresh cache decodes; the first fork's insertions never reach it."""
    from test_icecache import _decode_from_fork, _dense_prefill

    model, _ = shared_pair("llama_gqa")
    ids, mask, base, first = _dense_prefill(model)
    a = base.fork(policy=spec, budget=96)
    assert all(k is not None for _, k, _, _ in a.policy.tree_jobs.prefill_keys.values())
    _decode_from_fork(model, ids, mask, a, first, 30)  # makes the table (memo) and inserts into its own copy
    b = base.fork(policy=spec, budget=96)
    assert b.policy.tree_jobs.prefill_keys and all(k is None for _, k, _, _ in b.policy.tree_jobs.prefill_keys.values())
    fresh = kvdex.Cache(model, spec, budget=96, dense_layers=1)
    log_b, log_fresh = [], []
    _observe(b, log_b)
    _observe(fresh, log_fresh)
    t_fresh, l_fresh = greedy(model, ids, mask, fresh, new=31)
    t_b, l_b = _decode_from_fork(model, ids, mask, b, first, 30)
    assert torch.equal(t_b, t_fresh)
    torch.testing.assert_close(l_b, l_fresh[1:], atol=1e-5, rtol=0)
    assert len(log_b) == len(log_fresh) > 0
    for (l1, p1, v1), (l2, p2, v2) in zip(log_b, log_fresh, strict=True):
        assert l1 == l2
        assert torch.equal(p1.masked_fill(~v1, -1).sort(-1).values, p2.masked_fill(~v2, -1).sort(-1).values)
    for lay, pages in b.policy.summary_pages.pages.items():
        ref = fresh.policy.summary_pages.pages[lay]
        assert all(torch.equal(x, y) for x, y in zip(pages.tensors(), ref.tensors(), strict=True)), lay


def test_device_build_forks_share_the_table_and_decode_like_a_fresh_cache():
    """build=device: the first fork of a prefill builds the layer's table on the device and leaves it in the
    memo; a later fork (another budget, offloaded) copies it (no build), decodes what a fresh cache decodes, and
    the first fork's insertions never reach it."""
    from test_icecache import _decode_from_fork, _dense_prefill

    model, _ = shared_pair("llama_gqa")
    ids, mask, base, first = _dense_prefill(model)
    a = base.fork(policy=DEVICE, budget=96)
    assert a.policy.stats()["builds"] == 2 and a.policy.stats()["builds_reused"] == 0
    _decode_from_fork(model, ids, mask, a, first, 30)
    b = base.fork(policy=DEVICE, budget=64, offload=True)
    assert b.policy.stats()["builds"] == 0 and b.policy.stats()["builds_reused"] == 2
    fresh = kvdex.Cache(model, DEVICE, budget=64, offload=True, dense_layers=1)
    t_fresh, l_fresh = greedy(model, ids, mask, fresh, new=31)
    t_b, l_b = _decode_from_fork(model, ids, mask, b, first, 30)
    assert torch.equal(t_b, t_fresh)
    torch.testing.assert_close(l_b, l_fresh[1:], atol=1e-5, rtol=0)
    for lay, pages in b.policy.summary_pages.pages.items():
        ref = fresh.policy.summary_pages.pages[lay]
        assert all(torch.equal(x, y) for x, y in zip(pages.tensors(), ref.tensors(), strict=True)), lay
    assert fresh.stats()["policy_stats"]["semantic_store_per_dense_kv"] > 1.0


def test_device_build_draws_the_next_layers_promotions_ahead_with_its_seeds(monkeypatch):
    """build=device: each anchor layer's promotions are drawn with that layer's seeds, the first one inline and
    every later one on a worker thread while an earlier layer ran (submitted by the previous anchor's build)."""
    import threading

    from kvdex.policies.icecache import summary_pages

    calls = []

    def recording(params, seeds, n, d):
        calls.append((threading.current_thread().name, seeds.tolist(), n.tolist()))
        return promoted(params, seeds, n, d)

    monkeypatch.setattr(summary_pages, "promoted", recording)
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([260, 150], seed=7)
    cache = kvdex.Cache(model, DEVICE, budget=64, dense_layers=0, page_size=PAGE, sink=SINK, window=WINDOW)
    greedy(model, ids, mask, cache, new=2)
    pol = cache.policy
    anchors = sorted({a for a in pol.anchor_of.values()})
    assert len(anchors) >= 2 and pol.stats()["builds"] == len(anchors)
    heads = model.config.num_key_value_heads
    by_seeds = {tuple(c[1]): c[0] for c in calls}  # the worker may record before the inline call
    assert len(calls) == len(by_seeds) == len(anchors)
    threads = [by_seeds[tuple(torch.tensor(pol.tree_jobs.seeds(a, heads)).repeat(2).tolist())] for a in anchors]
    assert not threads[0].startswith("kvdex-dci-promote")
    assert all(t.startswith("kvdex-dci-promote") for t in threads[1:])
    assert all(c[2] == calls[0][2] for c in calls)
    assert not pol.summary_pages.promotions  # the last anchor submits none
