"""GPU check + timing of ``kvdex eval --decode graph`` against ``--decode eager`` (issue 3).

Runs two short tasks on a real model both ways, each into its own temporary results folder, and
checks that the predictions are identical; prints decode seconds per policy, eager vs graph:

* ``ruler`` at 8k, 3 subtasks (niah_single_2, niah_multikey_1: short answers; cwe: up to 120 tokens),
  1 sample each;
* ``passkey`` at 8k, 2 depths, answers of <= 12 tokens: the short-decode case, where one capture
  (plus its eager warm-up step) has the fewest replays to pay for it.

Policies: full + quest, pariskv, prkv, snapkv at budget 256 (``--policies`` / ``--budget``). A warm-up
(passkey at 2k, both modes, thrown away) loads every kernel first (Triton JIT included); the timed
graph runs go before the eager ones, so any warm-up left over is charged to graphs.

Usage (repo root, ~1-2 minutes on an H200)::

    PYTHONPATH=. python scripts/gpu_eval_decode.py --model /tmp/m/qwen.gguf --data /tmp/m/evaldata

Exit status 1 when a prediction differs between the modes, a graph-capable run never replayed, or
a graph run failed. Graph replay runs the same kernels as an eager step under static sizing (the
whole slot buffer / index capacity, masked), which equals dynamic sizing up to float rounding
(tests/test_graph.py: 1e-5 in fp32). In bf16 a near-tie could in principle flip a greedy token; a
difference is printed (sample, policy, both predictions), not hidden.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HOW = ("decode", "decode_steps", "decode_reason", "decode_s", "prefill_s")


def run(task, model, tok, out: Path, mode: str, policies, budget: int, length: int, dtype: str, samples: int = 1):
    from kvdex.eval.runner import EvalConfig, run_task

    cfg = EvalConfig(
        "qwen", policies, [budget], [length], samples=samples, out=str(out), progress=False, dtype=dtype, decode=mode
    )
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t0 = time.perf_counter()
    res = run_task(task, model, tok, cfg)
    sync()
    return res, time.perf_counter() - t0


def per_run(results) -> dict:
    """policy -> {decode_s, steps, replays, captures, eager, capture_s, reasons, preds}."""
    out = {}
    for r in results:
        recs = r.records()
        s = {"decode_s": sum(x["decode_s"] for x in recs), "preds": [], "reasons": set()}
        for k in ("eager", "captures", "replays", "capture_s"):
            s[k] = sum(x.get("decode_steps", {}).get(k, 0) for x in recs)
        s["steps"] = s["eager"] + s["replays"]
        for x in recs:
            s["preds"].append({k: v for k, v in x.items() if k not in HOW})
            if x.get("decode_reason"):
                s["reasons"].add(x["decode_reason"])
        out[r.policy if r.budget is None else f"{r.policy}@{r.budget}"] = s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/m/qwen.gguf")
    ap.add_argument("--data", default="/tmp/m/evaldata")
    ap.add_argument("--policies", default="quest,pariskv,prkv,snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--keep", action="store_true", help="keep the temporary results folders")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs: exits 1)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import kvdex
    from kvdex.eval import models
    from kvdex.eval.tasks.passkey_grid import PasskeyTask
    from kvdex.eval.tasks.ruler import RulerTask

    gpu = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    print(f"kvdex {kvdex.__version__}, torch {torch.__version__}, {gpu}")
    t0 = time.perf_counter()
    model, tok = models.load(a.model, None, device=a.device, dtype="auto")
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"model {a.model} ({dtype}) loaded in {time.perf_counter() - t0:.1f} s")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    root = Path(tempfile.mkdtemp(prefix="kvdex_eval_decode_"))
    tasks = {
        "ruler": (RulerTask(subtasks=["niah_single_2", "niah_multikey_1", "cwe"], data_root=a.data), a.length),
        "passkey": (PasskeyTask(depths=[25, 75], max_new_tokens=12), a.length),
    }
    bad = []
    t0 = time.perf_counter()
    for mode in ("graph", "eager"):  # warm-up: every kernel of both paths loaded / JIT-compiled
        run(PasskeyTask(depths=[50], max_new_tokens=24), model, tok, root / f"warm_{mode}", mode, policies,
            a.budget, min(2048, a.length), dtype)  # fmt: skip
    print(f"warm-up {time.perf_counter() - t0:.1f} s")
    table = []
    for name, (task, length) in tasks.items():
        stats, wall = {}, {}
        for mode in ("graph", "eager"):
            try:
                out = root / f"{name}_{mode}"
                res, wall[mode] = run(task, model, tok, out, mode, policies, a.budget, length, dtype)
            except Exception:
                traceback.print_exc()
                bad.append(f"{name}: the {mode} run failed")
                break
            stats[mode] = per_run(res)
        if len(stats) < 2:
            continue
        print(f"\n{name} L={length}: wall {wall['eager']:.1f} s eager, {wall['graph']:.1f} s graph")
        for pol in stats["eager"]:
            e, g = stats["eager"][pol], stats["graph"][pol]
            same = e["preds"] == g["preds"]
            if not same:
                bad.append(f"{name} {pol}: predictions differ")
                for pe, pg in zip(e["preds"], g["preds"], strict=True):
                    if pe != pg:
                        print(f"  DIFF {pol} {pe.get('sample_id')}:\n    eager {pe}\n    graph {pg}")
            if g["replays"] == 0:
                bad.append(f"{name} {pol}: no graph replay ({'; '.join(sorted(g['reasons'])) or '?'})")
            if g["reasons"]:
                print(f"  {pol}: eager steps because: {'; '.join(sorted(g['reasons']))}")
            table.append((name, pol, e, g, same))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"results kept in {root}")
    print("\ndecode seconds per policy (sum over samples; steps = decode steps after the prefill's token)")
    hdr = (
        f"{'task':8} {'policy':14} {'steps':>5} {'eager s':>8} {'graph s':>8} {'speedup':>7} {'eager ms/t':>10} "
        f"{'graph ms/t':>10} {'replays':>7} {'capt':>4} {'capt s':>6} same"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, pol, e, g, same in table:
        n = max(g["steps"], 1)
        print(
            f"{name:8} {pol:14} {g['steps']:5d} {e['decode_s']:8.2f} {g['decode_s']:8.2f} "
            f"{e['decode_s'] / max(g['decode_s'], 1e-9):6.1f}x {1e3 * e['decode_s'] / n:10.1f} "
            f"{1e3 * g['decode_s'] / n:10.1f} {g['replays']:7d} {g['captures']:4d} {g['capture_s']:6.2f} "
            f"{'yes' if same else 'NO'}"
        )
    for name in tasks:
        rows = [(e, g) for t, _, e, g, _ in table if t == name]
        if rows:
            es, gs = sum(e["decode_s"] for e, _ in rows), sum(g["decode_s"] for _, g in rows)
            print(f"{name:8} {'all':14} {'':5} {es:8.2f} {gs:8.2f} {es / max(gs, 1e-9):6.1f}x")
    print("\n" + ("OK: graph == eager predictions, graphs replayed" if not bad else "FAILED:\n  " + "\n  ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
