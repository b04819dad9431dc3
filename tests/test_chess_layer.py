"""``chess:scope=layer``: every sparse layer scores its own slice of the Grid -> Chunk -> Page hierarchy
per kv head (with the decode step's queries, or its window anchor); a covering budget is dense
attention, a planted page is found in its own (layer, kv head), the first decode step builds from its
own queries, rebuilds follow the trigger, static sizing selects what dynamic sizing selects, and no
score crosses tensor-parallel ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import greedy, left_padded, prompt, shared_pair

import kvdex
from kvdex import cache_kwargs
from kvdex.policies.base import PolicyInfo
from kvdex.policies.chess.layer_scope import unit_scores
from kvdex.storage import Grid, MiddleUpdate
from kvdex.view import LayerView

LAYER_Q = "chess:anchor_from=query:scope=layer"


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize(
    "opts",
    [
        "trigger=always",
        "trigger=uncertainty",
        "rho_g=1.0:rho_c=1.0:rho_p=1.0:trigger=always",
        "group=sum",
        "rerank=4:rerank_unit=page:rerank_group=weight:rerank_share=0.25",
        "units=digest:trigger=always",
        "units=digest:rerank=4:rerank_unit=page:rerank_group=weight:rerank_share=0.25",
        "refine=digest",
        "refine=exact",
    ],  # fmt: skip
)
def test_covering_budget_is_dense(family, opts, offload):
    """A budget above the context (budget mode, whatever the trigger: the covering selection takes
    every page that joins the middle) or every ratio 1 rebuilt every step: the output equals SDPA."""
    model, ref = shared_pair(family)
    ids = prompt(300, 5)
    tok_ref, logit_ref = greedy(ref, ids, new=40)
    cache = kvdex.Cache(model, f"{LAYER_Q}:{opts}", 4096, offload=offload, dense_layers=1)
    tok, logit = greedy(model, ids, cache=cache, new=40)
    torch.testing.assert_close(logit, logit_ref, atol=1e-4, rtol=0)
    assert torch.equal(tok, tok_ref)
    st = cache.stats()["policy_stats"]
    assert st["scope"] == "layer" and st["builds"] == 1 and st["query_builds"] >= 1


@pytest.mark.parametrize("opts", ["trigger=always", "trigger=interval:interval=8", "preset=aggressive:trigger=always"])
def test_batch_each_sequence_selects_for_itself(opts):
    """A left-padded ragged batch decodes and selects, per layer and kv head, as each prompt alone."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, prompts = left_padded([300, 180, 240], seed=12)
    spec = f"{LAYER_Q}:{opts}"
    cache = kvdex.Cache(model, spec, 112, dense_layers=1)
    tokens, logits = greedy(model, ids, mask, cache, new=30)
    width = ids.shape[1]
    for i, p in enumerate(prompts):
        alone = kvdex.Cache(model, spec, 112, dense_layers=1)
        t1, l1 = greedy(model, p[None], None, alone, new=30)
        assert torch.equal(tokens[i, width:], t1[0, len(p) :]), f"sequence {i} differs in the batch"
        torch.testing.assert_close(logits[:, i], l1[:, 0], atol=1e-4, rtol=0)
        for lay, sel in cache.policy.layer_scope.pages.items():
            one = alone.policy.layer_scope.pages[lay][0]
            for h in range(sel.shape[1]):
                assert sorted(x for x in sel[i, h].tolist() if x >= 0) == sorted(x for x in one[h].tolist() if x >= 0)


def test_window_anchor_in_layer_scope_is_dense_at_full_budget(llama):
    model, ref = llama
    ids = prompt(260, 4)
    tok_ref, logit_ref = greedy(ref, ids, new=30)
    cache = kvdex.Cache(model, "chess:anchor_from=window:scope=layer", 4096, dense_layers=1)
    tok, logit = greedy(model, ids, cache=cache, new=30)
    torch.testing.assert_close(logit, logit_ref, atol=1e-4, rtol=0)
    assert cache.stats()["policy_stats"]["query_builds"] == 0


def _planted_keys(kv_heads=2, group=3, pages=48, d=16, page=8, seed=0):
    """Synthetic keys of sparse layers 1 and 2: noise everywhere, and in layer ``l`` and kv head
    ``plant[l][0]`` one page ``plant[l][1]`` whose keys point along that head's (mean) query."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kv_heads * group, d, generator=g)
    plant = {1: (0, 37), 2: (1, 5)}  # layer -> (kv head, page)
    keys = {}
    for layer, (h, j) in plant.items():
        k = 0.05 * torch.randn(1, kv_heads, pages, page, d, generator=g)
        u = q[0, h * group : (h + 1) * group].mean(0)
        k[0, h, j] += 3.0 * u / u.norm()  # the largest q.k of that (layer, head), for every query head of the group
        keys[layer] = k
    return q, keys, plant


def _bind(keys, heads=slice(None), group=3, tp=None, spec=LAYER_Q + ":trigger=never:rerank=0"):
    """A policy bound to layers (1, 2) holding ``keys`` (the kv heads ``heads``), a rebuild requested."""
    k0 = keys[1][:, heads]
    kv, pages, page, d = k0.shape[1], k0.shape[2], k0.shape[3], k0.shape[4]
    cfg = kvdex.CacheConfig(budget=8 + 16 + 2 * page, page_size=page, sink=8, window=16)  # K = 2 pages
    pol = kvdex.make_policy(spec)
    pol.bind(PolicyInfo(cfg, 3, (1, 2), kv * group, kv, d, tp=tp))
    for layer, k in keys.items():
        pol.index(layer, MiddleUpdate(torch.zeros(1, dtype=torch.long), torch.tensor([pages]), k[:, heads]))
        grid, length = Grid(cfg.sink, page, cfg.window_pages), torch.tensor([cfg.sink + pages * page + cfg.window])
        pol._stores[layer] = SimpleNamespace(batch=1, kv_heads=kv, device=torch.device("cpu"), static=False,
                                             grid=grid, lengths=length, lengths_host=length)  # fmt: skip
    pol._batch = 1
    if pol.layer_scope is not None:
        pol.layer_scope.request(torch.ones(1, dtype=torch.bool))
    return pol


@pytest.mark.parametrize("group", ["max", "sum", "mean"])
def test_planted_page_is_selected_by_its_layer_and_head(group):
    q, keys, plant = _planted_keys()
    pol = _bind(keys, spec=f"{LAYER_Q}:trigger=never:group={group}")
    for layer, (h, j) in plant.items():
        sel = pol.select(q, LayerView.of(layer, pol._stores[layer], 1.0, pol.cfg)).pages  # [1, H, K]
        assert sel.shape[1] == 2 and int((sel[0, h] >= 0).sum()) == pol.cfg.retrieval_pages == 2
        assert j in sel[0, h].tolist(), f"layer {layer} head {h} misses its planted page {j}"
        assert j not in sel[0, 1 - h].tolist()  # the other head scores its own (noise) keys
    a, b = (pol.layer_scope.pages[lay] for lay in plant)
    assert not torch.equal(a, b), "each layer keeps its own selection"


def test_layer_scores_reduce_the_group():
    units = torch.randn(2, 7, 2 * 4)
    q = torch.randn(2, 6, 4)
    per_head = torch.einsum("bnhd,bhgd->bhgn", units.view(2, 7, 2, 4), q.view(2, 2, 3, 4))
    torch.testing.assert_close(unit_scores(units, q, 2, "max"), per_head.amax(2))
    torch.testing.assert_close(unit_scores(units, q, 2, "sum"), per_head.sum(2))
    # mean of the scores == the score of the mean query (the shared scope's per-kv-head query)
    torch.testing.assert_close(
        unit_scores(units, q, 2, "mean"), unit_scores(units, q.view(2, 2, 3, 4).mean(2), 2, "max")
    )


def test_first_decode_step_builds_from_its_own_queries(llama):
    """No selection exists after the prefill; the first decode step's select scores each layer's
    pages with that step's queries. Flat hierarchy (one page per chunk and grid): exactly the top-K
    pages per kv head of max over the group of q . mean key."""
    model, _ = llama
    cache = kvdex.Cache(model, f"{LAYER_Q}:chunk_pages=1:grid_chunks=1:trigger=never:rerank=0", 96, dense_layers=0)
    with torch.no_grad():
        model(input_ids=prompt(400, 5), **cache_kwargs(cache), use_cache=True)
    pol = cache.policy
    assert pol.layer_scope.pages == {} and pol.layer_scope.pending is not None
    seen = {}
    real = pol.select

    def spy(q, view):
        vp = pol.hierarchy.views()[2]  # before the build: the index is what the build reads
        seen[view.layer] = (q.clone(), vp.clone(), int(pol.hierarchy.npages[pol.hierarchy.slot[view.layer]][0]))
        return real(q, view)

    pol.select = spy
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[7]]), **cache_kwargs(cache), use_cache=True)
    pol.on_step(1, out.logits[:, -1])
    k = pol.cfg.retrieval_pages
    h, d = pol.info.kv_heads, pol.info.head_dim
    for layer, (q, vp, n) in seen.items():
        s = pol.hierarchy.slot[layer]
        v = vp[0, :n, s * h * d : (s + 1) * h * d].double().view(n, h, d)
        score = torch.einsum("nhd,hgd->hgn", v, q[0].double().view(h, -1, d)).amax(1)  # [H, n]
        want = torch.sort(torch.topk(score, k, dim=1).indices, dim=1).values
        assert torch.equal(pol.layer_scope.pages[layer][0].cpu(), want), f"layer {layer}"
    assert pol.query_builds == 1 and pol.layer_scope.pending is None
    assert len({tuple(pol.layer_scope.pages[lay].flatten().tolist()) for lay in seen}) > 1


def test_selection_is_reused_between_rebuilds_and_rebuilt_on_request(llama):
    model, _ = llama
    cache = kvdex.Cache(model, f"{LAYER_Q}:trigger=interval:interval=6", 96, dense_layers=1)
    pol = cache.policy
    snaps = []
    real = pol.on_step

    def spy(step, logits):
        real(step, logits)
        snaps.append((step, {lay: x.clone() for lay, x in pol.layer_scope.pages.items()}, pol.query_builds))

    pol.on_step = spy
    greedy(model, prompt(400, 3), cache=cache, new=20)
    by_step = {s: (p, n) for s, p, n in snaps}
    assert [s for s, _ in pol.rebuild_log] == [6, 12, 18]
    # steps 1..6 serve the first step's selection; the rebuild requested after step 6 is done by step 7
    for s in range(2, 7):
        assert all(torch.equal(by_step[s][0][lay], by_step[1][0][lay]) for lay in by_step[1][0])
    assert [by_step[s][1] for s in (1, 6, 7, 12, 13)] == [1, 1, 2, 2, 3]


def test_no_all_reduce_and_heads_select_independently():
    """Under tensor parallelism a rank holds whole kv heads: the layer scope never all-reduces, and a
    rank's selection (its heads' keys and queries only) equals the matching heads of one process."""

    class NoReduce:
        def all_reduce(self, x):
            raise AssertionError("scope=layer must not all-reduce")

    q, keys, plant = _planted_keys()
    whole = _bind(keys)
    want = {lay: whole.select(q, LayerView.of(lay, whole._stores[lay], 1.0, whole.cfg)).pages for lay in plant}
    for h in range(2):  # "rank" h holds kv head h and its 3 query heads
        rank = _bind(keys, heads=slice(h, h + 1), tp=NoReduce())
        for lay in plant:
            got = rank.select(q[:, 3 * h : 3 * h + 3], LayerView.of(lay, rank._stores[lay], 1.0, rank.cfg)).pages
            assert torch.equal(got[0, 0], want[lay][0, h])
    # the shared scope all-reduces its scores (the check above would catch a layer-scope call)
    shared = _bind(keys, tp=NoReduce(), spec="chess:anchor_from=window:trigger=never:scope=shared")
    with pytest.raises(AssertionError, match="must not all-reduce"):
        shared.hierarchy.scores(torch.zeros(1, shared.dim), 48)


@pytest.mark.parametrize(
    "opts,pattern",
    [
        (dict(scope="per-head"), "scope must be one of shared, layer"),
        (dict(group="min", scope="layer", anchor_from="query"), "group must be one of max, sum, mean"),
        (
            dict(group="sum", scope="layer", anchor_from="window"),
            "group='sum' .* needs scope='layer' and anchor_from='query'",
        ),
        (dict(group="sum", anchor_from="query", scope="shared"), "needs scope='layer'"),
        (dict(units="max"), "units must be one of mean, digest"),
        (dict(units="digest", scope="shared"), "units='digest' .* needs scope='layer' and anchor_from='query'"),
        (dict(units="digest", anchor_from="window"), "units='digest' .* needs scope='layer' and anchor_from="),
        (dict(units="digest", group="sum"), "units='digest' reduces .* by their max .*: drop group='sum'"),
        (dict(refine="topk"), "refine must be one of none, digest, exact"),
        (dict(refine="exact", rerank=0), "refine='exact' picks among .* needs rerank >= 1 and rerank_unit='page'"),
        (dict(refine="digest", units="mean", rerank=4, rerank_unit="page"), "refine='digest' .* needs units='digest'"),
    ],
)
def test_bad_layer_options(opts, pattern):
    with pytest.raises(ValueError, match=pattern):
        kvdex.make_policy("chess", **opts)


# ---- CUDA-graph decoding: the contract of tests/test_graph.py for the layer scope --------------------

GRAPH_SPECS = [
    f"{LAYER_Q}:trigger=interval:interval=5",
    f"{LAYER_Q}:units=digest:trigger=interval:interval=5",
    f"{LAYER_Q}:refine=digest:trigger=interval:interval=5",
    f"{LAYER_Q}:refine=exact:trigger=interval:interval=5",
    f"{LAYER_Q}:trigger=uncertainty:check_every=4:entropy_threshold=0.0:varentropy_threshold=0.0",
    f"{LAYER_Q}:trigger=always",
    f"{LAYER_Q}:preset=moderate:trigger=interval:interval=7",
    "chess:anchor_from=window:scope=layer:trigger=interval:interval=5",
]


@pytest.fixture(scope="module")
def tiny():
    from kvdex.bench import shapes

    return shapes.build_model("tiny", torch.float32, "cpu")


@pytest.mark.parametrize("spec", GRAPH_SPECS)
def test_static_selection_equals_dynamic(tiny, spec):
    """Static sizing (what a captured step runs) selects exactly what dynamic sizing selects, over 60
    steps with page boundaries and rebuilds; a rebuild step is eager (graph_key None)."""
    from test_graph import static_matches_dynamic

    c_dyn, _ = static_matches_dynamic(tiny, spec)
    assert c_dyn.policy.rebuilds > 0


@pytest.mark.parametrize("spec", [s for s in GRAPH_SPECS if "always" not in s])
def test_replayable_steps_issue_identical_device_work(tiny, spec):
    from test_graph import _replay_contract

    replayable, keys, problems = _replay_contract(tiny, spec)
    assert not problems, problems[:5]
    assert replayable >= 30, f"only {replayable} of 60 steps replayable"
    assert keys <= 12, f"{keys} graph keys in 60 steps: too many captures"


def test_rebuild_steps_are_eager(tiny):
    """trigger=always rebuilds inside every select: no step is replayed (graph_key is None)."""
    from test_graph import _replay_contract

    replayable, _, problems = _replay_contract(tiny, f"{LAYER_Q}:trigger=always")
    assert replayable == 0 and not problems


@pytest.mark.parametrize("storage", ["device", "offload"])
@pytest.mark.parametrize(
    "spec",
    [f"{LAYER_Q}:trigger=interval:interval=5", f"{LAYER_Q}:check_every=4", f"{LAYER_Q}:units=digest:check_every=4",
     f"{LAYER_Q}:refine=digest:check_every=4", f"{LAYER_Q}:refine=exact:trigger=interval:interval=5"],  # fmt: skip
)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decoding_matches_eager_on_gpu(spec, storage):
    """Captured CUDA-graph steps (between rebuilds) decode exactly as eager steps."""
    from kvdex.bench import runner, shapes

    model = shapes.build_model("tiny", torch.float32, "cuda")
    cfg = runner.BenchConfig(shape="tiny", dtype="float32", device="cuda", budget=80, check_context=150,
                             dense_layers=1, storages=(storage,))  # fmt: skip
    res = runner.check_graph(model, cfg, [f"{spec}/{storage}+graph"], steps=40)
    assert res[0]["ok"], res
    c = res[0]["counts"]
    assert c["replays"] >= 20 and c["captures"] >= 1, c


PAGE_UNIT = "rerank=4:rerank_unit=page:rerank_group=weight:rerank_share=1.0"


def _attended(model, ids, mask, spec):
    """(the cache, per sparse layer and decode step the attended positions per sequence and kv head, as sets)
    of ``spec`` decoding ``ids`` greedily for 6 tokens at budget 112."""
    cache = kvdex.Cache(model, spec, 112, dense_layers=1)
    seen = []

    def observer(layer, q, store, aset, scale):
        seen.append([[set(r[v].tolist()) for r, v in zip(p, w, strict=True)]
                     for p, w in zip(aset.positions, aset.valid, strict=True)])  # fmt: skip

    cache.observer = observer
    greedy(model, ids, mask, cache=cache, new=6)
    return cache, seen


def _assert_kept_between_rebuilds(seen, layers):
    """Each step attends the middle positions (below 200) the same layer attended one step before."""
    for i in range(layers, len(seen)):
        before, now = seen[i - layers], seen[i]
        for b, heads in enumerate(now):
            for h, slots in enumerate(heads):
                assert {x for x in before[b][h] if x < 200} == {x for x in slots if x < 200}


def test_page_unit_build_picks_the_candidates_best_pages():
    """``rerank_unit=page`` (kvdex option): a build takes the hierarchy's candidates (with the share 1.0 and a
    flat hierarchy, every middle page) and attends their best pages by the keys' exact softmax weights, as
    Quest's page unit does over every page: the first decode step attends the same tokens in every (layer,
    kv head); between rebuilds the layer keeps them."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([300, 230], seed=4)
    attended = {}
    for spec in (f"{LAYER_Q}:chunk_pages=1:grid_chunks=1:trigger=never:{PAGE_UNIT}", f"quest:{PAGE_UNIT}"):
        cache, attended[spec.split(":")[0]] = _attended(model, ids, mask, spec)
        assert cache.policy.granularity == "page"
    chess, quest = attended["chess"], attended["quest"]
    layers = len(cache.policy.info.sparse_layers)
    assert len(chess) == len(quest) == 5 * layers  # 5 decode steps (the first token comes from the prefill)
    assert chess[:layers] == quest[:layers]  # the first decode step: the same pages
    _assert_kept_between_rebuilds(chess, layers)  # trigger=never: the middle's pages do not move


def test_digest_units_flat_hierarchy_attends_arkvales_pages():
    """``units=digest`` (kvdex option): with one page per chunk and grid the hierarchy is the pages, scored by
    ArkVale's digests (the group's max): the first decode step attends exactly ``arkvale``'s pages in every
    (layer, kv head), and with the page unit exactly ``arkvale``'s page unit's; between rebuilds the layer keeps
    them."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([300, 230], seed=4)
    flat = f"{LAYER_Q}:units=digest:chunk_pages=1:grid_chunks=1:trigger=never"
    for extra in ("", f":{PAGE_UNIT}"):
        attended = {}
        for spec in (flat + extra, "arkvale" + extra):
            cache, attended[spec.split(":")[0]] = _attended(model, ids, mask, spec)
            if spec.startswith("chess"):  # the digests are its index: no mean-key hierarchy is kept
                assert cache.policy.hierarchy.vall is None and cache.policy.digests is not None
        chess, ark = attended["chess"], attended["arkvale"]
        layers = len(cache.policy.info.sparse_layers)
        assert chess[:layers] == ark[:layers], extra  # the first decode step: the same pages
        _assert_kept_between_rebuilds(chess, layers)  # trigger=never


@pytest.mark.parametrize("refine,other", [("digest", "arkvale"), ("exact", f"quest:{PAGE_UNIT}")])
def test_refine_picks_each_steps_best_candidates(refine, other):
    """``refine`` (kvdex option): a build keeps its candidates (here, with the share 1.0 and a flat hierarchy,
    every middle page) and every decode step picks their best pages for its own queries: by the digests
    (``arkvale``'s pages, which it scores every step) or by the keys' exact softmax weights (``quest``'s page
    unit over every page). Never rebuilt, unlike the default (the pages kept since the build), it follows them
    at every step."""
    model, _ = shared_pair("llama_gqa")
    ids, mask, _ = left_padded([300, 230], seed=4)
    spec = f"{LAYER_Q}:units=digest:chunk_pages=1:grid_chunks=1:trigger=never:{PAGE_UNIT}"
    cache, got = _attended(model, ids, mask, f"{spec}:refine={refine}")
    _, want = _attended(model, ids, mask, other)
    _, kept = _attended(model, ids, mask, spec)
    assert cache.policy.rebuilds == 0
    assert got == want
    assert got != kept  # the default keeps the build's pages: some later step differs


def test_max_levels_bound_their_pages():
    """A chunk's score is the max of its pages' (a partial last chunk: of the pages it has), a grid's the max
    of its chunks'."""
    from kvdex.policies.chess.levels import max_levels

    s_p = torch.tensor([[[1.0, 5.0, 2.0, -3.0, 4.0, 0.5, 7.0]]])  # [1, 1, 7]
    s_g, s_c = max_levels(s_p, nc=2, ng=3)
    assert s_c.tolist() == [[[5.0, 2.0, 4.0, 7.0]]]
    assert s_g.tolist() == [[[5.0, 7.0]]]


def test_default_selection_and_the_plain_one():
    """``chess`` alone is kvdex's selection (digest units, a quarter of the middle's pages as candidates, their
    best pages by exact weight); naming any selection option starts the others from the plain one (mean units,
    no rerank), and so do the paper's mode and ratio mode, where kvdex's selection does not apply."""
    from kvdex.policies.chess import DEFAULT_SELECTION, PLAIN_SELECTION

    keys = list(DEFAULT_SELECTION)

    def sel(spec):
        pol = kvdex.make_policy(spec)
        return {k: getattr(pol, k) for k in keys}

    assert sel("chess") == DEFAULT_SELECTION == sel("chess:trigger=never:chunk_pages=1")
    spelled = ":".join(f"{k}={v}" for k, v in DEFAULT_SELECTION.items())
    assert sel(f"chess:{spelled}") == DEFAULT_SELECTION
    assert sel("chess:rerank=0") == PLAIN_SELECTION
    assert sel("chess:units=digest") == {**PLAIN_SELECTION, "units": "digest"}
    for spec in ("chess:anchor_from=window:scope=shared", "chess:scope=shared", "chess:anchor_from=window",
                 "chess:preset=moderate", "chess:rho_g=0.5:rho_c=0.5:rho_p=0.5"):  # fmt: skip
        assert sel(spec) == PLAIN_SELECTION, spec
