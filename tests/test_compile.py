"""``GraphDecoder(compile=True)`` / ``kvdex.generate(..., compile=True)``: the model's decoder layers run
through torch.compile (inductor) while kvdex's cache update and attention stay eager.

On CPU there is no CUDA graph: every step is an eager step through the compiled layers (the same path
as the graph decoder's page-boundary steps and its warm-up before a capture). Invariants: compiled ==
uncompiled logits (fp32), no recompilation after the first step (page boundaries included, and for a
second decoder on the same model), the model's layers are restored after every step, the kernels of
the model's own work are fewer while kvdex's are unchanged, bad options -> ValueError, a compiler
failure before the cache changed falls back with one warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import PAGE, build_pair, left_padded, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.bench.compile import step_kernels
from kvdex.hf.compiled_layers import decoder_layers
from kvdex.hf.graph import GraphDecoder

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")

STEPS = 2 * PAGE + 6  # crosses two page boundaries (a page joins the middle every PAGE tokens)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _decode(model, compile, steps=STEPS, policy="quest", forced=None, n=100, **cache_kw):
    """Teacher-forced decode after an n-token prompt: (logits [steps, B, V], decoder, graphs compiled per step)."""
    cache = kvdex.Cache(model, policy, budget=64, **cache_kw)
    with torch.no_grad():
        nxt = model(input_ids=prompt(n, 3), **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        dec = GraphDecoder(model, cache, compile=compile, warn=False)
        out, new = [], []
        for i in range(steps):
            g0 = _graphs()
            lg = dec.step(nxt if forced is None or forced[i] is None else forced[i])  # teacher forcing
            new.append(_graphs() - g0)
            out.append(lg)
            nxt = lg.argmax(-1, keepdim=True)
    return torch.stack(out), dec, new


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2", "mistral"])
def test_compiled_equals_eager_without_recompiles(family):
    model, _ = shared_pair(family)
    ref, _, _ = _decode(model, False)
    got, dec, new = _decode(model, True, forced=[None] + [r.argmax(-1, keepdim=True) for r in ref[:-1]])
    assert dec.compile_reason is None and dec.compiled is not None
    assert new[0] > 0  # the first decode step compiled the layers
    assert sum(new[1:]) == 0, f"recompiled at steps {[i for i, x in enumerate(new) if x]}"
    assert dec.counts["eager"] == STEPS  # CPU: every step eager, through the compiled layers
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= 1e-4 * scale
    for box, i, layer, _ in dec.compiled.slots:  # the model is left as it was
        assert box[i] is layer
    assert all(not isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())


def test_second_decoder_and_other_policy_reuse_the_compiled_code():
    model, _ = shared_pair("llama_gqa")
    _decode(model, True, steps=2)
    _, dec, new = _decode(model, True, steps=PAGE + 2, policy="streaming", offload=True)
    assert sum(new) == 0 and dec.compiled.graphs == 0


def test_more_layers_than_the_default_recompile_limit():
    """Dynamo specialises on each layer's ``layer_idx``: a model deeper than torch's recompile limit must
    not run its last layers uncompiled (the decoder raises the limit; here hitting it would raise)."""
    model, _ = build_pair("llama_gqa", num_hidden_layers=torch._dynamo.config.recompile_limit + 2)
    ref, _, _ = _decode(model, False, steps=PAGE + 2)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        got, dec, new = _decode(model, True, steps=PAGE + 2)
    assert sum(new[1:]) == 0
    assert float((got - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


def test_generate_compiled_gives_the_same_tokens_left_padded():
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([40, 57], seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: graph decoding off (warned)
        a = kvdex.generate(model, kvdex.Cache(model, "quest", budget=64), ids, mask, max_new_tokens=24)
        cache = kvdex.Cache(model, "quest", budget=64)
        b = kvdex.generate(model, cache, ids, mask, max_new_tokens=24, compile=True)
    assert torch.equal(a, b)
    assert cache.compile_reason is None


def test_kernel_counts_model_work_fused_kvdex_unchanged():
    """The CPU proxy of device kernels per decode step (kvdex.bench.compile): the model's own work
    shrinks (RMSNorm, RoPE, SiLU * up, residual adds fused), kvdex's (cache update + attention) is the
    same code, uncompiled, so the same count."""
    model, _ = shared_pair("llama_gqa")
    n = len(decoder_layers(model))
    torch._dynamo.reset()  # compile again, here, with kernel names in the trace (compiled code is shared)
    res = {}
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        for comp in (False, True):
            cache = kvdex.Cache(model, "quest", budget=64)
            with torch.no_grad():
                nxt = model(input_ids=prompt(100, 3), **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
                dec = GraphDecoder(model, cache, compile=comp, warn=False)
                for _ in range(2):
                    nxt = dec.step(nxt).argmax(-1, keepdim=True)
                res[comp] = step_kernels(dec, nxt)
    assert res[True]["kvdex"] == res[False]["kvdex"] > 0
    assert any("cpp_fused" in k for k in res[True]["by_name"])
    # per layer: q, k, v, o, gate, up, down matmuls + a handful of fused kernels, against ~30 ops eager
    assert res[True]["model"] + 10 * n <= res[False]["model"]


@pytest.mark.parametrize("bad", ["reduce-overhead", "max-autotune", 1, "fast"])
def test_bad_compile_option_refused(llama, bad):
    model, _ = llama
    with pytest.raises(ValueError, match="compile"):
        GraphDecoder(model, kvdex.Cache(model, "quest", budget=64), compile=bad)
    with pytest.raises(ValueError, match="compile"):
        kvdex.generate(model, kvdex.Cache(model, "quest", budget=64), prompt(20, 1), compile=bad)


def _failing_after(n_ok: int):
    """A torch.compile backend that compiles ``n_ok`` graphs (as eager) and then fails."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        if len(calls) > n_ok:
            raise RuntimeError("no compiler here")
        return gm.forward

    return backend


def _with_backend(dec, backend):
    dec.compiled.slots = [
        (box, i, layer, torch.compile(layer, backend=backend)) for box, i, layer, _ in dec.compiled.slots
    ]


def test_compiler_failure_before_the_cache_changed_falls_back_with_one_warning():
    model, _ = shared_pair("llama_gqa")
    torch._dynamo.reset()  # compiled code is shared between models of one class: compile again, here
    ref, _, _ = _decode(model, False, steps=3)
    cache = kvdex.Cache(model, "quest", budget=64)
    with torch.no_grad():
        nxt = model(input_ids=prompt(100, 3), **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        dec = GraphDecoder(model, cache, compile=True, warn=True)
        _with_backend(dec, _failing_after(0))  # the first graph (before layer 0's cache update) fails
        with pytest.warns(UserWarning, match="torch.compile is off") as rec:
            got = [dec.step(nxt)]
            for _ in range(2):
                got.append(dec.step(got[-1].argmax(-1, keepdim=True)))
    assert sum("torch.compile is off" in str(w.message) for w in rec) == 1
    assert dec.compiled is None and "no compiler here" in dec.compile_reason
    assert torch.allclose(torch.stack(got), ref, atol=1e-5, rtol=0)
    assert all(box[i] is layer for box, i, layer in decoder_layers(model))


def test_compiler_failure_after_the_cache_changed_is_raised():
    model, _ = shared_pair("llama_gqa")
    torch._dynamo.reset()  # compiled code is shared between models of one class: compile again, here
    cache = kvdex.Cache(model, "quest", budget=64)
    with torch.no_grad():
        nxt = model(input_ids=prompt(100, 3), **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        dec = GraphDecoder(model, cache, compile=True, warn=False)
        _with_backend(dec, _failing_after(2))  # layer 0: norm and q/k/v + RoPE compile, the rest fails
        with pytest.raises(Exception, match="no compiler here"):
            dec.step(nxt)
    assert all(box[i] is layer for box, i, layer in decoder_layers(model))  # restored even so


# ---- kvdex bench --compile ---------------------------------------------------------------------------


def test_bench_compile_methods_and_cpu_measure():
    from kvdex.bench import runner, shapes
    from kvdex.bench.cli import build_parser, config_from_args

    cfg = runner.BenchConfig(
        shape="tiny", dtype="float32", device="cpu", contexts=(96,), batches=(1,), policies=("quest",),
        storages=("device", "offload"), baselines=(), budget=64, steps=3, warmup=1, split_steps=0,
        check_context=80, graph=True, compile=True,
    )  # fmt: skip
    assert cfg.methods() == [
        "quest/device", "quest/offload", "quest/device+graph", "quest/offload+graph",
        "quest/device+graph+compile", "quest/offload+graph+compile",
    ]  # fmt: skip
    assert runner.base_method("quest/offload+graph+compile") == "quest/offload"
    import argparse

    args = build_parser(argparse.ArgumentParser()).parse_args(["--compile", "--device", "cpu"])
    assert config_from_args(args).graph is True and config_from_args(args).compile is True
    model = shapes.build_model("tiny", torch.float32, "cpu")
    rec = runner.measure(model, "quest/device+graph+compile", 96, 1, cfg)  # CPU: eager steps, compiled layers
    assert rec["status"] == "ok", rec.get("error")
    assert rec["compile_reason"] is None and rec["compiled_graphs"] is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["quest/device", "quest/offload", "streaming/device"])
def test_compiled_graph_decoding_matches_eager_on_gpu(method):
    """Inductor's kernels recorded inside kvdex's CUDA graph: replays happen, no recompiles after the
    warm-up, logits as the uncompiled eager run (fp32: 1e-3 of max |logit|, runner.check_graph)."""
    from kvdex.bench import runner, shapes

    model = shapes.build_model("tiny", torch.float32, "cuda")
    cfg = runner.BenchConfig(
        shape="tiny", dtype="float32", device="cuda", contexts=(150,), batches=(1,), policies=("quest",),
        storages=("device",), baselines=(), budget=80, check_context=150, graph=True, compile=True,
    )  # fmt: skip
    res = runner.check_graph(model, cfg, [f"{method}+graph+compile"], steps=40)[0]
    assert res["ok"], res
    assert res["compile_reason"] is None and res["counts"]["replays"] > 20 and res["counts"]["captures"] >= 1
    g0 = _graphs()
    res = runner.check_graph(model, cfg, [f"{method}+graph+compile"], steps=40)[0]  # compiled code reused
    assert res["ok"] and _graphs() == g0
