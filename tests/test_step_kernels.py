"""Kernels that cut the small kernels of a decode step: DeviceStore's one-launch append.

The append kernel is a copy: the buffers must end bit-identical to DeviceStore's PyTorch writes
(its twin), for ragged lengths and several new columns. With ``advance=True`` the appends also advance the
device lengths in their launch (the last program of each sequence, by ticket): once per sequence, the ticket
back at zero, and the stores that use them end with the same lengths as their PyTorch path. On CPU it runs
through Triton's interpreter in a subprocess (as tests/test_triton_kernels.py); ``-m gpu`` runs it compiled
and checks a GPU DeviceStore decode with the kernel against ``KVDEX_TRITON=0``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, DEV, INTERP, run_kernels

triton = pytest.importorskip("triton")

from kvdex.kernels import append_triton as ap  # noqa: E402
from kvdex.kernels import query_ring_triton as qring  # noqa: E402
from kvdex.kernels import slots_triton as slots  # noqa: E402


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
@pytest.mark.parametrize("ring", [None, (3, 8)], ids=["slots", "ring"])
@pytest.mark.parametrize("b,h,t", [(1, 8, 1), (3, 2, 1), (2, 3, 4), (5, 1, 3)])
def test_append_advances_lengths_once(b, h, t, ring):
    """advance=True: the buffers of the twin (of the kernel without advance for a ring), every sequence's length
    advanced by t exactly once, launch after launch (ragged lengths), and the ticket back at zero; without it the
    lengths are untouched."""
    g = torch.Generator().manual_seed(b * 100 + h * 10 + t)
    s, d = 40, 24
    kb, vb = torch.randn(2, b, h, s, d, generator=g)
    lengths = torch.randint(0, 21, (b,), generator=g)
    rk, rv, rl = kb.clone().to(DEV), vb.clone().to(DEV), lengths.to(DEV)  # without advance: the reference
    fk, fv, fl = kb.clone().to(DEV), vb.clone().to(DEV), lengths.clone().to(DEV)
    ticket = torch.zeros(b, dtype=torch.int32, device=DEV)
    for step in range(3):
        k, v = torch.randn(2, b, h, t, d, generator=g).to(DEV)
        if ring is None:
            ap.append_rows_reference(rk, rv, k, v, rl)
        else:
            ap.append_rows(rk, rv, k, v, rl, ring=ring)
        assert torch.equal(rl.cpu(), lengths + step * t)  # untouched by the kernel
        ap.append_rows(fk, fv, k, v, fl, ring=ring, advance=True, ticket=ticket)
        rl = rl + t
        assert torch.equal(fk.cpu(), rk.cpu()) and torch.equal(fv.cpu(), rv.cpu()), step
        assert torch.equal(fl.cpu(), lengths + (step + 1) * t), step
        assert not bool(ticket.any()), step


@run_kernels
@pytest.mark.parametrize("b,h", [(1, 1), (6, 3), (4, 8)])
def test_append_join_advances_lengths_once(b, h):
    """append_join_rows with advance=True: the outputs and buffers of the twin at the lengths before the token,
    every length advanced by 1 exactly once, launch after launch across page joins, the ticket back at zero;
    without it the lengths are untouched."""
    from kvdex.kernels.reference import append_join_rows_reference
    from kvdex.storage import Grid

    grid = Grid(4, 8, 1)
    g = torch.Generator().manual_seed(b * 10 + h)
    s, d = 4 + 6 * 8, 40
    kb, vb = torch.randn(2, b, h, s, d, generator=g)
    lengths = torch.randint(0, 30, (b,), generator=g)
    lengths[0] = 11  # the next token makes the first page join
    rk, rv = kb.clone(), vb.clone()
    fk, fv, fl = kb.clone().to(DEV), vb.clone().to(DEV), lengths.clone().to(DEV)
    ticket = torch.zeros(b, dtype=torch.int32, device=DEV)
    for step in range(4):
        k, v = torch.randn(2, b, h, 1, d, generator=g)
        rl = lengths + step
        want = append_join_rows_reference(rk, rv, k, v, rl, grid)
        got = ap.append_join_rows(fk, fv, k.to(DEV), v.to(DEV), fl, grid, advance=True, ticket=ticket)
        for x, y in zip(got, want, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y), step
        assert torch.equal(fk.cpu(), rk) and torch.equal(fv.cpu(), rv), step
        assert torch.equal(fl.cpu(), rl + 1) and not bool(ticket.any()), step
    assert bool(want[0][0]) or step != 0  # a join happened on the first launch
    before = fl.clone()
    ap.append_join_rows(fk, fv, k.to(DEV), v.to(DEV), fl, grid)
    assert torch.equal(fl, before)


def test_advance_needs_a_ticket():
    kb, lengths = torch.zeros(2, 2, 8, 4), torch.zeros(2, dtype=torch.long)
    k = torch.zeros(2, 2, 1, 4)
    for ticket in (None, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="ticket"):
            ap.append_rows(kb, kb.clone(), k, k, lengths, advance=True, ticket=ticket)
    with pytest.raises(ValueError, match="ticket"):
        ap.append_join_rows(kb, kb.clone(), k, k, lengths, None, advance=True)


def _store_ops(offload: bool, device: str):
    """A store of ragged lengths after ingest, then appends of one and several tokens and join appends across
    page joins: per op the device outputs (CPU copies), the device and host lengths; the store."""
    from kvdex.storage import DeviceStore, Grid, OffloadStore, TransferStats

    grid, b, h, d = Grid(4, 8, 1), 3, 2, 16
    gen = torch.Generator().manual_seed(3)
    args = (grid, b, h, d, torch.float32, device, TransferStats())
    st = OffloadStore(*args, work_tokens=32) if offload else DeviceStore(*args)
    lengths = torch.tensor([3, 11, 19])
    st.ingest(*(torch.randn(b, h, 19, d, generator=gen).to(device) for _ in range(2)), lengths)
    out, ops = [], ["append1", "append3", *["join"] * 9, "append1", "append2", "join"]
    for op in ops:
        t = 1 if op == "join" else int(op[-1])
        k, v = (torch.randn(b, h, t, d, generator=gen).to(device) for _ in range(2))
        if op == "join":
            j = st.append_join(k, v)
            got = [j.joins, j.start, j.keys, j.values, j.positions, j.host_start, j.host_count]
        else:
            u = st.append(k, v)
            got = [u.start, u.count, u.keys, u.values]
        # snapshots (one copy on any device): .cpu() of a CPU tensor is the tensor itself, which later ops change
        out.append([x.to("cpu", copy=True) for x in (*got, st.lengths, st.lengths_host, st.k, st.v)])
        assert torch.equal(st.lengths.cpu(), st.lengths_host), op
        assert not bool(st.lengths_ticket.any()), op
    n = sum(1 if op == "join" else int(op[-1]) for op in ops)
    assert st.lengths_host.tolist() == (lengths + n).tolist()
    return out


@run_kernels
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_store_appends_advance_lengths_once(monkeypatch, offload):
    """DeviceStore / OffloadStore through the append kernels (the lengths advanced in their launch, no ``+=``) and
    through the PyTorch path (``+=``): the same outputs, buffers, device and host lengths after every op."""
    from kvdex.storage import device as dev_mod
    from kvdex.storage import offload as off_mod

    gates = [(dev_mod, "_fast_append", ap.append_rows), (dev_mod, "_fast_append_join", ap.append_join_rows),
             (off_mod, "_fast_append", ap.append_rows)]  # fmt: skip
    runs = []
    for use in (True, False):
        for mod, name, f in gates:  # the kernels on any device (the interpreter on CPU), or the PyTorch path
            monkeypatch.setattr(mod, name, (lambda on=None, f=f: f) if use else (lambda on=None: None))
        runs.append(_store_ops(offload, DEV if use else "cpu"))
    for i, (a, r) in enumerate(zip(*runs, strict=True)):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, r, strict=True)), i


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
        off = -(step % 2)  # odd steps: pos are lengths, the position one before (offset=-1)
        ring_push_reference(*want, q, pos, off)
        qring.ring_push_(*got, q.to(DEV), pos.int().to(DEV), off)
        for w, x in zip(want, got, strict=True):
            assert torch.equal(w, x.cpu()), step
    assert bool(want[2].all()) and int(want[1][0, -1]) == 1000 + size + 1 - (size + 1) % 2


def test_ring_push_bad_inputs():
    with pytest.raises(ValueError, match="contiguous ring"):
        qring.ring_push_(torch.zeros(1, 2, 3, 4)[:, :, :, :2], torch.zeros(1, 3, dtype=torch.long),
                      torch.zeros(1, 3, dtype=torch.bool), torch.zeros(1, 2, 2), torch.zeros(1))  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        qring.ring_push_(torch.zeros(1, 2, 3, 4), torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool),
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
    idx, valid, pos = slots.offload_slot_list(
        st.lengths.to(DEV), pages.to(DEV), sink, ps, wp, st.fixed
    )  # fmt: skip
    assert idx.dtype == a.idx.dtype and valid.dtype == a.valid.dtype and pos.dtype == a.positions.dtype
    assert torch.equal(idx.cpu(), a.idx) and torch.equal(valid.cpu(), a.valid) and torch.equal(pos.cpu(), a.positions)


def _device_store(sink, ps, wp, b=3, h=2, d=8, device="cpu"):
    from kvdex.storage import DeviceStore, Grid, TransferStats

    g = torch.Generator().manual_seed(sink + ps + wp)
    st = DeviceStore(Grid(sink, ps, wp), b, h, d, torch.float32, device, TransferStats())
    lengths = torch.tensor([sink + ps * (wp + 5) + 3, 3, sink + ps * wp + 1][:b])
    n = int(lengths.max())
    kv = [torch.randn(b, h, n, d, generator=g).to(device) for _ in range(2)]
    st.ingest(*kv, lengths)
    return st


@run_kernels
@pytest.mark.parametrize("sink,ps,wp", [(4, 16, 1), (16, 8, 2), (0, 8, 1), (3, 4, 3)])
@pytest.mark.parametrize("parts", ["pages", "tokens", "both", "expanded"])
def test_device_slot_list_equals_store_attend(sink, ps, wp, parts):
    """DeviceStore.attend's lists in one launch: pages, tokens (-1 padded), both, and a page list expanded over
    the kv heads (stride 0, as PRKV's static pages), equal to the store's PyTorch ops."""
    from kvdex.selection import Selection

    st = _device_store(sink, ps, wp)
    g = torch.Generator().manual_seed(len(parts))
    nmid = int(st.grid.num_middle_pages(st.lengths_host).max())
    ws = int(st.grid.window_start(st.lengths_host).max())
    pages = torch.randint(-1, nmid, (st.batch, st.kv_heads, 5), generator=g)
    tokens = torch.randint(-1, ws, (st.batch, st.kv_heads, 7), generator=g)
    sel = {
        "pages": Selection(pages=pages),
        "tokens": Selection(tokens=tokens),
        "both": Selection(pages=pages, tokens=tokens),
        "expanded": Selection(pages=pages[:, :1].expand(-1, st.kv_heads, -1)),
    }[parts]
    a = st.attend(sel)  # the PyTorch ops (CPU store)
    on = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    idx, valid = slots.device_slot_list(st.lengths.to(DEV), on(sel.pages), on(sel.tokens), sink, ps, wp)
    assert idx.dtype == a.idx.dtype and valid.dtype == a.valid.dtype
    assert torch.equal(idx.cpu(), a.idx) and torch.equal(valid.cpu(), a.valid)


@run_kernels
@pytest.mark.parametrize("prefix", [None, "one", "heads"])
def test_rerank_slots_equals_twin(prefix):
    """A rerank's chosen ids -> slots (-1 ids and -1 candidate pages give -1) behind a prefix shared by the kv
    heads (PRKV's static positions) or per head: equal to the twin."""
    from kvdex.kernels.reference import rerank_slots_reference

    g = torch.Generator().manual_seed(3)
    b, h, c, ps, t = 2, 3, 5, 4, 9
    pages = torch.randint(-1, 40, (b, h, c), generator=g)
    ids = torch.randint(-1, c * ps, (b, h, t), generator=g)
    pre = {None: None, "one": torch.randint(-1, 30, (b, 1, 6), generator=g),
           "heads": torch.randint(-1, 30, (b, h, 6), generator=g)}[prefix]  # fmt: skip
    want = rerank_slots_reference(ids, pages, 7, ps, pre)
    got = slots.rerank_slots(ids.to(DEV), pages.to(DEV), 7, ps, None if pre is None else pre.to(DEV))
    assert got.dtype == torch.long and torch.equal(got.cpu(), want)
    assert (want[..., -t:][ids < 0] == -1).all()


def test_device_slot_list_needs_a_selection():
    with pytest.raises(ValueError, match="pages"):
        slots.device_slot_list(torch.zeros(1, dtype=torch.long), None, None, 4, 16, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_device_attend_fast_equals_pytorch(monkeypatch):
    from kvdex.selection import Selection
    from kvdex.storage import device

    st = _device_store(4, 16, 2, device="cuda")
    st2 = _device_store(4, 16, 2, device="cuda")
    nmid = int(st.grid.num_middle_pages(st.lengths_host).max())
    pages = torch.randint(-1, nmid, (st.batch, st.kv_heads, 6), device="cuda")
    a = st.attend(Selection(pages=pages))
    monkeypatch.setattr(device, "_fast_slot_list", lambda on=None: None)
    r = st2.attend(Selection(pages=pages))
    for x, y in zip((a.k, a.v, a.idx, a.valid, a.positions), (r.k, r.v, r.idx, r.valid, r.positions), strict=True):
        assert torch.equal(x, y)


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
            for lay in cache.layers:  # the append kernels advanced the device lengths once per token (replays too)
                st = lay.store
                assert torch.equal(st.lengths.cpu(), st.lengths_host) and not bool(st.lengths_ticket.any()), policy
        assert torch.equal(stats[0][0], stats[1][0]) and stats[0][1] == stats[1][1], policy


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_gpu_decode_identical_with_and_without_step_kernels(monkeypatch, offload):
    """Eager decode of quest: the step kernels (append, offload slot list) vs the PyTorch ops, every other
    kernel the same: bit-identical logits and store buffers, the same device and host lengths (the kernels
    advance the device lengths in their launch, the PyTorch path with ``+=``)."""
    import kvdex
    from kvdex.bench import runner, shapes
    from kvdex.storage import device
    from kvdex.storage import offload as off

    model = shapes.build_model("tiny", torch.bfloat16, "cuda")
    ids = runner._prompt(2, 300, model.config.vocab_size, 0, "cuda")
    gates = {(device, "_fast_append"): device._fast_append(), (off, "_fast_append"): off._fast_append(),
             (device, "_fast_append_join"): device._fast_append_join(),
             (off, "_fast_slot_list"): off._fast_slot_list()}  # fmt: skip
    assert all(f is not None for f in gates.values())
    outs = []
    for use in (True, False):
        for (mod, name), f in gates.items():
            monkeypatch.setattr(mod, name, (lambda on=None, f=f: f) if use else (lambda on=None: None))
        cache = kvdex.Cache(model, "quest", 128, dense_layers=1, offload=offload)
        nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
        logits = []
        for _ in range(40):  # across page boundaries
            nxt, lg = runner._step(model, cache, nxt)
            logits.append(lg)
        stores = [lay.store for lay in cache.layers]
        for st in stores:
            assert torch.equal(st.lengths.cpu(), st.lengths_host) and not bool(st.lengths_ticket.any()), use
        outs.append((torch.stack(logits), [st.k.clone() for st in stores], [st.lengths.clone() for st in stores]))
    assert torch.equal(outs[0][0], outs[1][0])  # bit-identical decode
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outs[0][2], outs[1][2], strict=True))
