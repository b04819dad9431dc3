"""vLLM's plugin entry point (``[project.entry-points."vllm.general_plugins"] kvdex``): registers
:class:`kvdex.vllm.backend.KvdexBackend` as vLLM's ``CUSTOM`` attention backend in every vLLM process, so that
``vllm serve MODEL --attention-backend CUSTOM`` (``LLM(..., attention_backend="CUSTOM")``) decodes with kvdex.
Registering only names the class: vLLM imports it when an engine selects the backend."""

from __future__ import annotations

import importlib
import logging

BACKEND = "kvdex.vllm.backend.KvdexBackend"
_REGISTRIES = ("vllm.v1.attention.backends.registry", "vllm.attention.backends.registry")

log = logging.getLogger(__name__)


def register() -> bool:
    """Register kvdex's backend as ``AttentionBackendEnum.CUSTOM``; False (with a warning) where this vLLM has no
    backend registry (a vLLM without the CUSTOM backend: kvdex's vLLM adapter needs vllm>=0.26)."""
    for name in _REGISTRIES:
        try:
            registry = importlib.import_module(name)
        except ImportError:
            continue
        enum = getattr(registry, "AttentionBackendEnum", None) or getattr(registry, "_Backend", None)
        if enum is None or not hasattr(enum, "CUSTOM") or not hasattr(registry, "register_backend"):
            continue
        registry.register_backend(enum.CUSTOM, BACKEND)
        return True
    log.warning("kvdex: this vLLM has no attention-backend registry with a CUSTOM member; kvdex needs vllm>=0.26")
    return False
