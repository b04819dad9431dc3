"""PyTorch twins that the Triton kernels are checked against (and that the CPU paths call), plus the page-grid
arithmetic they share with ``kvdex.storage.layout.Grid``, in plain integers so that no kernel imports a store.
"""

from __future__ import annotations

import torch


def sparse_decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """The PyTorch twin (spec) of :func:`sparse_decode_attention`."""
    b, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    gi = idx[..., None].expand(-1, -1, -1, d)
    ks = k.gather(2, gi).float()  # [B, H, N, D]
    vs = v.gather(2, gi).float()
    qg = q.view(b, h, g, d).float()
    s = torch.einsum("bhgd,bhnd->bhgn", qg, ks) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", p, vs)
    return out.reshape(b, hq, d).to(q.dtype)


def window_start(lengths: torch.Tensor, sink: int, page_size: int, window_pages: int) -> torch.Tensor:
    """First window position per sequence for ``lengths`` [B] tokens (``Grid.window_start``)."""
    grid_pages = ((lengths - sink).clamp(min=0) + page_size - 1) // page_size
    return sink + (grid_pages - window_pages).clamp(min=0) * page_size


def ring_push_reference(
    rq: torch.Tensor, rp: torch.Tensor, rv: torch.Tensor, q: torch.Tensor, pos: torch.Tensor, offset: int = 0
):
    """A query ring's push in place (``kvdex.policies.observation.QueryRing``; Triton:
    ``query_ring_triton.ring_push_``): the ring rq [B, Hq, S, D], positions rp [B, S] and validity rv [B, S]
    shift by one row, q [B, Hq, D] at positions pos + offset [B] becomes the newest (valid) row."""
    rq.copy_(torch.cat([rq[:, :, 1:], q[:, :, None]], dim=2))
    rp.copy_(torch.cat([rp[:, 1:], pos.to(rp.device, torch.long)[:, None] + offset], dim=1))
    rv.copy_(torch.cat([rv[:, 1:], torch.ones(rv.shape[0], 1, dtype=torch.bool, device=rv.device)], dim=1))


_Q_CHUNK = 16  # observation queries scored at a time by attention_mass_reference (bounds its [.., chunk, L] weights)


def attention_mass_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    key_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed softmax weights per query head, by key slot (Triton: ``obs_triton.attention_mass``): q [B, Hq, W, D]
    at positions q_pos [B, W] (valid rows q_valid [B, W]), keys k [B, H, L, D] whose slot j holds position
    ``key_pos[b, h, j]`` (None: j) -> [B, Hq, L] fp32. Key slot j is seen by query i iff its position is
    ``<= q_pos[i]`` and ``j < lengths``."""
    b, hq, w, d = q.shape
    h, L = k.shape[1], k.shape[2]
    kf = k.float()
    j = torch.arange(L, device=k.device)
    live = j[None, :] < lengths.to(k.device)[:, None]  # [B, L]
    kpos = j[None, None, :] if key_pos is None else key_pos.to(k.device)  # [1 or B, 1 or H, L]
    out = torch.zeros(b, h, hq // h, L, device=k.device)
    for i0 in range(0, w, _Q_CHUNK):
        qc = q[:, :, i0 : i0 + _Q_CHUNK].float().view(b, h, hq // h, -1, d)
        s = torch.einsum("bhgwd,bhld->bhgwl", qc, kf) * scale
        qp = q_pos[:, i0 : i0 + _Q_CHUNK].to(k.device)  # [B, c]
        vis = (kpos[:, :, None, :] <= qp[:, None, :, None]) & live[:, None, None, :]  # [B, 1 or H, c, L]
        s = s.masked_fill(~vis[:, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = p * q_valid[:, i0 : i0 + _Q_CHUNK].to(p)[:, None, None, :, None]
        out += p.sum(3)
    return out.reshape(b, hq, L)


def permute_slots_reference(x: torch.Tensor, order: torch.Tensor, start: int) -> None:
    """Twin of ``permute_triton.permute_slots_``: in place, slot ``start + j`` of x [B, H, C, D] takes what slot
    ``start + order[b, h, j]`` held (order [B, H, M])."""
    m = order.shape[2]
    if m == 0:
        return
    idx = (order.to(x.device) + start)[..., None].expand(-1, -1, -1, x.shape[3])
    x[:, :, start : start + m] = x.gather(2, idx)  # gather copies before the write


def rerank_slots_reference(ids, pages, sink: int, page_size: int, prefix=None):
    """Twin of ``slots_triton.rerank_slots``: the slots [B, H, S + T] of ids [B, H, T] into the flattened candidate
    ``pages`` [B, H, C] (``-1``: none), behind ``prefix`` [B, 1 or H, S] when given."""
    pid = pages.gather(2, ids.clamp(min=0) // page_size)
    slot = torch.where((ids >= 0) & (pid >= 0), sink + pid * page_size + ids % page_size, -1)
    if prefix is None:
        return slot
    return torch.cat([prefix.long().expand(ids.shape[0], ids.shape[1], -1), slot], dim=-1)


def page_rows(pos: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The gather index [B, H, ps, D] into ``buf`` [B, H, S, D] of token positions ``pos`` [B, ps] (clamped to S)."""
    b, h, s, d = buf.shape
    return pos.clamp(max=s - 1)[:, None, :, None].expand(b, h, -1, d)


def append_join_rows_reference(k_buf, v_buf, k, v, lengths, grid):
    """One token per sequence (k/v [B, H, 1, D]) written at ``lengths`` [B] of the buffers [B, H, S, D], and the
    page that joins the middle with it (``grid``: the store's ``Grid``) -> ``joins`` [B] bool, ``start`` [B]
    int64, the page's ``keys`` [B, H, 1, ps, D] (read after the write) and ``positions`` [B, ps]: the PyTorch
    path of ``DeviceStore.append_join`` (Triton: ``append_triton.append_join_rows``). The caller advances
    ``lengths``."""
    bi = torch.arange(k_buf.shape[0], device=k_buf.device)
    k_buf[bi, :, lengths] = k[:, :, 0].to(k_buf.dtype)
    v_buf[bi, :, lengths] = v[:, :, 0].to(v_buf.dtype)
    start = grid.num_middle_pages(lengths)
    joins = grid.num_middle_pages(lengths + 1) > start
    pos = grid.page_positions(start)
    return joins, start, k_buf.gather(2, page_rows(pos, k_buf))[:, :, None], pos


def paged_attended_count_reference(pages, lengths, sink, page_size, window_pages, tokens=None):
    """The slots ``kvdex.kernels.triton_attention.paged_decode_attention`` attends (its ``count=``) for a page and /
    or token selection, a 0-dim int64 tensor: ``page_size`` per selected page, each selected token, and the sink and
    window rows below each length, for every kv head (``LayerEngine._paged_decode`` counts with it where the kernel
    does not). ``lengths`` may be the host copy of device ``pages``: the sum stays on the pages' device, no sync."""
    L = lengths
    fixed = (L.clamp(max=sink) + (L - window_start(L, sink, page_size, window_pages)).clamp(min=0)).sum()
    toks = 0 if tokens is None else (tokens >= 0).sum()
    return (pages >= 0).sum() * page_size + toks + fixed * pages.shape[1]


def dense_decode_reference(q, k, v, lengths, scale):
    """PyTorch twin of ``triton_attention.dense_decode_attention`` (the sparse twin with idx = arange, valid = j <
    length)."""
    b, h, s, _ = k.shape
    j = torch.arange(s, device=k.device)
    idx = j.expand(b, h, s)
    valid = (j[None, :] < lengths.to(k.device)[:, None])[:, None, :].expand(b, h, s)
    return sparse_decode_attention_reference(q, k, v, idx, valid, scale)


def paged_decode_reference(q, k, v, pages, lengths, sink, page_size, window_pages, scale, tokens=None):
    """Twin of ``triton_attention.paged_decode_attention``: DeviceStore.attend's slot list + the reference kernel."""
    b, h = pages.shape[:2]
    dev = k.device
    L = lengths.to(dev)
    fixed = torch.cat([torch.arange(sink, device=dev).expand(b, sink),
                       window_start(L, sink, page_size, window_pages)[:, None]
                       + torch.arange(window_pages * page_size, device=dev)[None, :]], dim=1)  # fmt: skip
    fvalid = fixed < L[:, None]
    from kvdex.selection import Selection  # the selection's token order (imported when used)

    mid = Selection(pages=pages, tokens=tokens).token_positions(sink, page_size)
    idx = torch.cat([fixed[:, None].expand(b, h, -1), mid.clamp(min=0)], dim=-1)
    valid = torch.cat([fvalid[:, None].expand(b, h, -1), mid >= 0], dim=-1)
    # slots past the buffer are invalid; clamp them so the gather of the reference stays in range
    idx = idx.clamp(max=k.shape[2] - 1)
    return sparse_decode_attention_reference(q, k, v, idx, valid, scale)
