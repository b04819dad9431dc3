"""Triton decode attention over a per-(sequence, kv head) set of slots (flash-decoding).

One split kernel serves every mode (idx/valid, dense, paged; a block table for vLLM's cache): the modes' wrappers
stay in this file beside the kernel whose constexpr arguments they set, which puts it past 400 lines.

One decode step attends, per (sequence b, kv head h), to the slots ``idx[b, h, :N]`` of the
layer's slot buffers ``k/v [B, H, S, D]`` (only where ``valid``). The PyTorch twin is
:func:`kvdex.kernels.reference.sparse_decode_attention_reference`; these kernels compute the same function:

* phase 1 (``_split_kernel``), grid ``(B*H, splits)``: each program owns one kv head of one
  sequence and one contiguous chunk of its selection. It loads the G query heads of the GQA group
  once (padded to a tile of >= 16 rows so the products use the tensor cores), gathers the selected
  K/V rows straight from the slot buffer (the "device gather" is fused into the attention: no copy
  of the selection is made), and keeps an online softmax (running max ``m``, sum ``l``, fp32
  accumulator) over tiles of ``BLOCK_N`` slots. It writes its partial ``(m, l, acc)``.
* phase 2 (``_combine_kernel``), grid ``(B*Hq,)``: merges the splits with the usual log-sum-exp
  rescaling and writes ``acc / l`` in the query dtype.

Splitting over the selection (flash-decoding) is what keeps the GPU busy at batch 1: with 8 kv
heads a kernel with one program per head would run on 8 of 132 SMs. The number of splits aims at
about two programs per SM.

``dense_decode_attention`` is the same kernel in "dense" mode: slot == position and the valid
slots of sequence b are ``[0, lengths[b])`` (ragged batch), so no index tensor is built at all;
it serves the dense layers and the ``full`` policy on a GPU-resident store.
``paged_decode_attention`` is the "paged" mode: the kernel builds ``DeviceStore.attend``'s slot list
(sink | window | the selected pages, from the device lengths and page ids) itself, so a page policy
on a GPU-resident store costs no index tensors either; with a block table it reads one request's tokens
in vLLM's paged cache in place (``PagedStore``: its block-table row, PRKV's relocation map).

Softmax statistics and accumulation are fp32. ``p`` is rounded to the value dtype before the
``p @ V`` product (as FlashAttention does); with fp32 inputs every product is exact IEEE fp32.

Kernels run compiled on CUDA tensors; with ``TRITON_INTERPRET=1`` set before triton is imported they
run through Triton's interpreter on CPU tensors (the CPU tests compare them with the twins that way).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(
    Q,
    K,
    V,
    IDX,
    VALID,
    LENS,
    M_OUT,
    L_OUT,
    ACC_OUT,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ib,
    stride_ih,
    stride_lb,
    stride_lh,
    H,
    N,
    chunk,
    splits,
    scale_log2,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,  # 0: idx/valid, 1: dense (slot == position < LENS[b]), 2: resident pages
    PREC: tl.constexpr,
    SINK: tl.constexpr = 0,
    PS: tl.constexpr = 16,
    WP: tl.constexpr = 1,
    TOK=None,  # MODE 2 with tokens: [B, H, T] selected positions (-1: none) listed after the pages
    stride_tb=0,
    stride_th=0,
    NPAGES=0,  # MODE 2 with tokens: the pages' count P (the tokens start at index P * PS of the middle)
    HAS_TOK: tl.constexpr = False,
    CNT=None,  # with HAS_CNT: a 0-dim int64 counter, += the valid slots this program attended
    HAS_CNT: tl.constexpr = False,
    BT=None,  # MODE 1 / 2 with HAS_BT: [B, n] block table (position p of sequence b: row BT[b, p // PS] * PS + p % PS)
    stride_bt=0,
    HAS_BT: tl.constexpr = False,
    ORD=None,  # MODE 2 with HAS_ORD: [1, H, NORD] relocation map (middle slot j holds position SINK + ORD[h, j])
    stride_oh=0,
    NORD=0,
    HAS_ORD: tl.constexpr = False,
):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid // H
    h = pid % H
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    q_ptrs = Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=gmask[:, None] & dmask[None, :], other=0.0)

    if MODE == 1:
        n_b = tl.load(LENS + b).to(tl.int32)  # one type for `end` in both branches below
    else:
        n_b = N
    if MODE == 2:  # DeviceStore.attend's slot list, built here: sink | window | selected pages
        L = tl.load(LENS + b).to(tl.int32)
        nmid = tl.maximum((tl.maximum(L - SINK, 0) + PS - 1) // PS - WP, 0)
        ws = SINK + nmid * PS  # window start
    start = sid * chunk
    end = start + chunk
    if end > n_b:
        end = n_b

    # finite "minus infinity" for the running max: exp2(-inf + 1e30) == 0 and never NaN
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n_ok = tl.zeros([BLOCK_N], dtype=tl.int32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        if MODE == 1:
            slot = offs_n
            ok = in_range
            if HAS_BT:  # a paged cache read in place: the position's row of its block
                blk = tl.load(BT + b * stride_bt + slot // PS, mask=ok, other=0).to(tl.int64)
                slot = blk * PS + slot % PS
        elif MODE == 2:
            i = offs_n - (SINK + WP * PS)  # index into the expanded page selection (then the tokens)
            ic = tl.maximum(i, 0)
            is_page = i >= 0
            if HAS_TOK:
                is_page = is_page & (i < NPAGES * PS)
            page = tl.load(IDX + b * stride_ib + h * stride_ih + ic // PS, mask=in_range & is_page, other=-1)
            page = page.to(tl.int32)
            fixed = offs_n < SINK + WP * PS
            slot = tl.where(offs_n < SINK, offs_n, tl.where(fixed, ws + offs_n - SINK, SINK + page * PS + ic % PS))
            ok = in_range & tl.where(fixed, slot < L, page >= 0)
            if HAS_TOK:
                it = i - NPAGES * PS
                is_tok = it >= 0
                tok = tl.load(TOK + b * stride_tb + h * stride_th + tl.maximum(it, 0), mask=in_range & is_tok, other=-1)
                tok = tok.to(tl.int32)
                slot = tl.where(is_tok, tok, slot)
                ok = tl.where(is_tok, in_range & (tok >= 0), ok)
            if HAS_ORD:  # a store slot of the relocated middle -> the position it holds
                j = slot - SINK
                mid = (j >= 0) & (j < NORD)
                moved = tl.load(ORD + h * stride_oh + tl.minimum(tl.maximum(j, 0), NORD - 1), mask=ok & mid, other=0)
                slot = tl.where(mid, SINK + moved.to(tl.int32), slot)
            if HAS_BT:  # a paged cache read in place: the position's row of its block
                blk = tl.load(BT + b * stride_bt + tl.maximum(slot, 0) // PS, mask=ok, other=0).to(tl.int64)
                slot = blk * PS + tl.maximum(slot, 0) % PS
        else:
            slot = tl.load(IDX + b * stride_ib + h * stride_ih + offs_n, mask=in_range, other=0)
            flag = tl.load(VALID + b * stride_lb + h * stride_lh + offs_n, mask=in_range, other=0)
            ok = in_range & (flag != 0)
        if HAS_CNT:
            n_ok += ok.to(tl.int32)
        kv_mask = ok[:, None] & dmask[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    row = (b * H + h) * G + offs_g  # query head index b*Hq + h*G + g
    tl.store(M_OUT + row * splits + sid, m_i, mask=gmask)
    tl.store(L_OUT + row * splits + sid, l_i, mask=gmask)
    acc_ptrs = ACC_OUT + (row[:, None] * splits + sid) * D + offs_d[None, :]
    tl.store(acc_ptrs, acc, mask=gmask[:, None] & dmask[None, :])
    if HAS_CNT:
        tl.atomic_add(CNT, tl.sum(n_ok, axis=0).to(tl.int64))


@triton.jit
def _combine_kernel(
    M_IN,
    L_IN,
    ACC_IN,
    OUT,
    splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)  # b * Hq + query head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < splits
    dmask = offs_d < D
    m = tl.load(M_IN + row * splits + offs_s, mask=smask, other=-1.0e30)
    l_s = tl.load(L_IN + row * splits + offs_s, mask=smask, other=0.0)
    acc = tl.load(
        ACC_IN + (row * splits + offs_s)[:, None] * D + offs_d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - m_all)
    total = tl.sum(l_s * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / total  # nothing valid at all -> 0/0 = NaN, as the twin
    tl.store(OUT + row * D + offs_d, o.to(OUT.dtype.element_ty), mask=dmask)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


def choose_splits(bh: int, n: int, block_n: int, device: torch.device) -> int:
    """Splits of the selection so that about two programs run per SM (at least one tile each)."""
    tiles = triton.cdiv(max(n, 1), block_n)
    if device.type == "cuda":
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4  # interpreter: a few splits so CPU tests exercise the combine step
    return max(1, min(tiles, triton.cdiv(target, max(bh, 1)), 64))


def _check(q, k, v):
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, Hq, D] and k/v [B, H, S, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    b, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)} (GQA needs Hq % H == 0)")
    if k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("k/v must be contiguous in the head dimension")


def _launch(q, k, v, idx, valid, lens, n, scale, mode, splits, block_n, grid=(0, 16, 1), tokens=None, count=None,
            bt=None, order=None):  # fmt: skip
    b, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    q = q.contiguous()
    block_n = block_n or (64 if d <= 128 else 32)
    if splits is None:
        splits = choose_splits(b * h, n, block_n, q.device)
    chunk = triton.cdiv(triton.cdiv(max(n, 1), splits), block_n) * block_n
    splits = max(1, triton.cdiv(max(n, 1), chunk))
    dev = q.device
    m_part = torch.empty(b * hq * splits, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(b * hq * splits * d, dtype=torch.float32, device=dev)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=dev)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if mode == 1:
        idx = valid = lens
        si = (0, 0, 0, 0)
    elif mode == 2:
        valid = idx
        si = (idx.stride(0), idx.stride(1), 0, 0)
    else:
        si = (idx.stride(0), idx.stride(1), valid.stride(0), valid.stride(1))
        lens = idx
    _split_kernel[(b * h, splits)](
        q, k, v, idx, valid, lens, m_part, l_part, acc_part,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *si,
        h, n, chunk, splits, scale * _LOG2E,
        G=g, BLOCK_G=_pow2(g, 16), D=d, BLOCK_D=_pow2(d, 16), BLOCK_N=block_n, MODE=mode, PREC=prec,
        SINK=grid[0], PS=grid[1], WP=grid[2],
        **({} if tokens is None else dict(TOK=tokens, stride_tb=tokens.stride(0), stride_th=tokens.stride(1),
                                          NPAGES=idx.shape[2], HAS_TOK=True)),
        **({} if count is None else dict(CNT=count, HAS_CNT=True)),
        **({} if bt is None else dict(BT=bt, stride_bt=bt.stride(0), HAS_BT=True)),
        **({} if order is None else dict(ORD=order, stride_oh=order.stride(1), NORD=order.shape[2], HAS_ORD=True)),
    )  # fmt: skip
    _combine_kernel[(b * hq,)](m_part, l_part, acc_part, out, splits, D=d, BLOCK_D=_pow2(d, 16), BLOCK_S=_pow2(splits))
    return out


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    *,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`kvdex.kernels.attention.sparse_decode_attention` (same arguments)."""
    _check(q, k, v)
    b, hq, _ = q.shape
    h = k.shape[1]
    if idx.shape[:2] != (b, h) or valid.shape != idx.shape:
        raise ValueError(f"idx/valid must be [B, H, N] = [{b}, {h}, N], got {tuple(idx.shape)}, {tuple(valid.shape)}")
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    if valid.dtype != torch.bool or valid.stride(-1) != 1:
        valid = valid.to(torch.bool).contiguous()
    valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    return _launch(q, k, v, idx, valid, None, idx.shape[-1], scale, 0, splits, block_n)


def dense_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    max_len: int | None = None,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """One decode step over the first ``lengths[b]`` slots of ``k/v [B, H, S, D]`` (slot == position).

    ``max_len`` (>= every length, <= S; default S) only sizes the launch grid: pass the host-side
    maximum so no device value has to be read.
    """
    _check(q, k, v)
    if lengths.shape != (q.shape[0],):
        raise ValueError(f"lengths must be [B] = [{q.shape[0]}], got {tuple(lengths.shape)}")
    n = k.shape[2] if max_len is None else int(max_len)
    if n > k.shape[2]:
        raise ValueError(f"max_len ({n}) exceeds the slot buffer ({k.shape[2]})")
    lens = lengths.to(q.device)  # read as stored (int64): no conversion kernel
    return _launch(q, k, v, None, None, lens, n, scale, 1, splits, block_n)


def _paged_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache [num_blocks, block_size, H, D] as the kernel's slot buffers [1, H, rows, D] (views; row r is
    flat slot r, which a block table addresses)."""
    nb, bs, h, d = k_cache.shape
    return k_cache.view(1, nb * bs, h, d).transpose(1, 2), v_cache.view(1, nb * bs, h, d).transpose(1, 2)


def block_table_decode_attention(
    q: torch.Tensor,
    blocks: torch.Tensor,
    lengths: torch.Tensor,
    capacity: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's decode over its tokens in a paged cache, read in place: q [1, Hq, D]; k/v_cache [num_blocks,
    block_size, H, D]; ``blocks`` [n] its block-table row (position p lies in block ``blocks[p // block_size]``);
    the first ``lengths[0]`` positions attended, ``capacity`` (a host int, <= n * block_size) sizing the grid, so
    that a CUDA graph captures it. Twin: :func:`kvdex.vllm.paged.decode_attention_reference`."""
    bs = k_cache.shape[1]
    if capacity > blocks.shape[0] * bs:
        raise ValueError(f"capacity {capacity} exceeds the row's {blocks.shape[0]} blocks of {bs}")
    k, v = _paged_views(k_cache, v_cache)
    _check(q, k, v)
    return _launch(q, k, v, None, None, lengths.to(q.device), capacity, scale, 1, None, None, (0, bs, 1),
                   bt=blocks.to(q.device).reshape(1, -1))  # fmt: skip


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
    *,
    tokens: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Decode over a GPU-resident store (slot == position) without building its slot list.

    Attends, per (sequence b, kv head h), to what ``DeviceStore.attend`` lists for a page selection:
    the sink ``[0, sink)``, the window (``window_pages`` grid pages from the window start implied by
    ``lengths[b]``), then every token of ``pages[b, h]`` (middle page ids, ``-1`` = none), each valid
    only below ``lengths[b]``; the slot list is computed inside the kernel, in the same order, so
    the result equals ``DeviceStore.attend`` + :func:`sparse_decode_attention` (twin:
    :func:`kvdex.kernels.reference.paged_decode_reference`). ``tokens`` [B, H, T] (middle positions, ``-1`` =
    none): a token selection's (or a selection of pages and tokens: PRKV's static pages with its reranked
    tokens), listed after the pages as ``Selection.token_positions`` lists them; ``pages`` may then be [B, H, 0].
    ``count`` (a 0-dim int64 tensor on q's device): the attended slots are added into it in place, as
    :func:`kvdex.kernels.reference.paged_attended_count_reference` counts them (``Cache.stats()``'s attended
    tokens, no extra launch).

    ``block_table`` [n] (one sequence): ``k`` / ``v`` are a paged cache [num_blocks, page_size, H, D] (vLLM's
    layout) read in place, position p in row ``block_table[p // page_size] * page_size + p % page_size``; with
    ``order`` [1, H, M], the store's slots of the middle are relocated (slot ``sink + j`` holds position ``sink +
    order[0, h, j]`` for j < M). The same result as ``kvdex.vllm.store.PagedStore.attend`` +
    :func:`sparse_decode_attention`.
    """
    bt = None
    if block_table is not None:  # a paged cache: [1, H, rows, D] views of it, rows addressed through the table
        if k.shape[1] != page_size or q.shape[0] != 1:
            raise ValueError(f"a block table needs one sequence and blocks of the page size, got {k.shape[1]} != "
                             f"{page_size}")  # fmt: skip
        k, v = _paged_views(k, v)
        bt = block_table.to(q.device).reshape(1, -1).contiguous()  # (a no-op for a row of a table)
    _check(q, k, v)
    b, h = k.shape[:2]
    if order is not None and (bt is None or order.dim() != 3 or order.shape[:2] != (1, h)):
        raise ValueError(f"order must be [1, H, M] = [1, {h}, M] with a block table, got {tuple(order.shape)}")
    if order is not None and order.stride(-1) != 1:
        order = order.contiguous()
    if pages.dim() != 3 or pages.shape[:2] != (b, h):
        raise ValueError(f"pages must be [B, H, P] = [{b}, {h}, P], got {tuple(pages.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B] = [{b}], got {tuple(lengths.shape)}")
    if pages.stride(-1) != 1:
        pages = pages.contiguous()
    n = sink + window_pages * page_size + pages.shape[2] * page_size
    if tokens is not None:
        if tokens.dim() != 3 or tokens.shape[:2] != (b, h):
            raise ValueError(f"tokens must be [B, H, T] = [{b}, {h}, T], got {tuple(tokens.shape)}")
        if tokens.stride(-1) != 1:
            tokens = tokens.contiguous()
        n += tokens.shape[2]
    if count is not None and (count.dim() != 0 or count.dtype != torch.long or count.device != q.device):
        raise ValueError(f"count must be a 0-dim int64 tensor on {q.device}, got {count.dtype} {tuple(count.shape)}")
    lens = lengths.to(q.device)  # read as stored (int64): no conversion kernel
    return _launch(q, k, v, pages, None, lens, n, scale, 2, splits, block_n, (sink, page_size, window_pages),
                   tokens=tokens, count=count, bt=bt, order=order)  # fmt: skip
