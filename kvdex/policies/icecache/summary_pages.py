"""IceCache's device semantic pages, ``search="summary"`` (kvdex.policies.icecache; not the paper's): made at a
layer's first use from the prefill's trees (``build="tree"``) or built on the device inside the prefill
(``build="device"``, :mod:`kvdex.index.leaf_pages`), then window pages join them on the device (eagerly in
``index``, or inside a captured step: ``reserve`` / ``joined`` / ``index_join``).

:class:`SummaryPages` owns every anchor layer's :class:`~kvdex.index.summary.SemanticPages`, the promotions drawn
ahead for the next anchor layer and the device builds' timings; it takes the prefill builds from the policy's
:class:`~kvdex.policies.icecache.tree_jobs.TreeJobs` and adds its builds and insertions to the counters.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvdex.config import CacheConfig
from kvdex.index.dci import DCIParams
from kvdex.index.leaf_pages import leaf_page_table, promoted
from kvdex.index.summary import SemanticPages
from kvdex.index.workers import pool
from kvdex.policies.icecache.tree_jobs import TreeJobs, table_key
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin


class SummaryPages:
    """The semantic pages of one IceCache policy's anchor layers (``anchor_of``: layer -> its anchor layer).
    ``summary``: the page summary kind; ``params``: the trees' parameters (promotions, parents)."""

    def __init__(
        self,
        cfg: CacheConfig,
        params: DCIParams,
        *,
        summary: str,
        anchor_of: dict[int, int],
        tree_jobs: TreeJobs,
        stats: dict,
    ) -> None:
        self.cfg = cfg
        self.params = params
        self.summary = summary
        self.anchor_of = anchor_of
        self.tree_jobs = tree_jobs
        self.stats = stats
        self.pages: dict[int, SemanticPages] = {}  # layer -> its pages on the device
        self.build_times: list[Any] = []  # build="device": seconds, or CUDA events around each build
        self.promotions: dict = {}  # build="device": (layer, n, D) -> future of the next layer's promotions

    def pages_of(self, layer: int, store: LayerStore) -> SemanticPages:
        """The layer's semantic pages on the device: made at its first use from the prefill's trees (the
        build joined here) and the prefill keys."""
        pages = self.pages.get(layer)
        if pages is not None:
            return pages
        memo_key, keys, ready, first, trees = self.tree_jobs.take_prefill(layer)
        B, H, g = store.batch, store.kv_heads, self.cfg
        # the table made from the shared prefill trees by a fork of the same prefill (host tensors, read only)
        memo = self.tree_jobs.memo
        key = table_key(memo_key, self.summary, store.dtype)
        table = memo.get(key) if memo is not None and memo_key is not None else None
        if table is None and keys is not None and trees is not None:
            if ready is not None:
                ready.synchronize()
            firsts = [first.get(b, 0) for b in range(B)]
            table = SemanticPages.host_table(trees, keys, firsts, self.summary, g.page_size, store.dtype, H)
            if memo is not None and memo_key is not None:
                memo[key] = table
        if table is None:
            pages = SemanticPages(B, H, store.head_dim, g.page_size, 64, self.summary, store.dtype, store.device)
        else:
            pages = SemanticPages.from_table(table, self.summary, g.page_size, store.dtype, store.device, B, H)
        self.pages[layer] = pages
        return pages

    def device_build(self, layer: int, update: MiddleUpdate, per_b: dict[int, torch.Tensor]) -> None:
        """``build="device"``: the layer's leaf pages made on the keys' device at prefill
        (:func:`~kvdex.index.leaf_pages.leaf_page_table`: the trees' promotions, exact parents; one host
        sync, the table's size). Forks of one prefill share the table through the memo, each decoding
        into its own copy."""
        keys, ps = update.keys, self.cfg.page_size
        B, H, D = keys.shape[0], keys.shape[1], keys.shape[-1]
        memo = self.tree_jobs.memo
        key = (*self.tree_jobs.memo_key(layer, per_b, (B, H)), "leaf-pages", self.summary, str(keys.dtype))
        table = None if memo is None else memo.get(key)
        if table is None:
            t0 = time.perf_counter()
            cuda = keys.device.type == "cuda"
            stream = torch.cuda.current_stream(keys.device) if cuda else None
            ev = [torch.cuda.Event(enable_timing=True) for _ in "ab"] if cuda else None
            if ev:
                ev[0].record(stream)
            n = (update.count * ps).repeat_interleave(H)
            first = (self.cfg.sink + update.start * ps).repeat_interleave(H)
            seeds = self.row_seeds(layer, H, B)
            prom = self.promoted(layer, seeds, n, B, H, D)
            table = leaf_page_table(keys.reshape(B * H, -1, D), n, first, seeds, self.params, self.summary, prom)
            if ev:
                ev[1].record(stream)
            self.build_times.append(ev or time.perf_counter() - t0)  # device time on CUDA (stats: built_s)
            self.stats["build_keys"] += int(n.sum())
            self.stats["builds"] += 1
            if memo is not None:
                memo[key] = table
        else:
            self.stats["builds_reused"] += 1
        share = memo is not None  # the memo's table stays as built
        self.pages[layer] = SemanticPages.from_table(table, self.summary, ps, keys.dtype, keys.device, B, H, share)

    def row_seeds(self, layer: int, heads: int, batch: int) -> torch.Tensor:
        """[batch * heads]: the seed of each (sequence, kv head) row's tree of ``layer``."""
        return torch.tensor(self.tree_jobs.seeds(layer, heads)).repeat(batch)

    def promoted(self, layer: int, seeds: torch.Tensor, n: torch.Tensor, B: int, H: int, D: int) -> torch.Tensor:
        """The promotions of ``layer``'s trees (:func:`~kvdex.index.leaf_pages.promoted`, host work: tens of
        ms at 128k keys), drawn on an index worker while an earlier layer ran, and the next anchor layer's
        submitted now: they need only the row lengths, which a prefill shares across layers, so the host
        draws them while the device runs this layer's attention instead of the device waiting for them."""
        key = (tuple(n.tolist()), B, H, D)
        fut = self.promotions.pop((layer, *key), None)
        later = [lay for lay, a in sorted(self.anchor_of.items()) if a == lay and lay > layer]
        if later:
            nxt = later[0]
            job = pool(1, "promote").submit(promoted, self.params, self.row_seeds(nxt, H, B), n, D)
            self.promotions = {(nxt, *key): job}
        return fut.result() if fut is not None else promoted(self.params, seeds, n, D)

    def built_s(self) -> float:
        """Seconds the device builds took (CUDA: between events around each build's work, one sync)."""
        out = 0.0
        for t in self.build_times:
            if isinstance(t, float):
                out += t
            else:
                t[1].synchronize()
                out += t[0].elapsed_time(t[1]) / 1e3
        return out

    def insert(self, layer: int, update: MiddleUpdate) -> None:
        """A window page joins the middle (eager path: ``index``)."""
        t0 = time.perf_counter()
        assert update.store is not None, "a page joins without its store"
        pages = self.pages_of(layer, update.store)
        ps, dev = self.cfg.page_size, pages.device
        for j in range(update.keys.shape[2]):  # one page per step while decoding
            ok = update.count > j
            if not bool(ok.any()):
                continue
            pos = self.cfg.sink + (update.start + j)[:, None] * ps + torch.arange(ps)[None, :]
            pages.insert(update.keys[:, :, j], pos.to(dev, non_blocking=True), ok)
            self.stats["inserts"] += 1
        self.stats["insert_s"] += time.perf_counter() - t0

    # ---- page joins inside a captured decode step (Policy.capturable_index) ------------------------------
    def reserve(self, layer: int, pages: int, store: LayerStore) -> None:
        """The layer's semantic pages (the prefill build joined here, outside any captured step) with room
        for the joins until every sequence holds ``pages`` middle pages (one semantic page per row and join
        at most). Called with the current count (``pages`` not ahead of the store) it reserves nothing
        beyond :meth:`joined`'s growth, as the eager ``index`` path."""
        if self.anchor_of.get(layer) != layer:
            return
        sp = self.pages_of(layer, store)
        nmid = store.grid.num_middle_pages(store.lengths_host).to(torch.long)
        if pages > int(nmid.max()):
            sp.ensure(int((sp.rows + (pages - nmid).clamp(min=0)).max()))

    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        sp = self.pages.get(layer)
        if sp is None or self.anchor_of.get(layer) != layer:
            return
        sp.joined(count > 0)
        self.stats["inserts"] += 1

    def index_join(self, layer: int, join: PageJoin) -> None:
        sp = self.pages.get(layer)
        if sp is None or self.anchor_of.get(layer) != layer:
            return
        sp.insert_device(join.keys[:, :, 0], join.positions, join.joins)
