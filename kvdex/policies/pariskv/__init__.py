"""``pariskv`` and ``pariskv-kmeans``: ParisKV (Qi et al., ICML 2026), a package of components
(:mod:`kvdex.policies.pariskv.policy` says which owns what). Importing it registers both policies."""

from kvdex.policies.pariskv.learned_centroids import ParisKVKMeansPolicy, kmeans, nearest
from kvdex.policies.pariskv.policy import PAPER_OPTIONS, PAPER_SPEC, ParisKVPolicy
from kvdex.policies.pariskv.pool import ADAPTIVE_RATIOS, PoolSizes, adaptive_ratios
from kvdex.policies.pariskv.recall import recall_at_k
from kvdex.policies.pariskv.summary import KeySummary, LayerSummary

__all__ = [
    "ADAPTIVE_RATIOS",
    "PAPER_OPTIONS",
    "PAPER_SPEC",
    "KeySummary",
    "LayerSummary",
    "ParisKVKMeansPolicy",
    "ParisKVPolicy",
    "PoolSizes",
    "adaptive_ratios",
    "kmeans",
    "nearest",
    "recall_at_k",
]
