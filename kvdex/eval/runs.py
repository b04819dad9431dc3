"""What an evaluation invocation asks for (:class:`EvalConfig`), what each run left in its folder
(:class:`RunResult`) and the machine record written with it (:func:`environment`)."""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvdex.config import DEFAULT_DENSE_LAYERS, DEFAULT_PAGE_SIZE, DEFAULT_SINK, DEFAULT_WINDOW

FULL = "full"
DECODE_MODES = ("auto", "eager", "graph")


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
        return read_predictions(self.dir / "predictions.jsonl")


def read_predictions(path: Path) -> list[dict]:
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
    import kvdex
    from kvdex.hf.compat import TRANSFORMERS_VERSION

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": TRANSFORMERS_VERSION,
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
