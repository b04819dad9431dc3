"""``kvdex vllm check``: greedy tokens of vLLM with kvdex's backend against vLLM's default backend.

    kvdex vllm check --model DIR [--policies full,quest,prkv,chess,pariskv] [--budget 0] [--prompt-tokens 1536]

Every engine decodes the same prompts (seeded random token ids of several lengths, served together: continuous
batching, chunked prefill with ``--max-num-batched-tokens``) greedily. With ``--budget 0`` (the default) the budget
covers every prompt and its new tokens, so each policy must give the default backend's tokens, as vLLM's own tests
compare two attention backends (``check_logprobs_close``): identical, or identical up to a first position where the
two greedy tokens differ and each is among the other engine's top ``--logprobs`` tokens there (a near-tie that two
kernels' rounding decides apart; the sequences part there). With a smaller budget the report gives how many tokens
agree; ``--reference transformers`` compares each policy instead with kvdex's transformers path at the same policy and
budget (each prompt alone), where a sparse budget's tokens should be the same up to near-ties that the two prefills'
rounding decides. Each engine runs in a spawned process of its own (:func:`isolated`), vLLM inside it without its
engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); vLLM is imported only there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable
from typing import Any

DEFAULT_POLICIES = "full,quest,prkv,chess,pariskv"


def prompts(lengths: list[int], seed: int = 0, low: int = 1000, high: int = 20000) -> list[list[int]]:
    """Seeded random token ids, one prompt per length."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


def _engine(model: str, kvdex: dict[str, Any] | None, args: argparse.Namespace) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=model, block_size=args.block_size, enforce_eager=not args.cuda_graphs, seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
    )  # fmt: skip
    if kvdex is None:
        return LLM(**kw)
    kw["additional_config"] = {"kvdex": kvdex}
    try:
        return LLM(**kw, attention_backend="CUSTOM")
    except TypeError as e:  # a vLLM whose engine arguments name no attention backend: its environment variable
        if "attention_backend" not in str(e):
            raise
    os.environ["VLLM_ATTENTION_BACKEND"] = "CUSTOM"
    try:
        return LLM(**kw)
    finally:
        os.environ.pop("VLLM_ATTENTION_BACKEND", None)


Top = list[list[dict[int, float]]]  # per prompt, per generated token: {token id: log-probability} of the top ones


def _child(send: Any, fn: Any, args: tuple) -> None:
    try:
        send.send(("ok", fn(*args)))
    except (ValueError, TypeError) as e:  # a mistake in the settings: the parent raises it as it is
        send.send(("raise", e))
    except BaseException as e:  # noqa: BLE001 -- everything goes back to the parent, which raises it
        import traceback

        send.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        send.close()


def isolated(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a fresh (spawned, non-daemonic) process, its result sent back. Each engine of a check runs
    in its own process: one process's second vLLM engine can neither reuse the first one's CUDA-graph memory pool
    (under CUDA graphs it failed an allocator assertion while capturing) nor lose the memory the first one did not
    give back. A ``ValueError`` or ``TypeError`` in the child is raised here as it is; any other failure as
    ``RuntimeError`` with the child's traceback."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        status, value = recv.recv()
    except EOFError:
        status, value = "error", "the process ended without a result"
    proc.join()
    if status == "raise":
        raise value
    if status != "ok":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its process (exit code {proc.exitcode}): {value}")
    return value


def _engine_tokens(
    model: str, kvdex: dict[str, Any] | None, ids: list[list[int]], args: argparse.Namespace
) -> tuple[list[list[int]], Top]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvdex.vllm.plugin import register

    register()
    return _generate(_engine(model, kvdex, args), ids, args.max_tokens, args.logprobs)  # the process ends after it


def _tokens(
    model: str, kvdex: dict[str, Any] | None, ids: list[list[int]], args: argparse.Namespace
) -> tuple[list[list[int]], Top]:
    """Greedy tokens of ``ids`` and their top ``args.logprobs`` log-probabilities, from a fresh engine (kvdex's
    backend with ``kvdex`` settings, else vLLM's default) in a process of its own (:func:`isolated`)."""
    return isolated(_engine_tokens, model, kvdex, ids, args)


def _generate(llm: Any, ids: list[list[int]], max_tokens: int, logprobs: int) -> tuple[list[list[int]], Top]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    top = [[{t: float(lp.logprob) for t, lp in (pos or {}).items()} for pos in (o.outputs[0].logprobs or [])]
           for o in outs]  # fmt: skip
    return tokens, top


def compare(base: list[list[int]], base_top: Top, got: list[list[int]], got_top: Top) -> dict[str, Any]:
    """A policy's greedy tokens against the default backend's, prompt by prompt: ``agree`` (tokens equal at the
    same position), ``first_diff`` (the first position that differs, None where none does), ``margin`` (there, the
    default backend's log-probability of its token minus that of the policy's token, None where unknown), ``match``
    (every prompt identical) and ``close`` (every prompt identical, or its first differing tokens each among the other
    engine's top log-probabilities there: vLLM's ``check_logprobs_close`` rule)."""
    agree = sum(a == b for x, y in zip(got, base, strict=True) for a, b in zip(x, y, strict=False))
    first: list[int | None] = []
    margin: list[float | None] = []
    close = True
    for j, (x, y) in enumerate(zip(base, got, strict=True)):
        i = next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
        if i is None and len(x) != len(y):
            i = min(len(x), len(y))
        first.append(i)
        if i is None:
            margin.append(None)
            continue
        bt = base_top[j][i] if j < len(base_top) and i < len(base_top[j]) else {}
        gt = got_top[j][i] if j < len(got_top) and i < len(got_top[j]) else {}
        a, b = (x[i] if i < len(x) else None), (y[i] if i < len(y) else None)
        margin.append(bt[a] - bt[b] if a in bt and b in bt else None)
        close = close and a is not None and b is not None and b in bt and a in gt
    return {"tokens": got, "match": got == base, "close": close, "agree": agree, "of": sum(len(b) for b in base),
            "first_diff": first, "margin": margin}  # fmt: skip


def transformers_tokens(
    model: Any,
    settings: Any,
    ids: list[list[int]],
    max_tokens: int,
    logprobs: int,
    follow: list[list[int]] | None = None,
) -> tuple[list[list[int]], Top]:
    """kvdex's transformers path on the same prompts: each prompt alone (batch 1) prefilled into a
    ``kvdex.Cache`` with the policy and sizes of ``settings`` (a :class:`~kvdex.vllm.config.VllmSettings`: the same
    policy instance vLLM's requests get, e.g. ``chess`` with ``trigger=interval``), then ``max_tokens`` greedy eager
    decode steps (no end-of-sequence stop, as vLLM's ``ignore_eos``). Returns the tokens and the top ``logprobs``
    log-probabilities of each, as :func:`_generate` does for vLLM. ``follow`` (per prompt, ``max_tokens`` tokens):
    teacher forcing -- each step is fed ``follow``'s token instead of its own greedy one, so every position is
    predicted after the same context as the engine that produced ``follow``."""
    import torch

    import kvdex
    from kvdex.hf.compat import cache_kwargs
    from kvdex.hf.graph import GraphDecoder

    device = next(model.parameters()).device
    c = settings.config
    tokens: list[list[int]] = []
    top: Top = []
    with torch.inference_mode():
        for j, p in enumerate(ids):
            sizes = dict(page_size=c.page_size, sink=c.sink, window=c.window, dense_layers=c.dense_layers)
            cache = kvdex.Cache(model, settings.make_policy(), c.budget, prefill_chunk=c.prefill_chunk, **sizes)
            x = torch.tensor([p], device=device)
            logits = model(input_ids=x, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
            dec = GraphDecoder(model, cache, enabled=False, warn=False)
            row: list[int] = []
            row_top: list[dict[int, float]] = []
            for i in range(max_tokens):
                lp = torch.log_softmax(logits.float(), -1)[0]
                nxt = int(lp.argmax())
                best = torch.topk(lp, logprobs)
                row.append(nxt)
                row_top.append({int(t): float(v) for t, v in zip(best.indices, best.values, strict=True)})
                if i + 1 < max_tokens:
                    fed = nxt if follow is None else follow[j][i]
                    logits = dec.step(torch.tensor([[fed]], device=device))
            tokens.append(row)
            top.append(row_top)
            del dec, cache
    return tokens, top


def _transformers_reference(
    model_dir: str,
    kv: dict[str, dict[str, Any]],
    ids: list[list[int]],
    args: argparse.Namespace,
    follow: dict[str, list[list[int]]],
) -> dict[str, dict[str, tuple[list[list[int]], Top]]]:
    """Per policy of ``kv`` (its kvdex settings, as its vLLM engine got them), :func:`transformers_tokens`
    free-running (``"free"``) and teacher-forced on that policy's vLLM tokens ``follow[policy]`` (``"forced"``), the
    model loaded once (bf16, on the GPU where there is one)."""
    import torch

    import kvdex
    from kvdex.vllm.config import settings_from

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf, _ = kvdex.load(model_dir, dtype=torch.bfloat16, device=device)
    out = {}
    for policy, settings_of in kv.items():
        settings = settings_from({"kvdex": settings_of})
        out[policy] = {
            "free": transformers_tokens(hf, settings, ids, args.max_tokens, args.logprobs),
            "forced": transformers_tokens(hf, settings, ids, args.max_tokens, args.logprobs, follow[policy]),
        }
    return out


def run_check(model: str, policies: list[str], args: argparse.Namespace,
              done: Callable[[str, str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """{"baseline": tokens, policy: {"tokens", "match", "agree", "budget"}} for each policy; with ``--reference
    transformers`` each policy's baseline is kvdex's transformers path at the same policy and budget
    (``reference_tokens`` per policy) instead of vLLM's default backend, and ``forced`` (:func:`compare_forced`)
    compares the two position by position after the same context. Every engine runs in its own process;
    ``done(policy, line)`` is called as each policy's engine finishes (its verdict against vLLM's default backend,
    or, with the transformers reference, which comes after every engine, that it served)."""
    import importlib.util

    from kvdex.vllm.bench_plan import kvdex_settings, more_settings
    from kvdex.vllm.config import settings_from

    more = more_settings(getattr(args, "settings", ""))
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed in this environment: pip install 'kvdex[vllm]' (vllm>=0.26)")
    n = args.prompt_tokens
    longest = n + args.max_tokens
    budget = args.budget or -(-longest // args.block_size) * args.block_size + args.block_size
    graphs = bool(getattr(args, "decode_graphs", False))
    # each policy's engine settings, checked before any engine starts: a mistake stops the check at once
    kv = {p: {"page_size": args.block_size, **kvdex_settings(p, budget, graphs, more)} for p in policies}
    for settings in kv.values():
        settings_from({"kvdex": settings})
    ids = prompts([n, max(1, 3 * n // 4), max(1, n // 2)][: args.requests], seed=args.seed)
    reference = getattr(args, "reference", "vllm")
    report: dict[str, Any] = {"budget": budget, "covering": not args.budget, "reference": reference}
    if reference != "transformers":
        base, base_top = _tokens(model, None, ids, args)
        report |= {"baseline": base, "baseline_top": base_top}
    report["decode_graphs"], report["settings"] = graphs, more
    got = {}
    for p in policies:
        got[p] = tokens, top = _tokens(model, kv[p], ids, args)
        if reference != "transformers":
            report[p] = compare(base, base_top, tokens, top) | {"top": top}
        if done is not None:
            done(p, "served" if reference == "transformers" else verdict(report[p]))
    if reference != "transformers":
        return report
    # after the engines: each ran in its own process, which gave its memory back
    refs = _transformers_reference(model, kv, ids, args, {p: got[p][0] for p in policies})
    for policy in policies:
        tokens, top = got[policy]
        base, base_top = refs[policy]["free"]
        forced = compare_forced(tokens, top, *refs[policy]["forced"])
        report[policy] = compare(base, base_top, tokens, top) | {"top": top, "forced": forced}
        report[policy] |= {"reference_tokens": base, "reference_top": base_top}
    return report


def compare_forced(got: list[list[int]], got_top: Top, ref: list[list[int]], ref_top: Top) -> dict[str, Any]:
    """Position by position, the reference's greedy token after the same context as the engine's (the reference
    teacher-forced on the engine's tokens ``got``): ``agree`` (the same token), ``near`` (different, each among the
    other's top log-probabilities: a near-tie), ``far`` (the rest), ``of`` (positions) and ``first_far``
    (per prompt, the first far position, None where none is)."""
    agree = near = far = 0
    first_far: list[int | None] = []
    for j, (x, y) in enumerate(zip(got, ref, strict=True)):
        first = None
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            if a == b:
                agree += 1
                continue
            gt = got_top[j][i] if i < len(got_top[j]) else {}
            rt = ref_top[j][i] if i < len(ref_top[j]) else {}
            if b in gt and a in rt:
                near += 1
            else:
                far += 1
                first = i if first is None else first
        first_far.append(first)
    return {"agree": agree, "near": near, "far": far, "of": sum(len(x) for x in got), "first_far": first_far}


def verdict(r: dict[str, Any]) -> str:
    """One line of :func:`compare`'s result."""
    if r["match"]:
        return f"same  ({r['agree']}/{r['of']} tokens agree)"
    parts = [f"prompt {j}: token {i}" + ("" if m is None else f" (margin {m:.3f})")
             for j, (i, m) in enumerate(zip(r["first_diff"], r["margin"], strict=True)) if i is not None]  # fmt: skip
    what = "close: a near-tie parts them" if r["close"] else "DIFFERENT"
    return f"{what}  ({r['agree']}/{r['of']} tokens agree; first difference {', '.join(parts)})"


def main(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    width = max(len(p) for p in policies)
    report = run_check(args.model, policies, args, lambda p, line: print(f"[{p}] {line}", flush=True))
    what = "covering the context" if report["covering"] else "sparse"
    against = ("kvdex's transformers path, same policy and budget" if report["reference"] == "transformers"
               else "vLLM's default backend")  # fmt: skip
    print(f"kvdex vllm check: {args.model}, budget {report['budget']} ({what}), greedy tokens vs {against}")
    for p in policies:
        print(f"  {p:<{width}}  {verdict(report[p])}")
        f = report[p].get("forced")
        if f:
            print(f"  {'':<{width}}  teacher-forced on vLLM's tokens: {f['agree']}/{f['of']} the same, {f['near']} "
                  f"near-ties, {f['far']} other differences")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(report[p]["close"] for p in policies)
    return 0 if ok or not (report["covering"] or report["reference"] == "transformers") else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model directory or hub id vLLM loads")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy specs (default: %(default)s)")
    p.add_argument("--budget", type=int, default=0, help="kvdex budget; 0: cover every prompt and its new tokens")
    p.add_argument("--prompt-tokens", type=int, default=1536, help="the longest prompt (others: 3/4 and 1/2 of it)")
    p.add_argument("--requests", type=int, default=3, choices=(1, 2, 3), help="prompts served together")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--block-size", type=int, default=16, help="vLLM's block size = kvdex's page size")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="small: prompts prefill in chunks")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--cuda-graphs", action="store_true", help="vLLM's default CUDA-graph mode instead of eager")
    graphs = "kvdex's setting decode_graphs: each request's decode step replays one graph per layer"
    p.add_argument("--decode-graphs", action="store_true", help=graphs)
    p.add_argument("--settings", default="", help='more kvdex settings, a JSON object (\'{"prefill_attention": '
                   '"flash"}\'; docs/vllm.md lists them)')  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs", type=int, default=5,
                   help="top log-probabilities kept per token: a first difference passes where each token is among the "
                        "other engine's top ones there (vLLM's check_logprobs_close)")  # fmt: skip
    p.add_argument("--reference", choices=("vllm", "transformers"), default="vllm",
                   help="what each policy is compared with: vLLM's default backend (vllm), or kvdex's transformers "
                        "path with the same policy and budget, each prompt alone (transformers: for sparse budgets, "
                        "where dense attention is not the expected answer)")  # fmt: skip
    p.add_argument("--json", default="", help="write the report (tokens included) to this file")


def register(sub: Any) -> None:
    """``kvdex vllm check`` and ``kvdex vllm bench`` (kvdex.cli)."""
    p = sub.add_parser("vllm", help="kvdex inside vLLM (docs/vllm.md): check the attention backend, benchmark it")
    vs = p.add_subparsers(dest="vllm_command", required=True, metavar="SUBCOMMAND")
    what = "greedy tokens of vLLM with kvdex's backend against vLLM's default backend (docs/vllm.md)"
    c = vs.add_parser("check", help=what, description=what[:1].upper() + what[1:] + ".")
    add_arguments(c)
    c.set_defaults(func=main)
    from kvdex.vllm.bench import register as register_bench

    register_bench(vs)  # kvdex vllm bench: serving speed against vLLM's default backend
