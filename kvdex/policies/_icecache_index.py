"""IceCache's index upkeep (kvdex.policies.icecache): the background tree jobs (build at prefill,
insertions while decoding, on worker threads; joined by ``flush`` / ``_sync``; shared by forks through
``_memo_key``) and, with ``search="summary"``, the device semantic pages made from the prefill's trees
(``build="tree"``) or built on the device at prefill (``build="device"``, :mod:`kvdex.index.leaf_pages`).

:class:`IndexJobsMixin` holds the methods; :class:`~kvdex.policies.icecache.IceCachePolicy` owns the
state (``_jobs``, ``_trees``, ``_pages``, ``_stats``, set in ``bind``) and submits the jobs in ``index``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from kvdex.index.leaf_pages import leaf_page_table, promoted
from kvdex.index.summary import SemanticPages
from kvdex.index.trees import update_trees
from kvdex.index.workers import pool


class IndexJobsMixin:
    """The index-upkeep methods of :class:`~kvdex.policies.icecache.IceCachePolicy`."""

    # ---- background tree jobs (Algorithm 1 lines 5-10 and 26-36, on worker threads) -------------------
    def _memo_key(self, layer: int, per_b: dict, shape: tuple) -> tuple:
        g = self.cfg
        rows = tuple((b, int(p[0]), p.numel()) for b, p in sorted(per_b.items()))
        return ("icecache", layer, self.params, self.seed, g.sink, g.page_size, g.window, shape, rows)

    def _index_job(self, layer, keys, ready, per_b, prev: Future | None, base, heads: int):
        """Worker thread: build or extend the trees of one layer; returns (trees, placements)."""
        if prev is not None:
            base = prev.result()[0]
        if ready is not None:
            ready.synchronize()
        t0 = time.perf_counter()
        trees = list(base) if base is not None else [None] * (keys.shape[0] * heads)
        seeds = self._seeds(layer, heads)
        stage = self.search == "device" or (self.search == "auto" and ready is not None)
        pin = (ready is not None) if base is not None and stage else None  # staged copies for the device mirror
        gens = self._gens.setdefault(layer, {})
        placements, staged, built, inserted = update_trees(trees, keys, per_b, self.params, seeds, gens, pin)
        dt = time.perf_counter() - t0
        with self._lock:
            s = self._stats
            if built:
                s["build_s"] += dt
                s["build_keys"] += built
                s["builds"] += 1
            else:
                s["insert_s"] += dt
                s["inserts"] += inserted
        return trees, placements, staged

    def _seeds(self, layer: int, heads: int) -> list[int]:
        # One random stream per (layer, kv head), the same for every sequence of a batch: a sequence
        # gets the same tree in a batch as alone; the model's head index, so a tensor-parallel rank
        # builds the trees one process builds for its heads.
        return [self.seed + 7919 * layer + self.info.head_offset + h for h in range(heads)]

    def flush(self) -> None:
        """Wait for every pending index job and apply it (tests, benchmarks, end of generation)."""
        for layer, q in self._jobs.items():
            store = self._stores.get(layer)
            while q:
                self._apply(layer, q.popleft()[0], store)

    def _apply(self, layer, fut: Future, store) -> None:
        t0 = time.perf_counter()
        trees, placements, staged = fut.result()
        self._stats["wait_s"] += time.perf_counter() - t0
        if staged:  # the latest staged copy of each tree (an older one no longer matches the snapshot)
            self._device.staged.setdefault(layer, {}).update(staged)
        trees = list(trees)  # the list may be shared with forks (share_index); the trees are immutable
        self._trees[layer] = trees
        self._clamped[layer] = sum(t.clamped for t in trees if t is not None)
        if store is not None and store.places_pages:
            for b, h, pages, slots, pos in placements:
                store.place(b, h, pages, slots, pos)

    def _sync(self, layer, store) -> list[torch.Tensor]:
        """Apply the index jobs of ``layer`` submitted before this step (joining them if they are
        still running: the first build, or an insertion slower than a whole decode step); return,
        per sequence, the positions evicted during this step (not in the tree yet: attended only
        when the budget covers every middle token)."""
        q = self._jobs.get(layer)
        now = self._selects.get(layer, 0)
        self._selects[layer] = now + 1
        while q:
            fut, _, step = q[0]
            if step == now and self._trees.get(layer) is not None:
                break  # evicted during this very step: attended explicitly, inserted by the next step
            self._apply(layer, q.popleft()[0], store)
        pending = [[] for _ in range(store.batch)]
        for _, per_b, _ in q or ():
            for b, pos in per_b.items():
                pending[b].append(pos)
        return [torch.cat(p) if p else torch.empty(0, dtype=torch.long) for p in pending]

    # ---- search="summary": the device semantic pages ----------------------------------------------------
    def _pages_of(self, layer, store) -> SemanticPages:
        """The layer's semantic pages on the device: made at its first use from the prefill's trees (the
        build joined here) and the prefill keys."""
        pages = self._pages.get(layer)
        if pages is not None:
            return pages
        for fut, _, _ in self._jobs.pop(layer, ()):
            self._apply(layer, fut, None)
        memo_key, keys, ready, first = self._prefill_keys.pop(layer, (None, None, None, {}))
        trees = self._trees.pop(layer, None)
        B, H, g = store.batch, store.kv_heads, self.cfg
        # the table made from the shared prefill trees by a fork of the same prefill (host tensors, read only)
        key = self._table_key(memo_key, store.dtype)
        table = self._memo.get(key) if self._memo is not None and memo_key is not None else None
        if table is None and keys is not None and trees is not None:
            if ready is not None:
                ready.synchronize()
            firsts = [first.get(b, 0) for b in range(B)]
            table = SemanticPages.host_table(trees, keys, firsts, self.summary, g.page_size, store.dtype, H)
            if self._memo is not None and memo_key is not None:
                self._memo[key] = table
        if table is None:
            pages = SemanticPages(B, H, store.head_dim, g.page_size, 64, self.summary, store.dtype, store.device)
        else:
            pages = SemanticPages.from_table(table, self.summary, g.page_size, store.dtype, store.device, B, H)
        self._pages[layer] = pages
        return pages

    def _device_build(self, layer, update, per_b) -> None:
        """``build="device"``: the layer's leaf pages made on the keys' device at prefill
        (:func:`~kvdex.index.leaf_pages.leaf_page_table`: the trees' promotions, exact parents; one host
        sync, the table's size). Forks of one prefill share the table through the memo, each decoding
        into its own copy."""
        keys, ps = update.keys, self.cfg.page_size
        B, H, D = keys.shape[0], keys.shape[1], keys.shape[-1]
        key = (*self._memo_key(layer, per_b, (B, H)), "leaf-pages", self.summary, str(keys.dtype))
        table = None if self._memo is None else self._memo.get(key)
        if table is None:
            t0 = time.perf_counter()
            cuda = keys.device.type == "cuda"
            stream = torch.cuda.current_stream(keys.device) if cuda else None
            ev = [torch.cuda.Event(enable_timing=True) for _ in "ab"] if cuda else None
            if ev:
                ev[0].record(stream)
            n = (update.count * ps).repeat_interleave(H)
            first = (self.cfg.sink + update.start * ps).repeat_interleave(H)
            seeds = self._row_seeds(layer, H, B)
            prom = self._promoted(layer, seeds, n, B, H, D)
            table = leaf_page_table(keys.reshape(B * H, -1, D), n, first, seeds, self.params, self.summary, prom)
            if ev:
                ev[1].record(stream)
            self._build_times.append(ev or time.perf_counter() - t0)  # device time on CUDA (stats: _built_s)
            self._stats["build_keys"] += int(n.sum())
            self._stats["builds"] += 1
            if self._memo is not None:
                self._memo[key] = table
        else:
            self._stats["builds_reused"] += 1
        share = self._memo is not None  # the memo's table stays as built
        self._pages[layer] = SemanticPages.from_table(table, self.summary, ps, keys.dtype, keys.device, B, H, share)

    def _row_seeds(self, layer: int, heads: int, batch: int) -> torch.Tensor:
        """[batch * heads]: the seed of each (sequence, kv head) row's tree of ``layer``."""
        return torch.tensor(self._seeds(layer, heads)).repeat(batch)

    def _promoted(self, layer: int, seeds: torch.Tensor, n: torch.Tensor, B: int, H: int, D: int) -> torch.Tensor:
        """The promotions of ``layer``'s trees (:func:`~kvdex.index.leaf_pages.promoted`, host work: tens of
        ms at 128k keys), drawn on an index worker while an earlier layer ran, and the next anchor layer's
        submitted now: they need only the row lengths, which a prefill shares across layers, so the host
        draws them while the device runs this layer's attention instead of the device waiting for them."""
        key = (tuple(n.tolist()), B, H, D)
        fut = self._promotions.pop((layer, *key), None)
        later = [lay for lay, a in sorted(self.anchor_of.items()) if a == lay and lay > layer]
        if later:
            nxt = later[0]
            job = pool(1, "promote").submit(promoted, self.params, self._row_seeds(nxt, H, B), n, D)
            self._promotions = {(nxt, *key): job}
        return fut.result() if fut is not None else promoted(self.params, seeds, n, D)

    def _built_s(self) -> float:
        """Seconds the device builds took (CUDA: between events around each build's work, one sync)."""
        out = 0.0
        for t in self._build_times:
            if isinstance(t, float):
                out += t
            else:
                t[1].synchronize()
                out += t[0].elapsed_time(t[1]) / 1e3
        return out

    def _table_key(self, memo_key, dtype) -> tuple:
        """The memo key of the semantic page table made from the prefill build ``memo_key`` (keys of ``dtype``)."""
        return ("icecache-summary", memo_key, self.summary, str(dtype))

    def _summary_insert(self, layer, update) -> None:
        """A window page joins the middle (eager path: ``index``)."""
        t0 = time.perf_counter()
        pages = self._pages_of(layer, update.store)
        ps, dev = self.cfg.page_size, pages.device
        for j in range(update.keys.shape[2]):  # one page per step while decoding
            ok = update.count > j
            if not bool(ok.any()):
                continue
            pos = self.cfg.sink + (update.start + j)[:, None] * ps + torch.arange(ps)[None, :]
            pages.insert(update.keys[:, :, j], pos.to(dev, non_blocking=True), ok)
            self._stats["inserts"] += 1
        self._stats["insert_s"] += time.perf_counter() - t0

    # ---- search="summary": page joins inside a captured decode step (Policy.capturable_index) -------------
    def reserve_index(self, layer, pages, store) -> None:
        """The layer's semantic pages (the prefill build joined here, outside any captured step) with room
        for the joins until every sequence holds ``pages`` middle pages (one semantic page per row and join
        at most). Called with the current count (``pages`` not ahead of the store) it reserves nothing
        beyond :meth:`joined`'s growth, as the eager ``index`` path."""
        if self.anchor_of.get(layer) != layer:
            return
        sp = self._pages_of(layer, store)
        nmid = store.grid.num_middle_pages(store.lengths_host).to(torch.long)
        if pages > int(nmid.max()):
            sp.ensure(int((sp.rows + (pages - nmid).clamp(min=0)).max()))

    def joined(self, layer, start, count) -> None:
        sp = self._pages.get(layer)
        if sp is None or self.anchor_of.get(layer) != layer:
            return
        sp.joined(count > 0)
        self._stats["inserts"] += 1

    def index_join(self, layer, join) -> None:
        sp = self._pages.get(layer)
        if sp is None or self.anchor_of.get(layer) != layer:
            return
        sp.insert_device(join.keys[:, :, 0], join.positions, join.joins)
