"""kvdex.hf: the transformers adapter (the Cache, the attention function, model loading, generation)."""

from kvdex.hf.cache import Cache, KVDexLayer
from kvdex.hf.loading import enable, load

__all__ = ["Cache", "KVDexLayer", "enable", "load"]
