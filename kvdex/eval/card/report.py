"""The scorecard's outputs, rebuilt from the cell files: ``scorecard.json``, ``scorecard.md``, a PNG.

Every reported cell is one (policy, budget, length, task): ``ratio`` to ``full`` over the same
prompts with its paired 95% bootstrap interval ``[low, high]`` (:mod:`kvdex.eval.card.stats`),
``n`` prompts, ``mark`` ("better" / "worse" where the interval excludes 1), the policy's absolute
``score`` and ``full``'s. Tasks: ``retrieval`` (all subtasks pooled, resampled within subtask) and
``retrieval/<subtask>``, ``passkey``, ``recall`` (attention mass kept; ``full`` = 1), ``ppl`` (ratio of
perplexities: above 1 is worse), ``longbench``, and ``tokens_per_s_b<B>`` (speed; no interval).
With ``against``, a policy is also compared with a base spec (:func:`bases`), paired over the prompts both
decoded: an option name makes the base the same spec without it (:func:`without`); a policy spec (a registered
name, with or without options) is the base of every other spec of that policy. ``report["against"]``: cells
with the base spec in ``against`` and its score in ``base``.
A (policy, budget) whose batches are not all finished (or ``full``'s) is reported over the prompts that
both have decoded, marked ``partial`` (with the prompts a complete cell has); one with no such prompt
is left out of that column ("missing").
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvdex.eval.card import stats, tasks
from kvdex.eval.card.config import is_spec
from kvdex.eval.card.plan import cell_name, write_json
from kvdex.eval.runner import environment

SCHEMA = "kvdex-scorecard/1"
LOWER_IS_BETTER = {"ppl"}


def _seed(*key) -> int:
    return int(hashlib.sha1(repr(key).encode()).hexdigest()[:8], 16)


def _records(plan, group, length, policy, budget) -> tuple[list[dict], bool]:
    """The records of every finished batch of one (group, length, policy, budget), and whether every
    batch is finished."""
    cdir = plan.cell_dir(group, length)
    n = plan.prompt_count(group, length)
    if n is None:
        return [], False
    out, complete = [], True
    for bi in range(-(-n // plan.cfg.batch)):
        path = cdir / cell_name(bi, policy, budget)
        if not path.is_file():
            complete = False
            continue
        out += json.loads(path.read_text())["records"]
    return out, complete


def _totals(plan, group, length) -> dict[str, int]:
    """Prompts a complete cell of each column of (group, length) has (the denominator of a partial one)."""
    info = tasks.prompt_info(plan.prompt_file(group, length))
    if info is None:
        return {}
    ids = info[1]
    out = {task: len(ids) for task, _, strat in _columns(group) if not isinstance(strat, tuple)}
    for task, _, strat in _columns(group):
        if isinstance(strat, tuple):  # retrieval prompt ids are "<subtask>-<i>"
            out[task] = sum(i.rpartition("-")[0] == strat[1] for i in ids)
    return out


def _columns(group) -> list[tuple[str, str, object]]:
    """(task name, field, stratum key or None) of the columns a group yields."""
    if group.name == "retrieval":
        cols = [("retrieval", "score", "subtask")]
        return cols + [(f"retrieval/{s}", "score", ("only", s)) for s in group.options["subtasks"]]
    if group.name == "longtext":
        return [("recall", "recall", None), ("ppl", "nll", None)]
    if group.name == "longbench":
        return [("longbench", "score", "dataset")]
    return [(group.name, "score", None)]


def cells(plan, resamples: int) -> tuple[list[dict], int, int]:
    """Every reportable cell; also how many (task, length, pair) slots exist and how many are done.

    A slot whose batches (or ``full``'s) are not all finished still gives a cell over the prompts both
    have decoded, with ``partial = {"of": N}`` (N: the prompts of the complete cell); a cell over all
    of its prompts (every cell of a finished slot, and e.g. a subtask whose batches are all done) has
    ``partial = None`` and is the same as when the slot finishes."""
    out, slots, done = [], 0, 0
    for length in plan.cfg.lengths:
        for g in plan.groups:
            full, full_done = _records(plan, g, length, "full", None)
            totals = _totals(plan, g, length) if full else {}
            for policy, budget in plan.pairs:
                slots += 1
                recs, finished = (full, full_done) if policy == "full" else _records(plan, g, length, policy, budget)
                complete = finished and full_done
                done += complete
                if not recs or not full:
                    continue
                for task, fieldname, strat in _columns(g):
                    c = _cell(task, fieldname, strat, recs, full, policy, budget, length, resamples)
                    if c["n"]:  # a subtask left out at this length (or not reached yet) has no prompts
                        of = totals.get(task, c["n"])
                        c["partial"] = None if complete or c["n"] >= of else {"of": of}
                        out.append(c)
    return out, slots, done


def _cell(task, fieldname, strat, recs, full, policy, budget, length, resamples) -> dict:
    ref = {r["id"]: r for r in full}
    rows = [(r, ref[r["id"]]) for r in recs if r["id"] in ref]
    if isinstance(strat, tuple):  # one subtask only
        rows = [(r, f) for r, f in rows if r.get("subtask") == strat[1]]
        strat = None
    x = np.array([r[fieldname] for r, _ in rows], dtype=float)
    y = np.array([f[fieldname] for _, f in rows], dtype=float)
    labels = None if strat is None else [r.get(strat) for r, _ in rows]
    kind = "exp_diff" if task == "ppl" else "ratio"
    iv = stats.paired_ratio(
        x, y, kind=kind, strata=labels, resamples=resamples, seed=_seed(task, length, policy, budget)
    )
    absolute = (lambda v: float(np.exp(v.mean()))) if task == "ppl" else (lambda v: float(v.mean()))
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    return {
        "policy": policy,
        "budget": budget,
        "length": length,
        "task": task,
        "ratio": r(iv.ratio),
        "low": r(iv.low),
        "high": r(iv.high),
        "n": iv.n,
        "mark": iv.mark(task not in LOWER_IS_BETTER),
        "score": r(absolute(x)) if len(x) else None,
        "full": r(absolute(y)) if len(y) else None,
        "p_exact": None if task in ("ppl", "recall") else r(stats.mcnemar_p(x, y)),
    }


def without(spec: str, option: str) -> str | None:
    """``spec`` (``name:KEY=VALUE:...``) with its ``option=...`` item removed; None when it does not set it."""
    name, *items = spec.split(":")
    kept = [i for i in items if i.partition("=")[0] != option]
    return None if len(kept) == len(items) else ":".join([name, *kept])


def bases(policy: str, against: list[str]) -> list[str]:
    """The specs ``policy`` is compared with: for an option name, ``policy`` without it (when it sets it); for a
    policy spec of the same registered name, that spec (unless it is ``policy`` itself)."""
    out = []
    for entry in against:
        if is_spec(entry):
            if entry != policy and entry.partition(":")[0] == policy.partition(":")[0]:
                out.append(entry)
        elif (base := without(policy, entry)) is not None:
            out.append(base)
    return list(dict.fromkeys(out))


def against_cells(plan, resamples: int) -> list[dict]:
    """Every (policy, budget) against its :func:`bases` at the same budget, paired over the prompts both have
    decoded (the base's cells must exist under the output folder, from this or another invocation); a cell over
    fewer prompts than a complete one is ``partial``."""
    out = []
    for length in plan.cfg.lengths:
        for g in plan.groups:
            totals = _totals(plan, g, length)
            for policy, budget in plan.pairs:
                bases_ = bases(policy, plan.cfg.against)
                recs = _records(plan, g, length, policy, budget)[0] if bases_ else None
                for base in bases_:
                    ref, _ = _records(plan, g, length, base, budget)
                    if not recs or not ref:
                        continue
                    for task, fieldname, strat in _columns(g):
                        c = _cell(task, fieldname, strat, recs, ref, policy, budget, length, resamples)
                        if c["n"]:  # over fewer prompts than a complete cell has: partial, as in cells()
                            c["base"] = c.pop("full")
                            of = totals.get(task, c["n"])
                            out.append({**c, "against": base, "partial": None if c["n"] >= of else {"of": of}})
    return out


def speed_cells(plan) -> list[dict]:
    cfg = plan.cfg
    length = max(cfg.lengths)
    sdir = plan.speed_dir(length)
    out = []
    for b in cfg.speed_batches:
        fpath = sdir / cell_name(b, "full", None)
        full = json.loads(fpath.read_text()) if fpath.is_file() else None
        for policy, budget in plan.pairs:
            path = sdir / cell_name(b, policy, budget)
            if not path.is_file() or full is None:
                continue
            s = json.loads(path.read_text())
            out.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "length": length,
                    "task": f"tokens_per_s_b{b}",
                    "ratio": round(s["tokens_per_s"] / full["tokens_per_s"], 4),
                    "low": None,
                    "high": None,
                    "n": s["steps"] * b,
                    "mark": "",
                    "score": round(s["tokens_per_s"], 2),
                    "full": round(full["tokens_per_s"], 2),
                    "p_exact": None,
                    "partial": None,
                }
            )
    return out


def write(plan, run) -> dict:
    """Write scorecard.json / .md / .png under the output folder from every finished cell."""
    from kvdex.eval.card import markdown

    cfg = plan.cfg
    t0 = time.perf_counter()
    found, slots, done = cells(plan, cfg.resamples)
    found += speed_cells(plan)
    speed_note = None
    if run.model is None:  # report_only: whatever the cells hold
        if not any(c["task"].startswith("tokens_per_s") for c in found):
            speed_note = "n/a (CPU)" if plan.device_name == "cpu" else "not measured"
    elif run.model.device.type != "cuda":
        speed_note = "n/a (CPU)"
    elif not cfg.speed:
        speed_note = "not measured"
    compute = 0.0
    pairs = {(str(p), b) for p, b in plan.pairs}
    for f in plan.out.glob("cells/**/*.json"):
        try:
            c = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (str(c.get("policy")), c.get("budget")) not in pairs or c.get("length") not in cfg.lengths:
            continue  # a cell of the same folder that this table does not show
        charged = c.get("prefill_charged", str(c.get("policy")) == "full")  # the cell that ran its batch's prefill
        compute += c.get("cell_s", 0.0) + (c.get("prefill_s", 0.0) if charged else 0.0)
    prompts, notes = {}, list(plan.notes)
    for g in plan.groups:
        for length in cfg.lengths:
            info = tasks.prompt_info(plan.prompt_file(g, length))
            if info is not None:
                prompts.setdefault(g.name, {})[str(length)] = info[1]
                notes += info[2]
    report = {
        "schema": SCHEMA,
        "model": plan.common["model"],
        "dtype": plan.common["dtype"],
        "device": plan.device_name,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],  # the program by name: no machine paths
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "environment": getattr(run, "environment", None) or environment(),
        "report_environment": environment(),
        "settings": cfg.to_dict(),
        "pairs": [[p, b] for p, b in plan.pairs],
        "seeds": {
            "seed": cfg.seed,
            "retrieval": "random.Random(f'{seed}-{length}-{subtask}-{i}') for prompt i of a subtask",
            "passkey": "random.Random(f'{seed}-{length}-{depth}-{i}').getrandbits(32) picks the key",
            "longtext": "random.Random(f'{seed}-{length}-{i}') picks the place in book i % 8",
            "bootstrap": "sha1 of (task, length, policy, budget); numpy default_rng",
        },
        "prompts": prompts,
        "notes": notes + ([f"speed: {speed_note}"] if speed_note else []),
        "failures": run.failures,
        "complete": done == slots and not run.failures and run.stopped is None,
        "slots_done": done,
        "slots_total": slots,
        "stopped": run.stopped,
        "invocation_wall_s": round(run.clock.elapsed(), 1),
        "compute_s": round(compute, 1),
        "cells": found,
        "against": against_cells(plan, cfg.resamples) if cfg.against else [],
    }
    paths = [plan.out / "scorecard.json", plan.out / "scorecard.md"]
    write_json(paths[0], report)
    paths[1].write_text(markdown.render(report, speed_note))
    png = markdown.heatmap(report, plan.out / "scorecard.png")
    if png is not None:
        paths.append(png)
    report["paths"] = paths
    report["report_s"] = round(time.perf_counter() - t0, 2)
    return report


def table(report: dict) -> dict:
    """{(policy, budget): {(task, length): cell}} of a report (for tests and tools)."""
    out = defaultdict(dict)
    for c in report["cells"]:
        out[(c["policy"], c["budget"])][(c["task"], c["length"])] = c
    return dict(out)
