"""Batched Lloyd k-means and nearest-centroid assignment: the learned centroids of ``pariskv-kmeans``
(kvdex/policies/pariskv_kmeans.py). Re-exported by ``kvdex.policies.pariskv``.
"""

from __future__ import annotations

import torch


def kmeans(
    x: torch.Tensor,
    k: int,
    iters: int,
    seed: int,
    valid: torch.Tensor | None = None,
    heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Batched Lloyd k-means: x [..., N, m] -> centroids [..., k, m]; init: k seeded random points.

    ``valid`` [..., N] (bool, any device): only those points are sampled and averaged.
    ``heads`` = (offset, total): x is [B, H, ..., N, m] holding the model's kv heads offset ... offset +
    H - 1 of ``total`` (a tensor-parallel rank's share); every sequence of a head draws the random
    numbers of that head, so a rank (or a sequence in a batch) gets what one process gets alone.
    """
    lead, n, m = x.shape[:-2], x.shape[-2], x.shape[-1]
    xf = x.reshape(-1, n, m)
    w = torch.ones(xf.shape[:2]) if valid is None else valid.reshape(-1, n).float().cpu()
    w = w + (w.sum(-1, keepdim=True) == 0).float()  # a row without valid points: sample uniformly
    g = torch.Generator().manual_seed(seed)
    if heads is None:
        u = torch.rand(*lead, k, generator=g)
    else:  # draws of every head of the model, this process's heads picked, the same for each sequence
        off, total = heads
        u = torch.rand(total, *lead[2:], k, generator=g)[off : off + lead[1]].expand(*lead, k)
    cdf = w.cumsum(-1)  # inverse-CDF sampling with replacement, weighted by w
    init = torch.searchsorted(cdf, u.reshape(-1, k) * cdf[:, -1:], right=True).clamp(max=n - 1).to(x.device)
    c = xf.gather(1, init[..., None].expand(-1, -1, m)).clone()
    wd = w.to(x.device)
    for _ in range(iters):
        a = nearest(xf, c)  # [G, N]
        s = torch.zeros_like(c).scatter_add_(1, a[..., None].expand(-1, -1, m), xf * wd[..., None])
        cnt = torch.zeros(c.shape[:2], device=x.device).scatter_add_(1, a, wd)
        c = torch.where(cnt[..., None] > 0, s / cnt.clamp(min=1)[..., None], c)  # empty cluster: keep
    return c.view(*lead, k, m)


def nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Index of the nearest centroid: x [..., N, m], c [..., K, m] -> int64 [..., N] (chunks of N bound memory)."""
    c2 = (c * c).sum(-1)[..., None, :]
    parts = [(c2 - 2 * x[..., i : i + chunk, :] @ c.transpose(-1, -2)).argmin(-1) for i in range(0, x.shape[-2], chunk)]
    return torch.cat(parts, dim=-1) if parts else x.new_zeros(x.shape[:-1], dtype=torch.long)
