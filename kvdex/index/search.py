"""The steps of one M-DCI level that the per-tree search (:class:`~kvdex.index.dci.DCITree`) and the
batched device search (:class:`~kvdex.index.forest.DCIForest`) share: prioritized DCI over the
points of the visited nodes (:func:`pdci`) and the child nodes of the points kept (:func:`children`).

Both work on flat arrays: ``X`` [N, d+1] transformed keys, ``proj`` [N + 1, m*p] their projections
with a last row of +inf (padding ids, -1, gather it), and the CSR child lists of one level. The
algorithm is described in :mod:`kvdex.index.dci`.
"""

from __future__ import annotations

import torch


def static_k1(n: int, prop: float, min_cand: int) -> int:
    """Candidates per composite index for ``n`` visited points, computed as :func:`pdci` does per row."""
    c = int((prop * torch.tensor(n)).ceil().long().clamp(min=min_cand))
    return min(c, n)


def pdci(
    X: torch.Tensor,
    proj: torch.Tensor,
    Xq: torch.Tensor,
    pq: torch.Tensor,
    cand: torch.Tensor,
    width: int,
    prop: float,
    num_comp: int,
    num_simp: int,
    min_cand: int,
    static: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prioritized DCI over the candidate sets cand [Q, C] (-1 padded) of transformed queries Xq
    [Q, d+1] (projected: pq [Q, m*p]): the best ``width`` by inner product, as ids [Q, w] (-1
    padded) and inner products [Q, w] (descending, -inf padded).

    ``static``: shapes from host-known bounds (no host sync): the candidate count ``K1`` is the bound
    for C visited points and each row's k1-th smallest lower bound comes from a sort; else ``K1`` is
    the largest k1 of the rows (a sync) and the threshold a ``kthvalue``."""
    Q, C = cand.shape
    if C == 0:
        return cand, torch.empty(Q, 0, device=cand.device)
    m = num_comp
    valid = cand >= 0
    # proj's last row is +inf: padding (-1) gathers it and gets an infinite lower bound
    pc = torch.index_select(proj, 0, (cand % proj.shape[0]).flatten()).view(Q, C, -1)
    lb = pc.sub_(pq[:, None, :]).abs_().view(Q, C, m, num_simp).amax(-1)  # [Q, C, m]
    nvalid = valid.sum(1)
    k1 = torch.minimum((prop * nvalid).ceil().long().clamp(min=min_cand), nvalid)  # [Q]
    # static: K1 >= every row's k1 (k1 grows with the visited points)
    K1 = static_k1(C, prop, min_cand) if static else (int(k1.max()) if Q else 0)
    if K1 == 0:
        return cand[:, :0], torch.empty(Q, 0, device=cand.device)
    if K1 * m >= C:  # most points are candidates: threshold each row's bounds at its k1-th smallest, score all
        if static:  # a sort: no assumption on how many padding entries a row has
            srt = torch.sort(lb, dim=1).values  # padding (+inf) last
            thr = srt.gather(1, (k1 - 1).clamp(min=0)[:, None, None].expand(Q, 1, m)).view(Q, m)
            thr = thr.masked_fill((k1 == 0)[:, None], float("-inf"))
        else:
            # The k1-th smallest bound of each row and composite index: a single kthvalue for every
            # row, after giving K1 - k1 of the row's padding entries a bound of -inf (a row has at
            # least that many: k1 grows by at most 1 per visited point).
            pad_rank = (~valid).cumsum(1) - 1
            lift = (~valid) & (pad_rank < (K1 - k1)[:, None])
            thr = torch.kthvalue(lb.masked_fill(lift[:, :, None], float("-inf")), K1, dim=1).values  # [Q, m]
        is_cand = ((lb <= thr[:, None, :]) & valid[:, :, None]).any(-1)
        dot = dots(X, cand, Xq).masked_fill(~is_cand, float("-inf"))
        ids = cand
    else:  # few candidates: take them in retrieval order, gather only them (duplicates count once)
        first = torch.topk(lb, K1, dim=1, largest=False).indices  # [Q, K1, m] retrieval order per composite
        keep = (torch.arange(K1, device=cand.device)[None, :] < k1[:, None])[:, :, None].expand_as(first)
        at = torch.where(keep, first, -1).flatten(1)
        at, _ = torch.sort(at, dim=1)
        dup = torch.zeros_like(at, dtype=torch.bool)
        dup[:, 1:] = at[:, 1:] == at[:, :-1]
        ok = (at >= 0) & ~dup
        ids = torch.where(ok, cand.gather(1, at.clamp(min=0)), -1)
        dot = dots(X, ids, Xq).masked_fill(~ok, float("-inf"))
    w = min(width, dot.shape[1])
    dot, j = torch.topk(dot, w, dim=1)
    return torch.where(torch.isfinite(dot), ids.gather(1, j), -1), dot


def children(
    kids: torch.Tensor, kid_start: torch.Tensor, kid_count: torch.Tensor, ids: torch.Tensor, C: int | None = None
) -> torch.Tensor:
    """The union of the nodes headed by ids [Q, w] (-1 padded) as [Q, C] (-1 padded), from one level's
    CSR child lists. ``C``: a host-known width >= every row's child count (no sync), or None: the
    exact width (a sync)."""
    Q, w = ids.shape
    dev = ids.device
    if C == 0 or w == 0:
        return torch.full((Q, 0), -1, dtype=torch.long, device=dev)
    safe = ids.clamp(min=0)
    cnt = torch.where(ids >= 0, kid_count[safe], 0)
    st = kid_start[safe]
    offs = cnt.cumsum(1)
    tot = offs[:, -1]
    if C is None:
        C = int(tot.max()) if Q else 0
        if C == 0:
            return torch.full((Q, 0), -1, dtype=torch.long, device=dev)
    j = torch.arange(C, device=dev).expand(Q, C).contiguous()
    owner = torch.searchsorted(offs, j, right=True).clamp(max=w - 1)
    within = j - (offs - cnt).gather(1, owner)
    at = (st.gather(1, owner) + within).clamp(0, kids.numel() - 1)
    return torch.where(j < tot[:, None], kids[at], -1)


def dots(X: torch.Tensor, ids: torch.Tensor, Xq: torch.Tensor) -> torch.Tensor:
    """Inner products X[ids] . Xq per row: ids [Q, C] (-1 allowed, gives junk), Xq [Q, d] -> [Q, C]."""
    Q, C = ids.shape
    rows = torch.index_select(X, 0, ids.clamp(min=0).flatten()).view(Q, C, -1)
    return torch.bmm(rows, Xq[:, :, None]).view(Q, C)


def dedupe(ids: torch.Tensor, dot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mark repeated ids of a row as -1 / -inf (a point found on several levels counts once)."""
    s, o = torch.sort(ids, dim=1)
    d = dot.gather(1, o)
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    bad = dup | (s < 0)
    return torch.where(bad, -1, s), d.masked_fill(bad, float("-inf"))
