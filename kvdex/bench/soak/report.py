"""A soak's results as text: one line per row while it runs (:func:`row_line`) and the closing table
(:func:`table`: per row, the excess growth per step and in total)."""

from __future__ import annotations


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(x) >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"


def row_line(res: dict) -> str:
    """One row's result in a line: steps, ms/step, the excess of device memory, RSS and objects, the verdict."""
    f = res["fits"]
    parts = [f"{res['steps']} steps, {res['ms_per_step']:.2f} ms/step"]
    for key in ("device", "rss"):
        if key in f:
            parts.append(f"{key} {f[key]['excess_per_step']:+.1f} B/step ({_fmt_bytes(f[key]['growth'])} total)")
    if "objects" in f:
        parts.append(f"objects {f['objects']['excess_per_step']:+.3f}/step")
    return ", ".join(parts) + (" ok" if res["ok"] else " NOT FLAT") + (f" [{res['stopped']}]" if res["stopped"] else "")


def table(result: dict) -> str:
    """The result as a fixed-width table: per row, the excess growth per step and in total."""
    head = ["row", "steps", "ms/step", "graphs", "device B/step", "device total", "rss B/step", "rss total",
            "tensors/step", "objects/step", "flat"]  # fmt: skip
    lines = [head]
    for r in result["rows"]:
        if "error" in r:
            lines.append([r["row"], "-", "-", "-", r["error"][:60], "", "", "", "", "", "ERROR"])
            continue
        f = r["fits"]
        per = {k: f"{v['excess_per_step']:+.{3 if k in ('tensors', 'objects') else 1}f}" for k, v in f.items()}
        tot = {k: _fmt_bytes(v["excess_total"]) for k, v in f.items()}
        g = r["graph"]
        graphs = "eager" if g["reason"] else f"{g['replays']}r/{g['captures']}c"
        lines.append([r["row"], str(r["steps"]), f"{r['ms_per_step']:.2f}", graphs, per.get("device", "-"),
                      tot.get("device", "-"), per.get("rss", "-"), tot.get("rss", "-"), per.get("tensors", "-"),
                      per.get("objects", "-"),
                      "yes" if r["ok"] else "NO"])  # fmt: skip
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
