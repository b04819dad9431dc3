"""One batched M-DCI search over all DCI-trees of a layer, on the device the model runs on.

:class:`DCIForest` mirrors a list of :class:`~kvdex.index.dci.DCITree` snapshots (the (sequence,
kv head) trees of one IceCache layer) as flat tensors on one device, and runs the *same* search as
:meth:`DCITree.search` (Algorithm 4 with prioritized DCI per level: same levels, same beam
``max(k, fov)``, same per-composite-index candidate count ``k1 = max(ceil(prop * n), 2)``, same
lower bounds, same final top-k) for every query of every tree at once: one set of tensor ops per
level instead of one search per tree on a CPU thread.

Layout: tree ``t`` owns rows ``[t*S, (t+1)*S)`` of every per-point array (``S`` = a point capacity
with headroom) and pages ``[t*Pc, (t+1)*Pc)``; a point's global id is ``t*S + local id``. Insertions
(Algorithm 1, lines 26-36) only append points, so :meth:`update` copies the new points' transformed
keys and projections and re-copies the tree's (small, int) structure arrays; when a tree outgrows
its capacity the mirror is rebuilt with more headroom. All copies go host -> device from pinned
memory without blocking, on the current stream (so they are ordered after the searches already
queued on the old arrays).

No host syncs in :meth:`search` / :meth:`select_pages`: every tensor shape comes from host-known
bounds (per level, the sum of the ``width`` largest node sizes of each tree), never from device
values. Rows padded with ``-1`` behave as in the per-tree search (they only add padding entries).

Differences to the per-tree CPU search: the query projections and the exact inner products are
computed in other batches (a ``bmm`` over all trees, on the GPU), which can change their last bit;
where two lower bounds or two inner products are within that rounding, a different candidate,
beam point or page can win. Without such near-ties the results are the same (tested on CPU,
tests/test_icecache_batched.py). See docs/policies/icecache.md, "Batched device search".
"""

from __future__ import annotations

import itertools
import math

import torch

from kvdex.index.dci import DCITree
from kvdex.index.pages import select_pages
from kvdex.index.search import children, dedupe, pdci

_UIDS = itertools.count()
_HEADROOM = 1.25  # capacity growth factor of the per-tree regions
STATIC_ON_CPU = False  # tests: run the sync-free (static-shape) variant on the CPU too


class DCIForest:
    """A device mirror of the trees ``trees`` (``None`` = an empty tree) of one layer."""

    def __init__(
        self,
        trees: list[DCITree | None],
        device: torch.device | str,
        capacity: tuple[int, int] | None = None,
        static_shapes: bool | None = None,
    ):
        self.device = torch.device(device)
        # static shapes (host-known bounds, no sync) on CUDA; on the CPU a sync is free, so the exact
        # shapes of the per-tree search are cheaper (no padding to the bound)
        if static_shapes is None:
            static_shapes = self.device.type == "cuda" or STATIC_ON_CPU
        self.static = static_shapes
        live = [t for t in trees if t is not None]
        if not live:
            raise ValueError("DCIForest needs at least one tree")
        p = live[0].params
        self.m, self.p, self.ps, self.min_cand = p.num_comp, p.num_simp, p.page_size, p.min_candidates
        self.d1 = live[0].X.shape[1]
        self.T = len(trees)
        self.L = max(t.num_levels for t in live)
        self.S = max(8, math.ceil(max(t.n for t in live) * _HEADROOM))
        self.Pc = max(8, math.ceil(max(t.num_pages for t in live) * _HEADROOM))
        if capacity is not None:  # (points, pages) per tree, e.g. to compare with an updated mirror
            if capacity[0] < max(t.n for t in live) or capacity[1] < max(t.num_pages for t in live):
                raise ValueError(f"capacity {capacity} is below the trees' sizes")
            self.S, self.Pc = capacity
        T, S, Pc, dev = self.T, self.S, self.Pc, self.device
        N = T * S
        self.X = torch.zeros(N + 1, self.d1, device=dev)
        self.proj = torch.full((N + 1, self.m * self.p), float("inf"), device=dev)
        self.dirs = torch.zeros(T, self.m * self.p, self.d1, device=dev)
        self.kids = [torch.zeros(N, dtype=torch.long, device=dev) for _ in range(self.L - 1)]
        self.kid_start = [torch.zeros(N, dtype=torch.long, device=dev) for _ in range(self.L - 1)]
        self.kid_count = [torch.zeros(N, dtype=torch.long, device=dev) for _ in range(self.L - 1)]
        self.pt_page = torch.full((N,), -1, dtype=torch.long, device=dev)
        self.page_pos = torch.full((T * Pc, self.ps), -1, dtype=torch.long, device=dev)
        self.page_fill = torch.zeros(T * Pc, dtype=torch.long, device=dev)
        self.c = torch.ones(T, device=dev)
        self.trees: list[DCITree | None] = [None] * T
        self.levels = [0] * T  # host: levels of each tree (0 = empty)
        self.roots: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * T
        # host: per child level, the cumsum of the node sizes sorted descending (bounds on candidate counts)
        self.node_cum: list[list[torch.Tensor]] = [[] for _ in range(T)]
        self._bounds: dict = {}
        self.version = 0
        self.staged_puts = 0  # updates that used arrays staged on the index worker thread
        self.uid = next(_UIDS)  # (uid, version) identifies the arrays a captured CUDA graph reads
        for t, tree in enumerate(trees):
            if tree is not None:
                self._put(t, tree, 0)
        self._put_roots()

    # ---- mirroring -----------------------------------------------------------------------------------
    def _h2d(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        if self.device.type == "cuda":  # pinned staging: the copy does not block the host
            dst.copy_(src if pinned else src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)

    @staticmethod
    def stage(tree: DCITree, n_from: int, pin: bool) -> dict:
        """The host side of :meth:`_put` for snapshot ``tree`` whose points ``:n_from`` are mirrored
        already: the arrays to copy (pinned if ``pin``) and the node-size bounds. Runs on the index
        worker thread after an insertion, so the step that applies it only issues the copies."""
        f = (lambda x: x.pin_memory()) if pin else (lambda x: x.contiguous())  # noqa: E731
        levels = range(tree.num_levels - 1)
        return {
            "tree": tree,
            "n_from": n_from,
            "pinned": pin,
            "X": f(tree.X[n_from:]),
            "proj": f(tree.proj[n_from : tree.n]),
            "pt_page": f(tree.pt_page),
            "kids": [f(tree.kids[lev]) for lev in levels],
            "kid_start": [f(tree.kid_start[lev]) for lev in levels],
            "kid_count": [f(tree.kid_count[lev]) for lev in levels],
            "page_pos": f(tree.page_positions(torch.arange(tree.num_pages))),
            "page_fill": f(tree.page_fill),
            "cums": [_node_cum(tree, lev) for lev in levels],
        }

    def _put(self, t: int, tree: DCITree, n_from: int, staged: dict | None = None) -> None:
        """Copy tree ``t``'s points ``n_from:`` and its structure arrays into its region (from
        ``staged`` = :meth:`stage` of this very snapshot and ``n_from`` when given)."""
        Pc, n, off = self.Pc, tree.n, t * self.S
        if staged is None or staged["tree"] is not tree or staged["n_from"] != n_from:
            staged = self.stage(tree, n_from, False)
        else:
            self.staged_puts += 1
        pin = staged["pinned"]
        if n_from == 0:
            self._h2d(self.dirs[t], tree.proj_dirs)
            self.c[t] = tree.c
        if n > n_from:
            self._h2d(self.X[off + n_from : off + n], staged["X"], pin)
            self._h2d(self.proj[off + n_from : off + n], staged["proj"], pin)
        # raw tree arrays are copied, then shifted into the region in place (no host-side temporaries)
        self._h2d(self.pt_page[off : off + n], staged["pt_page"], pin)
        self.pt_page[off : off + n].add_(t * Pc)  # every point of a DCITree is in a page (pt_page >= 0)
        for lev in range(tree.num_levels - 1):
            m = staged["kids"][lev].numel()
            self._h2d(self.kids[lev][off : off + m], staged["kids"][lev], pin)
            self.kids[lev][off : off + m].add_(off)
            self._h2d(self.kid_start[lev][off : off + n], staged["kid_start"][lev], pin)
            self.kid_start[lev][off : off + n].add_(off)
            self._h2d(self.kid_count[lev][off : off + n], staged["kid_count"][lev], pin)
        P = tree.num_pages
        self._h2d(self.page_pos[t * Pc : t * Pc + P], staged["page_pos"], pin)
        self._h2d(self.page_fill[t * Pc : t * Pc + P], staged["page_fill"], pin)
        self.node_cum[t] = staged["cums"]
        self.levels[t] = tree.num_levels
        self.roots[t] = tree.root + off
        self.trees[t] = tree
        self._bounds.clear()
        self.version += 1  # arrays (and bounds) changed: a captured CUDA graph of the search is stale

    def _put_roots(self) -> None:
        self.Rmax = max(1, max(r.numel() for r in self.roots))
        root = torch.full((self.T, self.Rmax), -1, dtype=torch.long)
        for t, r in enumerate(self.roots):
            root[t, : r.numel()] = r
        self.root = torch.empty_like(root, device=self.device)
        self._h2d(self.root, root)
        start = torch.zeros(self.L, self.T, dtype=torch.bool)
        for t, lv in enumerate(self.levels):
            if lv:
                start[lv - 1, t] = True
        self.starts_at = torch.empty_like(start, device=self.device)  # [L, T]: the tree's root is on level l
        self._h2d(self.starts_at, start)

    def update(self, trees: list[DCITree | None], staged: dict | None = None) -> DCIForest:
        """Mirror new snapshots of the trees (insertions append points): returns self, updated in
        place, or a fresh forest when a tree outgrew its capacity or changed its shape. ``staged``:
        tree index -> :meth:`stage` output prepared off the main thread (used when it matches)."""
        if len(trees) != self.T:
            return self._fresh(trees)
        changed = False
        for t, (old, new) in enumerate(zip(self.trees, trees, strict=True)):
            if new is old:
                continue
            if new is None:
                return self._fresh(trees)
            grown = old is not None and new.n >= old.n and new.num_levels == old.num_levels
            same = grown and torch.equal(new.proj_dirs, old.proj_dirs) and new.c == old.c
            if new.n > self.S or new.num_pages > self.Pc or new.num_levels > self.L:
                return self._fresh(trees)
            self._put(t, new, old.n if same else 0, (staged or {}).get(t))
            changed = True
        if changed:
            self._put_roots()
        return self

    def _fresh(self, trees) -> DCIForest:
        return DCIForest(trees, self.device, static_shapes=self.static)

    # ---- static sizes -------------------------------------------------------------------------------
    def _children_bound(self, trees: tuple[int, ...], lev: int, width: int) -> int:
        """Largest number of level-``lev`` points in the nodes of ``width`` level-``lev+1`` points."""
        key = (trees, lev, width)
        if key not in self._bounds:
            b = 0
            for t in trees:
                if lev < len(self.node_cum[t]):
                    cum = self.node_cum[t][lev]
                    if cum.numel():
                        b = max(b, int(cum[min(width, cum.numel()) - 1]))
            self._bounds[key] = b
        return self._bounds[key]

    # ---- search (Algorithm 4, batched) --------------------------------------------------------------
    def search(
        self, Xq: torch.Tensor, tq: torch.Tensor, trees: tuple[int, ...], k: int, fov: int, prop: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Page-selection search (``collect_all``) of transformed queries Xq [Q, d+1] in trees ``tq``
        [Q] (device; ``trees`` = the distinct values of tq, host). Returns global point ids [Q, k']
        (-1 padded) and T_Q(q).T_K(k) [Q, k'] (descending, -inf padded), as DCITree.search."""
        Q = Xq.shape[0]
        pq = torch.bmm(self.dirs[tq], Xq[:, :, None]).view(Q, -1)
        width = max(k, fov)
        top = max(self.levels[t] for t in trees) - 1
        pool_ids, pool_dot = [], []
        ids = None
        for lev in range(top, -1, -1):
            parts = []
            if ids is not None:
                C = self._children_bound(trees, lev, ids.shape[1]) if self.static else None
                parts.append(self._children(ids, lev, C))
            if any(self.levels[t] - 1 == lev for t in trees):
                parts.append(torch.where(self.starts_at[lev][tq][:, None], self.root[tq], -1))
            cand = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
            ids, dot = self._pdci(Xq, pq, cand, width, prop)
            pool_ids.append(ids)
            pool_dot.append(dot)
        ids, dot = torch.cat(pool_ids, 1), torch.cat(pool_dot, 1)
        if len(pool_ids) > 1:
            ids, dot = dedupe(ids, dot)
        kk = min(k, ids.shape[1])
        dot, j = torch.topk(dot, kk, dim=1)
        return torch.where(torch.isfinite(dot), ids.gather(1, j), -1), dot

    def _pdci(self, Xq, pq, cand, width, prop):
        """DCITree._pdci with host-known shapes (static: the k1-th smallest bound per row by a sort)."""
        return pdci(self.X, self.proj, Xq, pq, cand, width, prop, self.m, self.p, self.min_cand, self.static)

    def _children(self, ids: torch.Tensor, level: int, C: int | None) -> torch.Tensor:
        """DCITree._children with a host-known width C (>= every row's child count), or (None) the
        exact width (a sync)."""
        return children(self.kids[level], self.kid_start[level], self.kid_count[level], ids, C)

    # ---- page selection (Algorithm 3, kvdex's GQA union and budget rules, batched) -----------------
    def select_pages(
        self,
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
        """TreeSearch.select_pages for R trees at once: ids/dot [R*G, k'] (global, the search's
        output; the G query heads of row r are rows r*G ... r*G+G-1), rows_tree [R] (device). Returns
        token positions [R, T] (-1 padded, in page order) and the number of pages taken [R]."""
        return select_pages(self, ids, dot, rows_tree, G, room, cap, rule, merge, qk_scale, scale)


def _node_cum(tree: DCITree, lev: int) -> torch.Tensor:
    """Sizes of the level-``lev`` nodes (children of the level-``lev+1`` points), sorted descending,
    cumulated: entry w-1 bounds the points in the nodes of any w level-``lev+1`` points."""
    heads = tree.kid_count[lev][tree.top >= lev + 1]
    return torch.sort(heads, descending=True).values.cumsum(0)
