"""ParisKV on the GPU: Triton kernels vs their PyTorch twins, then retrieval latency per decode step.

    PYTHONPATH=. python3 scripts/gpu_pariskv.py [--lengths 32k,128k] [--topk 100,2048] [--json out.json]

Synthetic keys of the Llama-3.1-8B attention shape (batch 1, 8 kv heads, 32 query heads, head_dim 128,
bf16), anisotropic like real keys (a per-channel scale, a few outlier channels, a common offset).
For each context length the middle is indexed once (``policy.index``: SRHT + ids + 4-bit codes; its
time is reported as the prefill indexing cost), then one layer's retrieval is timed with CUDA events
after warm-up (median of 50): the stages (query transform + vote table, collision votes, bucket
top-k, 4-bit rerank + final top-k, UVA fetch of the top-k K/V rows from pinned host memory) and the
whole ``search``. Per decode step = per layer x 32 layers (the model's sparse layers all retrieve).
Then static sizing (what CUDA-graph decoding runs; must pick the same tokens): eager, one layer's search
replayed as a CUDA graph, and a whole step's retrieval (32 x (search + UVA fetch)) replayed as one graph.
The fetch is also timed the CPU way (index_select into pinned staging + one copy) for comparison.
Correctness first: every kernel equals its twin on these shapes, and the Triton search returns
the same top-k as the twin search (overlap reported; float summation order may swap near-ties).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from kvdex.config import CacheConfig
from kvdex.kernels import pariskv as K
from kvdex.kernels import pariskv_triton as T
from kvdex.policies import PolicyInfo, make_policy
from kvdex.policies.pariskv import adaptive_ratios
from kvdex.storage.base import MiddleUpdate

KV_HEADS, Q_HEADS, D, LAYERS, PAGE = 8, 32, 128, 32, 16
DEV = "cuda"  # --dry-run: "cpu" (kernels under TRITON_INTERPRET=1; checks the script, times nothing real)
ITERS = 50


def timed(fn, iters=None, warmup=5) -> float:
    """Median milliseconds of fn() with CUDA events after warm-up."""
    iters = min(iters or ITERS, ITERS)
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def pinned(x: torch.Tensor) -> torch.Tensor:
    return x.pin_memory() if DEV == "cuda" else x


def synthetic_keys(n: int, g: torch.Generator) -> torch.Tensor:
    scale = torch.linspace(0.3, 2.0, D)
    scale[[3, 17, 64, 100]] = 8.0  # outlier channels
    k = torch.randn(1, KV_HEADS, n, D, generator=g) * scale + 0.7
    return k.to(DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)


def check_kernels(n: int, g: torch.Generator) -> dict:
    """Each Triton kernel == its twin on a context of n tokens (raises on a mismatch)."""
    r, nsub, m = KV_HEADS, D // 8, 8
    ids = torch.randint(0, 256, (r, n, nsub), generator=g).to(torch.uint8).to(DEV)
    votes = torch.randint(0, 7, (r, nsub, 256), generator=g).int().to(DEV)
    assert torch.equal(T.collision_votes(ids, votes), K.collision_votes(ids, votes)), "collision_votes"
    score = K.collision_votes(ids, votes)
    c = max(100, n // 10)
    assert torch.equal(T.bucket_topk(score, c, 6 * nsub), K.bucket_topk(score, c, 6 * nsub)), "bucket_topk"
    # real (anisotropic) keys crowd into a few centroids: heavy ties at the threshold
    skew = torch.where(torch.rand(r, n, nsub, generator=g) < 0.7, 0, ids.cpu().long()).to(torch.uint8).to(DEV)
    s2 = K.collision_votes(skew, votes)
    assert torch.equal(T.collision_votes(skew, votes), s2), "collision_votes (skewed)"
    assert torch.equal(T.bucket_topk(s2, c, 6 * nsub), K.bucket_topk(s2, c, 6 * nsub)), "bucket_topk (ties)"
    signs = K.srht_signs(D, 1).to(DEV)
    t, cen = (x.to(DEV) for x in K.magnitude_levels(m))
    keys = synthetic_keys(n, g)[0]
    _, codes, w = K.encode_keys(keys, signs, m, t, cen)
    qb, qn = K.encode_query(torch.randn(r, D, generator=g).to(DEV), signs, m)
    cand = K.bucket_topk(score, c, 6 * nsub)
    a, b = T.rerank_scores(cand, codes, w, qb, qn, cen, m), K.rerank_scores(cand, codes, w, qb, qn, cen, m)
    err = float((a - b).abs().max() / b.abs().max())
    assert err < 1e-5, f"rerank_scores rel err {err}"
    pages = pinned(torch.randn(1, KV_HEADS, n // PAGE, 2, PAGE, D, generator=g).to(keys.dtype))
    rel = torch.randint(0, (n // PAGE) * PAGE, (1, KV_HEADS, 2048), generator=g).to(DEV)
    assert torch.equal(T.gather_rows(pages, rel), K.gather_rows(pages, rel)), "gather_rows (UVA)"
    return {"n": n, "rerank_rel_err": err, "ok": True}


def build(kern: str, k: int, pages: torch.Tensor, n: int):
    """A pariskv policy bound to the Llama-8B shape, its layer 2 indexed with n tokens: (policy, index ms)."""
    info = PolicyInfo(CacheConfig(budget=16 + 32 + k), LAYERS, tuple(range(2, LAYERS)), Q_HEADS, KV_HEADS, D)
    p = make_policy("pariskv", kernels=kern)
    p.bind(info)
    upd = MiddleUpdate(torch.tensor([0]), torch.tensor([n // PAGE]), pages)
    ms = timed(lambda: (p.index_.clear(), p.index(2, upd)), iters=3, warmup=1)
    return p, ms


def measure(n: int, k: int, pages: torch.Tensor, host: torch.Tensor, q: torch.Tensor) -> dict:
    """Timings of one layer's retrieval of the top-k of n tokens (Triton kernels; twins for comparison)."""
    p, ms_index = build("triton", k, pages, n)
    pt, ms_index_torch = build("torch", k, pages, n)
    nmid = torch.tensor([n])
    fin, _ = p.search(2, q, n, nmid, k)
    fin_torch, _ = pt.search(2, q, n, nmid, k)
    overlap = float((fin[..., :, None] == fin_torch[..., None, :]).any(-1).float().mean())
    idx = p.index_[2]
    beta, rho = adaptive_ratios(n)
    c = min(n, max(k, math.ceil(beta * n)))
    score, qb, qn = p.votes(2, q, n, nmid)
    cand = T.bucket_topk(score, c, p.max_votes)
    codes, w = idx.codes[:, :, :n].reshape(KV_HEADS, n, -1), idx.weight[:, :, :n].reshape(KV_HEADS, n, -1)
    ids = idx.ids[:, :, :n].reshape(KV_HEADS, n, -1)
    table = torch.zeros(KV_HEADS, p.num_sub, 256, dtype=torch.int32, device=DEV)
    centers = p.centers.to(DEV)
    rel = fin.clamp(min=0)
    row = {
        "context": n,
        "topk": k,
        "candidates": c,
        "collision_ratio": rho,
        "index_ms_per_layer": ms_index,
        "index_ms_per_layer_torch": ms_index_torch,
        "search_ms_per_layer": timed(lambda: p.search(2, q, n, nmid, k)),
        "search_ms_per_layer_torch": timed(lambda: pt.search(2, q, n, nmid, k), iters=10),
        "votes_ms": timed(lambda: p.votes(2, q, n, nmid)),
        "collision_kernel_ms": timed(lambda: T.collision_votes(ids, table)),
        "bucket_topk_ms": timed(lambda: T.bucket_topk(score, c, p.max_votes)),
        "torch_topk_ms": timed(lambda: torch.topk(score.float(), c, dim=-1)),
        "rerank_ms": timed(lambda: T.rerank_scores(cand, codes, w, qb, qn, centers, 8)),
        "uva_fetch_ms": timed(lambda: T.gather_rows(host, rel)),
        "cpu_gather_copy_ms": timed(lambda: K.gather_rows(host, rel.cpu()).to(DEV), iters=10),
        "triton_vs_torch_topk_overlap": overlap,
    }
    row["retrieval_ms_per_step_32_layers"] = LAYERS * (row["search_ms_per_layer"] + row["uva_fetch_ms"])
    row["retrieval_ms_per_step_cpu_gather"] = LAYERS * (row["search_ms_per_layer"] + row["cpu_gather_copy_ms"])
    row.update(measure_static(p, q, n, nmid, k, host, fin))
    return row


def measure_static(p, q, n: int, nmid: torch.Tensor, k: int, host: torch.Tensor, fin: torch.Tensor) -> dict:
    """Static sizing (what the CUDA-graph decoder runs): the same picks as the dynamic search, its eager
    time, and the time of a CUDA graph that replays a whole step's retrieval: 32 x (search + UVA fetch)."""
    fin_s, cand_s = p.search(2, q, n, nmid, k, static=True)
    same = all(
        set(a[a >= 0].tolist()) == set(b[b >= 0].tolist())
        for a, b in zip(fin.flatten(0, 1), fin_s.flatten(0, 1), strict=True)
    )
    out = {
        "static_equals_dynamic": same,
        "static_pool_width": cand_s.shape[-1],
        "search_ms_per_layer_static_eager": timed(lambda: p.search(2, q, n, nmid, k, static=True)),
    }
    if DEV != "cuda":
        return out

    def step():
        for _ in range(LAYERS):
            f, _ = p.search(2, q, n, nmid, k, static=True)
            T.gather_rows(host, f.clamp(min=0))

    def one():
        p.search(2, q, n, nmid, k, static=True)

    keys = {"layer": "search_ms_per_layer_graph", "step": "retrieval_ms_per_step_graph"}
    for name, fn in (("layer", one), ("step", step)):
        try:  # a failed capture is reported in the row, the other measurements stand
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()  # warm-up outside the capture (Triton compiles, allocator pools)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            out[keys[name]] = timed(g.replay)
            del g
        except Exception as e:  # noqa: BLE001
            out[keys[name]] = float("nan")
            out[f"graph_error_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"graph capture ({name}) failed: {out[f'graph_error_{name}']}", file=sys.stderr, flush=True)
            torch.cuda.synchronize()
    return out


def bench_length(n: int, topks: list[int], g: torch.Generator) -> list[dict]:
    keys = synthetic_keys(n, g)
    pages = keys.view(1, KV_HEADS, n // PAGE, PAGE, D)
    q = (keys[0, :, n // 3].float().repeat_interleave(4, 0) + torch.randn(Q_HEADS, D, device=DEV))[None]
    host = pinned(torch.stack([pages, pages], dim=3).cpu())  # [1, H, P, 2, ps, D]: the HostPages layout
    rows = []
    for k in topks:
        rows.append(measure(n, k, pages, host, q))
        print(json.dumps(rows[-1]), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    from kvdex.eval.cli import parse_sizes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=parse_sizes, default=[32768, 131072])
    ap.add_argument("--topk", type=parse_sizes, default=[100, 2048])
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1: exercise the script only")
    args = ap.parse_args(argv)
    global DEV, ITERS
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        DEV, ITERS = "cpu", 1
    elif not (torch.cuda.is_available() and T.available()):
        print("needs CUDA and triton", file=sys.stderr)
        return 2
    t_all = time.time()
    g = torch.Generator().manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
    }
    print(json.dumps(meta))
    checks = [check_kernels(n, g) for n in ((4093, 32768) if DEV == "cuda" else (1021,))]
    print(json.dumps({"kernel_checks": checks}))
    rows = [r for n in args.lengths for r in bench_length(n, args.topk, g)]
    print(f"\n{'context':>8} {'topk':>5} {'cand':>6} {'search ms':>9} {'(torch)':>8} {'votes':>6} {'bktopk':>6} "
          f"{'rerank':>6} {'uva':>6} {'cpu+cp':>7} {'step uva':>8} {'step cpu':>8} {'overlap':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['context']:>8} {r['topk']:>5} {r['candidates']:>6} {r['search_ms_per_layer']:>9.3f} "
            f"{r['search_ms_per_layer_torch']:>8.2f} {r['votes_ms']:>6.3f} {r['bucket_topk_ms']:>6.3f} "
            f"{r['rerank_ms']:>6.3f} {r['uva_fetch_ms']:>6.3f} {r['cpu_gather_copy_ms']:>7.2f} "
            f"{r['retrieval_ms_per_step_32_layers']:>8.2f} {r['retrieval_ms_per_step_cpu_gather']:>8.2f} "
            f"{r['triton_vs_torch_topk_overlap']:>7.3f}"
        )
    print(f"\n{'context':>8} {'topk':>5} {'pool':>6} {'same':>5} {'static eager':>12} "
          f"{'graph/layer':>11} {'graph/step':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['context']:>8} {r['topk']:>5} {r['static_pool_width']:>6} {str(r['static_equals_dynamic']):>5} "
            f"{r['search_ms_per_layer_static_eager']:>12.3f} {r.get('search_ms_per_layer_graph', float('nan')):>11.3f} "
            f"{r.get('retrieval_ms_per_step_graph', float('nan')):>10.2f}"
        )
    print("# static sizing (CUDA-graph decoding): same picks as dynamic?, eager ms per layer, one layer's search")
    print("# replayed as a CUDA graph, a whole step's retrieval (32 x (search + UVA fetch)) replayed as one graph")
    print("# per layer: search ms (Triton; torch twins), its stages, fetch of the top-k K/V rows by UVA (pinned host,")
    print(
        "# Triton kernel) or CPU gather + copy; per step = 32 layers x (search + fetch); total %.0f s"
        % (time.time() - t_all)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "kernel_checks": checks, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
