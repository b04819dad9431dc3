"""Tensor parallelism under vLLM, without vLLM or a second GPU: each rank runs kvdex's backend on its share of
the heads (vLLM gives rank r kv heads ``r * H / n ...`` and their query heads, and kvdex's geometry the offset of
its first kv head). A policy that selects per kv head must give each rank exactly the outputs the one-process run
gives for those heads; one that pools across heads (CHESS's ``scope=shared``) scores only its rank's heads, so
its selections may part from the one-process run's."""

from __future__ import annotations

import pytest
import torch
from vllm_sim import ATOL, run_scenario

from kvdex.vllm import SUPPORTED, settings_from

SMALL = dict(budget=96, page_size=16, sink=16, window=32, dense_layers=1)
VARIANTS = {"prkv": "prkv:static_ratio=0.5:refresh=8", "chess": "chess:interval=8"}
SPECS = [VARIANTS.get(p, p) for p in SUPPORTED]


@pytest.mark.parametrize("policy", SPECS)
def test_each_rank_gives_the_one_process_outputs_of_its_heads(policy):
    settings = settings_from({"kvdex": {"policy": policy, **SMALL}})
    whole, _ = run_scenario(settings)
    for rank in range(2):
        part, _ = run_scenario(settings, tp=(rank, 2))
        assert part.out.keys() == whole.out.keys()
        heads = part.q_heads
        for key, o in whole.out.items():
            assert torch.allclose(part.out[key], o[heads], atol=ATOL, rtol=1e-4), (policy, rank, key)


def test_a_policy_pooled_across_heads_scores_only_its_ranks_heads():
    """CHESS with one selection shared by every kv head: a rank's selection comes from its heads alone (the
    documented limit), so at least one output parts from the one-process run's."""
    settings = settings_from({"kvdex": {"policy": "chess:interval=8:scope=shared", **SMALL}})
    whole, _ = run_scenario(settings)
    part, _ = run_scenario(settings, tp=(0, 2))
    heads = part.q_heads
    assert any(not torch.allclose(part.out[k], o[heads], atol=ATOL, rtol=1e-4) for k, o in whole.out.items())


@pytest.mark.parametrize(
    "ranks, model_kv_heads, offsets",
    [(2, 2, [0, 1]), (2, 8, [0, 4]), (8, 4, [0, 0, 1, 1, 2, 2, 3, 3]), (4, 1, [0, 0, 0, 0])],
)
def test_a_ranks_first_kv_head_is_the_models_index_vllm_gives_it(ranks, model_kv_heads, offsets):
    """vLLM splits the kv heads over the ranks, or, with more ranks than kv heads, gives each rank one head,
    replicated over ``ranks // model_kv_heads`` consecutive ranks."""
    from kvdex.vllm.requests import rank_head_offset

    kv = max(1, model_kv_heads // ranks)
    assert [rank_head_offset(r, ranks, kv, model_kv_heads) for r in range(ranks)] == offsets


def test_the_geometry_holds_the_models_kv_heads():
    from types import SimpleNamespace

    from kvdex.vllm.requests import geometry_of

    mc = SimpleNamespace(get_num_attention_heads=lambda pc: 16, get_num_kv_heads=lambda pc: 4, get_head_size=lambda: 64,
                         hf_config=SimpleNamespace(num_hidden_layers=3), get_total_num_kv_heads=lambda: 4)  # fmt: skip
    g = geometry_of(SimpleNamespace(model_config=mc, parallel_config=None), SimpleNamespace(block_size=16))
    assert (g.kv_heads, g.head_offset, g.model_kv_heads, g.num_layers) == (4, 0, 4, 3)
