"""Indexes over keys used by policies: IceCache's DCI-tree.

``dci`` is the tree (one per sequence and kv head), ``search`` the level steps its search shares
with ``forest`` (the batched device mirror of a layer's trees), ``trees`` builds and extends a
layer's trees, ``pages`` turns search results into the pages attended, ``device_search`` and
``graphs`` run a layer's batched search (as a CUDA graph), ``workers`` holds the CPU thread pools.
"""

from kvdex.index.dci import DCIParams, DCITree, transform_keys, transform_queries
from kvdex.index.forest import DCIForest

__all__ = ["DCIForest", "DCIParams", "DCITree", "transform_keys", "transform_queries"]
