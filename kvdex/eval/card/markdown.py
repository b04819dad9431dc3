"""``scorecard.md`` and ``scorecard.png`` from a scorecard report (:func:`report.write`)."""

from __future__ import annotations

from pathlib import Path

MAIN = ("retrieval", "passkey", "recall", "ppl", "longbench")
MARK = {"better": " ▲", "worse": " ▼", "": ""}


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _columns(report: dict, tasks) -> list[tuple[str, int]]:
    have = {(c["task"], c["length"]) for c in report["cells"]}
    lengths = report["settings"]["lengths"]
    return [(t, n) for t in tasks for n in lengths if (t, n) in have]


def _partial(c: dict) -> str:
    p = c.get("partial")
    return f" (partial: {c['n']}/{p['of']})" if p else ""


def _fmt(c: dict | None) -> str:
    if c is None:
        return "missing"
    if c["ratio"] is None:
        return "n/a (full 0)" + _partial(c)
    if c["low"] is None:
        return f"{c['ratio']:.2f}" + _partial(c)
    return f"{c['ratio']:.2f} [{c['low']:.2f}, {c['high']:.2f}]{MARK[c['mark']]}" + _partial(c)


def _abs(c: dict | None) -> str:
    if c is None or c["full"] is None:
        return "missing"
    v = f"{c['full']:.1f}" if c["task"] == "ppl" or c["task"].startswith("tokens") else f"{c['full']:.3f}"
    return v + _partial(c)


def _table(report: dict, cols, speed_cols, speed_note) -> list[str]:
    by = {}
    for c in report["cells"]:
        by[(c["policy"], c["budget"], c["task"], c["length"])] = c
    head = (
        ["policy", "budget"]
        + [f"{t} {_k(n)}" for t, n in cols]
        + [f"{t.replace('tokens_per_s_', 'tok/s ')} {_k(n)}" for t, n in speed_cols]
    )
    if speed_note:
        head.append("tok/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full_row = ["full (absolute)", "-"] + [_abs(by.get(("full", None, t, n))) for t, n in cols + speed_cols]
    lines.append("| " + " | ".join(full_row + ([speed_note] if speed_note else [])) + " |")
    for policy, budget in report["pairs"]:
        if policy == "full":
            continue
        row = [policy, str(budget)] + [_fmt(by.get((policy, budget, t, n))) for t, n in cols + speed_cols]
        lines.append("| " + " | ".join(row + ([speed_note] if speed_note else [])) + " |")
    return lines


def _against(report: dict) -> list[str]:
    """The paired comparisons of ``report["against"]``: rows (policy, budget), columns (task, length)."""
    cells = report["against"]
    lengths = report["settings"]["lengths"]
    cols = [(t, n) for t in MAIN for n in lengths if any(c["task"] == t and c["length"] == n for c in cells)]
    by = {(c["policy"], c["budget"], c["against"], c["task"], c["length"]): c for c in cells}
    rows = list(dict.fromkeys((c["policy"], c["budget"], c["against"]) for c in cells))
    head = ["policy", "budget", "against"] + [f"{t} {_k(n)}" for t, n in cols]
    lines = [
        "Each cell: the policy's score as a ratio to the base's (the same spec without the option, or the named "
        "spec), over the prompts both decoded [paired 95% bootstrap interval].",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for policy, budget, base in rows:
        row = [policy, str(budget), base] + [_fmt(by.get((policy, budget, base, t, n))) for t, n in cols]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def render(report: dict, speed_note: str | None) -> str:
    env = report["environment"]
    s = report["settings"]
    out = [f"# kvdex scorecard: {report['model']}", ""]
    out.append(f"`{' '.join(report['command'])}`" if report["command"] else "")
    out += [
        "",
        f"device {report['device']}, {report['dtype']}; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}, kvdex {env.get('kvdex')}, commit {env.get('git_commit', '?')}"
        + (" (uncommitted changes)" if env.get("git_dirty") else "")
        + f"; seed {s['seed']}, batch {s['batch']}; written {report['written']}",
        "",
        "Each cell: the policy's score over the same prompts as `full`, as a ratio to `full` "
        "[paired 95% bootstrap interval]; ▲ / ▼: the interval lies above / below 1 (for ppl the ratio is "
        "of perplexities, so above 1 is worse and marked ▼). First row: `full`'s absolute scores "
        "(accuracy in [0, 1], recall, perplexity, tokens/s).",
        "",
    ]
    if not report["complete"]:
        out += [
            f"**Incomplete**: {report['slots_done']} of {report['slots_total']} (task, length, policy) slots "
            f"finished{'; stopped: ' + report['stopped'] if report['stopped'] else ''}."
            + (
                " A cell marked `(partial: n/N)` covers the n of its N prompts that both the policy and `full` "
                "have decoded so far; run the same command again to finish it."
                if any(c.get("partial") for c in report["cells"])
                else ""
            ),
            "",
        ]
    cols = _columns(report, MAIN)
    speed_cols = _columns(report, sorted({c["task"] for c in report["cells"] if c["task"].startswith("tokens")}))
    out += _table(report, cols, speed_cols, speed_note)
    subs = sorted({c["task"] for c in report["cells"] if c["task"].startswith("retrieval/")})
    if subs:
        for n in s["lengths"]:
            sub_cols = [(t, n) for t in subs if any(c["task"] == t and c["length"] == n for c in report["cells"])]
            if sub_cols:
                out += ["", f"## Retrieval by subtask, {_k(n)} tokens", ""] + _table(report, sub_cols, [], None)
    if report.get("against"):
        out += ["", "## Paired against a base spec", ""] + _against(report)
    if report["notes"] or report["failures"]:
        out += ["", "## Notes", ""] + [f"- {x}" for x in report["notes"]]
        out += [
            f"- failed: {f['policy']}@{f['budget']} {f['task']} L={f['length']}: {f['error']}"
            for f in report["failures"]
        ]
    out += ["", f"Compute time of all cells: {report['compute_s'] / 60:.1f} min.", ""]
    return "\n".join(out)


def heatmap(report: dict, path: Path) -> Path | None:
    """Rows policy x budget, columns task x length; colour = ratio to full (ppl inverted: greener is better)."""
    from kvdex.eval.plots import _pyplot

    cols = _columns(report, MAIN) + _columns(
        report, sorted({c["task"] for c in report["cells"] if c["task"].startswith("tokens")})
    )
    pairs = [(p, b) for p, b in report["pairs"] if p != "full"]
    if not cols or not pairs:
        return None
    plt = _pyplot()
    if plt is None:
        return None
    import numpy as np

    by = {(c["policy"], c["budget"], c["task"], c["length"]): c for c in report["cells"]}
    grid = np.full((len(pairs), len(cols)), np.nan)
    text = [["" for _ in cols] for _ in pairs]
    for i, (p, b) in enumerate(pairs):
        for j, (t, n) in enumerate(cols):
            c = by.get((p, b, t, n))
            if c is not None and c["ratio"] is not None:
                grid[i, j] = 1 / c["ratio"] if t == "ppl" else c["ratio"]
                text[i][j] = f"{c['ratio']:.2f}" + {"better": "+", "worse": "-", "": ""}[c["mark"]]
                text[i][j] += "*" if c.get("partial") else ""
    fig, ax = plt.subplots(figsize=(4.0 + 0.9 * len(cols), 1.5 + 0.35 * len(pairs)))  # room for row labels
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.2, aspect="auto")
    for i in range(len(pairs)):
        for j in range(len(cols)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), [f"{t.replace('tokens_per_s_', 'tok/s ')}\n{_k(n)}" for t, n in cols], fontsize=7)
    ax.set_yticks(range(len(pairs)), [f"{p} @{b}" for p, b in pairs], fontsize=7)
    star = ", *: partial" if any(c.get("partial") for c in report["cells"]) else ""
    ax.set_title(f"kvdex scorecard, {report['model']}\nratio to full (+/-: decidedly better/worse{star})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
