"""The capture path of kvdex's decode-step graphs, and what keeps CUDA graphs safe to capture and free.

:func:`capture_step` is the one place where a decode step (a whole model step of
:class:`~kvdex.hf.graph.GraphDecoder` or of the compile backend's ``WholeStep``, or one layer's kvdex
work in :class:`~kvdex.engine.graphs.layer_graphs.StepGraphs`) is recorded: a CUDA graph on a CUDA
device, else the tests' CPU stand-in (:data:`STAND_IN`), on the step's device, with the cyclic garbage
collector paused (:func:`gc_paused`). Graphs are freed through :func:`free_with` / :func:`free_deferred`,
never inside a capture.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# tests: a factory ``f(static)`` of CUDA-graph stand-ins (capture_begin / capture_end / replay) that runs the
# graph paths on the CPU (tests/step_graph_stand_in.py; tests/test_icecache_batched.py checks what a capture reads)
STAND_IN: Callable[[torch.Tensor], Any] | None = None


def as_current(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` as the current CUDA device while the block runs (nothing where it is current already, or not a
    CUDA device). Triton launches a kernel on the current device, and ``torch.cuda.graph`` captures on a stream
    of the current device: a layer (``device_map``) or a whole model on ``cuda:1`` while ``cuda:0`` is current
    hit an illegal memory access, and its replays skipped the model's kernels (wrong tokens; two H200s)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (restored after) for a CUDA graph capture. A collection that
    runs inside a capture finalizes whatever garbage is due, and some finalizers make CUDA calls that a
    capture forbids (a CUDA graph's ``cudaGraphExecDestroy`` / ``cudaGraphDestroy``, a Triton kernel's
    module unload): the call only warns ("operation not permitted when stream is capturing (function
    reset)"), but the capture is invalidated and its next launch fails ("operation failed due to a previous
    error during capture"). ``torch.cuda.graph`` neither pauses nor runs the collector (torch >= 2.9), so
    every kvdex capture runs inside this."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# graphs of owners that went while a capture was underway: freed at the next safe point (free_deferred)
_DEFERRED: list[dict] = []


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (kvdex's, inductor's, the user's)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def free_with(owner: object, graphs: dict) -> None:
    """Free ``graphs`` (a dict whose values hold CUDA graphs) when ``owner`` goes, but never inside a capture.
    An owner is often freed by the cyclic collector (torch.compile's tracing keeps references to the first
    cache it saw in cyclic garbage), which may run inside any capture, e.g. inductor recording its CUDA
    graphs between kvdex's ops; destroying a graph there invalidates that capture (:func:`gc_paused`).
    Such graphs are kept until :func:`free_deferred`, which kvdex calls at the start of every decode step."""
    weakref.finalize(owner, _owner_gone, graphs).atexit = False


def _owner_gone(graphs: dict) -> None:
    if graphs and _capturing():
        _DEFERRED.append(graphs)  # alive until free_deferred; otherwise freed when this returns


def free_deferred() -> None:
    """Free the graphs :func:`free_with` held back (nothing while a capture is underway)."""
    if _DEFERRED and not _capturing():
        _DEFERRED.clear()


@contextlib.contextmanager
def capture_step(
    device: torch.device,
    static: torch.Tensor | None,
    host: Sequence[torch.Tensor] = (),
    *,
    pool: Any = None,
    error_mode: str = "thread_local",
    cuda: bool | None = None,
) -> Iterator[Any]:
    """Record the block's device work as a graph, yielded (``replay()`` runs it again). On CUDA: a
    ``torch.cuda.CUDAGraph`` captured by ``torch.cuda.graph`` (memory ``pool``: None, a private one;
    ``error_mode``: its ``capture_error_mode``) after a synchronisation; a capture launches nothing, so the
    caller replays the graph for the step's device work. Elsewhere: ``STAND_IN(static)``, told that the
    tensors ``host`` (the stores' host lengths) are host-side. ``cuda``: a CUDA graph or the stand-in (None:
    from ``device``). The block runs on ``device`` as the current device, with the cyclic collector paused."""
    on_cuda = device.type == "cuda" if cuda is None else cuda
    with as_current(device), gc_paused():  # torch.cuda.graph makes its capture stream on the current device
        if on_cuda:
            graph: Any = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(device)
            ctx: contextlib.AbstractContextManager = torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode)
        else:
            if STAND_IN is None or static is None:
                raise RuntimeError(f"no CUDA graph on {device} (tests: set kvdex.engine.graphs.capture.STAND_IN)")
            graph = STAND_IN(static)
            ctx = _stand_in_capture(graph, host)
        with ctx:
            yield graph


@contextlib.contextmanager
def _stand_in_capture(graph: Any, host: Sequence[torch.Tensor]) -> Iterator[None]:
    graph.capture_begin(host=host)
    try:
        yield
    finally:
        graph.capture_end()
