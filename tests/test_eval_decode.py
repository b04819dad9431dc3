"""``kvdex eval --decode {auto,eager,graph}``: decode steps through CUDA graphs (GraphDecoder) or eagerly.

On CPU ``graph`` falls back to eager steps (GraphDecoder's eager path) and must predict exactly what
``eager`` predicts; the mode is not part of a run's identity (same folders, either mode resumes the
other); every prediction record says how it was decoded. The GPU test checks graph == eager on a tiny
random model with real replays, and that no fork's graphs outlive it.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvdex.eval import cli
from kvdex.eval.runner import DecodeContext, EvalConfig, greedy, prefill, resolve_decode, run_task, teacher_forced
from kvdex.hf.testing import byte_tokenizer, tiny_llama

CACHE = dict(page_size=16, sink=16, window=32, dense_layers=2, offload=False)
HOW = ("decode", "decode_steps", "decode_reason", "decode_s", "prefill_s")  # differ between modes by design


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab_size=len(tok))


def _passkey(model, tok, out, decode, policies=("quest", "pariskv", "streaming"), new=20, lengths=(384,)):
    from kvdex.eval.tasks.passkey_grid import PasskeyTask

    task = PasskeyTask(depths=[0, 60], max_new_tokens=new)
    cfg = EvalConfig("tiny", list(policies), [64], list(lengths), out=str(out), progress=False, decode=decode)
    return run_task(task, model, tok, cfg)


def _predictions(results, root):
    """{run folder relative to the results root: [records without how-it-decoded fields]}."""
    return {
        str(r.dir.relative_to(root)): [{k: v for k, v in x.items() if k not in HOW} for x in r.records()]
        for r in results
    }


def test_graph_on_cpu_falls_back_to_eager_with_identical_predictions(model, tok, tmp_path):
    eager = _passkey(model, tok, tmp_path / "eager", "eager")
    graph = _passkey(model, tok, tmp_path / "graph", "graph")
    auto = _passkey(model, tok, tmp_path / "auto", "auto")  # on CPU: eager
    pe, pg = _predictions(eager, tmp_path / "eager"), _predictions(graph, tmp_path / "graph")
    assert pe == pg  # same folders (the mode is not in the identity hash), same predictions
    assert pe == _predictions(auto, tmp_path / "auto")
    assert [r.metrics["score"] for r in eager] == [r.metrics["score"] for r in graph]
    assert all(len(recs) == 2 for recs in pe.values())
    generated = 0
    for r in eager + auto:
        for x in r.records():
            assert x["decode"] == "eager" and "decode_steps" not in x
    for r in graph:
        for x in r.records():
            assert x["decode"] == "eager"  # nothing was replayed on CPU, and the record says why
            assert "CUDA" in x["decode_reason"]
            s = x["decode_steps"]
            assert s["replays"] == 0 and s["captures"] == 0 and s["eager"] >= 1
            generated += s["eager"]
    assert generated > 2 * 3  # several steps per record (not only the prefill's token)


def test_either_mode_resumes_the_other(model, tok, tmp_path):
    first = _passkey(model, tok, tmp_path, "eager", policies=("quest",))
    again = _passkey(model, tok, tmp_path, "graph", policies=("quest",))
    assert [r.dir for r in first] == [r.dir for r in again]
    assert all(r.skipped for r in again) and not any(r.skipped for r in first)


def test_decode_option_is_validated(tok, capsys):
    with pytest.raises(ValueError, match="decode must be one of auto, eager, graph"):
        EvalConfig("tiny", ["quest"], [64], [256], decode="cuda")
    with pytest.raises(ValueError, match="decode must be one of"):
        resolve_decode("fast", "cpu")
    assert resolve_decode("auto", "cpu") == "eager"
    assert resolve_decode("auto", torch.device("cuda")) == "graph"  # no device needed to decide
    assert resolve_decode("graph", "cpu") == "graph" and resolve_decode("eager", "cuda:0") == "eager"
    with pytest.raises(SystemExit):
        cli.main(["passkey", "--model", "x", "--decode", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    parser = cli.build_parser(__import__("argparse").ArgumentParser())
    assert parser.parse_args(["ruler", "--model", "x"]).decode == "auto"
    assert parser.parse_args(["math", "--model", "x", "--decode", "graph"]).decode == "graph"


def _ctx(model, tok, policy="quest", budget=64, decode="graph", n=300, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n,), generator=g).tolist()
    base, logits = prefill(model, ids, CACHE)
    return base, DecodeContext(model, tok, base.fork(policy, budget), logits, n, decode=decode)


@torch.inference_mode()
def test_hooks_and_observers_decode_eagerly_and_unchanged(model, tok):
    """The recall task's per-step hook and cache observer: graph mode runs those steps eagerly
    (through ``forward_token``, as before) and says why."""
    from kvdex.eval.recall import RecallObserver

    out = {}
    for decode in ("eager", "graph"):
        _, ctx = _ctx(model, tok, decode=decode)
        seen = []
        toks = greedy(ctx, 12, before_step=seen.append)
        out[decode] = (toks, ctx.close())
        assert seen == list(range(1, 12))
    assert out["graph"][0] == out["eager"][0]
    how = out["graph"][1]
    assert how["decode"] == "eager" and "before_step" in how["decode_reason"]
    assert how["decode_steps"]["eager"] == 11 and how["decode_steps"]["replays"] == 0
    assert out["eager"][1] == {"decode": "eager"}

    nll = {}
    for decode in ("eager", "graph"):
        _, ctx = _ctx(model, tok, decode=decode, seed=4)
        obs = RecallObserver()
        ctx.cache.observer = obs
        nll[decode] = teacher_forced(ctx, list(range(40, 50)))
        ctx.cache.observer = None
        nll[decode + "_how"] = ctx.close()
        assert len(obs.rows) == 9 * 2  # the observer saw every step of both sparse layers
    assert nll["graph"] == nll["eager"]
    assert "observer" in nll["graph_how"]["decode_reason"]


@torch.inference_mode()
def test_context_step_returns_fresh_logits_and_close_is_idempotent(model, tok):
    _, ctx = _ctx(model, tok, policy="streaming")
    a = ctx.step(5)
    b = ctx.step(6)
    assert a.dtype == torch.float32 and a.shape == (model.config.vocab_size,)
    assert a.data_ptr() != b.data_ptr()
    how = ctx.close()
    assert how["decode_steps"]["eager"] == 2 and ctx._decoder is None
    assert ctx.close()["decode_steps"]["eager"] == 2  # nothing left to free


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_matches_eager_on_gpu_and_frees_its_graphs(tok, tmp_path):
    """Passkey on a tiny random fp32 model (quest, pariskv, full, budget 64): --decode graph predicts
    what --decode eager predicts, with replays in every graph-capable run, and no fork's graphs or
    buffers outlive it (allocated memory after a graph run == after the same graph run again)."""
    model = tiny_llama(vocab_size=len(tok)).cuda()
    pol = ("quest", "pariskv")
    eager = _passkey(model, tok, tmp_path / "eager", "eager", policies=pol, new=40, lengths=(384, 512))
    graph = _passkey(model, tok, tmp_path / "graph", "graph", policies=pol, new=40, lengths=(384, 512))
    assert _predictions(eager, tmp_path / "eager") == _predictions(graph, tmp_path / "graph")
    for r in graph:
        recs = r.records()
        replays = sum(x["decode_steps"]["replays"] for x in recs)
        assert replays > 0, (r.policy, [x["decode_reason"] for x in recs])
        assert all(x["decode_reason"] is None or "too few" in x["decode_reason"] for x in recs), recs
        assert any(x["decode"] == "graph" for x in recs)
    gc.collect()
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_allocated()
    again = _passkey(model, tok, tmp_path / "again", "auto", policies=pol, new=40, lengths=(384, 512))
    gc.collect()
    torch.cuda.synchronize()
    m2 = torch.cuda.memory_allocated()
    assert m2 == m1, f"{m2 - m1} bytes left allocated by a graph run"
    assert _predictions(again, tmp_path / "again") == _predictions(graph, tmp_path / "graph")
    assert all(x["decode"] == "graph" for r in again for x in r.records() if x["decode_steps"]["replays"])
