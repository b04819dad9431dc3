"""IceCache's per-step selection by tree search (Algorithms 3-4), the paper's: :class:`TreeSearch`.

Every query head of a kv head's group asks its (sequence, kv head)'s DCI tree for its top-k keys by inner
product (M-DCI; k = the cache budget, Alg. 3's k); the pages holding them are the selection (GQA: the union
over the group, merged rank by rank, or by NSA's summed probabilities), taken in order of their best-ranked
key while they fit the retrieval budget (``budget_rule="tokens"``) and ``max_pages``, or all of them
(``budget_rule="keys"``, the paper's accounting). The searches run on host threads (one task per tree, or the
group's heads split into ``query_chunks``) or, on CUDA, as one batched search of the layer's trees against a
device mirror (:class:`~kvdex.index.device_search.DeviceSearch`), replayed as a CUDA graph through the
engine's graph service (``graphs=True``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from kvdex.index.dci import DCITree, transform_queries
from kvdex.index.device_search import DeviceSearch
from kvdex.index.pages import cat_rows, nsa_order, pad_rows, rank_order, take_pages
from kvdex.index.workers import cpu_threads, run_all
from kvdex.selection import Selection
from kvdex.view import CaptureError, LayerView


@dataclass
class TreeSearch:
    """The tree search's options (the policy's), its counters in ``stats`` (shared with the policy, guarded
    by ``lock``), the device mirrors of the trees and the graph services the device search ran through."""

    budget: int  # the cache budget: Alg. 3's k unless ``topk``
    page_cap: int  # pages per kv head and step under budget_rule="tokens" (the policy's max_pages, resolved)
    topk: int = 0
    query_fov: int = 0
    query_prop: float = 0.8
    max_pages: int = 0  # the option: budget_rule="keys" caps the pages only when set
    budget_rule: str = "tokens"
    group_merge: str = "rank"
    threads: int = 0
    query_chunks: int = 1
    graphs: bool = True
    stats: dict = field(default_factory=lambda: {"pages_selected": 0, "tokens_selected": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)
    device: DeviceSearch = field(default_factory=DeviceSearch)
    services: dict = field(default_factory=dict)  # id -> the engine's graph services used (graphs=True)

    def select(self, q: torch.Tensor, view: LayerView, trees, pending, on_device: bool) -> Selection:
        """The layer's selection: ``trees`` [B * H] (None: no tree yet), ``pending`` [B] positions being
        inserted (selectable once inserted; a row whose keys all fit the budget takes them all)."""
        B, H, G = view.batch, view.kv_heads, q.shape[1] // view.kv_heads
        budget, scale = view.retrieval_tokens, view.scale
        qc = None if on_device else q.detach().float().cpu()  # the host search needs q on the CPU (a sync)
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
            return self._select_device(view, q, trees, work, searches)
        threads = self.threads or cpu_threads()
        chunks = min(self.query_chunks or max(1, threads // max(1, len(searches))), G)
        tasks: list[Callable[[], object]]
        if chunks == 1:  # one task per tree: its search and its page choice
            tasks = [partial(self.select_pages, t, qg, budget, scale=scale) for _, t, qg in searches]
        else:  # the group's query heads in `chunks` searches (rows are independent); pages chosen below
            parts = [(t, part) for _, t, qg in searches if qg is not None for part in qg.tensor_split(chunks)]
            tasks = [partial(self.search, t, part) for t, part in parts]
        done = run_all(tasks, threads)  # the trees of one layer (and their heads) are searched in parallel
        for j, (i, tree, _) in enumerate(searches):
            if chunks == 1:
                work[i] = done[j]
            else:
                work[i] = self.select_pages(tree, None, budget, cat_rows(done[j * chunks : (j + 1) * chunks]), scale)
        pin = q.device.type == "cuda"
        tokens = pad_rows(B * H, enumerate(work), pin).view(B, H, -1)
        # the semantic store reads the CPU copy (no device round trip)
        return Selection(tokens=tokens.to(q.device, non_blocking=pin), host_tokens=tokens)

    def _select_device(self, view: LayerView, q: torch.Tensor, trees, work, searches) -> Selection:
        """The layer's tree searches as one batched search on q's device (:class:`DeviceSearch`; ``graphs``:
        replayed through ``view.graphs``): the host path's M-DCI / P-DCI and page choice, no host sync."""
        k = self.topk or view.budget  # Alg. 3's k (see search)
        cap = (self.max_pages or 1 << 40) if self.budget_rule == "keys" else self.page_cap
        service = view.graphs if self.graphs and view.graphs is not None and view.graphs.usable(q.device) else None
        tokens = self.device.select(
            view.layer, trees, q, work, [i for i, _, _ in searches], k, self.query_fov or k, self.query_prop,
            view.retrieval_tokens, cap, self.budget_rule, self.group_merge, view.scale,
            None if service is None else partial(self._graph_run, service),
        )  # fmt: skip
        return Selection(tokens=tokens.view(q.shape[0], len(work) // q.shape[0], -1))

    def _graph_run(self, service, layer, sig, run, qd, keep=()):
        """``run(qd)`` through the layer's graph in the engine's graph ``service`` (``GraphService.run``)."""
        self.services[id(service)] = service  # stats: its captures and replays
        try:
            return service.run(layer, sig, run, qd, keep)
        except CaptureError as err:  # not capturable here: eager from now on, said in stats and a warning
            e = err.__cause__
            self.graphs = False
            self.stats["graph_error"] = repr(e)[:300]
            warnings.warn(f"icecache: CUDA graph capture failed, searching eagerly: {e!r}", stacklevel=2)
            return run(qd)

    def search(self, tree: DCITree, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query head's top-k keys (M-DCI, Algorithm 4): point ids [G, k'] in descending order
        (-1 padded) and their inner products q.k [G, k'] (-inf padded)."""
        # Alg. 3's k is the cache budget (the paper's "budget 64" retrieves the top-64 keys; sink and
        # window pages are kept on top, App. A). The pages attended still fit the retrieval budget
        # in tokens (kvdex's equal-budget rule). k = budget - sink - window (16 at budget 64) made
        # the M-DCI beam too narrow to find the needle: docs/policies/icecache.md, "budget 64".
        k = self.topk or self.budget
        ids, dot = tree.search(transform_queries(qg), k, 0, self.query_fov or k, self.query_prop, collect_all=True)
        # dot = T_Q(q).T_K(k) = q.k / (c |q|) (eq. 2/3), so q.k = dot * c * |q|
        return ids, dot * (tree.c * qg.float().norm(dim=-1, keepdim=True))

    def select_pages(self, tree: DCITree, qg, room: int, found=None, scale: float = 1.0) -> torch.Tensor:
        """Token positions of the pages holding each query head's top-k keys (GQA union), qg [G, D]
        (or the search's ``found`` = (ids, q.k) [G, k'])."""
        ids, qk = self.search(tree, qg) if found is None else found
        ordered = nsa_order(tree, ids, qk, scale) if self.group_merge == "nsa" else rank_order(tree, ids)
        return self.take_pages(tree, ordered, room)

    def take_pages(self, tree: DCITree, ordered: torch.Tensor, room: int) -> torch.Tensor:
        """Token positions of the pages ``ordered`` (best first) that fit ``room`` tokens."""
        if self.budget_rule == "keys":  # the paper's accounting: every page of the top-k keys
            room, cap = int(tree.page_fill.sum()), self.max_pages or ordered.numel()
        else:
            cap = self.page_cap
        chosen, pos = take_pages(tree, ordered, room, cap)
        with self.lock:  # the host searches of a layer run on several threads: += on a dict item is not atomic
            self.stats["pages_selected"] += chosen.numel()
            self.stats["tokens_selected"] += pos.numel()
        return pos

    def counts(self) -> dict:
        """What the device search selected and the graph services' captures and replays."""
        pages, tokens = self.device.selected()
        services = self.services.values()
        return {"pages": pages, "tokens": tokens, "graph_captures": sum(g.captures for g in services),
                "graph_replays": sum(g.replays for g in services)}  # fmt: skip
