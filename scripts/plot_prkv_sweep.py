"""Plot PRKV attention recall against the static ratio S (the paper's Figure 3b / 8 sweep).

Reads the collected recall CSV of a harness run (one row per run: length, policy, budget, recall) and draws one
panel per context length with one line per budget over S. The two ends are marked with their baselines: ArkVale at
S = 0 and SnapKV+ (``snapkv:kernel=1:refresh=128:obs=64``, the exact S = 1 end) at S = 1; where only other SnapKV
variants ran (32k in session 6), those are marked at S = 1 instead and labelled by their options.

    python scripts/plot_prkv_sweep.py                       # session-6 defaults
    python scripts/plot_prkv_sweep.py --csv docs/data/gpu_s6_recall__qwen.csv --out docs/figures/x.png
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_S = 0.25  # PRKVPolicy.static_ratio default: a bare "prkv" row is S = 0.25
SNAPKV_PLUS = "snapkv:kernel=1:refresh=128:obs=64"
OTHER_ENDS = {
    "snapkv:refresh=128": "snapkv:refresh=128 (kernel 7, obs 32)",
    "snapkv": "snapkv (prefill only, kernel 7, keeps decoded tokens)",
}


def static_ratio(policy: str) -> float | None:
    """S of a PRKV policy string ("prkv" or "prkv:static_ratio=x"), None for anything else or other options."""
    name, *opts = policy.split(":")
    if name != "prkv":
        return None
    if not opts:
        return DEFAULT_S
    if len(opts) == 1 and opts[0].startswith("static_ratio="):
        value = opts[0].split("=", 1)[1]
        return None if value == "auto" else float(value)
    return None  # other options (kernel, refresh, ...) are not part of the plain sweep


def load(path: Path):
    """{length: {budget: {S: recall}}} and {length: {budget: {end policy: recall}}}."""
    sweep = defaultdict(lambda: defaultdict(dict))
    ends = defaultdict(lambda: defaultdict(dict))
    with path.open() as f:
        for row in csv.DictReader(f):
            if not row["budget"]:
                continue  # full attention
            length, budget, recall = int(row["length"]), int(row["budget"]), float(row["recall"])
            s = static_ratio(row["policy"])
            if s is not None:
                if s in sweep[length][budget] and abs(sweep[length][budget][s] - recall) > 1e-12:
                    raise ValueError(f"two different recalls for S = {s} at {length} / {budget}")
                sweep[length][budget][s] = recall
            elif row["policy"] in ("arkvale", SNAPKV_PLUS, *OTHER_ENDS):
                ends[length][budget][row["policy"]] = recall
    if not sweep:
        raise ValueError(f"no prkv rows in {path}")
    return sweep, ends


def plot(sweep, ends, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(sweep)
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.6 * len(lengths), 4.2), squeeze=False, sharey=True)
    cmap = matplotlib.colormaps["viridis"]
    all_budgets = sorted({b for per in sweep.values() for b in per})
    colour = {b: cmap(i / max(1, len(all_budgets) - 1) * 0.85) for i, b in enumerate(all_budgets)}
    from matplotlib.lines import Line2D

    # marker, filled?, x position of each end baseline (offset a little when several sit at S = 1)
    end_style = {
        "arkvale": ("s", False, 0.0, "arkvale (the S = 0 end)"),
        SNAPKV_PLUS: ("^", False, 1.0, f"{SNAPKV_PLUS} (SnapKV+, the S = 1 end)"),
        "snapkv:refresh=128": ("x", True, 1.04, OTHER_ENDS["snapkv:refresh=128"]),
        "snapkv": ("+", True, 1.08, OTHER_ENDS["snapkv"]),
    }
    seen_ends = set()
    handles = []
    for ax, length in zip(axes[0], lengths, strict=True):
        for budget in sorted(sweep[length]):
            pts = sorted(sweep[length][budget].items())
            c = colour[budget]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c)
            best = max(pts, key=lambda p: p[1])
            ax.plot([best[0]], [best[1]], "o", ms=12, mfc="none", mec=c, mew=1.2)
            for pol, r in ends[length][budget].items():
                marker, filled, x, _ = end_style[pol]
                ax.plot(
                    [x],
                    [r],
                    linestyle="none",
                    marker=marker,
                    ms=10,
                    mew=1.6,
                    color=c,
                    mfc=c if filled else "none",
                    zorder=3,
                )
                seen_ends.add(pol)
        missing = sorted(
            {x for per in sweep.values() for b in per.values() for x in b}
            - {x for b in sweep[length].values() for x in b}
        )
        if missing:
            ax.text(
                0.02,
                0.97,
                "not run: S = " + ", ".join(f"{x:g}" for x in missing),
                transform=ax.transAxes,
                ha="left",
                va="top",
                fontsize=8,
                color="grey",
            )
        ax.set_title(f"{length // 1024}k context")
        ax.set_xlabel("static ratio S")
        ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("attention recall (teacher-forced)")
    for b in all_budgets:
        handles.append(Line2D([], [], color=colour[b], marker="o", label=f"prkv, budget {b}"))
    handles.append(Line2D([], [], linestyle="none", marker="o", ms=12, mfc="none", mec="black", label="best S"))
    for pol, (marker, filled, _, label) in end_style.items():
        if pol in seen_ends:
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="none",
                    marker=marker,
                    ms=10,
                    mew=1.6,
                    color="black",
                    mfc="black" if filled else "none",
                    label=label,
                )
            )
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", type=Path, default=ROOT / "docs/data/gpu_s6_recall__qwen.csv")
    p.add_argument("--out", type=Path, default=ROOT / "docs/figures/gpu_prkv_s_sweep__qwen.png")
    p.add_argument(
        "--title",
        default="PRKV recall vs S, Qwen2.5-Coder-0.5B bf16, H200, session 6 (1 book sample, "
        "32 teacher-forced steps, every 4th; page 16, sink 16, window 32)",
    )
    a = p.parse_args(argv)
    sweep, ends = load(a.csv)
    plot(sweep, ends, a.out, a.title)
    print(a.out)


if __name__ == "__main__":
    main()
