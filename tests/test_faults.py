"""Faults: a generate interrupted mid-way, and host memory that runs out while offloading.

* A ``KeyboardInterrupt`` or an exception in mid-``generate`` (a logits processor at step 5, a stopping
  criterion, the policy's selection inside a decode step -- on the graph paths, inside the step's capture)
  leaves the model usable: a new ``kvdex.Cache`` then decodes exactly the tokens of a model that was never
  interrupted, and plain dense generation too. Eager, per-layer step graphs and kvdex's compile backend on the
  CPU (the CUDA-graph stand-in); on CUDA (``gpu``) the real graphs and compilation.
* A step interrupted between ``kvdex::append`` and ``kvdex::attend`` pins nothing of a dropped cache.
* Host memory for offloaded pages that is not there: a :class:`kvdex.storage.host.HostMemoryError` (a
  ``MemoryError`` and a ``RuntimeError``) saying how many bytes were needed, how many are available and what to
  change -- from the check before allocating, or from a failed allocation.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import build_pair, prompt
from step_graph_stand_in import StepGraphStandIn
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import kvdex
from kvdex.engine.graphs import capture as graphs_mod
from kvdex.hf import compiled_ops
from kvdex.storage import host as host_mod

NEW = 40  # two page joins after the 100-token prompt (page 16)
AT = 5  # the step at which the fault fires


@pytest.fixture(scope="module")
def victim():
    """The model that gets interrupted (every test of the module interrupts it again)."""
    return build_pair("llama_gqa")[0]


@pytest.fixture(scope="module")
def untouched():
    """The same weights, never interrupted: the reference."""
    return build_pair("llama_gqa")[0]


class _Proc(LogitsProcessor):
    def __init__(self, exc, at: int = AT):
        self.exc, self.at, self.calls = exc, at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc
        return scores


class _Stop(StoppingCriteria):
    def __init__(self, exc, at: int = AT):
        self.exc, self.at, self.calls = exc, at, 0

    def __call__(self, input_ids, scores, **kw):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _raise_in_select(cache, exc) -> None:
    """``exc`` from the policy's selection of the first sparse layer in the second decode step that runs Python:
    on the graph paths the step after the eager warm-up, i.e. inside the first capture (a replay runs none)."""
    orig, calls = cache.policy.select, [0]

    def select(q, view):
        calls[0] += 1
        if calls[0] == len(cache.policy.info.sparse_layers) + 1:
            raise exc
        return orig(q, view)

    cache.policy.select = select


def _kw(mode: str) -> dict:
    if mode != "compile":
        return {"disable_compile": True}
    from kvdex.hf.step_backend import Backend

    cc = CompileConfig(backend=Backend("eager"), mode=None)
    cc._compile_all_devices = True  # transformers' switch for compiling on other devices than CUDA
    return {"compile_config": cc}


def _generate(model, spec, mode="eager", monkeypatch=None, fault=None, new=NEW):
    """Greedy tokens of prompt(100, 3) with a fresh cache of ``spec`` (None: transformers' dense cache).
    ``mode``: eager, graphs (per-layer step graphs on the CPU stand-in) or compile (kvdex's backend, whole steps
    on the stand-in). ``fault``: (where, exception): "processor", "stopping" or "select"."""
    graphs_mod.STAND_IN = StepGraphStandIn if mode != "eager" else None
    ids = prompt(100, 3)
    kw = _kw(mode)
    cache = None if spec is None else kvdex.Cache(model, spec, budget=64, dense_layers=1)
    if fault is not None:
        where, exc = fault
        if where == "processor":
            kw["logits_processor"] = LogitsProcessorList([_Proc(exc)])
        elif where == "stopping":
            kw["stopping_criteria"] = StoppingCriteriaList([_Stop(exc)])
        else:
            _raise_in_select(cache, exc)
    try:
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **kvdex.cache_kwargs(cache), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, **kw,
        )  # fmt: skip
    finally:
        graphs_mod.STAND_IN = None
        StepGraphStandIn.instances.clear()  # the stand-in's registry of every graph (a test helper's)
    return out, cache


_REF: dict = {}


def _reference(untouched, spec):
    if spec not in _REF:
        _REF[spec] = _generate(untouched, spec)[0]
    return _REF[spec]


FAULTS = {
    "interrupt-in-processor": ("processor", KeyboardInterrupt("Ctrl-C at step 5")),
    "error-in-stopping-criteria": ("stopping", RuntimeError("a stopping criterion failed at step 5")),
    "interrupt-in-select": ("select", KeyboardInterrupt("Ctrl-C inside a decode step's capture")),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize(
    "spec,mode",
    [("quest", "eager"), ("quest", "graphs"), ("chess", "graphs"), ("prkv:refresh=8", "graphs"),
     ("pariskv", "eager"), ("quest", "compile")],
)  # fmt: skip
def test_interrupted_generate_leaves_the_model_usable(victim, untouched, spec, mode, fault, monkeypatch):
    where, exc = FAULTS[fault]
    with pytest.raises(type(exc), match=str(exc)):
        _generate(victim, spec, mode, fault=(where, exc))
    assert graphs_mod.gc.isenabled()  # a capture that raised restores the collector
    got, cache = _generate(victim, spec, mode)
    assert torch.equal(got, _reference(untouched, spec)), "a new cache after the interrupted generate decodes otherwise"
    if mode == "graphs":  # the new cache took the graph path (captured and replayed), not an eager fallback
        assert cache.step_graphs.reason is None and cache.step_graphs.counts["replays"] > 0
    if mode == "compile":
        assert cache.whole_step.reason is None and cache.whole_step.counts["replays"] > 0
    dense, _ = _generate(victim, None, "eager")
    assert torch.equal(dense, _reference(untouched, None)), "dense generate after the interrupted generate differs"


def test_interrupted_step_pins_no_dropped_cache(victim):
    """A step interrupted between ``kvdex::append`` and ``kvdex::attend`` (Ctrl-C inside the compiled model)
    leaves its entry in the ops' pending table: it must not keep the dropped cache's layer and store alive."""
    cache = kvdex.Cache(victim, "quest", budget=64, dense_layers=1)
    with torch.no_grad():
        victim(prompt(100, 3), **kvdex.cache_kwargs(cache), use_cache=True)
    k = torch.randn(1, 2, 1, 16)
    compiled_ops.append(k, k.clone(), cache._handle, 1)  # appended; the step stops before its attention
    refs = [weakref.ref(cache), weakref.ref(cache.layers[1]), weakref.ref(cache.layers[1].store)]
    del cache
    gc.collect()
    assert [r() for r in refs] == [None] * 3, "the pending table keeps a dropped cache's layer alive"
    with pytest.raises(RuntimeError, match="no kvdex::append"):
        compiled_ops.attend(torch.randn(1, 4, 1, 16), torch.empty(1, 2, 0, 16), 1, 0.25)


# ---- host memory ------------------------------------------------------------------------------------------
def _offload_prefill(model, n=300):
    cache = kvdex.Cache(model, "quest", budget=64, dense_layers=1, offload=True)
    with torch.no_grad():
        model(prompt(n, 3), **kvdex.cache_kwargs(cache), use_cache=True)
    return cache


def test_host_memory_short_gives_a_clear_error(victim, monkeypatch):
    monkeypatch.setattr(host_mod, "available_host_bytes", lambda: 4096)
    with pytest.raises(host_mod.HostMemoryError) as info:
        _offload_prefill(victim)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err, RuntimeError)
    msg = str(err)
    # one layer's pages at the prompt: batch 1 x 2 kv heads x pages x (K, V) x 16 tokens x head dim 16 x 4 bytes
    pages = (300 - 16) // 16 + 1 - 2 + host_mod._GROW_PAGES
    need = 1 * 2 * pages * 2 * 16 * 16 * 4
    assert f"({need} bytes)" in msg and "(4096 bytes) is available" in msg, msg
    assert "shorter context" in msg and "offload=False" in msg and "KVDEX_HOST_MEMORY_CHECK=0" in msg
    monkeypatch.undo()  # the model is usable afterwards: an offloaded cache decodes when the memory is there
    out, _ = _generate(victim, "quest", new=4)
    assert out.shape[1] == 104


def test_icecache_semantic_pages_short_of_host_memory_give_a_clear_error(victim, monkeypatch):
    """IceCache's offloaded middle lives in semantic pages (kvdex.storage.semantic): their host allocation is
    checked as the KV pages' are, and a failed one is reported, not raw."""
    from kvdex.storage import semantic as semantic_mod

    real, grow, inside = host_mod.available_host_bytes, semantic_mod.SemanticOffloadStore._reserve, []

    def reserve(self, *args):  # the semantic pages' growth sees 4 KiB available, the other allocations the machine
        inside.append(1)
        try:
            return grow(self, *args)
        finally:
            inside.pop()

    monkeypatch.setattr(semantic_mod.SemanticOffloadStore, "_reserve", reserve)
    monkeypatch.setattr(host_mod, "available_host_bytes", lambda: 4096 if inside else real())
    cache = kvdex.Cache(victim, "icecache:search=host", budget=64, dense_layers=1, offload=True)
    ids = prompt(300, 3)
    with pytest.raises(host_mod.HostMemoryError, match="semantic pages") as info:  # placed at the first decode step
        victim.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                        **kvdex.cache_kwargs(cache))  # fmt: skip
    assert "(4096 bytes) is available" in str(info.value) and "offload=False" in str(info.value)
    monkeypatch.undo()
    out, _ = _generate(victim, "quest", new=4)  # the model is usable afterwards
    assert out.shape[1] == 104


def test_host_memory_check_can_be_skipped(victim, monkeypatch):
    monkeypatch.setattr(host_mod, "available_host_bytes", lambda: 4096)
    monkeypatch.setenv("KVDEX_HOST_MEMORY_CHECK", "0")
    cache = _offload_prefill(victim)
    assert cache.stats()["kv_bytes_host"] > 4096


@pytest.mark.parametrize(
    "text",
    ["CUDA error: out of memory", "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory"],
)
def test_failed_host_allocation_is_reported_not_raw(victim, monkeypatch, text):
    def fail(self, shape, nbytes):
        raise RuntimeError(text)

    monkeypatch.setattr(host_mod.HostPages, "_alloc_unchecked", fail)
    with pytest.raises(host_mod.HostMemoryError, match="the allocation failed") as info:
        _offload_prefill(victim)
    assert text[:20] in str(info.value) and isinstance(info.value.__cause__, RuntimeError)


def test_other_allocation_errors_pass_unchanged(victim, monkeypatch):
    def fail(self, shape, nbytes):
        raise RuntimeError("something else")

    monkeypatch.setattr(host_mod.HostPages, "_alloc_unchecked", fail)
    with pytest.raises(RuntimeError, match="something else") as info:
        _offload_prefill(victim)
    assert not isinstance(info.value, host_mod.HostMemoryError)


def test_available_host_bytes_reads_the_machine():
    n = host_mod.available_host_bytes()
    assert n is None or n > 0


# ---- CUDA ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["quest", "chess", "prkv:refresh=8", "pariskv", "full"])
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "per-layer"])
def test_interrupted_generate_on_cuda(spec, fault, compiled):
    """Plain ``model.generate`` on CUDA (kvdex's compile backend: whole steps captured; or per-layer step graphs)
    interrupted at step 5 -- with "select", inside the decode step, i.e. inside a graph capture or replay -- then
    a new cache gives a never-interrupted model's tokens (fp32), no capture is left open, dense generate matches."""
    where, exc = FAULTS[fault]
    model = build_pair("llama_gqa")[0].to("cuda")
    fresh = build_pair("llama_gqa")[0].to("cuda")
    ids = prompt(100, 3).to("cuda")

    def gen(m, spec, fault=None):
        cache = None if spec is None else kvdex.Cache(m, spec, budget=64, dense_layers=1)
        kw = {} if compiled else {"disable_compile": True}
        if fault == "processor":
            kw["logits_processor"] = LogitsProcessorList([_Proc(exc)])
        elif fault == "stopping":
            kw["stopping_criteria"] = StoppingCriteriaList([_Stop(exc)])
        elif fault == "select":
            _raise_in_select(cache, exc)
        out = m.generate(
            ids, attention_mask=torch.ones_like(ids), **kvdex.cache_kwargs(cache), max_new_tokens=NEW,
            min_new_tokens=NEW, do_sample=False, **kw,
        )  # fmt: skip
        return out, cache

    torch._dynamo.reset()
    ref, _ = gen(fresh, spec)
    ref_dense, _ = gen(fresh, None)
    with pytest.raises(type(exc), match=str(exc)):
        gen(model, spec, where)
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    got, cache = gen(model, spec)
    assert torch.equal(got, ref)
    steps = cache.whole_step if compiled else cache.step_graphs
    assert steps.reason is None and steps.counts["replays"] > 0, steps.counts
    dense, _ = gen(model, None)
    assert torch.equal(dense, ref_dense)
