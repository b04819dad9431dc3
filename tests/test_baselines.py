"""The baselines of the PRKV paper: ``arkvale`` (page digests), ``snapkv`` (observation window,
with SnapKV+'s periodic refresh) and ``h2o`` (accumulated-attention heavy hitters + recent).

Invariants: ArkVale's ``max`` digests never fall below the true per-page max of q.k (sphere and
cuboid) and the selected pages are the top-k by digest; SnapKV keeps exactly the tokens an
independent computation of its votes picks; H2O attends exactly ``budget`` tokens, its heavy
hitters are the top accumulated scores (accumulated independently here) and an evicted token never
returns; a covering budget reproduces transformers' dense attention; bad options raise ValueError.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import PAGE, SINK, WINDOW, greedy, left_padded, prompt, reference_greedy, shared_pair, window_start

import kvdex
from kvdex import cache_kwargs
from kvdex.policies.digest import DIGESTS, digest_scores, summarize
from kvdex.view import LayerView

BUDGET = 96
NEW = 40


def true_page_max(q, keys):
    """q [B, Hq, D], keys [B, H, P, ps, D] -> exact max_t q.k per (query head, page), float64."""
    b, hq, d = q.shape
    h = keys.shape[1]
    s = torch.einsum("bhgd,bhptd->bhgpt", q.double().view(b, h, hq // h, d), keys.double())
    return s.amax(-1).reshape(b, hq, -1)


# ---- ArkVale digests ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cuboid-max", "sphere-max"])
@pytest.mark.parametrize("kv_heads,q_heads", [(1, 1), (2, 4), (2, 8)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_max_digests_bound_the_true_page_max(kind, kv_heads, q_heads, page_size):
    g = torch.Generator().manual_seed(kv_heads * 100 + q_heads * 10 + page_size)
    for trial in range(5):
        b, p, d = 3, 7, 16
        keys = torch.randn(b, kv_heads, p, page_size, d, generator=g) * (1 + 3 * trial) - trial
        q = torch.randn(b, q_heads, d, generator=g) * 2 - 0.5 * (trial % 2)
        est = digest_scores(q, *summarize(keys, kind)).double()
        truth = true_page_max(q, keys)
        assert bool((est >= truth - 1e-4 * (1 + truth.abs())).all()), (est - truth).min()
        if page_size == 1 and kind == "cuboid-max":  # a one-key box is the key: exact
            torch.testing.assert_close(est, truth, atol=1e-3, rtol=1e-5)


def test_digest_formulas_and_ordering():
    """Cuboid = sum_i max(q_i hi_i, q_i lo_i) with hi/lo = c +- r; sphere = q.c + r|q|; the mean and
    center radii lie inside the max radius, so their estimates never exceed the bound's."""
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(2, 2, 5, 8, 16, generator=g) * 2 + 0.5
    q = torch.randn(2, 4, 16, generator=g)
    qg = q.view(2, 2, 2, 1, 16).double()
    for kind in DIGESTS:
        c, r = summarize(keys, kind)
        lo, hi = keys.amin(3), keys.amax(3)
        torch.testing.assert_close(c, (lo + hi) / 2)
        est = digest_scores(q, c, r).double()
        if kind.startswith("cuboid"):
            ref = torch.maximum(qg * (c + r)[:, :, None].double(), qg * (c - r)[:, :, None].double()).sum(-1)
        else:
            ref = (qg * c[:, :, None].double()).sum(-1) + qg.norm(dim=-1) * r[:, :, None, :, 0].double()
        torch.testing.assert_close(est, ref.reshape(2, 4, 5), atol=1e-4, rtol=1e-5)
        bound = digest_scores(q, *summarize(keys, kind.split("-")[0] + "-max"))
        assert bool((est <= bound + 1e-4).all()), kind
    # the released code's box (mean absolute deviation per channel), written out
    c = (keys.amin(3) + keys.amax(3)) / 2
    torch.testing.assert_close(summarize(keys, "cuboid-mean")[1], (keys - c[:, :, :, None]).abs().mean(3))


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("digest", ["cuboid-mean", "sphere-max"])
def test_arkvale_selects_top_pages_by_digest(offload, digest):
    model, _ = shared_pair("llama_gqa")
    lengths = [120, 60, 90]
    ids, mask, _ = left_padded(lengths, seed=13)
    cache = kvdex.Cache(model, "arkvale", budget=BUDGET, offload=offload, dense_layers=1, digest=digest)
    kvh = model.config.num_key_value_heads
    k_pages = (BUDGET - SINK - WINDOW) // PAGE
    seen = {"checked": 0}

    def observer(layer, q, store, aset, scale):
        k, _ = store.dense()
        lens = store.lengths_host.tolist()
        p = max((window_start(n) - SINK) // PAGE for n in lens)
        if not p:
            return
        b = len(lens)
        keys = k[:, :, SINK : SINK + p * PAGE].reshape(b, kvh, p, PAGE, -1)
        est = digest_scores(q, *summarize(keys, digest)).view(b, kvh, -1, p).amax(2)  # from the real keys
        for bi, n in enumerate(lens):
            ws = window_start(n)
            m = (ws - SINK) // PAGE
            for h in range(kvh):
                pos = aset.positions[bi, h][aset.valid[bi, h]].tolist()
                assert len(pos) == len(set(pos))
                pages = sorted({(x - SINK) // PAGE for x in pos if SINK <= x < ws})
                assert len(pages) == min(k_pages, m)
                if pages:
                    s = est[bi, h, :m]
                    kth = torch.sort(s, descending=True).values[len(pages) - 1]
                    assert bool((s[pages] >= kth - 1e-5).all())
                    rest = [x for x in range(m) if x not in pages]
                    assert bool((s[rest] <= kth + 1e-5).all())
                    seen["checked"] += 1

    cache.observer = observer
    model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=30, do_sample=False)
    assert seen["checked"] > 0


# ---- covering budget == dense -------------------------------------------------------------------

CONFIGS = [
    ("arkvale", {}),
    ("arkvale", {"digest": "sphere-max"}),
    ("snapkv", {}),
    ("snapkv", {"refresh": 1}),
    ("h2o", {}),
]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize("policy,opts", CONFIGS, ids=[f"{p}{o}" for p, o in CONFIGS])
def test_covering_budget_matches_sdpa(family, policy, opts, offload):
    model, _ = shared_pair(family)
    n = 70
    ref_tokens, ref_logits = reference_greedy(family, n, n, NEW)
    cache = kvdex.Cache(model, policy, budget=256, offload=offload, dense_layers=1, **opts)
    tokens, logits = greedy(model, prompt(n, seed=n), cache=cache, new=NEW)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.stats()["attended_tokens_per_step"] == pytest.approx(n + NEW / 2)


# ---- SnapKV -------------------------------------------------------------------------------------


def snapkv_reference(qo, k, length, scale, group, kernel, take):
    """SnapKV's votes written out per query head with loops: qo [Hq, W, D] (the prompt's last W
    queries), k [H, L, D]; returns the kept middle positions per kv head (sets)."""
    hq, w, _ = qo.shape
    ws = window_start(length)
    out = []
    for h in range(k.shape[0]):
        votes = []
        for qh in range(h * group, (h + 1) * group):
            acc = torch.zeros(ws - SINK, dtype=torch.float64)
            for i in range(w):
                qpos = length - w + i
                s = (k[h, : qpos + 1].double() @ qo[qh, i].double()) * scale
                p = torch.softmax(s, 0)
                acc += p[SINK:ws] if qpos + 1 >= ws else F.pad(p[SINK:], (0, ws - qpos - 1))
            acc /= w
            if kernel > 1:
                acc = F.max_pool1d(acc[None, None], kernel, 1, kernel // 2)[0, 0]
            votes.append(acc)
        score = torch.stack(votes).mean(0)
        order = torch.argsort(score, descending=True)
        n = min(take, ws - SINK)
        out.append((set((order[:n] + SINK).tolist()), score, n))
    return out


@pytest.mark.parametrize("kernel", [1, 7])
def test_snapkv_selection_equals_direct_computation(kernel):
    model, _ = shared_pair("llama_gqa")
    n = 140
    cache = kvdex.Cache(model, "snapkv", budget=BUDGET, dense_layers=1, kernel=kernel, obs=16)
    greedy(model, prompt(n, seed=3), cache=cache, new=3)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    scale = model.config.head_dim**-0.5
    for layer in (1, 2):
        lay = cache.layers[layer]
        k = lay.store.dense()[0][0, :, :n]
        qo = lay._obs_q[0, :, -16:]
        ref = snapkv_reference(qo, k, n, scale, group, kernel, BUDGET - SINK - WINDOW)
        chosen = cache.policy.chosen[layer][0]
        for h, (want, score, m) in enumerate(ref):
            got = set(x for x in chosen[h].tolist() if x >= 0)
            assert len(got) == m
            if got != want:  # only ties may differ: the scores of the two sets must agree
                a = sorted(score[[x - SINK for x in got]].tolist())
                b = sorted(score[[x - SINK for x in want]].tolist())
                assert a == pytest.approx(b, abs=1e-7), f"layer {layer} head {h}"


def test_snapkv_keeps_selection_and_every_later_token():
    """refresh=0: the prefill selection never changes and every token after the prefill's middle is kept."""
    model, _ = shared_pair("qwen2")
    n = 100
    cache = kvdex.Cache(model, "snapkv", budget=BUDGET, dense_layers=1)
    first = {}

    def observer(layer, q, store, aset, scale):
        length = int(store.lengths_host[0])
        pos = set(aset.positions[0, 0][aset.valid[0, 0]].tolist())
        chosen = set(x for x in cache.policy.chosen[layer][0, 0].tolist() if x >= 0)
        first.setdefault(layer, chosen)
        assert chosen == first[layer]
        later = set(range(window_start(n), length))
        assert pos == set(range(SINK)) | chosen | later

    cache.observer = observer
    greedy(model, prompt(n, seed=9), cache=cache, new=60)
    assert len(first[1]) == BUDGET - SINK - WINDOW


# ---- H2O ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_h2o_budget_heavy_hitters_and_recent(offload):
    """Exactly ``budget`` tokens per kv head: sink + the most recent half + heavy hitters; a token
    passed over once never returns; the scores are the sums of the attention weights of every step
    (accumulated here independently from the attend sets the kernel read)."""
    model, _ = shared_pair("llama_gqa")
    n = 130
    cache = kvdex.Cache(model, "h2o", budget=BUDGET, offload=offload, dense_layers=1)
    pol = cache.policy
    recent, heavy = BUDGET // 2, BUDGET - SINK - BUDGET // 2
    kvh = model.config.num_key_value_heads
    mine: dict[int, torch.Tensor] = {}
    dropped: dict[tuple, set] = {}
    calls = []

    def observer(layer, q, store, aset, scale):
        calls.append(layer)
        length = int(store.lengths_host[0])
        if layer not in mine:  # from the policy's prefill scores plus its first step
            mine[layer] = pol.score[layer][0].clone()
        else:
            acc = mine[layer]
            if acc.shape[1] < pol.score[layer].shape[2]:
                acc = mine[layer] = F.pad(acc, (0, pol.score[layer].shape[2] - acc.shape[1]))
            k = aset.k[0].gather(1, aset.idx[0][..., None].expand(-1, -1, q.shape[-1])).float()
            s = torch.einsum("hgd,hnd->hgn", q[0].view(kvh, -1, q.shape[-1]).float(), k) * scale
            p = torch.softmax(s.masked_fill(~aset.valid[0][:, None], float("-inf")), -1).sum(1)
            for h in range(kvh):
                for j in torch.nonzero(aset.valid[0, h]).flatten().tolist():
                    acc[h, int(aset.positions[0, h, j])] += p[h, j]
            torch.testing.assert_close(acc[:, :length], pol.score[layer][0, :, :length], atol=1e-4, rtol=1e-4)
        for h in range(kvh):
            pos = aset.positions[0, h][aset.valid[0, h]].tolist()
            assert len(pos) == len(set(pos)) == BUDGET, (layer, h, len(pos))
            rec = set(range(length - recent, length))
            assert set(range(SINK)) | rec <= set(pos)
            hh = set(pos) - set(range(SINK)) - rec
            gone = dropped.setdefault((layer, h), set())
            cand = set(range(SINK, length - recent)) - gone
            assert len(hh) == heavy and hh <= cand, "a heavy hitter that was evicted before"
            gone |= cand - hh

    cache.observer = observer
    greedy(model, prompt(n, seed=4), cache=cache, new=30)
    assert len(calls) == 29 * 2


def test_h2o_heavy_hitters_are_top_accumulated_scores():
    """Drive the policy directly: the heavy set is the top accumulated scores among the tokens not
    yet evicted, computed before the step's own attention is added."""
    model, _ = shared_pair("qwen2")
    n = 120
    cache = kvdex.Cache(model, "h2o", budget=BUDGET, dense_layers=1)
    greedy(model, prompt(n, seed=11), cache=cache, new=2)
    pol, layer = cache.policy, 1
    store = cache.layers[layer].store
    g = torch.Generator().manual_seed(2)
    recent = BUDGET // 2
    for _ in range(5):
        length = int(store.lengths_host[0])
        evicted = pol.evicted[layer][0].clone()
        score = pol.score[layer][0].clone()
        q = torch.randn(1, model.config.num_attention_heads, 16, generator=g)
        sel = pol.select(q, LayerView.of(layer, store, 0.25, pol.cfg))
        for h in range(store.kv_heads):
            toks = [x for x in sel.tokens[0, h].tolist() if x >= 0]
            hh = [x for x in toks if x < length - recent]
            cand = [x for x in range(SINK, length - recent) if not evicted[h, x]]
            best = sorted(cand, key=lambda x: -float(score[h, x]))[: BUDGET - SINK - recent]
            assert sorted(hh) == sorted(best)
        pol.observe(layer, q, store.attend(sel), 0.25)
        store.append(torch.randn(1, store.kv_heads, 1, 16), torch.randn(1, store.kv_heads, 1, 16))


# ---- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,opts",
    [
        ("arkvale", {"digest": "ball"}),
        ("snapkv", {"obs": 0}),
        ("snapkv", {"kernel": 4}),
        ("snapkv", {"pooling": "min"}),
        ("snapkv", {"refresh": -1}),
        ("h2o", {"recent_ratio": 1.5}),
        ("h2o", {"obs": 0}),
    ],
)
def test_bad_options_raise(policy, opts):
    with pytest.raises(ValueError):
        kvdex.make_policy(policy, **opts)


@pytest.mark.parametrize("cache_pages", [4, 5, 1000])
def test_arkvale_recall_count_simulates_its_page_cache(cache_pages):
    """The recall count equals an independent simulation of ArkVale's device cache: pages enter when
    they fill, a selected page not cached is a recall, overflow evicts the lowest-ranked unselected."""
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "arkvale", budget=BUDGET, dense_layers=1, cache_pages=cache_pages)
    pol = cache.policy
    k = (BUDGET - SINK - WINDOW) // PAGE
    state: dict = {}
    recalls = {"n": 0, "lookups": 0}

    def observer(layer, q, store, aset, scale):
        length = int(store.lengths_host[0])
        m = (window_start(length) - SINK) // PAGE
        kk, _ = store.dense()
        keys = kk[:, :, SINK : SINK + m * PAGE].reshape(1, store.kv_heads, m, PAGE, -1)
        est = digest_scores(q, *summarize(keys, "cuboid-mean")).view(1, store.kv_heads, -1, m).amax(2)[0]
        for h in range(store.kv_heads):
            cached = state.setdefault((layer, h), set(range(m)))  # every prefill page starts cached
            cached |= {p for p in range(m) if p >= state.get(("seen", layer, h), m)}  # pages that filled since
            state[("seen", layer, h)] = m
            pos = aset.positions[0, h][aset.valid[0, h]].tolist()
            sel = {(x - SINK) // PAGE for x in pos if SINK <= x < SINK + m * PAGE}
            assert len(sel) == min(k, m)
            recalls["n"] += len(sel - cached)
            recalls["lookups"] += 1
            cached |= sel
            if len(cached) > pol.capacity:
                rest = sorted(cached - sel, key=lambda p: -float(est[h, p]))
                cached.intersection_update(sel | set(rest[: pol.capacity - len(sel)]))

    cache.observer = observer
    greedy(model, prompt(150, seed=2), cache=cache, new=40)
    st = cache.stats()["policy_stats"]
    assert st["cache_pages"] == cache_pages
    assert st["recalled_pages_per_head_step"] == pytest.approx(recalls["n"] / recalls["lookups"])
    if cache_pages == 1000:
        assert recalls["n"] == 0  # everything fits: nothing is ever recalled
    else:
        assert recalls["n"] > 0


def test_arkvale_cache_smaller_than_selection_raises():
    model, _ = shared_pair("llama_gqa")
    with pytest.raises(ValueError, match="k < c"):
        kvdex.Cache(model, "arkvale", budget=BUDGET, dense_layers=1, cache_pages=3)  # 3 pages attended


def test_h2o_score_memory_stays_bounded():
    """The score buffers grow with the context, not with the number of steps (a padding-index bug
    once grew them every step)."""
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "h2o", budget=BUDGET, dense_layers=1)
    greedy(model, prompt(130, seed=4), cache=cache, new=60)
    for layer in (1, 2):
        assert cache.policy.score[layer].shape[2] <= 130 + 60 + 1024
