"""Output of ``kvdex bench``: a printed table, the JSON record and a PNG of ms/token vs context."""

from __future__ import annotations

import json
from pathlib import Path


def fmt(v, spec: str) -> str:
    """``v`` formatted by ``spec``, ``-`` for None (a table cell)."""
    return "-" if v is None else format(v, spec)


def ctx(n: int) -> str:
    """A context length as a label: ``131072`` -> ``128k``."""
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def _vs_full(result: dict, row: dict) -> float | None:
    """``row``'s tokens per second over dense ``full``'s at the same context and batch, with the same
    storage and decode path (``quest/device+graph`` is compared with ``full/device+graph``)."""
    policy = row["method"].split("/", 1)[0]
    if "/" not in row["method"] or policy.startswith("hf"):
        return None
    ref = "full" + row["method"][len(policy) :]
    for r in result.get("results", []):
        if r["status"] == "ok" and (r["method"], r["context"], r["batch"]) == (ref, row["context"], row["batch"]):
            return row["tokens_per_s"] / r["tokens_per_s"]
    return None


def table(result: dict) -> str:
    """One row per (context, batch, method): speed, memory, transfer and the split of a step.

    The headline is tokens per second over every timed step (index updates included) and its ratio
    to dense ``full`` at the same context, batch and storage; the median, p90 and mean ms per token
    stand beside it (a mean far above the median means some steps are much slower than the rest).
    ``eager``: CUDA-graph methods, the timed steps that ran eagerly instead of replaying a graph.
    Rows of ``--kv random`` runs (a cache filled with random keys / values, no prefill) give decode
    figures only: their ``prefill s`` and ``peak GB`` are ``-`` (those come from ``--kv prompt`` runs)
    and a note under the table says so."""
    head = (
        f"{'method':<26} {'ctx':>5} {'b':>2} {'tok/s':>9} {'x full':>6} {'ms med':>8} {'p90':>8} {'mean':>8} "
        f"{'prefill s':>9} "
        f"{'peak GB':>7} {'dec GB':>7} {'host GB':>7} {'H2D MB/step':>11} {'sel/xfer/attn/rest %':>22} "
        f"{'reuse':>5} {'pc hit':>6} {'eager':>5}"
    )
    lines = [head, "-" * len(head)]
    filled = False
    for r in result.get("results", []):
        lead = f"{r['method']:<26} {ctx(r['context']):>5} {r['batch']:>2}"
        if r["status"] != "ok":
            lines.append(f"{lead} {r['status']}: {r.get('error', '')[:80]}")
            continue
        sp = r.get("split")
        split = "-"
        if sp:
            split = "/".join(
                fmt(None if sp[f"{k}_frac"] is None else 100 * sp[f"{k}_frac"], ".0f")
                for k in ("selection", "transfer", "attention", "rest")
            )
        host = r.get("kv_host_gb")
        random_kv = r.get("kv") == "random"  # no prefill ran: no prefill time, no whole-method peak
        filled = filled or random_kv
        lines.append(
            f"{lead} {r['tokens_per_s']:>9.1f} {fmt(_vs_full(result, r), '.2f'):>6} {r['ms_median']:>8.2f} "
            f"{r['ms_p90']:>8.2f} {fmt(r.get('ms_mean'), '.2f'):>8} {fmt(r.get('prefill_s'), '.2f'):>9} "
            f"{fmt(None if random_kv else r.get('peak_device_gb'), '.1f'):>7} "
            f"{fmt(r.get('decode_peak_device_gb'), '.1f'):>7} "
            f"{fmt(host, '.1f'):>7} {r['h2d_bytes_per_step'] / 1e6:>11.1f} {split:>22} "
            f"{fmt(sp.get('page_reuse') if sp else None, '.2f'):>5} {fmt(r.get('page_cache_hit_rate'), '.3f'):>6} "
            f"{fmt(r.get('eager_steps'), 'd'):>5}"
        )
    if filled:
        lines.append(
            "--kv random: caches filled with random keys/values of the context (no prefill; fill_s and "
            "fill_peak_device_gb in bench.json); decode figures only, prefill time and peak come from --kv prompt runs"
        )
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def plot(result: dict, path: Path) -> bool:
    """ms/token (median) vs context length, one line per method, one panel per batch size.
    Returns False when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result.get("results", []) if r["status"] == "ok"]
    if not rows:
        return False
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["context"], r["ms_median"]) for r in rows if r["batch"] == b and r["method"] == m)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms / token (median)")
        kv = ", random KV" if result["config"].get("kv") == "random" else ""
        ax.set_title(f"{result['config']['shape']}, batch {b}, budget {result['config']['budget']}{kv}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
