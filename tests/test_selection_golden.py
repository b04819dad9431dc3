"""Every registered policy selects the same ids as when ``tests/data/golden_selections.json`` was recorded.

On a tiny random model (fixed seed, CPU, fp32) each policy decodes a ragged left-padded batch with a
budget smaller than the context, on the device and offloaded, and every selection it returns (one per
sparse layer and decode step, in call order) is compared with the recorded one: the selected middle
pages and tokens of each (sequence, kv head), as sets. Refactors must keep them identical; a change
that is meant to alter a policy's selections regenerates that policy's entry on purpose:

    KVDEX_REGEN_GOLDEN=1 python -m pytest tests/test_selection_golden.py            # every policy
    KVDEX_REGEN_GOLDEN=chess python -m pytest tests/test_selection_golden.py        # only these (comma list)

A policy registered after the file was written has no entry: the test is skipped for it until the
entry is generated. Every selection is also held to the policy's declared ``granularity``. Besides each
registered policy at its defaults, ``EXTRA`` specs are recorded under their spec string: configurations
kept beside a default (pariskv's paper configuration); regenerate one with its full spec in the list.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import greedy, left_padded, shared_pair

import kvdex
from kvdex.policies import make_policy

GOLDEN = Path(__file__).parent / "data" / "golden_selections.json"
FAMILY = "llama_gqa"
LENGTHS = [150, 97]  # ragged: row 1 is left-padded
BUDGET = 96  # sink 16 + window 32 + 3 retrieved pages: selection is real at both lengths
NEW = 7  # generated tokens: 6 decode steps after the prefill
OFFLOADS = (False, True)
# configurations recorded beside the registered defaults (the paper's, where a policy's default is kvdex's)
EXTRA = ["pariskv:group=mean:coarse=tiers:pool_factor=None:candidate_ratio=None", "prkv:rerank=0", "chess:rerank=0",
         # the page policies' token rerank (kvdex options beside the papers' selection)
         "quest:rerank=2:rerank_group=weight", "prkv:rerank=2"]  # fmt: skip
CASES = [*kvdex.policies(), *EXTRA]


def _rows(t: torch.Tensor | None) -> list[list[int]] | None:
    """[B, H, N] ids padded with -1 -> per (sequence, kv head) the sorted set of ids."""
    if t is None:
        return None
    flat = t.reshape(-1, t.shape[-1]).tolist()
    return [sorted({int(i) for i in row if i >= 0}) for row in flat]


def record(policy: str, offload: bool) -> list[dict]:
    """The selections ``policy`` returns while decoding, in call order."""
    calls: list[dict] = []
    pol = make_policy(policy)  # a name or a spec with options
    base = type(pol)

    class Recorder(base):  # a subclass that keeps what select returns; same fields, same behaviour
        def select(self, *args, **kwargs):
            sel = super().select(*args, **kwargs)
            calls.append({"pages": _rows(sel.pages), "tokens": _rows(sel.tokens), "everything": bool(sel.everything)})
            return sel

    Recorder.__name__ = base.__name__
    model, _ = shared_pair(FAMILY)
    ids, mask, _ = left_padded(LENGTHS, seed=11)
    torch.manual_seed(0)
    options = {f.name: getattr(pol, f.name) for f in dataclasses.fields(pol) if f.init}
    cache = kvdex.Cache(model, Recorder(**options), BUDGET, offload=offload, dense_layers=1)
    greedy(model, ids, mask, cache, new=NEW)
    return calls


def _key(offload: bool) -> str:
    return "offload" if offload else "device"


def _regen() -> set[str]:
    flag = os.environ.get("KVDEX_REGEN_GOLDEN", "")
    if flag in ("", "0"):
        return set()
    return set(CASES) if flag == "1" else set(flag.split(","))


def _dumps(data: dict) -> str:
    """JSON with one selection per line, so a changed selection reads as a changed line in a diff."""
    out = []
    for policy in sorted(data):
        runs = []
        for key, calls in data[policy].items():
            lines = ",\n".join("   " + json.dumps(c, separators=(",", ":")) for c in calls)
            runs.append(f"  {json.dumps(key)}: [\n{lines}\n  ]")
        out.append(f" {json.dumps(policy)}: {{\n" + ",\n".join(runs) + "\n }")
    return "{\n" + ",\n".join(out) + "\n}\n"


def _load() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("policy", CASES)
def test_selections_match_golden(policy):
    regen = _regen()
    if policy in regen:
        data = _load()
        data[policy] = {_key(o): record(policy, o) for o in OFFLOADS}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(_dumps(data))
        pytest.skip(f"regenerated {policy}'s golden selections")
    runs = {offload: record(policy, offload) for offload in OFFLOADS}
    for calls in runs.values():
        _check_granularity(policy, calls)
    golden = _load().get(policy)
    if golden is None:
        pytest.skip(f"no golden selections for {policy!r}: run with KVDEX_REGEN_GOLDEN={policy}")
    for offload in OFFLOADS:
        got, want = runs[offload], golden[_key(offload)]
        assert len(got) == len(want), f"{policy}/{_key(offload)}: {len(got)} selections, recorded {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{policy}/{_key(offload)}: selection {i} (step {i // 2}, layer {1 + i % 2}) differs"


def _check_granularity(policy: str, calls: list[dict]) -> None:
    """``Policy.granularity`` says what the selections name: "token" policies tokens only, "page"
    policies pages (single tokens may come with them) or everything."""
    granularity = make_policy(policy).granularity  # an instance: with rerank, a page policy selects tokens
    assert granularity in ("page", "token"), f"{policy}: granularity {granularity!r}"
    for i, call in enumerate(calls):
        if granularity == "token":
            assert call["pages"] is None and call["tokens"] is not None, f"{policy} (token): selection {i} {call}"
        else:
            assert call["pages"] is not None or call["everything"], f"{policy} (page): selection {i} {call}"


def test_golden_covers_selection():
    """The recorded selections are real: not empty, and not everything (budget < context)."""
    data = _load()
    if not data:
        pytest.skip("no golden file yet")
    assert "quest" in data and len(data["quest"]["device"]) == 2 * (NEW - 1)
    quest = data["quest"]["device"][-1]
    assert not quest["everything"]
    assert all(len(row) == 3 for row in quest["pages"])  # 3 retrieved pages per (sequence, kv head)
