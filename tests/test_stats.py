"""cache.stats(): attended tokens within budget, transfers and host memory only with offload,
timing breakdown only with timing=True."""

from __future__ import annotations

import pytest
import torch
from conftest import SPARSE_POLICIES, left_padded, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs

NEW = 40


def _generate(policy, offload, lengths=(90, 60), budget=96, new=NEW, **kw):
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded(list(lengths), seed=3)
    observer = kw.pop("observer", None)
    cache = kvdex.Cache(model, policy, budget, offload=offload, dense_layers=1, **kw)
    cache.observer = observer
    model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=new, do_sample=False)
    return cache, cache.stats()


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", SPARSE_POLICIES)
def test_attended_within_budget(policy, offload):
    observed = []
    observer = lambda layer, q, store, aset, scale: observed.append(aset.valid.sum(-1))
    cache, s = _generate(policy, offload, observer=observer)
    assert s["policy"] == policy and s["budget"] == 96 and s["retrieval_tokens"] == 48
    assert s["context_tokens"] == [90 + NEW - 1, 60 + NEW - 1]
    assert s["decode_steps"] == NEW - 1 and s["sparse_layers"] == 2 and s["dense_layers"] == 1
    assert 0 < s["attended_tokens_per_step"] <= 96
    # per step and per (sequence, kv head) too, not only on average
    assert len(observed) == 2 * (NEW - 1)
    per_head = torch.stack(observed).float()  # [calls, B, H]
    assert per_head.max() <= 96
    assert s["attended_tokens_per_step"] == pytest.approx(per_head.mean().item())


def test_full_policy_attends_everything():
    _, s = _generate("full", False)
    # step j (1..NEW-1) attends the whole context of each sequence: 90 + j and 60 + j tokens
    assert s["attended_tokens_per_step"] == pytest.approx((90 + 60) / 2 + NEW / 2)
    assert s["budget"] is None and s["retrieval_tokens"] is None


@pytest.mark.parametrize("policy", ["quest", "oracle", "streaming", "full"])
def test_transfers_and_host_memory_only_with_offload(policy):
    _, dev = _generate(policy, False)
    assert dev["offload"] is False
    assert dev["bytes_host_to_device"] == 0 and dev["host_to_device_transfers"] == 0
    assert dev["bytes_device_to_host"] == 0 and dev["kv_bytes_host"] == 0
    assert dev["kv_bytes_device"] > 0
    _, off = _generate(policy, True)
    assert off["offload"] is True
    assert off["bytes_host_to_device"] > 0 and off["host_to_device_transfers"] > 0
    assert off["bytes_device_to_host"] > 0 and off["kv_bytes_host"] > 0
    if policy in ("quest", "streaming"):  # they never copy the whole middle: less device memory
        assert off["kv_bytes_device"] < dev["kv_bytes_device"]


@pytest.mark.parametrize("policy", ["quest", "full"])
def test_no_host_memory_when_context_fits_sink_and_window(policy):
    # 20 + 20 - 1 = 39 tokens < sink + window = 48: nothing ever leaves the device
    _, s = _generate(policy, True, lengths=(20, 12), new=20)
    assert s["context_tokens"] == [39, 31]
    assert s["kv_bytes_host"] == 0 and s["bytes_device_to_host"] == 0
    assert s["bytes_host_to_device"] == 0


def test_timing_breakdown():
    _, s = _generate("quest", True, timing=True)
    t = s["time_ms_per_step"]
    assert {"selection", "transfer", "attention"} <= set(t)
    assert all(v >= 0 for v in t.values()) and t["attention"] > 0
    _, s = _generate("quest", True)
    assert "time_ms_per_step" not in s


def test_stats_before_any_forward():
    model, _ = shared_pair("llama_gqa")
    s = kvdex.Cache(model, "quest", 96).stats()
    assert s["context_tokens"] == [] and s["decode_steps"] == 0 and s["attended_tokens_per_step"] is None
    assert s["kv_bytes_device"] == 0 and s["kv_bytes_host"] == 0


def test_prefill_only_counts_no_decode():
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "quest", 96, offload=True, dense_layers=1)
    model.generate(prompt(100, 1), **cache_kwargs(cache), max_new_tokens=1, do_sample=False)
    s = cache.stats()
    assert s["decode_steps"] == 0 and s["attended_tokens_per_step"] is None
    assert s["bytes_host_to_device"] == 0 and s["kv_bytes_host"] > 0


def _kv_geometry(model):
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, next(model.parameters()).element_size()


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "fork"])
@pytest.mark.parametrize("policy", ["full", "quest", "streaming"])
def test_kv_bytes_device_is_the_tokens_keys_and_values(policy, fork):
    """offload=False: every layer holds every token on the device, and kv_bytes_device is exactly
    layers x kv_heads x tokens x head_dim x 2 (keys and values) x dtype bytes -- not the buffers'
    capacity, which grows ahead of the tokens (a fork's first decode step grows it by 25 %)."""
    model, _ = shared_pair("llama_gqa")
    layers, kv_heads, head_dim, item = _kv_geometry(model)
    ids, mask, _ = left_padded([90, 60], seed=3)
    if fork:
        base = kvdex.Cache(model, "full", 96, dense_layers=1)
        with torch.no_grad():
            model(ids, attention_mask=mask, **cache_kwargs(base), use_cache=True)
        cache = base.fork(policy=policy)
        ids = torch.cat([ids, torch.zeros_like(ids[:, :1])], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    else:
        cache = kvdex.Cache(model, policy, 96, offload=False, dense_layers=1)
    model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=NEW, do_sample=False)
    s = cache.stats()
    tokens = sum(s["context_tokens"])
    assert tokens == 90 + 60 + 2 * (NEW - 1) + (2 if fork else 0)
    assert s["kv_bytes_device"] == layers * kv_heads * tokens * head_dim * 2 * item
    assert s["kv_bytes_host"] == 0


@pytest.mark.parametrize("policy", ["full", "quest"])
def test_offloaded_host_bytes_hold_the_middle(policy):
    """offload=True: the host figure is the middle pages' keys and values of every sparse layer (all but the
    dense_layers=1 first), the device keeps the sink, the window and the working set, less than all tokens."""
    model, _ = shared_pair("llama_gqa")
    layers, kv_heads, head_dim, item = _kv_geometry(model)
    cache, s = _generate(policy, True)
    sink, page, window = s["sink"], s["page_size"], s["window"]
    middle = [max(-(-(n - sink) // page) - window // page, 0) * page for n in s["context_tokens"]]
    assert all(m > 0 for m in middle)
    assert s["kv_bytes_host"] == (layers - 1) * kv_heads * sum(middle) * head_dim * 2 * item
    _, dev = _generate(policy, False)
    if policy == "quest":  # the working set holds the budget's pages, not the whole middle as full's does
        assert s["kv_bytes_device"] < dev["kv_bytes_device"]
    assert dev["kv_bytes_device"] == layers * kv_heads * sum(dev["context_tokens"]) * head_dim * 2 * item
