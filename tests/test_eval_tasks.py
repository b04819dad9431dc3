"""Task smoke tests (passkey grid, perplexity) on a tiny random Llama, CPU only."""

from __future__ import annotations

import json
import math
import re

import pytest

from kvdex.eval import data
from kvdex.eval.runner import EvalConfig, run_task
from kvdex.eval.summary import format_table, summary_rows, write_summary
from kvdex.hf.testing import byte_tokenizer, tiny_llama

ROOT = data.data_root(required=False)
needs_data = pytest.mark.skipif(ROOT is None, reason="evaluation data not found (set KVDEX_DATA)")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab_size=len(tok))


def test_passkey_grid_runs_and_draws_heatmaps(model, tok, tmp_path):
    pytest.importorskip("kvdex.eval.passkey")
    from kvdex.eval.tasks.passkey_grid import PasskeyTask

    task = PasskeyTask(depths=[0, 50, 95], max_new_tokens=3)
    cfg = EvalConfig("tiny", ["quest"], [64], [384, 512], samples=1, out=str(tmp_path), progress=False)
    results = run_task(task, model, tok, cfg)
    assert [(r.length, r.policy, r.budget) for r in results] == [
        (384, "full", None),
        (384, "quest", 64),
        (512, "full", None),
        (512, "quest", 64),
    ]
    for r in results:
        recs = r.records()
        assert [x["depth"] for x in recs] == [0, 50, 95]
        assert all(x["prompt_tokens"] <= r.length and len(x["answer"]) == 5 for x in recs)
        assert set(r.metrics["per_depth"]) == {"0", "50", "95"}
        assert r.metrics["score"] == sum(x["correct"] for x in recs) / 3
    # the same sample (same key) for every policy of a length: prefill once, decode per policy
    assert results[0].records()[1]["answer"] == results[1].records()[1]["answer"]
    _, paths = write_summary(task, results, cfg)
    pytest.importorskip("matplotlib")
    names = {p.name for p in paths}
    assert {"passkey__tiny__full.png", "passkey__tiny__quest__b64.png"} <= names


@needs_data
def test_ppl_full_matches_a_dense_forward(model, tok, tmp_path):
    """Perplexity through the ``full`` cache equals one dense forward over context + continuation."""
    import torch

    from kvdex.eval.tasks.ppl import PerplexityTask

    task = PerplexityTask(tokens=8)
    cfg = EvalConfig("tiny", ["streaming"], [64], [256], samples=1, out=str(tmp_path), progress=False)
    results = run_task(task, model, tok, cfg)
    full, stream = results
    sample = task.samples(tok, 256, 1, 0)[0]
    ids = torch.tensor([sample.input_ids + sample.meta["continuation"]])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()  # no cache: the dense path
    logp = torch.log_softmax(logits, -1)
    n = len(sample.input_ids)
    want = [float(-logp[n + i, ids[0, n + i + 1]]) for i in range(8)]
    assert full.records()[0]["nll"] == pytest.approx(want, abs=1e-3)
    assert full.metrics["score"] == pytest.approx(math.exp(sum(want) / 8), rel=1e-3)
    assert stream.metrics["ratio_to_full"] == pytest.approx(stream.metrics["score"] / full.metrics["score"])
    assert task.higher_is_better is False
    m = json.loads((stream.dir / "metrics.json").read_text())
    assert set(m["ratios_to_full"]) == {"nll", "ppl_last_quarter"}


def test_summary_table_shows_ratio_and_score_name(tmp_path):
    from kvdex.eval.runner import RunResult, Task

    class Dummy(Task):
        name = "dummy"
        score_name = "accuracy"
        summary_keys = ("f1",)

    rs = [
        RunResult("dummy", "m", 1024, "full", None, tmp_path, {"score": 0.8, "f1": 0.5, "ratio_to_full": 1.0}),
        RunResult("dummy", "m", 1024, "quest", 64, tmp_path, {"score": 0.4, "f1": 0.25, "ratio_to_full": 0.5}),
    ]
    rows = summary_rows(Dummy(), rs)
    assert rows[1]["accuracy"] == 0.4 and rows[1]["ratio_to_full"] == 0.5 and rows[0]["budget"] == "-"
    table = format_table(rows).splitlines()
    assert table[0].split()[:6] == ["length", "policy", "budget", "f1", "accuracy", "ratio_to_full"]
    assert table[3].split()[:6] == ["1024", "quest", "64", "0.25", "0.4", "0.5"]


@needs_data
def test_ruler_prompts_hold_their_answers_within_the_length(tok):
    import random

    from kvdex.eval import prompting
    from kvdex.eval.tasks.ruler import SUBTASKS, generate

    for name, spec in SUBTASKS.items():
        length = 8000 if name.startswith(("qa", "cwe", "fwe")) else 1200  # long in bytes (byte tokenizer)
        text, refs = generate(spec, tok, length, random.Random(name), ROOT)
        n = len(prompting.encode(tok, text))
        slack = 4000 if name.startswith("qa") else 200  # filled to within a sentence / a paragraph (bytes)
        assert length - slack < n <= length, name
        assert refs and all(r in text for r in refs), name
        if name.startswith("niah"):
            needles = text.count("One of the special magic")
            want = {"niah_multikey_1": 4, "niah_multivalue": 4, "niah_multiquery": 4}.get(name, 1)
            assert needles == want or (spec.haystack == "needle" and needles > 5), name
        if name in ("cwe", "fwe"):  # the expected words are strictly the most frequent ones
            import collections

            body = text.split("Question:")[0]
            counts = collections.Counter(re.findall(r"[a-z]+", body.split("\n", 1)[1]))
            ranked = [c for _, c in counts.most_common()]
            least_ref = min(counts[r] for r in refs)
            assert len(ranked) > len(refs) and least_ref > ranked[len(refs)], (name, least_ref, ranked[:11])
        if name == "vt":  # the chain is in order: each variable is assigned after the one it copies
            at = [text.index(f"VAR {v} =") for v in refs]
            assert at == sorted(at) and f"VAR {refs[1]} = VAR {refs[0]}." in text


@needs_data
def test_ruler_runs_and_scores_subtasks(model, tok, tmp_path):
    from kvdex.eval.tasks.ruler import RulerTask

    task = RulerTask(subtasks=["niah_single_1", "vt"], max_new_tokens=4)
    cfg = EvalConfig("tiny", ["streaming"], [64], [512], samples=2, out=str(tmp_path), progress=False)
    full, stream = run_task(task, model, tok, cfg)
    recs = full.records()
    assert [r["subtask"] for r in recs] == ["niah_single_1"] * 2 + ["vt"] * 2
    assert recs[0]["references"] != recs[1]["references"]  # different samples, different needles
    for r in (full, stream):
        assert set(r.metrics) >= {"niah_single_1", "vt", "score"}
        assert r.metrics["score"] == pytest.approx((r.metrics["niah_single_1"] + r.metrics["vt"]) / 2)
    assert set(stream.metrics["ratios_to_full"]) == {"niah_single_1", "vt"}


def test_longbench_scoring_dispatch():
    from kvdex.eval.tasks.longbench import V1_TASKS, extract_choice, score_v1

    assert score_v1("trec", "Individual\nQuestion: next one", ["Individual"], ["Individual", "Date"]) == 1.0
    assert score_v1("triviaqa", "Paris\nAnswer: London", ["paris"]) == 1.0  # first line only
    assert score_v1("passage_count", "46", ["46"]) == 1.0
    assert score_v1("passage_retrieval_zh", "段落5", ["段落5"]) == 1.0
    assert score_v1("hotpotqa", "no", ["yes", "no"]) == 1.0  # best over the gold answers
    assert score_v1("lcc", "    if e.text == language:", ["            if e.text == language:"]) > 0.8
    assert len(V1_TASKS) == 21
    assert extract_choice("The correct answer is (C).") == "C"
    assert extract_choice("**The correct answer is B**") == "B"
    assert extract_choice("I think A") is None


@needs_data
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_longbench_runs_within_the_length(model, tok, tmp_path, version):
    from kvdex.eval.tasks.longbench import LongBenchTask

    datasets = ["trec", "passage_count"] if version == "v1" else None
    task = LongBenchTask(version=version, datasets=datasets, max_new_tokens=3)
    samples = task.samples(tok, 600, 1, 0)
    assert len(samples) == (2 if version == "v1" else 1)
    assert all(0 < len(s.input_ids) <= 600 for s in samples)
    cfg = EvalConfig("tiny", ["quest"], [64], [600], samples=1, out=str(tmp_path), progress=False)
    full, quest = run_task(task, model, tok, cfg)
    for r in (full, quest):
        assert r.metrics["samples"] == len(samples) and 0 <= r.metrics["score"] <= 1
        assert set(task.summary_keys) <= set(r.metrics)
    if version == "v1":
        assert set(full.metrics["per_dataset"]) == {"trec", "passage_count"}
        assert task.summary_keys == ("few_shot", "synthetic")
    else:
        assert full.records()[0]["answer"] in "ABCD"


@needs_data
def test_math_generation_budget_is_the_length(model, tok, tmp_path):
    from kvdex.eval.tasks.mathcot import MathTask

    task = MathTask("math500")
    cfg = EvalConfig("tiny", ["streaming"], [64], [8, 12], samples=1, out=str(tmp_path), progress=False)
    results = run_task(task, model, tok, cfg)
    assert [(r.length, r.policy) for r in results] == [(8, "full"), (8, "streaming"), (12, "full"), (12, "streaming")]
    for r in results:
        rec = r.records()[0]
        assert rec["gold"] == r"\left( 3, \frac{\pi}{2} \right)" and rec["tokens"] <= r.length
        assert r.metrics["score"] == float(rec["correct"])
