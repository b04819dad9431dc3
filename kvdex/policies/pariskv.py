"""``pariskv``: ParisKV (Qi et al., ICML 2026, arXiv 2602.07721) -- drift-robust top-k token retrieval.

Index (``index``, at prefill and whenever a window page joins the middle): every middle key is
l2-normalised and rotated by a shared SRHT; in each of its ``B = D/m`` subspaces it keeps the id of
the nearest *analytic* centroid of ``{+-1/sqrt(m)}^m`` (its sign pattern), a 4-bit direction code
and a weight ``|k| r / alpha`` (``kvdex.kernels.pariskv``). The summary lives on the device; with
``offload=True`` the full-precision K/V of the middle lives in host memory. Centroids are fixed by
``m`` alone, so no centroid is ever learned or re-learned: keys generated late in a long decode are
summarised exactly like prefill keys (the paper's drift-robustness claim).

Select (every step, per sparse layer and kv head): the query (mean over the GQA group, as the
authors' code) gets the same transform; in every subspace its best centroids vote for their keys
(six cumulative tiers over a quota of ``collision_ratio * n`` keys); the ``candidate_ratio * n``
keys with the most votes are kept by a bucket top-k on the integer scores; the 4-bit estimate
``|q| sum_b w_b <v_b, q~_b>`` reranks them and the best ``budget - sink - window`` tokens are
attended. The update buffer + sliding window of the paper is kvdex's window: a page is encoded when
it leaves the window (``window`` plays the paper's local window, a page its update buffer).

Where the paper is vague we follow the authors' released code (amy-77/ParisKV): ratios adapt to the
retrieval length (table below), tiers as in ``kernels.pariskv.TIERS``, one SRHT round, m = 8.
Documented in docs/policies/pariskv.md with measurements.

``pariskv-kmeans`` is the drift baseline of the paper's ablation ("no normalise+rotate, learned
centroids"): identical except that the centroids of each subspace are learned by k-means on the
prefill keys (raw key space) and then frozen; later keys are assigned to the nearest of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdex.kernels import pariskv as K
from kvdex.policies.base import Policy, register_policy
from kvdex.selection import Selection

_GROW = 4096  # tokens of index capacity added at a time

# (retrieval length below, candidate_ratio beta, collision_ratio rho): the authors' adaptive table.
ADAPTIVE_RATIOS = ((5_000, 0.5, 0.5), (10_000, 0.25, 0.3), (30_000, 0.2, 0.25), (math.inf, 0.1, 0.2))
KERNELS = ("auto", "torch", "triton")
GROUPS = ("mean", "heads")  # the GQA reduction: the group's mean query (authors) or every query head
COARSE = ("tiers", "scores")  # the vote table: the authors' rank tiers, or quantised centroid scores


def adaptive_ratios(n: int) -> tuple[float, float]:
    """(candidate_ratio, collision_ratio) for a retrieval zone of n tokens."""
    for limit, beta, rho in ADAPTIVE_RATIOS:
        if n < limit:
            return beta, rho
    raise AssertionError("unreachable")


@dataclass
class _LayerIndex:
    """The device-resident summary of one layer's middle tokens, slot j == position sink + j."""

    ids: torch.Tensor  # uint8 [B, H, cap, nsub]
    codes: torch.Tensor  # uint8 [B, H, cap, D/2]
    weight: torch.Tensor  # bf16  [B, H, cap, D/m]
    counts: torch.Tensor  # int32 [B, H, nsub, 2**m] keys per centroid
    n: torch.Tensor  # int64 [B] (CPU) encoded tokens per sequence


@dataclass
class _Rows:
    """Per-row sizes of one middle length (R = B * H rows), persistent device buffers that a new middle
    length (a page boundary) rewrites in place, so a captured CUDA graph reads the current sizes."""

    n_seq: torch.Tensor  # [B] middle tokens per sequence
    n_row: torch.Tensor  # [R]
    quotas: torch.Tensor  # [R, len(TIERS)] vote-tier key quotas
    pool: torch.Tensor  # [R] candidates kept by voting
    width: int  # max pool
    lengths: tuple  # the middle lengths these sizes are for (host)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.n_seq, self.n_row, self.quotas, self.pool


@register_policy
@dataclass
class ParisKVPolicy(Policy):
    name = "pariskv"
    capturable = True
    capturable_index = True
    granularity = "token"

    m: int = 8  # subspace size: 2**m analytic centroids per subspace
    candidate_ratio: float | None = None  # beta: share of the middle kept by voting (None: adaptive)
    collision_ratio: float | None = None  # rho: share of keys whose centroids vote (None: adaptive)
    seed: int = 42  # SRHT signs
    kernels: str = "auto"  # "torch" twins, "triton", or "auto" (triton on CUDA when importable)
    # kvdex extension, off by default (not in the paper): subtract a per-(sequence, kv head) mean key,
    # computed once from the first keys a layer indexes (the prefill) and then frozen, before the
    # summary. <q, k - mu> = <q, k> - <q, mu> ranks keys exactly like <q, k>, so the top-k target is
    # unchanged; it removes the common offset (Qwen2's k_proj bias) that normalise + rotate cannot
    # spread, which collapses the sign-pattern buckets (docs/policies/pariskv.md, "Why recall is low").
    center: bool = False
    # kvdex option, off by default: keep at least pool_factor * k candidates (k = tokens selected). The
    # paper's pool is ceil(beta * n) whatever k is; the authors' later adaptive-k variant caps k at 10% of
    # the pool. For budgets far above the paper's k = 100 the beta pool holds too little (docs).
    pool_factor: float | None = None
    # kvdex option, off by default: "heads" searches with every query head of a GQA group instead of the
    # group's mean query. Each head votes with its own query over the kv head's shared index and a key
    # keeps its best head's vote; each head reranks the pool, and the final top-k is by
    # kernels.pariskv.combine_heads (the heads' attention weights summed). A head that retrieves a needle
    # the others ignore is not averaged away (docs: "GQA and the coarse stage").
    group: str = "mean"
    # kvdex option, off by default: "scores" makes a centroid's vote its query score, quantised to
    # 0..kernels.pariskv.SCORE_LEVELS on one scale per kv head (kernels.pariskv.score_votes), so a key's
    # summed vote is a 1-bit estimate of <q, k/|k|>; "tiers" is the authors' six rank tiers over a quota of
    # collision_ratio * n keys (collision_ratio is unused with "scores").
    coarse: str = "tiers"

    def bind(self, info) -> None:
        super().bind(info)
        if self.m not in K.VALID_M:
            raise ValueError(f"pariskv: m must be one of {K.VALID_M} (2**m centroids per subspace), got {self.m}")
        for name in ("candidate_ratio", "collision_ratio"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"pariskv: {name} must be in (0, 1] or None (adaptive), got {v!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"pariskv: kernels must be one of {KERNELS}, got {self.kernels!r}")
        if not isinstance(self.center, bool):
            raise ValueError(f"pariskv: center must be True or False, got {self.center!r}")
        if self.group not in GROUPS:
            raise ValueError(f"pariskv: group must be one of {GROUPS}, got {self.group!r}")
        if self.coarse not in COARSE:
            raise ValueError(f"pariskv: coarse must be one of {COARSE}, got {self.coarse!r}")
        pf = self.pool_factor
        if pf is not None and (isinstance(pf, bool) or not isinstance(pf, (int, float)) or not pf >= 1):
            raise ValueError(f"pariskv: pool_factor must be a number >= 1 or None, got {pf!r}")
        self.rot_dim = K.padded_dim(info.head_dim)
        if self.m > self.rot_dim:
            raise ValueError(f"pariskv: m={self.m} exceeds the rotated head dim {self.rot_dim}; pass a smaller m")
        self.signs = K.srht_signs(info.head_dim, self.seed)
        self.thresholds, self.centers = K.magnitude_levels(self.m)
        self.index_: dict[int, _LayerIndex] = {}
        self.means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # center=True: layer -> (mu [B, H, d], set [B])
        self._ops = None
        self._consts: dict[torch.device, tuple] = {}
        self._rows: dict[tuple, _Rows] = {}
        self._done_dev: dict[int, torch.Tensor] = {}  # center=True, page joins: the means set, on the device

    def consts(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(SRHT signs, magnitude thresholds, centers, centroid codebook, SRHT matrix) on ``device`` (copied once)."""
        if device not in self._consts:
            book = K.centroid_codebook(self.m)
            rot = K.srht_matrix(self.info.head_dim, self.signs)
            consts = (self.signs, self.thresholds, self.centers, book, rot)
            self._consts[device] = tuple(x.to(device) for x in consts)
        return self._consts[device]

    # ---- kernels ---------------------------------------------------------------------------
    def ops(self, device: torch.device):
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

    # ---- index -------------------------------------------------------------------------------
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

    def index(self, layer, update) -> None:
        if update.empty:
            return
        b, h, pn, ps, d = update.keys.shape
        keys = update.keys.reshape(b, h, pn * ps, d)
        valid = torch.arange(pn * ps)[None, :] < (update.count * ps)[:, None]  # [B, N] (CPU)
        if self.center:
            keys = keys.float() - self.key_mean(layer, keys, valid)[:, :, None, :]
        signs, thresholds, centers = self.consts(keys.device)[:3]
        ids, codes, weight = K.encode_keys(keys, signs, self.m, thresholds, centers)
        ids = self.assign(layer, keys, ids, valid)
        start, count = update.start * ps, update.count * ps
        idx = self._reserve(layer, int((start + count).max()), keys)
        for bi in torch.nonzero(update.count).flatten().tolist():
            s, c = int(start[bi]), int(count[bi])
            idx.ids[bi, :, s : s + c] = ids[bi, :, :c]
            idx.codes[bi, :, s : s + c] = codes[bi, :, :c]
            idx.weight[bi, :, s : s + c] = weight[bi, :, :c]
            valid = torch.ones(h, c, dtype=torch.bool, device=keys.device)
            idx.counts[bi] += K.cluster_counts(ids[bi, :, :c], valid, 1 << self.m)
            idx.n[bi] = max(int(idx.n[bi]), s + c)

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

    # ---- CUDA-graph decoding (kvdex.integration.graph) -----------------------------------------------
    # Under static sizing (``store.static``, set by the graph decoder) select issues the same device work
    # on every step between two page boundaries and reads no device value on the host: it votes over the
    # whole index capacity (slots past each row's middle length masked on the device), keeps the pool in a
    # fixed width (the largest pool any middle length up to the capacity can have; each row's own pool size
    # is a device buffer), and reranks that width. The per-row sizes (``rows``) are persistent buffers that
    # only a new middle length rewrites, in place -- before a page-boundary step (graph_key sizes them for
    # the middle during the step); the page that joins is encoded inside the step (index_join).
    # Selected tokens == dynamic sizing.
    def graph_key(self, stores) -> tuple:
        st = stores[-1]
        # host bookkeeping: the middle lengths during the step (a page that joins in it included)
        nmid = st.grid.num_middle_pages(st.lengths_host + 1) * st.grid.page_size
        n, k = int(nmid.max()), self.cfg.retrieval_tokens
        mode = "empty" if n == 0 or not self.index_ else ("all" if n <= k else "search")  # select's branch
        if mode != "empty":  # the sizes of this middle length, before the step (no page joins in it)
            self.rows(nmid, st.kv_heads, k, next(iter(self.index_.values())).ids.device)
        widths = tuple(self.pool_width(i.ids.shape[2], k, int(nmid.min())) for _, i in sorted(self.index_.items()))
        return (mode, widths, self._graph_buffers())

    def _graph_buffers(self) -> tuple:
        """Identity and shape of every persistent tensor select reads (a re-allocation is a new key)."""
        idx = tuple(
            (lay, id(i.ids), tuple(i.ids.shape), id(i.codes), id(i.weight), id(i.counts))
            for lay, i in sorted(self.index_.items())
        ) + tuple((lay, id(self.means[lay][0]), id(d)) for lay, d in sorted(self._done_dev.items()))
        rows = tuple((key, id(r.n_row), id(r.quotas), id(r.pool)) for key, r in self._rows.items())
        return idx, rows

    # ---- select ------------------------------------------------------------------------------
    def select(self, layer, q, store, scale) -> Selection:
        k = self.cfg.retrieval_tokens
        b, h = store.batch, store.kv_heads
        static = getattr(store, "static", False)
        nmid = store.grid.num_middle_pages(store.lengths_host) * store.grid.page_size  # [B] CPU
        n = int(nmid.max())
        if layer not in self.index_ or n == 0:
            return Selection(tokens=torch.full((b, h, 0), -1, dtype=torch.long, device=q.device))
        if n <= k:  # the whole middle fits the budget: attend all of it (== dense)
            w = k if static else n  # static: a fixed width, -1 past each sequence's middle
            j = torch.arange(w, device=q.device)
            pos = torch.where(j[None, :] < self.rows(nmid, h, k, q.device).n_seq[:, None], store.grid.sink + j, -1)
            return Selection(tokens=pos[:, None, :].expand(b, h, w).contiguous())
        cand, _ = self.search(layer, q, n, nmid, k, static=static, scale=scale)
        return Selection(tokens=torch.where(cand >= 0, cand + store.grid.sink, -1))

    def votes(self, layer: int, q: torch.Tensor, n: int, nmid: torch.Tensor):
        """Coarse stage: collision scores of the first n middle tokens.

        q [B, Hq, D] -> (scores int32 [R, n] with -1 past ``nmid[b]``, rotated query blocks, query norms);
        R = B * H. ``group="mean"``: the query is the mean of the GQA group (authors' code), blocks
        [R, nsub, m] and norms [R]; ``"heads"``: every query head of the group votes (a key scores its
        best head's sum), blocks [R, G, nsub, m] and norms [R, G].
        """
        idx = self.index_[layer]
        b, hq, d = q.shape
        h = idx.ids.shape[1]
        r, g = b * h, (hq // h if self.group == "heads" else 1)
        qg = q.float().view(b, h, hq // h, d)
        qv = qg if self.group == "heads" else qg.mean(2)  # [B, H, G, d] or [B, H, d]
        qb, qn = K.encode_query_matrix(qv, self.consts(q.device)[4], self.m)  # == encode_query, fewer kernels
        rows = self.rows(nmid, h, self.cfg.retrieval_tokens, q.device)
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
        score = ops.collision_votes(idx.ids[:, :, :n].reshape(r, n, -1), votes, rows.n_row)  # -1 past n_row
        if g > 1:
            return score, qb.reshape(r, g, self.num_sub, self.m), qn.reshape(r, g)
        return score, qb.reshape(r, self.num_sub, self.m), qn.reshape(r)

    def rows(self, nmid: torch.Tensor, h: int, k: int, device) -> _Rows:
        """Per-row sizes for middle lengths ``nmid`` [B] (CPU), on ``device``. Recomputed only when the
        middle lengths change (a page boundary) and then written *in place* into the same device buffers,
        so steps in between copy nothing to the device and a captured graph reads the current sizes."""
        lengths = tuple(nmid.tolist())
        key = (h, k, device)
        cur = self._rows.get(key)
        if cur is None or cur.lengths != lengths:
            rho = torch.tensor([self.ratios(int(x))[1] for x in nmid]).repeat_interleave(h)
            pool = self.pool_sizes(nmid, k)
            vals = (
                nmid.long(),
                nmid.long().repeat_interleave(h),
                K.tier_quotas(nmid.repeat_interleave(h), rho),
                torch.tensor(pool, dtype=torch.long).repeat_interleave(h),
            )
            if cur is None or any(t.shape != v.shape for t, v in zip(cur.buffers(), vals, strict=True)):
                bufs = [torch.empty(v.shape, dtype=v.dtype, device=device) for v in vals]
                cur = self._rows[key] = _Rows(*bufs, width=0, lengths=())
            for t, v in zip(cur.buffers(), vals, strict=True):
                t.copy_(v)
            cur.width, cur.lengths = max(pool), lengths
        return cur

    def pool_width(self, cap: int, k: int, lo: int = 0) -> int:
        """Static pool width: the largest pool of any middle length in ``[lo, cap]`` (``lo``: the shortest
        middle of the batch now; middles only grow until the next prefill). Within one row of the adaptive
        table beta is fixed and the pool grows with n, so the maximum is at ``cap`` or at the last length
        of a table row; the width changes only when ``lo`` crosses a row or the capacity grows."""
        ends = [limit - 1 for limit, _, _ in ADAPTIVE_RATIOS if limit != math.inf and lo <= limit - 1 < cap]
        return max(self._pool(n, k) for n in (*ends, cap))

    def ratios(self, n: int) -> tuple[float, float]:
        """(candidate_ratio, collision_ratio) for a sequence with n middle tokens (options or adaptive)."""
        beta, rho = adaptive_ratios(n)
        return self.candidate_ratio or beta, self.collision_ratio or rho

    def pool_sizes(self, nmid: torch.Tensor, k: int) -> list[int]:
        """Candidates kept by voting per sequence: min(n, max(k, ceil(beta * n), ceil(pool_factor * k)))."""
        return [self._pool(int(x), k) for x in nmid]

    def _pool(self, n: int, k: int) -> int:
        floor = k if self.pool_factor is None else max(k, math.ceil(self.pool_factor * k))
        return min(n, max(floor, math.ceil(self.ratios(n)[0] * n)))

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
        idx = self.index_[layer]
        ops = self.ops(q.device)
        b, h = q.shape[0], idx.ids.shape[1]
        r = b * h
        if static:
            n = idx.ids.shape[2]
        score, qb, qn = self.votes(layer, q, n, nmid)
        rows = self.rows(nmid, h, k, q.device)  # pool sizes per sequence: a ragged batch == each alone
        c = self.pool_width(n, k, int(nmid.min())) if static else rows.width
        cand = ops.bucket_topk(score, c, self.max_votes, rows.pool)  # [R, C], -1 past a row's own count
        codes, weight = idx.codes[:, :, :n].reshape(r, n, -1), idx.weight[:, :, :n].reshape(r, n, -1)
        est = ops.rerank_scores(cand, codes, weight, qb, qn, self.consts(q.device)[2], self.m)
        if est.dim() == 3:  # group="heads": [R, G, C] -> one score per candidate
            est = K.combine_heads(est, self.info.head_dim**-0.5 if scale is None else scale)
        val, top = torch.topk(est, min(k, c), dim=-1)
        final = torch.where(val > float("-inf"), cand.gather(1, top), -1)  # -inf: no candidate (1 kernel, not 4)
        return final.view(b, h, -1), cand.view(b, h, -1)


@register_policy
@dataclass
class ParisKVKMeansPolicy(ParisKVPolicy):
    """The ablation/drift baseline: k-means centroids learned on prefill keys, then frozen."""

    name = "pariskv-kmeans"
    kmeans_iters: int = 10

    def bind(self, info) -> None:
        super().bind(info)
        if info.head_dim % self.m:
            raise ValueError(f"pariskv-kmeans: head_dim {info.head_dim} is not a multiple of m={self.m}")
        if self.kmeans_iters < 1:
            raise ValueError(f"pariskv-kmeans: kmeans_iters must be >= 1, got {self.kmeans_iters}")
        self.centroids: dict[int, torch.Tensor] = {}  # layer -> [B, H, nsub_raw, 2**m, m]

    @property
    def num_sub(self) -> int:  # subspaces of the raw head dim (no rotation, no padding)
        return self.info.head_dim // self.m

    def assign(self, layer, k, ids, valid):
        sub = k.float().unflatten(-1, (-1, self.m)).transpose(2, 3)  # [B, H, nsub, N, m]
        if layer not in self.centroids:  # first update of the layer == the prefill: learn, once
            w = valid[:, None, None, :].expand(sub.shape[:-1])  # padding of a ragged batch does not count
            heads = (self.info.head_offset, self.info.kv_heads * (self.info.tp.size if self.info.tp else 1))
            self.centroids[layer] = kmeans(sub, 1 << self.m, self.kmeans_iters, self.seed, w, heads=heads)
        return nearest(sub, self.centroids[layer]).transpose(2, 3).to(torch.uint8)

    def centroid_scores(self, layer, q, qb):
        qs = q.unflatten(-1, (-1, self.m))  # raw query subspaces [B, H, (G,) nsub, m]
        c = self.centroids[layer]  # [B, H, nsub, 2**m, m]
        return ((c if qs.dim() == 4 else c[:, :, None]) @ qs[..., None])[..., 0]

    def centroid_logits(self, layer, q, qb, qn):
        return self.centroid_scores(layer, q, qb)  # raw query and raw-key centroids: already <q, c>


def kmeans(
    x: torch.Tensor,
    k: int,
    iters: int,
    seed: int,
    valid: torch.Tensor | None = None,
    heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Batched Lloyd k-means: x [..., N, m] -> centroids [..., k, m]; init: k seeded random points.

    ``valid`` [..., N] (bool, any device): only those points are sampled and averaged.
    ``heads`` = (offset, total): x is [B, H, ..., N, m] holding the model's kv heads offset ... offset +
    H - 1 of ``total`` (a tensor-parallel rank's share); every sequence of a head draws the random
    numbers of that head, so a rank (or a sequence in a batch) gets what one process gets alone.
    """
    lead, n, m = x.shape[:-2], x.shape[-2], x.shape[-1]
    xf = x.reshape(-1, n, m)
    w = torch.ones(xf.shape[:2]) if valid is None else valid.reshape(-1, n).float().cpu()
    w = w + (w.sum(-1, keepdim=True) == 0).float()  # a row without valid points: sample uniformly
    g = torch.Generator().manual_seed(seed)
    if heads is None:
        u = torch.rand(*lead, k, generator=g)
    else:  # draws of every head of the model, this process's heads picked, the same for each sequence
        off, total = heads
        u = torch.rand(total, *lead[2:], k, generator=g)[off : off + lead[1]].expand(*lead, k)
    cdf = w.cumsum(-1)  # inverse-CDF sampling with replacement, weighted by w
    init = torch.searchsorted(cdf, u.reshape(-1, k) * cdf[:, -1:], right=True).clamp(max=n - 1).to(x.device)
    c = xf.gather(1, init[..., None].expand(-1, -1, m)).clone()
    wd = w.to(x.device)
    for _ in range(iters):
        a = nearest(xf, c)  # [G, N]
        s = torch.zeros_like(c).scatter_add_(1, a[..., None].expand(-1, -1, m), xf * wd[..., None])
        cnt = torch.zeros(c.shape[:2], device=x.device).scatter_add_(1, a, wd)
        c = torch.where(cnt[..., None] > 0, s / cnt.clamp(min=1)[..., None], c)  # empty cluster: keep
    return c.view(*lead, k, m)


def nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Index of the nearest centroid: x [..., N, m], c [..., K, m] -> int64 [..., N] (chunks of N bound memory)."""
    c2 = (c * c).sum(-1)[..., None, :]
    parts = [(c2 - 2 * x[..., i : i + chunk, :] @ c.transpose(-1, -2)).argmin(-1) for i in range(0, x.shape[-2], chunk)]
    return torch.cat(parts, dim=-1) if parts else x.new_zeros(x.shape[:-1], dtype=torch.long)


def recall_at_k(
    policy: ParisKVPolicy, layer: int, q: torch.Tensor, store, k: int = 100, scale: float | None = None
) -> dict[str, float]:
    """The paper's ablation metric on one decode query, averaged over (sequence, kv head), stage by stage.

    Truth: the exact top-k middle keys by the policy's target: <q_mean, key> (``group="mean"``, the
    query the policy searches with) or :func:`kvdex.kernels.pariskv.combine_heads` of the exact
    <q_h, key> (``group="heads"``; ``scale`` default 1/sqrt(head_dim)). ``coarse``: the top-k by
    collision votes alone (bucket top-k); ``pool``: the share of the truth inside the candidate pool
    (what the rerank can at best recover); ``e2e``: the top-k after the 4-bit rerank of that pool;
    ``rerank``: the top-k by the 4-bit estimate over *every* middle key (the rerank stage alone, no
    coarse stage). All are |found & truth| / k (ANN Recall@k).
    """
    nmid = store.grid.num_middle_pages(store.lengths_host) * store.grid.page_size
    n = int(nmid.max())
    if n <= k or layer not in policy.index_:
        return {}
    keys = store.middle_keys().float()  # [B, H, n, d]
    b, hq, d = q.shape
    h = keys.shape[1]
    sc = d**-0.5 if scale is None else scale
    qg = q.float().view(b, h, hq // h, d)
    live = torch.arange(n, device=q.device)[None, None, :] < nmid.to(q.device)[:, None, None]
    if policy.group == "heads":
        exact = torch.einsum("bhgd,bhnd->bhgn", qg, keys).masked_fill(~live[:, :, None], float("-inf"))
        target = K.combine_heads(exact.reshape(b * h, hq // h, n), sc).view(b, h, n)
    else:
        target = torch.einsum("bhd,bhnd->bhn", qg.mean(2), keys).masked_fill(~live, float("-inf"))
    truth = target.topk(k, dim=-1).indices
    final, pool = policy.search(layer, q, n, nmid, k, scale=sc)
    coarse = _coarse_topk(policy, layer, q, n, nmid, k)
    everything = torch.where(live, torch.arange(n, device=q.device), -1).expand(b, h, n).reshape(b * h, n)
    _, qb, qn = policy.votes(layer, q, n, nmid)
    idx = policy.index_[layer]
    codes, weight = idx.codes[:, :, :n].reshape(b * h, n, -1), idx.weight[:, :, :n].reshape(b * h, n, -1)
    est = K.rerank_scores(everything, codes, weight, qb, qn, policy.consts(q.device)[2], policy.m)
    if est.dim() == 3:
        est = K.combine_heads(est, sc)
    rerank = est.topk(k, dim=-1).indices.view(b, h, k)

    def rec(found):
        hit = (found[..., :, None] == truth[..., None, :]).any(-2).float()  # truth entries found
        return float(hit.mean())

    return {"coarse": rec(coarse), "pool": rec(pool), "e2e": rec(final), "rerank": rec(rerank)}


def _coarse_topk(policy: ParisKVPolicy, layer, q, n, nmid, k):
    """Top-k middle offsets by collision votes only (the coarse stage ranked on its own)."""
    score, _, _ = policy.votes(layer, q, n, nmid)
    return K.bucket_topk(score, k, policy.max_votes).view(q.shape[0], -1, k)
