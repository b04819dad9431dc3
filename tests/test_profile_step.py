"""scripts/profile_step.py runs on the CPU (tiny shape) and reports a positive time per step per policy."""

from __future__ import annotations

import re

import pytest
from conftest import script


def test_profile_step_reports_each_policy(capsys):
    rc = script("profile_step").main(
        "--shape tiny --device cpu --context 300 --budget 96 --dense-layers 1 --steps 2 --warmup 1 --top 3 "
        "--policies quest,quest:rerank=4".split()
    )
    out = capsys.readouterr().out
    assert rc == 0
    totals = re.findall(r"== (\S+): (\d+) us per step", out)
    assert [p for p, _ in totals] == ["quest", "quest:rerank=4"], out
    assert all(int(t) > 0 for _, t in totals)
    assert len(re.findall(r"^\s+[\d.]+ us\s+x", out, re.M)) == 6  # --top 3 kernels for each policy


def test_captured_needs_cuda(capsys):
    """--captured replays CUDA graphs: on the CPU the command line refuses it and says what to do."""
    with pytest.raises(SystemExit) as err:
        script("profile_step").main("--shape tiny --device cpu --captured".split())
    assert err.value.code == 2
    assert "needs --device cuda" in capsys.readouterr().err
