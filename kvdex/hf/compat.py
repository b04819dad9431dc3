"""The one place that knows which transformers is installed: its version and how it spells its arguments.

transformers 5.24 renamed the cache argument of ``forward`` and ``generate`` from
``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40 / 6.0). kvdex supports the
declared range in ``pyproject.toml`` on both sides of the rename; its own calls go through
:func:`cache_kwargs`, so they use whichever name the installed version documents.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import transformers

TRANSFORMERS_VERSION: str = transformers.__version__  # recorded with every evaluation and benchmark result


@lru_cache(maxsize=1)
def cache_arg() -> str:
    """``"cache"`` on transformers >= 5.24, ``"past_key_values"`` before."""
    from transformers import LlamaModel

    params = inspect.signature(LlamaModel.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``: splat it into ``forward`` / ``generate``.

    >>> model.generate(**inputs, **kvdex.cache_kwargs(cache), max_new_tokens=64)
    """
    return {cache_arg(): cache}
