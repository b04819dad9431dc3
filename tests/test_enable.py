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
