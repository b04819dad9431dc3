"""CUDA-graph decoding (kvdex.engine.graphs, kvdex.hf.graph): the capture-safety contract of every graph policy,
checked on CPU, plus graph == eager on a GPU.

A CUDA graph replays the kernels of one captured step. A policy may be replayed when, under static
sizing (``store.static = True``), on every step the decoder would replay:

1. its selection equals the dynamic one (same attended positions per sequence and kv head, same
   logits) -- :func:`test_static_selection_equals_dynamic`;
2. its select / observe never read a device value on the host (``aten._local_scalar_dense``: ``.item()``,
   ``int(t)``, ``bool(t)`` of a device tensor), never feed host bookkeeping tensors (the CPU lengths)
   into device work, and issue exactly the same device ops with the same shapes, the same Python
   arguments and the same persistent input buffers as every other step with the same graph key
   (what a replay would run) -- :func:`test_replayable_steps_issue_identical_device_work`. A torch
   dispatch mode records that trace on CPU; host bookkeeping (ops on ``lengths_host``) is traced
   apart since it does not run in a graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvdex
from kvdex import cache_kwargs
from kvdex.bench import runner, shapes
from kvdex.hf.generate import generate
from kvdex.hf.graph import GraphDecoder, graph_policies

BUDGET = 80  # sink 16 + window 32 + 32 retrieved tokens (2 pages of 16)

SPECS = [
    "quest",
    "streaming",
    "oracle",
    "chess:trigger=interval:interval=5",
    "chess:anchor_from=window:scope=shared:trigger=interval:interval=5",  # the paper's mode
    "chess:anchor_from=window:scope=shared:trigger=always",
    "chess:preset=moderate:trigger=interval:interval=7",
    "arkvale",
    "arkvale:cache_pages=3",
    "prkv:refresh=8:rerank=0",  # the paper's selection (prkv's default reuses its selection: select_every)
    "prkv:static_ratio=0.5:refresh=6:rerank=0",
    "prkv:static_ratio=0:rerank=0",
    "prkv:static_ratio='auto':refresh=8:rerank=0",
    "snapkv",
    "snapkv:refresh=8",
    "h2o",
    # the page policies' token rerank (kvdex/policies/rerank.py): 2 x 2 candidate pages of 6-9
    "quest:rerank=2",
    "quest:rerank=2:rerank_group=weight",
    "arkvale:rerank=2",
    "prkv:static_ratio=0.5:refresh=6:rerank=2",
    "chess:trigger=interval:interval=5:rerank=2",
    "chess:anchor_from=window:scope=shared:trigger=interval:interval=5:rerank=2",
    "quest:rerank=1:rerank_share=0.5",
    "prkv:static_ratio=0.5:refresh=6:rerank=1:rerank_share=0.5:rerank_group=weight",
    "prkv:static_ratio=0.5:refresh=6:rerank=1:rerank_share=0.5:rerank_group=weight:rerank_unit=page",
]


@pytest.fixture(scope="module")
def tiny():
    return shapes.build_model("tiny", torch.float32, "cpu")


def _cache(model, spec, **kw):
    return kvdex.Cache(model, spec, BUDGET, dense_layers=1, **kw)


def _prompt(model, batch=2, length=150, seed=0):
    return runner._prompt(batch, length, model.config.vocab_size, seed, "cpu")


class _SelectionLog:
    """Records, per select call, the attended middle positions of every (sequence, kv head) as sets."""

    def __init__(self, policy):
        self.policy, self.log = policy, []
        self._select = policy.select
        policy.select = self._wrapped

    def _wrapped(self, q, view):
        layer, store = view.layer, view.store
        sel = self._select(q, view)
        if sel.everything or sel.empty:
            self.log.append((layer, "everything" if sel.everything else "empty"))
            return sel
        pos = sel.token_positions(store.grid.sink, store.grid.page_size)
        rows = [[frozenset(p[p >= 0].tolist()) for p in ph] for ph in pos]
        self.log.append((layer, rows))
        return sel


def _decode(model, spec, ids, steps, static, feed=None, **kw):
    cache = _cache(model, spec, **kw)
    nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
    if static:
        for lay in cache.layers:
            lay.store.static = True
    log = _SelectionLog(cache.policy)
    fed, logits = [], []
    for i in range(steps):
        tok = nxt if feed is None else feed[i]
        fed.append(tok)
        nxt, lg = runner._step(model, cache, tok)
        logits.append(lg)
    return fed, logits, log.log, cache


@pytest.mark.parametrize("spec", SPECS)
def test_static_selection_equals_dynamic(tiny, spec):
    """Static sizing (what graph decoding runs, eager or replayed) selects exactly what dynamic sizing
    selects, over 60 steps: page boundaries, CHESS rebuilds, PRKV / SnapKV+ refreshes, H2O evictions."""
    c_dyn, c_sta = static_matches_dynamic(tiny, spec)
    assert c_dyn.stats()["attended_tokens_per_step"] == pytest.approx(c_sta.stats()["attended_tokens_per_step"])


def static_matches_dynamic(model, spec, steps: int = 60):
    """Decode ``steps`` steps with dynamic sizing, then teacher-forced with static sizing: the same
    selections every step and layer, logits within 1e-5, the same policy stats. Returns both caches."""
    ids = _prompt(model)
    fed, ref, sel_dyn, c_dyn = _decode(model, spec, ids, steps, static=False)
    _, got, sel_sta, c_sta = _decode(model, spec, ids, steps, static=True, feed=fed)
    assert len(sel_dyn) == len(sel_sta) == steps * 2
    for i, (a, b) in enumerate(zip(sel_dyn, sel_sta, strict=True)):
        assert a == b, f"step {i // 2} layer {a[0]}: static selection differs"
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert c_dyn.stats()["policy_stats"] == c_sta.stats()["policy_stats"]
    return c_dyn, c_sta


# ---- the trace of a replayable step -------------------------------------------------------------------


# ops whose output size depends on device data: on CUDA they copy it to the host (a synchronisation)
_SYNCING = {
    torch.ops.aten.nonzero,
    torch.ops.aten.masked_select,
    torch.ops.aten._unique2,
    torch.ops.aten.unique_consecutive,
    torch.ops.aten.unique_dim,
}


class _Trace(TorchDispatchMode):
    """Device ops issued inside select / observe, normalised so that two steps that a CUDA graph
    would replay identically give equal traces. Tensors are named by where they come from: a
    temporary of this trace (by the op that made it), a call argument, a persistent buffer (by its
    storage address), or a Python number (by value). Ops whose tensor inputs are all host
    bookkeeping (the CPU lengths and what is computed from them) run on the CPU, not in a graph:
    they are left out; mixing them into device work is an error, as is any host read of a device
    value. A factory's output (no tensor input) joins the trace when device work first uses it."""

    _ids = 0

    def __init__(self, host: list[torch.Tensor], args: dict[int, str]):
        super().__init__()
        _Trace._ids += 1
        self.id = _Trace._ids
        for t in host:
            self._tag(t, "host")
        self.args = args  # id(tensor) -> name
        self.ops: list = []
        self.pending: dict[str, tuple] = {}  # factory outputs not yet used by device work
        self.errors: list[str] = []

    def _tag(self, t, name):
        t._kvdex_trace = (self.id, name)

    def _cls(self, t: torch.Tensor) -> str:
        tag = getattr(t, "_kvdex_trace", None)
        if tag is not None and tag[0] == self.id:
            return tag[1]
        return "arg" if id(t) in self.args else "untagged"

    def _desc(self, x, written: bool = False):
        if isinstance(x, torch.Tensor):
            c = self._cls(x)
            if c == "arg":
                who = self.args[id(x)]
            elif c == "untagged":
                if x.dim() == 0 and not written:  # a Python number wrapped by the op
                    who = ("number", x.item())
                else:
                    who = ("buf", x.untyped_storage().data_ptr())
            else:
                who = c
                if c in self.pending:
                    self.ops.append(self.pending.pop(c))
            return (who, tuple(x.shape), x.dtype, tuple(x.stride()), x.storage_offset())
        if isinstance(x, (list, tuple)):
            return type(x)(self._desc(y) for y in x)
        return repr(x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (list, tuple)) else [a])]
        tens = [a for a in flat if isinstance(a, torch.Tensor)]
        written = {
            i for i, arg in enumerate(func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write
        }
        out = func(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        classes = [self._cls(t) for t in tens]
        host = "host" in classes
        # neutral: factory outputs and wrapped Python numbers (they go with either side)
        device = any(
            c != "host" and not c.startswith("factory") and not (c == "untagged" and t.dim() == 0)
            for c, t in zip(classes, tens, strict=True)
        )
        if host and not device:  # host bookkeeping: runs on the CPU at capture time only
            for o in outs:
                self._tag(o, "host")
            return out
        if host:
            self.errors.append(f"{func}: host bookkeeping mixed into device work")
        if func is torch.ops.aten._local_scalar_dense.default:
            self.errors.append("a device value read on the host (.item() / int() / bool())")
        if func.overloadpacket in _SYNCING or (
            func.overloadpacket is torch.ops.aten.index
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat[1:])
        ):
            self.errors.append(f"{func}: synchronises on CUDA (data-dependent output size)")
        desc = (
            str(func),
            tuple(self._desc(a, i in written) for i, a in enumerate(args)),
            self._desc(kwargs),
        )
        name = f"tmp{len(self.ops) + len(self.pending)}"
        if not tens:
            name = "factory" + name
            self.pending[name] = desc
        else:
            self.ops.append(desc)
        ins = {id(t) for t in tens}
        for o in outs:
            if id(o) not in ins:
                self._tag(o, name)
        return out


class _Tracer:
    """Wraps policy.select / observe; while ``on``, every call is traced into ``self.traces[-1]``."""

    def __init__(self, cache, whole: bool = False):
        self.cache, self.on, self.steps = cache, False, []
        if whole:  # the cache side of every layer: append, select, attend, kernel, observe, counters
            for lay in cache.layers:
                up, att = lay.update, lay.attention
                lay.update = lambda k, v, *a, _f=up, **kw: self._run(lambda: _f(k, v, *a, **kw), [k, v])
                lay.attention = lambda m, q, k, v, mask, sc, _f=att: self._run(
                    lambda: _f(m, q, k, v, mask, sc), [q, k, v]
                )
            return
        p = cache.policy
        self._select, self._observe = p.select, p.observe
        p.select, p.observe = self._sel, self._obs

    def _host(self):
        return [lay.store.lengths_host for lay in self.cache.layers]

    def _run(self, fn, tensors, *args):
        if not self.on:
            return fn(*args)
        if getattr(self, "_inside", False):
            raise AssertionError("nested trace")
        names = {id(t): f"arg{i}" for i, t in enumerate(tensors)}
        with _Trace(self._host(), names) as tr:
            out = fn(*args)
        self.steps[-1].append(tr)
        return out

    def _sel(self, q, view):
        return self._run(self._select, [q], q, view)

    def _obs(self, layer, q, aset, scale):
        return self._run(self._observe, [q, aset.idx, aset.valid, aset.positions], layer, q, aset, scale)


def _replay_contract(model, spec, static=True, steps=60, whole=False):
    """Run ``steps`` decode steps; returns (replayable steps, graph keys, problems found)."""
    ids = _prompt(model, seed=3)
    cache = _cache(model, spec)
    nxt = runner._prefill(model, cache, ids).argmax(-1, keepdim=True)
    for lay in cache.layers:
        lay.store.static = static
    dec = GraphDecoder(model, cache)  # used for its decisions only (no CUDA: nothing is captured)
    if whole:  # as GraphDecoder._capture: the attended-token counter is one buffer, added to in place
        cache.counters.attended = (
            torch.zeros((), dtype=torch.long) if cache.counters.attended is None else cache.counters.attended.clone()
        )
        cache.counters.inplace = True
    tracer = _Tracer(cache, whole)
    by_key: dict = {}
    replayable, problems = 0, []
    for i in range(steps):
        key = None if dec.plan.needs_eager() else dec.plan.key()
        tracer.on = key is not None
        tracer.steps.append([])
        nxt, _ = runner._step(model, cache, nxt)
        if key is None:
            continue
        replayable += 1
        traces = tracer.steps[-1]
        problems += [f"step {i}: {e}" for tr in traces for e in tr.errors]
        ops = [tr.ops for tr in traces]
        if key not in by_key:
            by_key[key] = ops
        elif ops != by_key[key]:
            diff = next(
                ((j, x, y) for j, (a, b) in enumerate(zip(by_key[key], ops, strict=True))
                 for x, y in zip(a, b, strict=False) if x != y), None,
            )  # fmt: skip
            problems.append(f"step {i}: the same graph key as an earlier step, different device work: {diff}")
    return replayable, len(by_key), problems


@pytest.mark.parametrize("spec", SPECS)
def test_replayable_steps_issue_identical_device_work(tiny, spec):
    replayable, keys, problems = _replay_contract(tiny, spec)
    assert not problems, problems[:5]
    assert replayable >= 30, f"only {replayable} of 60 steps replayable"
    assert keys <= 12, f"{keys} graph keys in 60 steps: too many captures"


WHOLE = ["quest", "streaming", "oracle", "chess:trigger=interval:interval=5", "arkvale",
         "prkv:static_ratio=0.5:refresh=6:rerank=0", "snapkv", "snapkv:refresh=8", "h2o", "full",
         "quest:rerank=2:rerank_group=weight", "prkv:static_ratio=0.5:refresh=6:rerank=2",
         "quest:rerank=1:rerank_share=0.5"]  # fmt: skip


@pytest.mark.parametrize("spec", WHOLE)
def test_whole_cache_side_of_a_replayable_step(tiny, spec):
    """The same contract for everything kvdex does in a step (GPU-resident store, the CPU reference
    kernels): append, select, attend set, attention, observe, the attended-token counter."""
    replayable, keys, problems = _replay_contract(tiny, spec, whole=True)
    assert not problems, problems[:5]
    assert replayable >= 30 and keys <= 12


DYNAMIC = [
    ("h2o", "read on the host"),
    ("quest", "different device work"),
    ("prkv:static_ratio=0.5:refresh=6:rerank=0", "different device work"),
]


@pytest.mark.parametrize("spec,what", DYNAMIC)
def test_contract_check_catches_dynamic_sizing(tiny, spec, what):
    """The check above is not vacuous: with dynamic sizing, H2O reads device values on the host
    (``int(ws.max())``) and Quest and PRKV slice their index by the host's middle page count, which differs
    between steps that share a graph key."""
    _, _, problems = _replay_contract(tiny, spec, static=False)
    assert any(what in p for p in problems), problems[:5]


def test_graph_policies_and_unsupported_reasons(tiny):
    names = set(graph_policies())
    assert {"full", "quest", "streaming", "oracle", "chess", "arkvale", "prkv", "snapkv", "h2o", "pariskv"} <= names
    assert "icecache" in names  # its default scores device pages; the paper's tree search is not captured
    assert not kvdex.make_policy("icecache:search=auto").capturable
    cache = _cache(tiny, "quest")
    runner._prefill(tiny, cache, _prompt(tiny))
    dec = GraphDecoder(tiny, cache)
    with pytest.warns(UserWarning, match="CUDA-graph decoding is off.*CUDA device"):
        dec.step(torch.ones(2, 1, dtype=torch.long))
    assert dec.counts == {"eager": 1, "captures": 0, "replays": 0}
    assert not getattr(cache.layers[-1].store, "static", False)  # eager fallback keeps dynamic sizing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dec.step(torch.ones(2, 1, dtype=torch.long))  # warned once
    off = _cache(tiny, "oracle", offload=True)
    runner._prefill(tiny, off, _prompt(tiny))
    assert "offload" in off.policy.graph_unsupported([lay.store for lay in off.layers])
    assert _cache(tiny, "oracle").policy.graph_unsupported([lay.store for lay in cache.layers]) is None
    with pytest.raises(ValueError, match="prefill"):
        GraphDecoder(tiny, _cache(tiny, "quest")).step(torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="kvdex.Cache"):
        GraphDecoder(tiny, object())


# ---- kvdex.generate ------------------------------------------------------------------------------------


def _left_padded(model, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(1, model.config.vocab_size, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("spec", ["quest", "h2o", "chess:trigger=interval:interval=5"])
def test_generate_matches_model_generate(tiny, spec):
    """kvdex.generate (eager here: no CUDA) == transformers' generate with the same cache settings,
    on a left-padded batch; cuda_graph=True on CPU falls back with a warning and gives the same."""
    ids, mask = _left_padded(tiny, [150, 97])
    tiny.generation_config.eos_token_id = None
    ref = tiny.generate(ids, attention_mask=mask, **cache_kwargs(_cache(tiny, spec)), max_new_tokens=40,
                        do_sample=False, pad_token_id=0)  # fmt: skip
    c1 = _cache(tiny, spec)
    got = generate(tiny, c1, ids, mask, max_new_tokens=40, cuda_graph=False)
    assert torch.equal(got, ref)
    assert c1.graph_counts["replays"] == 0 and c1.graph_reason.startswith("disabled")
    c2 = _cache(tiny, spec)
    with pytest.warns(UserWarning, match="CUDA device"):
        got2 = kvdex.generate(tiny, c2, ids, mask, max_new_tokens=40)
    assert torch.equal(got2, ref)
    s1, s2 = c1.stats(), c2.stats()
    assert s1["decode_steps"] == s2["decode_steps"] == 39 and s1["context_tokens"] == s2["context_tokens"]


def test_generate_eos_sampling_and_errors(tiny):
    ids, mask = _left_padded(tiny, [120, 120], seed=5)
    free = generate(tiny, _cache(tiny, "quest"), ids, mask, max_new_tokens=30, cuda_graph=False)
    eos = int(free[0, 120 + 3])  # the 4th token of row 0 becomes the end-of-sequence token
    out = generate(tiny, _cache(tiny, "quest"), ids, mask, max_new_tokens=30, cuda_graph=False, eos_token_id=eos,
                   pad_token_id=0, check_every=4)  # fmt: skip
    new = out[:, 120:]
    first = [int((row == eos).nonzero()[0]) if bool((row == eos).any()) else None for row in new]
    assert first[0] is not None and first[0] <= 3
    assert torch.equal(new[0, : first[0] + 1], free[0, 120 : 120 + first[0] + 1])
    assert bool((new[0, first[0] + 1 :] == 0).all())  # finished rows are padded
    if first[1] is not None:  # every row finished: nothing past the last first eos
        assert new.shape[1] == max(first) + 1
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    kw = dict(max_new_tokens=12, cuda_graph=False, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    a = generate(tiny, _cache(tiny, "quest"), ids, mask, generator=g1, **kw)
    b = generate(tiny, _cache(tiny, "quest"), ids, mask, generator=g2, **kw)
    assert torch.equal(a, b) and a.shape == (2, 132) and int(a.max()) < tiny.config.vocab_size
    with pytest.raises(ValueError, match="fresh"):
        c = _cache(tiny, "quest")
        runner._prefill(tiny, c, ids)
        generate(tiny, c, ids)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny, _cache(tiny, "quest"), ids, max_new_tokens=-1)


# ---- GPU: graph == eager -------------------------------------------------------------------------------

GPU_SPECS = [
    "chess:trigger=interval:interval=5",
    "chess:trigger=uncertainty:check_every=4",
    "chess:preset=moderate:trigger=interval:interval=7",
    "arkvale",
    "arkvale:cache_pages=3",
    "prkv:static_ratio=0.5:refresh=8",
    "prkv:static_ratio=0",
    "snapkv",
    "snapkv:refresh=8",
    "h2o",
    "quest",
    "streaming",
    "oracle",
    "quest:rerank=2",
    "quest:rerank=2:rerank_group=weight",
    "arkvale:rerank=2",
    "prkv:static_ratio=0.5:refresh=8:rerank=2",
    "chess:trigger=interval:interval=5:rerank=2",
    "quest:rerank=1:rerank_share=0.5",
    "quest:select_every=4",  # select and reuse steps: two graph variants (kvdex/engine/reuse.py)
    "prkv:static_ratio=0.5:refresh=8:rerank=2:select_every=3",
    "oracle:select_every=4",
    "quest:rerank=2:rerank_group=weight:rerank_unit=page",
    "prkv:static_ratio=0.5:refresh=8:rerank=2:rerank_unit=page:select_every=3",
]


@pytest.mark.parametrize("storage", ["device", "offload"])
@pytest.mark.parametrize("spec", GPU_SPECS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_matches_eager_on_gpu(spec, storage):
    if spec.split(":")[0] == "oracle" and storage == "offload":
        pytest.skip("oracle offloaded is not graph-capturable (it copies the whole middle each step)")
    model = shapes.build_model("tiny", torch.float32, "cuda")
    cfg = runner.BenchConfig(shape="tiny", dtype="float32", device="cuda", budget=BUDGET, check_context=150,
                             dense_layers=1, storages=(storage,))  # fmt: skip
    res = runner.check_graph(model, cfg, [f"{spec}/{storage}+graph"], steps=40)
    assert res[0]["ok"], res
    c = res[0]["counts"]
    assert c["replays"] >= 20 and c["captures"] >= 1, c


GEN_SPECS = [
    "quest",
    "chess:trigger=interval:interval=5",
    "arkvale",
    "prkv:static_ratio=0.5:refresh=8",
    "h2o",
    "quest:select_every=4",
    "prkv:static_ratio=0.5:refresh=8:select_every=3",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", GEN_SPECS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_with_graphs_matches_eager_on_gpu(spec, dtype):
    """kvdex.generate(cuda_graph=True) == cuda_graph=False on a left-padded batch: the same tokens,
    and the same CPU bookkeeping (steps, lengths, attended tokens per step, policy counters)."""
    model = shapes.build_model("tiny", dtype, "cuda")
    ids, mask = _left_padded(model, [150, 97], seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    runs = []
    for graph in (False, True):  # the eager run with the same static sizing: same kernels, same shapes
        c = _cache(model, spec)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(c), logits_to_keep=1)
        lg = out.logits[:, -1]
        for lay in c.layers:
            lay.store.static = True
        dec = GraphDecoder(model, c, enabled=graph)
        toks, logits = [], []
        for _ in range(48):
            nxt = lg.argmax(-1, keepdim=True)
            toks.append(nxt)
            lg = dec.step(nxt)
            logits.append(lg.float().clone())  # a replay rewrites the same logits buffer
        runs.append((torch.cat(toks, 1), torch.stack(logits), c, dict(dec.counts)))
    (t0, l0, c0, _), (t1, l1, c1, counts) = runs
    assert counts["replays"] >= 20 and counts["captures"] >= 1, counts
    assert torch.equal(t1, t0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(l1, l0, atol=tol * float(l0.abs().max()), rtol=0)
    s0, s1 = c0.stats(), c1.stats()
    for k in ("decode_steps", "context_tokens", "bytes_host_to_device", "policy_stats", "selection_steps"):
        assert s0.get(k) == s1.get(k), k
    assert s1["attended_tokens_per_step"] == pytest.approx(s0["attended_tokens_per_step"], rel=1e-6)


# ---- found while making SnapKV replayable --------------------------------------------------------------


@pytest.mark.parametrize("length", [254, 255, 256, 257, 258])
def test_snapkv_never_attends_a_token_twice(tiny, length):
    """SnapKV (refresh=0) at a budget covering the context == dense attention, whatever the prompt length.
    Before the fix, when the first decode token started a page, the tokens of the page that joined the
    middle were both chosen and kept, so they were attended twice (the bench's full-budget check failed)."""
    ids = _prompt(tiny, batch=1, length=length, seed=11)
    budget = length + 64 + 16 + 32
    dense = _cache(tiny, "full")
    runner._prefill(tiny, dense, ids)
    cache = kvdex.Cache(tiny, "snapkv", budget, dense_layers=1)
    runner._prefill(tiny, cache, ids)
    log = _SelectionLog(cache.policy)
    sel = cache.policy.select
    seen = []

    def counting(q, view):
        out = sel(q, view)
        for row in out.tokens.flatten(0, 1):  # every (sequence, kv head)
            t = row[row >= 0]
            seen.append((t.numel(), t.unique().numel()))
        return out

    cache.policy.select = counting
    tok = torch.tensor([[5]])
    for _ in range(20):
        _, a = runner._step(tiny, dense, tok)
        nxt, b = runner._step(tiny, cache, tok)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        tok = nxt
    assert all(n == u for n, u in seen), seen[:3]
    assert log.log


def test_cli_generate_has_cuda_graph_flag():
    from kvdex import cli

    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--cuda-graph"])
    assert args.cuda_graph is True and args.func is cli.cmd_generate
    assert cli.build_parser().parse_args(["generate", "--prompt", "hi"]).cuda_graph is False
