"""PRKV's static region as part of a selection (:class:`StaticRegion`): its whole pages, its ragged tail and
its partly filled page, from the static token count alone (``kvdex/policies/prkv/static_set.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.selection import Selection


@dataclass
class StaticRegion:
    """The static region's part of a selection, from the static count n [B] alone: its whole pages
    ``pages`` [B, 1, f] (-1 padded; the same for every kv head), its ragged tail ``tokens`` [B, 1, t]
    (positions, -1 padded; None when t = 0) and ``partial`` [B], the index of its partly filled
    page (n // page_size; also the first dynamic candidate). Widths f = n_static // page_size and
    t = min(page_size - 1, n_static), from the split alone, eager or captured: a request's first select under
    CUDA-graph decoding then re-sizes nothing that its captured steps read.
    ``positions`` [B, 1, f * page_size + t]: the region's token positions (-1 padded), a token rerank's prefix."""

    pages: torch.Tensor
    tokens: torch.Tensor | None
    partial: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of(cls, n: torch.Tensor, n_static: int, grid) -> StaticRegion:
        ps, b = grid.page_size, n.shape[0]
        full, tail = n // ps, n % ps
        f = n_static // ps
        sp = torch.arange(f, device=n.device)[None, :].expand(b, -1)
        sp = torch.where(sp < full[:, None], sp, -1)[:, None, :]
        t = min(ps - 1, n_static)
        tokens = None
        if t:
            offs = torch.arange(t, device=n.device)[None, :]
            tokens = torch.where(offs < tail[:, None], grid.sink + (full * ps)[:, None] + offs, -1)[:, None, :]
        positions = Selection(pages=sp, tokens=tokens).token_positions(grid.sink, ps)
        return cls(sp, tokens, full, positions)

    def copy_(self, other: StaticRegion) -> None:
        """In place (a captured CUDA graph reads these buffers)."""
        self.pages.copy_(other.pages)
        self.partial.copy_(other.partial)
        self.positions.copy_(other.positions)
        if self.tokens is not None:
            assert other.tokens is not None  # the same widths: both from the same split
            self.tokens.copy_(other.tokens)

    def ids(self) -> tuple:
        return tuple(id(t) for t in (self.pages, self.tokens, self.partial, self.positions))
