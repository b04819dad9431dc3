"""The exact scores of a page policy's candidate tokens in one Triton kernel: the first half of ``rerank``.

With ``rerank=N`` (``quest``, ``prkv``, ``arkvale``, ``chess``; ``kvdex/policies/rerank.py``) every decode
step ranks the tokens of ``N x`` the budget's pages by their exact ``q.k``. The PyTorch twin
(:func:`candidate_scores_reference`) gathers the candidates' keys out of the store into a new tensor
(``LayerStore.page_keys``), converts them to fp32 and multiplies: at the Llama-3.1-8B shape (128k, budget
2048, ``rerank=4``) that is 8192 keys per kv head and layer written twice and read twice, about 3.5 ms of
a 20.6 ms step on an H200 (``docs/policies/quest.md``). This kernel reads each candidate key once, in
place in the GPU-resident buffer, and writes only the scores:

* per (sequence, kv head, tile of ``BLOCK_N`` candidate tokens): the slot of each token from its page id
  (``sink + page * page_size + offset``), the keys of the live slots (a page id ``>= 0``, below the
  sequence's window, at or past ``first`` when given), the group's ``G`` query heads, one ``tl.dot``
  (fp32 accumulation; fp32 inputs in IEEE precision, not TF32);
* ``group="max"``: the largest ``q.k`` over the group, [B, H, N]; ``group="weight"``: every head's scaled
  logit ``scale * q.k``, [B, H, G, N]; ``-inf`` where the token is not live.

:func:`candidate_weights` (and :func:`slot_weights`, the same for candidates given by their slots: IceCache's
semantic pages) is ``rerank_group="weight"`` whole: the same kernel also writes each tile's
softmax statistics (max and sum of exponentials per query head), and a second kernel scores the sink and
window keys, combines everything into each head's log-sum-exp and writes the group-summed weights
[B, H, N]. Before, the softmax over sink, window and candidates ran in PyTorch (the sink and window
gathered, a concatenation, a log-sum-exp, an exponential and a sum over [B, H, G, N]): at the 8B shape
(128k, budget 2048, ``prkv:rerank=4:rerank_group=weight:rerank_share=0.25``, 32768 candidates per kv head)
the eager step's device time fell from 18.9 to 16.0 ms (H200, per-kernel profile).

Same values as the twin up to the order of the fp32 sums (bf16 / fp16 products are exact in fp32); fixed
shapes, no host read: a captured CUDA graph replays it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import candidate_scores as _scores_from_keys
from kvdex.kernels.scoring import slot_scores as _slot_scores


@triton.jit
def _dot_qk(q, k, IEEE: tl.constexpr):
    """q [BLOCK_G, BLOCK_D] . k [BLOCK_N, BLOCK_D]^T -> [BLOCK_G, BLOCK_N] fp32 (fp32 inputs: IEEE, not TF32)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _candidate_kernel(
    Q,
    K,
    PAGES,
    WSTART,
    FIRST,
    OUT,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_pb,
    stride_ph,
    H,
    N,
    scale,
    SINK: tl.constexpr,
    PS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    MAX: tl.constexpr,
    IEEE: tl.constexpr,
    BY_SLOT: tl.constexpr = False,  # PAGES holds each candidate token's slot (-1: none), not page ids
    PMAX=None,  # per-head logits only: each tile's max [B, H, G, NB] and its sum of exp(logit - max) in PSUM
    PSUM=None,
    NB=1,
    PART: tl.constexpr = False,
):
    bh = tl.program_id(0)
    nb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    if BY_SLOT:
        slot = tl.load(PAGES + b * stride_pb + h * stride_ph + offs_n, mask=nmask, other=-1).to(tl.int64)
        live = nmask & (slot >= 0)
    else:
        page = tl.load(PAGES + b * stride_pb + h * stride_ph + offs_n // PS, mask=nmask, other=-1)
        slot = SINK + page * PS + offs_n % PS
        live = nmask & (page >= 0) & (slot < tl.load(WSTART + b))
        if HAS_FIRST:
            live = live & (slot >= tl.load(FIRST + b))
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kp = K + b * stride_kb + h * stride_kh + slot[:, None].to(tl.int64) * stride_ks + offs_d[None, :]
    k = tl.load(kp, mask=live[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    qp = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(qp, mask=gmask[:, None] & dmask[None, :], other=0.0).to(k.dtype)  # [BLOCK_G, BLOCK_D]
    s = tl.where(live[None, :], _dot_qk(q, k, IEEE), float("-inf"))  # [BLOCK_G, BLOCK_N] fp32
    if MAX:
        s = tl.where(gmask[:, None], s, float("-inf"))
        tl.store(OUT + bh * N + offs_n, tl.max(s, axis=0), mask=nmask)
    else:
        s = s * scale
        out = OUT + (bh * G + offs_g)[:, None] * N + offs_n[None, :]
        tl.store(out, s, mask=gmask[:, None] & nmask[None, :])
        if PART:  # the tile's softmax statistics per query head (a tile without a live token: -inf, 0)
            m = tl.max(s, axis=1)
            e = tl.where(live[None, :], tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 0.0)
            part = (bh * G + offs_g) * NB + nb
            tl.store(PMAX + part, m, mask=gmask)
            tl.store(PSUM + part, tl.sum(e, axis=1), mask=gmask)


@triton.jit
def _weight_kernel(
    Q,
    K,
    LOGITS,
    PMAX,
    PSUM,
    WSTART,
    LEN,
    OUT,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    H,
    N,
    NB,
    scale,
    SINK: tl.constexpr,
    WIN: tl.constexpr,
    BLOCK_F: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Per (sequence, kv head, tile of BLOCK_N candidates): each head's log-sum-exp over sink, window (their
    logits here) and the candidates (the tiles' statistics); the tile's group-summed weights (-inf: no logit)."""
    bh = tl.program_id(0)
    nb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_g = tl.arange(0, BLOCK_G)
    gmask = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    # sink + window: slots [0, SINK) and [window start, + WIN), those below the length
    offs_f = tl.arange(0, BLOCK_F)
    slot = tl.where(offs_f < SINK, offs_f, tl.load(WSTART + b) + offs_f - SINK)
    fl = (offs_f < SINK + WIN) & (slot < tl.load(LEN + b))
    kp = K + b * stride_kb + h * stride_kh + slot[:, None].to(tl.int64) * stride_ks + offs_d[None, :]
    kf = tl.load(kp, mask=fl[:, None] & dmask[None, :], other=0.0)  # [BLOCK_F, BLOCK_D]
    qp = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(qp, mask=gmask[:, None] & dmask[None, :], other=0.0).to(kf.dtype)
    sf = tl.where(fl[None, :], _dot_qk(q, kf, IEEE) * scale, float("-inf"))  # [BLOCK_G, BLOCK_F]
    m = tl.max(sf, axis=1)  # finite: the window holds at least the newest token
    acc = tl.sum(tl.exp(sf - m[:, None]), axis=1)
    row = (bh * G + offs_g) * NB
    for start in range(0, NB, BLOCK_NB):  # combine the candidate tiles' statistics
        offs_p = start + tl.arange(0, BLOCK_NB)
        pm_mask = gmask[:, None] & (offs_p < NB)[None, :]
        pm = tl.load(PMAX + row[:, None] + offs_p[None, :], mask=pm_mask, other=float("-inf"))
        ps = tl.load(PSUM + row[:, None] + offs_p[None, :], mask=pm_mask, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=1))
        acc = acc * tl.exp(m - m_new) + tl.sum(ps * tl.exp(pm - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(acc)  # [BLOCK_G]
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    lg = tl.load(LOGITS + (bh * G + offs_g)[:, None] * N + offs_n[None, :], mask=gmask[:, None] & nmask[None, :],
                 other=float("-inf"))  # fmt: skip
    w = tl.sum(tl.exp(lg - lse[:, None]), axis=0)
    live = tl.max(lg, axis=0) > float("-inf")
    tl.store(OUT + bh * N + offs_n, tl.where(live, w, float("-inf")), mask=nmask)


BLOCK_N, WARPS = 64, 4  # candidate tokens per program of the candidate kernel, and its warps


def _check(q, k, idx, group: str, groups: tuple[str, str], window_start=None):
    if group not in groups:
        raise ValueError(f"group must be {groups[0]!r} or {groups[1]!r}, got {group!r}")
    if q.dim() != 3 or k.dim() != 4 or idx.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[2]:
        raise ValueError(
            f"expected q [B, Hq, D], k [B, H, S, D] and pages / slots [B, H, C], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(idx.shape)}"
        )
    if idx.shape[:2] != k.shape[:2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"pages / slots {tuple(idx.shape)} and q {tuple(q.shape)} do not match k {tuple(k.shape)}")
    if window_start is not None and window_start.shape != (q.shape[0],):
        raise ValueError(f"window_start must be [B], got {tuple(window_start.shape)}")


def _launch(q, k, idx, n: int, per_head: bool, scale: float, bounds=None, part=None, **consts) -> torch.Tensor:
    """Run :func:`_candidate_kernel` over ``n`` candidate tokens per (sequence, kv head): ``idx`` [B, H, *]
    holds their page ids (``bounds``: window start and first slot [B], int64) or their slots (``BY_SLOT``)."""
    b, hq, d = q.shape
    h = idx.shape[1]
    g = hq // h
    if k.stride(3) != 1:
        k = k.contiguous()
    if idx.stride(2) != 1:
        idx = idx.contiguous()
    q = q.contiguous()
    out = torch.empty((b, h, g, n) if per_head else (b, h, n), dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    ws, fst = bounds if bounds is not None else (idx, idx)  # BY_SLOT: never read
    pmax, psum = part if part is not None else (None, None)
    _candidate_kernel[(b * h, triton.cdiv(n, BLOCK_N))](
        q, k, idx, ws, fst, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), idx.stride(0), idx.stride(1),
        h, n, float(scale),
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=BLOCK_N, MAX=not per_head, IEEE=k.dtype == torch.float32,
        PMAX=pmax, PSUM=psum, NB=triton.cdiv(n, BLOCK_N), PART=part is not None, num_warps=WARPS, **consts,
    )  # fmt: skip
    return out


def candidate_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    pages: torch.Tensor,
    window_start: torch.Tensor,
    *,
    sink: int,
    page_size: int,
    scale: float,
    group: str = "max",
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact scores of the tokens of the candidate ``pages`` [B, H, C] (middle page ids, ``-1`` padded),
    read in place from the key buffer ``k`` [B, H, S, D] (slot-major; the last dim contiguous) for the
    query heads ``q`` [B, Hq, D]. A token (candidate ``c * page_size + j``, slot
    ``sink + pages[c] * page_size + j``) is live when its page id is ``>= 0``, its slot is below
    ``window_start`` [B] and, if given, at or past ``first`` [B].

    ``group="max"``: [B, H, C * page_size] fp32, the largest ``q.k`` over the kv head's query heads;
    ``"weight"``: [B, H, G, C * page_size] fp32, ``scale * q.k`` per query head. ``-inf`` where not live."""
    _check(q, k, pages, group, ("max", "weight"), window_start)
    ws = window_start.to(device=q.device, dtype=torch.int64)
    fst = ws if first is None else first.to(device=q.device, dtype=torch.int64)
    return _launch(q, k, pages, pages.shape[2] * page_size, group == "weight", scale, (ws, fst),
                   SINK=sink, PS=page_size, HAS_FIRST=first is not None)  # fmt: skip


def candidate_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    pages: torch.Tensor,
    window_start: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    page_size: int,
    scale: float,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``rerank_group="weight"`` score of every token of the candidate ``pages`` [B, H, C] in two
    kernels: [B, H, C * page_size] fp32, the sum over the kv head's query heads of each head's softmax
    weight of the token, normalised over the sink (slots ``[0, sink)``), the window (``[window_start,
    window_start + window)``; both below ``lengths`` [B]) and every live candidate (the rule of
    :func:`candidate_scores`); ``-inf`` where not live. The key buffer is positional (slot == position)."""
    _check(q, k, pages, "weight", ("max", "weight"), window_start)
    ws = window_start.to(device=q.device, dtype=torch.int64)
    fst = ws if first is None else first.to(device=q.device, dtype=torch.int64)
    launch = dict(bounds=(ws, fst), SINK=sink, PS=page_size, HAS_FIRST=first is not None)
    return _group_weights(q, k, pages, pages.shape[2] * page_size, ws, lengths, sink, window, scale, launch)


def slot_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    slots: torch.Tensor,
    window_start: torch.Tensor,
    lengths: torch.Tensor,
    *,
    sink: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    """:func:`candidate_weights` for candidate tokens given by their slots [B, H, N] (any int dtype, ``-1``:
    none; IceCache's semantic pages: positions in a positional key buffer) instead of page ids: [B, H, N]
    fp32, each token's softmax weights summed over the kv head's query heads, normalised over the sink, the
    window and every candidate; ``-inf`` where the slot is ``-1``."""
    _check(q, k, slots, "weight", ("max", "weight"), window_start)
    ws = window_start.to(device=q.device, dtype=torch.int64)
    launch = dict(SINK=0, PS=1, HAS_FIRST=False, BY_SLOT=True)
    return _group_weights(q, k, slots, slots.shape[2], ws, lengths, sink, window, scale, launch)


def _group_weights(q, k, idx, n: int, ws, lengths, sink: int, window: int, scale: float, launch: dict):
    """The candidates' logits with each tile's softmax statistics (``launch``: how ``idx`` names them), then
    the sink and window logits, each head's log-sum-exp and the group-summed weights: no PyTorch pass."""
    q = q.contiguous()
    if k.stride(3) != 1:
        k = k.contiguous()
    b, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    nb = triton.cdiv(n, BLOCK_N)
    pmax = torch.empty(b, h, g, max(nb, 1), dtype=torch.float32, device=q.device)
    part = (pmax, torch.empty_like(pmax))
    logits = _launch(q, k, idx, n, True, scale, part=part, **launch)
    out = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    block_n = 1024
    _weight_kernel[(b * h, triton.cdiv(n, block_n))](
        q, k, logits, part[0], part[1], ws, lengths.to(device=q.device, dtype=torch.int64), out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        h, n, nb, float(scale),
        SINK=sink, WIN=window, BLOCK_F=max(16, triton.next_power_of_2(sink + window)),
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_NB=min(256, max(16, triton.next_power_of_2(nb))), BLOCK_N=block_n, IEEE=k.dtype == torch.float32,
    )  # fmt: skip
    return out


def candidate_weights_reference(
    q, k, pages, window_start, lengths, *, sink: int, window: int, page_size: int, scale: float, first=None
) -> torch.Tensor:
    """The twin: :func:`candidate_scores_reference`'s per-head logits, the sink and window keys gathered
    and scored, one softmax over all of them per query head, summed over the group."""
    logits = candidate_scores_reference(q, k, pages, window_start, sink=sink, page_size=page_size, scale=scale,
                                        group="weight", first=first)  # fmt: skip
    return _group_weights_reference(q, k, logits, window_start, lengths, sink, window, scale)


def slot_weights_reference(q, k, slots, window_start, lengths, *, sink: int, window: int, scale: float):
    """The twin of :func:`slot_weights`: the per-head ``q.k`` of the slots, scaled, then the softmax."""
    logits = _slot_scores(q, k, slots, "heads") * scale
    return _group_weights_reference(q, k, logits, window_start, lengths, sink, window, scale)


def _group_weights_reference(q, k, logits, window_start, lengths, sink: int, window: int, scale: float):
    """The sink and window keys gathered and scored, one softmax over them and the candidates' ``logits``
    [B, H, G, N] per query head, summed over the group; ``-inf`` where no head's logit is finite."""
    b, hq, d = q.shape
    h = k.shape[1]
    dev = k.device
    fixed = torch.cat([torch.arange(sink, device=dev).expand(b, sink),
                       window_start.to(dev)[:, None] + torch.arange(window, device=dev)], dim=1)  # fmt: skip
    valid = fixed < lengths.to(dev)[:, None]
    kf = k.gather(2, torch.where(valid, fixed, 0)[:, None, :, None].expand(b, h, -1, d)).float()
    qg = q.float().view(b, h, hq // h, d)
    sf = torch.einsum("bhgd,bhfd->bhgf", qg, kf) * scale
    sf = sf.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([sf, logits], dim=-1), dim=-1, keepdim=True)
    w = torch.exp(logits - lse).sum(2)
    return w.masked_fill(~torch.isfinite(logits).any(2), float("-inf"))


def slot_scores(q: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, group: str = "max") -> torch.Tensor:
    """Exact ``q.k`` of the keys at ``slots`` [B, H, N] (any int dtype; ``-1``: no key) of the key buffer
    ``k`` [B, H, S, D], for the query heads ``q`` [B, Hq, D] (IceCache's semantic pages: their tokens'
    positions). ``group="max"``: [B, H, N], the kv head's largest; ``"heads"``: [B, H, G, N] per query
    head. fp32, ``-inf`` where the slot is ``-1``."""
    _check(q, k, slots, group, ("max", "heads"))
    return _launch(q, k, slots, slots.shape[2], group == "heads", 1.0,
                   SINK=0, PS=1, HAS_FIRST=False, BY_SLOT=True)  # fmt: skip


def slot_scores_reference(q, k, slots, *, group: str = "max") -> torch.Tensor:
    """The twin: :func:`kvdex.kernels.scoring.slot_scores` (the keys gathered, then the fp32 product)."""
    return _slot_scores(q, k, slots, group)


def candidate_scores_reference(
    q, k, pages, window_start, *, sink: int, page_size: int, scale: float, group: str = "max", first=None
) -> torch.Tensor:
    """The twin: the candidates' keys gathered from ``k`` (as ``LayerStore.page_keys`` does), then
    :func:`kvdex.kernels.scoring.candidate_scores` (the PyTorch path of ``rerank``)."""
    _check(q, k, pages, group, ("max", "weight"), window_start)
    b, h, c = pages.shape
    ar = torch.arange(page_size, device=k.device)
    slot = sink + pages.clamp(min=0).to(k.device)[..., None] * page_size + ar  # [B, H, C, ps]
    keys = k.gather(2, slot.clamp(max=k.shape[2] - 1).view(b, h, -1, 1).expand(-1, -1, -1, k.shape[-1]))
    live = (pages[..., None] >= 0) & (slot < window_start.to(k.device)[:, None, None, None])
    if first is not None:
        live = live & (slot >= first.to(k.device)[:, None, None, None])
    return _scores_from_keys(q, keys, live.flatten(2), group, scale)
