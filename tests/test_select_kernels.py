"""The device work of a replayable decode step's ``select``, per sparse layer (CUDA-graph decoding).

In a captured step every op that launches a kernel costs a few microseconds of GPU time whatever its
size, once per sparse layer and step, so ArkVale's and PRKV's selections are held to an upper bound on
their number of such ops. Counted on CPU with the trace of tests/test_graph.py (static sizing, the
PyTorch paths; on CUDA the digest scoring is one Triton kernel instead, ``kvdex.kernels.digest_triton``):
every aten op the trace keeps except those that launch nothing on a GPU (``kvdex.bench.compile.NO_KERNEL``:
views, allocations without fill) and the CPU wrapping of a Python number (``scalar_tensor``).

A change that adds device work to these selections must raise the bound here, on purpose.
"""

from __future__ import annotations

import collections

import pytest
import test_graph as G

import kvdex
from kvdex.bench import runner
from kvdex.bench.compile import NO_KERNEL
from kvdex.hf.graph import GraphDecoder

tiny = G.tiny

# spec -> kernels per sparse layer of select (budget 176: 128 retrieved tokens, prkv: 32 static + 6 pages)
BOUNDS = {
    "arkvale": 34,  # digest scores 15 (1 on CUDA), top-k 3, ArkVale's cache bookkeeping 15
    "prkv:rerank=0": 34,  # the paper's selection: query ring 8, digest scores 18 (1 on CUDA), top-k 3, static region 4
    "prkv:rerank=0:static_ratio=0": 19,  # ArkVale's selection without its cache bookkeeping
}


def _kernels(trace) -> list[str]:
    names = [op[0].split(".")[1] for op in trace.ops]
    return [n for n in names if f"aten::{n}" not in NO_KERNEL and n != "scalar_tensor"]


def select_kernels(model, spec: str, steps: int = 12, budget: int = 176, length: int = 400) -> list[list[str]]:
    """The kernels of ``select`` per sparse layer in the last replayable step of ``steps`` decode steps."""
    ids = runner._prompt(2, length, model.config.vocab_size, 3, "cpu")
    cache = kvdex.Cache(model, spec, budget, dense_layers=1)
    nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
    for lay in cache.layers:
        lay.store.static = True
    dec = GraphDecoder(model, cache)  # its decisions only (no CUDA: nothing is captured)
    tracer = G._Tracer(cache)
    last = None
    for _ in range(steps):
        key = None if dec.plan.needs_eager() else dec.plan.key()
        tracer.on = key is not None
        tracer.steps.append([])
        nxt, _ = runner._step(model, cache, nxt)
        if key is not None:
            last = tracer.steps[-1]
            assert not [e for tr in last for e in tr.errors]
    assert last, "no replayable step"
    return [_kernels(tr) for tr in last]


@pytest.mark.parametrize("spec", sorted(BOUNDS))
def test_select_kernels_per_layer_are_bounded(tiny, spec):
    layers = select_kernels(tiny, spec)
    counts = [len(k) for k in layers]
    assert counts and min(counts) > 0
    worst = layers[counts.index(max(counts))]
    assert max(counts) <= BOUNDS[spec], f"{spec}: {max(counts)} kernels per layer: {collections.Counter(worst)}"


def test_the_count_sees_the_selection(tiny):
    """Not vacuous: the static region's ops (PRKV's tail tokens) are counted, and a non-kernel op is not."""
    with_static = select_kernels(tiny, "prkv:rerank=0")[0]
    without = select_kernels(tiny, "prkv:rerank=0:static_ratio=0")[0]
    assert "cat" in with_static and "any" in with_static and "any" not in without
    assert "topk" in with_static and "view" not in with_static
