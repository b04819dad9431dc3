"""CHESS on the GPU: selection overhead as a share of step time, and rebuild rates.

    PYTHONPATH=. python scripts/gpu_chess.py overhead --model /tmp/m/qwen.gguf --lengths 8k,16k,32k
    PYTHONPATH=. python scripts/gpu_chess.py rebuilds --model /tmp/m/qwen.gguf --data /tmp/m/evaldata \
        --thresholds chess_thresholds.json

``overhead`` (the paper's Figure 8 claim: selection is 0.72% / 0.98% / 1.49% of a step at 8k /
16k / 32k): per context length, a prompt of real text is prefilled into a CHESS cache (page size 32,
the Aggressive preset) and decoded greedily. Two passes of the same decode:

1. plain: device-event time per step (after warm-up), nothing else measured;
2. instrumented: every call into the policy (``index`` -- page vectors and centroids; ``select``;
   ``on_step`` -- entropy/varentropy, the trigger, and rebuilds: anchor + one GEMM + masking) is
   bracketed by synchronised timers.

share = policy time per step (pass 2) / step time (pass 1). Reported per trigger: ``uncertainty``
(the paper's), ``interval`` (Appendix C) and ``always`` (a rebuild every step: the worst case),
with ``full`` for reference. Correctness first: with every ratio 1 and trigger=always, the
logits equal full attention's on this model.

``rebuilds``: LongBench v1 prompts decoded (greedy, their answer lengths, at least --min-new tokens)
with the uncertainty trigger and with the fixed interval; prints rebuilds per generated page
(paper: ~1 per 10 pages for the trigger, 1 per 6 for the baseline). Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import kvdex
from kvdex.eval.cli import parse_sizes

SIZES = dict(page_size=32, sink=16, window=64, dense_layers=0)


def real_prompt(tok, length: int, data_root: str | None, seed: int = 0) -> list[int]:
    try:
        from kvdex.eval import data

        return data.long_text_samples(data.data_root(data_root), "books", tok, length, 0, 1, seed)[0].input_ids
    except (ValueError, OSError):  # no data on this machine: random ids (timing does not depend on text)
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, tok.vocab_size - 100, (length,), generator=g).tolist()


def instrument(policy) -> dict[str, float]:
    """Wrap the policy's entry points with synchronised timers; returns the accumulating dict."""
    acc = {"index": 0.0, "select": 0.0, "on_step": 0.0}
    for name in acc:
        fn = getattr(policy, name)

        def timed(*a, _fn=fn, _name=name, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            torch.cuda.synchronize()
            acc[_name] += (time.perf_counter() - t0) * 1e3
            return out

        setattr(policy, name, timed)
    return acc


@torch.inference_mode()
def decode(model, ids: list[int], policy: str, budget: int, steps: int, warmup: int, timed_policy: bool):
    cache = kvdex.Cache(model, policy, budget, **SIZES)
    acc = instrument(cache.policy) if timed_policy else None
    x = torch.tensor([ids], device=model.device)
    out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if acc is not None:
        acc.update(index=0.0, select=0.0, on_step=0.0)  # prefill indexing is not a decode cost
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    times, logits = [], []
    for i in range(warmup + steps):
        if i == warmup and acc is not None:
            acc.update(index=0.0, select=0.0, on_step=0.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        end.record()
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        logits.append(out.logits[0, -1].float())
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    per_step = None if acc is None else {k: v / steps for k, v in acc.items()}
    return statistics.median(times), statistics.mean(times), per_step, cache, torch.stack(logits)


def cmd_overhead(args) -> dict:
    model, tok = kvdex.load(args.model, device="cuda", dtype=getattr(torch, args.dtype))
    rows = []
    for length in parse_sizes(args.lengths):
        ids = real_prompt(tok, length, args.data)
        # correctness first: every ratio 1, rebuilt every step == full attention
        _, _, _, _, ref = decode(model, ids, "full", 4096, 8, 0, False)
        _, _, _, _, got = decode(model, ids, "chess:rho_g=1:rho_c=1:rho_p=1:trigger=always", 4096, 8, 0, False)
        dlogit = float((ref - got).abs().max())
        full_med, full_mean, _, _, _ = decode(model, ids, "full", 4096, args.steps, args.warmup, False)
        for trig in ("uncertainty", "interval", "always"):
            spec = f"chess:preset={args.preset}:trigger={trig}"
            if args.thresholds and trig == "uncertainty":
                spec += f":thresholds={args.thresholds}"
            med, mean, _, _, _ = decode(model, ids, spec, 4096, args.steps, args.warmup, False)
            _, mean_i, parts, cache, _ = decode(model, ids, spec, 4096, args.steps, args.warmup, True)
            ps = cache.policy.stats()
            policy_ms = sum(parts.values())
            row = {
                "length": length,
                "trigger": trig,
                "step_ms_median": round(med, 3),
                "step_ms_mean": round(mean, 3),
                "full_step_ms_median": round(full_med, 3),
                "policy_ms_per_step": round(policy_ms, 4),
                "policy_parts_ms": {k: round(v, 4) for k, v in parts.items()},
                "share_of_step": round(policy_ms / mean, 5),
                "rebuilds": ps["rebuilds"],
                "selected_pages_mean": ps["selected_pages_mean"],
                "attended_tokens_per_step": cache.stats()["attended_tokens_per_step"],
                "dlogit_ratios1_vs_full": dlogit,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'len':>6} {'trigger':>11} {'ms/step':>8} {'full':>7} {'policy ms':>9} {'share':>7} {'rebuilds':>8}")
    for r in rows:
        print(
            f"{r['length']:>6} {r['trigger']:>11} {r['step_ms_median']:>8.2f} {r['full_step_ms_median']:>7.2f} "
            f"{r['policy_ms_per_step']:>9.3f} {100 * r['share_of_step']:>6.2f}% {r['rebuilds']:>8}"
        )
    return {"overhead": rows}


@torch.inference_mode()
def cmd_rebuilds(args) -> dict:
    from kvdex.eval.runner import forward_token, prefill, stop_token_ids
    from kvdex.eval.tasks.longbench import LongBenchTask

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # runs on the CPU too (small settings)
    model, tok = kvdex.load(args.model, device=dev, dtype=getattr(torch, args.dtype) if dev == "cuda" else "auto")
    datasets = [d for d in args.datasets.split(",") if d] or None
    task = LongBenchTask("v1", datasets=datasets, data_root=args.data)
    samples = task.samples(tok, parse_sizes(args.lengths)[0], args.samples, 0)
    stops = stop_token_ids(tok, model)
    specs = {
        "uncertainty": f"chess:preset={args.preset}"
        + (f":thresholds={args.thresholds}" if args.thresholds else "")
        + args.trigger_options,
        "interval": f"chess:preset={args.preset}:trigger=interval",
    }
    totals = {k: {"rebuilds": 0, "steps": 0, "checks": 0} for k in specs}
    for s in samples:
        base, logits = prefill(model, s.input_ids, SIZES)
        n = max(args.min_new, s.meta["max_new_tokens"])
        for name, spec in specs.items():
            cache = base.fork(spec, 4096)
            t = int(logits.argmax())
            for _ in range(n - 1):
                if t in stops and not args.ignore_eos:
                    break
                t = int(forward_token(model, cache, t).argmax())
            ps = cache.policy.stats()
            totals[name]["rebuilds"] += ps["rebuilds"]
            totals[name]["steps"] += ps["decode_steps"]
            totals[name]["checks"] += ps["checks"]
            totals[name].setdefault("page_stats", []).extend((h, v) for _, _, h, v in cache.policy.check_log)
        del base
    out = {}
    for name, t in totals.items():
        st = t.pop("page_stats", [])
        if st:  # where the checked pages sit relative to the thresholds
            hs, vs = torch.tensor([h for h, _ in st]), torch.tensor([v for _, v in st])
            t["page_entropy_p50_p90_max"] = [round(float(x), 3) for x in (hs.median(), hs.quantile(0.9), hs.max())]
            t["page_varentropy_p50_p90_max"] = [round(float(x), 3) for x in (vs.median(), vs.quantile(0.9), vs.max())]
            t["thresholds"] = list(kvdex.make_policy(specs[name])._tau)
        pages = t["steps"] / SIZES["page_size"]
        out[name] = {**t, "pages": pages, "pages_per_rebuild": pages / t["rebuilds"] if t["rebuilds"] else None}
        print(name, json.dumps(out[name]))
    return {"rebuilds": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("overhead", "rebuilds"))
    p.add_argument("--model", default="/tmp/m/qwen.gguf")
    p.add_argument("--data", default=None, help="evaluation data (default $KVDEX_DATA, ../shared/evaldata)")
    p.add_argument("--lengths", default="8k,16k,32k")
    p.add_argument("--preset", default="aggressive")
    p.add_argument("--thresholds", default="", help="kvdex calibrate chess output (default: built-in thresholds)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--samples", type=int, default=2, help="rebuilds: LongBench v1 samples per dataset")
    p.add_argument(
        "--datasets", default="gov_report,qmsum,multi_news,samsum,lcc", help="rebuilds: LongBench v1 datasets"
    )
    p.add_argument("--min-new", type=int, default=256, help="rebuilds: generated tokens per sample at least")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--trigger-options", default="", help="rebuilds: appended to the uncertainty spec, e.g. :combine=or")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.what == "overhead" and not torch.cuda.is_available():
        sys.exit("overhead needs a CUDA device")
    res = cmd_overhead(args) if args.what == "overhead" else cmd_rebuilds(args)
    res["environment"] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
