"""The user's path on CUDA: plain ``model.generate(..., cache=kvdex.Cache(model, policy, budget))`` exactly as
the README calls it (transformers compiles the decode step of the compileable kvdex cache, kvdex replays one
CUDA graph per layer), checked and timed next to transformers' ``DynamicCache`` through the same
``model.generate`` and to ``kvdex.generate``'s decode loop (``GraphDecoder``: whole-step CUDA graphs).

One run, in this order, each phase's outcome recorded even when it fails:

1. ``mechanism`` (a subprocess): whether destroying a CUDA graph inside another capture invalidates that
   capture on this torch (a stray graph in a reference cycle, collected inside a capture), with and without
   ``kvdex.engine.graphs.gc_paused``;
2. ``unfixed`` (a subprocess, ``--no-unfixed`` skips it): the sequence of the first failing GPU run (DynamicCache
   repeats, then quest's plain generate at the largest context, repeated on fresh caches) with kvdex's
   capture-safety switched off (collector not paused, the cache's plan holding it strongly, graphs freed
   whenever their owner goes): does it fail as that run did, and did a collection run inside a capture;
3. ``correctness``: greedy tokens of plain generate (compiled; compiled with ``step_graphs=False``; with
   ``disable_compile=True``) and of ``kvdex.generate(cuda_graph=True)`` against
   ``kvdex.generate(cuda_graph=False)`` (eager), quest, a ``--check-context`` prompt through a real prefill
   (the eager model with step graphs must match exactly; compiled ones may differ by inductor's rounding);
4. ``bench``: ms per token at each context for DynamicCache and, per policy, kvdex's plain generate and
   ``kvdex.generate``'s loop. Context filled with random keys/values (decode time does not depend on them),
   random weights of the shape; the first ``--skip`` decode steps (captures) left out; best of ``--repeats``
   timed runs after one untimed run, each on a fresh cache.

Every CUDA graph capture in the process is watched (``torch.cuda.graph`` wrapped): its owner (kvdex's layer
``i`` / GraphDecoder / inductor), collections that ran inside it, and, in kvdex's captures, the first aten op
after which the stream's capture was invalidated, with its Python stack (no ``CUDA_LAUNCH_BLOCKING``).
Writes ``user_path.json`` and ``user_path.md`` (a table) to ``$OUT`` (default ``./out``)::

    OUT=out PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python scripts/bench_user_path.py --budget-s 300
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StoppingCriteria, StoppingCriteriaList

import kvdex
from kvdex.bench import shapes
from kvdex.bench.decoding import fill_random, make_prompt, sync_device
from kvdex.hf.cache import dynamic_cache
from kvdex.hf.compat import TRANSFORMERS_VERSION, cache_kwargs
from kvdex.hf.graph import GraphDecoder

T0 = time.perf_counter()


# ---- watching captures ---------------------------------------------------------------------------------
class CaptureWatch:
    """Every ``torch.cuda.graph`` capture: owner, collections inside, first op after an invalidation."""

    def __init__(self):
        self.events: list[dict] = []
        self.count = 0
        self.active: dict | None = None
        self._mode = None
        self._libcuda = None
        with contextlib.suppress(OSError):
            self._libcuda = ctypes.CDLL("libcuda.so.1")

    def status(self) -> int:
        """The current stream's capture status (0 none, 1 active, 2 invalidated; -1 unknown)."""
        if self._libcuda is None:
            return -1
        s = ctypes.c_int(-1)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = self._libcuda.cuStreamIsCapturing(stream, ctypes.byref(s))
        return s.value if rc == 0 else -1

    def install(self) -> None:
        watch, base = self, torch.cuda.graph

        class Watched(base):
            def __enter__(self):
                owner = _owner(sys._getframe(1))
                r = super().__enter__()
                watch.begin(owner)
                return r

            def __exit__(self, *exc):
                watch.end(exc[1])
                return super().__exit__(*exc)

        torch.cuda.graph = Watched
        gc.callbacks.append(self._gc)

    def begin(self, owner: str) -> None:
        self.active = {"owner": owner, "gc": [], "invalidated_after": None, "t": round(time.perf_counter() - T0, 1)}
        if owner.startswith("kvdex"):
            self._mode = _OpTracer(self)
            self._mode.__enter__()

    def end(self, exc) -> None:
        a, self.active = self.active, None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if a is None:
            return
        a["status_at_end"] = self.status()
        if exc is not None:
            a["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if a["gc"] or exc is not None or a["invalidated_after"] or a["status_at_end"] == 2:
            self.events.append(a)  # only the remarkable captures are kept
        self.count += 1

    def _gc(self, phase, info) -> None:
        a = self.active
        if a is None:
            return
        if phase == "start":
            a["gc"].append({"generation": info["generation"], "status_before": self.status()})
        else:
            a["gc"][-1].update(collected=info["collected"], status_after=self.status())

    def summary(self) -> dict:
        return {"captures_watched": self.count, "remarkable": self.events[-40:]}


class _OpTracer(TorchDispatchMode):
    """Inside a kvdex capture: the first aten op after which the capture is invalidated, with its stack."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        a = self.watch.active
        if a is not None and a["invalidated_after"] is None and self.watch.status() == 2:
            stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()]
            a["invalidated_after"] = {"op": str(func), "stack": stack[-14:-1]}
        return out


def _owner(frame) -> str:
    while frame.f_back is not None and frame.f_code.co_filename.endswith(("graphs/capture.py", "contextlib.py")):
        frame = frame.f_back  # kvdex.engine.graphs.capture_step: its caller captures
    name = frame.f_code.co_filename
    if name.endswith("layer_graphs.py"):
        layer = frame.f_locals.get("layer")
        return f"kvdex layer {getattr(layer, 'layer_idx', '?')}"
    if name.endswith(os.path.join("hf", "graph.py")):
        return "kvdex step (GraphDecoder)"
    if "cudagraph_trees" in name:
        return "inductor"
    return f"other ({os.path.basename(name)})"


# ---- timing --------------------------------------------------------------------------------------------
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


def _cache(model, method: str, budget: int):
    return dynamic_cache(model) if method == "dynamic" else kvdex.Cache(model, method, budget)


def plain_generate(model, method, context, args, runs) -> dict:
    """``model.generate`` of ``--new-tokens`` after a ``context``-token cache (the first run: 16 tokens, untimed)."""
    dev = next(model.parameters()).device
    best = None
    for rep in range(runs):
        cache = _cache(model, method, args.budget)
        fill_random(model, cache, context, 1, args.seed)
        ids = make_prompt(1, context + 1, model.config.vocab_size, args.seed + 1, dev)
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
                r["whole_step"] = dict(cache.whole_step.counts)
                r["whole_step_off"] = cache.whole_step.reason
            best = r if best is None or r["median_ms"] < best["median_ms"] else best
    return best


def graph_decoder(model, method, context, args, runs) -> dict:
    """``kvdex.generate(cuda_graph=True)``'s decode loop (GraphDecoder) on the same filled cache."""
    dev = next(model.parameters()).device
    best = None
    for rep in range(runs):
        cache = _cache(model, method, args.budget)
        fill_random(model, cache, context, 1, args.seed)
        dec = GraphDecoder(model, cache)
        nxt = make_prompt(1, 1, model.config.vocab_size, args.seed + 1, dev)
        stamps = []
        for _ in range(args.new_tokens if rep else 16):
            nxt = dec.step(nxt).argmax(-1, keepdim=True)
            sync_device(dev)
            stamps.append(time.perf_counter())
        if rep:
            r = _times([stamps[0], *stamps], args.skip)
            r["graph_counts"] = dict(dec.counts)
            r["graph_off"] = dec.reason
            best = r if best is None or r["median_ms"] < best["median_ms"] else best
    return best


def compile_counters() -> dict:
    """Dynamo graphs / recompiles, inductor's partitions and cudagraph skips, graphs cudagraph trees recorded."""
    from torch._dynamo.utils import counters

    out = {
        "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else None,
        "cudagraph_partitions": int(counters["inductor"]["cudagraph_partitions"]),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees

        m = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        out["cudagraph_trees_recorded"] = None if m is None else int(repr(m.graph_counter)[6:-1])
    return out


def _try(fn, *a) -> dict:
    try:
        return fn(*a)
    except Exception as e:  # recorded, and the run goes on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:  # the caches of this method (torch.compile keeps the first it traced in cyclic garbage)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- phases ----------------------------------------------------------------------------------------------
def mechanism() -> dict:
    """A stray CUDA graph in a reference cycle, due for collection when a capture runs Python that allocates:
    the collector paused (kvdex's gc_paused), then running inside the capture (as torch.cuda.graph leaves it)."""
    import weakref

    from kvdex.engine.graphs import gc_paused

    class Cycle:
        def __init__(self, obj):
            self.obj, self.me = obj, self

    res = {}
    for name, guard in (("gc_paused", gc_paused), ("collector running", contextlib.nullcontext)):
        gone = []
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.zeros(1, device="cuda")
        gc.collect()
        gc.disable()  # the cycle stays in generation 0 until the capture
        weakref.finalize(Cycle(g), lambda gone=gone: gone.append(torch.cuda.is_current_stream_capturing()))
        del g
        junk = None
        try:
            with guard(), torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
                torch.zeros(1, device="cuda")
                if guard is contextlib.nullcontext:
                    gc.enable()
                junk = [[] for _ in range(5000)]  # past generation 0's threshold: a collection, unless paused
                torch.ones(4, device="cuda").sum()
            res[name] = "captured"
        except Exception as e:
            res[name] = f"{type(e).__name__}: {str(e)[:200]}"
        del junk
        res[name + ": stray graph destroyed inside the capture"] = gone[0] if gone else "not yet"
        gc.enable()
        gc.collect()
        torch.cuda.synchronize()
    return res


def unfix() -> None:
    """Switch kvdex's capture safety off (what the first GPU run had)."""
    from kvdex.engine.graphs import capture, layer_graphs, service
    from kvdex.hf import step_backend

    class Strong(layer_graphs.StepPlan):
        def __init__(self, cache, weak=False):
            super().__init__(cache, weak=False)

    layer_graphs.StepPlan = Strong
    capture.gc_paused = service.gc_paused = contextlib.nullcontext
    for mod in (layer_graphs, service, step_backend):
        mod.free_with = lambda owner, graphs: None


def unfixed(model, args) -> dict:
    """The first failing run's sequence: DynamicCache, then quest's plain generate, 3 runs each, fresh caches."""
    ctx = args.context_list[-1]
    out = {"context": ctx, "policy": "quest"}
    for method in ("dynamic", "quest"):
        out[method] = _try(plain_generate, model, method, ctx, args, 3)
        print(f"[{time.perf_counter() - T0:6.1f}s] unfixed {method}: {out[method]}", flush=True)
    return out


def correctness(model, args) -> dict:
    dev = next(model.parameters()).device
    ids = make_prompt(1, args.check_context, model.config.vocab_size, args.seed + 2, dev)
    n = args.check_tokens

    def kv_generate(cuda_graph):
        c = kvdex.Cache(model, "quest", args.budget)
        out = kvdex.generate(model, c, ids, max_new_tokens=n, cuda_graph=cuda_graph)
        return out[0, ids.shape[1] :].tolist(), getattr(c, "graph_counts", None)

    def plain(disable_compile, step_graphs=True):
        c = kvdex.Cache(model, "quest", args.budget, step_graphs=step_graphs)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **cache_kwargs(c), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, disable_compile=disable_compile,
        )  # fmt: skip
        counts = {**c.step_graphs.counts, "off": c.step_graphs.reason, "whole_step": dict(c.whole_step.counts)}
        return out[0, ids.shape[1] :].tolist(), {**counts, "whole_step_off": c.whole_step.reason}

    ref, _ = kv_generate(False)
    res = {"policy": "quest", "context": args.check_context, "tokens": n}
    for name, fn in (
        ("plain generate, eager model", lambda: plain(True)),
        ("plain generate, compiled", lambda: plain(False)),
        ("plain generate, compiled, step_graphs=False", lambda: plain(False, False)),
        ("kvdex.generate(cuda_graph=True)", lambda: kv_generate(True)),
    ):
        try:
            got, counts = fn()
            same = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
            res[name] = {"equal": got == ref, "first_mismatch": same, "counts": counts}
        except Exception as e:
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(f"[{time.perf_counter() - T0:6.1f}s] correctness {name}: {res[name]}", flush=True)
    return res


def bench(model, args, ctx) -> list[dict]:
    records = []
    runs = [("model.generate", "dynamic", plain_generate)]
    for pol in args.policy_list:
        runs += [("model.generate", pol, plain_generate), ("kvdex.generate", pol, graph_decoder)]
    for path, method, fn in runs:
        if time.perf_counter() - T0 > args.budget_s:
            records.append({"path": path, "method": method, "context": ctx, "skipped": "--budget-s reached"})
            continue
        r = {"path": path, "method": method, "context": ctx, **_try(fn, model, method, ctx, args, args.repeats + 1)}
        r["counters"] = compile_counters()
        records.append(r)
        ms = f"{r['median_ms']:8.3f}" if "median_ms" in r else "   error"
        print(f"[{time.perf_counter() - T0:6.1f}s] {ctx:>6} {path:<15} {method:<10} median {ms} ms/token  "
              f"{r.get('whole_step', r.get('graph_counts', ''))} {r.get('error', '')}", flush=True)  # fmt: skip
    return records


def table(records: list[dict]) -> str:
    head = "| context | policy | DynamicCache generate | kvdex plain generate | kvdex.generate (graphs) | plain/graph |"
    rows = [head, "| --- | --- | --- | --- | --- | --- |"]
    get = {(r["context"], r["path"], r["method"]): r.get("median_ms") for r in records}
    for ctx in sorted({r["context"] for r in records}):
        dyn = get.get((ctx, "model.generate", "dynamic"))
        for pol in sorted({r["method"] for r in records if r["method"] != "dynamic"}):
            p, g = get.get((ctx, "model.generate", pol)), get.get((ctx, "kvdex.generate", pol))
            rows.append(f"| {ctx} | {pol} | {_f(dyn)} | {_f(p)} | {_f(g)} | {_f(p / g) if p and g else '-'} |")
    return "\n".join(rows) + "\n\nms per token, median of the steady decode steps, batch 1.\n"


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def build(args):
    longest = max([*args.context_list, args.check_context]) + args.new_tokens + 64
    model = shapes.build_model(args.shape, getattr(torch, args.dtype), args.device, max_positions=longest)
    kvdex.enable(model)
    return model


def meta(args) -> dict:
    m = {"torch": torch.__version__, "transformers": TRANSFORMERS_VERSION, "device": args.device,
         "cudagraph_unsafe_tag": hasattr(torch._C.Tag, "cudagraph_unsafe")}  # fmt: skip
    with contextlib.suppress(Exception):
        import triton

        m["triton"] = triton.__version__
    with contextlib.suppress(Exception):
        from torch._inductor import config as ic

        m["inductor_graph_partition"] = ic.graph_partition
    if args.device.startswith("cuda"):
        m["gpu"] = torch.cuda.get_device_name()
    return m


def _subprocess(phase: str, args, timeout: int) -> dict:
    """Run ``phase`` of this script in a fresh process (its CUDA state cannot leak into this one)."""
    out = os.path.join(args.out_dir, f"{phase}.json")
    with contextlib.suppress(OSError):
        os.remove(out)
    cmd = [sys.executable, __file__, "--phase", phase, "--contexts", args.contexts, "--budget", str(args.budget),
           "--shape", args.shape, "--new-tokens", str(args.new_tokens), "--result", out]  # fmt: skip
    try:
        p = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:  # what it printed so far
        rc, text = f"timed out after {timeout} s", (e.stdout or b"").decode() + (e.stderr or b"").decode()
    print(f"---- {phase} ({rc}) ----\n{text[-3000:]}", flush=True)
    try:
        with open(out) as f:
            return {**json.load(f), "rc": rc}
    except (OSError, ValueError) as e:
        return {"error": f"{rc}: {type(e).__name__}: {e}", "output_tail": text[-2000:]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", help=f"one of {', '.join(shapes.shape_names())}")
    p.add_argument("--contexts", default="32k")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--policies", default="full,quest,chess,prkv,pariskv")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip", type=int, default=4, help="decode steps left out of the mean (captures)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--check-context", type=int, default=4096)
    p.add_argument("--check-tokens", type=int, default=24)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="start no timed method after this many seconds")
    p.add_argument("--no-unfixed", action="store_true", help="skip the run with kvdex's capture safety off")
    p.add_argument("--phase", default="all", choices=["all", "mechanism", "unfixed"], help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.context_list = [int(c[:-1]) * 1024 if c.endswith("k") else int(c) for c in args.contexts.split(",")]
    args.policy_list = [x for x in args.policies.split(",") if x]
    args.out_dir = os.environ.get("OUT") or "out"
    os.makedirs(args.out_dir, exist_ok=True)
    cuda = args.device.startswith("cuda")
    watch = CaptureWatch()
    if cuda:
        watch.install()
    warnings.simplefilter("always")
    if args.phase != "all":  # a subprocess of this script
        res = {"meta": meta(args)}
        if args.phase == "mechanism":
            res["result"] = _try(mechanism)
        else:
            unfix()
            res["result"] = unfixed(build(args), args)
        res["captures"] = watch.summary()
        res["counters"] = compile_counters()
        with open(args.result, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return
    report = {"meta": meta(args), "args": {k: v for k, v in vars(args).items() if k != "phase"}}
    print(json.dumps(report["meta"]), flush=True)
    if cuda:
        report["mechanism"] = _subprocess("mechanism", args, 90)
        if not args.no_unfixed:
            report["unfixed"] = _subprocess("unfixed", args, 150)
    model = build(args)
    report["correctness"] = _try(correctness, model, args)
    report["counters_after_correctness"] = compile_counters()
    report["records"] = []
    for ctx in args.context_list:
        report["records"] += bench(model, args, ctx)
    report["captures"] = watch.summary()
    report["seconds"] = round(time.perf_counter() - T0, 1)
    with open(os.path.join(args.out_dir, "user_path.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = table(report["records"])
    with open(os.path.join(args.out_dir, "user_path.md"), "w") as f:
        f.write(md)
    print(md, json.dumps({k: report.get(k) for k in ("mechanism", "correctness")}, default=str)[:3000], flush=True)


if __name__ == "__main__":
    main()
