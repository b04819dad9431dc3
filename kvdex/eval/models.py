"""Model names the evaluation commands accept, and loading them for kvdex.

``kvdex.load`` takes a hub id, a directory, a ``.gguf`` file or a known name (``smollm2``,
``qwen05b``: installed by ``kvdex models fetch NAME``, see :mod:`kvdex.models`).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvdex.models import resolve_model as resolve  # aliases smollm2 / qwen05b, files, dirs, hub ids


def tag(model: str, gguf: str | None = None) -> str:
    """A short file-name-safe name of the model for result folders and tables."""
    name = Path(gguf).stem if gguf else Path(model.rstrip("/")).name
    name = re.sub(r"\.gguf$", "", name, flags=re.I)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)[:48] or "model"


def load(model: str, gguf: str | None = None, device: str | None = None, dtype: str = "auto"):
    """``(model, tokenizer)`` ready for kvdex caches, in eval mode."""
    import torch

    import kvdex

    path, gguf_file = resolve(model, gguf)
    if dtype != "auto":
        dtype = getattr(torch, dtype)
    return kvdex.load(path, gguf_file=gguf_file, device=device, dtype=dtype)
