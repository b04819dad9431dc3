"""Where a decode step's time goes on the GPU: kernel launches and GPU-busy time per step.

Builds the random-weight model once, prefills each method at one context, then profiles a few
decode steps with torch.profiler: wall ms per step, CUDA kernels launched per step, and the sum of
their GPU time. wall >> GPU time means the step is launch/CPU bound (what a CUDA graph removes); for a
``+graph`` method the kernels per step are the graph's nodes (steps that start a page run eagerly).

    PYTHONPATH=$PWD python scripts/gpu_step_profile.py --shape llama3-8b --context 32768
    PYTHONPATH=$PWD python scripts/gpu_step_profile.py --context 131072 --methods quest/device+graph+compile \
        --kernels 25
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvdex.bench import runner, shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--methods", default="quest/device,quest/device+graph,quest/offload+graph,hf/dynamic")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--kernels", type=int, default=0, help="print the N kernels with the most GPU time per step")
    a = ap.parse_args()
    cfg = runner.BenchConfig(shape=a.shape, budget=a.budget)
    model = shapes.build_model(a.shape, torch.bfloat16, "cuda", a.context + 1024)
    print(f"{'method':<16} {'wall ms/step':>12} {'GPU ms/step':>12} {'kernels/step':>12}  top kernels (GPU ms/step)")
    for method in a.methods.split(","):
        cache = runner.make_cache(model, method, cfg)
        ids = torch.randint(1, model.config.vocab_size, (a.batch, a.context), device="cuda")
        nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
        graph = None
        if "+graph" in method:  # METHOD+graph or METHOD+graph+compile
            from kvdex.bench.graph import GraphDecoder

            graph = GraphDecoder(model, cache, a.batch, compile=method.endswith("+compile"))
        step = runner._stepper(model, cache, graph)
        for _ in range(20):  # past the first capture
            nxt, _ = step(nxt)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                nxt, _ = step(nxt)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / a.steps
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu = sum(e.device_time for e in kern) / 1e3 / a.steps
        by = {}
        for e in kern:
            by[e.name] = by.get(e.name, 0.0) + e.device_time / 1e3 / a.steps
        cnt = {}
        for e in kern:
            cnt[e.name] = cnt.get(e.name, 0) + 1 / a.steps
        ranked = sorted(by.items(), key=lambda x: -x[1])
        top = ", ".join(f"{n[:40]} {t:.2f}" for n, t in ranked[:4])
        print(f"{method:<16} {wall:>12.2f} {gpu:>12.2f} {len(kern) / a.steps:>12.0f}  {top}", flush=True)
        if a.kernels:  # the per-kernel split of the step's GPU time
            for n, t in ranked[: a.kernels]:
                print(f"    {t:>7.3f} ms  {cnt[n]:>6.0f}x  {n[:110]}", flush=True)
            rest = sum(t for _, t in ranked[a.kernels :])
            print(f"    {rest:>7.3f} ms  (the other {max(0, len(ranked) - a.kernels)} kernel names)", flush=True)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
