"""IceCache speed on real keys: DCI-tree build time per 32k keys, per-step query time, prefill overlap.

    PYTHONPATH=. python scripts/gpu_icecache.py --model /tmp/m/qwen.gguf --data /tmp/m/evaldata \
        --length 32768 --threads 16 --budget 256 --steps 32 --out /tmp/ice_speed.json

1. Prefill a book excerpt of ``--length`` tokens with the ``full`` policy and take every sparse
   layer's middle keys (real keys, per kv head).
2. Build time: one tree on one thread (latency), then all (layer, kv head) trees on a pool of
   ``--threads`` workers with one torch thread each (throughput), reported per 32k keys.
3. Quality of the parent search against exhaustive parents (share of exact parents), and top-k hit
   of the tree's search against the exact inner-product top-k for the prompt's last queries.
4. End to end: ``icecache`` (and ``icecache:reuse=True``) through ``model.generate`` for
   ``--steps`` tokens, GPU-resident and offloaded: prefill time vs the ``full`` policy, the time the
   first ``select`` of each layer waited for its tree (the part of the build not hidden behind the
   prefill), and the per-step time of selection (tree queries) / transfer / attention.
Prints a table and writes JSON. Runs on CPU too (small ``--length``) as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import kvdex
from kvdex.eval.data import data_root, long_text_samples
from kvdex.eval.models import load
from kvdex.index import DCIParams, DCITree, transform_queries


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompt_ids(tok, args):
    root = data_root(args.data)
    sample = long_text_samples(root, "books", tok, args.length, 0, 1, args.seed)[0]
    return torch.tensor(sample.input_ids)[None]


def real_keys(model, ids, device):
    cache = kvdex.Cache(model, "full", budget=64)
    with torch.no_grad():
        model(ids.to(device), past_key_values=cache, use_cache=True)
    return {lay.layer_idx: lay.store.middle_keys()[0].float().cpu() for lay in cache.layers if not lay.dense}


def build_bench(keys, params, threads):
    """Latency of one tree (1 thread) and throughput of all trees on a pool of ``threads``."""
    torch.set_num_threads(1)
    k0 = next(iter(keys.values()))[0]
    t0 = time.perf_counter()
    DCITree.build(k0, torch.arange(k0.shape[0]), params)
    one = time.perf_counter() - t0
    jobs = [(lay, h) for lay in keys for h in range(keys[lay].shape[0])]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        trees = list(
            pool.map(lambda j: DCITree.build(keys[j[0]][j[1]], torch.arange(keys[j[0]].shape[1]), params), jobs)
        )
    wall = time.perf_counter() - t0
    total = sum(keys[lay].shape[1] for lay, _ in jobs)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    DCITree.build(k0, torch.arange(k0.shape[0]), params)
    intra = time.perf_counter() - t0
    n = k0.shape[0]
    return {
        "keys_per_tree": n,
        "trees": len(jobs),
        "one_tree_1thread_s_per_32k": one / n * 32768,
        "one_tree_intraop_s_per_32k": intra / n * 32768,
        "pool_wall_s_all_trees": wall,
        "pool_s_per_32k_keys": wall / total * 32768,
    }, dict(zip(jobs, trees, strict=True))


def quality(keys, trees, params, budget):
    """Parent search vs exhaustive parents; tree top-k vs the exact inner-product top-k. Queries
    are keys plus noise (data-shaped; the recall harness measures real decode queries)."""
    lay, h = next(iter(trees))
    tree = trees[(lay, h)]
    n = tree.n
    same = 1.0
    if tree.num_levels > 1:  # the exact nearest level-1 point of every level-0-only point (chunked cdist)
        own = torch.nonzero(tree.top == 0).flatten()
        up = torch.nonzero(tree.top >= 1).flatten()
        exact = torch.cat([up[torch.cdist(tree.X[c], tree.X[up]).argmin(1)] for c in own.split(4096)])
        same = float((exact == tree.parent[0][own]).float().mean())
    g = torch.Generator().manual_seed(0)
    qs = keys[lay][h][torch.randint(0, n, (16,), generator=g)] + 0.5 * torch.randn(16, keys[lay].shape[2], generator=g)
    k = max(1, budget - 48)
    ids = tree.topk(qs, k, k, 0.8)
    true = torch.topk(qs @ keys[lay][h].T, k, dim=1).indices
    hit = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids, true, strict=True)) / true.numel()
    t0 = time.perf_counter()
    for _ in range(5):
        tree.search(transform_queries(qs[:7]), k, 0, k, 0.8, collect_all=True)
    q_ms = (time.perf_counter() - t0) / 5 * 1e3
    return {
        "level0_parent_exact_share": same,
        "topk_hit_vs_exact": hit,
        "query_ms_7_heads_one_tree": q_ms,
        "levels": tree.num_levels,
        "pages": tree.num_pages,
        "mean_page_fill": float(tree.page_fill.float().mean()),
    }


def end_to_end(model, ids, device, args, policy, offload):
    base = kvdex.Cache(model, "full", budget=args.budget, offload=offload)
    ids = ids.to(device)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        model(ids, past_key_values=base, use_cache=True)
        sync()
        prefill_full = time.perf_counter() - t0
        cache = kvdex.Cache(model, policy, budget=args.budget, offload=offload, timing=True)
        sync()
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2, do_sample=False
        )
        sync()
        tt2t = time.perf_counter() - t0
        cache = kvdex.Cache(model, policy, budget=args.budget, offload=offload, timing=True)
        sync()
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=args.steps, do_sample=False
        )
        sync()
        total = time.perf_counter() - t0
    st = cache.stats()
    ps = st.get("policy_stats", {})
    return {
        "policy": policy,
        "offload": offload,
        "prefill_full_s": prefill_full,
        "time_to_2nd_token_s": tt2t,
        "generate_s": total,
        "new_tokens": out.shape[1] - ids.shape[1],
        "time_ms_per_step": st.get("time_ms_per_step"),
        "tree_build_cpu_s": ps.get("build_s"),
        "first_select_wait_s": ps.get("wait_s"),
        "build_hidden_fraction": ps.get("build_hidden_fraction"),
        "query_ms_per_layer_step": ps.get("query_ms_per_layer_step"),
        "tokens_per_selected_page": ps.get("tokens_per_selected_page"),
        "h2d_MB": st["bytes_host_to_device"] / 2**20,
        "h2d_transfers": st["host_to_device_transfers"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/m/qwen.gguf")
    ap.add_argument("--data", default="/tmp/m/evaldata")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--out", default="ice_speed.json")
    args = ap.parse_args()
    random.seed(args.seed)
    model, tok = load(args.model, device=args.device)
    ids = prompt_ids(tok, args)
    keys = real_keys(model, ids, args.device)
    params = DCIParams(page_size=16)
    build, trees = build_bench(keys, params, args.threads)
    qual = quality(keys, trees, params, args.budget)
    torch.set_num_threads(args.threads)
    e2e = []
    if not args.skip_e2e:
        for policy in (f"icecache:threads={args.threads}", f"icecache:threads={args.threads}:reuse=True"):
            for offload in (False, True):
                e2e.append(end_to_end(model, ids, args.device, args, policy, offload))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "machine": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit,
        "context_tokens": ids.shape[1],
        "threads": args.threads,
        "build": build,
        "quality": qual,
        "end_to_end": e2e,
    }
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
