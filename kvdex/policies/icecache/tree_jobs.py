"""IceCache's host DCI trees and their background jobs (kvdex.policies.icecache; Algorithm 1 lines 5-10 and
26-36): the build at prefill and the insertions while decoding, on worker threads, joined by :meth:`TreeJobs.sync`
(a layer's next step) or :meth:`TreeJobs.flush`; forks of one prefill share the prefill's builds through the
memo (:meth:`TreeJobs.share`).

:class:`TreeJobs` owns the trees of every anchor layer, the jobs not applied yet, the insertion random streams,
the per-layer step counts, the layers' stores (placement of inserted tokens) and the fork memo; it adds its
build, insertion and wait times to the policy's counters (``stats``, guarded by ``lock`` where a worker writes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from kvdex.config import CacheConfig
from kvdex.index.dci import DCIParams, DCITree
from kvdex.index.device_search import DeviceSearch
from kvdex.index.trees import update_trees
from kvdex.index.workers import cpu_threads, pool, to_host
from kvdex.storage import LayerStore, MiddleUpdate


def page_positions(cfg: CacheConfig, update: MiddleUpdate) -> dict[int, torch.Tensor]:
    """{sequence: the positions of its middle pages in ``update``} (the sequences with pages only)."""
    start, count = update.start.clone(), update.count.clone()
    per_b = {}
    for b in torch.nonzero(count).flatten().tolist():
        first = cfg.sink + int(start[b]) * cfg.page_size
        per_b[b] = torch.arange(first, first + int(count[b]) * cfg.page_size)
    return per_b


def table_key(memo_key: Any, summary: str, dtype: torch.dtype) -> tuple:
    """The memo key of the semantic page table made from the prefill build ``memo_key`` (keys of ``dtype``)."""
    return ("icecache-summary", memo_key, summary, str(dtype))


class TreeJobs:
    """The DCI trees of one IceCache policy. ``params``: the trees' parameters; ``seed``: their random streams'
    base; ``search`` / ``summary``: the policy's options (what a job stages, what the summary pages need);
    ``threads``: the worker threads (0: the cores we may use); ``head_offset``: the model's index of kv head 0
    (tensor parallelism); ``device``: the device search, which takes the jobs' staged copies."""

    def __init__(
        self,
        cfg: CacheConfig,
        params: DCIParams,
        *,
        seed: int,
        search: str,
        summary: str,
        threads: int,
        head_offset: int,
        device: DeviceSearch,
        stats: dict,
        lock: threading.Lock,
    ) -> None:
        self.cfg = cfg
        self.params = params
        self.seed = seed
        self.search = search
        self.summary = summary
        self.threads = threads
        self.head_offset = head_offset
        self.device = device
        self.stats = stats
        self.lock = lock
        self.trees: dict[int, list[DCITree | None]] = {}
        self.jobs: dict[int, deque] = {}  # layer -> (future, {b: positions}, step) not applied yet
        self.clamped: dict[int, int] = {}  # layer -> inserted keys longer than c (ranked by cosine)
        self.gens: dict[int, dict[int, torch.Generator]] = {}  # layer -> tree -> insertion random stream
        self.selects: dict[int, int] = {}  # decode steps (selects) seen per layer
        self.stores: dict[int, LayerStore] = {}  # layer -> its store (semantic placement of inserted tokens)
        self.memo: dict | None = None  # shared by the forks of one prefill (share)
        self.prefill_builds: dict = {}  # memo key -> future of this policy's prefill build
        self.prefill_keys: dict = {}  # search="summary": layer -> the prefill keys on the host (summaries)

    def memo_key(self, layer: int, per_b: dict, shape: tuple) -> tuple:
        g = self.cfg
        rows = tuple((b, int(p[0]), p.numel()) for b, p in sorted(per_b.items()))
        return ("icecache", layer, self.params, self.seed, g.sink, g.page_size, g.window, shape, rows)

    def submit(self, layer: int, update: MiddleUpdate, per_b: dict[int, torch.Tensor]) -> None:
        """A job that builds (prefill) or extends (a page left the window) the trees of ``layer``."""
        q = self.jobs.setdefault(layer, deque())
        prev = q[-1][0] if q else None
        step = self.selects.get(layer, 0)  # the job is due at the layer's next step (deterministic)
        base = None if prev is not None else self.trees.get(layer)
        memo_key = fut = None
        if prev is None and base is None:  # the prefill build: a fork of the same prefill may have it
            memo_key = self.memo_key(layer, per_b, tuple(update.keys.shape[:2]))
            fut = self.memo.get(memo_key) if self.memo is not None else None
        # search="summary": the page summaries are made from the prefill keys with the trees (no copy of the
        # keys when a fork of the same prefill made the table already: SummaryPages.pages_of)
        if self.search == "summary":
            key = table_key(memo_key, self.summary, update.keys.dtype)
            need = memo_key is None or self.memo is None or key not in self.memo
        else:
            need = fut is None  # a reused build needs no keys
        keys, ready = to_host(update.keys) if need else (None, None)
        if self.search == "summary":
            self.prefill_keys[layer] = (memo_key, keys, ready, {b: int(p[0]) for b, p in per_b.items()})
        if fut is not None:
            self.stats["builds_reused"] += 1
            q.append((fut, per_b, step))
            return
        fut = pool(self.threads or cpu_threads()).submit(
            self.index_job, layer, keys, ready, per_b, prev, base, update.keys.shape[1]
        )
        if memo_key is not None:
            self.prefill_builds[memo_key] = fut
            if self.memo is not None:
                self.memo.setdefault(memo_key, fut)
        q.append((fut, per_b, step))

    def share(self, memo: dict) -> None:
        """Forks of one prefill share its builds through ``memo`` (``Policy.share_index``)."""
        self.memo = memo
        for key, fut in self.prefill_builds.items():
            memo.setdefault(key, fut)

    def index_job(self, layer, keys, ready, per_b, prev: Future | None, base, heads: int):
        """Worker thread: build or extend the trees of one layer; returns (trees, placements)."""
        if prev is not None:
            base = prev.result()[0]
        if ready is not None:
            ready.synchronize()
        t0 = time.perf_counter()
        trees = list(base) if base is not None else [None] * (keys.shape[0] * heads)
        seeds = self.seeds(layer, heads)
        stage = self.search == "device" or (self.search == "auto" and ready is not None)
        pin = (ready is not None) if base is not None and stage else None  # staged copies for the device mirror
        gens = self.gens.setdefault(layer, {})
        placements, staged, built, inserted = update_trees(trees, keys, per_b, self.params, seeds, gens, pin)
        dt = time.perf_counter() - t0
        with self.lock:
            s = self.stats
            if built:
                s["build_s"] += dt
                s["build_keys"] += built
                s["builds"] += 1
            else:
                s["insert_s"] += dt
                s["inserts"] += inserted
        return trees, placements, staged

    def seeds(self, layer: int, heads: int) -> list[int]:
        # One random stream per (layer, kv head), the same for every sequence of a batch: a sequence
        # gets the same tree in a batch as alone; the model's head index, so a tensor-parallel rank
        # builds the trees one process builds for its heads.
        return [self.seed + 7919 * layer + self.head_offset + h for h in range(heads)]

    def flush(self) -> None:
        """Wait for every pending index job and apply it (tests, benchmarks, end of generation)."""
        for layer, q in self.jobs.items():
            store = self.stores.get(layer)
            while q:
                self.apply(layer, q.popleft()[0], store)

    def apply(self, layer: int, fut: Future, store: LayerStore | None) -> None:
        t0 = time.perf_counter()
        trees, placements, staged = fut.result()
        self.stats["wait_s"] += time.perf_counter() - t0
        if staged:  # the latest staged copy of each tree (an older one no longer matches the snapshot)
            self.device.staged.setdefault(layer, {}).update(staged)
        trees = list(trees)  # the list may be shared with forks (share); the trees are immutable
        self.trees[layer] = trees
        self.clamped[layer] = sum(t.clamped for t in trees if t is not None)
        if store is not None and store.places_pages:
            for b, h, pages, slots, pos in placements:
                store.place(b, h, pages, slots, pos)  # type: ignore[attr-defined]  # places_pages: a semantic store

    def sync(self, layer: int, store: LayerStore) -> list[torch.Tensor]:
        """Apply the index jobs of ``layer`` submitted before this step (joining them if they are
        still running: the first build, or an insertion slower than a whole decode step); return,
        per sequence, the positions evicted during this step (not in the tree yet: attended only
        when the budget covers every middle token)."""
        q = self.jobs.get(layer)
        now = self.selects.get(layer, 0)
        self.selects[layer] = now + 1
        while q:
            fut, _, step = q[0]
            if step == now and self.trees.get(layer) is not None:
                break  # evicted during this very step: attended explicitly, inserted by the next step
            self.apply(layer, q.popleft()[0], store)
        pending: list[list[torch.Tensor]] = [[] for _ in range(store.batch)]
        for _, per_b, _ in q or ():
            for b, pos in per_b.items():
                pending[b].append(pos)
        return [torch.cat(p) if p else torch.empty(0, dtype=torch.long) for p in pending]

    def take_prefill(self, layer: int) -> tuple:
        """The prefill build of ``layer`` joined and handed over (search="summary": the pages are made from it
        once): (memo key, host keys, their copy event, {b: first position}, trees)."""
        for fut, _, _ in self.jobs.pop(layer, ()):
            self.apply(layer, fut, None)
        memo_key, keys, ready, first = self.prefill_keys.pop(layer, (None, None, None, {}))
        trees = self.trees.pop(layer, None)
        return memo_key, keys, ready, first, trees
