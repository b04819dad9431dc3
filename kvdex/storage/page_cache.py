"""The device page cache of the offloaded store (``page_cache=C > 0``; :mod:`kvdex.storage.offload`
describes it): C page slots per (sequence, kv head) at the front of the working set that keep recently
selected pages, so a step transfers only the selected pages that are not there yet. Hits, misses and
slot choices are made on the device with static shapes (graph-capturable), by one Triton kernel
(``kvdex.kernels.page_cache_triton.page_cache_step``) or its PyTorch twin below.

:class:`PageCacheMixin` holds the methods; :class:`~kvdex.storage.offload.OffloadStore` owns the state
(``page_cache``, ``host``, ``fixed``, the device buffers ``k`` / ``v``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kvdex.kernels.dispatch import triton_kernel

if TYPE_CHECKING:
    from kvdex.storage.host import HostPages
    from kvdex.storage.layout import Grid


class PageCacheMixin:
    """The page-cache methods of :class:`~kvdex.storage.offload.OffloadStore`."""

    # the store's state these methods read (made by OffloadStore and LayerStore; declared, not set, here)
    grid: Grid
    batch: int
    kv_heads: int
    head_dim: int
    device: torch.device
    page_cache: int
    host: HostPages
    fixed: int  # sink + window: the working set's first slot
    k: torch.Tensor
    v: torch.Tensor

    def _page_cache_alloc(self) -> None:
        dev, shape = self.device, (self.batch, self.kv_heads, self.page_cache + 1)  # column C: a write sink
        self.pc_page = torch.full(shape, -1, dtype=torch.long, device=dev)  # page held by each slot
        self.pc_stamp = torch.full(shape, -1, dtype=torch.long, device=dev)  # step it was last used
        self.pc_tick = torch.zeros((), dtype=torch.long, device=dev)
        self.pc_count = torch.zeros((self.batch, self.kv_heads, 2), dtype=torch.long, device=dev)  # hits, misses

    def _page_cache_flush(self) -> None:
        if self.page_cache:
            self.pc_page.fill_(-1)
            self.pc_stamp.fill_(-1)

    def page_cache_stats(self) -> dict:
        """Hits, misses (selected pages, summed over sequences and kv heads) and bytes moved host ->
        device through the page cache since the store was made (reads the device counters: a sync)."""
        if not self.page_cache:
            return {}
        hits, misses = (int(x) for x in self.pc_count.sum((0, 1)))
        page = 2 * self.grid.page_size * self.head_dim * self.k.element_size()
        return {"hits": hits, "misses": misses, "bytes_moved": misses * page}

    def _pc_fused(self):
        """kvdex.kernels.page_cache_triton when the bookkeeping runs as one Triton kernel (UVA stores, at most
        512 slots; ``KVDEX_PC_FUSED=0`` turns it off), else None (the PyTorch ops below, the kernel's twin). On by
        default: one kernel instead of a dozen small ones per layer and step; its GPU test decodes
        bit-identically to the PyTorch bookkeeping."""
        if self.host._uva is None or os.environ.get("KVDEX_PC_FUSED", "1") != "1" or self.page_cache > 512:
            return None
        return triton_kernel("page_cache_triton")

    def _cached_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Make every selected page resident in the pool; returns the rows of the selected pages' tokens in
        the store's buffers, [B, H, P * page_size] (entries that are padding point at slot 0)."""
        c, ps = self.page_cache, self.grid.page_size
        pages = pages.long()
        fused = self._pc_fused()
        if fused is not None:
            self.pc_tick.add_(1)
            rows, dst = fused.page_cache_step(
                pages.contiguous(), self.pc_page, self.pc_stamp, self.pc_tick, self.pc_count, self.fixed, ps
            )
            self.host.fill_slots(pages, dst, self.k, self.v, self.fixed)
            return rows
        live = pages >= 0
        eq = (pages[..., :, None] == self.pc_page[..., None, :c]) & live[..., None]  # [B, H, P, C]
        hit = eq.any(-1)
        hit_slot = eq.to(torch.uint8).argmax(-1)
        miss = live & ~hit
        used = eq.any(-2)  # slots a hit of this step keeps
        key = torch.where(used, torch.iinfo(torch.long).max, self.pc_stamp[..., :c])
        order = torch.sort(key, dim=-1, stable=True).indices  # free slots, least recently used first
        rank = (miss.long().cumsum(-1) - 1).clamp(min=0)  # the r-th miss takes the r-th free slot (C >= P)
        miss_slot = order.gather(-1, rank)
        slot = torch.where(hit, hit_slot, torch.where(miss, miss_slot, 0))
        self.pc_tick.add_(1)
        self.pc_page.scatter_(-1, torch.where(miss, miss_slot, c), pages)
        self.pc_stamp.scatter_(-1, torch.where(live, slot, c), self.pc_tick.expand(pages.shape))
        self.pc_count.add_(torch.stack([hit.sum(-1), miss.sum(-1)], dim=-1))
        self.host.fill_slots(pages, torch.where(miss, miss_slot, -1), self.k, self.v, self.fixed)
        offs = torch.arange(ps, device=self.device)
        return (self.fixed + slot[..., None] * ps + offs).flatten(2)
