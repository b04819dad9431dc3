"""transformers integration: the Cache, the attention function, model loading."""

from kvdex.integration.cache import Cache, KVDexLayer
from kvdex.integration.loading import enable, load

__all__ = ["Cache", "KVDexLayer", "enable", "load"]
