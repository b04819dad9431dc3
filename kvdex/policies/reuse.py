"""The ``select_every`` option (kvdex option, not in the papers): select every N decode steps and let
every sparse layer attend its last selection in between (:mod:`kvdex.engine.reuse` says when a step
selects anyway). The sink and window are attended every step; ``select_every=1`` (the default) selects
every step, as every paper does. A selection costs the same whether it is reused or not, so the step's
selection time is divided by up to N; what it costs in accuracy is measured on the scorecard
(docs/results.md, "Selecting every N steps")."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_select_every(every, name: str = "select_every") -> None:
    """ValueError unless ``every`` (``select_every``, or the option ``name`` of the same schedule) is an int >= 1."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        what = "select" if name == "select_every" else "refresh the candidates"
        raise ValueError(
            f"{name} must be an int >= 1 (1: {what} every decode step; N: {what} every N steps), got {every!r}"
        )


@dataclass
class SelectEveryOption:
    """The ``select_every`` option of a policy (a base before :class:`~kvdex.policies.base.Policy`)."""

    select_every: int = 1  # 1: select every step; N: every N steps (check_select_every in __post_init__)

    def reuse_steps(self) -> int:
        return self.select_every


class HeldPools:
    """What a refresh step keeps for the steps between refreshes (``pool_every``: the rerank's candidates), one
    tensor per layer, rewritten in place while its shape holds: a captured refresh step writes where a captured
    step between refreshes reads. A new shape or device gets a new tensor, and :meth:`key` (part of the policy's
    graph key) changes with it."""

    def __init__(self) -> None:
        self._by_layer: dict[int, torch.Tensor] = {}

    def hold(self, layer: int, t: torch.Tensor) -> None:
        held = self._by_layer.get(layer)
        if held is not None and held.shape == t.shape and held.device == t.device:
            held.copy_(t)
        else:
            self._by_layer[layer] = t.clone()

    def get(self, layer: int) -> torch.Tensor | None:
        return self._by_layer.get(layer)

    def key(self) -> tuple:
        """Ids and shapes of the held tensors, by layer."""
        return tuple((lay, id(t), *t.shape) for lay, t in sorted(self._by_layer.items()))
