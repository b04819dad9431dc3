"""Triton kernels of the ParisKV retrieval pipeline; each equals its twin in ``kernels.pariskv``.

* ``cluster_votes``   -- one program per (row, subspace): the vote table (keys ranked ahead of each
  centroid by pairwise comparison, then the tiers), instead of a sort, two gathers and a scatter;
* ``collision_votes`` -- one program per (row, block of keys): sum over subspaces of the vote
  table entry of each key's centroid id (the table is tiny and stays in L1/L2); with G tables per row
  (``group="heads"``: one per query head) the best head's sum; slots past a row's length score -1;
* ``bucket_topk``     -- histogram of the integer scores (atomics), threshold from its suffix sum,
  then a two-pass stream compaction (per-block counts, exclusive scan, in-block cumsum) that keeps
  every key above the threshold and the lowest-index ties: no sort, and the same output as the twin.
  Both passes derive the threshold and their block's offsets themselves (the histogram has <= 32 * B + 1
  bins, a row <= 1024 blocks): 5 launches instead of ~30 small PyTorch ops in between (launch-bound);
* ``rerank_scores``   -- gathers the 4-bit codes and weights of the candidates, unpacks both
  nibbles of each byte and reduces ``|q| sum_b w_b <v_b, q~_b>`` in registers, once per query head
  of the row (G heads share the codes read);
* ``gather_rows``     -- copies the selected K/V rows from the host page store. On CUDA the source
  may be *pinned host memory*: the kernel reads it directly over PCIe (UVA), so no CPU gather and no
  staging copy happen (measured on the H200: 42 GB/s this way vs 2.4 GB/s for a CPU gather).

triton is optional: the package imports without it (``available()`` says whether it can run).
With ``TRITON_INTERPRET=1`` set before triton is imported the kernels run on CPU tensors (CI checks
them against the twins that way, in a subprocess).
"""

from __future__ import annotations

import os

import torch

from kvdex.kernels import pariskv as twin
from kvdex.kernels.pinned import readable_from

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # the package works without triton: the policy falls back to the twins
    _HAS_TRITON = False


def available() -> bool:
    return _HAS_TRITON


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(*tensors: torch.Tensor) -> None:
    if not available():
        raise ValueError("the ParisKV Triton kernels need the triton package (pip install triton)")
    if not _interpret() and any(t.device.type != "cuda" for t in tensors):
        raise ValueError("the ParisKV Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU)")


if _HAS_TRITON:

    @triton.jit
    def _collision_kernel(
        ids_ptr, votes_ptr, live_ptr, out_ptr, n, s_ir, s_in,
        NSUB: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, HAS_LIVE: tl.constexpr,
        G: tl.constexpr, GP: tl.constexpr,
    ):  # fmt: skip
        # G vote tables per row (one per query head of a GQA group): a key scores its best head's sum
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        gi = tl.arange(0, GP)
        gm = gi < G
        acc = tl.zeros([BLOCK, GP], dtype=tl.int32)
        for s in tl.static_range(NSUB):
            cid = tl.load(ids_ptr + r * s_ir + offs * s_in + s, mask=mask, other=0).to(tl.int32)
            tab = votes_ptr + ((r * G + gi[None, :]) * NSUB + s) * K + cid[:, None]
            acc += tl.load(tab, mask=mask[:, None] & gm[None, :], other=0)
        best = tl.max(tl.where(gm[None, :], acc, -1), axis=1)
        if HAS_LIVE:  # slots past the row's own length score -1 (never selected)
            best = tl.where(offs < tl.load(live_ptr + r), best, -1)
        tl.store(out_ptr + r * n + offs, best, mask=mask)

    @triton.jit
    def _cluster_votes_kernel(
        score_ptr, count_ptr, quota_ptr, out_ptr,
        NSUB: tl.constexpr, K: tl.constexpr, CH: tl.constexpr, T: tl.constexpr, TP: tl.constexpr,
    ):  # fmt: skip
        # one program per (row, subspace): the keys ranked ahead of each centroid (a better score, or an
        # equal score and a lower id: the twin's stable descending argsort) by pairwise comparison in
        # chunks, then one vote per tier whose quota those keys do not fill yet
        pid = tl.program_id(0).to(tl.int64)
        r = pid // NSUB
        c = tl.arange(0, K)
        s_c = tl.load(score_ptr + pid * K + c)
        before = tl.zeros([K], dtype=tl.int64)
        for j0 in tl.static_range(0, K, CH):
            j = j0 + tl.arange(0, CH)
            s_j = tl.load(score_ptr + pid * K + j)
            n_j = tl.load(count_ptr + pid * K + j).to(tl.int64)
            ahead = (s_j[None, :] > s_c[:, None]) | ((s_j[None, :] == s_c[:, None]) & (j[None, :] < c[:, None]))
            before += tl.sum(tl.where(ahead, n_j[None, :], 0), axis=1)
        t = tl.arange(0, TP)
        quota = tl.load(quota_ptr + r * T + t, mask=t < T, other=0)
        hit = (before[:, None] < quota[None, :]) & (t[None, :] < T)
        tl.store(out_ptr + pid * K + c, tl.sum(hit.to(tl.int32), axis=1))

    @triton.jit
    def _histogram_kernel(score_ptr, hist_ptr, n, NB: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr):
        # a block histogram in registers, then NB atomics to distinct bins (not one atomic per key
        # on a handful of hot bins); invalid scores and the tail go to the spare bin NBP - 1
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(score_ptr + r * n + offs, mask=offs < n, other=-1)
        hist = tl.histogram(tl.where(s >= 0, s, NBP - 1), NBP)
        bins = tl.arange(0, NBP)
        tl.atomic_add(hist_ptr + r * NB + bins, hist, mask=bins < NB)

    @triton.jit
    def _block_counts_kernel(score_ptr, thr_ptr, cnt_ptr, n, nblk, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(score_ptr + r * n + offs, mask=offs < n, other=-1)
        thr = tl.load(thr_ptr + r)
        gt = tl.sum((s > thr).to(tl.int32), axis=0)
        eq = tl.sum(((s == thr) & (s >= 0)).to(tl.int32), axis=0)
        tl.store(cnt_ptr + (r * nblk + blk) * 2, gt)
        tl.store(cnt_ptr + (r * nblk + blk) * 2 + 1, eq)

    @triton.jit
    def _threshold(hist_ptr, rowk_ptr, r, k, NB: tl.constexpr, NBP: tl.constexpr, HAS_ROWK: tl.constexpr):
        # the twin's threshold_from_hist for one row: (threshold, ties at it to take)
        kk = k
        if HAS_ROWK:
            kk = tl.minimum(tl.load(rowk_ptr + r), k)
        v = tl.arange(0, NBP)
        h = tl.load(hist_ptr + r * NB + v, mask=v < NB, other=0).to(tl.int64)
        above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with score >= v
        thr = tl.maximum(tl.sum(((above >= kk) & (v < NB)).to(tl.int64), axis=0) - 1, 0)
        strictly = tl.sum(tl.where(v == thr + 1, above, 0), axis=0)  # 0 when thr + 1 == NB (masked)
        at = tl.sum(tl.where(v == thr, h, 0), axis=0)
        take = tl.minimum(tl.maximum(kk - strictly, 0), at)
        return thr, take

    @triton.jit
    def _fused_counts_kernel(
        score_ptr, hist_ptr, rowk_ptr, cnt_ptr, n, k, nblk,
        NB: tl.constexpr, NBP: tl.constexpr, HAS_ROWK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        thr, take = _threshold(hist_ptr, rowk_ptr, r, k, NB, NBP, HAS_ROWK)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(score_ptr + r * n + offs, mask=offs < n, other=-1)
        gt = tl.sum((s > thr).to(tl.int32), axis=0)
        eq = tl.sum(((s == thr) & (s >= 0)).to(tl.int32), axis=0)
        tl.store(cnt_ptr + (r * nblk + blk) * 2, gt)
        tl.store(cnt_ptr + (r * nblk + blk) * 2 + 1, eq)

    @triton.jit
    def _fused_compact_kernel(
        score_ptr, hist_ptr, rowk_ptr, cnt_ptr, out_ptr, n, k, nblk,
        NB: tl.constexpr, NBP: tl.constexpr, HAS_ROWK: tl.constexpr, NBLKP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # the compaction of _compact_kernel; each program derives its block's offsets (ties at the
        # threshold taken before it, keys selected before it) from the row's block counts itself
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        thr, take = _threshold(hist_ptr, rowk_ptr, r, k, NB, NBP, HAS_ROWK)
        b = tl.arange(0, NBLKP)
        bm = b < nblk
        gt_b = tl.load(cnt_ptr + (r * nblk + b) * 2, mask=bm, other=0).to(tl.int64)
        eq_b = tl.load(cnt_ptr + (r * nblk + b) * 2 + 1, mask=bm, other=0).to(tl.int64)
        eq_pre_b = tl.cumsum(eq_b, axis=0) - eq_b
        sel_b = gt_b + tl.minimum(tl.maximum(take - eq_pre_b, 0), eq_b)
        eq_pre = tl.sum(tl.where(b < blk, eq_b, 0), axis=0)
        sel_pre = tl.sum(tl.where(b < blk, sel_b, 0), axis=0)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(score_ptr + r * n + offs, mask=offs < n, other=-1)
        gt = s > thr
        eq = (s == thr) & (s >= 0)
        eq_rank = eq_pre + tl.cumsum(eq.to(tl.int64), axis=0) - 1
        sel = gt | (eq & (eq_rank < take))
        pos = sel_pre + tl.cumsum(sel.to(tl.int64), axis=0) - 1
        tl.store(out_ptr + r * k + pos, offs.to(tl.int64), mask=sel & (pos < k))

    @triton.jit
    def _compact_kernel(score_ptr, thr_ptr, take_ptr, eqpre_ptr, selpre_ptr, out_ptr, n, k, nblk, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(score_ptr + r * n + offs, mask=offs < n, other=-1)
        thr = tl.load(thr_ptr + r)
        take = tl.load(take_ptr + r)
        gt = s > thr
        eq = (s == thr) & (s >= 0)
        eq_rank = tl.load(eqpre_ptr + r * nblk + blk) + tl.cumsum(eq.to(tl.int64), axis=0) - 1
        sel = gt | (eq & (eq_rank < take))
        pos = tl.load(selpre_ptr + r * nblk + blk) + tl.cumsum(sel.to(tl.int64), axis=0) - 1
        tl.store(out_ptr + r * k + pos, offs.to(tl.int64), mask=sel & (pos < k))

    @triton.jit
    def _rerank_kernel(
        cand_ptr, codes_ptr, w_ptr, q_ptr, qn_ptr, cen_ptr, out_ptr, c_len,
        s_cr, s_cn, s_wr, s_wn,
        HALF: tl.constexpr, HALF_M: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr,
    ):  # fmt: skip
        # the candidates' codes and weights are read once and scored for each of the row's G query heads
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cm = offs < c_len
        cand = tl.load(cand_ptr + r * c_len + offs, mask=cm, other=-1)
        ok = cm & (cand >= 0)
        c = tl.where(ok, cand, 0)
        j = tl.arange(0, HALF)
        byte = tl.load(codes_ptr + r * s_cr + c[:, None] * s_cn + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        v_lo = tl.load(cen_ptr + (lo & 7)) * tl.where(lo >= 8, 1.0, -1.0)
        v_hi = tl.load(cen_ptr + (hi & 7)) * tl.where(hi >= 8, 1.0, -1.0)
        w = tl.load(w_ptr + r * s_wr + c[:, None] * s_wn + (j // HALF_M)[None, :], mask=ok[:, None], other=0.0)
        w = w.to(tl.float32)
        for gi in tl.static_range(G):
            q_even = tl.load(q_ptr + (r * G + gi) * 2 * HALF + 2 * j)
            q_odd = tl.load(q_ptr + (r * G + gi) * 2 * HALF + 2 * j + 1)
            est = tl.sum((v_lo * q_even[None, :] + v_hi * q_odd[None, :]) * w, axis=1)
            est = est * tl.load(qn_ptr + r * G + gi)
            tl.store(out_ptr + (r * G + gi) * c_len + offs, tl.where(ok, est, float("-inf")), mask=cm)

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
        "collision": _collision_kernel,
        "histogram": _histogram_kernel,
        "block_counts": _block_counts_kernel,
        "fused_counts": _fused_counts_kernel,
        "fused_compact": _fused_compact_kernel,
        "cluster_votes": _cluster_votes_kernel,
        "compact": _compact_kernel,
        "rerank": _rerank_kernel,
        "gather": _gather_kernel,
    }


def _k():
    return _KERNELS


def collision_votes(
    ids: torch.Tensor, votes: torch.Tensor, live: torch.Tensor | None = None, block: int = 256
) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.collision_votes`. ids uint8 [R, N, B] (last dim contiguous);
    votes [R, B, K] or [R, G, B, K] (the best of G heads); ``live`` [R] (optional): slots at or past it score -1."""
    _check(ids, votes)
    r, n, nsub = ids.shape
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    g = votes.shape[1] if votes.dim() == 4 else 1
    votes = votes.contiguous().to(torch.int32)
    out = torch.empty(r, n, dtype=torch.int32, device=ids.device)
    if r and n:
        grid = (r, -(-n // block))
        lv = out if live is None else live.contiguous()
        gp = 1 << max(0, (g - 1).bit_length())
        _k()["collision"][grid](
            ids, votes, lv, out, n, ids.stride(0), ids.stride(1), nsub, votes.shape[-1], block, live is not None, g, gp
        )
    return out


def cluster_votes(scores: torch.Tensor, counts: torch.Tensor, quotas: torch.Tensor) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.cluster_votes` (one launch instead of a sort, gathers and a scatter)."""
    _check(scores, counts, quotas)
    r, nsub, k = scores.shape
    scores, counts = scores.contiguous().float(), counts.contiguous().to(torch.int32)
    quotas = quotas.contiguous().long()
    out = torch.empty(r, nsub, k, dtype=torch.int32, device=scores.device)
    if r and nsub:
        t = quotas.shape[-1]
        tp = 1 << (t - 1).bit_length()
        _k()["cluster_votes"][(r * nsub,)](scores, counts, quotas, out, nsub, k, min(k, 32), t, tp)
    return out


def bucket_topk(
    scores: torch.Tensor, k: int, max_score: int, row_k: torch.Tensor | None = None, block: int = 1024
) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.bucket_topk` (same indices, same order)."""
    _check(scores)
    scores = scores.contiguous().to(torch.int32)
    r, n = scores.shape
    k = min(k, n)
    out = torch.full((r, k), -1, dtype=torch.long, device=scores.device)
    if r == 0 or n == 0 or k == 0:
        return out
    kern = _k()
    nb = max_score + 1
    nblk = -(-n // block)
    grid = (r, nblk)
    hist = torch.zeros(r, nb, dtype=torch.int32, device=scores.device)
    nbp = 1 << nb.bit_length()  # a power of two > nb: room for the spare bin
    kern["histogram"][grid](scores, hist, n, nb, nbp, block)
    if nblk <= 1024:  # fused: the threshold and the block offsets are derived inside the two kernels
        rk = hist if row_k is None else row_k.to(scores.device).contiguous().long()
        cnt = torch.empty(r, nblk, 2, dtype=torch.int32, device=scores.device)
        args = (nb, nbp, row_k is not None)
        kern["fused_counts"][grid](scores, hist, rk, cnt, n, k, nblk, *args, block)
        nblkp = 1 << max(0, (nblk - 1).bit_length())
        kern["fused_compact"][grid](scores, hist, rk, cnt, out, n, k, nblk, *args, nblkp, block)
        return out
    rk = k if row_k is None else row_k.to(scores.device).long().clamp(max=k)
    thr, take = twin.threshold_from_hist(hist.long(), rk)
    thr32 = thr.to(torch.int32).contiguous()
    cnt = torch.empty(r, nblk, 2, dtype=torch.int32, device=scores.device)
    kern["block_counts"][grid](scores, thr32, cnt, n, nblk, block)
    gt, eq = cnt[..., 0].long(), cnt[..., 1].long()
    eq_pre = eq.cumsum(1) - eq
    sel = gt + (take[:, None] - eq_pre).clamp(min=0).minimum(eq)
    sel_pre = sel.cumsum(1) - sel
    kern["compact"][grid](
        scores, thr32, take.contiguous(), eq_pre.contiguous(), sel_pre.contiguous(), out, n, k, nblk, block
    )
    return out


def rerank_scores(cand, codes, weight, qb, qnorm, centers, m: int, block: int = 64) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.rerank_scores` (fp32, summation order differs); qb [R, B, m] or
    [R, G, B, m] (G query heads per row: -> [R, G, C])."""
    _check(cand, codes, weight)
    r, c_len = cand.shape
    half = codes.shape[-1]
    g = qb.shape[1] if qb.dim() == 4 else 1
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
            cand, codes, weight, q, qnorm.float().contiguous(), centers.float().contiguous(), out, c_len,
            codes.stride(0), codes.stride(1), weight.stride(0), weight.stride(1), half, m // 2, block, g,
        )  # fmt: skip
    return out if qb.dim() == 4 else out[:, 0]


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
