"""Collect finished eval runs from several result folders (e.g. one per GPU lane) into one CSV per task,
and re-draw the recall plots over the merged runs.

    python scripts/collect_results.py OUT_PREFIX RESULTS_DIR [RESULTS_DIR ...] [--plots FIG_DIR]

Every ``metrics.json`` under the folders is one row of ``OUT_PREFIX_<task>[_<version>].csv`` (scalar
metrics only; run folder, length, policy and budget first). A run that appears in several folders
(``full`` is re-run by every lane) keeps its first copy; the others are listed on stderr so that a
difference between two copies of the same run is seen, not hidden. With ``--plots``, the recall runs
are drawn with :func:`kvdex.eval.plots.recall_plots` (recall vs budget, recall over decode steps).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

from kvdex.eval.runner import RunResult

FIRST = ("run", "length", "policy", "budget", "samples")


def load(dirs: list[Path]) -> dict[str, list[RunResult]]:
    by_task: dict[str, list[RunResult]] = defaultdict(list)
    seen: dict[str, dict] = {}
    for root in dirs:
        for mfile in sorted(root.rglob("metrics.json")):
            run = mfile.parent
            cfg = json.loads((run / "config.json").read_text())
            m = json.loads(mfile.read_text())
            if run.name in seen:
                other = seen[run.name]
                same = other.get("score") == m.get("score")
                print(f"duplicate {run.name} in {root}: score {m.get('score')} ({'same' if same else 'DIFFERS'})",
                      file=sys.stderr)
                continue
            seen[run.name] = m
            key = cfg["task"]
            version = (cfg.get("task_options") or {}).get("version")
            if version:
                key += f"_{version}"
            mode = (cfg.get("task_options") or {}).get("mode")
            if mode and mode != "teacher":
                key += f"_{mode}"
            by_task[key].append(RunResult(cfg["task"], cfg["model"], cfg["length"], cfg["policy"], cfg["budget"], run, m))
    return by_task


def write_csv(path: Path, results: list[RunResult]) -> None:
    rows = []
    for r in results:
        row = {"run": r.dir.name, "length": r.length, "policy": r.policy, "budget": r.budget}
        row.update({k: v for k, v in r.metrics.items() if isinstance(v, (int, float, str)) and k not in row})
        row.pop("task", None)
        row.pop("model", None)
        rows.append(row)
    cols = list(FIRST) + sorted({k for row in rows for k in row} - set(FIRST), key=lambda k: (k in ("score", "ratio_to_full"), k))
    rows.sort(key=lambda row: (row["length"], row["policy"], row["budget"] or 0))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} ({len(rows)} runs)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix", help="output CSV prefix, e.g. docs/data/gpu_s7")
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--plots", type=Path, help="folder for the merged recall plots")
    ap.add_argument("--label", default="merged", help="label in the plot titles and file names")
    args = ap.parse_args(argv)
    by_task = load(args.dirs)
    for key, results in sorted(by_task.items()):
        write_csv(Path(f"{args.prefix}_{key}.csv"), results)
        if args.plots and key.startswith("recall"):
            from kvdex.eval import plots

            args.plots.mkdir(parents=True, exist_ok=True)
            for p in plots.recall_plots(args.plots, results, f"{args.label}_{key}"):
                print(f"wrote {p}")


if __name__ == "__main__":
    main()
