# Over 400 lines: one command (its rows, samples, fits, verdict, table and arguments) that reads as one.
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
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

POLICIES = ("full", "quest", "icecache", "pariskv", "chess", "prkv")
DEFAULT_ROWS = tuple(f"{p}/{s}" for p in POLICIES for s in ("device", "offload"))


@dataclasses.dataclass
class SoakConfig:
    shape: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    context: int = 512
    batch: int = 1
    steps: int = 10_000
    warmup: int = -1  # -1: min(steps // 10, 500)
    every: int = 0  # 0: spread about 40 samples over the steps after the warm-up
    rows: tuple[str, ...] = DEFAULT_ROWS
    budget: int = 256
    page_cache: int = 0
    dense_layers: int = 1
    reserve: bool = True
    kv: str = "prompt"  # prompt: a prefill of random tokens; random: kvdex.bench.decoding.fill_random
    objects: bool = True  # count tensors and gc-tracked objects at each sample
    tolerance: float = 0.02  # excess bytes per step, as a fraction of one token's KV (all layers, the batch)
    object_tolerance: float = 0.02  # excess tensors / objects per step
    rss_tolerance: float = 4096.0  # excess RSS bytes per step
    max_minutes: float = 0.0  # 0: no limit; else each row stops early at its share of the time left
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 2 or self.context < 1 or self.batch < 1:
            raise ValueError("--steps must be >= 2, --context and --batch >= 1")
        if self.kv not in ("prompt", "random"):
            raise ValueError(f"--kv must be prompt or random, got {self.kv!r}")
        for row in self.rows:
            split_row(row)

    @property
    def warmup_steps(self) -> int:
        w = min(self.steps // 10, 500) if self.warmup < 0 else self.warmup
        if w >= self.steps - 1:
            raise ValueError(f"--warmup ({w}) leaves fewer than 2 steps to sample out of --steps {self.steps}")
        return w

    @property
    def sample_every(self) -> int:
        return self.every if self.every > 0 else max(1, (self.steps - self.warmup_steps) // 40)


def split_row(row: str) -> tuple[str, str]:
    """``"quest:select_every=8/offload"`` -> ``("quest:select_every=8", "offload")``."""
    spec, _, storage = row.rpartition("/")
    if not spec or storage not in ("device", "offload"):
        raise ValueError(f"row {row!r}: expected POLICY[:OPTIONS]/device or POLICY[:OPTIONS]/offload")
    return spec, storage


# ---- measurements ------------------------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``; elsewhere the peak from ``resource``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def live_tensors() -> tuple[int, int]:
    """(live torch tensors Python can reach, the bytes of their distinct storages)."""
    count, seen, total = 0, set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor):  # type(): no attribute lookup on odd objects
            count += 1
            try:  # meta / fake / sparse tensors (a compile leaves fake ones behind) have no data pointer
                st = o.untyped_storage()
                key = (st.device.type, st.device.index, st.data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return count, total


def sample(device: torch.device, objects: bool) -> dict:
    """One sample of every series (the device synchronised first; cyclic garbage collected before counting,
    so the counts are of objects still reachable, not of garbage the collector has not reached yet)."""
    if objects or device.type != "cuda":
        gc.collect()
    out = {"rss": rss_bytes()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["device"] = torch.cuda.memory_allocated(device)
        out["device_reserved"] = torch.cuda.memory_reserved(device)
    if objects or device.type != "cuda":
        n, nbytes = live_tensors()
        out["tensors"], out["tensor_bytes"] = n, nbytes
        if device.type != "cuda":
            out["device"] = nbytes
    if objects:
        out["objects"] = len(gc.get_objects())
    return out


def fit(steps: list[int], values: list[float]) -> dict:
    """Least-squares slope (per step) of ``values`` against ``steps``, and the growth from first to last."""
    n = len(steps)
    if n < 2:
        return {"slope": 0.0, "growth": 0.0, "samples": n}
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    sxy = sum((x - mx) * (y - my) for x, y in zip(steps, values, strict=True))
    return {"slope": sxy / sxx if sxx else 0.0, "growth": float(values[-1] - values[0]), "samples": n}


def kv_bytes_per_token(model, batch: int, dtype: torch.dtype) -> tuple[int, int]:
    """(K+V bytes one decoded token adds over all layers and the batch, the number of layers)."""
    from kvdex.hf.model_parts import head_geometry, text_config

    _, kv_heads, head_dim = head_geometry(model)
    layers = text_config(model).num_hidden_layers
    return layers * kv_heads * head_dim * 2 * dtype.itemsize * batch, layers


def expected_per_step(
    cfg: SoakConfig, spec: str, storage: str, kv_token: int, layers: int, device: torch.device
) -> dict:
    """Expected growth per step of each series: nothing when the buffers were reserved, else one token's KV
    where it lives (an offloaded sparse layer's middle on the host, every other layer's KV on the device;
    on a CPU device and host are one memory). ``full`` offloaded attends the whole middle: its sparse layers'
    device working set holds it and the host staging buffer that carries it there holds it again, so both
    grow by their KV per token whatever was reserved."""
    dense = min(cfg.dense_layers, layers)
    working = kv_token * (layers - dense) / layers if storage == "offload" and spec.split(":")[0] == "full" else 0.0
    if cfg.reserve:
        if device.type != "cuda":
            return {"device": 2 * working, "rss": 2 * working}
        return {"device": working, "rss": working}
    if device.type != "cuda":
        return {"device": kv_token + 2 * working, "rss": kv_token + 2 * working}
    if storage == "device":
        return {"device": float(kv_token), "rss": 0.0}
    return {"device": kv_token * dense / layers + working, "rss": kv_token * (layers - dense) / layers + working}


# ---- one row -----------------------------------------------------------------------------------------
def reserve_all(cache, tokens: int) -> None:
    """Size every store and the policy's index for ``tokens`` tokens per sequence up front."""
    policy = cache.policy
    for lay in cache.layers:
        lay.store.reserve_join(tokens)
    pages = cache.grid.middle_pages_of(tokens)
    for i in policy.info.sparse_layers:
        try:
            policy.reserve_index(i, pages, cache.layers[i].store)
        except NotImplementedError:  # a policy without capturable page joins: its index grows as it does
            pass


@torch.no_grad()
def run_row(model, cfg: SoakConfig, row: str, deadline: float | None = None) -> dict:
    """Decode ``cfg.steps`` steps of one row and sample its memory; the row's result (samples, fits, verdict)."""
    import kvdex
    from kvdex.bench import decoding
    from kvdex.hf.graph import GraphDecoder

    spec, storage = split_row(row)
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start = time.perf_counter()
    cache = kvdex.Cache(
        model, spec, cfg.budget, offload=storage == "offload", dense_layers=cfg.dense_layers,
        page_cache=cfg.page_cache if storage == "offload" else 0,
    )  # fmt: skip
    vocab = model.config.vocab_size
    if cfg.kv == "random":
        decoding.fill_random(model, cache, cfg.context, cfg.batch, cfg.seed)
        nxt = torch.randint(1, vocab, (cfg.batch, 1), generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    else:
        ids = decoding.make_prompt(cfg.batch, cfg.context, vocab, cfg.seed, device)
        nxt = decoding.prefill(model, cache, ids).argmax(-1, keepdim=True)
        del ids
    if cfg.reserve:
        reserve_all(cache, cfg.context + cfg.steps + 64 * cache.grid.page_size)
    dec = GraphDecoder(model, cache, warn=False)
    warmup, every = cfg.warmup_steps, cfg.sample_every
    samples: list[dict] = []
    done, stopped, sample_s = 0, None, 0.0
    t0 = time.perf_counter()
    for s in range(cfg.steps):
        nxt = dec.step(nxt).argmax(-1, keepdim=True)
        done = s + 1
        if done >= warmup and (done - warmup) % every == 0:
            t1 = time.perf_counter()
            samples.append({"step": done, **sample(device, cfg.objects)})
            sample_s += time.perf_counter() - t1
            if deadline is not None and time.monotonic() > deadline and len(samples) >= 3:
                stopped = "time limit (--max-minutes)"
                break
    if not samples or samples[-1]["step"] != done:
        samples.append({"step": done, **sample(device, cfg.objects)})
    decode_s = time.perf_counter() - t0 - sample_s  # the decode steps alone, the samples' time aside
    kv_token, layers = kv_bytes_per_token(model, cfg.batch, dtype)
    expect = expected_per_step(cfg, spec, storage, kv_token, layers, device)
    steps = [x["step"] for x in samples]
    fits, flat = {}, {}
    for key in ("device", "device_reserved", "rss", "tensors", "tensor_bytes", "objects"):
        if key not in samples[0]:
            continue
        f = fit(steps, [x[key] for x in samples])
        f["expected_per_step"] = expect.get(key, 0.0)
        f["excess_per_step"] = f["slope"] - f["expected_per_step"]
        f["excess_total"] = f["excess_per_step"] * (steps[-1] - steps[0])
        fits[key] = f
    limits = {"device": cfg.tolerance * kv_token, "rss": cfg.rss_tolerance}
    limits |= {"tensors": cfg.object_tolerance, "objects": cfg.object_tolerance}
    for key, lim in limits.items():
        if key in fits:
            flat[key] = fits[key]["excess_per_step"] <= lim
    result = {
        "row": row,
        "policy": spec,
        "storage": storage,
        "steps": done,
        "stopped": stopped,
        "context_end": cfg.context + done,
        "decode_s": decode_s,
        "ms_per_step": 1e3 * decode_s / max(done, 1),
        "sample_s": sample_s,
        "total_s": time.perf_counter() - start,
        "graph": {"reason": dec.reason, **dec.counts},
        "kv_bytes_per_token": kv_token,
        "limits_per_step": limits,
        "fits": fits,
        "flat": flat,
        "ok": all(flat.values()),
        "samples": samples,
    }
    del dec, cache, nxt
    gc.collect()
    return result


def run(cfg: SoakConfig, log=print, model=None) -> dict:
    """Every row of ``cfg`` on one model (built from ``cfg.shape`` unless given); the JSON-ready result."""
    import kvdex
    from kvdex.bench import shapes

    dtype = getattr(torch, cfg.dtype)
    if model is None:
        total = cfg.context + cfg.steps + 1024
        model = shapes.build_model(cfg.shape, dtype, cfg.device, max_positions=total, seed=cfg.seed)
    kvdex.enable(model)
    end = time.monotonic() + 60 * cfg.max_minutes if cfg.max_minutes > 0 else None
    rows = []
    for i, row in enumerate(cfg.rows):
        deadline = None if end is None else time.monotonic() + (end - time.monotonic()) / (len(cfg.rows) - i)
        log(f"[{i + 1}/{len(cfg.rows)}] {row}: {cfg.steps} steps from a {cfg.context}-token context")
        try:
            res = run_row(model, cfg, row, deadline)
        except Exception as e:  # a row that fails is reported, the others still run
            gc.collect()
            res = {"row": row, "error": f"{type(e).__name__}: {e}", "ok": False}
        log("    " + (res.get("error") or _line(res)))
        rows.append(res)
    cfg_dict = dataclasses.asdict(cfg) | {"warmup": cfg.warmup_steps, "every": cfg.sample_every}
    return {
        "config": cfg_dict,
        "device_name": torch.cuda.get_device_name(cfg.device) if str(cfg.device).startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "ok": all(r["ok"] for r in rows),
    }


# ---- report ------------------------------------------------------------------------------------------
def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(x) >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"


def _line(res: dict) -> str:
    f = res["fits"]
    parts = [f"{res['steps']} steps, {res['ms_per_step']:.2f} ms/step"]
    for key in ("device", "rss"):
        if key in f:
            parts.append(f"{key} {f[key]['excess_per_step']:+.1f} B/step ({_fmt_bytes(f[key]['growth'])} total)")
    if "objects" in f:
        parts.append(f"objects {f['objects']['excess_per_step']:+.3f}/step")
    return ", ".join(parts) + (" ok" if res["ok"] else " NOT FLAT") + (f" [{res['stopped']}]" if res["stopped"] else "")


def table(result: dict) -> str:
    """The result as a fixed-width table: per row, the excess growth per step and in total."""
    head = ["row", "steps", "ms/step", "graphs", "device B/step", "device total", "rss B/step", "rss total",
            "tensors/step", "objects/step", "flat"]  # fmt: skip
    lines = [head]
    for r in result["rows"]:
        if "error" in r:
            lines.append([r["row"], "-", "-", "-", r["error"][:60], "", "", "", "", "", "ERROR"])
            continue
        f = r["fits"]
        per = {k: f"{v['excess_per_step']:+.{3 if k in ('tensors', 'objects') else 1}f}" for k, v in f.items()}
        tot = {k: _fmt_bytes(v["excess_total"]) for k, v in f.items()}
        g = r["graph"]
        graphs = "eager" if g["reason"] else f"{g['replays']}r/{g['captures']}c"
        lines.append([r["row"], str(r["steps"]), f"{r['ms_per_step']:.2f}", graphs, per.get("device", "-"),
                      tot.get("device", "-"), per.get("rss", "-"), tot.get("rss", "-"), per.get("tensors", "-"),
                      per.get("objects", "-"),
                      "yes" if r["ok"] else "NO"])  # fmt: skip
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# ---- command line ------------------------------------------------------------------------------------
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


if __name__ == "__main__":
    sys.exit(main())
