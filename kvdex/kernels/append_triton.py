"""A decode step's append in one Triton launch: the new k/v rows, and with a page join the page that joins the
middle (a graph-replayed step pays ~2 us per kernel, and a kvdex layer issued dozens of tiny ones).

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
