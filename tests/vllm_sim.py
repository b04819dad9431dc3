"""A simulated vLLM engine for kvdex's vLLM adapter tests (``tests/test_vllm_adapter.py``): per-layer KV caches in
the backend's layout, blocks handed out from a free list (a freed block is handed out again first), batches whose
row order changes every step, slot mappings; requests with fixed random q / k / v per (layer, position), and the
replay of one request through kvdex's own path (a DeviceStore per layer, the engine driven as ``kvdex.Cache``
drives it)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import torch

from kvdex.storage import DeviceStore
from kvdex.vllm import Geometry, RequestState, RequestTable, Row, VllmSettings, forward_layer, settings_from
from kvdex.vllm.paged import kv_cache_shape, token_slots

PS = 16
LAYERS, HQ, H, D = 3, 4, 2, 16
SCALE = D**-0.5
GEO = Geometry(num_layers=LAYERS, q_heads=HQ, kv_heads=H, head_dim=D, block_size=PS)
NUM_BLOCKS = 96
# KVDEX_SIM_DEVICE=cuda runs the simulated engine on a GPU (kvdex's Triton kernels on both paths)
DEV = torch.device(os.environ.get("KVDEX_SIM_DEVICE", "cpu"))
ATOL = 2e-5 if DEV.type == "cpu" else 2e-3  # CUDA: the two paths take different kernels (TF32 products)


@dataclass
class Req:
    """A request: its q / k / v per layer and position, its blocks and its tokens in the cache."""

    name: str
    length: int  # tokens it will have at most
    seed: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    life: int = 0  # incarnations (a preemption starts a new one)
    steps: list[list[tuple[int, int]]] = field(default_factory=lambda: [[]])  # per life: (start, n) of each step

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.q = torch.randn(LAYERS, self.length, HQ, D, generator=g).to(DEV)
        self.k = torch.randn(LAYERS, self.length, H, D, generator=g).to(DEV)
        self.v = torch.randn(LAYERS, self.length, H, D, generator=g).to(DEV)


class Sim:
    """vLLM's side: caches, a free list of blocks (LIFO: a freed block is reused first), batches, slot mappings."""

    def __init__(self, settings: VllmSettings, seed: int = 0, prefill=None, write=None, decode=None,
                 tp: tuple[int, int] = (0, 1), table_width: int = 0) -> None:  # fmt: skip
        self.table_width = table_width  # block-table columns at least (vLLM's full width); 0: the longest row + 2
        self.prefill = prefill  # the prompt chunks' attention forward_layer gets (None: its default)
        self.write = write  # the cache write forward_layer gets (None: its default)
        rank, ranks = tp  # tensor parallelism: this rank's share of the heads, as vLLM gives each rank its own
        hq, h = HQ // ranks, H // ranks
        self.q_heads, self.kv_heads = slice(rank * hq, (rank + 1) * hq), slice(rank * h, (rank + 1) * h)
        geo = Geometry(LAYERS, hq, h, D, PS, head_offset=rank * h, model_kv_heads=H)
        self.kv = [torch.zeros(kv_cache_shape(NUM_BLOCKS, PS, h, D), device=DEV) for _ in range(LAYERS)]
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.rng = random.Random(seed + 1)
        self.table = RequestTable(
            lambda caches: self.recorded(RequestState(settings, geo, caches=caches, decode=decode)),
            PS,
            settings.max_idle_steps,
        )
        self.out: dict[tuple[str, int, int, int], torch.Tensor] = {}  # (req, life, layer, position) -> [Hq, D]
        self.selections: dict[tuple[int, int, int], tuple] = {}  # (state id, layer, step) -> selection tensors
        self.last_rows: list[Row] = []
        self.state_of: dict[tuple[str, int], RequestState] = {}  # (req, life) -> its state here

    def recorded(self, state: RequestState) -> RequestState:
        state.on_select = lambda view, sel, st=state: self.selections.__setitem__(
            (id(st), view.layer, st.step), (sel.pages, sel.tokens, sel.everything)
        )
        return state

    def step(self, batch: list[tuple[Req, int]], shuffle: bool = True) -> list[Row]:
        if shuffle:
            self.rng.shuffle(batch)
        starts, lens, table, slots = [0], [], [], []
        for req, n in batch:
            end = req.computed + n
            while len(req.blocks) * PS < end:
                req.blocks.append(self.free.pop())
            pos = torch.arange(req.computed, end)
            slots.append(token_slots(torch.tensor(req.blocks), pos, PS))
            starts.append(starts[-1] + n)
            lens.append(end)
            req.steps[req.life].append((req.computed, n))
        width = max(self.table_width, max(len(r.blocks) for r, _ in batch) + 2)
        table = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r, _ in batch], device=DEV)
        rows = self.table.plan(torch.tensor(starts), torch.tensor(lens), table)
        for (req, _), row in zip(batch, rows, strict=True):
            self.state_of[(req.name, req.life)] = row.state
        slot_mapping = torch.cat(slots).to(DEV)
        for layer in range(LAYERS):
            qh, kh = self.q_heads, self.kv_heads
            q = torch.cat([r.q[layer, r.computed : r.computed + n, qh] for r, n in batch])
            k = torch.cat([r.k[layer, r.computed : r.computed + n, kh] for r, n in batch])
            v = torch.cat([r.v[layer, r.computed : r.computed + n, kh] for r, n in batch])
            out = torch.full_like(q, float("nan"))
            kc, vc = self.kv[layer]
            hooks = dict(prefill=self.prefill, write=self.write)
            forward_layer(rows, layer, q, k, v, kc, vc, slot_mapping, SCALE, out, **hooks)
            for (req, n), s in zip(batch, starts, strict=False):
                for j in range(n):
                    self.out[(req.name, req.life, layer, req.computed + j)] = out[s + j]
        for req, n in batch:
            req.computed += n
        self.last_rows = rows
        return rows

    def finish(self, req: Req) -> None:
        self.free += req.blocks  # the last block (partly filled) is handed out first
        req.blocks = []

    def preempt(self, req: Req) -> None:
        """vLLM's preemption by recompute: the blocks go back, the request later prefills every token it has."""
        self.finish(req)
        req.computed, req.life = 0, req.life + 1
        req.steps.append([])


def run_scenario(settings: VllmSettings, prefill=None, write=None, decode=None, tp=(0, 1)) -> tuple[Sim, list[Req]]:
    """Three requests: a joins with a 150-token prompt, b with a 230-token prompt in chunks of 96 while a decodes,
    c (a 40-token prompt) later; rows shuffled every step; c is preempted and recomputed; a finishes and its blocks
    go to c's recompute."""
    sim = Sim(settings, prefill=prefill, write=write, decode=decode, tp=tp)
    a, b, c = Req("a", 230, 1), Req("b", 300, 2), Req("c", 120, 3)
    sim.step([(a, 150)])
    sim.step([(a, 1), (b, 96)])
    sim.step([(a, 1), (b, 96)])
    sim.step([(a, 1), (b, 38)])
    for _ in range(4):
        sim.step([(a, 1), (b, 1)])
    sim.step([(a, 1), (b, 1), (c, 40)])
    for _ in range(14):  # a and c cross page joins, b too
        sim.step([(a, 1), (b, 1), (c, 1)])
    sim.preempt(c)
    for _ in range(2):
        sim.step([(a, 1), (b, 1)])
    sim.finish(a)
    sim.step([(b, 1), (c, 55)])  # recompute: c's 40 + 15 tokens, in blocks a just freed
    for _ in range(14):
        sim.step([(b, 1), (c, 1)])
    return sim, [a, b, c]


def replay(settings: VllmSettings, req: Req, life: int) -> tuple[dict, dict]:
    """One life of ``req`` through kvdex's own path, as ``kvdex.Cache`` runs it: the prompt (every chunk the
    simulated engine prefilled) in one forward of each layer's ``LayerEngine.attention`` over DeviceStores (dense
    attention, then the prompt's ingest), ``on_step(0)``, then per decode step ``before_step`` and the reuse decision,
    each layer's append + attention, ``on_step``."""
    out, sels = {}, {}
    state = RequestState(settings, GEO, store_factory=lambda st, layer, args: DeviceStore(*args))
    state.on_select = lambda view, sel: sels.__setitem__((view.layer, state.step), (sel.pages, sel.tokens,
                                                                                      sel.everything))  # fmt: skip
    steps = req.steps[life]
    first = next((i for i, (s, n) in enumerate(steps) if n == 1 and s > 0), len(steps))
    plan = [(0, sum(n for _, n in steps[:first]))] + steps[first:]
    for i, (start, n) in enumerate(plan):
        if i:
            state.begin_step(Row(state, 0, 0, n, start + n, "decode"))
        for layer in range(LAYERS):
            q = req.q[layer, start : start + n].transpose(0, 1)[None]
            k = req.k[layer, start : start + n].transpose(0, 1)[None]
            v = req.v[layer, start : start + n].transpose(0, 1)[None]
            eng = state.engines[layer]
            if eng.store is not None:
                eng.append(k, v)
            o = eng.attention(q, k, v, None, SCALE)[0]  # [n, Hq, D]
            for j in range(n):
                out[(layer, start + j)] = o[j]
        if i:
            state.end_step()
        else:
            state.adopted = True
            state.policy.on_step(0, None)
    return out, sels


def settings(policy: str, sizes: dict) -> VllmSettings:
    return settings_from({"kvdex": {"policy": policy, **sizes}})
