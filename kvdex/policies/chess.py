# Over 400 lines: the policy's own lifecycle (options, bind, index, build, select, on_step) reads as one.
"""``chess``: CHESS (Fei et al.) -- Grid -> Chunk -> Page page selection, rebuilt only when the output
distribution becomes uncertain (the paper: key-key, one context for every layer; default: scored by each
layer's queries against its pages' digests).

Mechanism (the CHESS paper, §3, Algorithm 1; docs/policies/chess.md):

* page vector (eq. 1): the mean key of a page, per layer and kv head, flattened across all the
  layers the policy sees (the cache's sparse layers) and kv heads into one [F] vector,
  F = layers * kv_heads * head_dim; chunks of ``chunk_pages`` pages and grids of ``grid_chunks``
  chunks by centroid averaging (eq. 2). The three levels live in ONE buffer ``[grids | chunks |
  pages]`` so that scoring the whole hierarchy is one (batched) matrix product (Algorithm 1, l. 2-3);
* anchor (eq. 3): the mean of the page vectors of the recent window; affinity (eq. 4): the dot
  product of anchor and unit vector, keys against keys;
* top-down masking: keep the top ``rho_g`` of the grids, then the top ``rho_c`` of the chunks
  whose grid is kept, then the top ``rho_p`` of the pages whose chunk is kept (quantile
  thresholds, Algorithm 1); the context is those pages + sink + window (kvdex always attends
  sink and window). ONE selection serves every layer and head until the next rebuild;
* zero-copy: a selection is page ids only; on the GPU-resident store attention reads the chosen
  slots in place (``DeviceStore.attend``); offloaded stores fetch the pages as for any policy;
* quality-aware backtracking (§3.3): after every decode step ``on_step`` measures the entropy and
  varentropy of the next-token distribution; every ``check_every`` steps (default: one page of
  generated tokens, Figure 4 is per page) their means are compared with thresholds calibrated
  offline (99th percentile, ``kvdex calibrate chess``); the selection of a sequence is rebuilt
  only when they exceed them. ``trigger="interval"`` is Appendix C's fixed-interval baseline.

Where the paper is vague, the choices (and why) are in comments marked ``CHOICE`` and in the docs.

kvdex's default goes beyond the paper in named options, chosen by the scorecard and the benchmark
(docs/policies/chess.md): ``anchor_from="query"`` scores the hierarchy with the decode step's queries
instead of the window's keys, and ``scope="layer"`` (``_chess_layer.py``) gives every sparse layer its
own selection per kv head, built inside ``select`` from that step's queries; its selection
(:data:`DEFAULT_SELECTION`) scores the hierarchy's pages by ArkVale's digests (``units="digest"``,
chunks and grids by their pages' max), takes its top pages, at least a quarter of the middle's, as
candidates and keeps their best pages by exact softmax weight (``rerank=4``, ``rerank_unit="page"``,
``rerank_group="weight"``, ``rerank_share=0.25``) until the next rebuild. Naming any selection option
starts the others from :data:`PLAIN_SELECTION` (``chess:rerank=0``: the hierarchy's own top pages by
mean key). The paper's mode, exactly as above: ``chess:anchor_from=window:scope=shared``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvdex.policies._chess_hierarchy import HierarchyMixin
from kvdex.policies._chess_layer import LayerScope
from kvdex.policies._chess_levels import (
    PRESETS,
    count_mask,
    entropy_varentropy,
    level_mask,
    mask_to_ids,
    pad,
    trim,
    window_keys,
)
from kvdex.policies._chess_trigger import DEFAULT_THRESHOLDS, TriggerMixin  # noqa: F401 (re-exported)
from kvdex.policies._digest import DigestIndex
from kvdex.policies._rerank import RerankOption, candidate_pages, rerank_tokens, resolve_selection
from kvdex.policies.base import Policy, register_policy
from kvdex.selection import Selection
from kvdex.storage import MiddleUpdate

__all__ = ["ChessPolicy", "PRESETS", "count_mask", "entropy_varentropy", "level_mask", "window_keys"]

TRIGGERS = ("uncertainty", "interval", "always", "never")
# window: the paper's anchor, the mean key of the recent window (eq. 3: key-key affinity, query-agnostic);
# query: the decode step's query heads score the same hierarchy (a kvdex option, not in the paper)
ANCHORS = ("window", "query")
# shared: one selection for every layer and head (the paper); layer: each sparse layer scores its own
# slice of the hierarchy per kv head (a kvdex option, kvdex/policies/_chess_layer.py)
SCOPES = ("shared", "layer")
GROUPS = ("max", "sum", "mean")  # scope=layer with anchor_from=query: the GQA reduction of the group's scores
# mean: a unit's score is the query . its mean key (eq. 1-2's vectors); digest: a page's score is the query's
# estimate from its keys' bounding box (ArkVale's cuboid-mean digest, kvdex.policies._digest), a chunk's and a
# grid's the max of their pages' (a kvdex option for scope=layer with anchor_from=query, not in the paper)
UNITS = ("mean", "digest")
VARENTROPY_KINDS = ("output", "temporal")

# CHOICE: the paper does not give N_c and N_g. 4 pages per chunk and 4 chunks per grid (grids of
# 512 tokens at page size 32) keep >= 8 grids at 4k tokens, so the grid quantile is not a coin
# flip between two halves of a short context, and ~60 grids at 32k.
DEFAULT_CHUNK_PAGES = 4
DEFAULT_GRID_CHUNKS = 4
# Appendix C's fixed-interval baseline rebuilds "every 6 pages" of generated tokens.
DEFAULT_INTERVAL_PAGES = 6

# How a build picks pages. kvdex's default (docs/policies/chess.md, "Default configuration"): the hierarchy is
# scored by ArkVale's page digests (chunks and grids by their pages' max), its top pages -- at least a quarter of
# the middle's -- are candidates, and the candidates' best pages by their keys' exact softmax weights are kept
# until the next rebuild. PLAIN_SELECTION: the hierarchy's own top pages by q . mean key (the paper's units).
DEFAULT_SELECTION = {"group": "max", "units": "digest", "rerank": 4, "rerank_group": "weight", "rerank_share": 0.25,
                     "rerank_unit": "page"}  # fmt: skip
PLAIN_SELECTION = {"group": "max", "units": "mean", "rerank": 0, "rerank_group": "max", "rerank_share": 0.0,
                   "rerank_unit": "token"}  # fmt: skip


def resolve_selection_options(policy) -> None:
    """Fill the selection options left at None: none named, in budget mode with ``scope="layer"`` and
    ``anchor_from="query"`` (kvdex's default mode) -> :data:`DEFAULT_SELECTION`; otherwise (any of them named,
    the paper's mode ``anchor_from=window:scope=shared``, a preset or ratios) the others take
    :data:`PLAIN_SELECTION`'s values, so ``chess:rerank=0`` is the hierarchy's own top pages by mean key."""
    ratio_mode = bool(policy.preset) or any(getattr(policy, r) is not None for r in ("rho_g", "rho_c", "rho_p"))
    kvdex_mode = policy.scope == "layer" and policy.anchor_from == "query" and not ratio_mode
    resolve_selection(policy, DEFAULT_SELECTION, PLAIN_SELECTION, allowed=kvdex_mode)


@register_policy
@dataclass
class ChessPolicy(HierarchyMixin, TriggerMixin, RerankOption, Policy):  # rerank: budget mode only
    """CHESS. Ratio mode (``preset`` or ``rho_g/rho_c/rho_p``): the paper's retention ratios, the
    budget is not used. Budget mode (the default): the same hierarchy cut to exactly
    ``(budget - sink - window) / page_size`` pages per sequence, for comparisons at equal budget.
    """

    name = "chess"
    capturable = True
    capturable_index = True

    preset: str = ""  # conservative | moderate | aggressive; "" with no rho_*: budget mode
    rho_g: float | None = None
    rho_c: float | None = None
    rho_p: float | None = None
    shape: str = "aggressive"  # budget mode: the preset whose split of the reduction over levels is kept
    chunk_pages: int = DEFAULT_CHUNK_PAGES  # N_c
    grid_chunks: int = DEFAULT_GRID_CHUNKS  # N_g
    trigger: str = "uncertainty"  # uncertainty | interval (Appendix C) | always | never
    interval: int = 0  # trigger="interval": rebuild every this many decode steps (0: 6 pages)
    check_every: int = 0  # trigger="uncertainty": steps per check (0: one page of generated tokens)
    thresholds: str = ""  # JSON written by `kvdex calibrate chess`
    entropy_threshold: float | None = None  # explicit thresholds override the file
    varentropy_threshold: float | None = None
    varentropy: str = "output"  # output: mean per-step varentropy | temporal: variance of the entropy
    combine: str = "and"  # and: both exceed (Figure 4's upper-right region) | or: either
    anchor_from: str = "query"  # query: the decode step's queries (kvdex) | window: the paper's anchor (ANCHORS)
    scope: str = "layer"  # layer: a selection per sparse layer (kvdex) | shared: the paper's one for all (SCOPES)
    # the selection (None: resolved by resolve_selection_options -- DEFAULT_SELECTION when none is named in
    # kvdex's default mode, else PLAIN_SELECTION's values for the unnamed ones)
    group: str | None = None  # scope=layer, anchor_from=query: max | sum | mean of the query heads' scores
    units: str | None = None  # scope=layer, anchor_from=query: units scored by "mean" key | page "digest" (UNITS)
    rerank: int | None = None
    rerank_group: str | None = None
    rerank_share: float | None = None
    rerank_unit: str | None = None

    def __post_init__(self) -> None:
        resolve_selection_options(self)
        rhos = (self.rho_g, self.rho_c, self.rho_p)
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"unknown CHESS preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if any(r is not None for r in rhos):
            if self.preset:
                raise ValueError("pass a CHESS preset or rho_g/rho_c/rho_p, not both")
            if any(r is None for r in rhos):
                raise ValueError("pass all three retention ratios rho_g, rho_c, rho_p (or a preset)")
            for n, r in zip(("rho_g", "rho_c", "rho_p"), rhos, strict=True):
                if not isinstance(r, (int, float)) or not 0 < r <= 1:
                    raise ValueError(f"{n} must be a fraction in (0, 1], got {r!r}")
        if self.shape not in PRESETS:
            raise ValueError(f"unknown CHESS shape {self.shape!r}; choose from {', '.join(PRESETS)}")
        for n in ("chunk_pages", "grid_chunks"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n} must be an int >= 1, got {v!r}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown CHESS trigger {self.trigger!r}; choose from {', '.join(TRIGGERS)}")
        for n in ("interval", "check_every"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{n} must be an int >= 0 (0: the default), got {v!r}")
        if self.varentropy not in VARENTROPY_KINDS:
            raise ValueError(f"varentropy must be one of {', '.join(VARENTROPY_KINDS)}, got {self.varentropy!r}")
        if self.anchor_from not in ANCHORS:
            raise ValueError(f"anchor_from must be one of {', '.join(ANCHORS)}, got {self.anchor_from!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        if self.group != "max" and not (self.scope == "layer" and self.anchor_from == "query"):
            raise ValueError(
                f"group={self.group!r} reduces query heads' scores per kv head: it needs scope='layer' and "
                "anchor_from='query' (the shared scope scores with each group's mean query)"
            )
        if self.units not in UNITS:
            raise ValueError(f"units must be one of {', '.join(UNITS)}, got {self.units!r}")
        if self.units == "digest" and not (self.scope == "layer" and self.anchor_from == "query"):
            raise ValueError(
                "units='digest' scores each layer's pages by its decode queries against the pages' digests: it "
                "needs scope='layer' and anchor_from='query'"
            )
        if self.units == "digest" and self.group != "max":
            raise ValueError(f"units='digest' reduces a group's digest estimates by their max (ArkVale's rule): "
                             f"drop group={self.group!r}")  # fmt: skip
        if self.combine not in ("and", "or"):
            raise ValueError(f"combine must be 'and' or 'or', got {self.combine!r}")
        super().__post_init__()  # RerankOption's check
        if self.rerank_unit == "page" and self.scope != "layer":
            raise ValueError("rerank_unit='page' picks each layer's pages at its build: it needs scope='layer'")
        if self.rerank_share and self.rerank_unit != "page":
            raise ValueError(
                "chess keeps its token rerank's candidate pages between rebuilds, sized once by its budget: "
                "rerank_share needs rerank_unit='page' (the candidates sized at each build), or use rerank=N "
                "to widen chess's pool"
            )
        if self.rerank and self.ratios is not None:
            raise ValueError(
                "rerank > 0 needs budget mode (its candidates are rerank x the budget's pages): "
                "drop preset / rho_g / rho_c / rho_p, or pass rerank=0"
            )
        self._tau = self._load_thresholds()

    # ---- configuration ----------------------------------------------------------------------------
    @property
    def ratios(self) -> tuple[float, float, float] | None:
        """(rho_g, rho_c, rho_p) in ratio mode, None in budget mode."""
        if self.preset:
            return PRESETS[self.preset]
        if self.rho_g is not None:
            return (float(self.rho_g), float(self.rho_c), float(self.rho_p))
        return None

    def bind(self, info) -> None:
        super().bind(info)
        self._slot = {layer: i for i, layer in enumerate(info.sparse_layers)}
        self._hd = info.kv_heads * info.head_dim
        self.dim = len(info.sparse_layers) * self._hd  # F
        self._every = self.check_every or self.cfg.page_size
        r, ps = self.cfg.retrieval_tokens, self.cfg.page_size
        token_rerank = self.rerank and self.rerank_unit == "token"  # the candidates are the selection
        self.budget_pages = candidate_pages(r, ps, self.rerank) if token_rerank else self.cfg.retrieval_pages
        self._interval = self.interval or DEFAULT_INTERVAL_PAGES * self.cfg.page_size
        self._stores: dict = {}
        self._vall = None  # [B, Gcap + Ccap + Pcap, F] fp32: grids | chunks | pages
        self._gcap = 0
        self._npages = None  # [layers, B] pages indexed per layer (CPU)
        self._pages = None  # [B, K] the selection, -1 padded
        self._sel = None
        self._covering = None  # [B] bool (CPU): the last build kept every middle page (budget mode)
        self._static_pages = None  # [B, W] the selection, -1 padded to a fixed width (CUDA-graph decoding)
        self._last_len = None  # lengths at the last build / on_step (CPU)
        self._acc = None  # per-sequence sums since the last check: H, H^2, V, steps
        self._nacc = 0  # steps in those sums
        self._check = None  # (step, [3, B] host stats, event): the last check, read at the next step
        # counters (stats())
        self.builds = 0  # initial selections (one per prompt)
        self.rebuilds = 0  # rebuilds summed over sequences
        self.checks = 0  # trigger evaluations summed over sequences
        self.decode_steps = 0
        self.rebuild_log: list[tuple[int, int]] = []  # (step, sequence) of each rebuild
        self.check_log: list[tuple[int, int, float, float]] = []  # (step, sequence, entropy, varentropy stat)
        self.rebuild_ms = 0.0  # time in _build (measured only with the cache's timing=True)
        self.selected_pages: list[float] = []  # mean selected pages per sequence at each build
        self._queries: dict = {}  # anchor_from="query": layer -> [B, H, D] fp32, the last step's queries
        self.query_builds = 0  # builds (and rebuilds) scored by queries instead of the window's keys
        self._layers = LayerScope(self) if self.scope == "layer" else None
        self.digests = DigestIndex("cuboid-mean") if self.units == "digest" else None  # units="digest"
        self._batch = 0  # sequences (set at the first build)

    # ---- the hierarchy (its buffer, eq. 1-2 and the scoring, eq. 3-4: _chess_hierarchy.py) ---------
    def index(self, layer, update) -> None:
        if update.store is not None:
            self._stores[layer] = update.store
        slot = self._slot[layer]
        if self._npages is None:
            self._npages = torch.zeros(len(self._slot), update.count.shape[0], dtype=torch.long)
        if not update.empty:
            if self.digests is None:
                self._add_pages(slot, update)
            else:  # units="digest": the digests are the index, no mean-key hierarchy is kept
                self.digests.write(layer, update.start, update.count, update.keys)
                self._npages[slot] = torch.maximum(self._npages[slot], update.start + update.count)
            if self._layers is None:
                self._cover(update)
            else:
                self._layers.cover(layer, update)
        last = self.info.sparse_layers[-1]
        if not self._batch and layer == last and len(self._stores) == len(self._slot):
            # end of the prompt: every layer is stored and indexed (prefill / fork)
            self._batch = int(update.count.shape[0])
            if self._layers is None:
                self._build(step=0)
            else:  # the first decode step builds every layer's selection from its own queries
                self._layers.request(torch.ones(self._batch, dtype=torch.bool))
                self._last_len = self._stores[last].lengths_host.clone()
                self.builds += 1

    # ---- page joins inside a captured decode step (Policy.capturable_index) ---------------------------
    # The joining page's vector (eq. 1) is written at the device start of each joining sequence, then the
    # centroids (eq. 2) of its chunk and grid are recomputed (the other chunks do not change); the page
    # counts and the budget-mode cover of the selection (_cover: host-held) are the host side (joined).
    def reserve_index(self, layer, pages, store) -> None:
        if pages > 0 and self.digests is not None:
            self.digests.reserve(layer, pages, store)
        elif pages > 0:
            self._reserve(pages, torch.empty(store.batch, 0, device=store.device))

    def joined(self, layer, start, count) -> None:
        slot = self._slot[layer]
        if self._npages is None:
            self._npages = torch.zeros(len(self._slot), count.shape[0], dtype=torch.long)
        self._npages[slot] = torch.where(
            count > 0, torch.maximum(self._npages[slot], start + count), self._npages[slot]
        )
        update = MiddleUpdate(start, count, torch.empty(0))
        if self._layers is None:
            self._cover(update)
        else:  # the layer scope covers per layer, as in index
            self._layers.cover(layer, update)

    # ---- selection ------------------------------------------------------------------------------------
    def _build(self, step: int, rows: torch.Tensor | None = None) -> None:
        """(Re)build the selection of the sequences in ``rows`` [B] bool (None: all), from the
        current state of every layer (called between forwards, so every layer is at the same length)."""
        timing = self.cfg.timing
        if timing:
            sync = torch.cuda.synchronize if self._vall is not None and self._vall.is_cuda else (lambda: None)
            sync()
            t0 = time.perf_counter()
        grid = self._stores[self.info.sparse_layers[0]].grid
        n = self._stores[self.info.sparse_layers[-1]].lengths_host
        upcoming = grid.num_middle_pages(n + 1) > self._npages.min(dim=0).values  # next token starts a page
        anchor = self.anchor(upcoming)  # also indexes the page that joins the middle at the next step
        if self.anchor_from == "query" and len(self._queries) == len(self.info.sparse_layers):
            anchor = self.query_anchor()
            self.query_builds += 1
        npages = self._npages.min(dim=0).values  # [B] pages every layer has indexed
        b = npages.shape[0]
        p = int(npages.max())
        if p == 0 or self._vall is None:
            mask = torch.zeros(b, 0, dtype=torch.bool)
        else:
            s_g, s_c, s_p = self.scores(anchor, p)
            mask = self.select_pages(s_g, s_c, s_p, npages)[2]
        new = mask_to_ids(mask)
        if self._pages is None or rows is None:
            pages = new
        else:
            width = max(new.shape[1], self._pages.shape[1])
            old, new = pad(self._pages, width), pad(new.to(self._pages.device), width)
            pages = torch.where(rows.to(old.device)[:, None], new, old)
        # budget mode: a sequence whose build kept every middle page keeps them all while they fit (_cover)
        covering = (mask.sum(1) >= npages.to(mask.device)).cpu() & (self.ratios is None)
        keep = rows is not None and self._covering is not None
        self._covering = torch.where(rows, covering, self._covering) if keep else covering
        self._publish(trim(pages))
        self._last_len = self._stores[self.info.sparse_layers[-1]].lengths_host.clone()
        self.selected_pages.append(float((self._pages >= 0).sum(1).float().mean()))
        if timing:
            sync()
            self.rebuild_ms += (time.perf_counter() - t0) * 1e3
        if step == 0:
            self.builds += 1

    def _publish(self, pages: torch.Tensor) -> None:
        """Make ``pages`` [B, K] (ascending ids, -1 padded) the selection every layer reads."""
        self._pages = pages
        self._refresh_static()
        store = self._stores[self.info.sparse_layers[0]]
        b = pages.shape[0]
        self._sel = Selection(pages=pages.to(store.device)[:, None, :].expand(b, store.kv_heads, -1))
        self._sel_on = {}  # device_map: copies of the selection for layers on other devices

    def _cover(self, update) -> None:
        """Budget mode: while the budget holds every middle page of a sequence, its selection is every
        middle page. A page that leaves the window between rebuilds joins the selection of the
        sequences whose last build kept all pages, as long as the K-page budget has room; when it has
        none, the selection stays as built until the next rebuild (the mechanism's static selection).
        A budget smaller than the middle at build time is unaffected: such a selection never covers."""
        if self._pages is None or self._covering is None or not bool(self._covering.any()):
            return
        k = self.budget_pages
        pages = self._pages.cpu()
        rows = [pages[b][pages[b] >= 0] for b in range(pages.shape[0])]
        changed = False
        for b in torch.nonzero(self._covering & (update.count > 0)).flatten().tolist():
            new = torch.arange(int(update.start[b]), int(update.start[b] + update.count[b]))
            new = new[~torch.isin(new, rows[b])]
            if len(new) == 0:
                continue  # added already (the build saw the page coming, or an earlier layer added it)
            if len(rows[b]) + len(new) > k:
                self._covering[b] = False
                continue
            rows[b], changed = torch.cat([rows[b], new]), True
        if changed:
            width = max(len(r) for r in rows)
            out = torch.stack([pad(r[None], width)[0] for r in rows])
            self._publish(out.to(self._pages.device))

    def select(self, q, view) -> Selection:
        sel = self._page_selection(q, view)
        if self.rerank and self.rerank_unit == "token":  # the chosen pages are candidates: their best tokens
            # by exact q.k, every step (the page unit picked its pages at the build: _chess_layer)
            return Selection(tokens=rerank_tokens(q, view, sel.pages, view.retrieval_tokens, self.rerank_group))
        return sel

    def _page_selection(self, q, view) -> Selection:
        layer, store = view.layer, view.store
        self._stores[layer] = store
        if self._layers is not None:
            return self._layers.select(q, view)
        if self.anchor_from == "query":
            self._record_query(layer, q, view.kv_heads)
        if self._sel is None:  # no middle was ever indexed for this cache: sink + window only
            return Selection(pages=view.no_ids(q.device))
        if view.static:  # CUDA-graph decoding: one buffer, rewritten in place by rebuilds
            return Selection(pages=self._static_selection(store)[:, None, :].expand(-1, view.kv_heads, -1))
        if self._sel.pages.device != store.device:  # device_map: the layer's copy, moved once per build
            return self._sel_on.setdefault(store.device, Selection(pages=self._sel.pages.to(store.device)))
        return self._sel

    # ---- CUDA-graph decoding (kvdex.hf.graph) ------------------------------------------------
    # The selection only changes in _build, which runs in on_step (after the step, outside a captured
    # graph) or before a page-boundary step (joined: the budget cover). Under static sizing select returns
    # one persistent [B, W] buffer (-1 padded, W >= the budget's pages) that _build rewrites in place, so a captured
    # step reads the current selection without a new capture; a wider selection (ratio mode) makes a
    # new buffer, whose identity is in the graph key.
    def graph_key(self, stores) -> tuple | None:
        if self._layers is not None:
            return self._layers.graph_key()
        buf = self._static_pages
        if buf is None:
            return None  # this step's select allocates the buffer: an eager step
        queries = ()
        if self.anchor_from == "query":
            if len(self._queries) < len(self.info.sparse_layers):
                return None  # this step's select allocates the query buffers: an eager step
            queries = tuple((lay, id(x), tuple(x.shape)) for lay, x in sorted(self._queries.items()))
        index = (id(self._vall), self._gcap)  # page joins write into it inside the captured step
        return ("chess", id(buf), tuple(buf.shape), index) + queries

    def _static_selection(self, store) -> torch.Tensor:
        if self._static_pages is None:  # allocated in an eager step (the graph key changed)
            w = self._pages.shape[1]
            width = max(w, self.budget_pages) if self.ratios is None else w + max(1, w // 4)
            self._static_pages = torch.full((self._pages.shape[0], width), -1, dtype=torch.long, device=store.device)
            self._refresh_static()
        return self._static_pages

    def _refresh_static(self) -> None:
        buf = self._static_pages
        if buf is None:
            return
        w = self._pages.shape[1]
        if w > buf.shape[1]:
            self._static_pages = None  # wider than the buffer: a new one at the next static select
            return
        buf.fill_(-1)
        buf[:, :w] = self._pages.to(buf.device)

    # ---- quality-aware backtracking ----------------------------------------------------------------
    def on_step(self, step, logits) -> None:
        if not self._batch:
            return
        now = self._stores[self.info.sparse_layers[-1]].lengths_host.clone()
        grew = int((now - self._last_len).max()) > 1
        self._last_len = now
        if step < 1:  # step 0 is the prefill (its logits come from dense attention)
            return
        if grew:  # several tokens in one forward (a new turn): the context changed, rebuild
            self._check = None
            self._rebuild(step, None)
            return
        self.decode_steps += 1
        if self._layers is None and self.anchor_from == "query" and self.query_builds == 0 and len(self._queries):
            self._rebuild(step, None)  # the prefill's build had no decode query: score with the first one
            return
        rows = self._due(step, logits)
        if rows is not None:
            self._rebuild(step, rows)

    def _rebuild(self, step: int, rows: torch.Tensor | None) -> None:
        b = self._batch
        rows_cpu = torch.ones(b, dtype=torch.bool) if rows is None else rows.cpu()
        if self._layers is not None:  # done by every layer's select at the next step, with its queries
            self._layers.request(rows_cpu)
        else:
            self._build(step, None if rows is None else rows_cpu)
        for i in torch.nonzero(rows_cpu).flatten().tolist():
            self.rebuild_log.append((step, i))
        self.rebuilds += int(rows_cpu.sum())

    def stats(self) -> dict:
        b = self._batch
        pages_generated = self.decode_steps * b / self.cfg.page_size
        return {
            "mode": "ratio" if self.ratios is not None else "budget",
            "trigger": self.trigger,
            "thresholds": {"entropy": self._tau[0], "varentropy": self._tau[1]},
            "builds": self.builds,
            "rebuilds": self.rebuilds,
            "checks": self.checks,
            "decode_steps": self.decode_steps,
            "rebuilds_per_generated_page": self.rebuilds / pages_generated if pages_generated else None,
            "pages_between_rebuilds": pages_generated / self.rebuilds if self.rebuilds else None,
            "selected_pages_mean": sum(self.selected_pages) / len(self.selected_pages) if self.selected_pages else None,
            "rebuild_ms": self.rebuild_ms,
            "anchor_from": self.anchor_from,
            "scope": self.scope,
            "units": self.units,
            "query_builds": self.query_builds,
        }
