"""``kvdex bench``: decode speed of kvdex policies next to transformers' own caches.

For one model shape, every (context length, batch size) and every method -- each kvdex policy on
a GPU-resident store (``policy/device``) and offloaded (``policy/offload``), transformers'
``DynamicCache`` (``hf/dynamic``) and its offloaded variant (``hf/offloaded``) -- one run:

1. builds the cache and prefills random token ids (timed), or with ``kv="random"`` fills it with
   random keys / values of the context length through the ingest of a prefill (timed as ``fill_s``;
   decode timings only, see :func:`~kvdex.bench.decoding.fill_random`);
2. decodes ``warmup`` steps (graph methods: then more, until a page of steps captured no graph, so that
   every variant of the step is captured before timing; ``warmup_steps`` in the record), then ``steps``
   timed steps, greedy, the next ids never leaving the
   device (no host synchronisation added by the harness). On CUDA every step is bracketed by CUDA
   events; ms/token is their median and p90; throughput = batch * steps / wall time;
3. peak device memory over prefill (or fill) + decode and during decode alone, host RSS, KV bytes on host,
   host->device bytes per step;
4. for kvdex methods, ``split_steps`` more steps with the cache's phase timing switched on (it
   synchronises around selection / transfer / attention, so these steps are slower and only give
   the split of a step, as fractions of the step time measured in the same pass).

Before any timing, :func:`check_full_budget` runs every kvdex method at a budget covering the
whole context and compares one decode step's logits with ``DynamicCache`` + SDPA.
Out-of-memory results are recorded as ``status: "OOM"`` and the run goes on.

The pieces live in their own modules: :mod:`~kvdex.bench.config` (what to measure),
:mod:`~kvdex.bench.decoding` (cache, prompt, prefill, step), :mod:`~kvdex.bench.checks` (correctness
before timing) and :mod:`~kvdex.bench.timing` (timed steps, transfers, the split of a step); this
module runs them: :func:`measure` one (method, context, batch), :func:`run` the whole grid.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time

import torch

import kvdex
from kvdex.bench import shapes
from kvdex.bench.checks import COMPILE_TOL, check_full_budget, check_graph, compile_info
from kvdex.bench.config import HF_METHODS, BenchConfig, base_method, is_compiled, is_graph, parse_dtype
from kvdex.bench.decoding import (
    decode_step,
    fill_random,
    kvdex_cache,
    load_text_ids,
    make_cache,
    make_prompt,
    prefill,
    sync_device,
)
from kvdex.bench.timing import h2d_bytes, make_stepper, page_cache_counts, percentile, phase_split, timed_steps, warm_up

# graph methods: after --warmup, up to this many pages of steps more, until one page of steps captures nothing
WARMUP_PAGES = 4

# the names these helpers had here before they moved (tests and scripts use them)
_step, _prefill, _prompt, _dtype = decode_step, prefill, make_prompt, parse_dtype

__all__ = [
    "COMPILE_TOL", "HF_METHODS", "BenchConfig", "base_method", "check_full_budget", "check_graph", "is_compiled",
    "is_graph", "load_text_ids", "make_cache", "measure", "run", "versions",
]  # fmt: skip


def _host_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---- one measured run -------------------------------------------------------------------------------


def measure(model, method: str, context: int, batch: int, cfg: BenchConfig, text_ids=None) -> dict:
    device = next(model.parameters()).device
    rec = dict(method=method, context=context, batch=batch, status="ok")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cache = None
    need, avail = _host_need(model, method, context, batch, cfg), _host_available()
    if need and avail and need > 0.9 * avail:  # pinned host memory cannot be swapped: an OOM kill, not an error
        rec["status"] = "skipped"
        rec["error"] = f"offloaded KV needs {need / 1e9:.0f} GB of pinned host memory, {avail / 1e9:.0f} GB available"
        return rec
    try:
        cache = make_cache(model, method, cfg)
        nxt = _start(model, cache, rec, cfg, text_ids, device)
        stepper = None
        if is_graph(method):
            from kvdex.hf.graph import GraphDecoder

            stepper = GraphDecoder(model, cache, batch, compile=is_compiled(method))
        step = make_stepper(model, cache, stepper)
        ps = cache.config.page_size if stepper is not None else 0  # graphs: a page of steps with no capture
        counts = None if stepper is None else stepper.counts
        nxt, rec["warmup_steps"] = warm_up(step, nxt, cfg.warmup, counts, quiet=ps, most=WARMUP_PAGES * ps)
        sync_device(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        h2d0 = h2d_bytes(cache)
        pc0 = page_cache_counts(cache)
        eager0 = None if stepper is None else stepper.counts["eager"]
        captures0 = None if stepper is None else stepper.counts["captures"]
        ms, wall = timed_steps(step, nxt, cfg.steps, device)
        pc1 = page_cache_counts(cache)
        kc = kvdex_cache(cache)
        if pc1 != pc0 or (kc is not None and kc.page_cache):  # hits / misses over the timed steps
            hits, misses = pc1[0] - pc0[0], pc1[1] - pc0[1]
            rec["page_cache"] = cache.page_cache
            rec["page_cache_hits"], rec["page_cache_misses"] = hits, misses
            rec["page_cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
        if stepper is not None:
            rec["graph_counts"] = dict(stepper.counts)
            rec["eager_steps"] = stepper.counts["eager"] - eager0  # timed steps that ran eagerly (no replay)
            rec["captures_timed"] = stepper.counts["captures"] - captures0  # timed steps that captured a graph
            if is_compiled(method):
                rec.update(compile_info(stepper))  # compile_s: the warm-up steps that compiled
        rec["ms_median"] = statistics.median(ms)
        rec["ms_p90"] = percentile(ms, 0.9)
        rec["ms_mean"] = statistics.fmean(ms)
        rec["tokens_per_s"] = batch * cfg.steps / wall
        rec["steps"] = cfg.steps
        period = kc.policy.rebuild_period() if kc is not None else 0
        if period:  # the policy's periodic rebuilds (decode steps T, 2T, ...) among the timed steps
            first = rec["warmup_steps"]  # the timed steps are decode steps first ... first + steps - 1
            rec["rebuild_every"] = period
            rec["rebuilds_timed"] = (first + cfg.steps - 1) // period - (first - 1) // period
        if device.type == "cuda":
            rec["decode_peak_device_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        h2d = h2d_bytes(cache) - h2d0
        rec["h2d_bytes_per_step"] = h2d / cfg.steps
        rec["h2d_gbps_over_step"] = h2d / cfg.steps / (rec["ms_median"] * 1e-3) / 1e9
        if kc is not None:
            s = kc.stats()
            rec["kv_host_gb"] = s["kv_bytes_host"] / 1e9
            rec["kv_device_gb"] = s["kv_bytes_device"] / 1e9
            # the policy's own counters (IceCache's build_s, semantic_store_per_dense_kv, ...), numbers only
            rec["policy_stats"] = {k: v for k, v in s["policy_stats"].items() if isinstance(v, (int, float))}
            if cfg.split_steps and stepper is None:  # graph replays have no phases to time
                rec["split"] = phase_split(model, cache, nxt, cfg.split_steps, device)
                t = rec["split"].get("transfer_ms", 0.0)
                rec["h2d_gbps_during_transfer"] = rec["h2d_bytes_per_step"] / (t * 1e-3) / 1e9 if t > 0 else None
        if device.type == "cuda":
            # whole method: the prefill's peak and the peak since the reset after warm-up
            start_peak = rec.get("prefill_peak_device_gb", rec.get("fill_peak_device_gb", 0.0))
            rec["peak_device_gb"] = max(torch.cuda.max_memory_allocated(device) / 1e9, start_peak)
        rec["host_rss_gb"] = _host_rss() / 1e9
    except torch.OutOfMemoryError as e:
        rec["status"] = "OOM"
        rec["error"] = str(e).splitlines()[0][:300]
    except RuntimeError as e:
        rec["status"] = "error"
        rec["error"] = str(e).splitlines()[0][:300]
    finally:
        del cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def _start(model, cache, rec: dict, cfg: BenchConfig, text_ids, device) -> torch.Tensor:
    """Put the context into ``cache`` (``cfg.kv``: a timed prefill of the prompt, or a timed random fill)
    and return the first ids to decode [B, 1]. ``kv: "random"`` records the fill's time and device
    peak as ``fill_s`` / ``fill_peak_device_gb``, never as prefill figures."""
    context, batch, vocab = rec["context"], rec["batch"], model.config.vocab_size
    seed = cfg.seed + context + batch
    rec["kv"] = cfg.kv
    if cfg.kv == "random":
        sync_device(device)
        t0 = time.perf_counter()
        fill_random(model, cache, context, batch, seed)
        sync_device(device)
        rec["fill_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            rec["fill_peak_device_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        return make_prompt(batch, 1, vocab, seed + 1, device)
    ids = make_prompt(batch, context, vocab, seed, device, text_ids)
    sync_device(device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, ids, cfg.prefill_chunk)
    sync_device(device)
    rec["prefill_s"] = time.perf_counter() - t0
    if cfg.prefill_chunk:
        rec["prefill_chunk"] = cfg.prefill_chunk
    if device.type == "cuda":
        rec["prefill_peak_device_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return logits.argmax(-1, keepdim=True)


def _host_need(model, method: str, context: int, batch: int, cfg: BenchConfig) -> int:
    """Bytes of KV an offloaded kvdex method puts in host memory (0 for the others)."""
    if "/offload" not in method:
        return 0
    from kvdex.hf.model_parts import head_geometry, text_config

    _, kv_heads, head_dim = head_geometry(model)
    layers = max(text_config(model).num_hidden_layers - cfg.dense_layers, 0)
    item = next(model.parameters()).element_size()
    return 2 * layers * batch * kv_heads * (context + cfg.steps + cfg.warmup) * head_dim * item


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---- the whole run ----------------------------------------------------------------------------------


def versions() -> dict:
    import platform

    from kvdex.hf.compat import TRANSFORMERS_VERSION

    v = dict(python=platform.python_version(), torch=torch.__version__, transformers=TRANSFORMERS_VERSION)
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
    return v


def run(cfg: BenchConfig, log=print) -> dict:
    """Check, then measure every (context, batch, method). Returns the JSON-ready result."""
    for p in cfg.policies:
        kvdex.make_policy(p, **cfg.policy_options.get(p, {}))  # unknown policy/option: fail now
    kvdex.CacheConfig(
        budget=cfg.budget, page_size=cfg.page_size, sink=cfg.sink, window=cfg.window, dense_layers=cfg.dense_layers
    )
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; pass --device cpu (tiny shapes only)")
    dtype = parse_dtype(cfg.dtype)
    methods = cfg.methods()
    t0 = time.perf_counter()
    text_ids = None
    if cfg.model:
        model, tok = kvdex.load(cfg.model, dtype=dtype, device=device)
        model.generation_config.eos_token_id = None
        if cfg.text:
            text_ids = load_text_ids(cfg.text, tok)
        name = f"{cfg.model} (real weights)"
    else:
        if cfg.text:
            raise ValueError("--text needs --model (random weights have no tokenizer)")
        model = shapes.build_model(
            cfg.shape, dtype, device, max(cfg.contexts) + cfg.steps + cfg.warmup + 1024, cfg.seed
        )
        name = cfg.shape
    log(
        f"model {name}: {shapes.param_bytes(model) / 1e9:.2f} GB of {cfg.dtype} weights on {device} "
        f"(built in {time.perf_counter() - t0:.1f} s)"
        + (f"; prompts from {cfg.text} ({text_ids.numel()} tokens)" if text_ids is not None else "")
    )
    result = dict(config=dataclasses.asdict(cfg), versions=versions(), weights_gb=shapes.param_bytes(model) / 1e9)
    result["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVDEX_")}  # kernel switches
    if cfg.check:
        checks = check_full_budget(model, cfg, methods)
        result["check"] = checks
        for c in checks:
            log(
                f"check {c['method']:<22} full budget vs dense: max|dlogit| {c['max_abs_dlogit']:.3g} "
                f"(rel {c['rel']:.2e}), same token {c['same_token']} -> {'OK' if c['ok'] else 'FAILED'}"
            )
        bad = [c["method"] for c in checks if not c["ok"]]
        if bad:  # a method that fails its check is not timed (nor its graph variant)
            result["error"] = f"full-budget check failed for {', '.join(bad)}: not timed"
            methods = [m for m in methods if base_method(m) not in bad]
    if cfg.graph:
        if device.type != "cuda":
            raise ValueError("--graph needs a CUDA device")
        checks = check_graph(model, cfg, methods)
        result["graph_check"] = checks
        for c in checks:
            log(
                f"graph {c['method']:<22} vs eager over {c['steps']} steps: max rel dlogit {c['max_rel']:.2e} "
                f"{c['counts']} -> {'OK' if c['ok'] else 'FAILED'}"
                + (f" ({c['reason']})" if c.get("reason") else "")
                + (f" compiled {c['compiled_graphs']} graphs in {c['compile_s']} s" if "compile_s" in c else "")
                + (f" (compile off: {c['compile_reason']})" if c.get("compile_reason") else "")
            )
        bad = [c["method"] for c in checks if not c["ok"]]
        if bad:
            msg = f"graph-vs-eager check failed for {', '.join(bad)}: not timed"
            result["error"] = f"{result['error']}; {msg}" if result.get("error") else msg
            methods = [m for m in methods if m not in bad]
    rows = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            for method in methods:
                rec = measure(model, method, context, batch, cfg, text_ids)
                rows.append(rec)
                log(_line(rec))
    result["results"] = rows
    return result


def _line(r: dict) -> str:
    head = f"{r['method']:<26} ctx {r['context']:>7} b {r['batch']:>2}"
    if r["status"] != "ok":
        return f"{head}  {r['status']}: {r.get('error', '')}"
    hit = r.get("page_cache_hit_rate")
    return (
        f"{head}  {r['ms_median']:8.2f} ms/token (p90 {r['ms_p90']:.2f})  {r['tokens_per_s']:9.1f} tok/s  "
        + (f"prefill {r['prefill_s']:.2f} s" if "prefill_s" in r else f"random fill {r['fill_s']:.2f} s")
        + f"  H2D {r['h2d_bytes_per_step'] / 1e6:.1f} MB/step"
        + ("" if hit is None else f"  page-cache hits {hit:.3f}")
        + ("" if r.get("eager_steps") is None else f"  eager {r['eager_steps']}/{r['steps']} steps")
        + _rebuilds(r)
    )


def _rebuilds(r: dict) -> str:
    """The policy's periodic rebuilds among the timed steps, and a warning when there are none."""
    every = r.get("rebuild_every")
    if not every:
        return ""
    n = r["rebuilds_timed"]
    hint = "" if n else f" -- NOT in the timing: use --steps >= {every} (with the warm-up) to include its cost"
    return f"  rebuilds {n} (every {every} steps){hint}"
