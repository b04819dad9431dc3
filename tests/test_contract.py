"""The contract every registered policy keeps (``kvdex.policies()``: a new policy is covered by registering it).

On a tiny random model (fp32, ``tests/conftest.py``), teacher-forced (every run feeds the same tokens):

* **full budget == dense**: with a budget covering the whole context, on the device and offloaded,
  for one prompt and a ragged left-padded batch of three, the logits of every step equal the same
  model's without a kvdex cache (sdpa), within fp32 rounding; contexts that are not a multiple of the
  page size, and prompts shorter than sink + window whose middle appears while decoding; and (offloaded,
  a longer ragged batch of two) a budget whose retrieval part (budget - sink - window) is not a
  multiple of the page size;
* **offload == device**: the two storages give the same logits;
* **stats() consistent**: decode steps, context lengths, attended tokens per step (<= budget; at full
  budget exactly the context), bytes non-negative, nothing on the host without offload;
* **fork independence**: at a budget that selects, two forks of one prefill (one offloaded) decode the
  same tokens to the same logits, and decoding them changes nothing of the original's next logits;
* **captured == eager** (``-m gpu``): CUDA-graph decoding gives the tokens of eager decoding for every
  policy that declares itself capturable.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import PAGE, SINK, WINDOW, left_padded, positions, shared_pair

import kvdex
from kvdex import cache_kwargs

FAMILY = "llama_gqa"
STEPS = 36  # teacher-forced decode steps: 23 + 36 crosses sink + window (48) and a page boundary after it
FULL = 256  # covers 70 + 36 tokens
SMALL = 64  # sink 16 + window 32 + one retrieved page: selection is real at 100 tokens
BATCHES = {"b1": [70], "ragged3": [70, 45, 23]}  # none a multiple of the page size (16)
# A budget whose retrieval part is not a page multiple (199 - 16 - 32 = 151 = 9 pages + 7) covering
# 150 + 36 tokens; the prompt of 150 has 6 middle pages at prefill (PRKV's static region ends in one).
ODD, ODD_BATCH = 199, "long-ragged2"
LENGTHS = {**BATCHES, ODD_BATCH: [150, 61]}
ATOL = 1e-4
# Constructor options a policy needs for this contract, only where unavoidable (prefer the defaults).
OPTIONS: dict[str, dict] = {}

# Options beside the defaults that change what a policy selects, held to the same contract: the page
# policies' token rerank (kvdex/policies/rerank.py)
SPECS = [
    "quest:rerank=4",
    "prkv:rerank=4",
    "chess:rerank=4",
    "arkvale:rerank=4",
    "quest:rerank=1:rerank_share=0.5",
    "prkv:rerank=1:rerank_group=weight:rerank_share=0.5",
    # select_every (kvdex/engine/reuse.py): steps between page joins attend the last selection
    "quest:select_every=4",
    "oracle:select_every=3",
    "pariskv:select_every=4",
    "pariskv:pool_every=4",  # the coarse stage held for 4 steps, the rerank every step
    "prkv:rerank=1:rerank_group=weight:rerank_share=0.5:select_every=4",
    "icecache:search=summary:select_every=4",
    # the rerank's page unit: the candidates' best pages by their keys' exact scores
    "quest:rerank=2:rerank_unit=page",
    "prkv:rerank=1:rerank_group=weight:rerank_share=0.5:rerank_unit=page:select_every=4",
]
POLICIES = kvdex.policies() + SPECS


def _cache(model, policy: str, budget: int, offload: bool) -> kvdex.Cache:
    return kvdex.Cache(model, policy, budget, offload=offload, dense_layers=1, **OPTIONS.get(policy, {}))


def _continuation(batch: int, steps: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, shared_pair(FAMILY)[0].config.vocab_size, (batch, steps), generator=g)


@torch.no_grad()
def _prefill(model, cache, ids, mask) -> torch.Tensor:
    out = model(ids, attention_mask=mask, position_ids=positions(mask), **cache_kwargs(cache))
    return out.logits[:, -1]


@torch.no_grad()
def _decode(model, cache, mask, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``tokens`` [B, T] one step at a time after a prefill with ``mask``: (logits [T, B, V], final mask)."""
    last = positions(mask)[:, -1:]
    logits = []
    for t in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(tokens[:, t : t + 1], attention_mask=mask, position_ids=last + t + 1, **cache_kwargs(cache))
        logits.append(out.logits[:, -1])
    return torch.stack(logits), mask


@functools.cache
def _inputs(batch: str):
    ids, mask, _ = left_padded(LENGTHS[batch], seed=21)
    return ids, mask, _continuation(len(LENGTHS[batch]), STEPS, seed=22)


@functools.cache
def _dense(batch: str) -> torch.Tensor:
    """The reference (sdpa, no kvdex cache): logits after the prompt and after each fed token, [1 + T, B, V]."""
    _, ref = shared_pair(FAMILY)
    ids, mask, cont = _inputs(batch)
    full_ids = torch.cat([ids, cont], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(cont)], dim=1)
    with torch.no_grad():
        logits = ref(full_ids, attention_mask=full_mask, position_ids=positions(full_mask)).logits
    w = ids.shape[1]
    return logits[:, w - 1 : w + STEPS].transpose(0, 1)


@functools.cache
def _run(policy: str, offload: bool, batch: str, budget: int):
    """(logits [1 + T, B, V], stats) of a teacher-forced kvdex run."""
    model, _ = shared_pair(FAMILY)
    ids, mask, cont = _inputs(batch)
    cache = _cache(model, policy, budget, offload)
    first = _prefill(model, cache, ids, mask)
    logits, _ = _decode(model, cache, mask, cont)
    return torch.cat([first[None], logits]), cache.stats()


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", POLICIES)
def test_full_budget_equals_dense(policy, offload, batch):
    _check_full_budget(policy, offload, batch, FULL)


@pytest.mark.parametrize("policy", POLICIES)
def test_full_budget_not_a_page_multiple_equals_dense(policy):
    assert (ODD - SINK - WINDOW) % PAGE and ODD >= max(LENGTHS[ODD_BATCH]) + STEPS
    _check_full_budget(policy, True, ODD_BATCH, ODD)


def _check_full_budget(policy: str, offload: bool, batch: str, budget: int) -> None:
    logits, stats = _run(policy, offload, batch, budget)
    ref = _dense(batch)
    assert logits.shape == ref.shape
    diff = (logits - ref).abs().max().item()
    where = f"{policy}/{'offload' if offload else 'device'}/{batch}/budget {budget}"
    assert diff <= ATOL, f"{where}: max |logit - dense| = {diff:.3g}"

    # stats(): every step counted, every token attended (a full budget drops nothing), sizes sane
    lengths = LENGTHS[batch]
    assert stats["decode_steps"] == STEPS
    assert stats["context_tokens"] == [n + STEPS for n in lengths]
    assert stats["policy"] == policy.split(":")[0] and stats["offload"] == offload
    # step t (1..T) attends n + t tokens per kv head of each sequence: the mean over steps and sequences
    expected = sum(lengths) / len(lengths) + (STEPS + 1) / 2
    assert stats["attended_tokens_per_step"] == pytest.approx(expected), policy
    for key in ("kv_bytes_device", "kv_bytes_host", "bytes_host_to_device", "bytes_device_to_host"):
        assert stats[key] >= 0, key
    assert stats["kv_bytes_device"] > 0
    if not offload:
        assert stats["kv_bytes_host"] == 0 and stats["bytes_host_to_device"] == 0


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("policy", POLICIES)
def test_offload_equals_device_at_full_budget(policy, batch):
    dev, _ = _run(policy, False, batch, FULL)
    off, stats = _run(policy, True, batch, FULL)
    torch.testing.assert_close(off, dev, atol=ATOL, rtol=0)
    if min(BATCHES[batch]) + STEPS > 48 + 16:  # a middle page went to host memory
        assert stats["kv_bytes_host"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_fork_independence_and_offload_at_small_budget(policy):
    """Two forks of one prefill (device, offloaded) decode the same tokens to the same logits; the
    original then decodes exactly like a fresh cache that never forked; attended <= budget."""
    model, _ = shared_pair(FAMILY)
    ids, mask, _ = left_padded([100, 61, 23], seed=31)
    x, y = _continuation(3, 10, seed=32), _continuation(3, 10, seed=33)
    orig = _cache(model, policy, SMALL, offload=False)
    first = _prefill(model, orig, ids, mask)
    f_off = orig.fork(offload=True)
    f_dev = orig.fork()
    l_off, _ = _decode(model, f_off, mask, x)
    l_dev, _ = _decode(model, f_dev, mask, x)
    torch.testing.assert_close(l_off, l_dev, atol=ATOL, rtol=0, msg=f"{policy}: offloaded fork != device fork")
    l_orig, _ = _decode(model, orig, mask, y)
    fresh = _cache(model, policy, SMALL, offload=False)
    assert torch.equal(_prefill(model, fresh, ids, mask), first)
    l_fresh, _ = _decode(model, fresh, mask, y)
    assert torch.equal(l_orig, l_fresh), f"{policy}: decoding the forks changed the original"
    # the budget selects (these logits are not the dense ones) and is respected
    for c in (orig, f_off, f_dev):
        s = c.stats()
        assert s["decode_steps"] == 10
        if c.policy.uses_budget:
            assert s["attended_tokens_per_step"] <= SMALL
    if orig.policy.uses_budget:
        _, ref = shared_pair(FAMILY)
        full_ids, full_mask = torch.cat([ids, y], 1), torch.cat([mask, torch.ones_like(y)], 1)
        with torch.no_grad():
            dense = ref(full_ids, attention_mask=full_mask, position_ids=positions(full_mask)).logits
        assert not torch.allclose(l_orig[-1], dense[:, -1], atol=ATOL), f"{policy}: a small budget gave dense logits"


# ---- GPU: captured == eager --------------------------------------------------------------------------


def _capturable() -> list[str]:
    from kvdex.hf.graph import graph_policies

    return [p for p in POLICIES if p.split(":")[0] in graph_policies()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("policy", POLICIES)
def test_captured_equals_eager_on_gpu(policy, offload):
    if policy not in _capturable():
        pytest.skip(f"{policy} does not declare CUDA-graph support")
    model, _ = shared_pair(FAMILY)
    model = model.cuda()
    try:
        ids, mask, _ = left_padded([100, 61, 23], seed=41)
        ids, mask = ids.cuda(), mask.cuda()
        out = {}
        for graph in (False, True):
            cache = _cache(model, policy, SMALL, offload)
            out[graph] = kvdex.generate(model, cache, ids, mask, max_new_tokens=40, cuda_graph=graph)
            if graph and cache.graph_counts["replays"] == 0:
                pytest.skip(f"{policy}/{offload}: no step was captured ({cache.graph_reason})")
        assert torch.equal(out[True], out[False]), f"{policy}: captured decoding differs from eager"
    finally:
        model.cpu()
