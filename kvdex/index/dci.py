"""Multi-level Dynamic Continuous Indexing (M-DCI): the DCI-tree of IceCache (Mao et al., 2025).

One tree indexes the keys of one (sequence, kv head). Everything is a flat torch tensor on the
CPU; a node is a contiguous run of a CSR array, never a Python object.

Transform (IceCache eq. 2/3). A key k becomes ``T_K(k) = [k/c, sqrt(1 - |k|^2/c^2)]`` and a query
``T_Q(q) = [q/|q|, 0]``; both have unit norm, so ``|T_K(k) - T_Q(q)|^2 = 2 - 2 q.k / (c |q|)``:
Euclidean nearest neighbours of T_Q(q) are exactly the keys with the largest inner product with q.

Levels. Every point is on level 0; it is promoted to level 1, 2, ... with probability ``r`` each
time (geometric, Algorithm 2), empty levels are dropped. Level ``l`` holds the points whose top
level is >= l. Each point of level ``l < L-1`` has a parent on level ``l+1``: the nearest point
among the points promoted to ``l+1`` (a promoted point is its own parent). The children of one
parent form a *node*; the points of the top level form the root node. The nodes of level 0 are the
leaves, and a leaf is stored in physical pages of ``page_size`` tokens (a leaf that outgrows its
page spills into new pages).

Search (Algorithm 4, M-DCI). Start with the root node; on each level run prioritized DCI over the
points of the current nodes and keep the best ``fov`` points (the field of view of the DCI
reference implementation); their child nodes are searched on the level below. Page selection
collects the points found on every level and returns the k with the largest inner product.

Prioritized DCI within the nodes (Li & Malik, 2017). ``m`` composite indices of ``p`` simple
indices each; a simple index is a random unit direction u and the points sorted by their
projection. For a query, the priority queue of composite index j pops (point, simple index) pairs
by increasing ``|u.(x - q)|``; a point is retrieved once all p of its simple indices have been
popped, i.e. in increasing order of the composite lower bound ``max_u |u.(x - q)| <= |x - q|``.
The first ``k1`` retrieved points of every composite index become candidates and only the
candidates get their true distance. We compute that retrieval order directly: the lower bounds of
all points of the visited nodes (their projections are stored at insertion, the query is projected
once) and a per-composite top-k1. This yields the same candidates as walking the sorted lists with
the priority queue, in one vectorised pass; nodes hold ~1/r points, so a scan is cheaper than
pointer walks in Python. See docs/policies/icecache.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvdex.index.search import children, dedupe, pdci

_QUERY_CHUNK = 4096  # queries per batched search during construction (bounds memory)
PARENTS = ("dci", "exact")  # DCIParams.parents


# ---- the transform (eq. 2 / eq. 3) ------------------------------------------------------------------


def transform_keys(k: torch.Tensor, c: float) -> tuple[torch.Tensor, int]:
    """Eq. 2: [n, d] -> [n, d+1] unit vectors. Keys with |k| > c (possible only for keys inserted
    after the tree fixed c) are put on the sphere as [k/|k|, 0]; returns how many were clamped."""
    k = k.float()
    n2 = (k * k).sum(-1, keepdim=True)
    over = n2 > c * c
    scale = torch.where(over, n2.sqrt().clamp(min=1e-30), torch.full_like(n2, c))
    extra = (1.0 - n2 / (c * c)).clamp(min=0.0).sqrt()
    extra = torch.where(over, torch.zeros_like(extra), extra)
    return torch.cat([k / scale, extra], dim=-1), int(over.sum())


def transform_queries(q: torch.Tensor) -> torch.Tensor:
    """Eq. 3: [n, d] -> [n, d+1] = [q/|q|, 0]."""
    q = q.float()
    qn = q / q.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    return torch.cat([qn, torch.zeros_like(qn[:, :1])], dim=-1)


# ---- parameters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DCIParams:
    """Knobs of one DCI-tree (defaults: docs/policies/icecache.md says where each comes from)."""

    promotion_ratio: float = 1 / 16
    num_comp: int = 2  # composite indices (m)
    num_simp: int = 4  # simple indices (random projections) per composite index (p)
    construction_fov: int = 10  # points per level whose nodes are searched when finding a parent
    construction_prop: float = 0.25  # share of a visited node set retrieved per composite index (parent search)
    min_candidates: int = 2  # retrieve at least this many points per composite index
    page_size: int = 16
    norm_margin: float = 1.25  # c = norm_margin * max |k| of the keys the tree is built from
    seed: int = 0
    # how a point finds its parent on the level above: "dci" = the tree's own approximate search
    # (Algorithm 2, with construction_fov / construction_prop), "exact" = the largest inner product
    # among all points of that level (one matrix product per chunk; not the paper's construction)
    parents: str = "dci"

    def __post_init__(self) -> None:
        if not 0.0 < self.promotion_ratio < 1.0:
            raise ValueError(f"promotion_ratio must be in (0, 1), got {self.promotion_ratio}")
        for name in ("num_comp", "num_simp", "construction_fov", "min_candidates", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0.0 < self.construction_prop <= 1.0:
            raise ValueError(f"construction_prop must be in (0, 1], got {self.construction_prop}")
        if self.norm_margin < 1.0:
            raise ValueError(f"norm_margin must be >= 1 (c must bound every key norm), got {self.norm_margin}")
        if self.parents not in PARENTS:
            raise ValueError(f"parents must be one of {', '.join(map(repr, PARENTS))}, got {self.parents!r}")


# ---- the tree -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DCITree:
    """An immutable snapshot: :meth:`insert` returns a new tree, so a search running on another
    thread never sees a half-updated structure.

    Points are numbered in insertion order. ``parent[l]`` [n] (-1 if the point is not on level l),
    ``kids[l]`` the level-l points sorted by parent, ``kid_start[l]/kid_count[l]`` [n] the node of
    each level-(l+1) point inside ``kids[l]``. Pages: ``page_pts`` [P, ps] point ids (-1 empty),
    ``page_fill`` [P], ``node_last_page`` [n] (last page of the leaf node a point heads, -1),
    ``pt_page/pt_slot`` [n] where each point is stored.
    """

    params: DCIParams
    c: float
    proj_dirs: torch.Tensor  # [m*p, d+1] unit directions
    X: torch.Tensor  # [n, d+1] transformed keys
    proj: torch.Tensor  # [n + 1, m*p] projections of X, then a row of +inf (the padding sentinel)
    pos: torch.Tensor  # [n] token positions
    top: torch.Tensor  # [n] top level
    num_levels: int
    root: torch.Tensor  # [nr] points of the top level
    parent: tuple[torch.Tensor, ...]
    kids: tuple[torch.Tensor, ...]
    kid_start: tuple[torch.Tensor, ...]
    kid_count: tuple[torch.Tensor, ...]
    page_pts: torch.Tensor
    page_fill: torch.Tensor
    node_last_page: torch.Tensor
    pt_page: torch.Tensor
    pt_slot: torch.Tensor
    clamped: int = 0  # inserted keys whose norm exceeded c

    # ---- construction (Algorithm 2) ------------------------------------------------------------------
    @classmethod
    def build(cls, keys: torch.Tensor, positions: torch.Tensor, params: DCIParams) -> DCITree:
        """Index keys [n, d] (n >= 1) stored at token ``positions`` [n]."""
        keys = keys.detach().to("cpu", torch.float32)
        n, d = keys.shape
        if n == 0:
            raise ValueError("DCITree.build needs at least one key")
        c = float(keys.norm(dim=-1).max()) * params.norm_margin or 1.0
        X, _ = transform_keys(keys, c)
        dirs, top = sample_tree(params, n, d)
        top = torch.unique(top, return_inverse=True)[1]  # remove empty levels
        L = int(top.max()) + 1
        empty = torch.empty(0, dtype=torch.long)
        tree = cls(
            params, c, dirs, X, _with_sentinel(X @ dirs.T), positions.to("cpu", torch.long).clone(), top, L,
            torch.nonzero(top == L - 1).flatten(), (), (), (), (),
            empty.view(0, params.page_size), empty, torch.full((n,), -1), torch.full((n,), -1), torch.full((n,), -1),
        )  # fmt: skip
        # Parents level by level from the top: every parent search sees all promoted points above
        # (Algorithm 2 inserted in order of decreasing level).
        parents, kids, starts, counts = [None] * (L - 1), [None] * (L - 1), [None] * (L - 1), [None] * (L - 1)
        for lev in range(L - 2, -1, -1):
            par = torch.full((n,), -1, dtype=torch.long)
            up = torch.nonzero(top >= lev + 1).flatten()
            par[up] = up
            new = torch.nonzero(top == lev).flatten()
            if new.numel():
                par[new] = tree._parents_of(tree.X[new], lev + 1)
            parents[lev] = par
            kids[lev], starts[lev], counts[lev] = _csr(par, n)
            tree = dataclasses.replace(
                tree, parent=tuple(parents), kids=tuple(kids), kid_start=tuple(starts), kid_count=tuple(counts)
            )
        return tree._with_new_leaves(torch.arange(n))

    def insert(self, keys: torch.Tensor, positions: torch.Tensor, generator: torch.Generator) -> DCITree:
        """Algorithm 1, lines 26-36: insert keys [t, d] with the same random promotion (capped at
        the top level: a new point never creates a level above the root), each parent found by
        the tree's own search, each key stored in the last page of its leaf node or a new page."""
        keys = keys.detach().to("cpu", torch.float32)
        t = keys.shape[0]
        if t == 0:
            return self
        n0, L = self.n, self.num_levels
        Xn, over = transform_keys(keys, self.c)
        topn = _promote(t, self.params.promotion_ratio, generator).clamp(max=L - 1)
        ids = torch.arange(n0, n0 + t)
        tree = dataclasses.replace(
            self,
            X=torch.cat([self.X, Xn]),
            proj=_with_sentinel(torch.cat([self.proj[:-1], Xn @ self.proj_dirs.T])),
            pos=torch.cat([self.pos, positions.to("cpu", torch.long)]),
            top=torch.cat([self.top, topn]),
            root=torch.cat([self.root, ids[topn == L - 1]]),
            node_last_page=torch.cat([self.node_last_page, torch.full((t,), -1)]),
            pt_page=torch.cat([self.pt_page, torch.full((t,), -1)]),
            pt_slot=torch.cat([self.pt_slot, torch.full((t,), -1)]),
            clamped=self.clamped + over,
        )
        n = n0 + t
        parents, kids, starts, counts = list(self.parent), list(self.kids), list(self.kid_start), list(self.kid_count)
        for lev in range(L - 2, -1, -1):
            par = torch.cat([self.parent[lev], torch.full((t,), -1)])
            up = ids[topn >= lev + 1]
            par[up] = up
            new = ids[topn == lev]
            if new.numel():
                par[new] = tree._parents_of(tree.X[new], lev + 1)
            parents[lev] = par
            kids[lev], starts[lev], counts[lev] = _csr(par, n)
            tree = dataclasses.replace(
                tree, parent=tuple(parents), kids=tuple(kids), kid_start=tuple(starts), kid_count=tuple(counts)
            )
        return tree._with_new_leaves(ids)

    def _with_new_leaves(self, ids: torch.Tensor) -> DCITree:
        """Store points ``ids`` (in order) into the pages of their leaf nodes."""
        ps = self.params.page_size
        leaf = self.parent[0][ids] if self.num_levels > 1 else torch.zeros_like(ids)
        page_pts, fill = self.page_pts.clone(), self.page_fill.clone()
        last, pt_page, pt_slot = self.node_last_page.clone(), self.pt_page.clone(), self.pt_slot.clone()
        if last.numel() < self.n:  # single-level tree: the root is the only node, headed by point 0
            last = torch.cat([last, torch.full((self.n - last.numel(),), -1)])
        # Group the new points by leaf node (stable: insertion order inside a node).
        order = torch.argsort(leaf, stable=True)
        ids, leaf = ids[order], leaf[order]
        uniq, cnt = torch.unique_consecutive(leaf, return_counts=True)
        if page_pts.shape[0] == 0:  # a fresh build: every node starts its own pages (vectorised, no per-node loop)
            npages = (cnt + ps - 1) // ps
            first = npages.cumsum(0) - npages
            rank = torch.arange(ids.numel()) - torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
            page = torch.repeat_interleave(first, cnt) + rank // ps
            slot = rank % ps
            P = int(npages.sum())
            page_pts = torch.full((P, ps), -1, dtype=torch.long)
            page_pts[page, slot] = ids
            pt_page[ids], pt_slot[ids] = page, slot
            last[uniq] = first + npages - 1
            fill = torch.bincount(page, minlength=P)
            return dataclasses.replace(
                self, page_pts=page_pts, page_fill=fill, node_last_page=last, pt_page=pt_page, pt_slot=pt_slot
            )
        new_pages_pts, new_fill = [], []
        P = page_pts.shape[0]
        at = 0
        for node, c in zip(uniq.tolist(), cnt.tolist(), strict=True):
            members = ids[at : at + c]
            at += c
            lp = int(last[node])
            if lp >= 0:  # fill the node's last page first
                room = min(ps - int(fill[lp]) if lp < P else ps - new_fill[lp - P], c)
                if room > 0:
                    f0 = int(fill[lp]) if lp < P else new_fill[lp - P]
                    take = members[:room]
                    slots = torch.arange(f0, f0 + room)
                    if lp < P:
                        page_pts[lp, slots] = take
                        fill[lp] += room
                    else:
                        new_pages_pts[lp - P][slots] = take
                        new_fill[lp - P] += room
                    pt_page[take], pt_slot[take] = lp, slots
                    members = members[room:]
            for s in range(0, members.numel(), ps):  # spill into new pages
                chunk = members[s : s + ps]
                row = torch.full((ps,), -1, dtype=torch.long)
                row[: chunk.numel()] = chunk
                pid = P + len(new_pages_pts)
                new_pages_pts.append(row)
                new_fill.append(chunk.numel())
                pt_page[chunk], pt_slot[chunk] = pid, torch.arange(chunk.numel())
                last[node] = pid
        if new_pages_pts:
            page_pts = torch.cat([page_pts, torch.stack(new_pages_pts)])
            fill = torch.cat([fill, torch.tensor(new_fill, dtype=torch.long)])
        return dataclasses.replace(
            self, page_pts=page_pts, page_fill=fill, node_last_page=last, pt_page=pt_page, pt_slot=pt_slot
        )

    def _parents_of(self, Xq: torch.Tensor, level: int) -> torch.Tensor:
        """Nearest point of ``level`` for each transformed key (1-NN by the tree's own search, or exactly
        with ``parents="exact"``: transformed keys have one norm, so the nearest is the largest inner product)."""
        out = []
        p = self.params
        if p.parents == "exact":
            pts = torch.nonzero(self.top >= level).flatten()
            Xl = self.X[pts]
            for s in range(0, Xq.shape[0], _QUERY_CHUNK):
                out.append(pts[(Xq[s : s + _QUERY_CHUNK] @ Xl.T).argmax(1)])
            return torch.cat(out)
        for s in range(0, Xq.shape[0], _QUERY_CHUNK):
            ids, _ = self.search(Xq[s : s + _QUERY_CHUNK], 1, level, p.construction_fov, p.construction_prop)
            out.append(ids[:, 0])
        return torch.cat(out)

    # ---- search (Algorithm 4) ---------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def num_pages(self) -> int:
        return self.page_pts.shape[0]

    def search(
        self, Xq: torch.Tensor, k: int, stop_level: int, fov: int, prop: float, collect_all: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-DCI k-NN of transformed queries Xq [Q, d+1] among the points of ``stop_level``.

        Descends from the root; on every level P-DCI keeps the best ``max(k, fov)`` points of the
        visited nodes, whose child nodes are visited next. ``collect_all`` (page selection, the
        flag of Algorithm 4) ranks the points found on every level, else only those of
        ``stop_level``. Returns ids [Q, k'] (-1 padded) and inner products [Q, k'] (descending)."""
        Q = Xq.shape[0]
        pq = Xq @ self.proj_dirs.T
        width = max(k, fov)
        cand = self.root.expand(Q, -1)
        pool_ids, pool_dot = [], []
        for lev in range(self.num_levels - 1, stop_level - 1, -1):
            ids, dot = self._pdci(Xq, pq, cand, width, prop)
            if collect_all or lev == stop_level:
                pool_ids.append(ids)
                pool_dot.append(dot)
            if lev > stop_level:
                cand = self._children(ids, lev - 1)
        ids, dot = torch.cat(pool_ids, 1), torch.cat(pool_dot, 1)
        if len(pool_ids) > 1:  # a point found on several levels counts once
            ids, dot = dedupe(ids, dot)
        kk = min(k, ids.shape[1])
        dot, j = torch.topk(dot, kk, dim=1)
        ids = torch.where(torch.isfinite(dot), ids.gather(1, j), -1)
        return ids, dot

    def _pdci(self, Xq, pq, cand, width, prop):
        """Prioritized DCI over the candidate sets cand [Q, C] (-1 padded): best ``width`` by distance."""
        p = self.params
        return pdci(self.X, self.proj, Xq, pq, cand, width, prop, p.num_comp, p.num_simp, p.min_candidates)

    def _children(self, ids: torch.Tensor, level: int) -> torch.Tensor:
        """The union of the level-``level`` nodes headed by ids [Q, w] (-1 padded) as [Q, C] (-1 padded)."""
        return children(self.kids[level], self.kid_start[level], self.kid_count[level], ids)

    # ---- pages ------------------------------------------------------------------------------------
    def leaf_nodes(self) -> torch.Tensor:
        """[n] the leaf node (head point) of every point."""
        return self.parent[0] if self.num_levels > 1 else torch.zeros(self.n, dtype=torch.long)

    def page_positions(self, pages: torch.Tensor) -> torch.Tensor:
        """Token positions of pages [P] as [P, ps] (-1 in empty slots)."""
        pts = self.page_pts[pages]
        return torch.where(pts >= 0, self.pos[pts.clamp(min=0)], -1)

    def topk(self, q: torch.Tensor, k: int, fov: int, prop: float) -> torch.Tensor:
        """Page selection's query: the k keys with the largest (approximate) inner product with each
        query q [G, d]: point ids [G, k'] in descending order, -1 padded."""
        ids, _ = self.search(transform_queries(q), k, 0, fov, prop, collect_all=True)
        return ids


def sample_tree(params: DCIParams, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The random draws of :meth:`DCITree.build` for n keys of dimension d, from ``params.seed``: the
    projection directions [m*p, d+1] and every point's top level [n] before empty levels are removed.
    The levels of the first n' points are the same for every n >= n' (one stream, directions first), so
    a sequence's promotions do not depend on the length of the others in its batch."""
    g = torch.Generator().manual_seed(params.seed)
    dirs = torch.randn(params.num_comp * params.num_simp, d + 1, generator=g)
    return dirs / dirs.norm(dim=-1, keepdim=True), _promote(n, params.promotion_ratio, g)


def _with_sentinel(proj: torch.Tensor) -> torch.Tensor:
    return torch.cat([proj, torch.full_like(proj[:1], float("inf"))])


def _promote(n: int, r: float, g: torch.Generator) -> torch.Tensor:
    """Random promotion: level = number of successes of ``Random(0,1) < r`` (geometric)."""
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp(min=1e-300)
    return torch.floor(torch.log(u) / math.log(r)).long()


def _csr(parent: torch.Tensor, n: int):
    """Children lists of one level: kids (members sorted by parent), start and count per parent."""
    members = torch.nonzero(parent >= 0).flatten()
    par = parent[members]
    order = torch.argsort(par, stable=True)
    kids = members[order]
    count = torch.bincount(par, minlength=n)
    start = count.cumsum(0) - count
    return kids, start, count
