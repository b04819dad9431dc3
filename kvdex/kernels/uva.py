"""The host page store's gathers and writes over UVA: Triton kernels that read (or write) its pages directly.

The source is the host page store ``[B, H, P, 2, page_size, D]`` (``kvdex.storage.host``): K and V
of one (sequence, kv head, page) are one contiguous block. When that tensor lives in pinned host
memory, a CUDA kernel can dereference it through unified virtual addressing (UVA zero-copy): every
program reads its page over PCIe and writes it to device memory, so a scattered selection crosses
the bus in one launch with no CPU gather, no staging buffer and no host synchronisation (the page
ids stay on the device). On the H200 this measured 42 GB/s for 256-byte rows,
against 2.4 GB/s for a CPU gather into staging and 0.7 GB/s for one copy per page.

The same kernels gather from a device-resident source (then it is a plain device gather).

:func:`store_pages` is the write the other way: the page that leaves an offloaded window, one launch
whose grid does not depend on which sequences write (capturable). :func:`fill_slots` copies the pages
that missed the device page cache into their slots (the cache's bookkeeping:
``kvdex.kernels.page_cache_triton``).

Twins (the spec, used on CPU and by the tests): :func:`gather_pages_reference`,
:func:`gather_rows_reference` -- plain advanced indexing; :func:`fill_slots_reference`;
``kvdex.storage.host.store_pages_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.pinned import readable_from


@triton.jit
def _pages_kernel(
    SRC,
    PAGES,
    OUT,
    stride_sb,
    stride_sh,
    stride_sp,
    H,
    P,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # one program per selected (sequence, kv head, page)
    bh = i // P
    b = bh // H
    h = bh % H
    page = tl.load(PAGES + i)
    offs = tl.arange(0, BLOCK)
    m = (offs < BLOCK_SIZE) & (page >= 0)
    src = SRC + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + page.to(tl.int64) * stride_sp
    x = tl.load(src + offs, mask=m, other=0.0)
    tl.store(OUT + i.to(tl.int64) * BLOCK_SIZE + offs, x, mask=offs < BLOCK_SIZE)


@triton.jit
def _rows_kernel(
    SRC,
    POS,
    OUT,
    stride_sb,
    stride_sh,
    stride_sp,
    stride_skv,
    H,
    T,
    sink,
    PS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    tb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tm = offs_t < T
    pos = tl.load(POS + bh * T + offs_t, mask=tm, other=-1)
    ok = tm & (pos >= sink)
    rel = tl.where(ok, pos - sink, 0).to(tl.int64)
    page = rel // PS
    off = rel % PS
    base = SRC + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    row = base + page * stride_sp + off * D  # K row; V row is stride_skv further
    m = ok[:, None] & (offs_d[None, :] < D)
    kx = tl.load(row[:, None] + offs_d[None, :], mask=m, other=0.0)
    vx = tl.load(row[:, None] + stride_skv + offs_d[None, :], mask=m, other=0.0)
    out = OUT + ((bh.to(tl.int64) * T + offs_t) * 2)[:, None] * D + offs_d[None, :]  # [B, H, T, 2, D]
    sm = tm[:, None] & (offs_d[None, :] < D)
    tl.store(out, kx, mask=sm)
    tl.store(out + D, vx, mask=sm)


@triton.jit
def _fill_kernel(
    SRC,
    PAGES,
    DST,
    KBUF,
    VBUF,
    stride_sb,
    stride_sh,
    stride_sp,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    base,
    H,
    N,
    PS: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # one program per selected (sequence, kv head, page); hits and padding return at once
    bh = i // N
    b = bh // H
    h = bh % H
    page = tl.load(PAGES + i)
    slot = tl.load(DST + i)
    if (slot >= 0) & (page >= 0):
        offs = tl.arange(0, BLOCK)
        m = offs < PS * D
        src = SRC + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + page.to(tl.int64) * stride_sp
        kx = tl.load(src + offs, mask=m, other=0.0)
        vx = tl.load(src + PS * D + offs, mask=m, other=0.0)
        row = (base + slot.to(tl.int64) * PS + offs // D).to(tl.int64)
        col = offs % D
        kd = KBUF + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh + row * stride_ks + col
        vd = VBUF + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh + row * stride_vs + col
        tl.store(kd, kx, mask=m)
        tl.store(vd, vx, mask=m)


@triton.jit
def _store_kernel(
    DST,
    PAGES,
    BLOCKS,
    stride_db,
    stride_dh,
    stride_dp,
    H,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # one program per (sequence, kv head); rows with page -1 write nothing
    b = i // H
    h = i % H
    page = tl.load(PAGES + b)
    if page >= 0:
        offs = tl.arange(0, BLOCK)
        m = offs < BLOCK_SIZE
        x = tl.load(BLOCKS + i.to(tl.int64) * BLOCK_SIZE + offs, mask=m, other=0.0)
        dst = DST + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + page.to(tl.int64) * stride_dp
        tl.store(dst + offs, x, mask=m)


def _check_src(src: torch.Tensor) -> None:
    if src.dim() != 6 or src.shape[3] != 2:
        raise ValueError(f"source must be host pages [B, H, P, 2, page_size, D], got {tuple(src.shape)}")
    if src.stride(3) != src.shape[4] * src.shape[5] or src.stride(4) != src.shape[5] or src.stride(5) != 1:
        raise ValueError("each (sequence, head, page) block [2, page_size, D] of the source must be contiguous")


def _readable(src: torch.Tensor, device: torch.device) -> None:
    if not readable_from(src, device):
        raise ValueError("a CUDA kernel can read host memory only when it is pinned (pin_memory=True)")


def gather_pages(
    src: torch.Tensor, pages: torch.Tensor, out: torch.Tensor | None = None, keys_only: bool = False
) -> torch.Tensor:
    """src [B, H, P, 2, ps, D] (pinned host or device); pages [B, H, N] page ids on the kernel's device
    (``-1`` = padding, gathered as zeros) -> ``out`` [B, H, N, 2, ps, D] on that device (``keys_only``:
    [B, H, N, 1, ps, D], the keys alone: half the bytes read).

    The kernel runs on ``pages.device``; reading pinned host memory from there is the UVA path.
    """
    _check_src(src)
    b, h, cap, _, ps, d = src.shape
    if pages.dim() != 3 or pages.shape[:2] != (b, h):
        raise ValueError(f"pages must be [B, H, N] = [{b}, {h}, N], got {tuple(pages.shape)}")
    _readable(src, pages.device)
    n = pages.shape[2]
    kv = 1 if keys_only else 2
    shape = (b, h, n, kv, ps, d)
    if out is None:
        out = torch.empty(shape, dtype=src.dtype, device=pages.device)
    elif tuple(out.shape) != shape or not out.is_contiguous() or out.dtype != src.dtype:
        raise ValueError(f"out must be a contiguous {src.dtype} tensor of shape {shape}")
    if out.numel() == 0:
        return out
    pages = pages.contiguous()
    block = kv * ps * d  # a page's K rows come first in its [2, ps, D] block
    _pages_kernel[(b * h * n,)](
        src, pages, out, src.stride(0), src.stride(1), src.stride(2), h, n,
        BLOCK_SIZE=block, BLOCK=triton.next_power_of_2(block),
    )  # fmt: skip
    return out


def gather_rows(src: torch.Tensor, positions: torch.Tensor, sink: int) -> torch.Tensor:
    """src [B, H, P, 2, ps, D]; positions [B, H, T] middle token positions (``< sink`` = padding,
    gathered as zeros) on the kernel's device -> [B, H, T, 2, D] on that device."""
    _check_src(src)
    b, h, cap, _, ps, d = src.shape
    if positions.dim() != 3 or positions.shape[:2] != (b, h):
        raise ValueError(f"positions must be [B, H, T] = [{b}, {h}, T], got {tuple(positions.shape)}")
    _readable(src, positions.device)
    t = positions.shape[2]
    out = torch.empty(b, h, t, 2, d, dtype=src.dtype, device=positions.device)
    if out.numel() == 0:
        return out
    positions = positions.contiguous()
    block_t = 16
    _rows_kernel[(b * h, triton.cdiv(t, block_t))](
        src, positions, out, src.stride(0), src.stride(1), src.stride(2), src.stride(3), h, t, sink,
        PS=ps, D=d, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
    return out


def _check_fill(src, pages, dst, kbuf, vbuf, base):
    _check_src(src)
    b, h, _, _, ps, d = src.shape
    if pages.dim() != 3 or pages.shape[:2] != (b, h) or dst.shape != pages.shape:
        raise ValueError(f"pages and dst must be [B, H, N] = [{b}, {h}, N]: {tuple(pages.shape)} {tuple(dst.shape)}")
    for name, buf in (("k_buf", kbuf), ("v_buf", vbuf)):
        if buf.dim() != 4 or buf.shape[:2] != (b, h) or buf.shape[3] != d or buf.stride(3) != 1:
            raise ValueError(f"{name} must be [B, H, S, D] = [{b}, {h}, S, {d}] with unit last stride")
        if buf.dtype != src.dtype:
            raise ValueError(f"{name} dtype {buf.dtype} != source dtype {src.dtype}")
    if base < 0:
        raise ValueError(f"base must be >= 0, got {base}")


def fill_slots(
    src: torch.Tensor, pages: torch.Tensor, dst: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, base: int
) -> None:
    """Copy the selected pages that missed a device page cache into their cache slots, one launch.

    src [B, H, P, 2, ps, D] (pinned host or device); pages / dst [B, H, N] on the kernel's device:
    entry (b, h, j) with ``dst >= 0`` and ``pages >= 0`` copies host page ``pages[b, h, j]`` of
    (b, h) to rows ``base + dst*ps ... + ps - 1`` of ``k_buf[b, h]`` (K) and ``v_buf[b, h]`` (V);
    every other entry (a hit, padding) reads nothing. The grid is one program per entry whatever
    the number of misses, so a CUDA graph can capture it; only the misses cross PCIe.
    Rows written must lie inside the buffers (the caller's slots are < its pool size).
    """
    _check_fill(src, pages, dst, k_buf, v_buf, base)
    _readable(src, pages.device)
    b, h, _, _, ps, d = src.shape
    n = pages.shape[2]
    if b * h * n == 0:
        return
    pages, dst = pages.contiguous(), dst.contiguous()
    _fill_kernel[(b * h * n,)](
        src, pages, dst, k_buf, v_buf, src.stride(0), src.stride(1), src.stride(2),
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), v_buf.stride(0), v_buf.stride(1), v_buf.stride(2),
        base, h, n, PS=ps, D=d, BLOCK=triton.next_power_of_2(ps * d),
    )  # fmt: skip


def store_pages(dst: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write one page per sequence into the page store, one launch: dst [B, H, P, 2, ps, D] (pinned host
    or device); pages [B] page ids on the kernel's device (``-1``: that sequence writes nothing);
    blocks [B, H, 2, ps, D] on that device. The grid does not depend on which rows write, so a CUDA
    graph can capture it (the page that leaves an offloaded window, written through UVA)."""
    _check_src(dst)
    b, h, cap, _, ps, d = dst.shape
    if pages.shape != (b,) or tuple(blocks.shape) != (b, h, 2, ps, d) or blocks.dtype != dst.dtype:
        raise ValueError(f"pages must be [{b}] and blocks [{b}, {h}, 2, {ps}, {d}] of {dst.dtype}")
    _readable(dst, pages.device)
    if b * h == 0:
        return
    block = 2 * ps * d
    _store_kernel[(b * h,)](
        dst, pages.contiguous(), blocks.contiguous(), dst.stride(0), dst.stride(1), dst.stride(2), h,
        BLOCK_SIZE=block, BLOCK=triton.next_power_of_2(block),
    )  # fmt: skip


# ---- twins ------------------------------------------------------------------------------------------


def gather_pages_reference(src: torch.Tensor, pages: torch.Tensor, keys_only: bool = False) -> torch.Tensor:
    """The spec of :func:`gather_pages` (on ``src``'s device)."""
    if keys_only:
        src = src[:, :, :, :1]
    b, h = src.shape[:2]
    p = pages.to(src.device).long()
    bi = torch.arange(b, device=src.device)[:, None, None]
    hi = torch.arange(h, device=src.device)[None, :, None]
    out = src[bi, hi, p.clamp(min=0)]
    return torch.where((p >= 0)[..., None, None, None], out, torch.zeros((), dtype=src.dtype))


def gather_rows_reference(src: torch.Tensor, positions: torch.Tensor, sink: int) -> torch.Tensor:
    """The spec of :func:`gather_rows` (on ``src``'s device)."""
    b, h, _, _, ps, _ = src.shape
    pos = positions.to(src.device).long()
    ok = pos >= sink
    rel = torch.where(ok, pos - sink, 0)
    bi = torch.arange(b, device=src.device)[:, None, None]
    hi = torch.arange(h, device=src.device)[None, :, None]
    out = src[bi, hi, rel // ps, :, rel % ps]  # [B, H, T, 2, D]
    return torch.where(ok[..., None, None], out, torch.zeros((), dtype=src.dtype))


def fill_slots_reference(
    src: torch.Tensor, pages: torch.Tensor, dst: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, base: int
) -> None:
    """The spec of :func:`fill_slots` (PyTorch; reads the source on its own device, then copies)."""
    _check_fill(src, pages, dst, k_buf, v_buf, base)
    ps = src.shape[4]
    ok = (dst >= 0) & (pages >= 0)
    bi, hi, ji = ok.nonzero(as_tuple=True)  # a host sync: the twin is not for graph capture
    if bi.numel() == 0:
        return
    dev = src.device
    blocks = src[bi.to(dev), hi.to(dev), pages[bi, hi, ji].to(dev)].to(k_buf.device)  # [M, 2, ps, D]
    rows = base + dst[bi, hi, ji][:, None].to(k_buf.device) * ps + torch.arange(ps, device=k_buf.device)
    bi, hi = bi.to(k_buf.device)[:, None], hi.to(k_buf.device)[:, None]
    k_buf[bi, hi, rows] = blocks[:, 0]
    v_buf[bi, hi, rows] = blocks[:, 1]
