"""IceCache's semantic pages on the device (``icecache:search=summary``): the index arithmetic around the
rerank's scoring and top-k calls, and the nearest page of a joining key, in Triton kernels.

A step of the rerank takes, per (sequence, kv head) row, the ``Pc`` candidate pages' token positions out of
the page table, scores those keys exactly (:mod:`kvdex.kernels.rerank_triton`), and with
``rerank_unit="token"`` keeps the ``room`` best tokens. Around the scoring and the top-k, the PyTorch twins
(:func:`kvdex.kernels.scoring.candidate_slots` and :func:`kvdex.kernels.scoring.pick_tokens`) run about 25 small
elementwise, gather, scatter and reduction kernels per layer: on a small model (Qwen2.5-0.5B, 22 sparse
layers) those launches, not the work, are what the step waits for.

* :func:`candidate_slots`: one program per (row, tile of candidate slots) reads each candidate's page id and
  that page's positions from the table (``-1`` for an empty slot or a missing candidate) and writes them as
  int32: the slots the scoring kernel reads, and the positions a chosen token maps back to.
* :func:`pick_tokens`: one program per (row, tile of 512 chosen columns) maps the chosen columns (top-k ids,
  ``-1`` padded) to positions and counts the distinct candidate pages holding a chosen token: each chosen
  token marks its page in a zeroed scratch row by an atomic exchange, and a page counts where the exchange
  found it unmarked; (pages, tokens) go to the step counters by atomic adds. (One program per row with
  ``tl.histogram`` over the candidate pages took ~50 us per layer at 128k on an H200.)
* :func:`nearest_pages`: a window page joining the middle puts each key into the page whose centre is nearest
  (``SemanticPages.insert_device``). The twin materialises every page's centre in fp32 and the [keys, pages]
  distances: at 128k tokens (~14.7k partly filled pages per kv head) a dozen kernels over [R, C, D] fp32 per
  layer. One program per (row, tile of ``BLOCK_C`` pages) reads the summaries in their dtype (only the live
  pages'), forms the centres and distances in registers (fp32; ``tl.dot`` as three TF32 products) and writes each
  key's best distance and page of its tile; an ``argmin`` over the tiles picks the first best page, as the
  twin does. Both are fp32 with different summation orders, so a key whose two nearest centres are within
  rounding of each other may join either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import candidate_slots as candidate_slots_reference
from kvdex.kernels.scoring import nearest_pages as nearest_pages_reference
from kvdex.kernels.scoring import pick_tokens as pick_tokens_reference

__all__ = [
    "candidate_slots",
    "candidate_slots_reference",
    "nearest_pages",
    "nearest_pages_reference",
    "pick_tokens",
    "pick_tokens_reference",
]


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
def _pick_kernel(IDS, SLOTS, OUT, USED, COUNTS, T, NS, NPC, PS: tl.constexpr, BLOCK_T: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = offs < T
    ids = tl.load(IDS + r * T + offs, mask=m, other=-1)
    hit = m & (ids >= 0)
    pos = tl.load(SLOTS + r * NS + ids, mask=hit, other=-1)
    tl.store(OUT + r * T + offs, tl.where(hit, pos.to(tl.int64), -1), mask=m)
    # a candidate page is counted by the one chosen token that marks it first (atomic exchange: old value 0)
    old = tl.atomic_xchg(USED + r * NPC + ids // PS, 1, mask=hit)
    tl.atomic_add(COUNTS, tl.sum((hit & (old == 0)).to(tl.int64), axis=0))
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
    npc = slots.shape[1] // ps
    used = torch.zeros(R, npc, dtype=torch.int32, device=ids.device)  # candidate pages holding a chosen token
    grid = (R, triton.cdiv(T, 512))
    _pick_kernel[grid](ids, slots, out, used, counts, T, slots.shape[1], npc, PS=ps, BLOCK_T=512)
    return out


@triton.jit
def _nearest_kernel(
    K, A, B, FILL, MIN, ARG, N, C, NB,
    stride_kr, stride_kn, stride_ar, stride_ac, stride_br, stride_bc, stride_fr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, MINMAX: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    r, t = tl.program_id(0), tl.program_id(1)
    on, od = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    oc = t * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.load(K + r * stride_kr + on[:, None] * stride_kn + od[None, :], mask=(on[:, None] < N) & (od[None, :] < D),
                other=0.0).to(tl.float32)  # fmt: skip
    live = tl.load(FILL + r * stride_fr + oc, mask=oc < C, other=0) > 0
    m = live[:, None] & (od[None, :] < D)  # dead pages are not read (a minmax one holds +-inf)
    c = tl.load(A + r * stride_ar + oc[:, None] * stride_ac + od[None, :], mask=m, other=0.0).to(tl.float32)
    if MINMAX:
        hi = tl.load(B + r * stride_br + oc[:, None] * stride_bc + od[None, :], mask=m, other=0.0).to(tl.float32)
        c = (c + hi) / 2
    d2 = tl.sum(c * c, axis=1)[None, :] - 2 * tl.dot(k, tl.trans(c), input_precision=PRECISION)  # [BLOCK_N, BLOCK_C]
    d2 = tl.where(live[None, :], d2, float("inf"))
    best = tl.min(d2, axis=1)
    arg = tl.argmin(d2, axis=1)  # the first on ties
    tl.store(MIN + (r * N + on) * NB + t, best, mask=on < N)
    tl.store(ARG + (r * N + on) * NB + t, t * BLOCK_C + arg.to(tl.int64), mask=on < N)


def nearest_pages(
    keys: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    fill: torch.Tensor,
    kind: str,
    *,
    block_c: int = 64,
    precision: str = "tf32x3",
    num_warps: int = 4,
) -> torch.Tensor:
    """keys [R, N, D] -> [R, N] int64: each key's nearest live page (``fill`` [R, C] > 0) by the distance to its
    centre (``(a + b) / 2``, a / b [R, C, D] for ``kind="minmax"``; the mean ``a`` for ``"centroid"``); the
    first on ties, 0 where a row has no live page. The twin: ``kvdex.kernels.scoring.nearest_pages``.
    ``precision``: ``tl.dot``'s (``"tf32x3"``: three TF32 products, about fp32's precision; ``"ieee"``: fp32 on
    the CUDA cores). At 128k keys per kv head (8B shape, ~14.7k pages per row, H200): 66 us per layer with
    ``"tf32x3"``, 95 with ``"ieee"``, 388 for the twin; every choice the twin's in that measurement."""
    R, N, D = keys.shape
    C = fill.shape[1]
    if a.shape != (R, C, D) or fill.shape[0] != R or (kind == "minmax" and b.shape != a.shape):
        raise ValueError(f"expected keys [R, N, D], a / b [R, C, D], fill [R, C]; got {tuple(keys.shape)}, "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(fill.shape)}")  # fmt: skip
    if R == 0 or N == 0 or C == 0:
        return torch.zeros(R, N, dtype=torch.long, device=keys.device)
    keys, fill = keys.contiguous(), fill.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    minmax = kind == "minmax"
    b = (b if b.stride(-1) == 1 else b.contiguous()) if minmax else a
    nb = triton.cdiv(C, block_c)
    best = torch.empty(R, N, nb, dtype=torch.float32, device=keys.device)
    arg = torch.empty(R, N, nb, dtype=torch.long, device=keys.device)
    _nearest_kernel[(R, nb)](
        keys, a, b, fill, best, arg, N, C, nb,
        keys.stride(0), keys.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), fill.stride(0),
        D=D, BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_C=block_c, BLOCK_D=max(16, triton.next_power_of_2(D)),
        MINMAX=minmax, PRECISION=precision, num_warps=num_warps,
    )  # fmt: skip
    return arg.gather(2, best.argmin(2, keepdim=True)).squeeze(2)
