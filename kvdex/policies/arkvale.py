"""``arkvale``: ArkVale (Chen et al., NeurIPS 2024) -- page digests and recall of evicted pages.

Every page that fills (in kvdex: joins the middle) is backed up (with ``offload=True`` it lives in
host memory) and summarised into a digest, a bounding volume of its keys (:mod:`._digest`). Before
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.kernels.scoring import group_topk
from kvdex.policies._digest import DigestIndex, check_digest
from kvdex.policies.base import Policy, group_reduce, mask_pages, register_policy, topk_ids
from kvdex.selection import Selection


def head_scores(
    index: DigestIndex, layer: int, q: torch.Tensor, store, first: torch.Tensor | None = None, p: int | None = None
):
    """Digest estimate per query head of every middle page: [B, Hq, P], ``-inf`` past the middle.

    ``first`` [B] (optional): pages before it are not candidates (PRKV's static region).
    ``p``: pages to score (default :func:`static_pages`).
    """
    p = static_pages(index, layer, store) if p is None else p
    score = mask_pages(index.scores(layer, q, p), store.grid.num_middle_pages(store.lengths))
    if first is not None:
        ids = torch.arange(p, device=score.device)
        score = score.masked_fill(ids[None, None, :] < first.to(score.device)[:, None, None], float("-inf"))
    return score


def page_scores(
    index: DigestIndex, layer: int, q: torch.Tensor, store, first: torch.Tensor | None = None, p: int | None = None
):
    """Digest estimate per kv head (group max) of every middle page: [B, H, P] (:func:`head_scores`)."""
    return group_reduce(head_scores(index, layer, q, store, first, p), store.kv_heads, "max")


def static_pages(index: DigestIndex, layer: int, store, *others: torch.Tensor) -> int:
    """Pages to score: the longest middle, or under static sizing (CUDA-graph decoding) the index
    capacity (and no more than the capacity of ``others`` [B, H, cap] that are sliced alike): a value
    that changes only when a buffer is re-allocated, never with the lengths. Pages past each
    sequence's middle are masked with the device lengths either way."""
    if store.static:
        return min([index.centre[layer].shape[2], *(t.shape[2] for t in others)])
    return int(store.grid.num_middle_pages(store.lengths_host).max())


def top_pages(
    index: DigestIndex,
    layer: int,
    q: torch.Tensor,
    store,
    k: int,
    first: torch.Tensor | None = None,
    group: str = "max",
) -> torch.Tensor:
    """Top-k middle pages per kv head by digest estimate: [B, H, k], ``-1`` padded. ``group``: how the
    query heads' estimates combine (:func:`kvdex.kernels.scoring.group_topk`; ArkVale: ``"max"``)."""
    if layer not in index or k <= 0:
        return torch.full((store.batch, store.kv_heads, 0), -1, dtype=torch.long, device=q.device)
    return group_topk(head_scores(index, layer, q, store, first), store.kv_heads, k, group)


@register_policy
@dataclass
class ArkValePolicy(Policy):
    name = "arkvale"
    capturable = True
    capturable_index = True

    digest: str = "cuboid-mean"  # see kvdex/policies/_digest.py: {cuboid,sphere}-{mean,max,center}
    cache_pages: int = 0  # ArkVale's device page cache c, for the recall count (0: 2 x the attended pages)

    def __post_init__(self) -> None:
        check_digest(self.digest)
        if not isinstance(self.cache_pages, int) or isinstance(self.cache_pages, bool) or self.cache_pages < 0:
            raise ValueError(f"cache_pages must be an int >= 0 (0: twice the attended pages), got {self.cache_pages!r}")

    def bind(self, info) -> None:
        super().bind(info)
        self.digests = DigestIndex(self.digest)
        self.capacity = self.cache_pages or 2 * self.cfg.retrieval_pages
        if self.capacity <= self.cfg.retrieval_pages:
            raise ValueError(
                f"cache_pages ({self.cache_pages}) must exceed the attended pages ({self.cfg.retrieval_pages}), "
                "as ArkVale requires k < c; pass 0 for twice the attended pages"
            )
        self.cached: dict[int, torch.Tensor] = {}  # layer -> [B, H, P] bool: in ArkVale's device cache
        # layer -> [] long on the layer's device: pages recalled into its cache, summed over steps and
        # kv heads (added to in place, so a CUDA graph replays the addition; summed over layers by stats)
        self.recalled: dict[int, torch.Tensor] = {}
        self._lookup_layers: set[int] = set()
        self.lookups = 0  # (layer, step, sequence, kv head) selections
        self._lookups_per_step = 0  # what one step's selects add to lookups (CUDA-graph replays)

    # ---- CUDA-graph decoding (kvdex.hf.graph) ------------------------------------------------
    # Under static sizing the digests are scored over the index capacity (masked past the middle) and
    # the cache bookkeeping runs every step on the device, in place, so select has no host read. With
    # p = the capacity (> c) the eviction branch runs every step; when the cached pages number <= c it
    # keeps them all (every cached page has a finite rank), so the cache is the dynamic one.
    def graph_key(self, stores) -> tuple:
        return ("arkvale",) + _ids(self.digests.centre, self.digests.radius, self.cached, self.recalled)

    def graph_replayed(self) -> None:
        self.lookups += self._lookups_per_step

    def stats(self) -> dict:
        per = sum(int(n) for n in self.recalled.values()) / max(1, self.lookups)
        return {"cache_pages": self.capacity, "recalled_pages_per_head_step": per}

    def index(self, layer, update) -> None:
        self.digests.write(layer, update.start, update.count, update.keys)
        need = int((update.start + update.count).max()) if update.count.numel() else 0
        cur = self._reserve_cached(layer, need, update.keys)
        for b in torch.nonzero(update.count).flatten().tolist():  # a page that fills is in the cache
            s = int(update.start[b])
            cur[b, :, s : s + int(update.count[b])] = True

    # page joins inside a captured decode step (Policy.capturable_index): the digest and the cache flag of
    # the joining page, written at the device start of each joining sequence
    def reserve_index(self, layer, pages, store) -> None:
        if pages > 0:
            self.digests.reserve(layer, pages, store)
            self._reserve_cached(layer, pages, torch.empty(store.batch, store.kv_heads, device=store.device))

    def index_join(self, layer, join) -> None:
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

    def select(self, q, view) -> Selection:
        layer, store, k = view.layer, view.store, view.retrieval_pages
        if layer not in self.digests or k <= 0:
            return Selection(pages=top_pages(self.digests, layer, q, store, k))
        p = static_pages(self.digests, layer, store, self.cached[layer])
        score = page_scores(self.digests, layer, q, store, p=p)
        pages = topk_ids(score, k)
        self._recall(layer, pages, score)
        return Selection(pages=pages)

    def _recall(self, layer: int, pages: torch.Tensor, score: torch.Tensor) -> None:
        """ArkVale's cache: count the selected pages not cached, cache them, evict the lowest-ranked rest."""
        p = score.shape[2]
        cached = self.cached[layer][:, :, :p]
        sel = torch.zeros_like(cached)
        sel.scatter_(2, pages.clamp(min=0), pages >= 0)
        self.recalled[layer].add_((sel & ~cached).sum())  # in place: a CUDA graph replays the addition
        self.lookups += sel.shape[0] * sel.shape[1]
        self._lookup_layers.add(layer)
        self._lookups_per_step = len(self._lookup_layers) * sel.shape[0] * sel.shape[1]
        cached |= sel
        if p > self.capacity:
            top = torch.finfo(score.dtype).max  # finite: topk_ids drops non-finite entries
            rank = torch.where(sel, top, score.masked_fill(~cached, float("-inf")))
            keep = topk_ids(rank, self.capacity)
            cached.zero_()
            cached.scatter_(2, keep.clamp(min=0), keep >= 0)


def _ids(*tables: dict) -> tuple:
    """Identity and shape of every tensor of per-layer tables (a CUDA-graph key)."""
    return tuple((i, lay, id(t), tuple(t.shape)) for i, tab in enumerate(tables) for lay, t in sorted(tab.items()))
