"""``kvdex scorecard``: the command line of :func:`kvdex.eval.card.scorecard`."""

from __future__ import annotations

import argparse

from kvdex.cli_options import add_cache_options
from kvdex.eval.card.config import ORDERS, ScorecardConfig, smoke
from kvdex.eval.card.tasks import GROUPS, SUBTASKS
from kvdex.eval.tasks import parse_depths

# CacheConfig fields the scorecard sets otherwise (kvdex.cli_options)
CACHE_EXCLUDED = {
    "budget": "--budgets takes a list: every policy runs at each budget (NAME@B: at budget B only)",
    "offload": "the scorecard decodes from device memory; kvdex bench measures offloaded decoding",
    "page_cache": "a device cache of offloaded pages: the scorecard does not offload",
    "prefill_chunk": "a memory bound of the dense prefill; the default fits the scorecard's lengths",
    "timing": "the speed columns time whole decode steps; kvdex bench splits a step into phases",
}


def parse_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_sizes(text: str) -> list[int]:
    """``"256,1k,32k"`` -> [256, 1024, 32768] (``kvdex eval``'s size lists)."""
    from kvdex.eval.cli import parse_sizes as sizes  # imported when used: `kvdex scorecard` works without it

    return sizes(text)


DESCRIPTION = """Every policy's accuracy and speed side by side on one model: each (policy, budget) decodes
the same prompts (RULER-style retrieval, passkey grid, attention recall and perplexity on long text,
optionally LongBench v1) at every length, in batches prefilled once and forked per policy. Each cell is
the ratio to full with a paired 95% bootstrap interval; cells whose interval excludes 1 are marked.
Writes <out>/scorecard.md, scorecard.json and scorecard.png. Finished cells are kept under <out>/cells:
run the same command again to continue a stopped run (--max-minutes stops cleanly before a limit); a
stopped run reports unfinished slots over the prompts decoded so far, marked "(partial: n/N)".

examples:
  kvdex scorecard --model qwen05b --out scorecard-qwen --max-minutes 9     # the full default size
  kvdex scorecard --smoke                                                  # SmolLM2 on the CPU, ~2 min
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ScorecardConfig()
    g = p.add_argument_group("what to measure")
    g.add_argument("--model", default=None, help="known name, hub id, directory or .gguf (default qwen05b)")
    g.add_argument("--gguf", default=None, help="GGUF file name inside --model")
    g.add_argument(
        "--policies",
        type=parse_names,
        default=None,
        help="comma-separated policies (default: every registered one); NAME:KEY=VALUE options; NAME@B runs NAME "
        "at budget B only (e.g. oracle@65536); full always runs",
    )
    g.add_argument("--budgets", type=parse_sizes, default=None, help="tokens per kv head per step (default 256,1024)")
    g.add_argument("--lengths", type=parse_sizes, default=None, help="context lengths (default 8k,16k,32k)")
    g.add_argument(
        "--tasks",
        type=parse_names,
        default=None,
        help=f"task groups from {', '.join(GROUPS[:3])} (default all three; longtext = recall + ppl)",
    )
    g.add_argument("--with-longbench", action="store_true", help="add LongBench v1 (the 237-sample subset)")
    g.add_argument(
        "--subtasks", type=parse_names, default=None, help=f"retrieval subtasks (default {','.join(SUBTASKS)})"
    )
    g.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"retrieval prompts per length, spread over the subtasks (at least 25 each; default {d.prompts})",
    )
    g.add_argument("--per-subtask", type=int, default=None, help="retrieval prompts per subtask (overrides --prompts)")
    g.add_argument("--passkey-depths", type=parse_depths, default=None, help="needle depths in %% (default 0:95:5)")
    g.add_argument("--passkey-per-depth", type=int, default=None, help=f"(default {d.passkey_per_depth})")
    g.add_argument("--longtext-prompts", type=int, default=None, help=f"(default {d.longtext_prompts})")
    g.add_argument("--recall-steps", type=int, default=None, help=f"(default {d.recall_steps})")
    g.add_argument("--ppl-tokens", type=int, default=None, help=f"(default {d.ppl_tokens})")
    g.add_argument("--batch", type=int, default=None, help=f"prompts per batch (default {d.batch})")
    g.add_argument("--seed", type=int, default=None, help="prompt seed (default 0)")
    g.add_argument("--no-speed", action="store_true", help="skip the speed columns (measured on CUDA only)")
    g.add_argument(
        "--against",
        type=parse_names,
        default=None,
        help="option names: each policy whose spec sets one is also compared, paired, with the same spec "
        "without it (e.g. --against select_every: quest:select_every=8 against quest); policy specs: every "
        "other spec of that policy is compared with it (--against icecache: icecache:search=summary against "
        "icecache); the base's cells must exist",
    )
    g.add_argument("--smoke", action="store_true", help="the CI size: SmolLM2 on the CPU, 512 tokens, 4 policies")
    add_cache_options(p.add_argument_group("cache (kvdex.CacheConfig)"), exclude=CACHE_EXCLUDED)
    g = p.add_argument_group("running")
    g.add_argument("--out", default=None, help="output folder (default ./scorecard; --smoke: ./scorecard-smoke)")
    g.add_argument("--data", default=None, help="evaluation data folder (default $KVDEX_DATA)")
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    g.add_argument("--dtype", default=None, help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16")
    g.add_argument("--decode", choices=("auto", "eager", "graph"), default=None, help="auto: CUDA graphs on CUDA")
    g.add_argument("--max-minutes", type=float, default=None, help="stop cleanly before this wall time")
    g.add_argument("--max-cells", type=int, default=None, help="stop after computing this many cells")
    g.add_argument(
        "--order",
        choices=ORDERS,
        default=None,
        help="batches (default): prefill each prompt batch once for every policy; pairs: finish one (policy, "
        "budget) over every batch before the next (a prefill per batch and pair: slower, but a run stopped "
        "early has only complete slots)",
    )
    g.add_argument(
        "--prepare",
        action="store_true",
        help="only generate and save the prompts under --out (the tokenizer only: a CPU job before a GPU run)",
    )
    g.add_argument(
        "--report-only",
        action="store_true",
        help="only write scorecard.md/.json/.png from the cells already under --out (no model is loaded): for "
        "a run whose cells came from several commands or machines",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


_FIELDS = {
    "model": "model", "gguf": "gguf", "policies": "policies", "budgets": "budgets", "lengths": "lengths",
    "tasks": "tasks", "subtasks": "subtasks", "prompts": "prompts", "per_subtask": "per_subtask",
    "passkey_depths": "passkey_depths", "passkey_per_depth": "passkey_per_depth",
    "longtext_prompts": "longtext_prompts", "recall_steps": "recall_steps", "ppl_tokens": "ppl_tokens",
    "batch": "batch", "seed": "seed", "page_size": "page_size", "sink": "sink", "window": "window",
    "dense_layers": "dense_layers", "out": "out", "data": "data", "device": "device", "dtype": "dtype",
    "decode": "decode", "max_minutes": "max_minutes", "max_cells": "max_cells", "order": "order",
    "against": "against",
}  # fmt: skip


def config_from_args(a: argparse.Namespace) -> ScorecardConfig:
    given = {f: getattr(a, arg) for arg, f in _FIELDS.items() if getattr(a, arg) is not None}
    if a.no_speed:
        given["speed"] = False
    if a.no_progress:
        given["progress"] = False
    if a.prepare:
        given["prepare"] = True
    if a.report_only:
        given["report_only"] = True
    if a.with_longbench:
        base = given.get("tasks") or (smoke().tasks if a.smoke else ScorecardConfig().tasks)
        given["tasks"] = [*base, "longbench"] if "longbench" not in base else base
    cfg = smoke(**given) if a.smoke else ScorecardConfig(**given)
    cfg.validate()
    return cfg


def run(a: argparse.Namespace) -> int:
    from kvdex.eval.card.run import scorecard

    cfg = config_from_args(a)
    rep = scorecard(cfg)
    if cfg.prepare:
        return 0
    print(rep["paths"][1].read_text())
    return 0 if rep["complete"] or rep["stopped"] else 1


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``scorecard`` to kvdex's main CLI."""
    p = subparsers.add_parser(
        "scorecard",
        help="every policy's accuracy and speed side by side, ratios to full with 95%% intervals",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvdex.eval.card.cli",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    raise SystemExit(main())
