"""ArkVale page digests (Chen et al., NeurIPS 2024, §5.2): a bounding volume of each page's keys.

A page's importance for a query q is ``I(q, K) = max_{k in K} q.k``. ArkVale summarises the keys K of
a filled page by a bounding volume around the AABB centre ``c = (min K + max K) / 2`` and estimates
I from it:

* sphere (centre c, radius r):      ``q.c + r |q|``                          (paper eq. 1)
* cuboid (box c - r ... c + r):     ``sum_i max(q_i (c_i + r_i), q_i (c_i - r_i)) = q.c + |q|.r``  (eq. 3)

with three radii each (eqs. 2 and 4): ``max`` (the farthest key: a true bounding volume, so the
estimate is an upper bound of I), ``center`` (half-way between the nearest and the farthest key) and
``mean`` (the mean distance). Only the ``max`` variants are bounds; the paper's Figure 7 finds
``cuboid-mean`` the most accurate, and it is what ArkVale's released code computes, so it is the
default of ``arkvale`` and of PRKV's dynamic part.

:class:`DigestIndex` keeps the digests of every middle page of every layer (updated as pages join the
middle, rewritten when PRKV restructures the pages) and scores them for a query.
"""

from __future__ import annotations

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.scoring import digest_page_scores, digest_scores, digest_summary
from kvdex.storage import grown_capacity

DIGESTS = ("cuboid-mean", "cuboid-max", "cuboid-center", "sphere-mean", "sphere-max", "sphere-center")
_GROW = 256  # pages of index capacity added at a time (less below it: storage.grown_capacity)


def check_digest(kind: str) -> None:
    if kind not in DIGESTS:
        raise ValueError(f"unknown digest {kind!r}; choose one of: {', '.join(DIGESTS)}")


def summarize(keys: torch.Tensor, kind: str, count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest of pages: keys [..., ps, D] -> (centre [..., D], radius [..., D] (cuboid) or [..., 1] (sphere)), fp32.

    ``count`` (optional, broadcastable to keys[..., 0, 0]) is the number of real keys of each page
    (a page is full once it joins the middle, so callers leave it None). Full pages on CUDA: one Triton
    kernel (:func:`kvdex.kernels.digest_triton.summarize`); else the PyTorch twin
    (:func:`kvdex.kernels.scoring.digest_summary`).
    """
    fast = triton_kernel("digest_triton", "summarize", on=keys) if count is None else None
    return fast(keys, kind) if fast is not None else digest_summary(keys, kind, count)


class DigestIndex:
    """Digests of the middle pages of every layer: centre/radius [B, H, capacity, D or 1]."""

    def __init__(self, kind: str):
        check_digest(kind)
        self.kind = kind
        self.centre: dict[int, torch.Tensor] = {}
        self.radius: dict[int, torch.Tensor] = {}

    def __contains__(self, layer: int) -> bool:
        return layer in self.centre

    def _reserve(self, layer: int, pages: int, c: torch.Tensor, r: torch.Tensor) -> None:
        cur = self.centre.get(layer)
        cap = 0 if cur is None else cur.shape[2]
        if pages <= cap:
            return
        b, h, _, d = c.shape
        new_cap = grown_capacity(pages, cap, _GROW)
        centre = c.new_zeros(b, h, new_cap, d)
        radius = r.new_zeros(b, h, new_cap, r.shape[-1])
        if cur is not None:
            centre[:, :, :cap] = cur
            radius[:, :, :cap] = self.radius[layer]
        self.centre[layer], self.radius[layer] = centre, radius

    def write(self, layer: int, start: torch.Tensor, count: torch.Tensor, keys: torch.Tensor) -> None:
        """Pages ``start[b] ... start[b] + count[b] - 1`` of sequence b get the digests of keys[b, :, :count[b]].

        keys [B, H, Pn, ps, D]; start/count [B] (CPU).
        """
        if int(count.sum()) == 0:
            return
        c, r = summarize(keys, self.kind)
        self._reserve(layer, int((start + count).max()), c, r)
        centre, radius = self.centre[layer], self.radius[layer]
        for b in torch.nonzero(count).flatten().tolist():
            s, n = int(start[b]), int(count[b])
            centre[b, :, s : s + n] = c[b, :, :n]
            radius[b, :, s : s + n] = r[b, :, :n]

    def reserve(self, layer: int, pages: int, store) -> None:
        """Capacity for ``pages`` pages of ``layer`` (page joins inside a captured step: reserved beforehand)."""
        if pages > 0:
            b, h, d, dev = store.batch, store.kv_heads, store.head_dim, store.device
            r = 1 if self.kind.startswith("sphere") else d
            like = torch.empty(b, h, 0, d, device=dev)
            self._reserve(layer, pages, like, torch.empty(b, h, 0, r, device=dev))

    def write_join(self, layer: int, join) -> None:
        """The digest of the page each sequence with ``join.joins`` adds (a :class:`~kvdex.storage.PageJoin`),
        with fixed shapes; the same values as :meth:`write`."""
        if layer in self.centre:
            c, r = summarize(join.keys, self.kind)
            join.write(self.centre[layer], c)
            join.write(self.radius[layer], r)

    def scores(self, layer: int, q: torch.Tensor, pages: int) -> torch.Tensor:
        """[B, Hq, pages] estimated importance of pages 0 ... pages-1 for q [B, Hq, D]."""
        return digest_scores(q, self.centre[layer][:, :, :pages], self.radius[layer][:, :, :pages])

    def page_scores(self, layer: int, q: torch.Tensor, pages: int, view, first: torch.Tensor | None = None):
        """[B, H, pages] per kv head (the group's max of :meth:`scores`), ``-inf`` outside
        ``first <= p <`` the middle's pages of ``view`` (a :class:`~kvdex.view.LayerView`); ``first`` [B]
        or None (0). On CUDA one Triton kernel (:mod:`kvdex.kernels.digest_triton`), else its twin."""
        c, r = self.centre[layer][:, :, :pages], self.radius[layer][:, :, :pages]
        fast = triton_kernel("digest_triton", "page_scores", on=q)
        if fast is not None:  # it derives each sequence's middle page count from the device lengths itself
            return fast(q, c, r, view.lengths, view.grid, first)
        return digest_page_scores(q, c, r, view.middle_pages, first)
