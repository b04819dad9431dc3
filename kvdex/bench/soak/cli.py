"""``kvdex soak`` (``python -m kvdex.bench.soak``): does memory stay flat over thousands of decode steps?

For each row (``POLICY[:OPTIONS]/device`` or ``/offload``) a random-weight model of a named shape
(:mod:`kvdex.bench.shapes`) prefills a context into a fresh :class:`kvdex.Cache`, then decodes ``--steps``
greedy steps through :class:`~kvdex.hf.graph.GraphDecoder`, the loop of ``kvdex.generate``
(CUDA graphs on the GPU where the cache can be captured, eager steps elsewhere). After ``--warmup``
steps, every ``--every`` steps (after a device synchronisation) it samples:

* ``device``: ``torch.cuda.memory_allocated`` (CUDA; ``device_reserved``: ``memory_reserved``), or on a
  CPU the bytes of every live tensor Python can reach (``tensor_bytes``, exact where RSS is noisy);
* ``rss``: the process's resident host memory (``/proc/self/statm``);
* ``tensors`` and ``objects``: live torch tensors and objects the cyclic collector tracks
  (``gc.get_objects()``): a per-step leak of Python state shows here first.

Each series is fitted by least squares against the step (its slope, per step) and reported with its
growth from the first to the last sample. A decode context grows by one token per step: that growth
is expected. By default (``--reserve``) every store and the policy's index are sized up front for
``context + steps`` tokens (``LayerStore.reserve_join``, ``Policy.reserve_index``: what the CUDA-graph
decoder reserves a few pages ahead), so memory should not move at all; with ``--no-reserve`` buffers grow
as in normal decoding (by a quarter of their size at a time, so the series are steps) and the expected KV
growth, ``layers x kv_heads x head_dim x 2 x dtype bytes x batch`` per step where the KV lives, is
subtracted. ``excess`` = slope - expected. A row is *flat* when, for device memory, tensors and objects,
the excess stays within ``--tolerance`` (a fraction of one token's KV per step for bytes; objects per step
for counts); host RSS is judged with ``--rss-tolerance`` (bytes per step: the allocator's own noise).
Exit status 1 when a row is not flat.

Writes ``--out`` (JSON: the configuration, every row's samples, fits and verdict) and prints a table.

    kvdex soak --shape tiny --device cpu --dtype float32 --context 512 --steps 300 --out soak.json
    kvdex soak --shape qwen2.5-0.5b --device cuda --context 32k --steps 10000 --max-minutes 7 --out soak.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from kvdex.bench.soak.config import SoakConfig
from kvdex.bench.soak.report import table
from kvdex.bench.soak.runner import run

# `kvdex soak --help`: this module's docstring without its first line and its examples
DESCRIPTION = __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
EPILOG = """\
example (CPU, seconds): kvdex soak --shape tiny --device cpu --dtype float32 --context 512 --steps 300 \\
    --out soak.json
example (one H100): kvdex soak --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --context 32k --steps 10000 \\
    --kv random --max-minutes 7 --out soak.json
"""


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = SoakConfig()
    p.add_argument("--shape", default=d.shape, help="model shape (kvdex.bench.shapes; default %(default)s)")
    p.add_argument("--dtype", default=d.dtype, help="bfloat16 | float16 | float32 (default %(default)s)")
    p.add_argument("--device", default=d.device, help="cpu | cuda (default %(default)s)")
    p.add_argument("--context", default=str(d.context), help="prompt tokens before decoding, e.g. 32k")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps per row (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps before sampling (-1: min(steps/10, 500))")
    p.add_argument("--every", type=int, default=d.every, help="sample every K steps (0: about 40 samples)")
    p.add_argument("--rows", default=",".join(d.rows), help="POLICY[:OPTIONS]/device|offload, comma separated")
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--page-cache", type=int, default=d.page_cache, help="offloaded rows' device page cache")
    p.add_argument("--dense-layers", type=int, default=d.dense_layers)
    p.add_argument("--no-reserve", dest="reserve", action="store_false",
                   help="let buffers grow as in normal decoding (the expected KV growth is subtracted)")  # fmt: skip
    p.add_argument("--kv", default=d.kv, help="prompt (a prefill) or random (random keys/values, no prefill)")
    p.add_argument("--no-objects", dest="objects", action="store_false", help="skip the tensor / object counts")
    p.add_argument("--tolerance", type=float, default=d.tolerance, help="device bytes per step, x one token's KV")
    p.add_argument("--object-tolerance", type=float, default=d.object_tolerance)
    p.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance, help="RSS bytes per step")
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="stop rows early to end in time")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="soak.json", help="the JSON result (default %(default)s)")
    p.set_defaults(func=cmd)
    return p


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    from kvdex.bench.cli import parse_sizes

    (context,) = parse_sizes(args.context)
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    fields = {f.name for f in dataclasses.fields(SoakConfig)}
    kw = {k: v for k, v in vars(args).items() if k in fields and k not in ("context", "rows")}
    return SoakConfig(context=context, rows=rows, **kw)


def cmd(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    result = run(cfg, log=lambda s: print(s, flush=True))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=_json_default))
    print()
    print(table(result))
    print(f"\nwrote {out}")
    return 0 if result["ok"] else 1


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "soak",
        help="memory over thousands of decode steps per policy and storage (flat after warm-up?)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return build_parser(p)


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    prog = "python -m kvdex.bench.soak"
    parser = build_parser(
        argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    )
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
