"""Device page cache of offloaded stores (``OffloadStore(page_cache=C)``, ``kvdex.Cache(page_cache=C)``).

Invariants: with the cache, attention gets exactly the K/V it gets without it (bit-identical,
over many steps of changing selections, so slots are evicted and reused); hits / misses equal a
Python model of the cache (LRU among the slots no hit of the step keeps, ties to the lowest slot);
the Triton gather (``kvdex.kernels.uva.fill_slots``, run by Triton's interpreter on CPU) equals its
PyTorch twin; bad sizes raise ValueError. No timing is asserted.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, INTERP, greedy, left_padded

import kvdex
from kvdex.kernels.attention import sparse_decode_attention_reference
from kvdex.selection import Selection
from kvdex.storage import Grid, OffloadStore, TransferStats

B, H, D, PS = 2, 3, 8, 4
GRID = Grid(sink=4, page_size=PS, window_pages=2)


def _store(page_cache, lengths=(90, 77), seed=0, uva=False):
    st = OffloadStore(GRID, B, H, D, torch.float32, "cpu", TransferStats(), work_tokens=4 * PS, page_cache=page_cache)
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    st.ingest(k, v, torch.tensor(lengths))
    if uva:  # after ingest (a host-buffer growth with UVA syncs a CUDA stream)
        from kvdex.kernels import uva as uva_mod

        st.host._uva = uva_mod  # the Triton kernel on host tensors (interpreter)
    return st


def _selections(steps, n_sel, seed=1):
    """Random page selections [B, H, n_sel] over each sequence's middle: consecutive steps keep about
    half their pages (reuse, as decoding does), some entries are -1 padding; pages are distinct."""
    g = torch.Generator().manual_seed(seed)
    nmid = GRID.num_middle_pages(torch.tensor([90, 77]))
    prev = None
    out = []
    for _ in range(steps):
        sel = torch.full((B, H, n_sel), -1, dtype=torch.long)
        for b in range(B):
            for h in range(H):
                pool = torch.randperm(int(nmid[b]), generator=g)
                if prev is not None:  # keep some of the previous step's pages
                    keep = [p for p in prev[b, h].tolist() if p >= 0 and torch.rand(1, generator=g) < 0.6]
                    rest = [p for p in pool.tolist() if p not in keep]
                    pool = torch.tensor(keep + rest)
                cnt = n_sel - int(torch.randint(0, 2, (1,), generator=g))  # sometimes one padding entry
                sel[b, h, :cnt] = pool[:cnt][torch.randperm(cnt, generator=g)]
        out.append(sel)
        prev = sel
    return out


class LRUModel:
    """The page cache in plain Python: per (b, h) C slots, hits keep their slot, each miss (in selection
    order) takes the free slot with the oldest last use (never used first, ties to the lowest slot)."""

    def __init__(self, c):
        self.c = c
        self.page = {}  # (b, h) -> [page or None] * C
        self.stamp = {}
        self.tick = 0

    def step(self, sel):
        self.tick += 1
        hits = misses = 0
        for b in range(sel.shape[0]):
            for h in range(sel.shape[1]):
                page = self.page.setdefault((b, h), [None] * self.c)
                stamp = self.stamp.setdefault((b, h), [-1] * self.c)
                want = [p for p in sel[b, h].tolist() if p >= 0]
                kept = {i for i, p in enumerate(page) if p in want}
                free = sorted((i for i in range(self.c) if i not in kept), key=lambda i: (stamp[i], i))
                for p in want:
                    if p in page:
                        hits += 1
                        stamp[page.index(p)] = self.tick
                    else:
                        misses += 1
                        i = free.pop(0)
                        page[i], stamp[i] = p, self.tick
        return hits, misses


@pytest.mark.parametrize("c", [6, 9])
def test_page_cache_feeds_attention_the_same_kv_and_counts_like_the_model(c):
    n_sel = 6  # c == n_sel: the smallest pool, every step evicts
    plain, cached = _store(0), _store(c)
    model = LRUModel(c)
    q = torch.randn(B, 2 * H, D, generator=torch.Generator().manual_seed(5))
    hits = misses = 0
    for sel in _selections(30, n_sel):
        a0, a1 = plain.attend(Selection(pages=sel)), cached.attend(Selection(pages=sel))
        assert torch.equal(a0.valid, a1.valid) and torch.equal(a0.positions, a1.positions)
        gi = lambda a, x: x.gather(2, a.idx[..., None].expand(-1, -1, -1, D))  # noqa: E731
        ok = a0.valid[..., None]
        assert torch.equal(torch.where(ok, gi(a0, a0.k), 0), torch.where(ok, gi(a1, a1.k), 0))
        assert torch.equal(torch.where(ok, gi(a0, a0.v), 0), torch.where(ok, gi(a1, a1.v), 0))
        o0 = sparse_decode_attention_reference(q, a0.k, a0.v, a0.idx, a0.valid, 0.3)
        o1 = sparse_decode_attention_reference(q, a1.k, a1.v, a1.idx, a1.valid, 0.3)
        assert torch.equal(o0, o1)
        h_, m_ = model.step(sel)
        hits, misses = hits + h_, misses + m_
        st = cached.page_cache_stats()
        assert (st["hits"], st["misses"]) == (hits, misses)
    st = cached.page_cache_stats()
    assert st["hits"] == hits > 0 and st["misses"] == misses > 0
    assert st["bytes_moved"] == misses * 2 * PS * D * 4
    assert misses < sum(int((s >= 0).sum()) for s in _selections(30, n_sel))  # fewer pages moved than selected


def test_oversized_selection_bypasses_and_empties_the_pool():
    st = _store(4)
    sel = _selections(1, 4)[0]
    st.attend(Selection(pages=sel))
    assert int((st.pc_page[..., :4] >= 0).sum()) > 0
    ref = _store(0)
    big = torch.arange(6).expand(B, H, 6).contiguous()  # 6 pages > 4 slots
    with pytest.warns(UserWarning, match="bypass the device page cache"):
        a = st.attend(Selection(pages=big))
    r = ref.attend(Selection(pages=big))
    gi = lambda s, x: x.gather(2, s.idx[..., None].expand(-1, -1, -1, D))  # noqa: E731
    assert torch.equal(gi(a, a.k), gi(r, r.k))
    assert bool((st.pc_page == -1).all())
    a = st.attend(Selection(pages=sel))  # the pool refills from empty: all misses
    r = ref.attend(Selection(pages=sel))
    assert torch.equal(torch.where(a.valid[..., None], gi(a, a.v), 0), torch.where(r.valid[..., None], gi(r, r.v), 0))


def test_bad_page_cache_sizes_raise(llama):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="page_cache"):
            OffloadStore(GRID, B, H, D, torch.float32, "cpu", TransferStats(), work_tokens=8, page_cache=bad)
        with pytest.raises(ValueError, match="page_cache"):
            kvdex.Cache(llama[0], "quest", 96, offload=True, page_cache=bad)


@pytest.mark.parametrize("budget", [96, 160])
def test_cache_with_page_cache_decodes_bit_identically(llama, budget):
    """End to end (tiny Llama, fp32, ragged batch, Quest): offloaded with the smallest page cache (so
    steps evict) == offloaded without it, logits bit for bit over 40 steps; the stats add up."""
    model = llama[0]
    ids, mask, _ = left_padded([150, 97, 40], seed=3)
    plain = kvdex.Cache(model, "quest", budget, offload=True, dense_layers=1)
    t0, l0 = greedy(model, ids, mask, plain, new=40)
    pages = plain.config.retrieval_pages
    cached = kvdex.Cache(model, "quest", budget, offload=True, dense_layers=1, page_cache=pages)
    t1, l1 = greedy(model, ids, mask, cached, new=40)
    assert torch.equal(t0, t1) and torch.equal(l0, l1)
    s = cached.stats()["page_cache"]
    assert s["slots"] == pages and s["hits"] > 0 and s["misses"] > 0 and 0 < s["hit_rate"] < 1
    page_bytes = 2 * 16 * model.config.head_dim * 4
    assert s["bytes_moved"] == s["misses"] * page_bytes
    assert "page_cache" not in plain.stats()


@pytest.mark.skipif(INTERP or CUDA, reason="runs the kernels itself")
def test_interpreter_suite(interpreter_suite):
    """This file's kernel tests (``-k triton``) under TRITON_INTERPRET=1 in a fresh interpreter (triton must
    be imported after the variable is set; tests/conftest.py: one for every such file of the session)."""
    pytest.importorskip("triton")
    interpreter_suite(__file__)


@pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
def test_triton_fill_slots_matches_twin_and_store_paths_agree():
    pytest.importorskip("triton")
    from kvdex.kernels import uva

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 3, 7, 2, 4, 8, generator=g)
    pages = torch.randint(-1, 7, (2, 3, 5), generator=g)
    dst = torch.where(torch.rand(2, 3, 5, generator=g) < 0.6, torch.arange(5).expand(2, 3, 5), -1)
    bufs = [torch.full((2, 3, 30, 8), 7.0) for _ in range(4)]
    uva.fill_slots_reference(src, pages, dst, bufs[0], bufs[1], base=6)
    src_d = src.pin_memory() if dev == "cuda" else src
    kd, vd = bufs[2].to(dev), bufs[3].to(dev)
    uva.fill_slots(src_d, pages.to(dev), dst.to(dev), kd, vd, base=6)
    assert torch.equal(kd.cpu(), bufs[0]) and torch.equal(vd.cpu(), bufs[1])
    assert not torch.equal(bufs[0], torch.full_like(bufs[0], 7.0))  # something was written
    with pytest.raises(ValueError):
        uva.fill_slots(src_d, pages.to(dev), dst[:, :, :2].to(dev), kd, vd, base=6)
    if dev == "cpu":  # the whole store: the Triton path (interpreter) == the twin path, slots and outputs
        twin, kern = _store(6), _store(6, uva=True)
        for sel in _selections(12, 6):
            a, b = twin.attend(Selection(pages=sel)), kern.attend(Selection(pages=sel))
            assert torch.equal(a.idx, b.idx) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(twin.pc_count, kern.pc_count) and int(twin.pc_count[..., 0].sum()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", ["0", "1"], ids=["torch-bookkeeping", "fused-bookkeeping"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_page_cache_decodes_bit_identically(llama, dtype, fused, monkeypatch):
    """CUDA, pinned host pages, the UVA fill kernel: logits bit-identical to the offloaded store without
    a page cache (both run the same slot-list decode kernel over the same K/V in the same order)."""
    import copy

    monkeypatch.setenv("KVDEX_PC_FUSED", fused)
    model = copy.deepcopy(llama[0]).to(dtype).cuda()
    ids, mask, _ = left_padded([150, 97, 40], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    plain = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    t0, l0 = greedy(model, ids, mask, plain, new=60)
    cached = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1, page_cache=3)
    t1, l1 = greedy(model, ids, mask, cached, new=60)
    assert cached.layers[-1].store.host._uva is not None
    assert torch.equal(t0, t1) and torch.equal(l0, l1)
    s = cached.stats()["page_cache"]
    assert s["hits"] > 0 and s["misses"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_registered_host_pages(llama, monkeypatch):
    """Host pages pinned in place (cudaHostRegister, exact size; what large buffers use): the UVA gather,
    the page-cache fill and the staging path read them right, growth unpins the old buffer, and a
    whole offloaded decode with a page cache equals the offloaded decode without."""
    from kvdex.storage import host as host_mod

    monkeypatch.setattr(host_mod, "_REGISTER_MIN_BYTES", 0)  # register even the tiny test buffers
    hp = host_mod.HostPages(1, 2, 4, 8, torch.float32, "cuda", TransferStats())
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 4, 8, generator=g).cuda(), torch.randn(2, 10, 4, 8, generator=g).cuda()
    hp.write(0, 0, k, v)
    assert hp._registered and hp.data is hp._registered[0] and host_mod.is_registered(hp.data)
    pages = torch.tensor([[[3, 0, -1], [9, 2, 5]]], device="cuda")
    uva = hp.fetch_pages(pages.clamp(min=0))
    uva_mod, hp._uva = hp._uva, None
    staged = hp.fetch_pages(pages.clamp(min=0))
    hp._uva = uva_mod
    assert torch.equal(uva, staged)
    first = hp.data
    hp.write(0, 10, k[:, :1], v[:, :1])
    hp.reserve(hp.capacity + 100)  # growth: a new registered buffer, the old one unpinned
    assert hp.data is not first and len(hp._registered) == 1 and torch.equal(hp.data[0, :, :10, 0].cuda(), k)

    import copy

    model = copy.deepcopy(llama[0]).cuda()
    ids, mask, _ = left_padded([150, 97, 40], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    plain = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    t0, l0 = greedy(model, ids, mask, plain, new=30)
    cached = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1, page_cache=3)
    t1, l1 = greedy(model, ids, mask, cached, new=30)
    assert cached.layers[-1].store.host._registered
    assert torch.equal(t0, t1) and torch.equal(l0, l1)


def test_token_selections_bypass_the_pool_and_stay_exact():
    """A token selection (no pages) lands on the pool's rows: the pool is emptied, and a later page
    selection refills it; every step's attended K/V equals the store without a cache."""
    st, ref = _store(6), _store(0)
    sels = _selections(3, 6)
    toks = torch.tensor([[[4, 9, 30], [5, 6, 7], [40, 41, 8]], [[4, 5, 6], [70, 12, 13], [20, 21, 22]]])
    gi = lambda s, x: x.gather(2, s.idx[..., None].expand(-1, -1, -1, D))  # noqa: E731
    for sel in (Selection(pages=sels[0]), Selection(tokens=toks), Selection(pages=sels[1]), Selection(pages=sels[2])):
        a, r = st.attend(sel), ref.attend(sel)
        ok = r.valid[..., None]
        assert torch.equal(a.valid, r.valid)
        assert torch.equal(torch.where(ok, gi(a, a.k), 0), torch.where(ok, gi(r, r.k), 0))
        assert torch.equal(torch.where(ok, gi(a, a.v), 0), torch.where(ok, gi(r, r.v), 0))
        if sel.tokens is not None:
            assert bool((st.pc_page == -1).all())


@pytest.mark.skipif(not (INTERP or CUDA), reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("c,chunk", [(6, 32), (9, 32), (9, 2), (14, 4)])
def test_triton_page_cache_step_matches_twin(c, chunk, monkeypatch):
    """The fused bookkeeping kernel (KVDEX_PC_FUSED=1) takes the twin's decisions: same rows, same pool
    contents, same tags / stamps / counts, step after step (with eviction). 12 steps (was 25): every cache
    size still has a row that misses more pages than it holds, so it evicts (asserted below)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("store-level comparison on host tensors: interpreter only (the CUDA end-to-end test covers GPU)")
    monkeypatch.setenv("KVDEX_PC_FUSED", "1")
    from kvdex.kernels import page_cache_triton

    monkeypatch.setattr(page_cache_triton, "_PC_CHUNK", chunk)  # several tag chunks per program when chunk < C
    twin, kern = _store(c), _store(c, uva=True)
    twin.host._uva = None
    assert kern._pc_fused() is not None and twin._pc_fused() is None
    for sel in _selections(12, 6):
        a, b = twin.attend(Selection(pages=sel)), kern.attend(Selection(pages=sel))
        assert torch.equal(a.idx, b.idx) and torch.equal(a.valid, b.valid)
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(twin.pc_page[..., :c], kern.pc_page[..., :c])
        assert torch.equal(twin.pc_stamp[..., :c], kern.pc_stamp[..., :c])
        assert torch.equal(twin.pc_count, kern.pc_count)
    assert int(kern.pc_count[..., 0].sum()) > 0 and int(kern.pc_count[..., 1].sum()) > 0
    assert int(kern.pc_count[..., 1].max()) > c  # a row missed more pages than the cache holds: it evicted
