"""CHESS's Grid -> Chunk -> Page hierarchy (kvdex.policies.chess): the one buffer of page, chunk and
grid vectors, its indexing (eq. 1-2, also for page joins inside a captured step) and its scoring (the
window or query anchor, eq. 3, the affinities, eq. 4, and Algorithm 1's top-down masks).

:class:`HierarchyMixin` holds the methods; :class:`~kvdex.policies.chess.ChessPolicy` owns the state
(``_vall``, ``_gcap``, ``_npages``, ``_slot``, ``_hd``, set in ``bind``).
"""

from __future__ import annotations

import torch

from kvdex.policies._chess_levels import top_down, window_anchor, window_keys
from kvdex.storage import MiddleUpdate

_GROW_GRIDS = 16  # index capacity grows by this many grids (and >= 25%) at a time


class HierarchyMixin:
    """The hierarchy methods of :class:`~kvdex.policies.chess.ChessPolicy`."""

    # ---- the buffer and its indexing (eq. 1-2) -------------------------------------------------------
    @property
    def _ccap(self) -> int:
        return self._gcap * self.grid_chunks

    @property
    def _pcap(self) -> int:
        return self._ccap * self.chunk_pages

    def _reserve(self, pages: int, like: torch.Tensor) -> None:
        per_grid = self.chunk_pages * self.grid_chunks
        need = -(-pages // per_grid)
        if need <= self._gcap:
            return
        old, (og, oc, op) = self._vall, (self._gcap, self._ccap, self._pcap)
        self._gcap = max(need, self._gcap + max(_GROW_GRIDS, self._gcap // 4))
        b = like.shape[0]
        self._vall = torch.zeros(b, self._gcap + self._ccap + self._pcap, self.dim, device=like.device)
        if old is not None:
            self._vall[:, :og] = old[:, :og]
            self._vall[:, self._gcap : self._gcap + oc] = old[:, og : og + oc]
            self._vall[:, self._gcap + self._ccap : self._gcap + self._ccap + op] = old[:, og + oc :]

    def _views(self):
        """(grids [B, Gcap, F], chunks [B, Ccap, F], pages [B, Pcap, F]) views of the one buffer."""
        g, c = self._gcap, self._ccap
        return self._vall[:, :g], self._vall[:, g : g + c], self._vall[:, g + c :]

    def _add_pages(self, slot: int, update) -> None:
        """Eq. 1 for the new pages (this layer's slice of F), then eq. 2 for their chunks and grids."""
        start = update.start.clone()
        end = start + update.count
        self._reserve(int(end.max()), update.keys)
        vg, vc, vp = self._views()
        cols = slice(slot * self._hd, (slot + 1) * self._hd)
        means = update.keys.float().mean(dim=3)  # [B, H, Pn, D]: mean-pooled keys of each page
        b, h, pn, d = means.shape
        means = means.permute(0, 2, 1, 3).reshape(b, pn, h * d)  # flatten (kv head, dim)
        ids = update.page_ids()  # [B, Pn]
        bi, j = torch.nonzero(ids >= 0, as_tuple=True)
        dev = vp.device  # device_map: the one buffer lives on the first sparse layer's device, this layer's moves
        vp[bi.to(dev), ids[bi, j].to(dev), cols] = means[bi, j].to(dev)
        self._npages[slot] = torch.maximum(self._npages[slot], end)
        # centroids of the touched chunks and grids, over the pages/chunks each sequence has so far
        nc, ng = self.chunk_pages, self.grid_chunks
        live = update.count > 0
        c0, c1 = int(start[live].min()) // nc, -(-int(end.max()) // nc)
        n = self._npages[slot].to(vp.device)
        pages = vp[:, c0 * nc : c1 * nc, cols].reshape(b, c1 - c0, nc, -1)
        pid = torch.arange(c0 * nc, c1 * nc, device=vp.device).view(1, c1 - c0, nc)
        have = (pid < n[:, None, None]).float()  # [B, chunks, Nc]
        vc[:, c0:c1, cols] = (pages * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        g0, g1 = c0 // ng, -(-c1 // ng)
        chunks = vc[:, g0 * ng : g1 * ng, cols].reshape(b, g1 - g0, ng, -1)
        cid = torch.arange(g0 * ng, g1 * ng, device=vp.device).view(1, g1 - g0, ng)
        have = (cid < (-(-n // nc))[:, None, None]).float()
        vg[:, g0:g1, cols] = (chunks * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]

    def index_join(self, layer, join) -> None:
        self._stores[layer] = join.store
        if self.digests is not None:  # units="digest": the joining page's digest, in the captured step too
            self.digests.write_join(layer, join)
        if self._vall is None:
            return
        vg, vc, vp = self._views()
        dev = vp.device
        cols = slice(self._slot[layer] * self._hd, (self._slot[layer] + 1) * self._hd)
        means = join.keys.float().mean(dim=3)  # [B, H, 1, D]
        b, h, _, d = means.shape
        means = means.permute(0, 2, 1, 3).reshape(b, h * d).to(dev)
        on, bi = join.joins.to(dev)[:, None], torch.arange(b, device=dev)
        page = join.start.to(dev).clamp(max=vp.shape[1] - 1)
        vp[bi, page, cols] = torch.where(on, means, vp[bi, page, cols])
        nc, ng = self.chunk_pages, self.grid_chunks
        n = page + 1  # pages of a joining sequence (this one is its last)
        chunk, grid = page // nc, page // (nc * ng)
        pid = chunk[:, None] * nc + torch.arange(nc, device=dev)  # [B, Nc]
        have = (pid < n[:, None]).float()[:, None]  # [B, 1, Nc]
        pages = vp[bi[:, None], pid, cols][:, None]  # [B, 1, Nc, F_layer]
        cent = (pages * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        vc[bi, chunk, cols] = torch.where(on, cent[:, 0], vc[bi, chunk, cols])
        cid = grid[:, None] * ng + torch.arange(ng, device=dev)  # [B, Ng]
        have = (cid < (-(-n // nc))[:, None]).float()[:, None]
        chunks = vc[bi[:, None], cid, cols][:, None]
        cent = (chunks * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        vg[bi, grid, cols] = torch.where(on, cent[:, 0], vg[bi, grid, cols])

    # ---- scoring (eq. 3-4, Algorithm 1) ---------------------------------------------------------------
    def anchor(self, upcoming: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 3: the mean of the window's page vectors, [B, F] (the newest page may be partial).

        ``upcoming`` [B] (CPU): sequences whose next token starts a new page, so that the oldest
        window page joins the middle at the next step. Its page vector is indexed now (the same
        eq. 1 the cache's update will repeat), so a selection built between two steps covers the
        middle of the step it serves (with every ratio 1 it is exactly all middle pages).
        """
        parts = []
        ps = self.cfg.page_size
        for layer in self.info.sparse_layers:
            k, valid = window_keys(self._stores[layer])
            b, h, w, d = k.shape
            if upcoming is not None and bool(upcoming.any()):
                start = self._npages[self._slot[layer]].clone()  # not a view: _add_pages advances it
                self._add_pages(self._slot[layer], MiddleUpdate(start, upcoming.long(), k[:, :, None, :ps]))
            a = window_anchor(k, valid, ps)
            parts.append(a.reshape(b, h * d).to(parts[0].device if parts else a.device))
        return torch.cat(parts, dim=-1)

    def query_anchor(self) -> torch.Tensor:
        """``anchor_from="query"``: the last decode step's queries, [B, F] laid out as the page vectors
        (sparse layer, kv head, dim), each kv head's query the mean of its group's query heads. The
        affinity of a page is then the sum over layers and heads of q . mean key: the query-key score
        Quest and ArkVale bound, here on CHESS's grids, chunks and pages."""
        parts = [self._queries[layer] for layer in self.info.sparse_layers]
        dev = parts[0].device
        return torch.cat([x.reshape(x.shape[0], -1).to(dev) for x in parts], dim=-1)

    def _record_query(self, layer: int, q: torch.Tensor, kv_heads: int) -> None:
        """Keep this step's queries of ``layer`` (in place, so a captured step records them too)."""
        b, hq, d = q.shape
        qm = q.view(b, kv_heads, hq // kv_heads, d).float().mean(2)
        buf = self._queries.get(layer)
        if buf is None or buf.shape != qm.shape or buf.device != qm.device:
            self._queries[layer] = qm.clone()  # eager steps only: graph_key waits for every buffer
        else:
            buf.copy_(qm)

    def scores(self, anchor: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 4 for the whole hierarchy in ONE batched GEMM over the coalesced buffer (Alg. 1 l. 1-4).

        Returns (S_g [B, G], S_c [B, C], S_p [B, P]) for the first ``pages`` pages.
        """
        g, c = self._gcap, self._ccap
        s_all = torch.bmm(self._vall[:, : g + c + pages], anchor[:, :, None].to(self._vall.device)).squeeze(-1)
        if self.info.tp is not None:  # tensor parallelism: F is split over the ranks' heads, sum the partial scores
            s_all = self.info.tp.all_reduce(s_all.contiguous())
        nc, ng = self.chunk_pages, self.grid_chunks
        cn = -(-pages // nc)
        return s_all[:, : -(-cn // ng)], s_all[:, g : g + cn], s_all[:, g + c : g + c + pages]

    def select_pages(self, s_g, s_c, s_p, npages: torch.Tensor, k: int | None = None):
        """Top-down masking (Alg. 1 l. 5-18) for sequences with ``npages`` [B] middle pages.

        Returns the kept masks (grids [B, G], chunks [B, C], pages [B, P]); a chunk is scored only
        under a kept grid and a page only under a kept chunk. ``k``: the pages kept in budget mode
        (default ``budget_pages``).
        """
        return top_down(
            s_g, s_c, s_p, npages, nc=self.chunk_pages, ng=self.grid_chunks, ratios=self.ratios,
            k=self.budget_pages if k is None else k, shape=self.shape,
        )  # fmt: skip
