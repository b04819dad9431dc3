"""What a policy's ``select`` sees of one sparse layer at one decode step: a :class:`LayerView`.

The engine (:meth:`kvdex.engine.LayerEngine.decode`) builds one view per sparse layer and step and
calls ``policy.select(q, view)``. The view carries the layer index, its store, the attention scale,
the sequence lengths (the store's own tensors: device and host), the page grid, the retrieval budget,
and ``graphs``: the engine's CUDA-graph service (:class:`kvdex.engine.graphs.service.GraphService`), through
which a policy replays a piece of its selection (IceCache's device search) without capturing graphs
itself. A policy reads sizes from the view instead of asking the store or recomputing them.

Policies import this module; it imports neither the engine nor a policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvdex.config import CacheConfig
    from kvdex.storage import Grid, LayerStore


class CaptureError(RuntimeError):
    """A graph service could not capture a policy's work (the error that stopped it is the ``__cause__``)."""


class Graphs(Protocol):
    """What a policy may ask of the engine's graph service (:class:`kvdex.engine.graphs.service.GraphService`)."""

    captures: int  # graphs captured so far
    replays: int

    def usable(self, device: torch.device) -> bool:
        """Whether work on ``device`` can be replayed from a graph."""
        ...

    def run(self, key, sig, fn, qd: torch.Tensor, keep=()) -> tuple[torch.Tensor, ...]:
        """``fn(qd)`` replayed from the graph of ``key``, captured again when ``sig`` or ``qd``'s shape
        changes; ``keep``: tensors the captured work reads, held until the next capture. Raises
        :class:`CaptureError` where the work cannot be captured."""
        ...


@dataclass(frozen=True)
class LayerView:
    """One sparse layer at one decode step (built by the engine; :meth:`of` builds one from a store).

    ``lengths`` [B] (the store's device tensor) and ``lengths_host`` [B] (CPU) count the real tokens
    of each sequence, this step's token included. ``retrieval_pages`` / ``retrieval_tokens``: the
    middle budget per kv head (``budget - sink - window``). ``graphs``: None where the engine offers
    no graph service (a view built outside a cache)."""

    layer: int
    store: LayerStore
    scale: float
    lengths: torch.Tensor
    lengths_host: torch.Tensor
    grid: Grid
    budget: int
    retrieval_pages: int
    retrieval_tokens: int
    graphs: Graphs | None = None

    @classmethod
    def of(cls, layer: int, store: LayerStore, scale: float, config: CacheConfig, graphs=None) -> LayerView:
        """The view of ``layer`` whose store is ``store``, sized by the cache's ``config``."""
        return cls(layer, store, scale, store.lengths, store.lengths_host, store.grid, config.budget,
                   config.retrieval_pages, config.retrieval_tokens, graphs)  # fmt: skip

    # ---- the store's sizes -------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.store.batch

    @property
    def kv_heads(self) -> int:
        return self.store.kv_heads

    @property
    def static(self) -> bool:
        """Static sizing (CUDA-graph decoding): shapes must not follow the lengths, no host read of a
        device value; widths come from buffer capacities instead."""
        return self.store.static

    @property
    def page_size(self) -> int:
        return self.grid.page_size

    @property
    def sink(self) -> int:
        return self.grid.sink

    @property
    def window(self) -> int:
        return self.grid.window

    # ---- the middle region -------------------------------------------------------------------------
    @cached_property
    def middle_pages(self) -> torch.Tensor:
        """[B] middle pages per sequence, on the lengths' device."""
        return self.grid.num_middle_pages(self.lengths)

    @cached_property
    def window_start(self) -> torch.Tensor:
        """[B] first window position per sequence (== end of the middle), on the lengths' device."""
        return self.grid.window_start(self.lengths)

    @cached_property
    def max_middle_pages(self) -> int:
        """The longest middle of the batch, in pages (from the host lengths: no device sync)."""
        return int(self.grid.num_middle_pages(self.lengths_host).max())

    def score_width(self, *capacities: int) -> int:
        """Pages a page policy scores this step: the longest middle, or under static sizing the smallest
        of its index ``capacities`` (a value that changes only when a buffer is re-allocated, never with
        the lengths). Pages past each sequence's middle are masked either way."""
        return min(capacities) if self.static else self.max_middle_pages

    def no_ids(self, device: torch.device) -> torch.Tensor:
        """[B, H, 0] ids: an empty page or token selection (sink + window only)."""
        return torch.full((self.batch, self.kv_heads, 0), -1, dtype=torch.long, device=device)
