"""When a decode step selects anew, and when every sparse layer attends its last selection instead
(a policy's ``select_every=N``, :class:`kvdex.policies.reuse.SelectEveryOption`).

A selection names middle pages or tokens; the middle changes only when a page joins it (the window moves
on one page at a time), so a layer's last selection stays a valid set of middle tokens until then.
With ``select_every=N > 1`` a step selects when the layer holds no selection yet (the first step after a
prefill), when a page joins the middle in this step, when the policy asks for it
(:meth:`~kvdex.policies.base.Policy.must_select`, e.g. PRKV's static-set refresh) or when ``N - 1`` steps
have reused the last one; every other step attends the held selection and skips ``select`` (the
policy's :meth:`~kvdex.policies.base.Policy.reused` does its per-step bookkeeping). The sink and the
window are attended every step as always, so the newest tokens are never missed.

The decision is taken once per step, on the host, from the sequence lengths alone (no device value is
read), by whoever starts the step first: the CUDA-graph step plans (:mod:`kvdex.engine.graphs.plan`; a
select step and a reuse step are two graph variants) or, for an eager step, the cache at its first
layer. Eager and captured decoding therefore make the same choice on every step.
"""

from __future__ import annotations

from collections.abc import Callable

from kvdex.storage import page_joins


class SelectionReuse:
    """The step schedule of one cache: ``reuse`` is this step's decision (read by every layer's engine);
    ``selected`` / ``reused``: the decode steps decided so far each way (``Cache.stats()``)."""

    def __init__(self) -> None:
        self.selected = self.reused = 0
        self.reset()

    def reset(self) -> None:
        """No selection held (a prefill, or several tokens appended at once): the next step selects."""
        self.age = -1  # steps since the last select step (-1: none held)
        self.reuse = False
        self._step: int | None = None

    def decide(self, every: int, step: int, store, must_select: Callable[[], bool] | None = None) -> bool:
        """This step's decision (the same for every call with the same ``step``, the tokens seen before
        it): reuse when ``every > 1``, a selection is held, fewer than ``every - 1`` steps reused it, no
        page joins the middle of ``store`` (any layer's: all hold the same lengths) and ``must_select()``
        (the policy's, asked only when the rest allows a reuse) is False."""
        if every <= 1:  # select every step: nothing to decide (no host work per step)
            return False
        if step == self._step:
            return self.reuse
        self._step = step
        joins = page_joins(store)
        self.reuse = 0 <= self.age < every - 1 and not joins and not (must_select is not None and must_select())
        self.age = self.age + 1 if self.reuse else 0
        self.reused += self.reuse
        self.selected += not self.reuse
        return self.reuse
