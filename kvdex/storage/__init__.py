"""KV storage: page-grid layout, GPU-resident pages, host page store, batched transfers."""

from kvdex.storage.base import AttendSet, LayerStore, TransferStats, strip_left_padding
from kvdex.storage.device import DeviceStore
from kvdex.storage.joins import MiddleUpdate, PageJoin, host_joins, page_joins
from kvdex.storage.layout import Grid, grown_capacity, left_padding
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
    "grown_capacity",
    "left_padding",
    "strip_left_padding",
]
