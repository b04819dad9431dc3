"""Quest's page scoring in one Triton kernel: upper bounds of q.k per page, reduced over the GQA group.

The twin (:func:`page_scores_reference`, ``kvdex.kernels.scoring.quest_page_scores``) is the PyTorch
path of ``kvdex.policies.quest``: ``mask_pages(group_reduce(page_bounds(q, kmin, kmax), H, "max"), num_pages)``.
That path converts the whole min/max index to fp32 and materialises per-query-head bounds every step; at 128k tokens
(8k pages x 8 kv heads x 128 channels per layer) those copies cost more than the attention.
This kernel reads the index in its stored dtype once and writes only the [B, H, P] scores.

Per (sequence, kv head, tile of pages): ``ub[g, p] = sum_d max(q_gd * kmin_pd, q_gd * kmax_pd)``
(Quest's bound as the paper writes it, in fp32) for each of the G query heads of the group, then
the max over g; pages at or past ``num_pages[b]`` get -inf. Elementwise, no matrix unit: the
kernel is bound by reading the index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import quest_page_scores


@triton.jit
def _quest_kernel(
    Q,
    KMIN,
    KMAX,
    NPAGES,
    OUT,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kp,
    H,
    P,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FROM_LENGTHS: tl.constexpr = False,  # NPAGES holds token lengths: derive the middle page count
    SINK: tl.constexpr = 0,
    PS: tl.constexpr = 16,
    WP: tl.constexpr = 1,
    FILL=None,  # (FROM_FILL) [B, H, >= P] int: pages holding no key get -inf (semantic pages), NPAGES unread
    stride_fb=0,
    stride_fh=0,
    FROM_FILL: tl.constexpr = False,
):
    bh = tl.program_id(0)
    pb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    dmask = offs_d < D
    pmask = offs_p < P
    kp = (b * stride_kb + h * stride_kh) + offs_p[:, None] * stride_kp + offs_d[None, :]
    km = pmask[:, None] & dmask[None, :]
    kmax = tl.load(KMAX + kp, mask=km, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    kmin = tl.load(KMIN + kp, mask=km, other=0.0).to(tl.float32)
    score = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(G):  # Quest's bound per query head of the group, then the max
        qg = tl.load(Q + b * stride_qb + (h * G + g) * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        ub = tl.sum(tl.maximum(qg[None, :] * kmin, qg[None, :] * kmax), axis=1)
        score = tl.maximum(score, ub)
    if FROM_FILL:
        live = tl.load(FILL + b * stride_fb + h * stride_fh + offs_p, mask=pmask, other=0) > 0
    else:
        n = tl.load(NPAGES + b)
        if FROM_LENGTHS:  # Grid.num_middle_pages
            n = tl.maximum((tl.maximum(n - SINK, 0) + PS - 1) // PS - WP, 0)
        live = offs_p < n
    score = tl.where(live, score, float("-inf"))
    tl.store(OUT + bh * P + offs_p, score, mask=pmask)


def page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    num_pages: torch.Tensor | None = None,
    *,
    lengths: torch.Tensor | None = None,
    grid=None,
    fill: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; kmin/kmax [B, H, P, D] (any float dtype, last dim contiguous); num_pages [B]
    -> [B, H, P] fp32: per kv head the max over its query heads of Quest's bound, -inf past the middle.

    Instead of ``num_pages``, ``lengths`` [B] (tokens) and the store's ``grid`` (a
    ``kvdex.storage.Grid``) let the kernel compute ``grid.num_middle_pages(lengths)`` itself; or ``fill``
    [B, H, >= P] (integers, last dim contiguous: IceCache's semantic pages) gives -inf to the pages whose
    fill is 0."""
    if sum(x is not None for x in (num_pages, lengths, fill)) != 1 or (lengths is not None and grid is None):
        raise ValueError("pass one of num_pages, lengths and grid, or fill")
    b, hq, d = q.shape
    if kmin.dim() != 4 or kmin.shape != kmax.shape or kmin.shape[0] != b or kmin.shape[3] != d:
        raise ValueError(f"expected q [B, Hq, D] and kmin/kmax [B, H, P, D], got {tuple(q.shape)}, {tuple(kmin.shape)}")
    h, p = kmin.shape[1], kmin.shape[2]
    if hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({h})")
    if kmin.stride() != kmax.stride() or kmin.stride(3) != 1:
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    q = q.contiguous()
    out = torch.empty(b, h, p, dtype=torch.float32, device=q.device)
    if p == 0:
        return out
    g = hq // h
    block_p = 64  # with 8 warps: the fastest of a sweep of tiles and warps (H200, 128k, 8 kv heads, bf16)
    if fill is not None:
        if fill.shape[:2] != (b, h) or fill.dim() != 3 or fill.shape[2] < p or fill.stride(2) != 1:
            raise ValueError(f"fill must be [B, H, >= P] = [{b}, {h}, >= {p}] with a unit last stride, got "
                             f"{tuple(fill.shape)} strides {fill.stride()}")  # fmt: skip
        n = fill
        extra = dict(FILL=fill, stride_fb=fill.stride(0), stride_fh=fill.stride(1), FROM_FILL=True)
    else:
        n = (num_pages if lengths is None else lengths).to(q.device)
        extra = {}
        if lengths is not None:
            extra = dict(FROM_LENGTHS=True, SINK=grid.sink, PS=grid.page_size, WP=grid.window_pages)
    _quest_kernel[(b * h, triton.cdiv(p, block_p))](
        q, kmin, kmax, n, out, q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), h, p,
        G=g, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_P=block_p, num_warps=8, **extra,
    )  # fmt: skip
    return out


def page_scores_reference(q, kmin, kmax, num_pages):
    """The twin: the PyTorch path of the quest policy."""
    return quest_page_scores(q, kmin, kmax, num_pages)
