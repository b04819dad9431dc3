"""``streaming``: StreamingLLM (Xiao et al., 2024) -- attention sinks plus the most recent tokens.

kvdex always attends the sink and the window; the window holds between ``window - page_size + 1``
and ``window`` tokens as pages fill. StreamingLLM's cache is the sink plus the last
``budget - sink`` tokens, so this policy retrieves exactly the middle tokens just before the window
that complete it: ``budget - sink - (tokens in the window now)`` of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdex.policies.base import IndexFreePolicy
from kvdex.policies.registry import register_policy
from kvdex.selection import Selection
from kvdex.storage import LayerStore
from kvdex.view import LayerView


@register_policy
@dataclass
class StreamingPolicy(IndexFreePolicy):
    name = "streaming"
    capturable = True
    granularity = "token"

    def smallest_retrieval(self, page_size: int) -> int:
        """budget == sink + window is StreamingLLM's cache of the sink and the recent tokens: accepted."""
        return 0

    # CUDA-graph decoding (kvdex.engine.graphs): select is device arithmetic on the lengths only
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple:
        return ()

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        start = view.window_start  # [B]
        want = view.budget - view.sink - (view.lengths - start)  # [B], in [r, r + page_size - 1]
        width = view.retrieval_tokens + view.page_size - 1
        pos = start[:, None] - width + torch.arange(width, device=start.device)[None, :]
        keep = (pos >= view.sink) & (pos >= start[:, None] - want[:, None])
        pos = torch.where(keep, pos, -1)
        return Selection(tokens=pos[:, None, :].expand(-1, view.kv_heads, -1))
