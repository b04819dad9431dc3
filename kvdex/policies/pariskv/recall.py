"""``recall_at_k``: ParisKV's stage-by-stage Recall@k on one decode query (the paper's ablation metric),
a diagnostic over a :class:`~kvdex.policies.pariskv.ParisKVPolicy`, importable from ``kvdex.policies.pariskv``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdex.kernels import pariskv as K

if TYPE_CHECKING:
    from kvdex.policies.pariskv.policy import ParisKVPolicy


def recall_at_k(
    policy: ParisKVPolicy, layer: int, q: torch.Tensor, store, k: int = 100, scale: float | None = None
) -> dict[str, float]:
    """The paper's ablation metric on one decode query of a ``pariskv`` / ``pariskv-kmeans`` policy,
    averaged over (sequence, kv head), stage by stage.

    Truth: the exact top-k middle keys by the policy's target: <q_mean, key> (``group="mean"``, the
    query the policy searches with) or :func:`kvdex.kernels.pariskv.combine_heads` of the exact
    <q_h, key> (``group="heads"``; ``scale`` default 1/sqrt(head_dim)). ``coarse``: the top-k by
    collision votes alone (bucket top-k); ``pool``: the share of the truth inside the candidate pool
    (what the rerank can at best recover); ``e2e``: the top-k after the 4-bit rerank of that pool;
    ``rerank``: the top-k by the 4-bit estimate over *every* middle key (the rerank stage alone, no
    coarse stage). All are |found & truth| / k (ANN Recall@k).
    """
    nmid = store.grid.num_middle_pages(store.lengths_host) * store.grid.page_size
    n = int(nmid.max())
    if n <= k or layer not in policy.summary:
        return {}
    keys = store.middle_keys().float()  # [B, H, n, d]
    b, hq, d = q.shape
    h = keys.shape[1]
    sc = d**-0.5 if scale is None else scale
    qg = q.float().view(b, h, hq // h, d)
    live = torch.arange(n, device=q.device)[None, None, :] < nmid.to(q.device)[:, None, None]
    if policy.group == "heads":
        exact = torch.einsum("bhgd,bhnd->bhgn", qg, keys).masked_fill(~live[:, :, None], float("-inf"))
        target = K.combine_heads(exact.reshape(b * h, hq // h, n), sc).view(b, h, n)
    else:
        target = torch.einsum("bhd,bhnd->bhn", qg.mean(2), keys).masked_fill(~live, float("-inf"))
    truth = target.topk(k, dim=-1).indices
    final, pool = policy.search(layer, q, n, nmid, k, scale=sc)
    coarse = _coarse_topk(policy, layer, q, n, nmid, k)
    everything = torch.where(live, torch.arange(n, device=q.device), -1).expand(b, h, n).reshape(b * h, n)
    _, qb, qn = policy.votes(layer, q, n, nmid)
    idx = policy.summary[layer]
    codes, weight = idx.codes[:, :, :n].reshape(b * h, n, -1), idx.weight[:, :, :n].reshape(b * h, n, -1)
    est = K.rerank_scores(everything, codes, weight, qb, qn, policy.consts(q.device)[2], policy.m)
    if est.dim() == 3:
        est = K.combine_heads(est, sc)
    rerank = est.topk(k, dim=-1).indices.view(b, h, k)

    def rec(found):
        hit = (found[..., :, None] == truth[..., None, :]).any(-2).float()  # truth entries found
        return float(hit.mean())

    return {"coarse": rec(coarse), "pool": rec(pool), "e2e": rec(final), "rerank": rec(rerank)}


def _coarse_topk(policy: ParisKVPolicy, layer, q, n, nmid, k):
    """Top-k middle offsets by collision votes only (the coarse stage ranked on its own)."""
    score, _, _ = policy.votes(layer, q, n, nmid)
    return K.bucket_topk(score, k, policy.max_votes).view(q.shape[0], -1, k)
