"""CUDA graphs of a layer's batched tree search + page choice (IceCache ``graphs=True``): one launch
per layer and step instead of the ~300 small kernels of the eager device search."""

from __future__ import annotations

import contextlib

import torch


class CaptureError(RuntimeError):
    """The search could not be captured (the error that stopped it is the ``__cause__``)."""


class SearchGraphs:
    """One CUDA graph per layer, captured again when the layer's signature changes.

    A replay reads the very addresses the capture read, so every tensor the captured kernels
    read from outside the capture must stay alive and unchanged until the next capture: the
    static query (held here), the mirror's arrays (the forest, in ``keep``; they change only with its
    ``version``, part of the signature) and the row / tree index tensors (``keep``). A past bug: the
    per-step ``tq = ridx.repeat_interleave(G)`` was read by the graph but freed after the
    capturing step; the allocator reused its memory and the replays indexed the mirror with
    whatever was written there (device-side assert in an index/gather kernel)."""

    def __init__(self) -> None:
        self.graphs: dict = {}  # layer -> (signature, graph, static query, static outputs, kept tensors)
        self.streams: dict = {}  # device -> the side stream captures on it run on (layers may sit on several GPUs)
        self.captures = 0
        self.replays = 0

    def run(self, layer, sig, fn, qd: torch.Tensor, keep=(), stand_in=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``fn(qd)`` (a pair of tensors) through the layer's graph, captured again when ``sig`` changes
        (the mirror's arrays, its host-known bounds, the searched trees or the scale changed) or the
        query's shape does. The capture is on a side stream in thread-local mode (index worker threads
        may use CUDA meanwhile), after one eager warm-up run there; the outputs are copied out of the
        graph's pool. ``stand_in(static_q)``: a stand-in for a CUDA graph on the CPU (tests). Raises
        :class:`CaptureError` where the search cannot be captured."""
        ent = self.graphs.get(layer)
        if ent is None or ent[0] != sig or ent[2].shape != qd.shape:
            self.graphs.pop(layer, None)
            ent = self._capture(sig, fn, qd, keep, stand_in)
            self.graphs[layer] = ent
            self.captures += 1
        ent[2].copy_(qd)
        with torch.cuda.device(qd.device) if qd.device.type == "cuda" else contextlib.nullcontext():
            ent[1].replay()  # on the graph's own device (a device_map may put this layer on another GPU)
        self.replays += 1
        return ent[3][0].clone(), ent[3][1].clone()

    def _capture(self, sig, fn, qd, keep, stand_in):
        cuda = qd.device.type == "cuda"
        static_q = qd.clone()
        if cuda:
            if qd.device not in self.streams:
                self.streams[qd.device] = torch.cuda.Stream(qd.device)
            s, main = self.streams[qd.device], torch.cuda.current_stream(qd.device)
            s.wait_stream(main)
            graph, ctx = torch.cuda.CUDAGraph(), torch.cuda.stream(s)
        else:
            graph, ctx = stand_in(static_q), contextlib.nullcontext()
        try:
            with ctx:
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
        return (sig, graph, static_q, out, tuple(keep))
