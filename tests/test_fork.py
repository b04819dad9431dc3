"""Cache.fork: prefill once (policy full), decode per policy; identical to a fresh cache."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, left_padded, positions, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs

NEW = 40


def _prefill(model, ids, mask, **kw):
    cache = kvdex.Cache(model, "full", **kw)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(cache))
    assert cache.step == 0
    return cache, out.logits[:, -1]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", ["quest", "oracle", "streaming"])
def test_fork_equals_fresh_cache(policy, offload):
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([90, 57, 120], seed=12)
    src, last = _prefill(model, ids, mask, dense_layers=1)
    first = last.argmax(-1, keepdim=True)

    fresh = kvdex.Cache(model, policy, budget=96, offload=offload, dense_layers=1)
    t_fresh, l_fresh = greedy(model, ids, mask, fresh, new=NEW + 1)
    # the prefill logits of the full cache are those of the fresh cache's prefill
    torch.testing.assert_close(last, l_fresh[0], atol=1e-5, rtol=0)
    assert torch.equal(t_fresh[:, ids.shape[1]], first[:, 0])

    fork = src.fork(policy=policy, budget=96, offload=offload)
    assert fork is not src and fork.policy is not src.policy and fork.policy.name == policy
    assert fork.step == 0 and fork.config.budget == 96 and fork.config.offload == offload
    assert fork.get_seq_length() == src.get_seq_length() == ids.shape[1]
    store_type = kvdex.storage.OffloadStore if offload else kvdex.storage.DeviceStore
    assert isinstance(fork.layers[1].store, store_type) and isinstance(fork.layers[0].store, kvdex.storage.DeviceStore)
    if policy == "quest":  # the fork re-indexed the prompt with its own policy state
        for layer in (1, 2):
            fresh_q = kvdex.Cache(model, "quest", budget=96, offload=offload, dense_layers=1)
            with torch.no_grad():
                model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(fresh_q))
            assert torch.equal(fork.policy.kmin[layer], fresh_q.policy.kmin[layer])
            assert torch.equal(fork.policy.kmax[layer], fresh_q.policy.kmax[layer])
            assert not hasattr(src.policy, "kmin")

    ids2 = torch.cat([ids, first], dim=1)
    mask2 = torch.cat([mask, torch.ones_like(first)], dim=1)
    t_fork, l_fork = greedy(model, ids2, mask2, fork, new=NEW)
    assert torch.equal(t_fork, t_fresh), "fork decodes differently from a fresh cache"
    torch.testing.assert_close(l_fork, l_fresh[1:], atol=1e-5, rtol=0)
    # the source is untouched and can be forked again
    assert src.step == 0
    again = src.fork(policy=policy, budget=96, offload=offload)
    t_again, _ = greedy(model, ids2, mask2, again, new=NEW)
    assert torch.equal(t_again, t_fresh)


def test_fork_keeps_settings_and_overrides():
    model, _ = shared_pair("qwen3")
    ids = prompt(70, 1)
    src, _ = _prefill(model, ids, torch.ones_like(ids), dense_layers=1, page_size=16, sink=16, window=32)
    same = src.fork()
    assert same.policy.name == "full" and same.config == src.config
    fork = src.fork("quest", 128, offload=True, timing=True)
    assert fork.config.budget == 128 and fork.config.offload and fork.config.timing
    assert fork.config.dense_layers == 1 and fork.config.window == 32
    with pytest.raises(ValueError, match="unknown policy"):
        src.fork("nope")


def test_fork_after_decoding_raises():
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "full")
    with pytest.raises(ValueError, match="prefilled a prompt and not decoded"):
        cache.fork("quest", 96)  # nothing prefilled yet
    model.generate(prompt(60, 2), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)
    assert cache.step == 2
    with pytest.raises(ValueError, match="prefilled a prompt and not decoded"):
        cache.fork("quest", 96)


def test_fork_after_generate_one_token():
    """generate(max_new_tokens=1) only prefills: its cache can be forked and continued."""
    model, _ = shared_pair("mistral")
    ids = prompt(80, 4)
    src = kvdex.Cache(model, "full", dense_layers=1)
    first = model.generate(ids, **cache_kwargs(src), max_new_tokens=1, do_sample=False)
    assert src.step == 0
    fork = src.fork("quest", 96)
    t_fork, _ = greedy(model, first, None, fork, new=30)
    t_fresh, _ = greedy(model, ids, None, kvdex.Cache(model, "quest", 96, dense_layers=1), new=31)
    assert torch.equal(t_fork, t_fresh)


def test_pariskv_kmeans_forks_learn_the_centroids_once(monkeypatch):
    """Forks of one prefill at other budgets reuse the first fork's k-means centroids (share_index) and decode
    exactly what a fresh cache decodes; a fork with another seed learns its own."""
    from kvdex.policies.pariskv import learned_centroids as pk

    calls = []
    real = pk.kmeans

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(pk, "kmeans", counting)
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([90, 57, 120], seed=13)
    src, last = _prefill(model, ids, mask, dense_layers=1)
    first = last.argmax(-1, keepdim=True)
    ids2 = torch.cat([ids, first], dim=1)
    mask2 = torch.cat([mask, torch.ones_like(first)], dim=1)
    sparse = model.config.num_hidden_layers - 1
    forks = [src.fork(policy="pariskv-kmeans", budget=b) for b in (64, 96)]
    assert len(calls) == sparse  # the second fork learned nothing
    assert all(forks[0].policy.centroids[i] is forks[1].policy.centroids[i] for i in forks[0].policy.centroids)
    src.fork(policy="pariskv-kmeans:seed=1", budget=96)
    assert len(calls) == 2 * sparse
    for fork, b in zip(forks, (64, 96), strict=True):
        fresh = kvdex.Cache(model, "pariskv-kmeans", budget=b, dense_layers=1)
        t_fresh, _ = greedy(model, ids, mask, fresh, new=12)
        t_fork, _ = greedy(model, ids2, mask2, fork, new=11)
        assert torch.equal(t_fork, t_fresh)


@pytest.mark.parametrize("policy", ["quest", "prkv", "chess", "pariskv", "icecache", "icecache:search=auto"])
def test_deepcopy_after_the_prefill_is_a_fork(policy):
    """copy.deepcopy(cache) right after the prefill (transformers' recipe for reusing a prompt's cache): the copy and
    the original, stepped in turn with the same tokens, each give the logits of a cache that was never copied, past
    page joins (a generic copy of prkv's state decoded differently from its third step, and IceCache's locks could
    not be copied)."""
    import copy

    model, _ = shared_pair("llama_gqa")
    ids = prompt(150, 5)

    def prefill():
        cache = kvdex.Cache(model, policy, budget=96, dense_layers=1)
        with torch.no_grad():
            out = model(ids, **cache_kwargs(cache))
        return cache, out.logits[:, -1:].argmax(-1)

    ref, nxt = prefill()
    steps, want = [], []
    with torch.no_grad():
        for _ in range(24):
            steps.append(nxt)
            want.append(model(nxt, **cache_kwargs(ref)).logits)
            nxt = want[-1][:, -1:].argmax(-1)
    orig, _ = prefill()
    twin = copy.deepcopy(orig)
    assert twin is not orig and twin.policy is not orig.policy and twin.step == 0
    with torch.no_grad():
        for t, w in zip(steps, want, strict=True):
            assert torch.equal(model(t, **cache_kwargs(orig)).logits, w)
            assert torch.equal(model(t, **cache_kwargs(twin)).logits, w)


def test_deepcopy_of_an_empty_or_a_decoded_cache():
    import copy

    model, _ = shared_pair("llama_gqa")
    empty = kvdex.Cache(model, "prkv", budget=96, dense_layers=1, window=48)
    twin = copy.deepcopy(empty)
    assert twin.step == -1 and twin.config == empty.config and twin.policy.name == "prkv"
    model.generate(prompt(60, 2), **cache_kwargs(empty), max_new_tokens=3, do_sample=False)
    with pytest.raises(TypeError, match=r"has decoded \(2 steps\) cannot be deep-copied: copy it right after"):
        copy.deepcopy(empty)
