"""Reordering a range of a store's slots in place, in two Triton kernels (PRKV's relocation of the middle).

:func:`permute_slots_` is :func:`kvdex.kernels.reference.permute_slots_reference` on CUDA: afterwards slot
``start + j`` of (sequence, kv head) holds what slot ``start + order[b, h, j]`` held. The twin gathers with an
index expanded over the head dimension and assigns the result back through PyTorch's strided copy; here one
kernel copies whole rows (a token's ``D`` values) into a scratch buffer by ``order``, and a second copies the
scratch back into the range. Each row is read and written twice, as in the twin, but as contiguous rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, WARPS = 32, 4  # rows per program, warps per program


@triton.jit
def _rows_kernel(
    SRC,
    IDX,
    DST,
    stride_sb,
    stride_sh,
    stride_ss,
    stride_db,
    stride_dh,
    stride_ds,
    stride_ib,
    stride_ih,
    H,
    M,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_IDX: tl.constexpr,
):
    """DST[b, h, j] = SRC[b, h, IDX[b, h, j]] (HAS_IDX) or SRC[b, h, j], for j < M."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    if HAS_IDX:
        src = tl.load(IDX + b * stride_ib + h * stride_ih + offs, mask=mask, other=0).to(tl.int64)
    else:
        src = offs.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    both = mask[:, None] & (d < D)[None, :]
    x = tl.load(SRC + b * stride_sb + h * stride_sh + src[:, None] * stride_ss + d[None, :], mask=both)
    tl.store(DST + b * stride_db + h * stride_dh + offs[:, None].to(tl.int64) * stride_ds + d[None, :], x, mask=both)


def _rows(src: torch.Tensor, idx: torch.Tensor | None, dst: torch.Tensor) -> None:
    b, h, m, d = dst.shape
    grid = (b * h, triton.cdiv(m, BLOCK))
    _rows_kernel[grid](
        src, dst if idx is None else idx, dst,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), dst.stride(2),
        0 if idx is None else idx.stride(0), 0 if idx is None else idx.stride(1), h, m,
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK=BLOCK, HAS_IDX=idx is not None, num_warps=WARPS,
    )  # fmt: skip


def permute_slots_(x: torch.Tensor, order: torch.Tensor, start: int) -> None:
    """In place: slot ``start + j`` of ``x`` [B, H, C, D] takes what slot ``start + order[b, h, j]`` held, for
    ``order`` [B, H, M] (a permutation of 0..M-1 per row; not checked here)."""
    b, h, m = order.shape
    if m == 0:
        return
    if x.stride(3) != 1:
        raise ValueError("permute_slots_ needs rows of contiguous values (x.stride(3) == 1)")
    idx = (order.to(device=x.device, dtype=torch.int64) + start).contiguous()
    scratch = torch.empty(b, h, m, x.shape[3], dtype=x.dtype, device=x.device)
    _rows(x, idx, scratch)
    _rows(scratch, None, x[:, :, start : start + m])
