"""``oracle``: the exact top-k tokens by true attention weight -- the upper bound of every method.

Per kv head the oracle keeps the ``budget - sink - window`` middle tokens with the largest
attention weight summed over the query heads of its group. The weights are the true softmax
probabilities over the whole context (sink and window included), so this choice maximises the
summed attention recall of the group among all token sets of that size. It reads every key every
step (with ``offload=True`` it copies the whole middle to the device): a yardstick, not a system.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdex.kernels.scoring import group_reduce, topk_ids
from kvdex.policies.base import IndexFreePolicy
from kvdex.policies.registry import register_policy
from kvdex.policies.reuse import SelectEveryOption, check_select_every
from kvdex.selection import Selection
from kvdex.storage import LayerStore
from kvdex.view import LayerView


def true_attention(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax weights of one query per head over all keys: q [B, Hq, D], k [B, H, L, D] -> [B, Hq, L]."""
    b, hq, d = q.shape
    h, L = k.shape[1], k.shape[2]
    s = torch.einsum("bhgd,bhld->bhgl", q.view(b, h, hq // h, d).float(), k.float()) * scale
    live = torch.arange(L, device=k.device)[None, :] < lengths.to(k.device)[:, None]
    s = s.masked_fill(~live[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1).reshape(b, hq, L)


@register_policy
@dataclass
class OraclePolicy(SelectEveryOption, IndexFreePolicy):
    name = "oracle"
    granularity = "token"
    capturable = True

    def __post_init__(self) -> None:
        check_select_every(self.select_every)

    # CUDA-graph decoding (kvdex.engine.graphs). On the resident store with static sizing,
    # dense() is the whole slot buffer (rows past each length masked here by the device lengths).
    def graph_unsupported(self, stores: Sequence[LayerStore]) -> str | None:
        if any(s.offloaded for s in stores):
            return "oracle with offload=True copies the whole middle through host memory every step"
        return None

    def graph_key(self, stores: Sequence[LayerStore]) -> tuple:
        return ()

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        k = view.store.dense_keys()
        p = group_reduce(true_attention(q, k, view.lengths, view.scale), view.kv_heads, "sum")  # [B, H, L]
        pos = torch.arange(k.shape[2], device=k.device)
        middle = (pos[None, :] >= view.sink) & (pos[None, :] < view.window_start[:, None])
        score = p.masked_fill(~middle[:, None, :], float("-inf"))
        return Selection(tokens=topk_ids(score, view.retrieval_tokens))
