"""IceCache's batched search (kvdex/index/forest.py, ``icecache:search=device``): one search over all
trees of a layer returns what the per-tree search returns, the device mirror follows insertions, the
batched page choice is the host's, and the policy decodes like the host path."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import greedy, left_padded, prompt, shared_pair
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

import kvdex
from kvdex.engine.graphs import capture as graphs_mod
from kvdex.index import DCIParams, DCITree, transform_queries
from kvdex.index import forest as forest_mod
from kvdex.index.forest import DCIForest
from kvdex.index.pages import greedy_fit as _greedy_fit
from kvdex.policies import make_policy
from kvdex.policies.icecache.tree_search import TreeSearch

G = 7  # query heads per kv head (Qwen2.5-0.5B)

TREE = "icecache:search=auto"  # the paper's DCI-tree search (the default scores device pages)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(99)


@pytest.fixture(params=[False, True], ids=["exact", "static"])
def static(request, monkeypatch):
    """Both variants of the forest: exact shapes (CPU default) and host-bounded static shapes (the
    sync-free CUDA variant), here on the CPU."""
    monkeypatch.setattr(forest_mod, "STATIC_ON_CPU", request.param)
    return request.param


def clustered(n: int, d: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cent = torch.randn(max(1, n // 150), d, generator=g) * 2
    a = torch.randint(0, cent.shape[0], (n,), generator=g)
    return cent[a] + torch.randn(n, d, generator=g) * (0.3 + torch.rand(n, 1, generator=g))


def forest_of(sizes, d=32, seed=0):
    trees = [
        None if n == 0 else DCITree.build(clustered(n, d, seed + i), torch.arange(n) + 16, DCIParams(seed=seed + 7 * i))
        for i, n in enumerate(sizes)
    ]
    return trees


def _same_or_near_tie(host_ids, host_dot, dev_ids, dev_dot, tol=1e-5):
    """Same retrieved set; a difference is allowed only at the cut (near-tie of the k-th inner product)."""
    a = {i: v for i, v in zip(host_ids.tolist(), host_dot.tolist(), strict=True) if i >= 0}
    b = {i: v for i, v in zip(dev_ids.tolist(), dev_dot.tolist(), strict=True) if i >= 0}
    for i in set(a) & set(b):
        assert abs(a[i] - b[i]) <= tol
    diff = set(a) ^ set(b)
    if diff:
        cut = min(min(a.values()), min(b.values()))
        assert all(abs({**a, **b}[i] - cut) <= tol for i in diff), f"differ beyond a near-tie: {diff}"
    return not diff


def _check_search(trees, forest, rows, k, d=32, gen=None):
    q = torch.randn(len(rows) * G, d, generator=gen) * 3
    tq = torch.tensor(rows).repeat_interleave(G)
    ids, dot = forest.search(transform_queries(q), tq, tuple(rows), k, k, 0.8)
    exact = 0
    for j, r in enumerate(rows):
        hid, hdot = trees[r].search(transform_queries(q[j * G : (j + 1) * G]), k, 0, k, 0.8, collect_all=True)
        gid = ids[j * G : (j + 1) * G]
        loc = torch.where(gid >= 0, gid - r * forest.S, -1)
        assert bool(((gid < 0) | ((gid >= r * forest.S) & (gid < r * forest.S + trees[r].n))).all())  # its own tree
        for g in range(G):
            exact += _same_or_near_tie(hid[g], hdot[g], loc[g], dot[j * G + g])
    return exact, len(rows) * G


@pytest.mark.parametrize("k", [64, 256])
def test_batched_search_returns_the_per_tree_search_results_over_insertions(k, static):
    """Trees of different sizes and levels (and an empty one), 7 query heads each, k = fov = 64 / 256,
    query_prop 0.8; after each of several insertions the mirror is updated in place and the batched
    search still returns each tree's own search result (on these data: exactly, no near-tie)."""
    sizes = [1800, 700, 0, 2500, 90]
    trees = forest_of(sizes)
    forest = DCIForest(trees, "cpu")
    assert forest.static == static
    gens = [torch.Generator().manual_seed(i) for i in range(len(sizes))]
    gq = torch.Generator().manual_seed(5)
    rows = [0, 1, 3, 4]
    total = same = 0
    for step in range(4):
        e, n = _check_search(trees, forest, rows, k, gen=gq)
        same, total = same + e, total + n
        new = []
        for t, tree in enumerate(trees):  # a window page of 16 keys evicted into every non-empty tree
            if tree is not None:
                tree = tree.insert(clustered(16, 32, 100 + 10 * step + t), torch.arange(16) + 5000 + 16 * step, gens[t])
            new.append(tree)
        trees = new
        before = forest
        forest = forest.update(trees)
        assert forest is before  # incremental: capacity left, no rebuild
    assert same == total  # no near-tie on these data: every head's result is identical


def test_mirror_after_insertions_equals_a_fresh_mirror():
    trees = forest_of([600, 0, 900])
    forest = DCIForest(trees, "cpu")
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for step in range(6):
        trees = [
            t if t is None else t.insert(clustered(16, 32, 50 + step + i), torch.arange(16) + 2000 + 16 * step, gens[i])
            for i, t in enumerate(trees)
        ]
        forest = forest.update(trees)
    fresh = DCIForest(trees, "cpu", capacity=(forest.S, forest.Pc))
    for name in ("X", "proj", "dirs", "pt_page", "page_pos", "page_fill", "c", "root", "starts_at"):
        assert torch.equal(getattr(forest, name), getattr(fresh, name)), name
    for lev in range(forest.L - 1):
        for name in ("kids", "kid_start", "kid_count"):
            assert torch.equal(getattr(forest, name)[lev], getattr(fresh, name)[lev]), (name, lev)
    for x, y in zip(forest.node_cum, fresh.node_cum, strict=True):
        assert len(x) == len(y) and all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
    assert forest.levels == fresh.levels
    # a tree outgrowing its capacity gives a fresh, larger mirror
    big = [t if t is None else t.insert(clustered(400, 32, 9), torch.arange(400) + 9000, gens[0]) for t in trees]
    grown = forest.update(big)
    assert grown is not forest and grown.S >= max(t.n for t in big if t is not None)


def test_greedy_fit_equals_the_take_pages_loop():
    """The batched page choice (cumsum prefix + automaton prefix scan) takes exactly the pages of
    TreeSearch.take_pages' loop, for random fills, rooms and caps."""
    g = torch.Generator().manual_seed(0)
    ps = 16
    for _ in range(300):
        R, M = 3, int(torch.randint(1, 60, (1,), generator=g))
        f = torch.randint(1, ps + 1, (R, M), generator=g)
        nv = torch.randint(0, M + 1, (R,), generator=g)
        valid = torch.arange(M)[None, :] < nv[:, None]
        f = torch.where(valid, f, 0)
        room = int(torch.randint(0, 300, (1,), generator=g))
        cap = int(torch.randint(1, 40, (1,), generator=g))
        got = _greedy_fit(f, valid, room, cap, ps)
        for r in range(R):
            take, left = [], room
            for i in range(int(nv[r])):
                if f[r, i] <= left:
                    take.append(i)
                    left -= int(f[r, i])
                    if left == 0 or len(take) == cap:
                        break
            assert torch.nonzero(got[r]).flatten().tolist() == take


@pytest.mark.parametrize("merge", ["rank", "nsa"])
@pytest.mark.parametrize("rule", ["tokens", "keys"])
@pytest.mark.parametrize("k", [64, 256])
def test_batched_page_choice_equals_the_policy_per_tree(k, rule, merge, static):
    trees = forest_of([1500, 0, 800, 2000])
    forest = DCIForest(trees, "cpu")
    pol = TreeSearch(96, 13, budget_rule=rule, group_merge=merge, topk=k)  # the policy's tree search, 13 pages
    rows = (0, 2, 3)
    q = torch.randn(len(rows) * G, 32) * 3
    tq = torch.tensor(rows).repeat_interleave(G)
    ids, dot = forest.search(transform_queries(q), tq, rows, k, k, 0.8)
    room = 208
    cap = (1 << 40) if rule == "keys" else 13
    qk_scale = forest.c[tq][:, None] * q.norm(dim=-1, keepdim=True)
    toks, npages = forest.select_pages(ids, dot, torch.tensor(rows), G, room, cap, rule, merge, qk_scale, 0.125)
    for j, r in enumerate(rows):
        gid = ids[j * G : (j + 1) * G]
        found = (
            torch.where(gid >= 0, gid - r * forest.S, -1),
            dot[j * G : (j + 1) * G] * qk_scale[j * G : (j + 1) * G],
        )
        want = pol.select_pages(trees[r], None, room, found, 0.125)
        got = toks[j][toks[j] >= 0]
        assert got.tolist() == want.tolist()  # same pages in the same order
        if rule == "tokens":
            assert got.numel() <= room
    assert int(npages.sum()) == pol.stats["pages_selected"]


@pytest.mark.parametrize("spec", [TREE, TREE + ":budget_rule=keys", TREE + ":group_merge=nsa"])
@pytest.mark.parametrize("budget", [64, 96])
def test_device_search_decodes_like_the_host_search(spec, budget, static):
    """search=device (the batched forest, here on the CPU) vs search=host (one search per tree):
    the same attended tokens at every step and layer, the same greedy tokens and logits; a ragged
    batch of three sequences, 2 kv heads with groups of several query heads, insertions."""
    model, _ = shared_pair("qwen2")
    ids, mask, _ = left_padded([420, 260, 380], seed=7)
    outs = []
    for where in ("host", "device"):
        cache = kvdex.Cache(model, f"{spec}:search={where}", budget=budget, dense_layers=1)
        log = []
        cache.observer = lambda layer, q, store, aset, scale, log=log: log.append(
            (layer, aset.positions.clone(), aset.valid.clone())
        )
        out = greedy(model, ids, mask, cache, new=40)
        outs.append((out, log, cache.stats()["policy_stats"]))
        if where == "device":  # insertions reached the mirror through the worker-staged copies
            assert sum(f.staged_puts for f in cache.policy.tree_search.device.forests.values()) > 0
    (t1, l1), log1, s1 = outs[0]
    (t2, l2), log2, s2 = outs[1]
    assert torch.equal(t1, t2)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    assert len(log1) == len(log2)
    for (la, p1, v1), (lb, p2, v2) in zip(log1, log2, strict=True):
        assert la == lb
        for b in range(p1.shape[0]):
            for h in range(p1.shape[1]):
                a = torch.sort(p1[b, h][v1[b, h]]).values
                c = torch.sort(p2[b, h][v2[b, h]]).values
                assert torch.equal(a, c)
    assert s1["pages_selected"] == s2["pages_selected"] and s1["tokens_selected"] == s2["tokens_selected"]
    assert s1["inserts"] > 0


def test_device_search_with_semantic_offload_decodes_like_the_host_search(static):
    """Offloaded semantic pages (bulk loading reads the device selection back): same as the host search."""
    model, _ = shared_pair("qwen2")
    ids, mask, _ = left_padded([400, 300], seed=8)
    outs = []
    for where in ("host", "device"):
        cache = kvdex.Cache(model, f"icecache:search={where}", budget=64, dense_layers=1, offload=True)
        log = []
        cache.observer = lambda layer, q, store, aset, scale, log=log: log.append(_head_sets(aset))
        outs.append((greedy(model, ids, mask, cache, new=24), log))
    assert torch.equal(outs[0][0][0], outs[1][0][0])
    torch.testing.assert_close(outs[0][0][1], outs[1][0][1], atol=1e-5, rtol=0)
    assert outs[0][1] == outs[1][1]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_device_search_full_budget_equals_dense(offload, static):
    """Full budget: every key is attended, so search=device decodes like the full cache."""
    model, _ = shared_pair("llama_gqa")
    x = prompt(200, seed=2)
    ref = greedy(model, x, cache=kvdex.Cache(model, "full", budget=64, dense_layers=1), new=24)
    cache = kvdex.Cache(model, "icecache:search=device", budget=4096, dense_layers=1, offload=offload)
    out = greedy(model, x, cache=cache, new=24)
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=0)


def test_search_option_is_checked():
    with pytest.raises(ValueError, match="search"):
        make_policy("icecache", search="gpu")
    with pytest.raises(ValueError, match="graphs"):
        make_policy("icecache", graphs="maybe")
    assert make_policy("icecache", graphs="False").graphs is False  # text is typed, never truthy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [64, 256])
def test_cuda_forest_matches_cpu_forest_and_host_search(k):
    """The mirror on CUDA (pinned, non-blocking copies) equals the CPU mirror after insertions, and
    the CUDA search agrees with the per-tree host search up to near-ties (last-bit differences)."""
    trees = forest_of([3000, 2000, 2600])
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    fc, fd = DCIForest(trees, "cpu"), DCIForest(trees, "cuda")
    gq = torch.Generator().manual_seed(3)
    same = total = 0
    for step in range(3):
        trees = [t.insert(clustered(16, 32, 70 + step + i), torch.arange(16) + 9000 + 16 * step, gens[i])
                 for i, t in enumerate(trees)]  # fmt: skip
        fc, fd = fc.update(trees), fd.update(trees)
        for name in ("X", "proj", "pt_page", "page_pos", "page_fill", "root"):
            assert torch.equal(getattr(fc, name), getattr(fd, name).cpu()), name
        rows = (0, 1, 2)
        q = torch.randn(len(rows) * G, 32, generator=gq) * 3
        tq = torch.tensor(rows).repeat_interleave(G)
        ids, dot = fd.search(transform_queries(q).cuda(), tq.cuda(), rows, k, k, 0.8)
        ids, dot = ids.cpu(), dot.cpu()
        for j, r in enumerate(rows):
            hid, hdot = trees[r].search(transform_queries(q[j * G : (j + 1) * G]), k, 0, k, 0.8, collect_all=True)
            gid = ids[j * G : (j + 1) * G]
            loc = torch.where(gid >= 0, gid - r * fd.S, -1)
            for g in range(G):
                a, b = set(hid[g][hid[g] >= 0].tolist()), set(loc[g][loc[g] >= 0].tolist())
                same += a == b
                total += 1
                assert len(a & b) >= 0.9 * len(a)  # near-ties may swap a few keys, never most of them
    assert same >= 0.8 * total


def _head_sets(aset):
    pos, valid = aset.positions.flatten(0, 1).cpu(), aset.valid.flatten(0, 1).cpu()
    return [sorted(p[v].tolist()) for p, v in zip(pos, valid, strict=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_cuda_device_search_full_budget_equals_dense_and_tracks_host(offload):
    import copy

    model, _ = shared_pair("qwen2")
    model = copy.deepcopy(model).cuda()
    x = prompt(300, seed=4).cuda()
    ref = greedy(model, x, cache=kvdex.Cache(model, "full", budget=64, dense_layers=1), new=24)
    cache = kvdex.Cache(model, TREE, budget=4096, dense_layers=1, offload=offload)
    out = greedy(model, x, cache=cache, new=24)
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1], atol=1e-3, rtol=0)
    # sparse: each device selection vs the host page choice on the same trees and q (up to near-ties)
    cache = kvdex.Cache(model, TREE, budget=64, dense_layers=1, offload=offload, search="auto")
    pol, same = cache.policy, []
    assert pol.search == "auto"
    orig = pol.select

    def both(q, view):
        layer, scale = view.layer, view.scale
        sel = orig(q, view)
        tok, qc, H = sel.tokens.cpu(), q.float().cpu(), view.kv_heads
        G, saved = q.shape[1] // H, dict(pol._stats)
        for h in range(H):
            tree = pol.tree_jobs.trees[layer][h]
            if tree is not None and tree.n > pol.cfg.retrieval_tokens:
                qg = qc[0, h * G : (h + 1) * G]
                want = pol.tree_search.select_pages(tree, qg, pol.cfg.retrieval_tokens, scale=scale)
                same.append(set(want.tolist()) == set(tok[0, h][tok[0, h] >= 0].tolist()))
        pol._stats.clear()
        pol._stats.update(saved)  # in place: the components count into the same dict
        return sel

    pol.select = both
    greedy(model, x, cache=cache, new=24)
    assert pol.tree_search.device.forests  # auto on CUDA = the device search
    assert len(same) > 20 and sum(same) >= 0.8 * len(same)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_cuda_graphs_select_exactly_what_the_eager_device_search_selects(offload):
    """``graphs=True``: the captured search replays the same kernels on the same arrays, so the
    selections equal the eager device search's bit for bit; insertions force re-captures."""
    import copy

    model, _ = shared_pair("qwen2")
    model = copy.deepcopy(model).cuda()
    ids, mask, _ = left_padded([420, 260], seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    logs, stats = [], []
    for spec in ("icecache:search=device:graphs=False", "icecache:search=device:graphs=True"):
        cache = kvdex.Cache(model, spec, budget=64, dense_layers=1, offload=offload)
        log = []
        cache.observer = lambda layer, q, store, aset, scale, log=log: log.append(_head_sets(aset))
        out = greedy(model, ids, mask, cache, new=40)
        logs.append((out, log))
        stats.append(cache.stats()["policy_stats"])
    assert "graph_error" not in stats[1], stats[1].get("graph_error")
    assert stats[1]["graph_captures"] > 1 and stats[1]["graph_replays"] > stats[1]["graph_captures"]
    (t1, _), log1 = logs[0]
    (t2, _), log2 = logs[1]
    assert torch.equal(t1, t2)
    assert log1 == log2


# ---- CUDA graphs' contract, checked on the CPU ----------------------------------------------------------


class GraphStandIn:
    """What a CUDA graph does, on the CPU: the capture records the aten ops of the captured region;
    a replay runs them again on the *same tensors* (a graph re-launches the same kernels on the same
    addresses, whatever is stored there now) and writes the results into the captured outputs.

    The tensors the region reads from outside the capture (other than the static input) are held
    only weakly, and a replay fails when one of them was freed (on CUDA the graph would read memory
    the allocator has handed to someone else), moved (storage, size, stride, offset) or changed its
    values (the capture is stale: a re-capture was due). Data-dependent shapes fail too (the replay's
    results do not fit the captured outputs)."""

    def __init__(self, static_q: torch.Tensor):
        self.static = static_q
        self.ops: list = []
        self.inside: set[int] = set()  # ids of the tensors produced inside the capture (held by self.ops)
        self.outside: dict[int, tuple] = {}  # id -> (weakref, storage ptr, size, stride, offset, values)
        self.replays = 0
        self._mode = None

    def capture_begin(self, **_):
        stand_in = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                stand_in._record(func, args, kwargs or {}, out)
                return out

        self._mode = Record()
        self._mode.__enter__()

    def capture_end(self):
        self._mode.__exit__(None, None, None)

    def _record(self, func, args, kwargs, out):
        flat, spec = tree_flatten((args, kwargs))
        slots = []
        for x in flat:
            if not isinstance(x, torch.Tensor):
                slots.append(("value", x))
            elif id(x) in self.inside or x is self.static or func is torch.ops.aten.lift_fresh.default:
                slots.append(("value", x))  # produced in the capture, the static input, or a constant
            else:
                if id(x) not in self.outside:
                    meta = (x.untyped_storage().data_ptr(), x.shape, x.stride(), x.storage_offset())
                    self.outside[id(x)] = (weakref.ref(x), *meta, x.clone())
                slots.append(("outside", id(x)))
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                self.inside.add(id(o))
        self.ops.append((func, slots, spec, out))

    def replay(self):
        for ref, ptr, size, stride, off, values in self.outside.values():
            x = ref()
            assert x is not None, "the captured graph reads a tensor freed since the capture (stale pointer)"
            assert (x.untyped_storage().data_ptr(), x.shape, x.stride(), x.storage_offset()) == (ptr, size, stride, off)
            assert torch.equal(x, values), "a tensor the captured graph reads changed since the capture (stale graph)"
        for func, slots, spec, out in self.ops:
            flat = [self.outside[v][0]() if kind == "outside" else v for kind, v in slots]
            args, kwargs = tree_unflatten(flat, spec)
            res = func(*args, **kwargs)
            for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0], strict=True):
                if isinstance(o, torch.Tensor) and not (o.shape == r.shape and o.data_ptr() == r.data_ptr()):
                    o.copy_(r)  # (views of captured tensors already hold the result)
        self.replays += 1


def test_graph_stand_in_catches_freed_and_changed_inputs():
    """The checker itself: a region that reads a temporary freed after the capture, or an array
    changed in place without a re-capture, fails at replay; a well-kept one replays exactly."""
    kept = torch.arange(10.0)

    def region(q, tmp):
        return (q[:, None] * kept[tmp]).sum(0)

    q = torch.ones(3)
    g = GraphStandIn(q)
    tmp = torch.tensor([1, 2, 3])
    g.capture_begin()
    out = region(q, tmp)
    g.capture_end()
    q.copy_(torch.full((3,), 2.0))
    g.replay()
    assert torch.equal(out, 2 * torch.tensor([3.0, 6.0, 9.0]))
    kept.add_(1)
    with pytest.raises(AssertionError, match="changed since the capture"):
        g.replay()
    kept.sub_(1)
    del tmp
    with pytest.raises(AssertionError, match="freed since the capture"):
        g.replay()


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_graphs_replay_only_tensors_the_policy_keeps(offload, monkeypatch):
    """``graphs=True`` on the CPU through :class:`GraphStandIn` (static shapes, as on CUDA): every
    tensor a captured search reads stays alive, in place and unchanged until its replays (the
    session-5 H200 crash: a per-step index tensor read by the graph was freed after the capture),
    insertions force re-captures, and the selections equal the eager device search's."""
    monkeypatch.setattr(forest_mod, "STATIC_ON_CPU", True)
    monkeypatch.setattr(graphs_mod, "STAND_IN", GraphStandIn)
    model, _ = shared_pair("qwen2")
    ids, mask, _ = left_padded([420, 260], seed=5)
    logs, stats = [], []
    for spec in ("icecache:search=device:graphs=False", "icecache:search=device:graphs=True"):
        cache = kvdex.Cache(model, spec, budget=64, dense_layers=1, offload=offload)
        log = []
        cache.observer = lambda layer, q, store, aset, scale, log=log: log.append(_head_sets(aset))
        logs.append((greedy(model, ids, mask, cache, new=24), log))
        stats.append(cache.stats()["policy_stats"])
    assert "graph_error" not in stats[1], stats[1].get("graph_error")
    assert stats[1]["graph_captures"] > 1 and stats[1]["graph_replays"] > stats[1]["graph_captures"]
    assert stats[0]["graph_replays"] == 0
    (t1, l1), log1 = logs[0]
    (t2, l2), log2 = logs[1]
    assert torch.equal(t1, t2)
    torch.testing.assert_close(l1, l2, atol=0, rtol=0)
    assert log1 == log2


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_tree_first_built_during_decode_is_mirrored_whole(offload, static, monkeypatch):
    """A left-padded batch whose shortest sequence has no middle page at prefill: its trees are first
    built by a decode-time index job, after the layer's other trees exist (``base`` is set), and the
    device search stages them for the mirror from point 0 (session-6 H200 failure: ``n0`` was unbound
    there, UnboundLocalError on the index worker). search=device decodes like search=host (same
    attended tokens at every step and layer), the short sequence decodes as it does alone, and the
    mirror of the layer equals a fresh mirror of its trees. The static variant also captures the
    search as a (stand-in) CUDA graph, as on the H200 (static shapes, graphs=True)."""
    if static:
        monkeypatch.setattr(graphs_mod, "STAND_IN", GraphStandIn)
    model, _ = shared_pair("llama_gqa")
    lengths = [150, 97, 40]  # the H200 test's batch; 40 < sink + window + 1 page: no middle page at prefill
    ids, mask, prompts = left_padded(lengths, seed=2)
    width, short, new = ids.shape[1], 2, 24
    outs = []
    for where in ("host", "device"):
        cache = kvdex.Cache(model, f"icecache:search={where}", budget=96, dense_layers=1, offload=offload)
        pol, log, built_late = cache.policy, [], []
        heads = model.config.num_key_value_heads
        cache.observer = lambda layer, q, store, aset, scale, log=log: log.append((layer, _head_sets(aset)))
        job = pol.tree_jobs.index_job

        def spy(layer, keys, ready, per_b, prev, base, h, job=job, pol=pol, built_late=built_late):
            trees, placements, staged = job(layer, keys, ready, per_b, prev, base, h)
            if base is not None or prev is not None:  # a decode-time job: which trees did it create?
                before = prev.result()[0] if prev is not None else base
                late = [t for t, tree in enumerate(trees) if tree is not None and before[t] is None]
                if pol.search == "device":  # staged for the mirror from its first point: the whole tree
                    assert all(staged[t]["tree"] is trees[t] and staged[t]["n_from"] == 0 for t in late)
                built_late += [(layer, t) for t in late]
            return trees, placements, staged

        pol.tree_jobs.index_job = spy
        outs.append((greedy(model, ids, mask, cache, new=new), log))
        # the case under test happened: the short sequence's trees were built after the prefill's
        assert {t // heads for _, t in built_late} == {short}, built_late
        if where == "device":
            st = cache.stats()["policy_stats"]
            assert "graph_error" not in st, st.get("graph_error")
            assert (st["graph_captures"] > 1) == static  # graphs run only with static shapes on the CPU
            pol.flush()
            assert pol.tree_search.device.forests  # the searches ran on the mirror
            for layer, forest in pol.tree_search.device.forests.items():
                trees = pol.tree_jobs.trees[layer]
                assert all(t is not None for t in trees)
                forest = forest.update(trees, pol.tree_search.device.staged.get(layer))
                fresh = DCIForest(trees, "cpu", capacity=(forest.S, forest.Pc), static_shapes=forest.static)
                for name in ("X", "proj", "dirs", "pt_page", "page_pos", "page_fill", "c", "root", "starts_at"):
                    assert torch.equal(getattr(forest, name), getattr(fresh, name)), (layer, name)
                for lev in range(forest.L - 1):
                    for name in ("kids", "kid_start", "kid_count"):
                        assert torch.equal(getattr(forest, name)[lev], getattr(fresh, name)[lev]), (layer, name, lev)
    ((t_host, l_host), log_host), ((t_dev, l_dev), log_dev) = outs
    assert torch.equal(t_host, t_dev)
    torch.testing.assert_close(l_host, l_dev, atol=1e-5, rtol=0)
    assert log_host == log_dev
    alone = kvdex.Cache(model, "icecache:search=device", budget=96, dense_layers=1, offload=offload)
    t1, l1 = greedy(model, prompts[short][None], None, alone, new=new)
    assert torch.equal(t_dev[short, width:], t1[0, lengths[short] :])
    torch.testing.assert_close(l_dev[:, short], l1[:, 0], atol=1e-4, rtol=0)
