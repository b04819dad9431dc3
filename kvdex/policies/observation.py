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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.reference import attention_mass_reference, ring_push_reference
from kvdex.storage import page_joins

POOLINGS = ("max", "avg")


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
    if key_pos is not None:  # by position: slot j's mass to position - sink origin[j]
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
        self.q = self.pos = self.valid = None

    def load(self, q: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> None:
        """Start from the prompt's last rows: q [B, Hq, W, D], pos / valid [B, W] (W <= size)."""
        w = q.shape[2]
        b, hq, _, d = q.shape
        self.q = q.new_zeros(b, hq, self.size, d)
        self.pos = torch.zeros(b, self.size, dtype=torch.long, device=q.device)
        self.valid = torch.zeros(b, self.size, dtype=torch.bool, device=q.device)
        take = min(w, self.size)
        self.q[:, :, self.size - take :] = q[:, :, w - take :]
        self.pos[:, self.size - take :] = pos[:, w - take :].to(q.device)
        self.valid[:, self.size - take :] = valid[:, w - take :].to(q.device)

    def push(self, q: torch.Tensor, pos: torch.Tensor, offset: int = 0) -> None:
        """One decode query per sequence: q [B, Hq, D] at positions pos + offset [B] (the sequence lengths with
        ``offset=-1``: the new token's)."""
        if self.q is None:
            b, hq, d = q.shape
            self.load(q.new_zeros(b, hq, 0, d), pos.new_zeros(b, 0), torch.zeros(b, 0, dtype=torch.bool))
        # in place: the buffers keep their identity, so a captured CUDA graph (kvdex.hf.graph)
        # that pushes reads and writes the same ring on every replay; on CUDA one Triton launch
        push = triton_kernel("step_triton", "ring_push_", on=q) or ring_push_reference
        push(self.q, self.pos, self.valid, q, pos, offset)


def step_joins(stores, layers) -> bool:
    """Whether a page joins the middle of any sequence in the coming decode step (the stores of ``layers``
    hold the same lengths; False without sparse layers)."""
    return bool(layers) and page_joins(stores[layers[0]])


class ObsRefresh:
    """The periodic refresh of a policy that re-scores the middle from its query ring every ``refresh`` decode
    steps (PRKV's Algorithm 1, SnapKV+). The refresh of step t (t = T, 2T, ...) runs in ``before_step``, before
    the step's first layer, so that the step replays its CUDA graph; ``select`` runs it where ``before_step`` did
    not (the policy driven directly) or waited: a layer that :meth:`_waits_for_joins` refreshes after a page
    joins the middle in that step. The policy holds ``refresh``, ``steps``, ``refreshes``, ``scales``,
    ``rings``, ``pending`` and ``info`` and defines :meth:`_refreshing`, :meth:`_rebuild` and
    :meth:`_waits_for_joins`."""

    def _refreshing(self) -> bool:
        raise NotImplementedError

    def _rebuild(self, layer: int, store, scale: float) -> None:
        raise NotImplementedError

    def _waits_for_joins(self, layer: int) -> bool:
        """A page that joins the middle in a refresh step must be part of ``layer``'s refresh (no later
        selection could reach it before the next one)."""
        raise NotImplementedError

    def _refresh_due(self, layer: int, step: int) -> bool:
        """``layer`` refreshes before its decode step ``step`` (T, 2T, ...) and has not yet."""
        done = self.refreshes.get(layer)
        return bool(step) and step % self.refresh == 0 and layer in self.rings and not (done and done[-1] == step)

    def _refresh(self, layer: int, store, scale: float, step: int) -> None:
        self._rebuild(layer, store, scale)
        self.refreshes.setdefault(layer, []).append(step)

    def before_step(self, stores) -> None:
        """The refresh of every layer that is due, before the step's first layer (its graph then replays)."""
        if not self._refreshing() or self.pending:
            return
        joins = None
        for layer in self.info.sparse_layers:
            step = self.steps.get(layer, 0)
            if not self._refresh_due(layer, step):
                continue
            if self._waits_for_joins(layer):
                joins = step_joins(stores, self.info.sparse_layers) if joins is None else joins
                if joins:
                    continue  # select refreshes it, after the join (that step eagerly)
            self._refresh(layer, stores[layer], self.scales[layer], step)
