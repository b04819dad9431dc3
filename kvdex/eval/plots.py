"""PNG plots of evaluation results (matplotlib, the ``plot`` extra; skipped with a note without it)."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install 'kvdex[plot]'): no plots written", stacklevel=3)
        return None
    return plt


_MARKERS = "osD^vP*Xh<>p"


def _style(i: int) -> dict:
    """A distinct colour and marker per series (more policies than the default 10-colour cycle)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {"color": cmap(i % 20), "marker": _MARKERS[i % len(_MARKERS)]}


def recall_plots(task_dir: Path, results, label: str) -> list[Path]:
    """recall vs budget per policy (one panel per length), and recall over decoding steps."""
    plt = _pyplot()
    if plt is None or not results:
        return []
    paths = []
    lengths = sorted({r.length for r in results})
    model = results[0].model

    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        by_policy = defaultdict(list)
        for r in results:
            if r.length == length and r.budget is not None:
                by_policy[r.policy].append((r.budget, r.metrics["recall"], r.metrics.get("ceiling")))
        ceiling = defaultdict(list)
        for i, (policy, pts) in enumerate(sorted(by_policy.items())):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=policy, **_style(i))
            for b, _, c in pts:
                ceiling[b].append(c)
        if ceiling:
            bs = sorted(ceiling)
            ax.plot(bs, [max(ceiling[b]) for b in bs], ls="--", c="grey", label="top-k per query head")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per kv head)")
        ax.set_ylabel("attention recall")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{model}, context {length}, {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(by_policy) > 8 else 1)
    fig.tight_layout()
    paths.append(task_dir / f"recall_vs_budget__{model}__{label}.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    budgets = sorted({r.budget for r in results if r.budget is not None})
    if not budgets:
        return paths
    single = len(lengths) == len(budgets) == 1  # one long drift run: a larger panel, legend beside it
    size = (9, 4.5) if single else (4.5 * len(budgets), 3.5 * len(lengths))
    fig, axes = plt.subplots(len(lengths), len(budgets), figsize=size, squeeze=False)
    colour = {p: _style(k)["color"] for k, p in enumerate(sorted({r.policy for r in results}))}
    for i, length in enumerate(lengths):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            for r in results:
                if r.length == length and r.budget == budget:
                    steps, vals = _curve(r)
                    ax.plot(steps, vals, label=r.policy, lw=1, color=colour[r.policy])
            ax.set_title(f"context {length}, budget {budget}", fontsize=9)
            ax.set_xlabel("decode step")
            ax.set_ylabel("recall")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if single:
                ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
            else:
                ax.legend(fontsize=7)
    fig.suptitle(f"{model}: recall over decoding steps ({label})")
    fig.tight_layout()
    paths.append(task_dir / f"recall_over_steps__{model}__{label}.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _curve(result) -> tuple[list[int], list[float]]:
    """Mean recall per decode step over samples and measured layers (smoothed when long)."""
    per_step = result.metrics.get("per_step") or {}
    steps = [int(s) for s in per_step]
    vals = np.array(list(per_step.values()), dtype=float)
    if len(vals) > 200:  # moving average over ~1% of the steps so drift is visible through noise
        w = max(1, len(vals) // 100)
        vals = np.convolve(vals, np.ones(w) / w, mode="same")
    return steps, vals.tolist()


def heatmap(
    path: Path, matrix: np.ndarray, rows: list, cols: list, title: str, row_label: str, col_label: str
) -> Path | None:
    """A [rows, cols] accuracy heatmap in [0, 1] (IceCache Fig. 6 style: green good, red bad)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 + 0.9 * len(cols)), 1.6 + 0.25 * len(rows)))
    im = ax.imshow(matrix, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
