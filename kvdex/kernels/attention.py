"""Attention kernels: the PyTorch reference implementations (the spec, run by CPU CI).

Fast Triton versions plug in behind the same functions (``sparse_decode_attention`` is the
seam): they must match these twins on every shape the tests use.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.reference import sparse_decode_attention_reference

__all__ = [
    "causal_chunk_attention",
    "dense_attention",
    "dense_decode_attention",
    "paged_decode_attention",
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
]


def sparse_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode step over a per-(sequence, kv head) set of slots.

    q [B, Hq, D]; k/v [B, H, S, D] slot buffers; idx/valid [B, H, N]. Hq = H * G (GQA: the G
    query heads of a group share their kv head's slots). Softmax in fp32. Returns [B, Hq, D].
    CUDA inputs run the Triton kernel (``KVDEX_TRITON=0`` forces the reference), others the
    PyTorch reference :func:`sparse_decode_attention_reference`.
    """
    fast = triton_kernel("triton_attention", on=q)
    if fast is not None:
        return fast.sparse_decode_attention(q, k, v, idx, valid, scale)
    return sparse_decode_attention_reference(q, k, v, idx, valid, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    sink: int,
    page_size: int,
    window_pages: int,
    scale: float,
    tokens: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Decode over a GPU-resident store for a page and / or token selection, the slot list built in the kernel.

    Same result as ``DeviceStore.attend(Selection(pages=pages, tokens=tokens))`` + :func:`sparse_decode_attention`
    (see ``kvdex.kernels.triton_attention.paged_decode_attention``). Returns None when the fast
    kernel does not apply (not CUDA, no triton, ``KVDEX_TRITON=0``): the caller takes that path (and counts).
    ``count``: a 0-dim int64 device counter the kernel adds the attended slots to, in place. ``block_table`` /
    ``order``: k / v are a paged cache read through one sequence's block-table row (``PagedStore``).
    """
    fast = triton_kernel("triton_attention", on=q) if os.environ.get("KVDEX_PAGED", "1") != "0" else None
    if fast is None:
        return None
    return fast.paged_decode_attention(
        q, k, v, pages, lengths, sink, page_size, window_pages, scale, tokens=tokens, count=count,
        block_table=block_table, order=order,
    )  # fmt: skip


def dense_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float, max_len: int | None = None
) -> torch.Tensor:
    """One decode step over the first ``lengths[b]`` slots of k/v [B, H, S, D] (slot == position).

    q [B, Hq, D] -> [B, Hq, D]. CUDA inputs run the Triton kernel in dense mode; the reference
    is :func:`dense_attention` with the query at position ``lengths - 1``.
    """
    fast = triton_kernel("triton_attention", on=q)
    if fast is not None:
        return fast.dense_decode_attention(q, k, v, lengths, scale, max_len=max_len)
    pos = (lengths.to(q.device) - 1)[:, None]
    key_mask = torch.arange(k.shape[2], device=q.device)[None, :] < lengths.to(q.device)[:, None]
    return dense_attention(q[:, :, None], k, v, pos, key_mask, scale)[:, 0]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float,
    chunk: int = 2048,
) -> torch.Tensor:
    """Causal dense attention, chunked over query rows (SDPA).

    q [B, Hq, T, D] at key-index positions q_pos [B, T]; k/v [B, H, L, D]; key_mask [B, L] bool
    (False = padding) or None. ``q_pos=None`` (with T == L, no key_mask) is a plain causal prefill,
    served by one fused SDPA call that never materialises the score matrix. Key j is visible to
    query i of sequence b iff ``j <= q_pos[b, i]`` and ``key_mask[b, j]``. A row that sees no key
    (a padding query) attends to its own slot, so no NaN appears. Returns [B, T, Hq, D] (transformers' output layout).
    """
    b, hq, t, d = q.shape
    h, L = k.shape[1], k.shape[2]
    if q_pos is None:  # the T queries are the first T positions of T keys, no padding: fused causal kernel
        if key_mask is not None or t != L:
            raise ValueError("dense_attention: q_pos=None needs T == L and no key_mask")
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=h != hq)
        return o.transpose(1, 2)
    # a prefill (T > 1; a decode step must not read device values on the host: CUDA graphs)
    pads = _left_pads(q_pos, key_mask, t, L) if t > 1 else None
    if pads is not None:  # left padding, queries at the last T positions: fused causal kernels per sequence
        return _left_padded_attention(q, k, v, pads, scale)
    # Bound the score matrix a chunk materialises on backends without fused masking.
    rows = max(1, min(chunk, (1 << 27) // max(1, b * hq * L)))
    j = torch.arange(L, device=q.device)
    km = None if key_mask is None else key_mask.to(device=q.device, dtype=torch.bool)[:, None, :]
    out = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    for i0 in range(0, t, rows):
        qp = q_pos[:, i0 : i0 + rows].to(q.device)[:, :, None]  # [B, c, 1]
        mask = j <= qp
        if km is not None:
            mask = (mask & km) | (j == qp)
        o = F.scaled_dot_product_attention(
            q[:, :, i0 : i0 + rows], k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=h != hq
        )
        out[:, i0 : i0 + rows] = o.transpose(1, 2)
    return out


def _left_pads(q_pos: torch.Tensor, key_mask: torch.Tensor | None, t: int, L: int) -> list[int] | None:
    """Padding tokens per sequence when ``key_mask`` is left padding (False then True) and every
    sequence's T queries sit at positions L - T ... L - 1; else None (the general masked path)."""
    if key_mask is None or t > L:
        return None
    km = key_mask.to(torch.bool).cpu()
    if km.shape[1] != L or bool((km[:, 1:] < km[:, :-1]).any()):  # a True before a False: not left padding
        return None
    if not bool((q_pos.cpu() == torch.arange(L - t, L)[None, :]).all()):
        return None
    return (L - km.sum(1)).tolist()


def _left_padded_attention(q, k, v, pads: list[int], scale: float) -> torch.Tensor:
    """``dense_attention`` for a left-padded batch: each sequence's real queries attend causally to its
    real keys through :func:`causal_chunk_attention` (flash attention on CUDA, no mask in memory); a
    padding query attends to its own slot only, as on the masked path."""
    b, hq, t, d = q.shape
    h, L = k.shape[1], k.shape[2]
    g = hq // h
    out = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    for i, p in enumerate(pads):
        first = max(0, p - (L - t))  # the first real query of sequence i
        if first:  # padding rows: their own slot's value (only these rows, not the whole batch)
            out[i, :first] = v[i, :, L - t : L - t + first].repeat_interleave(g, dim=0).transpose(0, 1)
        if first < t:
            kb, vb = k[i : i + 1, :, p:], v[i : i + 1, :, p:]
            out[i : i + 1, first:] = causal_chunk_attention(q[i : i + 1, :, first:], kb, vb, scale)
    return out


def causal_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, max_bytes: int = 1 << 30
) -> torch.Tensor:
    """The last T of L positions attending causally to all L keys (a prefill chunk on a filled cache).

    q [B, Hq, T, D]; k/v [B, H, L, D], every sequence exactly L real keys (no padding); query i sits
    at position L - T + i. Fused SDPA with a lower-right causal bias (flash attention on CUDA), so
    no [T, L] score matrix is materialised there. GQA: each call takes a group of kv heads with
    their K/V repeated for their query heads, at most ``max_bytes`` of repeated K/V per call.
    Returns [B, T, Hq, D] (transformers' output layout).
    """
    from torch.nn.attention.bias import causal_lower_right

    b, hq, t, d = q.shape
    h, L = k.shape[1], k.shape[2]
    if hq % h or t > L:
        raise ValueError(f"causal_chunk_attention: {hq} query heads over {h} kv heads, T={t} > L={L}")
    g = hq // h
    bias = causal_lower_right(t, L)
    if g == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale).transpose(1, 2)
    per_head = 2 * b * g * L * d * k.element_size()
    step = max(1, min(h, max_bytes // max(per_head, 1)))
    out = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    for h0 in range(0, h, step):
        h1 = min(h, h0 + step)
        kk = k[:, h0:h1].repeat_interleave(g, dim=1)
        vv = v[:, h0:h1].repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q[:, h0 * g : h1 * g], kk, vv, attn_mask=bias, scale=scale)
        out[:, :, h0 * g : h1 * g] = o.transpose(1, 2)
    return out
