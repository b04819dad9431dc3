"""The soak's decode loop: every row of a :class:`~kvdex.bench.soak.config.SoakConfig` on one model.

For each row a random-weight model of a named shape (:mod:`kvdex.bench.shapes`) prefills a context into a
fresh :class:`kvdex.Cache`, then decodes ``steps`` greedy steps through :class:`~kvdex.hf.graph.GraphDecoder`,
the loop of ``kvdex.generate`` (CUDA graphs on the GPU where the cache can be captured, eager steps
elsewhere). After the warm-up, every ``every`` steps it takes a sample (:mod:`kvdex.bench.soak.sampling`);
the row's fits and verdict come from :mod:`kvdex.bench.soak.verdict`. With ``reserve`` (the default) every
store and the policy's index are sized up front for ``context + steps`` tokens (:func:`reserve_all`), so
memory should not move at all.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch

from kvdex.bench.soak.config import SoakConfig, split_row
from kvdex.bench.soak.report import row_line
from kvdex.bench.soak.sampling import sample
from kvdex.bench.soak.verdict import expected_per_step, judge, kv_bytes_per_token


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
    fits, limits, flat = judge(cfg, samples, expect, kv_token)
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
        log("    " + (res.get("error") or row_line(res)))
        rows.append(res)
    cfg_dict = dataclasses.asdict(cfg) | {"warmup": cfg.warmup_steps, "every": cfg.sample_every}
    return {
        "config": cfg_dict,
        "device_name": torch.cuda.get_device_name(cfg.device) if str(cfg.device).startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "ok": all(r["ok"] for r in rows),
    }
