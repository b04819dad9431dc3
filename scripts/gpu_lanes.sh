#!/usr/bin/env bash
# Run several GPU queues at once on a multi-GPU machine, one lane (queue) per GPU, as daemons that
# outlive the device call that starts them (they run until the machine is given back).
#   bash scripts/gpu_lanes.sh start QUEUE0 [QUEUE1 ...]   lane i runs QUEUEi on GPU i: results /tmp/res$i, log /tmp/lane$i/queue.log
#   bash scripts/gpu_lanes.sh report OUTDIR [TAIL]          each lane's last TAIL log lines (default 40) and a tar of
#                                                            every /tmp/res* into OUTDIR (safe while lanes still run)
# A queue line `wait-model` blocks until /tmp/m/ready exists (the model copy finished in a later call).
# Model-free lanes can start in the first call while the model is still being copied.
set -u
cmd=${1:?usage: gpu_lanes.sh start QUEUE... | report OUTDIR [TAIL]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
case $cmd in
start)
  i=0
  for q in "$@"; do
    q=$(realpath "$q")
    mkdir -p /tmp/lane$i /tmp/res$i
    # `wait-model` lines become a wait loop; every lane uses its own results folder
    sed -e "s#^wait-model\$#while [ ! -f /tmp/m/ready ]; do sleep 2; done#" -e "s#/tmp/res\b#/tmp/res$i#g" "$q" > /tmp/lane$i/queue.txt
    (cd "$here" && CUDA_VISIBLE_DEVICES=$i PYTHONUNBUFFERED=1 setsid nohup python3 scripts/gpu_queue.py \
       /tmp/lane$i/queue.txt --deadline "${LANE_DEADLINE:-1600}" --res /tmp/res$i --out /tmp/lane$i \
       > /tmp/lane$i/stdout.txt 2>&1 < /dev/null &)
    echo "lane $i on GPU $i: $q"
    i=$((i + 1))
  done ;;
report)
  out=${1:?report OUTDIR}
  n=${2:-40}
  mkdir -p "$out"
  for d in /tmp/lane*; do
    [ -f "$d/queue.log" ] || continue
    echo "===== $(basename "$d")"
    grep -v "GGUF\|Loading weights\|past_key_values.update\|^ *$\|UserWarning\|warnings.warn\|it/s\]\|s/it\]" "$d/queue.log" | tail -n "$n"
    cp "$d/queue.log" "$out/$(basename "$d").log"
  done
  tar -czf "$out/res.tar.gz" -C /tmp $(cd /tmp && ls -d res* 2>/dev/null) 2>/dev/null
  ls -la "$out" | tail -n +2 ;;
*)
  echo "unknown command $cmd"; exit 2 ;;
esac
