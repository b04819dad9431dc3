# Over 400 lines: the whole ParisKV retrieval pipeline in one place, each kernel beside its host wrapper.
"""Triton kernels of the ParisKV retrieval pipeline; each equals its twin in ``kernels.pariskv``.

* ``cluster_votes``   -- one program per (row, subspace): the vote table (keys ranked ahead of each
  centroid by pairwise comparison, then the tiers), instead of a sort, two gathers and a scatter;
* ``collision_votes`` -- one program per (row, block of keys): sum over subspaces of the vote
  table entry of each key's centroid id; with G tables per row (``group="heads"``: one per query head)
  the best head's sum, the G tables packed into int64 words when the caller bounds a key's sum (a
  head's sum never carries into the next head's bits), so one gather per (key, subspace) serves up to
  6 heads; slots past a row's length score -1;
* ``bucket_topk``     -- histogram of the integer scores (atomics), threshold from its suffix sum,
  then a two-pass stream compaction (per-block counts, exclusive scan, in-block cumsum) that keeps
  every key above the threshold and the lowest-index ties: no sort, and the same output as the twin.
  Both passes derive the threshold and their block's offsets themselves (the histogram has <= 32 * B + 1
  bins, a row <= 1024 blocks): 5 launches instead of ~30 small PyTorch ops in between (launch-bound);
* ``rerank_scores``   -- gathers the 4-bit codes and weights of the candidates, decodes both nibbles
  of each byte by selects (no table lookups) and reduces ``|q| sum_b w_b <v_b, q~_b>`` per subspace,
  once per query head of the row (G heads share the codes read); ``rerank_combined`` adds each block's
  best estimate per head and a second kernel sums the heads' relative weights (``combine_heads``);
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
        ids_ptr, table_ptr, live_ptr, out_ptr, n, s_ir, s_in,
        NSUB: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, HAS_LIVE: tl.constexpr,
        G: tl.constexpr, W: tl.constexpr, FIELDS: tl.constexpr, BITS: tl.constexpr,
    ):  # fmt: skip
        # The G vote tables of a row (one per query head of a GQA group) are packed FIELDS to an int64 word
        # (BITS bits a head, W words): one gather per (key, subspace, word) adds all of a word's heads at
        # once, since no head's sum can carry into the next field. A key scores its best head's sum.
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        best = tl.full([BLOCK], -1, dtype=tl.int32)
        for w in tl.static_range(W):
            acc = tl.zeros([BLOCK], dtype=tl.int64)
            for s in tl.static_range(NSUB):
                cid = tl.load(ids_ptr + r * s_ir + offs * s_in + s, mask=mask, other=0).to(tl.int64)
                acc += tl.load(table_ptr + ((r * W + w) * NSUB + s) * K + cid, mask=mask, other=0)
            for f in tl.static_range(FIELDS):
                if w * FIELDS + f < G:
                    best = tl.maximum(best, ((acc >> (f * BITS)) & ((1 << BITS) - 1)).to(tl.int32))
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
        "collision": _collision_kernel,
        "histogram": _histogram_kernel,
        "block_counts": _block_counts_kernel,
        "fused_counts": _fused_counts_kernel,
        "fused_compact": _fused_compact_kernel,
        "cluster_votes": _cluster_votes_kernel,
        "compact": _compact_kernel,
        "rerank": _rerank_kernel,
        "combine": _combine_kernel,
        "gather": _gather_kernel,
    }


def _k():
    return _KERNELS


def _packing(g: int, max_score: int | None) -> tuple[int, int, int]:
    """(words W, heads per word, bits per head) packing G vote tables whose per-key sums stay <= ``max_score``
    (unknown: one head per word)."""
    if max_score is None:
        return g, 1, 63
    bits = max(1, int(max_score).bit_length())
    fields = max(1, min(g, 63 // bits))
    return -(-g // fields), fields, bits


def collision_votes(
    ids: torch.Tensor,
    votes: torch.Tensor,
    live: torch.Tensor | None = None,
    max_score: int | None = None,
    block: int = 256,
) -> torch.Tensor:
    """Twin: :func:`kvdex.kernels.pariskv.collision_votes`. ids uint8 [R, N, B] (last dim contiguous);
    votes [R, B, K] or [R, G, B, K] (the best of G heads), each entry >= 0; ``live`` [R] (optional): slots at
    or past it score -1. ``max_score`` (a bound on a key's summed vote, e.g. the policy's ``max_votes``):
    the heads' tables are packed into int64 words, several heads a gather (else one head a word)."""
    _check(ids, votes)
    r, n, nsub = ids.shape
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    g = votes.shape[1] if votes.dim() == 4 else 1
    k = votes.shape[-1]
    w, fields, bits = _packing(g, max_score)
    tab = votes.reshape(r, g, nsub, k).long()
    if w * fields != g:
        tab = torch.nn.functional.pad(tab, (0, 0, 0, 0, 0, w * fields - g))
    if fields > 1:
        shifts = torch.arange(fields, device=tab.device) * bits
        tab = (tab.view(r, w, fields, nsub, k) << shifts[:, None, None]).sum(2)
    tab = tab.reshape(r, w, nsub, k).contiguous()
    out = torch.empty(r, n, dtype=torch.int32, device=ids.device)
    if r and n:
        lv = out if live is None else live.contiguous()
        args = (n, ids.stride(0), ids.stride(1), nsub, k, block, live is not None, g, w, fields, bits)
        _k()["collision"][(r, -(-n // block))](ids, tab, lv, out, *args)
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
    """Twin: :func:`kvdex.kernels.pariskv.bucket_topk` (same indices, same order). The histogram has its own
    kernel: counting it inside the vote kernel (``tl.histogram`` over every block's bins) measured slower
    (H200, 8 rows of 131,072 keys, 16 subspaces, 4 heads: 110 us against 33 + 26 us)."""
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
