"""The one switch for "use Triton here": every fast path in kvdex asks :func:`triton_kernel`.

A Triton kernel module of ``kvdex.kernels`` is used when

* its environment switch is not ``0``: ``KVDEX_TRITON`` for every kernel module except the host-memory
  gathers of ``uva`` and the page-cache bookkeeping that runs with them (``page_cache_triton``), which
  have their own ``KVDEX_UVA`` (offloaded stores and CUDA-graph decoding depend on them separately from
  the compute kernels);
* triton imports (the package works without it: every kernel has a PyTorch twin);
* the tensors passed as ``on=`` are CUDA tensors. On the CPU the PyTorch twins run, also under
  ``TRITON_INTERPRET=1``: the interpreter tests call the Triton functions directly.

The switches are read at every call, so tests and benchmarks can flip them between runs.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

# kernel module -> the environment variable that turns it off ("0"); others: KVDEX_TRITON
_SWITCHES = {"uva": "KVDEX_UVA", "page_cache_triton": "KVDEX_UVA"}


def switched_on(module: str = "") -> bool:
    """Whether the environment allows the Triton kernels of ``module`` (no import, no device check)."""
    return os.environ.get(_SWITCHES.get(module, "KVDEX_TRITON"), "1") != "0"


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _load(module: str):
    if not triton_available():
        return None
    try:
        return importlib.import_module(f"kvdex.kernels.{module}")
    except ImportError:
        return None


def triton_kernel(module: str, attr: str | None = None, *, on: torch.Tensor | None = None):
    """``kvdex.kernels.<module>`` (or its attribute ``attr``) when its switch is on, triton imports
    and ``on`` (if given) is a CUDA tensor; else None, and the caller runs the PyTorch twin."""
    if on is not None and not on.is_cuda:
        return None
    if not switched_on(module):
        return None
    mod = _load(module)
    return mod if mod is None or attr is None else getattr(mod, attr)
