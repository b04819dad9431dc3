"""``kvdex demo``'s command line: its arguments and defaults (which depend on the device), then the run:
load the model, build the passkey prompt, print the settings, decode every policy
(:mod:`kvdex.demo.decode`) and print the table and its legend (:mod:`kvdex.demo.report`)."""

from __future__ import annotations

import argparse
import platform
import time

import torch

import kvdex
from kvdex import models
from kvdex.cli_options import add_cache_options, cache_config_from_args
from kvdex.demo.decode import dense_baseline, run
from kvdex.demo.report import format_legend, format_table, kv_bytes
from kvdex.eval import passkey
from kvdex.hf.compat import TRANSFORMERS_VERSION

CPU_POLICIES = ("full", "streaming", "quest", "icecache", "pariskv", "chess", "prkv")
CUDA_POLICIES = ("full", "oracle", "streaming", "quest", "icecache", "pariskv", "chess", "prkv")
DEFAULT_POLICIES = CUDA_POLICIES  # (the name callers knew; the CPU default is CPU_POLICIES)
# SmolLM2-135M's trained context is 8k. On a CPU every decode step of every policy runs kvdex's eager path
# (a Python step per layer) and the prefill runs on two cores: 1000 tokens and 6 new tokens (the five
# digits of the key and one more) keep the whole demo near a minute; SmolLM2 answers with `full` there.
CUDA_LENGTH, CPU_LENGTH = 6000, 1000
CUDA_NEW_TOKENS, CPU_NEW_TOKENS = 16, 6
DEFAULT_LENGTH = CUDA_LENGTH
DEFAULT_BUDGET = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="a known name (smollm2, qwen05b: `kvdex models fetch NAME`), a Hugging Face id, a local directory "
        "or a .gguf file (default: smollm2)",
    )
    p.add_argument("--gguf", help="name of a GGUF file inside --model")
    p.add_argument(
        "--length",
        type=int,
        help=f"prompt length in tokens (default {CPU_LENGTH} on a CPU, {CUDA_LENGTH} on a CUDA device)",
    )
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="picks the pass key (default %(default)s)")
    p.add_argument(
        "--policies",
        help="comma-separated names or specs with options, e.g. prkv:rerank=0 (default on a CPU: "
        f"{','.join(CPU_POLICIES)}; on a CUDA device: {','.join(CUDA_POLICIES)})",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"(default {CPU_NEW_TOKENS} on a CPU: the key's five digits and one more; {CUDA_NEW_TOKENS} on a CUDA "
        "device)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: torch's choice). On a busy shared machine, 1 avoids waits for "
        "descheduled threads",
    )
    p.add_argument(
        "--no-fork",
        dest="fork",
        action="store_false",
        help="prefill anew for every policy instead of forking one prefilled cache",
    )
    add_cache_options(p.add_argument_group("cache (kvdex.CacheConfig)"), defaults={"budget": DEFAULT_BUDGET})


def main(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()  # where kvdex.load puts the model
    if args.policies is None:
        args.policies = ",".join(CUDA_POLICIES if cuda else CPU_POLICIES)
    if args.length is None:
        args.length = CUDA_LENGTH if cuda else CPU_LENGTH
    if args.max_new_tokens is None:
        args.max_new_tokens = CUDA_NEW_TOKENS if cuda else CPU_NEW_TOKENS
    progress = getattr(args, "progress", True)
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--policies names none; valid policies: {', '.join(kvdex.policies())}")
    for name in names:  # a name or a spec with options (prkv:rerank=0); a bad one fails before the slow model load
        kvdex.make_policy(name)
    cache_args = cache_config_from_args(args).to_dict()  # validated before the slow model load
    del cache_args["budget"]
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    model_id, gguf = models.resolve_model(args.model, args.gguf)
    t0 = time.perf_counter()
    model, tok = kvdex.load(model_id, gguf_file=gguf)
    load_s = time.perf_counter() - t0
    prompt, answer = passkey.make_passkey_prompt(tok, args.length, args.depth, args.seed)
    ids = torch.tensor([passkey.encode(tok, prompt)], device=model.device)

    print(f"kvdex {kvdex.__version__} demo: passkey retrieval, one prompt, {len(names)} policies")
    print(
        f"model:    {model_id}{'/' + gguf if gguf else ''} ({type(model).__name__}, {model.dtype}, "
        f"loaded in {load_s:.1f} s)"
    )
    print(
        f"device:   {model.device} ({_device_name(model.device)}); torch {torch.__version__}, "
        f"transformers {TRANSFORMERS_VERSION}, python {platform.python_version()}"
    )
    print(f"prompt:   {ids.shape[1]} tokens, needle at depth {args.depth:.2f}, key {answer} (seed {args.seed})")
    mode = "one prefill, a fork per policy" if args.fork else "a prefill per policy"
    print(
        f"settings: budget {args.budget} tokens/step/kv head, page_size {args.page_size}, sink {args.sink}, "
        f"window {args.window}, dense_layers {args.dense_layers}, offload {args.offload}"
        f"{f', page_cache {args.page_cache}' if args.page_cache else ''}, greedy, "
        f"max_new_tokens {args.max_new_tokens}, {mode}"
    )
    cuda = model.device.type == "cuda"
    if cuda:
        print(
            "speed:    ms/token = median gap between decode steps of model.generate (decode only); "
            "vs dense = transformers' own dense cache's ms/token over the policy's"
        )
    else:
        print(
            "speed:    not measured on a CPU: kvdex's speed comes from its CUDA kernels and graphs. Compare the "
            "answers and the attended tokens here; `kvdex bench` or this demo on a CUDA machine measure speed"
        )
    print(flush=True)
    t0 = time.perf_counter()
    baseline = dense_baseline(model, tok, ids, answer, args.max_new_tokens) if cuda else None
    if progress and args.fork:
        print(f"prefilling {ids.shape[1]} tokens once (each row forks that prefill) ...", flush=True)
    rows, prefill_ms = run(
        model,
        tok,
        ids,
        answer,
        names,
        args.budget,
        args.max_new_tokens,
        fork=args.fork,
        progress=progress,
        **cache_args,
    )
    print(format_table(rows, ids.shape[1], baseline))
    print()
    context = rows[0].stats.get("context_tokens") if rows else None
    kv = kv_bytes(model, context[0]) if context else None
    legend = (rows, answer, args.depth, args.budget, args.offload, args.max_new_tokens, kv, cuda)
    print(format_legend(*legend, context=ids.shape[1]))  # the prompt: the share of it a missing row attended
    print()
    total = time.perf_counter() - t0
    pre = f"prefill {prefill_ms / 1e3:.1f} s, " if prefill_ms is not None else ""
    print(
        f"{pre}prefill + decoding of {len(rows)} policies {total:.1f} s; "
        f"correct: {sum(r.correct for r in rows)}/{len(rows)}"
    )
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, torch threads: {torch.get_num_threads()}"
