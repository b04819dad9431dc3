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

The package, by concept: ``policy.py`` (this file: the options, the life cycle, the counters), ``options.py`` (the
defaults the paper leaves open, the selection options' resolution), ``hierarchy.py``
(:class:`~kvdex.policies.chess.hierarchy.Hierarchy`: the page/chunk/grid buffer, eq. 1-4 and the masks),
``shared_scope.py`` and ``layer_scope.py`` (the two ways a selection is built and served), ``trigger.py``
(:class:`~kvdex.policies.chess.trigger.Trigger`: when to rebuild), ``levels.py`` (pure tensor arithmetic) and
``scope.py`` (what the policy hands a scope). Each component owns its state; the policy calls them.

kvdex's default goes beyond the paper in named options, chosen by the scorecard and the benchmark
(docs/policies/chess.md): ``anchor_from="query"`` scores the hierarchy with the decode step's queries
instead of the window's keys, and ``scope="layer"`` (``layer_scope.py``) gives every sparse layer its
own selection per kv head, built inside ``select`` from that step's queries; its selection
(:data:`~kvdex.policies.chess.options.DEFAULT_SELECTION`) scores the hierarchy's pages by ArkVale's digests
(``units="digest"``, chunks and grids by their pages' max), takes its top pages, at least a quarter of the
middle's, as candidates and keeps their best pages by exact softmax weight (``rerank=4``, ``rerank_unit="page"``,
``rerank_group="weight"``, ``rerank_share=0.25``) until the next rebuild. Naming any selection option starts the
others from :data:`~kvdex.policies.chess.options.PLAIN_SELECTION` (``chess:rerank=0``: the hierarchy's own top
pages by mean key). The paper's mode, exactly as above: ``chess:anchor_from=window:scope=shared``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.policies.base import Policy, PolicyInfo
from kvdex.policies.chess.hierarchy import Hierarchy
from kvdex.policies.chess.layer_scope import LayerScope
from kvdex.policies.chess.levels import PRESETS
from kvdex.policies.chess.options import (
    DEFAULT_CHUNK_PAGES,
    DEFAULT_GRID_CHUNKS,
    DEFAULT_INTERVAL_PAGES,
    check_selection_options,
    resolve_selection_options,
)
from kvdex.policies.chess.scope import BuildLog, ScopeSettings
from kvdex.policies.chess.shared_scope import SharedScope
from kvdex.policies.chess.trigger import Trigger, load_thresholds
from kvdex.policies.digest import DigestIndex
from kvdex.policies.registry import register_policy
from kvdex.policies.rerank import NamedOptions, RerankOption, candidate_pages, rerank_tokens
from kvdex.selection import Selection
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin
from kvdex.view import LayerView

__all__ = ["ChessPolicy"]


@register_policy
@dataclass
class ChessPolicy(NamedOptions, RerankOption, Policy):  # rerank: budget mode only
    """CHESS. Ratio mode (``preset`` or ``rho_g/rho_c/rho_p``): the paper's retention ratios, the
    budget is not used. Budget mode (the default): the same hierarchy cut to exactly
    ``(budget - sink - window) / page_size`` pages per sequence, for comparisons at equal budget.

    Components (made at ``bind``): ``hierarchy`` (:class:`Hierarchy`, the index), ``digests`` (a
    :class:`DigestIndex` with ``units="digest"``, else None), one of ``layer_scope`` / ``shared_scope``
    (the selections), ``backtrack`` (:class:`Trigger`, when to rebuild) and ``log`` (:class:`BuildLog`).
    """

    name = "chess"
    capturable = True
    capturable_index = True

    preset: Literal["", "conservative", "moderate", "aggressive"] = (
        ""  # conservative | moderate | aggressive; "" with no rho_*: budget mode
    )
    rho_g: float | None = None
    rho_c: float | None = None
    rho_p: float | None = None
    shape: Literal["conservative", "moderate", "aggressive"] = (
        "aggressive"  # budget mode: the preset whose split of the reduction over levels is kept
    )
    chunk_pages: int = DEFAULT_CHUNK_PAGES  # N_c
    grid_chunks: int = DEFAULT_GRID_CHUNKS  # N_g
    trigger: Literal["uncertainty", "interval", "always", "never"] = "uncertainty"  # interval: Appendix C
    interval: int = 0  # trigger="interval": rebuild every this many decode steps (0: 6 pages)
    check_every: int = 0  # trigger="uncertainty": steps per check (0: one page of generated tokens)
    thresholds: str = ""  # JSON written by `kvdex calibrate chess`
    entropy_threshold: float | None = None  # explicit thresholds override the file
    varentropy_threshold: float | None = None
    varentropy: Literal["output", "temporal"] = "output"  # mean per-step varentropy | variance of the entropy
    combine: Literal["and", "or"] = "and"  # and: both exceed (Figure 4's upper-right region) | or: either
    # window: the paper's anchor, the mean key of the recent window (eq. 3: key-key affinity, query-agnostic);
    # query: the decode step's query heads score the same hierarchy (a kvdex option, not in the paper)
    anchor_from: Literal["window", "query"] = "query"
    # shared: one selection for every layer and head (the paper); layer: each sparse layer scores its own
    # slice of the hierarchy per kv head (a kvdex option, kvdex/policies/chess/layer_scope.py)
    scope: Literal["shared", "layer"] = "layer"
    # the selection (resolved by resolve_selection_options: DEFAULT_SELECTION, the defaults below, when none is
    # named in kvdex's default mode, else PLAIN_SELECTION's values for the unnamed ones)
    group: Literal["max", "sum", "mean"] = "max"  # scope=layer, anchor_from=query: the GQA reduction
    # mean: a unit's score is the query . its mean key (eq. 1-2's vectors); digest: a page's score is the query's
    # estimate from its keys' bounding box (ArkVale's cuboid-mean digest, kvdex.policies.digest), a chunk's and a
    # grid's the max of their pages' (a kvdex option for scope=layer with anchor_from=query, not in the paper)
    units: Literal["mean", "digest"] = "digest"
    rerank: int = 4
    rerank_group: Literal["max", "weight"] = "weight"
    rerank_share: float = 0.25
    rerank_unit: Literal["token", "page"] = "page"
    # none: a build's chosen pages are attended until the next build; digest / exact: a build keeps its candidates
    # and every decode step picks their best pages by this step's queries (ArkVale's digest estimate, or the keys'
    # exact softmax weights): a kvdex option (layer_scope.py), not in the paper
    refine: Literal["none", "digest", "exact"] = "none"

    def __post_init__(self) -> None:
        resolve_selection_options(self)
        super().__post_init__()  # the option choices (Policy) and RerankOption's check
        rhos = (self.rho_g, self.rho_c, self.rho_p)
        if any(r is not None for r in rhos):
            if self.preset:
                raise ValueError("pass a CHESS preset or rho_g/rho_c/rho_p, not both")
            if any(r is None for r in rhos):
                raise ValueError("pass all three retention ratios rho_g, rho_c, rho_p (or a preset)")
            for n, r in zip(("rho_g", "rho_c", "rho_p"), rhos, strict=True):
                if not isinstance(r, (int, float)) or not 0 < r <= 1:
                    raise ValueError(f"{n} must be a fraction in (0, 1], got {r!r}")
        for n in ("chunk_pages", "grid_chunks"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n} must be an int >= 1, got {v!r}")
        for n in ("interval", "check_every"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{n} must be an int >= 0 (0: the default), got {v!r}")
        check_selection_options(self)
        if self.rerank and self.ratios is not None:
            raise ValueError(
                "rerank > 0 needs budget mode (its candidates are rerank x the budget's pages): "
                "drop preset / rho_g / rho_c / rho_p, or pass rerank=0"
            )
        self.tau = load_thresholds(self.thresholds, self.entropy_threshold, self.varentropy_threshold, self.varentropy)

    # ---- configuration ----------------------------------------------------------------------------
    @property
    def ratios(self) -> tuple[float, float, float] | None:
        """(rho_g, rho_c, rho_p) in ratio mode, None in budget mode."""
        if self.preset:
            return PRESETS[self.preset]
        rho_g, rho_c, rho_p = self.rho_g, self.rho_c, self.rho_p
        if rho_g is not None:
            assert rho_c is not None and rho_p is not None  # __post_init__: all three or none
            return (float(rho_g), float(rho_c), float(rho_p))
        return None

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        cfg = self.cfg
        r, ps = cfg.retrieval_tokens, cfg.page_size
        token_rerank = self.rerank and self.rerank_unit == "token"  # the candidates are the selection
        self.budget_pages = candidate_pages(r, ps, self.rerank) if token_rerank else cfg.retrieval_pages
        self.hierarchy = Hierarchy(
            info.sparse_layers, info.kv_heads, info.head_dim, chunk_pages=self.chunk_pages,
            grid_chunks=self.grid_chunks, page_size=ps, ratios=self.ratios, shape=self.shape,
            budget_pages=self.budget_pages, tp=info.tp,
        )  # fmt: skip
        self.backtrack = Trigger(
            self.trigger, interval=self.interval or DEFAULT_INTERVAL_PAGES * ps, every=self.check_every or ps,
            varentropy=self.varentropy, combine=self.combine, tau=self.tau,
        )  # fmt: skip
        self.log = BuildLog()
        settings = ScopeSettings(
            sparse_layers=info.sparse_layers, page_size=ps, retrieval_tokens=r, retrieval_pages=cfg.retrieval_pages,
            timing=cfg.timing, budget_pages=self.budget_pages, ratio_mode=self.ratios is not None,
            anchor_from=self.anchor_from, group=self.group, rerank=self.rerank, rerank_unit=self.rerank_unit,
            rerank_group=self.rerank_group, rerank_share=float(self.rerank_share), refine=self.refine,
        )  # fmt: skip
        self.digests = DigestIndex("cuboid-mean") if self.units == "digest" else None  # units="digest"
        self.layer_scope = (
            LayerScope(settings, self.hierarchy, self.digests, self.log) if self.scope == "layer" else None
        )
        self.shared_scope = SharedScope(settings, self.hierarchy, self.log) if self.scope == "shared" else None
        self._stores: dict[int, LayerStore] = {}  # layer -> its store (the last index / select of it)
        self._last_len: torch.Tensor | None = None  # lengths at the last build / on_step (CPU)
        self._batch = 0  # sequences (set at the first build)

    # ---- counters (stats(); read by tests and scripts) ----------------------------------------------
    @property
    def dim(self) -> int:
        """F: the length of a page vector (sparse layers x kv heads x head dim)."""
        return self.hierarchy.dim

    @property
    def builds(self) -> int:
        return self.log.builds

    @property
    def rebuilds(self) -> int:
        return self.log.rebuilds

    @property
    def decode_steps(self) -> int:
        return self.log.decode_steps

    @property
    def rebuild_log(self) -> list[tuple[int, int]]:
        return self.log.rebuild_log

    @property
    def query_builds(self) -> int:
        return self.log.query_builds

    @property
    def checks(self) -> int:
        return self.backtrack.checks

    @property
    def check_log(self) -> list[tuple[int, int, float, float]]:
        return self.backtrack.check_log

    def anchor(self) -> torch.Tensor:
        """Eq. 3 for the cache's current state: the mean of the window's page vectors, [B, F]."""
        return self.hierarchy.anchor(self._stores)

    # ---- the index (kvdex.policies.chess.hierarchy, or the page digests) -----------------------------
    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.store is not None:
            self._stores[layer] = update.store
        hier = self.hierarchy
        slot = hier.slot[layer]
        hier.counts(update.count.shape[0])
        if not update.empty:
            if self.digests is None:
                hier.add_pages(slot, update)
            else:  # units="digest": the digests are the index, no mean-key hierarchy is kept
                self.digests.write(layer, update.start, update.count, update.keys)
                hier.counted(layer, update.start, update.count)
            self._cover(layer, update)
        last = self.info.sparse_layers[-1]
        if not self._batch and layer == last and len(self._stores) == len(hier.slot):
            # end of the prompt: every layer is stored and indexed (prefill / fork)
            self._batch = int(update.count.shape[0])
            if self.layer_scope is None:
                self._build(step=0)
            else:  # the first decode step builds every layer's selection from its own queries
                self.layer_scope.request(torch.ones(self._batch, dtype=torch.bool))
                self._last_len = self._stores[last].lengths_host.clone()
                self.log.builds += 1

    def _cover(self, layer: int, update: MiddleUpdate) -> None:
        """Budget mode: the pages of ``update`` join the selections that cover every middle page."""
        if self.layer_scope is not None:  # the layer scope covers per layer
            self.layer_scope.cover(layer, update)
        else:
            assert self.shared_scope is not None
            self.shared_scope.cover(update, self._stores)

    # ---- page joins inside a captured decode step (Policy.capturable_index) ---------------------------
    # The joining page's vector (eq. 1) is written at the device start of each joining sequence, then the
    # centroids (eq. 2) of its chunk and grid are recomputed (the other chunks do not change); the page
    # counts and the budget-mode cover of the selection (host-held) are the host side (joined).
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        if pages > 0 and self.digests is not None:
            self.digests.reserve(layer, pages, store)
        elif pages > 0:
            self.hierarchy.reserve(pages, torch.empty(store.batch, 0, device=store.device))

    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        self.hierarchy.joined(layer, start, count)
        self._cover(layer, MiddleUpdate(start, count, torch.empty(0)))

    def index_join(self, layer: int, join: PageJoin) -> None:
        self._stores[layer] = join.store
        if self.digests is not None:  # units="digest": the joining page's digest, in the captured step too
            self.digests.write_join(layer, join)
        self.hierarchy.index_join(layer, join)

    # ---- selection ------------------------------------------------------------------------------------
    def _build(self, step: int, rows: torch.Tensor | None = None) -> None:
        """(Re)build the shared scope's selection of the sequences in ``rows`` [B] bool (None: all)."""
        assert self.shared_scope is not None
        self.shared_scope.build(self._stores, rows)
        self._last_len = self._stores[self.info.sparse_layers[-1]].lengths_host.clone()
        if step == 0:
            self.log.builds += 1

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        sel = self._page_selection(q, view)
        if self.rerank and self.rerank_unit == "token":  # the chosen pages are candidates: their best tokens
            # by exact q.k, every step (the page unit picked its pages at the build: layer_scope)
            assert sel.pages is not None  # the scopes select pages
            return Selection(tokens=rerank_tokens(q, view, sel.pages, view.retrieval_tokens, self.rerank_group))
        return sel

    def _page_selection(self, q: torch.Tensor, view: LayerView) -> Selection:
        self._stores[view.layer] = view.store
        if self.layer_scope is not None:
            return self.layer_scope.select(q, view)
        assert self.shared_scope is not None
        return self.shared_scope.select(q, view)

    # ---- CUDA-graph decoding (kvdex.engine.graphs; each scope's module says how) ----------------------------
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple | None:
        if self.layer_scope is not None:
            return self.layer_scope.graph_key()
        assert self.shared_scope is not None
        return self.shared_scope.graph_key()

    # ---- quality-aware backtracking (kvdex.policies.chess.trigger) ------------------------------------
    def on_step(self, step: int, logits: torch.Tensor | None) -> None:
        if not self._batch:
            return
        now = self._stores[self.info.sparse_layers[-1]].lengths_host.clone()
        assert self._last_len is not None
        grew = int((now - self._last_len).max()) > 1
        self._last_len = now
        if step < 1:  # step 0 is the prefill (its logits come from dense attention)
            return
        if grew:  # several tokens in one forward (a new turn): the context changed, rebuild
            self.backtrack.drop_check()
            self._rebuild(step, None)
            return
        self.log.decode_steps += 1
        shared = self.shared_scope
        if shared is not None and self.anchor_from == "query" and self.log.query_builds == 0 and len(shared.queries):
            self._rebuild(step, None)  # the prefill's build had no decode query: score with the first one
            return
        rows = self.backtrack.due(step, logits, self._batch)
        if rows is not None:
            self._rebuild(step, rows)

    def _rebuild(self, step: int, rows: torch.Tensor | None) -> None:
        b = self._batch
        rows_cpu = torch.ones(b, dtype=torch.bool) if rows is None else rows.cpu()
        if self.layer_scope is not None:  # done by every layer's select at the next step, with its queries
            self.layer_scope.request(rows_cpu)
        else:
            self._build(step, None if rows is None else rows_cpu)
        for i in torch.nonzero(rows_cpu).flatten().tolist():
            self.log.rebuild_log.append((step, i))
        self.log.rebuilds += int(rows_cpu.sum())

    def stats(self) -> dict:
        b, log = self._batch, self.log
        pages_generated = log.decode_steps * b / self.cfg.page_size
        return {
            "mode": "ratio" if self.ratios is not None else "budget",
            "trigger": self.trigger,
            "thresholds": {"entropy": self.tau[0], "varentropy": self.tau[1]},
            "builds": log.builds,
            "rebuilds": log.rebuilds,
            "checks": self.backtrack.checks,
            "decode_steps": log.decode_steps,
            "rebuilds_per_generated_page": log.rebuilds / pages_generated if pages_generated else None,
            "pages_between_rebuilds": pages_generated / log.rebuilds if log.rebuilds else None,
            "selected_pages_mean": sum(log.selected_pages) / len(log.selected_pages) if log.selected_pages else None,
            "rebuild_ms": log.rebuild_ms,
            "anchor_from": self.anchor_from,
            "scope": self.scope,
            "units": self.units,
            "query_builds": log.query_builds,
        }
