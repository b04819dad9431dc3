# Over 400 lines: the whole demo a newcomer runs (model, prompt, one prefill, the rows, the legend) in one place.
"""``kvdex demo``: passkey retrieval, one prefill, kvdex's policies at a small budget.

The defaults depend on the device: on a CPU a 1000-token prompt, 6 new tokens and seven policies
(:data:`CPU_POLICIES`: ``full``, ``streaming`` and the sparse ones), about a minute on two cores; on a CUDA
device a 6000-token prompt, 16 new tokens and also ``oracle`` (:data:`CUDA_POLICIES`).
``--length``, ``--max-new-tokens`` and ``--policies`` override them.

What it does, in order:

1. loads the model (default: SmolLM2-135M-Instruct, installed by ``kvdex models fetch smollm2``,
   see :mod:`kvdex.models`) and builds one passkey prompt (:mod:`kvdex.eval.passkey`);
2. prefills the prompt ONCE into a ``full`` kvdex cache and takes the first answer token from the
   prefill's logits;
3. for every policy, forks the prefilled cache (``cache.fork(policy=..., budget=...)``) and decodes
   greedily from there with ``model.generate``, with a progress bar per policy (on stderr);
4. prints the settings and one row per policy: whether the key was retrieved, tokens attended per
   decode step per kv head (and their share of the context), the bytes of the keys and values held on
   the device and on the host, and the row's wall time (its fork and decode); then a legend: what each
   column means and which rows are expected to miss the key, and why.
   On a CUDA device it also decodes the prompt with transformers' own dense cache and shows each
   policy's decode speed next to it (ms/token and the speed-up) and the peak device memory of its
   decode. On a CPU it shows no timings: kvdex's speed comes from its CUDA kernels and graphs, and
   CPU timings say nothing about it (``kvdex bench`` measures speed on a GPU).

ms/token (CUDA only) is decode only: a stopping criterion stamps the time after every generated
token and the table shows the median gap between consecutive stamps (one decode forward plus
generate's own per-token work); prefill and generate's start-up are outside every gap.
``--threads`` sets torch's CPU threads (on a busy shared CPU, 1 avoids waits for descheduled threads).

``--no-fork`` prefills anew for every policy (a fresh ``kvdex.Cache`` passed to ``generate``),
which checks that forking changes nothing; it is slower by one prefill per policy.
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass, field

import torch

import kvdex
from kvdex import models
from kvdex.cli_options import add_cache_options, cache_config_from_args
from kvdex.eval import passkey
from kvdex.hf.compat import TRANSFORMERS_VERSION, cache_kwargs
from kvdex.hf.generate import timed_generate
from kvdex.hf.model_parts import head_geometry, text_config

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
# Policies that miss a needle in the middle of the context by design, and why (the legend under the table).
BY_DESIGN = {
    "streaming": "keeps only the sink and the newest tokens (StreamingLLM) by design and drops the middle of the "
    "context, where the needle is",
}


@dataclass
class Row:
    policy: str
    completion: str
    correct: bool
    stats: dict
    ms_per_token: float | None
    tokens: list[int] = field(default_factory=list)
    peak_bytes: int | None = None  # peak device memory during the decode (CUDA only)
    seconds: float | None = None  # wall time of the row: the fork (or prefill) and the decode


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache: kvdex.Cache) -> torch.Tensor:
    """Run the prompt through ``model`` into ``cache``; returns the greedy first token [B, 1]."""
    mask = torch.ones_like(input_ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].argmax(-1, keepdim=True)


def _generate(model, input_ids, cache, max_new_tokens: int, pad_token_id, bar=None) -> tuple[list[int], float | None]:
    """:func:`kvdex.hf.generate.timed_generate` that also ticks ``bar`` (a tqdm bar) per token."""
    return timed_generate(model, input_ids, cache, max_new_tokens, pad_token_id, None if bar is None else bar.update)


def decode_forked(
    model,
    tokenizer,
    input_ids,
    first,
    base: kvdex.Cache,
    policy: str,
    budget: int,
    max_new_tokens: int,
    *,
    bar=None,
    **overrides,
) -> tuple[list[int], float | None, kvdex.Cache]:
    """Decode from a fork of the prefilled ``base`` cache; the first token came from the prefill.
    ``bar``: a tqdm bar of ``max_new_tokens`` ticked per token (the prefill's first one included)."""
    cache = base.fork(policy=policy, budget=budget, **overrides)
    if bar is not None:
        bar.set_postfix_str("decoding")
        bar.update(1)  # the first token, from the prefill
    if max_new_tokens <= 1 or first.item() == tokenizer.eos_token_id:
        return first[0].tolist(), None, cache
    ids = torch.cat([input_ids, first], 1)
    new, ms = _generate(model, ids, cache, max_new_tokens - 1, tokenizer.pad_token_id, bar)
    return first[0].tolist() + new, ms, cache


def decode_fresh(
    model, tokenizer, input_ids, policy: str, budget: int, max_new_tokens: int, *, bar=None, **cache_args
) -> tuple[list[int], float | None, kvdex.Cache]:
    """Prefill and decode with a new cache (the path ``fork`` saves)."""
    cache = kvdex.Cache(model, policy=policy, budget=budget, **cache_args)
    if bar is not None:
        bar.set_postfix_str("prefill and decoding")
    new, ms = _generate(model, input_ids, cache, max_new_tokens, tokenizer.pad_token_id, bar)
    return new, ms, cache


def _bar(name: str, total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"{name:>10}", unit="tok", leave=False, dynamic_ncols=True)
    bar.set_postfix_str("forking the prefill")
    return bar


def run(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    answer: str,
    policies,
    budget: int,
    max_new_tokens: int,
    fork: bool = True,
    progress: bool = False,
    **cache_args,
) -> tuple[list[Row], float | None]:
    """Decode ``input_ids`` [1, L] with every policy. Returns the rows and the prefill time (ms, fork only).
    ``progress``: a tqdm bar per policy (stderr), ticked per generated token."""
    rows, prefill_ms = [], None
    if fork:
        # The prefill is dense whatever the policy; the base stays on the device, forks may offload.
        storage = {"offload": cache_args.get("offload", False), "page_cache": cache_args.get("page_cache", 0)}
        base = kvdex.Cache(model, policy="full", budget=budget, **{**cache_args, "offload": False, "page_cache": 0})
        t0 = time.perf_counter()
        first = prefill(model, input_ids, base)
        prefill_ms = (time.perf_counter() - t0) * 1e3
    cuda = input_ids.device.type == "cuda"
    for name in policies:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        bar = _bar(name, max_new_tokens, progress)
        t0 = time.perf_counter()
        try:
            if fork:
                ids, ms, cache = decode_forked(
                    model, tokenizer, input_ids, first, base, name, budget, max_new_tokens, bar=bar, **storage
                )
            else:
                ids, ms, cache = decode_fresh(
                    model, tokenizer, input_ids, name, budget, max_new_tokens, bar=bar, **cache_args
                )
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - t0
        text = tokenizer.decode(ids, skip_special_tokens=True)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        rows.append(Row(name, text, passkey.score(answer, text), cache.stats(), ms, ids, peak, seconds))
        del cache
    return rows, prefill_ms


def dense_baseline(model, tokenizer, input_ids, answer: str, max_new_tokens: int) -> Row:
    """The same greedy decode with transformers' own dense cache (no kvdex cache): the speed reference."""
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    new, ms = timed_generate(model, input_ids, None, max_new_tokens, tokenizer.pad_token_id)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if input_ids.device.type == "cuda" else None
    text = tokenizer.decode(new, skip_special_tokens=True)
    stats = {"attended_tokens_per_step": float(input_ids.shape[1]), "kv_bytes_device": None, "kv_bytes_host": 0}
    return Row("transformers (dense)", text, passkey.score(answer, text), stats, ms, new, peak, seconds)


# ---- printing -------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def format_table(rows: list[Row], context: int | None = None, baseline: Row | None = None) -> str:
    """One row per policy. With a ``baseline`` (transformers' dense cache, CUDA only) the table adds
    decode speed -- ms/token and the speed-up over the baseline -- and each decode's peak device memory."""
    head = ["policy", "correct", "attended/step/head", "device KV", "host KV", "time"]
    if baseline is not None:
        head += ["ms/token", "vs dense", "peak device mem"]
    head.append("completion")
    body = []
    for r in ([baseline] if baseline is not None else []) + list(rows):
        att = r.stats.get("attended_tokens_per_step")
        share = f" ({min(att / context, 1.0):.0%})" if att is not None and context else ""  # decoded tokens add up
        dev = r.stats["kv_bytes_device"]
        cells = [
            r.policy,
            "yes" if r.correct else "NO",
            "-" if att is None else f"{att:.0f}{share}",
            "-" if dev is None else _mib(dev),
            _mib(r.stats["kv_bytes_host"]),
            "-" if r.seconds is None else f"{r.seconds:.1f} s",
        ]
        if baseline is not None:
            ms, ref = r.ms_per_token, baseline.ms_per_token
            cells += [
                "-" if ms is None else f"{ms:.1f}",
                "-" if ms is None or not ref else f"{ref / ms:.2f}x",
                "-" if r.peak_bytes is None else _mib(r.peak_bytes),
            ]
        cells.append(repr(r.completion.strip()[:40]))
        body.append(tuple(cells))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def kv_bytes(model, tokens: int) -> tuple[int, str]:
    """Bytes of the keys and values of ``tokens`` tokens in every layer of ``model``, and the product
    that gives them: layers x kv heads x tokens x head_dim x 2 (keys and values) x dtype bytes."""
    layers = text_config(model).num_hidden_layers
    _, kv_heads, head_dim = head_geometry(model)
    item = model.dtype.itemsize
    total = layers * kv_heads * tokens * head_dim * 2 * item
    return total, f"{layers} layers x {kv_heads} kv heads x {tokens} tokens x {head_dim} x 2 (k, v) x {item} bytes"


def format_legend(
    rows: list[Row],
    answer: str,
    depth: float,
    budget: int,
    offload: bool,
    max_new_tokens: int,
    kv: tuple[int, str] | None = None,
    cuda: bool = False,
) -> str:
    """What each column of :func:`format_table` means, and which rows are expected to miss the key and why.
    ``kv``: :func:`kv_bytes` of the context, to show how the device KV figure is made."""
    device = (
        "bytes of the keys and values held on the device: every token's with --offload off (the same for every "
        "policy: they save attention reads, not memory), the sink, the window and the working set of selected "
        "tokens with --offload"
    )
    if kv is not None:
        device += (
            f". The {rows[0].policy} row's context: {kv[1]} = {_mib(kv[0])} (a row that stopped early holds fewer)"
        )
    lines = [
        "columns:",
        f"  correct             whether the completion holds the pass key {answer}",
        f"  attended/step/head  tokens attended per decode step per kv head in the sparse layers (mean), and their "
        f"share of the context: full attends all of it, the others at most the budget ({budget})",
        f"  device KV           {device}",
        "  host KV             bytes of the keys and values held in host memory: the middle of the context with "
        "--offload, else none",
        f"  time                wall time of the row: forking the prefill (the policy indexes the prompt) and "
        f"decoding {max_new_tokens} tokens" + ("" if cuda else " on this CPU (not kvdex's speed: see `kvdex bench`)"),
        "  completion          the first 40 characters of the answer",
    ]
    middle = 0.05 < depth < 0.95
    expected = [(r.policy, BY_DESIGN[r.policy.split(":")[0]]) for r in rows if r.policy.split(":")[0] in BY_DESIGN]
    if middle and expected:
        lines.append(f"expected to miss the key (the needle is at depth {depth:.2f}):")
        lines += [f"  {name:<18}  {why}" for name, why in expected]
    return "\n".join(lines)


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
    print(format_legend(rows, answer, args.depth, args.budget, args.offload, args.max_new_tokens, kv, cuda))
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kvdex.demo", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
