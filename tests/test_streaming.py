"""``streaming``: attention sinks plus the most recent tokens (StreamingLLM)."""

from __future__ import annotations

import pytest
from conftest import SINK, left_padded, shared_pair, window_start

import kvdex
from kvdex import cache_kwargs

BUDGET = 96


def _attended_sets(offload):
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([100, 61, 20], seed=17)
    cache = kvdex.Cache(model, "streaming", BUDGET, offload=offload, dense_layers=1)
    seen = []

    def observer(layer, q, store, aset, scale):
        for b, n in enumerate(store.lengths_host.tolist()):
            for h in range(store.kv_heads):
                pos = aset.positions[b, h][aset.valid[b, h]].tolist()
                assert len(pos) == len(set(pos)), "a position attended twice"
                seen.append((n, sorted(pos)))

    cache.observer = observer
    model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=40, do_sample=False)
    assert seen
    return seen


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_streaming_attends_sink_and_a_recent_suffix(offload):
    """Sink + one contiguous suffix of the last ``budget - sink`` tokens (all of them while the
    context is shorter), never more than the budget, and the whole window always inside it."""
    for n, pos in _attended_sets(offload):
        expected = list(range(min(SINK, n))) + list(range(max(SINK, n - (BUDGET - SINK)), n))
        assert pos == expected, f"context {n}"
        assert len(pos) <= BUDGET
        assert set(range(max(SINK, window_start(n)), n)) <= set(pos)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_streaming_attends_sink_plus_last_budget_minus_sink_tokens(offload):
    """kvdex/policies/streaming.py documents: 'the attended set is exactly sink + the last
    budget - sink tokens' (StreamingLLM). That must hold at every step once the context exceeds
    the budget, not only on steps where the window happens to be full."""
    checked = 0
    for n, pos in _attended_sets(offload):
        if n < BUDGET:
            continue
        checked += 1
        expected = list(range(SINK)) + list(range(n - (BUDGET - SINK), n))
        assert pos == expected, f"context {n}: attends {len(pos)} tokens, expected {BUDGET}"
    assert checked
