"""Indexes over keys used by policies (IceCache's DCI-tree)."""

from kvdex.index.dci import DCIParams, DCITree, transform_keys, transform_queries
from kvdex.index.forest import DCIForest

__all__ = ["DCIForest", "DCIParams", "DCITree", "transform_keys", "transform_queries"]
