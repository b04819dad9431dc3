"""GPU-resident store (``offload=False``): every token stays on the device; selection only
changes which slots the attention reads (CHESS's zero-copy reconstruction)."""

from __future__ import annotations

import torch

from kvdex.kernels.attention import paged_decode_attention
from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.reference import append_join_rows_reference, page_rows, permute_slots_reference
from kvdex.selection import Selection
from kvdex.storage.base import AttendSet, LayerStore
from kvdex.storage.base import fast_append as _fast_append
from kvdex.storage.joins import MiddleUpdate, PageJoin

# Capacity grows in steps of at least this many tokens (and 25%), so a decode step
# almost never reallocates.
_GROW_TOKENS = 1024


def _fast_append_join(on: torch.Tensor | None = None):
    """kvdex.kernels.append_triton.append_join_rows, as :func:`_fast_append` (else ``append_join_rows_reference``)."""
    return triton_kernel("append_triton", "append_join_rows", on=on)


def _fast_slot_list(on: torch.Tensor | None = None):
    """kvdex.kernels.slots_triton.device_slot_list on CUDA (``KVDEX_TRITON=0``: the PyTorch ops of ``attend``)."""
    return triton_kernel("slots_triton", "device_slot_list", on=on)


class DeviceStore(LayerStore):
    """k/v: [B, H, capacity, D]; slot == token position (left padding stripped)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k = self.v = None

    def _reserve(self, need: int) -> None:
        cap = 0 if self.k is None else self.k.shape[2]
        if need <= cap:
            return
        ps = self.grid.page_size
        new_cap = max(need, cap + max(_GROW_TOKENS, cap // 4))
        new_cap = -(-new_cap // ps) * ps
        shape = (self.batch, self.kv_heads, new_cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None:
            n = int(self.lengths_host.max())
            k[:, :, :n] = self.k[:, :, :n]
            v[:, :, :n] = self.v[:, :, :n]
        self.k, self.v = k, v

    # ---- capabilities ---------------------------------------------------------------------------
    def selection_decode(self, q, pages, tokens, scale, count=None):
        """The fused paged decode kernel over the slot buffers (CUDA; else None)."""
        g = self.grid
        return paged_decode_attention(
            q, self.k, self.v, pages, self.lengths, g.sink, g.page_size, g.window_pages, scale, tokens, count
        )

    @property
    def positional_slots(self) -> bool:
        return True

    def graph_unsupported(self) -> str | None:
        return None

    def grows_on_append(self, t: int = 1) -> bool:
        return int(self.lengths_host.max()) + t > self.k.shape[2]

    def reserve_prompt(self, tokens: int) -> None:
        self._reserve(tokens + _GROW_TOKENS)

    def window_slots(self, pos: torch.Tensor) -> torch.Tensor:
        return pos

    def ingest(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> MiddleUpdate:
        self.lengths_host = lengths.clone()
        self._reserve(k.shape[2])
        n = k.shape[2]
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        nmid = self.grid.num_middle_pages(self.lengths_host)
        self.lengths.copy_(self.lengths_host)
        return self._middle_update(torch.zeros_like(nmid), nmid, self.k, self.v)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> MiddleUpdate:
        t = k.shape[2]
        before = self.grid.num_middle_pages(self.lengths_host)
        self._reserve(int(self.lengths_host.max()) + t)
        fast = _fast_append(self.k)
        if fast is not None:  # one Triton launch instead of six kernels, lengths advanced (kvdex.kernels.append_triton)
            fast(self.k, self.v, k, v, self.lengths, advance=True, ticket=self.lengths_ticket)
        else:
            pos = self.lengths[:, None] + torch.arange(t, device=self.device)[None, :]  # [B, t]
            bi = torch.arange(self.batch, device=self.device)[:, None].expand_as(pos)
            self.k[bi, :, pos] = k.permute(0, 2, 1, 3)
            self.v[bi, :, pos] = v.permute(0, 2, 1, 3)
        self._advance(t, device=fast is None)
        after = self.grid.num_middle_pages(self.lengths_host)
        return self._middle_update(before, after - before, self.k, self.v)

    def reserve_join(self, tokens: int) -> None:
        self._reserve(tokens)

    def append_join(self, k: torch.Tensor, v: torch.Tensor) -> PageJoin:
        """:meth:`append` of one token with static shapes (the capacity is reserved beforehand; a step that
        must grow the buffer is not capturable): the joining page is read at the device start."""
        if k.shape[2] != 1:
            raise ValueError(f"append_join takes one token per sequence, got {k.shape[2]}")
        self._reserve(int(self.lengths_host.max()) + 1)  # a no-op when reserved ahead (host check only)
        fast = _fast_append_join(self.k)
        if fast is not None:  # one launch on CUDA: the write, the joining page, its keys, the lengths advanced
            joins, start, keys, pos = fast(
                self.k, self.v, k, v, self.lengths, self.grid, advance=True, ticket=self.lengths_ticket
            )
        else:
            joins, start, keys, pos = append_join_rows_reference(self.k, self.v, k, v, self.lengths, self.grid)
            self.lengths += 1
        host_start, host_count = self._advance_join()
        values = lambda: self.v.gather(2, page_rows(pos, self.v))[:, :, None]  # noqa: E731 (no policy reads them)
        return PageJoin(joins, start, keys, values, host_start, host_count, self, pos)

    def attend(self, sel: Selection) -> AttendSet:
        g, dev = self.grid, self.device
        b, h = self.batch, self.kv_heads
        fast = None if sel.everything or sel.empty else _fast_slot_list(self.k)
        if fast is not None:  # the lists below in one launch on CUDA (kvdex.kernels.slots_triton)
            idx, valid = fast(self.lengths, sel.pages, sel.tokens, g.sink, g.page_size, g.window_pages)
            return AttendSet(self.k, self.v, idx, valid, idx)
        sink = torch.arange(g.sink, device=dev).expand(b, g.sink)
        win = self._window_slots_positions()
        fixed = torch.cat([sink, win], dim=1)  # [B, sink + window]
        fixed_valid = fixed < self.lengths[:, None]
        # window rows past the length may lie past the buffer when sink % page_size != 0 (e.g. page 32,
        # sink 16): point them at slot 0 (they are masked) so no kernel gathers out of bounds
        fixed = torch.where(fixed_valid, fixed, 0)
        fixed = fixed[:, None, :].expand(b, h, -1)
        fixed_valid = fixed_valid[:, None, :].expand(b, h, -1)
        if sel.everything:
            mid = torch.arange(g.sink, int(g.window_start(self.lengths_host).max()), device=dev)
            mid = mid.expand(b, h, -1)
            mid_valid = mid < g.window_start(self.lengths)[:, None, None]
        elif sel.empty:
            mid = torch.empty(b, h, 0, dtype=torch.long, device=dev)
            mid_valid = torch.empty(b, h, 0, dtype=torch.bool, device=dev)
        else:
            mid = sel.token_positions(g.sink, g.page_size)
            mid_valid = mid >= 0
            mid = mid.clamp(min=0)
        idx = torch.cat([fixed, mid], dim=-1)
        valid = torch.cat([fixed_valid, mid_valid], dim=-1)
        return AttendSet(self.k, self.v, idx, valid, idx)

    def permute_middle(self, order: torch.Tensor, validate: bool = True) -> None:
        m = self._check_middle_order(order, validate)
        if m == 0:
            return
        permute = triton_kernel("permute_triton", "permute_slots_", on=self.k) or permute_slots_reference
        permute(self.k, order, self.grid.sink)
        permute(self.v, order, self.grid.sink)

    def dense(self):
        # static (set by a CUDA-graph decode, kvdex.bench.graph): the whole buffer, so no length is
        # baked into a captured step; rows past each length are masked by the kernels.
        n = self.k.shape[2] if self.static else int(self.lengths_host.max())
        return self.k[:, :, :n], self.v[:, :, :n]

    def device_bytes(self) -> int:
        """Bytes of the keys and values of the tokens held (each sequence's length), not of the buffers: their
        capacity runs ahead of the tokens (:data:`_GROW_TOKENS`, 25 % on growth)."""
        if self.k is None:
            return 0
        return 2 * int(self.lengths_host.sum()) * self.kv_heads * self.head_dim * self.k.element_size()
