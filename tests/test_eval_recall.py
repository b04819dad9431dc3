"""Recall harness smoke tests: a tiny random Llama, byte tokenizer, real book text (CPU, seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvdex.eval import data
from kvdex.eval.recall import Probe, RecallObserver, RecallTask, SelectAll
from kvdex.eval.runner import DecodeContext, EvalConfig, prefill, run_task, teacher_forced
from kvdex.hf.testing import byte_tokenizer, tiny_llama

ROOT = data.data_root(required=False)
needs_data = pytest.mark.skipif(ROOT is None, reason="evaluation data not found (set KVDEX_DATA)")
CACHE = dict(page_size=16, sink=16, window=32, dense_layers=2, offload=False)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab_size=len(tok))


@pytest.fixture(scope="module")
def sample(tok):
    if ROOT is None:
        pytest.skip("evaluation data not found (set KVDEX_DATA)")
    return RecallTask(steps=6).samples(tok, 768, 1, seed=0)[0]


@pytest.fixture(scope="module")
def prefilled(model, sample):
    """(base cache, logits) of the sample's prompt: never decoded, so every test can fork it."""
    return prefill(model, sample.input_ids, CACHE)


def observe(model, tok, sample, prefilled, policy, budget, steps=6, probe=False):
    """Teacher-forced decode of ``sample`` through ``policy`` (or, with ``probe``, densely while
    probing ``policy``); the observer measuring every step."""
    base, logits = prefilled
    cache = base.fork(Probe(target=policy) if probe else policy, budget)
    obs = RecallObserver(probe=cache.policy if probe else None)
    cache.observer = obs
    with torch.inference_mode():
        teacher_forced(
            DecodeContext(model, tok, cache, logits, len(sample.input_ids)),
            sample.meta["continuation"][: steps + 1],
            before_step=obs.set_step,
        )
    return obs


def group_recall(obs, kv_heads=2, first_only=True):
    """Recall summed over each kv head's query heads: [steps, layers, kv_heads].

    Decoding through the policies, q and the keys are the same for every policy only at the first
    sparse layer (earlier layers are dense), so only there are policies compared on exactly the
    same attention distribution; in probe mode (dense decode) they are at every layer.
    """
    steps, layers, t = obs.table("recall")
    if first_only:
        t = t[:, [layers.index(CACHE["dense_layers"])]]
    return t.reshape(len(steps), t.shape[1], kv_heads, -1).sum(-1)


@needs_data
def test_full_has_recall_one_and_no_output_error(model, tok, sample, prefilled):
    obs = observe(model, tok, sample, prefilled, SelectAll(), None)
    for metric, want in (("recall", 1.0), ("topk_hit", 1.0), ("ceiling", 1.0), ("rel_l2", 0.0)):
        _, _, t = obs.table(metric)
        assert t.size and np.allclose(t, want, atol=1e-5), metric


@needs_data
def test_select_all_decodes_like_full(model, tok, sample, prefilled):
    """The recall harness measures ``full`` through SelectAll: it must decode exactly like ``full``."""
    base, logits = prefilled
    outs = []
    for policy in ("full", SelectAll()):
        cache = base.fork(policy)
        ctx = DecodeContext(model, tok, cache, logits, len(sample.input_ids))
        with torch.inference_mode():
            outs.append(teacher_forced(ctx, sample.meta["continuation"][:5]))
    assert np.allclose(outs[0], outs[1], atol=1e-4)


@needs_data
@pytest.mark.parametrize("probe", [False, True])
def test_oracle_maximises_group_recall_and_grows_with_budget(model, tok, sample, prefilled, probe):
    def group(policy, b):
        obs = observe(model, tok, sample, prefilled, policy, b, steps=4, probe=probe)
        return group_recall(obs, first_only=not probe)

    oracle = {b: group("oracle", b) for b in (64, 128, 256)}
    for policy in ("quest", "streaming"):
        for b in (64, 128, 256):
            assert (oracle[b] >= group(policy, b) - 1e-5).all(), (policy, b)
    assert (oracle[128] >= oracle[64] - 1e-5).all() and (oracle[256] >= oracle[128] - 1e-5).all()
    assert oracle[256].mean() > oracle[64].mean() + 0.05  # a real difference, not a flat line


@needs_data
def test_metrics_match_a_direct_computation(model, tok, sample, prefilled):
    """Recall of streaming at one step recomputed by hand from the dense keys."""
    base, logits = prefilled
    cache = base.fork("streaming", 64)
    seen = {}

    def spy(layer, q, store, aset, scale):
        if layer == 3 and not seen:
            k, _ = store.dense()
            w = torch.softmax(torch.einsum("hgd,hld->hgl", q[0].view(2, 2, -1).float(), k[0].float()) * scale, -1)
            L = int(store.lengths[0])
            idx = [sorted(set(aset.positions[0, h][aset.valid[0, h]].tolist())) for h in range(2)]
            seen["recall"] = torch.stack([w[h, :, idx[h]].sum(-1) for h in range(2)]).flatten()
            seen["attended"] = [len(i) for i in idx]
            seen["L"] = L
        obs(layer, q, store, aset, scale)

    obs = RecallObserver(layers=[3])
    cache.observer = spy
    with torch.inference_mode():
        teacher_forced(
            DecodeContext(model, tok, cache, logits, len(sample.input_ids)),
            sample.meta["continuation"][:2],
            before_step=obs.set_step,
        )
    _, _, t = obs.table("recall")
    assert np.allclose(t[0, 0], seen["recall"].numpy(), atol=1e-5)
    # streaming at budget 64: sink 16 + (budget - sink - window = 16) + a window of 17..32 tokens
    assert seen["attended"][0] == seen["attended"][1] and 48 <= seen["attended"][0] <= 64


@needs_data
def test_runs_are_written_skipped_and_resumed(model, tok, tmp_path):
    task = RecallTask(steps=2)
    cfg = EvalConfig("tiny", ["oracle", "streaming"], [64, 128], [384], samples=2, out=str(tmp_path), progress=False)
    first = run_task(task, model, tok, cfg)
    assert len(first) == 5 and not any(r.skipped for r in first)  # full + 2 policies x 2 budgets
    for r in first:
        assert {p.name for p in r.dir.iterdir()} >= {"config.json", "predictions.jsonl", "metrics.json"}
        m = json.loads((r.dir / "metrics.json").read_text())
        assert m["samples"] == 2 and m["ratio_to_full"] == pytest.approx(m["score"])  # full's recall is 1
        assert set(m["ratios_to_full"]) == set(task.summary_keys)
        assert json.loads((r.dir / "config.json").read_text())["policy"] == r.policy
    full = next(r for r in first if r.policy == "full")
    assert full.metrics["score"] == pytest.approx(1.0, abs=1e-5)
    assert all(r.metrics["score"] < 1 for r in first if r.policy != "full")

    again = run_task(task, model, tok, cfg)
    assert all(r.skipped for r in again)
    assert [r.metrics["score"] for r in again] == [r.metrics["score"] for r in first]

    # an interrupted run: one sample predicted, no metrics -> only the missing sample is decoded
    victim = next(r for r in first if r.policy == "oracle" and r.budget == 64)
    lines = (victim.dir / "predictions.jsonl").read_text().splitlines()
    (victim.dir / "predictions.jsonl").write_text(lines[0] + "\n")
    (victim.dir / "metrics.json").unlink()
    third = run_task(task, model, tok, cfg)
    redone = [r for r in third if not r.skipped]
    assert [(r.policy, r.budget) for r in redone] == [("oracle", 64)]
    after = (victim.dir / "predictions.jsonl").read_text().splitlines()
    assert after[0] == lines[0] and len(after) == 2
    assert redone[0].metrics["score"] == pytest.approx(victim.metrics["score"], abs=1e-6)


@needs_data
def test_cli_recall_end_to_end(model, tok, tmp_path, capsys):
    from kvdex.eval import cli

    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    argv = [
        "recall",
        "--model",
        str(tmp_path / "tiny"),
        "--policies",
        "oracle,quest",
        "--budgets",
        "64,128",
        "--lengths",
        "512",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "ratio_to_full" in printed and "oracle" in printed and "quest" in printed
    task_dir = tmp_path / "out" / "recall"
    assert (task_dir / "summary__tiny__teacher.csv").is_file()
    pytest.importorskip("matplotlib")
    assert (task_dir / "recall_vs_budget__tiny__teacher.png").stat().st_size > 1000
    assert (task_dir / "recall_over_steps__tiny__teacher.png").stat().st_size > 1000


def test_parse_sizes():
    from kvdex.eval.cli import parse_sizes

    assert parse_sizes("64,256, 1k,32K") == [64, 256, 1024, 32768]
    with pytest.raises(Exception, match="size list"):
        parse_sizes("64,abc")


def test_data_root_env(tmp_path, monkeypatch):
    monkeypatch.setenv(data.ENV, str(tmp_path))
    assert data.data_root() == tmp_path.resolve()
    monkeypatch.setenv(data.ENV, str(tmp_path / "missing"))
    assert data.data_root(required=False) is None
    with pytest.raises(ValueError, match="KVDEX_DATA"):
        data.data_root()


@needs_data
def test_offloaded_store_measures_the_same(model, tok, tmp_path):
    """Recall and output error read the attended set from the store: host-offloaded pages must give
    exactly what device-resident ones give."""
    task = RecallTask(steps=2)
    got = []
    for offload in (False, True):
        cfg = EvalConfig(
            "tiny", ["oracle", "quest"], [64], [384], out=str(tmp_path / str(offload)), offload=offload, progress=False
        )
        got.append({(r.policy, r.budget): r.metrics for r in run_task(task, model, tok, cfg)})
    for key, m in got[0].items():
        for metric in ("recall", "topk_hit", "rel_l2"):
            assert got[1][key][metric] == pytest.approx(m[metric], abs=1e-6), (key, metric)


@needs_data
def test_free_running_mode_measures_sampled_steps_and_layers(model, tok, tmp_path):
    task = RecallTask(mode="free", steps=5, every=2, layers=[3])
    cfg = EvalConfig("tiny", ["streaming"], [64], [384], out=str(tmp_path), progress=False)
    full, stream = run_task(task, model, tok, cfg)
    rec = stream.records()[0]
    assert rec["steps"] == [1, 3, 5] and rec["layers"] == [3]
    assert isinstance(rec["generated"], str) and "nll" not in rec
    assert stream.metrics["ppl"] is None and list(stream.metrics["per_step"]) == ["1", "3", "5"]
    assert full.metrics["score"] == pytest.approx(1.0, abs=1e-5)


def test_cli_rejects_mistakes_before_loading(capsys):
    from kvdex.eval import cli

    for argv, msg in (
        (["recall", "--model", "none", "--policies", "nope"], "unknown policy nope"),
        (["recall", "--model", "none", "--budgets", "20"], "sink + window"),
        (["ruler", "--model", "none", "--subtasks", "niah_x"], "unknown RULER subtask"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


@needs_data
def test_probe_mode_scores_selections_on_the_dense_decode(model, tok, tmp_path):
    """In probe mode the decode is dense; at the first sparse layer (where q and K do not depend on
    the policy) a probed policy must score exactly what it scores inside its own decode."""
    results = {}
    for probe in (False, True):
        task = RecallTask(steps=3, probe=probe)
        cfg = EvalConfig("tiny", ["oracle", "quest"], [64], [512], out=str(tmp_path / str(probe)), progress=False)
        results[probe] = {(r.policy, r.budget): r.metrics for r in run_task(task, model, tok, cfg)}
    first = str(CACHE["dense_layers"])
    for key in (("oracle", 64), ("quest", 64)):
        own, probed = results[False][key], results[True][key]
        assert probed["per_layer"][first] == pytest.approx(own["per_layer"][first], abs=1e-6), key
        assert probed["ppl"] == pytest.approx(results[True][("full", None)]["ppl"], rel=1e-4)  # dense decode
    assert results[True][("full", None)]["score"] == pytest.approx(1.0, abs=1e-5)


def test_probe_refuses_policies_that_learn_from_their_own_attention():
    from kvdex.config import CacheConfig
    from kvdex.eval.recall import Probe
    from kvdex.policies import PolicyInfo

    info = PolicyInfo(CacheConfig(budget=128), 4, (2, 3), 4, 2, 8)
    with pytest.raises(ValueError, match="cannot measure 'h2o'"):
        Probe(target="h2o").bind(info)
    Probe(target="quest").bind(info)  # a policy that only selects is probed as before
