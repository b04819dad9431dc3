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
eager elsewhere): each fork gets its own :class:`kvdex.integration.graph.GraphDecoder`, dropped with
the fork. Graph replay runs the same kernels as an eager step under static sizing, which equals the
eager (dynamic) result up to float rounding, so the mode is not part of a run's identity; every
prediction record says how it was decoded (``decode``, ``decode_steps``, ``decode_reason``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvdex.config import DEFAULT_DENSE_LAYERS, DEFAULT_PAGE_SIZE, DEFAULT_SINK, DEFAULT_WINDOW
from kvdex.integration.compat import cache_kwargs

FULL = "full"
DECODE_MODES = ("auto", "eager", "graph")


# ---- what a task provides --------------------------------------------------------------------------


@dataclass
class Sample:
    """One prompt. ``input_ids``: the prompt's token ids; ``meta``: what the task needs to score it."""

    id: str
    input_ids: list[int]
    meta: dict = field(default_factory=dict)


@dataclass
class DecodeContext:
    """What a task's ``decode`` gets: the model, a fresh forked cache, and the prefill's last logits."""

    model: Any
    tokenizer: Any
    cache: Any
    first_logits: torch.Tensor  # [vocab] fp32, the dense prefill's prediction of the first new token
    prompt_len: int
    progress: bool = False
    decode: str = "eager"  # "eager" or "graph" (resolved: see resolve_decode)
    _decoder: Any = field(default=None, repr=False)  # the fork's GraphDecoder, made at the first step
    _eager_why: str | None = field(default=None, repr=False)  # why steps run eagerly although graph was asked
    # steps of closed decoders and of forward_token, capture seconds; why a decoder ran no graphs
    _counts: dict = field(default_factory=lambda: {"eager": 0, "captures": 0, "replays": 0}, repr=False)
    _capture_s: float = field(default=0.0, repr=False)
    _graph_why: str | None = field(default=None, repr=False)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token through the fork; returns the next-token logits [vocab] (fp32, a fresh tensor).

        ``decode == "graph"``: through the fork's :class:`~kvdex.integration.graph.GraphDecoder` (which
        replays CUDA graphs where it can and runs the other steps eagerly, e.g. page boundaries, or all
        of them where the policy / store cannot be captured or there is no CUDA device). While an
        observer is attached to the cache, or after :meth:`force_eager`, steps run eagerly here.
        """
        if self.decode != "graph" or self._eager_why is not None or self.cache.observer is not None:
            if self.decode == "graph" and self._eager_why is None:
                self._eager_why = "an observer is attached to the cache"
            self._counts["eager"] += 1
            return forward_token(self.model, self.cache, token)
        if self._decoder is None:
            from kvdex.integration.graph import GraphDecoder

            self._decoder = GraphDecoder(self.model, self.cache, 1, warn=False)
        dec = self._decoder
        captures = dec.counts["captures"]
        t0 = time.perf_counter()
        ids = torch.tensor([[token]], device=self.model.device)
        logits = dec.step(ids)[0].to(torch.float32, copy=True)  # a replay rewrites its output buffer
        if dec.counts["captures"] != captures:
            torch.cuda.synchronize(dec.device)
            self._capture_s += time.perf_counter() - t0
        return logits

    def force_eager(self, why: str) -> None:
        """Run every later step eagerly (e.g. a per-step hook that looks at the cache between steps)."""
        if self.decode == "graph" and self._eager_why is None:
            self._eager_why = why

    def close(self) -> dict:
        """Drop the fork's graph decoder (its graphs and memory pool); returns how the decode ran, for
        the prediction record: ``decode`` ("graph" where at least one step replayed a CUDA graph, else
        "eager"), and where graphs were asked for, ``decode_steps`` (eager steps, captures, replays,
        capture seconds) and ``decode_reason`` (why steps ran eagerly; None where nothing stopped
        replay)."""
        if self.decode != "graph":
            return {"decode": "eager"}
        dec, self._decoder = self._decoder, None
        if dec is not None:
            for k in self._counts:
                self._counts[k] += dec.counts[k]
            self._graph_why = self._graph_why or dec.reason
            dec.graph = dec.logits = None  # the graphs and their pool go now, whoever still holds dec
        counts = dict(self._counts)
        why = self._eager_why or self._graph_why
        if why is None and counts["replays"] == 0:
            why = f"too few steps to capture ({counts['eager']} eager)"
        counts["capture_s"] = round(self._capture_s, 4)
        return {
            "decode": "graph" if counts["replays"] else "eager",
            "decode_steps": counts,
            "decode_reason": why,
        }


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


# ---- decoding helpers ------------------------------------------------------------------------------


def forward_token(model, cache, token: int) -> torch.Tensor:
    """Feed one token through the cache; returns the next-token logits [vocab] (fp32)."""
    ids = torch.tensor([[token]], device=model.device)
    return model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[0, -1].float()


def greedy(ctx: DecodeContext, max_new_tokens: int, stop_ids=(), before_step=None) -> list[int]:
    """Greedy decoding; the first token comes from the prefill logits. Stops after a stop id.

    ``before_step(i)`` is called before decode step ``i`` (1-based; step i feeds token ``i - 1``).
    """
    out = [int(ctx.first_logits.argmax())]
    stop = set(stop_ids)
    if before_step is not None:
        ctx.force_eager("a before_step hook runs between steps")
    while len(out) < max_new_tokens and out[-1] not in stop:
        if before_step is not None:
            before_step(len(out))
        out.append(int(ctx.step(out[-1]).argmax()))
    return out


def teacher_forced(ctx: DecodeContext, tokens: list[int], before_step=None) -> list[float]:
    """Feed ``tokens[:-1]`` one at a time; returns the NLL (nats) of each of ``tokens[1:]``.

    ``tokens[0]`` is the text's true next token after the prompt (predicted by the dense prefill,
    so it is not scored: every scored token is predicted by a decode step through the policy).
    """
    nll = []
    if before_step is not None:
        ctx.force_eager("a before_step hook runs between steps")
    for i in range(len(tokens) - 1):
        if before_step is not None:
            before_step(i + 1)
        logits = ctx.step(tokens[i])
        nll.append(float(torch.log_softmax(logits, -1)[tokens[i + 1]].neg()))
    return nll


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """EOS ids of the tokenizer and of the model's generation config."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


# ---- runs and their folders ------------------------------------------------------------------------


@dataclass
class EvalConfig:
    """What an invocation evaluates. ``model_tag`` names the model in folders and tables."""

    model_tag: str
    policies: list[str]
    budgets: list[int]
    lengths: list[int]
    samples: int = 1
    out: str = "results"
    seed: int = 0
    page_size: int = DEFAULT_PAGE_SIZE
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    dense_layers: int = DEFAULT_DENSE_LAYERS
    offload: bool = False
    dtype: str | None = None  # the model's dtype: part of each run's identity (bf16 and fp32 differ)
    progress: bool = True
    extra: dict = field(default_factory=dict)  # recorded in config.json (e.g. model path, device)
    # auto / eager / graph: how decode steps run (not part of a run's identity; recorded per prediction)
    decode: str = "auto"

    def __post_init__(self):
        resolve_decode(self.decode, "cpu")  # a bad value: ValueError now

    def cache_kwargs(self) -> dict:
        return dict(
            page_size=self.page_size,
            sink=self.sink,
            window=self.window,
            dense_layers=self.dense_layers,
            offload=self.offload,
        )

    def pairs(self) -> list[tuple[str, int | None]]:
        """(policy, budget) pairs: ``full`` once (budget None), every other policy at every budget."""
        out = [(FULL, None)]
        for p in self.policies:
            if p != FULL:
                out += [(p, b) for b in self.budgets]
        return out


def resolve_decode(mode: str, device) -> str:
    """``auto`` / ``eager`` / ``graph`` -> ``eager`` or ``graph`` for a model on ``device`` (auto: graph
    on CUDA, eager elsewhere). ``graph`` where graphs cannot run (CPU, an uncapturable policy or store)
    still decodes eagerly, through the GraphDecoder's fallback, and the record says why."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    if mode == "auto":
        return "graph" if torch.device(device).type == "cuda" else "eager"
    return mode


@dataclass
class RunResult:
    task: str
    model: str
    length: int
    policy: str
    budget: int | None
    dir: Path
    metrics: dict
    skipped: bool = False

    def records(self) -> list[dict]:
        return _read_predictions(self.dir / "predictions.jsonl")


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
        return {r["sample_id"] for r in _read_predictions(self.dir / "predictions.jsonl")}

    def append(self, record: dict) -> None:
        with open(self.dir / "predictions.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def records(self) -> list[dict]:
        return _read_predictions(self.dir / "predictions.jsonl")

    def write_metrics(self, metrics: dict) -> None:
        tmp = self.dir / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
        tmp.replace(self.dir / "metrics.json")

    def read_metrics(self) -> dict:
        return json.loads((self.dir / "metrics.json").read_text())


def _read_predictions(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by an interrupted run: redo that sample
                break
    return out


def environment() -> dict:
    """Machine and versions, recorded in every config.json."""
    import transformers

    import kvdex

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvdex": kvdex.__version__,
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        root = Path(kvdex.__file__).resolve().parent.parent
        git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=5)
        env["git_commit"] = git("rev-parse", "--short", "HEAD").stdout.strip()
        # uncommitted changes to tracked kvdex files: the commit alone does not describe the code
        env["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no", "--", "kvdex").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return env


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
