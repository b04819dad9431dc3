"""Offloaded store (``offload=True``): the middle of the context lives in host memory.

Device buffer per layer, [B, H, S, D] with S = sink + window + work:

* ``[0, sink)``                  the sink tokens;
* ``[sink, sink + window)``      the window, a ring of pages: position p >= sink lives in slot
                                 ``sink + (p - sink) % window``; when a new page starts, the
                                 page it overwrites is the one leaving the window, copied to host
                                 first and reported to the policy;
* ``[sink + window, S)``         the working set: the selected middle pages/tokens of this step,
                                 fetched from host in one batched transfer.
"""

from __future__ import annotations

import torch

from kvdex.selection import Selection
from kvdex.storage.base import AttendSet, LayerStore, MiddleUpdate
from kvdex.storage.host import HostPages


class OffloadStore(LayerStore):
    def __init__(self, *args, work_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        g = self.grid
        self.host = HostPages(
            self.batch, self.kv_heads, g.page_size, self.head_dim, self.dtype, self.device, self.stats
        )
        self.fixed = g.sink + g.window
        self._alloc_device(max(work_tokens, g.page_size))

    def _alloc_device(self, work: int) -> None:
        shape = (self.batch, self.kv_heads, self.fixed + work, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if getattr(self, "k", None) is not None:
            k[:, :, : self.fixed] = self.k[:, :, : self.fixed]
            v[:, :, : self.fixed] = self.v[:, :, : self.fixed]
        self.k, self.v = k, v

    @property
    def work_capacity(self) -> int:
        return self.k.shape[2] - self.fixed

    def _slot(self, pos: torch.Tensor) -> torch.Tensor:
        g = self.grid
        return torch.where(pos < g.sink, pos, g.sink + (pos - g.sink).clamp(min=0) % g.window)

    # ---- writes -------------------------------------------------------------------------
    def ingest(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> MiddleUpdate:
        g = self.grid
        self.lengths_host = lengths.clone()
        self.lengths.copy_(lengths)
        n = min(g.sink, k.shape[2])
        self.k[:, :, :n] = k[:, :, :n]
        self.v[:, :, :n] = v[:, :, :n]
        nmid = g.num_middle_pages(lengths)
        for b in range(self.batch):
            m = int(nmid[b])
            if m:
                span = slice(g.sink, g.sink + m * g.page_size)
                shape = (self.kv_heads, m, g.page_size, self.head_dim)
                self.host.write(b, 0, k[b, :, span].reshape(shape), v[b, :, span].reshape(shape))
        pos = self._window_slots_positions()  # [B, W]
        ok = pos < self.lengths[:, None]
        src = pos.clamp(max=k.shape[2] - 1)[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        slot = torch.where(ok, self._slot(pos), self.k.shape[2])  # invalid rows -> dropped below
        for buf, x in ((self.k, k), (self.v, v)):
            rows = x.gather(2, src)
            keep = ok[:, None, :, None]
            cur = buf.gather(2, slot.clamp(max=buf.shape[2] - 1)[:, None, :, None].expand_as(rows))
            buf.scatter_(
                2, slot.clamp(max=buf.shape[2] - 1)[:, None, :, None].expand_as(rows), torch.where(keep, rows, cur)
            )
        return self._middle_update(torch.zeros_like(nmid), nmid, k, v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> MiddleUpdate:
        """One token per step per sequence; several columns are appended one at a time."""
        g = self.grid
        evicted: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in range(self.batch)]
        for j in range(k.shape[2]):
            pos_h = self.lengths_host
            rel = pos_h - g.sink
            leaving = (rel >= g.window) & (rel % g.page_size == 0)
            for b in torch.nonzero(leaving).flatten().tolist():
                page = int(rel[b]) // g.page_size - g.window_pages
                s0 = g.sink + (page * g.page_size) % g.window
                kp = self.k[b, :, s0 : s0 + g.page_size].clone()
                vp = self.v[b, :, s0 : s0 + g.page_size].clone()
                self.host.write(b, page, kp[:, None], vp[:, None])
                evicted[b].append((page, kp, vp))
            slot = self._slot(self.lengths)
            bi = torch.arange(self.batch, device=self.device)
            self.k[bi, :, slot] = k[:, :, j]
            self.v[bi, :, slot] = v[:, :, j]
            self._advance(1)
        return self._evicted_update(evicted)

    def _evicted_update(self, evicted) -> MiddleUpdate:
        g = self.grid
        count = torch.tensor([len(e) for e in evicted], dtype=torch.long)
        start = torch.tensor([e[0][0] if e else 0 for e in evicted], dtype=torch.long)
        pn = int(count.max()) if self.batch else 0
        keys = self.k.new_zeros(self.batch, self.kv_heads, pn, g.page_size, self.head_dim)
        vals = torch.zeros_like(keys)
        for b, e in enumerate(evicted):
            for j, (_, kp, vp) in enumerate(e):
                keys[b, :, j], vals[b, :, j] = kp, vp
        return MiddleUpdate(start, count, keys, vals)

    # ---- reads --------------------------------------------------------------------------
    def _fixed_set(self):
        g, b, h = self.grid, self.batch, self.kv_heads
        sink = torch.arange(g.sink, device=self.device).expand(b, g.sink)
        win = self._window_slots_positions()
        pos = torch.cat([sink, win], dim=1)
        valid = pos < self.lengths[:, None]
        slots = self._slot(pos)
        ex = lambda x: x[:, None, :].expand(b, h, -1)  # noqa: E731
        return ex(slots), ex(valid), ex(pos)

    def attend(self, sel: Selection) -> AttendSet:
        g = self.grid
        if sel.everything:
            nmid = int(g.num_middle_pages(self.lengths_host).max())
            pages = torch.arange(nmid, device=self.device).expand(self.batch, self.kv_heads, nmid)
            live = pages < g.num_middle_pages(self.lengths)[:, None, None]
            sel = Selection(pages=torch.where(live, pages, -1))
        if int(g.num_middle_pages(self.lengths_host).max()) == 0:
            sel = Selection()  # no middle yet: nothing to fetch (a selection can only hold -1)
        parts_slot, parts_valid, parts_pos = [], [], []
        cursor = self.fixed
        need = 0
        if sel.pages is not None:
            need += sel.pages.shape[-1] * g.page_size
        if sel.tokens is not None:
            need += sel.tokens.shape[-1]
        if need > self.work_capacity:
            self._alloc_device(need)
        b, h = self.batch, self.kv_heads
        if sel.pages is not None and sel.pages.shape[-1]:
            p = sel.pages.shape[-1]
            blocks = self.host.fetch_pages(sel.pages.clamp(min=0))  # [B, H, P, 2, ps, D]
            n = p * g.page_size
            self.k[:, :, cursor : cursor + n] = blocks[:, :, :, 0].reshape(b, h, n, self.head_dim)
            self.v[:, :, cursor : cursor + n] = blocks[:, :, :, 1].reshape(b, h, n, self.head_dim)
            parts_slot.append(cursor + torch.arange(n, device=self.device).expand(b, h, n))
            pos = Selection(pages=sel.pages).token_positions(g.sink, g.page_size)
            parts_valid.append(pos >= 0)
            parts_pos.append(pos)
            cursor += n
        if sel.tokens is not None and sel.tokens.shape[-1]:
            t = sel.tokens.shape[-1]
            ok = sel.tokens >= 0
            rows = self.host.fetch_rows(torch.where(ok, sel.tokens, g.sink), g.sink)  # [B, H, T, 2, D]
            self.k[:, :, cursor : cursor + t] = rows[:, :, :, 0]
            self.v[:, :, cursor : cursor + t] = rows[:, :, :, 1]
            parts_slot.append(cursor + torch.arange(t, device=self.device).expand(b, h, t))
            parts_valid.append(ok)
            parts_pos.append(sel.tokens.long())
        slots, valid, pos = self._fixed_set()
        idx = torch.cat([slots, *parts_slot], dim=-1)
        valid = torch.cat([valid, *parts_valid], dim=-1)
        pos = torch.cat([pos, *parts_pos], dim=-1)
        return AttendSet(self.k, self.v, idx, valid, pos)

    def permute_middle(self, order: torch.Tensor) -> None:
        """The middle lives in host memory only: the pages are reordered there."""
        m = self._check_middle_order(order)
        if m:
            self.host.permute_tokens(order.cpu())

    def dense(self):
        """Rebuild every token on the device (oracle scoring, multi-token extends): copies the middle."""
        g = self.grid
        n = int(self.lengths_host.max())
        shape = (self.batch, self.kv_heads, n, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        s = min(g.sink, n)
        k[:, :, :s], v[:, :, :s] = self.k[:, :, :s], self.v[:, :, :s]
        nmid = int(g.num_middle_pages(self.lengths_host).max())
        if nmid:
            blocks = self.host.data[:, :, :nmid].to(self.device)
            m = nmid * g.page_size
            k[:, :, g.sink : g.sink + m] = blocks[:, :, :, 0].reshape(self.batch, self.kv_heads, m, -1)
            v[:, :, g.sink : g.sink + m] = blocks[:, :, :, 1].reshape(self.batch, self.kv_heads, m, -1)
            self.stats.h2d_bytes += blocks.numel() * blocks.element_size()
        pos = self._window_slots_positions()
        ok = pos < self.lengths[:, None]
        slots = self._slot(pos)
        tgt = torch.where(ok, pos, n)[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        ix = slots[:, None, :, None].expand_as(tgt)
        for i, buf in enumerate((self.k, self.v)):
            dst = torch.cat([(k, v)[i], k.new_zeros(self.batch, self.kv_heads, 1, self.head_dim)], dim=2)
            dst.scatter_(2, tgt, buf.gather(2, ix))  # invalid rows land in the extra row n
            if i == 0:
                k = dst[:, :, :n]
            else:
                v = dst[:, :, :n]
        return k, v

    def device_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def host_bytes(self) -> int:
        return self.host.nbytes()
