"""What ``kvdex vllm bench`` (:mod:`kvdex.vllm.bench`) runs and records, without running it: the checked settings,
the dummy-weight model folder, the ``vllm serve`` and ``vllm bench serve`` command lines, the reading of vLLM's saved
result, the ratios to the default backend, the table and the resumable record (``bench.json``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from kvdex.bench.report import ctx, fmt

DEFAULT_ROW = "default"  # vLLM's default attention backend (dense FlashAttention on a Hopper GPU)
METRICS = ("output_throughput", "median_tpot_ms", "mean_tpot_ms", "median_ttft_ms")  # keys of vLLM's result JSON
ITL = ("median_itl_ms", "p99_itl_ms")  # printed from a row's whole result where it has them
# settings a resumed run shares with the rows already recorded (the grid itself may grow)
SAME = ("shape", "budget", "output_len", "prompts_per_concurrency", "request_rate", "gpu_memory_utilization",
        "enforce_eager", "seed", "serve_args", "decode_graphs", "kvdex_settings", "warmup_len")  # fmt: skip
# what a record made before a setting ran with
UNSET: dict[str, Any] = {"decode_graphs": False, "kvdex_settings": {}, "warmup_len": 0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
MARGIN = 256  # max-model-len room over context + output: a random prompt re-encoded may come out a little longer
SERVED = "kvdex-bench"  # --served-model-name
BLOCK_SIZE = 16  # vLLM's --block-size, both backends: kvdex's page size (its default, which the sink is a multiple of)
Row = tuple[str | None, int, int]  # (kvdex policy spec, None for the default backend; context; concurrency)


def parse_lengths(text: str, option: str) -> list[int]:
    """``"32k,128k"`` -> [32768, 131072] (``kvdex bench``'s size lists); a ValueError names ``option``."""
    from kvdex.bench.cli import parse_sizes

    try:
        return sorted(set(parse_sizes(text)))
    except ValueError as e:
        raise ValueError(f"{option} {text!r}: {e}") from None


def parse_skip(text: str, contexts: list[int], concurrency: list[int]) -> list[list[int]]:
    """``--skip "128k:8,32k:1"`` -> [[131072, 8], [32768, 1]]: rows of the grid that are not run (ValueError: the
    fix; each pair must name a context of ``--contexts`` and a concurrency of ``--concurrency``)."""
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        c, sep, n = item.partition(":")
        if not sep:
            raise ValueError(f"--skip {text!r}: give CONTEXT:CONCURRENCY pairs such as 128k:8")
        pair = [parse_lengths(c, "--skip")[0], parse_lengths(n, "--skip")[0]]
        if pair[0] not in contexts or pair[1] not in concurrency:
            raise ValueError(f"--skip {item!r} is not a row of the grid (--contexts x --concurrency)")
        pairs.append(pair)
    return pairs


def kvdex_settings(
    policy: str, budget: int, decode_graphs: bool = False, more: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``additional_config["kvdex"]`` of a kvdex row: the policy, the budget, ``decode_graphs`` when set and the
    other settings of ``--settings``."""
    return {"policy": policy, "budget": budget, **({"decode_graphs": True} if decode_graphs else {}), **(more or {})}


def more_settings(text: str) -> dict[str, Any]:
    """``--settings``: a JSON object of kvdex settings (docs/vllm.md) for every kvdex row, other than the policy and
    budget, which have their own options (ValueError: the fix)."""
    if not text.strip():
        return {}
    example = """'{"prefill_attention": "flash"}'"""
    try:
        more = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--settings must be a JSON object such as {example}: {e}") from None
    if not isinstance(more, dict):
        raise ValueError(f"--settings must be a JSON object such as {example}, got {text!r}")
    own = sorted({"policy", "budget", "decode_graphs"} & set(more))
    if own:
        raise ValueError(f"--settings: give {', '.join(own)} through --policies / --budget / --decode-graphs")
    return more


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings from the parsed arguments, each checked before any server starts (ValueError: the fix)."""
    from kvdex.bench.shapes import SHAPES, shape_names
    from kvdex.vllm.config import settings_from

    if args.shape not in SHAPES:
        raise ValueError(f"unknown --shape {args.shape!r}; shapes: {', '.join(shape_names())}")
    for name, value in (("--output-len", args.output_len), ("--prompts-per-concurrency", args.prompts_per_concurrency)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    warmup = getattr(args, "warmup_len", 0)
    warmup = args.output_len if warmup is None else warmup  # default: as long as the rows' requests
    if warmup < 0:
        raise ValueError(f"--warmup-len must be >= 0 (0: no warm-up request), got {warmup}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if len(set(policies)) != len(policies) or DEFAULT_ROW in policies:
        raise ValueError(f"--policies {args.policies!r}: name each policy spec once ({DEFAULT_ROW!r} is vLLM's row)")
    more = more_settings(getattr(args, "settings", ""))
    for p in policies:  # the engine's own check, so a bad spec or budget fails now, not after a server start
        try:
            settings_from({"kvdex": kvdex_settings(p, args.budget, more=more)})
        except (ValueError, TypeError) as e:
            raise ValueError(f"--policies {p!r}: {e}") from None
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must lie in (0, 1], got {args.gpu_memory_utilization}")
    rate = str(args.request_rate)
    if rate != "inf" and not (re.fullmatch(r"[0-9]*\.?[0-9]+", rate) and float(rate) > 0):
        raise ValueError(f"--request-rate must be inf (every request at once) or requests/s > 0, got {rate!r}")
    contexts = parse_lengths(args.contexts, "--contexts")
    concurrency = parse_lengths(args.concurrency, "--concurrency")
    skip = parse_skip(getattr(args, "skip", ""), contexts, concurrency)
    return {"shape": args.shape, "contexts": contexts, "concurrency": concurrency, "skip": skip, "policies": policies,
            "budget": args.budget, "output_len": args.output_len,
            "prompts_per_concurrency": args.prompts_per_concurrency, "request_rate": rate,
            "block_size": BLOCK_SIZE, "gpu_memory_utilization": args.gpu_memory_utilization,
            "enforce_eager": args.enforce_eager, "seed": args.seed, "serve_args": args.serve_args,
            "decode_graphs": bool(getattr(args, "decode_graphs", False)), "kvdex_settings": more,
            "warmup_len": warmup, "port": args.port}  # fmt: skip


def versions() -> dict[str, str | None]:
    """Installed versions (package metadata: nothing is imported)."""
    out: dict[str, str | None] = {}
    for name in ("vllm", "torch", "transformers", "kvdex"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def num_prompts(concurrency: int, per: int) -> int:
    return max(concurrency * per, concurrency)


def expected_requests(concurrency: int, s: dict[str, Any]) -> int:
    return num_prompts(concurrency, s["prompts_per_concurrency"])


def max_model_len(s: dict[str, Any]) -> int:
    return max(s["contexts"]) + s["output_len"] + MARGIN


def tokenizer_vocab(folder: Path) -> int:
    """One past the largest token id in ``folder``/tokenizer.json (0 where it lists none)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok.get("model", {}).get("vocab", {})
    ids = [*(vocab.values() if isinstance(vocab, dict) else []), *(t["id"] for t in tok.get("added_tokens", []))]
    return max(ids, default=-1) + 1


def write_model_dir(shape: str, dest: Path, max_positions: int) -> Path:
    """A folder vLLM loads with ``--load-format dummy``: ``config.json`` of ``shape`` (bf16, at least
    ``max_positions`` positions) and the tokenizer files of the fetched SmolLM2 (kept where ``dest`` has them)."""
    from kvdex import models
    from kvdex.bench.shapes import SHAPES, make_config

    dest = Path(dest)
    source = models.converted("smollm2")
    if source is None and not (dest / "tokenizer.json").is_file():
        raise ValueError(
            "kvdex vllm bench takes SmolLM2's tokenizer (its 49152 token ids all lie inside the shape's vocabulary) "
            f"from the fetched model: run `kvdex models fetch smollm2` (it installs under {models.models_dir()}; set "
            f"{models.ENV} to choose another folder), or pass --model-dir a folder that holds its tokenizer.json"
        )
    cfg = make_config(shape, max_positions)  # ValueError for an unknown shape
    needed = tokenizer_vocab(source or dest)
    if cfg.vocab_size < needed:
        raise ValueError(f"shape {shape} has a vocabulary of {cfg.vocab_size} tokens, SmolLM2's tokenizer {needed}: "
                         "pick a shape with a larger vocabulary (llama3-8b)")  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    if source is not None and source.resolve() != dest.resolve():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, dest / name)
    cfg.architectures = [ARCHITECTURES[SHAPES[shape][0]]]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(dest)
    return dest


def _vllm() -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_command(model: Path, policy: str | None, s: dict[str, Any]) -> list[str]:
    """``vllm serve`` for vLLM's default backend (``policy`` None) or kvdex's backend with ``policy``."""
    cmd = [*_vllm(), "serve", str(model), "--served-model-name", SERVED, "--load-format", "dummy",
           "--dtype", "bfloat16", "--max-model-len", str(max_model_len(s)), "--block-size", str(s["block_size"]),
           "--gpu-memory-utilization", str(s["gpu_memory_utilization"]), "--no-enable-prefix-caching",
           "--seed", str(s["seed"]), "--host", "127.0.0.1", "--port", str(s["port"])]  # fmt: skip
    if s["enforce_eager"]:
        cmd.append("--enforce-eager")
    if policy is not None:
        more = s.get("kvdex_settings", {})
        config = {"kvdex": kvdex_settings(policy, s["budget"], s.get("decode_graphs", False), more)}
        cmd += ["--attention-backend", "CUSTOM", "--additional-config", json.dumps(config)]
    return cmd + shlex.split(s["serve_args"])


def bench_command(model: Path, context: int, concurrency: int, s: dict[str, Any], result: Path,
                  warmup: bool = False) -> list[str]:  # fmt: skip
    """``vllm bench serve`` of one row, its result JSON saved as ``result``; ``warmup``: instead the server's
    warm-up, one request of ``context`` tokens and ``s["warmup_len"]`` output tokens."""
    out_len, prompts = (s["warmup_len"], 1) if warmup else (s["output_len"], expected_requests(concurrency, s))
    return [*_vllm(), "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(s["port"]),
            "--model", SERVED, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(context), "--random-output-len", str(out_len),
            "--random-range-ratio", "0", "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--request-rate", s["request_rate"], "--ignore-eos",
            "--temperature", "0", "--seed", str(s["seed"]), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]  # fmt: skip


def read_result(path: Path) -> dict[str, Any]:
    """``{"metrics": the four reported, "raw": the saved result, "slow_steps": :func:`slow_steps`}`` of a ``vllm
    bench serve`` result JSON (``--save-detailed``: with each request's inter-token latencies; its generated texts
    are left out)."""
    raw = json.loads(Path(path).read_text())
    missing = [k for k in METRICS if raw.get(k) is None]
    if missing:
        raise ValueError(f"{path}: vllm bench serve saved no {', '.join(missing)}")
    raw.pop("generated_texts", None)
    return {"metrics": {k: float(raw[k]) for k in METRICS}, "raw": raw, "slow_steps": slow_steps(raw.get("itls"))}


def slow_steps(itls: list[list[float]] | None, top: int = 5) -> list[list[float]]:
    """The ``top`` slowest output tokens of a row: ``[token, ms]`` (``token``: its index in its request's output, the
    first token being 0; ``ms``: its gap after the token before, the slowest over the row's requests), slowest
    first, from ``vllm bench serve``'s per-request inter-token latencies in seconds ([] without them)."""
    worst: dict[int, float] = {}
    for gaps in itls or []:
        for i, gap in enumerate(gaps, start=1):
            worst[i] = max(worst.get(i, 0.0), float(gap) * 1e3)
    return [[i, round(ms, 1)] for i, ms in sorted(worst.items(), key=lambda kv: -kv[1])[:top]]


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows``, each kvdex row with ``vs_default``: each metric over that of the default backend's row of the same
    context, concurrency and GPU (no ``vs_default`` where that row is missing)."""
    base = {(r["context"], r["concurrency"], r.get("gpu")): r for r in rows
            if r["label"] == DEFAULT_ROW and r["status"] == "ok"}  # fmt: skip
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k != "vs_default"}
        ref = base.get((r["context"], r["concurrency"], r.get("gpu")))
        if r["label"] != DEFAULT_ROW and r["status"] == "ok" and ref is not None:
            r["vs_default"] = {k: r["metrics"][k] / ref["metrics"][k] if ref["metrics"][k] else None for k in METRICS}
        out.append(r)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as text; ``x``: over the default backend's row (tok/s above 1, TPOT and TTFT below 1: faster)."""
    head = ("backend", "context", "conc", "prompts", "out tok/s", "TPOT med ms", "TPOT mean ms", "TTFT med ms",
            "ITL med ms", "ITL p99 ms", "tok/s x", "TPOT med x", "TTFT med x")  # fmt: skip
    lines: list[tuple[str, ...]] = [head]
    gpus = {r.get("gpu") for r in rows}
    for r in sorted(with_ratios(rows), key=lambda r: (str(r.get("gpu")), r["context"], r["concurrency"],
                                                       r["label"] != DEFAULT_ROW, r["label"])):  # fmt: skip
        name = r["label"] if r["label"] == DEFAULT_ROW else f"kvdex {r['label']}"
        name += f" ({r.get('gpu')})" if len(gpus) > 1 else ""
        m, x = r.get("metrics") or {}, r.get("vs_default") or {}
        cells = [fmt(m.get(k), ".1f") for k in METRICS] if r["status"] == "ok" else [r["status"], "", "", ""]
        raw = r.get("raw") or {}  # the inter-token latencies: a TPOT mean far above its median is a few slow steps
        cells += [fmt(raw.get(k), ".1f") if r["status"] == "ok" else "" for k in ITL]
        ratios = [fmt(x.get(k), ".2f") for k in ("output_throughput", "median_tpot_ms", "median_ttft_ms")]
        lines.append((name, ctx(r["context"]), str(r["concurrency"]), str(r["num_prompts"]), *cells, *ratios))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def load(out: Path, s: dict[str, Any]) -> dict[str, Any]:
    """``out``/bench.json (a fresh record where there is none); ValueError where it holds other settings."""
    path = out / "bench.json"
    if not path.is_file():
        return {"settings": s, "rows": []}
    record = json.loads(path.read_text())
    old = record.get("settings", {})
    diff = [f"{k} {old.get(k, UNSET.get(k))!r} -> {s[k]!r}" for k in SAME if old.get(k, UNSET.get(k)) != s[k]]
    if diff:
        raise ValueError(f"{path} holds rows measured with other settings ({'; '.join(diff)}): pass another --out, "
                         "or that run's settings to continue it")  # fmt: skip
    return record


def save(out: Path, record: dict[str, Any]) -> None:
    """Write ``out``/bench.json (whole, then renamed over the old one), ratios recomputed."""
    record["rows"] = with_ratios(record["rows"])
    part = out / "bench.json.part"
    part.write_text(json.dumps(record, indent=1))
    part.replace(out / "bench.json")


def label(policy: str | None) -> str:
    return policy or DEFAULT_ROW


def pending(record: dict[str, Any], s: dict[str, Any], gpu: str | None, retry: bool = False) -> list[Row]:
    """The rows of grid ``s`` (less its ``skip`` pairs) not yet in ``record`` for ``gpu`` (rows recorded as errors
    too where ``retry``), backend by backend: the default backend, then each policy."""
    done = {(r["label"], r["context"], r["concurrency"]) for r in record["rows"]
            if r.get("gpu") == gpu and (r["status"] == "ok" or not retry)}  # fmt: skip
    skip = {(c, n) for c, n in s.get("skip", [])}
    return [(p, c, n) for p in [None, *s["policies"]] for c in s["contexts"] for n in s["concurrency"]
            if (label(p), c, n) not in done and (c, n) not in skip]  # fmt: skip


def put(record: dict[str, Any], row: dict[str, Any]) -> None:
    """Add ``row`` to ``record``, replacing a row of the same backend, context, concurrency and GPU."""
    key = (row["label"], row["context"], row["concurrency"], row.get("gpu"))
    record["rows"] = [r for r in record["rows"] if (r["label"], r["context"], r["concurrency"], r.get("gpu")) != key]
    record["rows"].append(row)
