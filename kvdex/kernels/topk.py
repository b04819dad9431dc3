"""Top-k selection in one Triton kernel per call: ``topk_ids`` for the page / token policies.

``torch.topk`` on CUDA (``sbtopk``) runs one thread block per row; a decode step of Quest at 128k
tokens asks for the top 125 of 8192 page scores of each of 8 kv heads, so 8 blocks run on 8 of 132
SMs and the call costs ~54 us per layer (1.6 ms of a 10.5 ms step on the H200). This kernel is also one
program per row, but it does the selection with much less work per element:

1. **Keys.** Each score is mapped to a signed int32 that orders like the float (``-0.0`` folded onto
   ``+0.0``, every NaN largest, as ``torch.topk`` orders NaN).
2. **Radix select (bisection).** The k-th largest key ``T`` is built from the top bit down: for each
   bit, one pass counts the keys ``>= candidate`` and keeps the bit when the count is ``>= k``
   (32 passes for fp32; bf16 / fp16 scores have zero low bits in their fp32 image, so 16 / 19 passes).
   By default a pass decides two bits: the three counts for the candidates ``..01 / ..10 / ..11`` are
   packed into one int64 per element (20 bits each), so one reduction (one round of block
   synchronisation) serves two bits: 17 passes for fp32, 9 for bf16.
   A row of up to ``BLOCK`` scores is held in registers for all passes; longer rows are re-read from
   global memory (L1 / L2) tile by tile.
3. **Compaction.** With ``gt = #{key > T}``, the kernel takes every key ``> T`` and the ``k - gt``
   lowest-index keys ``== T`` (an exclusive ``tl.cumsum`` gives each its output slot), so exactly k
   entries are selected and ties at the k-th value go to the lowest index.
4. **Order.** The k selected entries are sorted (``tl.sort`` of ``key << 32 | ~index`` packed in
   int64) into descending score, ties by ascending index, like ``topk_ids``' contract. The order is
   kept because it is the order in which the attention visits the pages (the float sums follow it).
   Entries whose score is not finite become ``-1`` (the ``topk_ids`` convention for invalid pages).

The twin is :func:`topk_ids_reference` (a stable descending sort: the same function, ties included).
Against ``torch.topk`` the selected *set* is the same whenever the k-th value is not tied, and the
order is the same whenever no two selected scores are equal (``torch.topk`` leaves tie order open).

No host synchronisation and static shapes: the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows up to this many scores stay in registers; longer rows are looped over in tiles of this size.
MAX_BLOCK = 16384
# The final sort holds next_pow2(k) int64 keys in one program; larger k falls back to torch.topk.
MAX_K_BLOCK = 4096

_KEY_POS_INF = 0x7F800000  # key of +inf
_KEY_NEG_INF = -0x7F800001  # key of -inf (bits 0xFF800000 ^ 0x7FFFFFFF, as int32)


@triton.jit
def _keys(S, offs, N, LOW_BIT: tl.constexpr):
    """Order-preserving int32 image of the scores at ``offs`` (fp32 after the load); past N: INT32_MIN.
    The ``LOW_BIT`` low bits are cleared: a negative bf16 / fp16 score's fp32 image has zero low bits,
    which the flip of a negative turns into ones; cleared, every key has zero low bits like the threshold
    the passes build, so that threshold equals the k-th key and ``== thr`` finds its ties."""
    x = tl.load(S + offs, mask=offs < N, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x == 0.0, 0, key)  # -0.0 == +0.0
    key = tl.where(x != x, 0x7FFFFFFF, key)  # NaN largest (torch.topk's order)
    if LOW_BIT > 0:
        key = key & ~((1 << LOW_BIT) - 1)
    return tl.where(offs < N, key, -2147483647 - 1)


@triton.jit
def _finite(key):
    """Whether the keys are those of finite scores: above -inf's key (_KEY_NEG_INF), below +inf's
    (_KEY_POS_INF; NaN's key is above it)."""
    return (key > -0x7F800001) & (key < 0x7F800000)


@triton.jit
def _count3(key, c1, c2, c3):
    """Per element: [key >= c1] + [key >= c2] << 20 + [key >= c3] << 40 (three counts in one sum)."""
    return (key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 20) + ((key >= c3).to(tl.int64) << 40)


@triton.jit
def _row_k(KS, row, KDIV, K, SHARE, KMIN):
    """Row ``row``'s own count: ``min(K, max(KMIN, ceil(SHARE * KS[row // KDIV])))`` (the product in fp32), at
    least 0; the twin is ``kvdex.kernels.scoring.row_counts``."""
    n = tl.load(KS + row // KDIV).to(tl.float32)
    kr = tl.maximum(tl.ceil(n * SHARE).to(tl.int32), KMIN)
    return tl.minimum(tl.maximum(kr, 0), K)


@triton.jit
def _topk_kernel(
    S,
    OUT,
    stride_s,
    N,
    K,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
    K_BLOCK: tl.constexpr,
    LOW_BIT: tl.constexpr,  # bits below this are zero in every key (bf16: 16, fp16: 13, fp32: 0)
    PAIRS: tl.constexpr = 0,  # passes that decide two bits each (bits 30..31-2*PAIRS), then one per pass
    ORDERED: tl.constexpr = True,  # False: the k ids in ascending index order (no sort), -1 where not finite
    KS=None,  # (PER_ROW) each row's own k (:func:`_row_k`), the row's slots past it -1
    KDIV=1,
    PER_ROW: tl.constexpr = False,
    SHARE=1.0,
    KMIN=0,
):
    row = tl.program_id(0)
    s_row = S + row.to(tl.int64) * stride_s
    o_row = OUT + row.to(tl.int64) * K  # K: the output's row length
    offs = tl.arange(0, BLOCK)
    if PER_ROW:
        K_OUT = K
        K = _row_k(KS, row, KDIV, K_OUT, SHARE, KMIN)
    if TILES == 1:
        key = _keys(s_row, offs, N, LOW_BIT)

    # ---- 2. the k-th largest key: sign first, then bits 30..LOW_BIT, keep a bit while >= k keys stay ----
    if TILES == 1:
        cnt = tl.sum((key >= 0).to(tl.int32), axis=0)
    else:
        cnt = tl.full([], 0, tl.int32)
        for t in range(TILES):
            kt = _keys(s_row, t * BLOCK + offs, N, LOW_BIT)
            cnt += tl.sum((kt >= 0).to(tl.int32), axis=0)
    lo = tl.where(cnt >= K, 0, -2147483647 - 1)
    for i in tl.static_range(PAIRS):  # two bits per pass: three counts packed in one int64 sum (N < 2**20)
        c1 = lo + (1 << (29 - 2 * i))
        c2 = lo + (2 << (29 - 2 * i))
        c3 = lo + (3 << (29 - 2 * i))
        if TILES == 1:
            s3 = tl.sum(_count3(key, c1, c2, c3), axis=0)
        else:
            s3 = tl.full([], 0, tl.int64)
            for t in range(TILES):
                kt = _keys(s_row, t * BLOCK + offs, N, LOW_BIT)
                s3 += tl.sum(_count3(kt, c1, c2, c3), axis=0)
        n1 = s3 & 0xFFFFF
        n2 = (s3 >> 20) & 0xFFFFF
        n3 = s3 >> 40
        lo = tl.where(n3 >= K, c3, tl.where(n2 >= K, c2, tl.where(n1 >= K, c1, lo)))
    for i in tl.static_range(2 * PAIRS, 31 - LOW_BIT):  # one bit per pass (the rest)
        cand = lo + (1 << (30 - i))
        if TILES == 1:
            c = tl.sum((key >= cand).to(tl.int32), axis=0)
        else:
            c = tl.full([], 0, tl.int32)
            for t in range(TILES):
                kt = _keys(s_row, t * BLOCK + offs, N, LOW_BIT)
                c += tl.sum((kt >= cand).to(tl.int32), axis=0)
        lo = tl.where(c >= K, cand, lo)
    thr = lo

    # ---- 3. compaction: every key > thr, then the lowest-index keys == thr until k ----
    if TILES == 1:
        gt = key > thr
        eq = key == thr
        need_eq = K - tl.sum(gt.to(tl.int32), axis=0)
        eq_i = eq.to(tl.int32)
        take = gt | (eq & ((tl.cumsum(eq_i, axis=0) - eq_i) < need_eq))
        take_i = take.to(tl.int32)
        pos = tl.cumsum(take_i, axis=0) - take_i
        ids = offs.to(tl.int64)
        if not ORDERED:
            ids = tl.where(_finite(key), ids, -1)
        tl.store(o_row + pos, ids, mask=take)
    else:
        n_gt = tl.full([], 0, tl.int32)
        for t in range(TILES):
            kt = _keys(s_row, t * BLOCK + offs, N, LOW_BIT)
            n_gt += tl.sum((kt > thr).to(tl.int32), axis=0)
        need_eq = K - n_gt
        base = tl.full([], 0, tl.int32)
        eq_base = tl.full([], 0, tl.int32)
        for t in range(TILES):
            o = t * BLOCK + offs
            kt = _keys(s_row, o, N, LOW_BIT)
            gt = kt > thr
            eq = kt == thr
            eq_i = eq.to(tl.int32)
            take = gt | (eq & ((eq_base + tl.cumsum(eq_i, axis=0) - eq_i) < need_eq))
            take_i = take.to(tl.int32)
            pos = base + tl.cumsum(take_i, axis=0) - take_i
            ids = o.to(tl.int64)
            if not ORDERED:
                ids = tl.where(_finite(kt), ids, -1)
            tl.store(o_row + pos, ids, mask=take)
            base += tl.sum(take_i, axis=0)
            eq_base += tl.sum(eq_i, axis=0)
    if PER_ROW:  # the row's slots past its own k
        for t in range(0, K_OUT, BLOCK):
            o = t + offs
            tl.store(o_row + o, tl.full([BLOCK], -1, tl.int64), mask=(o >= K) & (o < K_OUT))
    if ORDERED:
        tl.debug_barrier()  # the scattered ids are read back by other threads of this program

        # ---- 4. descending score, ties by ascending index; -1 where the score is not finite ----
        ok = tl.arange(0, K_BLOCK)
        kmask = ok < K
        ids = tl.load(o_row + ok, mask=kmask, other=0)
        sk = _keys(s_row, ids, N, LOW_BIT).to(tl.int64)
        low = tl.full([], 0xFFFFFFFF, tl.int64)
        packed = (sk << 32) | (low - ids)
        packed = tl.where(kmask, packed, tl.full([], -9223372036854775807 - 1, tl.int64))
        packed = tl.sort(packed, descending=True)
        sk = packed >> 32
        ids = low - (packed & low)
        tl.debug_barrier()  # every id is read before any is overwritten
        tl.store(o_row + ok, tl.where(_finite(sk), ids, -1), mask=kmask)


def _low_bit(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def supported(score: torch.Tensor, k: int) -> bool:
    """Whether :func:`topk_ids` runs this kernel for these inputs (float scores, k <= MAX_K_BLOCK)."""
    return (
        score.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and score.dim() >= 1
        and 0 < min(k, score.shape[-1])
        and triton.next_power_of_2(min(k, score.shape[-1])) <= MAX_K_BLOCK
    )


def score_rows(score: torch.Tensor, k: int) -> tuple[torch.Tensor, int, torch.Size]:
    """score [..., N] as rows [R, N] with a unit last stride (a view where it can be), ``min(k, N)`` and the
    leading shape [...] the ids are returned in: the layout every top-k kernel here reads."""
    n = score.shape[-1]
    s = score.reshape(-1, n)
    return (s if s.stride(-1) == 1 else s.contiguous()), min(k, n), score.shape[:-1]


def topk_ids(
    score: torch.Tensor,
    k: int,
    block: int | None = None,
    bits: int = 2,
    num_warps: int | None = None,
    ordered: bool = True,
    row_k: torch.Tensor | None = None,
    row_share: float = 1.0,
    row_min: int = 0,
) -> torch.Tensor:
    """score [..., N] (fp32 / bf16 / fp16) -> [..., min(k, N)] int64: the ids of the k largest scores in
    descending score order (ties: lowest index first), ``-1`` where the score is not finite. With
    ``ordered=False`` the same k entries in ascending index order (no sort: for callers that use the set).
    ``row_k`` (with ``ordered=False``): an integer tensor [L] on the score's device, L dividing the number of
    rows; row ``r`` of the flattened rows takes its own count of best ids, ``scoring.row_counts(row_k,
    row_share, row_min, k)`` (``min(row_k[r // (rows // L)], k)`` by default; a rerank's share of each row's pages), and
    the rest of its ``k`` slots are ``-1``.

    ``block`` (a power of two), ``bits`` (key bits per pass: 1 or 2) and ``num_warps`` are for tests and
    tuning; ``block`` caps the tile of scores a program holds at once."""
    if not supported(score, k):
        raise ValueError(f"triton topk needs float scores and 0 < k <= {MAX_K_BLOCK}, got {score.dtype}, k={k}")
    s, k, lead = score_rows(score, k)
    n, rows = s.shape[1], s.shape[0]
    check_row_k(row_k, rows, score.device, ordered)
    out = torch.empty(rows, k, dtype=torch.long, device=score.device)
    if rows == 0:
        return out.view(*lead, k)
    blk = min(triton.next_power_of_2(n), block or MAX_BLOCK)
    low = _low_bit(score.dtype)
    _topk_kernel[(rows,)](
        s, out, s.stride(0), n, k,
        BLOCK=blk, TILES=triton.cdiv(n, blk), K_BLOCK=max(16, triton.next_power_of_2(k)),
        LOW_BIT=low, PAIRS=(31 - low) // 2 if bits == 2 and n < 1 << 20 else 0, ORDERED=ordered,
        KS=row_k if row_k is not None else out, KDIV=rows // row_k.numel() if row_k is not None else 1,
        PER_ROW=row_k is not None, SHARE=float(row_share), KMIN=int(row_min),
        num_warps=num_warps or _num_warps(blk),
    )  # fmt: skip
    return out.view(*lead, k)


def check_row_k(row_k: torch.Tensor | None, rows: int, device: torch.device, ordered: bool = False) -> None:
    """``ValueError`` unless ``row_k`` is None or an integer tensor [L] on ``device``, L dividing ``rows``,
    for an unordered call."""
    if row_k is not None and (ordered or row_k.dim() != 1 or row_k.numel() == 0 or rows % row_k.numel()
                              or row_k.device != device or row_k.is_floating_point()):  # fmt: skip
        raise ValueError(
            f"row_k must be an integer tensor [L] on {device}, L dividing the {rows} rows, with "
            f"ordered=False; got {tuple(row_k.shape)} {row_k.dtype} on {row_k.device}, ordered={ordered}"
        )


def topk_ids_split(score: torch.Tensor, k: int, segment: int = 8192, **kw) -> torch.Tensor:
    """:func:`topk_ids` for long rows in two stages: the top k of each ``segment`` scores (one program per
    segment, the row held in registers), then the top k of those S x k candidates.

    Same output as :func:`topk_ids` when every score is finite or ``-inf`` (what the policies produce:
    masked entries are ``-inf``): the global top k lie in the union of the segments' top k, and equal
    scores keep the lowest index in both stages (candidates are listed segment by segment, each
    segment's in descending score with ties by index, so among equal scores list order is index order).
    A ``NaN`` or ``+inf`` score is reported as ``-1`` by the first stage and loses its rank there.
    One row of 131072 scores runs as 16 programs instead of one re-reading its row for every pass.
    """
    n = score.shape[-1]
    if n <= segment:
        return topk_ids(score, k, **kw)
    k = min(k, n)
    lead = score.shape[:-1]
    s = score.reshape(-1, n)
    nseg = triton.cdiv(n, segment)
    if nseg * segment != n:
        s = torch.nn.functional.pad(s, (0, nseg * segment - n), value=float("-inf"))
    seg = s.reshape(-1, nseg, segment)
    local = topk_ids(seg, min(k, segment), **kw)  # [R, S, k'] ids within each segment, -1: not finite
    ok = local >= 0
    val = seg.gather(-1, local.clamp(min=0)).masked_fill(~ok, float("-inf"))
    gid = local + torch.arange(nseg, device=score.device)[:, None] * segment
    pick = topk_ids(val.reshape(s.shape[0], -1), k, **kw)  # positions in the candidate list
    out = gid.reshape(s.shape[0], -1).gather(-1, pick.clamp(min=0))
    return torch.where(pick >= 0, out, -1).view(*lead, k)


def topk_ids_reference(score: torch.Tensor, k: int) -> torch.Tensor:
    """The twin: a stable descending sort (ties: lowest index first, ``-0.0 == +0.0``, NaN largest), the
    first ``min(k, N)`` ids, ``-1`` where the score is not finite."""
    k = min(k, score.shape[-1])
    x = score.float()
    x = torch.where(torch.isnan(x), torch.inf, x)  # NaN sorts with +inf (both become -1 below)
    val, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    val, ids = val[..., :k], ids[..., :k]
    return torch.where(torch.isfinite(val), ids, -1)
