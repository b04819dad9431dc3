"""A budget that covers the whole context makes every policy exact.

With budget >= context length no token is dropped, so kvdex must reproduce transformers' own
attention (sdpa, same weights) step by step: logits within fp32 rounding and identical greedy
tokens over 56 decoded tokens that cross several page boundaries (page_size 16), with the KV on
the device and offloaded to host memory, for every model family.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    ALL_POLICIES,
    PAGE,
    SINK,
    SPARSE_POLICIES,
    WINDOW,
    build_pair,
    greedy,
    left_padded,
    prompt,
    reference_greedy,
    shared_pair,
)

import kvdex
from kvdex import cache_kwargs

NEW = 56
ATOL = 1e-4


# 70 tokens: the prefill already has middle pages; 30 tokens: the first middle pages appear while
# decoding (30 + 56 crosses sink + window = 48 and three page boundaries).
@pytest.mark.parametrize("n", [70, 30], ids=["prompt70", "prompt30"])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_covering_budget_matches_sdpa(pair, family, policy, offload, n):
    model, _ = pair
    ids = prompt(n, seed=n)
    ref_tokens, ref_logits = reference_greedy(family, n, n, NEW)
    cache = kvdex.Cache(
        model, policy, budget=256, page_size=PAGE, sink=SINK, window=WINDOW, offload=offload, dense_layers=1
    )
    tokens, logits = greedy(model, ids, cache=cache, new=NEW)
    assert logits.shape == ref_logits.shape == (NEW, 1, model.config.vocab_size)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens, ref_tokens), f"{family}/{policy}/offload={offload}: greedy tokens differ"
    stats = cache.stats()
    assert stats["context_tokens"] == [n + NEW - 1]
    assert stats["decode_steps"] == NEW - 1
    # Nothing dropped: decode step j (1..NEW-1) attends all n + j tokens of each kv head.
    assert stats["attended_tokens_per_step"] == pytest.approx(n + NEW / 2)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_all_layers_sparse_matches_sdpa(offload):
    """dense_layers=0: layer 0 is sparse too (its keys do not depend on earlier attention)."""
    model, ref = shared_pair("qwen2")
    ids = prompt(61, seed=3)
    ref_tokens, ref_logits = greedy(ref, ids, new=NEW)
    for policy in ("quest", "oracle"):
        cache = kvdex.Cache(model, policy, budget=128, offload=offload, dense_layers=0)
        tokens, logits = greedy(model, ids, cache=cache, new=NEW)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_sampling_same_seed_same_tokens(offload):
    model, ref = shared_pair("llama_gqa")
    ids = prompt(50, seed=7)
    kw = dict(do_sample=True, temperature=1.5, top_k=0, top_p=1.0, max_new_tokens=NEW)
    torch.manual_seed(1234)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    cache = kvdex.Cache(model, "quest", budget=256, offload=offload, dense_layers=1)
    torch.manual_seed(1234)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), **kw)
    assert torch.equal(got, expected)
    # The test can fail: another seed samples another continuation.
    torch.manual_seed(999)
    other = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert not torch.equal(other, expected)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("sink,page_size,window", [(0, 8, 8), (3, 1, 4), (5, 32, 32)])
def test_covering_budget_other_geometries(sink, page_size, window, offload):
    """Sink 0, one-token pages, a sink that is not page aligned, chunked prefill (7 rows)."""
    model, _ = shared_pair("llama_gqa")
    ref_tokens, ref_logits = reference_greedy("llama_gqa", 70, 70, NEW)
    for policy in SPARSE_POLICIES:
        cache = kvdex.Cache(
            model,
            policy,
            512,
            sink=sink,
            page_size=page_size,
            window=window,
            offload=offload,
            dense_layers=1,
            prefill_chunk=7,
        )
        tokens, logits = greedy(model, prompt(70, seed=70), cache=cache, new=NEW)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        assert torch.equal(tokens, ref_tokens), f"{policy}: greedy tokens differ"


def test_streaming_at_sink_plus_window_attends_exactly_the_budget():
    """budget == sink + window (refused for the policies that retrieve: tests/test_cache_lifecycle.py) is
    streaming's plain configuration: the sink plus the last budget - sink tokens, so it fills the window's
    empty slots with the tokens just before it -- exactly the budget, never more, on the device and
    offloaded alike, and not the dense result."""
    model, _ = shared_pair("llama_mha")
    ids = prompt(70, seed=5)
    results = {}
    for offload in (False, True):
        cache = kvdex.Cache(model, "streaming", SINK + WINDOW, offload=offload, dense_layers=1)
        results[offload] = greedy(model, ids, cache=cache, new=NEW)
        assert cache.stats()["attended_tokens_per_step"] == SINK + WINDOW
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert not torch.allclose(results[False][1], reference_greedy("llama_mha", 70, 5, NEW)[1], atol=ATOL)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_second_turn_extend_matches_sdpa(policy, offload):
    """A second turn (several new tokens on a filled cache: the multi-token extend path) of a
    left-padded batch, continued by greedy decoding, equals sdpa on the whole conversation."""
    model, ref = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([70, 44], seed=3)
    cache = kvdex.Cache(model, policy, 512, offload=offload, dense_layers=1)
    first, _ = greedy(model, ids, mask, cache, new=20)
    ids2 = torch.cat([first, prompt(13, 99).repeat(2, 1)], dim=1)
    mask2 = torch.cat([mask, torch.ones(2, 33, dtype=torch.long)], dim=1)
    tokens, logits = greedy(model, ids2, mask2, cache, new=30)
    ref_tokens, ref_logits = greedy(ref, ids2, mask2, new=30)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.stats()["context_tokens"] == [70 + 19 + 13 + 30, 44 + 19 + 13 + 30]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_bit_identical_to_device_for_sparse_policies(dtype):
    """Same selection, same slot order, same values: offloading changes no bit of the output
    (ragged batch with a row shorter than the sink, budget 96 so selection is real)."""
    model, _ = build_pair("qwen3", seed=4)
    model = model.to(dtype)
    ids, mask, _ = left_padded([120, 5, 33], seed=8)
    for policy in SPARSE_POLICIES:
        out = {}
        for offload in (False, True):
            cache = kvdex.Cache(model, policy, 96, offload=offload, dense_layers=1)
            out[offload] = greedy(model, ids, mask, cache, new=40)
            assert cache.layers[1].store.k.dtype == dtype
        assert torch.equal(out[True][0], out[False][0]), policy
        assert torch.equal(out[True][1], out[False][1]), policy
