"""The counters that every layer's step adds into: attended tokens and (optionally) time per phase."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StepCounters:
    """Attended tokens (one device counter for all layers) and milliseconds per phase (``timed``)."""

    def __init__(self):
        self.timing: dict[str, float] = {}
        self.attended: torch.Tensor | None = None
        self.calls = 0  # counts added into the attended tokens: one per sparse layer and step
        self.inplace = False  # CUDA-graph decoding: one counter, added to in place (GraphDecoder)

    @contextmanager
    def timed(self, name: str, on: bool):
        """Adds the time of the block to phase ``name`` when ``on`` (``CacheConfig.timing``), synchronizing CUDA."""
        if not on:
            yield
            return
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        yield
        sync()
        self.timing[name] = self.timing.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def count(self, total: torch.Tensor) -> None:
        # one counter for all layers, on the device of the first sparse layer that counts (device_map:
        # the other layers' counts move there explicitly)
        if self.attended is not None and total.device != self.attended.device:
            total = total.to(self.attended.device)
        if self.attended is not None and self.inplace:
            self.attended.add_(total)  # CUDA-graph decode: one buffer that replayed steps accumulate into
        else:
            self.attended = total if self.attended is None else self.attended + total
        self.calls += 1

    def count_in_place(self, device: torch.device) -> None:
        """From now on the attended-token count is one persistent device counter (long, on ``device``
        unless one exists) that every step adds into in place: CUDA-graph decoding, whose captured steps
        add into it by address. Made once; later calls do nothing (a counter replaced would be freed under
        the graphs that add into it, whose replays would then add into whatever tensor lands there)."""
        if self.inplace:
            return
        self.attended = (
            torch.zeros((), dtype=torch.long, device=device)
            if self.attended is None
            else self.attended.to(torch.long).clone()
        )
        self.inplace = True
