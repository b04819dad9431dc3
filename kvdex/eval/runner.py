"""Run one task for many (policy, budget) pairs: prefill once per sample, decode per policy.

A *run* is one (task, model, context length, policy, budget) with its settings; it owns a folder
named from them (``<out>/<task>/<task>__<model>__L<len>__<policy>__b<budget>__n<samples>__<hash>``)
holding ``config.json``, ``predictions.jsonl`` (one line per sample, appended as it finishes) and
``metrics.json`` (written last: a run with ``metrics.json`` is finished and is skipped next time;
an unfinished run resumes at the first sample it has no prediction for).

For each sample the prompt is prefilled once into a ``full`` cache; every run that still needs the
sample gets ``cache.fork(policy, budget)`` -- a fresh policy re-indexing the same prefill -- and the
task decodes from it. ``full`` is always run: every metric is reported with its ratio to ``full``.

Decode steps run eagerly or through CUDA graphs (``EvalConfig.decode``: ``auto`` = graphs on CUDA,
eager elsewhere): each fork gets its own :class:`kvdex.hf.graph.GraphDecoder`, dropped with
the fork. Graph replay runs the same kernels as an eager step under static sizing, which equals the
eager (dynamic) result up to float rounding, so the mode is not part of a run's identity; every
prediction record says how it was decoded (``decode``, ``decode_steps``, ``decode_reason``).

Here: what a task provides (:class:`Sample`, :class:`Task`), a run's folder (:class:`Run`) and the loop
(:func:`run_task`). :mod:`kvdex.eval.decoding` holds the decode context and loops tasks use,
:mod:`kvdex.eval.runs` the invocation's settings (:class:`EvalConfig`) and the runs' results.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from kvdex.eval.decoding import DecodeContext, forward_token, greedy, stop_token_ids, teacher_forced
from kvdex.eval.runs import DECODE_MODES, FULL, EvalConfig, RunResult, environment, read_predictions, resolve_decode
from kvdex.hf.compat import cache_kwargs

__all__ = [
    "DECODE_MODES", "FULL", "DecodeContext", "EvalConfig", "Run", "RunResult", "Sample", "Task", "environment",
    "forward_token", "greedy", "prefill", "ratio", "resolve_decode", "run_task", "stop_token_ids", "teacher_forced",
]  # fmt: skip


# ---- what a task provides --------------------------------------------------------------------------


@dataclass
class Sample:
    """One prompt. ``input_ids``: the prompt's token ids; ``meta``: what the task needs to score it."""

    id: str
    input_ids: list[int]
    meta: dict = field(default_factory=dict)


class Task:
    """Base of every evaluation task (one file per family under ``kvdex/eval/tasks``)."""

    name: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    score_name: ClassVar[str] = "score"  # what ``score`` is (the summary table's column name)
    summary_keys: ClassVar[tuple[str, ...]] = ()  # metrics shown in the summary table besides the score

    def options(self) -> dict:
        """Settings that change results: part of each run's identity (folder name hash)."""
        return {}

    def label(self) -> str:
        """A short name of the settings that matter most, for summary and plot file names."""
        return ""

    def policy(self, name: str):
        """The policy (name or instance) a run of ``name`` uses; tasks may substitute an equivalent."""
        return name

    def samples(self, tokenizer, length: int, n: int, seed: int) -> list[Sample]:
        raise NotImplementedError

    def decode(self, ctx: DecodeContext, sample: Sample) -> dict:
        """Decode one sample from ``ctx.cache``; returns its JSON-able prediction record."""
        raise NotImplementedError

    def metrics(self, records: list[dict]) -> dict:
        """Aggregate prediction records; the result must hold ``score``."""
        raise NotImplementedError

    def report(self, task_dir: Path, results: list[RunResult]) -> list[Path]:
        """Task-level files (plots, tables) over all runs of an invocation. Returns the paths written."""
        return []


# ---- a run and its folder ---------------------------------------------------------------------------


class Run:
    """One (task, length, policy, budget) and its folder."""

    def __init__(self, task: Task, cfg: EvalConfig, length: int, policy: str, budget: int | None):
        self.task, self.length, self.policy, self.budget = task, length, policy, budget
        self.identity = {
            "task": task.name,
            "task_options": task.options(),
            "model": cfg.model_tag,
            "length": length,
            "policy": policy,
            "budget": budget,
            "samples": cfg.samples,
            "seed": cfg.seed,
            "cache": cfg.cache_kwargs(),
        }
        if cfg.dtype is not None:
            self.identity["dtype"] = cfg.dtype
        digest = hashlib.sha1(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:8]
        b = "" if budget is None else f"__b{budget}"
        tag = re.sub(r"[^A-Za-z0-9._=:,-]+", "-", policy)  # "name:KEY=VALUE" options may hold paths
        name = f"{task.name}__{cfg.model_tag}__L{length}__{tag}{b}__n{cfg.samples}__{digest}"
        self.dir = Path(cfg.out) / task.name / name
        self.extra = cfg.extra
        self.model = cfg.model_tag

    @property
    def finished(self) -> bool:
        return (self.dir / "metrics.json").is_file()

    def start(self) -> set[str]:
        """Create the folder and config.json; returns the ids of samples already predicted."""
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.dir / "config.json"
        if not cfg_path.is_file():
            cfg = {**self.identity, **self.extra, "environment": environment(), "command": sys.argv}
            cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        return {r["sample_id"] for r in read_predictions(self.dir / "predictions.jsonl")}

    def append(self, record: dict) -> None:
        with open(self.dir / "predictions.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def records(self) -> list[dict]:
        return read_predictions(self.dir / "predictions.jsonl")

    def write_metrics(self, metrics: dict) -> None:
        tmp = self.dir / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
        tmp.replace(self.dir / "metrics.json")

    def read_metrics(self) -> dict:
        return json.loads((self.dir / "metrics.json").read_text())


# ---- the loop ---------------------------------------------------------------------------------------


@torch.inference_mode()
def prefill(model, input_ids: list[int], cache_options: dict):
    """Dense prefill of one prompt into a ``full`` cache; returns (cache, last logits [vocab] fp32)."""
    import kvdex

    kw = dict(cache_options)
    budget = kw.get("sink", 16) + kw.get("window", 32) + kw.get("page_size", 16)  # any valid budget
    cache = kvdex.Cache(model, policy=FULL, budget=budget, **kw)
    ids = torch.tensor([input_ids], device=model.device)
    out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1].float()


def run_task(task: Task, model, tokenizer, cfg: EvalConfig) -> list[RunResult]:
    """Evaluate ``task`` for every (length, policy, budget) of ``cfg``; returns all runs' results."""
    from tqdm.auto import tqdm

    results = []
    for length in cfg.lengths:
        runs = [Run(task, cfg, length, p, b) for p, b in cfg.pairs()]
        done = {id(r): set() for r in runs}
        pending = [r for r in runs if not r.finished]
        for r in pending:
            done[id(r)] = r.start()
        if pending:
            samples = task.samples(tokenizer, length, cfg.samples, cfg.seed)
            bar = tqdm(samples, desc=f"{task.name} L={length}", disable=not cfg.progress, unit="sample")
            for sample in bar:
                todo = [r for r in pending if sample.id not in done[id(r)]]
                if todo:
                    _run_sample(task, model, tokenizer, cfg, sample, todo, bar)
            for r in pending:
                r.write_metrics({**_describe(r), **task.metrics(r.records())})
        results += _with_ratios(task, runs, pending)
    return results


@torch.inference_mode()
def _run_sample(task, model, tokenizer, cfg, sample, runs, bar) -> None:
    mode = resolve_decode(cfg.decode, next(model.parameters()).device)
    t0 = time.perf_counter()
    base, logits = prefill(model, sample.input_ids, cfg.cache_kwargs())
    prefill_s = time.perf_counter() - t0
    for r in runs:
        bar.set_postfix_str(f"{r.policy}" + ("" if r.budget is None else f"@{r.budget}"))
        cache = base.fork(task.policy(r.policy), r.budget)
        ctx = DecodeContext(model, tokenizer, cache, logits, len(sample.input_ids), cfg.progress, decode=mode)
        t0 = time.perf_counter()
        try:
            record = task.decode(ctx, sample)
        finally:
            how = ctx.close()  # drops the fork's CUDA graphs, also when the task fails
        record = {
            "sample_id": sample.id,
            **record,
            "prefill_s": round(prefill_s, 3),
            "decode_s": round(time.perf_counter() - t0, 3),
            **how,
        }
        r.append(record)
        del cache, ctx
        if how["decode"] == "graph":  # free the fork's graph pool before the next fork captures
            gc.collect()
    del base
    gc.collect()


def _describe(run: Run) -> dict:
    return {"task": run.task.name, "model": run.model, "length": run.length, "policy": run.policy, "budget": run.budget}


def _with_ratios(task: Task, runs: list[Run], fresh: list[Run]) -> list[RunResult]:
    """Add each run's ratio to ``full`` (score and summary keys) to its metrics.json."""
    metrics = {id(r): r.read_metrics() for r in runs}
    full = next(metrics[id(r)] for r in runs if r.policy == FULL)
    out = []
    for r in runs:
        m = metrics[id(r)]
        m["ratio_to_full"] = ratio(m.get("score"), full.get("score"))
        m["ratios_to_full"] = {k: ratio(m.get(k), full.get(k)) for k in task.summary_keys}
        r.write_metrics(m)
        out.append(RunResult(task.name, r.model, r.length, r.policy, r.budget, r.dir, m, skipped=r not in fresh))
    return out


def ratio(x, ref) -> float | None:
    if not isinstance(x, (int, float)) or not isinstance(ref, (int, float)) or ref == 0:
        return None
    if math.isnan(x) or math.isnan(ref):
        return None
    return x / ref
