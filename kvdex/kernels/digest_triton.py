"""ArkVale's digests in Triton (``arkvale``, and ``prkv``'s dynamic pages): scoring them, and computing them.

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

:func:`summarize` computes the digests of full pages (twin: ``kvdex.kernels.scoring.digest_summary``), one
program per few pages: the keys read once in their dtype, the box's centre, each key's distance and the
radius in fp32 registers. The twin converts every key to fp32 and runs about ten kernels over the copies;
PRKV recomputes the digests of every middle page at each refresh of its static set (about 1 ms a layer
at 128k in PyTorch: ``scripts/profile_step.py --policies prkv:refresh=1`` on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvdex.kernels.scoring import digest_page_scores

RADII = {"max": 0, "center": 1, "mean": 2}
PAGES_PER_PROGRAM, SUMMARY_WARPS = 4, 1  # per program of _summary_kernel: the fastest of a sweep of both


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


@triton.jit
def _radius(dist, live, RADIUS: tl.constexpr, PS: tl.constexpr):
    """The radius over axis 0 of the distances ``dist`` (``live``: real keys): max (0), center (1) or mean (2)."""
    top = tl.max(tl.where(live, dist, float("-inf")), axis=0)
    if RADIUS == 0:
        r = top
    elif RADIUS == 1:
        r = (top + tl.min(tl.where(live, dist, float("inf")), axis=0)) / 2
    else:
        r = tl.sum(tl.where(live, dist, 0.0), axis=0) / PS
    return r


@triton.jit
def _summary_kernel(
    K,
    C,
    R,
    N,
    P,
    stride_ko,
    stride_kp,
    PS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPHERE: tl.constexpr,
    RADIUS: tl.constexpr,
    PAGES: tl.constexpr,
):
    """Pages [PAGES * pid, + PAGES) of the N = O x P pages of K [O, P, PS, D] (each page's [PS, D] contiguous) ->
    centre C [N, D], radius R [N, D or 1]."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < PS
    dmask = offs_d < D
    mask = smask[:, None] & dmask[None, :]
    for i in tl.static_range(PAGES):
        page = tl.program_id(0) * PAGES + i
        if page < N:
            base = (page // P).to(tl.int64) * stride_ko + (page % P).to(tl.int64) * stride_kp
            k = tl.load(K + base + offs_s[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            lo = tl.min(tl.where(mask, k, float("inf")), axis=0)
            hi = tl.max(tl.where(mask, k, float("-inf")), axis=0)
            c = (lo + hi) / 2
            diff = tl.where(mask, k - c[None, :], 0.0)
            if SPHERE:
                r = _radius(tl.sqrt(tl.sum(diff * diff, axis=1)), smask, RADIUS, PS)  # over the keys' distances
                tl.store(R + page, r)
            else:
                r = _radius(tl.abs(diff), mask, RADIUS, PS)  # per dimension
                tl.store(R + page.to(tl.int64) * D + offs_d, r, mask=dmask)
            tl.store(C + page.to(tl.int64) * D + offs_d, c, mask=dmask)


def summarize(keys: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The digests of full pages, keys [..., ps, D] -> (centre [..., D], radius [..., D] (cuboid) or [..., 1]
    (sphere)), fp32, for ``kind`` "<cuboid|sphere>-<max|center|mean>" (the twin's values up to the order of the
    fp32 sums of ``mean`` and of a sphere's distances)."""
    shape, radius = kind.split("-")
    if shape not in ("cuboid", "sphere") or radius not in RADII or keys.dim() < 2:
        raise ValueError(f"expected keys [..., ps, D] and a digest <cuboid|sphere>-<max|center|mean>, got {kind!r}")
    lead, (ps, d) = keys.shape[:-2], keys.shape[-2:]
    sphere = shape == "sphere"
    if keys.numel() == 0:
        none = keys.new_empty(*lead, d, dtype=torch.float32)
        return none, keys.new_empty(*lead, 1 if sphere else d, dtype=torch.float32)
    k = keys.reshape(-1, *keys.shape[-3:]) if keys.dim() > 3 else keys.reshape(1, -1, ps, d)  # [O, P, ps, D]
    if k.stride(3) != 1 or k.stride(2) != d:  # each page's keys contiguous (a slice of a store's buffer is)
        k = k.contiguous()
    n = k.shape[0] * k.shape[1]
    c = torch.empty(n, d, dtype=torch.float32, device=keys.device)
    r = torch.empty(n, 1 if sphere else d, dtype=torch.float32, device=keys.device)
    _summary_kernel[(triton.cdiv(n, PAGES_PER_PROGRAM),)](
        k, c, r, n, k.shape[1], k.stride(0), k.stride(1), PS=ps, BLOCK_S=max(16, triton.next_power_of_2(ps)), D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), SPHERE=sphere, RADIUS=RADII[radius], PAGES=PAGES_PER_PROGRAM,
        num_warps=SUMMARY_WARPS,
    )  # fmt: skip
    return c.reshape(*lead, d), r.reshape(*lead, r.shape[-1])
