"""``select_every=N`` (kvdex/engine/reuse.py, kvdex/policies/reuse.py): a step selects when no selection is
held, when a page joins the middle, when the policy must (PRKV's refresh) or after N - 1 reuse steps; every
other step attends each layer's last selection. Full budget == dense, offload == device and forks are in
tests/test_contract.py, captured == eager on the GPU there and in tests/test_graph.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, left_padded, positions, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.engine.reuse import SelectionReuse
from kvdex.storage import Grid

FAMILY = "llama_gqa"
STEPS = 40
GRID = Grid(SINK, PAGE, WINDOW // PAGE)


def _store(length: int):
    return SimpleNamespace(grid=GRID, lengths_host=torch.tensor([length]))


def _joins(length: int) -> bool:
    """Whether appending one token to ``length`` tokens moves a page into the middle."""
    n = GRID.num_middle_pages(torch.tensor([length, length + 1]))
    return bool(n[1] != n[0])


def _expected_selects(starts, steps: int, every: int) -> list[bool]:
    """Per decode step of rows of ``starts`` tokens: does it select? (the rule of the module docstring)"""
    out, age = [], -1
    for i in range(steps):
        select = age < 0 or age >= every - 1 or any(_joins(s + i) for s in starts)
        age = 0 if select else age + 1
        out.append(select)
    return out


def test_schedule_selects_on_joins_and_every_n_steps():
    r = SelectionReuse()
    start = 70
    got = [not r.decide(4, start + i, _store(start + i)) for i in range(STEPS)]
    assert got == _expected_selects([start], STEPS, 4)
    assert got.count(False) > STEPS // 2  # most steps reuse
    assert any(_joins(start + i) for i in range(STEPS))


def test_schedule_is_decided_once_per_step_and_resets():
    r = SelectionReuse()
    assert r.decide(4, 70, _store(70)) is False  # nothing held yet
    assert r.decide(4, 71, _store(71)) is True
    assert r.decide(4, 71, _store(71), must_select=lambda: True) is True  # the same step: the first decision stands
    assert r.decide(4, 72, _store(72), must_select=lambda: True) is False  # the policy asks for a selection
    r.reset()
    assert r.decide(4, 73, _store(73)) is False
    assert not any(SelectionReuse().decide(1, 70 + i, _store(70 + i)) for i in range(8))  # every=1: never


@torch.no_grad()
def _run(spec: str, budget: int = 64, lengths=(70, 45)):
    """Teacher-forced decode of STEPS tokens; (per step: selected?, per step and sparse layer: the middle
    positions attended per (row, kv head))."""
    model, _ = shared_pair(FAMILY)
    ids, mask, _ = left_padded(list(lengths), seed=3)
    cache = kvdex.Cache(model, spec, budget, dense_layers=1)
    selected, attended = [], []
    cache.on_select = lambda view, sel: selected.append(cache.step)

    def observe(layer, q, store, aset, scale):
        ws = store.grid.window_start(store.lengths_host)
        idx = torch.where(aset.valid, aset.idx, -1).cpu()
        middle = (idx >= SINK) & (idx < ws[:, None, None])
        attended.append((cache.step, layer, [sorted(set(idx[b, h][middle[b, h]].tolist()))
                                             for b in range(idx.shape[0]) for h in range(idx.shape[1])]))  # fmt: skip

    cache.observer = observe
    model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(cache))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, model.config.vocab_size, (len(lengths), STEPS), generator=g)
    last = positions(mask)[:, -1:]
    for t in range(STEPS):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        model(tokens[:, t : t + 1], attention_mask=mask, position_ids=last + t + 1, **cache_kwargs(cache))
    layers = len(cache.policy.info.sparse_layers)
    steps = sorted(set(selected))
    assert all(selected.count(s) == layers for s in steps)  # a step selects in every sparse layer or none
    return [s in steps for s in range(1, STEPS + 1)], attended, cache


@pytest.mark.parametrize("spec", ["quest:select_every=4", "prkv:rerank=2:rerank_group=weight:select_every=4",
                                  "icecache:search=summary:rerank=2:rerank_unit=token:select_every=5"])  # fmt: skip
def test_reuse_steps_attend_the_last_selection(spec):
    every = int(spec.rsplit("=", 1)[1])
    selects, attended, cache = _run(spec)
    assert selects == _expected_selects([70, 45], STEPS, every)  # a page joining any row's middle selects
    assert 0 < selects.count(True) < STEPS
    assert cache.stats()["selection_steps"] == {"select_every": every, "selected": selects.count(True),
                                                "reused": selects.count(False)}  # fmt: skip
    last = {}
    for step, layer, middle in attended:
        if not selects[step - 1]:
            assert middle == last[layer], f"{spec}: step {step} layer {layer} attends another middle set"
        last[layer] = middle


def test_select_every_one_selects_every_step():
    selects, _, cache = _run("quest")
    assert all(selects)
    assert cache.stats()["selection_steps"] == {"select_every": 1, "selected": len(selects), "reused": 0}


def test_prkv_refresh_steps_select():
    """PRKV restructures its static region every ``refresh`` steps: those steps select (must_select), and
    the queries of reuse steps still join its ring (``reused``), so the refreshes fall on the same steps."""
    selects, _, cache = _run("prkv:static_ratio=0.5:refresh=6:select_every=5", budget=96)
    ref_selects, _, ref = _run("prkv:static_ratio=0.5:refresh=6:select_every=1", budget=96)
    assert all(ref_selects)
    assert cache.policy.schedule.refreshes == ref.policy.schedule.refreshes and cache.policy.schedule.refreshes
    for steps in cache.policy.schedule.refreshes.values():
        assert all(selects[s] for s in steps)  # decode step s (0-based) is selects[s]


def test_bad_select_every():
    with pytest.raises(ValueError, match="select_every must be an int >= 1"):
        kvdex.make_policy("quest:select_every=0")
    with pytest.raises(ValueError, match="select_every"):
        kvdex.make_policy("icecache", select_every=1.5)
    with pytest.raises(TypeError, match="no option"):  # CHESS reuses its selection between rebuilds itself
        kvdex.make_policy("chess:select_every=4")
