"""``arkvale``: ArkVale (Chen et al., NeurIPS 2024) -- page digests and recall of evicted pages.

Every page that fills (in kvdex: joins the middle) is backed up (with ``offload=True`` it lives in
host memory) and summarised into a digest, a bounding volume of its keys (:mod:`._digest`). Before
each attention, ArkVale estimates every page's importance from its digest -- cached or evicted
alike -- ranks the pages and attends the top-k, recalling evicted ones from the backup. kvdex
attends sink + window + the top ``(budget - sink - window) / page_size`` middle pages per kv head.

GQA: ArkVale scores per query head; a kv head's page score is the max over its group (a page any
head of the group needs is fetched for the group). Differences from the released system, on
purpose: kvdex's offloaded store fetches every selected page each step instead of keeping a device
cache of ``c = 2k`` pages and fetching only the misses (``stats`` counts what is moved), and kvdex's
``budget`` is the attended set (ArkVale's ``k`` pages), not ArkVale's device cache size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.policies._digest import DigestIndex, check_digest
from kvdex.policies.base import Policy, group_reduce, mask_pages, register_policy, topk_ids
from kvdex.selection import Selection


def top_pages(
    index: DigestIndex, layer: int, q: torch.Tensor, store, k: int, first: torch.Tensor | None = None
) -> torch.Tensor:
    """Top-k middle pages per kv head by digest estimate (group max): [B, H, k], ``-1`` padded.

    ``first`` [B] (optional): pages before it are not candidates (PRKV's static region).
    """
    b, h = store.batch, store.kv_heads
    if layer not in index or k <= 0:
        return torch.full((b, h, 0), -1, dtype=torch.long, device=q.device)
    p = int(store.grid.num_middle_pages(store.lengths_host).max())
    score = group_reduce(index.scores(layer, q, p), h, "max")
    score = mask_pages(score, store.grid.num_middle_pages(store.lengths))
    if first is not None:
        ids = torch.arange(p, device=score.device)
        score = score.masked_fill(ids[None, None, :] < first.to(score.device)[:, None, None], float("-inf"))
    return topk_ids(score, k)


@register_policy
@dataclass
class ArkValePolicy(Policy):
    name = "arkvale"

    digest: str = "cuboid-mean"  # see kvdex/policies/_digest.py: {cuboid,sphere}-{mean,max,center}

    def __post_init__(self) -> None:
        check_digest(self.digest)

    def bind(self, info) -> None:
        super().bind(info)
        self.digests = DigestIndex(self.digest)

    def index(self, layer, update) -> None:
        self.digests.write(layer, update.start, update.count, update.keys)

    def select(self, layer, q, store, scale) -> Selection:
        return Selection(pages=top_pages(self.digests, layer, q, store, self.cfg.retrieval_pages))
