"""ArkVale's digest scoring in one Triton kernel (``arkvale``, and ``prkv``'s dynamic pages).

The twin (:func:`page_scores_reference`, ``kvdex.kernels.scoring.digest_page_scores``) is the PyTorch path
of those policies: the estimate of every page per query head (``digest_scores``: two matrix products and
an add), pages past each middle (and, for PRKV, before its first dynamic candidate) set to ``-inf``, the
max over the GQA group -- about fifteen kernels per layer and step, with [B, Hq, P] fp32 intermediates.
This kernel reads the digests once and writes only the [B, H, P] scores, as ``quest_triton`` does for
Quest's bounds.

Per (sequence, kv head, tile of pages), for each of the G query heads of the group: cuboid
``sum_d q_d c_d + |q_d| r_d``, sphere ``sum_d q_d c_d + |q| r``, in fp32; then the max over g; pages at
or past the middle's page count (derived from the token lengths, ``Grid.num_middle_pages``) or before
``first[b]`` get -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import digest_page_scores


@triton.jit
def _digest_kernel(
    Q,
    C,
    R,
    LENGTHS,
    FIRST,
    OUT,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_rb,
    stride_rh,
    stride_rp,
    H,
    P,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SPHERE: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    SINK: tl.constexpr,
    PS: tl.constexpr,
    WP: tl.constexpr,
):
    bh = tl.program_id(0)
    pb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    dmask = offs_d < D
    pmask = offs_p < P
    tile = pmask[:, None] & dmask[None, :]
    c = tl.load(C + b * stride_cb + h * stride_ch + offs_p[:, None] * stride_cp + offs_d[None, :], mask=tile, other=0.0)
    c = c.to(tl.float32)  # [BLOCK_P, BLOCK_D]
    rp = R + b * stride_rb + h * stride_rh + offs_p * stride_rp
    if SPHERE:
        r = tl.load(rp, mask=pmask, other=0.0).to(tl.float32)  # [BLOCK_P]
    else:
        r = tl.load(rp[:, None] + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
    score = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(Q + b * stride_qb + (h * G + g) * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        if SPHERE:
            s = tl.sum(qg[None, :] * c, axis=1) + tl.sqrt(tl.sum(qg * qg, axis=0)) * r
        else:
            s = tl.sum(qg[None, :] * c + tl.abs(qg)[None, :] * r, axis=1)
        score = tl.maximum(score, s)
    n = tl.load(LENGTHS + b)
    n = tl.maximum((tl.maximum(n - SINK, 0) + PS - 1) // PS - WP, 0)  # Grid.num_middle_pages
    live = offs_p < n
    if HAS_FIRST:
        live = live & (offs_p >= tl.load(FIRST + b))
    tl.store(OUT + bh * P + offs_p, tl.where(live, score, float("-inf")), mask=pmask)


def page_scores(
    q: torch.Tensor,
    centre: torch.Tensor,
    radius: torch.Tensor,
    lengths: torch.Tensor,
    grid,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; centre [B, H, P, D], radius [B, H, P, D] (cuboid) or [B, H, P, 1] (sphere), last dim
    contiguous; lengths [B] (tokens) and the store's ``grid`` (a ``kvdex.storage.Grid``); ``first`` [B]
    (optional): the first candidate page -> [B, H, P] fp32: per kv head the max over its query heads of
    the digest estimate, -inf outside ``first <= p < grid.num_middle_pages(lengths)``."""
    b, hq, d = q.shape
    if centre.dim() != 4 or centre.shape[0] != b or centre.shape[3] != d or radius.shape[:3] != centre.shape[:3]:
        raise ValueError(f"expected q [B, Hq, D] and centre [B, H, P, D], got {tuple(q.shape)}, {tuple(centre.shape)}")
    h, p = centre.shape[1], centre.shape[2]
    if hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({h})")
    sphere = radius.shape[3] == 1
    if not sphere and radius.shape[3] != d:
        raise ValueError(f"radius must be [B, H, P, {d}] (cuboid) or [B, H, P, 1] (sphere), got {tuple(radius.shape)}")
    if centre.stride(3) != 1:
        centre = centre.contiguous()
    if radius.stride(3) != 1 and not sphere:
        radius = radius.contiguous()
    q = q.contiguous()
    out = torch.empty(b, h, p, dtype=torch.float32, device=q.device)
    if p == 0:
        return out
    block_p = 16  # with 8 warps: the fastest of a sweep of tiles and warps (H200, 128k, 8 kv heads, fp32 cuboids)
    lengths = lengths.to(q.device)
    _digest_kernel[(b * h, triton.cdiv(p, block_p))](
        q, centre, radius, lengths, lengths if first is None else first.to(q.device), out,
        q.stride(0), q.stride(1), centre.stride(0), centre.stride(1), centre.stride(2),
        radius.stride(0), radius.stride(1), radius.stride(2), h, p,
        G=hq // h, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_P=block_p, SPHERE=sphere,
        HAS_FIRST=first is not None, SINK=grid.sink, PS=grid.page_size, WP=grid.window_pages, num_warps=8,
    )  # fmt: skip
    return out


def page_scores_reference(q, centre, radius, lengths, grid, first=None):
    """The twin: the PyTorch path of the arkvale / prkv policies."""
    return digest_page_scores(q, centre, radius, grid.num_middle_pages(lengths), first)
