"""CHESS's trigger statistics in one kernel (:mod:`kvdex.kernels.entropy_triton`) against the PyTorch twin
(:func:`kvdex.policies.chess.levels.entropy_varentropy` and the trigger's running sums).

The kernel tests run compiled on CUDA, and on a CPU machine under Triton's interpreter in a subprocess
(``test_interpreter_suite``, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, DEV, INTERP, run_kernels

from kvdex.policies.chess.levels import entropy_varentropy


@pytest.mark.skipif(CUDA or INTERP, reason="runs the kernels itself")
def test_interpreter_suite(interpreter_suite):
    """This file's kernel tests under TRITON_INTERPRET=1 in a fresh interpreter (tests/conftest.py)."""
    pytest.importorskip("triton")
    interpreter_suite(__file__)


def _twin(logits: torch.Tensor) -> torch.Tensor:
    h, v = entropy_varentropy(logits)
    return torch.stack([h, h.square(), v, torch.ones_like(h)])


def _logits(b: int, n: int, scale: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, generator=gen) * scale
    x[0, : min(n - 1, 4100)] = float("-inf")  # row 0: a first block with no mass (the max starts at -inf)
    if b > 1:
        x[1, torch.randperm(n, generator=gen)[: n // 3]] = float("-inf")  # masked tokens anywhere
    if b > 2:
        x[2] = -30.0  # uniform: the largest entropy, varentropy 0
        x[2, 7] = 5.0  # ... but one token stands out
    return x.to(dtype)


@run_kernels
@pytest.mark.parametrize(
    "b, n, scale, dtype",
    [(3, 50, 3.0, torch.float32), (4, 9000, 6.0, torch.float32), (2, 12289, 20.0, torch.bfloat16)],
)
def test_accumulate_matches_twin(b, n, scale, dtype):
    from kvdex.kernels.entropy_triton import accumulate

    x1, x2 = _logits(b, n, scale, 0, dtype), _logits(b, n, scale, 1, dtype)
    acc = torch.zeros(4, b, device=DEV)
    accumulate(x1.to(DEV), acc)
    accumulate(x2.to(DEV), acc)  # a second step adds to the sums
    want = _twin(x1.float()) + _twin(x2.float())
    torch.testing.assert_close(acc.cpu(), want, atol=2e-4, rtol=2e-4)


@run_kernels
def test_one_certain_token_has_zero_entropy():
    from kvdex.kernels.entropy_triton import accumulate

    x = torch.full((2, 5000), float("-inf"))
    x[0, 4999] = 1.0  # the only finite logit sits in the last block
    x[1, 3] = 0.0
    acc = torch.zeros(4, 2, device=DEV)
    accumulate(x.to(DEV), acc)
    torch.testing.assert_close(acc.cpu(), torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]))


@run_kernels
def test_bad_accumulator_is_a_value_error():
    from kvdex.kernels.entropy_triton import accumulate

    with pytest.raises(ValueError, match=r"contiguous \[4, 2\] fp32"):
        accumulate(torch.zeros(2, 10, device=DEV), torch.zeros(3, 2, device=DEV))
    with pytest.raises(ValueError, match="fp32"):
        accumulate(torch.zeros(2, 10, device=DEV), torch.zeros(4, 2, device=DEV, dtype=torch.float64))
