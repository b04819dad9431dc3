"""The evaluation tasks the CLI offers: name -> how to add its options and build it.

Only finished tasks are listed here; each task module is imported when the task is built.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSpec:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.Namespace], object]


def _recall_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recall")
    g.add_argument(
        "--mode",
        choices=("teacher", "free"),
        default="teacher",
        help="teacher: feed the text's real continuation (also gives perplexity); "
        "free: the model's own greedy continuation (drift over long generation)",
    )
    g.add_argument("--steps", type=int, default=32, help="decode steps per sample (default 32)")
    g.add_argument("--every", type=int, default=1, help="measure every N-th step (default 1)")
    g.add_argument(
        "--layers", default=None, help="comma-separated layer indices to measure (default: every sparse layer)"
    )
    g.add_argument(
        "--probe",
        action="store_true",
        help="decode densely and score each policy's selection against the dense model's queries "
        "(selection quality without compounding error; default: recall inside the policy's own decode)",
    )
    _source_arg(g)


def _source_arg(g) -> None:
    g.add_argument(
        "--source",
        default="books",
        help="long text: a text file of your own, or books (default), essays, wikitext, kjv from the data folder",
    )


def _recall(a: argparse.Namespace):
    from kvdex.eval.recall import RecallTask

    layers = None if a.layers is None else [int(x) for x in a.layers.split(",")]
    return RecallTask(
        mode=a.mode, steps=a.steps, every=a.every, layers=layers, source=a.source, probe=a.probe, data_root=a.data
    )


def _ppl_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ppl")
    g.add_argument("--tokens", type=int, default=256, help="tokens scored per sample after the context (default 256)")
    _source_arg(g)


def _ppl(a: argparse.Namespace):
    from kvdex.eval.tasks.ppl import PerplexityTask

    return PerplexityTask(tokens=a.tokens, source=a.source, data_root=a.data)


def parse_depths(text: str) -> list[int]:
    """``"0:95:5"`` (start:stop:step, stop included) or ``"0,50,90"`` -> percentages."""
    if ":" in text:
        start, stop, step = (int(x) for x in text.split(":"))
        return list(range(start, stop + 1, step))
    return [int(x) for x in text.split(",") if x.strip()]


def _passkey_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("passkey")
    g.add_argument(
        "--depths",
        type=parse_depths,
        default=list(range(0, 100, 5)),
        help="needle depths in percent: start:stop:step or a list (default 0:95:5)",
    )
    g.add_argument("--max-new-tokens", type=int, default=12)


def _passkey(a: argparse.Namespace):
    from kvdex.eval.tasks.passkey_grid import PasskeyTask

    return PasskeyTask(depths=a.depths, max_new_tokens=a.max_new_tokens)


def _ruler_args(p: argparse.ArgumentParser) -> None:
    from kvdex.eval.tasks.ruler import SUBTASKS

    g = p.add_argument_group("ruler")
    g.add_argument("--subtasks", default=None, help=f"comma-separated subset of: {', '.join(SUBTASKS)} (default all)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="override the per-subtask answer length")
    g.add_argument(
        "--haystack",
        default=None,
        help="text file for the essay-haystack subtasks (any long UTF-8 text; default: the data folder's essays)",
    )


def _ruler(a: argparse.Namespace):
    from kvdex.eval.tasks.ruler import RulerTask

    subtasks = None if a.subtasks is None else [s.strip() for s in a.subtasks.split(",") if s.strip()]
    return RulerTask(subtasks=subtasks, data_root=a.data, max_new_tokens=a.max_new_tokens, haystack=a.haystack)


def _needle_args(p: argparse.ArgumentParser) -> None:
    from kvdex.eval.needle import NEEDLE_SUBTASKS

    g = p.add_argument_group("needle")
    g.add_argument(
        "--subtasks", default=None, help=f"comma-separated RULER niah_* subtasks (default {','.join(NEEDLE_SUBTASKS)})"
    )


def _needle(a: argparse.Namespace):
    from kvdex.eval.needle import NeedleTask

    subtasks = None if a.subtasks is None else [s.strip() for s in a.subtasks.split(",") if s.strip()]
    return NeedleTask(subtasks=subtasks, data_root=a.data)


def _longbench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("longbench")
    g.add_argument("--version", choices=("v1", "v2"), default="v1", help="v1: 237-sample subset; v2: short MCQ")
    g.add_argument("--datasets", default=None, help="v1 only: comma-separated datasets (default all 21)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="override LongBench's per-dataset answer length")


def _longbench(a: argparse.Namespace):
    from kvdex.eval.tasks.longbench import LongBenchTask

    datasets = None if a.datasets is None else [d.strip() for d in a.datasets.split(",") if d.strip()]
    return LongBenchTask(version=a.version, datasets=datasets, data_root=a.data, max_new_tokens=a.max_new_tokens)


def _math_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("math (--lengths is the generation budget: max new tokens)")
    g.add_argument("--dataset", choices=("gsm8k", "math500", "aime24", "aime25"), default="gsm8k")


def _math(a: argparse.Namespace):
    from kvdex.eval.tasks.mathcot import MathTask

    return MathTask(dataset=a.dataset, data_root=a.data)


TASKS: dict[str, TaskSpec] = {
    "recall": TaskSpec(
        "attention recall / top-k hit rate / output error of each policy on long text", _recall_args, _recall
    ),
    "passkey": TaskSpec(
        "passkey retrieval over needle depth x context length (--samples per cell)", _passkey_args, _passkey
    ),
    "ruler": TaskSpec(
        "RULER: needle-in-a-haystack (single/multi-key/multi-value/multi-query), variable tracking, QA",
        _ruler_args,
        _ruler,
    ),
    "needle": TaskSpec(
        "needle diagnostics: per layer and kv head, the share of the needle's tokens and attention each policy "
        "keeps vs the exact top-k of the same size (RULER needles, answer teacher-forced; PNG per budget)",
        _needle_args,
        _needle,
    ),
    "longbench": TaskSpec(
        "LongBench v1 (237-sample subset, official metric per task) or v2 short multiple choice "
        "(--samples: per v1 dataset / v2 items; --lengths: prompt truncation)",
        _longbench_args,
        _longbench,
    ),
    "math": TaskSpec(
        "GSM8K / MATH-500 / AIME chain of thought: answer accuracy vs full (--lengths = max new tokens)",
        _math_args,
        _math,
    ),
    "ppl": TaskSpec("perplexity of long text decoded through each policy (teacher forced)", _ppl_args, _ppl),
}
