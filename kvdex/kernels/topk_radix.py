"""The unordered top-k of long rows in several programs per row: a rerank's best tokens among its candidates.

A rerank ranks ~59k candidate tokens per kv head with IceCache's share at 128k (32k for PRKV's), and keeps the
best 2,048. ``torch.topk`` runs that as ~20 launches (a radix select over blocks, then a gather) in ~50 us per
layer on an H200; :mod:`kvdex.kernels.topk` holds a row in one program, which for rows this long re-reads it
for each of its 17 passes (270-410 us). Here each row is split into tiles of ``TILE`` scores, one program
per (row, tile), and the k-th largest score is found digit by digit:

1. **Keys.** The order-preserving int32 image of :mod:`kvdex.kernels.topk` (``-0.0 == +0.0``, NaN largest),
   taken in offset order as uint32.
2. **Digits.** For each 8-bit digit from the top (4 passes for fp32 scores, 3 for fp16, 2 for bf16), every
   program adds the 256-bin histogram of its keys that share the digits decided so far into the row's
   histogram (atomic adds); each program of the next pass reads the finished histograms and decides the
   digits itself (a scan of 256 bins per pass: no launch in between).
3. **Compaction.** One pass counts each tile's keys above the k-th key ``T`` and equal to it; the last
   takes every key above ``T`` and the lowest-index keys equal to it until k, each tile writing at the
   offset the counts of the tiles before it give, so the k ids come out in ascending index order
   (``-1`` where the score is not finite), exactly the set and order of
   ``kvdex.kernels.topk.topk_ids(..., ordered=False)``.

With ``row_k`` each row finds its own count the way the one-program kernel does (a rerank's share of each
row's pages: ``ceil(share * pages)``, at least the rerank's count; the rest of the row ``-1``).

Fixed shapes, no host read: capturable in a CUDA graph. The twin is
:func:`kvdex.kernels.topk.topk_ids_reference` (its set, in index order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.topk import _finite, _keys, _low_bit, _row_k, check_row_k, score_rows

TILE = 2048
# unordered calls on rows longer than this run here rather than in the one-program kernel. In-graph timings (H200,
# 8 rows, a quarter of each row's pages as IceCache's share, or k = 2,048): 8,192 scores 25 us here against 21;
# 12,288 25 against 39; 14,700 (IceCache's page scores at 128k) 26 against 43; 16,384 25 against 39
MIN_N = 8192


@triton.jit
def _offset(key):
    """The keys in offset order (unsigned compare == signed compare of the keys)."""
    return (key ^ (-2147483647 - 1)).to(tl.uint32, bitcast=True)


@triton.jit
def _decided(HROW, K, PASSES: tl.constexpr):
    """The top ``8 * PASSES`` bits of the k-th largest key (offset order) from the first PASSES histograms of
    the row, and how many keys sharing them are among the k largest."""
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)
    need = K
    for p in tl.static_range(PASSES):
        h = tl.load(HROW + p * 256 + bins)
        at_least = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with a digit >= each bin
        d = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > d, h, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    return prefix, need


@triton.jit
def _tile(S, stride_s, N, K, TILE: tl.constexpr, LOW_BIT: tl.constexpr, KS, KDIV, SHARE, KMIN, PER_ROW: tl.constexpr):
    """This program's row, tile, the tile's offsets and keys, and the row's k (with PER_ROW its own count)."""
    row, t = tl.program_id(0), tl.program_id(1)
    if PER_ROW:
        K = _row_k(KS, row, KDIV, K, SHARE, KMIN)
    offs = t * TILE + tl.arange(0, TILE)
    return row, t, offs, _keys(S + row.to(tl.int64) * stride_s, offs, N, LOW_BIT), K


@triton.jit
def _digit_kernel(
    S, HIST, stride_s, N, K, PASS: tl.constexpr, TILE: tl.constexpr, LOW_BIT: tl.constexpr,
    KS=None, KDIV=1, SHARE=1.0, KMIN=0, PER_ROW: tl.constexpr = False,
):  # fmt: skip
    row, t, offs, key, kr = _tile(S, stride_s, N, K, TILE, LOW_BIT, KS, KDIV, SHARE, KMIN, PER_ROW)
    u = _offset(key)
    hrow = HIST + row * 1024
    prefix, need = _decided(hrow, kr, PASS)
    digit = ((u >> (24 - 8 * PASS)) & 0xFF).to(tl.int32)
    m = offs < N
    if PASS > 0:
        m = m & ((u >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
    h = tl.histogram(digit, 256, mask=m)
    bins = tl.arange(0, 256)
    tl.atomic_add(hrow + PASS * 256 + bins, h, mask=h > 0, sem="relaxed")


@triton.jit
def _count_kernel(
    S, HIST, CNT, stride_s, N, K, NT, PASSES: tl.constexpr, TILE: tl.constexpr, LOW_BIT: tl.constexpr,
    KS=None, KDIV=1, SHARE=1.0, KMIN=0, PER_ROW: tl.constexpr = False,
):  # fmt: skip
    row, t, offs, key, kr = _tile(S, stride_s, N, K, TILE, LOW_BIT, KS, KDIV, SHARE, KMIN, PER_ROW)
    prefix, _ = _decided(HIST + row * 1024, kr, PASSES)
    thr = prefix.to(tl.int32, bitcast=True) ^ (-2147483647 - 1)
    c = (row * NT + t) * 2
    tl.store(CNT + c, tl.sum((key > thr).to(tl.int32), axis=0))
    tl.store(CNT + c + 1, tl.sum((key == thr).to(tl.int32), axis=0))


@triton.jit
def _write_kernel(
    S, HIST, CNT, OUT, stride_s, N, K, NT,
    PASSES: tl.constexpr, TILE: tl.constexpr, LOW_BIT: tl.constexpr, NT_BLOCK: tl.constexpr,
    KS=None, KDIV=1, SHARE=1.0, KMIN=0, PER_ROW: tl.constexpr = False,
):  # fmt: skip
    row, t, offs, key, kr = _tile(S, stride_s, N, K, TILE, LOW_BIT, KS, KDIV, SHARE, KMIN, PER_ROW)
    o_row = OUT + row.to(tl.int64) * K  # K: the output's row length
    prefix, need_eq = _decided(HIST + row * 1024, kr, PASSES)  # need_eq: the ties at the k-th key to take
    thr = prefix.to(tl.int32, bitcast=True) ^ (-2147483647 - 1)
    tiles = tl.arange(0, NT_BLOCK)
    before = tiles < t
    gt_before = tl.sum(tl.load(CNT + (row * NT + tiles) * 2, mask=before, other=0), axis=0)
    eq_before = tl.sum(tl.load(CNT + (row * NT + tiles) * 2 + 1, mask=before, other=0), axis=0)
    gt = key > thr
    eq = key == thr
    eq_i = eq.to(tl.int32)
    take = gt | (eq & ((eq_before + tl.cumsum(eq_i, axis=0) - eq_i) < need_eq))
    take_i = take.to(tl.int32)
    pos = gt_before + tl.minimum(eq_before, need_eq) + tl.cumsum(take_i, axis=0) - take_i
    ids = tl.where(_finite(key), offs.to(tl.int64), -1)
    tl.store(o_row + pos, ids, mask=take & (pos < kr))


def topk_ids(
    score: torch.Tensor,
    k: int,
    tile: int = TILE,
    row_k: torch.Tensor | None = None,
    row_share: float = 1.0,
    row_min: int = 0,
) -> torch.Tensor:
    """score [..., N] (fp32 / bf16 / fp16) -> [..., min(k, N)] int64: the ids of the k largest scores in ascending
    index order (ties at the k-th value: the lowest indices), ``-1`` where the score is not finite; the set and
    order of ``kvdex.kernels.topk.topk_ids(score, k, ordered=False)``, and with ``row_k`` / ``row_share`` /
    ``row_min`` each row's own count as there (the rest of the row ``-1``). ``tile`` (a power of two) is for
    tests."""
    if score.dtype not in (torch.float32, torch.bfloat16, torch.float16) or score.dim() < 1 or k <= 0:
        raise ValueError(f"radix top-k needs float scores and k > 0, got {score.dtype}, k={k}")
    s, k, lead = score_rows(score, k)
    n, rows = s.shape[1], s.shape[0]
    check_row_k(row_k, rows, score.device)
    per_row = row_k is not None
    out = torch.empty(rows, k, dtype=torch.long, device=score.device)
    if per_row:  # a row writes only its own count
        out.fill_(-1)
    if rows == 0 or k == 0:
        return out.view(*lead, k)
    own = dict(KS=row_k if per_row else out, KDIV=rows // row_k.numel() if per_row else 1, SHARE=float(row_share),
               KMIN=int(row_min), PER_ROW=per_row)  # fmt: skip
    low = _low_bit(score.dtype)
    passes = (39 - low) // 8  # 8-bit digits above the zero low bits: fp32 4, fp16 3, bf16 2
    nt = triton.cdiv(n, tile)
    hist = torch.zeros(rows, 4, 256, dtype=torch.int32, device=score.device)
    cnt = torch.empty(rows, nt, 2, dtype=torch.int32, device=score.device)
    grid = (rows, nt)
    nw = 8 if tile >= 4096 else 4  # at 2,048-score tiles: 4 warps
    for p in range(passes):
        _digit_kernel[grid](s, hist, s.stride(0), n, k, PASS=p, TILE=tile, LOW_BIT=low, num_warps=nw, **own)
    _count_kernel[grid](s, hist, cnt, s.stride(0), n, k, nt, PASSES=passes, TILE=tile, LOW_BIT=low, num_warps=nw,
                        **own)  # fmt: skip
    _write_kernel[grid](
        s, hist, cnt, out, s.stride(0), n, k, nt,
        PASSES=passes, TILE=tile, LOW_BIT=low, NT_BLOCK=max(16, triton.next_power_of_2(nt)), num_warps=nw, **own,
    )  # fmt: skip
    return out.view(*lead, k)
