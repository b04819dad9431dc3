"""CHESS's shared scope, ``chess:scope=shared`` (kvdex.policies.chess; the paper's): ONE selection of
middle pages per sequence, served to every sparse layer and kv head until the next rebuild.

A build scores the whole hierarchy once (eq. 3-4, Algorithm 1) with the window's anchor or, with
``anchor_from="query"``, the last decode step's queries (recorded by :meth:`SharedScope.select`), and
publishes the pages as one :class:`~kvdex.selection.Selection`. In budget mode a selection that kept every
middle page keeps covering the pages that join it while the budget has room (:meth:`SharedScope.cover`).

CUDA-graph decoding (kvdex.engine.graphs): the selection only changes in a build, which runs in ``on_step``
(after the step, outside a captured graph) or before a page-boundary step (the budget cover). Under static
sizing ``select`` returns one persistent [B, W] buffer (-1 padded, W >= the budget's pages) that a build
rewrites in place, so a captured step reads the current selection without a new capture; a wider selection
(ratio mode) makes a new buffer, whose identity is in the graph key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from kvdex.policies.chess.hierarchy import Hierarchy
from kvdex.policies.chess.levels import mask_to_ids, pad, trim
from kvdex.policies.chess.scope import BuildLog, ScopeSettings
from kvdex.selection import Selection
from kvdex.storage import LayerStore, MiddleUpdate
from kvdex.view import LayerView


class SharedScope:
    """The one selection of a :class:`~kvdex.policies.chess.ChessPolicy` with ``scope="shared"``: scores
    ``hierarchy``, adds its builds to ``log``."""

    def __init__(self, settings: ScopeSettings, hierarchy: Hierarchy, log: BuildLog) -> None:
        self.settings = settings
        self.hierarchy = hierarchy
        self.log = log
        self.pages: torch.Tensor | None = None  # [B, K] the selection, -1 padded
        self.sel: Selection | None = None
        self.sel_on: dict[torch.device, Selection] = {}  # device_map: copies for layers on other devices
        self.covering: torch.Tensor | None = None  # [B] bool (CPU): the last build kept every middle page (budget)
        self.static_pages: torch.Tensor | None = None  # [B, W] the selection, -1 padded to a fixed width (graphs)
        self.queries: dict[int, torch.Tensor] = {}  # anchor_from="query": layer -> [B, H, D] fp32, the last step's

    # ---- a build -----------------------------------------------------------------------------------------
    def build(self, stores: Mapping[int, LayerStore], rows: torch.Tensor | None = None) -> None:
        """(Re)build the selection of the sequences in ``rows`` [B] bool (None: all), from the
        current state of every layer (called between forwards, so every layer is at the same length)."""
        st, hier = self.settings, self.hierarchy
        timing = st.timing
        if timing:
            vall = hier.vall
            sync: Callable[[], None] = torch.cuda.synchronize if vall is not None and vall.is_cuda else (lambda: None)
            sync()
            t0 = time.perf_counter()
        assert hier.npages is not None, "a build before the first index"
        grid = stores[st.sparse_layers[0]].grid
        n = stores[st.sparse_layers[-1]].lengths_host
        upcoming = grid.num_middle_pages(n + 1) > hier.npages.min(dim=0).values  # next token starts a page
        anchor = hier.anchor(stores, upcoming)  # also indexes the page that joins the middle at the next step
        if st.anchor_from == "query" and len(self.queries) == len(st.sparse_layers):
            anchor = self.query_anchor()
            self.log.query_builds += 1
        npages = hier.npages.min(dim=0).values  # [B] pages every layer has indexed
        b = npages.shape[0]
        p = int(npages.max())
        if p == 0 or hier.vall is None:
            mask = torch.zeros(b, 0, dtype=torch.bool)
        else:
            s_g, s_c, s_p = hier.scores(anchor, p)
            mask = hier.select_pages(s_g, s_c, s_p, npages)[2]
        new = mask_to_ids(mask)
        if self.pages is None or rows is None:
            pages = new
        else:
            width = max(new.shape[1], self.pages.shape[1])
            old, new = pad(self.pages, width), pad(new.to(self.pages.device), width)
            pages = torch.where(rows.to(old.device)[:, None], new, old)
        # budget mode: a sequence whose build kept every middle page keeps them all while they fit (cover)
        covering = (mask.sum(1) >= npages.to(mask.device)).cpu() & (not st.ratio_mode)
        if rows is not None and self.covering is not None:
            self.covering = torch.where(rows, covering, self.covering)
        else:
            self.covering = covering
        self.publish(trim(pages), stores)
        assert self.pages is not None
        self.log.selected_pages.append(float((self.pages >= 0).sum(1).float().mean()))
        if timing:
            sync()
            self.log.rebuild_ms += (time.perf_counter() - t0) * 1e3

    def query_anchor(self) -> torch.Tensor:
        """``anchor_from="query"``: the last decode step's queries, [B, F] laid out as the page vectors
        (sparse layer, kv head, dim), each kv head's query the mean of its group's query heads. The
        affinity of a page is then the sum over layers and heads of q . mean key: the query-key score
        Quest and ArkVale bound, here on CHESS's grids, chunks and pages."""
        parts = [self.queries[layer] for layer in self.settings.sparse_layers]
        dev = parts[0].device
        return torch.cat([x.reshape(x.shape[0], -1).to(dev) for x in parts], dim=-1)

    def record_query(self, layer: int, q: torch.Tensor, kv_heads: int) -> None:
        """Keep this step's queries of ``layer`` (in place, so a captured step records them too)."""
        b, hq, d = q.shape
        qm = q.view(b, kv_heads, hq // kv_heads, d).float().mean(2)
        buf = self.queries.get(layer)
        if buf is None or buf.shape != qm.shape or buf.device != qm.device:
            self.queries[layer] = qm.clone()  # eager steps only: graph_key waits for every buffer
        else:
            buf.copy_(qm)

    def publish(self, pages: torch.Tensor, stores: Mapping[int, LayerStore]) -> None:
        """Make ``pages`` [B, K] (ascending ids, -1 padded) the selection every layer reads."""
        self.pages = pages
        self._refresh_static()
        store = stores[self.settings.sparse_layers[0]]
        b = pages.shape[0]
        self.sel = Selection(pages=pages.to(store.device)[:, None, :].expand(b, store.kv_heads, -1))
        self.sel_on = {}  # device_map: copies of the selection for layers on other devices

    # ---- between rebuilds --------------------------------------------------------------------------------
    def cover(self, update: MiddleUpdate, stores: Mapping[int, LayerStore]) -> None:
        """Budget mode: while the budget holds every middle page of a sequence, its selection is every
        middle page. A page that leaves the window between rebuilds joins the selection of the
        sequences whose last build kept all pages, as long as the K-page budget has room; when it has
        none, the selection stays as built until the next rebuild (the mechanism's static selection).
        A budget smaller than the middle at build time is unaffected: such a selection never covers."""
        if self.pages is None or self.covering is None or not bool(self.covering.any()):
            return
        k = self.settings.budget_pages
        pages = self.pages.cpu()
        rows = [pages[b][pages[b] >= 0] for b in range(pages.shape[0])]
        changed = False
        for b in torch.nonzero(self.covering & (update.count > 0)).flatten().tolist():
            new = torch.arange(int(update.start[b]), int(update.start[b] + update.count[b]))
            new = new[~torch.isin(new, rows[b])]
            if len(new) == 0:
                continue  # added already (the build saw the page coming, or an earlier layer added it)
            if len(rows[b]) + len(new) > k:
                self.covering[b] = False
                continue
            rows[b], changed = torch.cat([rows[b], new]), True
        if changed:
            width = max(len(r) for r in rows)
            out = torch.stack([pad(r[None], width)[0] for r in rows])
            self.publish(out.to(self.pages.device), stores)

    # ---- select / CUDA graphs ----------------------------------------------------------------------------
    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        store = view.store
        if self.settings.anchor_from == "query":
            self.record_query(view.layer, q, view.kv_heads)
        if self.sel is None:  # no middle was ever indexed for this cache: sink + window only
            return Selection(pages=view.no_ids(q.device))
        if view.static:  # CUDA-graph decoding: one buffer, rewritten in place by rebuilds
            return Selection(pages=self._static_selection(store)[:, None, :].expand(-1, view.kv_heads, -1))
        pages = self.sel.pages
        assert pages is not None  # a page selection (publish)
        if pages.device != store.device:  # device_map: the layer's copy, moved once per build
            return self.sel_on.setdefault(store.device, Selection(pages=pages.to(store.device)))
        return self.sel

    def graph_key(self) -> tuple | None:
        buf = self.static_pages
        if buf is None:
            return None  # this step's select allocates the buffer: an eager step
        queries: tuple = ()
        if self.settings.anchor_from == "query":
            if len(self.queries) < len(self.settings.sparse_layers):
                return None  # this step's select allocates the query buffers: an eager step
            queries = tuple((lay, id(x), tuple(x.shape)) for lay, x in sorted(self.queries.items()))
        index = self.hierarchy.key()  # page joins write into it inside the captured step
        return ("chess", id(buf), tuple(buf.shape), index) + queries

    def _static_selection(self, store: LayerStore) -> torch.Tensor:
        if self.static_pages is None:  # allocated in an eager step (the graph key changed)
            assert self.pages is not None
            w = self.pages.shape[1]
            st = self.settings
            width = max(w, st.budget_pages) if not st.ratio_mode else w + max(1, w // 4)
            self.static_pages = torch.full((self.pages.shape[0], width), -1, dtype=torch.long, device=store.device)
            self._refresh_static()
        return self.static_pages

    def _refresh_static(self) -> None:
        buf = self.static_pages
        if buf is None:
            return
        assert self.pages is not None
        w = self.pages.shape[1]
        if w > buf.shape[1]:
            self.static_pages = None  # wider than the buffer: a new one at the next static select
            return
        buf.fill_(-1)
        buf[:, :w] = self.pages.to(buf.device)
