"""What a ``kvdex.Cache`` refuses before it decodes: an input that does not continue the tokens it holds
(:func:`check_continues`), a budget that leaves nothing to retrieve (:func:`check_retrieves`)."""

from __future__ import annotations

from typing import Any

import torch

from kvdex.config import CacheConfig


def check_continues(
    cache: Any,
    input_ids: torch.Tensor | None,
    width: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> None:
    """ValueError unless the input continues the tokens the cache ``cache`` holds (:meth:`kvdex.Cache.check_input`)."""
    held = cache.layers[0].seen
    store = cache.layers[0].store
    if held == 0 or store is None:
        return
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):  # prepared masks: positions
        attention_mask = None
    batch = store.batch
    ref = input_ids if input_ids is not None else attention_mask
    if ref is not None and ref.shape[0] != batch:
        raise ValueError(_reuse_message(held, f"a batch of {ref.shape[0]} sequences where it holds {batch}"))
    if attention_mask is not None and attention_mask.shape[1] != held + width:
        got = f"{width} new token(s) with an attention mask of {attention_mask.shape[1]} columns"
        raise ValueError(_reuse_message(held, f"{got}, not {held} + {width}"))
    if attention_mask is None and position_ids is not None and width > 1:  # one read of the first positions
        first = position_ids[:, 0].to("cpu").reshape(-1)
        real = store.lengths_host.reshape(-1)
        if first.shape == real.shape and not torch.equal(first, real.to(first.dtype)):
            got = f"{width} new token(s) from position {first.tolist()}, not {real.tolist()}"
            raise ValueError(_reuse_message(held, got))


def _reuse_message(held: int, got: str) -> str:
    return (
        f"this kvdex.Cache already holds {held} tokens of an earlier input, and got {got}: the input does not "
        "continue them. Create a new kvdex.Cache for each prompt (or call cache.reset()), or, to continue a "
        "conversation, pass the whole conversation (earlier input + generated tokens + new tokens) with its "
        "attention_mask"
    )


def check_retrieves(config: CacheConfig, policy) -> None:
    """A budget that leaves no room for retrieval after sink + window would attend only those: refused."""
    if not policy.uses_budget:
        return
    unit = policy.smallest_retrieval(config.page_size)
    if config.retrieval_tokens < unit:
        need = config.sink + config.window + unit
        what = "token" if unit == 1 else f"page ({unit} tokens)"
        raise ValueError(
            f"budget {config.budget} leaves {config.retrieval_tokens} tokens for retrieval after sink {config.sink} "
            f"+ window {config.window}, less than one {what}: {policy.name} would retrieve nothing from the middle "
            f"of the context. Pass budget >= {need}, or a smaller sink / window"
        )
