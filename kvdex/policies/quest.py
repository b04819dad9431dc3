"""``quest``: Quest (Tang et al., 2024) -- per-page key min/max and an upper bound on q.k.

For every middle page and channel the index keeps the min and max key. For a query q the bound
``sum_d max(q_d * min_d, q_d * max_d)`` is >= q.k for every key of the page; it is computed as
``relu(q) . max + min(q, 0) . min`` (two matrix products). Quest scores per head; with GQA a page's
score for a kv head is the max of its group's bounds (still an upper bound for every query head
of the group), and the top ``(budget - sink - window) / page_size`` pages are attended.

``group`` (kvdex option, :func:`kvdex.kernels.scoring.group_topk`): how the query heads of a kv head's
group combine when ranking pages -- ``"max"`` (default, as above), ``"sum"`` of the bounds, or
``"heads"``: every query head ranks the pages by its own bound and the kv head attends the union,
taken round-robin over the heads' rankings (every head's best page first) until the budget is filled.

``rerank`` / ``rerank_group`` / ``rerank_share`` (kvdex options,
:class:`~kvdex.policies.page_scoring.PageScoringPolicy`; default 0, the paper): the bounds choose ``rerank x`` as many
candidate pages (``rerank_share``: at least that share of the middle's pages) and the best tokens of them by
exact q.k are attended (:mod:`kvdex.policies._rerank`; docs/policies/quest.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.scoring import mask_pages, page_bounds, quest_page_scores
from kvdex.policies.base import PolicyInfo
from kvdex.policies.page_scoring import PageScoringPolicy
from kvdex.policies.registry import register_policy
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin, grown_capacity
from kvdex.view import LayerView

__all__ = ["QuestPolicy", "page_bounds"]

_GROW = 256  # pages of index capacity added at a time (less below it: storage.grown_capacity)


@register_policy
@dataclass
class QuestPolicy(PageScoringPolicy):
    name = "quest"
    capturable = True
    capturable_index = True
    scores_masked = True  # every path of page_scores masks (the Triton kernel inside itself)

    group: Literal["max", "sum", "heads"] = (
        "max"  # GQA: the group's max bound (default), "sum", or "heads" (each query head ranks; union)
    )

    def __post_init__(self) -> None:
        super().__post_init__()

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        self.kmin: dict[int, torch.Tensor] = {}
        self.kmax: dict[int, torch.Tensor] = {}

    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.empty:
            return
        lo = update.keys.amin(dim=3)  # [B, H, Pn, D]
        hi = update.keys.amax(dim=3)
        need = int((update.start + update.count).max())
        kmin, kmax = self._reserve(layer, need, lo)
        for b in torch.nonzero(update.count).flatten().tolist():
            s, c = int(update.start[b]), int(update.count[b])
            kmin[b, :, s : s + c] = lo[b, :, :c]
            kmax[b, :, s : s + c] = hi[b, :, :c]

    # page joins inside a captured decode step (Policy.capturable_index): the same bounds, written at the
    # device start of each joining sequence
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        if pages > 0:
            like = torch.empty(store.batch, store.kv_heads, 0, store.head_dim, dtype=store.dtype, device=store.device)
            self._reserve(layer, pages, like)

    def index_join(self, layer: int, join: PageJoin) -> None:
        if layer in self.kmin:
            join.write(self.kmin[layer], join.keys.amin(dim=3))
            join.write(self.kmax[layer], join.keys.amax(dim=3))

    def _reserve(self, layer, pages, like):
        cur = self.kmin.get(layer)
        cap = 0 if cur is None else cur.shape[2]
        if pages > cap:
            b, h, _, d = like.shape
            new_cap = grown_capacity(pages, cap, _GROW)
            kmin = like.new_zeros(b, h, new_cap, d)
            kmax = like.new_zeros(b, h, new_cap, d)
            if cur is not None:
                kmin[:, :, :cap] = cur
                kmax[:, :, :cap] = self.kmax[layer]
            self.kmin[layer], self.kmax[layer] = kmin, kmax
        return self.kmin[layer], self.kmax[layer]

    # CUDA-graph decoding (kvdex.engine.graphs): static select reads only device tensors
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple:
        return (
            tuple((lay, id(t), tuple(t.shape)) for lay, t in sorted(self.kmin.items()))
            + tuple((lay, id(t)) for lay, t in sorted(self.kmax.items()))
            + self.pools.key()
        )

    def page_scores(self, q: torch.Tensor, view: LayerView):
        """Quest's bounds of the indexed pages, -inf past each middle: per kv head (the group's max) or,
        with ``group`` "sum" / "heads", per query head."""
        if view.layer not in self.kmin:  # nothing indexed yet: the context is all sink + window
            return None
        p = view.score_width(self.kmin[view.layer].shape[2])  # static (CUDA-graph decode): the whole index
        kmin, kmax = self.kmin[view.layer][:, :, :p], self.kmax[view.layer][:, :, :p]
        if self.group != "max":  # per query head bounds, combined by the base (group_topk)
            return mask_pages(page_bounds(q, kmin, kmax), view.middle_pages)
        fast = triton_kernel("quest_triton", "page_scores", on=q)
        if fast is not None:  # one Triton kernel, same scores (kvdex.kernels.quest_triton); it derives
            # each sequence's middle page count from the device lengths itself
            return fast(q, kmin, kmax, lengths=view.lengths, grid=view.grid)
        return quest_page_scores(q, kmin, kmax, view.middle_pages)
