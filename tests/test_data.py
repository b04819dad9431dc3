"""Evaluation data through options only: ``--data`` / ``KVDEX_DATA``, a user's text file, the hub.

Uses the small data in ``tests/data`` (a story written for kvdex and a data folder of made-up
records in the benchmarks' schemas); nothing is downloaded (the hub is a stand-in module).
"""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path

import pytest

from kvdex.eval import data, prompting
from kvdex.eval.runner import EvalConfig, run_task
from kvdex.hf.testing import byte_tokenizer, tiny_llama

HERE = Path(__file__).parent / "data"
TEXT = HERE / "text.txt"
MINI = HERE / "evaldata"


@pytest.fixture(autouse=True)
def no_data_env(monkeypatch):
    monkeypatch.delenv(data.ENV, raising=False)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab_size=len(tok))


def test_data_folder_comes_from_the_option_or_the_environment(tmp_path, monkeypatch):
    assert data.data_root(required=False) is None  # no fallback to folders outside the package
    with pytest.raises(ValueError, match=r"pass --data DIR or set KVDEX_DATA=DIR"):
        data.data_root()
    assert data.data_root(tmp_path) == tmp_path.resolve()
    with pytest.raises(ValueError, match=r"evaluation data folder not found: .*absent \(from --data\)"):
        data.data_root(tmp_path / "absent", required=False)
    monkeypatch.setenv(data.ENV, str(MINI))
    assert data.data_root() == MINI.resolve()


def test_a_missing_file_says_what_it_is_and_where_it_goes(tmp_path):
    with pytest.raises(ValueError, match=r"math --dataset aime24: math/aime24.jsonl not found\. It is AIME 2024") as e:
        data.need(tmp_path, "math/aime24.jsonl", "math --dataset aime24")
    assert str(tmp_path / "math/aime24.jsonl") in str(e.value)
    with pytest.raises(ValueError, match=r"needs an evaluation data folder.*DIR/qa/squad.json, then pass --data DIR"):
        data.need(None, "qa/squad.json", "ruler qa_1")
    assert set(data.FILES) >= {rel for files in data.SOURCES.values() for rel in files}  # every source explained


def test_long_text_tasks_take_any_text_file(model, tok, tmp_path):
    import torch

    from kvdex.eval.tasks.ppl import PerplexityTask

    with pytest.raises(ValueError, match=r"ppl --source books: longtext/.* needs an evaluation data folder"):
        PerplexityTask(tokens=8)  # books live in the data folder: fails before any model work
    with pytest.raises(ValueError, match=r"neither a text file nor a known source"):
        PerplexityTask(tokens=8, source=str(tmp_path / "nope.txt"))
    task = PerplexityTask(tokens=8, source=str(TEXT))
    cfg = EvalConfig("tiny", ["streaming"], [64], [256], out=str(tmp_path), progress=False)
    full, stream = run_task(task, model, tok, cfg)
    sample = task.samples(tok, 256, 1, 0)[0]
    assert sample.meta["source"] == str(TEXT) and len(sample.input_ids) == 256
    assert tok.decode(sample.input_ids) in TEXT.read_text()  # a span of the file
    ids = torch.tensor([sample.input_ids + sample.meta["continuation"]])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    want = [float(-logp[256 + i, ids[0, 257 + i]]) for i in range(8)]  # the file's own next tokens
    assert full.records()[0]["nll"] == pytest.approx(want, abs=1e-3)


def test_recall_takes_a_text_file(model, tok, tmp_path):
    from kvdex.eval.recall import RecallTask

    with pytest.raises(ValueError, match="recall --source books"):
        RecallTask(steps=2)
    cfg = EvalConfig("tiny", ["quest"], [64], [384], out=str(tmp_path), progress=False)
    full, quest = run_task(RecallTask(steps=2, source=str(TEXT)), model, tok, cfg)
    assert 0 < quest.metrics["recall"] <= 1


def test_ruler_without_a_data_folder(tok, tmp_path):
    from kvdex.eval.tasks.ruler import SUBTASKS, RulerTask, generate

    RulerTask(subtasks=["niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe"])  # need no data at all
    with pytest.raises(ValueError, match=r"PaulGrahamEssays.json needs an evaluation data folder.*--haystack FILE"):
        RulerTask(subtasks=["niah_single_2"])
    with pytest.raises(ValueError, match=r"ruler qa_1: qa/squad.json needs an evaluation data folder"):
        RulerTask(subtasks=["qa_1"])
    with pytest.raises(ValueError, match=r"--haystack .*absent.txt: no such file"):
        RulerTask(subtasks=["niah_single_2"], haystack=str(tmp_path / "absent.txt"))
    task = RulerTask(subtasks=["niah_single_2", "niah_multivalue"], haystack=str(TEXT))
    samples = task.samples(tok, 1500, 1, 0)
    story = {s.strip() for s in TEXT.read_text().replace("\n", " ").split(". ")}
    for s in samples:
        text = tok.decode(s.input_ids)
        assert all(ref in text for ref in s.meta["references"])
        assert sum(sentence[:40] in text for sentence in story if len(sentence) > 40) >= 3  # the file is the haystack
    text, refs = generate(SUBTASKS["cwe"], tok, 3000, random.Random(0), None)  # made-up words without a word list
    assert len(refs) == 10 and len(prompting.encode(tok, text)) <= 3000


def test_longbench_v1_and_math_from_a_data_folder(model, tok, tmp_path):
    from kvdex.eval.tasks.longbench import LongBenchTask
    from kvdex.eval.tasks.mathcot import MathTask

    with pytest.raises(ValueError, match=r"longbench --version v1: longbench_v1/minilongbench_237.jsonl needs"):
        LongBenchTask(version="v1")
    task = LongBenchTask(version="v1", datasets=["trec", "passage_count"], data_root=MINI, max_new_tokens=3)
    samples = task.samples(tok, 600, 1, 0)
    assert [s.meta["dataset"] for s in samples] == ["trec", "passage_count"]
    assert [s.meta["max_new_tokens"] for s in samples] == [16, 8]  # dataset2maxlen.json
    with pytest.raises(ValueError, match=r"math/aime25.jsonl not found"):
        MathTask("aime25", data_root=MINI)
    cfg = EvalConfig("tiny", ["streaming"], [64], [8], out=str(tmp_path), progress=False)
    results = run_task(MathTask("math500", data_root=MINI), model, tok, cfg)
    assert results[0].records()[0]["gold"] == r"\left( 3, \frac{\pi}{2} \right)"


def test_longbench_v2_from_the_folder_the_hub_or_a_clear_error(tok, monkeypatch):
    from kvdex.eval.tasks import longbench

    task = longbench.LongBenchTask(version="v2", data_root=MINI)
    assert [s.meta["answer"] for s in task.samples(tok, 900, 5, 0)] == ["B"]

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ValueError, match=r"longbench_v2_short.jsonl needs .*pip install 'kvdex\[data\]'"):
        longbench.LongBenchTask(version="v2")

    rows = [{**longbench.v2_records(MINI)[0], "_id": f"h{i}", "length": length} for i, length in enumerate("ssl")]
    for r in rows:
        r["length"] = {"s": "short", "l": "long"}[r["length"]]
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        if name == "offline":
            raise ConnectionError("no network")
        return rows

    hub = types.SimpleNamespace(load_dataset=load_dataset)
    monkeypatch.setitem(sys.modules, "datasets", hub)
    task = longbench.LongBenchTask(version="v2")
    assert [s.id for s in task.samples(tok, 900, 5, 0)] == ["h0", "h1"]  # the "short" items
    assert calls == [(longbench.V2_HUB, "train")]
    monkeypatch.setattr(longbench, "V2_HUB", "offline")
    with pytest.raises(ValueError, match=r"failed \(ConnectionError: no network\)\. Offline, put longbench_v2/"):
        longbench.v2_records(None)
