"""``kvdex bench`` arguments; :func:`register` adds the subcommand to kvdex's main CLI."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvdex.bench import runner, shapes
from kvdex.cli_options import add_cache_options, cache_config_from_args

# CacheConfig fields kvdex bench sets otherwise (kvdex.cli_options)
CACHE_EXCLUDED = {
    "offload": "--storages device,offload runs every policy both ways",
    "prefill_chunk": "bench's own --prefill-chunk is the forward size of a chunked prefill (kvdex.hf.prefill)",
    "timing": "bench times the phases of a step itself (--split-steps)",
}

DESCRIPTION = """\
Decode speed of kvdex policies (GPU-resident and offloaded) next to transformers' DynamicCache and
its offloaded cache, on a random-weight model of a named shape. Checks first that every kvdex
method at a budget covering the context gives the dense step's logits, then measures per context
and batch: prefill time, ms/token (median, p90 over --steps after --warmup, CUDA events),
throughput, peak device / host memory, host->device bytes, and the split of a step into
selection / transfer / attention / rest. Writes bench.json, bench.png and a table.
--kv random fills each method's cache with random keys/values instead of prefilling a prompt:
decode timings only (prefill time and peak come from --kv prompt runs).

example (H200): kvdex bench --shape llama3-8b --contexts 32k,128k --batches 1 --budget 2048 --graph
"""


def parse_sizes(text: str) -> tuple[int, ...]:
    """'32k,128k,512k' -> (32768, 131072, 524288); plain integers pass through."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        mult = 1
        if item[-1] in "km":
            mult = 1024 if item[-1] == "k" else 1024 * 1024
            item = item[:-1]
        try:
            n = int(item) * mult
        except ValueError:
            raise ValueError(f"not a size: {item!r} (use e.g. 32k,128k or 4096)") from None
        if n < 1:
            raise ValueError(f"sizes must be positive, got {n}")
        out.append(n)
    if not out:
        raise ValueError("empty size list")
    return tuple(out)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shape", default="llama3-8b", help=f"model shape: {', '.join(shapes.shape_names())}")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32 (default %(default)s)")
    p.add_argument("--device", default="cuda", help="cuda | cpu (default %(default)s)")
    p.add_argument("--contexts", default="32k,128k", help="context lengths, e.g. 32k,128k,512k")
    p.add_argument("--batches", default="1", help="batch sizes, e.g. 1,8 (default %(default)s)")
    p.add_argument("--policies", default="quest", help="kvdex policies, comma separated (default %(default)s)")
    p.add_argument("--storages", default="device,offload", help="device and/or offload (default %(default)s)")
    p.add_argument(
        "--baselines",
        default=",".join(runner.HF_METHODS),
        help="transformers caches to compare: hf/dynamic, hf/offloaded, or none",
    )
    g = p.add_argument_group("cache (kvdex.CacheConfig)")
    add_cache_options(g, exclude=CACHE_EXCLUDED, defaults={"budget": runner.BenchConfig.budget})
    p.add_argument("--steps", type=int, default=100, help="timed decode steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--split-steps", type=int, default=10, help="extra steps with phase timing (0: no split)")
    p.add_argument("--check-context", type=int, default=2048, help="context of the full-budget check")
    p.add_argument("--no-check", action="store_true", help="skip the full-budget == dense check")
    p.add_argument(
        "--graph",
        action="store_true",
        help="also run each kvdex method through CUDA graphs (POLICY/STORAGE+graph, kvdex.hf.graph), "
        "checked against eager first",
    )
    p.add_argument("--graph-only", action="store_true", help="only the graph variants of the kvdex methods")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also the graph variants with the model's decoder layers compiled by torch.compile "
        "(POLICY/STORAGE+graph+compile; inductor fuses RMSNorm/RoPE/SiLU; kvdex's cache and attention stay "
        "eager); implies --graph",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="prefill in forwards of N tokens (KV goes to host as chunks finish; device memory stays flat); "
        "0 = one forward (default)",
    )
    p.add_argument(
        "--kv",
        default="prompt",
        help="prompt: each method prefills a prompt through the model (default); random: each method's cache "
        "is filled with seeded N(0,1) keys/values (and observation queries) of the context length per layer, "
        "through the same ingest as a prefill; decode timings only (its fill time is fill_s, not prefill)",
    )
    p.add_argument("--model", default=None, help="a real model (HF dir/id or .gguf via kvdex.load) instead of --shape")
    p.add_argument("--text", default=None, help="with --model: prompt text file (.txt, or .json with a 'text' field)")
    p.add_argument("--out", default=None, help="output folder (default runs/bench/<shape>-<time>)")
    p.set_defaults(func=run)
    return p


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="decode speed and memory of kvdex vs transformers' caches",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return build_parser(p)


def config_from_args(args: argparse.Namespace) -> runner.BenchConfig:
    storages = _names(args.storages)
    bad = [s for s in storages if s not in ("device", "offload")]
    if bad:
        raise ValueError(f"--storages: unknown {', '.join(bad)}; use device and/or offload")
    baselines = () if args.baselines.strip().lower() in ("", "none") else _names(args.baselines)
    bad = [b for b in baselines if b not in runner.HF_METHODS]
    if bad:
        raise ValueError(f"--baselines: unknown {', '.join(bad)}; use {', '.join(runner.HF_METHODS)} or none")
    if args.steps < 1 or args.warmup < 0 or args.split_steps < 0:
        raise ValueError("--steps must be >= 1, --warmup and --split-steps >= 0")
    shapes.make_config(args.shape)  # unknown shape: ValueError now
    if args.prefill_chunk < 0:
        raise ValueError("--prefill-chunk must be >= 0")
    if args.page_cache and "offload" not in storages:
        raise ValueError("--page-cache applies to offloaded methods: add offload to --storages, or drop --page-cache")
    cache = cache_config_from_args(args, offload="offload" in storages)  # bad sizes: ValueError now
    for name, path in (("--model", args.model), ("--text", args.text)):
        if path and path.endswith((".gguf", ".txt", ".json")) and not Path(path).is_file():
            raise ValueError(f"{name}: file not found: {path}")
    if args.text and not args.model:
        raise ValueError("--text needs --model (random weights have no tokenizer)")
    return runner.BenchConfig(
        shape=Path(args.model).stem if args.model else args.shape,
        dtype=args.dtype,
        device=args.device,
        contexts=parse_sizes(args.contexts),
        batches=parse_sizes(args.batches),
        policies=_names(args.policies),
        storages=storages,
        baselines=baselines,
        budget=cache.budget,
        page_size=cache.page_size,
        sink=cache.sink,
        window=cache.window,
        dense_layers=cache.dense_layers,
        steps=args.steps,
        warmup=args.warmup,
        split_steps=args.split_steps,
        check_context=args.check_context,
        check=not args.no_check,
        graph="only" if args.graph_only else (args.graph or args.compile),
        compile=args.compile,
        page_cache=cache.page_cache,
        prefill_chunk=args.prefill_chunk,
        model=args.model,
        text=args.text,
        kv=args.kv,
    )


def run(args: argparse.Namespace) -> int:
    from kvdex.bench import report

    cfg = config_from_args(args)
    out = Path(args.out or f"runs/bench/{cfg.shape}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = runner.run(cfg, log=lambda s: print(s, flush=True))
    report.write_json(result, out / "bench.json")
    print()
    print(report.table(result))
    drew = report.plot(result, out / "bench.png")
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if drew else ""))
    if result.get("error"):
        print(f"kvdex bench: {result['error']}")
        return 1
    return 0
