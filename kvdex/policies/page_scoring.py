"""``PageScoringPolicy``: a page policy written as its score function (Quest, ArkVale, PRKV's dynamic pages, ...).

The subclass implements :meth:`PageScoringPolicy.page_scores` (and its index); the class does the rest once:
masking the pages past each middle, combining the query heads per kv head (``group``), the top pages, the
token rerank option (:mod:`kvdex.policies.rerank`), ``select_every`` / ``pool_every`` (:mod:`kvdex.policies.reuse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdex.kernels.scoring import group_reduce, group_topk, mask_pages, share_candidates, topk_ids
from kvdex.policies.base import Policy, PolicyInfo
from kvdex.policies.rerank import PoolOption, RerankOption, candidate_pages, rerank_pages, rerank_tokens
from kvdex.policies.reuse import HeldPools, SelectEveryOption, check_select_every
from kvdex.selection import Selection
from kvdex.view import LayerView


@dataclass
class PageScoringPolicy(SelectEveryOption, RerankOption, PoolOption, Policy):
    """A page policy that is its score function: it implements :meth:`page_scores` (and its index);
    :meth:`select` does the rest once -- pages past each sequence's middle (the window's) set to
    ``-inf``, query-head scores combined per kv head (``group``), the top :meth:`page_budget` pages
    per kv head, the :class:`Selection` (:meth:`chosen`).

    ``group`` (a dataclass field in a subclass that offers the choice): how a kv head's query heads
    combine (:func:`kvdex.kernels.scoring.group_topk`): ``"max"`` / ``"sum"`` of the scores, or
    ``"heads"``, the union of every head's own ranking. ``scores_masked``: True where
    :meth:`page_scores` already sets the pages past each middle to ``-inf`` (a fused kernel).

    ``rerank`` (kvdex option, not in the papers; :mod:`kvdex.policies.rerank`): 0 (default) attends the
    top pages; ``N > 0`` takes ``N x`` as many pages as the token budget (:meth:`token_budget`) fills as
    candidates and attends the best tokens of them by exact ``q.k`` (the group combined by
    ``rerank_group``): a token selection; ``rerank_share`` > 0 makes the candidates at least that share of
    each sequence's middle pages; ``pool_every=N`` chooses those candidates every N steps and at page joins,
    and ranks the held candidates' tokens every step (:class:`~kvdex.policies.rerank.PoolOption`)."""

    group = "max"  # the GQA reduction of the page scores (quest, prkv: an option)
    scores_masked: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()  # RerankOption's check
        check_select_every(self.select_every)
        self.check_pool()
        if self.rerank_share and self.group == "heads":
            raise ValueError(
                "rerank_share sizes one ranking of pages per kv head; group='heads' ranks per query head: "
                "use group='max' or 'sum' with rerank_share, or drop rerank_share"
            )

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        self.pools = HeldPools()  # pool_every: layer -> the candidate pages [B, H, C] of its last refresh step

    def page_scores(self, q: torch.Tensor, view: LayerView) -> torch.Tensor | None:
        """Scores of the first P middle pages of ``view.layer`` (P: e.g. ``view.score_width(capacity)``):
        [B, Hq, P] per query head or [B, H, P] per kv head, higher first, ``-inf`` never chosen; None
        while nothing of the layer is indexed (sink + window only)."""
        raise NotImplementedError

    def page_budget(self, view: LayerView) -> int:
        """Pages per kv head this step. Default: the retrieval budget."""
        return view.retrieval_pages

    def token_budget(self, view: LayerView) -> int:
        """Tokens per kv head this step with ``rerank`` (its candidates: ``rerank`` x the pages they fill).
        Default: the retrieval budget."""
        return view.retrieval_tokens

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        pages, score = self.top_pages(q, view)
        if self.pool_every > 1 and score is not None:
            self.pools.hold(view.layer, pages)
        return self.chosen(q, view, pages, score)

    def reuse_steps(self) -> int:
        return self.pool_every if self.pool_every > 1 else self.select_every

    def reused(self, q: torch.Tensor, view: LayerView) -> Selection | None:
        """``pool_every``: a step between refreshes ranks the tokens of the held candidates by its own query."""
        pages = self.pools.get(view.layer) if self.pool_every > 1 else None
        return None if pages is None else self.chosen(q, view, pages, None)

    def top_pages(self, q: torch.Tensor, view: LayerView) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The top pages [B, H, k] (``-1`` padded) and the masked scores they were chosen from (per kv
        head; per query head with ``group="heads"``), or no pages and None."""
        k = self.page_budget(view)
        if self.rerank:  # candidates: rerank x the pages of the token budget
            k = candidate_pages(self.token_budget(view), view.page_size, self.rerank)
        score = self.page_scores(q, view) if k > 0 else None
        if score is None:
            return view.no_ids(q.device), None
        if not self.scores_masked:
            score = mask_pages(score, view.middle_pages)
        if self.group == "heads":
            return group_topk(score, view.kv_heads, k, "heads"), score
        if score.shape[1] != view.kv_heads:
            score = group_reduce(score, view.kv_heads, self.group)
        if self.rerank_share:  # at least that share of each middle's pages
            return share_candidates(score, k, self.rerank_share, view.middle_pages), score
        # a set: the attention sums its pages in any order, so on CUDA the unordered (radix) top-k, which skips
        # torch.topk's sort (about 25 us a layer at 128k on an H200); the CPU keeps the best first
        return topk_ids(score, k, ordered=not (self.rerank or score.is_cuda)), score

    def chosen(self, q: torch.Tensor, view: LayerView, pages: torch.Tensor, score: torch.Tensor | None) -> Selection:
        """The selection of ``pages`` (:meth:`top_pages`; ``score`` None: nothing was scored). Default:
        those pages, or with ``rerank`` the best tokens of them (:meth:`reranked`; ``rerank_unit="page"``:
        the best :meth:`page_budget` pages of them, :meth:`reranked_pages`)."""
        if self.rerank and self.rerank_unit == "page":
            return Selection(pages=self.reranked_pages(q, view, pages))
        if self.rerank:
            return Selection(tokens=self.reranked(q, view, pages))
        return Selection(pages=pages)

    def reranked(
        self,
        q: torch.Tensor,
        view: LayerView,
        pages: torch.Tensor,
        first: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The :meth:`token_budget` best tokens [B, H, T] of the candidate ``pages`` by exact ``q.k``
        (:func:`kvdex.policies.rerank.rerank_tokens`; ``first`` [B]: slots below it are no candidates;
        ``prefix`` [B, 1 or H, S]: positions put before them)."""
        return rerank_tokens(q, view, pages, self.token_budget(view), self.rerank_group, first, prefix)

    def reranked_pages(
        self, q: torch.Tensor, view: LayerView, pages: torch.Tensor, first: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The :meth:`page_budget` best pages [B, H, P] of the candidate ``pages`` by their keys' exact scores
        (:func:`kvdex.policies.rerank.rerank_pages`)."""
        return rerank_pages(q, view, pages, self.page_budget(view), self.rerank_group, first)
