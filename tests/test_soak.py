"""Soak: memory stays flat over many decode steps (``kvdex soak``, :mod:`kvdex.bench.soak`), and caches created
and dropped in a loop free their memory.

CPU at small size: a few hundred steps of the tiny shape per row, the live tensor bytes (exact) flat, and a
planted per-step leak reported as one; 100 caches all finalized after a collection, the live tensor count
flat, the compile path's first traced cache included. ``gpu``: the same on CUDA at larger sizes
(``torch.cuda.memory_allocated`` back to its baseline after 100 caches through ``model.generate``).
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from conftest import prompt
from step_graph_stand_in import StepGraphStandIn
from transformers import CompileConfig

import kvdex
from kvdex.bench import shapes, soak
from kvdex.engine.graphs import capture as graphs_mod
from kvdex.hf.testing import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    return kvdex.enable(shapes.build_model("tiny", torch.float32, "cpu", max_positions=2048))


def _cfg(**kw) -> soak.SoakConfig:
    base = dict(shape="tiny", device="cpu", context=200, steps=70, warmup=20, every=10, budget=96, rows=())
    return soak.SoakConfig(**{**base, **kw})


def test_fit_is_least_squares():
    f = soak.fit([0, 10, 20, 30], [5.0, 25.0, 45.0, 65.0])
    assert f["slope"] == pytest.approx(2.0) and f["growth"] == 60.0
    assert soak.fit([0, 1, 2], [3.0, 3.0, 3.0])["slope"] == 0.0


@pytest.mark.parametrize("row", ["quest/device", "quest/offload", "prkv:refresh=8/device", "chess/offload"])
def test_soak_row_is_flat_on_cpu(tiny, row):
    res = soak.run_row(tiny, _cfg(), row)
    f = res["fits"]
    assert res["steps"] == 70 and res["context_end"] == 270
    assert f["device"]["samples"] >= 6
    assert f["device"]["growth"] == 0, "live tensor bytes grew with the buffers reserved up front"
    assert f["tensors"]["excess_per_step"] <= 0.02 and f["objects"]["excess_per_step"] <= 0.02, f
    assert res["flat"]["device"] and res["flat"]["tensors"] and res["flat"]["objects"], res["flat"]


def test_soak_without_reserve_subtracts_the_kv_growth(tiny):
    res = soak.run_row(tiny, _cfg(reserve=False), "full/device")
    kv = 3 * 2 * 16 * 2 * 4  # the tiny shape: layers x kv heads x head dim x (K, V) x float32
    assert res["kv_bytes_per_token"] == kv and res["fits"]["device"]["expected_per_step"] == kv
    assert res["flat"]["device"], res["fits"]["device"]


def test_full_offloaded_grows_by_its_working_set_alone(tiny):
    """``full`` offloaded attends the whole middle: its device working set and the host staging that carries it
    grow by the sparse layers' KV per token (one memory on a CPU: twice), whatever was reserved; nothing else."""
    res = soak.run_row(tiny, _cfg(steps=150), "full/offload")
    per_token = 2 * 2 * 16 * 2 * 4  # 2 sparse layers x kv heads x head dim x (K, V) x float32
    assert res["fits"]["device"]["expected_per_step"] == 2 * per_token
    assert res["flat"]["device"] and res["flat"]["tensors"] and res["flat"]["objects"], res["fits"]


def test_soak_reports_a_planted_leak(tiny, monkeypatch):
    """The soak can fail: a policy that keeps one tensor per step is reported as not flat."""
    from kvdex.policies.quest import QuestPolicy as Quest

    kept = []
    orig = Quest.on_step

    def leaky(self, step, logits):
        kept.append(torch.zeros(64))
        return orig(self, step, logits)

    monkeypatch.setattr(Quest, "on_step", leaky)
    res = soak.run_row(tiny, _cfg(steps=60), "quest/device")
    assert not res["ok"] and not res["flat"]["device"] and not res["flat"]["tensors"], res["flat"]
    assert res["fits"]["device"]["excess_per_step"] == pytest.approx(256, rel=0.05)


def test_soak_command_writes_json_and_table(tmp_path, capsys):
    from kvdex import cli

    out = tmp_path / "soak.json"
    args = "soak --shape tiny --context 150 --steps 40 --warmup 10 --every 10 --budget 96 --rows quest/offload"
    args += " --rss-tolerance 1e9"  # RSS over 40 steps is the allocator's noise
    rc = cli.main([*args.split(), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert data["ok"] and [r["row"] for r in data["rows"]] == ["quest/offload"]
    assert "quest/offload" in text and "device B/step" in text
    with pytest.raises(ValueError, match="device or POLICY"):
        soak.SoakConfig(rows=("quest/gpu",))


# ---- caches created and dropped in a loop -----------------------------------------------------------------
def _tensor_count() -> int:
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_hundred_caches_are_all_freed():
    model = tiny_llama(layers=2)
    ids = prompt(60, 3)
    done, counts = [], []
    with torch.no_grad():
        for i in range(100):
            cache = kvdex.Cache(model, "quest" if i % 2 else "full", budget=64, dense_layers=1, offload=i % 4 == 3)
            flag = [False]
            weakref.finalize(cache, flag.__setitem__, 0, True)
            done.append(flag)
            logits = model(ids, **kvdex.cache_kwargs(cache), use_cache=True).logits[:, -1:]
            if i % 4 == 0:  # and a decode step
                logits = model(logits.argmax(-1), **kvdex.cache_kwargs(cache), use_cache=True).logits[:, -1:]
            del cache, logits
            if i in (9, 99):
                gc.collect()
                counts.append(_tensor_count())
    gc.collect()
    alive = [i for i, f in enumerate(done) if not f[0]]
    assert not alive, f"caches {alive} were never freed"
    assert counts[1] <= counts[0], f"live tensors grew from {counts[0]} (10 caches) to {counts[1]} (100 caches)"


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")
def test_caches_through_the_compile_path_are_freed(monkeypatch):
    """kvdex's compile backend (whole steps on the CPU stand-in): torch.compile keeps references to the first
    cache it traced in cyclic garbage; after a collection every cache is gone, the first included."""
    from kvdex.hf.step_backend import Backend

    model = tiny_llama(layers=2)
    cc = CompileConfig(backend=Backend("eager"), mode=None)
    cc._compile_all_devices = True
    monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    ids = prompt(60, 3)
    torch._dynamo.reset()
    refs, counts = [], []
    for _ in range(4):
        cache = kvdex.Cache(model, "quest", budget=64, dense_layers=1)
        refs.append(weakref.ref(cache))
        model.generate(ids, attention_mask=torch.ones_like(ids), **kvdex.cache_kwargs(cache), max_new_tokens=6,
                       min_new_tokens=6, do_sample=False, compile_config=cc)  # fmt: skip
        assert cache.whole_step.counts["replays"] > 0
        del cache
        StepGraphStandIn.instances.clear()  # the stand-in's registry of every graph (a test helper's)
        gc.collect()
        counts.append(_tensor_count())
    assert [r() for r in refs] == [None] * 4
    assert counts[-1] <= counts[1], counts


# ---- CUDA ----------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_hundred_caches_return_cuda_memory_to_baseline():
    """100 caches through plain ``model.generate`` on CUDA (kvdex's compile backend: whole steps captured; every
    fourth offloaded, pinned): after each is dropped and a collection, ``memory_allocated`` is back at the
    baseline taken after the first (compilation and its graphs' pools in place)."""
    model = tiny_llama(layers=3).to("cuda")
    ids = prompt(200, 3).to("cuda")

    def one(i):
        cache = kvdex.Cache(model, ["quest", "chess", "full", "pariskv"][i % 4], budget=64, dense_layers=1,
                            offload=i % 4 == 1)  # fmt: skip
        model.generate(ids, attention_mask=torch.ones_like(ids), **kvdex.cache_kwargs(cache), max_new_tokens=24,
                       min_new_tokens=24, do_sample=False)  # fmt: skip
        ref = weakref.ref(cache)
        assert cache.whole_step.counts["replays"] > 0, cache.whole_step.counts
        return ref

    torch._dynamo.reset()
    first = [one(i) for i in range(4)]  # one of each policy: compiled and captured once
    gc.collect()
    graphs_mod.free_deferred()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    refs = [one(i) for i in range(100)]
    gc.collect()
    graphs_mod.free_deferred()
    torch.cuda.synchronize()
    assert [r() for r in first + refs] == [None] * 104, "a cache outlived its generate"
    grown = torch.cuda.memory_allocated() - base
    assert grown <= 1 << 20, f"memory_allocated {grown} bytes above the baseline after 100 caches"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("row", [f"{p}/{s}" for p in soak.POLICIES for s in ("device", "offload")])
def test_soak_row_is_flat_on_cuda(row):
    """A short soak of every seed policy on CUDA (CUDA graphs where capturable): 1500 steps from a 2k context,
    memory_allocated, tensors and objects flat."""
    model = shapes.build_model("tiny", torch.float32, "cuda", max_positions=8192)
    cfg = soak.SoakConfig(shape="tiny", device="cuda", context=2048, steps=1500, warmup=200, every=100, budget=256)
    res = soak.run_row(kvdex.enable(model), cfg, row)
    assert res["flat"]["device"] and res["flat"]["tensors"] and res["flat"]["objects"], res["fits"]
