"""CHESS's per-(layer, kv head) scope, ``chess:scope=layer`` (kvdex.policies.chess; not in the paper).

The paper's mode (``scope=shared``) scores the Grid -> Chunk -> Page hierarchy once, with page
vectors flattened over every layer and head, and serves that one selection to all of them. In the
layer scope every sparse layer scores *its own slice* of the same hierarchy vectors (the columns of
its kv heads) and keeps its own pages per (sequence, kv head), with the same top-down masks and
the same budget rule:

* the score of a unit for kv head h is ``reduce_g(q_g . v_u[h])`` over the group's query heads g
  (``group``: max, sum or mean) with ``anchor_from=query``: the current decode step's queries of the
  layer; with ``anchor_from=window`` it is ``a[h] . v_u[h]``, a the layer's window anchor (eq. 3);
  with ``units=digest`` a page's score is the group's max of its digest estimate (ArkVale's bounding box of
  the page's keys, :mod:`kvdex.policies.digest`) and a chunk's or grid's the max of its pages' (``max_levels``);
* a (re)build happens *inside* ``select`` of the step after it was requested, so it reads that
  step's queries (the first decode step builds from its own queries) and each layer's index is up
  to date (the page that joins the middle at this step is already indexed);
* the entropy trigger requests rebuilds exactly as in the shared scope (per sequence, in
  ``on_step``); between rebuilds each layer reuses its selection, and in budget mode a selection
  that covers the whole middle keeps covering it while the budget has room (as ``_cover``).

CUDA graphs: a step with a pending rebuild runs eagerly (``graph_key`` is None then); the other
steps read one persistent [B, H, W] buffer per layer, rewritten in place by a rebuild.
Tensor parallelism: a rank holds whole kv heads and each (layer, kv head) selects from its own
scores, so no score is all-reduced (the shared scope all-reduces its flattened dot products).
"""

from __future__ import annotations

import math
import time

import torch

from kvdex.kernels.scoring import digest_scores, group_reduce, topk_ids
from kvdex.policies.arkvale import _ids
from kvdex.policies.chess.hierarchy import Hierarchy
from kvdex.policies.chess.levels import mask_to_ids, max_levels, pad, trim, window_anchor, window_keys
from kvdex.policies.chess.scope import BuildLog, ScopeSettings
from kvdex.policies.digest import DigestIndex
from kvdex.policies.rerank import candidate_pages, rerank_pages
from kvdex.selection import Selection
from kvdex.storage import MiddleUpdate
from kvdex.view import LayerView


def unit_scores(units: torch.Tensor, anchor: torch.Tensor, kv_heads: int, group: str) -> torch.Tensor:
    """Scores of hierarchy units for each kv head: units [B, N, H*D] (one layer's columns of the
    buffer), anchor [B, Hq, D] (query heads, or the kv heads' own anchors when Hq == H) -> [B, H, N]."""
    b, n, _ = units.shape
    hq, d = anchor.shape[1], anchor.shape[2]
    v = units.reshape(b, n, kv_heads, d)
    a = anchor.float().view(b, kv_heads, hq // kv_heads, d)
    s = torch.einsum("bnhd,bhgd->bhgn", v, a.to(v.device))  # [B, H, G, N]
    return group_reduce(s.reshape(b, hq, n), kv_heads, group)


class LayerScope:
    """Per-layer selections of a :class:`~kvdex.policies.chess.ChessPolicy` with ``scope="layer"``: scores
    ``hierarchy`` (or, with ``units="digest"``, the page ``digests``) per layer and kv head, adds its builds
    to ``log``."""

    def __init__(
        self, settings: ScopeSettings, hierarchy: Hierarchy, digests: DigestIndex | None, log: BuildLog
    ) -> None:
        self.settings = settings
        self.hierarchy = hierarchy
        self.digests = digests
        self.log = log
        self.pages: dict[int, torch.Tensor] = {}  # layer -> [B, H, W] page ids, -1 padded (the layer's device)
        self.static: dict[int, torch.Tensor] = {}  # layer -> persistent [B, H, W'] buffer (CUDA-graph decoding)
        self.covering: dict[int, torch.Tensor] = {}  # layer -> [B] bool (CPU): the last build kept every page
        self.filled: dict[int, torch.Tensor] = {}  # refine: layer -> [B] (CPU) columns of candidates in use
        self.pending: torch.Tensor | None = None  # [B] bool (CPU): sequences rebuilt at the next select
        self.todo: set[int] = set()  # layers that have not rebuilt the pending sequences yet

    def request(self, rows: torch.Tensor) -> None:
        """Rebuild the selections of ``rows`` [B] bool at the next decode step, in every sparse layer."""
        rows = rows.cpu()
        self.pending = rows.clone() if self.pending is None else self.pending | rows
        self.todo = set(self.settings.sparse_layers)

    # ---- a build, inside select ----------------------------------------------------------------------
    def build(self, layer: int, q: torch.Tensor, view: LayerView) -> None:
        st, hier = self.settings, self.hierarchy
        store = view.store
        timing = st.timing
        if timing:
            sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
            sync()
            t0 = time.perf_counter()
        slot = hier.slot[layer]
        assert hier.npages is not None, "a build before the first index"
        npages = hier.npages[slot].clone()  # [B] this layer's middle pages (indexed before its attention)
        b, h = npages.shape[0], store.kv_heads
        n = int(npages.max())
        if n == 0 or (hier.vall is None and self.digests is None):
            ids = torch.full((b, h, 0), -1, dtype=torch.long, device=store.device)
            kept = torch.zeros(b, h, dtype=torch.long)
        else:
            if st.anchor_from == "query":
                anchor, group = q, st.group
            else:  # the layer's own window anchor, one per kv head
                anchor, group = window_anchor(*window_keys(store), st.page_size), "max"
            nc, ng = hier.chunk_pages, hier.grid_chunks
            if self.digests is not None:  # units="digest": the pages' digest estimates, the max of them above
                s_p = self.digests.page_scores(layer, q, n, view)  # [B, H, n], the group's max
                levels = [*max_levels(s_p, nc, ng), s_p]
            else:
                assert hier.vall is not None
                g, c = hier.gcap, hier.ccap
                cols = hier.columns(slot)
                s = unit_scores(hier.vall[:, : g + c + n, cols], anchor, h, group)  # [B, H, G + C + n]
                cn = -(-n // nc)
                levels = [s[..., : -(-cn // ng)], s[..., g : g + cn], s[..., g + c : g + c + n]]
            flat = [x.reshape(b * h, -1) for x in levels]  # one row per (sequence, kv head)
            page_unit = st.rerank and st.rerank_unit == "page"  # the hierarchy's pages are candidates
            k = None  # the hierarchy keeps budget_pages
            if page_unit:  # rerank x the budget's pages, at least rerank_share of this build's middle
                k = candidate_pages(st.retrieval_tokens, view.page_size, st.rerank)
                k = max(k, math.ceil(st.rerank_share * n))
            mask = hier.select_pages(flat[0], flat[1], flat[2], npages.repeat_interleave(h), k=k)[2]
            ids = mask_to_ids(mask).view(b, h, -1).to(store.device)
            kept = mask.sum(1).view(b, h)
            if page_unit and st.refine == "none":  # the candidates' best pages by their keys' exact scores
                best = rerank_pages(q, view, ids, st.retrieval_pages, st.rerank_group)  # (a set, -1 padded)
                ids = trim(best.sort(dim=-1, descending=True).values)  # the chosen ids first
                kept = (ids >= 0).sum(-1)
            kept = kept.cpu()
        rows = self.pending
        old = self.pages.get(layer)
        if old is not None and rows is not None and not bool(rows.all()):
            width = max(ids.shape[2], old.shape[2])
            ids = torch.where(rows.to(old.device)[:, None, None], pad(ids, width), pad(old, width))
            ids = trim(ids)
        covering = (kept.min(1).values >= npages) & (not st.ratio_mode)
        prev = self.covering.get(layer)
        self.covering[layer] = covering if prev is None or rows is None else torch.where(rows, covering, prev)
        if st.refine != "none":
            self.filled[layer] = (ids >= 0).sum(-1).amax(1).cpu()  # ids are left-packed
        self._publish(layer, ids)
        self.log.selected_pages.append(float(kept[rows].float().mean()) if rows is not None and rows.any() else 0.0)
        self.todo.discard(layer)
        if not self.todo:
            self.pending = None
            if st.anchor_from == "query":
                self.log.query_builds += 1
        if timing:
            sync()
            self.log.rebuild_ms += (time.perf_counter() - t0) * 1e3

    def _publish(self, layer: int, ids: torch.Tensor, refill: bool = True) -> None:
        """``ids`` become the layer's pages, copied into its persistent buffer (``refill``: cleared first; a
        wider ``ids`` drops the buffer: a new one at the next static select, an eager step)."""
        self.pages[layer] = ids
        buf = self.static.get(layer)
        if buf is None:
            return
        if ids.shape[2] > buf.shape[2]:
            del self.static[layer]
            return
        if refill:
            buf.fill_(-1)
        buf[..., : ids.shape[2]] = ids.to(buf.device)

    # ---- between rebuilds ----------------------------------------------------------------------------
    def cover(self, layer: int, update: MiddleUpdate) -> None:
        """Budget mode: a sequence whose last build kept every middle page of ``layer`` keeps every
        page that joins it while the budget has room (the layer-scope twin of ``SharedScope.cover``).
        With ``refine`` every page that joins the middle becomes a candidate of its sequence instead."""
        if self.settings.refine != "none":
            self._join_candidates(layer, update)
            return
        cov = self.covering.get(layer)
        if cov is None or not bool(cov.any()) or layer not in self.pages:
            return
        k = self.settings.budget_pages
        cur = self.pages[layer].cpu()
        rows, changed = [cur[b] for b in range(cur.shape[0])], False
        for b in torch.nonzero(cov & (update.count > 0)).flatten().tolist():
            new = torch.arange(int(update.start[b]), int(update.start[b] + update.count[b]))
            have = rows[b][0][rows[b][0] >= 0]  # a covering sequence holds the same pages in every head
            new = new[~torch.isin(new, have)]
            if len(new) == 0:
                continue
            if len(have) + len(new) > k:
                cov[b] = False
                continue
            rows[b] = torch.cat([have, new])[None].expand(cur.shape[1], -1)
            changed = True
        if changed:
            width = max(r.shape[-1] for r in rows)
            out = torch.stack([pad(r, width) for r in rows])
            self._publish(layer, out.to(self.pages[layer].device))

    def _join_candidates(self, layer: int, update: MiddleUpdate) -> None:
        """``refine``: the pages of ``update`` join their sequences' candidates (every head's) until the next
        build, written in place into the persistent buffer while it has room (else it is dropped: the next
        step runs eagerly and allocates a wider one)."""
        ids, filled = self.pages.get(layer), self.filled.get(layer)
        rows = torch.nonzero(update.count > 0).flatten().tolist()
        if ids is None or filled is None or not rows:
            return
        need = max(int(filled[b] + update.count[b]) for b in rows)
        if need > ids.shape[2]:
            ids = pad(ids, need + max(1, need // 4))
        for b in rows:
            start, count, col = int(update.start[b]), int(update.count[b]), int(filled[b])
            ids[b, :, col : col + count] = torch.arange(start, start + count, device=ids.device)
            filled[b] = col + count
        self._publish(layer, ids, refill=False)

    # ---- select / CUDA graphs ------------------------------------------------------------------------
    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        layer, store = view.layer, view.store
        if self.pending is not None and layer in self.todo:
            self.build(layer, q, view)
        ids = self.pages.get(layer)
        if ids is None:
            return Selection(pages=view.no_ids(q.device))
        st = self.settings
        if view.static:
            buf = self.static.get(layer)
            if buf is None:  # allocated in an eager step (the graph key changes)
                w = ids.shape[2]
                wide = st.ratio_mode or st.refine != "none"  # room for a wider next build
                width = w + max(1, w // 4) if wide else max(w, st.budget_pages)
                buf = torch.full((*ids.shape[:2], width), -1, dtype=torch.long, device=store.device)
                buf[..., :w] = ids
                self.static[layer] = buf
            ids = buf
        if st.refine != "none":  # the held ids are a build's candidates: this step's best of them
            return Selection(pages=self.refine(layer, q, view, ids))
        return Selection(pages=ids)

    def refine(self, layer: int, q: torch.Tensor, view: LayerView, pages: torch.Tensor) -> torch.Tensor:
        """``refine``: the best ``retrieval_pages`` of the held candidate ``pages`` [B, H, C] (-1 padded) for this
        step's queries q [B, Hq, D]: by ArkVale's digest estimate (``digest``; the group's max, as a build scores
        pages) or by their keys' exact softmax weights (``exact``, :func:`rerank_pages`). Fixed shapes, no host
        read: a captured step replays it."""
        st = self.settings
        if st.refine == "exact":
            return rerank_pages(q, view, pages, st.retrieval_pages, st.rerank_group)
        assert self.digests is not None, "refine=digest scores the pages' digests (units='digest')"
        if pages.shape[-1] == 0 or layer not in self.digests:  # no page indexed yet: no candidate to pick
            return pages
        b, h, c = pages.shape
        at = pages.clamp(min=0)[..., None]
        centre, radius = self.digests.centre[layer], self.digests.radius[layer]
        centre = centre.gather(2, at.expand(-1, -1, -1, centre.shape[-1]))
        radius = radius.gather(2, at.expand(-1, -1, -1, radius.shape[-1]))
        score = digest_scores(q, centre, radius).view(b, h, -1, c).amax(2)  # [B, H, C]
        best = topk_ids(score.masked_fill(pages < 0, float("-inf")), st.retrieval_pages, ordered=False)
        return torch.where(best >= 0, pages.gather(2, best.clamp(min=0)), -1)

    def graph_key(self) -> tuple | None:
        if self.pending is not None:
            return None  # this step rebuilds inside select (host work, data-dependent shapes): eager
        layers = self.settings.sparse_layers
        if any(lay not in self.static for lay in layers):
            return None  # this step's select allocates the static buffers: an eager step
        key = tuple((lay, id(self.static[lay]), tuple(self.static[lay].shape)) for lay in layers)
        d = self.digests  # units="digest": page joins write the digests inside the captured step
        return ("chess/layer",) + key + (() if d is None else _ids(d.centre, d.radius))
