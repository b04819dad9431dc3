"""What ``kvdex soak`` measures: :class:`SoakConfig` (shape, context, steps, sampling, tolerances) and its rows.

A row is ``POLICY[:OPTIONS]/device`` or ``POLICY[:OPTIONS]/offload`` (:func:`split_row`); the default rows are
every seed policy (:data:`POLICIES`) on both storages.
"""

from __future__ import annotations

import dataclasses

POLICIES = ("full", "quest", "icecache", "pariskv", "chess", "prkv")
DEFAULT_ROWS = tuple(f"{p}/{s}" for p in POLICIES for s in ("device", "offload"))


@dataclasses.dataclass
class SoakConfig:
    shape: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    context: int = 512
    batch: int = 1
    steps: int = 10_000
    warmup: int = -1  # -1: min(steps // 10, 500)
    every: int = 0  # 0: spread about 40 samples over the steps after the warm-up
    rows: tuple[str, ...] = DEFAULT_ROWS
    budget: int = 256
    page_cache: int = 0
    dense_layers: int = 1
    reserve: bool = True
    kv: str = "prompt"  # prompt: a prefill of random tokens; random: kvdex.bench.decoding.fill_random
    objects: bool = True  # count tensors and gc-tracked objects at each sample
    tolerance: float = 0.02  # excess bytes per step, as a fraction of one token's KV (all layers, the batch)
    object_tolerance: float = 0.02  # excess tensors / objects per step
    rss_tolerance: float = 4096.0  # excess RSS bytes per step
    max_minutes: float = 0.0  # 0: no limit; else each row stops early at its share of the time left
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 2 or self.context < 1 or self.batch < 1:
            raise ValueError("--steps must be >= 2, --context and --batch >= 1")
        if self.kv not in ("prompt", "random"):
            raise ValueError(f"--kv must be prompt or random, got {self.kv!r}")
        for row in self.rows:
            split_row(row)

    @property
    def warmup_steps(self) -> int:
        w = min(self.steps // 10, 500) if self.warmup < 0 else self.warmup
        if w >= self.steps - 1:
            raise ValueError(f"--warmup ({w}) leaves fewer than 2 steps to sample out of --steps {self.steps}")
        return w

    @property
    def sample_every(self) -> int:
        return self.every if self.every > 0 else max(1, (self.steps - self.warmup_steps) // 40)


def split_row(row: str) -> tuple[str, str]:
    """``"quest:select_every=8/offload"`` -> ``("quest:select_every=8", "offload")``."""
    spec, _, storage = row.rpartition("/")
    if not spec or storage not in ("device", "offload"):
        raise ValueError(f"row {row!r}: expected POLICY[:OPTIONS]/device or POLICY[:OPTIONS]/offload")
    return spec, storage
