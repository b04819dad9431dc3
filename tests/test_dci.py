"""The DCI-tree of IceCache (kvdex/index/dci.py): transform, exactness, promotion, pages, insertion."""

from __future__ import annotations

import pytest
import torch

from kvdex.index import DCIParams, DCITree, transform_keys, transform_queries

EXHAUSTIVE = dict(construction_prop=1.0, construction_fov=10**6)  # every candidate gets its true distance
U32 = 2.0**-24  # float32 unit roundoff


def gamma(k: int) -> float:
    """|fl(x.y) - x.y| <= gamma(k) sum |x_i y_i| for a float32 inner product of k terms, in any summation order
    (any matmul kernel, blocked or fused)."""
    return k * U32 / (1 - k * U32)


def nearest_within_rounding(x: torch.Tensor, pts: torch.Tensor, Y: torch.Tensor, got: torch.Tensor) -> int:
    """Assert that ``got`` [Q] (ids into ``pts``, sorted) is, for every transformed vector x [Q, d+1], the point of
    ``pts`` (vectors Y [P, d+1]) nearest to it: exactly (float64 distances), except where float32 rounding cannot
    tell two points apart. The tree takes the largest float32 inner product of (near) unit vectors; taking p over
    the nearest y costs at most ``tol = max |y|^2 - min |y|^2 + 4 gamma(d+1) max |x| max |y|`` in squared distance
    (the norms of float32 unit vectors spread by a few ulps). Returns the number of ambiguous rows (several points
    within tol of the nearest), asserted to be few, so that nearly every row is checked exactly."""
    x, y = x.double(), Y.double()
    d2 = torch.cdist(x, y).square()
    n2 = y.square().sum(1)
    tol = float(n2.max() - n2.min()) + 4 * gamma(x.shape[1]) * float(x.norm(dim=1).max() * y.norm(dim=1).max())
    best = d2.min(1).values
    at = torch.searchsorted(pts, got)
    assert bool((at < pts.numel()).all()) and torch.equal(pts[at.clamp(max=pts.numel() - 1)], got), "not in the set"
    nearest = pts[d2.argmin(1)]
    ok = (got == nearest) | (d2.gather(1, at[:, None])[:, 0] <= best + tol)
    assert bool(ok.all()), (got[~ok], nearest[~ok], tol)
    ambiguous = int(((d2 <= best[:, None] + tol).sum(1) > 1).sum())
    assert ambiguous <= max(1, x.shape[0] // 100), f"{ambiguous} of {x.shape[0]} rows tie within {tol}"
    return ambiguous


def topk_within_rounding(ids: torch.Tensor, q: torch.Tensor, k: torch.Tensor, c: float) -> None:
    """Assert that the tree's top-k ``ids`` [Q, kk] of queries q [Q, d] among keys k [N, d] are the exact top-k by
    inner product, rank by rank (float64), except where two keys' inner products tie within float32 rounding: the
    tree compares the float32 inner products of the transformed vectors (q/|q| and k/c, rounded per coordinate),
    off by at most ``(gamma(d+1) + 4u) c |q|`` each on the scale of q.k."""
    ip = q.double() @ k.double().T
    want = torch.topk(ip, ids.shape[1], dim=1).indices
    tol = 2 * (gamma(k.shape[1] + 1) + 4 * U32) * c * q.double().norm(dim=1, keepdim=True)
    assert bool((ids >= 0).all()) and all(len(set(r.tolist())) == ids.shape[1] for r in ids)
    ok = (ids == want) | ((ip.gather(1, ids) - ip.gather(1, want)).abs() <= tol)
    assert bool(ok.all()), (ids, want)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)  # queries below use the global generator: same draws whatever the test order


def keys_of(n: int, d: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * (0.2 + 3 * torch.rand(n, 1, generator=g))  # varied norms


def test_transform_makes_nearest_neighbour_order_equal_inner_product_order():
    k = keys_of(500, 16)
    q = torch.randn(20, 16) * 7
    c = float(k.norm(dim=-1).max()) * 1.1
    tk, clamped = transform_keys(k, c)
    tq = transform_queries(q)
    assert clamped == 0
    torch.testing.assert_close(tk.norm(dim=-1), torch.ones(500))
    torch.testing.assert_close(tq.norm(dim=-1), torch.ones(20))
    dist = torch.cdist(tq.double(), tk.double())
    ip = q.double() @ k.double().T
    # the same order, rank by rank, but for keys whose inner products tie within the transform's float32 rounding
    by_dist, by_ip = torch.argsort(dist, dim=1), torch.argsort(-ip, dim=1)
    tol = 2 * (gamma(17) + 4 * U32) * c * q.double().norm(dim=1, keepdim=True)
    assert bool(((by_dist == by_ip) | ((ip.gather(1, by_dist) - ip.gather(1, by_ip)).abs() <= tol)).all())
    # |T_K(k) - T_Q(q)|^2 = 2 - 2 q.k / (c |q|)
    expect = 2 - 2 * ip / (c * q.double().norm(dim=-1, keepdim=True))
    torch.testing.assert_close(dist**2, expect, atol=1e-5, rtol=0)


def test_transform_clamps_keys_longer_than_c():
    k = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    tk, clamped = transform_keys(k, 1.0)
    assert clamped == 1
    torch.testing.assert_close(tk[0], torch.tensor([0.6, 0.8, 0.0]))
    torch.testing.assert_close(tk[1], torch.tensor([0.3, 0.4, (1 - 0.25) ** 0.5]))


def test_pdci_lower_bound_never_above_true_distance():
    tree = DCITree.build(keys_of(300), torch.arange(300), DCIParams(promotion_ratio=0.25, page_size=4))
    xq = transform_queries(torch.randn(9, 12))
    pq = xq @ tree.proj_dirs.T
    lb = (tree.proj[:-1][None] - pq[:, None]).abs().amax(-1)  # every simple index's bound
    assert bool((lb <= torch.cdist(xq, tree.X) + 1e-6).all())


def _push_next(heap, walkers, s, qp, C):
    """Push simple index s's next point outwards from the query (the closer side) onto the queue."""
    import heapq
    import math

    order, vals, left, right, col = walkers[s]
    dl = qp[col] - vals[left] if left >= 0 else math.inf
    dr = vals[right] - qp[col] if right < C else math.inf
    if dl == dr == math.inf:
        return
    if dl <= dr:
        heapq.heappush(heap, (dl, order[left], s))
        walkers[s][2] -= 1
    else:
        heapq.heappush(heap, (dr, order[right], s))
        walkers[s][3] += 1


def _pdci_reference(tree, xq, cand, prop):
    """Prioritized DCI as Li & Malik (2017) state it, one query, plain Python: per simple index the
    points sorted by projection, a pointer walking outwards from the query's projection on each
    side; per composite index a priority queue over the lists' next (point, simple index) pairs by
    |u.(x - q)|; a point is retrieved once popped from all p lists of the composite index, which
    stops after k1 retrievals. Returns the candidate set (the union over composite indices)."""
    import bisect
    import heapq
    import math

    p = tree.params
    C = len(cand)
    proj = tree.proj[torch.tensor(cand)].tolist()
    qp = (xq @ tree.proj_dirs.T).tolist()
    k1 = min(max(math.ceil(prop * C), p.min_candidates), C)
    out = set()
    for j in range(p.num_comp):
        heap, walkers, counts, got = [], [], [0] * C, 0
        for s in range(p.num_simp):
            col = j * p.num_simp + s
            order = sorted(range(C), key=lambda i, col=col: proj[i][col])
            vals = [proj[i][col] for i in order]
            at = bisect.bisect_left(vals, qp[col])
            walkers.append([order, vals, at - 1, at, col])
        for s in range(p.num_simp):
            _push_next(heap, walkers, s, qp, C)
        while got < k1:
            _, i, s = heapq.heappop(heap)
            counts[i] += 1
            if counts[i] == p.num_simp:
                out.add(cand[i])
                got += 1
            _push_next(heap, walkers, s, qp, C)
    return out


@pytest.mark.parametrize("prop", [0.05, 0.25, 0.8, 1.0])
def test_vectorised_pdci_retrieves_exactly_the_priority_queue_candidates(prop):
    """The vectorised P-DCI (per-composite-index top-k1 of the lower bound) retrieves the same
    candidates as sorted lists walked with a priority queue, for node sets of any size, several
    queries at once with padding (both the sparse and the dense code paths)."""
    tree = DCITree.build(keys_of(600, 16, seed=4), torch.arange(600), DCIParams(promotion_ratio=0.2))
    g = torch.Generator().manual_seed(0)
    sizes = [3, 16, 40, 250, 600]
    C = max(sizes)
    cand = torch.full((len(sizes), C), -1, dtype=torch.long)
    for r, c in enumerate(sizes):
        cand[r, :c] = torch.randperm(600, generator=g)[:c]
    xq = transform_queries(torch.randn(len(sizes), 16, generator=g))
    ids, dot = tree._pdci(xq, xq @ tree.proj_dirs.T, cand, C, prop)  # width C: every candidate comes back
    for r, c in enumerate(sizes):
        got = set(ids[r][torch.isfinite(dot[r])].tolist())
        assert got == _pdci_reference(tree, xq[r], cand[r, :c].tolist(), prop), (c, prop)


@pytest.mark.parametrize("n", [1, 2, 7, 60, 400])
def test_parents_are_exact_nearest_promoted_points_with_enough_candidates(n):
    tree = DCITree.build(keys_of(n, seed=n), torch.arange(n), DCIParams(promotion_ratio=0.3, page_size=4, **EXHAUSTIVE))
    for lev in range(tree.num_levels - 1):
        up = torch.nonzero(tree.top >= lev + 1).flatten()
        own = torch.nonzero(tree.top == lev).flatten()
        assert torch.equal(tree.parent[lev][up], up)  # a promoted point is its own parent
        if own.numel():
            nearest_within_rounding(tree.X[own], up, tree.X[up], tree.parent[lev][own])
        assert bool((tree.parent[lev][tree.top < lev] == -1).all())


@pytest.mark.parametrize("n", [1, 7, 60, 400, 3000])
def test_exact_parents_are_the_nearest_points_of_the_level_above(n):
    """parents="exact": with the default (approximate) search settings every parent is still the nearest."""
    params = DCIParams(promotion_ratio=0.3 if n < 1000 else 1 / 16, page_size=4, parents="exact")
    tree = DCITree.build(keys_of(n, seed=n), torch.arange(n), params)
    g = torch.Generator().manual_seed(3)
    grown = tree.insert(keys_of(40, seed=n + 7), torch.arange(n, n + 40), g)  # decode-time insertions too
    for t, first in ((tree, 0), (grown, n)):  # an inserted point's parent (the old points keep theirs)
        for lev in range(t.num_levels - 1):
            up = torch.nonzero(t.top >= lev + 1).flatten()
            own = torch.nonzero(t.top == lev).flatten()
            own = own[own >= first]
            assert torch.equal(t.parent[lev][up], up)
            if own.numel():
                nearest_within_rounding(t.X[own], up, t.X[up], t.parent[lev][own])
        check_pages(t, torch.arange(t.n))


def test_exact_parents_build_the_tree_of_an_exhaustive_dci_construction():
    """Same promotions, same parents: the tree (levels, nodes, pages) equals the paper's construction run with
    every candidate scored, which finds the exact nearest parent too. (The two compare float32 inner products
    computed by different kernels: this data has no parent tie within float32 rounding, checked first.)"""
    k = keys_of(500, seed=4)
    a = DCITree.build(k, torch.arange(500), DCIParams(promotion_ratio=0.2, page_size=8, parents="exact"))
    for lev in range(a.num_levels - 1):
        up, own = torch.nonzero(a.top >= lev + 1).flatten(), torch.nonzero(a.top == lev).flatten()
        assert nearest_within_rounding(a.X[own], up, a.X[up], a.parent[lev][own]) == 0
    b = DCITree.build(k, torch.arange(500), DCIParams(promotion_ratio=0.2, page_size=8, **EXHAUSTIVE))
    assert a.num_levels == b.num_levels and torch.equal(a.top, b.top)
    assert all(torch.equal(x, y) for x, y in zip(a.parent, b.parent, strict=True))
    assert torch.equal(a.page_pts, b.page_pts) and torch.equal(a.page_fill, b.page_fill)
    # the default construction is approximate: on this data it misses some nearest parents
    c = DCITree.build(k, torch.arange(500), DCIParams(promotion_ratio=0.2, page_size=8))
    assert not all(torch.equal(x, y) for x, y in zip(a.parent, c.parent, strict=True))


@pytest.mark.parametrize("n", [1, 5, 33, 250, 900])
def test_mdci_with_enough_candidates_returns_exact_top_k(n):
    k = keys_of(n, seed=n + 1)
    tree = DCITree.build(k, torch.arange(n) + 50, DCIParams(promotion_ratio=0.2, page_size=8, **EXHAUSTIVE))
    q = torch.randn(6, 12)
    kk = min(10, n)
    ids = tree.topk(q, kk, fov=10**6, prop=1.0)
    topk_within_rounding(ids, q, k, tree.c)
    # k-NN among the points of an upper level (the parent search of a level-l insertion)
    for lev in range(1, tree.num_levels):
        members = torch.nonzero(tree.top >= lev).flatten()
        got, _ = tree.search(transform_queries(q), 1, lev, 10**6, 1.0)
        nearest_within_rounding(transform_queries(q), members, tree.X[members], got[:, 0])


def test_default_search_is_approximate_but_finds_most_of_the_top_k():
    """Not exact with the default candidate share; measured, not asserted exact."""
    k = keys_of(3000, 32, seed=3)
    tree = DCITree.build(k, torch.arange(3000), DCIParams())
    q = k[:10] + 0.1 * torch.randn(10, 32)  # queries near the data, like attention queries
    ids = tree.topk(q, 50, fov=50, prop=0.8)
    true = torch.topk(q @ k.T, 50, dim=1).indices
    hit = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, true, strict=True)) / 500
    assert hit > 0.3
    assert bool((ids >= 0).all()) and all(len(set(r.tolist())) == 50 for r in ids)


def test_random_promotion_is_geometric_and_empty_levels_are_removed():
    r = 0.25
    tree = DCITree.build(keys_of(20000, 4), torch.arange(20000), DCIParams(promotion_ratio=r, page_size=16))
    frac1 = float((tree.top >= 1).float().mean())
    assert abs(frac1 - r) < 0.02
    levels = torch.unique(tree.top)
    assert torch.equal(levels, torch.arange(tree.num_levels))
    assert torch.equal(tree.root, torch.nonzero(tree.top == tree.num_levels - 1).flatten())


def check_pages(tree: DCITree, positions: torch.Tensor) -> None:
    """Every point in exactly one page; pages never exceed page_size; a page holds one leaf node;
    all pages of a node but its last are full; the maps agree with the page table."""
    ps = tree.params.page_size
    pts = tree.page_pts
    assert pts.shape[1] == ps
    live = pts[pts >= 0]
    assert live.numel() == tree.n and torch.equal(torch.sort(live).values, torch.arange(tree.n))
    assert torch.equal((pts >= 0).sum(1), tree.page_fill)
    assert bool((tree.page_fill >= 1).all()) and bool((tree.page_fill <= ps).all())
    # occupied slots come first
    assert bool(((pts >= 0).long().diff(dim=1) <= 0).all())
    for p in range(tree.num_pages):
        row = pts[p, : tree.page_fill[p]]
        assert torch.equal(tree.pt_page[row], torch.full_like(row, p))
        assert torch.equal(tree.pt_slot[row], torch.arange(row.numel()))
    leaf = tree.leaf_nodes()
    node_of_page = leaf[pts[:, 0]]
    for p in range(tree.num_pages):
        assert bool((leaf[pts[p, : tree.page_fill[p]]] == node_of_page[p]).all())
    for node in torch.unique(node_of_page).tolist():
        pages = torch.nonzero(node_of_page == node).flatten()
        assert bool((tree.page_fill[pages[:-1]] == ps).all())
        assert int(tree.node_last_page[node]) == int(pages[-1])
    assert torch.equal(torch.sort(tree.pos).values, torch.sort(positions).values)
    got = tree.page_positions(torch.arange(tree.num_pages))
    assert torch.equal(torch.sort(got[got >= 0]).values, torch.sort(positions).values)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_build_stores_every_token_in_exactly_one_page(ps):
    n = 700
    pos = torch.randperm(n) + 16
    tree = DCITree.build(keys_of(n), pos, DCIParams(promotion_ratio=0.2, page_size=ps))
    check_pages(tree, pos)


def test_insertion_keeps_pages_valid_and_the_old_snapshot_untouched():
    n = 300
    params = DCIParams(promotion_ratio=0.2, page_size=8, **EXHAUSTIVE)
    tree = DCITree.build(keys_of(n), torch.arange(n), params)
    snapshot = (tree.X.clone(), tree.page_pts.clone(), tree.page_fill.clone(), tree.parent[0].clone())
    g = torch.Generator().manual_seed(5)
    pos = torch.arange(n)
    grown = tree
    for step in range(12):  # one page of 16 keys at a time, as evicted window pages arrive
        new = keys_of(16, seed=100 + step)
        grown = grown.insert(new, torch.arange(16) + n + 16 * step, g)
        pos = torch.cat([pos, torch.arange(16) + n + 16 * step])
        check_pages(grown, pos)
    assert grown.n == n + 12 * 16 and grown.num_levels == tree.num_levels
    assert torch.equal(tree.X, snapshot[0]) and torch.equal(tree.page_pts, snapshot[1])
    assert torch.equal(tree.page_fill, snapshot[2]) and torch.equal(tree.parent[0], snapshot[3])
    # old points keep their pages and slots (append-only), inserted points have valid parents
    assert torch.equal(grown.pt_page[:n], tree.pt_page) and torch.equal(grown.pt_slot[:n], tree.pt_slot)
    for lev in range(grown.num_levels - 1):
        on = grown.top >= lev
        par = grown.parent[lev][on]
        assert bool((par >= 0).all()) and bool((grown.top[par] >= lev + 1).all())
    # the grown tree is still searched exactly with enough candidates
    k_all = torch.cat([keys_of(n)] + [keys_of(16, seed=100 + s) for s in range(12)])
    q = torch.randn(4, 12)
    c = grown.c
    ok = k_all.norm(dim=-1) <= c  # clamped keys (none expected here) would rank by cosine
    assert bool(ok.all())
    topk_within_rounding(grown.topk(q, 7, 10**6, 1.0), q, k_all, c)


def test_insertion_into_a_single_level_tree():
    params = DCIParams(promotion_ratio=0.01, page_size=4, seed=1)
    tree = DCITree.build(keys_of(3), torch.arange(3), params)
    assert tree.num_levels == 1
    grown = tree.insert(keys_of(6, seed=9), torch.arange(3, 9), torch.Generator().manual_seed(0))
    check_pages(grown, torch.arange(9))
    assert grown.num_pages == 3  # one node, spilled into pages of 4


@pytest.mark.parametrize(
    "bad",
    [
        dict(promotion_ratio=0.0),
        dict(promotion_ratio=1.0),
        dict(num_comp=0),
        dict(num_simp=1.5),
        dict(construction_prop=0.0),
        dict(page_size=0),
        dict(norm_margin=0.9),
        dict(parents="nearest"),
    ],
)
def test_bad_params_raise(bad):
    with pytest.raises(ValueError):
        DCIParams(**bad)


def test_build_needs_keys():
    with pytest.raises(ValueError, match="at least one key"):
        DCITree.build(torch.empty(0, 4), torch.empty(0, dtype=torch.long), DCIParams())
