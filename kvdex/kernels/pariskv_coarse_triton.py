"""ParisKV's coarse stage in Triton: the centroids' votes, every key's collision score and the candidate
pool (the keys with the most votes); each function equals its twin in ``kernels.pariskv``.

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
  bins, a row <= 1024 blocks): 5 launches instead of ~30 small PyTorch ops in between (launch-bound).

The pool's rerank and the final rows' gather are ``kvdex.kernels.pariskv_rerank_triton``; both stages
check their inputs with :func:`check_inputs`. triton is optional: the package imports without it
(:func:`available` says whether it can run). With ``TRITON_INTERPRET=1`` set before triton is imported the
kernels run on CPU tensors (CI checks them against the twins that way, in a subprocess).
"""

from __future__ import annotations

import os

import torch

from kvdex.kernels import pariskv as twin

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


def check_inputs(*tensors: torch.Tensor) -> None:
    """The check of every ParisKV Triton kernel: triton imports, the tensors are on CUDA (or the interpreter runs)."""
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

    _KERNELS = {
        "collision": _collision_kernel,
        "histogram": _histogram_kernel,
        "block_counts": _block_counts_kernel,
        "fused_counts": _fused_counts_kernel,
        "fused_compact": _fused_compact_kernel,
        "cluster_votes": _cluster_votes_kernel,
        "compact": _compact_kernel,
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
    check_inputs(ids, votes)
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
    check_inputs(scores, counts, quotas)
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
    check_inputs(scores)
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
