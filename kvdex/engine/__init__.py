"""The decoding engine without a model framework: one sparse layer's step (:mod:`kvdex.engine.step`),
the choice of store (:mod:`kvdex.engine.stores`) and the step counters (:mod:`kvdex.engine.counters`).

It imports torch and kvdex's storage, policies, kernels, selection and config, never transformers:
the transformers adapter (:mod:`kvdex.hf`) and any other backend drive it.
"""

from kvdex.engine.counters import StepCounters
from kvdex.engine.step import OBS_KEEP, EngineHost, LayerEngine
from kvdex.engine.stores import make_store

__all__ = ["OBS_KEEP", "EngineHost", "LayerEngine", "StepCounters", "make_store"]
