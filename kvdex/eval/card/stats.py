"""Paired intervals for a policy's score relative to ``full`` over the same prompts.

Every prompt is decoded by ``full`` and by the policy, so the two scores of a prompt are a pair.
:func:`paired_ratio` gives the ratio of the means and a percentile interval from a paired bootstrap:
each resample draws prompts with replacement (the same draws for both), optionally within strata
(the retrieval subtasks, so each keeps its share). A cell is *decided* when its interval excludes 1.
For binary outcomes, :func:`mcnemar_p` is the exact two-sided McNemar test on the discordant pairs.

Everything is deterministic for a seed, and the degenerate cases are exact: identical scores give
``(1, 1, 1)`` (also where both are all 0); otherwise a reference mean of 0 gives no ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("ratio", "exp_diff")


@dataclass(frozen=True)
class Interval:
    ratio: float | None
    low: float | None
    high: float | None
    n: int

    def mark(self, higher_is_better: bool = True) -> str:
        """``"better"`` / ``"worse"`` where the interval excludes 1, else ``""``."""
        if self.low is None or self.high is None:
            return ""
        if self.low > 1:
            return "better" if higher_is_better else "worse"
        if self.high < 1:
            return "worse" if higher_is_better else "better"
        return ""


def _stat(kind: str, x_mean, ref_mean):
    if kind == "ratio":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(ref_mean != 0, x_mean / np.where(ref_mean != 0, ref_mean, 1), np.nan)
    return np.exp(x_mean - ref_mean)


def paired_ratio(
    x,
    ref,
    *,
    kind: str = "ratio",
    strata=None,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """The paired statistic of ``x`` against ``ref`` (one value per prompt each, same order) with a
    bootstrap percentile interval at ``level``.

    ``kind="ratio"``: ``mean(x) / mean(ref)`` (accuracy-like scores; None when ``mean(ref) == 0``;
    resamples whose reference mean is 0 are left out). ``kind="exp_diff"``: ``exp(mean(x) -
    mean(ref))`` (x, ref: mean NLL per prompt, so the statistic is the perplexity ratio).
    ``strata``: a label per prompt; resampling then draws within each label.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x, ref = np.asarray(x, dtype=float), np.asarray(ref, dtype=float)
    if x.shape != ref.shape or x.ndim != 1:
        raise ValueError(f"x and ref must be 1-d and paired, got shapes {x.shape} and {ref.shape}")
    n = len(x)
    if n == 0:
        return Interval(None, None, None, 0)
    if np.array_equal(x, ref):  # the same outcome on every prompt: 1 by definition (also where both are 0)
        return Interval(1.0, 1.0, 1.0, n)
    point = float(_stat(kind, x.mean(), ref.mean()))
    if math.isnan(point):
        return Interval(None, None, None, n)
    rng = np.random.default_rng(seed)
    idx = _draws(rng, n, resamples, strata)
    stats = _stat(kind, x[idx].mean(1), ref[idx].mean(1))
    stats = stats[~np.isnan(stats)]
    if len(stats) == 0:
        return Interval(point, None, None, n)
    a = (1 - level) / 2
    low, high = np.quantile(stats, [a, 1 - a])
    return Interval(point, float(low), float(high), n)


def _draws(rng, n: int, resamples: int, strata) -> np.ndarray:
    """[resamples, n] prompt indices drawn with replacement (within each stratum when given)."""
    if strata is None:
        return rng.integers(0, n, size=(resamples, n))
    strata = np.asarray(strata)
    if len(strata) != n:
        raise ValueError(f"strata must label every prompt ({n}), got {len(strata)}")
    cols = []
    for label in sorted(set(strata.tolist()), key=str):
        members = np.flatnonzero(strata == label)
        cols.append(members[rng.integers(0, len(members), size=(resamples, len(members)))])
    return np.concatenate(cols, axis=1)


def mcnemar_p(x, ref) -> float | None:
    """Exact two-sided McNemar p-value of paired binary outcomes (None unless every value is 0 or 1).

    Only discordant pairs count: ``b`` prompts where ``ref`` is right and ``x`` wrong, ``c`` the other
    way; under "no difference" ``b ~ Binomial(b + c, 1/2)``; p = min(1, 2 * P(B <= min(b, c))).
    """
    x, ref = np.asarray(x, dtype=float), np.asarray(ref, dtype=float)
    if not (np.isin(x, (0, 1)).all() and np.isin(ref, (0, 1)).all()):
        return None
    b = int(((ref == 1) & (x == 0)).sum())
    c = int(((ref == 0) & (x == 1)).sum())
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2**m
    return min(1.0, 2 * tail)
