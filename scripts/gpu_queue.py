"""Run a queue of ``kvdex eval`` commands on the GPU machine within one call's time limit.

    python3 scripts/gpu_queue.py QUEUE_FILE --deadline 560 --res /tmp/res --out "$OUT"

Each non-empty, non-comment line of QUEUE_FILE is one shell command. They run in order, each
killed when the deadline is reached. ``kvdex eval`` skips finished runs and resumes interrupted
ones at their first missing sample, so calling this again with the same queue (while the
machine's /tmp survives) continues where the last call stopped. Afterwards the results folder
is packed into ``$OUT/res.tar.gz`` and the log into ``$OUT/queue.log`` (the device returns only
a few files per call).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("queue")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds for the whole queue")
    ap.add_argument("--res", default="/tmp/res", help="results folder to pack")
    ap.add_argument("--out", required=True, help="where res.tar.gz and queue.log go")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "queue.log").open("a")
    cmds = [ln.strip() for ln in Path(args.queue).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    # commands that finished (rc 0) in an earlier call are not run again (scripts do not resume)
    finished = Path(args.res) / "queue_finished.txt"
    finished.parent.mkdir(parents=True, exist_ok=True)
    already = set(finished.read_text().splitlines()) if finished.exists() else set()
    done = 0
    for cmd in cmds:
        if cmd in already:
            done += 1
            continue
        left = args.deadline - (time.time() - t0)
        if left < 20:
            print(f"[queue] out of time before: {cmd}", file=log, flush=True)
            break
        s = time.time()
        print(f"[queue] start ({left:.0f} s left): {cmd}", file=log, flush=True)
        try:
            r = subprocess.run(cmd, shell=True, stdout=log, stderr=subprocess.STDOUT, timeout=left)
            status = f"rc={r.returncode}"
            if r.returncode == 0:
                done += 1
                with finished.open("a") as f:
                    f.write(cmd + "\n")
        except subprocess.TimeoutExpired:
            status = "killed at the deadline (will resume)"
        print(f"[queue] {status} after {time.time() - s:.0f} s: {cmd}", file=log, flush=True)
    print(f"[queue] {done}/{len(cmds)} commands finished in {time.time() - t0:.0f} s", file=log, flush=True)
    log.close()
    res = Path(args.res)
    if res.exists():
        with tarfile.open(out / "res.tar.gz", "w:gz") as tar:
            tar.add(res, arcname=res.name)
    sys.stdout.write((out / "queue.log").read_text()[-6000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
