"""Timing one method's decode: timed steps, host->device bytes, page-cache counters, and the split of a
step into selection / transfer / attention from the cache's own phase timing."""

from __future__ import annotations

import dataclasses
import time

import torch

import kvdex
from kvdex.bench.decoding import decode_step, kvdex_cache, sync_device


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[i]


def page_cache_counts(cache) -> tuple[int, int, int]:
    """(hits, misses, bytes moved) of every offloaded store's device page cache so far (a sync)."""
    h = m = by = 0
    kc = kvdex_cache(cache)
    if kc is None:
        return 0, 0, 0
    for lay in kc.layers:
        st = lay.store
        if st is not None and st.page_cache:
            s = st.page_cache_stats()
            h, m, by = h + s["hits"], m + s["misses"], by + s["bytes_moved"]
    return h, m, by


def h2d_bytes(cache) -> int:
    """Host->device bytes so far: the cache's counter plus what its device page caches moved."""
    kc = kvdex_cache(cache)
    return kc.transfer.h2d_bytes + page_cache_counts(kc)[2] if kc is not None else 0


def make_stepper(model, cache, graph=None):
    """step(ids) -> (next ids, logits): eager, or through a GraphDecoder."""
    if graph is None:
        return lambda ids: decode_step(model, cache, ids)

    def step(ids):
        logits = graph.step(ids)
        return logits.argmax(-1, keepdim=True), logits

    return step


def warm_up(step, nxt, steps: int, counts: dict | None = None, quiet: int = 0, most: int = 0):
    """``steps`` warm-up steps; with ``counts`` (a graph decoder's ``counts``) more, until ``quiet`` steps in a
    row captured no graph, at most ``most`` more: a step's graph variants (a page joining the middle, a
    ``select_every`` reuse step) are captured on their first occurrence, which must not fall in the timed
    steps. Returns (the next ids, the warm-up steps run)."""
    for _ in range(steps):
        nxt, _ = step(nxt)
    n, calm = steps, 0
    while counts is not None and calm < quiet and n - steps < most:
        before = counts["captures"]
        nxt, _ = step(nxt)
        n += 1
        calm = calm + 1 if counts["captures"] == before else 0
    return nxt, n


def timed_steps(step, nxt, steps: int, device) -> tuple[list[float], float]:
    """Per-step milliseconds (CUDA events on CUDA, wall clock elsewhere) and total wall seconds."""
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for a, b in ev:
            a.record()
            nxt, _ = step(nxt)
            b.record()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        return [a.elapsed_time(b) for a, b in ev], wall
    ms = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        nxt, _ = step(nxt)
        ms.append((time.perf_counter() - t) * 1e3)
    return ms, time.perf_counter() - t0


class ReuseMeter:
    """Share of the selected middle pages (or tokens) of a step that the same layer and kv head
    also selected at the previous step: the hit rate a device-resident cache holding the previous
    step's selection would get (the per-step transfer of an offloaded policy would be the misses)."""

    def __init__(self, cache):
        self.cache, self.prev, self.hit, self.total = cache, {}, 0, 0
        cache.on_select = self._seen  # the engine's selection hook (kvdex.engine.step.EngineHost.on_select)

    def _seen(self, view, sel):
        ids = sel.pages if sel.pages is not None else sel.tokens
        if ids is not None and not sel.everything:
            b, h, n = ids.shape
            row = torch.arange(b * h, device=ids.device).view(b, h, 1) * (1 << 40)
            cur = torch.where(ids >= 0, ids.long() + row, -1).flatten()
            prev = self.prev.get(view.layer)
            if prev is not None and prev.numel() == cur.numel():
                live = cur >= 0
                self.hit += int((torch.isin(cur, prev) & live).sum())
                self.total += int(live.sum())
            self.prev[view.layer] = cur

    def detach(self):
        self.cache.on_select = None

    def rate(self):
        return self.hit / self.total if self.total else None


def phase_split(model, cache: kvdex.Cache, nxt, steps: int, device) -> dict:
    """Selection / transfer / attention / rest per step, from the cache's own phase timing."""
    cache.config = dataclasses.replace(cache.config, timing=True)
    before = dict(cache.counters.timing)
    reuse = ReuseMeter(cache)
    sync_device(device)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            nxt, _ = decode_step(model, cache, nxt)
        sync_device(device)
    finally:
        reuse.detach()
    total = (time.perf_counter() - t0) * 1e3 / steps
    cache.config = dataclasses.replace(cache.config, timing=False)
    out = {"step_ms_timed": total, "page_reuse": reuse.rate()}
    known = 0.0
    for name in ("selection", "transfer", "attention"):
        v = (cache.counters.timing.get(name, 0.0) - before.get(name, 0.0)) / steps
        out[f"{name}_ms"] = v
        known += v
    out["rest_ms"] = max(total - known, 0.0)
    for name in ("selection", "transfer", "attention", "rest"):
        out[f"{name}_frac"] = out[f"{name}_ms"] / total if total > 0 else None
    return out
