"""kvdex inside vLLM on a GPU (``-m gpu``; skipped without vLLM, without CUDA, or without ``KVDEX_VLLM_MODEL``, a
model directory vLLM loads, e.g. Qwen2.5-Coder-0.5B-Instruct).

Each engine in a process of its own, through :func:`kvdex.vllm.check.run_check` (what ``kvdex vllm
check`` runs): three prompts of different lengths served together with chunked prefill, greedy decoding

* with a budget covering every prompt and its new tokens, each of full, quest, prkv, chess and pariskv gives the
  tokens of vLLM's default backend, up to a near-tie as vLLM's own backend tests allow (``close``: the first
  differing tokens each among the other engine's top log-probabilities), eager and under vLLM's default
  CUDA-graph mode (also with kvdex's decode graphs and vLLM's FlashAttention for prompt chunks);
* at budget 256 the sparse policies decode every requested token.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from kvdex.vllm.check import add_arguments, run_check, verdict  # noqa: E402

MODEL = os.environ.get("KVDEX_VLLM_MODEL", "")
POLICIES = ["full", "quest", "prkv", "chess", "pariskv"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not MODEL, reason="set KVDEX_VLLM_MODEL to a model directory vLLM loads"),
]


def check_args(**options) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", MODEL])
    vars(args).update(options)
    return args


def test_covering_budget_gives_the_default_backends_tokens():
    report = run_check(MODEL, POLICIES, check_args(prompt_tokens=1536, max_tokens=32))
    assert report["covering"]
    for p in POLICIES:
        assert report[p]["close"], f"{p}: {verdict(report[p])}"


def test_covering_budget_under_cuda_graphs():
    """vLLM's default mode: the model's pieces replay CUDA graphs, kvdex's attention runs between them."""
    report = run_check(MODEL, ["quest", "prkv"], check_args(prompt_tokens=1024, max_tokens=24, cuda_graphs=True))
    for p in ("quest", "prkv"):
        assert report[p]["close"], f"{p}: {verdict(report[p])}"


def test_covering_budget_with_decode_graphs_and_flash_prefill():
    """vLLM's CUDA-graph mode with kvdex's own per-request decode graphs (the dense layers' decode on the blocks
    through vLLM's FlashAttention inside them) and vLLM's FlashAttention for prompt chunks: vLLM's tokens."""
    policies = ["full", "prkv", "chess"]
    args = check_args(prompt_tokens=1024, max_tokens=24, cuda_graphs=True, decode_graphs=True,
                      settings='{"prefill_attention": "flash"}')  # fmt: skip
    report = run_check(MODEL, policies, args)
    assert report["decode_graphs"] and report["settings"] == {"prefill_attention": "flash"}
    for p in policies:
        assert report[p]["close"], f"{p}: {verdict(report[p])}"


def test_sparse_budget_decodes_every_token():
    report = run_check(MODEL, POLICIES[1:], check_args(prompt_tokens=2048, max_tokens=32, budget=256))
    for p in POLICIES[1:]:
        assert [len(t) for t in report[p]["tokens"]] == [32, 32, 32], p
