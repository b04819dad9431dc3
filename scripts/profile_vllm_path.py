"""Where a served request's decode steps go: kvdex's vLLM request path, without vLLM, at a model's attention shape.

Drives what kvdex's vLLM backend runs for its attention layers -- :class:`~kvdex.vllm.RequestTable` (one state per
request) and :func:`~kvdex.vllm.forward_layer` (each layer's cache write, then each request's decode step) -- over
paged caches in vLLM's layout: ``--requests`` requests of ``--context`` random prompt tokens (written straight into
the blocks; the prompt's attention is skipped), then ``--steps`` decode steps of all of them together, each timed
on the host after a device synchronisation. The model's own layers are not run, so a step's time is the attention
layers' alone: kvdex's host work per request and layer, its graph replays and the selections' kernels. Prints the
median, mean and 90th percentile per step and the slowest steps, each with what the requests' step graphs did in
it (``E`` eager steps, ``C`` captures of a layer's graph), which names a step that warms up or captures
(``--eager``: no decode graphs). A warm-up request (one request, as many steps) runs first, as ``kvdex vllm bench``'s
does, so that Triton's first-use compiles fall outside the timed steps. The cache write is kvdex's PyTorch form,
not vLLM's kernel.

    python scripts/profile_vllm_path.py --policy prkv --context 32768 --requests 1 --steps 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from kvdex.bench.shapes import make_config, shape_names
from kvdex.hf.model_parts import head_geometry
from kvdex.vllm import Geometry, RequestState, RequestTable, forward_layer, settings_from
from kvdex.vllm.paged import kv_cache_shape, token_slots

PROMPT_CHUNK = 4096  # prompt tokens per engine step (vLLM's chunked prefill)


class PagedRun:
    """The requests' blocks, caches and lengths, and one engine step of kvdex's attention layers over them."""

    def __init__(self, a: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> None:
        cfg = make_config(a.shape)
        self.layers = cfg.num_hidden_layers
        self.hq, self.h, self.d = head_geometry(SimpleNamespace(config=cfg))  # (it reads a model's config)
        self.dev, self.dtype, self.ps = dev, dtype, a.page_size
        settings = settings_from({"kvdex": {"policy": a.policy, "budget": a.budget, "page_size": a.page_size,
                                            "decode_graphs": not a.eager}})  # fmt: skip
        geo = Geometry(self.layers, self.hq, self.h, self.d, self.ps)
        width = -(-(a.context + a.steps) // self.ps) + 2  # vLLM's block table: as wide as the longest request
        blocks = a.requests * width + 1  # block 0: vLLM's null block
        self.kv = [torch.zeros(kv_cache_shape(blocks, self.ps, self.h, self.d), device=dev, dtype=dtype)
                   for _ in range(self.layers)]  # fmt: skip
        self.table = RequestTable(lambda caches: RequestState(settings, geo, caches=caches), self.ps)
        self.rows = torch.arange(1, blocks, device=dev).view(a.requests, width)
        self.computed = [0] * a.requests
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.qkv: dict[int, tuple[torch.Tensor, ...]] = {}  # tokens in a step -> its q, k, v (made once, untimed)

    def _inputs(self, t: int) -> tuple[torch.Tensor, ...]:
        """Random q [t, Hq, D], k, v [t, H, D] for a step of ``t`` tokens (the same for every layer and step of
        that size: what they hold does not change the time)."""
        if t not in self.qkv:
            self.qkv[t] = tuple(torch.randn(t, h, self.d, device=self.dev, dtype=self.dtype, generator=self.gen)
                                for h in (self.hq, self.h, self.h))  # fmt: skip
        return self.qkv[t]

    def step(self, tokens: dict[int, int]) -> None:
        """One engine step: ``tokens[r]`` new tokens of request ``r`` (its rows in that order)."""
        reqs = list(tokens)
        starts, lens, slots = [0], [], []
        for r in reqs:
            pos = torch.arange(self.computed[r], self.computed[r] + tokens[r], device=self.dev)
            slots.append(token_slots(self.rows[r], pos, self.ps))
            starts.append(starts[-1] + tokens[r])
            lens.append(self.computed[r] + tokens[r])
        rows = self.table.plan(torch.tensor(starts), torch.tensor(lens), self.rows[reqs])
        slot_mapping = torch.cat(slots)
        q, k, v = self._inputs(starts[-1])
        for layer in range(self.layers):
            forward_layer(rows, layer, q, k, v, self.kv[layer][0], self.kv[layer][1], slot_mapping, self.d**-0.5,
                          torch.empty_like(q), prefill=lambda q, *_: torch.zeros_like(q))  # fmt: skip
        for r in reqs:
            self.computed[r] += tokens[r]

    def graph_counts(self) -> dict[str, int]:
        """Eager steps and layer captures of the running requests' step graphs so far."""
        out = {"eager": 0, "captures": 0}
        for st in self.table.running:
            if st.step_graphs is not None:
                for k in out:
                    out[k] += st.step_graphs.counts[k]
        return out


def _prefill(run: PagedRun, context: int) -> None:
    """Each request's prompt, alone, in chunks."""
    for r in range(len(run.computed)):
        while run.computed[r] < context:
            run.step({r: min(PROMPT_CHUNK, context - run.computed[r])})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=shape_names())
    p.add_argument("--policy", default="prkv")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--eager", action="store_true", help="no decode graphs (the vLLM setting decode_graphs off)")
    p.add_argument("--no-warmup", action="store_true",
                   help="no warm-up request (one of --context tokens decoding --steps steps first)")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args(argv)
    for name in ("budget", "context", "requests", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not a.no_warmup:  # first-use costs (Triton compiling each kind of step's kernels) outside the timed steps
        warm = PagedRun(argparse.Namespace(**{**vars(a), "requests": 1}), dev, dtype)
        _prefill(warm, a.context)
        for _ in range(a.steps):
            warm.step({0: 1})
        del warm
    run = PagedRun(a, dev, dtype)
    _prefill(run, a.context)
    times, events = [], []
    for _ in range(a.steps):
        before = run.graph_counts()
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        run.step(dict.fromkeys(range(a.requests), 1))
        if cuda:
            torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
        after = run.graph_counts()
        events.append(f"E{after['eager'] - before['eager']} C{after['captures'] - before['captures']}")
    ts = sorted(times)
    report = {"policy": a.policy, "shape": a.shape, "context": a.context, "requests": a.requests,
              "decode_graphs": not a.eager, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
              "ms_median": round(statistics.median(times), 2), "ms_mean": round(statistics.fmean(times), 2),
              "ms_p90": round(ts[int(0.9 * (len(ts) - 1))], 2)}  # fmt: skip
    print(json.dumps(report))
    print("slowest decode steps (step, ms, step graphs: E eager steps, C layer captures):")
    for i in sorted(range(a.steps), key=lambda i: -times[i])[: a.top]:
        print(f"  {i:5d} {times[i]:10.1f}  {events[i]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
