"""The slot lists a decode step reads, each in one Triton launch (a graph-replayed step pays ~2 us per kernel,
and these lists took 10-40 small PyTorch kernels per layer).

**Slot lists** (:func:`device_slot_list`, :func:`offload_slot_list`; twins: the stores' ``attend`` PyTorch
ops). A store's ``attend`` lists, per (sequence, kv head), the sink rows, the window rows and the selection's
rows, with their validity (and positions): 15-40 small kernels per layer (window start, ``token_positions``,
``cat``, clamps). One launch writes the same tensors; offloaded (``RING``): the window in its ring slots and
the fetched pages' rows from ``cursor`` on; GPU-resident: slot == position, pages then tokens. (A GPU-resident
decode step builds its list inside the paged attention kernel; ``DeviceStore.attend`` serves the steps that
hand the attended set to an observer: the evaluation's recall and needle diagnostics, H2O's scores.)

**A rerank's chosen slots** (:func:`rerank_slots`, twin :func:`kvdex.kernels.reference.rerank_slots_reference`).
A token rerank (``kvdex/policies/rerank.py``) picks ids into its candidates' flattened pages; their slots
(``sink + page * page_size + offset``), ``-1`` for none, behind a prefix (PRKV's static tokens) took ~10
kernels per layer (clamp, gather, where, a slot table of every candidate, a ``cat``). One launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slots_kernel(
    IDX,
    VALID,
    POS,
    LENS,
    PAGES,
    TOKS,
    H,
    P,
    T,
    N,
    cursor,
    sp_b,
    sp_h,
    st_b,
    st_h,
    SINK: tl.constexpr,
    PS: tl.constexpr,
    WP: tl.constexpr,
    RING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    bh = tl.program_id(0)
    cb = tl.program_id(1)
    b, h = bh // H, bh % H
    W: tl.constexpr = WP * PS
    F: tl.constexpr = SINK + W
    L = tl.load(LENS + b).to(tl.int64)
    ws = SINK + tl.maximum((tl.maximum(L - SINK, 0) + PS - 1) // PS - WP, 0) * PS  # Grid.window_start
    c = cb * BLOCK + tl.arange(0, BLOCK)
    inb = c < N
    # sink | window: position, valid below the length
    fpos = tl.where(c < SINK, c, ws + (c - SINK)).to(tl.int64)
    # the pages (Selection.token_positions), then the tokens
    j = tl.maximum(c - F, 0)
    is_p = (c >= F) & (j < P * PS)
    pid = tl.load(PAGES + b.to(tl.int64) * sp_b + h * sp_h + j // PS, mask=inb & is_p, other=-1).to(tl.int64)
    ppos = tl.where(pid >= 0, SINK + pid * PS + j % PS, -1)
    t = tl.maximum(j - P * PS, 0)
    is_t = (c >= F) & (j >= P * PS)
    tpos = tl.load(TOKS + b.to(tl.int64) * st_b + h * st_h + t, mask=inb & is_t, other=-1).to(tl.int64)
    is_f = c < F
    pos = tl.where(is_f, fpos, tl.where(is_p, ppos, tpos))
    ok = tl.where(is_f, fpos < L, pos >= 0)
    o = bh.to(tl.int64) * N + c
    if RING:  # OffloadStore: the window in its ring slots, the fetched pages' rows from `cursor` on
        fslot = tl.where(fpos < SINK, fpos, SINK + tl.maximum(fpos - SINK, 0) % W)
        tl.store(IDX + o, tl.where(is_f, fslot, cursor + j), mask=inb)
        tl.store(POS + o, pos, mask=inb)
    else:  # DeviceStore: slot == position; an invalid row reads slot 0 (masked)
        tl.store(IDX + o, tl.where(ok, pos, 0), mask=inb)
    tl.store(VALID + o, ok.to(tl.uint8), mask=inb)


def _slot_lists(lengths, pages, tokens, sink, page_size, window_pages, cursor, ring):
    b, h = (pages if pages is not None else tokens).shape[:2]
    p = 0 if pages is None else pages.shape[-1]
    t = 0 if tokens is None else tokens.shape[-1]
    if lengths.shape != (b,):
        raise ValueError(f"expected lengths [B] with B = {b}, got {tuple(lengths.shape)}")
    n = sink + window_pages * page_size + p * page_size + t
    dev = lengths.device
    idx = torch.empty(b, h, n, dtype=torch.long, device=dev)
    pos = torch.empty(b, h, n, dtype=torch.long, device=dev) if ring else idx
    valid = torch.empty(b, h, n, dtype=torch.uint8, device=dev)
    if b * h * n == 0:
        return idx, valid.view(torch.bool), pos
    pg = pages if not p or pages.stride(-1) == 1 else pages.contiguous()  # B and H strides as they are
    tk = tokens if not t or tokens.stride(-1) == 1 else tokens.contiguous()
    sp, stt = (pg.stride()[:2] if p else (0, 0)), (tk.stride()[:2] if t else (0, 0))
    pg, tk = (pg if p else lengths), (tk if t else lengths)  # an empty part is never read
    block = min(1024, triton.next_power_of_2(n))
    _slots_kernel[(b * h, triton.cdiv(n, block))](
        idx, valid, pos, lengths, pg, tk, h, p, t, n, cursor, sp[0], sp[1], stt[0], stt[1],
        SINK=sink, PS=page_size, WP=window_pages, RING=ring, BLOCK=block,
    )  # fmt: skip
    return idx, valid.view(torch.bool), pos


def offload_slot_list(
    lengths: torch.Tensor, pages: torch.Tensor, sink: int, page_size: int, window_pages: int, cursor: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lengths [B] (device), pages [B, H, P] (middle page ids, -1 = none), the first row of the fetched pages
    ``cursor`` -> ``(idx, valid, pos)`` [B, H, sink + window + P * page_size]: ``OffloadStore.attend``'s lists
    for that page selection (sink, window ring slots, then the pages' rows ``cursor ...``)."""
    if pages.dim() != 3:
        raise ValueError(f"expected pages [B, H, P], got {tuple(pages.shape)}")
    return _slot_lists(lengths, pages, None, sink, page_size, window_pages, cursor, ring=True)


def device_slot_list(
    lengths: torch.Tensor,
    pages: torch.Tensor | None,
    tokens: torch.Tensor | None,
    sink: int,
    page_size: int,
    window_pages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lengths [B] (device), the selection's pages [B, H, P] (middle page ids) and tokens [B, H, T] (positions;
    either may be None, each ``-1`` padded, any strides on B and H) -> ``(idx, valid)`` [B, H, sink + window +
    P * page_size + T]: ``DeviceStore.attend``'s lists (slot == position; an invalid row points at slot 0)."""
    if (pages is None and tokens is None) or any(x is not None and x.dim() != 3 for x in (pages, tokens)):
        raise ValueError("expected pages [B, H, P] and/or tokens [B, H, T]")
    idx, valid, _ = _slot_lists(lengths, pages, tokens, sink, page_size, window_pages, 0, ring=False)
    return idx, valid


@triton.jit
def _rerank_slots_kernel(OUT, IDS, PAGES, PRE, H, T, C, S, N, sp_b, sp_h, SINK, PS, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b, h = bh // H, bh % H
    j = tl.maximum(c - S, 0)
    is_t = (c >= S) & (c < N)
    i = tl.load(IDS + bh.to(tl.int64) * T + j, mask=is_t, other=-1).to(tl.int64)
    pid = tl.load(PAGES + bh.to(tl.int64) * C + tl.maximum(i, 0) // PS, mask=is_t & (i >= 0), other=-1).to(tl.int64)
    slot = tl.where(pid >= 0, SINK + pid * PS + i % PS, -1)
    pre = tl.load(PRE + b.to(tl.int64) * sp_b + h * sp_h + c, mask=c < S, other=-1).to(tl.int64)
    tl.store(OUT + bh.to(tl.int64) * N + c, tl.where(c < S, pre, slot), mask=c < N)


def rerank_slots(
    ids: torch.Tensor, pages: torch.Tensor, sink: int, page_size: int, prefix: torch.Tensor | None = None
) -> torch.Tensor:
    """ids [B, H, T] into the flattened candidate ``pages`` [B, H, C] (``C * page_size`` slots, ``-1``: none) ->
    their slots [B, H, S + T] (int64, ``-1`` for none) behind ``prefix`` [B, 1 or H, S] (optional)."""
    b, h, t = ids.shape
    s = 0 if prefix is None else prefix.shape[-1]
    n = s + t
    out = torch.empty(b, h, n, dtype=torch.long, device=ids.device)
    if b * h * n == 0:
        return out
    ids, pages = ids.contiguous(), pages.contiguous()
    pre = ids if not s else (prefix if prefix.stride(-1) == 1 else prefix.contiguous())  # s == 0: never read
    sp = (pre.stride(0), pre.stride(1) if pre.shape[1] > 1 else 0) if s else (0, 0)
    block = min(1024, triton.next_power_of_2(n))
    _rerank_slots_kernel[(b * h, triton.cdiv(n, block))](
        out, ids, pages, pre, h, t, pages.shape[-1], s, n, sp[0], sp[1], sink, page_size, BLOCK=block
    )
    return out
