#!/usr/bin/env bash
# Session 7 (issue 3), second start: every command its own process, several per GPU.
# The free-running recall decodes are CPU-bound (GPU at 10-15 %), so one process per (task, policy)
# on 4 GPUs finishes in the time of the longest one instead of a lane's sum.
#   bash scripts/queues/s7_parallel.sh FULL_DIRS     start all; results /tmp/rp/NAME, logs /tmp/rp/NAME.log
# FULL_DIRS holds session 6's finished `full` runs (ruler 32k, longbench v2, passkey 8k/16k, ppl 16k):
# copied into each output folder, they are skipped when their settings hash matches (same block of
# reference scores as session 6's tables), and re-run otherwise.
set -u
full=${1:?FULL_DIRS}
M="--model /tmp/m/qwen.gguf --data /tmp/m/evaldata --no-progress"
FREE="recall --mode free --budgets 256 --lengths 8k --steps 4096 --every 64"
MATH="math --dataset math500 --budgets 256 --lengths 2048 --samples 15"
jobs=(
  "0 ruler_ice32k ruler --policies icecache --budgets 256 --lengths 32k --samples 2"
  "0 ppl_ice16k ppl --policies full,icecache --budgets 256 --lengths 16k --samples 2 --tokens 512"
  "0 free_oracle $FREE --policies oracle"
  "0 free_quest $FREE --policies quest"
  "0 math_a $MATH --policies pariskv,quest,icecache"
  "1 lb2_ice longbench --version v2 --policies icecache --budgets 256 --lengths 32k --samples 30"
  "1 lb2_chess longbench --version v2 --policies chess --budgets 256 --lengths 32k --samples 30"
  "1 free_streaming $FREE --policies streaming"
  "1 free_icecache $FREE --policies icecache"
  "1 math_b $MATH --policies prkv,arkvale,snapkv"
  "2 pk_ice8k passkey --policies icecache --budgets 64,128,256 --lengths 8k --samples 1"
  "2 pk_ice16k passkey --policies icecache --budgets 64,128,256 --lengths 16k --samples 1"
  "2 free_pariskv $FREE --policies pariskv"
  "2 free_chess $FREE --policies chess"
  "3 free_prkv $FREE --policies prkv"
  "3 free_arkvale $FREE --policies arkvale"
  "3 free_snapkv $FREE --policies snapkv"
  "3 free_h2o $FREE --policies h2o"
  "3 prkv_sweep recall --policies prkv:static_ratio=0.0,prkv:static_ratio=0.5,prkv:static_ratio=0.75,prkv:static_ratio=1.0 --budgets 256 --lengths 8k,32k --samples 1 --steps 320 --every 8"
)
mkdir -p /tmp/rp
for j in "${jobs[@]}"; do
  set -- $j
  gpu=$1 name=$2 task=$3
  shift 2
  out=/tmp/rp/$name
  mkdir -p "$out/$task"
  for d in "$full"/"$task"__*; do [ -d "$d" ] && cp -r "$d" "$out/$task/"; done
  (CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 setsid nohup sh -c \
    "while [ ! -f /tmp/m/ready ]; do sleep 2; done; t=\$(date +%s); python3 -m kvdex.eval.cli $* $M --out $out; \
     echo \"$name rc=\$? after \$((\$(date +%s) - t)) s\"" > /tmp/rp/$name.log 2>&1 < /dev/null &)
  echo "GPU $gpu: $name"
done
