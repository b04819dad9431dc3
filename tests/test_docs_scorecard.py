"""The README and docs/results.md quote one scorecard, the one in ``docs/data/scorecard/qwen05b.json``: the
README's policy table gives each policy's retrieval ratio at 32k (budgets 256 / 1024) as that file has it, and
results.md carries the file's table as written (``qwen05b.md``). Regenerating the scorecard without updating the
two fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "docs/data/scorecard"


def _cells() -> dict[tuple[str, int], float]:
    report = json.loads((CARD / "qwen05b.json").read_text())
    return {
        (c["policy"], c["budget"]): c["ratio"]
        for c in report["cells"]
        if c["task"] == "retrieval" and c["length"] == 32768 and c["budget"] is not None
    }


def _readme_rows() -> dict[str, str]:
    """policy name -> the README policy table's retrieval cell (``0.89 / 0.93``; several names share a row)."""
    text = (ROOT / "README.md").read_text()
    head = next(line for line in text.splitlines() if line.startswith("| policy |") and "retrieval 32k" in line)
    col = next(i for i, c in enumerate(head.strip("|").split("|")) if "retrieval 32k" in c)
    rows = {}
    for line in text.split(head, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([\w-]+)`", cells[0])
        values = [v.strip() for v in cells[col].split(",")]
        for name, value in zip(names, values if len(values) == len(names) else values * len(names), strict=True):
            rows[name] = value
    return rows


def test_readme_quotes_the_scorecard():
    cells, rows = _cells(), _readme_rows()
    checked = 0
    for (policy, budget), ratio in cells.items():
        if policy not in rows:
            continue
        low, high = (float(x) for x in rows[policy].split("/"))
        assert {256: low, 1024: high}[budget] == round(ratio, 2), (policy, budget, rows[policy], ratio)
        checked += 1
    assert checked >= 16  # every selecting policy of the table at both budgets


def test_results_carries_the_scorecard_table():
    table = [line for line in (CARD / "qwen05b.md").read_text().split("## Retrieval by subtask")[0].splitlines()
             if line.startswith("|")]  # fmt: skip
    results = (ROOT / "docs/results.md").read_text()
    assert len(table) > 20 and "\n".join(table) in results
