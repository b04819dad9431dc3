"""The choice of a layer's store from the configuration: the one place that reads ``offload`` and
``page_cache`` to pick a store class."""

from __future__ import annotations

from kvdex.config import CacheConfig
from kvdex.policies.base import Policy
from kvdex.storage import DeviceStore, OffloadStore


def make_store(config: CacheConfig, policy: Policy, layer_idx: int, dense: bool, args: tuple):
    """The store of layer ``layer_idx``. ``args``: ``(grid, batch, kv_heads, head_dim, dtype, device,
    transfer_stats)``; ``config.page_cache``: device page slots of an offloaded store (0 = off).

    A sparse layer takes the policy's own store where it brings one (IceCache's semantic pages), else an
    :class:`OffloadStore` with ``offload``; every other layer (dense ones included) a :class:`DeviceStore`.
    """
    if not dense:
        work = config.retrieval_tokens if policy.uses_budget else args[0].page_size
        custom = policy.make_store(layer_idx, config.offload, args, work)
        if custom is not None:
            return custom
        if config.offload:
            return OffloadStore(*args, work_tokens=work, page_cache=config.page_cache)
    return DeviceStore(*args)
