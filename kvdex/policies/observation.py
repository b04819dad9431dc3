"""Observation-window scoring shared by SnapKV, PRKV's static part and H2O's prefill, and the ring of
recent queries that periodic refreshes read.

SnapKV (Li et al., 2024) and PRKV (Algorithm 1, lines 6-9) score every earlier token by the
attention the last W queries (the observation window) pay it. PRKV's GQA rule is used for both:
the kv heads are repeated for every query head, the softmax weights are computed per query head and
then averaged over the window and over the query heads of a group (averaging *queries* first lets
positive and negative scores cancel, PRKV §4.1). The softmax runs over every key the query sees
(causal, sink and window included): the true attention weights, which is what SnapKV slices its
scores from; the middle tokens' share of them is the score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.reference import attention_mass_reference, ring_push_reference
from kvdex.storage import LayerStore, page_joins


def check_kernel(kernel: int) -> None:
    """ValueError unless the pooling ``kernel`` is an odd int >= 1 (``pooling``'s choices are a ``Literal`` option)."""
    if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be an odd int >= 1 (1 = no pooling), got {kernel!r}")


def attention_mass(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    key_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed softmax weights per query head: q [B, Hq, W, D] at positions q_pos [B, W] (valid rows
    q_valid [B, W]), keys k [B, H, L, D] -> [B, Hq, L] (fp32), by key slot. Slot j holds the key of position
    ``key_pos[b, h, j]`` (PRKV's relocated middle) or, without ``key_pos``, of position j.

    Key slot j is visible to query i iff its position is ``<= q_pos[i]`` and ``j < lengths``. On CUDA two
    Triton kernels (:mod:`kvdex.kernels.obs_triton`), else the PyTorch twin.
    """
    fast = triton_kernel("obs_triton", "attention_mass", on=k)
    return (fast or attention_mass_reference)(q, q_pos, q_valid, k, lengths, scale, key_pos)


def middle_scores(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    grid,
    scale: float,
    kernel: int = 1,
    pooling: str = "max",
    per_query_head: bool = False,
    origin: torch.Tensor | None = None,
    lengths_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Observation-window score of every middle token per kv head, by position: [B, H, M], M = the longest
    middle (``per_query_head``: [B, Hq, M], before the group average).

    Mean softmax weight over the valid window queries, pooled along the sequence (SnapKV's
    clustering; ``kernel=1`` for none) per query head, then averaged over the group. The keys are in
    position order (slot == position), or ``origin`` [B, H, M] gives the position - sink of the key in
    each middle slot (PRKV's relocation; the slots outside the middle hold their own positions). Entries
    past a sequence's middle are ``-inf``. ``lengths_host``: the same lengths on the CPU (the store's), which
    spares a host sync for the middle's size.
    """
    h, L = k.shape[1], k.shape[2]
    end = grid.window_start(lengths.to(k.device))  # [B]
    m = int(grid.num_middle_pages(lengths.cpu() if lengths_host is None else lengths_host).max()) * grid.page_size
    s0 = grid.sink
    key_pos = None
    if origin is not None and m:
        origin = origin[:, :, :m].to(k.device)
        key_pos = torch.arange(L, device=k.device).repeat(k.shape[0], h, 1)
        key_pos[:, :, s0 : s0 + m] = origin + s0
    mass = attention_mass(q, q_pos, q_valid, k, lengths, scale, key_pos)[:, :, s0 : s0 + m]  # [B, Hq, M] by slot
    if origin is not None and key_pos is not None:  # by position: slot j's mass to position - sink origin[j]
        idx = origin.repeat_interleave(q.shape[1] // h, dim=1)
        mass = torch.zeros_like(mass).scatter_(2, idx, mass)
    mass = mass / q_valid.sum(-1).clamp(min=1).to(mass)[:, None, None]
    inside = (s0 + torch.arange(m, device=k.device))[None, :] < end[:, None]  # [B, M]
    mass = mass * inside[:, None, :]  # SnapKV pools the prefix only: nothing past the middle leaks in
    if kernel > 1 and m:
        b, hq = mass.shape[:2]
        x = mass.reshape(b * hq, 1, m)
        pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
        mass = pool(x, kernel, stride=1, padding=kernel // 2).reshape(b, hq, m)
    b, hq = mass.shape[:2]
    score = mass if per_query_head else mass.view(b, h, hq // h, m).mean(2)
    return score.masked_fill(~inside[:, None, :], float("-inf"))


@dataclass
class ObsRows:
    """A prefill's observation rows, detached from the :class:`~kvdex.storage.MiddleUpdate` that carried
    them (``prompt_rows`` reads the same two fields)."""

    obs_queries: torch.Tensor  # [B, Hq, W, D]
    obs_valid: torch.Tensor  # [B, W]


def obs_rows(update) -> ObsRows:
    """A compact copy of ``update``'s observation rows, to keep from the prefill to the first decode step.

    ``update.obs_queries`` is a slice of the layer's whole prompt queries [B, Hq, L, D]: keeping the
    update (or the slice) keeps all L rows alive, for every sparse layer, until decoding starts --
    twice the KV bytes with 32 query / 8 kv heads (Llama-3.1-8B), all of it during the prefill.
    """
    q = update.obs_queries.clone(memory_format=torch.contiguous_format)
    return ObsRows(q, update.obs_valid.clone())


class QueryRing:
    """The last ``size`` queries of one layer with their positions: q [B, Hq, size, D], oldest first."""

    def __init__(self, size: int):
        self.size = size
        self.q: torch.Tensor | None = None  # None until loaded (or the first push)
        self.pos: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def load(self, q: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> None:
        """Start from the prompt's last rows: q [B, Hq, W, D], pos / valid [B, W] (W <= size)."""
        w = q.shape[2]
        b, hq, _, d = q.shape
        self.q = ring_q = q.new_zeros(b, hq, self.size, d)
        self.pos = ring_pos = torch.zeros(b, self.size, dtype=torch.long, device=q.device)
        self.valid = ring_valid = torch.zeros(b, self.size, dtype=torch.bool, device=q.device)
        take = min(w, self.size)
        ring_q[:, :, self.size - take :] = q[:, :, w - take :]
        ring_pos[:, self.size - take :] = pos[:, w - take :].to(q.device)
        ring_valid[:, self.size - take :] = valid[:, w - take :].to(q.device)

    def push(self, q: torch.Tensor, pos: torch.Tensor, offset: int = 0) -> None:
        """One decode query per sequence: q [B, Hq, D] at positions pos + offset [B] (the sequence lengths with
        ``offset=-1``: the new token's)."""
        if self.q is None:
            b, hq, d = q.shape
            self.load(q.new_zeros(b, hq, 0, d), pos.new_zeros(b, 0), torch.zeros(b, 0, dtype=torch.bool))
        # in place: the buffers keep their identity, so a captured CUDA graph (kvdex.hf.graph)
        # that pushes reads and writes the same ring on every replay; on CUDA one Triton launch
        push = triton_kernel("query_ring_triton", "ring_push_", on=q) or ring_push_reference
        push(*self.buffers(), q, pos, offset)

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, pos, valid) of a loaded ring."""
        if self.q is None or self.pos is None or self.valid is None:
            raise RuntimeError("QueryRing read before it was loaded (load or push first)")
        return self.q, self.pos, self.valid


def step_joins(stores, layers) -> bool:
    """Whether a page joins the middle of any sequence in the coming decode step (the stores of ``layers``
    hold the same lengths; False without sparse layers)."""
    return bool(layers) and page_joins(stores[layers[0]])


class RefreshSchedule:
    """The observation state of a policy that re-scores the middle from its query ring every ``refresh`` decode
    steps (PRKV's Algorithm 1, SnapKV+), owned by the policy (made in ``bind``):

    * ``pending``: layer -> the prompt's observation rows (:func:`obs_rows`), until the layer's first decode step;
    * ``rings``: layer -> its :class:`QueryRing`; ``steps``: layer -> decode steps counted so far;
    * ``refreshes``: layer -> the decode steps at which it re-scored; ``scales``: layer -> its attention scale.

    The refresh of step t (t = T, 2T, ...) runs in :meth:`before_step` (the policy's ``before_step``), before
    the step's first layer, so that the step replays its CUDA graph; the policy's ``select`` runs it
    (:meth:`due`, :meth:`refresh_layer`) where ``before_step`` did not (the policy driven directly) or waited: a
    layer whose ``waits_for_joins`` says so refreshes after a page joins the middle in that step.
    ``rebuild(layer, store, scale)`` is the policy's re-scoring; ``active``: whether the policy refreshes at all.
    """

    def __init__(
        self,
        refresh: int,
        active: bool,
        sparse_layers: Sequence[int],
        rebuild: Callable[[int, LayerStore, float], None],
        waits_for_joins: Callable[[int], bool],
    ) -> None:
        self.refresh, self.active, self.sparse_layers = refresh, active, tuple(sparse_layers)
        self.rebuild, self.waits_for_joins = rebuild, waits_for_joins
        self.pending: dict[int, ObsRows] = {}
        self.rings: dict[int, QueryRing] = {}
        self.steps: dict[int, int] = {}
        self.refreshes: dict[int, list[int]] = {}
        self.scales: dict[int, float] = {}

    def start_step(self, layer: int, scale: float) -> int:
        """Count a decode step of ``layer`` that selects and keep its scale; the step's index (0 = the first)."""
        step = self.steps.get(layer, 0)
        self.steps[layer] = step + 1
        self.scales[layer] = scale
        return step

    def count_step(self, layer: int) -> None:
        """Count a decode step of ``layer`` that reuses a selection (or replays a captured graph)."""
        self.steps[layer] = self.steps.get(layer, 0) + 1

    def replayed(self) -> None:
        """A captured decode step replayed: every sparse layer counts it."""
        for layer in self.sparse_layers:
            self.count_step(layer)

    def due(self, layer: int, step: int) -> bool:
        """``layer`` refreshes before its decode step ``step`` (T, 2T, ...) and has not yet."""
        done = self.refreshes.get(layer)
        return bool(step) and step % self.refresh == 0 and layer in self.rings and not (done and done[-1] == step)

    def refresh_layer(self, layer: int, store: LayerStore, scale: float, step: int) -> None:
        self.rebuild(layer, store, scale)
        self.refreshes.setdefault(layer, []).append(step)

    def before_step(self, stores: Sequence[LayerStore]) -> None:
        """The refresh of every layer that is due, before the step's first layer (its graph then replays)."""
        if not self.active or self.pending:
            return
        joins = None
        for layer in self.sparse_layers:
            step = self.steps.get(layer, 0)
            if not self.due(layer, step):
                continue
            if self.waits_for_joins(layer):
                joins = step_joins(stores, self.sparse_layers) if joins is None else joins
                if joins:
                    continue  # select refreshes it, after the join (that step eagerly)
            self.refresh_layer(layer, stores[layer], self.scales[layer], step)

    def graph_key(self) -> tuple:
        """Identity of the rings' buffers (a captured step pushes into them in place)."""
        return tuple((lay, id(r.q), id(r.pos), id(r.valid)) for lay, r in sorted(self.rings.items()))
