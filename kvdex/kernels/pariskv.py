"""ParisKV retrieval kernels, PyTorch twins (the spec; CPU CI runs these).

The pipeline of one decode step (ParisKV, arXiv 2602.07721, §4), for one (sequence, kv head):

1. ``srht``            -- l2-normalise, then a shared random orthogonal rotation (random signs +
                          fast Walsh-Hadamard transform) of keys and queries;
2. ``centroid_ids``    -- per subspace of ``m`` coordinates, the id of the nearest analytic
                          centroid of ``{+-1/sqrt(m)}^m``: its sign pattern, bit j = coordinate j >= 0;
3. ``encode_keys``     -- per subspace a 4-bit direction code (1 sign bit + 3-bit magnitude index
                          into Lloyd-Max levels of the Beta prior) and the weight ``w = |k| r / alpha``;
4. ``cluster_votes`` / ``collision_votes`` -- the query ranks the ``2**m`` centroids of every
                          subspace; each key collects integer votes from the subspaces where its
                          centroid ranks high (six cumulative tiers, as the authors' kernel);
5. ``bucket_topk``     -- the ``beta * n`` keys with the most votes, by a histogram over the
                          integer scores (no sort);
6. ``rerank_scores``   -- ``<k, q> ~ |q| sum_b w_b <v_b, q~_b>`` from the 4-bit codes;
7. ``gather_rows``     -- fetch the final top-k K/V rows (UVA from pinned host memory on the GPU).

Triton runs 4-5 in ``kernels.pariskv_coarse_triton``, 6-7 in ``kernels.pariskv_rerank_triton``; each equals its twin.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

# Cumulative vote tiers of the coarse stage: a centroid earns one vote per tier whose key quota
# (a share of ``collision_ratio * n`` keys, filled by the query's best centroids first) it falls in.
# The paper says "the top-rho centroids vote"; the authors' released kernel weights them in these
# six tiers (best 5% of the quota: 6 votes ... last 25%: 1 vote), which we follow.
TIERS = (0.05, 0.15, 0.30, 0.50, 0.75, 1.0)
# ``votes="scores"`` (a kvdex option): a centroid's vote is its query score quantised to 0..SCORE_LEVELS.
SCORE_LEVELS = 32
MAG_LEVELS = 8  # 3 magnitude bits
VALID_M = (2, 4, 8)  # subspace sizes: 2**m centroids must fit a uint8 id, m even for nibble packing


# ---- rotation ------------------------------------------------------------------------------------


def padded_dim(d: int) -> int:
    """The Hadamard size for head_dim ``d``: the next power of two (zero padding is an isometry)."""
    return 1 << max(0, (d - 1).bit_length())


def srht_signs(d: int, seed: int) -> torch.Tensor:
    """The random +-1 diagonal of the SRHT for head_dim ``d``: float32 [padded_dim(d)], CPU, seeded."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (padded_dim(d),), generator=g) * 2 - 1).float()


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    h = 1
    y = x
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(*lead, n) / math.sqrt(n)


def srht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., d] -> [..., D] (fp32), D = len(signs) >= d: pad with zeros, flip signs, FWHT.

    ``H diag(signs) [I; 0]`` has orthonormal columns, so norms and inner products are preserved.
    """
    d, D = x.shape[-1], signs.shape[0]
    y = x.float()
    if D > d:
        y = torch.nn.functional.pad(y, (0, D - d))
    return fwht(y * signs.to(y.device))


def normalize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / |x|, |x|) over the last dim, fp32; a zero vector stays zero."""
    n = x.float().norm(dim=-1, keepdim=True)
    return x.float() / n.clamp(min=1e-12), n.squeeze(-1)


# ---- analytic centroids and 4-bit codes -----------------------------------------------------------


def centroid_ids(y: torch.Tensor, m: int) -> torch.Tensor:
    """Nearest analytic centroid per subspace: y [..., B*m] -> uint8 [..., B] (bit j = y_j >= 0).

    For a direction u the centroid ``s / sqrt(m)`` maximising ``<u, s>`` over s in {+-1}^m is
    ``s_j = sign(u_j)`` -- the sign pattern is the id, no distance is computed.
    """
    bits = (y.unflatten(-1, (-1, m)) >= 0).to(torch.int32)
    shifts = 1 << torch.arange(m, device=y.device, dtype=torch.int32)
    return (bits * shifts).sum(-1).to(torch.uint8)


def centroid_codebook(m: int, device=None) -> torch.Tensor:
    """All ``2**m`` analytic centroids, row i = the sign pattern of id i / sqrt(m): [2**m, m] fp32."""
    i = torch.arange(1 << m, device=device)[:, None]
    bits = (i >> torch.arange(m, device=device)[None, :]) & 1
    return (bits.float() * 2 - 1) / math.sqrt(m)


@functools.cache
def _magnitude_levels(m: int, levels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if m < 2:
        raise ValueError(f"subspace size m must be >= 2, got {m}")
    # |u_j| of a uniform direction on S^{m-1}: u_j^2 ~ Beta(1/2, (m-1)/2) (Proposition 4.1), i.e.
    # density of x = |u_j| proportional to (1 - x^2)^((m-3)/2) on [0, 1]. Lloyd-Max (MSE-optimal
    # scalar quantiser) on a fine midpoint grid of that density: deterministic, no sampling.
    n = 200_000
    x = (np.arange(n) + 0.5) / n
    pdf = (1.0 - x * x) ** ((m - 3) / 2.0)
    pdf /= pdf.sum()
    cdf = np.cumsum(pdf)
    edges = np.interp(np.arange(1, levels) / levels, cdf, x)  # start from equal-mass bins
    for _ in range(500):
        bins = np.searchsorted(edges, x)
        mass = np.bincount(bins, weights=pdf, minlength=levels)
        centers = np.bincount(bins, weights=pdf * x, minlength=levels) / np.maximum(mass, 1e-300)
        new = (centers[:-1] + centers[1:]) / 2
        if np.abs(new - edges).max() < 1e-10:
            break
        edges = new
    return tuple(float(e) for e in edges), tuple(float(c) for c in centers)


def magnitude_levels(m: int, levels: int = MAG_LEVELS, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max thresholds [levels-1] and centers [levels] (fp32) for |u_j|, u uniform on S^{m-1}."""
    t, c = _magnitude_levels(m, levels)
    return torch.tensor(t, device=device), torch.tensor(c, device=device)


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit values [..., 2n] -> bytes [..., n]: low nibble = even entry, high = odd entry."""
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: [..., n] -> [..., 2n] uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def decode_codes(codes: torch.Tensor, centers: torch.Tensor, m: int) -> torch.Tensor:
    """4-bit codes [..., B*m/2] -> quantised directions v [..., B, m] fp32 (sign * center[magnitude])."""
    nib = unpack_nibbles(codes).long()
    v = centers.to(codes.device)[nib & 7] * torch.where(nib >= 8, 1.0, -1.0)
    return v.unflatten(-1, (-1, m))


def encode_keys(
    k: torch.Tensor, signs: torch.Tensor, m: int, thresholds: torch.Tensor, centers: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-key summary ParisKV keeps on the device. k [..., N, d] ->

    * ids    uint8 [..., N, B]      nearest analytic centroid per subspace (for voting);
    * codes  uint8 [..., N, B*m/2]  4-bit direction code per coordinate (1 sign + 3 magnitude bits);
    * weight bf16  [..., N, B]      ``|k| * r_b / alpha_b``, with ``r_b`` the subspace radius of the
                                     rotated unit key and ``alpha_b = <v_b, u_b>`` the alignment of the
                                     quantised direction with the true one (RaBitQ's correction).
    """
    kh, knorm = normalize(k)
    y = srht(kh, signs)  # [..., N, D], unit norm
    ids = centroid_ids(y, m)
    blocks = y.unflatten(-1, (-1, m))  # [..., N, B, m]
    r = blocks.norm(dim=-1)
    u = blocks / r[..., None].clamp(min=1e-12)
    mag = torch.bucketize(u.abs(), thresholds.to(u.device)).clamp(max=len(centers) - 1)
    nib = (mag | ((u >= 0).long() << 3)).to(torch.uint8)
    codes = pack_nibbles(nib.flatten(-2))
    alpha = (centers.to(u.device)[mag] * u.abs()).sum(-1).clamp(min=1e-6)  # <v_b, u_b>
    weight = (knorm[..., None] * r / alpha).to(torch.bfloat16)
    return ids, codes, weight


def encode_query(q: torch.Tensor, signs: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., d] -> (rotated unit query split in subspaces [..., B, m] fp32, |q| [...])."""
    qh, qn = normalize(q)
    return srht(qh, signs).unflatten(-1, (-1, m)), qn


def srht_matrix(d: int, signs: torch.Tensor) -> torch.Tensor:
    """The SRHT of head_dim ``d`` as a matrix: fp64 [d, D] with ``x @ M == srht(x, signs)`` (zero padding,
    signs and the orthonormal Hadamard folded into one product)."""
    eye = torch.nn.functional.pad(torch.eye(d, dtype=torch.float64, device=signs.device), (0, signs.shape[0] - d))
    return fwht(eye * signs.double())


def encode_query_matrix(q: torch.Tensor, rot: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_query` in one fp64 matrix product (``rot = srht_matrix(d, signs)``) instead of the
    log2(D) butterfly stages: ~7 kernels per decode step and layer instead of ~40 (launch-bound on the GPU).
    Rotating first and normalising after is the same map (the rotation is orthogonal); fp64 keeps it
    exact to fp32 rounding whatever TF32 setting a caller chose for fp32 matmuls."""
    y = q.double() @ rot
    n = y.norm(dim=-1)
    return (y / n.clamp(min=1e-12)[..., None]).float().unflatten(-1, (-1, m)), n.float()


# ---- coarse stage: collision voting ----------------------------------------------------------------


def tier_quotas(n_keys: torch.Tensor, collision_ratio: float | torch.Tensor) -> torch.Tensor:
    """Key quota of each vote tier: n_keys [R], rho (scalar or [R]) -> int64 [R, len(TIERS)] = ceil(n rho tier)."""
    t = torch.tensor(TIERS, dtype=torch.float64, device=n_keys.device)
    rho = torch.as_tensor(collision_ratio, dtype=torch.float64, device=n_keys.device).reshape(-1, 1)
    return torch.ceil(n_keys.double()[:, None] * rho * t).long()


def cluster_votes(scores: torch.Tensor, counts: torch.Tensor, quotas: torch.Tensor) -> torch.Tensor:
    """Votes each centroid gives its keys: scores/counts [R, B, K], quotas [R, T] -> int32 [R, B, K].

    Per subspace the centroids are taken best-score first; centroid c gets one vote per tier whose
    quota is not yet filled by the keys of the centroids ranked before it (cumulative key counts),
    so the best centroids give ``T`` votes and centroids past the last quota give none.
    """
    order = scores.argsort(dim=-1, descending=True, stable=True)
    before = counts.gather(-1, order).cumsum(-1) - counts.gather(-1, order)  # keys ranked ahead
    tiers = (before[..., None] < quotas[:, None, None, :]).sum(-1).to(torch.int32)  # [R, B, K] by rank
    return torch.empty_like(tiers).scatter_(-1, order, tiers)


def score_votes(scores: torch.Tensor, levels: int = SCORE_LEVELS) -> torch.Tensor:
    """Vote table of ``votes="scores"``: scores [R, G, B, K] (a row's G query heads) -> int32 [R, G, B, K].

    Every centroid's score is quantised on one scale per row, ``round((s + M) * levels / 2M)`` with
    ``M = max |s|`` over the row's heads, subspaces and centroids, so votes lie in ``0..levels`` and a
    key's summed vote is an affine function of its summed score (up to rounding): comparable between
    the heads of a row, unlike tier votes, which only say how a centroid ranks in its own subspace.
    """
    m = scores.abs().amax(dim=(1, 2, 3), keepdim=True).clamp(min=1e-30)
    return torch.round((scores + m) * (levels / (2 * m))).to(torch.int32)


def collision_votes(
    ids: torch.Tensor, votes: torch.Tensor, live: torch.Tensor | None = None, max_score: int | None = None
) -> torch.Tensor:
    """Integer score of every key: ids uint8 [R, N, B], votes int32 [R, B, K] -> int32 [R, N].

    score[n] = sum_b votes[b, ids[n, b]] (the paper's collision count, tier-weighted). ``live`` [R]
    (optional): slots n >= live[r] score -1 (past the row's middle: never selected). ``votes`` may be
    [R, G, B, K], one table per query head of the row's group: then a key scores its best head's sum.
    ``max_score`` bounds a key's sum; the Triton kernel packs the heads' tables by it (unused here).
    """
    r, n, b = ids.shape
    k = votes.shape[-1]
    ix = ids.long() + torch.arange(b, device=ids.device) * k  # [R, N, B]
    if votes.dim() == 4:
        g = votes.shape[1]
        per = votes.flatten(2).gather(2, ix.flatten(1)[:, None].expand(r, g, n * b)).view(r, g, n, b)
        score = per.sum(-1, dtype=torch.int32).amax(1)
    else:
        score = votes.flatten(1).gather(1, ix.flatten(1)).view(r, n, b).sum(-1, dtype=torch.int32)
    if live is None:
        return score
    return torch.where(torch.arange(n, device=ids.device)[None, :] < live[:, None], score, -1)


def cluster_counts(ids: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Keys per centroid: ids uint8 [R, N, B], valid bool [R, N] -> int32 [R, B, K]."""
    r, n, b = ids.shape
    out = torch.zeros(r, b, k, dtype=torch.int32, device=ids.device)
    src = valid[:, :, None].expand(r, n, b).to(torch.int32)
    return out.scatter_add_(2, ids.long().transpose(1, 2), src.transpose(1, 2))


# ---- bucket top-k on integer scores -------------------------------------------------------------------


def score_histogram(scores: torch.Tensor, max_score: int) -> torch.Tensor:
    """Keys per score value: scores int [R, N] (negative = invalid) -> int64 [R, max_score + 1]."""
    hist = torch.zeros(scores.shape[0], max_score + 1, dtype=torch.int64, device=scores.device)
    return hist.scatter_add_(1, scores.clamp(min=0).long(), (scores >= 0).long())


def threshold_from_hist(hist: torch.Tensor, k: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The threshold step of :func:`bucket_topk`: hist [R, S], k (int or [R]) -> (threshold [R], ties to take [R]).

    Keys with ``score > threshold`` are all taken; ``take`` of the keys at ``score == threshold``
    complete the k (fewer when a row has fewer than k valid keys).
    """
    above = hist.flip(-1).cumsum(-1).flip(-1)  # above[v] = #keys with score >= v
    kk = k if isinstance(k, int) else k.reshape(-1, 1)
    thr = ((above >= kk).sum(-1) - 1).clamp(min=0)  # highest v with at least k keys >= v
    strictly = torch.cat([above, above.new_zeros(hist.shape[0], 1)], 1).gather(1, (thr + 1)[:, None])[:, 0]
    at = hist.gather(1, thr[:, None])[:, 0]
    take = (k - strictly).clamp(min=0).minimum(at)
    return thr, take


def bucket_topk(scores: torch.Tensor, k: int, max_score: int, row_k: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k highest integer scores per row, without a sort: scores int [R, N] -> int64 [R, k].

    A histogram over the score values finds the threshold; every key above it and the first
    (lowest-index) keys at it are taken. Output is in ascending index order, ``-1`` padded when a
    row has fewer than k valid (>= 0) scores. Ties are broken by index, so the result is
    deterministic and the Triton kernel reproduces it exactly. ``row_k`` [R] (<= k): take only
    that many in row r (a ragged batch: each sequence its own candidate count).
    """
    r, n = scores.shape
    k = min(k, n)
    rk = k if row_k is None else row_k.to(scores.device).long().clamp(max=k)
    thr, take = threshold_from_hist(score_histogram(scores, max_score), rk)
    gt = scores > thr[:, None]
    eq = (scores == thr[:, None]) & (scores >= 0)
    eq_rank = eq.long().cumsum(1) - 1
    sel = gt | (eq & (eq_rank < take[:, None]))
    pos = torch.where(sel, sel.long().cumsum(1) - 1, k)  # unselected -> spare column k
    out = torch.full((r, k + 1), -1, dtype=torch.long, device=scores.device)
    out.scatter_(1, pos, torch.arange(n, device=scores.device).expand(r, n))
    return out[:, :k]


# ---- fine stage: 4-bit rerank ---------------------------------------------------------------------------


def rerank_scores(
    cand: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    qb: torch.Tensor,
    qnorm: torch.Tensor,
    centers: torch.Tensor,
    m: int,
) -> torch.Tensor:
    """Estimated <k, q> of candidates: cand [R, C] (-1: none), codes [R, N, B*m/2], weight [R, N, B],
    qb [R, B, m], qnorm [R] -> fp32 [R, C] (``-inf`` for -1).

    ``<k, q> = |k||q| sum_b r_b <u_b, q~_b>`` and ``<u_b, q~_b> ~ <v_b, q~_b> / alpha_b``, so the
    estimate is ``|q| sum_b w_b <v_b, q~_b>``. With qb [R, G, B, m] and qnorm [R, G] (G query heads
    sharing the row's keys and candidates) -> [R, G, C].
    """
    ok = cand >= 0
    c = cand.clamp(min=0)
    cc = codes.gather(1, c[..., None].expand(-1, -1, codes.shape[-1]))
    cw = weight.gather(1, c[..., None].expand(-1, -1, weight.shape[-1])).float()
    v = decode_codes(cc, centers, m)  # [R, C, B, m]
    if qb.dim() == 4:  # per head: [R, G, C]
        per_sub = (v[:, None] * qb[:, :, None]).sum(-1)  # [R, G, C, B]
        est = (per_sub * cw[:, None]).sum(-1) * qnorm[..., None]
        return est.masked_fill(~ok[:, None], float("-inf"))
    per_sub = (v * qb[:, None]).sum(-1)  # [R, C, B]
    est = (per_sub * cw).sum(-1) * qnorm[:, None]
    return est.masked_fill(~ok, float("-inf"))


def combine_heads(est: torch.Tensor, scale: float) -> torch.Tensor:
    """One score per candidate from the estimates of a row's G query heads: est [R, G, C] -> [R, C].

    ``sum_g exp(scale * (est_g - max_c est_g))``: each head's attention weights over the candidates,
    relative to its own best candidate, summed over the group (the oracle sums the heads' softmax
    weights; a head that looks at one token gives it ~1 whatever the other heads do). Only a max, an
    exp and a G-term sum in a fixed order: a candidate's score does not depend on the pool's width
    (static and dynamic sizing select the same tokens). ``-inf`` where every estimate is ``-inf``.
    """
    top = est.amax(-1, keepdim=True).clamp(min=torch.finfo(est.dtype).min)  # an empty row: no -inf - -inf
    w = torch.exp((est - top) * scale)  # [R, G, C], 0 for no candidate
    out = w[:, 0]
    for g in range(1, est.shape[1]):
        out = out + w[:, g]
    return out.masked_fill(~(est > float("-inf")).any(1), float("-inf"))


def rerank_combined(
    cand: torch.Tensor,
    codes: torch.Tensor,
    weight: torch.Tensor,
    qb: torch.Tensor,
    qnorm: torch.Tensor,
    centers: torch.Tensor,
    m: int,
    scale: float,
) -> torch.Tensor:
    """One score per candidate of a row's G query heads: :func:`combine_heads` of :func:`rerank_scores`;
    qb [R, G, B, m], qnorm [R, G] -> [R, C]."""
    return combine_heads(rerank_scores(cand, codes, weight, qb, qnorm, centers, m), scale)


# ---- fetch ------------------------------------------------------------------------------------------------


def gather_rows(pages: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """K/V rows of the middle: pages [B, H, P, 2, ps, D] (HostPages layout), rel [B, H, T] middle
    offsets (position - sink, >= 0) -> [B, H, T, 2, D] on ``rel``'s device."""
    b, h, p, _, ps, d = pages.shape
    t = rel.shape[-1]
    r = rel.to(pages.device).long()
    ix = (
        (torch.arange(b, device=r.device)[:, None, None] * h + torch.arange(h, device=r.device)[None, :, None]) * p
        + r // ps
    ) * 2 * ps + r % ps  # row of K in [B*H*P*2*ps, D]
    src = pages.reshape(-1, d)
    k = src.index_select(0, ix.flatten())
    v = src.index_select(0, (ix + ps).flatten())
    return torch.stack((k, v), dim=1).view(b, h, t, 2, d).to(rel.device)
