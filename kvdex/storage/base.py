"""What every layer store provides, and the small objects it hands to policies and kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.selection import Selection
from kvdex.storage.joins import MiddleUpdate, PageJoin, host_joins
from kvdex.storage.layout import Grid


@dataclass
class AttendSet:
    """Device-resident K/V buffers and, per (sequence, kv head), the slots to attend.

    k, v: [B, H, S, D]; idx: [B, H, N] slot ids into S; valid: [B, H, N] bool.
    ``positions`` [B, H, N] are the token positions of those slots (for metrics).
    """

    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_calls: int = 0
    fields: dict = field(default_factory=dict)


def fast_append(on: torch.Tensor | None = None):
    """kvdex.kernels.append_triton.append_rows when triton imports and ``on`` (the store's buffer, if given) is on
    CUDA (``KVDEX_TRITON=0``: the PyTorch writes). The device and offloaded stores' gate, imported by each as
    ``_fast_append`` (tests switch it per module)."""
    return triton_kernel("append_triton", "append_rows", on=on)


class LayerStore(ABC):
    """KV of one layer for a batch, in HND layout: per (sequence, kv head) a run of pages.

    What the engine (``kvdex.hf``) and the policies may ask a store, instead of testing its
    class: :attr:`static`, :attr:`offloaded`, :attr:`positional_slots`, :attr:`page_cache`,
    :meth:`graph_unsupported`, :meth:`graph_buffers`, :meth:`grows_on_append`, :meth:`reserve_prompt`
    and :meth:`window_slots`.
    """

    #: The device key buffer [B, H, slots, D] every store keeps (a policy may read keys in place).
    k: torch.Tensor
    #: The device value buffer beside it (the paged decode kernel reads both in place).
    v: torch.Tensor
    #: Static sizing (CUDA-graph decoding, :mod:`kvdex.engine.graphs`): reads of the store and the
    #: selections made over it keep shapes that no host value decides (``dense`` returns the whole slot
    #: buffer, policies score their whole reserved index), so one captured step replays on every step.
    #: Off by default; switched on by :meth:`use_static_sizing` (never off again for this store).
    static: bool = False
    #: True for a store whose tokens the policy lays out by semantic pages (IceCache's offloaded store:
    #: ``place`` puts each indexed token in its page), False for stores laid out by position.
    places_pages: bool = False
    #: Page slots per (sequence, kv head) of a device page cache over host-held pages (0: none;
    #: :meth:`page_cache_stats` counts its hits and misses).
    page_cache: int = 0

    def __init__(self, grid: Grid, batch: int, kv_heads: int, head_dim: int, dtype, device, stats: TransferStats):
        self.grid = grid
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.stats = stats
        self.lengths_host = torch.zeros(batch, dtype=torch.long)  # real tokens per sequence (CPU)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        # the append kernels' per-sequence counters when they advance ``lengths`` themselves (kvdex.kernels.
        # append_triton, ``advance=True``): zero between launches; made here, never during a capture
        self.lengths_ticket = torch.zeros(batch, dtype=torch.int32, device=self.device)

    # ---- writes -------------------------------------------------------------------------
    @abstractmethod
    def ingest(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> MiddleUpdate:
        """First tokens of every sequence, left-aligned: k/v [B, H, L, D]; ``lengths`` [B] (CPU)."""

    @abstractmethod
    def append(self, k: torch.Tensor, v: torch.Tensor) -> MiddleUpdate:
        """New tokens, one column per step for every sequence: k/v [B, H, t, D]."""

    # ---- reads --------------------------------------------------------------------------
    @abstractmethod
    def attend(self, sel: Selection) -> AttendSet:
        """Sink + window + the selected middle, as device slots."""

    @abstractmethod
    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All tokens on the device, left-aligned: k/v [B, H, Lmax, D] (rows past a length are junk)."""

    def dense_keys(self) -> torch.Tensor:
        """Every token's key on the device, left-aligned [B, H, Lmax, D], as :meth:`dense` gives it: what scoring
        the whole context reads (a store that reads the middle from the host reads no values for it)."""
        return self.dense()[0]

    def dense_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """One query per sequence, q [B, Hq, D], attending every token the store holds -> [B, Hq, D], computed by
        the store where it has a way that reads its tokens in place (e.g. vLLM's paged cache through its block
        table); None: the engine attends :meth:`dense` instead (the default)."""
        return None

    def selection_decode(
        self, q: torch.Tensor, pages: torch.Tensor, tokens: torch.Tensor | None, scale: float,
        count: torch.Tensor | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """One query per sequence, q [B, Hq, D], attending the sink, the window and a selection's middle ``pages``
        [B, H, P] and ``tokens`` [B, H, T] (store slots, ``-1`` padded; T may be None) -> [B, Hq, D], in one kernel
        that lists the slots and reads the tokens in place, where the store has one (``count``: a 0-dim device
        counter the kernel adds the attended slots to); None: the engine gathers them with :meth:`attend` instead
        (the default)."""
        return None

    def middle_keys(self) -> torch.Tensor:
        """Keys of the middle region on the device, [B, H, Pmax*ps, D] (slot j == position sink+j)."""
        k, _ = self.dense()
        nmid = int(self.grid.num_middle_pages(self.lengths_host).max())
        s = self.grid.sink
        return k[:, :, s : s + nmid * self.grid.page_size]

    def page_keys(self, pages: torch.Tensor) -> torch.Tensor:
        """Keys of the middle pages ``pages`` [B, H, P] (slot pages; ``-1``: rows of junk the caller masks)
        on the device, [B, H, P, ps, D]: what a policy reads to rank the tokens of candidate pages
        (``rerank``). Fixed shapes, no host read under static sizing. Default: gathered from :meth:`dense`
        (in place where ``dense`` is a view of the device buffer)."""
        g = self.grid
        k, _ = self.dense()
        b, h, p = pages.shape
        slots = g.sink + pages.clamp(min=0).to(k.device)[..., None] * g.page_size
        slots = (slots + torch.arange(g.page_size, device=k.device)).clamp(max=k.shape[2] - 1)
        rows = k.gather(2, slots.view(b, h, p * g.page_size, 1).expand(-1, -1, -1, k.shape[-1]))
        return rows.view(b, h, p, g.page_size, k.shape[-1])

    def slot_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys of the middle tokens at ``slots`` [B, H, N] (positions; ``-1``: junk rows the caller masks) on the
        device, [B, H, N, D]: read through :meth:`page_keys` as the distinct pages of each row (one fetch of their
        keys on an offloaded store; IceCache's candidates, which semantic pages scatter over positional pages).
        Reads the rows' page count on the host."""
        g = self.grid
        slots = slots.to(self.device).long()
        page = torch.where(slots >= 0, (slots - g.sink).div(g.page_size, rounding_mode="floor"), -1)
        srt, order = page.sort(dim=-1)
        new = torch.ones_like(srt, dtype=torch.bool)
        new[..., 1:] = srt[..., 1:] != srt[..., :-1]
        rank = new.cumsum(-1) - 1  # each sorted entry's place among its row's distinct pages
        width = int(rank.max()) + 1 if rank.numel() else 0
        pages = torch.full((*slots.shape[:2], width), -1, dtype=torch.long, device=self.device)
        pages.scatter_(-1, rank, srt)
        where = torch.empty_like(rank).scatter_(-1, order, rank)  # each slot's page among the fetched ones
        keys = self.page_keys(pages).flatten(2, 3)  # [B, H, width * ps, D]
        at = where * g.page_size + (slots - g.sink).remainder(g.page_size)
        return keys.gather(2, at.clamp(min=0)[..., None].expand(-1, -1, -1, keys.shape[-1]))

    # ---- restructuring (PRKV) -----------------------------------------------------------
    def permute_middle(self, order: torch.Tensor, validate: bool = True) -> None:
        """Reorder the middle tokens of every (sequence, kv head) in place (PRKV's relocation).

        ``order`` [B, H, M], M = the longest middle in tokens: afterwards middle slot j of (b, h)
        holds what was in middle slot ``order[b, h, j]`` (slot j == position sink + j before any
        reordering). Each row must be a permutation of 0..M-1 that leaves the slots past the
        sequence's own middle in place (``ValueError`` otherwise; ``validate=False`` checks the shape
        only, without the check's host sync, for a caller whose order is one by construction). Keys
        carry their rotary position already, so attention over a reordered store is unchanged; only
        which slot holds which token moves.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot reorder its middle tokens")

    def _check_middle_order(self, order: torch.Tensor, validate: bool = True) -> int:
        """Validate a :meth:`permute_middle` order (``validate=False``: its shape only); returns M."""
        g = self.grid
        m = int(g.num_middle_pages(self.lengths_host).max()) * g.page_size
        if order.dim() != 3 or tuple(order.shape) != (self.batch, self.kv_heads, m) or order.is_floating_point():
            want = f"[{self.batch}, {self.kv_heads}, {m}]"
            raise ValueError(f"order must be an integer tensor {want}, got {tuple(order.shape)} {order.dtype}")
        if not validate:
            return m
        ar = torch.arange(m, device=order.device)
        # one host sync for both checks, no sort: every slot is named once (in range, each counted once) ...
        inside = (order >= 0) & (order < m)
        seen = torch.zeros(order.shape, dtype=torch.int32, device=order.device)
        seen.scatter_add_(2, order.clamp(0, max(m - 1, 0)).long(), inside.to(torch.int32))
        bad_perm = ~inside.all() | (seen != 1).any()
        # ... and the slots past a sequence's own middle stay where they are
        own = (g.num_middle_pages(self.lengths_host) * g.page_size).to(order.device)  # [B]
        tail = ar[None, None, :] >= own[:, None, None]
        bad_tail = (tail & (order != ar)).any()
        bad = torch.stack([bad_perm, bad_tail]).tolist()
        if bad[0]:
            raise ValueError("order must be a permutation of the middle slots 0..M-1 in every row")
        if bad[1]:
            raise ValueError("order must leave the slots past a sequence's own middle in place")
        return m

    # ---- capturable page joins (CUDA-graph decoding, kvdex.engine.graphs) ------------------
    def append_join(self, k: torch.Tensor, v: torch.Tensor) -> PageJoin:
        """One new token per sequence (k/v [B, H, 1, D]) with static shapes: every device op is the same
        whichever sequences' oldest window page joins the middle (a device mask), so a CUDA graph can
        capture it. The host side (lengths, counters) is :meth:`advance_host`; the device memory the
        step writes must be reserved first (:meth:`reserve_join`). Same end state as :meth:`append`."""
        raise NotImplementedError(f"{type(self).__name__} has no capturable append")

    def reserve_join(self, tokens: int) -> None:
        """Outside a captured step: make room for sequences of up to ``tokens`` tokens. Default: nothing."""
        return None

    def advance_host(self, t: int = 1) -> None:
        """The host side of appending ``t`` tokens per sequence (what a replayed step leaves to the CPU)."""
        self.lengths_host += t

    def count_join(self, count: torch.Tensor) -> None:
        """The host counters of a :meth:`append_join` in which ``count`` [B] (CPU) pages joined. Default: none."""
        return None

    def _advance_join(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host side of :meth:`append_join`: (start, count) of the joining pages, lengths advanced, counted."""
        start, count = host_joins(self.grid, self.lengths_host)
        self.advance_host(1)
        self.count_join(count)
        return start, count

    def _join_pages(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device (joins [B] bool, start [B] long) for appending one token to sequences of ``lengths``
        (device) tokens; ``start`` is the page id for every row (the window's first page where none joins)."""
        g = self.grid
        before = g.num_middle_pages(lengths)
        return g.num_middle_pages(lengths + 1) > before, before

    # ---- capabilities (what the engine asks instead of the store's class) -------------------------
    def use_static_sizing(self) -> None:
        """Switch :attr:`static` on (the CUDA-graph decoder, and tests that run its kernels eagerly)."""
        self.static = True

    @property
    def offloaded(self) -> bool:
        """True when the middle lives in host memory (a dense read copies it to the device)."""
        return False

    @property
    def positional_slots(self) -> bool:
        """True when the device buffers ``k`` / ``v`` hold every token at slot == its position (the fused
        paged decode kernel and the dense decode read them directly)."""
        return False

    def graph_unsupported(self) -> str | None:
        """Why a decode step over this store cannot be captured in a CUDA graph, or None."""
        return f"the store {type(self).__name__} has no graph support"

    def graph_buffers(self) -> tuple:
        """(id, shape) of every buffer a captured step reads by address: a re-allocated one means a new
        CUDA graph (part of the decoder's graph key)."""
        return ((id(self.k), tuple(self.k.shape)),)

    def grows_on_append(self, t: int = 1) -> bool:
        """Whether appending ``t`` tokens per sequence re-allocates a device buffer (such a step is not
        capturable). Default: never."""
        return False

    def reserve_prompt(self, tokens: int) -> None:
        """Size the buffers for a prompt of ``tokens`` tokens (plus decode slack) before it is all
        appended (chunked prefill), so they do not grow chunk after chunk. Default: nothing."""
        return None

    def window_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Slots in the device buffers ``k`` / ``v`` of sink or window ``pos`` (any shape, device)."""
        raise NotImplementedError(f"{type(self).__name__} does not map window positions to device slots")

    def page_cache_stats(self) -> dict:
        """Hits, misses and bytes moved by the device page cache (:attr:`page_cache`); {} without one."""
        return {}

    @abstractmethod
    def device_bytes(self) -> int: ...

    def host_bytes(self) -> int:
        return 0

    # ---- shared helpers -----------------------------------------------------------------
    def _advance(self, t: int, device: bool = True) -> None:
        """``t`` tokens appended per sequence: the host lengths, and the device ones unless the append kernel
        advanced them in its launch (``device=False``)."""
        self.lengths_host += t
        if device:
            self.lengths += t

    def _window_slots_positions(self) -> torch.Tensor:
        """[B, W] positions of the window rows (some past the length: invalid)."""
        start = self.grid.window_start(self.lengths)
        return start[:, None] + torch.arange(self.grid.window, device=self.device)[None, :]

    def _middle_update(
        self, start: torch.Tensor, count: torch.Tensor, k_pos: torch.Tensor, v_pos: torch.Tensor | None = None
    ) -> MiddleUpdate:
        """Build an update from position-indexed k_pos [B, H, >=..., D] (slot == position)."""
        ps, s = self.grid.page_size, self.grid.sink
        pn = int(count.max()) if count.numel() else 0
        b, h, d = self.batch, self.kv_heads, self.head_dim
        if pn == 0:
            empty = k_pos.new_zeros(b, h, 0, ps, d)
            return MiddleUpdate(start, count, empty, empty if v_pos is not None else None)
        first = int(start[count > 0].min())
        last = int((start + count).max())

        # Slice the covering range once, then shift rows per sequence only when starts differ.
        def pages(x):
            span = x[:, :, s + first * ps : s + last * ps].reshape(b, h, last - first, ps, d)
            if bool((start[count > 0] == first).all()):
                return span[:, :, :pn]
            out = x.new_zeros(b, h, pn, ps, d)
            for bi in range(b):
                c = int(count[bi])
                if c:
                    o = int(start[bi]) - first
                    out[bi, :, :c] = span[bi, :, o : o + c]
            return out

        return MiddleUpdate(start, count, pages(k_pos), pages(v_pos) if v_pos is not None else None)


def strip_left_padding(x: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] left-padded -> left-aligned (rows past each length are left as they were)."""
    if int(pads.max()) == 0:
        return x
    out = torch.empty_like(x)
    width = x.shape[2]
    for b, p in enumerate(pads.tolist()):
        out[b, :, : width - p] = x[b, :, p:]
        out[b, :, width - p :] = 0
    return out
