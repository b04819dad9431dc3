"""How a task decodes from a forked cache: :class:`DecodeContext` (one step, eagerly or through the
fork's CUDA-graph decoder) and the loops tasks use (:func:`greedy`, :func:`teacher_forced`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdex.hf.compat import cache_kwargs


@dataclass
class DecodeContext:
    """What a task's ``decode`` gets: the model, a fresh forked cache, and the prefill's last logits."""

    model: Any
    tokenizer: Any
    cache: Any
    first_logits: torch.Tensor  # [vocab] fp32, the dense prefill's prediction of the first new token
    prompt_len: int
    progress: bool = False
    decode: str = "eager"  # "eager" or "graph" (resolved: see resolve_decode)
    _decoder: Any = field(default=None, repr=False)  # the fork's GraphDecoder, made at the first step
    _eager_why: str | None = field(default=None, repr=False)  # why steps run eagerly although graph was asked
    # steps of closed decoders and of forward_token, capture seconds; why a decoder ran no graphs
    _counts: dict = field(default_factory=lambda: {"eager": 0, "captures": 0, "replays": 0}, repr=False)
    _capture_s: float = field(default=0.0, repr=False)
    _graph_why: str | None = field(default=None, repr=False)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token through the fork; returns the next-token logits [vocab] (fp32, a fresh tensor).

        ``decode == "graph"``: through the fork's :class:`~kvdex.hf.graph.GraphDecoder` (which
        replays CUDA graphs where it can and runs the other steps eagerly, e.g. page boundaries, or all
        of them where the policy / store cannot be captured or there is no CUDA device). While an
        observer is attached to the cache, or after :meth:`force_eager`, steps run eagerly here.
        """
        if self.decode != "graph" or self._eager_why is not None or self.cache.observer is not None:
            if self.decode == "graph" and self._eager_why is None:
                self._eager_why = "an observer is attached to the cache"
            self._counts["eager"] += 1
            return forward_token(self.model, self.cache, token)
        if self._decoder is None:
            from kvdex.hf.graph import GraphDecoder

            self._decoder = GraphDecoder(self.model, self.cache, 1, warn=False)
        dec = self._decoder
        captures = dec.counts["captures"]
        t0 = time.perf_counter()
        ids = torch.tensor([[token]], device=self.model.device)
        logits = dec.step(ids)[0].to(torch.float32, copy=True)  # a replay rewrites its output buffer
        if dec.counts["captures"] != captures:
            torch.cuda.synchronize(dec.device)
            self._capture_s += time.perf_counter() - t0
        return logits

    def force_eager(self, why: str) -> None:
        """Run every later step eagerly (e.g. a per-step hook that looks at the cache between steps)."""
        if self.decode == "graph" and self._eager_why is None:
            self._eager_why = why

    def close(self) -> dict:
        """Drop the fork's graph decoder (its graphs and memory pool); returns how the decode ran, for
        the prediction record: ``decode`` ("graph" where at least one step replayed a CUDA graph, else
        "eager"), and where graphs were asked for, ``decode_steps`` (eager steps, captures, replays,
        capture seconds) and ``decode_reason`` (why steps ran eagerly; None where nothing stopped
        replay)."""
        if self.decode != "graph":
            return {"decode": "eager"}
        dec, self._decoder = self._decoder, None
        if dec is not None:
            for k in self._counts:
                self._counts[k] += dec.counts[k]
            self._graph_why = self._graph_why or dec.reason
            dec.graph = dec.logits = None  # the graphs and their pool go now, whoever still holds dec
        counts = dict(self._counts)
        why = self._eager_why or self._graph_why
        if why is None and counts["replays"] == 0:
            why = f"too few steps to capture ({counts['eager']} eager)"
        counts["capture_s"] = round(self._capture_s, 4)
        return {
            "decode": "graph" if counts["replays"] else "eager",
            "decode_steps": counts,
            "decode_reason": why,
        }


def forward_token(model, cache, token: int) -> torch.Tensor:
    """Feed one token through the cache; returns the next-token logits [vocab] (fp32)."""
    ids = torch.tensor([[token]], device=model.device)
    return model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[0, -1].float()


def greedy(ctx: DecodeContext, max_new_tokens: int, stop_ids=(), before_step=None) -> list[int]:
    """Greedy decoding; the first token comes from the prefill logits. Stops after a stop id.

    ``before_step(i)`` is called before decode step ``i`` (1-based; step i feeds token ``i - 1``).
    """
    out = [int(ctx.first_logits.argmax())]
    stop = set(stop_ids)
    if before_step is not None:
        ctx.force_eager("a before_step hook runs between steps")
    while len(out) < max_new_tokens and out[-1] not in stop:
        if before_step is not None:
            before_step(len(out))
        out.append(int(ctx.step(out[-1]).argmax()))
    return out


def teacher_forced(ctx: DecodeContext, tokens: list[int], before_step=None) -> list[float]:
    """Feed ``tokens[:-1]`` one at a time; returns the NLL (nats) of each of ``tokens[1:]``.

    ``tokens[0]`` is the text's true next token after the prompt (predicted by the dense prefill,
    so it is not scored: every scored token is predicted by a decode step through the policy).
    """
    nll = []
    if before_step is not None:
        ctx.force_eager("a before_step hook runs between steps")
    for i in range(len(tokens) - 1):
        if before_step is not None:
            before_step(i + 1)
        logits = ctx.step(tokens[i])
        nll.append(float(torch.log_softmax(logits, -1)[tokens[i + 1]].neg()))
    return nll


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """EOS ids of the tokenizer and of the model's generation config."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids
