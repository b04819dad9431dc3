"""What a scorecard measures: :class:`ScorecardConfig`, its presets and its validation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvdex.config import DEFAULT_DENSE_LAYERS, DEFAULT_PAGE_SIZE, DEFAULT_SINK, DEFAULT_WINDOW
from kvdex.eval.card.tasks import SUBTASKS

PASSKEY_DEPTHS = tuple(range(0, 100, 5))
ORDERS = ("batches", "pairs")


def is_spec(entry: str) -> bool:
    """An ``against`` entry that names a registered policy (``icecache``, ``quest:rerank=4``), not an option."""
    from kvdex.policies import policies

    return entry.partition(":")[0] in policies()


@dataclass
class ScorecardConfig:
    """Settings of one scorecard. Sizes are tokens; ``lengths`` are prompt lengths (answers included
    for retrieval, as RULER counts). ``policies``: names (``name:KEY=VALUE`` options allowed;
    ``name@B`` runs that policy at budget B only); None = every registered policy. ``full`` always runs.
    """

    model: str = "qwen05b"
    gguf: str | None = None
    device: str | None = None
    dtype: str = "auto"
    policies: list[str] | None = None
    budgets: list[int] = field(default_factory=lambda: [256, 1024])
    lengths: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    tasks: list[str] = field(default_factory=lambda: ["retrieval", "passkey", "longtext"])
    # retrieval: prompts per length spread over the subtasks (at least 25 each), or per_subtask exactly
    subtasks: list[str] = field(default_factory=lambda: list(SUBTASKS))
    prompts: int = 200
    per_subtask: int | None = None
    max_new_cap: int | None = None  # caps every retrieval answer length (the smoke size)
    passkey_depths: list[int] = field(default_factory=lambda: list(PASSKEY_DEPTHS))
    passkey_per_depth: int = 2
    longtext_prompts: int = 16
    recall_steps: int = 16
    ppl_tokens: int = 128
    longbench_per_dataset: int = 1000  # all 237 MiniLongBench samples
    longbench_max_new_tokens: int = 128
    batch: int = 16
    seed: int = 0
    page_size: int = DEFAULT_PAGE_SIZE
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    dense_layers: int = DEFAULT_DENSE_LAYERS
    decode: str = "auto"  # auto (graphs on CUDA) | eager | graph
    speed: bool = True
    speed_batches: list[int] = field(default_factory=lambda: [1, 8])
    speed_steps: int = 128
    speed_warmup: int = 16
    out: str = "scorecard"
    data: str | None = None
    max_minutes: float | None = None
    max_cells: int | None = None
    # batches: each prompt batch prefilled once and decoded by every (policy, budget) before the next batch;
    # pairs: one (policy, budget) over every batch before the next (a prefill per batch and pair, slower,
    # but a stopped run has only complete slots)
    order: str = "batches"
    progress: bool = True
    resamples: int = 2000
    prepare: bool = False  # only generate and save the prompts (tokenizer only, no model weights, no device)
    # only write the table from the cells already under ``out`` (no model, no device): for a run whose cells
    # were computed by several commands, or on several machines
    report_only: bool = False
    # option names: every policy whose spec sets one is also compared with the same spec without it, paired
    # over the same prompts (report["against"]; e.g. ["select_every"]: "quest:select_every=8" against "quest");
    # policy specs: every other spec of that policy is compared with it (["icecache"]: "icecache:search=summary"
    # against "icecache")
    against: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.prepare and self.report_only:
            raise ValueError("prepare and report_only exclude each other (prepare: prompts; report_only: cells)")
        if self.decode not in ("auto", "eager", "graph"):
            raise ValueError(f"decode must be auto, eager or graph, got {self.decode!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be {' or '.join(ORDERS)}, got {self.order!r}")
        for name, v in (("batch", self.batch), ("prompts", self.prompts), ("speed_steps", self.speed_steps)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.per_subtask is not None and self.per_subtask < 1:
            raise ValueError(f"per_subtask must be >= 1, got {self.per_subtask}")
        for opt in self.against:
            if not isinstance(opt, str) or not (opt.isidentifier() or is_spec(opt)):
                raise ValueError(
                    f"against takes policy option names (e.g. select_every) or specs of a registered policy "
                    f"(e.g. icecache, quest:rerank=4), got {opt!r}"
                )
        if self.speed_warmup < 1:
            raise ValueError(f"speed_warmup must be >= 1 (graphs are captured there), got {self.speed_warmup}")
        if not self.lengths or any(n < 256 for n in self.lengths):
            raise ValueError(f"lengths must be >= 256 tokens each, got {self.lengths}")
        if self.recall_steps < 0 or self.ppl_tokens < 1:
            raise ValueError("recall_steps must be >= 0 and ppl_tokens >= 1")
        for b in self.budgets + [b for _, b in self.policy_budgets() if b is not None]:
            self.cache_config(b)

    def cache_config(self, budget: int):
        """The :class:`kvdex.CacheConfig` of a (policy, ``budget``) slot (ValueError for sizes that do not fit)."""
        from kvdex import CacheConfig

        sizes = dict(page_size=self.page_size, sink=self.sink, window=self.window, dense_layers=self.dense_layers)
        return CacheConfig(budget=budget, **sizes)

    def policy_budgets(self) -> list[tuple[str, int | None]]:
        """(policy, budget) pairs in table order: ``full`` (budget None) first."""
        import kvdex

        known = kvdex.policies()
        names = self.policies if self.policies is not None else [p for p in known if p != "full"]
        out: list[tuple[str, int | None]] = [("full", None)]
        for p in names:
            name, at, b = p.rpartition("@") if "@" in p else (p, "", "")
            if at and not b.isdigit():
                raise ValueError(f"{p!r}: a budget after @ must be a number of tokens, e.g. oracle@1024")
            base = name.split(":")[0]
            if base not in known:
                raise ValueError(f"unknown policy {base!r}; registered policies: {', '.join(known)}")
            if ":" in name:
                kvdex.make_policy(name)  # a bad option: ValueError now
            if base == "full":
                continue
            for budget in [int(b)] if at else self.budgets:
                if (name, budget) not in out:
                    out.append((name, budget))
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def smoke(**overrides) -> ScorecardConfig:
    """The CI size: SmolLM2 on the CPU, one short length, four policies, a few prompts per task
    (oracle also at a budget that covers the whole context, where it must equal ``full``)."""
    cfg = dict(
        model="smollm2",
        device="cpu",
        dtype="float32",
        policies=["oracle", "oracle@1024", "quest", "streaming"],
        budgets=[64],
        lengths=[512],
        tasks=["retrieval", "passkey"],
        subtasks=["niah_single", "niah_multikey", "vt", "fwe"],
        per_subtask=2,
        max_new_cap=16,
        passkey_depths=[10, 50, 90],
        passkey_per_depth=1,
        longtext_prompts=2,
        recall_steps=4,
        ppl_tokens=8,
        batch=4,
        speed=False,
        out="scorecard-smoke",
    )
    cfg.update(overrides)
    return ScorecardConfig(**cfg)
