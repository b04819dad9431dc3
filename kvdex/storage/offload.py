"""Offloaded store (``offload=True``): the middle of the context lives in host memory.

Device buffer per layer, [B, H, S, D] with S = sink + window + work:

* ``[0, sink)``                  the sink tokens;
* ``[sink, sink + window)``      the window, a ring of pages: position p >= sink lives in slot
                                 ``sink + (p - sink) % window``; when a new page starts, the
                                 page it overwrites is the one leaving the window, copied to host
                                 first and reported to the policy;
* ``[sink + window, S)``         the working set: the selected middle pages/tokens of this step,
                                 fetched from host in one batched transfer.

**Device page cache** (``page_cache=C > 0``): the first ``C * page_size`` rows of the working set
become a pool of C page slots per (sequence, kv head) that keeps recently selected pages, so a step
transfers only the pages it selects that are not already there (consecutive steps select mostly
the same pages). Everything runs on the device with static shapes (graph-capturable): a hit is a
selected page equal to one of the C slot tags; each miss takes a slot that no hit of this step
uses, least recently used first (ties: lowest slot), ranked by a stable sort of the slots' last-use
stamps; one gather launch over the whole selection copies only the misses (hits and padding
return at once), and attention reads the pool slots in selection order, so its input is the same
as without the cache. Needs C >= the pages selected per step; a step selecting more (e.g. ``full``
over a long middle) bypasses the pool and empties it. Hits, misses and the bytes moved are
counted on the device (:meth:`OffloadStore.page_cache_stats`).

**Multi-token appends** (chunked prefill, a second turn) are written in bulk: the pages that leave
the window go to host memory in one write per sequence, not token by token.
"""

from __future__ import annotations

import warnings

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.selection import Selection
from kvdex.storage.base import AttendSet, LayerStore
from kvdex.storage.base import fast_append as _fast_append
from kvdex.storage.host import _GROW_PAGES, HostPages
from kvdex.storage.joins import MiddleUpdate, PageJoin
from kvdex.storage.page_cache import PageCacheMixin


def _fast_slot_list():
    """kvdex.kernels.slots_triton.offload_slot_list when triton imports (``KVDEX_TRITON=0``: the PyTorch ops)."""
    return triton_kernel("slots_triton", "offload_slot_list")


class OffloadStore(PageCacheMixin, LayerStore):
    k: torch.Tensor  # [B, H, sink + window + working set, D] on the device (_alloc_device)
    v: torch.Tensor

    def __init__(self, *args, work_tokens: int, page_cache: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        g = self.grid
        if not isinstance(page_cache, int) or isinstance(page_cache, bool) or page_cache < 0:
            raise ValueError(f"page_cache must be an int >= 0 (page slots per sequence, kv head), got {page_cache!r}")
        self.host = HostPages(
            self.batch, self.kv_heads, g.page_size, self.head_dim, self.dtype, self.device, self.stats
        )
        self.fixed = g.sink + g.window
        self.page_cache = page_cache
        self._pc_warned = False
        work = page_cache * g.page_size if page_cache else max(work_tokens, g.page_size)
        self._alloc_device(work)
        if page_cache:
            self._page_cache_alloc()

    def _alloc_device(self, work: int) -> None:
        shape = (self.batch, self.kv_heads, self.fixed + work, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if "k" in self.__dict__:  # a resize (at construction there is nothing to keep)
            n = min(self.k.shape[2], shape[2])  # the fixed rows and the working set (the page cache's pool)
            k[:, :, :n] = self.k[:, :, :n]
            v[:, :, :n] = self.v[:, :, :n]
        self.k, self.v = k, v

    @property
    def work_capacity(self) -> int:
        return self.k.shape[2] - self.fixed

    def window_slots(self, pos: torch.Tensor) -> torch.Tensor:
        g = self.grid
        return torch.where(pos < g.sink, pos, g.sink + (pos - g.sink).clamp(min=0) % g.window)

    # ---- capabilities ---------------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return True

    def graph_unsupported(self) -> str | None:
        if self.host._uva is None:
            return "an offloaded store needs the UVA gather (triton, KVDEX_UVA != 0)"
        return None

    def graph_buffers(self) -> tuple:
        # the ring and working set on the device, and the host pages the UVA gather reads by address
        return ((id(self.k), tuple(self.k.shape)), (id(self.host.data), tuple(self.host.data.shape)))

    def reserve_prompt(self, tokens: int) -> None:
        self.host.reserve(self.grid.middle_pages_of(tokens) + _GROW_PAGES)

    # ---- writes -------------------------------------------------------------------------
    def ingest(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> MiddleUpdate:
        g = self.grid
        self._page_cache_flush()
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
        slot = torch.where(ok, self.window_slots(pos), self.k.shape[2])  # invalid rows -> dropped below
        for buf, x in ((self.k, k), (self.v, v)):
            rows = x.gather(2, src)
            keep = ok[:, None, :, None]
            cur = buf.gather(2, slot.clamp(max=buf.shape[2] - 1)[:, None, :, None].expand_as(rows))
            buf.scatter_(
                2, slot.clamp(max=buf.shape[2] - 1)[:, None, :, None].expand_as(rows), torch.where(keep, rows, cur)
            )
        return self._middle_update(torch.zeros_like(nmid), nmid, k, v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> MiddleUpdate:
        """One token per step per sequence (several columns: :meth:`_append_many`, in bulk)."""
        if k.shape[2] > 1:
            return self._append_many(k, v)
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
            fast = _fast_append(self.k) if g.window else None
            if fast is not None:  # one Triton launch instead of ~10 kernels, lengths too (kvdex.kernels.append_triton)
                kj, vj, ring = k[:, :, j : j + 1], v[:, :, j : j + 1], (g.sink, g.window)
                fast(self.k, self.v, kj, vj, self.lengths, ring=ring, advance=True, ticket=self.lengths_ticket)
            else:
                slot = self.window_slots(self.lengths)
                bi = torch.arange(self.batch, device=self.device)
                self.k[bi, :, slot] = k[:, :, j]
                self.v[bi, :, slot] = v[:, :, j]
            self._advance(1, device=fast is None)
        return self._evicted_update(evicted)

    def reserve_join(self, tokens: int) -> None:
        """Host pages for sequences of up to ``tokens`` tokens (the page leaving the window is written there)."""
        self.host.reserve(self.grid.middle_pages_of(tokens))

    def append_join(self, k: torch.Tensor, v: torch.Tensor) -> PageJoin:
        """:meth:`append` of one token with static shapes: the ring page the new token overwrites when a
        page leaves the window is read on the device and written to its host page by one kernel
        (``HostPages.write_join``; masked per sequence), then the token is written to the ring."""
        if k.shape[2] != 1:
            raise ValueError(f"append_join takes one token per sequence, got {k.shape[2]}")
        g = self.grid
        self.reserve_join(int(self.lengths_host.max()) + 1)  # a no-op when reserved ahead (host check only)
        joins, start = self._join_pages(self.lengths)
        rows = (g.sink + (start * g.page_size) % g.window)[:, None] + torch.arange(g.page_size, device=self.device)
        rows = rows[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        kp, vp = self.k.gather(2, rows), self.v.gather(2, rows)  # [B, H, ps, D], before the ring slot is reused
        self.host.write_join(torch.where(joins, start, -1), torch.stack([kp, vp], dim=2))
        fast = _fast_append(self.k)
        if fast is not None:  # the token and the lengths' advance in one launch
            fast(self.k, self.v, k, v, self.lengths, ring=(g.sink, g.window), advance=True, ticket=self.lengths_ticket)
        else:
            slot = self.window_slots(self.lengths)
            bi = torch.arange(self.batch, device=self.device)
            self.k[bi, :, slot] = k[:, :, 0]
            self.v[bi, :, slot] = v[:, :, 0]
            self.lengths += 1
        host_start, host_count = self._advance_join()
        return PageJoin(joins, start, kp[:, :, None], vp[:, :, None], host_start, host_count, self)

    def count_join(self, count: torch.Tensor) -> None:
        page = 2 * self.grid.page_size * self.kv_heads * self.head_dim * self.dtype.itemsize
        self.stats.d2h_bytes += int(count.sum()) * page  # as host.write counts the pages leaving the window

    def _append_many(self, k: torch.Tensor, v: torch.Tensor) -> MiddleUpdate:
        """t columns at once, the same end state as t single appends: per sequence, the rows from the
        start of the current window to the new end are laid out once; the pages among them that
        leave the window go to host memory in one write, the last ``window`` rows go to the ring."""
        g = self.grid
        ps, t = g.page_size, k.shape[2]
        l0 = self.lengths_host.clone()
        l1 = l0 + t
        m0, m1 = g.num_middle_pages(l0), g.num_middle_pages(l1)
        count = m1 - m0
        pn = int(count.max()) if self.batch else 0
        keys = self.k.new_zeros(self.batch, self.kv_heads, pn, ps, self.head_dim)
        vals = torch.zeros_like(keys)
        for b in range(self.batch):
            a, e = int(l0[b]), int(l1[b])
            ns = max(0, min(g.sink, e) - a)  # new rows that fall in the sink
            if ns:
                self.k[b, :, a : a + ns] = k[b, :, :ns]
                self.v[b, :, a : a + ns] = v[b, :, :ns]
            w0 = g.sink + int(m0[b]) * ps  # first position of the current window
            old = torch.arange(w0, max(w0, a), device=self.device)  # window rows already in the ring
            slots = self.window_slots(old)
            tail_k = torch.cat([self.k[b][:, slots], k[b, :, ns:]], dim=1)  # positions w0 ... e-1
            tail_v = torch.cat([self.v[b][:, slots], v[b, :, ns:]], dim=1)
            n = int(m1[b] - m0[b])
            if n:
                kp = tail_k[:, : n * ps].reshape(self.kv_heads, n, ps, self.head_dim)
                vp = tail_v[:, : n * ps].reshape(self.kv_heads, n, ps, self.head_dim)
                self.host.write(b, int(m0[b]), kp, vp)
                keys[b, :, :n], vals[b, :, :n] = kp, vp
            keep = min(g.window, tail_k.shape[1])  # the newest rows, each in its ring slot
            if keep:
                pos = torch.arange(e - keep, e, device=self.device)
                self.k[b][:, self.window_slots(pos)] = tail_k[:, -keep:]
                self.v[b][:, self.window_slots(pos)] = tail_v[:, -keep:]
        self._advance(t)
        return MiddleUpdate(torch.where(count > 0, m0, 0), count, keys, vals)

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
        slots = self.window_slots(pos)
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
        pooled = sel.pages is not None and 0 < sel.pages.shape[-1] <= self.page_cache
        if sel.pages is not None:
            need += (self.page_cache if pooled else sel.pages.shape[-1]) * g.page_size
        if sel.tokens is not None:
            need += sel.tokens.shape[-1]
        if need > self.work_capacity:
            self._alloc_device(need)
        if self.page_cache and not pooled and need:
            self._page_cache_flush()  # this step's pages / tokens land on the pool's rows
            if sel.pages is not None and sel.pages.shape[-1] > self.page_cache and not self._pc_warned:
                self._pc_warned = True
                warnings.warn(
                    f"page_cache={self.page_cache} is smaller than the {sel.pages.shape[-1]} pages selected this "
                    "step: such steps bypass the device page cache (use page_cache >= the pages per step)",
                    stacklevel=2,
                )
        b, h = self.batch, self.kv_heads
        if pooled and sel.pages is not None:  # through the device page cache: only the misses cross PCIe
            parts_slot.append(self._cached_pages(sel.pages))  # [B, H, P * page_size] rows in the pool
            pos = Selection(pages=sel.pages).token_positions(g.sink, g.page_size)
            parts_valid.append(pos >= 0)
            parts_pos.append(pos)
            cursor += self.page_cache * g.page_size
        elif sel.pages is not None and sel.pages.shape[-1]:
            p = sel.pages.shape[-1]
            blocks = self.host.fetch_pages(sel.pages.clamp(min=0))  # [B, H, P, 2, ps, D]
            n = p * g.page_size
            self.k[:, :, cursor : cursor + n] = blocks[:, :, :, 0].reshape(b, h, n, self.head_dim)
            self.v[:, :, cursor : cursor + n] = blocks[:, :, :, 1].reshape(b, h, n, self.head_dim)
            fast = _fast_slot_list() if self.k.is_cuda and sel.tokens is None and g.window_pages else None
            if fast is not None:  # the lists built below, in one launch (kvdex.kernels.slots_triton)
                idx, valid, pos = fast(self.lengths, sel.pages, g.sink, g.page_size, g.window_pages, cursor)
                return AttendSet(self.k, self.v, idx, valid, pos)
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

    def page_keys(self, pages: torch.Tensor) -> torch.Tensor:
        """The pages' keys through the fetch path (one batched host -> device transfer of their keys alone,
        counted like :meth:`attend`'s), not the whole middle as :meth:`dense` would copy."""
        return self.host.fetch_pages(pages.clamp(min=0), keys_only=True)[:, :, :, 0]

    def permute_middle(self, order: torch.Tensor, validate: bool = True) -> None:
        """The middle lives in host memory only: the pages are reordered there."""
        m = self._check_middle_order(order, validate)
        if m:
            self.host.permute_tokens(order.cpu())
            self._page_cache_flush()  # the pool's pages no longer hold what their ids say

    def dense(self):
        """Rebuild every token on the device (oracle scoring, multi-token extends): copies the middle."""
        k, v = self._rebuild(values=True)
        assert v is not None
        return k, v

    def dense_keys(self) -> torch.Tensor:
        """The keys alone (half the bytes of :meth:`dense` cross from the host)."""
        return self._rebuild(values=False)[0]

    def _rebuild(self, values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = self.grid
        n = int(self.lengths_host.max())
        shape = (self.batch, self.kv_heads, n + 1, self.head_dim)  # row n: where invalid window rows land
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k) if values else None
        s = min(g.sink, n)
        k[:, :, :s] = self.k[:, :, :s]
        if v is not None:
            v[:, :, :s] = self.v[:, :, :s]
        nmid = int(g.num_middle_pages(self.lengths_host).max())
        if nmid:
            m = nmid * g.page_size
            if v is not None:
                blocks = self.host.read_prefix(nmid)  # one DMA per (sequence, head); counts the bytes
                v[:, :, g.sink : g.sink + m] = blocks[:, :, :, 1].reshape(self.batch, self.kv_heads, m, -1)
            else:  # the pages' keys alone (UVA on CUDA)
                ids = torch.arange(nmid, device=self.device).expand(self.batch, self.kv_heads, nmid)
                blocks = self.host.fetch_pages(ids, keys_only=True)
            k[:, :, g.sink : g.sink + m] = blocks[:, :, :, 0].reshape(self.batch, self.kv_heads, m, -1)
            del blocks
        pos = self._window_slots_positions()
        ok = pos < self.lengths[:, None]
        slots = self.window_slots(pos)
        tgt = torch.where(ok, pos, n)[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        ix = slots[:, None, :, None].expand_as(tgt)
        for dst, buf in ((k, self.k), (v, self.v)):
            if dst is not None:
                dst.scatter_(2, tgt, buf.gather(2, ix))  # invalid rows land in the extra row n
        return k[:, :, :n], None if v is None else v[:, :, :n]

    def device_bytes(self) -> int:
        # the sink + window ring and the working set the selected middle is fetched into: sized by the
        # configuration (sink, window, budget or page_cache), not grown ahead of the context
        return 2 * self.k.numel() * self.k.element_size()

    def host_bytes(self) -> int:
        """Bytes of the middle pages' keys and values held on the host (not the host buffer's spare pages)."""
        pages = int(self.grid.num_middle_pages(self.lengths_host).sum())
        return pages * self.kv_heads * 2 * self.grid.page_size * self.head_dim * self.k.element_size()
