"""Page choice (IceCache Algorithm 3, with kvdex's GQA union and budget rules): from the keys a search
found for the query heads of one kv head's group to the pages attended.

The pages holding the group's retrieved keys are ordered, rank-major (``merge="rank"``: by the
best-ranked key among the group's heads) or by importance summed over the group (``merge="nsa"``,
NSA's shared selection), then taken greedily while they fit: ``rule="tokens"`` fits ``room`` tokens
and ``cap`` pages (a page that does not fit is skipped, a later smaller one may still fit),
``rule="keys"`` takes every page of the top-k keys up to ``cap``.

Per tree on the host (:func:`rank_order` / :func:`nsa_order`, then :func:`take_pages`) and for every
tree of a layer at once on the device (:func:`select_pages` over a
:class:`~kvdex.index.forest.DCIForest`'s mirror, no host sync); both choose the same pages in the
same order (tests/test_icecache_batched.py).
"""

from __future__ import annotations

import torch

from kvdex.index.dci import DCITree

# ---- one tree, on the host ----------------------------------------------------------------------------


def rank_order(tree: DCITree, ids: torch.Tensor) -> torch.Tensor:
    """Pages holding the keys ids [G, k'] (-1 padded, each row in rank order) in order of their
    best-ranked key over the group (rank-major: every head's rank 1, then rank 2, ...)."""
    pages = torch.where(ids >= 0, tree.pt_page[ids.clamp(min=0)], -1).T.flatten()  # rank-major
    pages = pages[pages >= 0]
    if pages.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    uniq, inv = torch.unique(pages, return_inverse=True)
    first = torch.full((uniq.numel(),), pages.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inv, torch.arange(pages.numel()), reduce="amin")
    return uniq[torch.argsort(first)]


def nsa_order(tree: DCITree, ids: torch.Tensor, qk: torch.Tensor, scale: float) -> torch.Tensor:
    """Pages of the group's retrieved keys, by importance summed over the group's query heads
    (NSA's shared selection, which the paper follows for GQA): a head's importance of a key is its
    softmax weight among the head's retrieved keys, a page's the sum over its keys and the heads."""
    ok = ids >= 0
    if not bool(ok.any()):
        return torch.empty(0, dtype=torch.long)
    prob = torch.softmax(qk.float() * scale, dim=1).nan_to_num(0.0).masked_fill(~ok, 0.0)
    pages = tree.pt_page[ids[ok]]
    uniq, inv = torch.unique(pages, return_inverse=True)
    score = torch.zeros(uniq.numel()).index_add_(0, inv, prob[ok])
    return uniq[torch.argsort(score, descending=True, stable=True)]


def take_pages(tree: DCITree, ordered: torch.Tensor, room: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages ``ordered`` (best first) that fit ``room`` tokens, at most ``cap`` of them: returns
    the pages taken and their token positions (empty slots dropped)."""
    if ordered.numel() == 0:
        return ordered, torch.empty(0, dtype=torch.long)
    # Pages in order of their best-ranked key; a page that does not fit the room left is
    # skipped and a later, smaller one may still fit (the budget is in tokens).
    take = []
    for i, f in enumerate(tree.page_fill[ordered].tolist()):
        if f <= room:
            take.append(i)
            room -= f
            if room == 0 or len(take) == cap:
                break
    chosen = ordered[torch.tensor(take, dtype=torch.long)]
    pos = tree.page_positions(chosen).flatten()
    return chosen, pos[pos >= 0]


def cat_rows(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack several searches' (ids, q.k) [g_i, k_i] into [sum g_i, max k_i] (-1 / -inf padded)."""
    w = max(x.shape[1] for x, _ in parts)
    pad = torch.nn.functional.pad
    ids = torch.cat([pad(x, (0, w - x.shape[1]), value=-1) for x, _ in parts])
    return ids, torch.cat([pad(d, (0, w - d.shape[1]), value=float("-inf")) for _, d in parts])


def pad_rows(n: int, rows, pin: bool = False) -> torch.Tensor:
    """Token positions ``rows`` = (row, positions) pairs as [n, T] (-1 padded, T the longest), pinned if ``pin``."""
    rows = list(rows)
    T = max((r.numel() for _, r in rows), default=0)
    out = torch.full((n, T), -1, dtype=torch.long, pin_memory=pin)
    for i, r in rows:
        out[i, : r.numel()] = r
    return out


# ---- every tree of a layer, on the device ---------------------------------------------------------------


def select_pages(
    forest,
    ids: torch.Tensor,
    dot: torch.Tensor,
    rows_tree: torch.Tensor,
    G: int,
    room: int,
    cap: int,
    rule: str = "tokens",
    merge: str = "rank",
    qk_scale: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The page choice of R trees of ``forest`` (a :class:`~kvdex.index.forest.DCIForest`) at once:
    ids/dot [R*G, k'] (global, the forest search's output; the G query heads of row r are rows
    r*G ... r*G+G-1), rows_tree [R] (device). Returns token positions [R, T] (-1 padded, in page
    order) and the number of pages taken [R]."""
    R = rows_tree.shape[0]
    kp = ids.shape[1]
    dev = ids.device
    Pc, big = forest.Pc, torch.iinfo(torch.long).max
    base = (rows_tree * Pc)[:, None]
    ok = ids >= 0
    page = torch.where(ok, forest.pt_page[ids.clamp(min=0)], -1)  # [R*G, k'] global pages
    local = torch.where(ok, page - base.repeat_interleave(G, 0), 0)
    M = min(Pc, G * kp)
    if merge == "nsa":
        qk = dot * qk_scale  # q.k
        prob = torch.softmax(qk.float() * scale, dim=1).nan_to_num(0.0).masked_fill(~ok, 0.0)
        score = torch.zeros(R, Pc, device=dev).scatter_add_(1, local.view(R, -1), prob.view(R, -1))
        hits = torch.zeros(R, Pc, device=dev).scatter_add_(1, local.view(R, -1), ok.view(R, -1).float())
        present = hits > 0
        key = score.masked_fill(~present, float("-inf"))
        srt, order = torch.sort(key, dim=1, descending=True, stable=True)
        valid = torch.isfinite(srt[:, :M])
    else:  # rank-major: a page's rank = the first (rank, head) position holding one of its keys
        rank = torch.arange(kp, device=dev)[None, :] * G + torch.arange(G, device=dev).repeat(R)[:, None] % G
        rank = torch.where(ok, rank, big).view(R, -1)
        first = torch.full((R, Pc), big, dtype=torch.long, device=dev)
        first.scatter_reduce_(1, local.view(R, -1), rank, reduce="amin")
        srt, order = torch.sort(first, dim=1, stable=True)
        valid = srt[:, :M] < big
    order = order[:, :M] + base  # global page ids, best first
    f = torch.where(valid, forest.page_fill[order], 0)
    pos_i = torch.arange(M, device=dev)[None, :]
    if rule == "keys":
        taken = valid & (pos_i < cap)
    else:
        taken = greedy_fit(f, valid, room, cap, forest.ps)
    npages = taken.sum(1)
    Tp = min(M, cap)
    key = torch.where(taken, pos_i, M + pos_i)
    sel = torch.sort(key, dim=1).values[:, :Tp]  # taken columns first, in order
    pages = torch.where(sel < M, order.gather(1, sel.clamp(max=M - 1)), -1)
    pos = torch.where(pages[:, :, None] >= 0, forest.page_pos[pages.clamp(min=0)], -1).flatten(1)
    Tt = min(pos.shape[1], room) if rule != "keys" else pos.shape[1]
    keep = torch.argsort((pos < 0).to(torch.int8), dim=1, stable=True)[:, :Tt]
    return pos.gather(1, keep), npages


def greedy_fit(f: torch.Tensor, valid: torch.Tensor, room: int, cap: int, ps: int) -> torch.Tensor:
    """Exactly :func:`take_pages`' loop (take a page if its fill fits the room left, else skip
    it; stop after ``cap`` pages) for every row at once. f [R, M] fills (>= 1 where valid; the valid
    pages are a prefix). Phase 1: the longest prefix that fits (a cumsum). After the first page that
    does not fit, the room left is < its fill <= ps, so the rest is an automaton over ps room
    states; its transitions are composed by a prefix scan (log2 M steps), no per-page loop."""
    R, M = f.shape
    dev = f.device
    pos_i = torch.arange(M, device=dev)[None, :]
    cum = f.cumsum(1)
    p1 = (valid & (cum <= room)).sum(1)  # pages taken before the first skip
    before = torch.where(p1 > 0, cum.gather(1, (p1 - 1).clamp(min=0)[:, None]).view(R), 0)
    room1 = (room - before).clamp(0, ps - 1)  # < ps whenever a page was skipped
    # Transition of each page after the skipped one on room v: v - f if f <= v else v (identity elsewhere).
    v = torch.arange(ps, device=dev)[None, None, :]
    live = (valid & (pos_i > p1[:, None]))[:, :, None]
    F = torch.where(live & (f[:, :, None] <= v), v - f[:, :, None], v)  # [R, M, ps]
    d = 1
    while d < M:  # inclusive prefix composition: F_i <- F_i o F_{i-d}
        F = torch.cat([F[:, :d], torch.gather(F[:, d:], 2, F[:, :-d])], dim=1)
        d *= 2
    ident = v.expand(R, 1, ps)
    excl = torch.cat([ident, F[:, :-1]], dim=1)  # the room map before each page
    room_before = excl.gather(2, room1[:, None, None].expand(R, M, 1)).view(R, M)
    taken = (pos_i < p1[:, None]) | (live.view(R, M) & (f <= room_before))
    return taken & (taken.cumsum(1) <= cap)
