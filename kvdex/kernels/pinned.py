"""The host buffers kvdex pinned in place with cudaHostRegister (``kvdex.storage.host`` registers them).

torch 2.11 (CUDA 13) reports registered memory as not pinned (``Tensor.is_pinned()`` is False
although cudaHostRegister returned success), so the kernels that read host memory over UVA ask here too.
"""

from __future__ import annotations

import torch

# data_ptr of the storage of every buffer kvdex registered
REGISTERED: set[int] = set()


def is_registered(t: torch.Tensor) -> bool:
    """True when t lies in a host buffer that kvdex pinned with cudaHostRegister."""
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in REGISTERED


def readable_from(src: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel on ``device`` can read ``src``: a CUDA kernel reads host memory only when it is pinned."""
    return not (src.device.type == "cpu" and device.type == "cuda" and not (src.is_pinned() or is_registered(src)))
