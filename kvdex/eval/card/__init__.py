"""``kvdex scorecard``: every policy's accuracy and speed side by side on one model, from the same
prompts, with paired intervals. In Python: ``kvdex.eval.scorecard(...)`` (:func:`run.scorecard`).

Modules: ``config`` (settings, the smoke size), ``tasks`` (prompts), ``decode`` (batched prefill,
forks, graph-replayed decode, speed), ``run`` (cells, resuming), ``stats`` (paired intervals),
``report`` / ``markdown`` (JSON, Markdown, PNG), ``cli`` (``kvdex scorecard``).
"""

from kvdex.eval.card.config import ScorecardConfig, smoke

__all__ = ["ScorecardConfig", "smoke"]
