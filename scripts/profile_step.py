"""Where a decode step's device time goes: per-kernel time of eager decode steps, one table per policy.

A random-weight model of a named shape (``kvdex bench``'s shapes), each policy's cache filled with random
keys/values of ``--context`` tokens (``kvdex.bench.decoding.fill_random``: decode time does not depend on
what the keys hold), a few warm-up steps, then ``--steps`` eager steps under ``torch.profiler``. Prints,
per policy, the device microseconds per step in all and the ``--top`` kernels by time (time per step, calls
per step, name). Eager steps launch the same kernels as a captured step (a CUDA graph replays them), so the
table says which kernels a policy's selection costs; the launch gaps of eager decoding are not in it.
``--captured`` (CUDA only) profiles the steps as ``kvdex bench``'s ``+graph+compile`` methods run them instead:
replayed from CUDA graphs with the decoder layers compiled, after a warm-up that captures every variant of
the step (the compiled model's fused kernels replace its eager ones in the table).
On the CPU (``--device cpu``) it times CPU ops instead, for trying the script out::

    PYTHONPATH=$PWD python scripts/profile_step.py --shape llama3-8b --context 131072 --budget 2048 \\
        --policies quest,quest:rerank=4:rerank_group=weight
"""

from __future__ import annotations

import argparse
import collections
import gc
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

import kvdex
from kvdex.bench.decoding import decode_step, fill_random
from kvdex.bench.runner import WARMUP_PAGES
from kvdex.bench.shapes import build_model, shape_names
from kvdex.bench.timing import make_stepper, warm_up
from kvdex.hf.graph import GraphDecoder


def kernel_table(
    model, policy: str, context: int, batch: int, budget: int, steps: int, warmup: int, captured: bool = False, **kw
):
    """(device microseconds per step, [(microseconds per step, calls per step, kernel name)]) of ``policy``;
    ``captured``: steps replayed from CUDA graphs with the layers compiled (``kvdex.bench``'s graph decoder)."""
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    cache = kvdex.Cache(model, policy, budget, **kw)
    fill_random(model, cache, context, batch, 0)
    nxt = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    if captured:  # as kvdex bench warms a graph method up: until a page of steps in a row captured nothing
        graph = GraphDecoder(model, cache, batch, compile=True)
        step = make_stepper(model, cache, graph)
        ps = cache.config.page_size
        nxt, _ = warm_up(step, nxt, warmup, graph.counts, quiet=ps, most=WARMUP_PAGES * ps)
    else:
        step = partial(decode_step, model, cache)
        for _ in range(warmup):
            nxt, _ = step(nxt)
    if cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            nxt, _ = step(nxt)
        if cuda:
            torch.cuda.synchronize(dev)
    time, calls = collections.Counter(), collections.Counter()
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda or (not cuda and e.cpu_parent is not None):  # CPU: top-level ops only
            continue
        us = e.device_time_total if cuda else e.cpu_time_total
        time[e.name] += us / steps
        calls[e.name] += 1
    del cache, step
    gc.collect()
    rows = sorted(((t, calls[n] / steps, n) for n, t in time.items()), reverse=True)
    return sum(time.values()), rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=shape_names())
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--policies", default="full,quest")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--captured", action="store_true", help="CUDA-graph replays of compiled steps (CUDA only)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.captured and dev.type != "cuda":
        p.error("--captured replays CUDA graphs: it needs --device cuda (leave it out to profile eager steps)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_model(a.shape, dtype, dev, max_positions=a.context + a.warmup + a.steps + 16)
    kvdex.enable(model)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{a.shape}, {a.context} tokens, batch {a.batch}, budget {a.budget}, {name}, torch {torch.__version__}")
    for policy in a.policies.split(","):
        total, rows = kernel_table(
            model, policy, a.context, a.batch, a.budget, a.steps, a.warmup, a.captured, dense_layers=a.dense_layers
        )
        print(f"\n== {policy}: {total:.0f} us per step ({'device' if dev.type == 'cuda' else 'CPU'} time)")
        for us, n, kernel in rows[: a.top]:
            print(f"  {us:9.1f} us  x{n:5.0f}  {kernel[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
