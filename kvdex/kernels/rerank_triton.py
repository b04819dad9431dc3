"""The exact scores of a page policy's candidate tokens in one Triton kernel: the first half of ``rerank``.

With ``rerank=N`` (``quest``, ``prkv``, ``arkvale``, ``chess``; ``kvdex/policies/_rerank.py``) every decode
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
  logit ``scale * q.k``, [B, H, G, N] (the softmax over sink, window and candidates stays in PyTorch);
  ``-inf`` where the token is not live.

Same values as the twin up to the order of the fp32 sums (products of bf16 / fp16 inputs are exact in
fp32). Fixed shapes, no host read: a captured CUDA graph replays it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import candidate_scores as _scores_from_keys
from kvdex.kernels.scoring import slot_scores as _slot_scores


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
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_G, BLOCK_N] fp32
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(live[None, :], s, float("-inf"))
    if MAX:
        s = tl.where(gmask[:, None], s, float("-inf"))
        tl.store(OUT + bh * N + offs_n, tl.max(s, axis=0), mask=nmask)
    else:
        out = OUT + (bh * G + offs_g)[:, None] * N + offs_n[None, :]
        tl.store(out, s * scale, mask=gmask[:, None] & nmask[None, :])


def _check(q, k, pages, window_start, group):
    if group not in ("max", "weight"):
        raise ValueError(f"group must be 'max' or 'weight', got {group!r}")
    if q.dim() != 3 or k.dim() != 4 or pages.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[2]:
        raise ValueError(
            f"expected q [B, Hq, D], k [B, H, S, D] and pages [B, H, C], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(pages.shape)}"
        )
    if pages.shape[:2] != k.shape[:2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"pages {tuple(pages.shape)} and q {tuple(q.shape)} do not match k {tuple(k.shape)}")
    if window_start.shape != (q.shape[0],):
        raise ValueError(f"window_start must be [B], got {tuple(window_start.shape)}")


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
    _check(q, k, pages, window_start, group)
    b, hq, d = q.shape
    h, c = pages.shape[1], pages.shape[2]
    g, n = hq // h, c * page_size
    if k.stride(3) != 1:
        k = k.contiguous()
    if pages.stride(2) != 1:
        pages = pages.contiguous()
    q = q.contiguous()
    shape = (b, h, n) if group == "max" else (b, h, g, n)
    out = torch.empty(shape, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    block_n = 64
    ws = window_start.to(device=q.device, dtype=torch.int64)
    fst = ws if first is None else first.to(device=q.device, dtype=torch.int64)
    _candidate_kernel[(b * h, triton.cdiv(n, block_n))](
        q, k, pages, ws, fst, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), pages.stride(0), pages.stride(1),
        h, n, float(scale),
        SINK=sink, PS=page_size, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, HAS_FIRST=first is not None,
        MAX=group == "max", IEEE=k.dtype == torch.float32,
    )  # fmt: skip
    return out


def slot_scores(q: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, group: str = "max") -> torch.Tensor:
    """Exact ``q.k`` of the keys at ``slots`` [B, H, N] (any int dtype; ``-1``: no key) of the key buffer
    ``k`` [B, H, S, D], for the query heads ``q`` [B, Hq, D] (IceCache's semantic pages: their tokens'
    positions). ``group="max"``: [B, H, N], the kv head's largest; ``"heads"``: [B, H, G, N] per query
    head. fp32, ``-inf`` where the slot is ``-1``."""
    if group not in ("max", "heads"):
        raise ValueError(f"group must be 'max' or 'heads', got {group!r}")
    zero = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    _check(q, k, slots, zero, "max")
    b, hq, d = q.shape
    h, n = slots.shape[1], slots.shape[2]
    g = hq // h
    if k.stride(3) != 1:
        k = k.contiguous()
    if slots.stride(2) != 1:
        slots = slots.contiguous()
    q = q.contiguous()
    out = torch.empty((b, h, n) if group == "max" else (b, h, g, n), dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    block_n = 64
    _candidate_kernel[(b * h, triton.cdiv(n, block_n))](
        q, k, slots, zero, zero, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), slots.stride(0), slots.stride(1),
        h, n, 1.0,
        SINK=0, PS=1, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=block_n, HAS_FIRST=False,
        MAX=group == "max", IEEE=k.dtype == torch.float32, BY_SLOT=True,
    )  # fmt: skip
    return out


def slot_scores_reference(q, k, slots, *, group: str = "max") -> torch.Tensor:
    """The twin: :func:`kvdex.kernels.scoring.slot_scores` (the keys gathered, then the fp32 product)."""
    return _slot_scores(q, k, slots, group)


def candidate_scores_reference(
    q, k, pages, window_start, *, sink: int, page_size: int, scale: float, group: str = "max", first=None
) -> torch.Tensor:
    """The twin: the candidates' keys gathered from ``k`` (as ``LayerStore.page_keys`` does), then
    :func:`kvdex.kernels.scoring.candidate_scores` (the PyTorch path of ``rerank``)."""
    _check(q, k, pages, window_start, group)
    b, h, c = pages.shape
    ar = torch.arange(page_size, device=k.device)
    slot = sink + pages.clamp(min=0).to(k.device)[..., None] * page_size + ar  # [B, H, C, ps]
    keys = k.gather(2, slot.clamp(max=k.shape[2] - 1).view(b, h, -1, 1).expand(-1, -1, -1, k.shape[-1]))
    live = (pages[..., None] >= 0) & (slot < window_start.to(k.device)[:, None, None, None])
    if first is not None:
        live = live & (slot >= first.to(k.device)[:, None, None, None])
    return _scores_from_keys(q, keys, live.flatten(2), group, scale)
