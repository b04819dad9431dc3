"""``streaming``: StreamingLLM (Xiao et al., 2024) -- attention sinks plus the most recent tokens.

With kvdex's fixed sink and window, the retrieval share of the budget goes to the tokens just
before the window, so the attended set is exactly sink + the last ``budget - sink`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.policies.base import Policy, register_policy
from kvdex.selection import Selection


@register_policy
@dataclass
class StreamingPolicy(Policy):
    name = "streaming"
    granularity = "token"

    def select(self, layer, q, store, scale) -> Selection:
        r = self.cfg.retrieval_tokens
        end = store.grid.window_start(store.lengths)  # [B]
        pos = end[:, None] - r + torch.arange(r, device=end.device)[None, :]
        pos = torch.where(pos >= store.grid.sink, pos, -1)
        return Selection(tokens=pos[:, None, :].expand(-1, store.kv_heads, -1))
