"""``prkv``: PRKV (page restructured KV cache) -- a static token set plus dynamically chosen pages.

The retrieval budget ``r = budget - sink - window`` per kv head is split in two (PRKV §3.5, §4.1):

* **static** (ratio ``S``): every ``T`` decode steps (and at prefill), Algorithm 1 scores every middle
  token by the attention of the last ``obs`` queries (computed per query head on repeated KV, then
  averaged over the window and the group: :mod:`kvdex.policies.observation`), takes the top ``k_s`` tokens per kv head,
  and *relocates* them: the middle of the store is permuted so they occupy its first slots (in
  position order), the other tokens following in their previous order, still in pages
  (``store.permute_middle``; with ``offload=True`` the host pages are rewritten). The page digests
  are recomputed from the restructured pages. The static tokens are attended every step as whole
  pages (plus the ragged tail as tokens) -- the point of making them contiguous;
* **dynamic** (ratio ``1 - S``): ``(r - k_s) / page_size`` pages chosen per step among the pages after
  the static region's whole pages by ArkVale's digests (:mod:`kvdex.policies.digest`, ``cuboid-mean`` by default),
  plus the sink and the local window that kvdex always attends.

``S = 0`` is ArkVale (the same selection, no relocation), ``S = 1`` is SnapKV+ (``snapkv`` with
``refresh=T`` and ``kernel=1``; pooling is not in Algorithm 1, ``kernel`` adds it for both).

Choices where the paper is silent (measured in docs/policies/prkv.md):

* ``k_s``: PRKV's Appendix G rounds the static count down to whole pages; we do the same,
  ``k_s = page_size * floor(S * r / page_size)``, and give the ``r mod page_size`` tokens that no
  whole page can use to the static part (so ``S = 1`` gives all of ``r`` and ``S = 0`` none). The
  static region's partly filled page (static tail first, then tokens that are not static) is a dynamic
  candidate like the pages after it: chosen, it is attended whole instead of its tail, so no middle token
  is out of reach and a budget covering the context attends all of it at any budget;
* the refresh uses the last ``obs`` queries of the sequence (prompt rows first, then decode queries),
  the prefill's static set is computed at the layer's first decode step (when the store is there); the
  refresh of decode step ``t`` (``t = T, 2T, ...``) runs before that step (``Policy.before_step``), on the
  queries up to step ``t - 1`` and the middle as it stands, so the step itself replays its CUDA graph (a
  page joining the middle in step ``t`` is a dynamic candidate; at ``S = 1`` the refresh then runs after
  the join, in ``select``, that step eagerly);
* scores are computed with the keys put back in position order (``origin`` maps each middle slot to
  its position), so the static choice never depends on a previous relocation;
* GQA, dynamic pages: ArkVale's rule, a page's estimate for a kv head is the max over its query heads
  (``group="max"``); ``group="heads"`` (kvdex option) lets every query head rank the pages by its own
  estimate and takes the union round-robin over the heads' rankings until the dynamic pages are filled
  (:func:`kvdex.kernels.scoring.group_topk`; ``"sum"`` sums the estimates);
* GQA, static tokens: Algorithm 1 averages the heads' scores over the group (``static_group="mean"``);
  ``static_group="heads"`` (kvdex option) takes the union of the heads' own top tokens round-robin, as
  ``group="heads"`` does for pages;
* ``static_ratio="auto"`` is Appendix G's online rule, per layer at prefill: ``C_h`` = overlap of
  the top-r tokens of the first and the last observation query of query head h (r = the retrieval
  budget), ``k_s = page_size * floor(mean_h C_h / page_size)`` (eq. 5), averaged over the batch.

**The dynamic part's selection: kvdex's default and the paper's.** By default (not the paper's, measured in
docs/policies/prkv.md, "Default configuration") the digests choose candidate pages, at least a quarter of the
middle's (``rerank=4``, ``rerank_share=0.25``), the dynamic pages attended are the candidates' best by their keys'
exact softmax weights (``rerank_group="weight"``, ``rerank_unit="page"``; :mod:`kvdex.policies.rerank`), and one
selection serves 16 decode steps (``select_every=16``; a page joining the middle or a refresh selects anew). The
paper's selection -- the digests' top pages, every step -- is ``prkv:rerank=0``. Naming any of these options
(``group``, ``rerank``, ``rerank_group``, ``rerank_share``, ``rerank_unit``, ``select_every``, ``pool_every``)
starts the others from the paper's values (:data:`PAPER_SELECTION`), so a spec means the paper's selection plus
what it names; naming none gives :data:`DEFAULT_SELECTION`. The static part (Algorithm 1) is the paper's either way.

The package, by concept: ``policy.py`` (this file: options, the refresh schedule, the dynamic pages and the
selection they compose with the static region), ``static_set.py`` (:class:`~kvdex.policies.prkv.static_set.
StaticSet`: Algorithm 1, the relocation and its origin map, the ``auto`` split) and ``region.py``
(:class:`~kvdex.policies.prkv.region.StaticRegion`: the static region as part of a selection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.kernels.scoring import mask_pages
from kvdex.policies.arkvale import _ids
from kvdex.policies.base import PolicyInfo
from kvdex.policies.digest import DigestIndex
from kvdex.policies.observation import QueryRing, RefreshSchedule, check_kernel, obs_rows
from kvdex.policies.page_scoring import PageScoringPolicy
from kvdex.policies.prkv.region import StaticRegion
from kvdex.policies.prkv.static_set import StaticSet, split_budget
from kvdex.policies.registry import register_policy
from kvdex.policies.rerank import NamedOptions, resolve_selection
from kvdex.policies.snapkv import check_obs, prompt_rows
from kvdex.selection import Selection
from kvdex.storage import Grid, LayerStore, MiddleUpdate, PageJoin
from kvdex.view import LayerView

# The dynamic part's selection. kvdex's default: the digests choose a quarter of the middle's pages as
# candidates, the candidates' keys' exact softmax weights pick the dynamic pages, one selection serves 16 decode
# steps (docs/policies/prkv.md, "Default configuration"). The paper's: the digests' top pages, every step.
DEFAULT_SELECTION = {"group": "max", "rerank": 4, "rerank_group": "weight", "rerank_share": 0.25, "rerank_unit": "page",
                     "select_every": 16, "pool_every": 1}  # fmt: skip
PAPER_SELECTION = {"group": "max", "rerank": 0, "rerank_group": "max", "rerank_share": 0.0, "rerank_unit": "token",
                   "select_every": 1, "pool_every": 1}  # fmt: skip


def resolve_selection_options(policy: NamedOptions) -> None:
    """Set the selection options the spec does not name: none of them named -> :data:`DEFAULT_SELECTION`; any
    named (``prkv:rerank=0`` is the paper's selection) -> the others take :data:`PAPER_SELECTION`'s values, so a
    spec means what it names on top of the paper's selection."""
    resolve_selection(policy, DEFAULT_SELECTION, PAPER_SELECTION)


@register_policy
@dataclass
class PRKVPolicy(NamedOptions, PageScoringPolicy):
    name = "prkv"
    capturable = True
    relocates = True
    capturable_index = True
    scores_masked = True  # page_scores masks (DigestIndex.page_scores: one Triton kernel on CUDA)

    static_ratio: float | str = 0.25  # S (paper default 0.25), or "auto" (Appendix G, per layer)
    refresh: int = 128  # T: decode steps between static-set updates
    obs: int = 64  # observation window: the paper's local window, 64
    digest: Literal["cuboid-mean", "cuboid-max", "cuboid-center", "sphere-mean", "sphere-max", "sphere-center"] = (
        "cuboid-mean"  # dynamic pages' digest, as ArkVale
    )
    kernel: int = 1  # pooling of the static scores (1 = none, as Algorithm 1)
    pooling: Literal["max", "avg"] = "max"
    # the observation window's own middle tokens (when obs > the cache's window): "score" -- they compete
    # with the others; "last" -- chosen only after every earlier token (Algorithm 1 scores K[:-n_local])
    obs_tokens: Literal["score", "last"] = "score"
    # GQA (kvdex options): how a kv head's query heads combine when ranking the dynamic pages -- "max"
    # (ArkVale's rule), "sum", or "heads" (each head ranks; union round-robin, kernels.scoring.group_topk);
    # and the static tokens -- "mean" (Algorithm 1's group average) or "heads" (the same union)
    group: Literal["max", "sum", "heads"] = "max"  # resolved with the selection options below ("max" in both)
    static_group: Literal["mean", "heads"] = "mean"  # the group's mean score (Algorithm 1) or each head's own top
    # the relocation (kvdex option): "shift" -- the static tokens first by position, the others after them in
    # their order (every middle token moves); "swap" -- the static tokens first, each token they displace into a
    # slot one of them left (about twice the static count move: an offloaded refresh rewrites that much of the host)
    relocate: Literal["shift", "swap"] = "shift"
    # the dynamic part's selection (kvdex's default, not the paper's; resolved by resolve_selection_options): none
    # of them named -> DEFAULT_SELECTION (the defaults below); any of them named -> the others from PAPER_SELECTION
    rerank: int = 4
    rerank_group: Literal["max", "weight"] = "weight"
    rerank_share: float = 0.25
    rerank_unit: Literal["token", "page"] = "page"
    select_every: int = 16
    pool_every: int = 1

    def __post_init__(self) -> None:
        resolve_selection_options(self)
        super().__post_init__()
        s = self.static_ratio
        if s != "auto" and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s <= 1.0):
            raise ValueError(f"static_ratio (S) must be a number in [0, 1] or 'auto', got {s!r}")
        check_obs(self.obs, self.refresh)
        if self.refresh == 0:
            raise ValueError("refresh (T) must be >= 1 decode steps")
        check_kernel(self.kernel)

    @property
    def obs_window(self) -> int:
        """The prompt's last ``obs`` queries are kept for ``index`` at prefill."""
        return self.obs

    def smallest_retrieval(self, page_size: int) -> int:
        """S > 0 (or "auto") gives retrieval tokens short of a page to the static set (k_s = r mod page_size):
        one token retrieves. S = 0 is page selection alone, as ArkVale: one page."""
        return page_size if self.static_ratio == 0 else 1

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        r, ps = self.cfg.retrieval_tokens, self.cfg.page_size
        self.auto = self.static_ratio == "auto"
        ratio = 0.0 if self.auto else float(self.static_ratio)
        self.n_static, self.n_dynamic = (0, r // ps) if self.auto else split_budget(r, ps, ratio)
        self.digests = DigestIndex(self.digest)
        self.static_set = StaticSet(
            n_static=self.n_static, n_dynamic=self.n_dynamic, auto=self.auto, retrieval_tokens=r,
            static_group=self.static_group, kernel=self.kernel, pooling=self.pooling, obs_tokens=self.obs_tokens,
            digests=self.digests, relocate=self.relocate,
        )  # fmt: skip
        # the refresh schedule, the prompt's observation rows and the query rings (observation.RefreshSchedule):
        # Algorithm 1 every refresh steps when the budget has a static part
        self.schedule = RefreshSchedule(self.refresh, bool(self.n_static or self.auto), info.sparse_layers,
                                        self._restructure, self._waits_for_joins)  # fmt: skip

    def stats(self) -> dict:
        if self.auto:
            return {"static_tokens_per_layer": {lay: s for lay, (s, _) in sorted(self.static_set.split.items())}}
        return {"static_tokens": self.n_static, "dynamic_pages": self.n_dynamic}

    def layer_split(self, layer: int) -> tuple[int, int]:
        """(static tokens, dynamic pages) of ``layer``."""
        return self.static_set.layer_split(layer)

    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.obs_queries is not None:  # the window's rows only, not the prompt's queries they slice
            self.schedule.pending[layer] = obs_rows(update)
        self.digests.write(layer, update.start, update.count, update.keys)

    # page joins inside a captured decode step (Policy.capturable_index): the joining page's digest (the
    # page joins after the static region: restructuring leaves the slots past the middle in place)
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        self.digests.reserve(layer, pages, store)
        self.static_set.reserve(layer, pages * store.grid.page_size, store)

    def index_join(self, layer: int, join: PageJoin) -> None:
        self.digests.write_join(layer, join)

    # ---- static part (Algorithm 1: kvdex.policies.prkv.static_set) ----------------------------------
    def _restructure(self, layer: int, store: LayerStore, scale: float) -> None:
        self.static_set.restructure(layer, store, scale, self.schedule.rings.get(layer))

    # ---- per step (the refresh schedule: observation.RefreshSchedule) -----------------------------------------
    def before_step(self, stores: Sequence[LayerStore]) -> None:
        self.schedule.before_step(stores)

    def _waits_for_joins(self, layer: int) -> bool:
        """A page that joins the middle in a refresh step is a dynamic candidate like any page that joins
        between refreshes -- unless the layer has no dynamic pages (``S = 1``, SnapKV+)."""
        return not self.layer_split(layer)[1]

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        layer, store, scale = view.layer, view.store, view.scale
        sched = self.schedule
        step = sched.start_step(layer, scale)
        if self.n_static or self.auto:
            if layer in sched.pending:  # Algorithm 1 at decode step 0 (prefill): the prompt's window
                sched.rings[layer] = QueryRing(self.obs)
                sched.rings[layer].load(*prompt_rows(sched.pending.pop(layer), view.lengths - 1))
                self._restructure(layer, store, scale)
            elif sched.due(layer, step):  # before_step did not run (the policy driven directly)
                sched.refresh_layer(layer, store, scale, step)
            ring = sched.rings.setdefault(layer, QueryRing(self.obs))
            ring.push(q, view.lengths, offset=-1)
        sched.pending.pop(layer, None)
        return super().select(q, view)  # the dynamic pages (PageScoringPolicy), then chosen: the static part

    def must_select(self) -> bool:
        """``select_every``: a step that restructures (the first decode step, every ``refresh``-th) selects."""
        if not (self.n_static or self.auto):
            return False
        sched = self.schedule
        if sched.pending:
            return True
        for layer in self.info.sparse_layers:
            step = sched.steps.get(layer, 0)
            if layer not in sched.rings or (step and step % self.refresh == 0):
                return True
        return False

    def rebuild_period(self) -> int:
        """Algorithm 1 runs every ``refresh`` steps, before the step (when the budget has a static part)."""
        return self.refresh if getattr(self, "n_static", 0) or getattr(self, "auto", False) else 0

    def reused(self, q: torch.Tensor, view: LayerView) -> Selection | None:
        """``select_every`` / ``pool_every``: the step is counted and its query joins the ring as ``select``
        does; ``pool_every``: the held candidates' tokens ranked by this query, after the static region."""
        self.schedule.count_step(view.layer)
        if self.n_static or self.auto:
            self.schedule.rings[view.layer].push(q, view.lengths, offset=-1)
        return super().reused(q, view)

    def page_budget(self, view: LayerView) -> int:
        return self.layer_split(view.layer)[1]

    def token_budget(self, view: LayerView) -> int:
        """``rerank``: the dynamic part's tokens (its pages' worth)."""
        return self.layer_split(view.layer)[1] * view.page_size

    def page_scores(self, q: torch.Tensor, view: LayerView) -> torch.Tensor | None:
        """ArkVale's digest estimate of the pages after the static region (the dynamic part), -inf past
        each middle: per kv head (the group's max) or, with ``group`` "sum" / "heads", per query head."""
        if view.layer not in self.digests:
            return None
        p = view.score_width(self.digests.centre[view.layer].shape[2])
        first = None
        if self.layer_split(view.layer)[0]:  # candidates: the pages after the static region's whole pages
            # (a partly filled static page is one: its tokens after the static tail are not static)
            region = self._region(view.layer, view.grid)
            first = region.partial if region is not None else self._static_count(view, q.device) // view.page_size
        if self.group == "max":
            return self.digests.page_scores(view.layer, q, p, view, first)
        return mask_pages(self.digests.scores(view.layer, q, p), view.middle_pages, first)

    def _static_count(self, view: LayerView, device: torch.device) -> torch.Tensor:
        """[B] static tokens of the layer (at the front of its middle)."""
        return self.static_set.count(view.layer, view.batch, device)

    def _region(self, layer: int, grid: Grid) -> StaticRegion | None:
        return self.static_set.region(layer, grid)

    def chosen(self, q: torch.Tensor, view: LayerView, pages: torch.Tensor, score: torch.Tensor | None) -> Selection:
        """The static region (whole pages + the ragged tail as tokens) before the dynamic ``pages``; a
        dynamic page that is the static region's partly filled page replaces its tail tokens. With
        ``rerank``: the static region as tokens, then the best dynamic tokens of the candidate ``pages``
        (the static tokens of the partly filled page are no candidates)."""
        n_static = self.layer_split(view.layer)[0]
        if not n_static:
            return super().chosen(q, view, pages, score)  # S = 0: ArkVale
        # widths from the split, not the counts, built with the count (kept in place for CUDA-graph decoding)
        region = self._region(view.layer, view.grid)
        if region is None:  # no static set yet
            n = self._static_count(view, q.device)  # [B]
            region = StaticRegion.of(n, n_static, view.grid)
        if self.rerank:
            first = view.sink + self._static_count(view, q.device)  # the static tokens are no candidates
            if self.rerank_unit == "page":  # the best candidate pages, composed below as PRKV's own
                pages = self.reranked_pages(q, view, pages, first)
            else:  # the static region's positions, then the best dynamic tokens
                return Selection(tokens=self.reranked(q, view, pages, first, prefix=region.positions))
        tokens = region.tokens
        if tokens is not None:  # [B, H, 1]: the partial page is a chosen dynamic page (static pages are below it)
            whole = (pages == region.partial[:, None, None]).any(-1, keepdim=True)
            tokens = torch.where(whole, -1, tokens)
        static_pages = region.pages.expand(view.batch, view.kv_heads, -1)
        return Selection(pages=torch.cat([static_pages, pages], dim=-1), tokens=tokens)

    # ---- CUDA-graph decoding (kvdex.engine.graphs) ------------------------------------------------
    # A step replays unless it restructures (the first decode step runs eagerly: Algorithm 1 permutes
    # the store with data-dependent shapes; every refresh-th step's refresh runs before it, in
    # before_step, and the step replays). Otherwise select pushes
    # the query into the ring (in place) and scores the digests over the index capacity; the static
    # region is attended through fixed widths (n_static // page_size pages and up to page_size - 1
    # tail tokens, -1 padded) read from the device count, which a refresh rewrites in place.
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple | None:
        sched = self.schedule
        if sched.pending:
            return None  # the first decode step restructures
        restructures = bool(self.n_static or self.auto)
        if restructures:
            for layer in self.info.sparse_layers:
                step = sched.steps.get(layer, 0)
                if layer not in sched.rings or sched.due(layer, step):
                    return None
        rings = sched.graph_key()
        static = self.static_set.key()
        splits = tuple(self.layer_split(lay) for lay in self.info.sparse_layers)
        return ("prkv", rings, static, splits) + _ids(self.digests.centre, self.digests.radius) + self.pools.key()

    def graph_replayed(self) -> None:
        self.schedule.replayed()

    def positions(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Token positions of store slots ``slots`` [B, H, N] of ``layer`` (undoes the relocation; -1 stays)."""
        return self.static_set.positions(layer, slots, self.cfg.sink)
