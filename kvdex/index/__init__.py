"""Indexes over keys used by policies (IceCache's DCI-tree)."""

from kvdex.index.dci import DCIParams, DCITree, transform_keys, transform_queries

__all__ = ["DCIParams", "DCITree", "transform_keys", "transform_queries"]
