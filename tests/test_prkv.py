"""``prkv``: the hybrid static + dynamic selection and the page restructuring behind it.

Invariants: the restructuring (``store.permute_middle``) keeps every token exactly once and leaves
attention unchanged, on the device and in host pages; S = 0 is ArkVale bit for bit; S = 1 is SnapKV+
(same tokens, same outputs); the static set is rebuilt exactly every T decode steps and is the
top-k of the observation-window scores, at the front of the middle; the dynamic pages never
overlap it and the attended set never exceeds the budget; a covering budget reproduces dense
attention; bad options raise ValueError.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, greedy, left_padded, prompt, reference_greedy, shared_pair, window_start

import kvdex
from kvdex.kernels import sparse_decode_attention
from kvdex.policies.digest import DigestIndex
from kvdex.policies.observation import middle_scores
from kvdex.policies.prkv import split_budget
from kvdex.selection import Selection
from kvdex.storage import DeviceStore, Grid, OffloadStore, TransferStats
from kvdex.view import LayerView

BUDGET = 96
R = BUDGET - SINK - WINDOW  # 48 retrieval tokens


def test_split_budget():
    assert split_budget(208, 16, 0.0) == (0, 13)
    assert split_budget(208, 16, 1.0) == (208, 0)
    assert split_budget(208, 16, 0.25) == (48, 10)  # 52 rounded down to whole pages
    assert split_budget(208, 16, 0.5) == (96, 7)
    assert split_budget(80, 16, 0.75) == (48, 2)
    assert split_budget(52, 16, 0.5) == (20, 2)  # 16 + the 4 tokens no page can use
    assert split_budget(52, 16, 1.0) == (52, 0)
    for r in (16, 48, 52, 80, 208):
        for s in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
            st, dy = split_budget(r, 16, s)
            assert st + dy * 16 <= r and r - st - dy * 16 < 16 and st >= 0


# ---- relocation in storage ------------------------------------------------------------------------


def _filled_store(cls, lengths, seed=0):
    """A store holding k/v whose channel 0 is the token's position (so moves are traceable)."""
    g = Grid(SINK, PAGE, WINDOW // PAGE)
    b, h, d = len(lengths), 2, 8
    extra = {"work_tokens": 64} if cls is OffloadStore else {}
    store = cls(g, b, h, d, torch.float32, "cpu", TransferStats(), **extra)
    L = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, L, d, generator=gen)
    v = torch.randn(b, h, L, d, generator=gen)
    k[..., 0] = torch.arange(L, dtype=torch.float32)
    v[..., 0] = torch.arange(L, dtype=torch.float32) + 1000 * torch.arange(h)[:, None]
    store.ingest(k, v, torch.tensor(lengths))
    return store, k, v


def _random_order(store, gen):
    g = store.grid
    own = (g.num_middle_pages(store.lengths_host) * g.page_size).tolist()
    m = max(own)
    order = torch.arange(m).repeat(store.batch, store.kv_heads, 1)
    for b, n in enumerate(own):
        for h in range(store.kv_heads):
            order[b, h, :n] = torch.randperm(n, generator=gen)
    return order


@pytest.mark.parametrize("cls", [DeviceStore, OffloadStore], ids=["device", "offload"])
def test_permute_middle_keeps_every_token_once_and_attention(cls):
    lengths = [150, 97, 64]
    store, k0, v0 = _filled_store(cls, lengths)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=gen)
    everything = Selection(everything=True)
    a = store.attend(everything)
    before = sparse_decode_attention(q, a.k, a.v, a.idx, a.valid, 0.3)
    total = None
    for _ in range(3):  # repeated restructurings compose
        order = _random_order(store, gen)
        store.permute_middle(order)
        total = order if total is None else total.gather(2, order)
    k, v = store.dense()
    g = store.grid
    for b, n in enumerate(lengths):
        m = int(g.num_middle_pages(torch.tensor(n))) * PAGE
        for h in range(2):
            pos = k[b, h, :n, 0].long()
            assert sorted(pos.tolist()) == list(range(n))  # every token exactly once
            assert torch.equal(pos[:SINK], torch.arange(SINK)) and torch.equal(
                pos[SINK + m :], torch.arange(SINK + m, n)
            )
            want = SINK + total[b, h, :m]
            assert torch.equal(pos[SINK : SINK + m], want)  # slot j holds what order sent there
            assert torch.equal(k[b, h, :n], k0[b, h, pos]) and torch.equal(v[b, h, :n], v0[b, h, pos])  # rows whole
    a = store.attend(everything)
    after = sparse_decode_attention(q, a.k, a.v, a.idx, a.valid, 0.3)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cls", [DeviceStore, OffloadStore], ids=["device", "offload"])
def test_permute_middle_rejects_bad_orders(cls):
    store, _, _ = _filled_store(cls, [150, 97])
    m = int(store.grid.num_middle_pages(store.lengths_host).max()) * PAGE
    ok = torch.arange(m).repeat(2, 2, 1)
    with pytest.raises(ValueError, match="integer tensor"):
        store.permute_middle(ok[:, :, :-1])
    dup = ok.clone()
    dup[0, 0, 1] = 0
    with pytest.raises(ValueError, match="permutation"):
        store.permute_middle(dup)
    tail = ok.clone()
    tail[1, 0, [0, m - 1]] = tail[1, 0, [m - 1, 0]]  # moves a slot past sequence 1's middle
    with pytest.raises(ValueError, match="in place"):
        store.permute_middle(tail)
    with pytest.raises(ValueError, match="integer tensor"):
        store.permute_middle(ok.float())
    out = ok.clone()
    out[0, 1, 2] = m  # names a slot that does not exist (and leaves slot 2 out)
    with pytest.raises(ValueError, match="permutation"):
        store.permute_middle(out)
    neg = ok.clone()
    neg[1, 1, 0] = -1
    with pytest.raises(ValueError, match="permutation"):
        store.permute_middle(neg)


# ---- S = 0 and S = 1 -------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
def test_s0_is_arkvale_exactly(family, offload):
    model, _ = shared_pair(family)
    ids, mask, _ = left_padded([130, 90], seed=5)
    out = {}
    for name, opts in (("arkvale", {}), ("prkv", {"static_ratio": 0.0, "refresh": 8, "rerank": 0})):
        cache = kvdex.Cache(model, name, budget=BUDGET, offload=offload, dense_layers=1, **opts)
        out[name] = greedy(model, ids, mask, cache=cache, new=40)
    assert torch.equal(out["prkv"][1], out["arkvale"][1])  # bit for bit
    assert torch.equal(out["prkv"][0], out["arkvale"][0])


@pytest.mark.parametrize("kernel", [1, 7])
def test_s1_is_snapkv_plus(kernel):
    """Same queries, same KV, two stores: PRKV (S = 1) relocates, SnapKV+ does not; every step both
    attend the same tokens (positions) and produce the same output."""
    from kvdex.policies import PolicyInfo, make_policy
    from kvdex.storage import MiddleUpdate

    lengths = [170, 120]
    gen = torch.Generator().manual_seed(3)
    stores = [_filled_store(DeviceStore, lengths, seed=2)[0] for _ in range(2)]
    T, W, hq, d = 5, 16, 4, 8
    pols = [
        make_policy("prkv", static_ratio=1.0, refresh=T, obs=W, kernel=kernel),
        make_policy("snapkv", refresh=T, obs=W, kernel=kernel),
    ]
    info = PolicyInfo(kvdex.CacheConfig(budget=BUDGET), 2, (1,), hq, 2, d)
    obs = torch.randn(2, hq, W, d, generator=gen)
    valid = torch.ones(2, W, dtype=torch.bool)
    for pol, st in zip(pols, stores, strict=True):
        pol.bind(info)
        nmid = st.grid.num_middle_pages(st.lengths_host)
        upd = st._middle_update(torch.zeros_like(nmid), nmid, st.k, st.v)
        pol.index(1, MiddleUpdate(upd.start, upd.count, upd.keys, upd.values, obs, valid))
    for step in range(23):
        kn, vn = torch.randn(2, 2, 1, d, generator=gen), torch.randn(2, 2, 1, d, generator=gen)
        q = 2 * torch.randn(2, hq, d, generator=gen)
        outs, sets = [], []
        for pol, st in zip(pols, stores, strict=True):
            upd = st.append(kn, vn)
            if not upd.empty:
                pol.index(1, upd)
            sel = pol.select(q, LayerView.of(1, st, 0.3, pol.cfg))
            a = st.attend(sel)
            outs.append(sparse_decode_attention(q, a.k, a.v, a.idx, a.valid, 0.3))
            pos = a.positions if pol.name == "snapkv" else pol.positions(1, a.positions)
            sets.append([[sorted(pos[b, h][a.valid[b, h]].tolist()) for h in range(2)] for b in range(2)])
        assert sets[0] == sets[1], f"step {step}"
        for b in range(2):
            for h in range(2):
                assert len(sets[0][b][h]) == len(set(sets[0][b][h])) <= BUDGET
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert pols[0].schedule.refreshes[1] == pols[1].schedule.refreshes[1] == [5, 10, 15, 20]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_s1_is_snapkv_plus_in_a_model(offload):
    model, _ = shared_pair("llama_gqa")
    ids = prompt(140, seed=8)
    out = {}
    for name, opts in (
        ("snapkv", {"refresh": 6, "obs": 16, "kernel": 1}),
        ("prkv", {"static_ratio": 1.0, "refresh": 6, "obs": 16}),
    ):
        cache = kvdex.Cache(model, name, budget=BUDGET, offload=offload, dense_layers=1, **opts)
        out[name] = greedy(model, ids, cache=cache, new=30)
    torch.testing.assert_close(out["prkv"][1], out["snapkv"][1], atol=1e-4, rtol=0)
    assert torch.equal(out["prkv"][0], out["snapkv"][0])


# ---- the hybrid during decoding ------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("static_ratio,relocate", [(0.25, "shift"), (0.5, "shift"), (0.75, "shift"), (0.25, "swap"),
                                                   (0.75, "swap")])  # fmt: skip
def test_refresh_every_T_static_front_dynamic_disjoint(static_ratio, relocate, offload):
    model, _ = shared_pair("qwen2")
    T, W = 7, 16
    lengths = [150, 110]
    ids, mask, _ = left_padded(lengths, seed=12)
    budget = 112  # 64 retrieval tokens: S = 0.25 / 0.5 / 0.75 -> 1 / 2 / 3 static pages
    opts = dict(static_ratio=static_ratio, refresh=T, obs=W, relocate=relocate)
    cache = kvdex.Cache(model, "prkv", budget=budget, offload=offload, dense_layers=1, **opts)
    pol = cache.policy
    n_static, n_dyn = split_budget(budget - SINK - WINDOW, PAGE, static_ratio)
    assert (n_static, n_dyn) == (pol.n_static, pol.n_dynamic) and n_static == 64 * static_ratio
    calls = {"n": 0}
    layers = (1, 2)

    def observer(layer, q, store, aset, scale):
        calls["n"] += 1
        org = pol.static_set.origin_map(layer)
        k, _ = store.dense()
        allpos = pol.positions(layer, aset.positions)
        for b, length in enumerate(store.lengths_host.tolist()):
            ws = window_start(length)
            mo = min(ws - SINK, org.shape[2])
            assert sorted(org[b, 0, :mo].tolist()) == list(range(mo))  # relocation: a permutation
            for h in range(store.kv_heads):
                valid = aset.valid[b, h]
                slots = aset.positions[b, h][valid]
                pos = allpos[b, h][valid]
                assert len(pos) == len(set(pos.tolist())) <= budget  # no token twice, never over the budget
                ns = int(pol.static_set.counts[layer][b])
                assert set(range(SINK, SINK + ns)) <= set(slots.tolist())  # static = the front of the middle
                dyn_pages = {(x - SINK) // PAGE for x in slots.tolist() if SINK + ns <= x < ws}
                assert len(dyn_pages) <= n_dyn and all(p * PAGE >= ns for p in dyn_pages)
                # each slot holds the key of the position the origin map names (prompt tokens)
                old = pos < lengths[b]
                assert torch.equal(k[b, h, slots[old]], ref_keys[layer][b, h, pos[old]])
        # the dynamic pages are ranked by digests of the pages as they are now (after the relocation)
        nmid = store.grid.num_middle_pages(store.lengths_host)
        m = int(nmid.max()) * PAGE
        fresh = DigestIndex(pol.digest)
        pages = k[:, :, SINK : SINK + m].reshape(*k.shape[:2], m // PAGE, PAGE, -1)
        fresh.write(layer, torch.zeros_like(nmid), nmid, pages)
        for b, n in enumerate(nmid.tolist()):
            for tab in ("centre", "radius"):
                got, want = getattr(pol.digests, tab)[layer][b, :, :n], getattr(fresh, tab)[layer][b, :, :n]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # keys by position: a dense prefill of the same prompt
    twin = kvdex.Cache(model, "full", budget=BUDGET, dense_layers=1)
    greedy(model, ids, mask, cache=twin, new=1)
    ref_keys = {lay: twin.layers[lay].store.dense()[0] for lay in layers}
    cache.observer = observer
    greedy(model, ids, mask, cache=cache, new=45)
    assert calls["n"] == 44 * len(layers)
    for layer in layers:
        assert pol.schedule.refreshes[layer] == [7, 14, 21, 28, 35, 42]  # exactly every T decode steps
    assert pol.static_set.counts[1].tolist() == [n_static, n_static]


def test_swap_order_moves_the_static_tokens_to_the_front_and_little_else():
    """relocate="swap": the static slots take the front in position order, each token they displace takes a slot
    one of them left, every other slot keeps its token (at most twice the static count move); a sequence's slots
    past its middle stay."""
    from kvdex.policies.prkv.static_set import swap_order

    g = torch.Generator().manual_seed(5)
    b, h, m = 2, 3, 48
    origin = torch.stack([torch.stack([torch.randperm(m, generator=g) for _ in range(h)]) for _ in range(b)])
    own = torch.tensor([48, 32]).view(b, 1, 1)
    is_static = torch.rand(b, h, m, generator=g) < 0.2
    is_static[..., :3] = True  # some statics already in the front
    order = swap_order(is_static, origin, own)
    for s in range(b):
        for k in range(h):
            o, live = order[s, k], int(own[s])
            st = [j for j in range(live) if is_static[s, k, j]]
            n = len(st)
            assert sorted(o.tolist()) == list(range(m))  # a permutation
            assert o[:n].tolist() == sorted(st, key=lambda j: int(origin[s, k, j]))  # statics first, by position
            moved = [j for j in range(m) if o[j] != j]
            assert len(moved) <= 2 * n and all(j < live for j in moved)
            for j in moved:
                if j >= n:  # a vacated static slot takes a token displaced from the front
                    assert is_static[s, k, j] and o[j] < n and not is_static[s, k, o[j]]


def _window_scores(pol, layer, store, scale, per_query_head=False, ring=None):
    """The observation scores of PRKV's ring (or ``ring``: a (q, pos, valid) copy) over the middle with the
    keys put back in position order (sequence 0), computed here from the store; returns (scores [1, H, L]
    or, ``per_query_head``, [1, Hq, L], origin of each middle slot)."""
    ring = pol.schedule.rings[layer] if ring is None else ring
    k, _ = store.dense()
    org = pol.static_set.origin_map(layer)
    m = org.shape[2]
    kpos = k.clone()
    for h in range(store.kv_heads):
        kpos[0, h, SINK + org[0, h, :m]] = k[0, h, SINK : SINK + m]
    s = middle_scores(
        ring.q, ring.pos, ring.valid, kpos, store.lengths, store.grid, scale, per_query_head=per_query_head
    )
    return s, org


def _ring_copy(pol, layer):
    """The ring of ``layer`` as it is now (the queries the next step's refresh reads: it runs before the
    step, or in ``select`` before the step's query joins the ring when a page joins the middle then)."""
    ring = pol.schedule.rings[layer]
    return SimpleNamespace(q=ring.q.clone(), pos=ring.pos.clone(), valid=ring.valid.clone())


@pytest.mark.parametrize(
    "name, opts, late",
    [("prkv", {"static_ratio": 0.5}, False), ("prkv", {"static_ratio": 1.0}, True), ("snapkv", {}, True)],
)
def test_refresh_runs_before_the_step_unless_a_page_joins(name, opts, late):
    """The refresh of decode step t (t = T, 2T, ...) runs in ``before_step``, on the host before the step's
    first layer -- once, however often it is asked -- so that the step's graph key exists (the step
    replays). When a page joins the middle in step t and the layer has no dynamic pages (``late``: PRKV at
    S = 1, SnapKV+), ``select`` runs it after the join (no key: eager); with dynamic pages the joining page
    is one of their candidates and the refresh still runs before the step.
    Asking early changes nothing: the same tokens and logits as a run that is not asked."""
    from kvdex.policies.observation import step_joins

    model, _ = shared_pair("llama_gqa")
    T, W, last = 5, 8, 2
    ids = prompt(140, seed=1)  # a page joins the middle at decode steps 4 and 20
    runs, kinds = [], {}
    for ask in (False, True):
        cache = kvdex.Cache(model, name, budget=BUDGET, dense_layers=1, refresh=T, obs=W, **opts)
        pol = cache.policy

        def observer(layer, q, store, aset, scale, pol=pol, cache=cache):
            step = pol.schedule.steps[layer] - 1
            if layer != last or (step + 1) % T:
                return
            stores = [lay.store for lay in cache.layers]
            joins = step_joins(stores, pol.info.sparse_layers)
            for _ in range(2):
                pol.before_step(stores)
            done = [pol.schedule.refreshes[lay][-1] == step + 1 for lay in pol.info.sparse_layers]
            assert done == [not (joins and late)] * len(done), (step, joins)
            assert (pol.graph_key(stores) is None) == (joins and late)
            kinds[step + 1] = joins

        if ask:
            cache.observer = observer
        runs.append(greedy(model, ids, cache=cache, new=22))
        assert all(pol.schedule.refreshes[lay] == [5, 10, 15, 20] for lay in pol.info.sparse_layers)
    assert kinds == {5: False, 10: False, 15: False, 20: True}
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=0, rtol=0)


def test_static_set_is_topk_of_window_scores():
    """After a refresh, the front of the middle holds exactly the top-k_s tokens by the observation
    scores of the last W queries (keys in position order). The refresh of step t reads the queries up
    to step t - 1 (the ring after step t - 1) and the middle before step t (a page joins it in step 20,
    after the refresh: a dynamic candidate)."""
    model, _ = shared_pair("llama_gqa")
    T, W = 5, 8
    cache = kvdex.Cache(model, "prkv", budget=BUDGET, dense_layers=1, static_ratio=0.5, refresh=T, obs=W)
    pol = cache.policy
    checked, before = [], {}

    def observer(layer, q, store, aset, scale):
        step = pol.schedule.steps[layer] - 1
        if (step + 1) % T == 0:
            before[layer] = _ring_copy(pol, layer)
        if step == 0 or step % T:
            return
        assert pol.schedule.refreshes[layer][-1] == step
        s, org = _window_scores(pol, layer, store, scale, ring=before.pop(layer))
        s = s[..., : org.shape[2]]  # the middle the refresh restructured (not a page that joined after it)
        ns = int(pol.static_set.counts[layer][0])
        for h in range(store.kv_heads):
            front = set((org[0, h, :ns] + SINK).tolist())
            top = torch.sort(s[0, h], descending=True)
            kth = top.values[ns - 1]
            assert bool((s[0, h][org[0, h, :ns]] >= kth).all())
            rest = [x for x in range(int(torch.isfinite(s[0, h]).sum())) if x + SINK not in front]
            assert bool((s[0, h][rest] <= kth).all())
        checked.append(step)

    cache.observer = observer
    greedy(model, prompt(140, seed=1), cache=cache, new=22)
    assert sorted(set(checked)) == [5, 10, 15, 20]


@pytest.mark.parametrize("obs_tokens", ["score", "last"])
def test_obs_tokens_last_ranks_the_windows_own_tokens_last(obs_tokens):
    """obs > the cache's window: the observation queries' own tokens lie in the middle. With
    ``obs_tokens="last"`` the static set is the top-k_s of the earlier tokens only (Algorithm 1 scores
    K[:-n_local]); with "score" those tokens compete (and, with their local attention, get in)."""
    model, _ = shared_pair("llama_gqa")
    T, W = 5, 40  # window 32: 8-23 of the 40 observation queries' tokens lie in the middle
    opts = dict(static_ratio=1.0, refresh=T, obs=W, obs_tokens=obs_tokens)
    cache = kvdex.Cache(model, "prkv", budget=BUDGET, dense_layers=1, **opts)
    pol = cache.policy
    late_static, before = [], {}

    def observer(layer, q, store, aset, scale):
        step = pol.schedule.steps[layer] - 1
        if (step + 1) % T == 0:
            before[layer] = _ring_copy(pol, layer)
        if step == 0 or step % T:
            return
        ring = before.pop(layer)
        first = int(ring.pos[0][ring.valid[0]].min())
        s, org = _window_scores(pol, layer, store, scale, ring=ring)
        ns = int(pol.static_set.counts[layer][0])
        assert first - SINK > ns  # enough earlier tokens: "last" never needs a late one
        for h in range(store.kv_heads):
            static = org[0, h, :ns]
            late_static.append(int((static + SINK >= first).sum()))
            if obs_tokens == "last":
                early = s[0, h, : first - SINK]
                kth = torch.sort(early, descending=True).values[ns - 1]
                assert bool((static + SINK < first).all())
                assert bool((early[static] >= kth).all())  # the top-k_s of the earlier tokens

    cache.observer = observer
    greedy(model, prompt(200, seed=1), cache=cache, new=22)
    assert late_static
    assert (sum(late_static) == 0) == (obs_tokens == "last")


CONFIGS = [
    {"static_ratio": 0.0},
    {"static_ratio": 0.25},
    {"static_ratio": 0.5, "refresh": 8},
    {"static_ratio": 0.5, "refresh": 8, "relocate": "swap"},
    {"static_ratio": 1.0, "refresh": 1},
    {"static_ratio": 1.0, "refresh": 1, "obs_tokens": "last"},
]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("opts", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_covering_budget_matches_sdpa(opts, offload):
    family, n, new = "llama_gqa", 70, 40
    model, _ = shared_pair(family)
    ref_tokens, ref_logits = reference_greedy(family, n, n, new)
    cache = kvdex.Cache(model, "prkv", budget=256, offload=offload, dense_layers=1, **opts)
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=new)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)


# budget - sink - window = 214, not a page multiple: S = 0.25 -> 48 + 6 static tokens (a partly filled page)
ODD_CONFIGS = [{"static_ratio": 0.25}, {"static_ratio": 0.5, "refresh": 8, "static_group": "heads", "group": "heads"}]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("opts", ODD_CONFIGS, ids=[str(c) for c in ODD_CONFIGS])
def test_covering_budget_not_a_page_multiple_matches_sdpa(opts, offload):
    """The static region ends inside a page: the rest of that page is still attended (it is a dynamic
    candidate), so a budget covering the context equals dense attention at any budget."""
    family, n, new, budget = "llama_gqa", 150, 40, 262
    assert split_budget(budget - SINK - WINDOW, PAGE, opts["static_ratio"])[0] % PAGE
    model, _ = shared_pair(family)
    ref_tokens, ref_logits = reference_greedy(family, n, n, new)
    cache = kvdex.Cache(model, "prkv", budget=budget, offload=offload, dense_layers=1, **opts)
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=new)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_retrieval_budget_under_one_page(offload):
    """sink + window < budget < sink + window + page_size: no whole page fits. S = 0 (as ArkVale) would
    attend sink + window only, so the cache refuses it naming the smallest budget that retrieves; S > 0
    gives the r < page_size tokens to the static set (k_s = r mod page_size) and attends them."""
    model, _ = shared_pair("llama_gqa")
    budget = SINK + WINDOW + PAGE - 9  # r = 7
    for name, opts in (("arkvale", {}), ("prkv", {"static_ratio": 0.0})):
        with pytest.raises(ValueError, match=f"budget >= {SINK + WINDOW + PAGE}"):
            kvdex.Cache(model, name, budget=budget, offload=offload, dense_layers=1, **opts)
    ids, mask, _ = left_padded([130, 90], seed=5)
    cache = kvdex.Cache(model, "prkv", budget=budget, offload=offload, dense_layers=1, static_ratio=0.25)
    assert (cache.policy.n_static, cache.policy.n_dynamic) == (7, 0)
    middles = []

    def observer(layer, q, store, aset, scale):
        start = store.grid.window_start(store.lengths).to(aset.positions.device)[:, None, None]
        middle = aset.valid & (aset.positions >= SINK) & (aset.positions < start)
        middles.append(middle.sum(-1))

    cache.observer = observer
    greedy(model, ids, mask, cache=cache, new=20)
    # both prompts' middles hold >= 7 tokens once decoding starts: each head attends exactly 7 of them
    assert bool((torch.stack(middles) == 7).all())


def test_partly_filled_static_page_is_attended_whole_or_as_tail():
    """At a budget that selects, with k_s not a page multiple: each step attends the static tail as
    tokens or -- chosen as a dynamic page -- the whole partly filled page instead, never a slot twice
    and never over the budget; the page's slots after the tail are reachable (chosen on some steps)."""
    model, _ = shared_pair("llama_gqa")
    budget = 119  # r = 71: S = 0.25 -> 16 + 7 static tokens, 3 dynamic pages
    cache = kvdex.Cache(model, "prkv", budget=budget, dense_layers=1, static_ratio=0.25, rerank=0)
    pol = cache.policy
    assert (pol.n_static, pol.n_dynamic) == (23, 3)
    seen = {"whole": 0, "tail": 0}

    def observer(layer, q, store, aset, scale):
        ns = int(pol.static_set.counts[layer][0])
        assert ns == 23
        tail = set(range(SINK + PAGE, SINK + ns))  # the static tail: slots of the partly filled page
        rest = set(range(SINK + ns, SINK + 2 * PAGE))  # that page's slots after it (not static)
        for h in range(store.kv_heads):
            slots = aset.positions[0, h][aset.valid[0, h]].tolist()
            assert len(slots) == len(set(slots)) <= budget
            assert tail <= set(slots)
            got = rest & set(slots)
            assert got in (set(), rest)
            seen["whole" if got else "tail"] += 1

    cache.observer = observer
    greedy(model, prompt(200, seed=3), cache=cache, new=20)
    assert seen["whole"] and seen["tail"]


@pytest.mark.parametrize(
    "opts",
    [
        {"static_ratio": 1.5},
        {"static_ratio": -0.1},
        {"static_ratio": "half"},
        {"refresh": 0},
        {"refresh": -3},
        {"obs": 0},
        {"digest": "ball"},
        {"kernel": 2},
        {"pooling": "median"},
        {"obs_tokens": "drop"},
    ],
)
def test_bad_options_raise(opts):
    with pytest.raises(ValueError):
        kvdex.make_policy("prkv", **opts)


def test_auto_static_ratio_is_appendix_g():
    """static_ratio='auto': per layer, k_s = page_size * floor(mean_h |top_r(first) & top_r(last)| / page_size),
    the overlap of the top-r middle tokens of the first and last observation queries of each query head."""
    model, _ = shared_pair("llama_gqa")
    n, W, budget = 200, 16, 112
    r = budget - SINK - WINDOW
    cache = kvdex.Cache(model, "prkv", budget=budget, dense_layers=1, static_ratio="auto", obs=W)
    greedy(model, prompt(n, seed=6), cache=cache, new=3)
    pol = cache.policy
    twin = kvdex.Cache(model, "full", budget=budget, dense_layers=1)
    greedy(model, prompt(n, seed=6), cache=twin, new=1)
    scale = model.config.head_dim**-0.5
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    ws = window_start(n)
    for layer in (1, 2):
        k = twin.layers[layer].store.dense()[0][0]
        qo = twin.layers[layer]._obs_q[0, :, -W:]
        overlaps = []
        for qh in range(qo.shape[0]):
            tops = []
            for i in (0, W - 1):
                qpos = n - W + i
                p = torch.softmax((k[qh // group, : qpos + 1] @ qo[qh, i]) * scale, 0)[SINK:ws]
                tops.append(set(torch.topk(p, min(r, ws - SINK)).indices.tolist()))
            overlaps.append(len(tops[0] & tops[1]))
        want = PAGE * int(sum(overlaps) / len(overlaps) // PAGE)
        assert pol.static_set.split[layer] == (want, (r - want) // PAGE), (layer, overlaps)
        assert pol.layer_split(layer) == pol.static_set.split[layer]
        assert int(pol.static_set.counts.get(layer, torch.zeros(1))[0]) == min(want, ws - SINK)
    assert set(pol.stats()["static_tokens_per_layer"]) == {1, 2}


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_auto_covering_budget_matches_sdpa(offload):
    family, n, new = "qwen2", 70, 40
    model, _ = shared_pair(family)
    ref_tokens, ref_logits = reference_greedy(family, n, n, new)
    cache = kvdex.Cache(model, "prkv", budget=256, offload=offload, dense_layers=1, static_ratio="auto")
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=new)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)


# ---- the default selection and the paper's ------------------------------------------------------------------

SELECTION_KEYS = ("group", "rerank", "rerank_group", "rerank_share", "rerank_unit", "select_every", "pool_every")


def _selection(spec: str) -> dict:
    pol = kvdex.make_policy(spec)
    return {k: getattr(pol, k) for k in SELECTION_KEYS}


def test_default_selection_and_the_papers():
    """``prkv`` alone (or with options outside the selection's) is kvdex's selection; naming any selection
    option starts the rest from the paper's, so ``prkv:rerank=0`` is the paper's and an older spec that named
    the rerank keeps its meaning (the token unit, selecting every step)."""
    default = {"group": "max", "rerank": 4, "rerank_group": "weight", "rerank_share": 0.25, "rerank_unit": "page",
               "select_every": 16, "pool_every": 1}  # fmt: skip
    paper = {"group": "max", "rerank": 0, "rerank_group": "max", "rerank_share": 0.0, "rerank_unit": "token",
             "select_every": 1, "pool_every": 1}  # fmt: skip
    assert _selection("prkv") == default
    assert _selection("prkv:refresh=8:static_ratio=0.5") == default
    assert _selection("prkv:rerank=0") == paper
    assert _selection("prkv:select_every=8") == {**paper, "select_every": 8}
    assert _selection("prkv:group=heads") == {**paper, "group": "heads"}
    assert _selection("prkv:rerank=4:rerank_group=weight:rerank_share=0.25") == {
        **paper, "rerank": 4, "rerank_group": "weight", "rerank_share": 0.25}  # fmt: skip
    assert _selection("prkv:rerank=4:rerank_group=weight:rerank_share=0.25:pool_every=16")["rerank_unit"] == "token"
    assert kvdex.make_policy("prkv").granularity == "page" and kvdex.make_policy("prkv").reuse_steps() == 16
    with pytest.raises(ValueError, match="rerank_unit='page'"):
        kvdex.make_policy("prkv:rerank_unit=page")  # named alone: the paper's rerank=0, which cannot rank pages
