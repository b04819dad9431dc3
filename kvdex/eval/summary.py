"""The summary of an invocation: one row per run (score, ratio to ``full``), printed and saved."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from kvdex.eval.runner import EvalConfig, RunResult, Task


def summary_rows(task: Task, results: list[RunResult]) -> list[dict]:
    rows = []
    for r in results:
        m = r.metrics
        row = {"length": r.length, "policy": r.policy, "budget": r.budget if r.budget is not None else "-"}
        for k in task.summary_keys:
            row[k] = m.get(k)
        row[task.score_name] = m.get("score")
        row["ratio_to_full"] = m.get("ratio_to_full")
        row["samples"] = m.get("samples")
        row["skipped"] = r.skipped
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)"
    cols = list(rows[0])
    cells = [[_fmt(row.get(c)) for c in cols] for row in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, width, strict=True))
    return "\n".join([line(cols), line(["-" * w for w in width]), *(line(x) for x in cells)])


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else ""
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3e}"
    return str(x)


def write_summary(task: Task, results: list[RunResult], cfg: EvalConfig) -> tuple[str, list[Path]]:
    """Summary table (returned as text) + CSV/JSON beside the runs, and the task's own reports."""
    task_dir = Path(cfg.out) / task.name
    task_dir.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(task, results)
    stem = "__".join(x for x in ("summary", cfg.model_tag, task.label()) if x)
    paths = [task_dir / f"{stem}.json", task_dir / f"{stem}.csv"]
    paths[0].write_text(
        json.dumps([{**row, "dir": str(r.dir)} for row, r in zip(rows, results, strict=True)], indent=2) + "\n"
    )
    if rows:
        with open(paths[1], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    paths += task.report(task_dir, results)
    return format_table(rows), paths
