"""``arkvale``: ArkVale (Chen et al., NeurIPS 2024) -- page digests and recall of evicted pages.

Every page that fills (in kvdex: joins the middle) is backed up (with ``offload=True`` it lives in
host memory) and summarised into a digest, a bounding volume of its keys (:mod:`kvdex.policies.digest`). Before
each attention, ArkVale estimates every page's importance from its digest -- cached or evicted
alike -- ranks the pages and attends the top-k, recalling evicted ones from the backup. kvdex
attends sink + window + the top ``(budget - sink - window) / page_size`` middle pages per kv head.

GQA: ArkVale scores per query head; a kv head's page score is the max over its group (a page any
head of the group needs is fetched for the group). Differences from the released system, on
purpose: kvdex's offloaded store fetches every selected page each step instead of keeping a device
cache of ``c = 2k`` pages and fetching only the misses, and kvdex's ``budget`` is the attended set
(ArkVale's ``k`` pages), not ArkVale's device cache size. The policy does keep ArkVale's cache
bookkeeping (``cache_pages``, default ``2k``): which pages a device cache of that size would hold
(a page is cached when it fills; selected pages are recalled into it; when it overflows, the
lowest-ranked unselected pages are evicted, as ArkVale's Figure 5), and ``stats()`` reports the
recalls per step that ArkVale would transfer (its Figure 4b).

``rerank`` / ``rerank_group`` / ``rerank_share`` (kvdex options, default 0: the paper): the digests choose
``rerank x`` as many candidate pages (``rerank_share``: at least that share of the middle's pages) and the best
tokens of them by exact q.k are attended (:mod:`kvdex.policies.rerank`);
the cache bookkeeping then counts the candidate pages (their keys are read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.kernels.scoring import topk_ids
from kvdex.policies.base import PolicyInfo
from kvdex.policies.digest import DigestIndex
from kvdex.policies.page_scoring import PageScoringPolicy
from kvdex.policies.registry import register_policy
from kvdex.selection import Selection
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin
from kvdex.view import LayerView


@register_policy
@dataclass
class ArkValePolicy(PageScoringPolicy):
    name = "arkvale"
    capturable = True
    capturable_index = True
    scores_masked = True  # page_scores masks (DigestIndex.page_scores: one Triton kernel on CUDA)

    digest: Literal["cuboid-mean", "cuboid-max", "cuboid-center", "sphere-mean", "sphere-max", "sphere-center"] = (
        "cuboid-mean"  # see kvdex/policies/digest.py: {cuboid,sphere}-{mean,max,center}
    )
    cache_pages: int = 0  # ArkVale's device page cache c, for the recall count (0: 2 x the attended pages)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.cache_pages, int) or isinstance(self.cache_pages, bool) or self.cache_pages < 0:
            raise ValueError(f"cache_pages must be an int >= 0 (0: twice the attended pages), got {self.cache_pages!r}")

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        self.digests = DigestIndex(self.digest)
        k = self.cfg.retrieval_pages  # 0 when the retrieval budget is under one page: sink + window only
        self.capacity = self.cache_pages or 2 * k
        if k and self.capacity <= k:
            raise ValueError(
                f"cache_pages ({self.cache_pages}) must exceed the attended pages ({k}), "
                "as ArkVale requires k < c; pass 0 for twice the attended pages"
            )
        self.cached: dict[int, torch.Tensor] = {}  # layer -> [B, H, P] bool: in ArkVale's device cache
        # layer -> [] long on the layer's device: pages recalled into its cache, summed over steps and
        # kv heads (added to in place, so a CUDA graph replays the addition; summed over layers by stats)
        self.recalled: dict[int, torch.Tensor] = {}
        self._lookup_layers: set[int] = set()
        self.lookups = 0  # (layer, step, sequence, kv head) selections
        self._lookups_per_step = 0  # what one step's selects add to lookups (CUDA-graph replays)

    # ---- CUDA-graph decoding (kvdex.engine.graphs) ------------------------------------------------
    # Under static sizing the digests are scored over the index capacity (masked past the middle) and
    # the cache bookkeeping runs every step on the device, in place, so select has no host read. With
    # p = the capacity (> c) the eviction branch runs every step; when the cached pages number <= c it
    # keeps them all (every cached page has a finite rank), so the cache is the dynamic one.
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple:
        return (
            ("arkvale",) + _ids(self.digests.centre, self.digests.radius, self.cached, self.recalled) + self.pools.key()
        )

    def graph_replayed(self) -> None:
        self.lookups += self._lookups_per_step

    def stats(self) -> dict:
        per = sum(int(n) for n in self.recalled.values()) / max(1, self.lookups)
        return {"cache_pages": self.capacity, "recalled_pages_per_head_step": per}

    def index(self, layer: int, update: MiddleUpdate) -> None:
        self.digests.write(layer, update.start, update.count, update.keys)
        need = int((update.start + update.count).max()) if update.count.numel() else 0
        cur = self._reserve_cached(layer, need, update.keys)
        for b in torch.nonzero(update.count).flatten().tolist():  # a page that fills is in the cache
            s = int(update.start[b])
            cur[b, :, s : s + int(update.count[b])] = True

    # page joins inside a captured decode step (Policy.capturable_index): the digest and the cache flag of
    # the joining page, written at the device start of each joining sequence
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        if pages > 0:
            self.digests.reserve(layer, pages, store)
            self._reserve_cached(layer, pages, torch.empty(store.batch, store.kv_heads, device=store.device))

    def index_join(self, layer: int, join: PageJoin) -> None:
        self.digests.write_join(layer, join)
        if layer in self.cached:
            b, h = join.keys.shape[:2]
            join.write(self.cached[layer], torch.ones(b, h, 1, dtype=torch.bool, device=join.keys.device))

    def _reserve_cached(self, layer: int, need: int, like: torch.Tensor) -> torch.Tensor:
        cur = self.cached.get(layer)
        if cur is None or cur.shape[2] < need:
            b, h = like.shape[:2]
            new = torch.zeros(b, h, max(need, 2 * (0 if cur is None else cur.shape[2])), dtype=torch.bool,
                              device=like.device)  # fmt: skip
            if cur is None:  # this layer's recall count, on its device
                self.recalled[layer] = torch.zeros((), dtype=torch.long, device=new.device)
            else:
                new[:, :, : cur.shape[2]] = cur
            self.cached[layer] = cur = new
        return cur

    def page_scores(self, q: torch.Tensor, view: LayerView):
        """The digest estimate of every indexed page per kv head (the group's max), -inf past each middle."""
        if view.layer not in self.digests:
            return None
        p = view.score_width(self.digests.centre[view.layer].shape[2], self.cached[view.layer].shape[2])
        return self.digests.page_scores(view.layer, q, p, view)

    def chosen(self, q: torch.Tensor, view: LayerView, pages: torch.Tensor, score: torch.Tensor | None) -> Selection:
        if score is not None:  # with rerank: the candidate pages (their keys are read)
            self._recall(view.layer, pages, score)
        return super().chosen(q, view, pages, score)

    def _recall(self, layer: int, pages: torch.Tensor, score: torch.Tensor) -> None:
        """ArkVale's cache: count the selected pages not cached, cache them, evict the lowest-ranked rest."""
        b, h, p = score.shape
        cached = self.cached[layer][:, :, :p]
        # the selected pages as a mask; the -1 padding lands in the extra column p (so never on page 0)
        mark = torch.zeros(b, h, p + 1, dtype=torch.bool, device=cached.device)
        mark.scatter_(2, pages.masked_fill(pages < 0, p), True)
        sel = mark[:, :, :p]
        self.recalled[layer].add_((sel > cached).sum())  # selected, not cached; in place: a graph replays it
        self.lookups += b * h
        self._lookup_layers.add(layer)
        self._lookups_per_step = len(self._lookup_layers) * b * h
        cached |= sel
        if p > self.capacity:
            # keep the top ``capacity`` cached pages, the selected ones first (a finite rank above any
            # score); a non-finite rank (an uncached page, or a cached one scored -inf) is not kept
            rank = torch.where(cached, score, float("-inf")).masked_fill_(sel, torch.finfo(score.dtype).max)
            keep = topk_ids(rank, self.capacity, ordered=not rank.is_cuda)  # a set; -1: not finite, not kept
            mark.zero_()  # now the kept pages; -1 lands in the extra column p
            mark.scatter_(2, keep.masked_fill(keep < 0, p), True)
            cached.copy_(mark[:, :, :p])


def _ids(*tables: dict) -> tuple:
    """Identity and shape of every tensor of per-layer tables (a CUDA-graph key)."""
    return tuple((i, lay, id(t), tuple(t.shape)) for i, tab in enumerate(tables) for lay, t in sorted(tab.items()))
