"""The decoding engine without a model framework: one sparse layer's step (:mod:`kvdex.engine.step`),
the choice of store (:mod:`kvdex.engine.stores`), the step counters (:mod:`kvdex.engine.counters`) and
CUDA-graph decoding (:mod:`kvdex.engine.graphs`: the step plan, the capture path, the per-layer step graphs
and the graph service for work inside a policy's selection) and the schedule of steps that reuse a selection
(:mod:`kvdex.engine.reuse`).

It imports torch and kvdex's storage, policies, kernels, selection and config, never transformers:
the transformers adapter (:mod:`kvdex.hf`) and any other backend drive it.
"""

from kvdex.engine.counters import StepCounters
from kvdex.engine.graphs import GraphService
from kvdex.engine.reuse import SelectionReuse
from kvdex.engine.step import OBS_KEEP, EngineHost, LayerEngine
from kvdex.engine.stores import make_store

__all__ = ["OBS_KEEP", "EngineHost", "GraphService", "LayerEngine", "SelectionReuse", "StepCounters", "make_store"]
