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
  pages'), forms the centres and distances in registers (fp32 sums; the products of 16-bit keys with 16-bit
  summaries on the tensor cores, exact; fp32 keys as three TF32 products) and writes each key's best
  distance and page of its tile; a second small kernel picks the first best page over the tiles (in place of
  an ``argmin`` and a gather), as the twin does. Both are fp32 with different summation orders, so a key whose
  two nearest centres are within rounding of each other may join either.
* :func:`insert_pages`: the rest of a join, one program per row: each key's slot in its page or in the row's
  new page, the positions, fills and page count, and the summaries of the pages it joined (min / max, or the
  mean and radius) with the keys of one page folded in the order they come. The twin runs ~40 small kernels
  per layer (among them two ``scatter_reduce`` over the summaries); in a captured step each costs a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import candidate_slots as candidate_slots_reference
from kvdex.kernels.scoring import insert_pages as insert_pages_reference
from kvdex.kernels.scoring import nearest_pages as nearest_pages_reference
from kvdex.kernels.scoring import pick_tokens as pick_tokens_reference

__all__ = [
    "candidate_slots",
    "candidate_slots_reference",
    "insert_pages",
    "insert_pages_reference",
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
    PRECISION: tl.constexpr, NATIVE: tl.constexpr,
):  # fmt: skip
    r, t = tl.program_id(0), tl.program_id(1)
    on, od = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    oc = t * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.load(K + r * stride_kr + on[:, None] * stride_kn + od[None, :], mask=(on[:, None] < N) & (od[None, :] < D),
                other=0.0)  # fmt: skip
    live = tl.load(FILL + r * stride_fr + oc, mask=oc < C, other=0) > 0
    m = live[:, None] & (od[None, :] < D)  # dead pages are not read (a minmax one holds +-inf)
    a = tl.load(A + r * stride_ar + oc[:, None] * stride_ac + od[None, :], mask=m, other=0.0)
    if MINMAX:
        hi = tl.load(B + r * stride_br + oc[:, None] * stride_bc + od[None, :], mask=m, other=0.0)
        c = (a.to(tl.float32) + hi.to(tl.float32)) / 2
    else:
        c = a.to(tl.float32)
    if NATIVE:  # 16-bit keys and summaries: k.a (+ k.b) on the tensor cores, each product exact in fp32
        kc2 = tl.dot(k, tl.trans(a))
        if MINMAX:
            kc2 += tl.dot(k, tl.trans(hi))  # k.a + k.b = 2 k.c
        else:
            kc2 = 2 * kc2
    else:
        kc2 = 2 * tl.dot(k.to(tl.float32), tl.trans(c), input_precision=PRECISION)
    d2 = tl.sum(c * c, axis=1)[None, :] - kc2  # [BLOCK_N, BLOCK_C]
    d2 = tl.where(live[None, :], d2, float("inf"))
    best = tl.min(d2, axis=1)
    arg = tl.argmin(d2, axis=1)  # the first on ties
    tl.store(MIN + (r * N + on) * NB + t, best, mask=on < N)
    tl.store(ARG + (r * N + on) * NB + t, t * BLOCK_C + arg.to(tl.int64), mask=on < N)


@triton.jit
def _first_best_kernel(MIN, ARG, OUT, RN, NB, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per key (row of the [R * N, NB] tile results): the page of the first tile holding its best distance."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = tl.arange(0, BLOCK_T)
    m = (r[:, None] < RN) & (t[None, :] < NB)
    best = tl.load(MIN + r[:, None] * NB + t[None, :], mask=m, other=float("inf"))
    low = tl.min(best, axis=1)
    first = tl.min(tl.where(best == low[:, None], t[None, :], BLOCK_T), axis=1)  # the first tile at the minimum
    first = tl.minimum(first, NB - 1)  # a key with no finite distance: its row has no live page, tile 0 says 0
    first = tl.where(low == float("inf"), 0, first)
    tl.store(OUT + r, tl.load(ARG + r * NB + first, mask=r < RN, other=0), mask=r < RN)


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
    Keys and summaries of one 16-bit dtype (a bf16 / fp16 model): ``k.c`` as the tensor cores' products of the
    keys with the summaries themselves (``(k.a + k.b) / 2`` for min / max: exact products, fp32 sums).
    Otherwise ``precision`` is ``tl.dot``'s on fp32 operands (``"tf32x3"``: three TF32 products, about fp32's
    precision; ``"ieee"``: fp32 on the CUDA cores). At 128k keys per kv head (8B shape, ~14.7k pages per row,
    H200, fp32 keys): 66 us per layer with ``"tf32x3"``, 95 with ``"ieee"``, 388 for the twin; every choice the
    twin's in that measurement."""
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
    native = keys.dtype == a.dtype == b.dtype and keys.dtype in (torch.bfloat16, torch.float16)
    nb = triton.cdiv(C, block_c)
    best = torch.empty(R, N, nb, dtype=torch.float32, device=keys.device)
    arg = torch.empty(R, N, nb, dtype=torch.long, device=keys.device)
    _nearest_kernel[(R, nb)](
        keys, a, b, fill, best, arg, N, C, nb,
        keys.stride(0), keys.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), fill.stride(0),
        D=D, BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_C=block_c, BLOCK_D=max(16, triton.next_power_of_2(D)),
        MINMAX=minmax, PRECISION=precision, NATIVE=native, num_warps=num_warps,
    )  # fmt: skip
    out = torch.empty(R, N, dtype=torch.long, device=keys.device)
    _first_best_kernel[(triton.cdiv(R * N, 32),)](best, arg, out, R * N, nb, BLOCK_R=32,
                                                   BLOCK_T=max(16, triton.next_power_of_2(nb)))  # fmt: skip
    return out


@triton.jit
def _insert_kernel(
    K, TGT, OK, POSN, POS, FILL, NPAGES, A, B, H,
    stride_kr, stride_kn, stride_tr, stride_nb, stride_pr, stride_pc, stride_fr, stride_ar, stride_ac,
    stride_br, stride_bc,
    PS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, MINMAX: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i, od = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    okr = tl.load(OK + r // H) != 0
    iv = (i < PS) & okr  # the keys that join (all of a row's, or none)
    dm = od < D
    t = tl.load(TGT + r * stride_tr + i, mask=iv, other=0)
    f_t = tl.load(FILL + r * stride_fr + t, mask=iv, other=0)
    rank = tl.sum(((t[:, None] == t[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    join = iv & (f_t > 0) & (f_t + rank < PS)
    spill = iv & ~join
    sp = spill.to(tl.int32)
    new = tl.load(NPAGES + r)
    page = tl.where(join, t, new)
    slot = tl.where(join, f_t + rank, tl.cumsum(sp, axis=0) - 1)
    p_in = tl.load(POSN + (r // H) * stride_nb + i, mask=iv, other=-1)
    tl.store(POS + r * stride_pr + page * stride_pc + slot, p_in.to(tl.int32), mask=iv)
    f0 = tl.load(FILL + r * stride_fr + page, mask=iv, other=0)
    same = (page[:, None] == page[None, :]) & iv[None, :]  # [key, key]: the second joins the first's page
    cnt = tl.sum(same.to(tl.int32), axis=1)
    m2 = iv[:, None] & dm[None, :]
    a_ptr = A + r * stride_ar + page[:, None] * stride_ac + od[None, :]
    lo = tl.load(a_ptr, mask=m2, other=0.0).to(tl.float32)  # each key's page's summary (a row per key)
    if MINMAX:
        b_ptr = B + r * stride_br + page[:, None] * stride_bc + od[None, :]
        hi = tl.load(b_ptr, mask=m2, other=0.0).to(tl.float32)
    else:
        lo = lo * f0.to(tl.float32)[:, None]  # the page's key sum, then the keys that join it
    for j in tl.static_range(PS):  # key j into every row whose page is key j's
        kj = tl.load(K + r * stride_kr + j * stride_kn + od, mask=dm & okr, other=0.0).to(tl.float32)
        pj = tl.sum(tl.where(i == j, page, 0), axis=0)
        mj = ((page == pj) & iv)[:, None]
        if MINMAX:
            lo = tl.where(mj, tl.minimum(lo, kj[None, :]), lo)
            hi = tl.where(mj, tl.maximum(hi, kj[None, :]), hi)
        else:
            lo = tl.where(mj, lo + kj[None, :], lo)
    if MINMAX:
        tl.store(a_ptr, lo.to(A.dtype.element_ty), mask=m2)
        tl.store(b_ptr, hi.to(B.dtype.element_ty), mask=m2)
    else:
        mu0 = tl.load(a_ptr, mask=m2, other=0.0).to(tl.float32)
        mu1 = (lo / (f0 + cnt).to(tl.float32)[:, None]).to(A.dtype.element_ty)
        mu1f = mu1.to(tl.float32)
        dmu = mu1f - mu0
        shift = tl.sqrt(tl.sum(dmu * dmu, axis=1))
        r0 = tl.load(B + r * stride_br + page * stride_bc, mask=iv, other=0.0)
        r1 = tl.where(f0 > 0, r0 + shift, 0.0)
        k = tl.load(K + r * stride_kr + i[:, None] * stride_kn + od[None, :], mask=m2, other=0.0).to(tl.float32)
        dk = k - mu1f  # each key against its own page's new mean (its row of mu1)
        dk = tl.where(iv, tl.sqrt(tl.sum(dk * dk, axis=1)), 0.0)
        r1 = tl.maximum(r1, tl.max(tl.where(same, dk[None, :], 0.0), axis=1))
        tl.debug_barrier()  # every row read its page's mean before any is overwritten
        tl.store(a_ptr, mu1, mask=m2)
        tl.store(B + r * stride_br + page * stride_bc, r1, mask=iv)
    tl.debug_barrier()  # every fill was read before any is written
    tl.store(FILL + r * stride_fr + page, f0 + cnt, mask=iv)
    tl.store(NPAGES + r, new + (tl.sum(sp, axis=0) > 0).to(new.dtype), mask=okr)


def insert_pages(keys, tgt, ok, positions, pos, fill, npages, a, b, kind: str) -> None:
    """One window page of keys [R, ps, D] joins the semantic pages of the rows of the sequences ``ok`` [B],
    in place: the twin's contract (:func:`kvdex.kernels.scoring.insert_pages`) in one launch. The minmax
    summaries are the twin's exactly; the centroid's mean sums a page's keys in their order from its
    old sum, as the twin does on CPU (fp32, rounded to the summary dtype)."""
    R, ps, D = keys.shape
    C = fill.shape[1]
    minmax = kind == "minmax"
    ok_shape = ok.dim() == 1 and ok.numel() > 0 and R % ok.numel() == 0
    b_shape = (R, C, D) if minmax else (R, C)
    if (not ok_shape or tgt.shape != (R, ps) or positions.shape != (ok.numel(), ps) or pos.shape != (R, C, ps)
            or npages.shape != (R,) or a.shape != (R, C, D) or b.shape != b_shape):  # fmt: skip
        raise ValueError(
            f"expected keys [R, ps, D], tgt [R, ps], ok [B], positions [B, ps], pos [R, C, ps], fill [R, C], "
            f"npages [R], a [R, C, D], b [R, C, D] or [R, C]; got {tuple(keys.shape)}, {tuple(tgt.shape)}, "
            f"{tuple(ok.shape)}, {tuple(positions.shape)}, {tuple(pos.shape)}, {tuple(fill.shape)}, "
            f"{tuple(npages.shape)}, {tuple(a.shape)}, {tuple(b.shape)}"
        )
    for name, x in (("pos", pos), ("fill", fill), ("npages", npages), ("a", a), ("b", b)):
        if x.stride(-1) != 1:  # written in place: no copy may stand in for it
            raise ValueError(f"{name} must have a unit last stride (it is written in place)")
    if R == 0 or ps == 0:
        return
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    tgt, positions = tgt.contiguous(), positions.to(keys.device).contiguous()
    okb = ok.to(device=keys.device, dtype=torch.int8)
    _insert_kernel[(R,)](
        keys, tgt, okb, positions, pos, fill, npages, a, b, R // ok.numel(),
        keys.stride(0), keys.stride(1), tgt.stride(0), positions.stride(0), pos.stride(0), pos.stride(1),
        fill.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        PS=ps, BLOCK_N=max(16, triton.next_power_of_2(ps)), D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        MINMAX=minmax,
    )  # fmt: skip
