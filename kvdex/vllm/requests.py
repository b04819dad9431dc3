"""Per-request kvdex state inside vLLM, and its life cycle across engine steps.

**One state per request.** A :class:`RequestState` is what ``kvdex.Cache`` is to transformers for a batch of one:
the policy instance (bound to this request alone), one :class:`~kvdex.engine.LayerEngine` per attention layer with
a :class:`~kvdex.vllm.store.PagedStore` over vLLM's blocks, the step counters, the selection-reuse schedule and the
request's block-table row. vLLM's batch changes at every step (requests join, finish, are preempted, change rows),
so nothing is kept per batch row: every step maps each row to its request's state.

**Keying** (no request id reaches an attention backend). A request's state is filed under ``(block, length)``: the
block holding its last token and the number of tokens it holds after the step that last ran it. At the next step a
row with ``computed = seq_len - query_len`` tokens already in the cache continues the state filed under
``(blocks[(computed - 1) // block_size], computed)`` -- the same request, grown by this step's tokens. Its block is
its own: a partly filled block is never shared, and a full one is shared (prefix caching) only by requests whose
tokens up to it are identical, which hold the same KV there. A row gets a new state (``Row.fresh``; the request's
tokens are indexed from the blocks at its first decode step) when

* ``computed == 0``: a new request, or one preempted and recomputed from its first token;
* no state is filed under its key: a prefix-cache hit, a sequence shorter than the one held (rolled back), a
  block table that does not continue the held one, or a state freed by the rules below;
* the state filed under its key is claimed by an earlier row of the same batch (two requests whose whole held
  context is one shared run of blocks: the first row keeps the state).

**Freeing.** A state not in the batch is kept for ``max_idle_steps`` steps (a running request that the scheduler
skips for a step comes back to it), and freed earlier when its last block, partly filled, appears in another
request's row (vLLM freed the request and reassigned the block) or when a live request is filed under its key.
A state of a finished request is otherwise dropped after ``max_idle_steps`` steps; nothing else holds it.

**Prompt, then decoding** (as ``kvdex.Cache`` sees a prompt prefilled in one forward, whatever vLLM's chunking).
The rows of a request's prompt (every chunk of a chunked prefill, a prefix-cache hit's remaining tokens) attend
densely over the request's tokens in the blocks, and the state keeps each layer's last prompt queries. At the
request's first decode step (``query_len == 1`` on cached tokens, vLLM's ``is_prefilling`` False where it says)
the state indexes the whole prompt before any layer runs: each layer's ``LayerEngine.adopt`` over the prompt's
keys and values, read back from the blocks, with the kept queries as the observation window -- kvdex's prefill
ingest -- then the policy's ``on_step(0)``. From then on every step is a decode step (``policy.before_step`` and
the reuse decision before the first layer, the append and the sparse attention in each layer,
``policy.on_step(step, None)`` after the last: an attention backend sees no logits).
:meth:`RequestTable.plan` runs once per engine step, before the layers (vLLM's metadata builder).

**Graphs** (the setting ``decode_graphs``): a state is also the :class:`~kvdex.engine.graphs.plan.StepHost` of
kvdex's per-layer step graphs (:class:`~kvdex.engine.graphs.layer_graphs.StepGraphs`): at a decode step the plan
decides eager, capture or replay before the first layer, and each layer's append + decode is one replay. Its
block-table row is kept in a persistent buffer (:class:`~kvdex.vllm.store.BlockRow`) that its stores read under
static sizing. The graphs start at the request's second decode step (:data:`GRAPHS_FROM_STEP`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvdex.engine import OBS_KEEP, GraphService, LayerEngine, SelectionReuse, StepCounters
from kvdex.engine.graphs.layer_graphs import StepGraphs
from kvdex.engine.graphs.plan import StepHost
from kvdex.policies import PolicyInfo
from kvdex.storage import Grid, LayerStore, TransferStats
from kvdex.vllm.config import VllmSettings
from kvdex.vllm.paged import PagedDecode, request_kv
from kvdex.vllm.store import BlockRow, PagedStore

Caches = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (k_cache, v_cache), shared by a table's states
# decode_graphs: a request's step graphs are set up (static sizing, the index's room for page joins, a graph pool)
# at its second decode step; its first runs eagerly. A request that decodes once holds none of that memory: vLLM's
# start-up warm-up runs one decode step of as many short requests as a step takes (hundreds), each a state here.
GRAPHS_FROM_STEP = 2


@dataclass(frozen=True)
class Geometry:
    """The model as this process sees it: attention layers (numbered as in the model), this rank's query and kv
    heads, the head size, vLLM's block size, and under tensor parallelism the model's index of this rank's first
    kv head and the model's kv heads (0: ``kv_heads``, one process)."""

    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    head_offset: int = 0
    model_kv_heads: int = 0


def rank_head_offset(rank: int, ranks: int, kv_heads: int, model_kv_heads: int) -> int:
    """The model's index of tensor-parallel rank ``rank``'s first kv head: ``rank * kv_heads``, or, where the ranks
    outnumber the model's kv heads, vLLM's replication (each head on ``ranks // model_kv_heads`` consecutive
    ranks)."""
    replicas = max(1, kv_heads * ranks // max(model_kv_heads, 1))
    return rank * kv_heads // replicas


def geometry_of(vllm_config: Any, kv_cache_spec: Any) -> Geometry:
    """This process's :class:`Geometry` from vLLM's config and the KV-cache group's spec (duck-typed; the rank
    from ``vllm.distributed`` where it is set up)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    q_heads = int(mc.get_num_attention_heads(pc))
    kv_heads = int(getattr(kv_cache_spec, "num_kv_heads", 0) or mc.get_num_kv_heads(pc))
    head = int(getattr(kv_cache_spec, "head_size", 0) or mc.get_head_size())
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    layers = int(getattr(text, "num_hidden_layers", 0) or mc.get_num_layers(pc))
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        rank, ranks = int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # no distributed state (tests, a single process without it)
        rank, ranks = 0, 1
    total = getattr(mc, "get_total_num_kv_heads", None)
    total = int(total()) if callable(total) else kv_heads * ranks
    offset = rank_head_offset(rank, ranks, kv_heads, total)
    return Geometry(layers, q_heads, kv_heads, head, int(kv_cache_spec.block_size), offset, total)


StoreFactory = Callable[["RequestState", int, tuple], LayerStore]


class RequestState:
    """kvdex's state of one vLLM request: its policy, its layers' engines and stores, its block-table row.
    It is the :class:`~kvdex.engine.EngineHost` of its engines. ``store_factory(state, layer, args)`` makes a
    layer's store (default: a :class:`PagedStore` over the layer's cache in :attr:`caches`)."""

    def __init__(
        self,
        settings: VllmSettings,
        geometry: Geometry,
        store_factory: StoreFactory | None = None,
        caches: Caches | None = None,
        decode: PagedDecode | None = None,
    ) -> None:
        cfg = settings.config
        self.config = cfg
        self.geometry = geometry
        self.policy = settings.make_policy()
        n = geometry.num_layers
        sparse = tuple(i for i in range(n) if i >= cfg.dense_layers)
        g = geometry
        info = PolicyInfo(cfg, n, sparse, g.q_heads, g.kv_heads, g.head_dim, g.head_offset, None, g.model_kv_heads)
        self.policy.bind(info)
        self.grid = Grid(cfg.sink, cfg.page_size, cfg.window_pages)
        self.transfer = TransferStats()
        self.counters = StepCounters()
        self.graphs = GraphService()
        self.reuse = SelectionReuse()
        self.observer: Callable[..., None] | None = None  # EngineHost: no evaluation observer, no selection hook
        self.on_select: Callable[..., None] | None = None
        self.join_step: bool | None = None
        self.joins_external = False
        self.engines = [LayerEngine(self, i, dense=i < cfg.dense_layers) for i in range(n)]
        self.row = BlockRow(torch.zeros(0, dtype=torch.long), persistent=settings.decode_graphs)
        # decode_graphs: each decode step replays one CUDA graph per layer (kvdex.engine.graphs.layer_graphs),
        # this state being the StepHost those graphs decode (its layers, model, decoder_active, warn_if_long)
        self.layers = [_StepLayer(e) for e in self.engines]
        self.decoder_active = False
        # (a StepHost by its members; cast: the protocol's attributes are typed more loosely than this state's)
        self.step_graphs = StepGraphs(cast(StepHost, self)) if settings.decode_graphs else None
        self.caches: Caches = {} if caches is None else caches  # the layers' vLLM caches, as forward sees them
        self.store_factory = store_factory
        self.decode = decode  # dense decode in place over the blocks (PagedStore.dense_decode), where there is one
        self.queries: dict[int, torch.Tensor] = {}  # layer -> the prompt's last queries [1, Hq, <= OBS_KEEP, D]
        self.adopted = False  # the prompt is stored and indexed (every layer's engine has its store)
        self.step = 0  # 0: the prompt; then one per decode step
        self.length = 0  # tokens in the cache after the last step that ran it
        self.idle = 0  # engine steps since the last one that ran it

    # ---- EngineHost ---------------------------------------------------------------------------------
    def new_store(self, layer_idx: int, dense: bool, k: torch.Tensor) -> LayerStore:
        b, h, _, d = k.shape
        args = (self.grid, b, h, d, k.dtype, k.device, self.transfer)
        if self.store_factory is not None:
            return self.store_factory(self, layer_idx, args)
        if layer_idx not in self.caches:
            raise RuntimeError(f"layer {layer_idx}'s KV cache was not handed to the request state before its store")
        kc, vc = self.caches[layer_idx]
        return PagedStore(*args, k_cache=kc, v_cache=vc, row=self.row, decode=self.decode)

    @property
    def stores(self) -> list[LayerStore | None]:
        return [e.store for e in self.engines]

    # ---- StepHost (decode_graphs) ---------------------------------------------------------------------
    @property
    def model(self) -> object:
        """No model object under vLLM: the geometry stands for it (the step graphs only ask that it exists)."""
        return self.geometry

    def warn_if_long(self, total: int, stacklevel: int = 2) -> None:
        """Nothing: vLLM refuses requests past the model's length."""

    # ---- the prompt ---------------------------------------------------------------------------------
    def keep_queries(self, layer: int, q: torch.Tensor) -> None:
        """A prompt chunk's queries q [1, Hq, n, D] of ``layer``: the prompt's last ones are kept (as many as
        kvdex's prefill keeps, :data:`~kvdex.engine.OBS_KEEP`, or the policy's observation window) for the index."""
        held = self.queries.get(layer)
        q = q if held is None else torch.cat([held, q], dim=2)
        self.queries[layer] = q[:, :, -max(OBS_KEEP, self.policy.obs_window) :].clone()  # not a view of the chunk

    def adopt(self, length: int) -> bool:
        """Store and index the prompt, the request's first ``length`` tokens, in every layer (kvdex's prefill
        ingest), then the policy's ``on_step(0)``; False (nothing done) while no layer's cache is known."""
        layers = sorted(self.caches)  # the attention layers this process runs (seen by the prompt's forwards)
        if not layers:
            return False
        for i in layers:
            self.adopt_layer(i, length)
        self.adopted = True
        self.queries.clear()
        self.policy.on_step(0, None)
        return True

    def adopt_layer(self, layer: int, length: int) -> None:
        """The prompt's ``length`` tokens of one layer into its engine (store and index)."""
        kc, vc = self.caches[layer]
        k, v = request_kv(self.row.blocks, length, kc, vc)
        q = self.queries.get(layer)
        if q is None:  # no prompt query seen (a request kvdex meets at a decode step): no observation window
            q = k.new_zeros(1, self.geometry.q_heads, 0, k.shape[-1])
        self.engines[layer].adopt(k, v, torch.tensor([length]), torch.zeros(1, dtype=torch.long), q)

    # ---- steps --------------------------------------------------------------------------------------
    def begin_step(self, row: Row) -> None:
        """Before the step's first layer. A decode step: the prompt indexed first if it is not yet, then the
        policy's ``before_step`` and whether the step reuses the last selection. Several tokens on an indexed
        state: a step that resets that schedule. A prompt chunk: nothing (the prompt is step 0)."""
        if row.kind == "prefill":
            return
        if row.kind == "decode" and not self.adopted and not self.adopt(row.computed):
            self.adopted = True  # some layer's cache is not known yet: each layer adopts in its forward
        self.step += 1
        first = next((s for s in self.stores if s is not None), None)
        if row.kind == "decode" and first is not None:
            for lay in self.layers:
                lay.seen = row.computed
            steps = self.step_graphs
            if steps is not None and self.step >= GRAPHS_FROM_STEP and all(s is not None for s in self.stores):
                steps.begin()  # eager, capture or replay (the plan runs before_step and the reuse first)
            self.policy.before_step(cast(list[LayerStore], self.stores))  # by layer index, as kvdex.Cache passes them
            self.reuse.decide(self.policy.reuse_steps(), row.computed, first, self.policy.must_select)
        else:
            self.reuse.reset()

    def end_step(self) -> None:
        """After the step's last layer (called at the next step's plan): the policy's ``on_step``, no logits."""
        if self.adopted:
            self.policy.on_step(self.step, None)


class _StepLayer:
    """One layer of a request as its step graphs see it (:class:`kvdex.engine.graphs.plan.StepLayer`)."""

    def __init__(self, engine: LayerEngine) -> None:
        self.engine = engine
        self.layer_idx = engine.layer_idx
        self.seen = 0  # tokens in the cache before the step (set by RequestState.begin_step)

    @property
    def store(self) -> LayerStore:
        assert self.engine.store is not None, "a step graph runs on an indexed prompt"
        return self.engine.store


@dataclass
class Row:
    """One request's part of a step's batch: its state, its row in the batch (``index``), its first token in the
    batch (``start``), its new tokens (``query_len``) and its length after the step (``seq_len``). ``kind``:
    ``"prefill"`` (prompt tokens: dense attention), ``"decode"`` (one token after the prompt: kvdex's sparse step)
    or ``"extend"`` (several tokens after an indexed prompt: appended, dense attention). ``fresh``: the state was
    made for this row."""

    state: RequestState
    index: int
    start: int
    query_len: int
    seq_len: int
    kind: str
    fresh: bool = False

    @property
    def computed(self) -> int:
        """Tokens in the cache before this step."""
        return self.seq_len - self.query_len

    @property
    def decode(self) -> bool:
        return self.kind == "decode"


class RequestTable:
    """The request states of one vLLM engine process, keyed as the module docstring says. ``make_state(caches)``
    makes the state of a new request (``caches``: the table's layer -> cache map, shared by its states)."""

    def __init__(self, make_state: Callable[[Caches], RequestState], block_size: int, max_idle_steps: int = 32) -> None:
        self.make_state = make_state
        self.caches: Caches = {}  # every layer's cache, as the layers' forwards hand them over
        self.block_size = block_size
        self.max_idle_steps = max_idle_steps
        self.held: dict[tuple[int, int], RequestState] = {}
        self.running: list[RequestState] = []  # the states of the last plan (their step ends at the next plan)
        self.made = self.freed = 0  # states made / freed so far

    def __len__(self) -> int:
        return len(self.held)

    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        is_prefilling: torch.Tensor | None = None,
        null_block: int | None = None,
    ) -> list[Row]:
        """This step's rows. ``query_start_loc`` [n + 1] and ``seq_lens`` [n] (CPU): vLLM's per-request token
        offsets in the batch and lengths after the step; ``block_table`` [n, max_blocks]: its block-table rows
        (any device; each row's blocks are copied onto that device for the request's stores);
        ``is_prefilling`` [n] (optional): the request still has prompt tokens to compute (a last prompt chunk of
        one token is then no decode step); ``null_block``: a block id no request is given (vLLM's block 0): a row
        that starts with it is a dummy run's (warm-up, profiling) and gets no state."""
        for st in self.running:
            st.end_step()
        n = int(seq_lens.shape[0])
        qsl = query_start_loc.long().tolist()
        lens = seq_lens.long().tolist()
        prefilling = [False] * n if is_prefilling is None else [bool(x) for x in is_prefilling[:n].tolist()]
        table = block_table[:n].long()
        table_cpu = table.cpu()
        bs = self.block_size
        rows: list[Row] = []
        claimed: set[int] = set()
        for i in range(n):
            ql, sl = qsl[i + 1] - qsl[i], lens[i]
            if ql <= 0 or sl <= 0 or (null_block is not None and int(table_cpu[i, 0]) == null_block):
                continue  # a padding row, or a dummy run's
            computed = sl - ql
            state = None
            if computed > 0:
                key = (int(table_cpu[i, (computed - 1) // bs]), computed)
                found = self.held.get(key)
                if found is not None and id(found) not in claimed:
                    state = self.held.pop(key)
            fresh = state is None
            if state is None:
                state = self.make_state(self.caches)
                self.made += 1
            claimed.add(id(state))
            state.row.assign(table[i], -(-sl // bs))
            if ql == 1 and computed > 0 and not prefilling[i]:
                kind = "decode"
            else:
                kind = "extend" if state.adopted else "prefill"
            rows.append(Row(state, i, qsl[i], ql, sl, kind, fresh))
        self._age(rows, table_cpu)
        for row in rows:
            st = row.state
            key = (int(table_cpu[row.index, (row.seq_len - 1) // bs]), row.seq_len)
            if self.held.get(key) is not None:
                self.freed += 1  # a stale state under a live request's key: its blocks were reassigned
            self.held[key] = st
            st.length, st.idle = row.seq_len, 0
            st.begin_step(row)
        self.running = [row.state for row in rows]
        return rows

    def _age(self, rows: Sequence[Row], table_cpu: torch.Tensor) -> None:
        """The states not in this step: one step older; freed past ``max_idle_steps`` or when their partly filled
        last block is in another request's row."""
        if not self.held:
            return
        live: set[int] | None = None
        for key, st in list(self.held.items()):
            st.idle += 1
            block, length = key
            dead = st.idle > self.max_idle_steps
            if not dead and length % self.block_size:
                if live is None:
                    live = {b for r in rows for b in table_cpu[r.index, : -(-r.seq_len // self.block_size)].tolist()}
                dead = block in live
            if dead:
                del self.held[key]
                self.freed += 1

    def clear(self) -> None:
        """Forget every state (a new KV cache, e.g. after vLLM's memory profiling)."""
        self.freed += len(self.held)
        self.held.clear()
        self.running = []
