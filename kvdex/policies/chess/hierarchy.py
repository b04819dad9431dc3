"""CHESS's Grid -> Chunk -> Page hierarchy (kvdex.policies.chess): the one buffer of page, chunk and
grid vectors, its indexing (eq. 1-2, also for page joins inside a captured step) and its scoring (the
window anchor, eq. 3, the affinities, eq. 4, and Algorithm 1's top-down masks).

:class:`Hierarchy` owns the buffer (``vall``, ``gcap``), the pages indexed per layer (``npages``) and the
layout of the flattened page vectors (``slot``, ``hd``, ``dim``); the policy's scopes score it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvdex.policies.chess.levels import top_down, window_anchor, window_keys
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin, grown_capacity

_GROW_GRIDS = 16  # index capacity grows by this many grids (and >= 25%) at a time (storage.grown_capacity)


class Hierarchy:
    """The coalesced ``[grids | chunks | pages]`` buffer of one policy, all its sparse layers.

    ``ratios``: (rho_g, rho_c, rho_p) in ratio mode, None in budget mode (``budget_pages`` pages kept,
    split over the levels like the ``shape`` preset); ``tp``: the tensor-parallel group (its ``all_reduce``
    sums the partial scores of the ranks' heads), None in one process."""

    def __init__(
        self,
        sparse_layers: tuple[int, ...],
        kv_heads: int,
        head_dim: int,
        *,
        chunk_pages: int,
        grid_chunks: int,
        page_size: int,
        ratios: tuple[float, float, float] | None,
        shape: str,
        budget_pages: int,
        tp: Any = None,
    ) -> None:
        self.layers = sparse_layers
        self.slot = {layer: i for i, layer in enumerate(sparse_layers)}  # layer -> its columns' block of F
        self.hd = kv_heads * head_dim  # columns per layer
        self.dim = len(sparse_layers) * self.hd  # F
        self.chunk_pages = chunk_pages  # N_c
        self.grid_chunks = grid_chunks  # N_g
        self.page_size = page_size
        self.ratios = ratios
        self.shape = shape
        self.budget_pages = budget_pages
        self.tp = tp
        self.vall: torch.Tensor | None = None  # [B, Gcap + Ccap + Pcap, F] fp32: grids | chunks | pages
        self.gcap = 0
        self.npages: torch.Tensor | None = None  # [layers, B] pages indexed per layer (CPU)

    # ---- the buffer and its indexing (eq. 1-2) -------------------------------------------------------
    @property
    def ccap(self) -> int:
        return self.gcap * self.grid_chunks

    @property
    def pcap(self) -> int:
        return self.ccap * self.chunk_pages

    def columns(self, slot: int) -> slice:
        """The columns of F that hold the sparse layer of index ``slot``."""
        return slice(slot * self.hd, (slot + 1) * self.hd)

    def counts(self, batch: int) -> torch.Tensor:
        """``npages``, made (zeros) for ``batch`` sequences at the first index."""
        if self.npages is None:
            self.npages = torch.zeros(len(self.slot), batch, dtype=torch.long)
        return self.npages

    def counted(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        """Pages ``start`` .. ``start + count`` [B] of ``layer`` are indexed elsewhere (page digests)."""
        slot = self.slot[layer]
        npages = self.counts(count.shape[0])
        npages[slot] = torch.maximum(npages[slot], start + count)

    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        """The host side of a captured page join: the counts of the sequences with ``count > 0``."""
        slot = self.slot[layer]
        npages = self.counts(count.shape[0])
        npages[slot] = torch.where(count > 0, torch.maximum(npages[slot], start + count), npages[slot])

    def key(self) -> tuple:
        """What a captured step's page joins write into (its identity and capacity)."""
        return (id(self.vall), self.gcap)

    def reserve(self, pages: int, like: torch.Tensor) -> None:
        per_grid = self.chunk_pages * self.grid_chunks
        need = -(-pages // per_grid)
        if need <= self.gcap:
            return
        old, (og, oc, op) = self.vall, (self.gcap, self.ccap, self.pcap)
        self.gcap = grown_capacity(need, self.gcap, _GROW_GRIDS)
        b = like.shape[0]
        self.vall = torch.zeros(b, self.gcap + self.ccap + self.pcap, self.dim, device=like.device)
        if old is not None:
            self.vall[:, :og] = old[:, :og]
            self.vall[:, self.gcap : self.gcap + oc] = old[:, og : og + oc]
            self.vall[:, self.gcap + self.ccap : self.gcap + self.ccap + op] = old[:, og + oc :]

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grids [B, Gcap, F], chunks [B, Ccap, F], pages [B, Pcap, F]) views of the one buffer."""
        assert self.vall is not None, "views of an unallocated hierarchy"
        g, c = self.gcap, self.ccap
        return self.vall[:, :g], self.vall[:, g : g + c], self.vall[:, g + c :]

    def add_pages(self, slot: int, update: MiddleUpdate) -> None:
        """Eq. 1 for the new pages (this layer's slice of F), then eq. 2 for their chunks and grids."""
        start = update.start.clone()
        end = start + update.count
        self.reserve(int(end.max()), update.keys)
        vg, vc, vp = self.views()
        cols = self.columns(slot)
        means = update.keys.float().mean(dim=3)  # [B, H, Pn, D]: mean-pooled keys of each page
        b, h, pn, d = means.shape
        means = means.permute(0, 2, 1, 3).reshape(b, pn, h * d)  # flatten (kv head, dim)
        ids = update.page_ids()  # [B, Pn]
        bi, j = torch.nonzero(ids >= 0, as_tuple=True)
        dev = vp.device  # device_map: the one buffer lives on the first sparse layer's device, this layer's moves
        vp[bi.to(dev), ids[bi, j].to(dev), cols] = means[bi, j].to(dev)
        npages = self.counts(b)
        npages[slot] = torch.maximum(npages[slot], end)
        # centroids of the touched chunks and grids, over the pages/chunks each sequence has so far
        nc, ng = self.chunk_pages, self.grid_chunks
        live = update.count > 0
        c0, c1 = int(start[live].min()) // nc, -(-int(end.max()) // nc)
        n = npages[slot].to(vp.device)
        pages = vp[:, c0 * nc : c1 * nc, cols].reshape(b, c1 - c0, nc, -1)
        pid = torch.arange(c0 * nc, c1 * nc, device=vp.device).view(1, c1 - c0, nc)
        have = (pid < n[:, None, None]).float()  # [B, chunks, Nc]
        vc[:, c0:c1, cols] = (pages * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        g0, g1 = c0 // ng, -(-c1 // ng)
        chunks = vc[:, g0 * ng : g1 * ng, cols].reshape(b, g1 - g0, ng, -1)
        cid = torch.arange(g0 * ng, g1 * ng, device=vp.device).view(1, g1 - g0, ng)
        have = (cid < (-(-n // nc))[:, None, None]).float()
        vg[:, g0:g1, cols] = (chunks * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]

    def index_join(self, layer: int, join: PageJoin) -> None:
        """Eq. 1-2 for the page that joins the middle of each sequence with ``join.joins``, inside a captured
        step (device work only, fixed shapes); nothing before the buffer exists."""
        if self.vall is None:
            return
        vg, vc, vp = self.views()
        dev = vp.device
        cols = self.columns(self.slot[layer])
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
    def anchor(self, stores: Mapping[int, LayerStore], upcoming: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 3: the mean of the window's page vectors, [B, F] (the newest page may be partial).

        ``upcoming`` [B] (CPU): sequences whose next token starts a new page, so that the oldest
        window page joins the middle at the next step. Its page vector is indexed now (the same
        eq. 1 the cache's update will repeat), so a selection built between two steps covers the
        middle of the step it serves (with every ratio 1 it is exactly all middle pages).
        """
        parts: list[torch.Tensor] = []
        ps = self.page_size
        for layer in self.layers:
            k, valid = window_keys(stores[layer])
            b, h, w, d = k.shape
            if upcoming is not None and bool(upcoming.any()):
                start = self.counts(b)[self.slot[layer]].clone()  # not a view: add_pages advances it
                self.add_pages(self.slot[layer], MiddleUpdate(start, upcoming.long(), k[:, :, None, :ps]))
            a = window_anchor(k, valid, ps)
            parts.append(a.reshape(b, h * d).to(parts[0].device if parts else a.device))
        return torch.cat(parts, dim=-1)

    def scores(self, anchor: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 4 for the whole hierarchy in ONE batched GEMM over the coalesced buffer (Alg. 1 l. 1-4).

        Returns (S_g [B, G], S_c [B, C], S_p [B, P]) for the first ``pages`` pages.
        """
        assert self.vall is not None, "scores of an unallocated hierarchy"
        g, c = self.gcap, self.ccap
        s_all = torch.bmm(self.vall[:, : g + c + pages], anchor[:, :, None].to(self.vall.device)).squeeze(-1)
        if self.tp is not None:  # tensor parallelism: F is split over the ranks' heads, sum the partial scores
            s_all = self.tp.all_reduce(s_all.contiguous())
        nc, ng = self.chunk_pages, self.grid_chunks
        cn = -(-pages // nc)
        return s_all[:, : -(-cn // ng)], s_all[:, g : g + cn], s_all[:, g + c : g + c + pages]

    def select_pages(
        self, s_g: torch.Tensor, s_c: torch.Tensor, s_p: torch.Tensor, npages: torch.Tensor, k: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-down masking (Alg. 1 l. 5-18) for sequences with ``npages`` [B] middle pages.

        Returns the kept masks (grids [B, G], chunks [B, C], pages [B, P]); a chunk is scored only
        under a kept grid and a page only under a kept chunk. ``k``: the pages kept in budget mode
        (default ``budget_pages``).
        """
        return top_down(
            s_g, s_c, s_p, npages, nc=self.chunk_pages, ng=self.grid_chunks, ratios=self.ratios,
            k=self.budget_pages if k is None else k, shape=self.shape,
        )  # fmt: skip
