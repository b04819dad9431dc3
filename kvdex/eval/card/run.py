"""Run a scorecard: every (length, task, prompt batch, policy, budget) cell, resumably.

A *cell* is one prompt batch decoded by one (policy, budget) at one length. Each finished cell is
one JSON file under ``<out>/cells/<task>/L<length>__<hash>/`` (the hash covers every setting that
changes its numbers: model, dtype, seed, cache sizes, batch size, the task's options), written
atomically, so a run stopped anywhere (``max_minutes``, ``max_cells``, a killed command) continues
where it stopped and never recomputes a finished cell. ``order="batches"``: a batch is prefilled once
for all its missing cells; ``order="pairs"``: one (policy, budget) runs over every batch before the
next, with a prefill per batch and pair (the same cells, so the same numbers). The report
(:mod:`kvdex.eval.card.report`) is rebuilt from the cell files at the end of every invocation, so an
interrupted and a resumed run give the same table as one run; a (policy, budget) with some batches
left is reported over the prompts decoded so far, marked partial.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import re
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from kvdex.eval import data
from kvdex.eval.card import decode, tasks
from kvdex.eval.card.config import ScorecardConfig
from kvdex.eval.card.plan import Clock, Plan, cell_name, expected_prompts, write_json
from kvdex.eval.runner import resolve_decode, stop_token_ids


def scorecard(config: ScorecardConfig | None = None, *, model=None, tokenizer=None, on_cell=None, **overrides):
    """Measure every (policy, budget) of ``config`` (or ``ScorecardConfig(**overrides)``) and write
    ``scorecard.md``, ``scorecard.json`` and ``scorecard.png`` under ``config.out``. Returns the report
    (the JSON's content plus ``paths``). ``model`` / ``tokenizer``: an already loaded model (kvdex-enabled)
    used instead of loading ``config.model`` (which then only names it). ``on_cell(info)`` is called after
    every computed cell; returning ``False`` stops the run (finished cells are kept)."""
    from kvdex.eval.card import report

    cfg = dataclasses.replace(config, **overrides) if config is not None else ScorecardConfig(**overrides)
    cfg.validate()
    clock = Clock(cfg.max_minutes)
    from kvdex.eval import models

    if cfg.prepare:
        return _prepare(cfg, tokenizer)
    if cfg.report_only:
        return _report_only(cfg)
    if model is None:
        model, tokenizer = models.load(cfg.model, cfg.gguf, device=cfg.device, dtype=cfg.dtype)
        tag = models.tag(cfg.model, cfg.gguf)
    else:
        if tokenizer is None:
            raise ValueError("pass the tokenizer with the model")
        tag = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.model)
    device = next(model.parameters()).device
    graph = resolve_decode(cfg.decode, device) == "graph"
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    root = data.data_root(cfg.data, required=False)
    plan = Plan(cfg, tag, str(model.dtype).removeprefix("torch."), root, dev_name)
    state = _Run(cfg, plan, model, tokenizer, graph, clock, on_cell)
    state.loop()
    out = report.write(plan, state)
    state.say(f"wrote {', '.join(str(p) for p in out['paths'])}" + ("" if out["complete"] else " (incomplete)"))
    return out


def _prepare(cfg: ScorecardConfig, tokenizer) -> dict:
    """Generate and save every prompt file of ``cfg`` (a CPU job: the tokenizer only)."""
    from kvdex.eval import models

    if tokenizer is None:
        from kvdex.hf.loading import load_tokenizer

        tokenizer = load_tokenizer(*models.resolve(cfg.model, cfg.gguf))
    tag = models.tag(cfg.model, cfg.gguf)
    plan = Plan(cfg, tag, "-", data.data_root(cfg.data, required=False), "-")
    for note in plan.notes:
        print(note, flush=True)
    jobs = [(g, n) for n in cfg.lengths for g in plan.groups]
    if cfg.speed:
        jobs.append((plan.speed_group(), max(cfg.lengths)))
    paths = []
    for g, n in jobs:
        t0 = time.perf_counter()
        samples = tasks.load_or_generate(plan.prompt_file(g, n), g, tokenizer, n, cfg.seed, plan.root)
        paths.append(plan.prompt_file(g, n))
        print(f"L={n} {g.name}: {len(samples)} prompts in {time.perf_counter() - t0:.1f}s -> {paths[-1]}", flush=True)
    return {"prepared": paths, "notes": plan.notes}


def _report_only(cfg: ScorecardConfig) -> dict:
    """Write the table of ``cfg`` from the cells already under ``cfg.out``, loading no model. The device named
    is every device the cells were computed on. The dtype (part of each cell's identity) is ``cfg.dtype`` when
    given, else the earlier report's, else the one the folder's cells were computed in."""
    from kvdex.eval import models
    from kvdex.eval.card import report

    out = Path(cfg.out)
    devices, speed, dtype = set(), set(), cfg.dtype
    for f in out.glob("cells/**/*.json"):
        try:
            dev = json.loads(f.read_text()).get("device")
        except (OSError, json.JSONDecodeError):
            continue
        devices.add(dev)
        if f.parent.parent.name == "speed":
            speed.add(dev)
    old, env, dtypes = out / "scorecard.json", None, [] if dtype == "auto" else [dtype]
    if old.is_file():  # the last measuring command's report: its dtype and machine (the cells' versions)
        prev = json.loads(old.read_text())
        dtypes, env = dtypes or [prev.get("dtype")], prev.get("environment")
    if not devices - {None}:
        raise ValueError(f"report_only: no finished cells under {out}; run the scorecard there first")
    name = " + ".join(sorted(devices - {None}))
    tag, root = models.tag(cfg.model, cfg.gguf), data.data_root(cfg.data, required=False)
    plans = [Plan(cfg, tag, d, root, name) for d in dict.fromkeys(dtypes or ["bfloat16", "float16", "float32"])]
    found = [sum(p.cell_dir(g, n).is_dir() for g in p.groups for n in cfg.lengths) for p in plans]
    plan = plans[found.index(max(found))]
    if not max(found):
        raise ValueError(
            f"report_only: no cells under {out} match these settings ({plan.common_batched['dtype']}, cache sizes, "
            "batch, seed, tasks, data folder): give the options of the command that computed them"
        )
    if len(speed - {None}) == 1:  # the speed columns of the one device that timed them
        plan.speed_device = next(iter(speed - {None}))
    state = SimpleNamespace(model=None, failures=[], stopped=None, clock=Clock(None), environment=env)
    return report.write(plan, state)


class _Run:
    def __init__(self, cfg, plan: Plan, model, tokenizer, graph: bool, clock: Clock, on_cell):
        self.cfg, self.plan, self.model, self.tok, self.graph = cfg, plan, model, tokenizer, graph
        self.clock, self.on_cell = clock, on_cell
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.computed = 0
        self.stopped: str | None = None
        self.failures: list[dict] = []
        self.bar = None

    def say(self, msg: str) -> None:
        line = f"[{self.clock.elapsed():7.1f}s] {msg}"
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def _stop(self, why: str) -> bool:
        if self.stopped is None:
            self.stopped = why
            self.say(f"stopping: {why}; run the same command again to continue")
        return True

    def loop(self) -> None:
        from tqdm.auto import tqdm

        plan = self.plan
        units = []  # (group, length, number of prompts)
        for length in self.cfg.lengths:
            for g in plan.groups:
                units.append((g, length, expected_prompts(g)))
        total = sum(math.ceil((n or 0) / self.cfg.batch) * len(plan.pairs) for _, _, n in units)
        done = sum(len(list(plan.cell_dir(g, L).glob("*.json"))) for g, L, _ in units if plan.cell_dir(g, L).is_dir())
        self.bar = tqdm(total=max(total - done, 0), disable=not self.cfg.progress, unit="cell", desc="scorecard")
        for note in plan.notes:
            self.say(note)
        try:
            for g, length, _ in units:
                if self.stopped or not self._group(g, length):
                    break
            if not self.stopped and self.cfg.speed:
                self._speed()
        finally:
            self.bar.close()
            self.bar = None

    def _group(self, g: tasks.Group, length: int) -> bool:
        plan, cfg = self.plan, self.cfg
        cdir = plan.cell_dir(g, length)
        n = plan.prompt_count(g, length)
        if n is not None and all(
            (cdir / cell_name(i, p, b)).is_file() for i in range(math.ceil(n / cfg.batch)) for p, b in plan.pairs
        ):
            return True
        samples = self._prompts(g, length)
        if samples is None:
            return not self._stop("--max-minutes reached (before generating prompts)")
        if n != len(samples):
            self.bar.total += (math.ceil(len(samples) / cfg.batch) - math.ceil((n or 0) / cfg.batch)) * len(plan.pairs)
            self.bar.refresh()
        for note in tasks.prompt_info(plan.prompt_file(g, length))[2]:
            self.say(note)
        failed: set = set()
        batches = plan.batches(len(samples))
        if cfg.order == "pairs":  # one (policy, budget) over every batch, then the next: a prefill each
            schedule = [(bi, [pair]) for pair in plan.pairs for bi in range(len(batches))]
        else:  # a batch prefilled once for every (policy, budget), then the next batch
            schedule = [(bi, plan.pairs) for bi in range(len(batches))]
        for bi, pairs in schedule:
            rows = batches[bi]
            todo = [(p, b) for p, b in pairs if not (cdir / cell_name(bi, p, b)).is_file() and (p, b) not in failed]
            if not todo:
                continue
            key = (g.name, length)
            if not self.clock.allows(key + ("prefill",), key):
                return not self._stop("--max-minutes reached")
            batch = [samples[i] for i in rows]
            try:
                ids = [s.input_ids for s in batch]
                base, logits, pf_s = decode.prefill(self.model, self.tok, ids, plan.cache_options)
            except Exception as e:  # e.g. out of memory: every later batch of this task and length would fail too
                self._failed(g.name, length, bi, "prefill", None, e)
                return True
            self.clock.note(key + ("prefill",), pf_s)
            width = max(len(s.input_ids) for s in batch)
            self.say(f"L={length} {g.name} batch {bi + 1}/{len(batches)}: prefill {len(batch)}x{width} {pf_s:.2f}s")
            charged = False  # the first cell of a prefill carries its time in the report's compute time
            for policy, budget in todo:
                if not self.clock.allows(key):
                    return not self._stop("--max-minutes reached")
                t1 = time.perf_counter()
                try:
                    cell = self._cell(g, batch, base, logits, policy, budget)
                except Exception as e:  # one policy failing must not end the scorecard
                    failed.add((policy, budget))
                    self._failed(g.name, length, bi, policy, budget, e)
                    continue
                dt = time.perf_counter() - t1
                self.clock.note(key, dt)
                cell.update(
                    task=g.name,
                    length=length,
                    batch=bi,
                    policy=policy,
                    budget=budget,
                    prefill_s=round(pf_s, 4),
                    prefill_charged=not charged,
                    cell_s=round(dt, 4),
                    device=plan.device_name,
                )
                write_json(cdir / cell_name(bi, policy, budget), cell)
                charged = True
                self.computed += 1
                self.bar.update(1)
                d = cell["decode"]
                how = f"{d['replays']} replayed, {d['eager']} eager, {d['captures']} captures"
                self.say(
                    f"L={length} {g.name} batch {bi + 1}/{len(batches)} {policy}"
                    + ("" if budget is None else f"@{budget}")
                    + f": {dt:.2f}s, {cell['steps']} steps ({how})"
                    + (f" - eager because {d['reason']}" if self.graph and d["reason"] and d["eager"] > 1 else "")
                )
                if self.on_cell is not None and self.on_cell(cell) is False:
                    return not self._stop("stopped by the on_cell callback")
                if self.cfg.max_cells is not None and self.computed >= self.cfg.max_cells:
                    return not self._stop(f"max_cells={self.cfg.max_cells} reached")
            del base, logits
            _free(self.model)
        return True

    def _failed(self, task, length, batch, policy, budget, e: Exception) -> None:
        why = f"{type(e).__name__}: {e}"
        self.failures.append(
            {"task": task, "length": length, "batch": batch, "policy": policy, "budget": budget, "error": why[:500]}
        )
        self.say(f"FAILED {policy}@{budget} L={length} {task} batch {batch}: {why[:300]}")
        self.say(traceback.format_exc(limit=-3).strip())
        _free(self.model)

    def _prompts(self, g: tasks.Group, length: int):
        """The prompts of (g, length); None where generating them would pass ``max_minutes`` (guessed from
        the seconds per token of this group's earlier lengths)."""
        path = self.plan.prompt_file(g, length)
        if not path.is_file():
            rate = self.clock.seen.get(("prompts", g.name))
            if rate is not None and not self.clock.allows_seconds(1.2 * rate * length):
                return None
        t0 = time.perf_counter()
        fresh = not path.is_file()
        samples = tasks.load_or_generate(path, g, self.tok, length, self.cfg.seed, self.plan.root)
        dt = time.perf_counter() - t0
        if fresh:
            self.clock.note(("prompts", g.name), dt / length)
        self.say(f"L={length} {g.name}: {len(samples)} prompts {'generated' if fresh else 'loaded'} in {dt:.1f}s")
        return samples

    def _cell(self, g: tasks.Group, batch, base, logits, policy, budget) -> dict:
        if g.teacher:
            steps = g.options["recall_steps"]
            cont = torch.tensor([s.meta["continuation"] for s in batch])
            rows, info = decode.teacher(self.model, base, logits, policy, budget, cont, steps, self.graph)
            recs = [
                {"id": s.id, **{k: (None if v is None else round(v[i], 6)) for k, v in rows.items()}}
                for i, s in enumerate(batch)
            ]
        else:
            limits = [s.meta["max_new"] for s in batch]
            toks, info = decode.greedy(self.model, base, logits, policy, budget, limits, self.stop_ids, self.graph)
            recs = []
            for s, t in zip(batch, toks, strict=True):
                pred = self.tok.decode(t, skip_special_tokens=True).strip()
                rec = {"id": s.id, "score": tasks.score(g, s, pred), "prediction": pred}
                for k in ("subtask", "dataset"):
                    if k in s.meta:
                        rec[k] = s.meta[k]
                recs.append(rec)
        steps, decode_s = info.pop("steps"), info.pop("decode_s")
        return {"records": recs, "steps": steps, "decode_s": decode_s, "decode": info}

    def _speed(self) -> None:
        plan, cfg = self.plan, self.cfg
        if self.model.device.type != "cuda":
            return
        length = max(cfg.lengths)
        sdir = plan.speed_dir(length)
        g = plan.speed_group()
        todo = [
            (b, p, bud)
            for b in cfg.speed_batches
            for p, bud in plan.pairs
            if not (sdir / cell_name(b, p, bud)).is_file()
        ]
        if not todo:
            return
        self.bar.total += len(todo)
        self.bar.refresh()
        samples = self._prompts(g, length)
        if samples is None:
            self._stop("--max-minutes reached (before generating prompts)")
            return
        for b in cfg.speed_batches:
            pend = [(p, bud) for bb, p, bud in todo if bb == b]
            if not pend:
                continue
            key = ("speed", b)
            if not self.clock.allows(key, key):
                self._stop("--max-minutes reached")
                return
            try:
                ids = [s.input_ids for s in samples[:b]]
                base, logits, _ = decode.prefill(self.model, self.tok, ids, plan.cache_options)
            except Exception as e:
                self._failed("speed", length, b, "prefill", None, e)
                continue
            for policy, budget in pend:
                if not self.clock.allows(key):
                    self._stop("--max-minutes reached")
                    return
                t1 = time.perf_counter()
                try:
                    res = decode.speed(self.model, base, logits, policy, budget, cfg.speed_steps, cfg.speed_warmup)
                except Exception as e:
                    self._failed("speed", length, b, policy, budget, e)
                    continue
                self.clock.note(key, time.perf_counter() - t1)
                res.update(task="speed", length=length, policy=policy, budget=budget, device=plan.device_name)
                write_json(sdir / cell_name(b, policy, budget), res)
                self.bar.update(1)
                self.say(
                    f"speed L={length} batch {b} {policy}"
                    + ("" if budget is None else f"@{budget}")
                    + f": {res['tokens_per_s']:.1f} tok/s, {res['ms_per_step']:.2f} ms/step"
                    + f" (timed steps: {res['timed_steps']})"
                )
            del base, logits
            _free(self.model)


def _free(model) -> None:
    gc.collect()
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()
