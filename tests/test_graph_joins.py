"""Page joins inside a captured decode step (``Policy.capturable_index``, kvdex.engine.graphs).

Under static sizing a policy that declares ``capturable_index`` indexes the page that joins the middle
(at most one per sequence and step) through ``LayerStore.append_join`` -> ``Policy.joined`` (host) ->
``Policy.index_join`` (device, fixed shapes, a device mask of the joining sequences) instead of
``Policy.index``. On CPU (no CUDA graphs) these tests hold that path to the eager one and to the capture
contract of tests/test_graph.py:

* the index state (every tensor the policy keeps), the offloaded host pages, the selections and the
  logits after 40 decode steps of a ragged batch of 3 (rows join at different steps; one row starts
  with an empty middle) are bit-identical to the eager ``index`` path with the same static sizing;
* a join step reads no device value on the host and issues the same device work whichever rows join,
  and whether any row joins at all (the decoder captures the join variant on a step without a join).

On a GPU (``gpu`` marker): ``GraphDecoder`` replays the join steps (no boundary step runs eagerly) and
decodes what the eager static path decodes.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest
import test_graph as G
import torch
from conftest import left_padded, shared_pair
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import kvdex
from kvdex import cache_kwargs
from kvdex.bench import shapes
from kvdex.hf.graph import GraphDecoder, graph_policies
from kvdex.policies import policy_class
from kvdex.storage import host_joins

SPECS = [
    "quest",
    "quest:group=heads",
    "pariskv",
    "pariskv:group=mean:coarse=tiers:pool_factor=None:candidate_ratio=None",  # the paper's configuration
    "pariskv-kmeans",
    "pariskv:center=True",
    "chess:trigger=interval:interval=5",
    "chess:preset=moderate:trigger=interval:interval=7",
    "chess:trigger=never",
    "chess:anchor_from=window:scope=shared:trigger=interval:interval=5",  # the paper's mode
    "arkvale",
    "arkvale:cache_pages=4",
    "prkv:refresh=8:rerank=0",  # the paper's selection
    "prkv:static_ratio=0:rerank=0",
    "prkv:refresh=8:rerank=4:rerank_group=weight:rerank_share=0.25:rerank_unit=page",  # the default's, every step
    "prkv:refresh=8:group=heads:static_group=heads",
    "full",  # IndexFreePolicy: nothing to index, the join steps are captured too
    "oracle",
    "streaming",
    "snapkv",  # no index: the kept tokens past the prefill's middle grow with the store's lengths
    "snapkv:refresh=8",
    "h2o",  # nothing to index at a join: its score buffers cover every position already
    "icecache:search=summary",  # the semantic page insertion inside the step (SemanticPages.insert_device)
    "icecache:search=summary:rerank=4",
    "icecache:search=summary:rerank=4:rerank_unit=token",
    "icecache:search=summary:summary=centroid:group_merge=max",
    "icecache:search=summary:build=device",  # the prefill's leaf pages built on the device (no tree)
]
# test_join_path_equals_eager_index holds the index state (and the store) of the join path to the eager
# index path; a spec that differs from another one only in how it selects (reading the same index state)
# runs that test's code and assertions again. The capture contract below runs every spec: its select differs.
SELECT_ONLY = {
    "quest:group=heads": "quest",  # group combines the query heads' page scores; index / index_join: quest's
    "oracle": "full",  # IndexFreePolicy: no index (index_join does nothing); the store's join path: full's
    "streaming": "full",
    "icecache:search=summary:rerank=4": "icecache:search=summary",  # rerank reads the keys in select only
    "icecache:search=summary:rerank=4:rerank_unit=token": "icecache:search=summary",
}
JOIN_PATH_SPECS = [s for s in SPECS if s not in SELECT_ONLY]
LENGTHS = [200, 133, 40]  # rows join at steps 8, 11 and 8 (+16 each); the last starts with no middle
STEPS = 40
BUDGET = 96


def test_opted_in_policies_are_graph_policies():
    assert all(s in SPECS and base in JOIN_PATH_SPECS for s, base in SELECT_ONLY.items())
    names = {"quest", "pariskv", "pariskv-kmeans", "chess", "arkvale", "prkv", "full", "oracle", "streaming", "snapkv"}
    names |= {"h2o", "icecache"}
    assert all(policy_class(n).capturable_index for n in names)
    assert names <= set(graph_policies())
    # icecache: only search="summary" (its default; no tree search) indexes its joins inside the step (an instance
    # attribute), and not offloaded with a rerank (the candidates' keys come from the host)
    assert kvdex.make_policy("icecache").capturable_index
    assert kvdex.make_policy("icecache:search=summary").capturable_index
    assert not any(kvdex.make_policy("icecache", search=s).capturable_index for s in ("auto", "device", "host"))


def _tensors(obj, prefix="", out=None, depth=0) -> dict[str, torch.Tensor]:
    """Every tensor a policy holds (attributes, dicts, lists, dataclasses, DigestIndex), by path."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif depth > 4 or isinstance(obj, (str, int, float, bool, type(None))):
        pass
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{prefix}[{k!r}]", out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, f"{prefix}[{i}]", out, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, kvdex.Cache)):
        for k, v in vars(obj).items():
            if k not in ("info", "cfg", "_stores", "_sel", "_sel_on", "_consts", "_ops"):
                _tensors(v, f"{prefix}.{k}", out, depth + 1)
    return out


def _ragged_decode(model, spec, offload, join, feed=None, lengths=LENGTHS, steps=STEPS, mark=None):
    """Prefill a left-padded batch, switch to static sizing and decode ``steps`` tokens (greedy, or
    ``feed``). ``join=False``: the eager ``index`` path (the reference). ``mark(i, cache)``: the
    join_step to force at step i (None: where a page joins)."""
    ids, mask, _ = left_padded(lengths, seed=10)
    cache = kvdex.Cache(model, spec, BUDGET, dense_layers=1, offload=offload)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    for lay in cache.layers:
        lay.store.static = True
    if not join:
        cache.policy.capturable_index = False  # this instance indexes through Policy.index
    log = G._SelectionLog(cache.policy)
    joined = []
    f = cache.policy.index_join
    cache.policy.index_join = lambda layer, j: (joined.append(int(j.host_count.sum())), f(layer, j))[1]
    tok, fed, logits = out.logits[:, -1:].argmax(-1), [], []
    for i in range(steps):
        tok = tok if feed is None else feed[i]
        fed.append(tok)
        if mark is not None:
            cache.join_step = mark(i, cache)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = mask.sum(-1, keepdim=True) - 1
        with torch.no_grad():
            o = model(input_ids=tok, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
        logits.append(o.logits[:, -1])
        tok = o.logits[:, -1:].argmax(-1)
    return fed, torch.stack(logits), log.log, cache, joined


@pytest.mark.parametrize("storage", ["device", "offload"])
@pytest.mark.parametrize("spec", JOIN_PATH_SPECS)
def test_join_path_equals_eager_index(spec, storage):
    _skip_resident_only(spec, storage)
    model, _ = shared_pair("llama_gqa")
    off = storage == "offload"
    fed, ref, sel_ref, c_ref, calls_ref = _ragged_decode(model, spec, off, join=False)
    _, got, sel, c, calls = _ragged_decode(model, spec, off, join=True, feed=fed)
    assert calls_ref == [] and len(calls) >= 6 and sum(calls) >= 6, calls  # the join path ran, rows apart
    assert sel == sel_ref
    assert torch.equal(got, ref)
    # capacity buffers that the join path reserves ahead are compared by their content: center=True's device
    # flags (join path only) and PRKV's origin map (its restructured slots, below)
    reserved = ("done_dev", ".static_set.origin[")
    a = {k: x for k, x in _tensors(c_ref.policy).items() if not any(r in k for r in reserved)}
    b = {k: x for k, x in _tensors(c.policy).items() if not any(r in k for r in reserved)}
    assert set(a) == set(b), set(a) ^ set(b)
    st_ref, st = getattr(c_ref.policy, "static_set", None), getattr(c.policy, "static_set", None)
    if st_ref is not None:
        assert st_ref.restructured == st.restructured
        for layer in st_ref.restructured:
            assert torch.equal(st_ref.origin_map(layer), st.origin_map(layer)), f"origin map of layer {layer}"
    for k, x in a.items():
        assert x.shape == b[k].shape and x.dtype == b[k].dtype, k
        assert torch.equal(x, b[k]), f"{k} differs"
    for l1, l2 in zip(c_ref.layers, c.layers, strict=True):
        assert torch.equal(l1.store.k, l2.store.k) and torch.equal(l1.store.v, l2.store.v)
        assert torch.equal(l1.store.lengths, l2.store.lengths) and torch.equal(
            l1.store.lengths_host, l2.store.lengths_host
        )
        if off and not l1.dense:
            assert torch.equal(l1.store.host.data, l2.store.host.data)
    s1, s2 = c_ref.stats(), c.stats()
    for key in ("bytes_device_to_host", "bytes_host_to_device", "policy_stats", "attended_tokens_per_step"):
        assert _untimed(s1[key]) == _untimed(s2[key]), key


def _skip_resident_only(spec, storage):
    if "rerank" in spec and storage == "offload":
        pytest.skip("icecache's offloaded rerank reads the candidates' keys from the host: not captured")


def _untimed(v):
    """Stats without their wall-clock timings (IceCache's ``build_s``, ``query_ms_per_layer_step``,
    ``build_hidden_fraction``, ...), which differ from run to run."""
    if not isinstance(v, dict):
        return v
    timed = ("_s", "_s_per_", "_ms_", "hidden_fraction")
    return {k: x for k, x in v.items() if not (k.endswith("_s") or any(t in k for t in timed[1:]))}


@pytest.mark.parametrize("spec", ["quest", "pariskv", "chess:trigger=interval:interval=5", "arkvale", "prkv:refresh=8"])
def test_join_variant_on_steps_without_a_join(spec):
    """The decoder captures the join variant early, on a step where nothing joins, and replays it at every
    step where something does: running it on every step (masked) changes nothing."""
    model, _ = shared_pair("llama_gqa")
    fed, ref, sel_ref, c_ref, _ = _ragged_decode(model, spec, True, join=False)
    _, got, sel, c, calls = _ragged_decode(model, spec, True, join=True, feed=fed, mark=lambda i, cache: True)
    assert len(calls) == STEPS * len(c.policy.info.sparse_layers)
    assert sel == sel_ref and torch.equal(got, ref)
    a, b = _tensors(c_ref.policy), _tensors(c.policy)
    for k, x in a.items():
        assert torch.equal(x, b[k]), k


def test_join_step_mark_must_cover_the_joins():
    model, _ = shared_pair("llama_gqa")
    with pytest.raises(RuntimeError, match="did not mark"):
        _ragged_decode(model, "quest", False, join=True, mark=lambda i, cache: False)


# ---- the capture contract of a join step (tests/test_graph.py's trace) ---------------------------------


def _join_contract(model, spec, offload=False, steps=48):
    """Decode a ragged batch as GraphDecoder would with joins inside its graphs; trace the cache side
    (append, index_join, select, ...) of every step with a key. Returns (join steps traced, keys, problems)."""
    ids, mask, _ = left_padded([150, 97], seed=3)
    ids = ids % model.config.vocab_size
    cache = kvdex.Cache(model, spec, G.BUDGET, dense_layers=1, offload=offload)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
    for lay in cache.layers:
        lay.store.static = True
    dec = GraphDecoder(model, cache)  # its decisions only (no CUDA: nothing is captured)
    dec.plan.joins, cache.joins_external = True, True
    cache.counters.attended = (
        torch.zeros((), dtype=torch.long) if cache.counters.attended is None else cache.counters.attended.clone()
    )
    cache.counters.inplace = True
    # the whole cache side on the GPU-resident store; offloaded (whose CPU fetch path syncs, unlike its
    # UVA path on a GPU): the store's join append, the policy's select and its index_join
    tracer = G._Tracer(cache, whole=not offload)
    if offload:
        for lay in cache.layers:
            lay.store.append_join = lambda k, v, _f=lay.store.append_join: tracer._run(lambda: _f(k, v), [k, v])
        ij = cache.policy.index_join
        cache.policy.index_join = lambda layer, j: tracer._run(
            lambda: ij(layer, j), [j.joins, j.start, j.keys, j.values]
        )
    by_key, problems, joins = {}, [], 0
    tok = out.logits[:, -1:].argmax(-1)
    for i in range(steps):
        joining = dec.plan.join_host()
        key = None if dec.plan.needs_eager() else dec.plan.key()
        variant = joining or i % 3 == 0  # the join variant also on steps without a join (masked)
        cache.join_step = variant
        tracer.on = key is not None
        tracer.steps.append([])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        p = mask.sum(-1, keepdim=True) - 1
        with torch.no_grad():
            o = model(input_ids=tok, attention_mask=mask, position_ids=p, **cache_kwargs(cache), use_cache=True)
        tok = o.logits[:, -1:].argmax(-1)
        if key is None:
            continue
        joins += joining
        traces = tracer.steps[-1]
        problems += [f"step {i}: {e}" for tr in traces for e in tr.errors]
        ops = [tr.ops for tr in traces]
        k = (key, variant)
        if k not in by_key:
            by_key[k] = (i, ops)
        elif ops != by_key[k][1]:
            first = by_key[k][0]
            problems.append(f"step {i}: the same key as step {first} (join variant {variant}), other device work")
    return joins, len(by_key), problems


@pytest.mark.parametrize("storage", ["device", "offload"])
@pytest.mark.parametrize("spec", SPECS)
def test_join_steps_issue_identical_device_work(tiny, spec, storage):
    if spec == "oracle" and storage == "offload":
        pytest.skip("oracle offloaded copies the whole middle each step: not graph-capturable")
    _skip_resident_only(spec, storage)
    joins, keys, problems = _join_contract(tiny, spec, offload=storage == "offload")
    assert not problems, problems[:5]
    assert joins >= 4, f"only {joins} join steps traced"
    assert keys <= 12, f"{keys} graph keys"


tiny = G.tiny


# ---- GPU: the decoder replays the join steps -------------------------------------------------------------

GPU_SPECS = [
    "full",
    "quest",
    "pariskv",
    # the paper's mode rebuilds between steps (replayed); the default layer scope rebuilds inside select, so
    # its rebuild steps run eagerly by design: it is held to the page joins here without rebuilds
    "chess:anchor_from=window:scope=shared:trigger=interval:interval=5",
    "chess:trigger=never",
    "arkvale",
    "prkv:static_ratio=0.5",
    "prkv:static_ratio=0.5:rerank=0",  # the paper's selection (every step)
    "h2o",
    "icecache:search=summary",
    "icecache:search=summary:build=device",
]


@pytest.mark.parametrize("storage", ["device", "offload"])
@pytest.mark.parametrize("spec", GPU_SPECS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_replays_page_joins_on_gpu(spec, storage):
    """3 x page_size + 8 decode steps of a ragged batch through GraphDecoder, teacher-forced with the eager
    static path's tokens: logits within replay noise; every page boundary after the warm-up steps is replayed
    (the eager steps are the warm-ups of the plain and the join variant, and the policy's own)."""
    model = shapes.build_model("tiny", torch.float32, "cuda")
    ids, mask = G._left_padded(model, [150, 97], seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    steps = 3 * 16 + 8
    runs = []
    for graph in (False, True):
        c = G._cache(model, spec, offload=storage == "offload")
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(c), logits_to_keep=1)
        lg = out.logits[:, -1]
        for lay in c.layers:
            lay.store.static = True
        dec = GraphDecoder(model, c, enabled=graph)
        toks, logits, eager_at = [], [], []
        for i in range(steps):
            st = c.layers[-1].store
            boundary = bool((host_joins(st.grid, st.lengths_host)[1] > 0).any())
            before = dec.counts["eager"]
            # the graph run is teacher-forced with the eager run's tokens: a random model's logits are near
            # ties, and replay rounding may flip one (the logits are what is compared)
            nxt = lg.argmax(-1, keepdim=True) if not graph else runs[0][0][:, i : i + 1]
            toks.append(nxt)
            lg = dec.step(nxt)
            logits.append(lg.float().clone())
            if dec.counts["eager"] > before:
                eager_at.append((i, boundary))
        runs.append((torch.cat(toks, 1), torch.stack(logits), c, dict(dec.counts), eager_at))
    (t0, l0, c0, _, _), (t1, l1, c1, counts, eager_at) = runs
    assert torch.equal(t1, t0)
    torch.testing.assert_close(l1, l0, atol=5e-4 * float(l0.abs().max()), rtol=0)
    if spec == "full" and storage == "offload":
        # full's offloaded step fetches the whole middle: its graph key is the page count, so every page that
        # joins starts a new key (one eager warm-up of its plain and join variants, a few steps after the join)
        joined = [i for i, b in eager_at if b]
        assert joined and all(i < 6 or any(j <= i <= j + 4 for j in joined) for i, _ in eager_at), eager_at
        assert counts["replays"] >= steps - 4 * (len(joined) + 1), counts
    else:
        # the warm-ups of the plain and the join variant; with select_every (prkv's default) the join variant
        # of a select step is warmed up at the first page join (a reuse step has no early join variant)
        first = min((i for i, joins in eager_at if joins), default=None)
        late_ok = c1.policy.reuse_steps() > 1
        assert counts["eager"] <= 4 and all(i < 6 or (late_ok and i == first) for i, _ in eager_at), eager_at
        assert counts["replays"] >= steps - 4, counts
    s0, s1 = c0.stats(), c1.stats()
    for k in ("decode_steps", "context_tokens", "bytes_device_to_host", "bytes_host_to_device", "policy_stats"):
        assert _untimed(s0[k]) == _untimed(s1[k]), k
    for a, b in zip(c0.layers, c1.layers, strict=True):
        if storage == "offload" and not a.dense:  # the pages that left the window, written by the graph
            n = int(a.store.grid.num_middle_pages(a.store.lengths_host).max())
            assert torch.equal(a.store.host.data[:, :, :n], b.store.host.data[:, :, :n])


# ---- the kept graphs of a key: nothing they read or write is freed under them ----------------------------


class _FakeGraph:
    """torch.cuda.CUDAGraph on CPU: the capture runs the step once (its CPU side and, here, its device work),
    recording every tensor storage the step uses that it did not allocate itself (the persistent buffers a
    real graph reads and writes by address); a replay does nothing."""

    def __init__(self):
        self.buffers = {}  # data_ptr -> (weak reference to the storage, first op that used it, shape, dtype)

    def replay(self):
        pass


class _Buffers(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph, self.made = graph, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (list, tuple)) else [a])]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in self.made:
                ref = StorageWeakRef(t.untyped_storage())
                self.graph.buffers.setdefault(t.untyped_storage().data_ptr(), (ref, str(func), tuple(t.shape), t.dtype))
        out = func(*args, **kwargs)
        for o in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in self.graph.buffers:
                self.made.add(o.untyped_storage().data_ptr())  # a temporary (the graph's private pool)
        return out


@contextmanager
def _fake_capture(graph, **_kw):
    with _Buffers(graph):
        yield


# the decoder's warm-up sequence of a policy that selects every step (a reuse step has no early join variant);
# prkv's default selection is here every step
KEPT = [s for s in GPU_SPECS if kvdex.make_policy(s).reuse_steps() == 1]
KEPT += ["pariskv:center=True", "prkv:static_ratio=0.5:rerank=4:rerank_group=weight:rerank_share=0.25:rerank_unit=page"]


@pytest.mark.parametrize("spec", KEPT)
def test_kept_graphs_buffers_stay_alive(tiny, spec, monkeypatch):
    """GraphDecoder's own warm-up and capture sequence for a capturable_index policy (captures faked on CPU):
    the plain graph of a key is captured, then its join variant, and both are kept and replayed. A replay
    reads and writes the buffers of its capture by address: none may be freed (re-allocated, replaced) while
    the graph is kept. (The attended-token counter was made anew at each capture: the plain graph's replays
    then added into the freed counter's memory, i.e. into whatever the allocator put there next -- on a GPU
    the next sampled token or the caller's logits.)"""
    ids, mask = G._left_padded(tiny, [150, 97], seed=1)
    cache = G._cache(tiny, spec)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = tiny(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), logits_to_keep=1)
    monkeypatch.setattr(GraphDecoder, "_unsupported", lambda self: None)  # CPU: decide as on a GPU
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    dec = GraphDecoder(tiny, cache)
    nxt, keep = out.logits[:, -1:].argmax(-1), []
    for _ in range(8):  # eager warm-up, capture (plain); eager warm-up, capture (join variant)
        nxt = dec.step(nxt).argmax(-1, keepdim=True)
        keep.append(nxt)
        if len(dec.graphs) == 2:
            break
    assert sorted(k[1] for k in dec.graphs) == [False, True], dec.counts
    gc.collect()
    for key, (g, _, _) in dec.graphs.items():
        assert len(g.buffers) > 20
        freed = [(op, shape, dtype) for ref, op, shape, dtype in g.buffers.values() if ref.expired()]
        assert not freed, f"join variant {key[1]}: buffers freed under the kept graph: {freed}"
