"""``kvdex scorecard``: the interval code on hand-computed counts, ``full`` against itself, ``oracle`` at a
budget covering the context against ``full``, and a resumed run against an uninterrupted one.

The structural tests run a tiny random Llama with a byte tokenizer (fast); the ``--smoke`` size on the real
SmolLM2 is ``tests/test_real_model.py::test_smoke_smollm2`` (beside the other SmolLM2 tests, so one
test process loads the model once for both)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from kvdex.eval.card import ScorecardConfig
from kvdex.eval.card.report import table
from kvdex.eval.card.stats import Interval, mcnemar_p, paired_ratio
from kvdex.hf.testing import byte_tokenizer, tiny_llama

# ---- the interval code, on answers computable by hand -------------------------------------------------


def test_identical_outcomes_give_exactly_one():
    iv = paired_ratio([1, 0, 1, 1], [1, 0, 1, 1])
    assert (iv.ratio, iv.low, iv.high, iv.n) == (1.0, 1.0, 1.0, 4)
    assert paired_ratio([0, 0], [0, 0]).ratio == 1.0  # both all wrong: still the same outcome
    assert paired_ratio([1, 0], [0, 0]).ratio is None  # full never right: no ratio


def test_two_prompts_enumerable_bootstrap():
    # x = (1, 0), ref = (1, 1): resamples {a,a} -> 1 (p 1/4), {a,b} -> 1/2 (p 1/2), {b,b} -> 0 (p 1/4);
    # the 2.5% / 97.5% quantiles of that distribution are 0 and 1.
    iv = paired_ratio([1, 0], [1, 1])
    assert iv.ratio == 0.5
    assert (iv.low, iv.high) == (0.0, 1.0)
    assert iv.mark() == ""


def test_one_extra_success_in_ten():
    # x right on all 10, ref wrong on one: ratio 10/9. A resample's ratio is 10 / (10 - m), m = draws of the
    # bad prompt ~ Binomial(10, 0.1): P(m = 0) = 0.349 > 2.5% -> low = 1 exactly; P(m <= 2) = 0.930,
    # P(m <= 3) = 0.987 -> the 97.5% quantile is m = 3: high = 10 / 7. Not decided (low == 1).
    iv = paired_ratio([1] * 10, [1] * 9 + [0])
    assert iv.ratio == pytest.approx(10 / 9)
    assert iv.low == 1.0
    assert iv.high == pytest.approx(10 / 7)
    assert iv.mark() == ""


def test_strata_keep_each_subtask_share():
    # stratum a: policy always right; stratum b: always wrong. Every within-stratum resample has mean 1/2,
    # so the interval collapses onto the point and is decided (below 1).
    iv = paired_ratio([1, 1, 0, 0], [1, 1, 1, 1], strata=["a", "a", "b", "b"])
    assert (iv.ratio, iv.low, iv.high) == (0.5, 0.5, 0.5)
    assert iv.mark() == "worse"
    unstratified = paired_ratio([1, 1, 0, 0], [1, 1, 1, 1])
    assert unstratified.low < 0.5 < unstratified.high


def test_perplexity_ratio_and_marks():
    nll_full = np.array([2.0, 2.5, 3.0])
    iv = paired_ratio(nll_full + math.log(2), nll_full, kind="exp_diff")  # every prompt 2x the perplexity
    assert iv.ratio == pytest.approx(2.0) and iv.low == pytest.approx(2.0) and iv.high == pytest.approx(2.0)
    assert iv.mark(higher_is_better=False) == "worse" and iv.mark(higher_is_better=True) == "better"
    assert Interval(0.5, 0.4, 0.6, 10).mark() == "worse"
    assert Interval(0.9, 0.8, 1.1, 10).mark() == ""
    with pytest.raises(ValueError, match="kind"):
        paired_ratio([1], [1], kind="diff")
    with pytest.raises(ValueError, match="paired"):
        paired_ratio([1, 0], [1])


def test_mcnemar_exact():
    # 6 discordant pairs all one way: 2 * (1/2)^6; 5 vs 1: 2 * (1 + 6) / 64
    assert mcnemar_p([0] * 6 + [1] * 4, [1] * 10) == pytest.approx(0.03125)
    assert mcnemar_p([1] * 5 + [0] + [1] * 4, [0] * 5 + [1] + [1] * 4) == pytest.approx(0.21875)
    assert mcnemar_p([1, 0], [1, 0]) == 1.0
    assert mcnemar_p([0.5, 1], [1, 1]) is None


# ---- whole runs on a tiny model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(), byte_tokenizer()


@pytest.fixture(autouse=True)
def no_data(monkeypatch):
    """The same prompts whether or not an evaluation data folder is configured."""
    monkeypatch.delenv("KVDEX_DATA", raising=False)


def _cfg(out, **kw):
    base = dict(
        model="tiny",
        policies=["oracle", "oracle@2048", "quest"],
        budgets=[64],
        lengths=[1024],
        tasks=["retrieval", "passkey"],
        subtasks=["niah_single", "niah_multikey", "vt"],
        per_subtask=2,
        max_new_cap=6,
        passkey_depths=[20, 80],
        passkey_per_depth=1,
        batch=4,
        progress=False,
        resamples=300,
        out=str(out),
    )
    return ScorecardConfig(**{**base, **kw})


def _records(out) -> dict:
    """{(task, policy, budget): {prompt id: (score, prediction)}} from the cell files."""
    recs = {}
    for f in sorted(out.glob("cells/*/*/*.json")):
        c = json.loads(f.read_text())
        for r in c["records"]:
            recs.setdefault((c["task"], c["policy"], c["budget"]), {})[r["id"]] = (r["score"], r["prediction"])
    return recs


@pytest.fixture(scope="module")
def whole(tiny, tmp_path_factory):
    """(folder, report) of one uninterrupted run of ``_cfg``, shared by the tests that check it or compare
    another run against it: they read its folder, and copy it before changing anything."""
    from kvdex.eval import scorecard

    out = tmp_path_factory.mktemp("whole")
    model, tok = tiny
    return out, scorecard(_cfg(out), model=model, tokenizer=tok)


def test_full_is_one_and_covering_oracle_equals_full(whole):
    tmp_path, rep = whole
    assert rep["complete"] and (tmp_path / "scorecard.md").is_file() and (tmp_path / "scorecard.json").is_file()
    t = table(rep)
    full = t[("full", None)]
    assert {task for task, _ in full} >= {"retrieval", "passkey", "retrieval/vt"}
    for c in full.values():
        assert (c["ratio"], c["low"], c["high"]) == (1.0, 1.0, 1.0)
    recs = _records(tmp_path)
    for task in ("retrieval", "passkey"):
        f, o = recs[(task, "full", None)], recs[(task, "oracle", 2048)]
        assert len(f) == len(o) > 0 and f == o  # same score and same text on every prompt
    assert all(c["ratio"] == 1.0 for c in t[("oracle", 2048)].values())
    saved = json.loads((tmp_path / "scorecard.json").read_text())
    cell = saved["cells"][0]
    assert {"policy", "budget", "length", "task", "ratio", "low", "high", "n"} <= set(cell)
    assert saved["prompts"]["retrieval"]["1024"][0] == "niah_single-0" and saved["environment"]["torch"]
    assert "n/a (CPU)" in (tmp_path / "scorecard.md").read_text()


def test_resumed_run_gives_the_same_table(tiny, whole, tmp_path):
    from kvdex.eval.card.run import scorecard

    model, tok = tiny
    a, whole = whole  # the uninterrupted run
    seen = []
    part = scorecard(_cfg(tmp_path / "b", max_cells=3), model=model, tokenizer=tok, on_cell=seen.append)
    assert not part["complete"] and part["stopped"].startswith("max_cells") and len(seen) == 3

    def until_five(cell):  # resumes, then stops from the callback
        seen.append(cell)
        return len(seen) < 5

    part = scorecard(_cfg(tmp_path / "b"), model=model, tokenizer=tok, on_cell=until_five)
    assert not part["complete"] and len(seen) == 5
    before = {str(p): p.stat().st_mtime_ns for p in (tmp_path / "b").glob("cells/*/*/*.json")}
    assert len(before) == 5
    done = scorecard(_cfg(tmp_path / "b"), model=model, tokenizer=tok, on_cell=seen.append)
    assert done["complete"]
    after = {str(p): p.stat().st_mtime_ns for p in (tmp_path / "b").glob("cells/*/*/*.json")}
    assert all(after[k] == v for k, v in before.items())  # finished cells were not recomputed
    assert len(seen) == len(after) == 3 * 4  # 3 batches (2 retrieval, 1 passkey) x 4 (policy, budget) pairs
    assert _records(a) == _records(tmp_path / "b")
    assert whole["cells"] == done["cells"]
    # the table written again from the cells alone (no model): the same cells, the cells' device named
    again = scorecard(_cfg(tmp_path / "b", report_only=True))
    assert again["cells"] == done["cells"] and again["complete"] and again["device"] == "cpu"
    with pytest.raises(ValueError, match="no finished cells"):
        scorecard(_cfg(tmp_path / "empty", report_only=True))
    (tmp_path / "b/scorecard.json").unlink()  # the cells alone (e.g. copied from a GPU machine): their dtype found
    assert scorecard(_cfg(tmp_path / "b", report_only=True, dtype="auto"))["cells"] == done["cells"]
    with pytest.raises(ValueError, match="no cells under .* match these settings"):
        scorecard(_cfg(tmp_path / "b", report_only=True, dtype="bfloat16"))
    assert (a / "scorecard.md").read_text().split("## Retrieval")[0].splitlines()[6:] == (
        tmp_path / "b/scorecard.md"
    ).read_text().split("## Retrieval")[0].splitlines()[6:]


def _rescore(out) -> None:
    """Give every record a 0/1 score that differs between policies and prompts (the tiny model scores 0
    everywhere), the same function of (policy, budget, prompt id) in every output folder."""
    import hashlib

    for f in out.glob("cells/*/*/*.json"):
        c = json.loads(f.read_text())
        for r in c["records"]:
            key = f"{c['policy']}@{c['budget']}/{r['id']}" if c["policy"] != "full" else f"full/{r['id']}"
            r["score"] = float(hashlib.sha1(key.encode()).digest()[0] % 3 != 0)
        f.write_text(json.dumps(c))


def _cells(cfg) -> dict:
    """{(policy, budget, task, length): cell} rebuilt from a folder's cell files."""
    from kvdex.eval.card import report
    from kvdex.eval.card.plan import Plan

    found, _, _ = report.cells(Plan(cfg, "tiny", "float32", None, "cpu"), cfg.resamples)
    return {(c["policy"], c["budget"], c["task"], c["length"]): c for c in found}


def test_stopped_run_reports_partial_cells_equal_to_a_run_over_those_prompts(tiny, whole, tmp_path):
    from kvdex.eval.card.run import scorecard

    model, tok = tiny
    # 5 cells: retrieval batch 0 (niah_single, niah_multikey) for all 4 pairs, batch 1 (vt) for full only
    part = scorecard(_cfg(tmp_path / "b", max_cells=5), model=model, tokenizer=tok)
    assert part["stopped"].startswith("max_cells") and part["slots_done"] == 1 and not part["complete"]
    t = table(part)
    assert all(c["partial"] is None for c in t[("full", None)].values())  # full's retrieval slot finished
    for pair in [("oracle", 64), ("oracle", 2048), ("quest", 64)]:
        got = t[pair]
        assert set(got) == {(x, 1024) for x in ("retrieval", "retrieval/niah_single", "retrieval/niah_multikey")}
        assert got[("retrieval", 1024)]["n"] == 4 and got[("retrieval", 1024)]["partial"] == {"of": 6}
        assert got[("retrieval/niah_single", 1024)]["partial"] is None  # every prompt of the subtask decoded
    md = (tmp_path / "b/scorecard.md").read_text()
    assert "(partial: 4/6)" in md and "**Incomplete**: 1 of 8" in md
    saved = json.loads((tmp_path / "b/scorecard.json").read_text())
    assert [c["partial"] for c in saved["cells"] if c["task"] == "retrieval"] == [None] + [{"of": 6}] * 3

    # the same prompts uninterrupted: batch 0 holds exactly the first two subtasks' prompts
    ref_cfg = _cfg(tmp_path / "c", subtasks=["niah_single", "niah_multikey"], tasks=["retrieval"])
    assert scorecard(ref_cfg, model=model, tokenizer=tok)["complete"]
    # and every prompt uninterrupted: the shared run's retrieval cells (a copy: rescored below)
    shutil.copytree(whole[0], tmp_path / "a")
    whole_cfg = _cfg(tmp_path / "a", tasks=["retrieval"])
    for out in ("a", "b", "c"):
        _rescore(tmp_path / out)
    got, ref, whole = _cells(_cfg(tmp_path / "b")), _cells(ref_cfg), _cells(whole_cfg)
    drop = lambda c: {k: v for k, v in c.items() if k != "partial"}  # noqa: E731
    assert got.keys() == {k for k in ref if k[0] != "full"} | {k for k in whole if k[0] == "full"}
    assert any(c["ratio"] != 1.0 for c in got.values())  # the check below compares real intervals
    for k, c in got.items():
        assert drop(c) == drop(ref[k] if k[0] != "full" else whole[k]), k


def test_order_pairs_gives_the_same_table(tiny, whole, tmp_path):
    from kvdex.eval.card.run import scorecard

    model, tok = tiny
    a, batches = whole  # the default order (batches), uninterrupted
    part = scorecard(_cfg(tmp_path / "b", order="pairs", max_cells=2), model=model, tokenizer=tok)
    assert part["slots_done"] == 1 and all(c["policy"] == "full" and not c["partial"] for c in part["cells"])
    pairs = scorecard(_cfg(tmp_path / "b", order="pairs"), model=model, tokenizer=tok)
    assert batches["complete"] and pairs["complete"]
    assert _records(a) == _records(tmp_path / "b")
    assert batches["cells"] == pairs["cells"]
    with pytest.raises(ValueError, match="order must be batches or pairs"):
        _cfg(tmp_path, order="pair").validate()


def test_batched_ragged_decoding_equals_one_prompt_at_a_time(tiny):
    from kvdex.eval.card import decode

    model, tok = tiny
    sizes = dict(page_size=16, sink=16, window=32, dense_layers=2)
    prompts = [[(7 * i + n) % 250 + 3 for i in range(n)] for n in (700, 690, 651)]  # left padding: 0, 10, 49
    base, logits, _ = decode.prefill(model, tok, prompts, sizes)
    limits = [12, 5, 12]
    rows, info = decode.greedy(model, base, logits, "quest", 64, limits, set(), graph=False)
    assert [len(r) for r in rows] == limits and info["steps"] == 11
    for p, n, row in zip(prompts, limits, rows, strict=True):
        one, one_logits, _ = decode.prefill(model, tok, [p], sizes)
        alone, _ = decode.greedy(model, one, one_logits, "quest", 64, [n], set(), graph=False)
        assert alone[0] == row
    cont = torch.tensor([[(5 * i) % 200 + 5 for i in range(9)]] * 3)
    out, info = decode.teacher(model, base, logits, "quest", 64, cont, 3, graph=False)
    assert len(out["nll"]) == 3 and all(0 < r < 1 for r in out["recall"]) and info["steps"] == 8
    full, _ = decode.teacher(model, base, logits, "full", None, cont, 3, graph=False)
    assert full["recall"] == [1.0] * 3
    fast = decode.speed(model, base, logits, "streaming", 64, steps=20, warmup=2)  # wall clock on the CPU
    assert fast["tokens_per_s"] > 0 and fast["timed_steps"]["eager"] == 20


@pytest.mark.gpu
def test_scorecard_on_cuda_replays_graphs_and_times_speed(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvdex.eval import scorecard

    model, tok = tiny_llama().cuda(), byte_tokenizer()
    cfg = _cfg(tmp_path, policies=["oracle", "quest", "streaming", "chess"], speed_batches=[1, 2], speed_steps=40)
    rep = scorecard(cfg, model=model, tokenizer=tok)
    assert rep["complete"], rep["failures"]
    cells = [json.loads(f.read_text()) for f in tmp_path.glob("cells/retrieval/*/*.json")]
    assert any(c["decode"]["replays"] > 0 for c in cells if c["policy"] == "quest")
    speed = [c for c in rep["cells"] if c["task"].startswith("tokens_per_s")]
    assert {c["task"] for c in speed} == {"tokens_per_s_b1", "tokens_per_s_b2"} and len(speed) == 2 * 5
    assert all(c["score"] > 0 for c in speed) and all(c["ratio"] == 1.0 for c in speed if c["policy"] == "full")


def test_task_left_out_for_missing_data_is_noted(tmp_path):
    from kvdex.eval.card.tasks import make_groups

    cfg = ScorecardConfig(tasks=["retrieval", "longtext", "longbench"], out=str(tmp_path / "o"))
    skipped: list[str] = []
    names = [g.name for g in make_groups(cfg, tmp_path, skipped)]  # an empty data folder
    assert names == ["retrieval"]
    assert any(n.startswith("recall / ppl skipped") for n in skipped)
    assert any(n.startswith("LongBench v1 skipped") for n in skipped)


@pytest.mark.parametrize("live_gb,collects", [(10, 0), (50, 1)])
def test_a_closed_fork_is_collected_only_when_device_memory_fills(monkeypatch, live_gb, collects):
    """decode.release: a full garbage collection (about 0.2 s) runs after a fork only when live device
    memory passes half the GPU; never on the CPU."""
    from types import SimpleNamespace

    from kvdex.eval.card import decode

    calls = []
    monkeypatch.setattr(decode.gc, "collect", lambda *a: calls.append(1))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: live_gb * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 10**9))
    decode.release("cpu")
    assert calls == []
    decode.release("cuda:0")
    assert len(calls) == collects


def test_against_compares_a_policy_with_the_same_spec_without_the_option(whole, tmp_path):
    """``against=["select_every"]``: quest:select_every=4 against quest, paired over the same prompts (the
    option's cells here are quest's renamed and rescored, so the two differ prompt by prompt); ``against=["quest"]``
    (a policy spec as the base) gives the same cells."""
    from kvdex.eval.card import report, stats
    from kvdex.eval.card.plan import cell_name
    from kvdex.eval.card.run import scorecard

    assert report.without("quest:rerank=4:select_every=8", "select_every") == "quest:rerank=4"
    assert report.without("quest:rerank=4", "select_every") is None
    out = tmp_path / "a"
    shutil.copytree(whole[0], out)
    for f in list(out.glob("cells/*/*/*__quest__b64.json")):
        c = json.loads(f.read_text())
        c["policy"] = "quest:select_every=4"
        (f.parent / cell_name(int(f.name[:3]), c["policy"], 64)).write_text(json.dumps(c))
    _rescore(out)
    cfg = _cfg(out, policies=["quest:select_every=4"], report_only=True, against=["select_every"])
    rep = scorecard(cfg)
    got = {(c["task"], c["length"]): c for c in rep["against"]}
    assert {"retrieval", "passkey"} <= {t for t, _ in got} and all(c["against"] == "quest" for c in got.values())
    recs = _records(out)
    x, y = recs[("retrieval", "quest:select_every=4", 64)], recs[("retrieval", "quest", 64)]
    ids = sorted(x)
    strata = [i.rpartition("-")[0] for i in ids]
    seed = report._seed("retrieval", 1024, "quest:select_every=4", 64)
    xs, ys = [x[i][0] for i in ids], [y[i][0] for i in ids]
    iv = stats.paired_ratio(xs, ys, strata=strata, resamples=cfg.resamples, seed=seed)
    c = got[("retrieval", 1024)]
    assert (c["ratio"], c["low"], c["high"]) == (round(iv.ratio, 4), round(iv.low, 4), round(iv.high, 4))
    assert c["n"] == len(ids) and c["ratio"] != 1.0
    assert c["base"] == round(sum(ys) / len(ids), 4)
    assert "## Paired against a base spec" in (out / "scorecard.md").read_text()
    # a policy spec as the base: every other spec of that policy against it, the same cells as the option's
    spec = scorecard(_cfg(out, policies=["quest:select_every=4"], report_only=True, against=["quest"]))
    assert spec["against"] == rep["against"]
    both = scorecard(_cfg(out, policies=["quest:select_every=4"], report_only=True, against=["quest", "select_every"]))
    assert both["against"] == rep["against"]  # the same base named twice is compared once
    assert report.bases("quest:select_every=4", ["prkv", "chess:rerank=4"]) == []  # other policies' specs
    assert report.bases("quest", ["quest"]) == []  # not against itself
    assert report.bases("icecache:search=summary", ["icecache", "icecache:search=host"]) == [
        "icecache",
        "icecache:search=host",
    ]
    assert all(c["partial"] is None for c in rep["against"])
    # the option's second retrieval batch missing: its cell is over 4 of the 6 prompts, marked partial
    (second,) = out.glob("cells/retrieval/*/001__quest+select_every=4__b64.json")
    second.unlink()
    part = scorecard(_cfg(out, policies=["quest:select_every=4"], report_only=True, against=["quest"]))
    got = {(c["task"], c["length"]): c for c in part["against"]}
    assert got[("retrieval", 1024)]["n"] == 4 and got[("retrieval", 1024)]["partial"] == {"of": 6}
    assert got[("passkey", 1024)]["partial"] is None and "(partial: 4/6)" in (out / "scorecard.md").read_text()
    with pytest.raises(ValueError, match="option names"):
        _cfg(out, against=["select_every=4"]).validate()
    with pytest.raises(ValueError, match="registered policy"):
        _cfg(out, against=["nosuchpolicy:rerank=4"]).validate()
