"""A decode loop for users: :func:`generate` (prefill, then CUDA-graph decoding with :class:`GraphDecoder`);
and :func:`timed_generate`, transformers' own greedy ``model.generate`` timed per token (``kvdex demo``)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvdex.hf.cache import Cache
from kvdex.hf.compat import cache_kwargs
from kvdex.hf.compiled_layers import _compile_mode
from kvdex.hf.graph import GraphDecoder


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """Next ids [B, 1] from logits [B, V]: temperature, then top-k, then nucleus (top-p), as
    transformers' default processors; all on the device."""
    x = logits.float() / max(temperature, 1e-5)
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False  # always keep the most likely token
        x = x.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)


@torch.no_grad()
def generate(
    model,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 64,
    cuda_graph: bool = True,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    prefill_chunk: int = 0,
    check_every: int = 16,
    compile: bool | str = False,
) -> torch.Tensor:
    """Prefill ``input_ids`` [B, L] (left padding marked by ``attention_mask``) into a fresh ``cache``
    and decode up to ``max_new_tokens``; returns ``[B, L + n]`` like ``model.generate``.

    ``cuda_graph=True``: decode steps replay CUDA graphs (:class:`GraphDecoder`), falling back to
    eager steps with a warning where the cache cannot be captured. Greedy by default; ``do_sample``
    with ``temperature`` / ``top_k`` / ``top_p``. ``eos_token_id`` (default: the model's generation
    config) ends a row; finished rows get ``pad_token_id``. The next ids never leave the device
    inside the loop; whether every row has finished is looked at every ``check_every`` steps.
    ``prefill_chunk``: prefill in forwards of that many tokens (``kvdex.hf.prefill``).
    ``generator``: a ``torch.Generator`` on the model's device, for reproducible sampling.
    ``compile``: decode steps run the model's decoder layers through ``torch.compile`` (inductor fuses
    the elementwise work; the prefill stays uncompiled), see :class:`GraphDecoder`. Compiling happens on
    the first decode step. ``cache.compile_reason`` says why it was switched off, if it was.
    """
    if not isinstance(cache, Cache):
        raise ValueError("kvdex.generate needs a kvdex.Cache")
    if cache.layers[0].store is not None:
        raise ValueError("kvdex.generate needs a fresh kvdex.Cache (this one has a prompt already)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got {tuple(input_ids.shape)}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every!r}")
    _compile_mode(compile)  # a bad value: ValueError before the prefill
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None)
    eos = None
    if eos_token_id is not None:
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
        if pad_token_id is None:
            pad_token_id = int(eos[0])
    # prefill
    kw = {}
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        pos = attention_mask.long().cumsum(-1) - 1
        kw = dict(attention_mask=attention_mask, position_ids=pos.masked_fill(attention_mask == 0, 1))
    if prefill_chunk and input_ids.shape[1] > prefill_chunk:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("prefill_chunk needs prompts without padding")
        from kvdex.hf.prefill import chunked_prefill

        logits = chunked_prefill(model, cache, input_ids, prefill_chunk)[:, -1]
    else:
        logits = model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
    dec = GraphDecoder(model, cache, enabled=cuda_graph, compile=compile)
    out = []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        nxt = _sample(logits, temperature, top_k, top_p, generator) if do_sample else logits.argmax(-1, keepdim=True)
        if eos is not None:
            nxt = torch.where(done[:, None], pad_token_id, nxt)
            done = done | torch.isin(nxt[:, 0], eos)
        out.append(nxt)
        if i + 1 == max_new_tokens or (eos is not None and (i + 1) % check_every == 0 and bool(done.all())):
            break
        logits = dec.step(nxt)
    new = torch.cat(out, dim=1) if out else input_ids.new_zeros(input_ids.shape[0], 0)
    if eos is not None and new.shape[1]:  # drop the steps after the one in which the last row finished
        is_eos = torch.isin(new, eos)
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), new.shape[1])  # each row's first eos
        new = new[:, : min(int(first.max()) + 1, new.shape[1])]
    cache.graph_counts = dict(dec.counts)
    cache.graph_reason = dec.reason
    if dec.compile_mode is not None:
        cache.compile_reason = dec.compile_reason
    return torch.cat([input_ids, new], dim=1)


class StepTimes(StoppingCriteria):
    """Stamps ``time.perf_counter()`` after every generated token (and calls ``on_token()``, e.g. a progress
    bar's update); never stops generation."""

    def __init__(self, on_token=None):
        self.stamps: list[float] = []
        self.on_token = on_token

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        if self.on_token is not None:
            self.on_token()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def median_gap_ms(self) -> float | None:
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return statistics.median(gaps) * 1e3 if gaps else None


def timed_generate(
    model, input_ids: torch.Tensor, cache: Cache | None, max_new_tokens: int, pad_token_id: int | None, on_token=None
) -> tuple[list[int], float | None]:
    """Greedy ``model.generate`` of row 0 of ``input_ids`` (no padding) into ``cache`` (``None``:
    transformers' own dense cache); returns (new token ids, median ms between consecutive tokens:
    one decode forward plus generate's per-token work, ``None`` for fewer than two tokens). ``on_token()`` is
    called after every generated token."""
    times = StepTimes(on_token)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        **cache_kwargs(cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        stopping_criteria=StoppingCriteriaList([times]),
        pad_token_id=pad_token_id,
    )
    return out[0, input_ids.shape[1] :].tolist(), times.median_gap_ms()
