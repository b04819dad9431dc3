"""scripts/profile_vllm_path.py runs kvdex's vLLM request path on the CPU (tiny shape) and names the steps in which
the requests' step graphs warmed up or captured (the tests' stand-in for a CUDA graph)."""

from __future__ import annotations

import json
import re

from conftest import script
from step_graph_stand_in import StepGraphStandIn

import kvdex.engine.graphs.capture as graphs_mod


def test_profile_vllm_path_reports_the_steps_and_their_graph_events(capsys, monkeypatch):
    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    steps = 20
    args = f"--shape tiny --device cpu --policy quest --budget 96 --context 300 --requests 2 --steps {steps} --top 20"
    rc = script("profile_vllm_path").main(args.split())
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    report = json.loads(out[0])
    assert report["requests"] == 2 and report["decode_graphs"] and 0 < report["ms_median"] <= report["ms_p90"]
    events = [re.fullmatch(r"\s+(\d+)\s+[\d.]+\s+E(\d+) C(\d+)", line) for line in out[2:]]
    assert len(events) == steps and all(events), out
    eager = sum(int(m.group(2)) for m in events if m)
    captures = sum(int(m.group(3)) for m in events if m)
    # both requests: decode step 1 before the graphs, a warm-up, then one capture per layer; the rest replays
    assert 2 <= eager < steps and captures > 0, (eager, captures)
