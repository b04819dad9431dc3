"""ParisKV's ablation metric: coarse and end-to-end Recall@k of the retrieval, over decoding steps.

The model decodes densely (exact attention, so every policy sees the same queries and keys) while
each ParisKV variant indexes the same pages as they leave the window; at sampled steps and layers
every variant searches with the real decode query and is scored against the exact top-k keys by
``<q_mean, k>`` (``kvdex.policies.pariskv.recall_at_k``): ``coarse`` = top-k by collision votes alone,
``e2e`` = top-k after the 4-bit rerank of the candidate pool. Free-running (greedy) decoding over
thousands of steps shows drift: new keys are indexed with analytic centroids (``pariskv``) or with
k-means centroids frozen at prefill (``pariskv-kmeans``).

    PYTHONPATH=. python scripts/pariskv_recall.py --model smollm2 --length 3k --steps 64 --every 16
    PYTHONPATH=. python scripts/pariskv_recall.py --model /tmp/m/qwen.gguf --length 8k --steps 4096 --every 256 \\
        --data /tmp/m/evaldata --out pariskv_recall_8k.json
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--policies", type=parse_names, default=["pariskv", "pariskv-kmeans"])
    ap.add_argument("--length", type=lambda s: parse_sizes(s)[0], default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--layers", type=parse_names, default=None, help="layers to measure (default: all sparse)")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--mode", choices=("free", "teacher"), default="free")
    ap.add_argument("--source", default="books")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, help="write the per-step table as JSON here")
    args = ap.parse_args(argv)

    import kvdex

    model, tok = load(args.model, args.gguf, args.device, args.dtype)
    extra = args.steps + 1 if args.mode == "teacher" else 0
    sample = data.long_text_samples(data.data_root(args.data), args.source, tok, args.length, extra, 1, args.seed)[0]
    cache = kvdex.Cache(model, MultiProbe(targets=tuple(args.policies)), budget=16 + 32 + args.k)
    probe = cache.policy  # the cache binds its own copy of the policy
    layers = None if args.layers is None else {int(x) for x in args.layers}
    rows: dict[int, dict[str, list]] = {}
    state = {"step": 0}

    def observer(layer, q, store, aset, scale):
        if state["step"] % args.every or (layers is not None and layer not in layers):
            return
        for name, p in probe.probes.items():
            r = recall_at_k(p, layer, q, store, args.k)
            for key, v in r.items():
                rows.setdefault(state["step"], {}).setdefault(f"{name}/{key}", []).append(v)

    t0 = time.time()
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
    table = {s: {k: float(np.mean(v)) for k, v in m.items()} for s, m in sorted(rows.items())}
    cols = sorted({k for m in table.values() for k in m})
    print(f"# Recall@{args.k}, {args.length} prompt tokens, {args.steps} {args.mode} steps, {time.time() - t0:.0f} s")
    print("step  " + "  ".join(f"{c:>22}" for c in cols))
    for s, m in table.items():
        print(f"{s:<5} " + "  ".join(f"{m.get(c, float('nan')):>22.3f}" for c in cols))
    means = {c: float(np.mean([m[c] for m in table.values() if c in m])) for c in cols}
    print("mean  " + "  ".join(f"{means[c]:>22.3f}" for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "per_step": table, "mean": means}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
