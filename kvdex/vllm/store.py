"""``PagedStore``: a :class:`~kvdex.storage.LayerStore` over vLLM's paged KV cache -- one request's tokens of one
layer, read through the request's block-table row, with no copy of its own.

The engine (:class:`~kvdex.engine.LayerEngine`) and every policy see a store like any other: ``attend(selection)``
gathers sink + window + the selected middle tokens from vLLM's blocks into an :class:`~kvdex.storage.AttendSet`
(compact: slot ``i`` of its buffers is entry ``i`` of its list), ``dense()`` / ``page_keys()`` / ``middle_keys()``
gather what they name, and ``ingest`` / ``append`` only count tokens and hand the pages that join the middle to the
policy (vLLM has written the tokens through its slot mapping already; ``writes=True`` makes the store write them
itself, for use without vLLM).

**Relocation without moving KV** (PRKV). ``permute_middle`` does not touch vLLM's blocks (they may be shared by
several requests under prefix caching): the store keeps the order as a map, middle slot ``j`` of kv head ``h``
holding position ``sink + order[h, j]``, and every read goes through it. Reads see exactly what a
:class:`~kvdex.storage.DeviceStore` whose buffers were permuted in place holds.

The store is for one request (batch 1): vLLM batches change every step, so each request owns its stores and its
policy (:mod:`kvdex.vllm.requests`).
"""

from __future__ import annotations

import torch

from kvdex.kernels.attention import paged_decode_attention
from kvdex.kernels.dispatch import triton_kernel
from kvdex.selection import Selection
from kvdex.storage import AttendSet, Grid, LayerStore, MiddleUpdate, PageJoin, TransferStats, grown_capacity
from kvdex.vllm.paged import PagedDecode, gather_heads, token_slots, write_kv

# slots of room past the middle in a new relocation map (besides a quarter of the middle): the middle grows by
# a page every page_size decode steps, and a map that must grow is a new buffer, which recaptures the graphs
RELOCATION_ROOM = 1024


class BlockRow:
    """A request's block-table row: ``blocks`` [n] (long, on the cache's device), the vLLM blocks that hold its
    tokens in order. One object per request, shared by its stores; the metadata builder replaces ``blocks`` at
    every step (the row grows as the request does). ``persistent``: the whole row is also copied, in place, into
    the front of ``buffer`` (at least vLLM's block-table width; entries past the request's blocks are whatever
    vLLM or an earlier step left there, never read unmasked), which the stores read under static sizing: a
    captured decode step reads it by address. A table narrower than the buffer (vLLM versions that cut it to the
    batch's longest row) is copied into it as it is; a wider one re-allocates it, growing by at least a quarter,
    so that a row growing a block at a time does not change the graphs' key at every page."""

    def __init__(self, blocks: torch.Tensor, persistent: bool = False) -> None:
        self.blocks = blocks
        self.persistent = persistent
        self.buffer: torch.Tensor | None = None

    def assign(self, row: torch.Tensor, n: int) -> None:
        """This step's row: ``row`` [width] (long) of which the first ``n`` blocks hold the request's tokens."""
        self.blocks = row[:n].clone()
        if not self.persistent:
            return
        buf, width = self.buffer, row.shape[0]
        if buf is None or buf.shape[0] < width or buf.device != row.device or buf.dtype != row.dtype:
            cap = width if buf is None or buf.device != row.device else grown_capacity(width, buf.shape[0], 1)
            self.buffer = buf = row.new_zeros(cap)  # a new buffer: a new graph key (PagedStore.graph_buffers)
        buf[:width].copy_(row)


class PagedStore(LayerStore):
    """One layer's KV of one request in vLLM's blocks ``k_cache`` / ``v_cache`` ([num_blocks, block_size, H, D]),
    addressed through ``row``. ``writes``: ``ingest`` / ``append`` write the tokens they get into the blocks."""

    def __init__(
        self,
        grid: Grid,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        stats: TransferStats,
        *,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        row: BlockRow,
        writes: bool = False,
        decode: PagedDecode | None = None,
    ) -> None:
        super().__init__(grid, batch, kv_heads, head_dim, dtype, device, stats)
        if batch != 1:
            raise ValueError(f"a PagedStore holds one request (batch 1), got batch {batch}")
        if tuple(k_cache.shape[2:]) != (kv_heads, head_dim) or k_cache.shape != v_cache.shape:
            raise ValueError(
                f"k_cache / v_cache must be [num_blocks, block_size, {kv_heads}, {head_dim}], got "
                f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
            )
        self.k_cache, self.v_cache, self.row, self.writes = k_cache, v_cache, row, writes
        self.decode = decode  # dense decode in place over the blocks (vLLM's FlashAttention), else gather + kernel
        # [1, H, M]: middle slot j holds position sink + order[..., j] (identity past the relocated slots)
        self.order: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return int(self.k_cache.shape[1])

    # ---- reads through the block table --------------------------------------------------------------
    def slot_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Token positions [1, H, N] of the store slots ``slots`` [1, H, N] (``-1`` stays): the relocation map
        applied to middle slots, identity elsewhere."""
        if self.order is None:
            return slots
        m, s = self.order.shape[2], self.grid.sink
        j = slots - s
        mid = (j >= 0) & (j < m)
        return torch.where(mid, s + self.order.gather(2, j.clamp(0, m - 1)), slots)

    def _blocks(self) -> torch.Tensor:
        """The block-table row reads go through: the persistent whole row under static sizing (no length of this
        step baked into a captured step), else this step's blocks."""
        buf = self.row.buffer
        return buf if self.static and buf is not None else self.row.blocks

    def _addressable(self) -> int:
        """Tokens the block-table row reads go through can address (under static sizing: the whole persistent row,
        so that no length of this step is baked into a captured step)."""
        return self._blocks().shape[0] * self.block_size

    def _dense_span(self) -> int:
        """Tokens a read of every token covers: the whole persistent row under static sizing (past the length:
        masked by the kernels), else the longest length."""
        return self._addressable() if self.static else int(self.lengths_host.max())

    def _flat(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat cache slots [H, N], positions [1, H, N]) of store slots [1, H, N] (``-1``: none)."""
        pos = self.slot_positions(slots.long())
        return token_slots(self._blocks(), pos[0], self.block_size), pos

    def read(self, slots: torch.Tensor, values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Keys, values (None unless ``values``) [1, H, N, D] and positions [1, H, N] of store slots [1, H, N]
        (``-1`` or past the request's blocks: slot 0's row, which the caller masks)."""
        flat, pos = self._flat(slots)
        k = gather_heads(self.k_cache, flat)[None]
        v = gather_heads(self.v_cache, flat)[None] if values else None
        return k, v, pos

    def _range(self, first: int, n: int) -> torch.Tensor:
        """Store slots first .. first + n - 1 of every kv head, [1, H, n]."""
        return torch.arange(first, first + n, device=self.device).expand(1, self.kv_heads, n)

    # ---- writes -----------------------------------------------------------------------------------------
    def _write(self, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k / v [H, t, D] at positions first .. first + t - 1 (``writes=True`` only)."""
        pos = torch.arange(first, first + k.shape[1], device=self.device)
        slots = token_slots(self.row.blocks, pos, self.block_size)
        if bool((slots < 0).any()):
            raise ValueError(f"positions {first}..{first + k.shape[1] - 1} lie past the request's blocks")
        write_kv(self.k_cache, self.v_cache, slots, k.transpose(0, 1), v.transpose(0, 1))

    def ingest(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> MiddleUpdate:
        """The request's first ``lengths[0]`` tokens, k/v [1, H, L, D] in position order (in the blocks already
        unless ``writes``)."""
        n = int(lengths[0])
        if self.writes:
            self._write(0, k[0, :, :n], v[0, :, :n])
        self.order = None
        self.lengths_host = lengths.clone().long().cpu()
        self.lengths.copy_(self.lengths_host)
        nmid = self.grid.num_middle_pages(self.lengths_host)
        return self._middle_update(torch.zeros_like(nmid), nmid, k, v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> MiddleUpdate:
        """``t`` new tokens, k/v [1, H, t, D]: counted (written with ``writes``); the pages that join the middle
        are read back from the blocks for the policy's index."""
        before = self.grid.num_middle_pages(self.lengths_host)
        if self.writes:
            self._write(int(self.lengths_host[0]), k[0], v[0])
        self._advance(k.shape[2])
        count = self.grid.num_middle_pages(self.lengths_host) - before
        return self._joined(torch.where(count > 0, before, 0), count)

    def _joined(self, start: torch.Tensor, count: torch.Tensor) -> MiddleUpdate:
        g, h, d = self.grid, self.kv_heads, self.head_dim
        pn = int(count.max())
        if pn == 0:
            empty = torch.zeros(1, h, 0, g.page_size, d, dtype=self.dtype, device=self.device)
            return MiddleUpdate(start, count, empty, empty)
        first = g.sink + int(start[0]) * g.page_size  # pages past the relocation map: slot == position
        k, v, _ = self.read(self._range(first, pn * g.page_size))
        assert v is not None
        shape = (1, h, pn, g.page_size, d)
        return MiddleUpdate(start, count, k.reshape(shape), v.reshape(shape))

    # ---- the engine's reads ---------------------------------------------------------------------------
    def attend(self, sel: Selection) -> AttendSet:
        g, dev, h = self.grid, self.device, self.kv_heads
        sink = torch.arange(g.sink, device=dev).expand(1, g.sink)
        fixed = torch.cat([sink, self._window_slots_positions()], dim=1)  # [1, sink + window]
        fixed_valid = fixed < self.lengths[:, None]
        fixed = torch.where(fixed_valid, fixed, -1)[:, None, :].expand(1, h, -1)
        fixed_valid = fixed_valid[:, None, :].expand(1, h, -1)
        if sel.everything:  # static: every middle token the persistent row can address, masked past the length
            end = self._addressable() if self.static else int(g.window_start(self.lengths_host).max())
            mid = torch.arange(g.sink, max(end, g.sink), device=dev).expand(1, h, -1)
            mid_valid = mid < g.window_start(self.lengths)[:, None, None]
        elif sel.empty:
            mid = torch.empty(1, h, 0, dtype=torch.long, device=dev)
            mid_valid = torch.empty(1, h, 0, dtype=torch.bool, device=dev)
        else:
            mid = sel.token_positions(g.sink, g.page_size).to(dev)
            mid_valid = mid >= 0
        slots = torch.cat([fixed, mid.long()], dim=-1)
        valid = torch.cat([fixed_valid, mid_valid], dim=-1)
        k, v, pos = self.read(torch.where(valid, slots, -1))
        assert v is not None
        n = slots.shape[2]
        idx = torch.arange(n, device=dev).expand(1, h, n).contiguous()  # kernels index it by its strides
        return AttendSet(k, v, idx, valid, torch.where(valid, pos, 0))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, _ = self.read(self._range(0, self._dense_span()))
        assert v is not None
        return k, v

    def dense_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """With ``decode`` (the backend passes vLLM's FlashAttention), else on CUDA kvdex's Triton decode over the
        block table (:func:`~kvdex.kernels.triton_attention.block_table_decode_attention`): the query over the
        request's tokens in the blocks through its block-table row, no gather (every token: order-free, so a
        relocation map changes nothing). Under static sizing the bound is the whole row, the length a device
        tensor (capturable)."""
        decode = self.decode or triton_kernel("triton_attention", "block_table_decode_attention", on=q)
        if decode is None:  # the CPU: the tokens are gathered and attended by kvdex's decode (LayerEngine)
            return None
        return decode(q, self._blocks(), self.lengths, self._dense_span(), self.k_cache, self.v_cache, scale)

    def selection_decode(self, q, pages, tokens, scale, count=None):
        """On CUDA: kvdex's fused paged decode kernel reading the blocks in place through the block-table row
        (the persistent row under static sizing) and the relocation map (``paged_decode_attention`` with
        ``block_table`` and ``order``), in place of :meth:`attend`'s gathers + the decode kernel; else None."""
        g = self.grid
        return paged_decode_attention(
            q, self.k_cache, self.v_cache, pages, self.lengths, g.sink, g.page_size, g.window_pages, scale, tokens,
            count, block_table=self._blocks(), order=self.order,
        )  # fmt: skip

    def page_keys(self, pages: torch.Tensor) -> torch.Tensor:
        g = self.grid
        b, h, p = pages.shape
        slots = g.sink + pages.clamp(min=0).to(self.device)[..., None] * g.page_size
        slots = slots + torch.arange(g.page_size, device=self.device)
        k, _, _ = self.read(slots.view(b, h, p * g.page_size), values=False)
        return k.view(b, h, p, g.page_size, self.head_dim)

    def slot_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys [1, H, N, D] of the store slots ``slots`` [1, H, N] (``-1``: junk rows the caller masks), gathered
        from the blocks directly: fixed shapes, no host read."""
        slots = slots.to(self.device).long()
        return self.read(torch.where(slots >= 0, slots, 0), values=False)[0]

    def permute_middle(self, order: torch.Tensor, validate: bool = True) -> None:
        m = self._check_middle_order(order, validate)
        if m == 0:
            return
        cur = self.order
        have = 0 if cur is None else cur.shape[2]
        if m > have:  # a wider map (a new buffer, a new graph key): identity past the old one, room to grow
            cap = m + max(m // 4, RELOCATION_ROOM)
            full = torch.arange(cap, device=self.device).expand(1, self.kv_heads, -1).clone()
            if cur is not None:
                full[:, :, :have] = cur
            self.order = cur = full
        assert cur is not None  # m > 0: made above where there was none
        # in place: a captured decode step reads the map by address, so a refresh keeps the request's graphs
        cur[:, :, :m] = cur[:, :, :m].gather(2, order.to(self.device).long())

    # ---- sink and window keys (CHESS's window anchor reads them through ``k`` / ``window_slots``) --------
    def _window_positions(self) -> torch.Tensor:
        """[1, sink + window] positions of the sink and the window rows (some past the length)."""
        sink = torch.arange(self.grid.sink, device=self.device)[None, :]
        return torch.cat([sink, self._window_slots_positions()], dim=1)

    @property
    def k(self) -> torch.Tensor:  # type: ignore[override]
        """[1, H, sink + window, D]: the sink's and the window's keys, gathered from the blocks at each read
        (:meth:`window_slots` addresses them)."""
        pos = self._window_positions()
        valid = pos < self.lengths[:, None]
        slots = torch.where(valid, pos, -1)[:, None, :].expand(1, self.kv_heads, -1)
        return self.read(slots, values=False)[0]

    @k.setter
    def k(self, value: torch.Tensor) -> None:
        raise AttributeError("a PagedStore's keys live in vLLM's blocks")

    def window_slots(self, pos: torch.Tensor) -> torch.Tensor:
        ws = self.grid.window_start(self.lengths).view(-1, *([1] * (pos.dim() - 1)))
        return torch.where(pos < self.grid.sink, pos, self.grid.sink + pos - ws)

    # ---- capturable decode steps (kvdex.engine.graphs; the vLLM setting decode_graphs) ---------------------
    def append_join(self, k: torch.Tensor, v: torch.Tensor) -> PageJoin:
        """One token (k/v [1, H, 1, D], in the blocks already unless ``writes``) with static shapes: the joining
        page's keys are read from the blocks at the device lengths."""
        if k.shape[2] != 1:
            raise ValueError(f"append_join takes one token per sequence, got {k.shape[2]}")
        if self.writes:
            at = token_slots(self._blocks(), self.lengths.long(), self.block_size)
            write_kv(self.k_cache, self.v_cache, at, k[0].transpose(0, 1), v[0].transpose(0, 1))
        joins, start = self._join_pages(self.lengths)
        pos = self.grid.page_positions(start)  # [1, ps]: a joining page lies past the relocation map
        slots = pos[:, None, :].expand(1, self.kv_heads, -1)
        keys = self.read(slots, values=False)[0][:, :, None]
        self.lengths += 1
        host_start, host_count = self._advance_join()

        def values() -> torch.Tensor:  # read on first use (no policy indexes values)
            v = self.read(slots)[1]
            assert v is not None
            return v[:, :, None]

        return PageJoin(joins, start, keys, values, host_start, host_count, self, pos)

    def graph_unsupported(self) -> str | None:
        if self.row.buffer is None:
            return "its request's block-table row is not kept in a persistent buffer (the vLLM setting decode_graphs)"
        return None

    def graph_buffers(self) -> tuple:
        bufs = [(id(t), tuple(t.shape)) for t in (self.k_cache, self.v_cache, self.row.buffer) if t is not None]
        if self.order is not None:  # PRKV's relocation map, replaced at each refresh
            bufs.append((id(self.order), tuple(self.order.shape)))
        return tuple(bufs)

    # ---- capabilities -----------------------------------------------------------------------------------

    def device_bytes(self) -> int:
        """0: the keys and values belong to vLLM's cache, the store holds none."""
        return 0
