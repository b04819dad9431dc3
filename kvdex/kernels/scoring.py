"""Selection arithmetic shared by the policies and the kernels (PyTorch; the references of the Triton
scoring and top-k kernels): the GQA reduction, page masks, top-k ids, the choice of a kv head's pages
from its query heads' scores (``group_topk``), Quest's page bounds, ArkVale's digest estimates, and
IceCache's rerank candidates (``candidate_slots``, ``pick_tokens``) and device build parents (``nearest_rows``).

``kvdex.policies`` re-exports ``group_reduce``, ``mask_pages`` and ``topk_ids``; ``kvdex.policies.quest``
re-exports ``page_bounds``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from kvdex.kernels.dispatch import triton_kernel


def group_reduce(x: torch.Tensor, kv_heads: int, mode: str = "max") -> torch.Tensor:
    """[B, Hq, ...] per query head -> [B, H, ...] per kv head (max / sum / mean over the group)."""
    b, hq = x.shape[:2]
    xg = x.view(b, kv_heads, hq // kv_heads, *x.shape[2:])
    if mode == "max":
        return xg.amax(dim=2)
    if mode == "sum":
        return xg.sum(dim=2)
    if mode == "mean":
        return xg.mean(dim=2)
    raise ValueError(f"unknown group reduction {mode!r}; use 'max', 'sum' or 'mean'")


GROUPS = ("max", "sum", "heads")  # how a kv head's query heads combine when ranking pages (group_topk)


def check_group(group: str, option: str = "group") -> None:
    if group not in GROUPS:
        raise ValueError(f"{option} must be one of {', '.join(GROUPS)}, got {group!r}")


def group_topk(score: torch.Tensor, kv_heads: int, k: int, group: str = "max") -> torch.Tensor:
    """A kv head's ``k`` pages (or tokens) from its query heads' scores: score [B, Hq, N] (``-inf``:
    not a candidate) -> [B, H, min(k, N)] ids, ``-1`` padded.

    ``"max"`` / ``"sum"``: the top-k of the group's max / sum of scores. ``"heads"``: every query head
    ranks the candidates by its own score (top-k of its row, ties as :func:`topk_ids`) and the kv head
    takes the union in round-robin order -- every head's best, then every head's second, ... (head g
    before head g + 1 within a rank) -- skipping candidates already taken, until ``k`` are taken or the
    heads' finite candidates run out. So with ``k >= G * j`` every query head's top ``j`` are in the set.
    Fixed shapes, no host read: a candidate's priority is ``min over heads of rank * G + g`` (scattered
    into [B, H, N]), and the k smallest priorities win, in that order.
    """
    if group != "heads":
        check_group(group)
        return topk_ids(group_reduce(score, kv_heads, group), k)
    b, hq, n = score.shape
    g = hq // kv_heads
    k = min(k, n)
    ids = topk_ids(score, k).view(b, kv_heads, g, k)  # [B, H, G, k] per head by rank, -1 padded
    rank = torch.arange(k, device=score.device)[None, :] * g + torch.arange(g, device=score.device)[:, None]
    prio = rank.to(torch.float32).expand_as(ids).masked_fill(ids < 0, float("inf"))  # [B, H, G, k]
    best = torch.full((b, kv_heads, n + 1), float("inf"), device=score.device)  # column n: the -1 entries
    best.scatter_reduce_(2, torch.where(ids >= 0, ids, n).reshape(b, kv_heads, g * k), prio.reshape(b, kv_heads, -1),
                         "amin")  # fmt: skip
    return topk_ids(-best[..., :n], k)


def mask_pages(score: torch.Tensor, num_pages: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """Set scores of pages past each sequence's middle to ``-inf``; score [B, H, P], num_pages [B];
    ``first`` [B] (optional): the pages before it too (PRKV's static region)."""
    p = torch.arange(score.shape[-1], device=score.device)[None, None, :]
    out = p >= num_pages.to(score.device)[:, None, None]
    if first is not None:
        out = out | (p < first.to(score.device)[:, None, None])
    return score.masked_fill(out, float("-inf"))


def topk_ids(score: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """Top-k indices along the last dim, ``-1`` where the score is ``-inf`` (invalid entries).

    score [B, H, N] -> [B, H, min(k, N)] (int64), ordered by descending score; with ``ordered=False`` the
    same set in an order left to ``torch.topk(sorted=False)`` (deterministic; on CUDA it skips the sort
    of the k results): for callers that use the set only, such as a rerank's candidates.
    """
    k = min(k, score.shape[-1])
    if k <= 0:
        return torch.empty(*score.shape[:-1], 0, dtype=torch.long, device=score.device)
    fast = _fast_topk(score, k, ordered)
    if fast is not None:  # one Triton kernel (kvdex.kernels.topk): same set, ties to the lowest index
        return fast(score, k) if ordered else fast(score, k, ordered=False)
    val, ids = torch.topk(score, k, dim=-1, sorted=ordered)
    # |val| < inf is isfinite (NaN and +-inf fail it) in two kernels instead of isfinite's four
    return torch.where(val.abs() < float("inf"), ids, -1)


def share_candidates(score: torch.Tensor, k: int, share: float, middle_pages: torch.Tensor) -> torch.Tensor:
    """The candidate pages [B, H, K] (``-1`` padded) of the page ``score`` [B, H, P] (``-inf`` past each
    row's pages) under a rerank's ``rerank_share``: row b keeps its best ``max(k, ceil(share *
    middle_pages[b]))`` pages (``middle_pages`` [B] on the score's device: the pages row b holds; the product
    in fp32, :func:`row_counts`). K = ``max(k, ceil(share * P))``
    depends on the width P only (the longest middle, or the index capacity under static sizing), so a
    captured step has the eager step's candidates. The candidates are a set: on CUDA one Triton top-k that
    works out each row's count itself (``row_k``, ``row_share``, ``row_min`` of :func:`kvdex.kernels.topk.topk_ids`
    or, past ``topk_radix.MIN_N`` pages, the radix select's; ids in index order, ``-1`` after them),
    elsewhere the best first."""
    width = score.shape[-1]
    kmax = min(width, max(k, math.ceil(share * width)))
    fast = _fast_topk(score, kmax, ordered=False, per_row=True) if kmax > 0 else None
    if fast is not None:  # one top-k: each row's own count of its best (worked out in the kernel), as a set
        return fast(score, kmax, ordered=False, row_k=middle_pages.to(score.device), row_share=share, row_min=k)
    quota = row_counts(middle_pages.to(score.device), share, k, kmax)  # [B] (the kernels' arithmetic)
    ids = topk_ids(score, kmax, ordered=True)  # best first: a row's count of them is its candidates
    keep = torch.arange(kmax, device=ids.device) < quota[:, None, None]
    return torch.where(keep, ids, -1)


def row_counts(row_k: torch.Tensor, share: float, least: int, k: int) -> torch.Tensor:
    """Each row's own count of a top-k call with ``row_k`` (:func:`kvdex.kernels.topk.topk_ids`): ``min(k,
    max(least, ceil(share * row_k)))``, at least 0, the product in fp32 as the kernels compute it (exact for
    counts below 2**24 with ``share`` 1)."""
    # share rounded to fp32 on the host: no tensor is made per call (a captured step reads no host buffer)
    n = torch.ceil(row_k.to(torch.float32) * float(np.float32(share))).long()
    return n.clamp(min=least).clamp(min=0, max=k)


def _fast_topk(score: torch.Tensor, k: int, ordered: bool = True, per_row: bool = False):
    """The Triton top-k (kvdex.kernels.topk) where it applies, else None.

    Unordered calls (``ordered=False``: a rerank's candidates and its chosen tokens; ``per_row``: with each row's
    own count, a rerank's share) of rows up to ``topk_radix.MIN_N`` scores run the kernel without its final
    sort (``KVDEX_TOPK_UNORDERED=0``: torch.topk), longer rows the multi-program radix select of
    :mod:`kvdex.kernels.topk_radix` (``KVDEX_TOPK_WIDE=0``: the one-program kernel up to ``MAX_BLOCK`` scores,
    torch.topk past it). In
    the decode step of the 8B shape at 128k (H200, eager, per-kernel device time) those calls took 3.92 ms
    per step against torch.topk's 4.73 ms for IceCache's token rerank (60 calls over 13-16k scores) and
    2.91 against 3.03 ms for ``quest:rerank=4`` (8192 scores).

    Ordered calls: rows longer than ``KVDEX_TOPK_MAX_N`` go to torch.topk. Default 0, i.e. torch.topk: in isolation
    (H200, graph-replayed, 8 rows, k = 125, random scores) the kernel took 15-23 us against
    torch.topk's 46-63 us at 8192 scores per row, but inside the real decode step (Llama-3.1-8B
    shape, 128k, quest/device+graph+compile, Quest's page bounds) it took 2.22 ms per
    step (74 us a call) against torch.topk's 1.74 ms, and the step 8.35 against 8.02 ms GPU time
    (docs/bench/step_kernels.md). So it is opt-in (``KVDEX_TOPK_MAX_N=16384`` sends rows of up to
    16384 scores to it). In the step Quest's rows are 10,236 scores wide (the index capacity under static
    sizing), so the kernel's register tile is 16,384 and a call costs twice what 8,192 scores cost
    (docs/bench/step_kernels.md).
    ``KVDEX_TOPK_SPLIT=1`` sends the longer rows to the two-stage ``topk_ids_split`` (8192-score
    segments, then their candidates) instead of torch.topk (in isolation 56-213 us vs torch.topk's
    46-91 us at 32768-131072 scores: no faster)."""
    topk = triton_kernel("topk", on=score)
    if topk is None:
        return None
    if not ordered and os.environ.get("KVDEX_TOPK_UNORDERED", "1") != "0":
        wide = triton_kernel("topk_radix", on=score) if os.environ.get("KVDEX_TOPK_WIDE", "1") != "0" else None
        n = score.shape[-1]
        if wide is not None and n > wide.MIN_N:
            return lambda s, kk, ordered=False, **own: wide.topk_ids(s, kk, **own)
        return topk.topk_ids if n <= topk.MAX_BLOCK and topk.supported(score, k) else None
    long_row = score.shape[-1] > int(os.environ.get("KVDEX_TOPK_MAX_N", 0))
    if long_row and os.environ.get("KVDEX_TOPK_SPLIT", "0") != "1":
        return None
    if not topk.supported(score, k):
        return None
    return topk.topk_ids_split if long_row else topk.topk_ids


def candidate_scores(q: torch.Tensor, keys: torch.Tensor, live: torch.Tensor, group: str, scale: float) -> torch.Tensor:
    """Exact scores of candidate tokens (the PyTorch path of a page policy's ``rerank``; the twin of
    :func:`kvdex.kernels.rerank_triton.candidate_scores`): q [B, Hq, D], their keys [B, H, N, D], live
    [B, H, N] -> ``group="max"``: the group's largest ``q.k`` [B, H, N]; ``"weight"``: ``scale * q.k`` per
    query head [B, H, G, N]; fp32, ``-inf`` where not live."""
    b, hq, d = q.shape
    h = keys.shape[1]
    s = torch.einsum("bhgd,bhnd->bhgn", q.float().view(b, h, hq // h, d), keys.float())  # [B, H, G, N]
    s = s.masked_fill(~live[:, :, None, :].to(s.device), float("-inf"))
    return s.amax(2) if group == "max" else s * scale


def slot_scores(q: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, group: str) -> torch.Tensor:
    """Exact ``q.k`` of the keys at ``slots`` [B, H, N] (any int dtype; -1: none) of ``keys`` [B, H, S, D]
    for the query heads q [B, Hq, D] (IceCache's rerank of semantic pages; the twin of
    :func:`kvdex.kernels.rerank_triton.slot_scores`): fp32, -inf where none; ``group="max"`` [B, H, N]
    the kv head's largest, ``"heads"`` [B, H, G, N] per query head."""
    s = slots.long().to(keys.device)
    k = keys.gather(2, s.clamp(min=0, max=keys.shape[2] - 1)[..., None].expand(-1, -1, -1, keys.shape[-1]))
    out = candidate_scores(q, k, s >= 0, "weight", 1.0)  # [B, H, G, N]
    return out.amax(2) if group == "max" else out


def candidate_slots(cand: torch.Tensor, pos: torch.Tensor, ps: int) -> torch.Tensor:
    """The rerank's candidate tokens: cand [R, Pc] (page ids, ``-1``: none), pos [R, C, ps] (the page table's
    positions, ``-1`` empty) -> [R, Pc * ps] int32 positions, ``-1`` where the slot is empty or the candidate
    missing. The twin of :func:`kvdex.kernels.semantic_triton.candidate_slots` (IceCache's summary rerank)."""
    R, Pc = cand.shape
    got = pos.gather(1, cand.clamp(min=0)[..., None].expand(-1, -1, ps))  # [R, Pc, ps]
    return torch.where((cand >= 0)[..., None], got, -1).view(R, Pc * ps).int()


def pick_tokens(ids: torch.Tensor, slots: torch.Tensor, ps: int, counts: torch.Tensor) -> torch.Tensor:
    """``rerank_unit="token"``: the positions [R, T] int64 of the chosen columns ``ids`` [R, T] (``-1``: none)
    of ``slots`` [R, Pc * ps]; adds (distinct candidate pages holding a chosen token, chosen tokens) to
    ``counts`` [2] in place. The twin of :func:`kvdex.kernels.semantic_triton.pick_tokens`."""
    R, pc = ids.shape[0], slots.shape[1] // ps
    hit = ids >= 0
    out = torch.where(hit, slots.gather(1, ids.clamp(min=0)).long(), -1)
    page = torch.where(hit, torch.div(ids, ps, rounding_mode="floor"), pc)  # column pc: no token
    used = torch.zeros(R, pc + 1, dtype=torch.int8, device=ids.device)
    used.scatter_(1, page, 1)  # every write is 1: no atomics
    counts.add_(torch.stack([used[:, :pc].sum(), hit.sum()]))
    return out


def nearest_pages(keys: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fill: torch.Tensor, kind: str) -> torch.Tensor:
    """keys [R, N, D] -> [R, N] int64: per key, the live page (``fill`` [R, C] > 0) of its row whose centre is
    nearest (squared distance ``|c|^2 - 2 k.c``, fp32; the first on ties; 0 where a row has no live page).
    The centre of a page: ``(a + b) / 2`` for ``kind="minmax"`` (a, b [R, C, D]: per-channel min and max), the
    mean ``a`` for ``"centroid"``. IceCache's semantic pages (``SemanticPages.insert_device``: which page a
    joining key goes to); twin of :func:`kvdex.kernels.semantic_triton.nearest_pages`."""
    centre = (a.float() + b.float()) / 2 if kind == "minmax" else a.float()
    live = fill > 0
    centre = torch.where(live[:, :, None], centre, 0.0)
    d2 = (centre * centre).sum(-1)[:, None, :] - 2 * torch.bmm(keys.float(), centre.transpose(1, 2))  # [R, N, C]
    return d2.masked_fill(~live[:, None, :], float("inf")).argmin(-1)


def insert_pages(keys, tgt, ok, positions, pos, fill, npages, a, b, kind: str) -> None:
    """One window page of keys [R, ps, D] (R = B x H rows) joins its rows' semantic pages, in place (IceCache's
    ``SemanticPages.insert_device``): each key goes to its page ``tgt`` [R, ps] (its nearest live page,
    :func:`nearest_pages`) if that page has room (keys of one page in the order they come), else into one new
    page per row (``npages`` [R], the pages used) with every key of the row that did not fit. ``ok`` [B]:
    the sequences whose rows take the page (the others are not changed); ``positions`` [B, ps] the keys' token
    positions. The table: ``pos`` [R, C, ps] int32 (-1 empty), ``fill`` [R, C] int32, the summaries ``a`` /
    ``b`` [R, C, D] (``"minmax"``: per-channel min / max) or ``a`` the mean [R, C, D] and ``b`` the radius
    [R, C] fp32 (``"centroid"``: ``r' = max(r + |mu' - mu|, |k - mu'|)``, 0 for a new page); page ``C - 1``
    is the trash page (never written). Pages no key joined are unchanged. Fixed shapes, no host read
    (capturable). Twin of :func:`kvdex.kernels.semantic_triton.insert_pages`."""
    R, ps, D = keys.shape
    C, H, dev = fill.shape[1], R // ok.shape[0], keys.device
    k = keys.float()
    rok = ok.to(dev).repeat_interleave(H)[:, None].expand(R, ps)  # [R, ps]
    f = fill.long()
    j = torch.arange(ps, device=dev)
    earlier = j[None, None, :] < j[None, :, None]
    rank = ((tgt[:, :, None] == tgt[:, None, :]) & earlier).sum(-1)  # the keys before it that chose its page
    f_t = f.gather(1, tgt)
    join = rok & (f_t > 0) & (f_t + rank < ps)  # tgt is live wherever the row has a live page
    spill = rok & ~join
    page = torch.where(join, tgt, torch.where(spill, npages[:, None].expand(R, ps), C - 1))
    slot = torch.where(join, f_t + rank, torch.where(spill, spill.cumsum(1) - 1, 0))
    flat = (torch.arange(R, device=dev)[:, None] * C + page).flatten()  # row-major page ids
    put = (join | spill).flatten()
    pos_in = torch.where(rok, positions.to(dev).int().repeat_interleave(H, 0), -1)  # the trash page keeps -1
    pos.view(R * C, ps)[flat, slot.flatten()] = pos_in.flatten()
    f_new = f.flatten().index_add(0, flat, put.long())
    kf = k.reshape(R * ps, D)
    if kind == "minmax":
        m = put[:, None]
        idx = flat[:, None].expand(-1, D)
        a.view(R * C, D).scatter_reduce_(0, idx, kf.masked_fill(~m, float("inf")).to(a.dtype), "amin")
        b.view(R * C, D).scatter_reduce_(0, idx, kf.masked_fill(~m, -float("inf")).to(b.dtype), "amax")
    else:
        touched = torch.zeros(R * C, dtype=torch.long, device=dev).index_add(0, flat, put.long()) > 0
        f0 = f.view(R * C, 1).float()
        mu0 = a.reshape(R * C, D).float()
        tot = (mu0 * f0).index_add(0, flat, kf * put[:, None].float())
        mu1 = torch.where(touched[:, None], tot / f_new.float().view(-1, 1).clamp(min=1), mu0).to(a.dtype)
        shift = (mu1.float() - mu0).norm(dim=-1)
        r = b.view(R * C)
        r1 = torch.where(touched, torch.where(f0.view(-1) > 0, r + shift, 0.0), r)
        dk = (kf - mu1.float()[flat]).norm(dim=-1) * put.float()
        a.view(R * C, D).copy_(mu1)
        r.copy_(r1.scatter_reduce(0, flat, dk, "amax"))
    fill.view(R * C).copy_(f_new)
    npages.add_(spill.any(1).long())


def nearest_rows(X: torch.Tensor, Xp: torch.Tensor, chunk: int = 1 << 27) -> torch.Tensor:
    """X [R, N, E], Xp [R, Np, E] -> [R, N] int64: per key, the index of its largest inner product among its
    row's points (the first on ties), by fp32 batched matmuls of at most ``chunk`` scores and ``argmax``. The
    twin of :func:`kvdex.kernels.parents_triton.nearest` (IceCache's device page build)."""
    R, N, _ = X.shape
    best = torch.empty(R, N, dtype=torch.long, device=X.device)
    step = max(1, chunk // max(1, R * Xp.shape[1]))
    for s in range(0, N, step):
        best[:, s : s + step] = torch.bmm(X[:, s : s + step], Xp.transpose(1, 2)).argmax(-1)
    return best


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bounds of q.k per page: q [B, Hq, D], kmin/kmax [B, H, P, D] -> [B, Hq, P] (fp32)."""
    b, hq, d = q.shape
    h = kmin.shape[1]
    qg = q.view(b, h, hq // h, d).float()
    ub = torch.einsum("bhgd,bhpd->bhgp", qg.clamp(min=0), kmax.float())
    ub = ub + torch.einsum("bhgd,bhpd->bhgp", qg.clamp(max=0), kmin.float())
    return ub.reshape(b, hq, -1)


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: torch.Tensor) -> torch.Tensor:
    """Quest's per-kv-head page scores [B, H, P] (pages past ``num_pages`` [B] are -inf): the twin of
    :func:`kvdex.kernels.quest_triton.page_scores`."""
    return mask_pages(group_reduce(page_bounds(q, kmin, kmax), kmin.shape[1], "max"), num_pages)


def digest_summary(
    keys: torch.Tensor, kind: str, count: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """ArkVale's digest of pages (``kvdex.policies._digest.summarize``; Triton: ``digest_triton.summarize``):
    keys [..., ps, D] -> (centre [..., D], radius [..., D] (cuboid) or [..., 1] (sphere)), fp32, for ``kind``
    "<cuboid|sphere>-<max|center|mean>". ``count`` (optional, broadcastable to keys[..., 0, 0]): the real
    keys of each page (the first ``count``)."""
    shape, radius = kind.split("-")
    k = keys.float()
    if count is not None:
        live = torch.arange(k.shape[-2], device=k.device) < count[..., None]  # [..., ps]
        live = live[..., None]
        lo = torch.where(live, k, float("inf")).amin(-2)
        hi = torch.where(live, k, float("-inf")).amax(-2)
    else:
        live = None
        lo, hi = k.amin(-2), k.amax(-2)
    c = (lo + hi) / 2
    dist = (k - c[..., None, :]).abs() if shape == "cuboid" else (k - c[..., None, :]).norm(dim=-1, keepdim=True)
    if live is not None:
        dist_max = torch.where(live, dist, float("-inf")).amax(-2)
        dist_min = torch.where(live, dist, float("inf")).amin(-2)
        dist_mean = torch.where(live, dist, 0.0).sum(-2) / live.sum(-2).clamp(min=1)
    else:
        dist_max, dist_min, dist_mean = dist.amax(-2), dist.amin(-2), dist.mean(-2)
    r = {"max": dist_max, "center": (dist_min + dist_max) / 2, "mean": dist_mean}[radius]
    return c, r


def digest_scores(q: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Estimated importance per query head and page: q [B, Hq, D], centre [B, H, P, D],
    radius [B, H, P, D] (cuboid) or [B, H, P, 1] (sphere) -> [B, Hq, P] (fp32).

    Cuboid: ``q.c + |q|.r`` (== sum_i max(q_i hi_i, q_i lo_i)); sphere: ``q.c + r |q|``.
    """
    b, hq, d = q.shape
    h = centre.shape[1]
    qg = q.view(b, h, hq // h, d).float()
    s = torch.einsum("bhgd,bhpd->bhgp", qg, centre.float())
    if radius.shape[-1] == 1:
        s = s + qg.norm(dim=-1)[..., None] * radius[..., 0].float()[:, :, None, :]
    else:
        s = s + torch.einsum("bhgd,bhpd->bhgp", qg.abs(), radius.float())
    return s.reshape(b, hq, -1)


def digest_page_scores(
    q: torch.Tensor,
    centre: torch.Tensor,
    radius: torch.Tensor,
    num_pages: torch.Tensor,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """ArkVale's per-kv-head page scores [B, H, P] (the group's max of :func:`digest_scores`), -inf outside
    ``first <= p < num_pages`` ([B] each; no ``first``: 0): the twin of
    :func:`kvdex.kernels.digest_triton.page_scores`."""
    return group_reduce(mask_pages(digest_scores(q, centre, radius), num_pages, first), centre.shape[1], "max")
