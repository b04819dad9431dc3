"""``kvdex eval <task>``: evaluate policies side by side (also ``python -m kvdex.eval.cli <task>``).

``register(subparsers)`` adds the ``eval`` command to kvdex's main parser; every task subcommand
sets ``func`` (``args.func(args)`` runs it and returns the exit status). Mistakes raise
``ValueError`` with the fix in the message.
"""

from __future__ import annotations

import argparse
import sys

from kvdex.cli_options import add_cache_options, cache_config_from_args
from kvdex.eval import tasks

DESCRIPTION = """Evaluate kvdex policies side by side: each prompt is prefilled once, then decoded per
(policy, budget); every score is reported with its ratio to full. Results go to one folder per run
under --out (config.json, predictions.jsonl, metrics.json); finished runs are skipped.

example:
  kvdex eval recall --model smollm2 --policies oracle,quest,streaming --budgets 64,256 \\
      --lengths 2k --samples 2 --steps 32 --out results
"""


# CacheConfig fields kvdex eval sets otherwise (kvdex.cli_options)
CACHE_EXCLUDED = {
    "budget": "--budgets takes a list: every policy runs at each budget",
    "prefill_chunk": "a memory bound of the dense prefill; the default fits eval's lengths",
    "timing": "kvdex eval measures accuracy, not time (kvdex bench measures speed)",
    "page_cache": "a speed option of offloaded decoding that leaves every result as it is (kvdex bench)",
}


def parse_sizes(text: str) -> list[int]:
    """``"64,256,1k,32k"`` -> [64, 256, 1024, 32768] (k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(part[:-1] if mult > 1 else part) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size list: {text!r} (e.g. 64,256,1k)") from None
    if not out:
        raise argparse.ArgumentTypeError("empty size list")
    return out


def parse_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to compare")
    g.add_argument(
        "--model",
        required=True,
        help="hub id, local directory, .gguf file, or a known name: smollm2, qwen05b (kvdex models fetch NAME)",
    )
    g.add_argument("--gguf", default=None, help="GGUF file name inside --model (a directory or hub repo)")
    g.add_argument(
        "--policies",
        type=parse_names,
        default=None,
        help="comma-separated policies (default: all registered); full is always run for the ratios; "
        "a policy may carry options as NAME:KEY=VALUE:KEY=VALUE (e.g. chess:preset=aggressive)",
    )
    g.add_argument(
        "--budgets",
        type=parse_sizes,
        default=[64, 256, 1024],
        help="tokens attended per kv head per step, sink and window included (default 64,256,1024)",
    )
    g.add_argument("--lengths", type=parse_sizes, default=[4096], help="context lengths in tokens (default 4k)")
    g.add_argument("--samples", type=int, default=1, help="samples per length (default 1)")
    g.add_argument("--seed", type=int, default=0)
    add_cache_options(p.add_argument_group("cache (kvdex.CacheConfig)"), exclude=CACHE_EXCLUDED)
    g = p.add_argument_group("where")
    g.add_argument("--out", default="results", help="results folder (default ./results)")
    g.add_argument(
        "--data",
        default=None,
        help="evaluation data folder (default $KVDEX_DATA); the tasks that need a file say which and where from",
    )
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument(
        "--decode",
        choices=("auto", "eager", "graph"),
        default="auto",
        help="how decode steps run: graph replays CUDA graphs (kvdex.GraphDecoder; steps that cannot be "
        "captured, and policies / stores / observers without graph support, run eagerly), eager runs every "
        "step through the model; auto (default): graph on CUDA, eager elsewhere. Not part of a run's identity "
        "(graph == eager up to float rounding); each prediction records how it was decoded",
    )


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = parser.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    for name, spec in tasks.TASKS.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        add_common(p)
        spec.add_arguments(p)
        p.set_defaults(func=run, eval_task=name)
    return parser


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``eval`` (with one subcommand per task) to kvdex's main CLI."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate policies: recall, task accuracy, perplexity",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return build_parser(p)


def run(args: argparse.Namespace) -> int:
    import kvdex
    from kvdex.eval import models
    from kvdex.eval.runner import EvalConfig, run_task
    from kvdex.eval.summary import write_summary

    known = kvdex.policies()
    policies = args.policies or known
    unknown = [p for p in policies if p.split(":")[0] not in known]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; registered policies: {', '.join(known)}")
    for p in policies:  # "name:KEY=VALUE:..." options: fail on a bad one before loading anything
        if ":" in p:
            kvdex.make_policy(p)
    caches = [cache_config_from_args(args, budget=b) for b in args.budgets]  # fail before loading anything
    task = tasks.TASKS[args.eval_task].build(args)
    model, tok = models.load(args.model, args.gguf, device=args.device, dtype=args.dtype)
    cfg = EvalConfig(
        model_tag=models.tag(args.model, args.gguf),
        policies=policies,
        budgets=args.budgets,
        lengths=args.lengths,
        samples=args.samples,
        out=args.out,
        seed=args.seed,
        page_size=caches[0].page_size,
        sink=caches[0].sink,
        window=caches[0].window,
        dense_layers=caches[0].dense_layers,
        offload=caches[0].offload,
        dtype=str(model.dtype).removeprefix("torch."),
        progress=not args.no_progress,
        decode=args.decode,
        extra={"model_arg": args.model, "gguf": args.gguf, "device": str(model.device)},
    )
    results = run_task(task, model, tok, cfg)
    table, paths = write_summary(task, results, cfg)
    print(f"\n{task.name} on {cfg.model_tag} ({'higher' if task.higher_is_better else 'lower'} score is better)")
    print(table)
    for p in paths:
        print(f"wrote {p}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvdex.eval.cli", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    args = build_parser(parser).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # a user mistake: the message says how to fix it
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
