"""PRKV's static set (kvdex.policies.prkv; Algorithm 1): the tokens of each layer's middle that the last
``obs`` queries attend most, relocated to the front of the middle and attended every step as whole pages
plus a ragged tail.

:class:`StaticSet` owns, per layer, the origin map (``origin``: which position each middle slot holds since
the relocations), the static token counts (``counts``), the ``auto`` split (Appendix G) and the static
region's part of a statically sized selection (``regions``); :meth:`StaticSet.restructure` runs Algorithm 1
on a layer's store and rewrites the page ``digests`` of the restructured pages. :func:`split_budget` sizes
the static part (its choice of rounding: the module docstring of :mod:`kvdex.policies.prkv.policy`).
"""

from __future__ import annotations

import math

import torch

from kvdex.kernels.scoring import group_topk, topk_ids
from kvdex.policies.digest import DigestIndex
from kvdex.policies.observation import QueryRing, middle_scores
from kvdex.policies.prkv.region import StaticRegion
from kvdex.storage import Grid, LayerStore


def split_budget(retrieval: int, page_size: int, static_ratio: float) -> tuple[int, int]:
    """(static tokens, dynamic pages) for a retrieval budget of ``retrieval`` tokens."""
    if static_ratio == 0:
        return 0, retrieval // page_size
    static = page_size * math.floor(static_ratio * retrieval / page_size + 1e-9) + retrieval % page_size
    return static, (retrieval - static) // page_size


def swap_order(is_static: torch.Tensor, origin: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The ``relocate="swap"`` order [B, H, m] (slot j takes the token in slot ``order[..., j]``): the static slots
    (``is_static`` [B, H, m], within each sequence's middle of ``own`` [B, 1, 1] slots) move to the front in
    position order (``origin``: the position - sink each slot holds), each token they displace from the front takes
    a slot a static token left (both in slot order), and every other token stays where it is."""
    b, h, m = is_static.shape
    j = torch.arange(m, device=is_static.device)
    st = is_static & (j < own)
    cnt = st.sum(-1, keepdim=True)
    far = 2 * m + j  # past every origin: sorts last, each value once
    front = j < cnt
    order = torch.where(front, torch.where(st, origin, far).argsort(-1), j)  # the front takes the statics
    displaced = torch.where(front & ~st, j, far).argsort(-1)  # front slots of other tokens, first
    vacated = torch.where(~front & st, j, far).argsort(-1)  # static slots past the front, first
    pair = j < (front & ~st).sum(-1, keepdim=True)
    out = torch.cat([order, order.new_zeros(b, h, 1)], -1)  # a spare column takes the unpaired scatters
    out.scatter_(-1, torch.where(pair, vacated, m), torch.where(pair, displaced, 0))
    return out[..., :m]


class StaticSet:
    """The static sets of one PRKV policy's sparse layers. ``n_static`` / ``n_dynamic``: the split of the
    retrieval budget (``auto``: per layer, :meth:`auto_split` at its first restructure); the scoring options
    of Algorithm 1 (``static_group``, ``kernel``, ``pooling``, ``obs_tokens``); ``digests``: the dynamic
    pages' index, rewritten for the restructured pages."""

    def __init__(
        self,
        *,
        n_static: int,
        n_dynamic: int,
        auto: bool,
        retrieval_tokens: int,
        static_group: str,
        kernel: int,
        pooling: str,
        obs_tokens: str,
        digests: DigestIndex,
        relocate: str = "shift",
    ) -> None:
        self.n_static = n_static
        self.n_dynamic = n_dynamic
        self.auto = auto
        self.retrieval_tokens = retrieval_tokens
        self.static_group = static_group
        self.kernel = kernel
        self.pooling = pooling
        self.obs_tokens = obs_tokens
        self.digests = digests
        self.relocate = relocate
        self.split: dict[int, tuple[int, int]] = {}  # layer -> (static tokens, dynamic pages) under "auto"
        self.origin: dict[int, torch.Tensor] = {}  # layer -> [B, H, M]: position - sink of the token in middle slot j
        self.restructured: dict[int, int] = {}  # layer -> middle slots its last restructure ordered
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [B] static tokens (at the front of the middle)
        # layer -> its static region's part of a selection (StaticRegion), a function of
        # counts[layer] alone: built once, rewritten in place when a refresh rewrites the count
        self.regions: dict[int, StaticRegion] = {}

    def layer_split(self, layer: int) -> tuple[int, int]:
        """(static tokens, dynamic pages) of ``layer``."""
        return self.split.get(layer, (self.n_static, self.n_dynamic)) if self.auto else (self.n_static, self.n_dynamic)

    def count(self, layer: int, batch: int, device: torch.device) -> torch.Tensor:
        """[B] static tokens of ``layer`` (at the front of its middle)."""
        return self.counts.get(layer, torch.zeros(batch, dtype=torch.long, device=device))

    def reserve(self, layer: int, tokens: int, store: LayerStore) -> None:
        """Room in ``layer``'s origin map for ``tokens`` middle slots: slots past the restructured ones map to
        themselves (identity), so the map only grows when the middle outgrows what was reserved."""
        cur = self.origin.get(layer)
        have = 0 if cur is None else cur.shape[2]
        if have >= tokens:
            return
        tokens = max(tokens, have + have // 4)  # grown, not reserved: by a quarter at least, as the digests
        buf = torch.arange(tokens, device=store.device).expand(store.batch, store.kv_heads, -1).clone()
        if cur is not None:
            buf[:, :, :have] = cur
        self.origin[layer] = buf

    def origin_map(self, layer: int) -> torch.Tensor:
        """[B, H, M] the position - sink each of the M middle slots of ``layer``'s last restructure holds."""
        return self.origin[layer][:, :, : self.restructured[layer]]

    def _origin(self, layer: int, store: LayerStore, m: int) -> torch.Tensor:
        """[B, H, m] origin map (a view of the layer's buffer; identity for pages that joined the middle since)."""
        self.reserve(layer, m, store)
        return self.origin[layer][:, :, :m]

    def restructure(self, layer: int, store: LayerStore, scale: float, ring: QueryRing | None) -> None:
        """Algorithm 1 on ``layer``'s ``store``: score the middle by the attention of ``ring``'s queries, take
        the top tokens per kv head and move them to the front of the middle."""
        g = store.grid
        m = int(g.num_middle_pages(store.lengths_host).max()) * g.page_size
        if m == 0 or ((not self.auto or layer in self.split) and not self.layer_split(layer)[0]):
            return
        origin = self._origin(layer, store, m)  # the keys are scored where they are, by their positions
        k = store.dense_keys()
        assert ring is not None, "a restructure before the layer's query ring"
        if self.auto and layer not in self.split:
            self.split[layer] = self.auto_split(ring, k, origin, store, scale)
        n_static = self.layer_split(layer)[0]
        if not n_static:
            return
        heads = self.static_group == "heads"
        ring_q, ring_pos, ring_valid = ring.buffers()
        score = middle_scores(ring_q, ring_pos, ring_valid, k, store.lengths, g, scale, self.kernel, self.pooling,
                              per_query_head=heads, origin=origin, lengths_host=store.lengths_host)  # fmt: skip
        if self.obs_tokens == "last":
            score = _demote_observed(score, ring, g.sink)
        # [B, H, n] positions - sink, -1 padded
        top = group_topk(score, store.kv_heads, n_static, "heads") if heads else topk_ids(score, n_static)
        is_static = torch.zeros(store.batch, store.kv_heads, m + 1, dtype=torch.bool, device=k.device)
        is_static.scatter_(2, torch.where(top >= 0, top, m), True)
        is_static = is_static[:, :, :m].gather(2, origin)  # per slot
        j = torch.arange(m, device=k.device)
        own = (g.num_middle_pages(store.lengths) * g.page_size)[:, None, None]
        if self.relocate == "swap":  # static tokens to the front, the tokens there into the slots they left
            order = swap_order(is_static, origin, own)
        else:  # static tokens by position, then the rest in their current order, then the slots past a
            # sequence's middle in place
            key = torch.where(is_static, origin, m + j)
            key = torch.where(j < own, key, 2 * m + j)
            order = key.argsort(dim=-1, stable=True)
        # page representations of the restructured pages, from the keys already on the device: a store whose
        # buffers hold every token (dense() is a view of them) holds the moved keys once permute_middle has
        # reordered them in place; from another store's dense copy they are gathered before.
        if store.positional_slots:
            store.permute_middle(order, validate=False)  # a permutation, tails in place
            moved = store.k[:, :, g.sink : g.sink + m]
        else:
            moved = k[:, :, g.sink : g.sink + m].gather(2, order[..., None].expand(-1, -1, -1, k.shape[-1]))
            store.permute_middle(order, validate=False)  # a permutation, tails in place
        origin.copy_(origin.gather(2, order))  # in the layer's buffer (origin is a view of it)
        self.restructured[layer] = m
        count = (top >= 0).sum(-1)[:, 0]  # same count for every kv head of a sequence
        if layer in self.counts:  # in place: a captured CUDA graph reads this buffer
            self.counts[layer].copy_(count)
        else:
            self.counts[layer] = count
        self.region(layer, g, refresh=True)  # the static region's selection part, in place too
        pages = moved.reshape(store.batch, store.kv_heads, m // g.page_size, g.page_size, -1)
        nmid = g.num_middle_pages(store.lengths_host)
        self.digests.write(layer, torch.zeros_like(nmid), nmid, pages)

    def auto_split(
        self, ring: QueryRing, k: torch.Tensor, origin: torch.Tensor, store: LayerStore, scale: float
    ) -> tuple[int, int]:
        """Appendix G: overlap of the top-r middle tokens of the first and the last window query."""
        g, r = store.grid, self.retrieval_tokens
        overlaps = []
        ring_q, ring_pos, ring_valid = ring.buffers()
        for b in range(store.batch):
            rows = torch.nonzero(ring_valid[b]).flatten().tolist()
            if not rows:
                continue
            picks = []
            for i in (rows[0], rows[-1]):
                one = torch.zeros_like(ring_valid[b : b + 1])
                one[0, i] = True
                s = middle_scores(ring_q[b : b + 1], ring_pos[b : b + 1], one, k[b : b + 1], store.lengths[b : b + 1],
                                  g, scale, per_query_head=True, origin=origin[b : b + 1])  # fmt: skip
                picks.append(topk_ids(s, r))  # [1, Hq, r]
            for h in range(picks[0].shape[1]):
                a, c = set(picks[0][0, h].tolist()) - {-1}, set(picks[1][0, h].tolist()) - {-1}
                overlaps.append(len(a & c))
        mean = sum(overlaps) / max(1, len(overlaps))
        ps = g.page_size
        static = min(r, ps * math.floor(mean / ps))
        return static, (r - static) // ps

    def region(self, layer: int, grid: Grid, refresh: bool = False) -> StaticRegion | None:
        """The static region's part of a selection of ``layer`` (None before the layer has a static count). Built
        from the count at the layer's first restructure; ``refresh``: rebuilt in place (the count changed), so a
        captured step that reads it stays valid."""
        n = self.counts.get(layer)
        if n is None:
            return None
        cur = self.regions.get(layer)
        if cur is not None and not refresh:
            return cur
        new = StaticRegion.of(n, self.layer_split(layer)[0], grid)
        if cur is None:
            self.regions[layer] = new
        else:
            cur.copy_(new)
        return self.regions[layer]

    def key(self) -> tuple:
        """The device buffers a captured step reads (the counts and the regions made from them)."""
        static = tuple((lay, id(t)) for lay, t in sorted(self.counts.items()))
        return static + tuple((lay, r.ids()) for lay, r in sorted(self.regions.items()))

    def positions(self, layer: int, slots: torch.Tensor, sink: int) -> torch.Tensor:
        """Token positions of store slots ``slots`` [B, H, N] of ``layer`` (undoes the relocation; -1 stays)."""
        org = self.origin.get(layer)
        if org is None:
            return slots
        m = org.shape[2]
        mid = (slots >= sink) & (slots < sink + m)
        mapped = org.gather(2, (slots - sink).clamp(0, m - 1).to(org.device)) + sink
        return torch.where(mid, mapped, slots)


def _demote_observed(score: torch.Tensor, ring: QueryRing, sink: int) -> torch.Tensor:
    """``score`` [B, H, M] (middle tokens by position - sink) with the tokens at or after the window's first
    valid query ranked below every earlier one (scores are mean softmax weights in [0, 1]: minus 2 keeps
    them finite, so a budget that covers every earlier token still takes them)."""
    big = torch.iinfo(torch.long).max
    _, ring_pos, ring_valid = ring.buffers()
    first = torch.where(ring_valid, ring_pos, big).amin(-1)  # [B]
    pos = sink + torch.arange(score.shape[-1], device=score.device)
    late = pos[None, :] >= first.to(score.device)[:, None]  # [B, M]
    return torch.where(late[:, None, :], score - 2.0, score)
