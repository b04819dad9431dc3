"""``snapkv``: SnapKV (Li et al., 2024) -- the prompt's observation window picks the tokens to keep.

The last ``obs`` prompt queries (the observation window) vote for earlier tokens with their
attention weights (mean over the window; GQA per query head then averaged over the group,
:mod:`kvdex.policies.observation`); the votes are pooled along the sequence (``kernel``, max pooling: SnapKV's
clustering, so a selected token brings its neighbours) and the top ``budget - sink - window``
middle tokens per kv head are kept. SnapKV compresses the prompt once, at prefill, and never
recalls a dropped token; every token after the prefill's middle (SnapKV's kept window and the
tokens generated afterwards) stays, as in SnapKV (its cache grows by one token per step), so with
``refresh=0`` the attended set is the budget plus the tokens that have left the window since.

``refresh=T > 0`` is SnapKV+ (PRKV §5.1/§5.3: "SnapKV with the full cache reserved and updated
periodically"): every T decode steps the selection is recomputed over the whole context from the
last ``obs`` queries (prompt rows, then decode queries), and between refreshes the attended set is
sink + the selected tokens + window -- exactly the budget. PRKV with S = 1 equals it.

The votes are computed at the layer's first decode step (the store is needed to see every key);
that is the first moment the selection is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.kernels.scoring import topk_ids
from kvdex.policies.base import JoinFreePolicy, PolicyInfo
from kvdex.policies.observation import QueryRing, RefreshSchedule, check_kernel, middle_scores, obs_rows
from kvdex.policies.registry import register_policy
from kvdex.selection import Selection
from kvdex.storage import LayerStore, MiddleUpdate
from kvdex.view import LayerView


def check_obs(obs: int, refresh: int) -> None:
    if not isinstance(obs, int) or isinstance(obs, bool) or obs < 1:
        raise ValueError(f"obs (observation window, queries) must be an int >= 1, got {obs!r}")
    if not isinstance(refresh, int) or isinstance(refresh, bool) or refresh < 0:
        raise ValueError(f"refresh must be an int >= 0 (0 = never, SnapKV; T > 0 = SnapKV+), got {refresh!r}")


def prompt_rows(update, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, positions, valid) of the prefill's observation queries; ``lengths`` = prompt lengths [B]."""
    q = update.obs_queries
    w = q.shape[2]
    pos = lengths.to(q.device)[:, None] - w + torch.arange(w, device=q.device)[None, :]
    return q, pos.clamp(min=0), update.obs_valid.to(q.device) & (pos >= 0)


@register_policy
@dataclass
class SnapKVPolicy(JoinFreePolicy):
    name = "snapkv"
    capturable = True
    # JoinFreePolicy: a page joining the middle needs no index work (the prompt's choice is fixed; with
    # refresh=0 the joined tokens are kept by _kept, read from the store's lengths; else they wait for the
    # next refresh)
    granularity = "token"

    obs: int = 32  # observation window (SnapKV's window_size)
    kernel: int = 7  # pooling kernel along the sequence (1 = none)
    pooling: Literal["max", "avg"] = "max"
    refresh: int = 0  # 0: SnapKV (prompt only); T > 0: SnapKV+ (re-select every T decode steps)

    def __post_init__(self) -> None:
        super().__post_init__()  # the Literal options' choices (Policy.__post_init__)
        check_obs(self.obs, self.refresh)
        check_kernel(self.kernel)

    @property
    def obs_window(self) -> int:
        """The prompt's last ``obs`` queries are kept for ``index`` at prefill."""
        return self.obs

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        # SnapKV+'s re-selection schedule, the prompt's observation rows and the query rings: a page that joins
        # the middle in a refresh step is re-selected with the rest (nothing else would reach it before the next)
        self.schedule = RefreshSchedule(self.refresh, bool(self.refresh), info.sparse_layers, self._choose,
                                        lambda layer: True)  # fmt: skip
        self.chosen: dict[int, torch.Tensor] = {}  # layer -> [B, H, n] positions, -1 padded
        self.kept_from: dict[int, torch.Tensor] = {}  # layer -> [B] end of the prefill's middle
        self._kept_host: dict[int, list[int]] = {}  # the same on the host (CUDA-graph decoding)
        self._kept_w: dict[int, int] = {}  # layer -> static width of the kept tokens (CUDA-graph decoding)

    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.obs_queries is not None:
            self.schedule.pending[layer] = obs_rows(update)  # not the update: it holds the whole prompt's queries

    # ---- CUDA-graph decoding (kvdex.engine.graphs) ------------------------------------------------
    # The first decode step (the prompt's votes) runs eagerly; every refresh-th step (SnapKV+) re-selects
    # before the step (before_step, on the queries up to the step before) and replays like the
    # others, which only push the query into the ring (in place) and read the chosen tokens (a buffer that a
    # refresh rewrites in place) and, with refresh=0, the tokens kept since the prefill: a -1-padded
    # width computed from host lengths that grows in steps of >= 256 tokens (a new graph key), not
    # with every page.
    _KEPT_GROW = 256

    def rebuild_period(self) -> int:
        """SnapKV+ re-selects every ``refresh`` steps, before the step."""
        return self.refresh

    def before_step(self, stores: Sequence[LayerStore]) -> None:
        self.schedule.before_step(stores)

    def graph_key(self, stores: Sequence[LayerStore]) -> tuple | None:
        sched = self.schedule
        if sched.pending:
            return None
        for layer in self.info.sparse_layers:
            step = sched.steps.get(layer, 0)
            if self.refresh and (layer not in sched.rings or sched.due(layer, step)):
                return None
            if self.refresh == 0 and layer in self.kept_from:
                self._kept_width(layer, stores[layer], ahead=1)
        chosen = tuple((lay, id(t), tuple(t.shape)) for lay, t in sorted(self.chosen.items()))
        return ("snapkv", sched.graph_key(), chosen, tuple(sorted(self._kept_w.items())))

    def graph_replayed(self) -> None:
        self.schedule.replayed()

    def _kept_width(self, layer, store, ahead: int = 0) -> int:
        """Static width of the kept tokens of ``layer``: >= their count ``ahead`` tokens from now."""
        widths = self._kept_w
        end = store.grid.window_start(store.lengths_host + ahead)
        need = max([0] + [e - k for e, k in zip(end.tolist(), self._kept_host[layer], strict=True)])
        w = widths.get(layer, 0)
        if need > w:
            widths[layer] = w = max(need, w + max(self._KEPT_GROW, w // 4))
        return w

    def _choose(self, layer, store, scale) -> None:
        ring_q, ring_pos, ring_valid = self.schedule.rings[layer].buffers()
        s = middle_scores(ring_q, ring_pos, ring_valid, store.dense_keys(), store.lengths, store.grid, scale,
                          self.kernel, self.pooling, lengths_host=store.lengths_host)  # fmt: skip
        if self.refresh == 0 and layer in self.kept_from:
            # SnapKV compresses the prompt's middle only: positions from kept_from on are kept by _kept
            # (when the first decode token starts a page, the middle already reaches past kept_from;
            # choosing them here too attended those tokens twice)
            pos = store.grid.sink + torch.arange(s.shape[-1], device=s.device)
            s = s.masked_fill(pos[None, None, :] >= self.kept_from[layer].to(s.device)[:, None, None], float("-inf"))
        ids = topk_ids(s, self.cfg.retrieval_tokens)
        chosen = torch.where(ids >= 0, ids + store.grid.sink, -1)
        cur = self.chosen.get(layer)
        if cur is not None and cur.shape == chosen.shape:  # in place: a captured CUDA graph reads it
            cur.copy_(chosen)
        else:
            self.chosen[layer] = chosen

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        layer, store, scale = view.layer, view.store, view.scale
        sched = self.schedule
        step = sched.start_step(layer, scale)
        if layer in sched.pending:  # first decode step: the prompt is lengths - 1 tokens
            prompt = view.lengths - 1
            self.kept_from[layer] = view.grid.window_start(prompt)
            self._kept_host[layer] = view.grid.window_start(view.lengths_host - 1).tolist()  # the same, host ints
            sched.rings[layer] = ring = QueryRing(self.obs)
            ring.load(*prompt_rows(sched.pending.pop(layer), prompt))
            self._choose(layer, store, scale)
        if self.refresh:
            if sched.due(layer, step):  # before_step did not run (the policy driven directly)
                sched.refresh_layer(layer, store, scale, step)
            ring = sched.rings.setdefault(layer, QueryRing(self.obs))
            ring.push(q, view.lengths, offset=-1)
        chosen = self.chosen.get(layer, view.no_ids(q.device))
        if self.refresh == 0 and layer in self.kept_from:
            chosen = torch.cat([chosen, self._kept(view)], dim=-1)
        return Selection(tokens=chosen)

    def _kept(self, view) -> torch.Tensor:
        """Middle positions past the prefill's middle (SnapKV keeps them all): [B, H, n], -1 padded."""
        start = self.kept_from[view.layer]
        end = view.window_start
        if view.static:  # CUDA-graph decoding: a width from host values, grown in steps
            n = self._kept_width(view.layer, view.store)
        else:
            n = int((end - start).clamp(min=0).max())
        pos = start[:, None] + torch.arange(n, device=start.device)[None, :]
        pos = torch.where(pos < end[:, None], pos, -1)
        return pos[:, None, :].expand(-1, view.kv_heads, -1)
