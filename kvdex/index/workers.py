"""Where the CPU-side index work runs: shared thread pools for tree builds / insertions and per-step
host searches, and the asynchronous copy of keys to host memory that a worker waits on."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_POOLS: dict[tuple[int, str], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def pool(threads: int, role: str = "index") -> ThreadPoolExecutor:
    """Shared pools per (thread count, role): index jobs (builds, insertions) and per-step tree
    searches never wait for each other; the evaluation harness forks many caches."""
    with _POOLS_LOCK:
        key = (threads, role)
        if key not in _POOLS:
            # One torch thread per worker (torch's thread count is per thread): the parallelism is
            # across trees, and `threads` workers with default intra-op teams would oversubscribe.
            _POOLS[key] = ThreadPoolExecutor(
                threads, f"kvdex-dci-{role}", initializer=torch.set_num_threads, initargs=(1,)
            )
        return _POOLS[key]


def run_all(tasks: list, threads: int, role: str = "query") -> list:
    """The results of the callables ``tasks``, run on the shared pool of ``threads`` workers (in this
    thread where there is one task or one thread)."""
    if len(tasks) > 1 and threads > 1:
        return list(pool(threads, role).map(lambda f: f(), tasks))
    return [f() for f in tasks]


def cpu_threads() -> int:
    """The CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying device keys to (pinned) host memory; the worker waits on the returned event."""
    if x.device.type != "cuda":
        return x.detach().float(), None
    buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    buf.copy_(x.detach(), non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return buf, ev
