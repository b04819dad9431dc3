"""IceCache speed on real keys: DCI-tree build time per 32k keys and tree-query time per decode step.

    PYTHONPATH=. python scripts/gpu_icecache.py --model /tmp/m/qwen.gguf --data /tmp/m/evaldata \
        --length 32768 --threads 16 --out /tmp/ice_speed.json

Self-contained, about 1-2 minutes on the GPU machine (Qwen2.5-0.5B at 32k, 16 cores):

1. prefill a book excerpt of ``--length`` tokens with the ``full`` policy and take every sparse
   layer's middle keys (real keys, per kv head);
2. build time: one tree on one thread, then all (layer, kv head) trees on a pool of ``--threads``
   workers with one torch thread each (what the policy does at prefill), per 32k keys;
3. decode: fork ``icecache`` at each of ``--budgets`` from the prefill (the first fork builds the
   trees on the policy's pool, the later forks reuse them: fork time is reported) and greedily
   decode ``--steps`` tokens; reports the tree-query time per decode step (all sparse layers,
   ``policy_stats.query_s``), per layer, and the decode time per step against ``full``.

4. (session 4) ``--search device,host``: every budget is decoded with the batched device search
   (``icecache:search=device``, kvdex/index/forest.py) and with the per-tree host search; per run the
   decode ms per step (no extra syncs) and, in a second pass with a device sync before and after
   every ``select``, the true query ms per step (search + page choice, GPU work included);
5. ``--agree``: a device-search decode where every layer-query is also run on the host (per tree,
   same trees, same q) and the selected token sets are compared: the share of (step, layer, kv head)
   selections that are identical, and the mean Jaccard overlap (near-ties may differ, see docs).

Prints a table and writes JSON. Runs on CPU at a small ``--length`` as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import kvdex
from kvdex.eval.data import data_root, long_text_samples
from kvdex.eval.models import load
from kvdex.index import DCIParams, DCITree


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompt_ids(tok, args):
    root = data_root(args.data)
    sample = long_text_samples(root, "books", tok, args.length, 0, 1, args.seed)[0]
    return torch.tensor(sample.input_ids)[None]


def build_bench(keys, params, threads):
    """Latency of one tree (1 thread) and wall time of all trees on a pool of ``threads`` workers."""
    torch.set_num_threads(1)
    k0 = next(iter(keys.values()))[0]
    t0 = time.perf_counter()
    DCITree.build(k0, torch.arange(k0.shape[0]), params)
    one = time.perf_counter() - t0
    jobs = [(lay, h) for lay in keys for h in range(keys[lay].shape[0])]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        list(pool.map(lambda j: DCITree.build(keys[j[0]][j[1]], torch.arange(keys[j[0]].shape[1]), params), jobs))
    wall = time.perf_counter() - t0
    n = k0.shape[0]
    total = sum(keys[lay].shape[1] for lay, _ in jobs)
    return {
        "keys_per_tree": n,
        "trees": len(jobs),
        "one_tree_1thread_s": one,
        "one_tree_1thread_s_per_32k": one / n * 32768,
        "all_trees_pool_wall_s": wall,
        "all_trees_pool_s_per_32k_keys": wall / total * 32768,
    }


def _search_name(policy: str) -> str | None:
    if "search=" not in policy:
        return None
    return policy.split("search=")[1].replace(":graphs=True", "+graphs")


def _timed_select(pol, times):
    """Wrap ``pol.select``: a device sync before and after, so the time includes the GPU work."""
    orig = pol.select

    def select(layer, q, store, scale):
        sync()
        t0 = time.perf_counter()
        sel = orig(layer, q, store, scale)
        sync()
        times.append(time.perf_counter() - t0)
        return sel

    pol.select = select


def _agreeing_select(pol, agree):
    """Wrap ``pol.select`` (device search): also choose each searched tree's pages on the host."""
    orig = pol.select

    def select(layer, q, store, scale):
        sel = orig(layer, q, store, scale)
        trees = pol._trees.get(layer)
        if trees is None or pol.anchor_of[layer] != layer:
            return sel
        saved = dict(pol._stats)
        nthreads = torch.get_num_threads()
        torch.set_num_threads(1)  # one search per call: intra-op teams only slow it down (session 3)
        tok = sel.tokens.cpu()
        qc = q.detach().float().cpu()
        H = store.kv_heads
        G = q.shape[1] // H
        room = pol.cfg.retrieval_tokens
        for b in range(store.batch):
            for h in range(H):
                tree = trees[b * H + h]
                if tree is None or tree.n <= room:
                    continue
                want = set(pol._select_pages(tree, qc[b, h * G : (h + 1) * G], room, scale=scale).tolist())
                got = set(tok[b, h][tok[b, h] >= 0].tolist())
                agree.append((want == got, len(want & got) / max(1, len(want | got))))
        pol._stats = saved
        torch.set_num_threads(nthreads)
        return sel

    pol.select = select


@torch.inference_mode()
def decode_bench(model, base, first, budgets, steps, threads, searches=("host",), agree=False):
    """Fork icecache per budget (and search) from the ``full`` prefill, decode ``steps`` tokens
    greedily. The first fork builds the trees, the others reuse them."""
    rows = []
    # query_chunks=0 (a group's heads split over threads) measured 10x slower on the H200 host: not rerun
    spec = {"graphs": "search=device:graphs=True"}  # the device search captured as CUDA graphs
    runs = [
        (f"icecache:threads={threads}:{spec.get(s, 'search=' + s)}", b, m)
        for b in budgets
        for s in searches
        for m in ("plain", "timed")
    ]
    if agree:
        runs += [(f"icecache:threads={threads}:search=device", b, "agree") for b in budgets]
    runs += [("full", None, "plain")]
    lost = None  # a failure that left the CUDA context unusable (e.g. a device-side assert)
    for policy, budget, mode in runs:
        if lost is not None:
            rows.append(_error_row(policy, budget, mode, f"skipped: the CUDA context was lost earlier ({lost})"))
            continue
        try:
            rows.append(_decode_run(model, base, first, policy, budget, mode, steps))
        except Exception as e:  # report the failing run, go on with the others
            err = f"{type(e).__name__}: {e}".strip()[:600]
            print(f"[gpu_icecache] {policy} budget={budget} mode={mode} FAILED: {err}", file=sys.stderr, flush=True)
            rows.append(_error_row(policy, budget, mode, err))
            if not _cuda_usable():
                lost = f"{policy} budget={budget} mode={mode}: {err[:200]}"
    return rows


def _cuda_usable() -> bool:
    """False when the CUDA context is broken (a device-side assert poisons it for the process)."""
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").sum().item() == 1.0
    except Exception:
        return False


def _error_row(policy, budget, mode, err) -> dict:
    return {
        "policy": "icecache" if policy.startswith("icecache") else policy,
        "spec": policy,
        "mode": mode,
        "search": _search_name(policy),
        "budget": budget,
        "error": err,
    }


def _decode_run(model, base, first, policy, budget, mode, steps) -> dict:
    """One fork of the prefill (``policy`` at ``budget``; ``mode`` plain / timed / agree), ``steps``
    greedy decode steps; its row of the table."""
    t0 = time.perf_counter()
    cache = base.fork(policy, budget if budget is not None else base.config.budget)
    fork_s = time.perf_counter() - t0
    if budget is not None:
        t0 = time.perf_counter()
        cache.policy.flush()  # the prefill trees: built on the pool, or reused from an earlier fork
        trees_s = time.perf_counter() - t0
    else:
        trees_s = 0.0
    times, agreement = [], []
    if mode == "timed":
        _timed_select(cache.policy, times)
    elif mode == "agree":
        _agreeing_select(cache.policy, agreement)
    tok = first
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
    sync()
    dt = time.perf_counter() - t0
    ps = cache.stats().get("policy_stats", {})
    layers = len(cache.policy.info.sparse_layers)
    q = ps.get("query_s", 0.0)
    row = {
        "policy": "full" if budget is None else "icecache",
        "spec": policy,
        "mode": mode,
        "search": _search_name(policy),
        "graph_captures": ps.get("graph_captures"),
        "graph_error": ps.get("graph_error"),
        "budget": budget,
        "query_ms_per_step_synced": sum(times) / steps * 1e3 if times else None,
        "agree_identical": sum(a for a, _ in agreement) / len(agreement) if agreement else None,
        "agree_jaccard": sum(j for _, j in agreement) / len(agreement) if agreement else None,
        "agree_n": len(agreement),
        "fork_s": fork_s,
        "trees_ready_s": trees_s,
        "builds": ps.get("builds"),
        "builds_reused": ps.get("builds_reused"),
        "decode_ms_per_step": dt / steps * 1e3,
        "query_ms_per_step": q / steps * 1e3 if budget is not None else None,
        "q_wait_ms_per_step": ps.get("q_wait_s", 0.0) / steps * 1e3 if budget is not None else None,
        "query_ms_per_layer_step": q / (steps * layers) * 1e3 if budget is not None else None,
        "insert_s": ps.get("insert_s"),
        "tokens_per_selected_page": ps.get("tokens_per_selected_page"),
        "error": None,
    }
    del cache
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/m/qwen.gguf")
    ap.add_argument("--data", default="/tmp/m/evaldata")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--search", default="host", help="comma list of icecache search modes: device,graphs,host")
    ap.add_argument("--agree", action="store_true", help="compare device-search selections with the host's")
    ap.add_argument("--skip-build", action="store_true", help="skip the build benchmark (step 2)")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="run each search mode in its own process (a device-side assert in one mode poisons the CUDA "
        "context of its process only; each process loads the model and prefills again)",
    )
    ap.add_argument("--out", default="ice_speed.json")
    args = ap.parse_args()
    searches = tuple(args.search.split(","))
    if args.isolate and len(searches) > 1:
        result = isolated(args, searches)
    else:
        result = bench(args, searches)
    report(result, args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def isolated(args, searches) -> dict:
    """Each search mode in a child process of this script; their results merged (a failed child is
    one error row; the build benchmark runs in the first child, the ``full`` row is the first's)."""
    result, rows = None, []
    agree_in = "device" if "device" in searches else searches[0]
    with tempfile.TemporaryDirectory() as tmp:
        for i, s in enumerate(searches):
            out = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--search", s, "--out", out]
            for name in ("model", "data", "length", "threads", "budgets", "steps", "seed", "device"):
                cmd += [f"--{name}", str(getattr(args, name))]
            if args.skip_build or i > 0:
                cmd.append("--skip-build")
            if args.agree and s == agree_in:
                cmd.append("--agree")
            print(f"[gpu_icecache] --search {s} in a child process", file=sys.stderr, flush=True)
            rc = subprocess.run(cmd).returncode
            if rc != 0 or not os.path.exists(out):
                rows.append(
                    _error_row(
                        f"icecache:search={s}", None, "all", f"child process for --search {s} exited with rc {rc}"
                    )
                )
                continue
            with open(out) as f:
                child = json.load(f)
            keep = [r for r in child["decode"] if r["policy"] != "full" or result is None]
            rows += keep
            if result is None:
                result = child
    if result is None:
        raise SystemExit("gpu_icecache: every search mode failed (see the errors above)")
    result["decode"] = rows
    result["isolated"] = True
    return result


def bench(args, searches) -> dict:
    t_start = time.perf_counter()
    model, tok = load(args.model, device=args.device)
    ids = prompt_ids(tok, args).to(args.device)
    base = kvdex.Cache(model, "full", budget=64)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=base, use_cache=True, logits_to_keep=1)
        sync()
        prefill_s = time.perf_counter() - t0
    first = out.logits[:, -1:].argmax(-1)
    keys = {lay.layer_idx: lay.store.middle_keys()[0].float().cpu() for lay in base.layers if not lay.dense}
    if args.skip_build:
        build = None
    else:
        build = build_bench(keys, DCIParams(page_size=base.config.page_size), args.threads)
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    dec = decode_bench(model, base, first, budgets, args.steps, args.threads, searches, args.agree)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "machine": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit,
        "context_tokens": ids.shape[1],
        "sparse_layers": len(keys),
        "kv_heads": next(iter(keys.values())).shape[0],
        "threads": args.threads,
        "prefill_full_s": prefill_s,
        "build": build,
        "decode": dec,
        "script_s": time.perf_counter() - t_start,
    }
    print(json.dumps(result, indent=1))
    return result


def report(result, args) -> None:
    b, commit = result["build"], result["commit"]
    n = result["context_tokens"]
    print(f"\nIceCache speed, {result['device']}, {n} tokens, {args.threads} threads, commit {commit}")
    if b is not None:
        print(f"build, one tree of {b['keys_per_tree']} keys on 1 thread: {b['one_tree_1thread_s']:.2f} s "
              f"({b['one_tree_1thread_s_per_32k']:.2f} s per 32k keys)")  # fmt: skip
        print(f"build, all {b['trees']} trees on {args.threads} threads: {b['all_trees_pool_wall_s']:.2f} s wall "
              f"({b['all_trees_pool_s_per_32k_keys']:.3f} s per 32k keys)")  # fmt: skip
    print("| policy | search | mode | budget | fork s | trees s | builds (reused) | decode ms/step | query ms/step "
          "(host time) | query ms/step (synced) | same selection | Jaccard |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    f1 = lambda x: "" if x is None else f"{x:.1f}"  # noqa: E731
    f3 = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    for r in result["decode"]:
        if r.get("error"):
            head = f"| {r['policy']} | {r['search'] or ''} | {r['mode']} | {r['budget'] or ''}"
            print(f"{head} | FAILED: {r['error'][:200]} |")
            continue
        print(
            f"| {r['policy']} | {r['search'] or ''} | {r['mode']} | {r['budget'] or ''} | {r['fork_s']:.2f} | "
            f"{r['trees_ready_s']:.2f} | {r['builds'] or 0} ({r['builds_reused'] or 0}) | "
            f"{r['decode_ms_per_step']:.1f} | "
            f"{f1(r['query_ms_per_step'])} | {f1(r['query_ms_per_step_synced'])} | {f3(r['agree_identical'])} | "
            f"{f3(r['agree_jaccard'])} |"
        )
    print(f"(query, host time: policy_stats.query_s of all {result['sparse_layers']} sparse layers per step -- for "
          "search=device only the time to issue the asynchronous GPU work; synced: a device sync before and after "
          "every select (mode 'timed', its decode ms include those syncs); same selection / Jaccard: mode 'agree', "
          "device vs host page choice per (step, layer, kv head))")  # fmt: skip
    failed = [r for r in result["decode"] if r.get("error")]
    if failed:
        print(f"{len(failed)} run(s) FAILED (rows 'FAILED' above, 'error' in the JSON)")


if __name__ == "__main__":
    main()
