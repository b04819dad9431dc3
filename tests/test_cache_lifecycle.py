"""A cache's lifecycle, for every registered policy: a new prompt on a used cache is refused (it would answer
from the old prompt), a continuation of the held tokens (a multi-turn chat) goes on, ``reset()`` makes the
cache as good as new; and a budget that leaves nothing to retrieve is refused at construction.

Tiny random model (``tests/conftest.py``), greedy ``model.generate``, batch 1 and a ragged left-padded batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, greedy, left_padded, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs

FAMILY = "llama_gqa"
BUDGET = 64  # sink 16 + window 32 + one retrieved page: selection is real at these lengths
NEW = 6
BATCHES = {"b1": [90], "ragged2": [90, 57]}


def _inputs(lengths, seed):
    if len(lengths) == 1:
        ids = prompt(lengths[0], seed)
        return ids, torch.ones_like(ids)
    ids, mask, _ = left_padded(lengths, seed)
    return ids, mask


@pytest.fixture(params=sorted(kvdex.policies()))
def policy(request):
    return request.param


@pytest.mark.parametrize("batch", list(BATCHES))
def test_a_new_prompt_on_a_used_cache_is_refused_and_reset_makes_it_new(policy, batch):
    model, _ = shared_pair(FAMILY)
    ids, mask = _inputs(BATCHES[batch], seed=3)
    other, other_mask = _inputs([n - 20 for n in BATCHES[batch]], seed=4)  # a different, shorter prompt
    cache = kvdex.Cache(model, policy, budget=BUDGET, step_graphs=False)
    greedy(model, ids, mask, cache, new=NEW)
    with pytest.raises(ValueError, match="does not continue them.*new kvdex.Cache.*reset"):
        greedy(model, other, other_mask, cache, new=NEW)
    with pytest.raises(ValueError, match="batch of 1 sequences" if batch != "b1" else "batch of 2"):
        wrong = torch.cat([ids, ids]) if batch == "b1" else ids[:1]
        greedy(model, wrong, torch.ones_like(wrong), cache, new=NEW)

    cache.reset()
    assert cache.step == -1 and all(lay.store is None and lay.seen == 0 for lay in cache.layers)
    seq, logits = greedy(model, other, other_mask, cache, new=NEW)
    ref_seq, ref_logits = greedy(model, other, other_mask, kvdex.Cache(model, policy, budget=BUDGET, step_graphs=False),
                                 new=NEW)  # fmt: skip
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert cache.stats()["context_tokens"] == [int(n) for n in other_mask.sum(1) + NEW - 1]


@pytest.mark.parametrize("batch", list(BATCHES))
def test_a_continuation_of_the_held_tokens_goes_on(policy, batch):
    """A second turn: the whole conversation (first input + generated tokens + new tokens) with its mask."""
    model, _ = shared_pair(FAMILY)
    ids, mask = _inputs(BATCHES[batch], seed=5)
    cache = kvdex.Cache(model, policy, budget=BUDGET, step_graphs=False)
    seq, _ = greedy(model, ids, mask, cache, new=NEW)
    turn = prompt(12, seed=6).expand(seq.shape[0], -1)
    conv = torch.cat([seq, turn], 1)
    conv_mask = torch.cat([mask, torch.ones(seq.shape[0], NEW + 12, dtype=mask.dtype)], 1)
    seq2, logits2 = greedy(model, conv, conv_mask, cache, new=NEW)
    assert torch.equal(seq2[:, : conv.shape[1]], conv)
    assert cache.stats()["context_tokens"] == [int(n) for n in conv_mask.sum(1) + NEW - 1]
    if policy == "full":  # dense: the same as transformers' own cache continuing the conversation
        from transformers import DynamicCache

        dyn = DynamicCache(config=model.config)
        greedy(model, ids, mask, dyn, new=NEW)
        ref_seq, ref_logits = greedy(model, conv, conv_mask, dyn, new=NEW)
        assert torch.equal(seq2, ref_seq)
        torch.testing.assert_close(logits2, ref_logits, rtol=0, atol=1e-4)


def test_a_forward_that_does_not_continue_is_refused():
    """model(...) called by hand: an attention mask that does not cover the held tokens plus the new ones."""
    model, _ = shared_pair(FAMILY)
    cache = kvdex.Cache(model, "quest", budget=BUDGET)
    ids = prompt(80, seed=1)
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), use_cache=True)
        nxt = prompt(1, seed=2)
        model(nxt, attention_mask=torch.ones(1, 81, dtype=torch.long), **cache_kwargs(cache), use_cache=True)
        with pytest.raises(ValueError, match="holds 81 tokens.*mask of 80 columns, not 81 \\+ 1"):
            model(nxt, attention_mask=torch.ones(1, 80, dtype=torch.long), **cache_kwargs(cache), use_cache=True)
        model(nxt, **cache_kwargs(cache), use_cache=True)  # no mask: new tokens only, as transformers allows


@pytest.mark.parametrize("policy", ["quest", "oracle", "pariskv", "prkv:static_ratio=0"])
def test_a_budget_that_retrieves_nothing_is_refused_with_the_smallest_that_does(policy):
    model, _ = shared_pair(FAMILY)
    token = kvdex.make_policy(policy).granularity == "token"
    smallest = SINK + WINDOW + (1 if token else PAGE)
    with pytest.raises(ValueError, match=f"budget {SINK + WINDOW} leaves 0 tokens.*budget >= {smallest}"):
        kvdex.Cache(model, policy, budget=SINK + WINDOW)
    if not token:
        with pytest.raises(ValueError, match=f"budget >= {smallest}"):
            kvdex.Cache(model, policy, budget=smallest - 1)
    kvdex.Cache(model, policy, budget=smallest)
    kvdex.Cache(model, "full", budget=SINK + WINDOW)  # full attends everything: its budget is not used


def test_streaming_and_static_tokens_take_a_budget_short_of_a_page():
    """streaming is the sink plus the recent tokens: budget == sink + window is its plain configuration.
    PRKV with S > 0 gives retrieval tokens short of a page to its static set: one token retrieves."""
    model, _ = shared_pair(FAMILY)
    kvdex.Cache(model, "streaming", budget=SINK + WINDOW)
    with pytest.raises(ValueError, match=f"budget >= {SINK + WINDOW + 1}"):
        kvdex.Cache(model, "prkv:static_ratio=0.25", budget=SINK + WINDOW)
    kvdex.Cache(model, "prkv:static_ratio=0.25", budget=SINK + WINDOW + 1)


def test_stats_name_the_selection_steps_for_every_schedule():
    model, _ = shared_pair(FAMILY)
    ids = prompt(90, seed=7)
    for spec, every in (("quest", 1), ("quest:select_every=4", 4)):
        cache = kvdex.Cache(model, spec, budget=BUDGET)
        greedy(model, ids, None, cache, new=NEW)
        steps = cache.stats()["selection_steps"]
        assert steps["select_every"] == every
        assert steps["selected"] + steps["reused"] == NEW - 1  # decode steps (the first token is the prefill's)
        assert (steps["reused"] == 0) == (every == 1)
