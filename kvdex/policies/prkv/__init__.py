"""``prkv``: PRKV (page restructured KV cache), a package of components (:mod:`kvdex.policies.prkv.policy`
says which owns what). Importing it registers the policy."""

from kvdex.policies.prkv.policy import (
    DEFAULT_SELECTION,
    PAPER_SELECTION,
    PRKVPolicy,
    resolve_selection_options,
)
from kvdex.policies.prkv.region import StaticRegion
from kvdex.policies.prkv.static_set import StaticSet, split_budget

__all__ = [
    "DEFAULT_SELECTION",
    "PAPER_SELECTION",
    "PRKVPolicy",
    "StaticRegion",
    "StaticSet",
    "resolve_selection_options",
    "split_budget",
]
