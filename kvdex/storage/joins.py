"""Pages joining the middle: :class:`MiddleUpdate` (the pages a store hands a policy's ``index``: all of them at
prefill, then one at a time), :class:`PageJoin` (a join inside a captured decode step, fixed shapes) and the
host-side arithmetic of when a page joins (:func:`host_joins`, :func:`page_joins`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvdex.storage.layout import Grid


@dataclass
class MiddleUpdate:
    """Pages that joined the middle region (at prefill, or as the window moves on).

    start [B] / count [B] (CPU): the new middle page ids of sequence b are
    ``start[b] ... start[b] + count[b] - 1``. keys [B, H, Pn, ps, D] (device) hold their keys,
    page ``start[b] + j`` at ``keys[b, :, j]``; entries past ``count[b]`` are padding.
    ``obs_queries`` [B, Hq, W, D]: the last W prompt queries (prefill only, for policies that
    declare an observation window); ``obs_valid`` [B, W] marks real (non-padding) rows.
    ``store``: the layer's store the pages belong to (set by the cache; lets a policy that needs
    more than the new pages, e.g. CHESS's window anchor over every layer, read sink and window).
    """

    start: torch.Tensor
    count: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor | None = None
    obs_queries: torch.Tensor | None = None
    obs_valid: torch.Tensor | None = None
    store: Any = None  # the kvdex.storage.LayerStore it comes from (typed loosely: the store imports this module)

    @property
    def empty(self) -> bool:
        return int(self.count.sum()) == 0

    def page_ids(self) -> torch.Tensor:
        """[B, Pn] page id of each entry of ``keys`` (``-1`` for padding), on the keys' device."""
        j = torch.arange(self.keys.shape[2])
        ids = self.start[:, None] + j[None, :]
        ids = torch.where(j[None, :] < self.count[:, None], ids, -1)
        return ids.to(self.keys.device)


@dataclass
class PageJoin:
    """At most one page per sequence joining the middle in a single-token decode step, with static
    shapes (the capturable twin of :class:`MiddleUpdate`, ``LayerStore.append_join``).

    Device (what captured work may read): ``joins`` [B] bool -- sequence b's oldest window page joins
    the middle; ``start`` [B] long -- its middle page id (for other rows a valid id that must not be
    written); ``keys`` / ``values`` [B, H, 1, ps, D] -- its keys / values (junk where not ``joins``; a store
    may pass ``values_of`` as a function that gathers them on first use, in the same step: no policy indexes
    values, and a captured step then has no gather for them); ``positions`` [B, ps] -- its token positions.
    Host (CPU, bookkeeping only, never fed into device work): ``host_start`` / ``host_count`` [B], the same
    as a :class:`MiddleUpdate`'s ``start`` / ``count``.
    """

    joins: torch.Tensor
    start: torch.Tensor
    keys: torch.Tensor
    values_of: torch.Tensor | Callable[[], torch.Tensor]
    host_start: torch.Tensor
    host_count: torch.Tensor
    store: Any = None  # the kvdex.storage.LayerStore it comes from (typed loosely: the store imports this module)
    positions_of: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        """[B, ps] int64: the joining page's token positions (``sink + start * ps + j``)."""
        if self.positions_of is None:
            assert self.store is not None, "a page join's positions need its store"
            self.positions_of = self.store.grid.page_positions(self.start)
        return self.positions_of

    @property
    def values(self) -> torch.Tensor:
        """[B, H, 1, ps, D]: the joining page's values."""
        if callable(self.values_of):
            self.values_of = self.values_of()
        return self.values_of

    def write(self, buf: torch.Tensor, val: torch.Tensor) -> None:
        """``buf[b, :, start[b]*n : start[b]*n + n] = val[b]`` for every sequence b that joins, in place with
        fixed shapes (a gather and a scatter): buf [B, H, cap, ...], val [B, H, n, ...] (n entries per page:
        1 for a per-page index, page_size for a per-token one)."""
        b, h, n = val.shape[:3]
        rest = val.shape[3:]
        idx = (self.start * n)[:, None] + torch.arange(n, device=self.start.device)[None, :]
        idx = idx.clamp(max=buf.shape[2] - 1).view(b, 1, n, *([1] * len(rest))).expand(b, h, n, *rest)
        cur = buf.gather(2, idx)
        on = self.joins.view(b, 1, 1, *([1] * len(rest)))
        buf.scatter_(2, idx, torch.where(on, val.to(buf.dtype), cur))


def host_joins(grid: Grid, lengths_host: torch.Tensor, t: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, count) [B] (CPU) of the middle pages that join when ``t`` tokens are appended to
    sequences of ``lengths_host`` tokens (``start`` is 0 where ``count`` is 0)."""
    before = grid.num_middle_pages(lengths_host)
    count = grid.num_middle_pages(lengths_host + t) - before
    return torch.where(count > 0, before, 0), count


def page_joins(store) -> bool:
    """Whether a page joins the middle of any sequence of ``store`` when one token is appended (host lengths
    only: no device value is read)."""
    return bool((host_joins(store.grid, store.lengths_host)[1] > 0).any())
