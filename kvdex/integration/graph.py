"""CUDA-graph decoding of a kvdex cache: :class:`GraphDecoder` and :func:`generate`.

Eager decoding of a 32-layer model launches thousands of small kernels per token from Python;
the GPU waits on the CPU. A CUDA graph records one step's kernels once and replays them with one
launch. A kvdex step is replayable when nothing in it depends on values the CPU must look at:

* between page boundaries nothing joins the middle region, so ``policy.index`` (Python over
  data-dependent shapes) does not run and every shape is fixed. A step in which a new page starts
  (the oldest window page joins the middle, once every ``page_size`` tokens) is replayed from a
  second graph when the policy declares ``capturable_index`` (*page joins*, below), else it runs
  eagerly; a step in which a policy does data-dependent work in ``select`` (PRKV's restructuring
  every ``refresh`` steps, SnapKV's first step and refreshes, H2O's prefill scores) runs eagerly;
* stores and policies are switched to *static sizing* (``store.static = True``): the dense layers
  read the whole slot buffer (rows past each length are masked by the kernel using the device
  lengths), Quest / ArkVale / PRKV score their whole index capacity (pages past the middle masked),
  H2O its whole score buffer, and every selection has a width fixed by the budget (``-1`` padding)
  instead of the largest count of this step. No host-side length is baked into the captured step;
* positions are fed from a device buffer (``position_ids``, per row: left padding is honoured);
* offloaded stores are replayable only with the UVA gather (page ids never leave the device).

**The policy protocol.** A policy takes part by defining (duck-typed, no base-class change):

* ``graph_unsupported(stores) -> str | None``: why its decode step cannot be captured with these
  stores (e.g. ``oracle`` with ``offload=True``: it copies the whole middle through host memory);
* ``graph_key(stores) -> tuple | None`` before each step: ``None`` when this step must run eagerly,
  else the identity and shape of every tensor its ``select`` / ``observe`` read plus every host
  value they bake into the step. A changed key captures again (after one eager step, so every
  kernel is loaded before capturing);
* ``graph_replayed()`` after each replay: the Python-side effects of ``select`` / ``observe`` that
  the replay skipped (step counters, lookup counts). Device-side effects (H2O's score accumulation,
  ArkVale's cache bookkeeping) are inside the graph, written in place into persistent buffers.

**Page joins** (``Policy.capturable_index``: quest, pariskv, chess, arkvale, prkv). In a decode step at
most one page per sequence joins the middle, and the host knows which from its lengths. The step is
then made of fixed-shape device work over device-side indices: ``LayerStore.append_join`` appends the
token and returns a :class:`~kvdex.storage.PageJoin` (device ``joins`` mask and page ``start`` from the
device lengths, the page's keys gathered there; an offloaded store first writes the page leaving its
window ring to pinned host memory with one UVA kernel), and ``Policy.index_join`` writes the page's
index entries in place under the mask. Everything data-dependent stays on the host, outside the
graph: before every step (eager, captured or replayed) the decoder grows the stores and the policy's
index ``JOIN_HEADROOM_PAGES`` ahead (``reserve_join`` / ``reserve_index``; a re-allocation is a new
graph key, so it happens once every so many pages) and runs the policy's host side of the join
(``Policy.joined``: CPU counters, CHESS's host-held selection); after a replay the stores' host
side (``advance_host``, ``count_join``: lengths, the bytes written out). The cache takes this path
under static sizing for every single-token step that ``Cache.join_step`` marks (without a decoder:
every step in which a page joins). The decoder keys its graphs by (the policy's key, join step): two
graphs per key. The join graph is right on a step in which nothing joins (an empty mask), so it is
warmed up and captured on the first steps after the plain one and never at a boundary: steady
decoding runs no eager step.
``joined`` + ``index_join`` leave the index exactly as ``index`` would (tests/test_graph_joins.py).

A policy without ``graph_key`` (``icecache``: its tree search runs on CPU threads) is decoded
eagerly, with a warning that says so once. ``full`` is built in. :data:`GRAPH_POLICIES` lists them.

**CPU bookkeeping after a replay** (what the eager step's Python would have done): the step counter,
every layer's sequence length and host lengths (``advance_host``; ``count_join`` in a join step), the
transfer counters (the captured step's counts), the attended-token count
(``Cache.stats()["attended_tokens_per_step"]``: accumulated on the device inside the graph, its call
count here), the policy's :meth:`graph_replayed`, then ``policy.on_step``
with the replayed logits (CHESS's trigger and rebuild, PRKV's refresh clock run outside the graph).
A capture runs the step's Python once (its CPU-side effects are those of the captured step; the
``on_step`` hook is held back and called after the first replay, when the logits exist).

**torch.compile of the model's own work** (``compile=True``, opt-in; docs/bench/compile.md). Inside a
CUDA graph each kernel still costs ~2 us, and transformers' eager decoder layer issues ~40 small
elementwise kernels (RMSNorm's cast / pow / mean / rsqrt / mul, RoPE's slices / neg / cat, SiLU * up,
residual adds). The decoder compiles each decoder layer with inductor (``dynamic=False``, no inductor
cudagraphs: kvdex captures its own graph around the whole step) so that these fuse. kvdex's entry points
stay eager Python: ``kvdex.Cache.update`` and the ``"kvdex"`` attention function are
``torch.compiler.disable``d, so each layer compiles to the work before the cache update and the work
after the attention (two graph breaks per layer). The compiled layers are swapped into the model's
layer list only while the decoder runs a step (prefill and the user's own calls run the model as it
was), one compilation per layer and shape (dynamo specialises on the module's ``layer_idx``), on the
first decode step; later steps, eager ones included, reuse them (no recompiles).
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

import torch

from kvdex.integration.cache import Cache
from kvdex.integration.compat import cache_kwargs
from kvdex.storage import DeviceStore, OffloadStore, host_joins

# Policies with built-in graph support that do not define the protocol themselves.
_BUILTIN = {"full"}


# Page joins of a capturable_index policy: the stores and the index are grown this many pages ahead of
# the longest sequence (half of it used up -> grown again), so that a re-allocation (a new graph key, an
# eager warm-up step and a capture) happens once every JOIN_HEADROOM_PAGES / 2 pages at most, and rarely
# in practice (the buffers grow by a quarter of their size at a time).
JOIN_HEADROOM_PAGES = 16

# torch.compile modes that keep inductor's own CUDA graphs off (kvdex captures the whole step itself).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def _compile_mode(compile) -> str | None:
    """``compile`` argument -> inductor mode (None: off)."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "default"
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return compile
    raise ValueError(
        f"compile must be a bool or one of {', '.join(COMPILE_MODES)} (modes with inductor cudagraphs such as "
        f"'reduce-overhead' would nest graphs inside kvdex's own capture), got {compile!r}"
    )


def decoder_layers(model) -> list[tuple[torch.nn.ModuleList, int, torch.nn.Module]]:
    """(layer list, index, decoder layer) of every layer holding a kvdex-served attention module: the
    direct parent of the attention module, an element of a ``ModuleList``. ValueError where a model is
    built otherwise."""
    from kvdex.integration.loading import attention_modules

    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for idx, attn in sorted(attention_modules(model).items()):
        parent, _, _ = names[id(attn)].rpartition(".")
        holder, _, key = parent.rpartition(".")
        box = model.get_submodule(holder) if holder else model
        if not isinstance(box, torch.nn.ModuleList) or not key.isdigit():
            raise ValueError(f"layer {idx}: the attention module's parent {parent!r} is not in a ModuleList")
        out.append((box, int(key), box[int(key)]))
    if not out:
        raise ValueError("no attention modules found to compile")
    return out


class CompiledLayers:
    """Each decoder layer of ``model`` compiled with ``torch.compile(layer, dynamic=False, mode=mode)``,
    swapped into the model's layer list only inside :meth:`active` (the model object is restored after
    every call). Dynamo specialises on each layer's ``layer_idx`` (an int attribute handed to the cache
    update), so every layer is its own compiled entry: the recompile limit is raised to cover them while
    active. ``graphs``: the graphs dynamo compiled while active (``torch._dynamo`` counters)."""

    def __init__(self, model, mode: str = "default"):
        self.mode = mode
        self.slots = [
            (box, i, layer, torch.compile(layer, dynamic=False, mode=mode)) for box, i, layer in decoder_layers(model)
        ]
        n = len(self.slots)
        cfg = torch._dynamo.config
        self._patch = {}
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                self._patch[name] = max(getattr(cfg, name), 8 * n + 8)  # a few batch sizes / dtypes
                break
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):  # newer / older torch
            if hasattr(cfg, name):
                self._patch[name] = max(getattr(cfg, name), 16 * n + 64)
                break
        self.graphs = 0
        self.compile_s = 0.0  # wall time of the calls in which dynamo compiled something

    @staticmethod
    def _graph_count() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @contextmanager
    def active(self):
        g0, t0 = self._graph_count(), time.perf_counter()
        for box, i, _, comp in self.slots:
            box[i] = comp
        cfg = torch._dynamo.config  # set / restored by hand: config.patch() costs ~1.5 ms per step
        saved = {k: getattr(cfg, k) for k, v in self._patch.items() if getattr(cfg, k) < v}
        try:
            for k in saved:
                setattr(cfg, k, self._patch[k])
            yield
        finally:
            for k, v in saved.items():
                setattr(cfg, k, v)
            for box, i, layer, _ in self.slots:
                box[i] = layer
            new = self._graph_count() - g0
            if new:
                self.graphs += new
                self.compile_s += time.perf_counter() - t0


def graph_policies() -> list[str]:
    """Registered policies whose decode step can be captured (with a suitable store)."""
    from kvdex.policies.base import _REGISTRY

    return sorted(n for n, cls in _REGISTRY.items() if n in _BUILTIN or hasattr(cls, "graph_key"))


class GraphDecoder:
    """Decode a prefilled :class:`kvdex.Cache` one token at a time, replaying CUDA graphs.

    ``step(ids [B, 1]) -> logits [B, vocab]``. Where the cache cannot be captured (no CUDA device, a
    policy or store without graph support, ``timing=True``, an observer) every step runs eagerly
    and :attr:`reason` says why (warned once). ``counts``: eager steps, captures, replays.

    ``compile=True`` (or an inductor mode from :data:`COMPILE_MODES`): every step, eager or captured,
    runs the model's decoder layers compiled by ``torch.compile`` (:class:`CompiledLayers`); also on CPU
    and with ``enabled=False``. :attr:`compiled` holds them (``.graphs``, ``.compile_s``);
    :attr:`compile_reason` says why compilation is off where it was asked for (warned once).
    """

    def __init__(
        self,
        model,
        cache: Cache,
        batch: int | None = None,
        *,
        enabled: bool = True,
        warn: bool = True,
        compile: bool | str = False,
    ):
        if not isinstance(cache, Cache):
            raise ValueError("graph decoding needs a kvdex.Cache")
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.batch = batch
        self.enabled, self.warn = enabled, warn
        self.reason: str | None = None
        self._checked = False
        self.graphs: dict = {}  # key -> (CUDA graph, its logits, its transfer / counter deltas)
        self.key = None
        self._warmed: set = set()  # keys run eagerly once (the next step with that key captures)
        self.logits = None
        self._joins = False  # the policy indexes page joins inside captured steps (capturable_index)
        self._join_count = None  # [B] (CPU) pages joining in this step (capturable_index)
        self._reserved = 0  # tokens per sequence the stores and the index have room for (page joins)
        self.ids = self.pos = self._neg_pads = None
        self.counts = {"eager": 0, "captures": 0, "replays": 0}
        self.compile_mode = _compile_mode(compile)
        self.compiled: CompiledLayers | None = None
        self.compile_reason: str | None = None
        self._compile_proven = False
        if self.compile_mode is not None:
            why = None
            if not torch._dynamo.is_dynamo_supported():
                why = "torch.compile is not supported on this Python / platform"
            else:
                try:
                    self.compiled = CompiledLayers(model, self.compile_mode)
                except ValueError as e:
                    why = str(e)
            if why is not None:
                self._compile_off(why)

    @property
    def graph(self):
        """The CUDA graph of the last replayed key (None: none). Setting None drops every graph and its pool."""
        entry = self.graphs.get(self.key)
        return None if entry is None else entry[0]

    @graph.setter
    def graph(self, value) -> None:
        if value is not None:
            raise ValueError("GraphDecoder.graph can only be reset (set to None)")
        self.graphs.clear()
        self.key = None

    def _compile_off(self, why: str) -> None:
        self.compiled, self.compile_reason = None, why
        if self.warn:
            warnings.warn(f"kvdex: torch.compile is off, running the model uncompiled: {why}", stacklevel=4)

    def _run(self, **kw):
        """The model's forward for one decode step, through the compiled layers when compiling. If the
        very first compiled call fails before any layer's cache was updated (no compiler, an inductor
        error), compilation is switched off with a warning and the step runs uncompiled; a failure after
        the cache changed cannot be undone and is raised."""
        if self.compiled is None:
            return self.model(**kw)
        if self._compile_proven:
            with self.compiled.active():
                return self.model(**kw)
        seen = [lay.seen for lay in self.cache.layers]
        try:
            with self.compiled.active():
                out = self.model(**kw)
        except Exception as e:
            if [lay.seen for lay in self.cache.layers] != seen:
                raise
            root = getattr(e, "inner_exception", None) or e
            while root.__cause__ is not None:
                root = root.__cause__
            line = next((x for x in str(root).splitlines() if x.strip()), "")
            self._compile_off(f"compiling failed ({type(e).__name__}): {type(root).__name__}: {line[:200]}")
            return self.model(**kw)
        self._compile_proven = True
        return out

    # ---- decisions --------------------------------------------------------------------------------
    def _stores(self):
        return [lay.store for lay in self.cache.layers]

    def _unsupported(self) -> str | None:
        c = self.cache
        if self.device.type != "cuda":
            return "it needs a CUDA device"
        if c.config.timing:
            return "timing=True synchronises inside the step"
        if c.observer is not None:
            return "an observer runs Python inside the step"
        stores = self._stores()
        for st in stores:
            if type(st) not in (DeviceStore, OffloadStore):
                return f"the store {type(st).__name__} has no graph support"
            if isinstance(st, OffloadStore) and st.host._uva is None:
                return "an offloaded store needs the UVA gather (triton, KVDEX_UVA != 0)"
        p = c.policy
        if hasattr(p, "graph_unsupported"):
            return p.graph_unsupported(stores)
        if p.name in _BUILTIN:
            return None
        return f"policy {p.name!r} does not support graph capture (its selection touches the CPU)"

    def _prepare(self) -> None:
        if self._checked:
            return
        stores = self._stores()
        if any(st is None for st in stores):
            raise ValueError("prefill the cache before decoding with GraphDecoder")
        self._checked = True
        self.reason = self._unsupported() if self.enabled else "disabled (cuda_graph=False)"
        b = stores[0].batch
        if self.batch is not None and self.batch != b:
            raise ValueError(f"batch {self.batch} does not match the cache's batch {b}")
        self.batch = b
        dev = stores[0].device
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        pads = getattr(self.cache.layers[0], "_pads", None)
        pads = torch.zeros(b, dtype=torch.long) if pads is None else pads.to(torch.long).cpu()
        self._neg_pads = (-pads).to(dev)[:, None]
        if self.reason is not None:
            if self.warn and self.enabled:
                warnings.warn(f"kvdex: CUDA-graph decoding is off, decoding eagerly: {self.reason}", stacklevel=4)
            return
        for st in stores:
            st.static = True
        self._joins = bool(self.cache.policy.capturable_index)

    def _join_host(self) -> bool:
        """Before a step of a ``capturable_index`` policy: room for the pages to come (stores and index,
        :data:`JOIN_HEADROOM_PAGES` ahead, re-allocating -- a new graph key -- only every so many pages),
        then the host side of this step's joins (``Policy.joined``). True when a page joins."""
        c, p = self.cache, self.cache.policy
        lays = [c.layers[i] for i in p.info.sparse_layers]
        if not lays:
            return False
        st = lays[0].store
        g = st.grid
        top = int(st.lengths_host.max()) + 1
        if top + JOIN_HEADROOM_PAGES * g.page_size // 2 > self._reserved:
            self._reserved = top + JOIN_HEADROOM_PAGES * g.page_size
            pages = g.middle_pages_of(self._reserved)
            for lay in c.layers:
                lay.store.reserve_join(self._reserved)
            for lay in lays:
                p.reserve_index(lay.layer_idx, pages, lay.store)
        start, count = host_joins(g, st.lengths_host)
        self._join_count = count
        if not bool((count > 0).any()):
            return False
        for lay in lays:
            p.joined(lay.layer_idx, start, count)
        return True

    def _needs_eager(self) -> bool:
        st = self._stores()[0]
        g, L = st.grid, st.lengths_host
        if not self._joins and bool((g.num_middle_pages(L + 1) != g.num_middle_pages(L)).any()):
            return True  # a page joins the middle: store/policy index work with data-dependent shapes
        for s in self._stores():
            if not isinstance(s, OffloadStore) and int(s.lengths_host.max()) + 1 > s.k.shape[2]:
                return True  # the resident buffer grows
        return False

    def _key(self):
        stores = self._stores()
        key = []
        for s in stores:
            key.append((id(s.k), tuple(s.k.shape)))
            if isinstance(s, OffloadStore):  # the UVA gather reads the host buffer by address
                key.append((id(s.host.data), tuple(s.host.data.shape)))
        p = self.cache.policy
        if hasattr(p, "graph_key"):
            pk = p.graph_key(stores)
            if pk is None:
                return None
            key.append(pk)
        elif any(isinstance(s, OffloadStore) for s in stores):  # offloaded "full" fetches range(nmid)
            st = stores[-1]
            key.append(int(st.grid.num_middle_pages(st.lengths_host).max()))
        return tuple(key)

    # ---- one step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode one token for ids [B, 1] (device); returns the last-position logits [B, vocab]."""
        self._prepare()
        c = self.cache
        try:
            # page joins: Policy.joined runs in _join_host, before every step (a replay runs no Python)
            c.joins_external = self._joins
            return self._step(ids)
        finally:  # the cache used without the decoder decides page joins itself again
            c.join_step, c.joins_external = None, False

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.cache
        joining = self._join_host() if self.reason is None and self._joins else False
        key = None if self.reason is not None or self._needs_eager() else self._key()
        if key is not None and self._joins:
            # the join variant of the step (page-join path, masked per sequence on the device) is right on
            # any step: it is warmed up and captured on the first steps after the plain one, not at a boundary
            early = not joining and (key, False) in self.graphs and (key, True) not in self.graphs
            key = (key, joining or early)
        if self.reason is None and self._joins:
            c.join_step = joining if key is None else key[1]
        torch.add(self._neg_pads, c.layers[0].seen, out=self.pos)  # position of the new token, per row
        if key is None or (key not in self.graphs and key not in self._warmed):
            # eager: a boundary (a policy without capturable_index), a step the policy keeps eager, or a new
            # key run once eagerly first so that every kernel variant is compiled and loaded before a
            # capture (no module loads while capturing)
            if key is not None:
                self._warmed = {k for k in self._warmed if self._base(k) == self._base(key)} | {key}
            self.counts["eager"] += 1
            out = self._run(input_ids=ids, **cache_kwargs(c), use_cache=True, logits_to_keep=1, position_ids=self.pos)
            return out.logits[:, -1]
        self.ids.copy_(ids)
        if key not in self.graphs:
            self._capture(key)
            self.key = key
            self.graphs[key][0].replay()  # the capture ran this step's CPU side; this does its device work
            self.counts["replays"] += 1
            c.policy.on_step(c.step, self.logits)  # held back during the capture
            return self.logits
        graph, self.logits, self._delta = self.graphs[key]
        self.key = key
        self._bookkeeping()
        graph.replay()
        self.counts["replays"] += 1
        if hasattr(c.policy, "graph_replayed"):
            c.policy.graph_replayed()
        c.policy.on_step(c.step, self.logits)
        return self.logits

    def _bookkeeping(self) -> None:
        """The CPU side of one replayed step, as the captured step's Python did it."""
        c = self.cache
        c.step += 1
        join = self._joins and self.key[1] and bool((self._join_count > 0).any())
        for lay in c.layers:
            lay.seen += 1
            lay.store.advance_host(1)
            if join:
                lay.store.count_join(self._join_count)  # an offloaded store: the pages it wrote to host memory
        c.transfer.h2d_bytes += self._delta[0]
        c.transfer.h2d_calls += self._delta[1]
        c._attended_calls += self._delta[2]
        total = c.layers[0].seen
        if c._max_positions and total > c._max_positions and not c._warned_long:
            c._warned_long = True
            warnings.warn(
                f"the sequence ({total} tokens) is longer than the model's max_position_embeddings "
                f"({c._max_positions}); quality past the trained context is not guaranteed",
                stacklevel=3,
            )

    def _base(self, key):
        """The key without the page-join flag (the policy's buffers and shapes)."""
        return key[0] if self._joins else key

    def _capture(self, key) -> None:
        c = self.cache
        for k in [k for k in self.graphs if self._base(k) != self._base(key)]:
            del self.graphs[k]  # captured over buffers that were re-allocated since: never replayed again
        # attended tokens: a persistent device counter that the replays accumulate into (in place), made at
        # the first capture only: the graphs kept (both page-join variants of a key) add into it by address,
        # and a counter replaced here would be freed under them (their replays then add into whatever
        # tensor the allocator puts there next: a sampled token, the caller's logits)
        if not c._attended_inplace:
            c._attended = (
                torch.zeros((), dtype=torch.long, device=self.device)
                if c._attended is None
                else c._attended.to(torch.long).clone()
            )
            c._attended_inplace = True
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        t = c.transfer
        before = (t.h2d_bytes, t.h2d_calls, c._attended_calls)
        # compiled layers: compiled (and their kernels loaded) by the eager warm-up step before this
        with _on_step_held(c.policy), torch.cuda.graph(g):  # a private pool per graph
            out = self._run(
                input_ids=self.ids, **cache_kwargs(c), use_cache=True, logits_to_keep=1, position_ids=self.pos
            )
            self.logits = out.logits[:, -1]
        self._delta = (t.h2d_bytes - before[0], t.h2d_calls - before[1], c._attended_calls - before[2])
        self.graphs[key] = (g, self.logits, self._delta)
        self.counts["captures"] += 1


@contextmanager
def _on_step_held(policy):
    """``policy.on_step`` does nothing inside (the logits hook fires during a capture, before any
    logits exist; the decoder calls it after the first replay)."""
    had = "on_step" in vars(policy)
    old = vars(policy).get("on_step")
    policy.on_step = lambda step, logits: None
    try:
        yield
    finally:
        if had:
            policy.on_step = old
        else:
            del policy.on_step


# ---- a decode loop for users ---------------------------------------------------------------------------


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """Next ids [B, 1] from logits [B, V]: temperature, then top-k, then nucleus (top-p), as
    transformers' default processors; all on the device."""
    x = logits.float() / max(temperature, 1e-5)
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False  # always keep the most likely token
        x = x.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)


@torch.no_grad()
def generate(
    model,
    cache: Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 64,
    cuda_graph: bool = True,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    prefill_chunk: int = 0,
    check_every: int = 16,
    compile: bool | str = False,
) -> torch.Tensor:
    """Prefill ``input_ids`` [B, L] (left padding marked by ``attention_mask``) into a fresh ``cache``
    and decode up to ``max_new_tokens``; returns ``[B, L + n]`` like ``model.generate``.

    ``cuda_graph=True``: decode steps replay CUDA graphs (:class:`GraphDecoder`), falling back to
    eager steps with a warning where the cache cannot be captured. Greedy by default; ``do_sample``
    with ``temperature`` / ``top_k`` / ``top_p``. ``eos_token_id`` (default: the model's generation
    config) ends a row; finished rows get ``pad_token_id``. The next ids never leave the device
    inside the loop; whether every row has finished is looked at every ``check_every`` steps.
    ``prefill_chunk``: prefill in forwards of that many tokens (``kvdex.integration.prefill``).
    ``generator``: a ``torch.Generator`` on the model's device, for reproducible sampling.
    ``compile``: decode steps run the model's decoder layers through ``torch.compile`` (inductor fuses
    the elementwise work; the prefill stays uncompiled), see :class:`GraphDecoder`. Compiling happens on
    the first decode step. ``cache.compile_reason`` says why it was switched off, if it was.
    """
    if not isinstance(cache, Cache):
        raise ValueError("kvdex.generate needs a kvdex.Cache")
    if cache.layers[0].store is not None:
        raise ValueError("kvdex.generate needs a fresh kvdex.Cache (this one has a prompt already)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got {tuple(input_ids.shape)}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every!r}")
    _compile_mode(compile)  # a bad value: ValueError before the prefill
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None)
    eos = None
    if eos_token_id is not None:
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
        if pad_token_id is None:
            pad_token_id = int(eos[0])
    # prefill
    kw = {}
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        pos = attention_mask.long().cumsum(-1) - 1
        kw = dict(attention_mask=attention_mask, position_ids=pos.masked_fill(attention_mask == 0, 1))
    if prefill_chunk and input_ids.shape[1] > prefill_chunk:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("prefill_chunk needs prompts without padding")
        from kvdex.integration.prefill import chunked_prefill

        logits = chunked_prefill(model, cache, input_ids, prefill_chunk)[:, -1]
    else:
        logits = model(input_ids=input_ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
    dec = GraphDecoder(model, cache, enabled=cuda_graph, compile=compile)
    out = []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        nxt = _sample(logits, temperature, top_k, top_p, generator) if do_sample else logits.argmax(-1, keepdim=True)
        if eos is not None:
            nxt = torch.where(done[:, None], pad_token_id, nxt)
            done = done | torch.isin(nxt[:, 0], eos)
        out.append(nxt)
        if i + 1 == max_new_tokens or (eos is not None and (i + 1) % check_every == 0 and bool(done.all())):
            break
        logits = dec.step(nxt)
    new = torch.cat(out, dim=1) if out else input_ids.new_zeros(input_ids.shape[0], 0)
    if eos is not None and new.shape[1]:  # drop the steps after the one in which the last row finished
        is_eos = torch.isin(new, eos)
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), new.shape[1])  # each row's first eos
        new = new[:, : min(int(first.max()) + 1, new.shape[1])]
    cache.graph_counts = dict(dec.counts)
    cache.graph_reason = dec.reason
    if dec.compile_mode is not None:
        cache.compile_reason = dec.compile_reason
    return torch.cat([input_ids, new], dim=1)
