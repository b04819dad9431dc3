"""Kernels that cut the small kernels of a decode step: DeviceStore's one-launch append.

The append kernel is a copy: the buffers must end bit-identical to DeviceStore's PyTorch writes
(its twin), for ragged lengths and several new columns. On CPU it runs through Triton's interpreter
in a subprocess (as tests/test_triton_kernels.py); ``-m gpu`` runs it compiled and checks a
GPU DeviceStore decode with the kernel against ``KVDEX_TRITON=0``.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"
run_kernels = pytest.mark.skipif(not (CUDA or INTERP), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

if INTERP and not CUDA:  # the test-only shim of tests/test_triton_kernels.py
    from triton.runtime import interpreter as _itp

    _orig_patch = _itp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _itp._patch_lang_tensor = _patch_lang_tensor

from kvdex.kernels import step_triton as ap  # noqa: E402


@pytest.mark.skipif(CUDA or INTERP, reason="runs the kernels itself")
def test_interpreter_suite(interpreter_suite):
    """This file under TRITON_INTERPRET=1 (tests/conftest.py: one fresh interpreter for every such file)."""
    interpreter_suite(__file__)


@run_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("b,h,t,d", [(1, 8, 1, 128), (3, 2, 1, 64), (2, 3, 4, 48)])
def test_append_equals_twin(dtype, b, h, t, d):
    g = torch.Generator().manual_seed(b * 10 + t)
    s = 40
    kb = torch.randn(b, h, s, d, generator=g).to(dtype)
    vb = torch.randn(b, h, s, d, generator=g).to(dtype)
    k = torch.randn(b, h, t, d, generator=g).to(dtype)
    v = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # the model's layout: [B, t, H, D] transposed
    lengths = torch.randint(0, s - t, (b,), generator=g)
    rk, rv = kb.clone(), vb.clone()
    ap.append_rows_reference(rk, rv, k, v, lengths)
    fk, fv = kb.clone().to(DEV), vb.clone().to(DEV)
    ap.append_rows(fk, fv, k.to(DEV), v.to(DEV), lengths.to(DEV))
    assert torch.equal(fk.cpu(), rk) and torch.equal(fv.cpu(), rv)


@run_kernels
@pytest.mark.parametrize("sink,ps,wp", [(4, 16, 1), (0, 8, 2), (3, 4, 3)])
def test_ring_append_equals_offload_store_append(sink, ps, wp):
    """OffloadStore.append (one column): the kernel with ring=(sink, window) writes the same ring slots."""
    st = _offload_store(sink, ps, wp, b=2)
    g = torch.Generator().manual_seed(7)
    for _ in range(2 * ps + 3):  # across page boundaries (the ring wraps)
        k = torch.randn(st.batch, st.kv_heads, 1, st.head_dim, generator=g)
        v = torch.randn(st.batch, st.kv_heads, 1, st.head_dim, generator=g)
        fk, fv = st.k.clone().to(DEV), st.v.clone().to(DEV)
        ap.append_rows(fk, fv, k.to(DEV), v.to(DEV), st.lengths.to(DEV), ring=(sink, st.grid.window))
        st.append(k, v)  # CPU store: the PyTorch writes
        assert torch.equal(fk.cpu(), st.k) and torch.equal(fv.cpu(), st.v)


@run_kernels
@pytest.mark.parametrize("sink,ps,wp", [(4, 16, 1), (0, 8, 2), (3, 4, 3)])
def test_append_join_equals_twin(sink, ps, wp):
    """DeviceStore.append_join's one launch: the token written, which pages join, their ids, keys and positions
    (clamped to the buffer) as the PyTorch path computes them, bit for bit; lengths below the sink, in the
    first window, at a page boundary (a join) and just past it, and at the buffer's end."""
    from kvdex.kernels.reference import append_join_rows_reference
    from kvdex.storage import Grid

    grid = Grid(sink, ps, wp)
    g = torch.Generator().manual_seed(ps + wp)
    S = sink + 6 * ps
    b, h, d = 6, 3, 48
    first = sink + wp * ps  # the first length at which a page joins
    lengths = torch.tensor([0, max(sink - 1, 0), first - 1, first, first + 1, S - 1])
    for dtype in (torch.float32, torch.float16):
        kb = torch.randn(b, h, S, d, generator=g).to(dtype)
        vb = torch.randn(b, h, S, d, generator=g).to(dtype)
        k = torch.randn(b, h, 1, d, generator=g).to(dtype)
        v = torch.randn(b, h, 1, d, generator=g).to(dtype)
        rk, rv = kb.clone(), vb.clone()
        want = append_join_rows_reference(rk, rv, k, v, lengths, grid)
        fk, fv = kb.clone().to(DEV), vb.clone().to(DEV)
        got = ap.append_join_rows(fk, fv, k.to(DEV), v.to(DEV), lengths.to(DEV), grid)
        assert torch.equal(fk.cpu(), rk) and torch.equal(fv.cpu(), rv)
        for x, y in zip(got, want, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y)
        assert want[0].tolist() == [False, False, False, True, False, False] or sink == 0
    with pytest.raises(ValueError, match="one row"):
        ap.append_join_rows(fk, fv, k.to(DEV).expand(-1, -1, 2, -1), v.to(DEV), lengths.to(DEV), grid)


def test_append_bad_inputs_raise_value_error():
    kb = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError):
        ap.append_rows(
            kb, kb.clone(), torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), torch.zeros(1, dtype=torch.long)
        )
    with pytest.raises(ValueError):
        ap.append_rows(
            kb, kb.clone(), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(2, dtype=torch.long)
        )


@run_kernels
@pytest.mark.parametrize("size", [1, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_push_equals_twin(size, dtype):
    """PRKV's query ring: the one-launch shift + write ends bit-identical to QueryRing.push's PyTorch ops,
    push after push (every row moves; the oldest leaves), from a partly valid ring, q not contiguous."""
    from kvdex.kernels.reference import ring_push_reference

    g = torch.Generator().manual_seed(size)
    b, hq, d = 2, 6, 24  # D not a power of two: masked columns
    rq = torch.randn(b, hq, size, d, generator=g).to(dtype)
    rp = torch.randint(0, 999, (b, size), generator=g)
    rv = torch.rand(b, size, generator=g) < 0.5
    want = [t.clone() for t in (rq, rp, rv)]
    got = [t.to(DEV) for t in (rq, rp, rv)]
    for step in range(size + 2):
        q = torch.randn(b, d, hq, generator=g).to(dtype).transpose(1, 2)  # [B, Hq, D], strided
        pos = torch.tensor([1000 + step, 2000 + step])
        ring_push_reference(*want, q, pos)
        ap.ring_push_(*got, q.to(DEV), pos.to(DEV))
        for w, x in zip(want, got, strict=True):
            assert torch.equal(w, x.cpu()), step
    assert bool(want[2].all()) and int(want[1][0, -1]) == 1000 + size + 1


def test_ring_push_bad_inputs():
    with pytest.raises(ValueError, match="contiguous ring"):
        ap.ring_push_(torch.zeros(1, 2, 3, 4)[:, :, :, :2], torch.zeros(1, 3, dtype=torch.long),
                      torch.zeros(1, 3, dtype=torch.bool), torch.zeros(1, 2, 2), torch.zeros(1))  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        ap.ring_push_(torch.zeros(1, 2, 3, 4), torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool),
                      torch.zeros(1, 2, 4), torch.zeros(1))  # fmt: skip


def _offload_store(sink, ps, wp, b=2, h=3, d=8, device="cpu"):
    from kvdex.storage import Grid, OffloadStore, TransferStats

    g = torch.Generator().manual_seed(sink + ps)
    st = OffloadStore(Grid(sink, ps, wp), b, h, d, torch.float32, device, TransferStats(), work_tokens=64)
    lengths = torch.tensor([sink + ps * (wp + 5) + 3, 3][:b])
    n = int(lengths.max())
    st.ingest(torch.randn(b, h, n, d, generator=g).to(device), torch.randn(b, h, n, d, generator=g).to(device), lengths)
    for _ in range(ps + 2):  # decode appends: the window ring turns, pages leave it
        st.append(torch.randn(b, h, 1, d, generator=g).to(device), torch.randn(b, h, 1, d, generator=g).to(device))
    return st


@run_kernels
@pytest.mark.parametrize("sink,ps,wp", [(4, 16, 1), (16, 8, 2), (0, 8, 1), (3, 4, 3)])
@pytest.mark.parametrize("p", [5, 1])
def test_offload_slot_list_equals_store_attend(sink, ps, wp, p):
    from kvdex.selection import Selection

    st = _offload_store(sink, ps, wp)
    g = torch.Generator().manual_seed(p)
    nmid = int(st.grid.num_middle_pages(st.lengths_host).max())
    pages = torch.randint(-1, nmid, (st.batch, st.kv_heads, p), generator=g)
    a = st.attend(Selection(pages=pages))  # the PyTorch ops (CPU store)
    idx, valid, pos = ap.offload_slot_list(
        st.lengths.to(DEV), pages.to(DEV), sink, ps, wp, st.fixed
    )  # fmt: skip
    assert idx.dtype == a.idx.dtype and valid.dtype == a.valid.dtype and pos.dtype == a.positions.dtype
    assert torch.equal(idx.cpu(), a.idx) and torch.equal(valid.cpu(), a.valid) and torch.equal(pos.cpu(), a.positions)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_offload_attend_fast_equals_pytorch(monkeypatch):
    from kvdex.selection import Selection
    from kvdex.storage import offload

    st = _offload_store(4, 16, 2, device="cuda")
    nmid = int(st.grid.num_middle_pages(st.lengths_host).max())
    pages = torch.randint(-1, nmid, (st.batch, st.kv_heads, 6), device="cuda")
    a = st.attend(Selection(pages=pages))
    monkeypatch.setattr(offload, "_fast_slot_list", lambda: None)
    r = st.attend(Selection(pages=pages))
    for x, y in zip((a.k, a.v, a.idx, a.valid, a.positions), (r.k, r.v, r.idx, r.valid, r.positions), strict=True):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_graph_decode_attended_count_identical():
    """CUDA-graph decode on a device store, pages (quest) and tokens (prkv's reranked tokens): the count the
    attention kernel adds in place equals the eager decode's PyTorch expression (host lengths)."""
    import kvdex
    from kvdex.bench import runner, shapes

    model = shapes.build_model("tiny", torch.bfloat16, "cuda")
    ids = runner._prompt(2, 300, model.config.vocab_size, 0, "cuda")
    for policy in ("quest", "prkv:rerank=4:rerank_group=weight"):
        stats = []
        for graph in (True, False):
            cache = kvdex.Cache(model, policy, 128, dense_layers=1)
            out = kvdex.generate(model, cache, ids, max_new_tokens=40, cuda_graph=graph)
            stats.append((out, cache.stats()["attended_tokens_per_step"]))
        assert torch.equal(stats[0][0], stats[1][0]) and stats[0][1] == stats[1][1], policy


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_gpu_decode_identical_with_and_without_step_kernels(monkeypatch, offload):
    """Eager decode of quest: the step kernels (append, offload slot list) vs the PyTorch ops, every other
    kernel the same: bit-identical logits and store buffers."""
    import kvdex
    from kvdex.bench import runner, shapes
    from kvdex.storage import device
    from kvdex.storage import offload as off

    model = shapes.build_model("tiny", torch.bfloat16, "cuda")
    ids = runner._prompt(2, 300, model.config.vocab_size, 0, "cuda")
    gates = {(device, "_fast_append"): device._fast_append(), (off, "_fast_append"): off._fast_append(),
             (off, "_fast_slot_list"): off._fast_slot_list()}  # fmt: skip
    assert all(f is not None for f in gates.values())
    outs = []
    for use in (True, False):
        for (mod, name), f in gates.items():
            monkeypatch.setattr(mod, name, (lambda f=f: f) if use else (lambda: None))
        cache = kvdex.Cache(model, "quest", 128, dense_layers=1, offload=offload)
        nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
        logits = []
        for _ in range(40):  # across page boundaries
            nxt, lg = runner._step(model, cache, nxt)
            logits.append(lg)
        outs.append((torch.stack(logits), [lay.store.k.clone() for lay in cache.layers]))
    assert torch.equal(outs[0][0], outs[1][0])  # bit-identical decode
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))
