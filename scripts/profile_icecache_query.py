"""Profile one IceCache layer-query: one DCI-tree, one GQA group of query heads, on the CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/profile_icecache_query.py --keys 32720 --topk 64,256

Builds one tree over synthetic clustered keys (64 clusters, head dim 64: Qwen2.5-0.5B's shape) and
times ``DCITree.search`` the way ``IceCachePolicy._search`` calls it (k = fov = the budget,
query_prop 0.8, collect_all) for ``--heads`` query heads at once. Prints the median time per
layer-query, the time per tree level (P-DCI and child expansion, with the candidate-set sizes),
the torch ops that take the time, and (``--intra-threads 1,2,...``) the time with torch intra-op
threads inside the search, checking that the results stay identical. Nothing is asserted on time.

``--batched 2`` (session 4) also times one layer-query of ``--batched`` trees (a layer's kv heads)
the two ways the policy can run it: ``search=host`` (one ``DCITree.search`` + page choice per tree,
here sequentially on one thread) and ``search=device`` (one :class:`kvdex.index.forest.DCIForest`
search + batched page choice over all trees, on ``--device``, synchronised), and how often the two
select the same pages.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvdex.index.dci import DCIParams, DCITree, transform_queries
from kvdex.index.forest import DCIForest
from kvdex.policies import make_policy


def clustered_keys(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(64, d, generator=g) * 3
    return centres[torch.randint(0, 64, (n,), generator=g)] + torch.randn(n, d, generator=g)


def median_ms(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


class _Timed(DCITree):
    """The same tree, its per-level steps timed (a subclass: the library's class is untouched)."""

    log: list

    def _pdci(self, Xq, pq, cand, width, prop):
        t0 = time.perf_counter()
        out = super()._pdci(Xq, pq, cand, width, prop)
        self.log.append(("pdci", tuple(cand.shape), int((cand >= 0).sum()), time.perf_counter() - t0))
        return out

    def _children(self, ids, level):
        t0 = time.perf_counter()
        out = super()._children(ids, level)
        self.log.append((f"children->L{level}", tuple(out.shape), int((out >= 0).sum()), time.perf_counter() - t0))
        return out


def batched_bench(args) -> None:
    """One layer-query over ``args.batched`` trees: per-tree host search vs one batched forest search."""
    dev = torch.device(args.device)
    ntree = args.batched
    t0 = time.perf_counter()
    pos = torch.arange(args.keys) + 16
    keys = [clustered_keys(args.keys, args.dim, args.seed + t) for t in range(ntree)]
    trees = [DCITree.build(k, pos, DCIParams(seed=t)) for t, k in enumerate(keys)]
    print(f"\n== batched: {ntree} trees of {args.keys} keys built in {time.perf_counter() - t0:.1f} s, device {dev}")
    t0 = time.perf_counter()
    forest = DCIForest(trees, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    print(f"mirror: {time.perf_counter() - t0:.3f} s (capacity {forest.S} points, {forest.Pc} pages per tree)")
    G, room, cap = args.heads, args.room, args.cap
    rows = tuple(range(ntree))
    ridx = torch.tensor(rows, device=dev)
    tq = ridx.repeat_interleave(G)
    g = torch.Generator().manual_seed(args.seed + 2)
    for k in [int(x) for x in args.topk.split(",")]:
        pol = make_policy("icecache", topk=k)
        pol._stats = {"pages_selected": 0, "tokens_selected": 0}
        pol._max_pages = lambda: cap
        same = total = 0
        qs = [torch.randn(ntree * G, args.dim, generator=g) * 2 for _ in range(args.reps)]
        it = iter(range(10**9))

        def host(qs=qs, it=it, pol=pol, k=k):
            q = qs[next(it) % len(qs)]
            return [pol._select_pages(trees[t], q[t * G : (t + 1) * G], room) for t in rows]

        it2 = iter(range(10**9))
        qd = [q.to(dev) for q in qs]

        def device(qd=qd, it2=it2, k=k):
            q = qd[next(it2) % len(qd)]
            ids, dot = forest.search(transform_queries(q), tq, rows, k, k, 0.8)
            toks, _ = forest.select_pages(ids, dot, ridx, G, room, cap)
            sync()
            return toks

        h_ms, d_ms = median_ms(host, args.reps), median_ms(device, args.reps)
        for q in qs:
            want = [pol._select_pages(trees[t], q[t * G : (t + 1) * G], room) for t in rows]
            ids, dot = forest.search(transform_queries(q.to(dev)), tq, rows, k, k, 0.8)
            got = forest.select_pages(ids, dot, ridx, G, room, cap)[0].cpu()
            for t in rows:
                total += 1
                same += set(want[t].tolist()) == set(got[t][got[t] >= 0].tolist())
        print(
            f"k = fov = {k}, {G} query heads per tree, room {room} tokens, max {cap} pages: "
            f"host per-tree {h_ms:.2f} ms, batched on {dev} {d_ms:.2f} ms per layer-query "
            f"({h_ms / d_ms:.1f}x); same pages {same}/{total}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=32720)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=7, help="query heads per kv head (GQA group)")
    ap.add_argument("--topk", default="64,256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--intra-threads", default="", help="e.g. 1,2,4: torch threads inside one search")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batched", type=int, default=0, help="also time the batched search over this many trees")
    ap.add_argument("--batched-only", action="store_true")
    ap.add_argument("--device", default="cpu", help="device of the batched search")
    ap.add_argument("--room", type=int, default=208, help="retrieval tokens (budget 256 - sink 16 - window 32)")
    ap.add_argument("--cap", type=int, default=26, help="max pages per kv head (2 x retrieval pages)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.batched:
        batched_bench(args)
        if args.batched_only:
            return
    t0 = time.perf_counter()
    tree = DCITree.build(clustered_keys(args.keys, args.dim, args.seed), torch.arange(args.keys), DCIParams(seed=1))
    levels = [int((tree.top >= lev).sum()) for lev in range(tree.num_levels)]
    print(f"build: {time.perf_counter() - t0:.2f} s, points per level {levels}")
    g = torch.Generator().manual_seed(args.seed + 1)
    Xq = transform_queries(torch.randn(args.heads, args.dim, generator=g) * 2)
    timed = _Timed(**{f: getattr(tree, f) for f in DCITree.__dataclass_fields__})
    for k in [int(x) for x in args.topk.split(",")]:

        def run(t=tree, k=k):
            return t.search(Xq, k, 0, k, 0.8, collect_all=True)

        print(f"\nk = fov = {k}, {args.heads} query heads, {args.keys} keys: {median_ms(run, args.reps):.2f} ms median")
        timed.log = []
        for _ in range(args.reps):
            run(timed)
        agg: dict = {}
        for name, shape, valid, dt in timed.log:
            agg.setdefault((name, shape, valid), []).append(dt)
        for (name, shape, valid), dts in agg.items():
            print(f"  {name:14s} rows x cols {shape}, {valid} valid: {sorted(dts)[len(dts) // 2] * 1e3:.2f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
        if args.intra_threads:
            ref = run()
            for nt in [int(x) for x in args.intra_threads.split(",")]:
                torch.set_num_threads(nt)
                out = run()
                same = torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
                print(f"  torch threads {nt}: {median_ms(run, args.reps):.2f} ms, identical results: {same}")
            torch.set_num_threads(1)


if __name__ == "__main__":
    main()
