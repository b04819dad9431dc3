"""One memory sample of a soak: device memory, host RSS, live tensors and gc-tracked objects.

* ``device``: ``torch.cuda.memory_allocated`` (CUDA; ``device_reserved``: ``memory_reserved``), or on a
  CPU the bytes of every live tensor Python can reach (``tensor_bytes``, exact where RSS is noisy);
* ``rss``: the process's resident host memory (``/proc/self/statm``);
* ``tensors`` and ``objects``: live torch tensors and objects the cyclic collector tracks
  (``gc.get_objects()``): a per-step leak of Python state shows here first.
"""

from __future__ import annotations

import gc
import os
import sys

import torch


def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``; elsewhere the peak from ``resource``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def live_tensors() -> tuple[int, int]:
    """(live torch tensors Python can reach, the bytes of their distinct storages)."""
    count, seen, total = 0, set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor):  # type(): no attribute lookup on odd objects
            count += 1
            try:  # meta / fake / sparse tensors (a compile leaves fake ones behind) have no data pointer
                st = o.untyped_storage()
                key = (st.device.type, st.device.index, st.data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return count, total


def sample(device: torch.device, objects: bool) -> dict:
    """One sample of every series (the device synchronised first; cyclic garbage collected before counting,
    so the counts are of objects still reachable, not of garbage the collector has not reached yet)."""
    if objects or device.type != "cuda":
        gc.collect()
    out = {"rss": rss_bytes()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["device"] = torch.cuda.memory_allocated(device)
        out["device_reserved"] = torch.cuda.memory_reserved(device)
    if objects or device.type != "cuda":
        n, nbytes = live_tensors()
        out["tensors"], out["tensor_bytes"] = n, nbytes
        if device.type != "cuda":
            out["device"] = nbytes
    if objects:
        out["objects"] = len(gc.get_objects())
    return out
