"""The nearest promoted point of every key (IceCache's device page build) in one Triton kernel.

``icecache:build=device`` (:mod:`kvdex.index.leaf_pages`) finds every key's parent: the point of its row
promoted to the level above with the largest inner product in the transformed space of eq. 2 (unit vectors
of ``D + 1`` coordinates). The twin (:func:`nearest_reference`, ``kvdex.kernels.scoring.nearest_rows``) is one
fp32 batched matmul per chunk of keys and an ``argmax`` over the scores it writes: at 128k keys per kv head
and the default promotion ratio 1/16, 8.6e9 scores per layer of an 8B model go to memory and are read
back, and the fp32 matmul runs without the matrix units.

This kernel keeps the scores in registers. One program per (row, tile of ``BLOCK_M`` keys) walks the row's
promoted points in tiles of ``BLOCK_N``: the first ``D`` coordinates through ``tl.dot``, the last coordinate
as an outer product, then a running max and its first index (ties to the lowest index, as ``argmax``). Only
the ids are written. Points past ``NP`` (the tile padding) score ``-inf``.

Precision (``precision=``). The default ``"bf16x3"`` splits every fp32 coordinate into a bf16 high part and
a bf16 low part (16 of fp32's 24 bits) and sums three bf16 products in fp32 (``hi.hi + hi.lo + lo.hi``): a
score's error is about 1e-5, against the twin's fp32 rounding of about 1e-7. Triton's own ``"tf32x3"`` is
about as precise but was slower than the twin on an H200 at the 8B / 128k build shape (86-130 ms against
72 ms per layer; ``"ieee"``, fp32 on the CUDA cores, was not timed); ``"bf16x3"`` took 14.5 ms, one-pass
``"tf32"`` 13.5 ms with about 1e-3 error (it changed 0.1 % of the parents). So the kernel and the twin can
pick different parents where two promoted points score within about 1e-5 of each other: 1 key in 1e5 in that
measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import nearest_rows

PRECISIONS = ("bf16x3", "tf32x3", "ieee", "tf32")


@triton.jit
def _nearest_kernel(
    XH,
    XL,
    XE,
    PH,
    PL,
    PE,
    OUT,
    N,
    NP,
    stride_xr,
    stride_xn,
    stride_pr,
    stride_pn,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # XH/XL (PH/PL): bf16 high and low parts of the fp32 coordinates
    PRECISION: tl.constexpr,  # without SPLIT: tl.dot's input precision on the fp32 XH / PH
):
    mb = tl.program_id(0)
    r = tl.program_id(1)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < N
    dmask = offs_d < D
    xo = r * stride_xr + offs_m[:, None] * stride_xn + offs_d[None, :]
    xm = mmask[:, None] & dmask[None, :]
    xh = tl.load(XH + xo, mask=xm, other=0.0)
    if SPLIT:
        xl = tl.load(XL + xo, mask=xm, other=0.0)
    xe = tl.load(XE + r * N + offs_m, mask=mmask, other=0.0)  # the transform's last coordinate (fp32)
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    arg = tl.zeros([BLOCK_M], dtype=tl.int32)
    for nb in range(0, NP, BLOCK_N):
        offs_n = nb + tl.arange(0, BLOCK_N)
        nmask = offs_n < NP
        po = r * stride_pr + offs_n[None, :] * stride_pn + offs_d[:, None]  # [BLOCK_D, BLOCK_N]: P transposed
        pm = nmask[None, :] & dmask[:, None]
        ph = tl.load(PH + po, mask=pm, other=0.0)
        if SPLIT:  # hi.hi + hi.lo + lo.hi: bf16 products, fp32 sums (lo.lo is below fp32's last bits)
            pl = tl.load(PL + po, mask=pm, other=0.0)
            s = tl.dot(xh, ph)
            s = tl.dot(xh, pl, s)
            s = tl.dot(xl, ph, s)
        else:
            s = tl.dot(xh, ph, input_precision=PRECISION)
        pe = tl.load(PE + r * NP + offs_n, mask=nmask, other=0.0)
        s = s + xe[:, None] * pe[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        a = tl.argmax(s, axis=1, tie_break_left=True) + nb
        upd = m > best  # strict: an equal score later in the row keeps the earlier index
        best = tl.where(upd, m, best)
        arg = tl.where(upd, a, arg)
    tl.store(OUT + r * N + offs_m, arg.to(tl.int64), mask=mmask)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def nearest(
    X: torch.Tensor,
    Xp: torch.Tensor,
    *,
    precision: str = "bf16x3",
    block_m: int = 128,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
) -> torch.Tensor:
    """X [R, N, E], Xp [R, Np, E] (fp32, E = D + 1: the transformed keys and promoted points of each row)
    -> [R, N] int64: for every key, the index in ``Xp[r]`` of its largest inner product (the first on ties).

    ``precision``: ``"bf16x3"`` (default: each coordinate split into bf16 high and low parts, three bf16
    products summed in fp32, about 16 bits of each coordinate), ``"tf32x3"``, ``"ieee"`` (fp32 without the
    matrix units) or ``"tf32"`` (one TF32 product: about 1e-3 relative error). The block sizes and launch
    settings are for tuning."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if X.dim() != 3 or Xp.dim() != 3 or X.shape[0] != Xp.shape[0] or X.shape[2] != Xp.shape[2]:
        raise ValueError(f"X [R, N, E] and Xp [R, Np, E] must share R and E, got {tuple(X.shape)}, {tuple(Xp.shape)}")
    if X.dtype != torch.float32 or Xp.dtype != torch.float32:
        raise ValueError(f"X and Xp must be float32, got {X.dtype}, {Xp.dtype}")
    R, N, E = X.shape
    Np, D = Xp.shape[1], E - 1
    out = torch.zeros(R, N, dtype=torch.long, device=X.device)
    if R == 0 or N == 0 or Np == 0:
        return out
    xe, pe = X[..., D].contiguous(), Xp[..., D].contiguous()
    split = precision == "bf16x3"
    if split:
        (xh, xl), (ph, pl) = _split(X[..., :D].contiguous()), _split(Xp[..., :D].contiguous())
    else:
        xh, ph = X[..., :D].contiguous(), Xp[..., :D].contiguous()
        xl, pl = xh, ph
    block_d = max(16, triton.next_power_of_2(D))
    if block_d > (128 if split else 64):  # wide heads (fp32 tiles: from 128): smaller tiles, so that both
        block_m, block_n = min(block_m, 64), min(block_n, 64)  # operands' tiles fit in shared memory
        if not split and block_d > 128:  # fp32 tiles of 256 columns (tf32x3 splits them again): small, one stage
            block_m, block_n, num_stages = min(block_m, 32), min(block_n, 32), 1
    grid = (triton.cdiv(N, block_m), R)
    _nearest_kernel[grid](
        xh, xl, xe, ph, pl, pe, out, N, Np, xh.stride(0), xh.stride(1), ph.stride(0), ph.stride(1),
        D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
        PRECISION="ieee" if split else precision, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def nearest_reference(X: torch.Tensor, Xp: torch.Tensor, **_) -> torch.Tensor:
    """The twin: fp32 batched matmuls and ``argmax`` (:func:`kvdex.kernels.scoring.nearest_rows`)."""
    return nearest_rows(X, Xp)
