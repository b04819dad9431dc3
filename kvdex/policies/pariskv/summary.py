"""ParisKV's key summary: per sparse layer, the device-resident codes of every middle key
(:class:`LayerSummary`: centroid ids, 4-bit direction codes, weights, keys per centroid), their growth,
the frozen mean key of ``center=True`` and the page joins inside a captured decode step.

:class:`KeySummary` owns this state. The policy encodes keys (``kvdex.kernels.pariskv.encode_keys``, then
its own centroid assignment) and hands the codes to :meth:`KeySummary.write` (prefill, eager page joins)
or :meth:`KeySummary.write_join` (a page joining inside a captured step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.kernels import pariskv as K
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin, grown_capacity

_GROW = 4096  # tokens of summary capacity added at a time (less below it: storage.grown_capacity)


@dataclass
class LayerSummary:
    """The device-resident summary of one layer's middle tokens, slot j == position sink + j."""

    ids: torch.Tensor  # uint8 [B, H, cap, nsub]
    codes: torch.Tensor  # uint8 [B, H, cap, D/2]
    weight: torch.Tensor  # bf16  [B, H, cap, D/m]
    counts: torch.Tensor  # int32 [B, H, nsub, 2**m] keys per centroid
    n: torch.Tensor  # int64 [B] (CPU) encoded tokens per sequence


class KeySummary:
    """Every sparse layer's :class:`LayerSummary` (``layers``) and, with ``center=True``, the frozen mean
    key per (sequence, kv head) (``means``: layer -> (mu [B, H, d] fp32, set [B] bool CPU); ``done_dev``:
    the set flags on the device, for page joins inside a captured step)."""

    def __init__(self, num_sub: int, code_bytes: int, m: int, head_dim: int, page_size: int, center: bool) -> None:
        self.num_sub, self.code_bytes, self.m = num_sub, code_bytes, m
        self.head_dim, self.page_size, self.center = head_dim, page_size, center
        self.layers: dict[int, LayerSummary] = {}
        self.means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.done_dev: dict[int, torch.Tensor] = {}

    def __contains__(self, layer: int) -> bool:
        return layer in self.layers

    def __getitem__(self, layer: int) -> LayerSummary:
        return self.layers[layer]

    # ---- capacity ------------------------------------------------------------------------------------
    def reserve(self, layer: int, tokens: int, batch: int, heads: int, device: torch.device) -> LayerSummary:
        """``layer``'s summary with room for ``tokens`` middle tokens per sequence (grown by ``_GROW`` tokens or
        a quarter at a time, less while small: :func:`~kvdex.storage.grown_capacity`; the keys-per-centroid counts
        and ``n`` carry over)."""
        cur = self.layers.get(layer)
        cap = 0 if cur is None else cur.ids.shape[2]
        if tokens > cap:
            new_cap = grown_capacity(tokens, cap, _GROW)
            new = LayerSummary(
                ids=torch.zeros(batch, heads, new_cap, self.num_sub, dtype=torch.uint8, device=device),
                codes=torch.zeros(batch, heads, new_cap, self.code_bytes, dtype=torch.uint8, device=device),
                weight=torch.zeros(batch, heads, new_cap, self.num_sub, dtype=torch.bfloat16, device=device),
                counts=torch.zeros(batch, heads, self.num_sub, 1 << self.m, dtype=torch.int32, device=device)
                if cur is None
                else cur.counts,
                n=torch.zeros(batch, dtype=torch.long) if cur is None else cur.n,
            )
            if cur is not None:
                new.ids[:, :, :cap], new.codes[:, :, :cap], new.weight[:, :, :cap] = cur.ids, cur.codes, cur.weight
            self.layers[layer] = new
        return self.layers[layer]

    def reserve_pages(self, layer: int, pages: int, store: LayerStore) -> None:
        """Room for ``pages`` middle pages per sequence (``Policy.reserve_index``, outside a captured step);
        with ``center=True`` the mean buffers and their device flags exist from here on."""
        if pages <= 0:
            return
        self.reserve(layer, pages * store.grid.page_size, store.batch, store.kv_heads, store.device)
        if self.center and layer not in self.means:
            self.means[layer] = (torch.zeros(store.batch, store.kv_heads, self.head_dim, device=store.device),
                                 torch.zeros(store.batch, dtype=torch.bool))  # fmt: skip
        if self.center and layer not in self.done_dev:
            self.done_dev[layer] = self.means[layer][1].to(store.device, copy=True)

    # ---- writes --------------------------------------------------------------------------------------
    def write(
        self, layer: int, update: MiddleUpdate, ids: torch.Tensor, codes: torch.Tensor, weight: torch.Tensor
    ) -> None:
        """The codes of ``update``'s pages (ids / codes / weight [B, H, pages x page_size, ...]) at each
        sequence's slots (the prefill, or pages joining outside a captured step)."""
        ps = update.keys.shape[3]
        start, count = update.start * ps, update.count * ps
        b, h = ids.shape[:2]
        idx = self.reserve(layer, int((start + count).max()), b, h, ids.device)
        for bi in torch.nonzero(update.count).flatten().tolist():
            s, c = int(start[bi]), int(count[bi])
            idx.ids[bi, :, s : s + c] = ids[bi, :, :c]
            idx.codes[bi, :, s : s + c] = codes[bi, :, :c]
            idx.weight[bi, :, s : s + c] = weight[bi, :, :c]
            valid = torch.ones(h, c, dtype=torch.bool, device=ids.device)
            idx.counts[bi] += K.cluster_counts(ids[bi, :, :c], valid, 1 << self.m)
            idx.n[bi] = max(int(idx.n[bi]), s + c)

    # Page joins inside a captured decode step (Policy.capturable_index): the page that joins (at most one per
    # sequence) is encoded with fixed shapes and written at the device start of each joining sequence; its
    # centroid counts are added under the device mask; the encoded token count ``n`` (CPU) is the host side
    # (``joined``). center=True: a sequence whose mean key is not set yet (no middle at prefill) takes it from
    # its first joining page, under a device flag.
    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        """Host bookkeeping of a captured step's joins (``Policy.joined``)."""
        if layer in self.layers:
            n = self.layers[layer].n
            n.copy_(torch.where(count > 0, torch.maximum(n, (start + count) * self.page_size), n))
        if self.center and layer in self.means:
            self.means[layer][1].logical_or_(count > 0)

    def join_keys(self, layer: int, join: PageJoin) -> tuple[torch.Tensor, torch.Tensor]:
        """The joining pages' keys [B, H, page_size, d] to encode (centred with ``center=True``, the mean of a
        sequence without one set from them first) and which are real [B, page_size]."""
        b, h, _, ps, d = join.keys.shape
        keys = join.keys.reshape(b, h, ps, d)
        valid = join.joins[:, None].expand(b, ps)
        if self.center:
            mu, done = self.means[layer][0], self.done_dev[layer]
            w = valid.float()
            mean = torch.einsum("bn,bhnd->bhd", w, keys.float()) / w.sum(1).clamp(min=1)[:, None, None]
            mu.copy_(torch.where((join.joins & ~done)[:, None, None], mean, mu))
            done.logical_or_(join.joins)
            keys = keys.float() - mu[:, :, None, :]
        return keys, valid

    def write_join(
        self, layer: int, join: PageJoin, ids: torch.Tensor, codes: torch.Tensor, weight: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:  # fmt: skip
        """The codes of the joining pages (:meth:`join_keys`' keys, encoded) at each joining sequence's slots."""
        idx = self.layers[layer]
        b, h, ps = ids.shape[:3]
        join.write(idx.ids, ids)
        join.write(idx.codes, codes)
        join.write(idx.weight, weight)
        live = valid[:, None, :].expand(b, h, ps).reshape(b * h, ps)
        idx.counts += K.cluster_counts(ids.reshape(b * h, ps, -1), live, 1 << self.m).view(idx.counts.shape)

    # ---- center=True -------------------------------------------------------------------------------
    def key_mean(self, layer: int, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The frozen mean key per (sequence, kv head) [B, H, d] fp32. A sequence's mean is set from the first
        update that holds keys of it (the prefill) and never changes after."""
        b, h, _, d = keys.shape
        if layer not in self.means:
            self.means[layer] = (torch.zeros(b, h, d, device=keys.device), torch.zeros(b, dtype=torch.bool))
        mu, done = self.means[layer]
        w = valid.to(keys.device, torch.float32)  # [B, N]
        fresh = (~done) & valid.any(1)
        if fresh.any():
            mean = torch.einsum("bn,bhnd->bhd", w, keys.float()) / w.sum(1).clamp(min=1)[:, None, None]
            mu[fresh.to(mu.device)] = mean[fresh.to(mu.device)]
            done |= fresh
        return mu

    def graph_buffers(self) -> tuple:
        """Identity and shape of every persistent tensor a captured step reads (a re-allocation is a new key)."""
        return tuple(
            (lay, id(i.ids), tuple(i.ids.shape), id(i.codes), id(i.weight), id(i.counts))
            for lay, i in sorted(self.layers.items())
        ) + tuple((lay, id(self.means[lay][0]), id(d)) for lay, d in sorted(self.done_dev.items()))
