"""ParisKV's candidate pool sizes: how many keys the coarse stage (collision votes) keeps per sequence,
the vote quotas of the paper's tiers, and the fixed pool width a captured CUDA graph reads.

:class:`PoolSizes` owns the options that size the pool (``candidate_ratio`` beta, ``collision_ratio`` rho,
``pool_factor``) and the per-row device buffers (:class:`Rows`) that a new middle length rewrites in place.
``None`` ratios follow the authors' adaptive table (:data:`ADAPTIVE_RATIOS`, their released code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdex.kernels import pariskv as K

# (retrieval length below, candidate_ratio beta, collision_ratio rho): the authors' adaptive table.
ADAPTIVE_RATIOS = ((5_000, 0.5, 0.5), (10_000, 0.25, 0.3), (30_000, 0.2, 0.25), (math.inf, 0.1, 0.2))


def adaptive_ratios(n: int) -> tuple[float, float]:
    """(candidate_ratio, collision_ratio) for a retrieval zone of n tokens."""
    for limit, beta, rho in ADAPTIVE_RATIOS:
        if n < limit:
            return beta, rho
    raise AssertionError("unreachable")


@dataclass
class Rows:
    """Per-row sizes of one middle length (R = B * H rows), persistent device buffers that a new middle
    length (a page boundary) rewrites in place, so a captured CUDA graph reads the current sizes."""

    n_seq: torch.Tensor  # [B] middle tokens per sequence
    n_row: torch.Tensor  # [R]
    quotas: torch.Tensor  # [R, len(TIERS)] vote-tier key quotas
    pool: torch.Tensor  # [R] candidates kept by voting
    width: int  # max pool
    lengths: tuple  # the middle lengths these sizes are for (host)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.n_seq, self.n_row, self.quotas, self.pool


class PoolSizes:
    """The pool of a sequence with ``n`` middle tokens and ``k`` tokens to select:
    ``min(n, max(k, ceil(beta n), ceil(pool_factor k)))`` (``pool_factor=None``: the paper, no floor above k)."""

    def __init__(self, candidate_ratio: float | None, collision_ratio: float | None, pool_factor: float | None) -> None:
        self.candidate_ratio, self.collision_ratio, self.pool_factor = candidate_ratio, collision_ratio, pool_factor
        self.rows_of: dict[tuple, Rows] = {}  # (kv heads, k, device) -> the sizes of the last middle lengths

    def ratios(self, n: int) -> tuple[float, float]:
        """(candidate_ratio, collision_ratio) for a sequence with n middle tokens (options or adaptive)."""
        beta, rho = adaptive_ratios(n)
        return self.candidate_ratio or beta, self.collision_ratio or rho

    def pool(self, n: int, k: int) -> int:
        floor = k if self.pool_factor is None else max(k, math.ceil(self.pool_factor * k))
        return min(n, max(floor, math.ceil(self.ratios(n)[0] * n)))

    def pool_sizes(self, nmid: torch.Tensor, k: int) -> list[int]:
        """Candidates kept by voting per sequence (``nmid`` [B] middle tokens)."""
        return [self.pool(int(x), k) for x in nmid]

    def pool_width(self, cap: int, k: int, lo: int = 0) -> int:
        """Static pool width: the largest pool of any middle length in ``[lo, cap]`` (``lo``: the shortest
        middle of the batch now; middles only grow until the next prefill). Within one row of the adaptive
        table beta is fixed and the pool grows with n, so the maximum is at ``cap`` or at the last length
        of a table row; the width changes only when ``lo`` crosses a row or the capacity grows."""
        ends = [int(limit) - 1 for limit, _, _ in ADAPTIVE_RATIOS if limit != math.inf and lo <= limit - 1 < cap]
        return max(self.pool(n, k) for n in (*ends, cap))

    def rows(self, nmid: torch.Tensor, h: int, k: int, device) -> Rows:
        """Per-row sizes for middle lengths ``nmid`` [B] (CPU), on ``device``. Recomputed only when the
        middle lengths change (a page boundary) and then written *in place* into the same device buffers,
        so steps in between copy nothing to the device and a captured graph reads the current sizes."""
        lengths = tuple(nmid.tolist())
        key = (h, k, device)
        cur = self.rows_of.get(key)
        if cur is None or cur.lengths != lengths:
            rho = torch.tensor([self.ratios(int(x))[1] for x in nmid]).repeat_interleave(h)
            pool = self.pool_sizes(nmid, k)
            vals = (
                nmid.long(),
                nmid.long().repeat_interleave(h),
                K.tier_quotas(nmid.repeat_interleave(h), rho),
                torch.tensor(pool, dtype=torch.long).repeat_interleave(h),
            )
            if cur is None or any(t.shape != v.shape for t, v in zip(cur.buffers(), vals, strict=True)):
                n_seq, n_row, quotas, pool_t = (torch.empty(v.shape, dtype=v.dtype, device=device) for v in vals)
                cur = self.rows_of[key] = Rows(n_seq, n_row, quotas, pool_t, width=0, lengths=())
            for t, v in zip(cur.buffers(), vals, strict=True):
                t.copy_(v)
            cur.width, cur.lengths = max(pool), lengths
        return cur

    def graph_buffers(self) -> tuple:
        """Identity of the row buffers a captured step reads."""
        return tuple((key, id(r.n_row), id(r.quotas), id(r.pool)) for key, r in self.rows_of.items())
