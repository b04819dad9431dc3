"""``pariskv``: ParisKV (Qi et al., ICML 2026, arXiv 2602.07721) -- drift-robust top-k token retrieval.

Index (``index``, at prefill and whenever a window page joins the middle): every middle key is
l2-normalised and rotated by a shared SRHT; in each of its ``B = D/m`` subspaces it keeps the id of
the nearest *analytic* centroid of ``{+-1/sqrt(m)}^m`` (its sign pattern), a 4-bit direction code
and a weight ``|k| r / alpha`` (``kvdex.kernels.pariskv``). The summary lives on the device; with
``offload=True`` the full-precision K/V of the middle lives in host memory. Centroids are fixed by
``m`` alone, so no centroid is ever learned or re-learned: keys generated late in a long decode are
summarised exactly like prefill keys (the paper's drift-robustness claim).

Select (every step, per sparse layer and kv head): the query gets the same transform; in every
subspace the centroids vote for their keys; the pool of keys with the most votes is kept by a bucket
top-k on the integer scores; the 4-bit estimate ``|q| sum_b w_b <v_b, q~_b>`` reranks them and the
best ``budget - sink - window`` tokens are attended. The update buffer + sliding window of the paper
is kvdex's window: a page is encoded when it leaves the window (``window`` plays the paper's local
window, a page its update buffer).

Default configuration (kvdex's, measured better on needle retrieval; docs/policies/pariskv.md):
every query head of a GQA group votes with its own query (``group="heads"``), a centroid's vote is its
quantised query score (``coarse="scores"``), and the pool holds ``max(0.2 * n, 8 * k)`` keys
(``candidate_ratio=0.2``, ``pool_factor=8``). The paper's configuration (:data:`PAPER_OPTIONS`,
``pariskv:group=mean:coarse=tiers:pool_factor=None:candidate_ratio=None``): the query is the mean over
the GQA group (as the authors' code), its best centroids vote in six cumulative tiers over a quota of
``collision_ratio * n`` keys, and the pool is ``candidate_ratio * n`` keys with the ratios adapted to
the retrieval length (table below).

Where the paper is vague its configuration follows the authors' released code (amy-77/ParisKV): ratios
adapt to the retrieval length (``pool.ADAPTIVE_RATIOS``), tiers as in ``kernels.pariskv.TIERS``, one SRHT round, m = 8.
Documented in docs/policies/pariskv.md with measurements.

``pariskv-kmeans`` is the drift baseline of the paper's ablation ("no normalise+rotate, learned
centroids"): identical except that the centroids of each subspace are learned by k-means on the
prefill keys (raw key space) and then frozen; later keys are assigned to the nearest of them
(``learned_centroids.py``). As the paper's baseline its defaults are the paper's configuration (compare it with
``PAPER_SPEC``); kvdex's options apply to it as well.

The package's components: this module (the options, the two stages, CUDA-graph sizing); ``summary.py``
(:class:`~kvdex.policies.pariskv.summary.KeySummary`, the middle keys' codes per layer, ``center=True``'s
means, page joins inside a captured step); ``pool.py`` (:class:`~kvdex.policies.pariskv.pool.PoolSizes`,
the coarse stage's pool and its device sizes); ``learned_centroids.py`` (``pariskv-kmeans``); ``recall.py``
(``recall_at_k``, the stage-by-stage diagnostic).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvdex.kernels import pariskv as K
from kvdex.kernels.scoring import topk_ids
from kvdex.policies.base import Policy, PolicyInfo
from kvdex.policies.pariskv.pool import PoolSizes
from kvdex.policies.pariskv.summary import KeySummary
from kvdex.policies.registry import register_policy
from kvdex.policies.reuse import HeldPools, SelectEveryOption, check_select_every
from kvdex.selection import Selection
from kvdex.storage import LayerStore, MiddleUpdate, PageJoin
from kvdex.view import LayerView

# The paper's configuration, i.e. the four options whose defaults are kvdex's: make_policy("pariskv",
# **PAPER_OPTIONS) or make_policy(PAPER_SPEC) runs the paper's retrieval pipeline (tested).
PAPER_OPTIONS = {"group": "mean", "coarse": "tiers", "pool_factor": None, "candidate_ratio": None}
PAPER_SPEC = "pariskv:group=mean:coarse=tiers:pool_factor=None:candidate_ratio=None"


@register_policy
@dataclass
class ParisKVPolicy(SelectEveryOption, Policy):
    """ParisKV with kvdex's default retrieval options (every query head votes with quantised centroid
    scores over a pool of max(0.2 n, 8 k) keys); ``**PAPER_OPTIONS`` (or :data:`PAPER_SPEC`) restores the
    paper's mean-query, tier-vote, adaptive-beta configuration."""

    name = "pariskv"
    capturable = True
    capturable_index = True
    granularity = "token"

    m: int = 8  # subspace size: 2**m analytic centroids per subspace
    # beta: share of the middle kept by voting. Default 0.2 (kvdex); None = the paper's adaptive table
    # (pool.ADAPTIVE_RATIOS: 0.5 below 5k tokens ... 0.1 from 30k).
    candidate_ratio: float | None = 0.2
    collision_ratio: float | None = None  # rho: share of keys whose centroids vote (None: adaptive; "tiers" only)
    seed: int = 42  # SRHT signs
    kernels: Literal["auto", "torch", "triton"] = (
        "auto"  # "torch" twins, "triton", or "auto" (triton on CUDA when importable)
    )
    # kvdex extension, off by default (not in the paper): subtract a per-(sequence, kv head) mean key,
    # computed once from the first keys a layer indexes (the prefill) and then frozen, before the
    # summary. <q, k - mu> = <q, k> - <q, mu> ranks keys exactly like <q, k>, so the top-k target is
    # unchanged; it removes the common offset (Qwen2's k_proj bias) that normalise + rotate cannot
    # spread, which collapses the sign-pattern buckets (docs/policies/pariskv.md, "Why recall is low").
    center: bool = False
    # kvdex option, default 8: keep at least pool_factor * k candidates (k = tokens selected). None = the
    # paper: the pool is ceil(beta * n) whatever k is (the authors' later adaptive-k variant caps k at 10%
    # of the pool). For budgets far above the paper's k = 100 the beta pool holds too little (docs).
    pool_factor: float | None = 8
    # kvdex option, default "heads": every query head of a GQA group searches instead of the group's mean
    # query ("mean", the paper / the authors' query_avg). Each head votes with its own query over the kv
    # head's shared index and a key keeps its best head's vote; each head reranks the pool, and the final
    # top-k is by kernels.pariskv.combine_heads (the heads' attention weights summed). A head that
    # retrieves a needle the others ignore is not averaged away (docs: "GQA and the coarse stage").
    group: Literal["mean", "heads"] = "heads"
    # kvdex option, default "scores": a centroid's vote is its query score, quantised to
    # 0..kernels.pariskv.SCORE_LEVELS on one scale per kv head (kernels.pariskv.score_votes), so a key's
    # summed vote is a 1-bit estimate of <q, k/|k|>; "tiers" is the paper's (the authors' kernel) six rank
    # tiers over a quota of collision_ratio * n keys (collision_ratio is unused with "scores").
    coarse: Literal["tiers", "scores"] = "scores"
    # kvdex option, off by default (not in the paper): the coarse stage (votes, the pool's bucket top-k) runs
    # every N steps and at page joins; the steps between rerank the held pool by their own query
    pool_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()  # the Literal options' choices (Policy.__post_init__)
        check_select_every(self.select_every)
        check_select_every(self.pool_every, "pool_every")
        if self.pool_every > 1 and self.select_every > 1:
            raise ValueError("pariskv: pool_every=N replaces select_every: pass one of them (the other 1)")
        self.sizes = PoolSizes(self.candidate_ratio, self.collision_ratio, self.pool_factor)  # pool.py

    def bind(self, info: PolicyInfo) -> None:
        super().bind(info)
        if self.m not in K.VALID_M:
            raise ValueError(f"pariskv: m must be one of {K.VALID_M} (2**m centroids per subspace), got {self.m}")
        for name in ("candidate_ratio", "collision_ratio"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"pariskv: {name} must be in (0, 1] or None (adaptive), got {v!r}")
        if not isinstance(self.center, bool):
            raise ValueError(f"pariskv: center must be True or False, got {self.center!r}")
        pf = self.pool_factor
        if pf is not None and (isinstance(pf, bool) or not isinstance(pf, (int, float)) or not pf >= 1):
            raise ValueError(f"pariskv: pool_factor must be a number >= 1 or None, got {pf!r}")
        self.rot_dim = K.padded_dim(info.head_dim)
        if self.m > self.rot_dim:
            raise ValueError(f"pariskv: m={self.m} exceeds the rotated head dim {self.rot_dim}; pass a smaller m")
        self.signs = K.srht_signs(info.head_dim, self.seed)
        self.thresholds, self.centers = K.magnitude_levels(self.m)
        # the middle keys' codes per layer, center=True's mean keys (summary.py)
        self.summary = KeySummary(self.num_sub, self.rot_dim // 2, self.m, info.head_dim, self.cfg.page_size,
                                  self.center)  # fmt: skip
        self._ops: types.ModuleType | None = None  # the kernels' module (ops)
        self._consts: dict[torch.device, tuple] = {}
        self.pools = HeldPools()  # pool_every: layer -> the coarse stage's candidates [R, C] of its last refresh

    def consts(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(SRHT signs, magnitude thresholds, centers, centroid codebook, SRHT matrix) on ``device`` (copied once)."""
        if device not in self._consts:
            book = K.centroid_codebook(self.m)
            rot = K.srht_matrix(self.info.head_dim, self.signs)
            consts = (self.signs, self.thresholds, self.centers, book, rot)
            self._consts[device] = tuple(x.to(device) for x in consts)
        return self._consts[device]

    # ---- kernels ---------------------------------------------------------------------------
    def ops(self, device: torch.device) -> types.ModuleType:
        """The kernel module for ``device``: Triton on CUDA (when requested/available), else the twins."""
        if self._ops is None:
            use_triton = self.kernels == "triton" or (self.kernels == "auto" and device.type == "cuda")
            if use_triton:
                from kvdex.kernels import pariskv_triton as T

                if not T.available():
                    if self.kernels == "triton":
                        raise ValueError("pariskv: kernels='triton' needs the triton package (pip install triton)")
                    use_triton = False
            self._ops = T if use_triton else K
        return self._ops

    # ---- index: encode keys, the summary keeps their codes (summary.py) ------------------------
    @property
    def num_sub(self) -> int:
        return self.rot_dim // self.m

    def assign(self, layer: int, k: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Centroid ids of keys k [B, H, N, d] (``valid`` [B, N]: real, not padding); ``ids`` are the
        analytic ones -> uint8 [B, H, N, nsub]."""
        return ids

    def centroid_scores(self, layer: int, q: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
        """Query-centroid scores per subspace: q [B, H, (G,) d], qb [B, H, (G,) nsub, m] -> [B, H, (G,) nsub, 2**m]."""
        return qb @ self.consts(qb.device)[3].T

    def centroid_logits(self, layer: int, q: torch.Tensor, qb: torch.Tensor, qn: torch.Tensor) -> torch.Tensor:
        """:meth:`centroid_scores` on the scale of <q, key direction> (the analytic ones are of the unit query)."""
        return self.centroid_scores(layer, q, qb) * qn[..., None, None]

    def index(self, layer: int, update: MiddleUpdate) -> None:
        if update.empty:
            return
        b, h, pn, ps, d = update.keys.shape
        keys = update.keys.reshape(b, h, pn * ps, d)
        valid = torch.arange(pn * ps)[None, :] < (update.count * ps)[:, None]  # [B, N] (CPU)
        if self.center:
            keys = keys.float() - self.summary.key_mean(layer, keys, valid)[:, :, None, :]
        self.summary.write(layer, update, *self.encode(layer, keys, valid))

    def encode(
        self, layer: int, keys: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(centroid ids, 4-bit codes, weights) of keys [B, H, N, d] (``valid`` [B, N]: not padding)."""
        signs, thresholds, centers = self.consts(keys.device)[:3]
        ids, codes, weight = K.encode_keys(keys, signs, self.m, thresholds, centers)
        return self.assign(layer, keys, ids, valid), codes, weight

    # ---- page joins inside a captured decode step (Policy.capturable_index; summary.py) -----------------
    def reserve_index(self, layer: int, pages: int, store: LayerStore) -> None:
        self.summary.reserve_pages(layer, pages, store)

    def joined(self, layer: int, start: torch.Tensor, count: torch.Tensor) -> None:
        self.summary.joined(layer, start, count)

    def index_join(self, layer: int, join: PageJoin) -> None:
        if layer not in self.summary:
            return
        keys, valid = self.summary.join_keys(layer, join)
        self.summary.write_join(layer, join, *self.encode(layer, keys, valid), valid)

    # ---- CUDA-graph decoding (kvdex.engine.graphs) -----------------------------------------------
    # Under static sizing (``store.static``, set by the graph decoder) select issues the same device work
    # on every step between two page boundaries and reads no device value on the host: it votes over the
    # whole index capacity (slots past each row's middle length masked on the device), keeps the pool in a
    # fixed width (the largest pool any middle length up to the capacity can have; each row's own pool size
    # is a device buffer), and reranks that width. The per-row sizes (``rows``) are persistent buffers that
    # only a new middle length rewrites, in place -- before a page-boundary step (graph_key sizes them for
    # the middle during the step); the page that joins is encoded inside the step (index_join).
    # Selected tokens == dynamic sizing.
    def graph_key(self, stores: Sequence[LayerStore]) -> tuple:
        st = stores[-1]
        # host bookkeeping: the middle lengths during the step (a page that joins in it included)
        nmid = st.grid.num_middle_pages(st.lengths_host + 1) * st.grid.page_size
        n, k = int(nmid.max()), self.cfg.retrieval_tokens
        mode = "empty" if n == 0 or not self.summary.layers else ("all" if n <= k else "search")  # select's branch
        if mode != "empty":  # the sizes of this middle length, before the step (no page joins in it)
            self.sizes.rows(nmid, st.kv_heads, k, next(iter(self.summary.layers.values())).ids.device)
        caps = [i.ids.shape[2] for _, i in sorted(self.summary.layers.items())]
        widths = tuple(self.sizes.pool_width(cap, k, int(nmid.min())) for cap in caps)
        return (mode, widths, self._graph_buffers(), self.pools.key())

    def _graph_buffers(self) -> tuple:
        """Identity and shape of every persistent tensor select reads (a re-allocation is a new key)."""
        return self.summary.graph_buffers(), self.sizes.graph_buffers()

    # ---- select ------------------------------------------------------------------------------
    def reuse_steps(self) -> int:
        return self.pool_every if self.pool_every > 1 else self.select_every

    def reused(self, q: torch.Tensor, view: LayerView) -> Selection | None:
        """``pool_every``: a step between refreshes reranks the held candidates by its own query."""
        cand = self.pools.get(view.layer) if self.pool_every > 1 else None
        nmid = view.grid.num_middle_pages(view.lengths_host) * view.page_size  # [B] CPU, as select sees it
        if cand is None or view.layer not in self.summary or int(nmid.max()) <= view.retrieval_tokens:
            return None  # the layer attends its last selection (the whole middle, or nothing yet)
        final = self.fine(view.layer, q, cand, view.retrieval_tokens, view.scale)
        return Selection(tokens=torch.where(final >= 0, final + view.sink, -1))

    def select(self, q: torch.Tensor, view: LayerView) -> Selection:
        layer, k = view.layer, view.retrieval_tokens
        b, h = view.batch, view.kv_heads
        static = view.static
        nmid = view.grid.num_middle_pages(view.lengths_host) * view.page_size  # [B] CPU
        n = int(nmid.max())
        if layer not in self.summary or n == 0:
            return Selection(tokens=view.no_ids(q.device))
        if n <= k:  # the whole middle fits the budget: attend all of it (== dense)
            w = k if static else n  # static: a fixed width, -1 past each sequence's middle
            j = torch.arange(w, device=q.device)
            pos = torch.where(j[None, :] < self.sizes.rows(nmid, h, k, q.device).n_seq[:, None], view.sink + j, -1)
            return Selection(tokens=pos[:, None, :].expand(b, h, w).contiguous())
        cand, _ = self.search(layer, q, n, nmid, k, static=static, scale=view.scale)
        return Selection(tokens=torch.where(cand >= 0, cand + view.sink, -1))

    def votes(self, layer: int, q: torch.Tensor, n: int, nmid: torch.Tensor):
        """Coarse stage: collision scores of the first n middle tokens.

        q [B, Hq, D] -> (scores int32 [R, n] with -1 past ``nmid[b]``, rotated query blocks, query norms);
        R = B * H. ``group="mean"``: the query is the mean of the GQA group (authors' code), blocks
        [R, nsub, m] and norms [R]; ``"heads"``: every query head of the group votes (a key scores its
        best head's sum), blocks [R, G, nsub, m] and norms [R, G].
        """
        idx = self.summary[layer]
        b, hq, d = q.shape
        h = idx.ids.shape[1]
        r, g = b * h, (hq // h if self.group == "heads" else 1)
        qv, qb, qn = self._query(q, h)
        rows = self.sizes.rows(nmid, h, self.cfg.retrieval_tokens, q.device)
        ops = self.ops(q.device)
        if self.coarse == "scores":
            votes = K.score_votes(self.centroid_logits(layer, qv, qb, qn).reshape(r, g, self.num_sub, -1))
        else:
            cscore = self.centroid_scores(layer, qv, qb).reshape(r * g, self.num_sub, -1)
            counts, quotas = idx.counts.reshape(r, 1, self.num_sub, -1), rows.quotas
            if g > 1:  # every head of a row ranks the centroids against that row's key counts
                counts, quotas = counts.expand(-1, g, -1, -1), quotas.repeat_interleave(g, 0)
            votes = ops.cluster_votes(cscore, counts.reshape(r * g, self.num_sub, -1), quotas)
            votes = votes.view(r, g, self.num_sub, -1)
        votes = votes if g > 1 else votes[:, 0]  # one table per row: the paper's kernel path
        ids = idx.ids[:, :, :n].reshape(r, n, -1)
        score = ops.collision_votes(ids, votes, rows.n_row, self.max_votes)  # -1 past n_row
        return (score, *self._rows_of(qb, qn, r, g))

    def _query(self, q: torch.Tensor, h: int):
        """q [B, Hq, D] -> (the searching query [B, H, G, d] or [B, H, d] by ``group``, its rotated blocks, norms)."""
        b, hq, d = q.shape
        qg = q.float().view(b, h, hq // h, d)
        qv = qg if self.group == "heads" else qg.mean(2)  # [B, H, G, d] or [B, H, d]
        qb, qn = K.encode_query_matrix(qv, self.consts(q.device)[4], self.m)  # == encode_query, fewer kernels
        return qv, qb, qn

    def _rows_of(self, qb: torch.Tensor, qn: torch.Tensor, r: int, g: int):
        if g > 1:
            return qb.reshape(r, g, self.num_sub, self.m), qn.reshape(r, g)
        return qb.reshape(r, self.num_sub, self.m), qn.reshape(r)

    def query_blocks(self, q: torch.Tensor, h: int):
        """The rotated query blocks and norms the rerank reads: [R, G, nsub, m] and [R, G] (``group="heads"``)
        or [R, nsub, m] and [R]; R = B * H."""
        _, qb, qn = self._query(q, h)
        return self._rows_of(qb, qn, q.shape[0] * h, q.shape[1] // h if self.group == "heads" else 1)

    @property
    def max_votes(self) -> int:
        return (K.SCORE_LEVELS if self.coarse == "scores" else len(K.TIERS)) * self.num_sub

    def search(
        self,
        layer: int,
        q: torch.Tensor,
        n: int,
        nmid: torch.Tensor,
        k: int,
        static: bool = False,
        scale: float | None = None,
    ):
        """Two-stage retrieval over the first n middle tokens. q [B, Hq, D] -> (final top-k middle
        offsets [B, H, k] (-1 padded), coarse candidates [B, H, C]); offsets past ``nmid[b]`` never win.

        ``static``: vote over the whole index capacity and keep the pool in :meth:`pool_width` columns
        (CUDA-graph decoding); the extra slots and columns are masked, so the selected tokens are the same.
        ``scale``: the attention's softmax scale (``group="heads"`` combines the heads' weights;
        default 1/sqrt(head_dim)).
        """
        idx = self.summary[layer]
        ops = self.ops(q.device)
        b, h = q.shape[0], idx.ids.shape[1]
        if static:
            n = idx.ids.shape[2]
        score, qb, qn = self.votes(layer, q, n, nmid)
        rows = self.sizes.rows(nmid, h, k, q.device)  # pool sizes per sequence: a ragged batch == each alone
        c = self.sizes.pool_width(n, k, int(nmid.min())) if static else rows.width
        cand = ops.bucket_topk(score, c, self.max_votes, rows.pool)  # [R, C], -1 past a row's own count
        if self.pool_every > 1:
            self.pools.hold(layer, cand)
        return self.fine(layer, q, cand, k, scale, qb, qn), cand.view(b, h, -1)

    def fine(self, layer: int, q, cand, k: int, scale: float | None = None, qb=None, qn=None) -> torch.Tensor:
        """Fine stage: the best k of the candidates ``cand`` [R, C] (middle offsets, ``-1`` padded) by the 4-bit
        estimate -> [B, H, min(k, C)] middle offsets (``-1`` padded). ``qb``, ``qn``: the rotated query blocks
        and norms when the coarse stage made them (else from ``q`` [B, Hq, D])."""
        idx = self.summary[layer]
        ops = self.ops(q.device)
        b, h, n = q.shape[0], idx.ids.shape[1], idx.ids.shape[2]
        r, c = b * h, cand.shape[1]
        if qb is None:
            qb, qn = self.query_blocks(q, h)
        codes, weight = idx.codes[:, :, :n].reshape(r, n, -1), idx.weight[:, :, :n].reshape(r, n, -1)
        cen = self.consts(q.device)[2]
        if qb.dim() == 4:  # group="heads": the heads' estimates combined into one score per candidate
            sc = self.info.head_dim**-0.5 if scale is None else scale
            est = ops.rerank_combined(cand, codes, weight, qb, qn, cen, self.m, sc)
        else:
            est = ops.rerank_scores(cand, codes, weight, qb, qn, cen, self.m)
        # the best k candidates; on CUDA as a set (an unordered Triton top-k, ascending ids); -1: no candidate
        top = topk_ids(est, min(k, c), ordered=not est.is_cuda)
        final = torch.where(top >= 0, cand.gather(1, top.clamp(min=0)), -1)
        return final.view(b, h, -1)
