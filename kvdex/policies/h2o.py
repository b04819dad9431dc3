"""``h2o``: H2O (Zhang et al., NeurIPS 2023) -- heavy hitters by accumulated attention plus recent tokens.

H2O keeps a fixed-size cache split between the most recent tokens and the "heavy hitters", the
tokens with the largest attention accumulated over every step they stayed cached. Each step the
new token enters, the attention weights of the step are added to every cached token's score, and
the non-recent token with the lowest score is evicted for good (a greedy eviction, never recalled).

In kvdex (per kv head; sink and window are always attended, so they count towards the budget):

* recent = ``round(recent_ratio * budget)`` tokens (H2O's 50/50 split by default, at least the
  window): the window plus the newest middle tokens before it;
* heavy = ``budget - sink - recent`` middle tokens: the top scores among the non-recent tokens
  still cached; the others are marked evicted and never selected again. Picking the top-k each
  step equals H2O's greedy one-token eviction (one token leaves the recent part per step);
* scores accumulate through :meth:`observe` (the ``observes`` hook of the cache): the softmax
  weights of the step's attention over the attended set -- exactly the distribution the decode
  used -- summed over the query heads of the kv head's group (H2O scores per head; kvdex selects
  per kv head);
* prefill: H2O sums the attention each prompt token received from every prompt query. kvdex hands
  a policy the last ``obs`` prompt queries (at most 128 in a forked cache), so the prefill scores
  are the attention from those rows (ArkVale's H2O baseline used the last row only). Computed at
  the layer's first decode step, when the store is at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdex.kernels.scoring import group_reduce, topk_ids
from kvdex.policies.base import JoinFreePolicy, PolicyInfo
from kvdex.policies.observation import attention_mass, obs_rows
from kvdex.policies.registry import register_policy
from kvdex.policies.snapkv import prompt_rows
from kvdex.selection import Selection
from kvdex.storage import AttendSet, LayerStore, MiddleUpdate, grown_capacity
from kvdex.view import LayerView

_GROW = 1024  # positions of score capacity added at a time (less below it: storage.grown_capacity)


@register_policy
@dataclass
class H2OPolicy(JoinFreePolicy):
    name = "h2o"
    capturable = True  # and JoinFreePolicy: a joining page's positions already have their scores
    granularity = "token"
    observes = True

    recent_ratio: float = 0.5  # share of the budget for recent tokens (H2O: half heavy, half recent)
    obs: int = 128  # prompt queries whose attention seeds the scores at prefill

    def __post_init__(self) -> None:
        super().__post_init__()  # the Literal options' choices (Policy.__post_init__)
        if not isinstance(self.recent_ratio, (int, float)) or not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be a number in [0, 1], got {self.recent_ratio!r}")
        if not isinstance(self.obs, int) or isinstance(self.obs, bool) or self.obs < 1:
            raise ValueError(f"obs must be an int >= 1, got {self.obs!r}")

    @property
    def obs_window(self) -> int:
        """The prompt's last ``obs`` queries are kept for ``index`` at prefill."""
        return self.obs

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        c = self.cfg
        self.recent = min(max(round(self.recent_ratio * c.budget), c.window), c.budget - c.sink)
        self.heavy = c.budget - c.sink - self.recent
        self.score: dict[int, torch.Tensor] = {}  # layer -> [B, H, cap] accumulated attention per position
        self.evicted: dict[int, torch.Tensor] = {}  # layer -> [B, H, cap] bool
        self.pending: dict[int, object] = {}
        self._static = False  # the last select's store.static (observe sizes its tables the same way)

    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.obs_queries is not None:
            self.pending[layer] = obs_rows(update)  # not the update: it holds the whole prompt's queries

    def _reserve(self, layer: int, n: int, like: torch.Tensor) -> None:
        cur = self.score.get(layer)
        cap = 0 if cur is None else cur.shape[2]
        if n <= cap:
            return
        b, h = like.shape[:2]
        new_cap = grown_capacity(n, cap, _GROW)
        score = torch.zeros(b, h, new_cap, device=like.device)
        evicted = torch.zeros(b, h, new_cap, dtype=torch.bool, device=like.device)
        if cur is not None:
            score[:, :, :cap] = cur
            evicted[:, :, :cap] = self.evicted[layer]
        self.score[layer], self.evicted[layer] = score, evicted

    # ---- CUDA-graph decoding (kvdex.engine.graphs) ------------------------------------------------
    # The first decode step (prefill scores) runs eagerly, and so does a step whose position would
    # outgrow the score buffers (re-allocated: a new graph key). Otherwise, under static sizing, select
    # ranks the whole score buffer (positions past the heavy range masked by the device lengths), the
    # recent part has the fixed width ``recent`` (-1 padded), and observe's scatter-add accumulates
    # the step's attention into the persistent score buffer inside the graph.
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple | None:
        if self.pending:
            return None
        for layer in self.info.sparse_layers:
            cur = self.score.get(layer)
            if cur is None or int(stores[layer].lengths_host.max()) + 2 > cur.shape[2]:
                return None  # select reserves lengths + 1 (after this step's append): a re-allocation
        tabs = (self.score, self.evicted)
        ids = tuple((i, lay, id(t), tuple(t.shape)) for i, tab in enumerate(tabs) for lay, t in sorted(tab.items()))
        return ("h2o", *ids)

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        layer, store, h = view.layer, view.store, view.kv_heads
        static = view.static
        self._static = static
        k = None
        if layer in self.pending:
            k = store.dense_keys()
        self._reserve(layer, int(view.lengths_host.max()) + 1, q.new_zeros(view.batch, h))
        if k is not None:  # prefill scores from the prompt's last queries (the prompt is lengths - 1 tokens)
            qo, pos, valid = prompt_rows(self.pending.pop(layer), view.lengths - 1)
            mass = group_reduce(attention_mass(qo, pos, valid, k, view.lengths, view.scale), h, "sum")
            m = min(mass.shape[2], self.score[layer].shape[2])  # static: mass spans the store's whole buffer,
            self.score[layer][:, :, :m] += mass[:, :, :m]  # zero past the lengths (< the score capacity)
        ws = view.window_start  # [B]
        recent_mid = (self.recent - (view.lengths - ws)).clamp(min=0)  # middle tokens that are recent
        heavy_end = (ws - recent_mid).clamp(min=view.sink)  # [B]: middle positions before it compete
        n = self.score[layer].shape[2] if static else int(ws.max())  # static: the whole buffer, masked
        pos = torch.arange(n, device=q.device)
        cand = (pos[None, :] >= view.sink) & (pos[None, :] < heavy_end[:, None])  # [B, n]
        cand = cand[:, None, :] & ~self.evicted[layer][:, :, :n]
        score = self.score[layer][:, :, :n].masked_fill(~cand, float("-inf"))
        heavy = topk_ids(score, self.heavy)  # [B, H, heavy]
        keep = torch.zeros_like(cand)
        keep.scatter_(2, heavy.clamp(min=0), heavy >= 0)
        self.evicted[layer][:, :, :n] |= cand & ~keep  # H2O evicts for good
        width = self.recent if static else int(recent_mid.max())  # recent_mid <= recent
        rec = heavy_end[:, None] + torch.arange(width, device=q.device)[None, :]
        rec = torch.where(rec < ws[:, None], rec, -1)[:, None, :].expand(-1, h, -1)
        return Selection(tokens=torch.cat([heavy, rec], dim=-1))

    def observe(self, layer: int, q: torch.Tensor, attend_set: AttendSet, scale: float) -> None:
        a = attend_set
        b, hq, d = q.shape
        h = a.k.shape[1]
        gi = a.idx[..., None].expand(-1, -1, -1, d)
        ks = a.k.gather(2, gi).float()  # [B, H, N, D]
        s = torch.einsum("bhgd,bhnd->bhgn", q.view(b, h, hq // h, d).float(), ks) * scale
        p = torch.softmax(s.masked_fill(~a.valid[:, :, None, :], float("-inf")), dim=-1).sum(2)  # [B, H, N]
        pos = torch.where(a.valid, a.positions.long(), 0)  # padding adds 0 to position 0
        p = torch.where(a.valid, p, 0.0)
        if not self._static:  # static: select reserved lengths + 1 > every position
            self._reserve(layer, int(pos.max()) + 1, self.score[layer])
        self.score[layer].scatter_add_(2, pos.to(self.score[layer].device), p)
