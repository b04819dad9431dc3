"""``chess``: CHESS (Fei et al.), a package of components (:mod:`kvdex.policies.chess.policy` says which
owns what). Importing it registers the policy."""

from kvdex.policies.chess.levels import PRESETS, count_mask, entropy_varentropy, level_mask, window_keys
from kvdex.policies.chess.options import DEFAULT_SELECTION, PLAIN_SELECTION, resolve_selection_options
from kvdex.policies.chess.policy import ChessPolicy
from kvdex.policies.chess.trigger import DEFAULT_THRESHOLDS

__all__ = [
    "DEFAULT_SELECTION",
    "DEFAULT_THRESHOLDS",
    "PLAIN_SELECTION",
    "PRESETS",
    "ChessPolicy",
    "count_mask",
    "entropy_varentropy",
    "level_mask",
    "resolve_selection_options",
    "window_keys",
]
