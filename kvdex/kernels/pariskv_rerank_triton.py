"""ParisKV's rerank stage in Triton: the pool's 4-bit estimates of ``<k, q>``, the heads' combination, and the
gather of the final K/V rows; each function equals its twin in ``kernels.pariskv``.

* ``rerank_scores``   -- gathers the 4-bit codes and weights of the candidates, decodes both nibbles
  of each byte by selects (no table lookups) and reduces ``|q| sum_b w_b <v_b, q~_b>`` per subspace,
  once per query head of the row (G heads share the codes read); ``rerank_combined`` adds each block's
  best estimate per head and a second kernel sums the heads' relative weights (``combine_heads``);
* ``gather_rows``     -- copies the selected K/V rows from the host page store. On CUDA the source
  may be *pinned host memory*: the kernel reads it directly over PCIe (UVA), so no CPU gather and no
  staging copy happen (measured on the H200: 42 GB/s this way vs 2.4 GB/s for a CPU gather).

The candidates come from the coarse stage (``kvdex.kernels.pariskv_coarse_triton``, which holds the checks
both stages make). triton is optional, as there: without it the module imports and its functions refuse.
"""

from __future__ import annotations

import torch

from kvdex.kernels.pariskv_coarse_triton import check_inputs as _check
from kvdex.kernels.pinned import readable_from

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # the package works without triton: the policy falls back to the twins
    _HAS_TRITON = False


if _HAS_TRITON:

    @triton.jit
    def _level(code, c0, c1, c2, c3, c4, c5, c6, c7):
        # a 4-bit code's coordinate: sign (bit 3) * center[magnitude] (bits 0-2), by selects (no table gather)
        b0 = (code & 1) != 0
        b1 = (code & 2) != 0
        low = tl.where(b1, tl.where(b0, c3, c2), tl.where(b0, c1, c0))
        high = tl.where(b1, tl.where(b0, c7, c6), tl.where(b0, c5, c4))
        mag = tl.where((code & 4) != 0, high, low)
        return tl.where((code & 8) != 0, mag, -mag)

    @triton.jit
    def _rerank_kernel(
        cand_ptr, codes_ptr, w_ptr, q_ptr, qn_ptr, cen_ptr, out_ptr, top_ptr, c_len, nblk,
        s_cr, s_cn, s_wr, s_wn,
        NSUB: tl.constexpr, HM: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr, TOP: tl.constexpr,
    ):  # fmt: skip
        # A candidate's codes as [NSUB, HM] bytes (byte t of subspace b: coordinates 2t, 2t + 1 of its m),
        # decoded once and scored for each of the row's G query heads; TOP: each head's best estimate of the
        # block goes to top [R, G, nblk] (combine reduces them: no atomics on G addresses a row)
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        cm = offs < c_len
        cand = tl.load(cand_ptr + r * c_len + offs, mask=cm, other=-1)
        ok = cm & (cand >= 0)
        c = tl.where(ok, cand, 0)
        b = tl.arange(0, NSUB)
        byte_of = b[:, None] * HM + tl.arange(0, HM)[None, :]  # [NSUB, HM]
        ptr = codes_ptr + r * s_cr + c[:, None, None] * s_cn + byte_of[None, :, :]
        byte = tl.load(ptr, mask=ok[:, None, None], other=0).to(tl.int32)
        c0, c1, c2, c3 = tl.load(cen_ptr), tl.load(cen_ptr + 1), tl.load(cen_ptr + 2), tl.load(cen_ptr + 3)
        c4, c5, c6, c7 = tl.load(cen_ptr + 4), tl.load(cen_ptr + 5), tl.load(cen_ptr + 6), tl.load(cen_ptr + 7)
        v_lo = _level(byte & 15, c0, c1, c2, c3, c4, c5, c6, c7)
        v_hi = _level(byte >> 4, c0, c1, c2, c3, c4, c5, c6, c7)
        w = tl.load(w_ptr + r * s_wr + c[:, None] * s_wn + b[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        for gi in tl.static_range(G):
            q = q_ptr + (r * G + gi) * 2 * NSUB * HM + 2 * byte_of
            per = tl.sum(v_lo * tl.load(q)[None, :, :] + v_hi * tl.load(q + 1)[None, :, :], axis=2)
            est = tl.sum(per * w, axis=1) * tl.load(qn_ptr + r * G + gi)
            est = tl.where(ok, est, float("-inf"))
            tl.store(out_ptr + (r * G + gi) * c_len + offs, est, mask=cm)
            if TOP:
                tl.store(top_ptr + (r * G + gi) * nblk + blk, tl.max(est, axis=0))

    @triton.jit
    def _combine_kernel(
        est_ptr, top_ptr, out_ptr, c_len, nblk, scale, G: tl.constexpr, BLOCK: tl.constexpr, NBLKP: tl.constexpr
    ):
        # the twin's combine_heads: sum over the heads, in order, of exp(scale * (est - the head's best))
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cm = offs < c_len
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        live = tl.zeros([BLOCK], dtype=tl.int1)
        j = tl.arange(0, NBLKP)
        for gi in tl.static_range(G):
            best = tl.max(tl.load(top_ptr + (r * G + gi) * nblk + j, mask=j < nblk, other=float("-inf")), axis=0)
            top = tl.maximum(best, -3.4028234663852886e38)
            e = tl.load(est_ptr + (r * G + gi) * c_len + offs, mask=cm, other=float("-inf"))
            acc += tl.exp((e - top) * scale)
            live = live | (e > float("-inf"))
        tl.store(out_ptr + r * c_len + offs, tl.where(live, acc, float("-inf")), mask=cm)

    @triton.jit
    def _gather_kernel(
        src_ptr, rel_ptr, out_ptr, t_len, P, PS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr
    ):
        bh = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tm = t < t_len
        rel = tl.load(rel_ptr + bh * t_len + t, mask=tm, other=0).to(tl.int64)
        row = (bh * P + rel // PS) * 2 * PS + rel % PS  # K row; its V row is PS rows further
        d = tl.arange(0, BD)
        m = tm[:, None] & (d[None, :] < D)
        k = tl.load(src_ptr + row[:, None] * D + d[None, :], mask=m)
        v = tl.load(src_ptr + (row + PS)[:, None] * D + d[None, :], mask=m)
        dst = (bh * t_len + t)[:, None] * 2 * D + d[None, :]
        tl.store(out_ptr + dst, k, mask=m)
        tl.store(out_ptr + dst + D, v, mask=m)

    _KERNELS = {
        "rerank": _rerank_kernel,
        "combine": _combine_kernel,
        "gather": _gather_kernel,
    }


def _k():
    return _KERNELS


def _rerank(cand, codes, weight, qb, qnorm, centers, m: int, top: torch.Tensor | None, block: int, warps: int):
    _check(cand, codes, weight)
    r, c_len = cand.shape
    g = qb.shape[1] if qb.dim() == 4 else 1
    nsub = codes.shape[-1] * 2 // m
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    cand = cand.contiguous().long()
    q = qb.reshape(r, -1).float().contiguous()
    out = torch.empty(r, g, c_len, dtype=torch.float32, device=cand.device)
    if r and c_len:
        grid = (r, -(-c_len // block))
        _k()["rerank"][grid](
            cand, codes, weight, q, qnorm.float().contiguous(), centers.float().contiguous(), out,
            out if top is None else top, c_len, grid[1], codes.stride(0), codes.stride(1), weight.stride(0),
            weight.stride(1), nsub, m // 2, block, g, top is not None, num_warps=warps,
        )  # fmt: skip
    return out


# 16 candidates a program on one warp: in CUDA-graph replays on the H200 (8 rows of 26,214 candidates, 4 heads,
# d = 128) 37 us, against 50-115 us for 32-128 candidates on 1-8 warps
RERANK_BLOCK, RERANK_WARPS = 16, 1


def rerank_scores(cand, codes, weight, qb, qnorm, centers, m: int, block: int = RERANK_BLOCK) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.rerank_scores` (fp32, summation order differs); qb [R, B, m] or
    [R, G, B, m] (G query heads per row: -> [R, G, C])."""
    out = _rerank(cand, codes, weight, qb, qnorm, centers, m, None, block, RERANK_WARPS)
    return out if qb.dim() == 4 else out[:, 0]


def rerank_combined(
    cand, codes, weight, qb, qnorm, centers, m: int, scale: float, block: int = RERANK_BLOCK
) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.rerank_combined` (the G heads' estimates and their combination in
    two kernels; fp32, ``exp`` and summation order differ): qb [R, G, B, m], qnorm [R, G] -> [R, C]."""
    r, g, c_len = cand.shape[0], qb.shape[1], cand.shape[1]
    nblk = -(-c_len // block)
    top = torch.empty(r, g, max(nblk, 1), dtype=torch.float32, device=cand.device)  # each block's best, per head
    est = _rerank(cand, codes, weight, qb, qnorm, centers, m, top, block, RERANK_WARPS)
    out = torch.empty(r, c_len, dtype=torch.float32, device=cand.device)
    if r and c_len:
        cb = 1024
        nblkp = 1 << max(0, (nblk - 1).bit_length())
        _k()["combine"][(r, -(-c_len // cb))](est, top, out, c_len, nblk, float(scale), g, cb, nblkp)
    return out


def gather_rows(pages: torch.Tensor, rel: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.gather_rows`. ``pages`` may be pinned host memory (UVA read)."""
    _check(rel)
    if not pages.is_contiguous():
        raise ValueError("gather_rows needs a contiguous page store")
    if not readable_from(pages, rel.device):
        raise ValueError("gather_rows reads host pages over UVA: the page store must be pinned (pin_memory=True)")
    b, h, p, _, ps, d = pages.shape
    t = rel.shape[-1]
    rel = rel.contiguous().long()
    out = torch.empty(b, h, t, 2, d, dtype=pages.dtype, device=rel.device)
    if b * h * t:
        grid = (b * h, -(-t // block))
        bd = 1 << max(0, (d - 1).bit_length())
        _k()["gather"][grid](pages, rel, out, t, p, ps, d, bd, block)
    return out
