"""kvdex inside vLLM: an attention backend (``--attention-backend CUSTOM``) that runs kvdex's engine and policies on
vLLM's paged KV cache.

Everything here but :mod:`kvdex.vllm.backend` and :mod:`kvdex.vllm.plugin` is torch only (vLLM is imported lazily
by those two), so the block-table mapping (:mod:`~kvdex.vllm.paged`), the store that reads vLLM's blocks
(:mod:`~kvdex.vllm.store`), the per-request state (:mod:`~kvdex.vllm.requests`) and the per-layer forward
(:mod:`~kvdex.vllm.forward`) run and are tested without vLLM. ``docs/vllm.md`` is the user's guide.
"""

from kvdex.vllm.config import REFUSED, SUPPORTED, VllmSettings, settings_from
from kvdex.vllm.forward import forward_layer
from kvdex.vllm.requests import Geometry, RequestState, RequestTable, Row
from kvdex.vllm.store import BlockRow, PagedStore

__all__ = [
    "REFUSED",
    "SUPPORTED",
    "BlockRow",
    "Geometry",
    "PagedStore",
    "RequestState",
    "RequestTable",
    "Row",
    "VllmSettings",
    "forward_layer",
    "settings_from",
]
