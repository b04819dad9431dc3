"""``chess``: CHESS (Fei et al.) -- Grid -> Chunk -> Page key-key selection, one context per step,
rebuilt only when the output distribution becomes uncertain.

Mechanism (the CHESS paper, §3, Algorithm 1; docs/policies/chess.md):

* page vector (eq. 1): the mean key of a page, per layer and kv head, flattened across all the
  layers the policy sees (the cache's sparse layers) and kv heads into one [F] vector,
  F = layers * kv_heads * head_dim; chunks of ``chunk_pages`` pages and grids of ``grid_chunks``
  chunks by centroid averaging (eq. 2). The three levels live in ONE buffer ``[grids | chunks |
  pages]`` so that scoring the whole hierarchy is one (batched) matrix product (Algorithm 1, l. 2-3);
* anchor (eq. 3): the mean of the page vectors of the recent window; affinity (eq. 4): the dot
  product of anchor and unit vector, keys against keys;
* top-down masking: keep the top ``rho_g`` of the grids, then the top ``rho_c`` of the chunks
  whose grid is kept, then the top ``rho_p`` of the pages whose chunk is kept (quantile
  thresholds, Algorithm 1); the context is those pages + sink + window (kvdex always attends
  sink and window). ONE selection serves every layer and head until the next rebuild;
* zero-copy: a selection is page ids only; on the GPU-resident store attention reads the chosen
  slots in place (``DeviceStore.attend``); offloaded stores fetch the pages as for any policy;
* quality-aware backtracking (§3.3): after every decode step ``on_step`` measures the entropy and
  varentropy of the next-token distribution; every ``check_every`` steps (default: one page of
  generated tokens, Figure 4 is per page) their means are compared with thresholds calibrated
  offline (99th percentile, ``kvdex calibrate chess``); the selection of a sequence is rebuilt
  only when they exceed them. ``trigger="interval"`` is Appendix C's fixed-interval baseline.

Where the paper is vague, the choices (and why) are in comments marked ``CHOICE`` and in the docs.

Beyond the paper (named options, the paper's mode is the default): ``anchor_from="query"`` scores
the hierarchy with the decode step's queries instead of the window's keys; ``scope="layer"``
(``_chess_layer.py``) gives every sparse layer its own selection per kv head, scored on its own
slice of the page / chunk / grid vectors and built inside ``select`` from that step's queries.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdex.policies._chess_layer import LayerScope
from kvdex.policies._chess_levels import (
    PRESETS,
    count_mask,
    entropy_varentropy,
    level_mask,
    mask_to_ids,
    pad,
    top_down,
    trim,
    window_anchor,
    window_keys,
)
from kvdex.policies.base import Policy, register_policy
from kvdex.selection import Selection
from kvdex.storage import MiddleUpdate

__all__ = ["ChessPolicy", "PRESETS", "count_mask", "entropy_varentropy", "level_mask", "window_keys"]

TRIGGERS = ("uncertainty", "interval", "always", "never")
# window: the paper's anchor, the mean key of the recent window (eq. 3: key-key affinity, query-agnostic);
# query: the decode step's query heads score the same hierarchy (a kvdex option, not in the paper)
ANCHORS = ("window", "query")
# shared: one selection for every layer and head (the paper); layer: each sparse layer scores its own
# slice of the hierarchy per kv head (a kvdex option, kvdex/policies/_chess_layer.py)
SCOPES = ("shared", "layer")
GROUPS = ("max", "sum", "mean")  # scope=layer with anchor_from=query: the GQA reduction of the group's scores
VARENTROPY_KINDS = ("output", "temporal")

# CHOICE: the paper does not give N_c and N_g. 4 pages per chunk and 4 chunks per grid (grids of
# 512 tokens at page size 32) keep >= 8 grids at 4k tokens, so the grid quantile is not a coin
# flip between two halves of a short context, and ~60 grids at 32k.
DEFAULT_CHUNK_PAGES = 4
DEFAULT_GRID_CHUNKS = 4
# Appendix C's fixed-interval baseline rebuilds "every 6 pages" of generated tokens.
DEFAULT_INTERVAL_PAGES = 6

# Default thresholds when neither a calibration file nor explicit values are given: the 99th
# percentiles measured by `kvdex calibrate chess` on SmolLM2-135M-Instruct (CPU, fp32): LongBench v1
# gov_report/qmsum/multi_news/samsum/lcc (the last 3 samples of each), prompts of 3072 tokens, 192
# greedy tokens with full attention, 76 pages of 32 generated tokens (docs/policies/chess.md,
# docs/policies/chess_calibration_smollm2.json). Thresholds are model-specific: calibrate yours.
DEFAULT_THRESHOLDS = {"entropy": 2.6133, "varentropy": 6.3457, "temporal_varentropy": 3.5523}

_GROW_GRIDS = 16  # index capacity grows by this many grids (and >= 25%) at a time


@register_policy
@dataclass
class ChessPolicy(Policy):
    """CHESS. Ratio mode (``preset`` or ``rho_g/rho_c/rho_p``): the paper's retention ratios, the
    budget is not used. Budget mode (the default): the same hierarchy cut to exactly
    ``(budget - sink - window) / page_size`` pages per sequence, for comparisons at equal budget.
    """

    name = "chess"
    capturable = True
    capturable_index = True

    preset: str = ""  # conservative | moderate | aggressive; "" with no rho_*: budget mode
    rho_g: float | None = None
    rho_c: float | None = None
    rho_p: float | None = None
    shape: str = "aggressive"  # budget mode: the preset whose split of the reduction over levels is kept
    chunk_pages: int = DEFAULT_CHUNK_PAGES  # N_c
    grid_chunks: int = DEFAULT_GRID_CHUNKS  # N_g
    trigger: str = "uncertainty"  # uncertainty | interval (Appendix C) | always | never
    interval: int = 0  # trigger="interval": rebuild every this many decode steps (0: 6 pages)
    check_every: int = 0  # trigger="uncertainty": steps per check (0: one page of generated tokens)
    thresholds: str = ""  # JSON written by `kvdex calibrate chess`
    entropy_threshold: float | None = None  # explicit thresholds override the file
    varentropy_threshold: float | None = None
    varentropy: str = "output"  # output: mean per-step varentropy | temporal: variance of the entropy
    combine: str = "and"  # and: both exceed (Figure 4's upper-right region) | or: either
    anchor_from: str = "window"  # window (the paper) | query: the decode step's queries (ANCHORS)
    scope: str = "shared"  # shared (the paper): one selection for all layers and heads | layer (SCOPES)
    group: str = "max"  # scope=layer, anchor_from=query: max | sum | mean of the query heads' scores

    def __post_init__(self) -> None:
        rhos = (self.rho_g, self.rho_c, self.rho_p)
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"unknown CHESS preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if any(r is not None for r in rhos):
            if self.preset:
                raise ValueError("pass a CHESS preset or rho_g/rho_c/rho_p, not both")
            if any(r is None for r in rhos):
                raise ValueError("pass all three retention ratios rho_g, rho_c, rho_p (or a preset)")
            for n, r in zip(("rho_g", "rho_c", "rho_p"), rhos, strict=True):
                if not isinstance(r, (int, float)) or not 0 < r <= 1:
                    raise ValueError(f"{n} must be a fraction in (0, 1], got {r!r}")
        if self.shape not in PRESETS:
            raise ValueError(f"unknown CHESS shape {self.shape!r}; choose from {', '.join(PRESETS)}")
        for n in ("chunk_pages", "grid_chunks"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{n} must be an int >= 1, got {v!r}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"unknown CHESS trigger {self.trigger!r}; choose from {', '.join(TRIGGERS)}")
        for n in ("interval", "check_every"):
            v = getattr(self, n)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{n} must be an int >= 0 (0: the default), got {v!r}")
        if self.varentropy not in VARENTROPY_KINDS:
            raise ValueError(f"varentropy must be one of {', '.join(VARENTROPY_KINDS)}, got {self.varentropy!r}")
        if self.anchor_from not in ANCHORS:
            raise ValueError(f"anchor_from must be one of {', '.join(ANCHORS)}, got {self.anchor_from!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        if self.group != "max" and not (self.scope == "layer" and self.anchor_from == "query"):
            raise ValueError(
                f"group={self.group!r} reduces query heads' scores per kv head: it needs scope='layer' and "
                "anchor_from='query' (the shared scope scores with each group's mean query)"
            )
        if self.combine not in ("and", "or"):
            raise ValueError(f"combine must be 'and' or 'or', got {self.combine!r}")
        self._tau = self._load_thresholds()

    # ---- configuration ----------------------------------------------------------------------------
    @property
    def ratios(self) -> tuple[float, float, float] | None:
        """(rho_g, rho_c, rho_p) in ratio mode, None in budget mode."""
        if self.preset:
            return PRESETS[self.preset]
        if self.rho_g is not None:
            return (float(self.rho_g), float(self.rho_c), float(self.rho_p))
        return None

    def _load_thresholds(self) -> tuple[float, float]:
        table = dict(DEFAULT_THRESHOLDS)
        if self.thresholds:
            path = Path(self.thresholds).expanduser()
            if not path.is_file():
                raise ValueError(f"CHESS thresholds file {path} not found; write it with `kvdex calibrate chess`")
            try:
                data = json.loads(path.read_text())
                table = {k: float(data[k]) for k in DEFAULT_THRESHOLDS}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"CHESS thresholds file {path} is not a `kvdex calibrate chess` output "
                    f"(needs numbers {', '.join(DEFAULT_THRESHOLDS)}): {e}"
                ) from None
        h = table["entropy"] if self.entropy_threshold is None else float(self.entropy_threshold)
        key = "varentropy" if self.varentropy == "output" else "temporal_varentropy"
        v = table[key] if self.varentropy_threshold is None else float(self.varentropy_threshold)
        return h, v

    def bind(self, info) -> None:
        super().bind(info)
        self._slot = {layer: i for i, layer in enumerate(info.sparse_layers)}
        self._hd = info.kv_heads * info.head_dim
        self.dim = len(info.sparse_layers) * self._hd  # F
        self._every = self.check_every or self.cfg.page_size
        self._interval = self.interval or DEFAULT_INTERVAL_PAGES * self.cfg.page_size
        self._stores: dict = {}
        self._vall = None  # [B, Gcap + Ccap + Pcap, F] fp32: grids | chunks | pages
        self._gcap = 0
        self._npages = None  # [layers, B] pages indexed per layer (CPU)
        self._pages = None  # [B, K] the selection, -1 padded
        self._sel = None
        self._covering = None  # [B] bool (CPU): the last build kept every middle page (budget mode)
        self._static_pages = None  # [B, W] the selection, -1 padded to a fixed width (CUDA-graph decoding)
        self._last_len = None  # lengths at the last build / on_step (CPU)
        self._acc = None  # per-sequence sums since the last check: H, H^2, V, steps
        self._nacc = 0  # steps in those sums
        # counters (stats())
        self.builds = 0  # initial selections (one per prompt)
        self.rebuilds = 0  # rebuilds summed over sequences
        self.checks = 0  # trigger evaluations summed over sequences
        self.decode_steps = 0
        self.rebuild_log: list[tuple[int, int]] = []  # (step, sequence) of each rebuild
        self.check_log: list[tuple[int, int, float, float]] = []  # (step, sequence, entropy, varentropy stat)
        self.rebuild_ms = 0.0  # time in _build (measured only with the cache's timing=True)
        self.selected_pages: list[float] = []  # mean selected pages per sequence at each build
        self._queries: dict = {}  # anchor_from="query": layer -> [B, H, D] fp32, the last step's queries
        self.query_builds = 0  # builds (and rebuilds) scored by queries instead of the window's keys
        self._layers = LayerScope(self) if self.scope == "layer" else None
        self._batch = 0  # sequences (set at the first build)

    # ---- the hierarchy ------------------------------------------------------------------------------
    @property
    def _ccap(self) -> int:
        return self._gcap * self.grid_chunks

    @property
    def _pcap(self) -> int:
        return self._ccap * self.chunk_pages

    def _reserve(self, pages: int, like: torch.Tensor) -> None:
        per_grid = self.chunk_pages * self.grid_chunks
        need = -(-pages // per_grid)
        if need <= self._gcap:
            return
        old, (og, oc, op) = self._vall, (self._gcap, self._ccap, self._pcap)
        self._gcap = max(need, self._gcap + max(_GROW_GRIDS, self._gcap // 4))
        b = like.shape[0]
        self._vall = torch.zeros(b, self._gcap + self._ccap + self._pcap, self.dim, device=like.device)
        if old is not None:
            self._vall[:, :og] = old[:, :og]
            self._vall[:, self._gcap : self._gcap + oc] = old[:, og : og + oc]
            self._vall[:, self._gcap + self._ccap : self._gcap + self._ccap + op] = old[:, og + oc :]

    def _views(self):
        """(grids [B, Gcap, F], chunks [B, Ccap, F], pages [B, Pcap, F]) views of the one buffer."""
        g, c = self._gcap, self._ccap
        return self._vall[:, :g], self._vall[:, g : g + c], self._vall[:, g + c :]

    def index(self, layer, update) -> None:
        if update.store is not None:
            self._stores[layer] = update.store
        slot = self._slot[layer]
        if self._npages is None:
            self._npages = torch.zeros(len(self._slot), update.count.shape[0], dtype=torch.long)
        if not update.empty:
            self._add_pages(slot, update)
            if self._layers is None:
                self._cover(update)
            else:
                self._layers.cover(layer, update)
        last = self.info.sparse_layers[-1]
        if not self._batch and layer == last and len(self._stores) == len(self._slot):
            # end of the prompt: every layer is stored and indexed (prefill / fork)
            self._batch = int(update.count.shape[0])
            if self._layers is None:
                self._build(step=0)
            else:  # the first decode step builds every layer's selection from its own queries
                self._layers.request(torch.ones(self._batch, dtype=torch.bool))
                self._last_len = self._stores[last].lengths_host.clone()
                self.builds += 1

    def _add_pages(self, slot: int, update) -> None:
        """Eq. 1 for the new pages (this layer's slice of F), then eq. 2 for their chunks and grids."""
        start = update.start.clone()
        end = start + update.count
        self._reserve(int(end.max()), update.keys)
        vg, vc, vp = self._views()
        cols = slice(slot * self._hd, (slot + 1) * self._hd)
        means = update.keys.float().mean(dim=3)  # [B, H, Pn, D]: mean-pooled keys of each page
        b, h, pn, d = means.shape
        means = means.permute(0, 2, 1, 3).reshape(b, pn, h * d)  # flatten (kv head, dim)
        ids = update.page_ids()  # [B, Pn]
        bi, j = torch.nonzero(ids >= 0, as_tuple=True)
        dev = vp.device  # device_map: the one buffer lives on the first sparse layer's device, this layer's moves
        vp[bi.to(dev), ids[bi, j].to(dev), cols] = means[bi, j].to(dev)
        self._npages[slot] = torch.maximum(self._npages[slot], end)
        # centroids of the touched chunks and grids, over the pages/chunks each sequence has so far
        nc, ng = self.chunk_pages, self.grid_chunks
        live = update.count > 0
        c0, c1 = int(start[live].min()) // nc, -(-int(end.max()) // nc)
        n = self._npages[slot].to(vp.device)
        pages = vp[:, c0 * nc : c1 * nc, cols].reshape(b, c1 - c0, nc, -1)
        pid = torch.arange(c0 * nc, c1 * nc, device=vp.device).view(1, c1 - c0, nc)
        have = (pid < n[:, None, None]).float()  # [B, chunks, Nc]
        vc[:, c0:c1, cols] = (pages * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        g0, g1 = c0 // ng, -(-c1 // ng)
        chunks = vc[:, g0 * ng : g1 * ng, cols].reshape(b, g1 - g0, ng, -1)
        cid = torch.arange(g0 * ng, g1 * ng, device=vp.device).view(1, g1 - g0, ng)
        have = (cid < (-(-n // nc))[:, None, None]).float()
        vg[:, g0:g1, cols] = (chunks * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]

    # ---- page joins inside a captured decode step (Policy.capturable_index) ---------------------------
    # The joining page's vector (eq. 1) is written at the device start of each joining sequence, then the
    # centroids (eq. 2) of its chunk and grid are recomputed (the other chunks do not change); the page
    # counts and the budget-mode cover of the selection (_cover: host-held) are the host side (joined).
    def reserve_index(self, layer, pages, store) -> None:
        if pages > 0:
            self._reserve(pages, torch.empty(store.batch, 0, device=store.device))

    def joined(self, layer, start, count) -> None:
        slot = self._slot[layer]
        if self._npages is None:
            self._npages = torch.zeros(len(self._slot), count.shape[0], dtype=torch.long)
        self._npages[slot] = torch.where(
            count > 0, torch.maximum(self._npages[slot], start + count), self._npages[slot]
        )
        self._cover(MiddleUpdate(start, count, torch.empty(0)))

    def index_join(self, layer, join) -> None:
        self._stores[layer] = join.store
        if self._vall is None:
            return
        vg, vc, vp = self._views()
        dev = vp.device
        cols = slice(self._slot[layer] * self._hd, (self._slot[layer] + 1) * self._hd)
        means = join.keys.float().mean(dim=3)  # [B, H, 1, D]
        b, h, _, d = means.shape
        means = means.permute(0, 2, 1, 3).reshape(b, h * d).to(dev)
        on, bi = join.joins.to(dev)[:, None], torch.arange(b, device=dev)
        page = join.start.to(dev).clamp(max=vp.shape[1] - 1)
        vp[bi, page, cols] = torch.where(on, means, vp[bi, page, cols])
        nc, ng = self.chunk_pages, self.grid_chunks
        n = page + 1  # pages of a joining sequence (this one is its last)
        chunk, grid = page // nc, page // (nc * ng)
        pid = chunk[:, None] * nc + torch.arange(nc, device=dev)  # [B, Nc]
        have = (pid < n[:, None]).float()[:, None]  # [B, 1, Nc]
        pages = vp[bi[:, None], pid, cols][:, None]  # [B, 1, Nc, F_layer]
        cent = (pages * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        vc[bi, chunk, cols] = torch.where(on, cent[:, 0], vc[bi, chunk, cols])
        cid = grid[:, None] * ng + torch.arange(ng, device=dev)  # [B, Ng]
        have = (cid < (-(-n // nc))[:, None]).float()[:, None]
        chunks = vc[bi[:, None], cid, cols][:, None]
        cent = (chunks * have[..., None]).sum(2) / have.sum(2).clamp(min=1)[..., None]
        vg[bi, grid, cols] = torch.where(on, cent[:, 0], vg[bi, grid, cols])

    # ---- selection ------------------------------------------------------------------------------------
    def anchor(self, upcoming: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 3: the mean of the window's page vectors, [B, F] (the newest page may be partial).

        ``upcoming`` [B] (CPU): sequences whose next token starts a new page, so that the oldest
        window page joins the middle at the next step. Its page vector is indexed now (the same
        eq. 1 the cache's update will repeat), so a selection built between two steps covers the
        middle of the step it serves (with every ratio 1 it is exactly all middle pages).
        """
        parts = []
        ps = self.cfg.page_size
        for layer in self.info.sparse_layers:
            k, valid = window_keys(self._stores[layer])
            b, h, w, d = k.shape
            if upcoming is not None and bool(upcoming.any()):
                start = self._npages[self._slot[layer]].clone()  # not a view: _add_pages advances it
                self._add_pages(self._slot[layer], MiddleUpdate(start, upcoming.long(), k[:, :, None, :ps]))
            a = window_anchor(k, valid, ps)
            parts.append(a.reshape(b, h * d).to(parts[0].device if parts else a.device))
        return torch.cat(parts, dim=-1)

    def query_anchor(self) -> torch.Tensor:
        """``anchor_from="query"``: the last decode step's queries, [B, F] laid out as the page vectors
        (sparse layer, kv head, dim), each kv head's query the mean of its group's query heads. The
        affinity of a page is then the sum over layers and heads of q . mean key: the query-key score
        Quest and ArkVale bound, here on CHESS's grids, chunks and pages."""
        parts = [self._queries[layer] for layer in self.info.sparse_layers]
        dev = parts[0].device
        return torch.cat([x.reshape(x.shape[0], -1).to(dev) for x in parts], dim=-1)

    def _record_query(self, layer: int, q: torch.Tensor, kv_heads: int) -> None:
        """Keep this step's queries of ``layer`` (in place, so a captured step records them too)."""
        b, hq, d = q.shape
        qm = q.view(b, kv_heads, hq // kv_heads, d).float().mean(2)
        buf = self._queries.get(layer)
        if buf is None or buf.shape != qm.shape or buf.device != qm.device:
            self._queries[layer] = qm.clone()  # eager steps only: graph_key waits for every buffer
        else:
            buf.copy_(qm)

    def scores(self, anchor: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Eq. 4 for the whole hierarchy in ONE batched GEMM over the coalesced buffer (Alg. 1 l. 1-4).

        Returns (S_g [B, G], S_c [B, C], S_p [B, P]) for the first ``pages`` pages.
        """
        g, c = self._gcap, self._ccap
        s_all = torch.bmm(self._vall[:, : g + c + pages], anchor[:, :, None].to(self._vall.device)).squeeze(-1)
        if self.info.tp is not None:  # tensor parallelism: F is split over the ranks' heads, sum the partial scores
            s_all = self.info.tp.all_reduce(s_all.contiguous())
        nc, ng = self.chunk_pages, self.grid_chunks
        cn = -(-pages // nc)
        return s_all[:, : -(-cn // ng)], s_all[:, g : g + cn], s_all[:, g + c : g + c + pages]

    def select_pages(self, s_g, s_c, s_p, npages: torch.Tensor):
        """Top-down masking (Alg. 1 l. 5-18) for sequences with ``npages`` [B] middle pages.

        Returns the kept masks (grids [B, G], chunks [B, C], pages [B, P]); a chunk is scored only
        under a kept grid and a page only under a kept chunk.
        """
        return top_down(
            s_g, s_c, s_p, npages, nc=self.chunk_pages, ng=self.grid_chunks, ratios=self.ratios,
            k=self.cfg.retrieval_pages, shape=self.shape,
        )  # fmt: skip

    def _build(self, step: int, rows: torch.Tensor | None = None) -> None:
        """(Re)build the selection of the sequences in ``rows`` [B] bool (None: all), from the
        current state of every layer (called between forwards, so every layer is at the same length)."""
        timing = self.cfg.timing
        if timing:
            sync = torch.cuda.synchronize if self._vall is not None and self._vall.is_cuda else (lambda: None)
            sync()
            t0 = time.perf_counter()
        grid = self._stores[self.info.sparse_layers[0]].grid
        n = self._stores[self.info.sparse_layers[-1]].lengths_host
        upcoming = grid.num_middle_pages(n + 1) > self._npages.min(dim=0).values  # next token starts a page
        anchor = self.anchor(upcoming)  # also indexes the page that joins the middle at the next step
        if self.anchor_from == "query" and len(self._queries) == len(self.info.sparse_layers):
            anchor = self.query_anchor()
            self.query_builds += 1
        npages = self._npages.min(dim=0).values  # [B] pages every layer has indexed
        b = npages.shape[0]
        p = int(npages.max())
        if p == 0 or self._vall is None:
            mask = torch.zeros(b, 0, dtype=torch.bool)
        else:
            s_g, s_c, s_p = self.scores(anchor, p)
            mask = self.select_pages(s_g, s_c, s_p, npages)[2]
        new = mask_to_ids(mask)
        if self._pages is None or rows is None:
            pages = new
        else:
            width = max(new.shape[1], self._pages.shape[1])
            old, new = pad(self._pages, width), pad(new.to(self._pages.device), width)
            pages = torch.where(rows.to(old.device)[:, None], new, old)
        # budget mode: a sequence whose build kept every middle page keeps them all while they fit (_cover)
        covering = (mask.sum(1) >= npages.to(mask.device)).cpu() & (self.ratios is None)
        keep = rows is not None and self._covering is not None
        self._covering = torch.where(rows, covering, self._covering) if keep else covering
        self._publish(trim(pages))
        self._last_len = self._stores[self.info.sparse_layers[-1]].lengths_host.clone()
        self.selected_pages.append(float((self._pages >= 0).sum(1).float().mean()))
        if timing:
            sync()
            self.rebuild_ms += (time.perf_counter() - t0) * 1e3
        if step == 0:
            self.builds += 1

    def _publish(self, pages: torch.Tensor) -> None:
        """Make ``pages`` [B, K] (ascending ids, -1 padded) the selection every layer reads."""
        self._pages = pages
        self._refresh_static()
        store = self._stores[self.info.sparse_layers[0]]
        b = pages.shape[0]
        self._sel = Selection(pages=pages.to(store.device)[:, None, :].expand(b, store.kv_heads, -1))
        self._sel_on = {}  # device_map: copies of the selection for layers on other devices

    def _cover(self, update) -> None:
        """Budget mode: while the budget holds every middle page of a sequence, its selection is every
        middle page. A page that leaves the window between rebuilds joins the selection of the
        sequences whose last build kept all pages, as long as the K-page budget has room; when it has
        none, the selection stays as built until the next rebuild (the mechanism's static selection).
        A budget smaller than the middle at build time is unaffected: such a selection never covers."""
        if self._pages is None or self._covering is None or not bool(self._covering.any()):
            return
        k = self.cfg.retrieval_pages
        pages = self._pages.cpu()
        rows = [pages[b][pages[b] >= 0] for b in range(pages.shape[0])]
        changed = False
        for b in torch.nonzero(self._covering & (update.count > 0)).flatten().tolist():
            new = torch.arange(int(update.start[b]), int(update.start[b] + update.count[b]))
            new = new[~torch.isin(new, rows[b])]
            if len(new) == 0:
                continue  # added already (the build saw the page coming, or an earlier layer added it)
            if len(rows[b]) + len(new) > k:
                self._covering[b] = False
                continue
            rows[b], changed = torch.cat([rows[b], new]), True
        if changed:
            width = max(len(r) for r in rows)
            out = torch.stack([pad(r[None], width)[0] for r in rows])
            self._publish(out.to(self._pages.device))

    def select(self, layer, q, store, scale) -> Selection:
        self._stores[layer] = store
        if self._layers is not None:
            return self._layers.select(layer, q, store)
        if self.anchor_from == "query":
            self._record_query(layer, q, store.kv_heads)
        if self._sel is None:  # no middle was ever indexed for this cache: sink + window only
            return Selection(pages=torch.full((store.batch, store.kv_heads, 0), -1, device=q.device))
        if getattr(store, "static", False):  # CUDA-graph decoding: one buffer, rewritten in place by rebuilds
            return Selection(pages=self._static_selection(store)[:, None, :].expand(-1, store.kv_heads, -1))
        if self._sel.pages.device != store.device:  # device_map: the layer's copy, moved once per build
            return self._sel_on.setdefault(store.device, Selection(pages=self._sel.pages.to(store.device)))
        return self._sel

    # ---- CUDA-graph decoding (kvdex.integration.graph) ------------------------------------------------
    # The selection only changes in _build, which runs in on_step (after the step, outside a captured
    # graph) or before a page-boundary step (joined: the budget cover). Under static sizing select returns
    # one persistent [B, W] buffer (-1 padded, W >= the budget's pages) that _build rewrites in place, so a captured
    # step reads the current selection without a new capture; a wider selection (ratio mode) makes a
    # new buffer, whose identity is in the graph key.
    def graph_key(self, stores) -> tuple | None:
        if self._layers is not None:
            return self._layers.graph_key()
        buf = self._static_pages
        if buf is None:
            return None  # this step's select allocates the buffer: an eager step
        queries = ()
        if self.anchor_from == "query":
            if len(self._queries) < len(self.info.sparse_layers):
                return None  # this step's select allocates the query buffers: an eager step
            queries = tuple((lay, id(x), tuple(x.shape)) for lay, x in sorted(self._queries.items()))
        index = (id(self._vall), self._gcap)  # page joins write into it inside the captured step
        return ("chess", id(buf), tuple(buf.shape), index) + queries

    def _static_selection(self, store) -> torch.Tensor:
        if self._static_pages is None:  # allocated in an eager step (the graph key changed)
            w = self._pages.shape[1]
            width = max(w, self.cfg.retrieval_pages) if self.ratios is None else w + max(1, w // 4)
            self._static_pages = torch.full((self._pages.shape[0], width), -1, dtype=torch.long, device=store.device)
            self._refresh_static()
        return self._static_pages

    def _refresh_static(self) -> None:
        buf = self._static_pages
        if buf is None:
            return
        w = self._pages.shape[1]
        if w > buf.shape[1]:
            self._static_pages = None  # wider than the buffer: a new one at the next static select
            return
        buf.fill_(-1)
        buf[:, :w] = self._pages.to(buf.device)

    # ---- quality-aware backtracking ----------------------------------------------------------------
    def on_step(self, step, logits) -> None:
        if not self._batch:
            return
        now = self._stores[self.info.sparse_layers[-1]].lengths_host.clone()
        grew = int((now - self._last_len).max()) > 1
        self._last_len = now
        if step < 1:  # step 0 is the prefill (its logits come from dense attention)
            return
        if grew:  # several tokens in one forward (a new turn): the context changed, rebuild
            self._rebuild(step, None)
            return
        self.decode_steps += 1
        if self._layers is None and self.anchor_from == "query" and self.query_builds == 0 and len(self._queries):
            self._rebuild(step, None)  # the prefill's build had no decode query: score with the first one
            return
        rows = self._due(step, logits)
        if rows is not None:
            self._rebuild(step, rows)

    def _rebuild(self, step: int, rows: torch.Tensor | None) -> None:
        b = self._batch
        rows_cpu = torch.ones(b, dtype=torch.bool) if rows is None else rows.cpu()
        if self._layers is not None:  # done by every layer's select at the next step, with its queries
            self._layers.request(rows_cpu)
        else:
            self._build(step, None if rows is None else rows_cpu)
        for i in torch.nonzero(rows_cpu).flatten().tolist():
            self.rebuild_log.append((step, i))
        self.rebuilds += int(rows_cpu.sum())

    def _due(self, step: int, logits) -> torch.Tensor | None:
        """Sequences whose selection is rebuilt after decode step ``step``: [B] bool, or None."""
        b = self._batch
        if self.trigger == "never":
            return None
        if self.trigger == "always":
            return torch.ones(b, dtype=torch.bool)
        if self.trigger == "interval":
            return torch.ones(b, dtype=torch.bool) if step % self._interval == 0 else None
        if logits is None:
            return None
        h, v = entropy_varentropy(logits)
        acc = torch.stack([h, h.square(), v, torch.ones_like(h)])
        self._acc = acc if self._acc is None else self._acc + acc
        self._nacc += 1
        if self._nacc < self._every:
            return None
        h_page, v_page = self.page_stats(self._acc)
        exceed = self.exceeds(h_page, v_page)
        self._acc, self._nacc = None, 0
        self.checks += b
        pairs = zip(h_page.tolist(), v_page.tolist(), strict=True)
        self.check_log += [(step, i, h, v) for i, (h, v) in enumerate(pairs)]
        return exceed.cpu() if bool(exceed.any()) else None

    def page_stats(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean entropy, varentropy statistic) [B] from sums acc [4, B] = (H, H^2, V, steps)."""
        n = acc[3]
        h_mean = acc[0] / n
        if self.varentropy == "output":
            return h_mean, acc[2] / n
        return h_mean, (acc[1] / n - h_mean.square()).clamp(min=0)

    def exceeds(self, h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        th, tv = self._tau
        return (h > th) & (v > tv) if self.combine == "and" else (h > th) | (v > tv)

    def stats(self) -> dict:
        b = self._batch
        pages_generated = self.decode_steps * b / self.cfg.page_size
        return {
            "mode": "ratio" if self.ratios is not None else "budget",
            "trigger": self.trigger,
            "thresholds": {"entropy": self._tau[0], "varentropy": self._tau[1]},
            "builds": self.builds,
            "rebuilds": self.rebuilds,
            "checks": self.checks,
            "decode_steps": self.decode_steps,
            "rebuilds_per_generated_page": self.rebuilds / pages_generated if pages_generated else None,
            "pages_between_rebuilds": pages_generated / self.rebuilds if self.rebuilds else None,
            "selected_pages_mean": sum(self.selected_pages) / len(self.selected_pages) if self.selected_pages else None,
            "rebuild_ms": self.rebuild_ms,
            "anchor_from": self.anchor_from,
            "scope": self.scope,
            "query_builds": self.query_builds,
        }
