"""kvdex's attention function and mask function, registered in transformers' public
``AttentionInterface`` / ``AttentionMaskInterface`` under the name ``"kvdex"``.

The model's attention module calls ``cache.update(k, v, layer_idx)`` and hands what it
returns straight to the attention function. A kvdex cache returns the new k/v tagged with the
layer cache that stored them (``_kvdex_layer``); that tag is how this function finds the cache
without globals. Untagged keys (no cache, a DynamicCache, ...) take the ordinary dense path, so
an enabled model keeps working normally without a kvdex cache.

The mask function gives this function only the 2D key-padding mask (as [B, 1, 1, L]); causality
is applied here, per query chunk, so prefill memory stays bounded.
"""

from __future__ import annotations

import torch

from kvdex.kernels import dense_attention

ATTN_NAME = "kvdex"
TAG = "_kvdex_layer"


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    kv_offset: int = 0,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function: the key-padding mask [B, 1, 1, kv_length] (bool), or None without padding."""
    if attention_mask is None or (q_length == 1 and kv_length == 1):  # one token attending to itself
        return None
    m = attention_mask.to(torch.bool)
    m = m[:, kv_offset : kv_offset + kv_length]
    if m.shape[-1] < kv_length:  # mask shorter than the keys: the missing (newest) keys are real
        pad = torch.ones(m.shape[0], kv_length - m.shape[-1], dtype=torch.bool, device=m.device)
        m = torch.cat([m, pad], dim=-1)
    if bool(m.all()):
        return None
    return m[:, None, None, :]


def kvdex_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
):
    """query [B, Hq, T, D]; key/value [B, H, L, D] -> ([B, T, Hq, D], None). Under ``torch.compile`` a
    kvdex decode step (an empty key from ``kvdex::append``) is the opaque op ``kvdex::attend``; everything
    else runs eagerly (a graph break)."""
    if torch.compiler.is_compiling() and key.shape[2] == 0 and sliding_window is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return torch.ops.kvdex.attend(query, key, module.layer_idx, scale), None  # kvdex.hf.compiled_ops
    return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, sliding_window, **kwargs)


@torch.compiler.disable  # selection + store + kernels stay eager Python under torch.compile (a graph break)
def _eager_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
):
    """query [B, Hq, T, D]; key/value [B, H, L, D] -> ([B, T, Hq, D], None)."""
    if sliding_window is not None:
        raise ValueError(
            "kvdex does not support sliding-window attention layers; load the model with full attention "
            "(e.g. config.use_sliding_window=False) or use attn_implementation='sdpa'"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key_mask = None if attention_mask is None else attention_mask.reshape(attention_mask.shape[0], -1)
    layer = getattr(key, TAG, None)
    if layer is not None:
        return layer.attention(module, query, key, value, key_mask, scale), None
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] != 1:
        raise ValueError(
            "kvdex attention got a full 4D attention mask; it expects key-padding masks made by its own "
            "mask function. Call kvdex.enable(model) instead of setting attn_implementation by hand."
        )
    t, L = query.shape[2], key.shape[2]
    if key_mask is None and t == L:
        return dense_attention(query, key, value, None, None, scale), None
    q_pos = (L - t + torch.arange(t, device=query.device)).expand(query.shape[0], t)
    return dense_attention(query, key, value, q_pos, key_mask, scale), None
