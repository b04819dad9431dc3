"""``kvdex vllm bench``: serving speed of vLLM with kvdex's backend against vLLM's default attention backend.

    kvdex vllm bench [--shape llama3-8b] [--contexts 32k,128k] [--concurrency 1,8] [--policies quest,prkv,chess]

For vLLM's default backend and then for each policy, ``vllm serve`` starts as a subprocess on a model folder of the
named shape with dummy (random) weights (``--load-format dummy``; the tokenizer is SmolLM2's, whose ids all lie
inside the shape's vocabulary), and vLLM's own load generator, ``vllm bench serve`` (random prompts of each context
length, ``--max-concurrency`` of each concurrency, ``--ignore-eos``), measures output tokens/s, TPOT and TTFT. One
server serves every context and concurrency of its backend. ``bench.json`` in ``--out`` keeps every row with the
raw metrics of vLLM's saved result; a rerun skips the rows already there (measured on the same GPU), so a grid can
be run in several invocations, each stopped cleanly at ``--max-minutes``. vLLM runs only in the subprocesses.
What runs and what is recorded, without running it: :mod:`kvdex.vllm.bench_plan`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvdex.bench.report import ctx
from kvdex.vllm.bench_plan import (
    DEFAULT_ROW,
    METRICS,
    bench_command,
    expected_requests,
    label,
    load,
    max_model_len,
    num_prompts,
    pending,
    put,
    read_result,
    save,
    serve_command,
    settings_of,
    table,
    versions,
    with_ratios,
    write_model_dir,
)

__all__ = ["DEFAULT_ROW", "METRICS", "Server", "main", "register", "run", "settings_of", "table", "with_ratios"]


def _clock() -> float:
    return time.monotonic()


class ServerError(RuntimeError):
    """``vllm serve`` exited or did not answer in time."""


class Deadline(Exception):
    """``--max-minutes`` came while a server started."""


def _tail(path: Path, n: int = 6) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.is_file() else []
    return " / ".join(lines[-n:]) or f"no output (log {path})"


class Server:
    """One ``vllm serve`` subprocess (its own process group), up from ``__enter__`` (``/v1/models`` answers) to
    ``__exit__`` (the group stopped: SIGTERM, SIGKILL after a grace period)."""

    def __init__(self, cmd: list[str], port: int, log: Path, deadline: float, timeout: float = 1200.0):
        self.cmd, self.port, self.log, self.deadline, self.timeout = cmd, port, log, deadline, timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> Server:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                raise ValueError(f"port {self.port} is in use (a server left from an earlier run?): stop it or "
                                 "pass another --port")  # fmt: skip
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.log, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait(self) -> None:
        t0 = _clock()
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerError(f"vllm serve exited with {self.proc.returncode} before serving: {_tail(self.log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        self.startup_s = _clock() - t0
                        print(f"  server up in {self.startup_s:.0f} s ({self.attention_backend()})", flush=True)
                        return
            except OSError:
                pass
            if _clock() > self.deadline:
                raise Deadline
            if _clock() - t0 > self.timeout:
                late = f"vllm serve did not answer /v1/models within {self.timeout:.0f} s"
                raise ServerError(f"{late}: {_tail(self.log)}")
            time.sleep(2)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 30.0)):
            if self._gone(sig, grace):
                break
        self.proc = None
        self.out.close()

    def _gone(self, sig: int, grace: float) -> bool:
        """Send ``sig`` to the server's process group; whether every process of it ended within ``grace`` s."""
        assert self.proc is not None
        pgid = self.proc.pid  # start_new_session: the group's id is the server's pid
        end = _clock() + grace
        while True:
            self.proc.poll()  # reaps the server once it exits
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return True
            if _clock() > end:
                return False
            sig = 0  # sent once; from here on only: is any process of the group left (vLLM's engine core)?
            time.sleep(0.5)

    def _found(self, pattern: str) -> list[str]:
        return re.findall(pattern, self.log.read_text(errors="replace") if self.log.is_file() else "")

    def attention_backend(self) -> str | None:
        """The attention backend vLLM's log names (``CUSTOM`` for kvdex's, ``FLASH_ATTN``...), None if unnamed."""
        found = self._found(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+)(?: attention)? backend")
        return found[-1] if found else None

    def kvdex_messages(self) -> list[str]:
        """kvdex's warnings in the server's log so far (a kernel of vLLM's refused, decode graphs off...), once each."""
        return list(dict.fromkeys(m.strip() for m in self._found(r"kvdex: [^\n]+")))


def gpu_name() -> str | None:
    """The GPU's name from torch, in a subprocess (so this process holds no CUDA context beside vLLM's)."""
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    try:
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return got.stdout.strip() or None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text)


def _check_installed(todo: list) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed in this environment: pip install 'kvdex[vllm]'")
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if any(p for p, _, _ in todo) and not any(ep.value.startswith("kvdex.vllm") for ep in plugins):
        raise ValueError("kvdex's vllm.general_plugins entry point is not installed, so vLLM would not register the "
                         "CUSTOM backend: pip install -e . (or pip install kvdex) in this environment")  # fmt: skip


def run(s: dict[str, Any], out: Path, model_dir: Path, max_minutes: float = 0, retry: bool = False,
        dry_run: bool = False) -> dict[str, Any]:  # fmt: skip
    """Measure the rows of grid ``s`` not yet in ``out``/bench.json, saving after each; stops cleanly (no new
    server or row, a row still running killed and not recorded) ``max_minutes`` after the start. Returns the record."""
    start = _clock()
    deadline = start + max_minutes * 60 if max_minutes > 0 else float("inf")
    out.mkdir(parents=True, exist_ok=True)
    record = load(out, s)
    gpu = None if dry_run else gpu_name()
    todo = pending(record, s, gpu, retry)
    model = write_model_dir(s["shape"], model_dir, max_model_len(s)).resolve()
    backends = list(dict.fromkeys(p for p, _, _ in todo))
    if dry_run:
        for policy in backends:
            print(shlex.join(serve_command(model, policy, s)))
            if s.get("warmup_len"):
                warm = out / "results" / f"warmup-{_slug(label(policy))}.json"
                print("  " + shlex.join(bench_command(model, max(s["contexts"]), 1, s, warm, warmup=True)))
            for _, c, n in (t for t in todo if t[0] == policy):
                result = out / "results" / f"{_slug(label(policy))}_{ctx(c)}_c{n}.json"
                print("  " + shlex.join(bench_command(model, c, n, s, result)))
        return record
    if todo:
        _check_installed(todo)
    record.update(settings={**record["settings"], **s}, versions=versions(), gpu=gpu)
    stopped, startup = "", 60.0  # the longest server start seen so far
    for policy in backends:
        if _clock() > deadline - startup:
            stopped = "too little time left for the next server start"
            break
        cmd = serve_command(model, policy, s)
        print(f"[{_clock() - start:5.0f} s] vllm serve, {label(policy)}", flush=True)
        try:
            with Server(cmd, s["port"], out / "logs" / f"serve-{_slug(label(policy))}.log", deadline) as server:
                startup = max(startup, server.startup_s)
                stopped = _warm_up(out, model, policy, s, deadline)
                print("".join(f"  {m}\n" for m in server.kvdex_messages()), end="", flush=True)  # before the rows
                for _, c, n in (t for t in todo if t[0] == policy and not stopped):
                    stopped = _row(record, out, model, (policy, c, n), s, gpu, server, deadline)
                    save(out, record)
                    if stopped or not server.alive():
                        break
        except Deadline:
            stopped = "--max-minutes came while a server started"
        except ServerError as e:
            print(f"  {label(policy)}: {e}", flush=True)
            for _, c, n in (t for t in todo if t[0] == policy):
                put(record, {"label": label(policy), "policy": policy, "context": c, "concurrency": n, "gpu": gpu,
                             "num_prompts": num_prompts(n, s["prompts_per_concurrency"]), "status": "error",
                             "error": str(e), "serve_command": cmd})  # fmt: skip
        save(out, record)
        if stopped:
            break
    left, failed = pending(record, s, gpu), len(pending(record, s, gpu, retry=True)) - len(pending(record, s, gpu))
    record["complete"] = not left and not failed
    save(out, record)
    print(f"kvdex vllm bench: {s['shape']} (dummy weights), budget {s['budget']}, {s['output_len']} output tokens, "
          f"{gpu or 'GPU not named'}; x: the metric over the default backend's row")  # fmt: skip
    print(table(record["rows"]))
    if left:
        why = f" ({stopped})" if stopped else ""
        print(f"INCOMPLETE{why}: {len(left)} row(s) left; run the same command again to continue ({out}/bench.json)")
    if failed:
        print(f"{failed} row(s) recorded as errors (bench.json, {out}/logs): --retry-errors measures them again")
    return record


def _bench(cmd: list[str], log: Path, timeout: float) -> int | None:
    """Run ``vllm bench serve``, its output into ``log``: its exit status, None where ``timeout`` s ran out."""
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def _warm_up(out: Path, model: Path, policy: str | None, s: dict[str, Any], deadline: float) -> str:
    """Before a server's rows, one request of the grid's longest prompt and ``s["warmup_len"]`` output tokens, so
    that first-use costs (Triton compiling kvdex's kernels, the first captures) fall outside the measured rows.
    Returns why the run stops ('' to go on); a failed warm-up is a :class:`ServerError`."""
    if not s.get("warmup_len"):
        return ""
    stem = f"warmup-{_slug(label(policy))}"
    result, log = out / "results" / f"{stem}.json", out / "logs" / f"bench-{stem}.log"
    for folder in (result.parent, log.parent):
        folder.mkdir(parents=True, exist_ok=True)
    t0 = _clock()
    rc = _bench(bench_command(model, max(s["contexts"]), 1, s, result, warmup=True), log, max(1.0, deadline - t0))
    if rc is None:
        return f"--max-minutes came during the warm-up of {label(policy)}"
    if rc:
        raise ServerError(f"its warm-up request failed (vllm bench serve exited with {rc}): {_tail(log)}")
    print(f"  warm-up request: {_clock() - t0:.0f} s", flush=True)
    return ""


def _row(record: dict[str, Any], out: Path, model: Path, row: tuple[str | None, int, int], s: dict[str, Any],
         gpu: str | None, server: Server, deadline: float) -> str:  # fmt: skip
    """Measure one row into ``record``; returns why the run stops ('' to go on)."""
    policy, context, conc = row
    name = f"{label(policy)} at {ctx(context)} x {conc}"
    known = [r.get("wall_s", 0.0) for r in record["rows"] if (r["context"], r["concurrency"]) == (context, conc)]
    if _clock() + max(known, default=0.0) > deadline:
        return f"too little time left for {name}"
    stem = f"{_slug(label(policy))}_{ctx(context)}_c{conc}"
    result, log = out / "results" / f"{stem}.json", out / "logs" / f"bench-{stem}.log"
    for folder in (result.parent, log.parent):
        folder.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    cmd = bench_command(model, context, conc, s, result)
    print(f"  vllm bench serve, {name}", flush=True)
    t0 = _clock()
    rc = _bench(cmd, log, max(1.0, deadline - t0))
    if rc is None:
        return f"--max-minutes came during {name}, not recorded"
    entry: dict[str, Any] = {
        "label": label(policy), "policy": policy, "context": context, "concurrency": conc, "gpu": gpu,
        "num_prompts": num_prompts(conc, s["prompts_per_concurrency"]), "wall_s": round(_clock() - t0, 1),
        "max_model_len": max_model_len(s), "attention_backend": server.attention_backend(),
        "kvdex_messages": server.kvdex_messages(),
        "vllm": record["versions"].get("vllm"), "serve_command": server.cmd, "bench_command": cmd,
    }  # fmt: skip
    try:
        if rc:
            raise ValueError(f"vllm bench serve exited with {rc}: {_tail(log)}")
        entry |= read_result(result) | {"status": "ok", "result_file": str(result.relative_to(out))}
        got, want = entry["raw"].get("total_output_tokens"), expected_requests(conc, s) * s["output_len"]
        if entry["raw"].get("failed"):
            entry |= {"status": "error", "error": f"{entry['raw']['failed']} request(s) failed (log {log})"}
        elif (got is not None and got < want) or not server.alive():  # --ignore-eos: every request its output_len
            entry |= {"status": "error", "error": f"{got} of {want} output tokens came back; server alive: "
                      f"{server.alive()} (log {server.log})"}  # fmt: skip
    except (ValueError, OSError) as e:
        entry |= {"status": "error", "error": str(e)}
    put(record, entry)
    m = entry.get("metrics") or {}
    slow = ", ".join(f"#{i} {ms:.0f} ms" for i, ms in entry.get("slow_steps") or [])
    tpot = m.get("median_tpot_ms", 0)
    print(f"    {entry['status']}: {m.get('output_throughput', 0):.1f} tok/s, TPOT median {tpot:.2f} ms, "
          f"{entry['wall_s']:.0f} s" + (f"; slowest tokens {slow}" if slow else ""), flush=True)  # fmt: skip
    return ""


def main(args: argparse.Namespace) -> int:
    s = settings_of(args)
    out = Path(args.out)
    model_dir = Path(args.model_dir) if args.model_dir else out / "model"

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through Server.__exit__: the server stops too

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        run(s, out, model_dir, args.max_minutes, args.retry_errors, args.dry_run)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


DESCRIPTION = """\
Serving speed of vLLM with kvdex's attention backend, per policy, against vLLM's default backend (dense
FlashAttention), in one run: for each backend a `vllm serve` subprocess on a model of the named shape with
dummy weights, measured by vLLM's own `vllm bench serve` (random prompts of each context, --ignore-eos) at
each concurrency. Reports output tokens/s, TPOT (median, mean), TTFT (median) and each kvdex row's metrics
over the default backend's. Writes OUT/bench.json; a rerun skips the rows already there (same GPU). Needs
vLLM and the fetched SmolLM2 tokenizer (kvdex models fetch smollm2).

example: kvdex vllm bench --contexts 32k --concurrency 1,8 --policies quest,prkv,chess --max-minutes 9
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--shape", default="llama3-8b", help="model shape (kvdex/bench/shapes.py), dummy weights (default %(default)s)")
    a("--contexts", default="32k,128k", help="prompt lengths in tokens (default %(default)s)")
    a("--concurrency", default="1,8", help="vllm bench serve --max-concurrency values (default %(default)s)")
    a("--skip", default="", help="CONTEXT:CONCURRENCY rows of the grid not to run (--skip 128k:8)")
    a("--policies", default="quest,prkv,chess", help="kvdex policy specs, comma separated (default %(default)s)")
    a("--budget", type=int, default=2048, help="kvdex budget, tokens per kv head and step (default %(default)s)")
    a("--output-len", type=int, default=128, help="output tokens per request (default %(default)s)")
    a("--warmup-len", type=int, help="output tokens of a warm-up request per server (longest context) before its "
      "rows, so each step kind they meet (page joins, prkv's refresh) compiles outside them; 0: none (default: "
      "--output-len)")  # fmt: skip
    a("--prompts-per-concurrency", type=int, default=2,
      help="requests per row: max(concurrency x this, concurrency) (default %(default)s)")  # fmt: skip
    a("--request-rate", default="inf", help="requests/s; inf: every request at once (default %(default)s)")
    a("--gpu-memory-utilization", type=float, default=0.8,
      help="vLLM's share of GPU memory, both backends; the rest leaves room for kvdex's temporary tensors "
           "(default %(default)s)")  # fmt: skip
    a("--enforce-eager", action="store_true", help="no CUDA graphs, both backends (default: vLLM's graph mode)")
    graphs = "kvdex rows with the setting decode_graphs (each request's decode step replays one graph per layer)"
    a("--decode-graphs", action="store_true", help=graphs)
    a("--settings", default="", help='more kvdex settings for every kvdex row, a JSON object '
      '(--settings \'{"prefill_attention": "flash"}\'; docs/vllm.md lists them)')  # fmt: skip
    a("--seed", type=int, default=0, help="prompts and servers (default %(default)s)")
    a("--port", type=int, default=8000, help="the servers' port (default %(default)s)")
    a("--serve-args", default="", help="more vllm serve arguments, both backends (--serve-args='--max-num-seqs 16')")
    a("--out", default="runs/vllm_bench", help="bench.json, results/, logs/, model/ (default %(default)s)")
    a("--model-dir", default="", help="the dummy-weight model folder (default OUT/model)")
    a("--max-minutes", type=float, default=0,
      help="stop cleanly this many minutes after the start, rows so far saved (0: no limit)")  # fmt: skip
    a("--retry-errors", action="store_true", help="measure again the rows recorded as errors")
    a("--dry-run", action="store_true", help="write the model folder, print the commands, run nothing")


def register(vs: Any) -> None:
    """``kvdex vllm bench`` among ``kvdex vllm``'s subcommands (:func:`kvdex.vllm.check.register`)."""
    what = "serving speed of vLLM with kvdex's backend per policy against vLLM's default backend (docs/vllm.md)"
    fmt = argparse.RawDescriptionHelpFormatter
    b = vs.add_parser("bench", help=what, description=DESCRIPTION, formatter_class=fmt)
    add_arguments(b)
    b.set_defaults(func=main)
