"""``full``: dense attention over every token (the reference every policy is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdex.policies.base import IndexFreePolicy, register_policy
from kvdex.selection import Selection


@register_policy
@dataclass
class FullPolicy(IndexFreePolicy):
    name = "full"
    uses_budget = False
    capturable = True

    def graph_key(self, stores) -> tuple:
        """An offloaded store fetches the whole middle (its page count is baked into the step)."""
        if any(s.offloaded for s in stores):
            st = stores[-1]
            return (int(st.grid.num_middle_pages(st.lengths_host).max()),)
        return ()

    def select(self, q, view) -> Selection:
        return Selection(everything=True)
