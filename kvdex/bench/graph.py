"""Moved to :mod:`kvdex.hf.graph` (graph decoding is for users too: ``kvdex.generate``,
``kvdex.GraphDecoder``); kept so that ``kvdex.bench.graph.GraphDecoder`` still works."""

from __future__ import annotations

from kvdex.hf.graph import GraphDecoder, generate, graph_policies

# Policies whose decode step can be captured (with a suitable store), see kvdex.hf.graph.
STATIC_SAFE = set(graph_policies())

__all__ = ["STATIC_SAFE", "GraphDecoder", "generate", "graph_policies"]
