# Over 400 lines: the decode step's small per-layer work, one launch each, with its wrappers (one place).
"""Small per-layer work of a decode step in one Triton launch each (a graph-replayed step pays
~2 us per kernel, and a kvdex layer issued dozens of tiny ones).

**Append** (:func:`append_rows`, twin :func:`append_rows_reference`).
``DeviceStore.append`` writes the step's new k/v rows at each sequence's length: in PyTorch that is
``arange`` + ``add`` (positions), ``arange`` (batch rows), two advanced-index writes (k, v), i.e.
five kernels per layer and step, ~2 us each even inside a CUDA graph. This kernel does the same
writes in one launch: program ``(b * H + h, j)`` copies row ``j`` of the new k and v of sequence
``b``, kv head ``h``, into slot ``lengths[b] + j`` of the buffers. The lengths are read on the
device (nothing is baked into a captured step). A pure copy: the buffers end bit-identical to the
PyTorch path's (the twin, :func:`append_rows_reference`).

**Advancing the lengths in the same launch** (``advance=True``, both appends; the stores use it on CUDA).
Without it the caller advances ``lengths`` afterwards, one more tiny kernel per layer and step. Every
program of sequence b reads ``lengths[b]``, so none may write it before all of them have read it: each
program, after its reads and writes, draws a ticket (``atomic_add`` on ``ticket[b]``, acquire-release,
after a barrier of its threads); the one that draws the last (``H * t - 1``) stores ``lengths[b] + t`` and
puts the ticket back to 0. ``ticket`` is an int32 [B] buffer of zeros that the caller keeps (one per
store: a captured step bakes its address in) and finds zero again after every launch.

**Append with a page join** (:func:`append_join_rows`, twin
:func:`kvdex.kernels.reference.append_join_rows_reference`, ``DeviceStore``'s PyTorch path).
``DeviceStore.append_join`` (a captured step) appends one token and hands the policy the page that joins
the middle: which sequences' pages join and their page ids (``Grid.num_middle_pages`` before and after, 8
elementwise kernels), the page's keys (positions, a clamp, a gather: 6 more) and its token positions (4 more
in the policy). One launch does all of it: program ``b * H + h`` writes the new k/v row and copies head h's
keys of the joining page; the programs of head 0 write ``joins``, ``start`` and the positions.

**Slot lists** (:func:`device_slot_list`, :func:`offload_slot_list`; twins: the stores' ``attend`` PyTorch
ops). A store's ``attend`` lists, per (sequence, kv head), the sink rows, the window rows and the selection's
rows, with their validity (and positions): 15-40 small kernels per layer (window start, ``token_positions``,
``cat``, clamps). One launch writes the same tensors; offloaded (``RING``): the window in its ring slots and
the fetched pages' rows from ``cursor`` on; GPU-resident: slot == position, pages then tokens. (A GPU-resident
decode step builds its list inside the paged attention kernel; ``DeviceStore.attend`` serves the steps that
hand the attended set to an observer: the evaluation's recall and needle diagnostics, H2O's scores.)

**A rerank's chosen slots** (:func:`rerank_slots`, twin :func:`kvdex.kernels.reference.rerank_slots_reference`).
A token rerank (``kvdex/policies/rerank.py``) picks ids into its candidates' flattened pages; their slots
(``sink + page * page_size + offset``), ``-1`` for none, behind a prefix (PRKV's static tokens) took ~10
kernels per layer (clamp, gather, where, a slot table of every candidate, a ``cat``). One launch.

**Query ring push** (:func:`ring_push_`, twin :func:`kvdex.kernels.reference.ring_push_reference`).
PRKV keeps each layer's last queries (``kvdex.policies.observation.QueryRing``: q [B, Hq, S, D], positions
and validity [B, S], oldest first) and pushes the step's query into it on every step, a
``select_every`` reuse step too: in PyTorch a ``cat`` and a ``copy_`` per buffer plus a ``ones``
(~8 kernels per layer and step). This kernel shifts the three buffers by one row and writes the new
row in one launch (a program per (sequence, query head) row, with a barrier between its loads and
its stores: the shift is in place); it reads the sequence lengths and writes ``length - 1`` as the new
row's position itself (``offset=-1``), so no kernel computes it first. A pure copy: bit-identical to the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_last(LENS, TICKET, b, length, t, programs):
    """``LENS[b] = length + t`` by the last of sequence b's ``programs`` programs to get here (the ticket pattern
    of the module docstring): every earlier one has read ``LENS[b]`` by then. Resets ``TICKET[b]`` to 0."""
    tl.debug_barrier()  # every thread of this program has read LENS[b] and written its rows
    drawn = tl.atomic_add(TICKET + b, 1, sem="acq_rel")
    if drawn == programs - 1:
        tl.store(LENS + b, length + t)
        tl.store(TICKET + b, 0)


@triton.jit
def _append_kernel(
    K_BUF,
    V_BUF,
    K,
    V,
    LENS,
    TICKET,
    stride_bb,
    stride_bh,
    stride_bs,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    H,
    T,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINK: tl.constexpr = 0,
    W: tl.constexpr = 0,  # > 0: an offloaded store's ring (OffloadStore._slot: the sink, then sink + (pos - sink) % W)
    ADVANCE: tl.constexpr = False,  # the last program of each sequence stores LENS[b] + T (TICKET: _advance_last)
):
    bh = tl.program_id(0)
    j = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    length = tl.load(LENS + b)
    pos = length + j
    if W > 0:
        pos = tl.where(pos < SINK, pos, SINK + tl.maximum(pos - SINK, 0) % W)
    dst = b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh + pos.to(tl.int64) * stride_bs + offs
    kr = tl.load(K + b * stride_kb + h * stride_kh + j * stride_kt + offs, mask=m)
    vr = tl.load(V + b * stride_vb + h * stride_vh + j * stride_vt + offs, mask=m)
    tl.store(K_BUF + dst, kr, mask=m)
    tl.store(V_BUF + dst, vr, mask=m)
    if ADVANCE:
        _advance_last(LENS, TICKET, b, length, T, H * T)


def _ticket(lengths, advance: bool, ticket):
    """The ticket buffer the kernel gets: the caller's (checked) with ``advance``, else ``lengths`` (never read)."""
    if not advance:
        return lengths
    if ticket is None or ticket.dtype != torch.int32 or ticket.shape != lengths.shape or not ticket.is_contiguous():
        raise ValueError("advance=True needs ticket: a contiguous int32 [B] buffer of zeros (the store's)")
    if ticket.device != lengths.device or not lengths.is_contiguous():
        raise ValueError("advance=True needs ticket and contiguous lengths on the same device")
    return ticket


def _new_rows(k_buf, v_buf, k, v, lengths):
    """The checks of an append's inputs (buffers [B, H, S, D] sharing strides with a contiguous last dim, rows
    [B, H, t, D], lengths [B]) and the rows in the buffers' dtypes with a contiguous last dim."""
    b, h, _, d = k.shape
    if k_buf.dim() != 4 or k_buf.shape[0] != b or k_buf.shape[1] != h or k_buf.shape[3] != d or v.shape != k.shape:
        raise ValueError(
            f"expected buffers [B, H, S, D] and rows [B, H, t, D], got {tuple(k_buf.shape)}, {tuple(k.shape)}"
        )
    if k_buf.stride() != v_buf.stride() or k_buf.stride(3) != 1 or lengths.shape != (b,):
        raise ValueError("k_buf / v_buf must share strides with a contiguous last dim; lengths must be [B]")
    if k_buf.dtype != k.dtype or v_buf.dtype != v.dtype:
        k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
    return (k if k.stride(3) == 1 else k.contiguous()), (v if v.stride(3) == 1 else v.contiguous())


def append_rows(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    ring: tuple[int, int] | None = None,
    *,
    advance: bool = False,
    ticket: torch.Tensor | None = None,
):
    """k_buf/v_buf [B, H, S, D] (same strides, last dim contiguous); k/v [B, H, t, D]; lengths [B] (device):
    ``k_buf[b, h, lengths[b] + j] = k[b, h, j]`` (and v) for every b, h, j < t. The caller guarantees
    ``lengths[b] + t <= S``. ``ring=(sink, window)``: the row goes to ``OffloadStore._slot`` of that
    position instead (the sink rows, then the window ring). ``advance=True`` (with ``ticket``, int32 [B]
    zeros, left zero): ``lengths += t`` in the same launch; without it the caller advances ``lengths``."""
    k, v = _new_rows(k_buf, v_buf, k, v, lengths)
    tk = _ticket(lengths, advance, ticket)
    b, h, t, d = k.shape
    if b * h * t == 0:
        if advance and t:
            lengths += t
        return
    _append_kernel[(b * h, t)](
        k_buf, v_buf, k, v, lengths, tk,
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        h, t, D=d, BLOCK_D=triton.next_power_of_2(d), SINK=ring[0] if ring else 0, W=ring[1] if ring else 0,
        ADVANCE=advance,
    )  # fmt: skip


@triton.jit
def _append_join_kernel(
    K_BUF, V_BUF, K, V, LENS, JOINS, START, KEYS, POS, TICKET,
    stride_bb, stride_bh, stride_bs, stride_kb, stride_kh, stride_vb, stride_vh, H, S,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SINK: tl.constexpr, PS: tl.constexpr, WP: tl.constexpr,
    ADVANCE: tl.constexpr = False,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    length = tl.load(LENS + b)
    row = b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    dst = row + length.to(tl.int64) * stride_bs + offs
    tl.store(K_BUF + dst, tl.load(K + b * stride_kb + h * stride_kh + offs, mask=m), mask=m)
    tl.store(V_BUF + dst, tl.load(V + b * stride_vb + h * stride_vh + offs, mask=m), mask=m)
    tl.debug_barrier()  # the page's keys are read after the write, as the PyTorch path does
    # Grid.num_middle_pages before and after the token (C division truncates where floor would not: both clamp to 0)
    before = tl.maximum((length + (PS - 1 - SINK - WP * PS)) // PS, 0)
    after = tl.maximum((length + 1 + (PS - 1 - SINK - WP * PS)) // PS, 0)
    j = tl.arange(0, PS)
    pos = SINK + before * PS + j  # the page's token positions (the window's first page where none joins)
    slot = tl.minimum(pos, S - 1)
    keys = tl.load(K_BUF + row + slot.to(tl.int64)[:, None] * stride_bs + offs[None, :], mask=m[None, :])
    tl.store(KEYS + bh.to(tl.int64) * PS * D + j[:, None] * D + offs[None, :], keys, mask=m[None, :])
    if h == 0:
        tl.store(JOINS + b, after > before)
        tl.store(START + b, before.to(tl.int64))
        tl.store(POS + b * PS + j, pos.to(tl.int64))
    if ADVANCE:  # after every read of this program (LENS[b] and the page's keys)
        _advance_last(LENS, TICKET, b, length, 1, H)


def append_join_rows(
    k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, grid,
    *, advance: bool = False, ticket: torch.Tensor | None = None,
):  # fmt: skip
    """One token per sequence (k/v [B, H, 1, D]) written at ``lengths`` [B] (device) of the buffers [B, H, S, D],
    and the page that joins the middle with it (``grid``: the store's ``Grid``) -> ``joins`` [B] bool,
    ``start`` [B] int64 (the page id; the window's first page where none joins), ``keys`` [B, H, 1, ps, D]
    (read after the write, slots clamped to the buffer) and ``positions`` [B, ps] int64, all of the lengths
    before the token. ``advance=True`` (with ``ticket``, as :func:`append_rows`): ``lengths += 1`` in the same
    launch; without it the caller advances ``lengths``. Same values as
    ``kvdex.kernels.reference.append_join_rows_reference``."""
    if k.dim() != 4 or k.shape[2] != 1:
        raise ValueError(f"expected one row [B, H, 1, D] per sequence, got {tuple(k.shape)}")
    k, v = _new_rows(k_buf, v_buf, k, v, lengths)
    tk = _ticket(lengths, advance, ticket)
    b, h, _, d = k.shape
    ps, dev = grid.page_size, k_buf.device
    joins = torch.empty(b, dtype=torch.bool, device=dev)
    start = torch.empty(b, dtype=torch.long, device=dev)
    keys = torch.empty(b, h, 1, ps, d, dtype=k_buf.dtype, device=dev)
    pos = torch.empty(b, ps, dtype=torch.long, device=dev)
    if b * h:
        _append_join_kernel[(b * h,)](
            k_buf, v_buf, k, v, lengths, joins, start, keys, pos, tk,
            k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            h, k_buf.shape[2],
            D=d, BLOCK_D=triton.next_power_of_2(d), SINK=grid.sink, PS=ps, WP=grid.window_pages, ADVANCE=advance,
        )  # fmt: skip
    elif advance:
        lengths += 1
    return joins, start, keys, pos


def append_rows_reference(k_buf, v_buf, k, v, lengths):
    """The twin: DeviceStore.append's PyTorch writes."""
    t = k.shape[2]
    pos = lengths[:, None] + torch.arange(t, device=k_buf.device)[None, :]  # [B, t]
    bi = torch.arange(k_buf.shape[0], device=k_buf.device)[:, None].expand_as(pos)
    k_buf[bi, :, pos] = k.permute(0, 2, 1, 3)
    v_buf[bi, :, pos] = v.permute(0, 2, 1, 3)


@triton.jit
def _slots_kernel(
    IDX,
    VALID,
    POS,
    LENS,
    PAGES,
    TOKS,
    H,
    P,
    T,
    N,
    cursor,
    sp_b,
    sp_h,
    st_b,
    st_h,
    SINK: tl.constexpr,
    PS: tl.constexpr,
    WP: tl.constexpr,
    RING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bh = tl.program_id(0)
    cb = tl.program_id(1)
    b, h = bh // H, bh % H
    W: tl.constexpr = WP * PS
    F: tl.constexpr = SINK + W
    L = tl.load(LENS + b).to(tl.int64)
    ws = SINK + tl.maximum((tl.maximum(L - SINK, 0) + PS - 1) // PS - WP, 0) * PS  # Grid.window_start
    c = cb * BLOCK + tl.arange(0, BLOCK)
    inb = c < N
    # sink | window: position, valid below the length
    fpos = tl.where(c < SINK, c, ws + (c - SINK)).to(tl.int64)
    # the pages (Selection.token_positions), then the tokens
    j = tl.maximum(c - F, 0)
    is_p = (c >= F) & (j < P * PS)
    pid = tl.load(PAGES + b.to(tl.int64) * sp_b + h * sp_h + j // PS, mask=inb & is_p, other=-1).to(tl.int64)
    ppos = tl.where(pid >= 0, SINK + pid * PS + j % PS, -1)
    t = tl.maximum(j - P * PS, 0)
    is_t = (c >= F) & (j >= P * PS)
    tpos = tl.load(TOKS + b.to(tl.int64) * st_b + h * st_h + t, mask=inb & is_t, other=-1).to(tl.int64)
    is_f = c < F
    pos = tl.where(is_f, fpos, tl.where(is_p, ppos, tpos))
    ok = tl.where(is_f, fpos < L, pos >= 0)
    o = bh.to(tl.int64) * N + c
    if RING:  # OffloadStore: the window in its ring slots, the fetched pages' rows from `cursor` on
        fslot = tl.where(fpos < SINK, fpos, SINK + tl.maximum(fpos - SINK, 0) % W)
        tl.store(IDX + o, tl.where(is_f, fslot, cursor + j), mask=inb)
        tl.store(POS + o, pos, mask=inb)
    else:  # DeviceStore: slot == position; an invalid row reads slot 0 (masked)
        tl.store(IDX + o, tl.where(ok, pos, 0), mask=inb)
    tl.store(VALID + o, ok.to(tl.uint8), mask=inb)


def _slot_lists(lengths, pages, tokens, sink, page_size, window_pages, cursor, ring):
    b, h = (pages if pages is not None else tokens).shape[:2]
    p = 0 if pages is None else pages.shape[-1]
    t = 0 if tokens is None else tokens.shape[-1]
    if lengths.shape != (b,):
        raise ValueError(f"expected lengths [B] with B = {b}, got {tuple(lengths.shape)}")
    n = sink + window_pages * page_size + p * page_size + t
    dev = lengths.device
    idx = torch.empty(b, h, n, dtype=torch.long, device=dev)
    pos = torch.empty(b, h, n, dtype=torch.long, device=dev) if ring else idx
    valid = torch.empty(b, h, n, dtype=torch.uint8, device=dev)
    if b * h * n == 0:
        return idx, valid.view(torch.bool), pos
    pg = pages if not p or pages.stride(-1) == 1 else pages.contiguous()  # B and H strides as they are
    tk = tokens if not t or tokens.stride(-1) == 1 else tokens.contiguous()
    sp, stt = (pg.stride()[:2] if p else (0, 0)), (tk.stride()[:2] if t else (0, 0))
    pg, tk = (pg if p else lengths), (tk if t else lengths)  # an empty part is never read
    block = min(1024, triton.next_power_of_2(n))
    _slots_kernel[(b * h, triton.cdiv(n, block))](
        idx, valid, pos, lengths, pg, tk, h, p, t, n, cursor, sp[0], sp[1], stt[0], stt[1],
        SINK=sink, PS=page_size, WP=window_pages, RING=ring, BLOCK=block,
    )  # fmt: skip
    return idx, valid.view(torch.bool), pos


def offload_slot_list(
    lengths: torch.Tensor, pages: torch.Tensor, sink: int, page_size: int, window_pages: int, cursor: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lengths [B] (device), pages [B, H, P] (middle page ids, -1 = none), the first row of the fetched pages
    ``cursor`` -> ``(idx, valid, pos)`` [B, H, sink + window + P * page_size]: ``OffloadStore.attend``'s lists
    for that page selection (sink, window ring slots, then the pages' rows ``cursor ...``)."""
    if pages.dim() != 3:
        raise ValueError(f"expected pages [B, H, P], got {tuple(pages.shape)}")
    return _slot_lists(lengths, pages, None, sink, page_size, window_pages, cursor, ring=True)


def device_slot_list(
    lengths: torch.Tensor,
    pages: torch.Tensor | None,
    tokens: torch.Tensor | None,
    sink: int,
    page_size: int,
    window_pages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lengths [B] (device), the selection's pages [B, H, P] (middle page ids) and tokens [B, H, T] (positions;
    either may be None, each ``-1`` padded, any strides on B and H) -> ``(idx, valid)`` [B, H, sink + window +
    P * page_size + T]: ``DeviceStore.attend``'s lists (slot == position; an invalid row points at slot 0)."""
    if (pages is None and tokens is None) or any(x is not None and x.dim() != 3 for x in (pages, tokens)):
        raise ValueError("expected pages [B, H, P] and/or tokens [B, H, T]")
    idx, valid, _ = _slot_lists(lengths, pages, tokens, sink, page_size, window_pages, 0, ring=False)
    return idx, valid


@triton.jit
def _rerank_slots_kernel(OUT, IDS, PAGES, PRE, H, T, C, S, N, sp_b, sp_h, SINK, PS, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b, h = bh // H, bh % H
    j = tl.maximum(c - S, 0)
    is_t = (c >= S) & (c < N)
    i = tl.load(IDS + bh.to(tl.int64) * T + j, mask=is_t, other=-1).to(tl.int64)
    pid = tl.load(PAGES + bh.to(tl.int64) * C + tl.maximum(i, 0) // PS, mask=is_t & (i >= 0), other=-1).to(tl.int64)
    slot = tl.where(pid >= 0, SINK + pid * PS + i % PS, -1)
    pre = tl.load(PRE + b.to(tl.int64) * sp_b + h * sp_h + c, mask=c < S, other=-1).to(tl.int64)
    tl.store(OUT + bh.to(tl.int64) * N + c, tl.where(c < S, pre, slot), mask=c < N)


def rerank_slots(
    ids: torch.Tensor, pages: torch.Tensor, sink: int, page_size: int, prefix: torch.Tensor | None = None
) -> torch.Tensor:
    """ids [B, H, T] into the flattened candidate ``pages`` [B, H, C] (``C * page_size`` slots, ``-1``: none) ->
    their slots [B, H, S + T] (int64, ``-1`` for none) behind ``prefix`` [B, 1 or H, S] (optional)."""
    b, h, t = ids.shape
    s = 0 if prefix is None else prefix.shape[-1]
    n = s + t
    out = torch.empty(b, h, n, dtype=torch.long, device=ids.device)
    if b * h * n == 0:
        return out
    ids, pages = ids.contiguous(), pages.contiguous()
    pre = ids if not s else (prefix if prefix.stride(-1) == 1 else prefix.contiguous())  # s == 0: never read
    sp = (pre.stride(0), pre.stride(1) if pre.shape[1] > 1 else 0) if s else (0, 0)
    block = min(1024, triton.next_power_of_2(n))
    _rerank_slots_kernel[(b * h, triton.cdiv(n, block))](
        out, ids, pages, pre, h, t, pages.shape[-1], s, n, sp[0], sp[1], sink, page_size, BLOCK=block
    )
    return out


@triton.jit
def _ring_push_kernel(
    RQ,  # [B, Hq, S, D] contiguous
    RP,  # [B, S] int64
    RV,  # [B, S] bool
    Q,  # [B, Hq, D]
    POS,  # [B]
    stride_qb,
    stride_qh,
    HQ,
    S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OFFSET: tl.constexpr = 0,
):
    r = tl.program_id(0)  # b * HQ + hq
    b = r // HQ
    os, od = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    src = tl.minimum(os + 1, S - 1)
    m = (os[:, None] < S - 1) & (od[None, :] < D)
    old = tl.load(RQ + r * S * D + src[:, None] * D + od[None, :], mask=m)
    new = tl.load(Q + b * stride_qb + (r % HQ) * stride_qh + od, mask=od < D)
    first = r % HQ == 0  # one program per sequence moves its positions and validity
    ms = (os < S - 1) & first
    p_old = tl.load(RP + b * S + src, mask=ms)
    v_old = tl.load(RV + b * S + src, mask=ms)
    tl.debug_barrier()  # every load of the row before any store: the shift is in place
    tl.store(RQ + r * S * D + os[:, None] * D + od[None, :], old, mask=m)
    tl.store(RQ + r * S * D + (S - 1) * D + od, new, mask=od < D)
    tl.store(RP + b * S + os, p_old, mask=ms)
    tl.store(RV + b * S + os, v_old, mask=ms)
    tl.store(RP + b * S + S - 1, tl.load(POS + b).to(tl.int64) + OFFSET, mask=first)
    tl.store(RV + b * S + S - 1, tl.full([], 1, tl.int1), mask=first)


def ring_push_(
    rq: torch.Tensor, rp: torch.Tensor, rv: torch.Tensor, q: torch.Tensor, pos: torch.Tensor, offset: int = 0
) -> None:
    """Shift the ring ``rq`` [B, Hq, S, D], ``rp`` [B, S] (int64), ``rv`` [B, S] (bool) by one row (the oldest
    leaves) and write q [B, Hq, D] at positions ``pos + offset`` [B] as the newest (valid) row, in place
    (``offset=-1`` with the sequence lengths as ``pos``: the new token's position, without a launch for it)."""
    b, hq, size, d = rq.shape
    ring = (rq, rp, rv)
    if not all(t.is_contiguous() for t in ring) or rp.shape != (b, size) or rv.shape != (b, size):
        raise ValueError("expected a contiguous ring q [B, Hq, S, D], positions / validity [B, S] (written in place)")
    if q.shape != (b, hq, d):
        raise ValueError(f"q must be [B, Hq, D] = [{b}, {hq}, {d}], got {tuple(q.shape)}")
    if rp.dtype != torch.long or rv.dtype != torch.bool or pos.shape != (b,) or size < 1:
        raise ValueError("ring positions must be int64, validity bool, pos [B], S >= 1")
    if q.stride(-1) != 1:
        q = q.contiguous()
    _ring_push_kernel[(b * hq,)](
        rq, rp, rv, q, pos.to(rq.device), q.stride(0), q.stride(1), hq,
        S=size, D=d, BLOCK_S=triton.next_power_of_2(size), BLOCK_D=triton.next_power_of_2(d), OFFSET=offset,
    )  # fmt: skip
