"""Where a scorecard's cells live (:class:`Plan`), their file names, and the wall clock of ``max_minutes``.

A cell file sits at ``<out>/cells/<task>/L<length>__<hash>/<batch>__<policy>__<budget>.json``; the hash
covers every setting that changes the cell's numbers (model, dtype, seed, cache sizes, batch size, the
task's options, :data:`FORMAT`). Prompts are kept at ``<out>/prompts/<task>__L<length>__<hash>.npz``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from kvdex.eval.card import tasks
from kvdex.eval.card.config import ScorecardConfig

FORMAT = 1  # bump when a cell's meaning changes: every hash changes with it


def cell_name(batch: int, policy: str, budget: int | None) -> str:
    tag = re.sub(r"[^A-Za-z0-9._=:,-]+", "-", policy).replace(":", "+")
    return f"{batch:03d}__{tag}__{'dense' if budget is None else f'b{budget}'}.json"


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False) + "\n")
    tmp.replace(path)


def expected_prompts(group: tasks.Group) -> int | None:
    """Prompts a group will have before they are generated (None: known only then)."""
    o = group.options
    return {
        "retrieval": lambda: len(o["subtasks"]) * o["per_subtask"],
        "passkey": lambda: len(o["depths"]) * o["per_depth"],
        "longtext": lambda: o["prompts"],
    }.get(group.name, lambda: None)()


class Plan:
    """Where the cells of one invocation live, which exist, and the prompts they decode."""

    def __init__(self, cfg: ScorecardConfig, model_tag: str, dtype: str, root, device_name: str):
        self.cfg, self.root = cfg, root
        self.out = Path(cfg.out)
        self.pairs = cfg.policy_budgets()
        skipped: list[str] = []
        self.groups = tasks.make_groups(cfg, root, skipped)
        cache = dict(page_size=cfg.page_size, sink=cfg.sink, window=cfg.window, dense_layers=cfg.dense_layers)
        self.cache_options = cache
        self.common = {"format": FORMAT, "model": model_tag, "dtype": dtype, "seed": cfg.seed, "cache": cache}
        self.common_batched = {**self.common, "batch": cfg.batch}
        self.device_name = device_name
        self.speed_device = device_name  # speed cells are kept per device: timings of two GPUs never mix
        self.notes = skipped + [n for g in self.groups for n in g.notes]

    def cell_dir(self, group: tasks.Group, length: int) -> Path:
        return self.out / "cells" / group.name / f"L{length}__{group.digest(self.common_batched)}"

    def prompt_file(self, group: tasks.Group, length: int) -> Path:
        """Prompts depend on the tokenizer (the model), the seed and the task's options only."""
        key = {k: self.common[k] for k in ("format", "model", "seed")}
        return self.out / "prompts" / f"{group.name}__L{length}__{group.digest(key)}.npz"

    def speed_group(self) -> tasks.Group:
        n = max(self.cfg.speed_batches)
        return tasks.Group("passkey", {"depths": [50], "per_depth": n})

    def speed_dir(self, length: int) -> Path:
        opts = {"steps": self.cfg.speed_steps, "warmup": self.cfg.speed_warmup, "device": self.speed_device}
        g = tasks.Group("speed", opts)
        return self.out / "cells" / "speed" / f"L{length}__{g.digest(self.common)}"

    def prompt_count(self, group: tasks.Group, length: int) -> int | None:
        """Prompts of (group, length): from the prompt file when generated, else as expected."""
        info = tasks.prompt_info(self.prompt_file(group, length))
        return info[0] if info is not None else expected_prompts(group)

    def batches(self, n: int) -> list[range]:
        b = self.cfg.batch
        return [range(i, min(i + b, n)) for i in range(0, n, b)]


class Clock:
    """Wall time since the start and a guess of the next unit's cost, for ``max_minutes``."""

    def __init__(self, limit_min: float | None):
        self.t0 = time.perf_counter()
        self.limit = None if limit_min is None else 60.0 * limit_min
        self.seen: dict[tuple, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def note(self, key: tuple, seconds: float) -> None:
        self.seen[key] = max(self.seen.get(key, 0.0), seconds)

    def allows(self, *keys: tuple) -> bool:
        """Whether the units ``keys`` (their longest time so far; twice the longest unit seen for a new
        kind) still fit before the limit."""
        if self.limit is None:
            return True
        seen = [v for k, v in self.seen.items() if k[0] != "prompts"]
        fallback = 2 * max(seen, default=0.0)
        return self.allows_seconds(sum(self.seen.get(k, fallback) for k in keys))

    def allows_seconds(self, seconds: float) -> bool:
        return self.limit is None or self.elapsed() + seconds <= self.limit
