"""Where a transformers model keeps what kvdex reads: its text configuration and its attention modules."""

from __future__ import annotations

import torch


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def head_geometry(model) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of the model's attention, from its text configuration (whole
    model: under tensor parallelism each rank holds a share of the heads)."""
    cfg = text_config(model)
    q_heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or q_heads
    return q_heads, kv_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """The attention module of each layer, by ``layer_idx``."""
    found = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if idx is not None and hasattr(m, "o_proj") and "Attention" in type(m).__name__:
            found[idx] = m
    return found
