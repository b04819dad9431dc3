"""Where a transformers model keeps what kvdex reads: its text configuration and its attention modules."""

from __future__ import annotations

import torch


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """The attention module of each layer, by ``layer_idx``."""
    found = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if idx is not None and hasattr(m, "o_proj") and "Attention" in type(m).__name__:
            found[idx] = m
    return found
