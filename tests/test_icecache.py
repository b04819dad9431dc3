"""IceCache through kvdex.Cache / generate: exactness at full budget, budget and page invariants,
semantic-page offload with bulk loading, ragged batches, the reuse variant, option errors."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, greedy, left_padded, prompt, reference_greedy, shared_pair, window_start

import kvdex
from kvdex import cache_kwargs
from kvdex.policies import make_policy
from kvdex.policies.icecache.tree_search import TreeSearch
from kvdex.selection import Selection
from kvdex.storage.semantic import SemanticOffloadStore

NEW = 56
ATOL = 1e-4

TREE = "icecache:search=auto"  # the paper's DCI-tree search (the default scores device pages)


@pytest.mark.parametrize("n", [70, 30], ids=["prompt70", "prompt30"])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "llama_mha", "qwen3"])
@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "reuse"])
def test_covering_budget_matches_sdpa(family, offload, n, reuse):
    """Budget >= context: every key is retrieved, so the output is transformers' own attention."""
    model, _ = shared_pair(family)
    ref_tokens, ref_logits = reference_greedy(family, n, n, NEW)
    cache = kvdex.Cache(
        model, TREE, budget=256, page_size=PAGE, sink=SINK, window=WINDOW, offload=offload,
        dense_layers=1, reuse=reuse,
    )  # fmt: skip
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=NEW)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.stats()["attended_tokens_per_step"] == pytest.approx(n + NEW / 2)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_exact_parents_at_a_covering_budget_match_sdpa(offload):
    """parents="exact" builds other trees (the prefill's and the decode-time insertions), the same invariant."""
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", 70, 70, NEW)
    cache = kvdex.Cache(model, TREE + ":parents=exact", budget=256, page_size=PAGE, sink=SINK, window=WINDOW,
                        offload=offload, dense_layers=1)  # fmt: skip
    tokens, logits = greedy(model, prompt(70, seed=70), cache=cache, new=NEW)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.policy.params.parents == "exact"


def _observe(cache, log):
    def obs(layer, q, store, aset, scale):
        log.append((layer, aset.positions.clone(), aset.valid.clone(), store.lengths_host.clone()))

    cache.observer = obs


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_selection_is_whole_semantic_pages_within_budget(offload):
    """Every selection is whole leaf pages of the tree snapshot it was searched in."""
    model, _ = shared_pair("llama_gqa")
    budget = 96
    cache = kvdex.Cache(model, TREE, budget=budget, offload=offload, dense_layers=1)
    log = []
    _observe(cache, log)
    pol = cache.policy
    snaps = []
    select = pol.select

    def spy(q, view):  # the tree snapshots each selection was made from
        sel = select(q, view)
        snaps.append((view.layer, list(pol.tree_jobs.trees[view.layer]), sel.tokens.cpu()))
        return sel

    pol.select = spy
    greedy(model, prompt(300, seed=2), cache=cache, new=40)
    retrieval = budget - SINK - WINDOW
    for _, _, valid, _ in log:
        assert int(valid.sum(-1).max()) <= budget  # sink + window + selection never exceed the budget
    n_checked = 0
    for _, trees, tokens in snaps:
        for h, tree in enumerate(trees):
            t = tokens[0, h]
            t = t[t >= 0]
            assert t.numel() == torch.unique(t).numel() <= retrieval
            known = torch.isin(t, tree.pos)
            # Algorithm 1: a page leaving the window during this step is not selectable yet
            assert bool(known.all())
            pages = torch.unique(_pages_of(tree, t[known]))
            whole = tree.page_positions(pages)
            assert torch.equal(torch.sort(whole[whole >= 0]).values, torch.sort(t[known]).values)
            n_checked += 1
    assert n_checked > 50
    st = pol.stats()
    assert st["queries"] > 0 and st["pages_selected"] > 0


def test_search_asks_for_the_budget_many_keys_and_attends_within_the_budget(monkeypatch):
    """Alg. 3's k is the cache budget: every query head's M-DCI search asks for the top-``budget``
    keys with a beam of at least ``budget`` points (k = budget - sink - window, 16 at budget 64,
    missed the passkey on Qwen); the pages attended still fit budget - sink - window tokens."""
    from kvdex.index.dci import DCITree

    model, _ = shared_pair("llama_gqa")
    calls = []
    orig = DCITree.search

    def spy(self, Xq, k, stop_level, fov, prop, collect_all=False):
        if collect_all:  # page selection (insertions search for parents with k = 1)
            calls.append((k, fov))
        return orig(self, Xq, k, stop_level, fov, prop, collect_all)

    monkeypatch.setattr(DCITree, "search", spy)
    for budget in (64, 80):
        calls.clear()
        cache = kvdex.Cache(model, TREE, budget=budget, dense_layers=1)
        log = []
        _observe(cache, log)
        greedy(model, prompt(400, seed=3), cache=cache, new=12)
        assert calls and all(k == budget and fov == budget for k, fov in calls)
        assert max(int(valid.sum(-1).max()) for _, _, valid, _ in log) <= budget
    calls.clear()
    cache = kvdex.Cache(model, "icecache:search=auto:topk=24:query_fov=40", budget=64, dense_layers=1)
    greedy(model, prompt(400, seed=3), cache=cache, new=4)
    assert calls and all(c == (24, 40) for c in calls)


@pytest.mark.parametrize("chunks", [2, 0], ids=["two", "auto"])
def test_query_heads_split_over_threads_select_the_same_pages(chunks):
    """``query_chunks``: a tree's group of query heads searched in several tasks selects exactly
    what one batched search selects (the rows of a search are independent)."""
    model, _ = shared_pair("qwen3")
    logs = []
    # query_chunks=0 (auto): 4 threads // 2 trees = 2
    for spec in ("icecache:search=auto:threads=4", f"icecache:search=auto:threads=4:query_chunks={chunks}"):
        cache = kvdex.Cache(model, spec, budget=64, dense_layers=1)
        log = []
        _observe(cache, log)
        out = greedy(model, prompt(300, seed=5), cache=cache, new=20)
        logs.append((out, log))
    (t1, l1), log1 = logs[0]
    (t2, l2), log2 = logs[1]
    assert torch.equal(t1, t2)
    torch.testing.assert_close(l1, l2, atol=0, rtol=0)
    for (_, p1, v1, _), (_, p2, v2, _) in zip(log1, log2, strict=True):
        assert torch.equal(torch.sort(p1[v1]).values, torch.sort(p2[v2]).values)


def test_nsa_group_merge_orders_pages_by_importance_summed_over_the_group():
    """``group_merge="nsa"``: when the group's union does not fit, pages go by the softmax weight of
    their retrieved keys summed over the group's heads (rank-major would favour head 0)."""
    from kvdex.index.dci import DCIParams, DCITree
    from kvdex.index.pages import nsa_order as _nsa_order

    tree = DCITree.build(torch.randn(200, 8), torch.arange(200), DCIParams(page_size=4, promotion_ratio=0.25))
    p0, p1, p2 = (int(tree.page_pts[i, 0]) for i in range(3))  # a key in each of three pages
    ids = torch.tensor([[p0, p2], [p1, p2]])  # head 0: p0 then p2; head 1: p1 then p2
    qk = torch.tensor([[1.0, 0.9], [9.0, 0.0]])  # head 1 is sure of p1; p2 collects weight from both heads
    order = _nsa_order(tree, ids, qk, 1.0).tolist()
    # weights: p0 .525, p2 .475 + .0001, p1 .9999 -> page of p1, then p0, then p2
    assert order == [int(tree.pt_page[p1]), int(tree.pt_page[p0]), int(tree.pt_page[p2])]
    assert _nsa_order(tree, torch.full((2, 2), -1), torch.full((2, 2), float("-inf")), 1.0).numel() == 0
    # through the cache: whole pages, within the budget
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "icecache:search=auto:group_merge=nsa", budget=80, dense_layers=1)
    log = []
    _observe(cache, log)
    greedy(model, prompt(300, seed=4), cache=cache, new=12)
    assert max(int(valid.sum(-1).max()) for _, _, valid, _ in log) <= 80


def test_budget_rule_keys_attends_every_page_of_the_retrieved_keys():
    """``budget_rule="keys"`` (the paper's accounting): every page of the ordered list is attended,
    however many tokens; the default ("tokens") takes a prefix-fitting subset within the room."""
    from kvdex.index.dci import DCIParams, DCITree

    tree = DCITree.build(torch.randn(200, 8), torch.arange(200), DCIParams(page_size=4, promotion_ratio=0.25))
    ordered = torch.randperm(tree.page_fill.numel(), generator=torch.Generator().manual_seed(0))[:12]
    ordered = ordered[tree.page_fill[ordered] > 0]
    keys, tok = TreeSearch(64, 1000, budget_rule="keys"), TreeSearch(64, 1000, max_pages=1000)
    every = set(tree.page_positions(ordered).flatten().tolist()) - {-1}
    got_keys = keys.take_pages(tree, ordered, room=10)
    got_tok = tok.take_pages(tree, ordered, room=10)
    assert set(got_keys.tolist()) == every and got_keys.numel() == int(tree.page_fill[ordered].sum())
    assert got_tok.numel() <= 10 and set(got_tok.tolist()) <= every
    # through the cache: whole pages, and more than the budget on some step
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "icecache:search=auto:budget_rule=keys", budget=64, dense_layers=1)
    log = []
    _observe(cache, log)
    tokens, logits = greedy(model, prompt(400, seed=3), cache=cache, new=8)
    assert max(int(valid.sum(-1).max()) for _, _, valid, _ in log) > 64
    off = kvdex.Cache(model, "icecache:search=auto:budget_rule=keys", budget=64, dense_layers=1, offload=True)
    tokens_off, logits_off = greedy(model, prompt(400, seed=3), cache=off, new=8)  # the semantic store grows
    assert torch.equal(tokens, tokens_off)
    torch.testing.assert_close(logits, logits_off, atol=0, rtol=0)


def _pages_of(tree, positions):
    order = torch.argsort(tree.pos)
    at = torch.searchsorted(tree.pos[order], positions)
    return tree.pt_page[order[at]]


def test_every_middle_token_is_in_exactly_one_page_after_decoding():
    model, _ = shared_pair("qwen2")
    ids, mask, prompts = left_padded([150, 40, 95], seed=3)
    cache = kvdex.Cache(model, TREE, budget=80, dense_layers=1)
    greedy(model, ids, mask, cache, new=70)
    cache.policy.flush()
    store = cache.layers[1].store
    nmid = store.grid.num_middle_pages(store.lengths_host)
    for b in range(3):
        expect = torch.arange(SINK, SINK + int(nmid[b]) * PAGE)
        for h in range(store.kv_heads):
            tree = cache.policy.tree_jobs.trees[1][b * store.kv_heads + h]
            if expect.numel() == 0:
                assert tree is None
                continue
            got = tree.page_positions(torch.arange(tree.num_pages))
            got = got[got >= 0]
            assert torch.equal(torch.sort(got).values, expect)
            assert int(tree.page_fill.max()) <= PAGE


def test_offload_keeps_semantic_pages_physically_and_bulk_loads_only_missing_pages():
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, TREE, budget=96, offload=True, dense_layers=1)
    greedy(model, prompt(260, seed=4), cache=cache, new=30)
    cache.policy.flush()
    store = cache.layers[1].store
    assert isinstance(store, SemanticOffloadStore)
    k, v = store.dense()
    for h in range(store.kv_heads):
        tree = cache.policy.tree_jobs.trees[1][h]
        for p in range(tree.num_pages):
            f = int(tree.page_fill[p])
            pos = tree.page_positions(torch.tensor([p]))[0, :f]
            torch.testing.assert_close(store.sem[0, h, p, 0, :f], k[0, h, pos], atol=0, rtol=0)
            torch.testing.assert_close(store.sem[0, h, p, 1, :f], v[0, h, pos], atol=0, rtol=0)
    # the same selection twice: the second time every page is resident, nothing crosses
    tree = cache.policy.tree_jobs.trees[1][0]
    toks = tree.page_positions(torch.arange(min(3, tree.num_pages))).flatten()
    toks = toks[toks >= 0]
    sel = Selection(tokens=toks.expand(1, store.kv_heads, -1).contiguous())
    a1 = store.attend(sel)
    bytes1, calls1 = store.stats.h2d_bytes, store.stats.h2d_calls
    a2 = store.attend(sel)
    assert store.stats.h2d_bytes == bytes1 and store.stats.h2d_calls == calls1
    assert torch.equal(a1.idx, a2.idx)
    # the attended rows are exactly the selected tokens' keys
    got = a2.k[0, 0, a2.idx[0, 0][a2.valid[0, 0]]]
    want = k[0, 0, a2.positions[0, 0][a2.valid[0, 0]]]
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_bit_identical_to_device(dtype):
    """Same trees, same selection: semantic pages + bulk loading change no bit of the output
    (only the slot order of the attended set differs, which the fp32 softmax does not see here)."""
    model = copy.deepcopy(shared_pair("qwen3")[0]).to(dtype)  # the shared pair's weights stay fp32
    ids, mask, _ = left_padded([120, 5, 33], seed=8)
    out = {}
    for offload in (False, True):
        cache = kvdex.Cache(model, TREE, 96, offload=offload, dense_layers=1)
        out[offload] = greedy(model, ids, mask, cache, new=40)
    assert torch.equal(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_batch_equals_alone(offload):
    model, _ = shared_pair("llama_gqa")
    lengths = [90, 60, 120]
    ids, mask, prompts = left_padded(lengths, seed=10)
    cache = kvdex.Cache(model, TREE, budget=96, offload=offload, dense_layers=1)
    tokens, logits = greedy(model, ids, mask, cache, new=50)
    assert cache.stats()["attended_tokens_per_step"] <= 96
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = kvdex.Cache(model, TREE, budget=96, offload=offload, dense_layers=1)
        t1, l1 = greedy(model, p[None], None, alone, new=50)
        assert torch.equal(tokens[i, width:], t1[0, len(p) :]), f"sequence {i} differs in the batch"
        torch.testing.assert_close(logits[:, i], l1[:, 0], atol=1e-4, rtol=0)


def test_reuse_indexes_anchor_layers_only_and_shares_their_selection():
    model, _ = shared_pair("llama_gqa")  # 3 layers, dense_layers=0: sparse 0,1,2 -> anchors 0 (every 2)
    cache = kvdex.Cache(model, TREE, budget=96, dense_layers=0, reuse=True, reuse_every=2)
    log = []
    _observe(cache, log)
    greedy(model, prompt(200, seed=6), cache=cache, new=20)
    pol = cache.policy
    assert pol.anchor_of == {0: 0, 1: 0, 2: 2}
    assert set(pol.tree_jobs.trees) == {0, 2}
    by_step = {}
    for layer, pos, valid, _ in log:
        by_step.setdefault(layer, []).append(torch.sort(pos[valid]).values)
    for a, b in zip(by_step[0], by_step[1], strict=True):
        assert torch.equal(a, b)


def test_registered_and_bad_options_raise():
    assert "icecache" in kvdex.policies()
    for bad in (
        dict(promotion_ratio=1.5),
        dict(promotion_ratio=-0.1),
        dict(query_prop=0.0),
        dict(construction_prop=2.0),
        dict(num_comp=0),
        dict(num_simp=2.5),
        dict(topk=-1),
        dict(max_pages=-2),
        dict(reuse_every=0),
        dict(norm_margin=0.5),
        dict(query_chunks=-1),
        dict(group_merge="sum"),
        dict(budget_rule="pages"),
        dict(parents="nearest"),
    ):
        with pytest.raises(ValueError):
            make_policy("icecache", **bad)
    with pytest.raises(ValueError, match="parents must be one of dci, exact, got 'knn'"):
        make_policy("icecache:search=auto:parents=knn")
    with pytest.raises(TypeError, match="no option"):
        make_policy("icecache", ratio=0.1)
    p = make_policy("icecache:search=auto:promotion_ratio=0.125:reuse=True")
    assert p.promotion_ratio == 0.125 and p.reuse is True


def _tree_tensors(tree):
    return {
        f: getattr(tree, f).clone()
        for f in ("X", "proj", "pos", "top", "root", "page_pts", "page_fill", "node_last_page", "pt_page", "pt_slot")
    } | {
        f"{f}{i}": t.clone()
        for f in ("parent", "kids", "kid_start", "kid_count")
        for i, t in enumerate(getattr(tree, f))
    }


def _same_tree(a, b) -> bool:
    ta, tb = _tree_tensors(a), _tree_tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _dense_prefill(model):
    """A ragged batch of two prompts prefilled densely once (the prefill its forks share) and the first
    greedy token: (ids, mask, the ``full`` cache, first token [B, 1])."""
    from conftest import positions

    ids, mask, _ = left_padded([260, 150], seed=7)
    base = kvdex.Cache(model, "full", budget=64, dense_layers=1)
    with torch.no_grad():
        last = model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(base)).logits[:, -1]
    return ids, mask, base, last.argmax(-1, keepdim=True)


def _decode_from_fork(model, ids, mask, fork, first, new):
    ids2 = torch.cat([ids, first], dim=1)
    mask2 = torch.cat([mask, torch.ones_like(first)], dim=1)
    return greedy(model, ids2, mask2, fork, new=new)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_forks_share_the_prefill_trees_and_decode_like_a_fresh_cache(offload):
    """Forks of one prefill reuse its trees (no rebuild) and select exactly what a freshly built
    cache selects; a fork's insertions never reach the shared trees, the original or a sibling."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, base, first = _dense_prefill(model)
    a = base.fork(policy=TREE, budget=96, offload=offload)
    b = base.fork(policy=TREE, budget=64, offload=offload)  # another budget: the trees do not depend on it
    a.policy.flush()
    b.policy.flush()
    assert a.policy.stats()["builds"] == 2 and a.policy.stats()["builds_reused"] == 0
    assert b.policy.stats()["builds"] == 0 and b.policy.stats()["builds_reused"] == 2
    before = {lay: [_tree_tensors(t) for t in a.policy.tree_jobs.trees[lay]] for lay in (1, 2)}
    for lay in (1, 2):
        assert all(x is y for x, y in zip(a.policy.tree_jobs.trees[lay], b.policy.tree_jobs.trees[lay], strict=True))

    # the trees equal a freshly built cache's, and so do the decoded tokens, logits and selections
    fresh = kvdex.Cache(model, TREE, budget=64, offload=offload, dense_layers=1)
    log_fresh, log_b = [], []
    _observe(fresh, log_fresh)
    t_fresh, l_fresh = greedy(model, ids, mask, fresh, new=41)
    _observe(b, log_b)
    t_b, l_b = _decode_from_fork(model, ids, mask, b, first, 40)
    assert torch.equal(t_b, t_fresh)
    torch.testing.assert_close(l_b, l_fresh[1:], atol=1e-5, rtol=0)
    assert len(log_b) == len(log_fresh) == 2 * 40  # 40 decode steps x 2 sparse layers in both
    for (lay1, p1, v1, _), (lay2, p2, v2, _) in zip(log_b, log_fresh, strict=True):
        assert lay1 == lay2
        for bb in range(p1.shape[0]):
            for h in range(p1.shape[1]):
                assert torch.equal(torch.sort(p1[bb, h][v1[bb, h]]).values, torch.sort(p2[bb, h][v2[bb, h]]).values)
    b.policy.flush()
    assert b.policy.stats()["inserts"] > 0  # b inserted evicted window pages into its own trees

    # isolation: b's insertions left the shared trees (held by a) untouched; a decodes as fresh too
    for lay in (1, 2):
        for t, snap in zip(a.policy.tree_jobs.trees[lay], before[lay], strict=True):
            assert _tree_tensors(t).keys() == snap.keys()
            assert all(torch.equal(_tree_tensors(t)[k], snap[k]) for k in snap)
        assert b.policy.tree_jobs.trees[lay][0].n > a.policy.tree_jobs.trees[lay][0].n
    fresh96 = kvdex.Cache(model, TREE, budget=96, offload=offload, dense_layers=1)
    t_f96, _ = greedy(model, ids, mask, fresh96, new=21)
    t_a, _ = _decode_from_fork(model, ids, mask, a, first, 20)
    assert torch.equal(t_a, t_f96)
    # a sibling forked after the others decoded still starts from the prefill trees
    c = base.fork(policy=TREE, budget=64, offload=offload)
    c.policy.flush()
    assert c.policy.stats()["builds_reused"] == 2
    for lay in (1, 2):
        for t, snap in zip(c.policy.tree_jobs.trees[lay], before[lay], strict=True):
            assert all(torch.equal(_tree_tensors(t)[k], snap[k]) for k in snap)


def test_forks_with_other_tree_settings_build_their_own():
    model, _ = shared_pair("llama_gqa")
    ids = prompt(200, seed=7)
    src = kvdex.Cache(model, TREE, budget=96)  # an icecache source shares its own prefill build
    with torch.no_grad():
        model(ids, **cache_kwargs(src), use_cache=True)
    same = src.fork(budget=64)
    other_seed = src.fork(policy=TREE + ":seed=3", budget=96)
    other_r = src.fork(policy=TREE + ":promotion_ratio=0.25", budget=96)
    other_grid = src.fork(budget=96, page_size=8, window=32)
    exact = src.fork(policy=TREE + ":parents=exact", budget=96)
    for c in (src, same, other_seed, other_r, other_grid, exact):
        c.policy.flush()
    assert same.policy.stats()["builds_reused"] == 1 and same.policy.stats()["builds"] == 0
    assert same.policy.tree_jobs.trees[2][0] is src.policy.tree_jobs.trees[2][0]
    assert (
        exact.policy.tree_jobs.trees[2][0].params.parents == "exact"
        and src.policy.tree_jobs.trees[2][0].params.parents == "dci"
    )
    for c in (other_seed, other_r, other_grid, exact):
        assert c.policy.stats()["builds"] == 1 and c.policy.stats()["builds_reused"] == 0
        assert c.policy.tree_jobs.trees[2][0] is not src.policy.tree_jobs.trees[2][0]
    assert not torch.equal(other_seed.policy.tree_jobs.trees[2][0].top, src.policy.tree_jobs.trees[2][0].top)
    assert other_grid.policy.tree_jobs.trees[2][0].params.page_size == 8


def test_prefill_index_is_built_off_the_main_thread_and_joined_at_the_first_select():
    """Figure 5b: ``index`` at prefill only submits the build; the layer's first ``select`` joins it."""
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, TREE, budget=96, dense_layers=1, threads=2)
    with torch.no_grad():
        model(prompt(200, seed=9), **cache_kwargs(cache), use_cache=True)
    pol = cache.policy
    assert set(pol.tree_jobs.jobs) == {1, 2} and all(len(q) == 1 for q in pol.tree_jobs.jobs.values())
    assert pol.tree_jobs.trees == {}  # nothing applied on the main thread during the prefill
    with torch.no_grad():
        model(torch.tensor([[5]]), **cache_kwargs(cache), use_cache=True)  # one decode step
    assert set(pol.tree_jobs.trees) == {1, 2}
    st = pol.stats()
    middle = window_start(200) - SINK  # tokens indexed per (layer, kv head) at prefill
    assert st["builds"] == 2 and st["build_keys"] == 2 * 2 * middle


def test_eval_harness_runs_icecache_by_name_in_both_storage_modes(tmp_path):
    """``kvdex eval recall --policies icecache``: same recall with the KV on the device or offloaded
    into semantic pages (the harness reads the attended set from the store)."""
    from kvdex.eval import data
    from kvdex.eval.recall import RecallTask
    from kvdex.eval.runner import EvalConfig, run_task
    from kvdex.hf.testing import byte_tokenizer, tiny_llama

    if data.data_root(required=False) is None:
        pytest.skip("evaluation data not found (set KVDEX_DATA)")
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    got = []
    for offload in (False, True):
        cfg = EvalConfig("tiny", [TREE], [64], [384], out=str(tmp_path / str(offload)), offload=offload, progress=False)
        got.append({(r.policy, r.budget): r.metrics for r in run_task(RecallTask(steps=2), model, tok, cfg)})
    ice = got[0][(TREE, 64)]
    assert 0 < ice["recall"] < 1
    for metric in ("recall", "topk_hit", "rel_l2"):
        assert got[1][(TREE, 64)][metric] == pytest.approx(ice[metric], abs=1e-6), metric


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_semantic_offload_matches_resident(dtype, monkeypatch):
    """On the GPU: pinned semantic pages, async key copies to the index threads, bulk loading with
    residency; same tokens as the GPU-resident store, and the full budget equals sdpa."""
    import copy

    from conftest import build_pair

    monkeypatch.setenv("KVDEX_PAGED", "0")  # the same decode kernel for both stores
    model, ref = build_pair("llama_gqa")
    model = copy.deepcopy(model).cuda().to(dtype)
    ids, mask, _ = left_padded([150, 97, 40], seed=2)
    ids, mask = ids.cuda(), mask.cuda()
    out = {}
    for offload in (False, True):
        cache = kvdex.Cache(model, TREE, budget=96, offload=offload, dense_layers=1)
        out[offload] = greedy(model, ids, mask, cache, new=60)
    assert torch.equal(out[True][0], out[False][0])
    assert cache.transfer.fields["icecache_pages_loaded"] > 0
    assert cache.transfer.fields["icecache_pages_reused"] > 0
    if dtype == torch.float32:
        ref = ref.cuda()
        p = prompt(80, seed=1).cuda()
        want = greedy(ref, p, new=40)
        got = greedy(model, p, cache=kvdex.Cache(model, TREE, budget=512, offload=True, dense_layers=1), new=40)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=0)
