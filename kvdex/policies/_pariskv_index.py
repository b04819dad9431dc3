"""ParisKV's index buffers (kvdex.policies.pariskv): the per-layer device summary (:class:`_LayerIndex`),
its growth, the frozen mean key of ``center=True``, and the page joins inside a captured decode step
(``Policy.capturable_index``).

:class:`IndexMixin` holds the methods; :class:`~kvdex.policies.pariskv.ParisKVPolicy` owns the state
(``index_``, ``means``, ``_done_dev``, set in ``bind``) and its ``index`` encodes the prefill's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.kernels import pariskv as K

_GROW = 4096  # tokens of index capacity added at a time


@dataclass
class _LayerIndex:
    """The device-resident summary of one layer's middle tokens, slot j == position sink + j."""

    ids: torch.Tensor  # uint8 [B, H, cap, nsub]
    codes: torch.Tensor  # uint8 [B, H, cap, D/2]
    weight: torch.Tensor  # bf16  [B, H, cap, D/m]
    counts: torch.Tensor  # int32 [B, H, nsub, 2**m] keys per centroid
    n: torch.Tensor  # int64 [B] (CPU) encoded tokens per sequence


class IndexMixin:
    """The index-buffer methods of :class:`~kvdex.policies.pariskv.ParisKVPolicy`."""

    # ---- page joins inside a captured decode step (Policy.capturable_index) ---------------------------
    # The page that joins (at most one per sequence) is encoded with fixed shapes and written at the device
    # start of each joining sequence; its centroid counts are added under the device mask; the encoded
    # token count ``n`` (CPU) is the host side (``joined``). center=True: a sequence whose mean key is not
    # set yet (no middle at prefill) takes it from its first joining page, under a device flag.
    def reserve_index(self, layer, pages, store) -> None:
        if pages <= 0:
            return
        like = torch.empty(store.batch, store.kv_heads, 0, 1, device=store.device)
        self._reserve(layer, pages * store.grid.page_size, like)
        if self.center and layer not in self.means:
            self.means[layer] = (torch.zeros(store.batch, store.kv_heads, self.info.head_dim, device=store.device),
                                 torch.zeros(store.batch, dtype=torch.bool))  # fmt: skip
        if self.center and layer not in self._done_dev:
            self._done_dev[layer] = self.means[layer][1].to(store.device, copy=True)

    def joined(self, layer, start, count) -> None:
        ps = self.cfg.page_size
        if layer in self.index_:
            n = self.index_[layer].n
            n.copy_(torch.where(count > 0, torch.maximum(n, (start + count) * ps), n))
        if self.center and layer in self.means:
            self.means[layer][1].logical_or_(count > 0)

    def index_join(self, layer, join) -> None:
        if layer not in self.index_:
            return
        b, h, _, ps, d = join.keys.shape
        keys = join.keys.reshape(b, h, ps, d)
        valid = join.joins[:, None].expand(b, ps)
        if self.center:
            mu, done = self.means[layer][0], self._done_dev[layer]
            w = valid.float()
            mean = torch.einsum("bn,bhnd->bhd", w, keys.float()) / w.sum(1).clamp(min=1)[:, None, None]
            mu.copy_(torch.where((join.joins & ~done)[:, None, None], mean, mu))
            done.logical_or_(join.joins)
            keys = keys.float() - mu[:, :, None, :]
        signs, thresholds, centers = self.consts(keys.device)[:3]
        ids, codes, weight = K.encode_keys(keys, signs, self.m, thresholds, centers)
        ids = self.assign(layer, keys, ids, valid)
        idx = self.index_[layer]
        join.write(idx.ids, ids)
        join.write(idx.codes, codes)
        join.write(idx.weight, weight)
        live = valid[:, None, :].expand(b, h, ps).reshape(b * h, ps)
        idx.counts += K.cluster_counts(ids.reshape(b * h, ps, -1), live, 1 << self.m).view(idx.counts.shape)

    def key_mean(self, layer: int, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``center=True``: the frozen mean key per (sequence, kv head) [B, H, d] fp32. A sequence's mean
        is set from the first update that holds keys of it (the prefill) and never changes after."""
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

    def _reserve(self, layer: int, tokens: int, like: torch.Tensor) -> _LayerIndex:
        cur = self.index_.get(layer)
        cap = 0 if cur is None else cur.ids.shape[2]
        if tokens > cap:
            b, h, dev = like.shape[0], like.shape[1], like.device
            new_cap = max(tokens, cap + max(_GROW, cap // 4))
            nsub = self.num_sub
            new = _LayerIndex(
                ids=torch.zeros(b, h, new_cap, nsub, dtype=torch.uint8, device=dev),
                codes=torch.zeros(b, h, new_cap, self.rot_dim // 2, dtype=torch.uint8, device=dev),
                weight=torch.zeros(b, h, new_cap, nsub, dtype=torch.bfloat16, device=dev),
                counts=torch.zeros(b, h, nsub, 1 << self.m, dtype=torch.int32, device=dev)
                if cur is None
                else cur.counts,
                n=torch.zeros(b, dtype=torch.long) if cur is None else cur.n,
            )
            if cur is not None:
                new.ids[:, :, :cap], new.codes[:, :, :cap], new.weight[:, :, :cap] = cur.ids, cur.codes, cur.weight
            self.index_[layer] = new
        return self.index_[layer]
