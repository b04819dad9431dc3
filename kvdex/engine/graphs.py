"""The engine's CUDA-graph service for work inside a policy's selection (IceCache ``graphs=True``: a
layer's batched tree search + page choice, one launch per layer and step instead of the ~300 small
kernels of the eager device search).

A policy captures no graph itself: it hands the service a function of a query tensor
(``LayerView.graphs.run``) and a signature of everything else that function reads; the service
captures, keeps and replays the graphs. One service per cache (``kvdex.Cache.graphs``); a fork gets
its own. Layers that a ``device_map`` puts on several GPUs are captured and replayed on their own
device, each device with its own side stream.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch

from kvdex.view import CaptureError

# tests: a factory ``f(static_q)`` of CUDA-graph stand-ins (capture_begin / capture_end / replay) that
# runs the graph path on the CPU (tests/test_icecache_batched.py checks what a capture reads)
STAND_IN = None


def as_current(device: torch.device):
    """``device`` as the current CUDA device while the block runs (nothing where it is current already, or not a
    CUDA device). Triton launches a kernel on the current device, and ``torch.cuda.graph`` captures on a stream
    of the current device: a layer (``device_map``) or a whole model on ``cuda:1`` while ``cuda:0`` is current
    hit an illegal memory access, and its replays skipped the model's kernels (wrong tokens; two H200s)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@contextlib.contextmanager
def gc_paused():
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
_DEFERRED: list = []


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (kvdex's, inductor's, the user's)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def free_with(owner, graphs: dict) -> None:
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


class GraphService:
    """One CUDA graph per key (a policy's layer), captured again when the key's signature changes.

    A replay reads the very addresses the capture read, so every tensor the captured kernels
    read from outside the capture must stay alive and unchanged until the next capture: the
    static query (held here) and whatever the caller passes as ``keep`` (held with the graph; a
    changed content must change the signature). A past bug: a per-step index tensor read by the
    graph was freed after the capturing step; the allocator reused its memory and the replays
    indexed with whatever was written there (device-side assert in an index/gather kernel)."""

    def __init__(self) -> None:
        self.graphs: dict = {}  # key -> (signature, graph, static query, static outputs, kept tensors)
        free_with(self, self.graphs)
        self.streams: dict = {}  # device -> the side stream captures on it run on (layers may sit on several GPUs)
        self.captures = 0
        self.replays = 0

    def usable(self, device: torch.device) -> bool:
        """Whether work on ``device`` can go through a graph (CUDA; on the CPU only with a test stand-in)."""
        return device.type == "cuda" or STAND_IN is not None

    def run(self, key, sig, fn, qd: torch.Tensor, keep=()) -> tuple[torch.Tensor, ...]:
        """``fn(qd)`` (a tuple of tensors) through the graph of ``key``, captured again when ``sig`` changes
        or the query's shape does. The capture is on a side stream in thread-local mode (index worker
        threads may use CUDA meanwhile), after one eager warm-up run there; the outputs are copied out of
        the graph's pool. Raises :class:`~kvdex.view.CaptureError` where the work cannot be captured."""
        ent = self.graphs.get(key)
        if ent is None or ent[0] != sig or ent[2].shape != qd.shape:
            self.graphs.pop(key, None)
            ent = self._capture(sig, fn, qd, keep)
            self.graphs[key] = ent
            self.captures += 1
        ent[2].copy_(qd)
        with as_current(qd.device):
            ent[1].replay()  # on the graph's own device (a device_map may put this layer on another GPU)
        self.replays += 1
        return tuple(t.clone() for t in ent[3])

    def _capture(self, sig, fn, qd, keep):
        cuda = qd.device.type == "cuda"
        static_q = qd.clone()
        if cuda:
            if qd.device not in self.streams:
                self.streams[qd.device] = torch.cuda.Stream(qd.device)
            s, main = self.streams[qd.device], torch.cuda.current_stream(qd.device)
            s.wait_stream(main)
            graph, ctx = torch.cuda.CUDAGraph(), torch.cuda.stream(s)
        else:
            graph, ctx = STAND_IN(static_q), contextlib.nullcontext()
        try:
            with ctx, gc_paused():
                fn(static_q)  # warm-up (lazy initialisations stay out of the capture)
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = fn(static_q)
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            raise CaptureError(str(e)) from e
        finally:
            if cuda:
                main.wait_stream(s)
        return (sig, graph, static_q, tuple(out), tuple(keep))
