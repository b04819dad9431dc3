"""kvdex.enable is idempotent, and an enabled model without a kvdex cache behaves exactly like
transformers' own attention: no cache, DynamicCache through generate, left-padded batches."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_NAMES, build_pair, greedy, left_padded, positions, prompt
from transformers import AttentionInterface, DynamicCache

import kvdex
from kvdex.hf.attention import kvdex_attention, padding_mask


@pytest.fixture(params=FAMILY_NAMES)
def fresh(request):
    return build_pair(request.param, seed=2)


def test_enable_idempotent(fresh):
    model, ref = fresh
    ids, mask, _ = left_padded([30, 19], seed=1)
    with torch.no_grad():
        once = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert kvdex.enable(model) is model
    assert kvdex.enable(kvdex.enable(model)) is model
    assert model.config._attn_implementation == "kvdex"
    assert AttentionInterface._global_mapping["kvdex"] is kvdex_attention
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionMaskInterface._global_mapping["kvdex"] is padding_mask
    with torch.no_grad():
        twice = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert torch.equal(once, twice)
    # caches made on an enabled model keep it enabled and still work
    kvdex.Cache(model, "quest", 96)
    assert model.config._attn_implementation == "kvdex"
    # enabling the reference switches it to kvdex; its outputs do not change
    with torch.no_grad():
        before = ref(ids, attention_mask=mask, position_ids=positions(mask)).logits
        kvdex.enable(ref)
        after = ref(ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert ref.config._attn_implementation == "kvdex"
    real = mask.bool()  # padding rows are undefined in sdpa; compare the real ones
    torch.testing.assert_close(after[real], before[real], atol=1e-4, rtol=0)


def test_enabled_model_without_cache_matches_sdpa(pair):
    model, ref = pair
    ids = prompt(45, 3)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        exp = ref(ids, use_cache=False).logits
    torch.testing.assert_close(got, exp, atol=1e-4, rtol=0)
    # left-padded batch, no cache: real rows match sdpa
    ids, mask, _ = left_padded([45, 23, 31], seed=4)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        exp = ref(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], exp[real], atol=1e-4, rtol=0)
    assert torch.isfinite(got).all()  # padding rows attend to themselves: no NaN


def test_enabled_model_with_dynamic_cache_generate_matches_sdpa(pair):
    model, ref = pair
    ids, mask, _ = left_padded([40, 27, 33], seed=6)
    t_ref, l_ref = greedy(ref, ids, mask, new=30)
    t_got, l_got = greedy(model, ids, mask, new=30)  # generate makes a DynamicCache
    assert torch.equal(t_got, t_ref)
    torch.testing.assert_close(l_got, l_ref, atol=1e-4, rtol=0)
    # an explicit DynamicCache, and no cache at all (use_cache=False)
    t_dyn, _ = greedy(model, ids, mask, DynamicCache(config=model.config), new=30)
    assert torch.equal(t_dyn, t_ref)
    t_nc, _ = greedy(model, ids, mask, new=30, use_cache=False)
    assert torch.equal(t_nc, t_ref)


# ---- transformers' compile_config: kvdex's on CUDA models only -------------------------------------------


def test_cpu_generate_with_a_kvdex_cache_does_not_warn_about_compile_config(llama, recwarn):
    """transformers logs "You have set `compile_config`, but we are unable to meet the criteria for compilation"
    at every generate (once per process: warning_once) of a model whose generation_config has a compile_config
    where it cannot compile, a CPU among them: kvdex.enable sets none on a CPU model."""
    import logging

    from transformers.utils import logging as hf_logging

    model, _ = llama
    assert model.device.type == "cpu" and model.generation_config.compile_config is None
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    hf_logging.warning_once.cache_clear()  # an earlier test's warning would hide this one's
    try:
        cache = kvdex.Cache(model, "quest", 96, dense_layers=1)
        model.generate(prompt(120, 3), **kvdex.cache_kwargs(cache), max_new_tokens=4, do_sample=False)
    finally:
        hf_logger.removeHandler(handler)
    assert cache.step > 0
    said = [r.getMessage() for r in records] + [str(w.message) for w in recwarn]
    assert not [m for m in said if "compile_config" in m], said


def test_enable_sets_kvdex_compile_config_on_cuda_only(monkeypatch):
    """On CUDA (the device faked here) enable gives the model kvdex's compile_config unless the user set one; on a
    CPU none, and a model moved off CUDA loses kvdex's (never the user's)."""
    from transformers import CompileConfig

    from kvdex.hf import loading
    from kvdex.hf.step_backend import Backend

    model, _ = build_pair("llama_gqa", seed=4)
    kvdex.enable(model)
    assert model.generation_config.compile_config is None
    monkeypatch.setattr(loading, "_device_type", lambda m: "cuda")
    kvdex.enable(model)
    assert model.generation_config.compile_config.backend == Backend()
    monkeypatch.setattr(loading, "_device_type", lambda m: "cpu")
    kvdex.Cache(model, "quest", 96)  # a cache enables its model again: moved to the CPU, kvdex's config goes
    assert model.generation_config.compile_config is None
    model.generation_config.compile_config = mine = CompileConfig(mode="default")
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(loading, "_device_type", lambda m, d=device: d)
        kvdex.enable(model)
        assert model.generation_config.compile_config is mine
