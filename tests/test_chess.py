"""``chess``: the hierarchy holds exact means, the top-down masks respect parents, one GEMM scores
every level, every ratio 1 is dense attention, and the rebuild triggers fire exactly when they should."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PAGE, SINK, greedy, left_padded, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.policies import chess as chess_mod
from kvdex.policies.chess import ChessPolicy, entropy_varentropy, level_mask
from kvdex.view import LayerView

ALL_ONE = dict(rho_g=1.0, rho_c=1.0, rho_p=1.0)
# the paper's mode (the window's key-key anchor, one selection shared by every layer and head): what
# these tests hold to the paper; kvdex's default (query anchor, a selection per layer) is tests/test_chess_layer.py's
PAPER = "chess:anchor_from=window:scope=shared"


def _prefill(model, ids, mask=None, **kw):
    kw.setdefault("dense_layers", 0)
    cache = kvdex.Cache(model, PAPER, kw.pop("budget", 96), **kw)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    return cache


def _direct_vectors(cache, nc, ng):
    """Eq. 1 / eq. 2 straight from the stored keys: (pages, chunks, grids) per sequence, float64."""
    pol = cache.policy
    out = []
    for b in range(cache.layers[0].store.batch):
        n = int(cache.layers[0].store.lengths_host[b])
        p = int(cache.grid.num_middle_pages(torch.tensor([n]))[0])
        per_layer = []
        for layer in pol.info.sparse_layers:
            k, _ = cache.layers[layer].store.dense()
            keys = k[b, :, SINK : SINK + p * PAGE].double().reshape(k.shape[1], p, PAGE, -1)
            per_layer.append(keys.mean(2).permute(1, 0, 2).reshape(p, -1))  # [P, H*D]
        pages = torch.cat(per_layer, dim=-1)
        chunks = torch.stack([pages[i : i + nc].mean(0) for i in range(0, p, nc)])
        grids = torch.stack([chunks[i : i + ng].mean(0) for i in range(0, len(chunks), ng)])
        out.append((pages, chunks, grids))
    return out


def _check_hierarchy(cache, nc, ng):
    vg, vc, vp = cache.policy.hierarchy.views()
    for b, (pages, chunks, grids) in enumerate(_direct_vectors(cache, nc, ng)):
        torch.testing.assert_close(vp[b, : len(pages)].double(), pages, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc[b, : len(chunks)].double(), chunks, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg[b, : len(grids)].double(), grids, atol=1e-5, rtol=1e-5)
        if len(pages) % nc == 0:  # a full chunk's vector is also the plain mean of its tokens' keys
            assert torch.allclose(chunks[-1], pages[-nc:].mean(0))


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_hierarchy_vectors_equal_direct_means(llama, offload):
    """13 middle pages, chunks of 3 (last one partial), grids of 2 chunks (last one partial),
    two sequences of different lengths; again after decoding moves pages into the middle."""
    model, _ = llama
    ids, mask, _ = left_padded([247, 200], seed=3)
    cache = kvdex.Cache(model, PAPER, 96, dense_layers=1, offload=offload, chunk_pages=3, grid_chunks=2)
    assert cache.policy.dim == 2 * 2 * 16  # sparse layers x kv heads x head dim
    greedy(model, ids, mask, cache, new=40)
    _check_hierarchy(cache, 3, 2)
    # the coalesced buffer is [grids | chunks | pages] of one tensor
    pol = cache.policy
    vg, vc, vp = pol.hierarchy.views()
    assert (
        vg.untyped_storage().data_ptr()
        == vp.untyped_storage().data_ptr()
        == pol.hierarchy.vall.untyped_storage().data_ptr()
    )


def test_hierarchy_after_prefill_only(llama):
    model, _ = llama
    cache = _prefill(model, prompt(300, 1), chunk_pages=4, grid_chunks=3)
    _check_hierarchy(cache, 4, 3)


def test_one_gemm_over_coalesced_levels_equals_per_level_scoring(llama, monkeypatch):
    model, _ = llama
    ids, mask, _ = left_padded([300, 247], seed=4)
    cache = _prefill(model, ids, mask, chunk_pages=3, grid_chunks=2)
    pol = cache.policy
    anchor = pol.anchor()
    p = int(pol.hierarchy.npages.min(0).values.max())
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    s_g, s_c, s_p = pol.hierarchy.scores(anchor, p)
    assert len(calls) == 1, "the whole hierarchy is scored by one matrix product"
    vg, vc, vp = pol.hierarchy.views()
    a = anchor.double()
    torch.testing.assert_close(
        s_g.double(), torch.einsum("bnf,bf->bn", vg[:, : s_g.shape[1]].double(), a), atol=1e-4, rtol=1e-5
    )
    torch.testing.assert_close(
        s_c.double(), torch.einsum("bnf,bf->bn", vc[:, : s_c.shape[1]].double(), a), atol=1e-4, rtol=1e-5
    )
    torch.testing.assert_close(s_p.double(), torch.einsum("bnf,bf->bn", vp[:, :p].double(), a), atol=1e-4, rtol=1e-5)


def test_anchor_is_mean_of_window_page_vectors(llama):
    """Eq. 3 against the stored window keys; the newest window page is partial here."""
    model, _ = llama
    n = 16 + 16 * 10 + 5
    cache = _prefill(model, prompt(n, 2))
    ws = n - 5 - 16  # two window pages: [ws, ws + 16) full, [ws + 16, n) partial
    parts = []
    for layer in cache.policy.info.sparse_layers:
        k, _ = cache.layers[layer].store.dense()
        full, part = k[0, :, ws : ws + 16].double().mean(1), k[0, :, ws + 16 : n].double().mean(1)
        parts.append(((full + part) / 2).reshape(-1))
    torch.testing.assert_close(cache.policy.anchor()[0].double(), torch.cat(parts), atol=1e-5, rtol=1e-5)


def _quantile_reference(s, active, rho):
    """Independent float64 reference of the per-level rule: keep active units >= the (1 - rho)
    quantile (linear interpolation). Also returns the units within rounding of the threshold."""
    import numpy as np

    out = torch.zeros_like(active)
    near = torch.zeros_like(active)
    for b in range(s.shape[0]):
        vals = s[b][active[b]].double().numpy()
        if len(vals):
            tau = float(np.quantile(vals, 1 - rho))
            out[b] = active[b] & (s[b].double() >= tau)
            near[b] = active[b] & ((s[b].double() - tau).abs() < 1e-5)
    return out, near


def _same_up_to_rounding(got, ref):
    want, near = ref
    assert not ((got != want) & ~near).any()


@pytest.mark.parametrize("preset", ["conservative", "moderate", "aggressive", None])
def test_masks_respect_parents(preset):
    """Random scores on a bound policy: no child under an inactive parent, each level's kept set
    is the quantile rule over the active children (ratio mode) or exactly K pages (budget mode)."""
    from kvdex.config import CacheConfig
    from kvdex.policies import PolicyInfo

    g = torch.Generator().manual_seed(7)
    budget = 16 + 32 + 16 * 9
    pol = ChessPolicy(anchor_from="window", scope="shared", preset=preset or "", chunk_pages=3, grid_chunks=4)
    pol.bind(PolicyInfo(CacheConfig(budget=budget), 3, (1, 2), 4, 2, 16))
    npages = torch.tensor([200, 137, 40, 5])
    p = int(npages.max())
    cn, gn = -(-p // 3), -(-p // 12)
    for trial in range(4):
        s_g, s_c, s_p = (torch.randn(4, n, generator=g) * (1 + trial) - trial for n in (gn, cn, p))
        m_g, m_c, m_p = pol.hierarchy.select_pages(s_g, s_c, s_p, npages)
        pc, pp = torch.arange(cn) // 4, torch.arange(p) // 3
        assert not (m_c & ~m_g[:, pc]).any(), "a chunk was kept under an inactive grid"
        assert not (m_p & ~m_c[:, pp]).any(), "a page was kept under an inactive chunk"
        live_p = torch.arange(p)[None] < npages[:, None]
        assert not (m_p & ~live_p).any()
        if preset:
            rg, rc, rp = chess_mod.PRESETS[preset]
            nchunks = (npages + 2) // 3
            live_g = torch.arange(gn)[None] < ((nchunks + 3) // 4)[:, None]
            live_c = torch.arange(cn)[None] < nchunks[:, None]
            _same_up_to_rounding(m_g, _quantile_reference(s_g, live_g, rg))
            _same_up_to_rounding(m_c, _quantile_reference(s_c, live_c & m_g[:, pc], rc))
            _same_up_to_rounding(m_p, _quantile_reference(s_p, live_p & m_c[:, pp], rp))
        else:  # budget mode: exactly K pages where the sequence has more, everything otherwise
            k = pol.cfg.retrieval_pages
            assert m_p.sum(1).tolist() == [min(k, int(n)) for n in npages]


def test_level_mask_all_ones_keeps_every_active_unit():
    s = torch.randn(3, 10)
    active = torch.rand(3, 10) > 0.3
    assert torch.equal(level_mask(s, active, 1.0), active)
    assert not level_mask(s, torch.zeros_like(active), 0.5).any()


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize("mode", ["ratios", "budget"])
def test_all_ratios_one_is_dense(family, mode, offload):
    """Every ratio 1 (or a budget larger than the context), rebuilt every step: the selection is
    every middle page, so the output equals transformers' SDPA."""
    model, ref = shared_pair(family)
    ids = prompt(300, 5)
    tok_ref, logit_ref = greedy(ref, ids, new=40)
    opts = ALL_ONE if mode == "ratios" else {}
    cache = kvdex.Cache(model, PAPER, 4096, offload=offload, dense_layers=1, trigger="always", **opts)
    tok, logit = greedy(model, ids, cache=cache, new=40)
    torch.testing.assert_close(logit, logit_ref, atol=1e-4, rtol=0)
    assert torch.equal(tok, tok_ref)
    assert cache.policy.rebuilds == 39  # after every decode step (steps 1..39)


@pytest.mark.parametrize("window", [16, 32])
def test_dense_across_page_boundaries(llama, window):
    """80 decode steps cross five page boundaries, so the page joining the middle lands on every
    position inside a chunk of 4 (a regression: the pre-indexed page once aliased its start)."""
    model, ref = llama
    ids = prompt(16 + 16 * 11 + 3, 15)
    tok_ref, logit_ref = greedy(ref, ids, new=80)
    cache = kvdex.Cache(model, PAPER, 4096, window=window, dense_layers=1, trigger="always", chunk_pages=4, **ALL_ONE)
    tok, logit = greedy(model, ids, cache=cache, new=80)
    torch.testing.assert_close(logit, logit_ref, atol=1e-4, rtol=0)
    _check_hierarchy(cache, 4, 4)


def test_one_selection_for_every_layer_and_head(llama):
    model, _ = llama
    cache = _prefill(model, prompt(300, 6), preset="aggressive")
    pol = cache.policy
    views = [LayerView.of(lay, cache.layers[lay].store, 1.0, pol.cfg) for lay in pol.info.sparse_layers]
    sels = [pol.select(None, view) for view in views]
    assert all(s is sels[0] for s in sels)
    pages = sels[0].pages
    assert pages.shape[1] == 2 and torch.equal(pages[:, 0], pages[:, 1])
    # the aggressive preset keeps about 0.5 * 0.2 * 0.1 of the pages (at least one)
    assert 1 <= int((pages[0, 0] >= 0).sum()) <= 3


def test_zero_copy_on_device_store(llama):
    """The selection is page ids; attention reads the store's own buffer at those slots."""
    model, _ = llama
    cache = _prefill(model, prompt(300, 8), preset="moderate")
    store = cache.layers[1].store
    sel = cache.policy.select(None, LayerView.of(1, store, 1.0, cache.config))
    aset = store.attend(sel)
    assert aset.k is store.k and aset.v is store.v
    want = sel.token_positions(SINK, PAGE)[0, 0]
    got = aset.idx[0, 0][aset.valid[0, 0]]
    assert set(want[want >= 0].tolist()) <= set(got.tolist())


def test_fixed_interval_rebuilds_exactly_every_n_steps(llama):
    model, _ = llama
    cache = kvdex.Cache(model, PAPER + ":trigger=interval:interval=8", 96, dense_layers=1)
    greedy(model, prompt(260, 9), cache=cache, new=40)
    assert [s for s, _ in cache.policy.rebuild_log] == [8, 16, 24, 32]
    st = cache.stats()["policy_stats"]
    assert st["rebuilds"] == 4 and st["builds"] == 1 and st["decode_steps"] == 39
    # the default interval is Appendix C's 6 pages of generated tokens
    cache = kvdex.Cache(model, PAPER, 96, dense_layers=1, trigger="interval")
    greedy(model, prompt(260, 9), cache=cache, new=6 * PAGE + 2)
    assert [s for s, _ in cache.policy.rebuild_log] == [6 * PAGE]


def test_fork_path_counts_steps_like_generate(llama):
    """The harness prefills a `full` cache and forks: the same step numbers as generate()."""
    model, _ = llama
    ids = prompt(260, 9)
    base = kvdex.Cache(model, "full", 96, dense_layers=1)
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(base), use_cache=True)
        cache = base.fork(PAPER + ":trigger=interval:interval=8")
        tok = out.logits[0, -1].argmax()
        for _ in range(17):
            out = model(input_ids=tok.view(1, 1), **cache_kwargs(cache), use_cache=True)
            tok = out.logits[0, -1].argmax()
    assert cache.policy.builds == 1
    assert [s for s, _ in cache.policy.rebuild_log] == [8, 16]


def _bound(llama, **opts):
    model, _ = llama
    ids, mask, _ = left_padded([300, 260], seed=11)
    return _prefill(model, ids, mask, dense_layers=1, **opts).policy


def _logits(entropy_like: list[float], vocab: int = 64):
    """[B, vocab] logits: row b uniform over round(exp(x)) tokens (entropy ln k, varentropy 0)."""
    out = torch.full((len(entropy_like), vocab), -1e4)
    for b, x in enumerate(entropy_like):
        k = max(1, min(vocab, round(torch.tensor(x).exp().item())))
        out[b, :k] = 0.0
    return out


def test_entropy_varentropy_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    h, v = entropy_varentropy(logits)
    p = torch.softmax(logits.double(), -1)
    surprise = -torch.log(p)
    torch.testing.assert_close(h.double(), (p * surprise).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        v.double(), (p * (surprise - (p * surprise).sum(-1, keepdim=True)) ** 2).sum(-1), atol=1e-4, rtol=1e-4
    )
    h1, v1 = entropy_varentropy(_logits([0.0]))
    assert abs(float(h1)) < 1e-6 and abs(float(v1)) < 1e-6  # one certain token (exact zeros elsewhere)


@pytest.mark.parametrize("combine", ["and", "or"])
@pytest.mark.parametrize("kind", ["output", "temporal"])
def test_trigger_rebuilds_exactly_when_thresholds_exceeded(llama, combine, kind):
    """Drive on_step with logits of known entropy; rebuilds happen exactly for the sequences whose page
    statistics exceed the thresholds (computed here independently), requested at the step after the check
    (its result is read one step late, so the host never waits for the device)."""
    tv = 0.9 if kind == "output" else 0.05
    pol = _bound(llama, check_every=4, entropy_threshold=1.5, varentropy_threshold=tv, combine=combine, varentropy=kind)
    g = torch.Generator().manual_seed(1)
    expected = []
    acc = [[], []]
    for step in range(1, 42):
        logits = torch.randn(2, 64, generator=g) * torch.tensor([[0.5], [4.0]]) * (1 + (step // 8) % 3)
        h, v = entropy_varentropy(logits)
        for b in range(2):
            acc[b].append((float(h[b]), float(v[b])))
        if step % 4 == 0:
            for b in range(2):
                hs = torch.tensor([x for x, _ in acc[b]], dtype=torch.float64)
                vs = torch.tensor([y for _, y in acc[b]], dtype=torch.float64)
                stat = vs.mean() if kind == "output" else hs.var(unbiased=False)
                e, w = bool(hs.mean() > 1.5), bool(stat > tv)
                if (e and w) if combine == "and" else (e or w):
                    expected.append((step + 1, b))
            acc = [[], []]
        before = pol.shared_scope.pages.clone()
        pol.on_step(step, logits)
        rebuilt = {b for s, b in pol.rebuild_log if s == step}
        for b in set(range(2)) - rebuilt:  # a sequence that did not trigger keeps its selection
            assert torch.equal(pol.shared_scope.pages[b][pol.shared_scope.pages[b] >= 0], before[b][before[b] >= 0])
    assert pol.rebuild_log == expected
    assert pol.checks == 2 * 10
    assert [s for s, *_ in pol.check_log] == [s for s in range(4, 41, 4) for _ in range(2)]
    assert 0 < len(expected) < 20, "the test must exercise both outcomes"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trigger_on_cuda_logits_decides_as_on_cpu(llama):
    """CUDA logits take the fused statistics kernel and the unwaited copy of each check; the checks' values
    and the rebuilds are those of the CPU path (one step late on both)."""
    opts = dict(check_every=4, entropy_threshold=1.5, varentropy_threshold=0.9)
    pols = [_bound(llama, **opts), _bound(llama, **opts)]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 42):
        logits = torch.randn(2, 40000, generator=g) * torch.tensor([[0.5], [4.0]]) * (1 + (step // 8) % 3)
        pols[0].on_step(step, logits)
        pols[1].on_step(step, logits.cuda())
    assert pols[1].rebuild_log == pols[0].rebuild_log and pols[0].rebuild_log
    assert [c[:2] for c in pols[1].check_log] == [c[:2] for c in pols[0].check_log]
    got, want = torch.tensor([c[2:] for c in pols[1].check_log]), torch.tensor([c[2:] for c in pols[0].check_log])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_trigger_never_and_thresholds_file(llama, tmp_path):
    path = tmp_path / "th.json"
    path.write_text(json.dumps({"entropy": 0.5, "varentropy": 1e-4, "temporal_varentropy": 0.0}))
    pol = _bound(llama, thresholds=str(path), check_every=2)
    assert pol.tau == (0.5, 1e-4)
    pol.on_step(1, _logits([2.0, 0.0]))
    pol.on_step(2, _logits([2.0, 0.0]))  # row 0: H = ln 7 > 0.5 but varentropy ~0 -> no rebuild
    assert pol.rebuild_log == []
    pol = _bound(llama, thresholds=str(path), check_every=2, combine="or")
    pol.on_step(1, _logits([2.0, 0.0]))
    pol.on_step(2, _logits([2.0, 0.0]))
    assert pol.rebuild_log == []  # the check at step 2 is read at step 3
    pol.on_step(3, _logits([0.0, 0.0]))
    assert pol.rebuild_log == [(3, 0)]
    pol = _bound(llama, trigger="never", entropy_threshold=0.0, varentropy_threshold=-1.0)
    for s in range(1, 65):
        pol.on_step(s, _logits([3.0, 3.0]))
    assert pol.rebuilds == 0 and pol.builds == 1


@pytest.mark.parametrize("opts", [dict(preset="aggressive", trigger="always"), dict(trigger="interval", interval=8)])
def test_batch_each_sequence_selects_for_itself(opts):
    model, _ = shared_pair("llama_gqa")
    ids, mask, prompts = left_padded([300, 180, 240], seed=12)
    cache = kvdex.Cache(model, PAPER, 112, dense_layers=1, **opts)
    tokens, logits = greedy(model, ids, mask, cache, new=30)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = kvdex.Cache(model, PAPER, 112, dense_layers=1, **opts)
        t1, l1 = greedy(model, p[None], None, alone, new=30)
        assert torch.equal(tokens[i, width:], t1[0, len(p) :]), f"sequence {i} differs in the batch"
        torch.testing.assert_close(logits[:, i], l1[:, 0], atol=1e-4, rtol=0)
        row = cache.policy.shared_scope.pages[i]
        assert torch.equal(row[row >= 0], alone.policy.shared_scope.pages[0][alone.policy.shared_scope.pages[0] >= 0])


def test_budget_mode_attends_the_budget(llama):
    model, _ = llama
    cache = kvdex.Cache(model, PAPER, 96, dense_layers=1)
    greedy(model, prompt(400, 13), cache=cache, new=20)
    assert cache.policy.stats()["mode"] == "budget"
    k = (96 - 16 - 32) // 16
    assert all((r >= 0).sum() == k for r in cache.policy.shared_scope.pages)
    assert cache.stats()["attended_tokens_per_step"] <= 96


def test_policy_spec_strings():
    p = kvdex.make_policy("chess:preset=moderate:interval=64:trigger=interval")
    assert (p.preset, p.interval, p.trigger) == ("moderate", 64, "interval")
    assert p.ratios == (0.8, 0.7, 0.7)
    assert kvdex.make_policy("chess:rho_g=0.5:rho_c=0.5:rho_p=1").ratios == (0.5, 0.5, 1.0)
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        kvdex.make_policy("chess:preset")
    with pytest.raises(TypeError, match="has no option"):
        kvdex.make_policy("chess:bogus=1")


@pytest.mark.parametrize(
    "opts,pattern",
    [
        (dict(preset="fast"), "preset must be one of '', conservative, moderate, aggressive, got 'fast'"),
        (dict(rho_g=0.5), "all three retention ratios"),
        (dict(rho_g=0.0, rho_c=0.5, rho_p=0.5), r"rho_g must be a fraction in \(0, 1\]"),
        (dict(rho_g=0.5, rho_c=1.5, rho_p=0.5), "rho_c must be a fraction"),
        (dict(preset="moderate", rho_g=0.5, rho_c=0.5, rho_p=0.5), "preset or rho_g/rho_c/rho_p, not both"),
        (dict(shape="x"), "shape must be one of conservative"),
        (dict(chunk_pages=0), "chunk_pages must be an int >= 1"),
        (dict(grid_chunks=2.5), "grid_chunks=2.5: expected int"),
        (dict(trigger="sometimes"), "trigger must be one of uncertainty, interval, always, never, got 'sometimes'"),
        (dict(interval=-1), "interval must be an int >= 0"),
        (dict(check_every=-2), "check_every must be an int >= 0"),
        (dict(varentropy="x"), "varentropy must be one of"),
        (dict(combine="xor"), "combine must be one of and, or, got 'xor'"),
        (dict(thresholds="/nonexistent/th.json"), "thresholds file .* not found.*kvdex calibrate chess"),
    ],
)
def test_bad_options(opts, pattern):
    with pytest.raises(ValueError, match=pattern):
        kvdex.make_policy("chess", **opts)


def test_bad_thresholds_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"entropy": 1.0}))
    with pytest.raises(ValueError, match="not a `kvdex calibrate chess` output"):
        kvdex.make_policy("chess", thresholds=str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a `kvdex calibrate chess` output"):
        kvdex.make_policy("chess", thresholds=str(path))


def test_calibration_statistics_and_thresholds(llama, tmp_path):
    """Per-page statistics equal a direct computation; the percentile file drives the policy."""
    from kvdex.calibrate import generation_statistics, page_statistics, thresholds

    model, _ = llama
    h, v = generation_statistics(model, prompt(120, 14)[0].tolist(), 70)
    assert h.shape == v.shape == (70,)
    st = page_statistics(h, v, 32)  # two complete pages, the last 6 steps are not a page
    for i in range(2):
        seg_h, seg_v = h[32 * i : 32 * (i + 1)].double(), v[32 * i : 32 * (i + 1)].double()
        assert torch.isclose(st["entropy"][i], seg_h.mean())
        assert torch.isclose(st["varentropy"][i], seg_v.mean())
        assert torch.isclose(st["temporal_varentropy"][i], seg_h.var(unbiased=False))
    assert page_statistics(h[:10], v[:10], 32)["entropy"].numel() == 0
    x = {k: torch.arange(101, dtype=torch.float64) for k in ("entropy", "varentropy", "temporal_varentropy")}
    assert thresholds(x, 99.0) == {"entropy": 99.0, "varentropy": 99.0, "temporal_varentropy": 99.0}
    with pytest.raises(ValueError, match="percentile"):
        thresholds(x, 0)
    with pytest.raises(ValueError, match="no complete page"):
        thresholds({"entropy": torch.zeros(0)}, 99)
    th = thresholds(st, 99.0)
    path = tmp_path / "th.json"
    path.write_text(json.dumps(th))
    pol = kvdex.make_policy(f"chess:thresholds={path}:varentropy=temporal")
    assert pol.tau == (th["entropy"], th["temporal_varentropy"])


@pytest.mark.filterwarnings("ignore:the sequence")
def test_page_size_32_with_sink_16(llama):
    """The paper's page size with kvdex's default sink: the grid starts at 16, so the window can
    reach past a tight device buffer (1050 tokens -> capacity 1056, window up to 1072). Regression:
    the attend set once pointed masked window rows out of bounds."""
    model, _ = llama
    cache = kvdex.Cache(model, PAPER + ":preset=moderate", 4096, page_size=32, window=32, dense_layers=1)
    tok, _ = greedy(model, prompt(1050, 16), cache=cache, new=4)
    assert tok.shape[1] == 1054
    assert cache.layers[1].store.k.shape[2] == 1056


def test_query_anchor_scores_pages_by_the_decode_query(llama):
    """``anchor_from="query"``: after the first decode step the selection is rebuilt from that step's
    queries (group means per kv head, every sparse layer); with one page per chunk and one chunk per
    grid the hierarchy is flat, so the selection is exactly the top-K pages by sum_l,h q . mean key."""
    model, _ = llama
    ids = prompt(400, 5)
    cache = _prefill(model, ids, budget=96, anchor_from="query", chunk_pages=1, grid_chunks=1, trigger="never")
    pol = cache.policy
    assert pol.query_builds == 0  # the prefill's build has no decode query: the window's keys
    window_pages = pol.shared_scope.pages.clone()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[7]]), **cache_kwargs(cache), use_cache=True)
    pol.on_step(1, out.logits[:, -1])
    assert pol.query_builds == 1 and pol.stats()["anchor_from"] == "query"
    # the anchor is the recorded queries, laid out like the page vectors
    anchor = pol.shared_scope.query_anchor()
    assert anchor.shape == (1, pol.dim)
    p = int(pol.hierarchy.npages.min(0).values.max())
    _, _, vp = pol.hierarchy.views()
    score = torch.einsum("bnf,bf->bn", vp[:, :p].double(), anchor.double())
    k = pol.cfg.retrieval_pages
    want = torch.sort(torch.topk(score, k, dim=1).indices, dim=1).values
    assert torch.equal(pol.shared_scope.pages[:, :k].cpu(), want.cpu())
    assert not torch.equal(pol.shared_scope.pages.cpu(), window_pages.cpu())  # the query moved the selection
    with pytest.raises(ValueError, match="anchor_from"):
        ChessPolicy(anchor_from="queries")
