"""The ``kvdex`` lm-evaluation-harness model on SmolLM2 with a tiny local generate-until task.

The task (tests/data/lmeval/kvdex_passkey.yaml) finds a pass key in 130-200 tokens of filler; its
data is a jsonl file beside it, so nothing is downloaded. One model load serves every run.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason='lm-eval is not installed: pip install "kvdex[lmeval]"')

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import kvdex.lmeval  # noqa: E402  (registers the "kvdex" model)
from kvdex import models  # noqa: E402
from kvdex.hf.lmeval import KVDexLM, split_model_args, validate  # noqa: E402

TASKS = Path(__file__).parent / "data" / "lmeval"
TASK = "kvdex_passkey"
LIMIT = 4
BATCH = 2


def evaluate(lm, task_manager, limit=LIMIT):
    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager, log_samples=True, limit=limit)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out, [s["resps"][0][0] for s in samples]


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def runs(task_manager):
    """lm-eval runs of one SmolLM2 load: kvdex ``full``, plain ``hf`` (sdpa), kvdex ``quest`` at budget 64.
    ``full`` and ``plain`` decode one batch (the first two prompts, 530 and 710 characters: left-padded);
    ``quest`` decodes LIMIT prompts, several batches (its usage counts add up over generate calls)."""
    try:
        models.default_model()
    except ValueError as exc:
        pytest.skip(f"SmolLM2 is not available: {exc}")
    # the string path: kvdex's alias -> its converted folder (else the GGUF file), loaded by HFLM
    full = KVDexLM(pretrained="smollm2", policy="full", batch_size=BATCH, device="cpu", dtype="float32")
    plain_model = copy.deepcopy(full.model)
    plain_model.set_attn_implementation("sdpa")
    plain = HFLM(pretrained=plain_model, tokenizer=full.tokenizer, batch_size=BATCH)
    quest = KVDexLM(pretrained=full.model, tokenizer=full.tokenizer, policy="quest", budget=64, batch_size=BATCH)
    return {
        "full": (full, *evaluate(full, task_manager, limit=BATCH)),
        "plain": (plain, *evaluate(plain, task_manager, limit=BATCH)),
        "quest": (quest, *evaluate(quest, task_manager)),
    }


def test_results_and_cache_used(runs):
    lm, out, gens = runs["quest"]
    assert len(gens) == LIMIT and all(isinstance(g, str) for g in gens)
    assert "exact_match,digits" in out["results"][TASK]
    info = out["config"]["kvdex"]
    assert info["policy"] == "quest" and info["budget"] == 64
    usage = info["usage"]
    assert usage["generate_calls"] == LIMIT // BATCH  # one cache per generate call, for the whole batch
    assert usage["sequences"] == LIMIT
    assert usage["decode_steps"] >= usage["generate_calls"]
    # sparse: at most the budget per step, well below the context
    assert 0 < usage["attended_tokens_per_step"] <= 64 < usage["context_tokens_max"]
    # the batch was left-padded: prompts of different lengths shared one cache
    lengths = lm.last_cache_stats["context_tokens"]
    assert len(lengths) == BATCH and len(set(lengths)) == BATCH


def test_full_policy_matches_plain_hf(runs):
    _, _, plain = runs["plain"]
    lm, out, full = runs["full"]
    assert full == plain
    assert out["config"]["kvdex"]["usage"]["decode_steps"] > 0
    assert len(set(lm.last_cache_stats["context_tokens"])) == BATCH  # one left-padded batch of two lengths
    assert out["results"][TASK]["exact_match,digits"] == runs["plain"][1]["results"][TASK]["exact_match,digits"]


def test_loglikelihood_is_dense(runs):
    """Loglikelihood requests take HFLM's one dense forward pass (no kvdex cache): same scores as hf."""
    reqs = [
        Instance("loglikelihood", {}, ("The sky is", " blue"), 0),
        Instance("loglikelihood", {}, ("There and back", " again. Here we go."), 1),
    ]
    plain = runs["plain"][0].loglikelihood(reqs, disable_tqdm=True)
    quest = runs["quest"][0].loglikelihood(reqs, disable_tqdm=True)
    for (a, greedy_a), (b, greedy_b) in zip(plain, quest, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


@pytest.mark.parametrize(
    "args, message",
    [
        ({"policy": "nope"}, "unknown kvdex policy 'nope'"),
        ({"policy": "quest:nope=1"}, "no option"),
        ({"policy": "quest", "budget": 32}, "budget (32) is smaller than sink + window"),
        ({"policy": "quest", "page_size": 12}, "power of two"),
        ({"policy": "quest", "bugdet": 64}, "did you mean 'budget'"),
        ({"policy": "quest", "preset": "moderate"}, "not an option of policy 'quest'"),
        ({"policy": "chess:preset=nope"}, "preset"),
        ({"policy": "quest", "attn_implementation": "sdpa"}, "attention implementation"),
    ],
)
def test_bad_model_args(args, message):
    with pytest.raises(ValueError) as err:
        KVDexLM(pretrained="smollm2", **args)  # checked before any model is loaded
    assert message in str(err.value)


def test_registered_and_string_args(task_manager):
    assert get_model("kvdex") is KVDexLM and get_model("hf") is HFLM  # lm-eval's own models still resolve
    with pytest.raises(ValueError, match="did you mean 'budget'"):
        lm_eval.simple_evaluate(
            model="kvdex",
            model_args="pretrained=smollm2,policy=quest,bugdet=64",
            tasks=[TASK],
            task_manager=task_manager,
        )


def test_policy_options_from_model_args():
    args = {"interval": 64, "window": 32, "dtype": "auto"}
    name, options, cache, hf = split_model_args("chess:preset=moderate", args)
    assert (name, options) == ("chess", {"preset": "moderate", "interval": 64})
    assert (cache, hf) == ({"window": 32}, {"dtype": "auto"})
    # an extra key=value overrides the option in the policy string
    assert split_model_args("chess:preset=moderate", {"preset": "aggressive"})[1] == {"preset": "aggressive"}
    # text options are typed by the policy's fields, in the policy string or as separate arguments
    name, options, cache, _ = split_model_args("icecache:reuse=false", {"reuse_every": "4"})
    typed = validate(name, options, 256, cache)
    assert typed["reuse"] is False and typed["reuse_every"] == 4


def test_command_line_finds_the_model(monkeypatch):
    """``python -m kvdex.lmeval ARGS`` runs lm-eval's own CLI with ``--model kvdex`` known (in process here;
    a bad model arg fails before any model is loaded)."""
    argv = ["--model", "kvdex", "--model_args", "pretrained=smollm2,policy=nope", "--tasks", TASK]
    argv += ["--include_path", str(TASKS)]
    monkeypatch.setattr(sys, "argv", ["kvdex.lmeval"])
    with pytest.raises(ValueError, match="unknown kvdex policy 'nope'"):
        kvdex.lmeval.main(argv)
    assert sys.argv == ["kvdex.lmeval"]  # main() restores the command line it replaced
