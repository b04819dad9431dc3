"""Offloaded store whose middle lives in *semantic* pages (IceCache's leaf nodes) with bulk loading.

An :class:`~kvdex.storage.offload.OffloadStore` keeps the middle in host pages on the token grid
(used for ``dense()``, forks and tokens not yet placed). On top of that this store keeps a second
host copy laid out by the policy: semantic page ``p`` of (sequence b, kv head h) is one contiguous
block ``sem[b, h, p] = [2, page_size, D]`` holding the tokens of one DCI-tree leaf node
(``place`` writes them, in the order the tree stored them).

Device buffer per layer, [B, H, fixed + slots * page_size + rows, D]:

* ``[0, fixed)``                   sink + window ring (as in OffloadStore);
* ``[fixed, fixed + slots*ps)``    page slots: semantic pages resident on the device; a page stays
                                   resident across steps until its slot is needed by another page;
* the rest                         rows for selected tokens that are not in a semantic page yet
                                   (their tree insertion is still running): fetched from the grid.

Bulk loading (IceCache Figure 4): per step, the pages holding the selected tokens are found; those
already resident are kept; only the missing ones are gathered (one ``index_select``) into a pinned
staging buffer, cross to the device in one copy, and are scattered (``index_copy_``) into free
slots. Selections must be token-level (``Selection.tokens``); anything else falls back to the
grid path of OffloadStore.
"""

from __future__ import annotations

import math

import torch

from kvdex.selection import Selection
from kvdex.storage.base import AttendSet
from kvdex.storage.host import checked_host_allocation
from kvdex.storage.offload import OffloadStore

_GROW_PAGES = 64
_GROW_POSITIONS = 1024
_BIG = 1 << 62


class SemanticOffloadStore(OffloadStore):
    places_pages = True

    def __init__(self, *args, work_tokens: int, page_slots: int, **kwargs):
        super().__init__(*args, work_tokens=work_tokens, **kwargs)
        b, h, ps, d = self.batch, self.kv_heads, self.grid.page_size, self.head_dim
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        self.sem = torch.zeros(b, h, 0, 2, ps, d, dtype=self.dtype, pin_memory=self.pin)
        self.tok_page = torch.full((b, h, 0), -1, dtype=torch.long)  # middle position - sink -> page
        self.tok_slot = torch.full((b, h, 0), -1, dtype=torch.long)
        self.page_slots, self.row_cap = 0, 0
        self.slot_page = torch.full((b * h, 0), -1, dtype=torch.long)  # resident page per device slot
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._layout(max(1, page_slots), max(work_tokens, ps))

    def graph_unsupported(self) -> str | None:
        return f"the store {type(self).__name__} has no graph support"

    # ---- device layout -------------------------------------------------------------------------
    def _layout(self, slots: int, rows: int) -> None:
        self.page_slots, self.row_cap = slots, rows
        self._alloc_device(slots * self.grid.page_size + rows)
        self.slot_page = torch.full((self.batch * self.kv_heads, slots), -1, dtype=torch.long)

    @property
    def _row_base(self) -> int:
        return self.fixed + self.page_slots * self.grid.page_size

    # ---- host layout (written by the policy) ------------------------------------------------------
    def place(self, b: int, h: int, pages: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Store middle tokens at ``positions`` [t] of (b, h) into semantic ``pages``/``slots`` [t].

        The rows are copied from the grid copy on the host; device copies of the touched pages
        become stale and are dropped from their slots."""
        if positions.numel() == 0:
            return
        g = self.grid
        need_p, need_t = int(pages.max()) + 1, int(positions.max()) - g.sink + 1
        self._reserve(need_p, need_t)
        rel = positions - g.sink
        src = self.host.data[b, h, rel // g.page_size, :, rel % g.page_size]  # [t, 2, D]
        self.sem[b, h, pages, :, slots] = src
        self.tok_page[b, h, rel] = pages
        self.tok_slot[b, h, rel] = slots
        row = self.slot_page[b * self.kv_heads + h]
        row[torch.isin(row, pages)] = -1

    def _reserve(self, pages: int, positions: int) -> None:
        b, h = self.batch, self.kv_heads
        if pages > self.sem.shape[2]:
            cap = max(pages, self.sem.shape[2] + max(_GROW_PAGES, self.sem.shape[2] // 4))
            shape = (b, h, cap, *self.sem.shape[3:])
            nbytes = math.prod(shape) * self.dtype.itemsize
            what = (f"one layer's semantic pages ({b} sequence(s) x {h} kv heads x {cap} pages of "
                    f"{self.grid.page_size} tokens x head dim {self.head_dim}, {str(self.dtype).replace('torch.', '')}"
                    f"{', pinned' if self.pin else ''})")  # fmt: skip
            new = checked_host_allocation(
                nbytes, what, lambda: torch.zeros(shape, dtype=self.dtype, pin_memory=self.pin), self.pin
            )
            new[:, :, : self.sem.shape[2]] = self.sem
            self.sem = new
        if positions > self.tok_page.shape[2]:
            cap = max(positions, self.tok_page.shape[2] + max(_GROW_POSITIONS, self.tok_page.shape[2] // 4))
            for name in ("tok_page", "tok_slot"):
                old = getattr(self, name)
                new = torch.full((b, h, cap), -1, dtype=torch.long)
                new[:, :, : old.shape[2]] = old
                setattr(self, name, new)

    # ---- reads ------------------------------------------------------------------------------------
    def attend(self, sel: Selection) -> AttendSet:
        g = self.grid
        nmid = int(g.num_middle_pages(self.lengths_host).max())
        if sel.tokens is None or sel.pages is not None or sel.everything or nmid == 0:
            self.slot_page.fill_(-1)  # the grid path writes over the page slots
            return super().attend(sel)
        b, h, ps = self.batch, self.kv_heads, g.page_size
        R = b * h
        tok = sel.tokens if sel.host_tokens is None else sel.host_tokens
        tok = tok.cpu().long().reshape(R, -1)
        ok = tok >= 0
        rel = torch.where(ok, tok - g.sink, 0)
        cap = self.tok_page.shape[2]
        inside = ok & (rel < cap)
        relc = rel.clamp(max=max(cap - 1, 0))
        page = torch.where(inside, self.tok_page.view(R, cap).gather(1, relc), -1) if cap else torch.full_like(tok, -1)
        slot_in_page = torch.where(page >= 0, self.tok_slot.view(R, cap).gather(1, relc), 0) if cap else page
        req, col = _unique_per_row(page)  # [R, P] pages needed, col [R, T] column of each token's page
        loose = ok & (page < 0)  # tokens whose tree insertion has not landed yet: fetched as rows from the grid
        n_loose = int(loose.sum(1).max()) if R else 0
        if req.shape[1] > self.page_slots or n_loose > self.row_cap:
            self._layout(max(req.shape[1], self.page_slots), max(n_loose, self.row_cap))
        where = self._load_pages(req)  # [R, P] device slot of each needed page
        where = torch.cat([where, torch.zeros(R, 1, dtype=torch.long)], dim=1)  # a column for tokens without a page
        mid_idx = self.fixed + where.gather(1, col.clamp(min=0)) * ps + slot_in_page
        if n_loose:
            mid_idx = torch.where(loose, self._load_rows(tok, loose), mid_idx)
        mid_idx = torch.where(ok, mid_idx, 0)
        slots, valid, pos = self._fixed_set()
        to_dev = lambda x: x.view(b, h, -1).to(self.device)  # noqa: E731
        idx = torch.cat([slots, to_dev(mid_idx)], dim=-1)
        valid = torch.cat([valid, to_dev(ok)], dim=-1)
        pos = torch.cat([pos, to_dev(tok)], dim=-1)
        return AttendSet(self.k, self.v, idx, valid, pos)

    def _load_pages(self, req: torch.Tensor) -> torch.Tensor:
        """Make pages req [R, P] (-1 padded) resident; return their slots [R, P] (0 for padding)."""
        R, P = req.shape
        S = self.page_slots
        live = req >= 0
        hit = (self.slot_page[:, :, None] == req[:, None, :]) & live[:, None, :]  # [R, S, P]
        keep = hit.any(2)
        resident = hit.any(1)
        missing = live & ~resident
        free_order = torch.argsort((keep).to(torch.int8), dim=1, stable=True)  # free slots first
        mrank = (missing.cumsum(1) - 1).clamp(min=0)
        new_slot = free_order.gather(1, mrank.clamp(max=S - 1)) if S else mrank
        where = torch.where(resident, hit.to(torch.int8).argmax(1), new_slot)
        where = torch.where(live, where, 0)
        r_idx, p_idx = torch.nonzero(missing, as_tuple=True)
        nmiss = r_idx.numel()
        self.stats.fields["icecache_pages_reused"] = self.stats.fields.get("icecache_pages_reused", 0) + int(
            (live & resident).sum()
        )
        self.stats.fields["icecache_pages_loaded"] = self.stats.fields.get("icecache_pages_loaded", 0) + nmiss
        if nmiss == 0:
            return where
        pages, slots = req[r_idx, p_idx], where[r_idx, p_idx]
        self.slot_page[r_idx, slots] = pages
        # Bulk loading: gather the missing pages into pinned staging, one copy, scatter into slots.
        ps, d = self.grid.page_size, self.head_dim
        cap = self.sem.shape[2]
        src = self.sem.view(R * cap, 2, ps, d)
        stage = self._stage((nmiss, 2, ps, d))
        torch.index_select(src, 0, r_idx * cap + pages, out=stage)
        blocks = stage.to(self.device, non_blocking=True)
        self._count(stage)
        width = self.k.shape[2]
        rows = (r_idx * width + self.fixed + slots * ps)[:, None] + torch.arange(ps)[None, :]
        rows = rows.flatten().to(self.device)
        self.k.view(R * width, d).index_copy_(0, rows, blocks[:, 0].reshape(-1, d))
        self.v.view(R * width, d).index_copy_(0, rows, blocks[:, 1].reshape(-1, d))
        return where

    def _load_rows(self, tok: torch.Tensor, loose: torch.Tensor) -> torch.Tensor:
        """Fetch rows of the tokens marked ``loose`` [R, T] from the grid; return their device slots."""
        R = tok.shape[0]
        rank = loose.cumsum(1) - 1
        U = int(loose.sum(1).max())
        compact = torch.full((R, U), self.grid.sink, dtype=torch.long)
        r_idx = torch.nonzero(loose, as_tuple=True)[0]
        compact[r_idx, rank[loose]] = tok[loose]
        b, h = self.batch, self.kv_heads
        rows = self.host.fetch_rows(compact.view(b, h, U), self.grid.sink)  # [B, H, U, 2, D]
        base = self._row_base
        self.k[:, :, base : base + U] = rows[:, :, :, 0]
        self.v[:, :, base : base + U] = rows[:, :, :, 1]
        return base + rank.clamp(min=0)

    def _stage(self, shape) -> torch.Tensor:
        if self._copied is not None:  # the previous async copy must have left the staging buffer
            self._copied.synchronize()
        n = shape[0] * shape[1] * shape[2] * shape[3]
        staging = self._staging
        if staging is None or staging.numel() < n:
            self._staging = staging = torch.empty(max(n, 1), dtype=self.dtype, pin_memory=self.pin)
        return staging[:n].view(shape)

    def _count(self, stage: torch.Tensor) -> None:
        if self.pin:
            self._copied = copied = torch.cuda.Event()
            copied.record()
        self.stats.h2d_bytes += stage.numel() * stage.element_size()
        self.stats.h2d_calls += 1

    def host_bytes(self) -> int:
        return super().host_bytes() + self.sem.numel() * self.sem.element_size()


def _unique_per_row(page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """page [R, T] (-1 = none) -> (distinct pages per row [R, P] ascending, -1 padded; column of
    each entry's page [R, T], -1 where none)."""
    R, T = page.shape
    key = torch.where(page >= 0, page, _BIG)
    s, _ = torch.sort(key, dim=1)
    first = torch.ones_like(s, dtype=torch.bool)
    if T:
        first[:, 1:] = s[:, 1:] != s[:, :-1]
    first &= s != _BIG
    P = int(first.sum(1).max()) if R and T else 0
    rank = first.cumsum(1) - 1
    req = torch.full((R, P + 1), _BIG, dtype=torch.long)
    req.scatter_(1, torch.where(first, rank, P), s)
    req = req[:, :P]
    col = torch.searchsorted(req.contiguous(), key.contiguous())
    col = torch.where(page >= 0, col, -1)
    return torch.where(req == _BIG, -1, req), col
