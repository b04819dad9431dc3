"""The user's path: plain ``model.generate(..., cache=kvdex.Cache(...))``, no kvdex-specific call.

On CUDA transformers compiles the decode step of a compileable cache (``kvdex.Cache.is_compileable``) and
kvdex replays one graph per layer (``kvdex.engine.graphs.layer_graphs``). On the CPU: transformers' own compile
switch for other devices (``CompileConfig._compile_all_devices``) and the CPU stand-in for CUDA graphs
(``kvdex.engine.graphs.capture.STAND_IN``). Invariants: the same tokens as eager generation (a left-padded batch,
page joins, CHESS rebuilds, PRKV refreshes), the same attended tokens, graphs captured once per key and
replayed afterwards, no recompilation after the first compiled step, a cache that cannot be captured
decodes eagerly with one warning saying why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from step_graph_stand_in import StepGraphStandIn, failing_captures
from transformers import CompileConfig, StoppingCriteria, StoppingCriteriaList

import kvdex
from kvdex.engine.graphs import capture as graphs_mod
from kvdex.hf.testing import tiny_llama

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")

POLICIES = ["quest", "chess", "prkv:refresh=8"]  # per-layer graphs (pariskv, full: test_graph.py)
# select_every / pool_every (kvdex/engine/reuse.py): a select step and a reuse step are two graph variants of a step
REUSE = [
    "quest:select_every=4",
    "prkv:refresh=8:select_every=3",
    "prkv:refresh=8:rerank=2:rerank_share=0.5:pool_every=3",
]
NEW = 60  # three page joins (page 16) and CHESS / PRKV host-side work


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=4)


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 250, (2, 300))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding
    return ids, mask


class _Graphs(StoppingCriteria):
    """Graphs dynamo compiled so far, after every token (never stops generation)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kw):
        from torch._dynamo.utils import counters

        self.seen.append(int(counters["stats"]["unique_graphs"]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _generate(model, spec, compile_backend=None, stand_in=False, monkeypatch=None, **cache_kw):
    if stand_in:
        monkeypatch.setattr(graphs_mod, "STAND_IN", StepGraphStandIn)
    cache = kvdex.Cache(model, spec, budget=64, dense_layers=1, **cache_kw)
    ids, mask = _batch()
    kw = {"disable_compile": True}
    rec = _Graphs()
    if compile_backend is not None:
        cc = CompileConfig(backend=compile_backend, mode="default" if compile_backend == "inductor" else None)
        cc._compile_all_devices = True  # transformers' switch for compiling on other devices than CUDA
        kw = {"compile_config": cc}
    torch._dynamo.reset()
    out = model.generate(
        ids, attention_mask=mask, **kvdex.cache_kwargs(cache), max_new_tokens=NEW, do_sample=False,
        stopping_criteria=StoppingCriteriaList([rec]), **kw,
    )  # fmt: skip
    if stand_in:
        monkeypatch.setattr(graphs_mod, "STAND_IN", None)
    return out, cache, rec.seen


_EAGER: dict = {}


def _eager(model, spec):
    """``_generate(model, spec)``: plain eager generation, the reference of several tests below; run once per
    spec on this module's model (a worker's share of them under pytest-xdist). Do not mutate the cache."""
    if spec not in _EAGER:
        _EAGER[spec] = _generate(model, spec)
    return _EAGER[spec]


def test_cache_is_compileable(model):
    cache = kvdex.Cache(model, "quest")
    assert cache.is_compileable
    with pytest.raises(ValueError, match="step_graphs"):
        kvdex.Cache(model, "quest", step_graphs="yes")


@pytest.mark.parametrize("spec", POLICIES + REUSE)
def test_compiled_generate_with_step_graphs_equals_eager(model, spec, monkeypatch):
    ref, c_ref, _ = _eager(model, spec)
    assert c_ref.step_graphs.reason == "it needs a CUDA device"  # CPU without the stand-in: eager steps
    got, c, graphs = _generate(model, spec, "eager", stand_in=True, monkeypatch=monkeypatch)
    assert torch.equal(ref, got)
    assert c.step_graphs.reason is None
    n = c.step_graphs.counts
    layers = len(c.layers)
    assert n["captures"] >= layers and n["captures"] % layers == 0  # whole steps captured, layer by layer
    assert n["replays"] >= (c.step - 10) * layers, n  # steady decoding: replays only
    assert graphs[1] > 0 and graphs[-1] == graphs[1], f"recompiled after the first decode step: {graphs}"
    assert c.stats()["attended_tokens_per_step"] == pytest.approx(c_ref.stats()["attended_tokens_per_step"])
    assert c.step == c_ref.step and [lay.seen for lay in c.layers] == [lay.seen for lay in c_ref.layers]
    assert c.stats().get("selection_steps") == c_ref.stats().get("selection_steps")  # select_every: same schedule
    assert "_every" not in spec or c.stats()["selection_steps"]["reused"] > NEW // 2


@pytest.mark.parametrize("spec", ["quest", "full"])
def test_step_graphs_without_compile_equal_eager(model, spec, monkeypatch):
    """Plain eager generate (no compile): kvdex's per-layer step still replays its graphs."""
    ref, _, _ = _eager(model, spec)
    got, c, _ = _generate(model, spec, stand_in=True, monkeypatch=monkeypatch)
    assert torch.equal(ref, got) and c.step_graphs.counts["replays"] > 0


@pytest.mark.parametrize("after", [0, 5])
def test_a_capture_that_cannot_begin_decodes_eagerly_with_one_warning(model, monkeypatch, after):
    """A capture refused before anything of the layer ran (at the first layer of a step, or midway through one):
    that layer and the rest of generation decode eagerly, the same tokens, one warning naming the failure."""
    ref, _, _ = _eager(model, "prkv:refresh=8:select_every=3")
    calls = failing_captures(monkeypatch, after)
    with pytest.warns(UserWarning, match="capture failed.*INTERNAL ASSERT") as rec:
        got, c, _ = _generate(model, "prkv:refresh=8:select_every=3", stand_in=True, monkeypatch=monkeypatch)
    assert torch.equal(ref, got)
    assert len([w for w in rec if "capture failed" in str(w.message)]) == 1 and len(calls) == after + 1
    assert "INTERNAL ASSERT" in c.step_graphs.reason and c.step_graphs.counts["captures"] == after
    assert c.step_graphs.counts["eager"] > NEW // 2 and not c.step_graphs.graphs


def test_inductor_compiled_generate_equals_eager(model, monkeypatch):
    """The compiler transformers uses on CUDA (inductor; CUDA graphs are CUDA-only): the same tokens."""
    ref, _, _ = _eager(model, "quest")
    got, c, graphs = _generate(model, "quest", "inductor", stand_in=True, monkeypatch=monkeypatch)
    assert torch.equal(ref, got) and graphs[-1] == graphs[1]


def test_step_graphs_off_by_option(model, monkeypatch):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, c, _ = _generate(model, "quest", stand_in=True, monkeypatch=monkeypatch, step_graphs=False)
    assert c.step_graphs.counts["captures"] == 0 and "disabled" in c.step_graphs.reason
    assert not [x for x in w if "step graphs" in str(x.message)]


# ---- kvdex's torch.compile backend: whole decode steps as one graph -------------------------------------
@pytest.mark.parametrize("spec", ["quest", "chess", "prkv:refresh=8"] + REUSE)
def test_whole_step_backend_equals_eager(model, spec, monkeypatch):
    """kvdex's backend (what kvdex.enable sets as the model's compile_config): each decode step is captured
    whole (page joins, CHESS's host-side trigger, PRKV's refreshes) and replayed; the same tokens, attended
    tokens and host state as eager generation, and the per-layer step graphs stay out."""
    from kvdex.hf.step_backend import Backend

    ref, c_ref, _ = _eager(model, spec)
    got, c, graphs = _generate(model, spec, Backend("eager"), stand_in=True, monkeypatch=monkeypatch)
    assert torch.equal(ref, got)
    n = c.whole_step.counts
    assert c.whole_step.reason is None and n["captures"] <= 4 and n["replays"] >= c.step - 10, n
    assert c.step_graphs.counts == {"eager": 0, "captures": 0, "replays": 0}
    assert graphs[1] > 0 and graphs[-1] == graphs[1], f"recompiled after the first decode step: {graphs}"
    assert c.stats()["attended_tokens_per_step"] == pytest.approx(c_ref.stats()["attended_tokens_per_step"])
    assert c.step == c_ref.step and [lay.seen for lay in c.layers] == [lay.seen for lay in c_ref.layers]
    assert c.stats().get("selection_steps") == c_ref.stats().get("selection_steps")  # select_every: same schedule
    assert "_every" not in spec or c.stats()["selection_steps"]["reused"] > NEW // 2


def test_whole_step_backend_falls_back_per_layer(model, monkeypatch):
    """A policy that cannot be captured: the compiled step runs as it is, the per-layer path warns once."""
    from kvdex.hf.step_backend import Backend

    ref, _, _ = _eager(model, "icecache:search=auto")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, c, _ = _generate(model, "icecache:search=auto", Backend("eager"), stand_in=True, monkeypatch=monkeypatch)
    assert torch.equal(ref, got)
    assert "icecache" in c.whole_step.reason and c.whole_step.counts["captures"] == 0
    assert len([x for x in w if "per-layer step graphs are off" in str(x.message)]) == 1


def test_whole_step_backend_with_a_graph_break_decodes_per_layer(model, monkeypatch):
    """A graph break (here a hook; accelerate's device_map hooks, or dynamo's fallback after too many
    recompilations, do the same) splits the compiled step into several graphs: the whole-step plan would run
    once per part (page joins decided twice, a step counted twice), so the per-layer step graphs decide."""
    from kvdex.hf.step_backend import SPLIT, Backend

    hook = model.model.layers[2].register_forward_pre_hook(lambda m, a: torch._dynamo.graph_break())
    try:
        ref, c_ref, _ = _generate(model, "quest")
        got, c, _ = _generate(model, "quest", Backend("eager"), stand_in=True, monkeypatch=monkeypatch)
    finally:
        hook.remove()
    assert torch.equal(ref, got)
    assert c.whole_step.reason == SPLIT and c.whole_step.counts["captures"] == 0
    assert c.step_graphs.counts["replays"] >= (c.step - 10) * len(c.layers), c.step_graphs.counts
    assert [lay.seen for lay in c.layers] == [lay.seen for lay in c_ref.layers]


def test_enable_sets_kvdex_compile_config_unless_the_user_did():
    from kvdex.hf.step_backend import Backend

    m = tiny_llama(layers=1)
    kvdex.enable(m)  # on the CPU transformers cannot compile: kvdex sets nothing (test_enable.py: CUDA only)
    assert (
        getattr(m.generation_config, "compile_config", None) is None
        or m.generation_config.compile_config.backend != Backend()
    )
    mine = tiny_llama(layers=1)
    mine.generation_config.compile_config = CompileConfig(mode="default")
    kvdex.enable(mine)
    assert mine.generation_config.compile_config.backend == "inductor"
    with pytest.raises(ValueError, match="inductor"):
        Backend("cudagraphs")


@pytest.mark.parametrize("spec", ["quest", "chess", "prkv:refresh=8", "pariskv", "full"] + REUSE)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_whole_step_backend_on_cuda(spec):
    """On CUDA, plain model.generate with the compile config kvdex.enable sets: whole decode steps captured and
    replayed, the same greedy tokens as the same compiled model with kvdex's graphs off (fp32)."""
    m = tiny_llama(layers=4).to("cuda")
    ids, mask = (t.to("cuda") for t in _batch())

    def run(step_graphs):
        cache = kvdex.Cache(m, spec, budget=64, dense_layers=1, step_graphs=step_graphs)
        torch._dynamo.reset()
        out = m.generate(ids, attention_mask=mask, **kvdex.cache_kwargs(cache), max_new_tokens=NEW, do_sample=False)
        return out, cache

    ref, _ = run(False)
    got, c = run(True)
    assert torch.equal(ref, got)
    n = c.whole_step.counts
    assert c.whole_step.reason is None and n["captures"] >= 1 and n["replays"] >= c.step - 10, n


@pytest.mark.parametrize("spec", ["quest:select_every=4", "prkv:refresh=8:select_every=3"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_graphs_on_cuda_outlive_a_held_selection_reallocated(spec):
    """A prompt whose middle gets its first pages while decoding: the held selection (``select_every``) changes
    shape inside a capture, so it is allocated in the graphs' memory pool, and the next step drops every graph of
    the old key. Capturing into that pool again (no graph holds it, the held selection still lives in it) is an
    internal assertion of PyTorch's caching allocator; the step graphs take a new pool instead. Per-layer graphs
    without compile, fp32: the eager tokens."""
    m = tiny_llama(layers=4).to("cuda")
    torch.manual_seed(1)
    ids = torch.randint(0, 250, (2, 50), device="cuda")  # sink 16 + window 32: the middle starts below a page

    def run(step_graphs):
        cache = kvdex.Cache(m, spec, budget=64, dense_layers=1, step_graphs=step_graphs)
        out = m.generate(ids, **kvdex.cache_kwargs(cache), max_new_tokens=NEW, do_sample=False, disable_compile=True)
        return out, cache

    ref, _ = run(False)
    got, c = run(True)
    assert torch.equal(ref, got)
    n = c.step_graphs.counts
    assert c.step_graphs.reason is None and n["captures"] > len(c.layers) and n["replays"] > 0, n
