"""KV storage: page-grid layout, GPU-resident pages, host page store, batched transfers."""

from kvdex.storage.base import (
    AttendSet,
    LayerStore,
    MiddleUpdate,
    PageJoin,
    TransferStats,
    host_joins,
    page_joins,
    strip_left_padding,
)
from kvdex.storage.device import DeviceStore
from kvdex.storage.layout import Grid, left_padding
from kvdex.storage.offload import OffloadStore

__all__ = [
    "AttendSet",
    "DeviceStore",
    "Grid",
    "LayerStore",
    "MiddleUpdate",
    "OffloadStore",
    "PageJoin",
    "TransferStats",
    "host_joins",
    "page_joins",
    "left_padding",
    "strip_left_padding",
]
