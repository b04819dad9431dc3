"""GPU check of ``GraphDecoder(compile=True)``: the model's decoder layers through torch.compile inside
kvdex's CUDA-graph decode step (docs/bench/compile.md).

1. correctness: graph / graph+compile decoding vs uncompiled eager decoding, 40 teacher-forced steps
   (``kvdex.bench.runner.check_graph``: max |dlogit| / max |logit|, several page boundaries);
2. kernels per decode step (one eager step under torch.profiler, the kernels a replay launches),
   split into the model's own work and kvdex's (cache update + attention), without / with compile;
3. speed: per (storage, context) one prefilled cache, decoded first by a plain graph decoder, then by
   a compiled one (``--warmup`` steps each first; the compiled decoder compiles there, timed as
   ``compile s``), ``--steps`` timed steps each (CUDA events per step): median / mean ms per token.

Prints a short table last and writes compile.json (to $OUT when set, else --out).

H200 (~4-5 min):   PYTHONPATH=$PWD python3 scripts/gpu_compile.py
CPU smoke test:    python scripts/gpu_compile.py --device cpu --dtype float32 --shape tiny --contexts 256 \
                       --offload-context 0 --steps 5 --warmup 2 --check-context 128
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdex.bench import runner, shapes  # noqa: E402
from kvdex.bench.cli import parse_sizes  # noqa: E402
from kvdex.bench.compile import step_kernels  # noqa: E402
from kvdex.integration.graph import GraphDecoder  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dec: GraphDecoder, nxt: torch.Tensor, steps: int, dev) -> tuple[list[float], list[bool], torch.Tensor]:
    """Per-step ms (CUDA events on CUDA) of greedy decoding through ``dec``, and whether each step ran
    eagerly (a page boundary) rather than from a replay."""
    ms, eager = [], []
    if dev.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        sync(dev)
        for a, b in ev:
            e0 = dec.counts["eager"]
            a.record()
            nxt = dec.step(nxt).argmax(-1, keepdim=True)
            b.record()
            eager.append(dec.counts["eager"] > e0)
        sync(dev)
        ms = [a.elapsed_time(b) for a, b in ev]
    else:
        for _ in range(steps):
            e0 = dec.counts["eager"]
            t = time.perf_counter()
            nxt = dec.step(nxt).argmax(-1, keepdim=True)
            ms.append((time.perf_counter() - t) * 1e3)
            eager.append(dec.counts["eager"] > e0)
    return ms, eager, nxt


def speed_rows(model, storage: str, context: int, cfg: runner.BenchConfig, args, dev) -> list[dict]:
    """One prefilled cache, decoded by a graph decoder, then by a compiled graph decoder."""
    method = f"quest/{storage}"
    cache = runner.make_cache(model, method, cfg)
    ids = runner._prompt(1, context, model.config.vocab_size, cfg.seed + context, dev)
    sync(dev)
    t = time.perf_counter()
    logits = runner._prefill(model, cache, ids, cfg.prefill_chunk)
    sync(dev)
    prefill_s = time.perf_counter() - t
    del ids
    nxt = logits.argmax(-1, keepdim=True)
    rows = []
    for compiled in (False, True):
        name = f"{method}+graph" + ("+compile" if compiled else "")
        row = dict(method=name, context=context, prefill_s=round(prefill_s, 2))
        try:
            dec = GraphDecoder(model, cache, 1, compile=compiled)
            t = time.perf_counter()
            for _ in range(args.warmup):
                nxt = dec.step(nxt).argmax(-1, keepdim=True)
            sync(dev)
            row["warmup_s"] = round(time.perf_counter() - t, 2)
            ms, eager, nxt = timed(dec, nxt, args.steps, dev)
            em = [x for x, e in zip(ms, eager, strict=True) if e]
            rm = [x for x, e in zip(ms, eager, strict=True) if not e]
            row.update(
                ms_median=statistics.median(ms),
                ms_mean=statistics.fmean(ms),
                ms_min=min(ms),
                ms_replay_median=statistics.median(rm) if rm else None,
                ms_eager_median=statistics.median(em) if em else None,  # page-boundary steps
                counts=dict(dec.counts),
                graph_reason=dec.reason,
            )
            if compiled:
                c = dec.compiled
                row.update(
                    compile_s=None if c is None else round(c.compile_s, 2),
                    compiled_graphs=None if c is None else c.graphs,
                    compile_reason=dec.compile_reason,
                )
            if args.kernels and context == min(parse_sizes(args.contexts)) and storage == "device":
                k = step_kernels(dec, nxt)  # one eager step, profiled (advances the cache by a token)
                row["kernels"] = {key: k[key] for key in ("model", "kvdex", "unattributed", "total")}
                row["kernels_top"] = dict(list(k["by_name"].items())[:25])
            log(
                f"{name:<28} ctx {context:>7}: median {row['ms_median']:.2f} ms/token (mean {row['ms_mean']:.2f}, "
                f"min {row['ms_min']:.2f}, eager steps {row['ms_eager_median']}) {row['counts']}"
                + (f" compile {row.get('compile_s')} s, {row.get('compiled_graphs')} graphs" if compiled else "")
                + (f" kernels/step {row['kernels']}" if "kernels" in row else "")
                + (f" [graph off: {dec.reason}]" if dec.reason else "")
                + (f" [compile off: {dec.compile_reason}]" if compiled and dec.compile_reason else "")
            )
            del dec
        except Exception as e:  # report and go on with the next row
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(f"{name} ctx {context}: ERROR {row['error']}")
            traceback.print_exc()
        rows.append(row)
        gc.collect()
    del cache
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="32k,128k", help="device-resident rows (quest/device)")
    ap.add_argument("--offload-context", default="128k", help="the quest/offload row's context (0: none)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--page-cache", type=int, default=0, help="offload row: device page-cache slots (0: off)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--check-context", type=int, default=2048)
    ap.add_argument("--check-steps", type=int, default=40)
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip the profiled kernel counts")
    ap.add_argument("--out", default="runs/compile")
    args = ap.parse_args()

    dev = torch.device(args.device)
    dtype = runner._dtype(args.dtype)
    contexts = parse_sizes(args.contexts)
    off_ctx = parse_sizes(args.offload_context)[0] if args.offload_context not in ("0", "") else 0
    cfg = runner.BenchConfig(
        shape=args.shape,
        dtype=args.dtype,
        device=args.device,
        contexts=contexts,
        batches=(1,),
        policies=("quest",),
        storages=("device", "offload"),
        baselines=(),
        budget=args.budget,
        steps=args.steps,
        warmup=args.warmup,
        split_steps=0,
        check_context=args.check_context,
        graph=True,
        compile=True,
        page_cache=args.page_cache,
    )
    result = dict(args=vars(args), versions=runner.versions())
    log(f"versions {result['versions']}")
    model = shapes.build_model(args.shape, dtype, dev, max(contexts + (off_ctx,)) + 2 * args.steps + 1024, 0)
    log(f"model {args.shape}: {shapes.param_bytes(model) / 1e9:.1f} GB {args.dtype} on {dev}")

    # 1. correctness (also the first compile, at the check's shapes: batch 1, one token)
    checks = []
    methods = ["quest/device+graph", "quest/device+graph+compile"]
    if off_ctx:
        methods += ["quest/offload+graph+compile"]
    for m in methods:
        try:
            c = runner.check_graph(model, cfg, [m], steps=args.check_steps)[0]
        except Exception as e:
            c = dict(method=m, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc()
        checks.append(c)
        log(f"check {m:<28} vs eager: {c}")
    result["checks"] = checks

    # 2 + 3. kernels and speed
    rows = []
    for ctx in contexts:
        rows += speed_rows(model, "device", ctx, cfg, args, dev)
    if off_ctx:
        if dev.type != "cuda":
            log("offload row skipped: needs CUDA")
        else:
            rows += speed_rows(model, "offload", off_ctx, cfg, args, dev)
    result["rows"] = rows

    out = Path(os.environ.get("OUT") or args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=2, default=str))

    print("\n== checks: graph(+compile) vs uncompiled eager, 40 teacher-forced steps ==")
    for c in checks:
        print(
            f"{c['method']:<28} max rel dlogit {c.get('max_rel', float('nan')):.2e}  ok {c.get('ok')}  "
            f"counts {c.get('counts')}  compile_s {c.get('compile_s', '-')}  {c.get('error', '') or ''}"
        )
    print(f"\n== ms/token (median over {args.steps} steps; mean includes the eager page-boundary steps) ==")
    print(
        f"{'method':<28} {'ctx':>7} {'median':>8} {'mean':>8} {'eager step':>10} {'compile s':>9} "
        f"{'kernels model/kvdex/total':>26}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<28} {r['context']:>7} ERROR {r['error'][:100]}")
            continue
        k = r.get("kernels")
        ks = f"{k['model']}/{k['kvdex']}/{k['total']}" if k else "-"
        cs = r.get("compile_s")
        es = r.get("ms_eager_median")
        print(
            f"{r['method']:<28} {r['context']:>7} {r['ms_median']:>8.2f} {r['ms_mean']:>8.2f} "
            f"{'-' if es is None else f'{es:.2f}':>10} {'-' if cs is None else cs:>9} {ks:>26}"
        )
    print(f"\nwrote {out / 'compile.json'}; total {time.perf_counter() - T0:.0f} s")
    return 0 if all(c.get("ok") for c in checks) and not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
