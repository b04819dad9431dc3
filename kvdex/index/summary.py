"""Semantic pages scored on the device (IceCache ``search="summary"``): per (sequence, kv head) the DCI
tree's leaf pages as a fixed-capacity table on the model's device, each page with a summary that
bounds (``"minmax"``) or approximates (``"centroid"``) its keys' inner products with a query.

A step scores every page of every (sequence, kv head) at once from the summaries alone (no tree
search, no host sync) and takes pages with the policy's budget rule (:func:`kvdex.index.pages.greedy_fit`:
best first, a page taken if its fill fits the room left, at most ``cap`` pages), so a selection is
a fixed-width ``-1``-padded list of token positions: replayable from a CUDA graph.

Summaries (``q`` one query head, ``k`` the keys of a page):

* ``"minmax"``: per channel the min and max key (Quest's bound on semantic pages),
  ``relu(q).max + min(q, 0).min >= q.k`` for every key of the page (exact: min/max are key values);
* ``"centroid"``: the mean key ``mu`` and the radius ``r = max |k - mu|``: ``q.mu + |q| r >= q.k``
  (Cauchy-Schwarz; ``r`` is kept conservative under insertions: ``r' = max(r + |mu' - mu|, |k - mu'|)``).

Layout per layer: ``pos`` [B, H, C + 1, ps] token positions (int32, -1 empty), ``fill`` [B, H, C + 1],
the summaries [B, H, C + 1, D] (key dtype; the centroid's radius fp32 [B, H, C + 1]); page ``C`` of
every row is a trash page that masked writes go to (its fill stays 0, so it is never scored).
``npages`` [B, H] (device) counts the pages used; ``rows`` [B] (host) bounds it per sequence (a join adds
at most one page to each of a sequence's rows) and ``bound`` is its max, so the capacity grows on the host,
without reading the device, outside any captured step (:meth:`SemanticPages.joined` / ``ensure``).

Pages come from the prefill's trees (built on the host, :meth:`SemanticPages.from_trees`), or from the same
leaf-node definition computed on the device (:mod:`kvdex.index.leaf_pages`, ``build="device"``). A window
page that joins the middle is placed on the device (:meth:`SemanticPages.insert_device`, fixed shapes,
capturable; masked to the sequences it joins): each
key goes to the nearest page (distance to the page's box centre / centroid); it joins that page if
it has room (keys of the same page in the order they come), else it spills into one new page per
(sequence, kv head) that holds every key of this window page that did not fit, like a leaf node that
outgrows its page.
"""

from __future__ import annotations

import torch

from kvdex.index.pages import greedy_fit
from kvdex.kernels import scoring
from kvdex.kernels.dispatch import triton_kernel
from kvdex.kernels.scoring import page_bounds, share_candidates, slot_scores, topk_ids

SUMMARIES = ("minmax", "centroid")
MERGES = ("rank", "max", "nsa")
_INF = float("inf")


class SemanticPages:
    """The semantic pages of one layer's (sequence, kv head) rows on one device."""

    def __init__(self, B: int, H: int, D: int, ps: int, cap: int, kind: str, dtype, device):
        if kind not in SUMMARIES:
            raise ValueError(f"summary must be one of {', '.join(SUMMARIES)}, got {kind!r}")
        self.kind, self.ps, self.dtype, self.device = kind, ps, dtype, torch.device(device)
        self.B, self.H, self.D = B, H, D
        self.bound = 0
        # host, per sequence: an upper bound on its rows' page counts (max over its heads at the build, + 1
        # per page that joined since: a join adds at most one page to each of the sequence's rows)
        self.rows = torch.zeros(B, dtype=torch.long)
        self.npages = torch.zeros(B, H, dtype=torch.long, device=device)
        self.counts = torch.zeros(2, dtype=torch.long, device=device)  # pages, tokens selected (in place)
        self._alloc(cap)

    def _alloc(self, cap: int) -> None:
        B, H, D, ps, dev = self.B, self.H, self.D, self.ps, self.device
        self.pos = torch.full((B, H, cap + 1, ps), -1, dtype=torch.int32, device=dev)
        self.fill = torch.zeros(B, H, cap + 1, dtype=torch.int32, device=dev)
        if self.kind == "minmax":
            self.a = torch.full((B, H, cap + 1, D), _INF, dtype=self.dtype, device=dev)  # per-channel min
            self.b = torch.full((B, H, cap + 1, D), -_INF, dtype=self.dtype, device=dev)  # per-channel max
        else:
            self.a = torch.zeros(B, H, cap + 1, D, dtype=self.dtype, device=dev)  # centroid
            self.b = torch.zeros(B, H, cap + 1, dtype=torch.float32, device=dev)  # radius

    @property
    def capacity(self) -> int:
        return self.pos.shape[2] - 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every device tensor a selection reads (a CUDA graph's inputs)."""
        return self.pos, self.fill, self.a, self.b, self.counts

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pos, self.fill, self.a, self.b, self.npages))

    def joined(self, ok: torch.Tensor) -> None:
        """Host side of a page joining the rows of the sequences ``ok`` [B] (CPU bool): the host bound
        and, where it reaches the capacity, a larger table (a copy, outside any captured step). No
        device value is read."""
        self.rows += ok.to(self.rows.dtype)
        self.bound = int(self.rows.max())
        self.ensure(self.bound)

    def ensure(self, pages: int) -> None:
        """Capacity for ``pages`` pages in every row: grows the table (a copy) if it has fewer."""
        cap = self.capacity
        if pages <= cap:
            return
        old = (self.pos, self.fill, self.a, self.b)
        self._alloc(max(pages, cap + max(16, cap // 16)))
        for new, o in zip((self.pos, self.fill, self.a, self.b), old, strict=True):
            new[:, :, :cap] = o[:, :, :cap]

    # ---- building from the prefill's trees (host) -------------------------------------------------
    @classmethod
    def from_trees(cls, trees, keys, first, kind, ps, dtype, device, B, H):
        """The pages of ``trees`` (row ``b * H + h``, None: no pages) with their summaries from the keys
        [B, H, Pn, ps, D] (host) of the pages starting at token position ``first[b]``."""
        return cls.from_table(cls.host_table(trees, keys, first, kind, ps, dtype, H), kind, ps, dtype, device, B, H)

    @staticmethod
    def host_table(trees, keys, first, kind, ps, dtype, H) -> dict:
        """:meth:`from_trees`' table on the host: pos, fill, a, b [B * H, C + 1, ...], npages [B * H] and
        ``used`` (the most pages of a row). Forks of one prefill share it (read only)."""
        D = keys.shape[-1]
        rows = []
        for t, tree in enumerate(trees):
            if tree is None or tree.num_pages == 0:
                rows.append(None)
                continue
            b, h = divmod(t, H)
            pos = tree.page_positions(torch.arange(tree.num_pages))  # [P, ps]
            k = keys[b, h].reshape(-1, D)[(pos - first[b]).clamp(min=0)].float()  # [P, ps, D]
            rows.append((t, pos, k, pos >= 0))
        used = max((r[1].shape[0] for r in rows if r is not None), default=0)
        R, C = len(trees), used + max(16, used // 16) + 1  # with the trash page
        pos_all = torch.full((R, C, ps), -1, dtype=torch.int32)
        fill = torch.zeros(R, C, dtype=torch.int32)
        if kind == "minmax":
            a, b_ = torch.full((R, C, D), _INF, dtype=dtype), torch.full((R, C, D), -_INF, dtype=dtype)
        else:
            a, b_ = torch.zeros(R, C, D, dtype=dtype), torch.zeros(R, C, dtype=torch.float32)
        npages = torch.zeros(R, dtype=torch.long)
        for r in rows:
            if r is None:
                continue
            t, pos, k, ok = r
            P = pos.shape[0]
            pos_all[t, :P], fill[t, :P], npages[t] = pos.int(), ok.sum(1).int(), P
            a[t, :P], b_[t, :P] = page_summaries(k, ok, kind, dtype)
        return dict(pos=pos_all, fill=fill, a=a, b=b_, npages=npages, used=used)

    @classmethod
    def from_table(cls, table: dict, kind, ps, dtype, device, B, H, copy: bool = True):
        """The pages of a :meth:`host_table` (or of :func:`kvdex.index.leaf_pages.leaf_page_table`, on the
        device) on ``device``: copies (the table is not changed), or with ``copy=False`` the table's own
        tensors (already on ``device``; the pages then write into them)."""
        D, C = table["a"].shape[2], table["pos"].shape[1]
        self = cls(B, H, D, ps, C - 1 if copy else 0, kind, dtype, device)
        nb = self.device.type == "cuda"
        for name in ("pos", "fill", "a", "b"):
            if copy:
                dst = getattr(self, name)
                dst.copy_(table[name].view_as(dst), non_blocking=nb)
            else:
                setattr(self, name, table[name].view(B, H, *table[name].shape[1:]))
        self.npages.copy_(table["npages"].view(B, H), non_blocking=nb)
        self.rows = table.get("row_pages", table["npages"]).view(B, H).amax(1)  # host
        self.bound = table["used"]
        return self

    # ---- a window page joins (device, fixed shapes) -----------------------------------------------
    def insert(self, keys: torch.Tensor, positions: torch.Tensor, ok: torch.Tensor) -> None:
        """Place one page of keys [B, H, ps, D] (device) at token positions [B, ps] into the rows of the
        sequences ``ok`` [B] (CPU bool): :meth:`joined` (host), then :meth:`insert_device`."""
        if not bool(ok.any()):
            return
        self.joined(ok)
        self.insert_device(keys, positions, ok)

    def insert_device(self, keys: torch.Tensor, positions: torch.Tensor, ok: torch.Tensor) -> None:
        """The device side of :meth:`insert` (after :meth:`joined` made room): fixed shapes, no host read of
        a device value, in place (CUDA-graph capturable); ``ok`` [B] bool on any device, positions
        [B, ps]. The rows of the other sequences are not changed (their keys go to the trash page)."""
        B, H, D, ps = self.B, self.H, self.D, self.ps
        C = self.capacity + 1  # with the trash page
        R = B * H
        k = keys.reshape(R, ps, D)
        ops = triton_kernel("semantic_triton", on=k) or scoring  # on CUDA two kernels, no fp32 copy of the table
        fill = self.fill.view(R, C)
        a, b = self.a.view(R, C, *self.a.shape[3:]), self.b.view(R, C, *self.b.shape[3:])
        tgt = ops.nearest_pages(k, a, b, fill, self.kind)  # [R, ps] the nearest live page
        ops.insert_pages(k, tgt, ok, positions, self.pos.view(R, C, ps), fill, self.npages.view(R), a, b, self.kind)

    # ---- a decode step (device, fixed shapes) -----------------------------------------------------
    def scores(self, q: torch.Tensor, P: int) -> torch.Tensor:
        """Each query head's bound (or estimate) of q.k per page: q [B, Hq, D] -> [B, Hq, P] fp32,
        -inf for pages without keys."""
        B, Hq, D = q.shape
        H = self.H
        if self.kind == "minmax":
            s = page_bounds(q, self.a[:, :, :P], self.b[:, :, :P])
        else:
            qg = q.view(B, H, Hq // H, D).float()
            s = torch.einsum("bhgd,bhpd->bhgp", qg, self.a[:, :, :P].float())
            s = (s + qg.norm(dim=-1, keepdim=True) * self.b[:, :, None, :P]).reshape(B, Hq, P)
        live = (self.fill[:, :, :P] > 0).repeat_interleave(Hq // H, 1)
        return torch.where(live, s, -_INF)

    def group_max(self, q: torch.Tensor, P: int) -> torch.Tensor:
        """The largest of :meth:`scores` over each kv head's query heads: [B, H, P] fp32 (the rerank's
        candidate pages). On CUDA the min/max bound runs in Quest's Triton kernel (the same bound, read in
        the summaries' dtype, the empty pages masked there; ``kvdex.kernels.quest_triton``) instead of fp32
        copies and per-head bounds."""
        B, Hq, _ = q.shape
        fast = triton_kernel("quest_triton", "page_scores", on=q) if self.kind == "minmax" else None
        if fast is None:
            return self.scores(q, P).view(B, self.H, Hq // self.H, P).amax(2)
        return fast(q, self.a[:, :, :P], self.b[:, :, :P], fill=self.fill)  # -inf where a page holds no key

    def candidates(self, q, P: int, k: int, share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The rerank's candidate pages of the queries q [B, Hq, D] among the first ``P`` pages of every row:
        the ``k`` best by summary (the group's max), with ``share`` > 0 at least that share of each row's
        pages (:func:`kvdex.kernels.scoring.share_candidates`). Returns their page ids [R, Pc] (``-1``: none)
        and their token positions [R, Pc * ps] int32 (``-1``: an empty slot), R = B x kv heads."""
        R = self.B * self.H
        bound = self.group_max(q, P).view(R, 1, P)
        if share:  # at least that share of each row's pages (npages: the device count)
            cand = share_candidates(bound, k, share, self.npages.view(R))[:, 0]
        else:
            cand = topk_ids(bound, k, ordered=False)[:, 0]  # [R, Pc] a set
        ops = triton_kernel("semantic_triton", on=q) or scoring  # on CUDA the index arithmetic in two kernels
        return cand, ops.candidate_slots(cand, self.pos.view(R, -1, self.ps), self.ps)

    def rerank_tokens(self, q, slots, room: int, keys=None, token_scores=None, scores_out: list | None = None):
        """``rerank_unit="token"``: token positions [B, H, T] (``-1`` padded) of the ``room`` best candidate
        tokens at ``slots`` [R, N] (int32 positions, ``-1``: none) by the group's max q.k read from ``keys``
        [B, H, S, D], or by ``token_scores`` (slots [B, H, N] -> scores [B, H, N], ``-inf`` where none).
        ``scores_out``: a list the candidates' scores [R, N] are appended to (:meth:`narrow`)."""
        B, H, ps = self.B, self.H, self.ps
        R = B * H
        by = token_scores or (lambda s: exact_scores(q, keys, s, "max"))  # the group's max q.k by default
        score = by(slots.view(B, H, -1)).view(R, -1)  # [R, N]
        if scores_out is not None:
            scores_out.append(score)
        ids = topk_ids(score[:, None], room, ordered=False)[:, 0]  # [R, T] a set, -1: fewer live tokens
        ops = triton_kernel("semantic_triton", on=score) or scoring
        return ops.pick_tokens(ids, slots, ps, self.counts).view(B, H, -1)

    def narrow(self, slots: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
        """The ``k`` candidate pages of ``slots`` [R, Pc * ps] whose best token ``score`` [R, Pc * ps] is
        highest (``pool_every``: the pool the steps until the next refresh rerank): their slots [R, min(k,
        Pc) * ps] int32, page-aligned as :meth:`rerank_tokens` counts them, ``-1`` for a missing page."""
        R, ps = slots.shape[0], self.ps
        page = score.view(R, 1, -1, ps).amax(-1)  # [R, 1, Pc] the page's best token (-inf: no live token)
        ids = topk_ids(page, k, ordered=False)[:, 0]  # [R, K] a set, -1 where fewer pages hold a token
        got = slots.view(R, -1, ps).gather(1, ids.clamp(min=0)[..., None].expand(-1, -1, ps))
        return torch.where((ids >= 0)[..., None], got, -1).reshape(R, -1)

    def select(
        self,
        q,
        P: int,
        room: int,
        cap: int,
        merge: str,
        scale: float,
        keys=None,
        rerank: int = 0,
        unit: str = "page",
        share: float = 0.0,
        token_scores=None,
    ):
        """Token positions [B, H, T] (-1 padded, T = min(pages taken at most x ps, room)) of the pages
        taken for the queries q [B, Hq, D] among the first ``P`` pages of every row (the capacity under
        a CUDA graph, ``bound`` otherwise: the same pages). ``rerank`` > 0: the ``rerank * cap`` best pages
        by summary (the group's max) are ranked by the exact max q.k of their keys, read from ``keys``
        [B, H, S, D] (slot == position: a GPU-resident store); ``unit="token"``: the ``room`` best tokens of
        those candidate pages by the group's max q.k instead (no page fit), or by ``token_scores`` (a callable:
        the candidates' slots [B, H, N] -> their scores [B, H, N], ``-inf`` where none; IceCache's weights).
        ``share`` > 0: at least that share of each row's pages are candidates
        (:func:`kvdex.kernels.scoring.share_candidates`)."""
        B, Hq, D = q.shape
        H, ps, dev = self.H, self.ps, q.device
        G, R = Hq // H, B * self.H
        if P == 0 or room <= 0:
            return torch.full((B, H, 0), -1, dtype=torch.long, device=dev)
        cand = None  # page id of each scored column (None: column == page)
        if rerank:
            cand, slots = self.candidates(q, P, rerank * cap, share)
            if unit == "token":
                return self.rerank_tokens(q, slots, room, keys, token_scores)
            cand = cand.clamp(min=0)
            slots = slots.view(B, H, -1)
            s = exact_scores(q, keys, slots, "heads").view(R, G, -1, ps).amax(-1)  # [R, G, Pc]
        else:
            s = self.scores(q, P).view(R, G, P)
        P = s.shape[2]
        M = min(P, 2 * cap)
        if merge == "rank":  # the union over the group, rank-major (every head's best page, then the second, ...)
            c = min(P, cap)
            val, ids = torch.topk(s, c, dim=2)  # [R, G, c]
            ok = torch.isfinite(val).transpose(1, 2).reshape(R, -1)
            ids = ids.transpose(1, 2).reshape(R, -1)
            N = ids.shape[1]
            key = torch.where(ok, ids, P).int()  # int32 keys: half the radix passes of int64
            srt, perm = torch.sort(key, dim=1, stable=True)
            first = torch.ones_like(ok)
            first[:, 1:] = srt[:, 1:] != srt[:, :-1]
            keep = torch.zeros_like(ok).scatter_(1, perm, first & (srt < P))
            col = torch.arange(N, device=dev)[None, :]
            order = torch.sort(torch.where(keep, col, N + col).int(), dim=1).values[:, :M].long()
            valid = order < N
            order = torch.where(valid, ids.gather(1, order.clamp(max=N - 1)), 0)
        else:
            if merge == "max":  # Quest's GQA rule: the max of the group's bounds
                score = s.amax(1)
            else:  # "nsa": each head's softmax over the pages' scores, summed over the group
                prob = torch.softmax(s * scale, dim=2).nan_to_num(0.0)
                score = torch.where(torch.isfinite(s[:, 0]), prob.sum(1), -_INF)
            val, order = torch.topk(score, M, dim=1)
            valid = torch.isfinite(val)
        if cand is not None:
            order = cand.gather(1, order)
        fill = self.fill.view(R, -1)
        f = torch.where(valid, fill.gather(1, order).long(), 0)
        taken = greedy_fit(f, valid, room, cap, ps)
        Tp = min(M, cap)
        col = torch.arange(M, device=dev)[None, :]
        sel = torch.sort(torch.where(taken, col, M + col).int(), dim=1).values[:, :Tp].long()
        pages = torch.where(sel < M, order.gather(1, sel.clamp(max=M - 1)), -1)
        rows = torch.arange(R, device=dev)[:, None] * fill.shape[1]
        pos = self.pos.view(R * fill.shape[1], ps)[(rows + pages.clamp(min=0)).flatten()].view(R, Tp * ps)
        pos = torch.where((pages >= 0).repeat_interleave(ps, 1), pos, -1)
        T = min(Tp * ps, room)
        keep = torch.argsort((pos < 0).to(torch.int8), dim=1, stable=True)[:, :T]
        out = pos.gather(1, keep).long()
        self.counts.add_(torch.stack([taken.sum(), (out >= 0).sum()]))
        return out.view(B, H, T)


def exact_scores(q: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, group: str) -> torch.Tensor:
    """Exact ``q.k`` of the keys at ``slots`` [B, H, N] (-1: none) of ``keys`` [B, H, S, D] (slot ==
    position), fp32, -inf where none: ``group="max"`` [B, H, N] the kv head's largest, ``"heads"``
    [B, H, G, N] per query head. On CUDA one Triton kernel reads the keys in place
    (:func:`kvdex.kernels.rerank_triton.slot_scores`); elsewhere its twin gathers them."""
    fast = triton_kernel("rerank_triton", "slot_scores", on=q)
    if fast is not None:
        return fast(q, keys, slots, group=group)
    return slot_scores(q, keys, slots, group)


def page_summaries(k: torch.Tensor, held: torch.Tensor, kind: str, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The summaries of pages of keys ``k`` [..., ps, D] whose slots ``held`` [..., ps] hold a key:
    ``"minmax"``: per-channel min and max ([..., D], ``dtype``; +inf / -inf for an empty page);
    ``"centroid"``: the mean key ([..., D], ``dtype``) and the radius max |k - mu| ([...], fp32)."""
    m = held[..., None]
    if kind == "minmax":
        return k.masked_fill(~m, _INF).amin(-2).to(dtype), k.masked_fill(~m, -_INF).amax(-2).to(dtype)
    kf = k.float()
    mu = ((kf * m).sum(-2) / held.sum(-1, keepdim=True).clamp(min=1)).to(dtype)
    return mu, ((kf - mu.float()[..., None, :]).norm(dim=-1) * held).amax(-1)


def summary_stats(layers) -> dict:
    """``policy_stats`` of the layers' :class:`SemanticPages`: pages and tokens selected, pages held,
    tokens per page, the index bytes and (dense KV of the held tokens + index) / dense KV (one sync)."""
    out = dict(pages_selected=0, tokens_selected=0, semantic_pages=0, summary_index_bytes=0)
    kv = held = 0
    for p in layers:
        pages, tokens = p.counts.tolist()
        out["pages_selected"] += pages
        out["tokens_selected"] += tokens
        out["semantic_pages"] += int(p.npages.sum())
        out["summary_index_bytes"] += p.nbytes()
        n = int(p.fill.sum())
        held += n
        kv += n * 2 * p.D * p.a.element_size()
    out["tokens_per_semantic_page"] = held / max(1, out["semantic_pages"])
    out["semantic_store_per_dense_kv"] = (kv + out["summary_index_bytes"]) / kv if kv else 0.0
    return out
