"""``oracle`` selects exactly the true top-k middle tokens by softmax attention weight.

The truth is computed here, independently of kvdex's code: float64 softmax of every query head
over all real keys of its sequence (sink and window included), summed over the query heads of
each kv-head group, restricted to the middle region [sink, window_start), top ``budget - sink -
window``. It is compared (as sets) with what the policy selected, both through the cache's
``observer`` hook during generation and by calling ``policy.select`` on a real store.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SINK, WINDOW, left_padded, positions, shared_pair, window_start

import kvdex
from kvdex import cache_kwargs
from kvdex.view import LayerView

BUDGET = 96
RETRIEVAL = BUDGET - SINK - WINDOW


def true_topk(q, k, length, scale, group):
    """q [Hq, D], k [H, >=length, D] of one sequence -> per kv head (sorted weights, positions)."""
    ws = window_start(length)
    out = []
    for h in range(k.shape[0]):
        kk = k[h, :length].double()
        w = torch.softmax(q[h * group : (h + 1) * group].double() @ kk.T * scale, dim=-1).sum(0)  # [length]
        mid = w[SINK:ws]
        order = torch.argsort(mid, descending=True)
        out.append((mid, order + SINK))
    return out


class Checker:
    """Compares a selected middle set with the true top-k, tolerant only to exact-boundary ties."""

    def __init__(self):
        self.strict = 0
        self.tied = 0
        self.nonempty = 0

    def check(self, selected: list[int], mid: torch.Tensor, order: torch.Tensor, where: str):
        n_mid = mid.numel()
        k = min(RETRIEVAL, n_mid)
        assert len(selected) == len(set(selected)), f"{where}: duplicate positions {sorted(selected)}"
        assert len(selected) == k, f"{where}: selected {len(selected)} tokens, expected {k} of {n_mid} middle"
        if k == 0:
            return
        self.nonempty += 1
        truth = set(order[:k].tolist())
        vals = mid[order - SINK]
        # fp32 softmax weights carry ~1e-7 relative error: a relative gap of 1e-4 is decisive.
        gap_ok = k == n_mid or bool(vals[k - 1] - vals[k] > 1e-4 * vals[k - 1])
        if gap_ok:
            self.strict += 1
            assert set(selected) == truth, (
                f"{where}: oracle picked {sorted(set(selected) - truth)} instead of {sorted(truth - set(selected))}"
            )
        else:  # a tie at the k-th weight: any tied token is as good
            self.tied += 1
            sel_w = mid[torch.tensor(selected) - SINK]
            assert bool((sel_w >= vals[k] * (1 - 1e-4)).all()), f"{where}: selected a non-top-k token"


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "llama_mha", "qwen3"])
def test_oracle_observer_matches_true_topk(family, offload):
    model, _ = shared_pair(family)
    lengths = [90, 57, 120]
    ids, mask, _ = left_padded(lengths, seed=21)
    cache = kvdex.Cache(model, "oracle", budget=BUDGET, offload=offload, dense_layers=1)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    checker = Checker()
    calls = []

    def observer(layer, q, store, aset, scale):
        calls.append(layer)
        k, _ = store.dense()
        lens = store.lengths_host.tolist()
        for b, length in enumerate(lens):
            truth = true_topk(q[b], k[b], length, scale, group)
            ws = window_start(length)
            for h, (mid, order) in enumerate(truth):
                valid = aset.valid[b, h]
                pos = aset.positions[b, h][valid].tolist()
                # sink and window are always attended, nothing beyond the context is
                assert set(range(min(SINK, length))) | set(range(ws, length)) <= set(pos)
                assert max(pos) < length
                selected = [p for p in pos if SINK <= p < ws]
                checker.check(selected, mid, order, f"layer {layer} step {len(calls)} seq {b} head {h}")

    cache.observer = observer
    model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=30, do_sample=False)
    sparse_layers = model.config.num_hidden_layers - 1
    assert len(calls) == 29 * sparse_layers
    assert checker.nonempty > 0 and checker.strict >= 0.9 * checker.nonempty, vars(checker)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_oracle_select_on_prefilled_store(offload):
    """policy.select on a real store after a left-padded prefill, random peaked GQA queries."""
    model, _ = shared_pair("llama_gqa")
    lengths = [100, 66, 49, 130]
    ids, mask, _ = left_padded(lengths, seed=5)
    cache = kvdex.Cache(model, "oracle", budget=BUDGET, offload=offload, dense_layers=1)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(cache))
    checker = Checker()
    g = torch.Generator().manual_seed(0)
    hq, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    for layer in (1, 2):
        store = cache.layers[layer].store
        assert store.lengths_host.tolist() == lengths
        assert isinstance(store, kvdex.storage.OffloadStore if offload else kvdex.storage.DeviceStore)
        k, _ = store.dense()
        for trial in range(4):
            q = 2.0 * torch.randn(len(lengths), hq, d, generator=g)
            sel = cache.policy.select(q, LayerView.of(layer, store, d**-0.5, cache.config))
            assert sel.tokens is not None and sel.pages is None and not sel.everything
            assert sel.tokens.shape[:2] == (len(lengths), model.config.num_key_value_heads)
            for b, length in enumerate(lengths):
                for h, (mid, order) in enumerate(true_topk(q[b], k[b], length, d**-0.5, 2)):
                    chosen = [t for t in sel.tokens[b, h].tolist() if t >= 0]
                    checker.check(chosen, mid, order, f"layer {layer} trial {trial} seq {b} head {h}")
    assert checker.strict >= 0.9 * checker.nonempty > 0, vars(checker)
