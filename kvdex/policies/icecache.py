"""``icecache``: IceCache (Mao et al., 2025) -- semantic pages from a DCI-tree, per-head retrieval.

Per sparse layer and (sequence, kv head) a DCI-tree (:mod:`kvdex.index.dci`) indexes the middle
keys in the transformed space of eq. 2/3; its leaf nodes are the pages. Algorithm 1:

* prefill (``index`` with all middle pages): the keys go to the host (pinned, async) and the tree
  is built on a CPU thread pool while the GPU prefills the next layers (Figure 5b); the build is
  joined lazily at the layer's first ``select``;
* a window page leaves the window (``index`` with one page): its keys are inserted with the same
  random promotion (lines 26-36) on a worker thread while this step goes on; as in Algorithm 1
  (offload at line 17, select at line 22, insert at line 26) the page is selectable from the
  layer's next step, which joins the insertion (deterministic; it rarely has to wait);
* decode (``select``, Algorithms 3-4): every query head of a kv head's group asks the tree for its
  top-k keys by inner product (M-DCI; k = the budget, Alg. 3's k); the pages holding them are the
  selection (GQA: the union over the group, merged rank by rank), taken in order of their
  best-ranked key while they fit the retrieval budget (tokens) and ``max_pages``.

Forks (``Cache.fork``) of one prefill share its trees through :meth:`IceCachePolicy.share_index`:
the trees are immutable snapshots, so sharing them is a zero-copy, fully isolated fork.

With ``offload=True`` the layer store is a :class:`~kvdex.storage.semantic.SemanticOffloadStore`:
the host keeps every leaf page contiguous, and each step only the selected pages that are not
already on the device are gathered into pinned staging and sent in one copy (bulk loading).

``reuse=True`` is IceCache (reuse), Appendix C: trees and queries only on anchor layers (every
``reuse_every``-th sparse layer from the first); the layers in between attend the tokens selected
at the most recent anchor layer. Choices the paper leaves open are listed in docs/policies/icecache.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvdex.index.dci import DCIParams, DCITree, transform_queries
from kvdex.index.forest import DCIForest
from kvdex.policies.base import Policy, register_policy
from kvdex.selection import Selection
from kvdex.storage.semantic import HOST_TOKENS, SemanticOffloadStore

_POOLS: dict[tuple[int, str], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
# tests: a factory ``f(static_q)`` of CUDA-graph stand-ins (capture_begin / capture_end / replay) to run
# the graphs=True path on the CPU (tests/test_icecache_batched.py checks what a capture reads)
GRAPHS_ON_CPU = None


def _pool(threads: int, role: str = "index") -> ThreadPoolExecutor:
    """Shared pools per (thread count, role): index jobs (builds, insertions) and per-step tree
    searches never wait for each other; the evaluation harness forks many caches."""
    with _POOLS_LOCK:
        key = (threads, role)
        if key not in _POOLS:
            # One torch thread per worker (torch's thread count is per thread): the parallelism is
            # across trees, and `threads` workers with default intra-op teams would oversubscribe.
            _POOLS[key] = ThreadPoolExecutor(
                threads, f"kvdex-dci-{role}", initializer=torch.set_num_threads, initargs=(1,)
            )
        return _POOLS[key]


@register_policy
@dataclass
class IceCachePolicy(Policy):
    name = "icecache"
    granularity = "token"

    promotion_ratio: float = 0.0  # r; 0 -> 1 / page_size (a leaf node fills about one page)
    num_comp: int = 2  # composite indices per tree (m)
    num_simp: int = 4  # random projections per composite index (p)
    construction_fov: int = 10
    construction_prop: float = 0.25
    query_fov: int = 0  # points kept per level when selecting; 0 -> topk
    query_prop: float = 0.8
    topk: int = 0  # keys retrieved per query head (Alg. 3's k); 0 -> the budget (docs: "budget 64")
    max_pages: int = 0  # pages per kv head and step; 0 -> 2 * retrieval_pages
    norm_margin: float = 1.25
    reuse: bool = False
    reuse_every: int = 3
    threads: int = 0  # CPU threads for tree construction / insertion / search; 0 -> the cores we may use
    query_chunks: int = 1  # search tasks per tree and step (its group's query heads split); 0 -> fill the threads
    group_merge: str = "rank"  # GQA union order when it exceeds the budget: "rank" (rank-major) | "nsa" (summed probs)
    # "tokens": the attended pages fit budget - sink - window tokens (kvdex's equal-budget rule, the default);
    # "keys": the paper's accounting (Alg. 3, App. A): every page holding one of the group's top-k keys is
    # attended (at most max_pages if set), sink and window on top, so a step may attend more than the budget.
    budget_rule: str = "tokens"
    # where the per-step tree searches run: "device" = one batched search over all trees of a layer
    # (kvdex.index.forest, a mirror of the trees on q's device, no host sync), "host" = one search per
    # tree on the CPU thread pool, "auto" = device when the model runs on CUDA, else host.
    # Default "auto": on the H200 the device search passed its GPU tests, chose the same
    # pages as the host search (agreement 1.000 over 16 steps x 22 layers x 2 kv heads, Qwen2.5-0.5B, 32k)
    # and gave the same passkey answers, at 128 ms/step of tree queries against the host's 190-320
    # (docs/policies/icecache.md).
    search: str = "auto"
    # search=device on CUDA: capture each layer's batched search + page choice as a CUDA graph (one
    # launch instead of ~300 small kernels), re-captured when the layer's mirror changes (an insertion).
    # Default on (GPU test: selections == the eager device search; 54-68 ms/step of
    # queries against 111-130 eager, same machine); no effect on the host search or on the CPU.
    graphs: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.promotion_ratio < 1.0:
            raise ValueError(f"promotion_ratio must be in (0, 1) (0 = 1/page_size), got {self.promotion_ratio}")
        for name in ("num_comp", "num_simp", "construction_fov", "reuse_every"):
            _check_int(name, getattr(self, name), 1)
        for name in ("query_fov", "topk", "max_pages", "threads", "seed", "query_chunks"):
            _check_int(name, getattr(self, name), 0)
        for name in ("construction_prop", "query_prop"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if self.norm_margin < 1.0:
            raise ValueError(f"norm_margin must be >= 1 (c must bound every key norm), got {self.norm_margin}")
        if self.group_merge not in ("rank", "nsa"):
            raise ValueError(f"group_merge must be 'rank' or 'nsa', got {self.group_merge!r}")
        if self.budget_rule not in ("tokens", "keys"):
            raise ValueError(f"budget_rule must be 'tokens' or 'keys', got {self.budget_rule!r}")
        if self.search not in ("auto", "device", "host"):
            raise ValueError(f"search must be 'auto', 'device' or 'host', got {self.search!r}")
        if not isinstance(self.graphs, bool):
            raise ValueError(f"graphs must be True or False, got {self.graphs!r}")
        self._lock = threading.Lock()  # (again in bind) stats shared by the search threads

    # ---- set-up ------------------------------------------------------------------------------------
    def bind(self, info) -> None:
        super().bind(info)
        ps = self.cfg.page_size
        self.params = DCIParams(
            promotion_ratio=self.promotion_ratio or 1.0 / ps,
            num_comp=self.num_comp,
            num_simp=self.num_simp,
            construction_fov=self.construction_fov,
            construction_prop=self.construction_prop,
            page_size=ps,
            norm_margin=self.norm_margin,
            seed=self.seed,
        )
        sparse = info.sparse_layers
        every = self.reuse_every if self.reuse else 1
        self.anchor_of = {lay: sparse[(i // every) * every] for i, lay in enumerate(sparse)}
        self._trees: dict[int, list[DCITree | None]] = {}
        self._jobs: dict[int, deque] = {}  # layer -> (future, {b: positions}, step) not applied yet
        self._clamped: dict[int, int] = {}  # layer -> inserted keys longer than c (ranked by cosine)
        self._gens: dict[tuple[int, int], torch.Generator] = {}
        self._last: dict[int, Selection] = {}
        self._selects: dict[int, int] = {}  # decode steps (selects) seen per layer
        self._stores: dict = {}  # layer -> its store (semantic placement of inserted tokens)
        self._memo: dict | None = None  # shared by the forks of one prefill (share_index)
        self._prefill_builds: dict = {}  # memo key -> future of this policy's prefill build
        self._lock = threading.Lock()
        self._stats = {k: 0.0 for k in ("build_s", "build_keys", "builds", "insert_s", "inserts", "wait_s")}
        self._stats.update(query_s=0.0, q_wait_s=0.0, queries=0, pages_selected=0, tokens_selected=0, builds_reused=0)
        self._forests: dict[int, DCIForest] = {}  # layer -> device mirror of its trees (search="device")
        self._dev_counts: torch.Tensor | None = None  # pages / tokens selected by device searches (no sync)
        self._row_idx: dict = {}  # (device, searched rows, G) -> (row index, tree of each query row) on the device
        self._graphs: dict = {}  # layer -> (signature, CUDA graph, static query, static outputs)
        self._staged: dict = {}  # layer -> {tree index: DCIForest.stage(...)} not mirrored yet
        self._capture_stream = None
        self._stats.update(graph_captures=0, graph_replays=0)

    def make_store(self, layer, offload, args, work_tokens):
        if not offload or self.anchor_of.get(layer) != layer:
            return None  # GPU-resident store: selected tokens are read in place
        return SemanticOffloadStore(*args, work_tokens=work_tokens, page_slots=self._max_pages())

    def _max_pages(self) -> int:
        return self.max_pages or max(1, 2 * self.cfg.retrieval_pages)

    # ---- indexing (Algorithm 1 lines 5-10 and 26-36) --------------------------------------------------
    def index(self, layer, update) -> None:
        if update.empty or self.anchor_of.get(layer) != layer:
            return
        if getattr(update, "store", None) is not None:
            self._stores[layer] = update.store
        keys, ready = _to_host(update.keys)
        start, count = update.start.clone(), update.count.clone()
        g = self.cfg
        per_b = {}
        for b in torch.nonzero(count).flatten().tolist():
            first = g.sink + int(start[b]) * g.page_size
            per_b[b] = torch.arange(first, first + int(count[b]) * g.page_size)
        q = self._jobs.setdefault(layer, deque())
        prev = q[-1][0] if q else None
        step = self._selects.get(layer, 0)  # the job is due at the layer's next step (deterministic)
        base = None if prev is not None else self._trees.get(layer)
        memo_key = None
        if prev is None and base is None:  # the prefill build: a fork of the same prefill may have it
            memo_key = self._memo_key(layer, per_b, tuple(update.keys.shape[:2]))
            fut = self._memo.get(memo_key) if self._memo is not None else None
            if fut is not None:
                self._stats["builds_reused"] += 1
                q.append((fut, per_b, step))
                return
        fut = _pool(self._threads()).submit(
            self._index_job, layer, keys, ready, per_b, prev, base, update.keys.shape[1]
        )
        if memo_key is not None:
            self._prefill_builds[memo_key] = fut
            if self._memo is not None:
                self._memo.setdefault(memo_key, fut)
        q.append((fut, per_b, step))

    def share_index(self, memo: dict) -> None:
        """Forks of one prefill share the prefill's trees instead of rebuilding them (Cache.fork).

        The memo holds the *future* of each layer's prefill build, keyed by everything the trees
        depend on (the tree parameters and seed, the grid that decides which tokens are in the
        middle, the batch layout). Trees are immutable snapshots (:meth:`DCITree.insert` returns a
        new tree and never writes into the old one's tensors), so a fork's later insertions cannot
        change the shared trees, the original's or a sibling's: sharing is a zero-copy fork."""
        self._memo = memo
        for key, fut in self._prefill_builds.items():
            memo.setdefault(key, fut)

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
        B = keys.shape[0]
        trees = list(base) if base is not None else [None] * (B * heads)
        placements = []
        staged: dict = {}  # tree index -> DCIForest.stage(...) of an inserted-into tree
        stage = self.search == "device" or (self.search == "auto" and ready is not None)
        built = inserted = 0
        for b, pos in per_b.items():
            for h in range(heads):
                k = keys[b, h, : pos.numel() // self.cfg.page_size].reshape(pos.numel(), -1)
                tree = trees[b * heads + h]
                # One random stream per (layer, kv head), the same for every sequence of a batch:
                # a sequence gets the same tree in a batch as alone; the model's head index, so a
                # tensor-parallel rank builds the trees one process builds for its heads.
                seed = self.seed + 7919 * layer + self.info.head_offset + h
                if tree is None:
                    params = DCIParams(**{**self.params.__dict__, "seed": seed})
                    tree, new = DCITree.build(k, pos, params), torch.arange(pos.numel())
                    n0 = 0  # a tree first built after the others (a short sequence of a batch): mirror it whole
                    built += pos.numel()
                else:
                    gen = self._gens.setdefault((layer, b * heads + h), torch.Generator().manual_seed(seed + 1))
                    n0 = tree.n
                    tree = tree.insert(k, pos, gen)
                    new = torch.arange(n0, tree.n)
                    inserted += 1
                trees[b * heads + h] = tree
                placements.append((b, h, tree.pt_page[new], tree.pt_slot[new], tree.pos[new]))
                if base is not None and stage:  # the device mirror's copies, prepared here (off the main thread)
                    staged[b * heads + h] = DCIForest.stage(tree, n0, pin=ready is not None)
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
            self._staged.setdefault(layer, {}).update(staged)
        trees = list(trees)  # the list may be shared with forks (share_index); the trees are immutable
        self._trees[layer] = trees
        self._clamped[layer] = sum(t.clamped for t in trees if t is not None)
        if isinstance(store, SemanticOffloadStore):
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

    # ---- page selection (Algorithms 3-4) -----------------------------------------------------------
    def select(self, layer, q, store, scale) -> Selection:
        anchor = self.anchor_of[layer]
        if anchor != layer and anchor in self._last:
            return self._last[anchor]  # IceCache (reuse): the indices of the most recent anchor layer
        t0 = time.perf_counter()
        pending = self._sync(layer, store)
        trees = self._trees.get(layer)
        B, H = store.batch, store.kv_heads
        G = q.shape[1] // H
        budget = self.cfg.retrieval_tokens
        on_device = self.search == "device" or (self.search == "auto" and q.device.type == "cuda")
        qc = None if on_device else q.detach().float().cpu()  # the host search needs q on the CPU (a sync)
        t1 = time.perf_counter()
        self._stats["q_wait_s"] += t1 - t0  # waiting for the device to produce q (and applying jobs)
        work, searches = [], []  # per (b, h): a result or a tree to pick pages from; search tasks
        for b in range(B):
            for h in range(H):
                tree = trees[b * H + h] if trees is not None else None
                n = (0 if tree is None else tree.n) + pending[b].numel()
                if n <= budget:  # a top-k with k >= n is every key, indexed or being inserted
                    work.append(pending[b] if tree is None else torch.cat([tree.pos, pending[b]]))
                elif tree is None:
                    work.append(torch.empty(0, dtype=torch.long))
                else:  # Alg. 1: a page leaving the window this step is selectable from the next step
                    work.append(tree)
                    searches.append((len(work) - 1, tree, None if qc is None else qc[b, h * G : (h + 1) * G]))
        if on_device:
            return self._select_device(layer, q, trees, work, searches, scale, t1)
        threads = self._threads()
        chunks = self.query_chunks or max(1, threads // max(1, len(searches)))
        chunks = min(chunks, G)
        if chunks == 1:  # one task per tree: its search and its page choice
            tasks = [lambda t=t, qg=qg: self._select_pages(t, qg, budget, scale=scale) for _, t, qg in searches]
        else:  # the group's query heads in `chunks` searches (rows are independent); pages chosen below
            parts = [(t, part) for _, t, qg in searches for part in qg.tensor_split(chunks)]
            tasks = [lambda t=t, part=part: self._search(t, part) for t, part in parts]
        if len(tasks) > 1 and threads > 1:  # the trees of one layer (and their heads) are searched in parallel
            done = list(_pool(threads, "query").map(lambda f: f(), tasks))
        else:
            done = [f() for f in tasks]
        for j, (i, tree, _) in enumerate(searches):
            if chunks == 1:
                work[i] = done[j]
            else:
                found = _cat_rows(done[j * chunks : (j + 1) * chunks])
                work[i] = self._select_pages(tree, None, budget, found, scale)
        chosen = work
        rows = chosen
        T = max((r.numel() for r in rows), default=0)
        pin = q.device.type == "cuda"
        tokens = torch.full((B * H, T), -1, dtype=torch.long, pin_memory=pin)
        for i, r in enumerate(rows):
            tokens[i, : r.numel()] = r
        tokens = tokens.view(B, H, T)
        sel = Selection(tokens=tokens.to(q.device, non_blocking=pin))
        setattr(sel, HOST_TOKENS, tokens)  # the semantic store reads the CPU copy (no device round trip)
        self._last[layer] = sel
        self._stats["query_s"] += time.perf_counter() - t1  # tree searches + page choice, on the CPU
        self._stats["queries"] += 1
        return sel

    def _select_device(self, layer, q, trees, work, searches, scale, t1) -> Selection:
        """The searches of every (sequence, kv head) tree of the layer as one batched search on q's
        device (:class:`DCIForest`): the same M-DCI / P-DCI and page choice as the host path, no
        host sync (rows whose budget covers every key come from the host as before)."""
        dev = q.device
        B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
        R = len(work)
        G = Hq // (R // B) if R else 1
        budget = self.cfg.retrieval_tokens
        parts = []
        if searches:
            forest = self._forests.get(layer)
            staged = self._staged.pop(layer, None)
            if forest is None or forest.device != dev:
                forest = DCIForest(trees, dev)
            else:
                forest = forest.update(trees, staged)
            self._forests[layer] = forest
            rows = tuple(i for i, _, _ in searches)
            key = (dev, rows, G)
            if key not in self._row_idx:  # long-lived: a captured graph reads them at every replay
                ridx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
                self._row_idx[key] = (ridx, ridx.repeat_interleave(G))
            ridx, tq = self._row_idx[key]
            qd = q.detach().float().reshape(R, G, D)[ridx].reshape(-1, D)
            k = self.topk or self.cfg.budget  # Alg. 3's k (see _search)
            keys_rule = self.budget_rule == "keys"
            cap = (self.max_pages or 1 << 40) if keys_rule else self._max_pages()

            def run(qd, forest=forest, tq=tq, ridx=ridx, k=k, cap=cap):
                ids, dot = forest.search(transform_queries(qd), tq, rows, k, self.query_fov or k, self.query_prop)
                qk_scale = forest.c[tq][:, None] * qd.norm(dim=-1, keepdim=True)
                return forest.select_pages(
                    ids, dot, ridx, G, budget, cap, self.budget_rule, self.group_merge, qk_scale, scale
                )

            if self.graphs and (dev.type == "cuda" or GRAPHS_ON_CPU is not None):
                sig = (forest.uid, forest.version, rows, float(scale))
                toks, npages = self._graph_run(layer, sig, run, qd, keep=(forest, ridx, tq))
            else:
                toks, npages = run(qd)
            out = torch.full((R, toks.shape[1]), -1, dtype=torch.long, device=dev)
            out[ridx] = toks
            parts.append(out)
            counts = torch.stack([npages.sum(), (toks >= 0).sum()])
            self._dev_counts = counts if self._dev_counts is None else self._dev_counts + counts
        host = [(i, r) for i, r in enumerate(work) if isinstance(r, torch.Tensor) and r.numel()]
        if host or not parts:
            T = max((r.numel() for _, r in host), default=0)
            pin = dev.type == "cuda"
            tok = torch.full((R, T), -1, dtype=torch.long, pin_memory=pin)
            for i, r in host:
                tok[i, : r.numel()] = r
            parts.append(tok.to(dev, non_blocking=pin))
        tokens = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        sel = Selection(tokens=tokens.view(B, R // B, -1))
        self._last[layer] = sel
        self._stats["query_s"] += time.perf_counter() - t1  # host time to issue the search (device: asynchronous)
        self._stats["queries"] += 1
        return sel

    def _graph_run(self, layer, sig, run, qd, keep=()):
        """``run(qd)`` through a CUDA graph of the layer, captured again when ``sig`` changes (the
        mirror's arrays, its host-known bounds, the searched trees or the scale changed). The capture
        is on a side stream in thread-local mode (index worker threads may use CUDA meanwhile),
        after one eager warm-up run there; the outputs are copied out of the graph's pool.

        A replay reads the very addresses the capture read, so every tensor the captured kernels
        read from outside the capture must stay alive and unchanged until the next capture: the
        static query (here), the mirror's arrays (the forest, in ``keep``; they change only with its
        ``version``, part of ``sig``) and the row / tree index tensors (``keep``). A past bug: the
        per-step ``tq = ridx.repeat_interleave(G)`` was read by the graph but freed after the
        capturing step; the allocator reused its memory and the replays indexed the mirror with
        whatever was written there (device-side assert in an index/gather kernel)."""
        ent = self._graphs.get(layer)
        if ent is None or ent[0] != sig or ent[2].shape != qd.shape:
            self._graphs.pop(layer, None)
            cuda = qd.device.type == "cuda"
            static_q = qd.clone()
            if cuda:
                if self._capture_stream is None:
                    self._capture_stream = torch.cuda.Stream(qd.device)
                s, main = self._capture_stream, torch.cuda.current_stream(qd.device)
                s.wait_stream(main)
                graph, ctx = torch.cuda.CUDAGraph(), torch.cuda.stream(s)
            else:  # tests: a stand-in for a CUDA graph on the CPU (GRAPHS_ON_CPU)
                graph, ctx = GRAPHS_ON_CPU(static_q), contextlib.nullcontext()
            try:
                with ctx:
                    run(static_q)  # warm-up (lazy initialisations stay out of the capture)
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        out = run(static_q)
                    finally:
                        graph.capture_end()
            except RuntimeError as e:  # not capturable here: eager from now on, said in stats and a warning
                if cuda:
                    main.wait_stream(s)
                self.graphs = False
                self._stats["graph_error"] = repr(e)[:300]
                warnings.warn(f"icecache: CUDA graph capture failed, searching eagerly: {e!r}", stacklevel=2)
                return run(qd)
            if cuda:
                main.wait_stream(s)
            ent = (sig, graph, static_q, out, tuple(keep))
            self._graphs[layer] = ent
            self._stats["graph_captures"] += 1
        ent[2].copy_(qd)
        ent[1].replay()
        self._stats["graph_replays"] += 1
        return ent[3][0].clone(), ent[3][1].clone()

    def _threads(self) -> int:
        if self.threads:
            return self.threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def _search(self, tree: DCITree, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query head's top-k keys (M-DCI, Algorithm 4): point ids [G, k'] in descending order
        (-1 padded) and their inner products q.k [G, k'] (-inf padded)."""
        # Alg. 3's k is the cache budget (the paper's "budget 64" retrieves the top-64 keys; sink and
        # window pages are kept on top, App. A). The pages attended still fit the retrieval budget
        # in tokens (kvdex's equal-budget rule). k = budget - sink - window (16 at budget 64) made
        # the M-DCI beam too narrow to find the needle: docs/policies/icecache.md, "budget 64".
        k = self.topk or self.cfg.budget
        ids, dot = tree.search(transform_queries(qg), k, 0, self.query_fov or k, self.query_prop, collect_all=True)
        # dot = T_Q(q).T_K(k) = q.k / (c |q|) (eq. 2/3), so q.k = dot * c * |q|
        return ids, dot * (tree.c * qg.float().norm(dim=-1, keepdim=True))

    def _select_pages(self, tree: DCITree, qg, room: int, found=None, scale: float = 1.0) -> torch.Tensor:
        """Token positions of the pages holding each query head's top-k keys (GQA union), qg [G, D]
        (or the search's ``found`` = (ids, q.k) [G, k'])."""
        ids, qk = self._search(tree, qg) if found is None else found
        if self.group_merge == "nsa":
            return self._take_pages(tree, _nsa_order(tree, ids, qk, scale), room)
        pages = torch.where(ids >= 0, tree.pt_page[ids.clamp(min=0)], -1).T.flatten()  # rank-major
        pages = pages[pages >= 0]
        if pages.numel() == 0:
            return torch.empty(0, dtype=torch.long)
        uniq, inv = torch.unique(pages, return_inverse=True)
        first = torch.full((uniq.numel(),), pages.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inv, torch.arange(pages.numel()), reduce="amin")
        return self._take_pages(tree, uniq[torch.argsort(first)], room)

    def _take_pages(self, tree: DCITree, ordered: torch.Tensor, room: int) -> torch.Tensor:
        """Token positions of the pages ``ordered`` (best first) that fit ``room`` tokens."""
        if ordered.numel() == 0:
            return torch.empty(0, dtype=torch.long)
        # Pages in order of their best-ranked key; a page that does not fit the room left is
        # skipped and a later, smaller one may still fit (the budget is in tokens).
        if self.budget_rule == "keys":  # the paper's accounting: every page of the top-k keys
            take, room, cap = [], int(tree.page_fill.sum()), self.max_pages or ordered.numel()
        else:
            take, cap = [], self._max_pages()
        for i, f in enumerate(tree.page_fill[ordered].tolist()):
            if f <= room:
                take.append(i)
                room -= f
                if room == 0 or len(take) == cap:
                    break
        chosen = ordered[torch.tensor(take, dtype=torch.long)]
        pos = tree.page_positions(chosen).flatten()
        pos = pos[pos >= 0]
        with self._lock:  # the host searches of a layer run on several threads: += on a dict item is not atomic
            self._stats["pages_selected"] += chosen.numel()
            self._stats["tokens_selected"] += pos.numel()
        return pos

    # ---- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = dict(self._stats)
        if self._dev_counts is not None:
            pages, tokens = self._dev_counts.tolist()
            s["pages_selected"] += pages
            s["tokens_selected"] += tokens
        s["clamped_keys"] = sum(self._clamped.values())
        if s["build_keys"]:
            s["build_s_per_32k_keys"] = s["build_s"] / s["build_keys"] * 32768
        if s["build_s"]:
            s["build_hidden_fraction"] = max(0.0, 1.0 - s["wait_s"] / s["build_s"])
        if s["queries"]:
            s["query_ms_per_layer_step"] = 1e3 * s["query_s"] / s["queries"]
        if s["pages_selected"]:
            s["tokens_per_selected_page"] = s["tokens_selected"] / s["pages_selected"]
        return s


def _to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying device keys to (pinned) host memory; the worker waits on the returned event."""
    if x.device.type != "cuda":
        return x.detach().float(), None
    buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    buf.copy_(x.detach(), non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return buf, ev


def _cat_rows(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack several searches' (ids, q.k) [g_i, k_i] into [sum g_i, max k_i] (-1 / -inf padded)."""
    w = max(x.shape[1] for x, _ in parts)
    pad = torch.nn.functional.pad
    ids = torch.cat([pad(x, (0, w - x.shape[1]), value=-1) for x, _ in parts])
    return ids, torch.cat([pad(d, (0, w - d.shape[1]), value=float("-inf")) for _, d in parts])


def _nsa_order(tree: DCITree, ids: torch.Tensor, qk: torch.Tensor, scale: float) -> torch.Tensor:
    """Pages of the group's retrieved keys, by importance summed over the group's query heads
    (NSA's shared selection, which the paper follows for GQA): a head's importance of a key is its
    softmax weight among the head's retrieved keys, a page's the sum over its keys and the heads."""
    ok = ids >= 0
    if not bool(ok.any()):
        return torch.empty(0, dtype=torch.long)
    prob = torch.softmax(qk.float() * scale, dim=1).nan_to_num(0.0).masked_fill(~ok, 0.0)
    pages = tree.pt_page[ids[ok]]
    uniq, inv = torch.unique(pages, return_inverse=True)
    score = torch.zeros(uniq.numel()).index_add_(0, inv, prob[ok])
    return uniq[torch.argsort(score, descending=True, stable=True)]


def _check_int(name: str, v, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
