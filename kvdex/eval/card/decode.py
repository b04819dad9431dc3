"""Batched decoding for the scorecard: one prefill per prompt batch, one fork per (policy, budget).

A batch of prompts of different lengths is left-padded and prefilled densely once into a ``full``
kvdex cache; every (policy, budget) decodes from ``cache.fork(policy, budget)`` (the fork re-indexes
the same prefill with its own policy). The first new token comes from the dense prefill's logits, as
in ``kvdex eval``. Decode steps go through :class:`kvdex.GraphDecoder` -- the loop of
``kvdex.generate`` -- which replays CUDA graphs on CUDA where the policy allows it and runs eager
steps elsewhere (positions per row from the left padding, page-boundary steps eagerly). Steps with
a recall observer attached run eagerly (the observer is Python between kernels).
"""

from __future__ import annotations

import gc
import time

import torch

import kvdex
from kvdex.eval.recall import attention_metrics
from kvdex.eval.runner import FULL
from kvdex.hf.compat import cache_kwargs
from kvdex.hf.graph import GraphDecoder


def _pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0


@torch.inference_mode()
def prefill(model, tokenizer, prompts: list[list[int]], cache_options: dict):
    """Left-padded dense prefill of ``prompts`` -> (``full`` cache, last logits [B, vocab] fp32, seconds)."""
    device = next(model.parameters()).device
    lens = [len(p) for p in prompts]
    width = max(lens)
    ids = torch.full((len(prompts), width), _pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(cache_options)
    budget = kw.get("sink", 16) + kw.get("window", 32) + kw.get("page_size", 16)  # any valid budget
    cache = kvdex.Cache(model, policy=FULL, budget=budget, **kw)
    extra = {}
    if min(lens) != width:  # ragged: positions count real tokens only (as model.generate does)
        mask = mask.to(device)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        extra = dict(attention_mask=mask, position_ids=pos)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids.to(device), **cache_kwargs(cache), use_cache=True, logits_to_keep=1, **extra)
    logits = out.logits[:, -1].float()
    sync(device)
    return cache, logits, time.perf_counter() - t0


def release(device, share: float = 0.5) -> None:
    """Collect cyclic garbage when live memory on ``device`` (CUDA) passes ``share`` of it. A finished
    fork's graphs and buffers can sit in reference cycles until a collection; a full collection costs
    about 0.2 s -- more than the decoding of a short cell -- so it runs only when the garbage matters."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if torch.cuda.memory_allocated(device) > share * torch.cuda.get_device_properties(device).total_memory:
        gc.collect()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _Decoding:
    """A fork and its step function; ``close()`` frees the fork's graphs and reports how it ran."""

    def __init__(self, model, base, policy, budget, graph: bool):
        self.model, self.graph = model, graph
        self.device = next(model.parameters()).device
        self.cache = base.fork(policy, budget)
        self.dec = None
        self.counts = {"eager": 0, "captures": 0, "replays": 0}
        self.reason = None

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dec is None:
            # an observer forces eager steps (GraphDecoder says so in .reason); detach it, then
            # call new_decoder() to replay graphs for the later steps
            self.dec = GraphDecoder(self.model, self.cache, enabled=self.graph, warn=False)
        return self.dec.step(ids)

    def new_decoder(self) -> None:
        self._fold()
        self.dec = None

    def _fold(self) -> None:
        if self.dec is not None:
            for k in self.counts:
                self.counts[k] += self.dec.counts[k]
            if self.dec.reason and (self.reason is None or self.counts["replays"] == 0):
                self.reason = self.dec.reason
            self.dec.graph = self.dec.logits = None  # the graph and its pool go now

    def close(self) -> dict:
        self._fold()
        self.dec = None
        del self.cache
        release(self.device)
        return {**self.counts, "reason": self.reason}


@torch.inference_mode()
def greedy(model, base, first_logits, policy, budget, limits: list[int], stop_ids, graph: bool, check_every=8):
    """Greedy decoding of every row from a fork of ``base``: row i stops after ``limits[i]`` tokens or at
    a stop id. Returns (token lists, info: steps, seconds, eager / capture / replay counts, reason)."""
    dev = first_logits.device
    d = _Decoding(model, base, policy, budget, graph)
    eos = torch.tensor(sorted(stop_ids) or [-1], device=dev)
    limit = torch.tensor(limits, device=dev)
    pad = int(eos[0]) if int(eos[0]) >= 0 else 0
    t0 = time.perf_counter()
    nxt = first_logits.argmax(-1, keepdim=True)
    out = [nxt]
    done = torch.zeros(len(limits), dtype=torch.bool, device=dev)
    steps = 0
    try:
        for i in range(1, max(limits)):
            done = done | torch.isin(nxt[:, 0], eos) | (limit <= i)
            if i % check_every == 0 and bool(done.all()):
                break
            logits = d.step(nxt)
            steps += 1
            nxt = torch.where(done[:, None], pad, logits.argmax(-1, keepdim=True))
            out.append(nxt)
        toks = torch.cat(out, 1).tolist()
    finally:
        info = d.close()
    sync(dev)
    rows = []
    stop = set(stop_ids)
    for r, n in zip(toks, limits, strict=True):
        r = r[:n]
        cut = next((j for j, t in enumerate(r) if t in stop), None)
        rows.append(r if cut is None else r[: cut + 1])
    return rows, {"steps": steps, "decode_s": round(time.perf_counter() - t0, 4), **info}


class _BatchRecall:
    """A ``cache.observer`` summing, per row, the mean over query heads of the attention recall (and the
    oracle top-k ceiling of the same size) at every sparse layer of every observed step."""

    def __init__(self):
        self.recall = self.ceiling = self.hit = None
        self.count = 0

    def __call__(self, layer, q, store, aset, scale) -> None:
        m = attention_metrics(q, store, aset, scale)
        r, c, h = (m[k].float().mean(-1) for k in ("recall", "ceiling", "topk_hit"))
        if self.recall is None:
            self.recall, self.ceiling, self.hit = r, c, h
        else:
            self.recall, self.ceiling, self.hit = self.recall + r, self.ceiling + c, self.hit + h
        self.count += 1

    def means(self, rows: int) -> dict[str, list[float] | None]:
        if self.count == 0:
            return {"recall": None, "ceiling": None, "topk_hit": None}
        f = lambda t: (t / self.count).cpu().tolist()  # noqa: E731
        return {"recall": f(self.recall), "ceiling": f(self.ceiling), "topk_hit": f(self.hit)}


@torch.inference_mode()
def teacher(model, base, first_logits, policy, budget, continuation: torch.Tensor, recall_steps: int, graph: bool):
    """Feed ``continuation`` [B, T] (its token 0 is predicted by the prefill, not scored). The first
    ``recall_steps`` steps measure attention recall (eagerly; not for ``full``, whose recall is 1 by
    definition); every step scores the NLL of the next token. Returns (per-row dict, info)."""
    dev = first_logits.device
    cont = continuation.to(dev)
    b, t = cont.shape
    d = _Decoding(model, base, policy, budget, graph)
    obs = None
    if policy != FULL and recall_steps > 0:
        obs = _BatchRecall()
        d.cache.observer = obs
    nll = torch.zeros(b, t - 1, device=dev)
    rows = torch.arange(b, device=dev)
    t0 = time.perf_counter()
    try:
        for i in range(t - 1):
            if obs is not None and i == recall_steps:
                d.cache.observer = None
                d.new_decoder()
            logits = d.step(cont[:, i : i + 1]).float()
            nll[:, i] = -torch.log_softmax(logits, -1)[rows, cont[:, i + 1]]
        nll_rows = nll.mean(1).tolist()
    finally:
        info = d.close()
    sync(dev)
    out = {"nll": nll_rows}
    out.update(obs.means(b) if obs is not None else {"recall": [1.0] * b, "ceiling": [1.0] * b, "topk_hit": [1.0] * b})
    return out, {"steps": t - 1, "decode_s": round(time.perf_counter() - t0, 4), **info}


@torch.inference_mode()
def speed(model, base, first_logits, policy, budget, steps: int, warmup: int) -> dict:
    """Tokens per second of ``steps`` free-running decode steps after ``warmup`` steps (captures happen
    there), timed with CUDA events: every step counts, page-boundary steps (index updates) included.
    (On the CPU the wall clock times them; the scorecard reports no CPU speeds.)"""
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    dev = first_logits.device
    cuda = dev.type == "cuda"
    d = _Decoding(model, base, policy, budget, cuda)
    nxt = first_logits.argmax(-1, keepdim=True)
    try:
        for _ in range(warmup):
            nxt = d.step(nxt).argmax(-1, keepdim=True)
        before = dict(d.dec.counts)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = d.step(nxt).argmax(-1, keepdim=True)
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        timed = {k: d.dec.counts[k] - before[k] for k in before}
    finally:
        info = d.close()
    b = first_logits.shape[0]
    return {
        "tokens_per_s": b * steps / (ms / 1e3),
        "ms_per_step": ms / steps,
        "batch": b,
        "steps": steps,
        "timed_steps": timed,
        **info,
    }
