"""kvdex: long-context decoding that attends to a small budget of the most relevant KV pages.

model, tok = kvdex.load("Qwen/Qwen2.5-0.5B-Instruct")
cache = kvdex.Cache(model, policy="quest", budget=256)
out = model.generate(**tok(prompt, return_tensors="pt"), cache=cache, max_new_tokens=64)
(transformers < 5.24 names the argument past_key_values; ``**kvdex.cache_kwargs(cache)`` fits both)
print(cache.stats())
"""

from kvdex.config import CacheConfig
from kvdex.hf import Cache, enable, load
from kvdex.hf.compat import cache_kwargs
from kvdex.hf.generate import generate
from kvdex.hf.graph import GraphDecoder
from kvdex.policies import Policy, make_policy, policies, register_policy
from kvdex.selection import Selection

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "CacheConfig",
    "GraphDecoder",
    "Policy",
    "Selection",
    "cache_kwargs",
    "enable",
    "generate",
    "load",
    "make_policy",
    "policies",
    "register_policy",
    "__version__",
]
