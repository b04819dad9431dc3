"""``pariskv-kmeans``: the drift baseline of the ParisKV paper's ablation ("no normalise+rotate, learned
centroids"), on :class:`~kvdex.policies.pariskv.ParisKVPolicy`: identical except that the centroids of each
subspace are learned by k-means on the prefill keys (raw key space) and then frozen; later keys are
assigned to the nearest of them. Its defaults are the paper's configuration
(``kvdex.policies.pariskv.PAPER_OPTIONS``), the baseline of the paper's ablation; ``pariskv``'s defaults are
kvdex's. Documented in docs/policies/pariskv.md. :func:`kmeans` and :func:`nearest` learn and apply the
centroids (batched Lloyd k-means).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.policies.base import PolicyInfo
from kvdex.policies.pariskv.policy import ParisKVPolicy
from kvdex.policies.registry import register_policy


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


@register_policy
@dataclass
class ParisKVKMeansPolicy(ParisKVPolicy):
    """The ablation/drift baseline: k-means centroids learned on prefill keys, then frozen."""

    name = "pariskv-kmeans"
    kmeans_iters: int = 10
    # the paper's configuration (pariskv.PAPER_OPTIONS), not pariskv's defaults: the ablation's baseline
    candidate_ratio: float | None = None
    pool_factor: float | None = None
    group: Literal["mean", "heads"] = "mean"
    coarse: Literal["tiers", "scores"] = "tiers"

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        if info.head_dim % self.m:
            raise ValueError(f"pariskv-kmeans: head_dim {info.head_dim} is not a multiple of m={self.m}")
        if self.kmeans_iters < 1:
            raise ValueError(f"pariskv-kmeans: kmeans_iters must be >= 1, got {self.kmeans_iters}")
        self.centroids: dict[int, torch.Tensor] = {}  # layer -> [B, H, nsub_raw, 2**m, m]
        self._memo: dict | None = None  # shared by the forks of one prefill (share_index)

    def share_index(self, memo: dict) -> None:
        """Forks of one prefill (``Cache.fork``: one per budget in the scorecard) learn the same centroids
        from the same prompt keys: the first fork's k-means result is kept in ``memo``, keyed by everything
        it depends on (layer, m, iterations, seed, the grid that decides the middle tokens, their shape), and
        read by the others. The centroids are never written after the prefill, so sharing is exact."""
        self._memo = memo

    @property
    def num_sub(self) -> int:  # subspaces of the raw head dim (no rotation, no padding)
        return self.info.head_dim // self.m

    def assign(self, layer, k, ids, valid):
        sub = k.float().unflatten(-1, (-1, self.m)).transpose(2, 3)  # [B, H, nsub, N, m]
        if layer not in self.centroids:  # first update of the layer == the prefill: learn, once
            cfg = self.info.config
            key = ("pariskv-kmeans", layer, self.m, self.kmeans_iters, self.seed, cfg.sink, cfg.window,
                   cfg.page_size, tuple(k.shape), str(k.device))  # fmt: skip
            c = None if self._memo is None else self._memo.get(key)
            if c is None:
                w = valid[:, None, None, :].expand(sub.shape[:-1])  # padding of a ragged batch does not count
                heads = (self.info.head_offset, self.info.all_kv_heads)
                c = kmeans(sub, 1 << self.m, self.kmeans_iters, self.seed, w, heads=heads)
                if self._memo is not None:
                    self._memo[key] = c
            self.centroids[layer] = c
        return nearest(sub, self.centroids[layer]).transpose(2, 3).to(torch.uint8)

    def centroid_scores(self, layer, q, qb):
        qs = q.unflatten(-1, (-1, self.m))  # raw query subspaces [B, H, (G,) nsub, m]
        c = self.centroids[layer]  # [B, H, nsub, 2**m, m]
        return ((c if qs.dim() == 4 else c[:, :, None]) @ qs[..., None])[..., 0]

    def centroid_logits(self, layer, q, qb, qn):
        return self.centroid_scores(layer, q, qb)  # raw query and raw-key centroids: already <q, c>
