"""``full``: dense attention over every token (the reference every policy is compared with)."""

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
class FullPolicy(IndexFreePolicy):
    name = "full"
    uses_budget = False
    capturable = True

    def graph_key(self, stores: Sequence[LayerStore]) -> tuple:
        """An offloaded store fetches the whole middle: the step's page count (after its token is appended, as
        ``attend`` sees it) is baked into the step. Keyed before the step, so it counts ``lengths + 1``: in a ragged
        batch a join step of a shorter row and one of the longest row start from the same count but attend
        different numbers of pages."""
        if any(s.offloaded for s in stores):
            st = stores[-1]
            return (int(st.grid.num_middle_pages(st.lengths_host + 1).max()),)
        return ()

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        return Selection(everything=True)
