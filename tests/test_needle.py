"""Needle diagnostics (``kvdex eval needle``) on a tiny random Llama, CPU only."""

from __future__ import annotations

import numpy as np
import pytest

from kvdex.eval.needle import NeedleTask, find_positions
from kvdex.eval.runner import EvalConfig, run_task
from kvdex.hf.testing import byte_tokenizer, tiny_llama


def test_find_positions_covers_every_occurrence():
    prompt = [1, 2, 3, 9, 4, 2, 3, 2]
    assert find_positions(prompt, [[2, 3]]) == [1, 2, 5, 6]
    assert find_positions(prompt, [[7], [9, 4]]) == [3, 4]
    assert find_positions(prompt, [[]]) == []


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    task = NeedleTask(subtasks=["niah_multikey_3"])
    out = tmp_path_factory.mktemp("needle")
    cfg = EvalConfig(
        "tiny", ["oracle", "streaming"], [64, 4096], [512], samples=1, out=str(out), progress=False, decode="eager"
    )
    return {(r.policy, r.budget): r for r in run_task(task, model, tok, cfg)}, out


def test_full_and_a_covering_oracle_keep_every_needle_token(results):
    res, _ = results
    for key in [("full", None), ("oracle", 4096)]:
        m = res[key].metrics
        assert m["measured"] == 1
        assert m["kept"] == pytest.approx(1.0) and m["mass"] == pytest.approx(1.0) and m["oracle"] == pytest.approx(1)
        assert m["missed"] == 0


def test_streaming_never_attends_a_needle_in_the_middle(results):
    res, _ = results
    for rec in res[("streaming", 64)].records():
        assert np.all(np.array(rec["kept"]) == 0)  # the uuid needles lie outside sink and window
        assert np.all(np.array(rec["oracle"]) >= 0)
    m = res[("streaming", 64)].metrics
    assert m["kept"] == 0 and m["mass"] == 0
    # the oracle of the same size does better than nothing somewhere, so streaming "missed" there
    assert res[("oracle", 64)].metrics["mass"] > m["mass"]


def test_needle_report_draws_one_png_per_budget(results):
    pytest.importorskip("matplotlib")
    res, out = results
    from kvdex.eval.needle import plot_mass

    paths = plot_mass(out, list(res.values()))
    assert sorted(p.name for p in paths) == ["needle_mass_L512_b4096.png", "needle_mass_L512_b64.png"]


def test_panel_titles_wrap_long_policy_specs_at_their_separators():
    from kvdex.eval.needle import _wrap_spec

    spec = "prkv:rerank=4:rerank_group=weight:rerank_share=0.25"
    lines = _wrap_spec(spec).split("\n")
    assert len(lines) == 3 and all(len(line) <= 26 for line in lines)
    assert "".join(lines) == spec  # nothing lost: the lines are the spec cut before a ':'
    assert _wrap_spec("oracle") == "oracle"


def test_needle_task_refuses_other_subtasks():
    with pytest.raises(ValueError, match="niah_"):
        NeedleTask(subtasks=["vt"])


def test_metrics_follow_a_store_whose_slots_are_permuted():
    """PRKV reorders its store: the true weights and the attended slots are both mapped back to token
    positions before comparing."""
    from types import SimpleNamespace

    import torch

    from kvdex.eval.needle import needle_metrics
    from kvdex.storage.layout import Grid

    torch.manual_seed(0)
    L, d = 64, 8
    k = torch.randn(1, 1, L, d)
    q = 4 * k[:, :, 40]  # looks at token 40 above all
    perm = torch.randperm(L)  # slot s holds token perm[s]
    store_k = k[:, :, perm]
    grid = Grid(sink=0, page_size=16, window_pages=1)
    store = SimpleNamespace(dense=lambda: (store_k, store_k), lengths=torch.tensor([L]), grid=grid)
    slot40 = int((perm == 40).nonzero())  # the attended set names store slots (PRKV's relocated ones)
    aset = SimpleNamespace(valid=torch.ones(1, 1, 1, dtype=torch.bool), positions=torch.tensor([[[slot40]]]))
    needle = torch.zeros(1, L, dtype=torch.bool)
    needle[0, 40] = True
    m = needle_metrics(q, store, aset, needle, d**-0.5, lambda slots: perm[slots])
    assert m["kept"][0, 0] == 1 and m["mass"][0, 0] == 1 and m["oracle"][0, 0] == 1
    wrong = needle_metrics(q, store, aset, needle, d**-0.5)  # slot order taken for token order: the weights miss
    assert wrong["oracle"][0, 0] == 0
