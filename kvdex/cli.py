"""The ``kvdex`` command line.

    kvdex policies                      one line per policy: what, paper, CUDA-graph capture
    kvdex generate --policy quest --budget 128 --prompt-file long.txt --chat
    kvdex models fetch smollm2          download a known model (kvdex.models)
    kvdex demo                          passkey retrieval at ~6k tokens, every policy (kvdex.demo)
    kvdex eval ...                      the evaluation harness (present when kvdex.eval.cli exists)
    kvdex calibrate chess ...           CHESS's rebuild thresholds, offline (kvdex.calibrate)
    kvdex vllm check --model DIR        kvdex's vLLM attention backend vs vLLM's own (kvdex.vllm.check)
    kvdex vllm bench                    its serving speed vs vLLM's default backend (kvdex.vllm.bench)

Every subcommand sets ``func(args) -> int | None`` with ``set_defaults``; ``kvdex.eval.cli`` follows
the same contract through ``register(subparsers)``. Mistakes kvdex reports (``ValueError``,
``TypeError``, a missing file) print ``kvdex: error: <message>`` and exit with status 2; set
``KVDEX_TRACEBACK=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvdex.cli_options import add_cache_options, cache_config_from_args
from kvdex.hf.compat import cache_kwargs
from kvdex.policies.spec import parse_options

# ---- policies ------------------------------------------------------------------------------------


def describe_policy(name: str) -> tuple[str, str]:
    """``(what it is, its paper)`` of a registered policy, from its module's and class's docstrings.

    A policy module opens with ``name``: Paper (authors, venue) -- what it does.``; a second policy
    class in the same module (a variant) adds the first sentence of its own docstring.
    """
    import sys

    from kvdex.policies import policy_class

    cls = policy_class(name)
    head = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    head = " ".join(head.split())
    if head.startswith("``"):
        head = head.split(":", 1)[-1].strip()
    paper, sep, what = head.partition(" -- ")
    if not sep or not paper[:1].isupper():  # no paper named (the reference, the upper bound)
        paper, what = "", head.replace(" -- ", ": ")
    own = (cls.__doc__ or "").strip()
    if own and not own.startswith(cls.__name__ + "(") and not own.startswith(paper.split(" (")[0] or "\0"):
        first = " ".join(own.split("\n\n")[0].split()).split(". ")[0]
        what = first[:1].lower() + first[1:]  # a variant: its own docstring says what it is
    return what.rstrip(".") or "-", paper or "-"


def cmd_policies(args: argparse.Namespace) -> int:
    import kvdex
    from kvdex.hf.graph import graph_policies

    capturable = set(graph_policies())
    names = kvdex.policies()
    width = max(map(len, names))
    print(f"{'policy'.ljust(width)}  cuda-graph  what it is [paper]")
    for name in names:
        what, paper = describe_policy(name)
        graph = "yes" if name in capturable else "no"
        print(f"{name.ljust(width)}  {graph.ljust(10)}  {what}" + (f" [{paper}]" if paper != "-" else ""))
    return 0


# ---- generate ------------------------------------------------------------------------------------


def _policy_options(items: list[str]) -> dict:
    """``["k=v", ...]`` -> ``{k: v}``; values are Python literals where they parse, else strings."""
    return parse_options(items, lambda item: f"--option expects KEY=VALUE, got {item!r}")


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise ValueError("--prompt is empty; give the text to continue (or --prompt-file FILE)")
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise ValueError(f"--prompt-file {path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"--prompt-file {path} is empty; the prompt needs at least one token")
    return text


def format_stats(stats: dict) -> str:
    """One ``key  value`` line per statistic, keys aligned; byte counts also in MiB."""
    width = max(map(len, stats), default=0)
    lines = []
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.2f}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items()) or "-"
        elif "bytes" in key and isinstance(value, int):
            value = f"{value} ({value / 2**20:.2f} MiB)"
        lines.append(f"{key.ljust(width)}  {value}")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import kvdex
    from kvdex import models

    options = _policy_options(args.option)
    kvdex.make_policy(args.policy, **options)  # unknown policy / option: fail before the slow load
    config = cache_config_from_args(args)  # bad sizes: fail before the slow load
    prompt = _read_prompt(args)
    model_id, gguf = models.resolve_model(args.model, args.gguf)

    model, tok = kvdex.load(model_id, gguf_file=gguf)
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer of {model_id} has no chat template; drop --chat")
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(prompt, return_tensors="pt")
    if enc["input_ids"].shape[-1] == 0:
        raise ValueError("the prompt tokenizes to 0 tokens; give a longer prompt")
    enc = enc.to(model.device)
    cache = kvdex.Cache(model, policy=args.policy, **config.to_dict(), **options)
    if args.sample:
        torch.manual_seed(args.seed)
        sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    compiled = getattr(args, "compile", False)  # decoder layers through torch.compile (kvdex.generate)
    if getattr(args, "cuda_graph", False) or compiled:  # kvdex's own decode loop, steps replayed from CUDA graphs
        top_k = getattr(model.generation_config, "top_k", None) or 0  # as model.generate samples
        knobs = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=top_k) if args.sample else {}
        out = kvdex.generate(
            model, cache, enc["input_ids"], enc.get("attention_mask"), max_new_tokens=args.max_new_tokens,
            pad_token_id=tok.pad_token_id, cuda_graph=bool(getattr(args, "cuda_graph", False)), compile=compiled,
            **knobs,
        )  # fmt: skip
    else:
        with torch.no_grad():
            out = model.generate(
                **enc, **cache_kwargs(cache), max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id,
                **sampling,
            )  # fmt: skip
    print(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    print()
    print(format_stats(cache.stats()))
    if getattr(args, "cuda_graph", False):
        print(format_stats({"graph_steps": cache.graph_counts, "graph_off_because": cache.graph_reason or "-"}))
    if compiled:
        print(format_stats({"compile_off_because": getattr(cache, "compile_reason", None) or "-"}))
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a continuation with a kvdex cache and print its stats",
        description="Generate a continuation with a kvdex cache, then print the cache's stats.",
        epilog="examples:\n"
        "  kvdex generate --policy quest --budget 128 --prompt-file long.txt --chat\n"
        "  kvdex generate --model qwen05b --policy icecache -o reuse=true --prompt 'Once upon a time'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="a known name (smollm2, qwen05b: `kvdex models fetch NAME`), a Hugging Face id, a local directory "
        "or a .gguf file (default: smollm2)",
    )
    p.add_argument("--gguf", help="name of a GGUF file inside --model (a directory or a Hugging Face repo)")
    p.add_argument("--policy", default="quest", help="a registered policy, see `kvdex policies` (default %(default)s)")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy option (repeatable), e.g. --policy icecache -o reuse=true; see docs/policies/<name>.md",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a UTF-8 file holding the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default %(default)s)")
    add_cache_options(p.add_argument_group("cache (kvdex.CacheConfig)"))
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7, help="with --sample (default %(default)s)")
    p.add_argument("--top-p", type=float, default=0.9, help="with --sample (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="with --sample (default %(default)s)")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="decode with kvdex.generate, replaying each step from a CUDA graph where the policy and store "
        "allow it (eager otherwise, with the reason)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode with kvdex.generate, the model's decoder layers compiled by torch.compile (inductor fuses "
        "norms, RoPE, SiLU; kvdex's cache and attention stay eager); with or without --cuda-graph",
    )
    p.set_defaults(func=cmd_generate)


# ---- demo and eval -------------------------------------------------------------------------------


def _add_demo(sub) -> None:
    from kvdex import demo

    p = sub.add_parser(
        "demo",
        help="passkey retrieval at ~6k tokens with every policy at a small budget",
        description=demo.__doc__.split("\n\n")[0],
    )
    demo.add_arguments(p)
    p.set_defaults(func=demo.main)


def _add_eval(sub) -> None:
    """``kvdex eval`` comes from ``kvdex.eval.cli.register(subparsers)`` when that module exists."""
    try:
        from kvdex.eval.cli import register
    except ModuleNotFoundError as e:
        if e.name == "kvdex.eval.cli":
            return  # no harness installed: no `eval` subcommand
        failure = e
    except ImportError as e:
        failure = e
    else:
        register(sub)
        return

    def unavailable(args):  # the harness exists but cannot be imported: say why when asked for it
        raise ValueError(f"`kvdex eval` is unavailable: importing kvdex.eval.cli failed: {failure}")

    sub.add_parser("eval", help="(unavailable, see `kvdex eval`)").set_defaults(func=unavailable)


def _add_calibrate(sub) -> None:
    """``kvdex calibrate chess ...``: offline threshold calibration (kvdex/calibrate.py)."""
    from kvdex.calibrate import register

    register(sub)


def build_parser() -> argparse.ArgumentParser:
    import kvdex

    parser = argparse.ArgumentParser(
        prog="kvdex",
        description="Sparse, offloadable KV caches for long-context decoding with Hugging Face transformers.",
    )
    parser.add_argument("--version", action="version", version=f"kvdex {kvdex.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "policies", help="the registered policies: what each is, its paper, whether it decodes in a CUDA graph"
    ).set_defaults(func=cmd_policies)
    _add_generate(sub)
    _add_demo(sub)
    _add_eval(sub)
    from kvdex.eval.card.cli import register as _register_scorecard

    _register_scorecard(sub)  # kvdex scorecard (kvdex/eval/card)
    from kvdex.bench.cli import register as _register_bench

    _register_bench(sub)  # kvdex bench (kvdex/bench)
    from kvdex.bench.soak.cli import register as _register_soak

    _register_soak(sub)  # kvdex soak: memory over thousands of decode steps (kvdex/bench/soak)
    _add_calibrate(sub)
    from kvdex.models import register as _register_models

    _register_models(sub)  # kvdex models list | fetch
    from kvdex.vllm.check import register as _register_vllm

    _register_vllm(sub)  # kvdex vllm check: kvdex's vLLM backend against vLLM's own (kvdex/vllm)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, TypeError, OSError) as e:
        if os.environ.get("KVDEX_TRACEBACK"):
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
