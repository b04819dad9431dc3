"""Every user mistake raises a clear error (or warns) with the fix in its message."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import build_pair, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.config import CacheConfig
from kvdex.policies import base as policy_base


def test_policies_lists_builtins():
    assert {"full", "oracle", "streaming", "quest"} <= set(kvdex.policies())
    assert kvdex.policies() == sorted(kvdex.policies())


def test_unknown_policy_lists_valid_ones(llama):
    model, _ = llama
    with pytest.raises(ValueError, match="unknown policy 'nope'") as err:
        kvdex.Cache(model, "nope")
    for name in kvdex.policies():
        assert name in str(err.value)
    with pytest.raises(ValueError, match="unknown policy"):
        kvdex.make_policy("Quest")


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            dict(budget=40, sink=16, window=32),
            r"budget \(40\) is smaller than sink \+ window \(16 \+ 32\).*budget >= 48",
        ),
        (dict(budget=8, page_size=16, sink=0, window=16), r"budget \(8\) is smaller than one page \(16 tokens\)"),
        (dict(page_size=12), r"page_size must be a power of two.*got 12.*page_size=16"),
        (dict(page_size=0), r"page_size must be a power of two"),
        (dict(window=40), r"window must be a positive multiple of page_size \(16\), got 40.*window=48"),
        (dict(window=0), r"window must be a positive multiple of page_size"),
        (dict(sink=-1), r"sink and dense_layers must be >= 0"),
    ],
)
def test_config_errors(llama, kwargs, pattern):
    model, _ = llama
    with pytest.raises(ValueError, match=pattern):
        CacheConfig(**kwargs)
    budget = kwargs.pop("budget", 256)
    with pytest.raises(ValueError, match=pattern):
        kvdex.Cache(model, "quest", budget, **kwargs)


def test_config_type_errors():
    with pytest.raises(TypeError, match="budget must be an int"):
        CacheConfig(budget=96.0)
    with pytest.raises(TypeError, match="page_size must be an int"):
        CacheConfig(page_size=True)


def test_valid_config_boundaries_accepted():
    c = CacheConfig(budget=48, sink=16, window=32)  # budget == sink + window
    assert c.retrieval_tokens == 0 and c.retrieval_pages == 0
    c = CacheConfig(budget=16, page_size=16, sink=0, window=16)  # budget == one page
    assert c.window_pages == 1
    assert CacheConfig(budget=100).retrieval_pages == (100 - 48) // 16


def test_unknown_policy_option_lists_options(llama, monkeypatch):
    model, _ = llama
    with pytest.raises(TypeError, match=r"policy 'quest' has no option\(s\) foo.*its options are: \(none\)"):
        kvdex.Cache(model, "quest", 96, foo=1)

    # a policy with options lists them
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))

    @kvdex.register_policy
    @dataclasses.dataclass
    class WithOptions(kvdex.Policy):
        name = "test_with_options"
        alpha: float = 0.5
        beta: int = 2

        def select(self, layer, q, store, scale):
            return kvdex.Selection(everything=True)

    with pytest.raises(TypeError, match=re.escape("no option(s) bogus, gamma; its options are: alpha, beta")):
        kvdex.make_policy("test_with_options", gamma=1, bogus=2)
    p = kvdex.make_policy("test_with_options", beta=7)
    assert p.options() == {"alpha": 0.5, "beta": 7}


def test_sliding_window_model_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4096,
    )
    model = MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"sliding-window attention.*sliding_window=4096.*sliding_window = None"):
        kvdex.enable(model)
    with pytest.raises(ValueError, match="sliding-window"):
        kvdex.Cache(model, "quest", 96)


def test_qwen2_with_sliding_window_enabled_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
    )
    with pytest.raises(ValueError, match="sliding-window"):
        kvdex.enable(Qwen2ForCausalLM(cfg).eval())


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_right_padded_mask_refused(llama, offload):
    model, _ = llama
    ids = prompt(20, 0).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding
    cache = kvdex.Cache(model, "quest", 96, offload=offload)
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=3, do_sample=False)


def test_cache_of_another_enabled_model_refused(llama):
    model, _ = llama
    other, _ = build_pair("llama_gqa", seed=5)
    cache = kvdex.Cache(model, "quest", 96)
    with pytest.raises(ValueError, match=r"made for another model.*create a new kvdex.Cache"):
        other.generate(prompt(20, 0), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)


def test_cache_used_with_a_model_without_kvdex_attention_refused(llama):
    """The cache's model twin with transformers' sdpa attention: kvdex's attention never runs, so
    the cache never stores a token; it must refuse instead of decoding with an empty cache."""
    model, ref = llama
    cache = kvdex.Cache(model, "quest", 96)
    with pytest.raises(ValueError):
        ref.generate(prompt(60, 0), **cache_kwargs(cache), max_new_tokens=5, do_sample=False)


def test_prompt_longer_than_max_positions_warns():
    model, _ = build_pair("llama_gqa", max_position_embeddings=64)
    cache = kvdex.Cache(model, "quest", 96)
    with pytest.warns(UserWarning, match=r"\(70 tokens\) is longer than the model's max_position_embeddings \(64\)"):
        model.generate(prompt(70, 0), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)


def test_no_warning_within_max_positions(recwarn):
    model, _ = shared_pair("llama_gqa")
    cache = kvdex.Cache(model, "quest", 96)
    model.generate(prompt(70, 0), **cache_kwargs(cache), max_new_tokens=3, do_sample=False)
    assert not [w for w in recwarn if "max_position_embeddings" in str(w.message)]


@pytest.mark.parametrize(
    "call,pattern",
    [
        (lambda c: c.reorder_cache(torch.tensor([0])), "beam search"),
        (lambda c: c.crop(3), "cropped"),
        (lambda c: c.batch_repeat_interleave(2), "num_return_sequences"),
        (lambda c: c.batch_select_indices(torch.tensor([0])), "selecting batch rows"),
    ],
)
def test_unsupported_cache_operations(llama, call, pattern):
    model, _ = llama
    with pytest.raises(NotImplementedError, match=pattern):
        call(kvdex.Cache(model, "quest", 96))
