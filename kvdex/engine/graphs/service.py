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
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from kvdex.engine.graphs import capture
from kvdex.engine.graphs.capture import as_current, free_with, gc_paused
from kvdex.view import CaptureError


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
        return device.type == "cuda" or capture.STAND_IN is not None

    def run(
        self,
        key: Hashable,
        sig: Hashable,
        fn: Callable[[torch.Tensor], Sequence[torch.Tensor]],
        qd: torch.Tensor,
        keep: Sequence[torch.Tensor] = (),
    ) -> tuple[torch.Tensor, ...]:
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

    def _capture(
        self,
        sig: Hashable,
        fn: Callable[[torch.Tensor], Sequence[torch.Tensor]],
        qd: torch.Tensor,
        keep: Sequence[torch.Tensor],
    ) -> tuple:
        cuda = qd.device.type == "cuda"
        static_q = qd.clone()
        if cuda:
            if qd.device not in self.streams:
                self.streams[qd.device] = torch.cuda.Stream(qd.device)
            s, main = self.streams[qd.device], torch.cuda.current_stream(qd.device)
            s.wait_stream(main)
            graph: Any = torch.cuda.CUDAGraph()
            ctx: contextlib.AbstractContextManager = torch.cuda.stream(s)
        else:
            assert capture.STAND_IN is not None, "usable(): CUDA or a stand-in"
            graph, ctx = capture.STAND_IN(static_q), contextlib.nullcontext()
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
