"""The per-step tree searches of an IceCache layer as one batched search on the model's device
(``search="device"``): the layer's :class:`~kvdex.index.forest.DCIForest` mirror, kept up to date with
the snapshots the index jobs produce, then the forest's search and page choice, optionally replayed
through the engine's graph service (``graph_run``). No host sync (docs/policies/icecache.md, "Batched
device search")."""

from __future__ import annotations

import torch

from kvdex.index.dci import transform_queries
from kvdex.index.forest import DCIForest
from kvdex.index.pages import pad_rows


class DeviceSearch:
    """The device-side state of one policy: a mirror per layer and what its searches reuse."""

    def __init__(self) -> None:
        self.forests: dict[int, DCIForest] = {}  # layer -> device mirror of its trees
        self.staged: dict = {}  # layer -> {tree index: DCIForest.stage(...)} not mirrored yet
        self.row_idx: dict = {}  # (device, searched rows, G) -> (row index, tree of each query row) on the device
        # pages / tokens selected, summed on each layer's device (no sync; a device_map may spread the layers)
        self.counts: dict[torch.device, torch.Tensor] = {}

    def selected(self) -> tuple[int, int]:
        """(pages, tokens) the device searches selected, over every device."""
        per = [c.tolist() for c in self.counts.values()]
        return sum(p for p, _ in per), sum(t for _, t in per)

    def mirror(self, layer: int, trees, device: torch.device) -> DCIForest:
        """The layer's mirror of ``trees`` on ``device``: updated in place (with the copies staged by the
        index jobs), or built afresh."""
        forest = self.forests.get(layer)
        staged = self.staged.pop(layer, None)
        if forest is None or forest.device != device:
            forest = DCIForest(trees, device)
        else:
            forest = forest.update(trees, staged)
        self.forests[layer] = forest
        return forest

    def select(
        self,
        layer: int,
        trees,
        q: torch.Tensor,
        work: list,
        searched: list[int],
        k: int,
        fov: int,
        prop: float,
        room: int,
        cap: int,
        rule: str,
        merge: str,
        scale: float,
        graph_run=None,
    ) -> torch.Tensor:
        """Token positions [R, T] (-1 padded) for the layer's R = batch x kv heads trees and the queries
        q [B, Hq, 1, D]: rows ``searched`` from the batched search and page choice, the others from
        ``work`` (positions chosen on the host: a budget covering every key, or no tree).
        ``graph_run(layer, sig, run, qd, keep)`` runs the search through the engine's graph service
        (:meth:`kvdex.engine.graphs.service.GraphService.run`; None: eagerly)."""
        dev = q.device
        parts = []
        if searched:
            parts.append(self._search(layer, trees, q, tuple(searched), len(work), k, fov, prop, room, cap, rule,
                                      merge, scale, graph_run))  # fmt: skip
        host = [(i, r) for i, r in enumerate(work) if isinstance(r, torch.Tensor) and r.numel()]
        if host or not parts:
            pin = dev.type == "cuda"
            parts.append(pad_rows(len(work), host, pin).to(dev, non_blocking=pin))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _search(self, layer, trees, q, rows, R, k, fov, prop, room, cap, rule, merge, scale, graph_run):
        dev = q.device
        B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
        G = Hq // (R // B)
        forest = self.mirror(layer, trees, dev)
        key = (dev, rows, G)
        if key not in self.row_idx:  # long-lived: a captured graph reads them at every replay
            ridx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
            self.row_idx[key] = (ridx, ridx.repeat_interleave(G))
        ridx, tq = self.row_idx[key]
        qd = q.detach().float().reshape(R, G, D)[ridx].reshape(-1, D)

        def run(qd, forest=forest, tq=tq, ridx=ridx):
            ids, dot = forest.search(transform_queries(qd), tq, rows, k, fov, prop)
            qk_scale = forest.c[tq][:, None] * qd.norm(dim=-1, keepdim=True)
            return forest.select_pages(ids, dot, ridx, G, room, cap, rule, merge, qk_scale, scale)

        if graph_run is not None:
            sig = (forest.uid, forest.version, rows, float(scale))
            toks, npages = graph_run(layer, sig, run, qd, keep=(forest, ridx, tq))
        else:
            toks, npages = run(qd)
        out = torch.full((R, toks.shape[1]), -1, dtype=torch.long, device=dev)
        out[ridx] = toks
        counts = torch.stack([npages.sum(), (toks >= 0).sum()])
        self.counts[dev] = counts if dev not in self.counts else self.counts[dev] + counts
        return out
