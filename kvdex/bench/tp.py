"""``kvdex bench`` under tensor parallelism: one process per GPU, started by ``torchrun``.

    torchrun --nproc-per-node 2 -m kvdex.bench.tp --tp 2 --shape llama3-70b --layers 8 \\
        --contexts 128k --batches 1,4 --budget 2048 --policies full,quest,icecache,pariskv,chess,prkv \\
        --storages device --baselines none

Takes every ``kvdex bench`` option, plus ``--layers`` (fewer layers than the shape, same per-layer
work) and ``--tp`` (the number of ranks, checked against torchrun's). Each rank builds the
random-weight model with transformers' tensor parallelism (``DistributedConfig(tp_plan="auto")``:
the attention and MLP projections sharded over the ranks, so each rank's kvdex cache holds its share
of the kv heads), then runs the same check and measurements as ``kvdex bench`` with the same prompts
(seeded on the CPU). ``--graph`` / ``--graph-only`` capture each rank's decode step in its own CUDA
graph, the tensor-parallel all-reduces included (NCCL collectives are capturable). Every rank writes
``rank<r>/bench.json`` (its own peak device memory); rank 0
prints the table. All ranks must take the same path: a method that runs out of memory on one rank
only would leave the others waiting in a collective (run with headroom).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

import kvdex
from kvdex.bench import cli, report, runner, shapes
from kvdex.bench.config import parse_dtype
from kvdex.hf.loading import random_model


def build_tp_model(cfg: runner.BenchConfig, layers: int = 0):
    """A random-weight model of ``cfg.shape`` sharded over the torchrun ranks (``layers`` > 0: that many layers)."""
    conf = shapes.make_config(cfg.shape, max(cfg.contexts) + cfg.steps + cfg.warmup + 1024)
    if layers:
        conf.num_hidden_layers = layers
    conf._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    model = random_model(conf, parse_dtype(cfg.dtype), tp_plan="auto")
    model.generation_config.eos_token_id = None
    return model


def run_tp(cfg: runner.BenchConfig, layers: int, log=print) -> dict:
    """``runner.run`` for a tensor-parallel model: check, then measure every (context, batch, method)."""
    for p in cfg.policies:
        kvdex.make_policy(p, **cfg.policy_options.get(p, {}))  # unknown policy/option: fail now
    t0 = time.perf_counter()
    model = build_tp_model(cfg, layers)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    log(
        f"model {cfg.shape} ({model.config.num_hidden_layers} layers), tensor parallel over {world} ranks, "
        f"built in {time.perf_counter() - t0:.1f} s"
    )
    result = dict(config=dataclasses.asdict(cfg), versions=runner.versions(), layers=model.config.num_hidden_layers)
    result["tensor_parallel"] = dict(rank=rank, ranks=world)
    methods = cfg.methods()
    if cfg.check:
        checks = runner.check_full_budget(model, cfg, methods)
        result["check"] = checks
        bad = [c["method"] for c in checks if not c["ok"]]
        for c in checks:
            log(f"check {c['method']:<22} max|dlogit| {c['max_abs_dlogit']:.3g} -> {'OK' if c['ok'] else 'FAILED'}")
        if bad:
            result["error"] = f"full-budget check failed for {', '.join(bad)}: not timed"
            methods = [m for m in methods if runner.base_method(m) not in bad]
    rows = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            for method in methods:
                rec = runner.measure(model, method, context, batch, cfg)
                rows.append(rec)
                log(runner._line(rec) + f"  peak {rec.get('decode_peak_device_gb', float('nan')):.1f} GB (rank {rank})")
    result["results"] = rows
    return result


def main(argv: list[str] | None = None) -> int:
    p = cli.build_parser(argparse.ArgumentParser(prog="torchrun ... -m kvdex.bench.tp", description=__doc__))
    p.add_argument("--layers", type=int, default=0, help="layers of the shape to build (0: all)")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel ranks (checked against torchrun's)")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 2:
        raise SystemExit("kvdex.bench.tp runs under torchrun with >= 2 processes: torchrun --nproc-per-node 2 -m ...")
    if args.tp and args.tp != world:
        raise SystemExit(f"--tp {args.tp} but torchrun started {world} processes (--nproc-per-node {args.tp})")
    if args.layers < 0:
        raise SystemExit("--layers must be >= 0")
    cfg = cli.config_from_args(args)
    rank = int(os.environ.get("RANK", "0"))
    log = print if rank == 0 else (lambda s: None)
    out = Path(args.out or f"runs/bench/{cfg.shape}-tp{world}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = run_tp(cfg, args.layers, log=lambda s: log(s) or sys.stdout.flush())
    report.write_json(result, out / f"rank{rank}" / "bench.json")
    if rank == 0:
        print()
        print(report.table(result))
        print(f"\nwrote {out}/rank*/bench.json")
    torch.distributed.destroy_process_group()
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
