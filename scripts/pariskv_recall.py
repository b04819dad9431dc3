"""ParisKV's ablation metric: coarse and end-to-end Recall@k of the retrieval, over decoding steps.

The model decodes densely (exact attention, so every policy sees the same queries and keys) while
each ParisKV variant indexes the same pages as they leave the window; at sampled steps and layers
every variant searches with the real decode query and is scored against the exact top-k keys by
``<q_mean, k>`` (``kvdex.policies.pariskv.recall_at_k``), stage by stage: ``coarse`` = top-k by
collision votes alone, ``pool`` = truth inside the beta candidate pool, ``e2e`` = top-k after the
4-bit rerank of that pool, ``rerank`` = top-k by the 4-bit estimate over every key (no coarse
stage). The default variants are the paper's method, its learned-centroid ablation baseline and
kvdex's mean-centred option (``pariskv:center=True``). Free-running (greedy) decoding over
thousands of steps shows drift: new keys are indexed with analytic centroids (``pariskv``) or with
k-means centroids frozen at prefill (``pariskv-kmeans``).

    PYTHONPATH=. python scripts/pariskv_recall.py --model smollm2 --lengths 3k --steps 64 --every 16
    PYTHONPATH=. python scripts/pariskv_recall.py --model /tmp/m/qwen.gguf --lengths 8k,32k --steps 33 --every 16 \\
        --data /tmp/m/evaldata --out pariskv_recall.json
    PYTHONPATH=. python scripts/pariskv_recall.py --model /tmp/m/qwen.gguf --lengths 8k --steps 4097 --every 256 \\
        --per-step --data /tmp/m/evaldata --out pariskv_drift_8k.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvdex.eval import data
from kvdex.eval.cli import parse_names, parse_sizes
from kvdex.eval.models import load
from kvdex.eval.recall import SelectAll
from kvdex.kernels import pariskv as K
from kvdex.policies import make_policy
from kvdex.policies.pariskv import recall_at_k


@dataclass
class MultiProbe(SelectAll):
    """Dense decode that keeps several ParisKV variants indexed on the same cache (no selection used)."""

    targets: tuple = ("pariskv", "pariskv-kmeans")
    uses_budget = True

    def bind(self, info) -> None:
        super().bind(info)
        self.probes = {}
        for name in self.targets:
            p = make_policy(name)
            p.bind(info)
            self.probes[name] = p

    def index(self, layer, update) -> None:
        for p in self.probes.values():
            p.index(layer, update)


def attention_mass(probes: dict, layer: int, q: torch.Tensor, store, scale: float, budgets) -> dict[str, float]:
    """Where the attention-recall loss of a budget comes from: the true softmax mass (mean over query
    heads; sink + window + the selected middle tokens) of the top ``budget - sink - window`` middle
    tokens chosen by ``oracle`` (summed group attention, the harness's oracle), ``exact`` (exact
    <q_mean, k>: ParisKV's target, the GQA mean query), and per variant ``rerank`` (the 4-bit estimate
    over every middle key: no coarse stage) and the variant's full two-stage pipeline."""
    k, _ = store.dense()
    b, hq, d = q.shape
    h, L = k.shape[1], k.shape[2]
    kf = k.float()
    p = torch.softmax(torch.einsum("bhgd,bhld->bhgl", q.float().view(b, h, hq // h, d), kf) * scale, -1)
    nmid = store.grid.num_middle_pages(store.lengths_host) * store.grid.page_size
    n, sink = int(nmid.max()), store.grid.sink
    if b != 1 or L != int(store.lengths_host[0]):
        raise ValueError("attention_mass measures one unpadded sequence")
    pm = p[..., sink : sink + n]  # [B, H, G, n]
    base = p.sum(-1) - pm.sum(-1)  # sink + window
    qm = q.float().view(b, h, hq // h, d).mean(2)
    exact = torch.einsum("bhd,bhnd->bhn", qm, kf[:, :, sink : sink + n])
    window = L - sink - n
    out = {}

    def mass(sel):  # middle offsets [B, H, T] (-1: none)
        m = torch.zeros(b, h, n + 1, device=q.device)
        m.scatter_(2, torch.where(sel >= 0, sel, n), 1.0)
        return float((base + (pm * m[:, :, None, :n]).sum(-1)).mean())

    for budget in budgets:
        kk = budget - sink - window
        if not 0 < kk < n:
            continue
        out[f"B{budget}/oracle"] = mass(pm.sum(2).topk(kk, -1).indices)
        out[f"B{budget}/exact"] = mass(exact.topk(kk, -1).indices)
        for name, pol in probes.items():
            if layer not in pol.index_:
                continue
            final, _ = pol.search(layer, q, n, nmid, kk)
            out[f"B{budget}/{name}"] = mass(final)
            _, qb, qn = pol.votes(layer, q, n, nmid)
            idx = pol.index_[layer]
            codes, w = idx.codes[:, :, :n].reshape(b * h, n, -1), idx.weight[:, :, :n].reshape(b * h, n, -1)
            every = torch.arange(n, device=q.device).expand(b * h, n)
            est = K.rerank_scores(every, codes, w, qb, qn, pol.consts(q.device)[2], pol.m)
            out[f"B{budget}/{name} rerank-all"] = mass(est.topk(kk, -1).indices.view(b, h, kk))
    return out


def run_length(model, tok, length: int, args) -> dict[int, dict[str, float]]:
    """Prefill ``length`` tokens, decode ``args.steps`` densely; per measured step the mean over
    (layer, kv head) of every variant's stage recalls."""
    import kvdex

    extra = args.steps + 1 if args.mode == "teacher" else 0
    sample = data.long_text_samples(data.data_root(args.data), args.source, tok, length, extra, 1, args.seed)[0]
    cache = kvdex.Cache(model, MultiProbe(targets=tuple(args.policies)), budget=16 + 32 + args.k)
    probe = cache.policy  # the cache binds its own copy of the policy
    layers = None if args.layers is None else {int(x) for x in args.layers}
    rows: dict[int, dict[str, list]] = {}
    state = {"step": 0}

    def observer(layer, q, store, aset, scale):
        if state["step"] % args.every or (layers is not None and layer not in layers):
            return
        row = rows.setdefault(state["step"], {})
        for name, p in probe.probes.items():
            for key, v in recall_at_k(p, layer, q, store, args.k).items():
                row.setdefault(f"{name}/{key}", []).append(v)
        if args.budgets:
            for key, v in attention_mass(probe.probes, layer, q, store, scale, args.budgets).items():
                row.setdefault(key, []).append(v)

    with torch.no_grad():
        ids = torch.tensor([sample.input_ids], device=model.device)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        cache.observer = observer
        cont = sample.meta.get("continuation", [])
        token = int(logits.argmax()) if args.mode == "free" else cont[0]
        for step in range(args.steps):
            state["step"] = step
            logits = model(input_ids=torch.tensor([[token]], device=model.device), past_key_values=cache).logits[0, -1]
            token = int(logits.argmax()) if args.mode == "free" else cont[step + 1]
    return {s: {k: float(np.mean(v)) for k, v in m.items()} for s, m in sorted(rows.items())}


STAGES = ("coarse", "pool", "e2e", "rerank")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", default=None)
    ap.add_argument(
        "--policies",
        type=parse_names,
        default=["pariskv", "pariskv-kmeans", "pariskv:center=True"],
        help="ParisKV variants indexed side by side (NAME:KEY=VALUE options allowed)",
    )
    ap.add_argument("--lengths", "--length", type=parse_sizes, default=[4096], help="prompt lengths, e.g. 8k,32k")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--layers", type=parse_names, default=None, help="layers to measure (default: all sparse)")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument(
        "--budgets",
        type=parse_sizes,
        default=[],
        help="also split the attention recall of these budgets (sink + window included) by stage",
    )
    ap.add_argument("--mode", choices=("free", "teacher"), default="free")
    ap.add_argument("--source", default="books")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--per-step", action="store_true", help="also print the per-step table (drift runs)")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args(argv)

    t_all = time.time()
    model, tok = load(args.model, args.gguf, args.device, args.dtype)
    result = {}
    for length in args.lengths:
        t0 = time.time()
        table = run_length(model, tok, length, args)
        cols = sorted({k for m in table.values() for k in m})
        means = {c: float(np.mean([m[c] for m in table.values() if c in m])) for c in cols}
        result[length] = {"per_step": table, "mean": means, "seconds": time.time() - t0}
        print(f"# {length}: {args.steps} {args.mode} steps, every {args.every}: {time.time() - t0:.0f} s", flush=True)
        if args.per_step:
            print("step  " + "  ".join(f"{c:>22}" for c in cols))
            for s, m in table.items():
                print(f"{s:<5} " + "  ".join(f"{m.get(c, float('nan')):>22.3f}" for c in cols))
    k = args.k
    print(f"\n# Recall@{k} by stage (mean over measured steps, sparse layers, kv heads); truth = exact top-{k} by "
          f"<q_mean, k>\n# coarse: top-{k} by votes; pool: truth inside the beta pool; e2e: after the 4-bit "
          f"rerank of the pool; rerank: 4-bit estimate over every key (no coarse stage)")  # fmt: skip
    w = max(28, *(len(x) for x in args.policies))
    print(f"{'length':>7}  {'variant':<{w}} " + " ".join(f"{s:>7}" for s in STAGES))
    for length, r in result.items():
        for name in args.policies:
            vals = [r["mean"].get(f"{name}/{s}", float("nan")) for s in STAGES]
            print(f"{length:>7}  {name:<{w}} " + " ".join(f"{v:>7.3f}" for v in vals))
    if args.budgets:
        print("\n# attention recall (true softmax mass on sink + window + selected; mean over query heads) by what")
        print("# selects the middle: oracle (group attention), exact <q_mean,k> top-k (ParisKV's target), the 4-bit")
        print("# rerank over every key (no coarse stage), and the two-stage pipeline (votes -> beta pool -> rerank)")
        print(f"{'length':>7} {'budget':>6}  {'variant':<{w}} {'oracle':>7} {'exact':>7} {'rerank':>7} {'2-stage':>7}")
        for length, r in result.items():
            for budget in args.budgets:
                for name in args.policies:
                    cols = ("oracle", "exact", f"{name} rerank-all", name)
                    vals = [r["mean"].get(f"B{budget}/{c}", float("nan")) for c in cols]
                    print(f"{length:>7} {budget:>6}  {name:<{w}} " + " ".join(f"{v:>7.3f}" for v in vals))
    print(f"# total {time.time() - t_all:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "lengths": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
