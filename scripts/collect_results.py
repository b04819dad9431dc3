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
                diff = sorted(k for k, v in _scalars(m).items() if _scalars(seen[run.name]).get(k) != v)
                print(
                    f"duplicate {run.name} ({mfile}): " + (f"DIFFERS in {diff}" if diff else "identical metrics"),
                    file=sys.stderr,
                )
                continue
            seen[run.name] = m
            key = cfg["task"]
            version = (cfg.get("task_options") or {}).get("version")
            if version:
                key += f"_{version}"
            mode = (cfg.get("task_options") or {}).get("mode")
            if mode and mode != "teacher":
                key += f"_{mode}"
            by_task[key].append(
                RunResult(cfg["task"], cfg["model"], cfg["length"], cfg["policy"], cfg["budget"], run, m)
            )
    return by_task


def _scalars(m: dict) -> dict:
    return {k: v for k, v in m.items() if isinstance(v, (int, float, str))}


def write_csv(path: Path, results: list[RunResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in results:
        row = {"run": r.dir.name, "length": r.length, "policy": r.policy, "budget": r.budget}
        row.update({k: v for k, v in _scalars(r.metrics).items() if k not in row})
        row.pop("task", None)
        row.pop("model", None)
        rows.append(row)
    cols = list(FIRST) + sorted(
        {k for row in rows for k in row} - set(FIRST), key=lambda k: (k in ("score", "ratio_to_full"), k)
    )
    rows.sort(key=lambda row: (row["length"], row["policy"], row["budget"] or 0))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} ({len(rows)} runs)")


PHASES = ((0, 512), (512, 2048), (2048, 1 << 30))


def write_phases(path: Path, results: list[RunResult]) -> None:
    """Mean recall over phases of a long decode (first 512 steps, to 2048, after), and as a share of
    ``oracle``'s recall in the same phase (how much of the budget's best the policy keeps as it goes)."""
    import numpy as np

    def phases(r: RunResult) -> list[float]:
        per_step = {int(k): v for k, v in (r.metrics.get("per_step") or {}).items()}
        steps = np.array(sorted(per_step))
        vals = np.array([per_step[s] for s in steps])
        return [float(vals[(steps >= a) & (steps < b)].mean()) for a, b in PHASES]

    ref = {(r.length, r.budget): phases(r) for r in results if r.policy == "oracle"}
    names = [f"{a}-{b if b < 1 << 30 else 'end'}" for a, b in PHASES]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["length", "policy", "budget", "recall", *names, *(f"{n}_vs_oracle" for n in names)])
        for r in sorted(results, key=lambda r: -r.metrics["recall"]):
            if r.budget is None:
                continue
            ph, o = phases(r), ref.get((r.length, r.budget))
            w.writerow(
                [
                    r.length,
                    r.policy,
                    r.budget,
                    round(r.metrics["recall"], 4),
                    *(round(x, 4) for x in ph),
                    *((round(x / y, 3) for x, y in zip(ph, o, strict=True)) if o else [""] * len(ph)),
                ]
            )
    print(f"wrote {path}")


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
        if key == "recall_free":
            write_phases(Path(f"{args.prefix}_{key}_phases.csv"), results)
        if args.plots and key.startswith("recall"):
            from kvdex.eval import plots

            args.plots.mkdir(parents=True, exist_ok=True)
            for p in plots.recall_plots(args.plots, results, f"{args.label}_{key}"):
                print(f"wrote {p}")


if __name__ == "__main__":
    main()
