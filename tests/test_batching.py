"""A ragged left-padded batch decodes each sequence exactly as if it were alone.

At budget 96 (sink 16 + window 32 + 48 retrieved) and contexts up to 170 tokens the selection is
real, so this checks that padding never leaks into storage, indexing or selection.
"""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, left_padded, shared_pair

import kvdex

NEW = 50
LENGTHS = [90, 60, 120]


def _run(family, policy, offload):
    model, _ = shared_pair(family)
    ids, mask, prompts = left_padded(LENGTHS, seed=10)
    cache = kvdex.Cache(model, policy, budget=96, offload=offload, dense_layers=1)
    tokens, logits = greedy(model, ids, mask, cache, new=NEW)
    width = ids.shape[1]
    avg_context = sum(n + NEW / 2 for n in LENGTHS) / len(LENGTHS)
    attended = cache.stats()["attended_tokens_per_step"]
    assert attended <= 96 and attended < avg_context - 10, "selection must really drop tokens here"
    for i, p in enumerate(prompts):
        alone = kvdex.Cache(model, policy, budget=96, offload=offload, dense_layers=1)
        t1, l1 = greedy(model, p[None], None, alone, new=NEW)
        assert torch.equal(tokens[i, width:], t1[0, len(p) :]), f"sequence {i} (len {len(p)}) differs in the batch"
        torch.testing.assert_close(logits[:, i], l1[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", ["quest", "oracle", "streaming"])
def test_batch_equals_alone_llama(policy, offload):
    _run("llama_gqa", policy, offload)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_batch_equals_alone_qwen2_quest(offload):
    _run("qwen2", "quest", offload)
