"""Decode speed of the user's path: plain ``model.generate(..., cache=kvdex.Cache(model, policy, budget))``
exactly as the README calls it (no kvdex-specific call: transformers compiles the decode step of the
compileable kvdex cache on CUDA, kvdex replays one graph per layer), next to transformers' own
``DynamicCache`` through the same ``model.generate`` and to ``kvdex.generate``'s decode loop
(``GraphDecoder``, whole-step CUDA graphs).

The context is filled with random keys and values (``kvdex bench --kv random``: decode time does not
depend on what the keys hold); the model has random weights of the named shape. Times are ms per token
over the decode steps (the first generated token, a one-token prefill, excluded): ``median`` of the gaps
between tokens (steady state), ``mean`` over all decode steps after the first ``--skip``; each method runs
once untimed first (compilation, captures), then ``--repeats`` timed runs on fresh caches (best run kept).

    python scripts/bench_user_path.py --shape qwen2.5-0.5b --contexts 32k --batches 1 --budget 256 \\
        --policies quest,chess,pariskv,prkv --new-tokens 128 --out user_path.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import kvdex
from kvdex.bench import shapes
from kvdex.bench.decoding import fill_random, make_prompt, sync_device
from kvdex.hf.cache import dynamic_cache
from kvdex.hf.compat import TRANSFORMERS_VERSION, cache_kwargs
from kvdex.hf.graph import GraphDecoder


class _Stamps(StoppingCriteria):
    def __init__(self, device):
        self.device, self.t = device, []

    def __call__(self, input_ids, scores, **kw):
        sync_device(self.device)
        self.t.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _times(stamps: list[float], skip: int) -> dict:
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]  # gaps[0]: the first decode step
    steady = gaps[skip:] or gaps
    return {"median_ms": statistics.median(steady), "mean_ms": statistics.fmean(steady), "steps": len(steady)}


def _cache(model, method: str, args):
    if method == "dynamic":
        return dynamic_cache(model)
    return kvdex.Cache(model, method.split(":", 1)[1], args.budget)


def user_path(model, method, context, batch, args) -> dict:
    """``model.generate`` of ``--new-tokens`` tokens after a ``context``-token cache (the ids of the context
    are random: generate feeds only the token past the cache)."""
    dev = next(model.parameters()).device
    best = None
    for rep in range(args.repeats + 1):
        cache = _cache(model, method, args)
        fill_random(model, cache, context, batch, args.seed)
        ids = make_prompt(batch, context + 1, model.config.vocab_size, args.seed + 1, dev)
        stamps = _Stamps(dev)
        n = args.new_tokens if rep else min(args.new_tokens, 16)
        model.generate(
            ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, stopping_criteria=StoppingCriteriaList([stamps]),
        )  # fmt: skip
        if rep:
            r = _times(stamps.t, args.skip)
            if isinstance(cache, kvdex.Cache):
                r["step_graphs"] = dict(cache.step_graphs.counts)
                r["step_graphs_off"] = cache.step_graphs.reason
            best = r if best is None or r["median_ms"] < best["median_ms"] else best
    return best


def graph_decoder(model, method, context, batch, args) -> dict:
    """``kvdex.generate(cuda_graph=True)``'s decode loop (GraphDecoder) on the same filled cache."""
    dev = next(model.parameters()).device
    best = None
    for rep in range(args.repeats + 1):
        cache = _cache(model, method, args)
        fill_random(model, cache, context, batch, args.seed)
        dec = GraphDecoder(model, cache)
        nxt = make_prompt(batch, 1, model.config.vocab_size, args.seed + 1, dev)
        stamps = []
        for _ in range(args.new_tokens if rep else 16):
            nxt = dec.step(nxt).argmax(-1, keepdim=True)
            sync_device(dev)
            stamps.append(time.perf_counter())
        if rep:
            r = _times([stamps[0], *stamps], args.skip)
            r["graph_counts"] = dict(dec.counts)
            best = r if best is None or r["median_ms"] < best["median_ms"] else best
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", help=f"one of {', '.join(shapes.shape_names())}")
    p.add_argument("--contexts", default="32k")
    p.add_argument("--batches", default="1")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--policies", default="quest,chess,pariskv,prkv")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip", type=int, default=4, help="decode steps left out of the mean (captures)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graph-decoder", action="store_true", help="skip the kvdex.generate column")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args(argv)
    ctxs = [int(c[:-1]) * 1024 if c.endswith("k") else int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    pols = [x for x in args.policies.split(",") if x]
    dtype = getattr(torch, args.dtype)
    records = []
    for ctx in ctxs:
        model = shapes.build_model(args.shape, dtype, args.device, max_positions=ctx + args.new_tokens + 64)
        kvdex.enable(model)
        for b in batches:
            runs = [("model.generate", "dynamic", user_path)]
            for pol in pols:
                runs.append(("model.generate", f"kvdex:{pol}", user_path))
                if not args.no_graph_decoder:
                    runs.append(("kvdex.generate", f"kvdex:{pol}", graph_decoder))
            for path, method, fn in runs:
                r = {"path": path, "method": method, "context": ctx, "batch": b, "shape": args.shape,
                     "budget": args.budget, **fn(model, method, ctx, b, args)}  # fmt: skip
                records.append(r)
                print(
                    f"{ctx:>7} b{b} {path:<15} {method:<16} median {r['median_ms']:8.3f} ms/token  "
                    f"mean {r['mean_ms']:8.3f}  {r.get('step_graphs', r.get('graph_counts', ''))}",
                    flush=True,
                )
        del model
    meta = {"torch": torch.__version__, "transformers": TRANSFORMERS_VERSION, "device": str(args.device)}
    if args.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "args": vars(args), "records": records}, f, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
