"""The device page cache's bookkeeping of one step in one Triton launch (:func:`page_cache_step`).

An offloaded store with ``page_cache=C`` (``kvdex.storage.page_cache``) keeps C page slots per (sequence,
kv head) on the device. Each step decides, for the selected pages, which are already there (hits, by
tag), which slots the misses take (the least recently used, ties to the lowest slot), updates the tags,
stamps and hit / miss counters in place and writes the selection's token rows -- a dozen small PyTorch
ops per layer and step, one kernel here (one program per (sequence, kv head)), with static shapes so a
CUDA graph captures it. The misses are then copied in by ``kvdex.kernels.uva.fill_slots``.

Twin (the spec): the PyTorch path of ``OffloadStore._cached_pages`` (``kvdex.storage.page_cache``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PC_CHUNK = 32  # slots compared with the selection at a time (tests lower it to run several chunks)


@triton.jit
def _pc_step_kernel(
    PAGES,
    TAG,
    STAMP,
    TICK,
    COUNT,
    SLOT_TOK,
    DST,
    P,
    C,
    base,
    PS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One (sequence, kv head) of a device page-cache step: the same decisions as
    ``OffloadStore._cached_pages`` (hits by tag, misses to the least recently used free slots, ties to
    the lowest slot), tags / stamps / counters updated in place, the selection's token rows written.

    No [P, C] or [C, C] matrix is held at once (the first version ranked the slots by an all-pairs
    comparison and spilled its registers: 3.4 ms per step on the H200 at 30 layers): hits are found
    CHUNK slots at a time; the hit slots are stamped with this step's tick first, so a sort of all slots
    by (stamp, slot) lists the free ones first, least recently used first (every older stamp < tick);
    the r-th miss takes the r-th entry (a gather); tags and stamps of the misses are scattered."""
    bh = tl.program_id(0).to(tl.int64)
    po = tl.arange(0, BLOCK_P)
    pm = po < P
    pages = tl.load(PAGES + bh * P + po, mask=pm, other=-1)
    live = pages >= 0
    tick = tl.load(TICK)
    row0 = bh * (C + 1)
    hit_slot = tl.full([BLOCK_P], -1, tl.int64)
    for c0 in range(0, C, CHUNK):
        cc = c0 + tl.arange(0, CHUNK)
        tags = tl.load(TAG + row0 + cc, mask=cc < C, other=-2)
        eq = ((pages[:, None] == tags[None, :]) & live[:, None]).to(tl.int32)
        found = tl.max(eq, axis=1) > 0
        first = tl.argmax(eq, axis=1).to(tl.int64) + c0
        hit_slot = tl.where(found & (hit_slot < 0), first, hit_slot)
    hit = hit_slot >= 0
    miss = live & (hit_slot < 0)
    tl.store(STAMP + row0 + hit_slot, tick, mask=hit)
    tl.debug_barrier()
    co = tl.arange(0, BLOCK_C)
    stamps = tl.load(STAMP + row0 + co, mask=co < C, other=0)
    key = tl.where(co < C, (stamps + 1) * BLOCK_C + co, 9223372036854775807)  # stamps >= -1: keys >= 0
    order = tl.sort(key) % BLOCK_C  # slots by (last use, slot): the free ones first
    rmiss = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    miss_slot = tl.gather(order, tl.where(miss, rmiss, 0), 0)
    tl.store(TAG + row0 + miss_slot, pages, mask=miss)
    tl.store(STAMP + row0 + miss_slot, tick, mask=miss)
    tl.store(DST + bh * P + po, tl.where(miss, miss_slot, -1), mask=pm)
    slot = tl.where(hit, hit_slot, tl.where(miss, miss_slot, 0))
    nh = tl.sum(hit.to(tl.int64), axis=0)
    nm = tl.sum(miss.to(tl.int64), axis=0)
    tl.store(COUNT + bh * 2, tl.load(COUNT + bh * 2) + nh)
    tl.store(COUNT + bh * 2 + 1, tl.load(COUNT + bh * 2 + 1) + nm)
    # token rows of the selection in the pool: base + slot * PS + 0..PS-1 (dead entries: slot 0, masked later)
    so = tl.arange(0, PS)
    rows = base + slot[:, None] * PS + so[None, :]
    tl.store(SLOT_TOK + (bh * P + po)[:, None] * PS + so[None, :], rows, mask=pm[:, None])


def page_cache_step(
    pages: torch.Tensor,
    tag: torch.Tensor,
    stamp: torch.Tensor,
    tick: torch.Tensor,
    count: torch.Tensor,
    base: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bookkeeping of one device page-cache step in one launch (one program per (sequence, kv head)).

    pages [B, H, P] int64 (-1 padding, distinct otherwise); tag / stamp [B, H, C+1] int64 (the pool's page
    ids and last-use steps; column C unused), tick: int64 scalar tensor (this step's stamp), count [B, H, 2]
    int64 (hits, misses; accumulated) -- all updated in place. Returns (token rows [B, H, P*page_size]:
    ``base + slot*page_size + i`` for each selected page, dst [B, H, P]: the slot a miss is copied to, or -1).
    Same decisions as the PyTorch path ``OffloadStore._cached_pages`` (the twin).
    """
    b, h, p = pages.shape
    c = tag.shape[-1] - 1
    if tag.shape != (b, h, c + 1) or stamp.shape != tag.shape or count.shape != (b, h, 2):
        raise ValueError("page_cache_step: tag / stamp must be [B, H, C+1] and count [B, H, 2]")
    for name, t in (("pages", pages), ("tag", tag), ("stamp", stamp), ("count", count), ("tick", tick)):
        if t.dtype != torch.long or not t.is_contiguous():
            raise ValueError(f"page_cache_step: {name} must be a contiguous int64 tensor")
    rows = torch.empty(b, h, p * page_size, dtype=torch.long, device=pages.device)
    dst = torch.empty(b, h, p, dtype=torch.long, device=pages.device)
    if b * h * p == 0:
        return rows, dst.fill_(-1)
    _pc_step_kernel[(b * h,)](
        pages, tag, stamp, tick, count, rows, dst, p, c, base,
        PS=page_size, BLOCK_P=triton.next_power_of_2(p), BLOCK_C=triton.next_power_of_2(c),
        CHUNK=min(_PC_CHUNK, triton.next_power_of_2(c)), num_warps=4,
    )  # fmt: skip
    return rows, dst
