"""IceCache's rerank on semantic pages (``icecache:search=summary:rerank=N``): the index arithmetic around
its scoring and top-k calls, in two small Triton kernels.

A step of the rerank takes, per (sequence, kv head) row, the ``Pc`` candidate pages' token positions out of
the page table, scores those keys exactly (:mod:`kvdex.kernels.rerank_triton`), and with
``rerank_unit="token"`` keeps the ``room`` best tokens. Around the scoring and the top-k, the PyTorch twins
(:func:`kvdex.kernels.scoring.candidate_slots` and :func:`kvdex.kernels.scoring.pick_tokens`) run about 25 small
elementwise, gather, scatter and reduction kernels per layer: on a small model (Qwen2.5-0.5B, 22 sparse
layers) those launches, not the work, are what the step waits for.

* :func:`candidate_slots`: one program per (row, tile of candidate slots) reads each candidate's page id and
  that page's positions from the table (``-1`` for an empty slot or a missing candidate) and writes them as
  int32: the slots the scoring kernel reads, and the positions a chosen token maps back to.
* :func:`pick_tokens`: one program per row maps the chosen columns (top-k ids, ``-1`` padded) to positions,
  counts the distinct candidate pages holding a chosen token with ``tl.histogram`` over the candidate
  columns, and adds (pages, tokens) to the step counters with two atomic adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import candidate_slots as candidate_slots_reference
from kvdex.kernels.scoring import pick_tokens as pick_tokens_reference

__all__ = ["candidate_slots", "candidate_slots_reference", "pick_tokens", "pick_tokens_reference"]


@triton.jit
def _slots_kernel(CAND, POS, OUT, N, stride_cr, stride_pr, stride_pp, PS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    page = tl.load(CAND + r * stride_cr + offs // PS, mask=m, other=-1)
    ok = m & (page >= 0)
    pos = tl.load(POS + r * stride_pr + page * stride_pp + offs % PS, mask=ok, other=-1)
    tl.store(OUT + r * N + offs, pos.to(tl.int32), mask=m)


@triton.jit
def _pick_kernel(
    IDS, SLOTS, OUT, COUNTS, T, NS, PS: tl.constexpr, NBINS: tl.constexpr, BLOCK_T: tl.constexpr
):  # fmt: skip
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)
    m = offs < T
    ids = tl.load(IDS + r * T + offs, mask=m, other=-1)
    hit = m & (ids >= 0)
    pos = tl.load(SLOTS + r * NS + ids, mask=hit, other=-1)
    tl.store(OUT + r * T + offs, tl.where(hit, pos.to(tl.int64), -1), mask=m)
    page = tl.where(hit, ids // PS, NBINS - 1).to(tl.int32)  # bin NBINS - 1: no token
    hist = tl.histogram(page, NBINS)
    bins = tl.arange(0, NBINS)
    pages = tl.sum(((hist > 0) & (bins < NBINS - 1)).to(tl.int64), axis=0)
    tl.atomic_add(COUNTS, pages)
    tl.atomic_add(COUNTS + 1, tl.sum(hit.to(tl.int64), axis=0))


def candidate_slots(cand: torch.Tensor, pos: torch.Tensor, ps: int) -> torch.Tensor:
    """cand [R, Pc] (candidate page ids, ``-1``: none), pos [R, C, ps] (the page table's token positions,
    ``-1`` empty, last dim contiguous) -> [R, Pc * ps] int32: every candidate's positions, ``-1`` where the
    slot is empty or the candidate missing."""
    if cand.dim() != 2 or pos.dim() != 3 or pos.shape[0] != cand.shape[0] or pos.shape[2] != ps:
        raise ValueError(f"expected cand [R, Pc] and pos [R, C, {ps}], got {tuple(cand.shape)}, {tuple(pos.shape)}")
    R, Pc = cand.shape
    n = Pc * ps
    out = torch.empty(R, n, dtype=torch.int32, device=cand.device)
    if R == 0 or n == 0:
        return out
    if pos.stride(2) != 1:
        pos = pos.contiguous()
    if cand.stride(1) != 1:
        cand = cand.contiguous()
    block = 1024
    _slots_kernel[(R, triton.cdiv(n, block))](
        cand, pos, out, n, cand.stride(0), pos.stride(0), pos.stride(1), PS=ps, BLOCK=block
    )
    return out


def pick_tokens(ids: torch.Tensor, slots: torch.Tensor, ps: int, counts: torch.Tensor) -> torch.Tensor:
    """ids [R, T] (chosen columns of ``slots``, ``-1``: none), slots [R, Pc * ps] (int32, ``-1`` empty) ->
    [R, T] int64 positions (``-1`` where none); adds (distinct candidate pages holding a chosen token, chosen
    tokens) to ``counts`` [2] int64 in place."""
    if ids.dim() != 2 or slots.dim() != 2 or ids.shape[0] != slots.shape[0] or slots.shape[1] % ps:
        raise ValueError(f"expected ids [R, T] and slots [R, Pc * {ps}], got {tuple(ids.shape)}, {tuple(slots.shape)}")
    if counts.shape != (2,) or counts.dtype != torch.long:
        raise ValueError(f"counts must be [2] int64, got {tuple(counts.shape)} {counts.dtype}")
    R, T = ids.shape
    out = torch.empty(R, T, dtype=torch.long, device=ids.device)
    if R == 0 or T == 0:
        return out
    ids, slots = ids.contiguous(), slots.contiguous()
    nbins = triton.next_power_of_2(slots.shape[1] // ps + 1)
    _pick_kernel[(R,)](
        ids, slots, out, counts, T, slots.shape[1], PS=ps, NBINS=nbins, BLOCK_T=max(16, triton.next_power_of_2(T))
    )
    return out
