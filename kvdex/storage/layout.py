"""Page-grid arithmetic shared by every store and policy.

Tokens of one sequence are numbered from 0 (left padding is stripped on ingest). The first
``sink`` tokens form the sink. After it, tokens are grouped in pages of ``page_size`` on a grid
that starts at ``sink``: grid page ``g`` holds positions ``[sink + g*ps, sink + (g+1)*ps)``.
The window is the last ``window_pages`` grid pages (the newest may be partial); every grid page
before it is a *middle* page, with middle page id == grid page id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    sink: int
    page_size: int
    window_pages: int

    @property
    def window(self) -> int:
        return self.window_pages * self.page_size

    def num_middle_pages(self, lengths: torch.Tensor) -> torch.Tensor:
        """Middle pages per sequence for ``lengths`` [B] real tokens."""
        # max(ceil(max(L - sink, 0) / ps) - window_pages, 0) as one floor division (three kernels, not six:
        # a decode step calls this a few times per layer): below the sink the floor is <= 0 and clamps to 0
        return (
            (lengths + (self.page_size - 1 - self.sink - self.window_pages * self.page_size)) // self.page_size
        ).clamp(min=0)

    def middle_pages_of(self, length: int) -> int:
        """:meth:`num_middle_pages` of one length, in Python (host bookkeeping without a tensor)."""
        return max(0, -(-max(length - self.sink, 0) // self.page_size) - self.window_pages)

    def window_start(self, lengths: torch.Tensor) -> torch.Tensor:
        """First position of the window per sequence (== end of the middle)."""
        return self.sink + self.num_middle_pages(lengths) * self.page_size

    def page_start(self, page: torch.Tensor | int):
        return self.sink + page * self.page_size

    def page_positions(self, page: torch.Tensor) -> torch.Tensor:
        """[..., page_size] token positions of the grid pages ``page`` [...] (a tensor)."""
        return self.page_start(page)[..., None] + torch.arange(self.page_size, device=page.device)


def grown_capacity(need: int, cap: int, step: int) -> int:
    """The capacity a buffer of ``cap`` entries is re-allocated to when it must hold ``need``: ``need`` at least,
    growing by a quarter of ``cap`` or by ``step``, whichever is more -- but by no more than ``need`` itself below
    ``step``, so that a short sequence's index stays about its own size (doubling while small) instead of taking
    ``step`` entries per layer. Many short requests at once (a serving engine's batch) then hold little."""
    return max(need, cap + max(min(step, need), cap // 4))


def left_padding(attention_mask: torch.Tensor | None, batch: int, width: int) -> torch.Tensor:
    """Number of leading padding positions per sequence from a 2D 0/1 mask [B, >=width].

    Only left padding is supported: each row must be zeros followed by ones. Anything else
    (right padding, holes) raises ``ValueError`` instead of giving a silently wrong answer.
    """
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long)
    m = attention_mask[:, :width].to(torch.bool)
    pads = (~m).long().cumprod(dim=1).sum(dim=1)
    real = m.long().sum(dim=1)
    if bool(((pads + real) != width).any()):
        raise ValueError(
            "kvdex supports left-padded batches only (each row of attention_mask must be 0...0 1...1); "
            "set tokenizer.padding_side = 'left'"
        )
    if bool((real == 0).any()):
        raise ValueError("a sequence in the batch has no tokens (its attention_mask row is all zeros)")
    return pads.cpu()
