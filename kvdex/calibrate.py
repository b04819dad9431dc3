"""``kvdex calibrate chess``: the offline calibration of CHESS's rebuild thresholds (§3.3, §5.1).

The paper decodes a calibration set with full attention, collects the entropy and varentropy of
the output distribution, aggregates them per page of generated tokens (Figure 4) and takes the
99th percentiles as the thresholds above which generation counts as uncertain. This module does
exactly that and writes a JSON file the policy loads with ``chess:thresholds=FILE``:

    {"entropy": p99 of the per-page mean entropy,
     "varentropy": p99 of the per-page mean varentropy (the output distribution's, per step),
     "temporal_varentropy": p99 of the per-page variance of the per-step entropy,
     ...provenance: model, source, lengths, pages, command}

Calibration prompts are disjoint from the evaluation harness's by default: the harness takes the
*first* samples of each LongBench dataset, calibration the *last* ones (``--from-start`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

SOURCES = ("longbench1", "longbench2", "books")


def page_statistics(h: torch.Tensor, v: torch.Tensor, page_tokens: int) -> dict[str, torch.Tensor]:
    """Per-step entropy/varentropy [T] of one generation -> per complete page of ``page_tokens``
    steps: mean entropy, mean varentropy, variance of the entropy (the policy's three statistics)."""
    n = (h.numel() // page_tokens) * page_tokens
    if n == 0:  # shorter than one page: no statistic (the policy never checks such a generation either)
        return {k: torch.zeros(0, dtype=torch.float64) for k in ("entropy", "varentropy", "temporal_varentropy")}
    hp = h[:n].double().view(-1, page_tokens)
    vp = v[:n].double().view(-1, page_tokens)
    return {
        "entropy": hp.mean(1),
        "varentropy": vp.mean(1),
        "temporal_varentropy": hp.var(1, unbiased=False),
    }


def thresholds(stats: dict[str, torch.Tensor], percentile: float = 99.0) -> dict[str, float]:
    """The ``percentile`` of each statistic over every calibration page (linear interpolation)."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    out = {}
    for key, x in stats.items():
        if x.numel() == 0:
            raise ValueError("no complete page of generated tokens: generate more tokens (--new-tokens) or samples")
        out[key] = float(torch.quantile(x.double(), percentile / 100))
    return out


@torch.inference_mode()
def generation_statistics(model, input_ids: list[int], new_tokens: int, stop_ids=()) -> tuple[torch.Tensor, ...]:
    """Greedy decode with full attention; entropy/varentropy [T] of every decode step's distribution.

    Like the policy (which sees decode steps only), the prefill's distribution is not counted.
    """
    from kvdex.eval.runner import forward_token, prefill
    from kvdex.policies.chess import entropy_varentropy

    cache, logits = prefill(model, input_ids, {})
    tok = int(logits.argmax())
    hs, vs = [], []
    stop = set(stop_ids)
    for _ in range(new_tokens):
        if tok in stop:
            break
        logits = forward_token(model, cache, tok)
        h, v = entropy_varentropy(logits[None])
        hs.append(h)
        vs.append(v)
        tok = int(logits.argmax())
    if not hs:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(hs).cpu(), torch.cat(vs).cpu()


def calibration_samples(
    source: str, tokenizer, length: int, n: int, seed: int, from_start: bool, data_root=None, datasets=None
):
    """``n`` prompts (per LongBench v1 dataset) of about ``length`` tokens, by default from the end."""
    from kvdex.eval import data

    if source == "books":
        return data.long_text_samples(data.data_root(data_root), "books", tokenizer, length, 0, n, seed + 7919)
    if source not in SOURCES:
        raise ValueError(f"unknown calibration source {source!r}; choose from {', '.join(SOURCES)}")
    from kvdex.eval.tasks.longbench import LongBenchTask

    v1 = source == "longbench1"
    task = LongBenchTask(version="v1" if v1 else "v2", datasets=datasets if v1 else None, data_root=data_root)
    every = task.samples(tokenizer, length, 10**6, seed)
    groups = defaultdict(list)
    for s in every:
        groups[s.meta.get("dataset", "v2")].append(s)
    return [s for g in groups.values() for s in (g[:n] if from_start else g[-n:])]


def calibrate_chess(args: argparse.Namespace) -> int:
    from kvdex.eval import models
    from kvdex.eval.runner import environment, stop_token_ids

    if args.new_tokens < args.page_tokens:
        raise ValueError(f"--new-tokens ({args.new_tokens}) must be >= --page-tokens ({args.page_tokens})")
    model, tok = models.load(args.model, args.gguf, device=args.device, dtype=args.dtype)
    datasets = [d for d in (args.datasets or "").split(",") if d] or None
    samples = calibration_samples(
        args.source, tok, args.length, args.samples, args.seed, args.from_start, args.data, datasets
    )
    stops = () if args.ignore_eos else stop_token_ids(tok, model)
    per_page = defaultdict(list)
    steps = 0
    t0 = time.perf_counter()
    for i, s in enumerate(samples):
        h, v = generation_statistics(model, s.input_ids, args.new_tokens, stops)
        steps += h.numel()
        for key, x in page_statistics(h, v, args.page_tokens).items():
            per_page[key].append(x)
        print(f"[{i + 1}/{len(samples)}] {s.id}: {len(s.input_ids)} prompt tokens, {h.numel()} generated", flush=True)
    stats = {k: torch.cat(v) for k, v in per_page.items()}
    th = thresholds(stats, args.percentile)
    out = {
        **th,
        "percentile": args.percentile,
        "page_tokens": args.page_tokens,
        "pages": int(stats["entropy"].numel()),
        "steps": steps,
        "samples": len(samples),
        "source": args.source,
        "datasets": datasets,
        "length": args.length,
        "new_tokens": args.new_tokens,
        "model": models.tag(args.model, args.gguf),
        "summary": {k: {q: float(torch.quantile(x, q / 100)) for q in (50, 90, 99)} for k, x in stats.items()},
        "seconds": round(time.perf_counter() - t0, 1),
        "command": sys.argv,
        "environment": environment(),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        _plot(stats, th, path.with_suffix(".png"), out["model"])
    print(json.dumps({k: round(v, 4) for k, v in th.items()}))
    print(f"wrote {path} ({out['pages']} pages of {args.page_tokens} tokens); use it as chess:thresholds={path}")
    return 0


def _plot(stats, th, path: Path, model: str) -> None:
    """Figure 4's view: per-page mean entropy vs varentropy with the percentile thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("varentropy", "temporal_varentropy"), strict=True):
        ax.scatter(stats["entropy"].numpy(), stats[key].numpy(), s=4, alpha=0.4)
        ax.axvline(th["entropy"], ls="--", c="k")
        ax.axhline(th[key], ls="--", c="k")
        ax.set_xlabel("mean entropy per page (nats)")
        ax.set_ylabel(key.replace("_", " ") + " per page")
    fig.suptitle(f"CHESS calibration, {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``calibrate`` (with the ``chess`` subcommand) to kvdex's main CLI."""
    p = subparsers.add_parser(
        "calibrate",
        help="offline calibration of policy thresholds (CHESS rebuild trigger)",
        description="Offline calibration of policy thresholds.",
    )
    sub = p.add_subparsers(dest="calibrate_policy", required=True, metavar="POLICY")
    c = sub.add_parser(
        "chess",
        help="99th-percentile entropy / varentropy thresholds of CHESS's rebuild trigger",
        description=__doc__.split("\n\n")[1],
    )
    c.add_argument("--model", required=True, help="hub id, local directory, .gguf file, or smollm2 / qwen05b")
    c.add_argument("--gguf", default=None, help="GGUF file name inside --model")
    c.add_argument("--source", choices=SOURCES, default="longbench1", help="calibration prompts (default %(default)s)")
    c.add_argument(
        "--datasets",
        default=None,
        help="longbench1: comma-separated datasets (default all; short answers give no page)",
    )
    c.add_argument("--length", type=int, default=4096, help="prompt tokens (default %(default)s)")
    c.add_argument("--samples", type=int, default=4, help="prompts (per LongBench v1 dataset) (default %(default)s)")
    c.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per prompt (default %(default)s)")
    c.add_argument("--page-tokens", type=int, default=32, help="steps per page statistic (default %(default)s)")
    c.add_argument("--percentile", type=float, default=99.0, help="(default %(default)s)")
    c.add_argument("--ignore-eos", action="store_true", help="generate past EOS (default: a generation stops there)")
    c.add_argument("--from-start", action="store_true", help="take the first samples (the harness's) not the last")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--data",
        default=None,
        help="evaluation data folder (default $KVDEX_DATA): LongBench v1/v2 files or the books, see kvdex.eval.data",
    )
    c.add_argument("--device", default=None)
    c.add_argument("--dtype", default="auto")
    c.add_argument("--plot", action="store_true", help="also write a PNG of the joint distribution (Figure 4)")
    c.add_argument("--out", default="chess_thresholds.json", help="(default %(default)s)")
    c.set_defaults(func=calibrate_chess)
    return p
