"""vLLM's paged KV cache as kvdex reads it: the layout, the block table -> slot / page mapping, gathers and writes.

**Layout** (the one place it is defined; the backend's ``get_kv_cache_shape`` returns :func:`kv_cache_shape`): one
tensor per attention layer, ``[2, num_blocks, block_size, kv_heads, head_size]`` -- keys then values, each a run
of blocks of ``block_size`` tokens, a token's heads side by side (FlashAttention's classic layout).
:func:`split_kv` gives the two ``[num_blocks, block_size, kv_heads, head_size]`` views.

**Addresses.** Token ``p`` of a request sits in its block-table row's block ``blocks[p // block_size]``, at offset
``p % block_size``; its flat slot is ``block * block_size + offset`` (what vLLM's ``slot_mapping`` holds for the
tokens of a step, ``-1`` = :data:`PAD_SLOT_ID` for padding). vLLM's block size must equal kvdex's page size, and
the sink a whole number of pages, so that kvdex's middle page ``g`` is exactly the request's block
``sink // page_size + g`` (:func:`page_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PAD_SLOT_ID = -1


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The shape of one layer's KV cache tensor: ``(2, num_blocks, block_size, num_kv_heads, head_size)``."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def split_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache), each ``[num_blocks, block_size, kv_heads, head_size]``, views of ``kv_cache``."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        shape = tuple(kv_cache.shape)
        raise ValueError(f"a kvdex KV cache is [2, num_blocks, block_size, kv_heads, head_size], got {shape}")
    return kv_cache[0], kv_cache[1]


def check_block_size(block_size: int, page_size: int) -> None:
    """ValueError unless vLLM's block size equals kvdex's page size."""
    if block_size != page_size:
        raise ValueError(
            f"kvdex's page size ({page_size}) must equal vLLM's KV block size ({block_size}): start vLLM with "
            f"--block-size {page_size} (LLM(..., block_size={page_size})), or set page_size={block_size} in "
            "--additional-config '{\"kvdex\": {...}}'"
        )


def token_slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slots of the token ``positions`` (any shape; ``-1``: none) of a request whose block-table row is
    ``blocks`` [n] (long): ``blocks[p // block_size] * block_size + p % block_size``, ``-1`` where the position is
    negative or past the row's blocks."""
    pos = positions.long()
    idx = pos // block_size
    inside = (pos >= 0) & (idx < blocks.shape[0])
    block = blocks.long()[idx.clamp(0, max(blocks.shape[0] - 1, 0))] if blocks.numel() else torch.zeros_like(idx)
    return torch.where(inside, block * block_size + pos % block_size, PAD_SLOT_ID)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [num_blocks, block_size, H, D] as [num_blocks * block_size, H, D] (a view: writes land in it)."""
    return cache.view(-1, cache.shape[2], cache.shape[3])


def gather_heads(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [H, N, D] of ``cache`` [num_blocks, block_size, H, D]: head ``h``'s row at flat slot ``slots[h, n]``
    (``-1``: slot 0's row, to be masked by the caller)."""
    h = cache.shape[2]
    if slots.dim() != 2 or slots.shape[0] != h:
        raise ValueError(f"slots must be [kv_heads={h}, N], got {tuple(slots.shape)}")
    heads = torch.arange(h, device=cache.device)[:, None]
    return _rows(cache)[slots.clamp(min=0).to(cache.device), heads]


def gather_tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [N, H, D] of ``cache`` at the flat ``slots`` [N] (every head; ``-1``: slot 0's row)."""
    return _rows(cache)[slots.clamp(min=0).to(cache.device)]


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` [T, H, D] into ``cache`` at the flat ``slots`` [T]; :data:`PAD_SLOT_ID` entries are skipped (the
    PyTorch form of vLLM's ``reshape_and_cache_flash``). Nothing is read back to the host (no device sync, as in
    every layer of every step): a padding entry writes a real entry's row again, to that entry's slot, and when
    every entry is padding the cache's first row is written back unchanged."""
    if slots.numel() == 0:
        return
    flat = _rows(cache)
    keep = slots >= 0
    first = keep.int().argmax().view(1)  # a real entry (entry 0 when there is none); a tensor index, not an int
    target = torch.where(keep, slots, slots.index_select(0, first)).clamp(min=0).long()
    src = torch.where(keep[:, None, None], rows, rows.index_select(0, first)).to(cache.dtype)
    src = torch.where(keep.any(), src, flat[:1])
    flat.index_put_((target,), src)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """A step's keys and values [T, H, D] into the caches at the flat ``slots`` [T] (padding skipped): the PyTorch
    form of the cache write (:func:`kvdex.vllm.kernels.vllm_cache_write` is vLLM's own kernel, one launch)."""
    write_slots(k_cache, slots, key)
    write_slots(v_cache, slots, value)


def prefill_attention_reference(
    q: torch.Tensor, blocks: torch.Tensor, seq_len: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """A prompt chunk's attention over its request's tokens in the paged cache: q [n, Hq, D] the queries of
    positions ``seq_len - n ... seq_len - 1``, attending causally to the request's first ``seq_len`` tokens, whose
    block-table row is ``blocks``. Returns [n, Hq, D]. PyTorch: the keys and values gathered from the blocks, then
    fused SDPA with a lower-right causal mask; vLLM's FlashAttention on the paged cache computes the same
    (:func:`kvdex.vllm.kernels.flash_prefill`)."""
    from kvdex.kernels.attention import causal_chunk_attention

    k, v = request_kv(blocks, seq_len, k_cache, v_cache)
    return causal_chunk_attention(q.transpose(0, 1).unsqueeze(0), k, v, scale)[0]


@dataclass(frozen=True)
class DenseBatch:
    """A step's batch as a policy that attends every token needs it: vLLM's per-request query offsets [n + 1],
    lengths after the step [n] and block-table rows [n, max_blocks] (device tensors, as vLLM's own FlashAttention
    takes them), with the bounds ``max_query_len`` / ``max_seq_len``."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


#: ``(q [T, Hq, D], batch, k_cache, v_cache, scale, out [T, Hq, D]) -> None``: every request's queries of the step
#: attending causally to its tokens in the paged cache, written into ``out`` (:func:`batch_attention_reference` is
#: its PyTorch form, vLLM's FlashAttention varlen kernel its CUDA form)
BatchAttention = Callable[[torch.Tensor, DenseBatch, torch.Tensor, torch.Tensor, float, torch.Tensor], None]


def batch_attention_reference(
    q: torch.Tensor, batch: DenseBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """Each request's queries ``q[start:end]`` (its offsets in ``batch.query_start_loc``) attending causally to its
    first ``seq_lens`` tokens (:func:`prefill_attention_reference`, one request at a time), into ``out``; rows
    with no query or no token are left as they are."""
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    for i, n in enumerate(lens):
        s, e = int(qsl[i]), int(qsl[i + 1])
        if e > s and n > 0:
            o = prefill_attention_reference(q[s:e], batch.block_table[i], int(n), k_cache, v_cache, scale)
            out[s:e] = o.to(out.dtype)


#: ``(q [1, Hq, D], block-table row, lengths [1] (device), capacity, k_cache, v_cache, scale) -> [1, Hq, D]``: a
#: decode query's attention over all of its request's tokens in the paged cache, read in place
#: (:func:`decode_attention_reference` is its PyTorch form)
PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decode_attention_reference(
    q: torch.Tensor,
    blocks: torch.Tensor,
    lengths: torch.Tensor,
    capacity: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query q [1, Hq, D] of a request attending all of its ``lengths[0]`` tokens (a device tensor [1])
    in the paged cache, whose block-table row is ``blocks``; ``capacity`` (a host int) bounds the length, so that
    no host read of the length is needed. Returns [1, Hq, D]. PyTorch: the first ``capacity`` tokens of the row
    gathered, those at or past the length masked; vLLM's FlashAttention on the paged cache computes the same
    (:func:`kvdex.vllm.kernels.flash_decode`)."""
    from kvdex.kernels.attention import dense_decode_attention

    pos = torch.arange(capacity, device=k_cache.device)
    slots = token_slots(blocks.to(k_cache.device), pos, k_cache.shape[1]).clamp(min=0)  # past the row: masked
    k = gather_tokens(k_cache, slots).transpose(0, 1).unsqueeze(0)
    v = gather_tokens(v_cache, slots).transpose(0, 1).unsqueeze(0)
    return dense_decode_attention(q, k, v, lengths.to(k.device).long(), scale, max_len=None)


def request_kv(
    blocks: torch.Tensor, length: int, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` tokens' keys and values [1, H, length, D] of the request whose block-table row is
    ``blocks``, gathered from the cache."""
    pos = torch.arange(length, device=k_cache.device)
    slots = token_slots(blocks.to(k_cache.device), pos, k_cache.shape[1])
    if bool((slots < 0).any()):
        raise ValueError(f"the request's block-table row ({blocks.shape[0]} blocks) does not cover {length} tokens")
    k = gather_tokens(k_cache, slots).transpose(0, 1).unsqueeze(0)
    v = gather_tokens(v_cache, slots).transpose(0, 1).unsqueeze(0)
    return k, v


def page_blocks(blocks: torch.Tensor, pages: torch.Tensor, sink: int, page_size: int) -> torch.Tensor:
    """vLLM block ids of kvdex middle ``pages`` (any shape, ``-1``: none) of a request whose block-table row is
    ``blocks`` [n]; ``-1`` stays. Needs ``sink % page_size == 0`` and block size == page size."""
    if sink % page_size:
        raise ValueError(f"sink ({sink}) must be a multiple of page_size ({page_size}) to map pages to blocks")
    idx = pages.long() + sink // page_size
    ok = (pages >= 0) & (idx < blocks.shape[0])
    return torch.where(ok, blocks.long()[idx.clamp(0, max(blocks.shape[0] - 1, 0))], -1)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token's attention over the token ``positions`` [H, N] (``-1`` padded; per kv head) of a request
    whose block-table row is ``blocks``: q [Hq, D] -> [Hq, D], in fp32 (GQA: query head ``i`` reads kv head
    ``i // (Hq // H)``). The specification of a decode step over a selection on the paged layout."""
    hq, d = q.shape
    h = positions.shape[0]
    slots = token_slots(blocks, positions, k_cache.shape[1])
    valid = slots >= 0
    k = gather_heads(k_cache, slots).float()  # [H, N, D]
    v = gather_heads(v_cache, slots).float()
    qg = q.float().view(h, hq // h, d)
    s = torch.einsum("hgd,hnd->hgn", qg, k) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hgn,hnd->hgd", p, v).reshape(hq, d)
