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
the trees are immutable snapshots, so sharing them is a zero-copy, fully isolated fork (``search="summary"``:
and the host copy of the page table made from them, which each fork copies to the device).

With ``offload=True`` the layer store is a :class:`~kvdex.storage.semantic.SemanticOffloadStore`:
the host keeps every leaf page contiguous, and each step only the selected pages that are not
already on the device are gathered into pinned staging and sent in one copy (bulk loading).

``reuse=True`` is IceCache (reuse), Appendix C: trees and queries only on anchor layers (every
``reuse_every``-th sparse layer from the first); the layers in between attend the tokens selected
at the most recent anchor layer. Choices the paper leaves open are listed in docs/policies/icecache.md.

``search="summary"`` (not the paper's: a GPU retrieval mode) keeps the trees' leaf pages on the device
with one summary per page (``summary="minmax"``: per-channel min/max keys, Quest's bound;
``"centroid"``: mean key + radius) and scores every page of every (sequence, kv head) from them at
each step (:mod:`kvdex.index.summary`): no tree search and no host sync, so the step can be replayed
from a CUDA graph (``graph_key``). Window pages join on the device, each key into its nearest page, inside
the captured step too (``capturable_index``: ``reserve_index`` / ``joined`` / ``index_join``). ``build="device"``
makes those pages on the device inside the prefill instead of from host trees: the trees' promotions, each
key's exact nearest promoted point as its parent (:mod:`kvdex.index.leaf_pages`).

The package, by concept: ``policy.py`` (this file: options, life cycle, the per-step selection by summaries,
reporting), ``tree_search.py`` (:class:`~kvdex.policies.icecache.tree_search.TreeSearch`: the paper's per-step
tree searches and page choice, on host threads or batched on the device), ``tree_jobs.py``
(:class:`~kvdex.policies.icecache.tree_jobs.TreeJobs`: the host trees, their background jobs and the fork memo) and
``summary_pages.py`` (:class:`~kvdex.policies.icecache.summary_pages.SummaryPages`: the device semantic pages of
``search="summary"``). Each component owns its state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from kvdex.index.dci import DCIParams
from kvdex.index.summary import summary_stats
from kvdex.policies.base import Policy, PolicyInfo
from kvdex.policies.icecache.summary_pages import SummaryPages
from kvdex.policies.icecache.tree_jobs import TreeJobs, page_positions
from kvdex.policies.icecache.tree_search import TreeSearch
from kvdex.policies.registry import register_policy
from kvdex.policies.rerank import NamedOptions, check_share, fetched_token_scores, resolve_selection, slot_weights
from kvdex.policies.reuse import HeldPools, SelectEveryOption, check_select_every
from kvdex.selection import Selection
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin
from kvdex.storage.semantic import SemanticOffloadStore
from kvdex.view import LayerView

# The selection. kvdex's default (docs/policies/icecache.md, "Default configuration"): the semantic leaf pages built
# on the device at prefill, every page scored from its min / max summary each step, the best pages (4 x max_pages, at
# least a quarter of the middle's) as candidates and their best tokens by the group's softmax weights attended
# (the oracle's criterion over the candidates); capturable in a CUDA graph. The paper's: the DCI trees built on the
# host and searched every step (on the GPU against a device mirror where the model runs on CUDA), the pages holding
# the top-k keys attended. Naming any of these options starts the others from the paper's values.
DEFAULT_SELECTION = {"search": "summary", "build": "device", "rerank": 4, "rerank_unit": "token", "rerank_share": 0.25,
                     "rerank_group": "weight"}  # fmt: skip
PAPER_SELECTION = {"search": "auto", "build": "tree", "rerank": 0, "rerank_unit": "page", "rerank_share": 0.0,
                   "rerank_group": "max"}  # fmt: skip


@register_policy
@dataclass
class IceCachePolicy(NamedOptions, SelectEveryOption, Policy):
    name = "icecache"
    granularity = "token"
    capturable = True  # the default (search="summary"); an instance with a tree search says no (_capture_flags)
    capturable_index = True

    promotion_ratio: float = 0.0  # r; 0 -> 1 / page_size (a leaf node fills about one page)
    num_comp: int = 2  # composite indices per tree (m)
    num_simp: int = 4  # random projections per composite index (p)
    construction_fov: int = 10
    construction_prop: float = 0.25
    # a point's parent on the level above: "dci" = the tree's own search (Algorithm 2, the paper), "exact" = the
    # nearest point of that level by one matrix product (kvdex option: the leaf nodes of build="device"; ~20x
    # faster host builds, docs/policies/icecache.md, "Exact parents")
    parents: Literal["dci", "exact"] = "dci"
    query_fov: int = 0  # points kept per level when selecting; 0 -> topk
    query_prop: float = 0.8
    topk: int = 0  # keys retrieved per query head (Alg. 3's k); 0 -> the budget (docs: "budget 64")
    max_pages: int = 0  # pages per kv head and step; 0 -> 2 * retrieval_pages
    norm_margin: float = 1.25
    reuse: bool = False
    reuse_every: int = 3
    threads: int = 0  # CPU threads for tree construction / insertion / search; 0 -> the cores we may use
    query_chunks: int = 1  # search tasks per tree and step (its group's query heads split); 0 -> fill the threads
    group_merge: Literal["rank", "max", "nsa"] = (
        "rank"  # GQA union order when it exceeds the budget: "rank" (rank-major) | "nsa" (summed probs)
    )
    # "tokens": the attended pages fit budget - sink - window tokens (kvdex's equal-budget rule, the default);
    # "keys": the paper's accounting (Alg. 3, App. A): every page holding one of the group's top-k keys is
    # attended (at most max_pages if set), sink and window on top, so a step may attend more than the budget.
    budget_rule: Literal["tokens", "keys"] = "tokens"
    # The selection options (search, rerank, rerank_unit, rerank_group, rerank_share, build; resolve_selection): a
    # spec that names none of them gets DEFAULT_SELECTION (the defaults below); one that names any gets
    # PAPER_SELECTION's values for the others.
    # where the per-step tree searches run: "device" = one batched search over all trees of a layer on q's
    # device (kvdex.index.forest, no host sync), "host" = one search per tree on the CPU thread pool, "auto" =
    # device when the model runs on CUDA, else host. Same pages as the host search, faster on the H200:
    # docs/policies/icecache.md, "Speed on the H200". "summary": no tree search per step, every leaf page
    # scored from its device summary (kvdex.index.summary; capturable in a CUDA graph; not the paper's).
    search: Literal["auto", "device", "host", "summary"] = "summary"
    # search="summary": "minmax" (per-channel min/max keys: an upper bound of q.k, Quest's on semantic pages)
    # or "centroid" (mean key + radius: q.mu + |q| r, also an upper bound, looser); ignored otherwise
    summary: Literal["minmax", "centroid"] = "minmax"
    # search="summary": 0 = pages ranked by their summaries; N > 0 = the N * max_pages best pages by summary
    # (the group's max) are ranked by the exact max q.k of their keys (GPU-resident store only)
    rerank: int = 4
    # rerank > 0: "page" = attend the candidate pages with the best exact max q.k (the budget rule above);
    # "token" = attend the candidates' tokens with the best exact q.k (the group's max), as the page
    # policies' ``rerank`` (kvdex/policies/rerank.py): no page-fit step, the budget spent on tokens
    rerank_unit: Literal["page", "token"] = "token"
    # rerank_unit="token": rank the candidates' tokens by the group's "max" q.k, or by "weight" (each query
    # head's softmax over sink + window + the candidates, summed over the group: the page policies' option)
    rerank_group: Literal["max", "weight"] = "weight"
    # rerank > 0: the candidates at least this share of each row's pages (kvdex option, as the page policies'
    # ``rerank_share``: a pool of a fixed multiple of the budget covers less of a longer context)
    rerank_share: float = 0.25
    # rerank_unit="token": choose the candidates (the bounds' pass, the share) every N decode steps and whenever a
    # page joins, keeping the rerank x max_pages best of them by that step's token scores; every step still
    # ranks the held candidates' tokens by its own query (kvdex option: docs/policies/icecache.md, "A held pool")
    pool_every: int = 1
    # pool_every > 1: the pool held between refreshes. "rerank" = the rerank x max_pages best candidate pages by the
    # refresh step's token scores; "all" = every candidate (with rerank_share, that share of the middle's pages)
    pool_pages: Literal["rerank", "all"] = "rerank"
    # search="summary": the prefill's pages. "tree": the host DCI trees' leaves (the paper's construction, on CPU
    # threads); "device": the same leaf-node definition with exact parents, on the device inside the prefill
    build: Literal["tree", "device"] = "device"
    # search=device on CUDA: replay each layer's batched search + page choice as a CUDA graph (one launch
    # instead of ~300 small kernels), re-captured when the layer's mirror changes (an insertion); selections
    # == the eager device search (GPU test). No effect on the host search or on the CPU.
    graphs: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        resolve_selection(self, DEFAULT_SELECTION, PAPER_SELECTION)
        super().__post_init__()  # the Literal options' choices (Policy.__post_init__)
        if not 0.0 <= self.promotion_ratio < 1.0:
            raise ValueError(f"promotion_ratio must be in (0, 1) (0 = 1/page_size), got {self.promotion_ratio}")
        for name in ("num_comp", "num_simp", "construction_fov", "reuse_every"):
            _check_int(name, getattr(self, name), 1)
        for name in ("query_fov", "topk", "max_pages", "threads", "seed", "query_chunks", "rerank"):
            _check_int(name, getattr(self, name), 0)
        for name in ("construction_prop", "query_prop"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if self.norm_margin < 1.0:
            raise ValueError(f"norm_margin must be >= 1 (c must bound every key norm), got {self.norm_margin}")
        if self.rerank_unit == "token" and not (self.rerank and self.search == "summary"):
            raise ValueError("rerank_unit='token' ranks the tokens of rerank > 0 candidate pages: add search=summary "
                             "and rerank=N (e.g. 4)")  # fmt: skip
        if self.rerank_group == "weight" and self.rerank_unit != "token":
            raise ValueError("rerank_group='weight' ranks the candidates' tokens: add rerank_unit=token")
        check_share(self.rerank, self.rerank_share)
        check_select_every(self.select_every)
        check_select_every(self.pool_every, "pool_every")
        if self.pool_every > 1 and (self.rerank_unit != "token" or self.select_every > 1):
            raise ValueError("pool_every=N reranks a held pool's tokens every step: it needs search=summary, rerank=N "
                             "and rerank_unit=token, and select_every=1 (it replaces select_every)")  # fmt: skip
        if self.rerank_share and self.search != "summary":
            raise ValueError("rerank_share sizes the candidates of search='summary': add search=summary")
        if self.build == "device" and self.search != "summary":
            raise ValueError("build='device' makes the pages of search='summary' (no tree to search): add "
                             "search=summary, or use build='tree'")  # fmt: skip
        if self.search == "summary" and self.budget_rule != "tokens":
            raise ValueError("search='summary' retrieves no keys: use budget_rule='tokens' (or another search)")
        if self.search != "summary" and self.group_merge == "max":
            raise ValueError("group_merge='max' (max of the group's page bounds) needs search='summary'")
        self._capture_flags()
        if not isinstance(self.graphs, bool):
            raise ValueError(f"graphs must be True or False, got {self.graphs!r}")
        self._lock = threading.Lock()  # (again in bind) stats shared by the search threads

    def _capture_flags(self, offload: bool = False) -> None:
        """CUDA-graph decoding (kvdex.engine.graphs) only without tree searches: the protocol's ``graph_key`` /
        ``graph_replayed`` are this policy's on a ``search="summary"`` instance only (else :class:`Policy`'s), and a
        window page joining the middle is then placed inside the captured step too (``reserve_index`` / ``joined``
        / ``index_join``, summary_pages.py). ``offload`` with a rerank: the candidates' keys come from the host (a
        sync), so no step is captured."""
        self.capturable = self.capturable_index = self.search == "summary" and not (offload and self.rerank)

    # ---- set-up ------------------------------------------------------------------------------------
    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        self._capture_flags(info.config.offload)
        ps = self.cfg.page_size
        same = ("num_comp", "num_simp", "construction_fov", "construction_prop", "norm_margin", "seed", "parents")
        self.params = DCIParams(
            promotion_ratio=self.promotion_ratio or 1.0 / ps, page_size=ps, **{f: getattr(self, f) for f in same}
        )
        sparse = info.sparse_layers
        every = self.reuse_every if self.reuse else 1
        self.anchor_of = {lay: sparse[(i // every) * every] for i, lay in enumerate(sparse)}
        self._last: dict[int, Selection] = {}
        self._lock = threading.Lock()
        self._stats = {k: 0.0 for k in ("build_s", "build_keys", "builds", "insert_s", "inserts", "wait_s")}
        self._stats.update(query_s=0.0, q_wait_s=0.0, queries=0, pages_selected=0, tokens_selected=0, builds_reused=0)
        self._pools = HeldPools()  # pool_every: layer -> the held candidates' positions [R, N]
        self.tree_search = TreeSearch(
            self.cfg.budget, self._max_pages(), topk=self.topk, query_fov=self.query_fov, query_prop=self.query_prop,
            max_pages=self.max_pages, budget_rule=self.budget_rule, group_merge=self.group_merge,
            threads=self.threads, query_chunks=self.query_chunks, graphs=self.graphs, stats=self._stats,
            lock=self._lock,
        )  # fmt: skip
        self.tree_jobs = TreeJobs(
            self.cfg, self.params, seed=self.seed, search=self.search, summary=self.summary, threads=self.threads,
            head_offset=info.head_offset, device=self.tree_search.device, stats=self._stats, lock=self._lock,
        )  # fmt: skip
        self.summary_pages = SummaryPages(
            self.cfg, self.params, summary=self.summary, anchor_of=self.anchor_of, tree_jobs=self.tree_jobs,
            stats=self._stats,
        )  # fmt: skip

    def make_store(self, layer: int, offload: bool, args: tuple, work_tokens: int) -> LayerStore | None:
        if not offload or self.anchor_of.get(layer) != layer or self.search == "summary":
            return None  # GPU-resident store: selected tokens are read in place
        return SemanticOffloadStore(*args, work_tokens=work_tokens, page_slots=self._max_pages())

    def _max_pages(self) -> int:
        return self.max_pages or max(1, 2 * self.cfg.retrieval_pages)

    # ---- indexing (Algorithm 1 lines 5-10 and 26-36: tree_jobs.py; search="summary": summary_pages.py) -----
    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.empty or self.anchor_of.get(layer) != layer:
            return
        jobs = self.tree_jobs
        if self.search == "summary" and (
            layer in self.summary_pages.pages or jobs.jobs.get(layer) or jobs.trees.get(layer)
        ):
            return self.summary_pages.insert(layer, update)  # a window page joins, on the device
        if getattr(update, "store", None) is not None:
            jobs.stores[layer] = update.store
        per_b = page_positions(self.cfg, update)
        if self.build == "device":  # the leaf pages on the device now: no tree job
            return self.summary_pages.device_build(layer, update, per_b)
        jobs.submit(layer, update, per_b)

    def share_index(self, memo: dict) -> None:
        """Forks of one prefill share the prefill's trees instead of rebuilding them (Cache.fork).

        The memo holds the *future* of each layer's prefill build, keyed by everything the trees
        depend on (the tree parameters and seed, the grid that decides which tokens are in the
        middle, the batch layout). Trees are immutable snapshots (:meth:`DCITree.insert` returns a
        new tree and never writes into the old one's tensors), so a fork's later insertions cannot
        change the shared trees, the original's or a sibling's: sharing is a zero-copy fork."""
        self.tree_jobs.share(memo)

    def flush(self) -> None:
        """Wait for every pending index job and apply it (tests, benchmarks, end of generation)."""
        self.tree_jobs.flush()

    # ---- search="summary": page joins inside a captured decode step (Policy.capturable_index) -------------
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        self.summary_pages.reserve(layer, pages, store)

    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        self.summary_pages.joined(layer, start, count)

    def index_join(self, layer: int, join: PageJoin) -> None:
        self.summary_pages.index_join(layer, join)

    # ---- page selection (Algorithms 3-4) -----------------------------------------------------------
    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        layer, store, scale = view.layer, view.store, view.scale
        anchor = self.anchor_of[layer]
        if anchor != layer and anchor in self._last:
            return self._last[anchor]  # IceCache (reuse): the indices of the most recent anchor layer
        t0 = time.perf_counter()
        if self.search == "summary":  # every page scored from its summary on q's device: no host sync
            pages = self.summary_pages.pages_of(layer, store)
            P = pages.capacity if view.static else min(pages.bound, pages.capacity)
            room, cap = view.retrieval_tokens, self._max_pages()
            qd = q.detach()
            keys, by = self._token_scores(qd, view)
            if self.pool_every > 1:  # the candidates, the step's tokens among them, and the pool held for reuse
                _, slots = pages.candidates(qd, P, self.rerank * cap, self.rerank_share)
                got: list = []
                tokens = pages.rerank_tokens(qd, slots, room, keys, by, got)
                self._pools.hold(
                    layer, slots if self.pool_pages == "all" else pages.narrow(slots, got[0], self.rerank * cap)
                )
            else:
                tokens = pages.select(qd, P, room, cap, self.group_merge, scale, keys, rerank=self.rerank,
                                      unit=self.rerank_unit, share=self.rerank_share, token_scores=by)  # fmt: skip
            return self._selected(layer, Selection(tokens=tokens), t0)
        pending = self.tree_jobs.sync(layer, store)
        on_device = self.search == "device" or (self.search == "auto" and q.device.type == "cuda")
        t1 = time.perf_counter()
        self._stats["q_wait_s"] += t1 - t0  # waiting for the device to produce q (and applying jobs)
        sel = self.tree_search.select(q, view, self.tree_jobs.trees.get(layer), pending, on_device)
        return self._selected(layer, sel, t1)  # query_s: tree searches + page choice (device: issuing them)

    def reuse_steps(self) -> int:
        return self.pool_every if self.pool_every > 1 else self.select_every

    def reused(self, q: torch.Tensor, view: LayerView) -> Selection | None:
        """``pool_every``: a step between refreshes ranks the held pool's tokens by its own query."""
        if self.pool_every <= 1:
            return None
        layer, anchor = view.layer, self.anchor_of[view.layer]
        if anchor != layer and anchor in self._last:
            return self._last[anchor]
        t0 = time.perf_counter()
        qd = q.detach()
        keys, by = self._token_scores(qd, view)
        pages = self.summary_pages.pages[layer]
        tokens = pages.rerank_tokens(qd, self._pools.get(layer), view.retrieval_tokens, keys, by)
        return self._selected(layer, Selection(tokens=tokens), t0)

    def _token_scores(self, qd: torch.Tensor, view: LayerView):
        """(keys, token_scores) of a rerank (:meth:`SemanticPages.select`): the resident store's keys, read in
        place, with ``rerank_group="weight"``'s scores; offloaded, scores of keys fetched from the host."""
        store = view.store
        if not self.rerank or store.positional_slots:
            by = (lambda slots: slot_weights(qd, view, slots)) if self.rerank_group == "weight" else None
            return (store.k if self.rerank else None), by
        if self.rerank_unit != "token":
            raise ValueError("icecache rerank_unit='page' reads the candidate pages' keys on the device: use "
                             "offload=False, or rerank_unit=token")  # fmt: skip
        return None, partial(fetched_token_scores, qd, view, group=self.rerank_group)

    def _selected(self, layer, sel: Selection, t1: float) -> Selection:
        self._last[layer] = sel
        self._stats["query_s"] += time.perf_counter() - t1
        self._stats["queries"] += 1
        return sel

    # ---- search="summary": CUDA-graph decoding (kvdex.engine.graphs; pages: summary_pages.py) ----
    def graph_unsupported(self, stores: Sequence[LayerStore]) -> str | None:
        if self.search == "summary":
            return None if self.capturable else "icecache's offloaded rerank reads the candidates' keys from the host"
        return (f"policy 'icecache' with search={self.search!r} searches trees with host-driven shapes and threads; "
                "icecache (its default, search=summary) is capturable")  # fmt: skip

    def graph_key(self, stores: Sequence[LayerStore]) -> tuple | None:
        """A capturable instance (``search="summary"``): None while a prefill build is pending (joined by an eager
        step), else every device tensor the selection reads, with its shape. Otherwise :class:`Policy`'s."""
        if not self.capturable:
            return super().graph_key(stores)
        if any(self.tree_jobs.jobs.values()):
            return None
        layers = sorted(self.summary_pages.pages.items())
        pages = tuple((lay, *map(id, p.tensors()), *p.pos.shape) for lay, p in layers)
        return pages + self._pools.key()

    def graph_replayed(self) -> None:
        if self.capturable:
            self._stats["queries"] += len(self.summary_pages.pages)

    # ---- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = dict(self._stats)
        searched = self.tree_search.counts()
        s["pages_selected"] += searched["pages"]
        s["tokens_selected"] += searched["tokens"]
        if self.summary_pages.pages:  # search="summary": pages on the device, their index bytes vs the KV they hold
            for k, v in summary_stats(self.summary_pages.pages.values()).items():
                s[k] = s.get(k, 0) + v
        s["clamped_keys"] = sum(self.tree_jobs.clamped.values())
        s["graph_captures"], s["graph_replays"] = searched["graph_captures"], searched["graph_replays"]
        s["build_s"] += self.summary_pages.built_s()
        if s["build_keys"]:
            s["build_s_per_32k_keys"] = s["build_s"] / s["build_keys"] * 32768
        if s["build_s"] and self.build == "tree":
            s["build_hidden_fraction"] = max(0.0, 1.0 - s["wait_s"] / s["build_s"])
        if s["queries"]:
            s["query_ms_per_layer_step"] = 1e3 * s["query_s"] / s["queries"]
        if s["pages_selected"]:
            s["tokens_per_selected_page"] = s["tokens_selected"] / s["pages_selected"]
        return s


def _check_int(name: str, v, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
