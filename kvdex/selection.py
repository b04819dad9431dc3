"""The one object that crosses every boundary: what a kv head attends to in the middle region.

A policy returns a :class:`Selection`; storage turns it into device slots; the attention
kernel, the transfer engine and the metrics read only that (GUIDE practice 2).

The sink and the recent window are always attended and are not part of a selection.
Indices are per (sequence, kv head) and padded with ``-1``:

* ``pages``  [B, H, P]  middle page ids (page ``m`` holds tokens ``sink + m*page_size ...``);
* ``tokens`` [B, H, T]  absolute token positions inside the middle region.

A policy fills one or both. ``everything=True`` marks the dense selection (all middle pages),
which lets storage skip index work without changing the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Selection:
    pages: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    everything: bool = False
    # ``tokens`` already on the CPU, where the policy made them there (IceCache's host search): a store that reads
    # the selection on the host (kvdex.storage.semantic) takes this copy instead of copying ``tokens`` back
    host_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("pages", "tokens"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 3 or t.dtype not in (torch.int32, torch.int64)):
                raise ValueError(
                    f"Selection.{name} must be an integer tensor [B, H, N], got {tuple(t.shape)} {t.dtype}"
                )

    def num_pages(self) -> torch.Tensor | None:
        """Selected pages per (sequence, kv head), [B, H]."""
        return None if self.pages is None else (self.pages >= 0).sum(-1)

    def num_tokens(self) -> torch.Tensor | None:
        return None if self.tokens is None else (self.tokens >= 0).sum(-1)

    def token_positions(self, sink: int, page_size: int) -> torch.Tensor:
        """All selected middle positions as one [B, H, N] tensor (pages expanded), ``-1`` padded."""
        parts = []
        if self.pages is not None:
            offs = torch.arange(page_size, device=self.pages.device)
            pos = sink + self.pages.unsqueeze(-1) * page_size + offs  # [B, H, P, ps]
            pos = torch.where(self.pages.unsqueeze(-1) >= 0, pos, -1)
            parts.append(pos.flatten(2))
        if self.tokens is not None:
            parts.append(self.tokens.long())
        if not parts:
            raise ValueError("empty Selection: set pages and/or tokens")
        return torch.cat(parts, dim=-1)

    @property
    def empty(self) -> bool:
        """Selects nothing from the middle (sink + window only)."""
        return self.pages is None and self.tokens is None and not self.everything
