"""How ``kvdex demo`` decodes: one prefill forked per policy (or a fresh prefill each), greedy decoding with
``model.generate``, a progress bar per policy, and transformers' own dense cache as the speed reference.

:func:`run` returns one :class:`Row` per policy: the completion, whether it holds the key, the cache's stats,
the decode's ms/token (CUDA), its peak device memory (CUDA) and the row's wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import kvdex
from kvdex.eval import passkey
from kvdex.hf.compat import cache_kwargs
from kvdex.hf.generate import timed_generate


@dataclass
class Row:
    policy: str
    completion: str
    correct: bool
    stats: dict
    ms_per_token: float | None
    tokens: list[int] = field(default_factory=list)
    peak_bytes: int | None = None  # peak device memory during the decode (CUDA only)
    seconds: float | None = None  # wall time of the row: the fork (or prefill) and the decode


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache: kvdex.Cache) -> torch.Tensor:
    """Run the prompt through ``model`` into ``cache``; returns the greedy first token [B, 1]."""
    mask = torch.ones_like(input_ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].argmax(-1, keepdim=True)


def _generate(model, input_ids, cache, max_new_tokens: int, pad_token_id, bar=None) -> tuple[list[int], float | None]:
    """:func:`kvdex.hf.generate.timed_generate` that also ticks ``bar`` (a tqdm bar) per token."""
    return timed_generate(model, input_ids, cache, max_new_tokens, pad_token_id, None if bar is None else bar.update)


def decode_forked(
    model,
    tokenizer,
    input_ids,
    first,
    base: kvdex.Cache,
    policy: str,
    budget: int,
    max_new_tokens: int,
    *,
    bar=None,
    **overrides,
) -> tuple[list[int], float | None, kvdex.Cache]:
    """Decode from a fork of the prefilled ``base`` cache; the first token came from the prefill.
    ``bar``: a tqdm bar of ``max_new_tokens`` ticked per token (the prefill's first one included)."""
    cache = base.fork(policy=policy, budget=budget, **overrides)
    if bar is not None:
        bar.set_postfix_str("decoding")
        bar.update(1)  # the first token, from the prefill
    if max_new_tokens <= 1 or first.item() == tokenizer.eos_token_id:
        return first[0].tolist(), None, cache
    ids = torch.cat([input_ids, first], 1)
    new, ms = _generate(model, ids, cache, max_new_tokens - 1, tokenizer.pad_token_id, bar)
    return first[0].tolist() + new, ms, cache


def decode_fresh(
    model, tokenizer, input_ids, policy: str, budget: int, max_new_tokens: int, *, bar=None, **cache_args
) -> tuple[list[int], float | None, kvdex.Cache]:
    """Prefill and decode with a new cache (the path ``fork`` saves)."""
    cache = kvdex.Cache(model, policy=policy, budget=budget, **cache_args)
    if bar is not None:
        bar.set_postfix_str("prefill and decoding")
    new, ms = _generate(model, input_ids, cache, max_new_tokens, tokenizer.pad_token_id, bar)
    return new, ms, cache


def _bar(name: str, total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"{name:>10}", unit="tok", leave=False, dynamic_ncols=True)
    bar.set_postfix_str("forking the prefill")
    return bar


def run(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    answer: str,
    policies,
    budget: int,
    max_new_tokens: int,
    fork: bool = True,
    progress: bool = False,
    **cache_args,
) -> tuple[list[Row], float | None]:
    """Decode ``input_ids`` [1, L] with every policy. Returns the rows and the prefill time (ms, fork only).
    ``progress``: a tqdm bar per policy (stderr), ticked per generated token."""
    rows, prefill_ms = [], None
    if fork:
        # The prefill is dense whatever the policy; the base stays on the device, forks may offload.
        storage = {"offload": cache_args.get("offload", False), "page_cache": cache_args.get("page_cache", 0)}
        base = kvdex.Cache(model, policy="full", budget=budget, **{**cache_args, "offload": False, "page_cache": 0})
        t0 = time.perf_counter()
        first = prefill(model, input_ids, base)
        prefill_ms = (time.perf_counter() - t0) * 1e3
    cuda = input_ids.device.type == "cuda"
    for name in policies:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        bar = _bar(name, max_new_tokens, progress)
        t0 = time.perf_counter()
        try:
            if fork:
                ids, ms, cache = decode_forked(
                    model, tokenizer, input_ids, first, base, name, budget, max_new_tokens, bar=bar, **storage
                )
            else:
                ids, ms, cache = decode_fresh(
                    model, tokenizer, input_ids, name, budget, max_new_tokens, bar=bar, **cache_args
                )
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - t0
        text = tokenizer.decode(ids, skip_special_tokens=True)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        rows.append(Row(name, text, passkey.score(answer, text), cache.stats(), ms, ids, peak, seconds))
        del cache
    return rows, prefill_ms


def dense_baseline(model, tokenizer, input_ids, answer: str, max_new_tokens: int) -> Row:
    """The same greedy decode with transformers' own dense cache (no kvdex cache): the speed reference."""
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    new, ms = timed_generate(model, input_ids, None, max_new_tokens, tokenizer.pad_token_id)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if input_ids.device.type == "cuda" else None
    text = tokenizer.decode(new, skip_special_tokens=True)
    stats = {"attended_tokens_per_step": float(input_ids.shape[1]), "kv_bytes_device": None, "kv_bytes_host": 0}
    return Row("transformers (dense)", text, passkey.score(answer, text), stats, ms, new, peak, seconds)
