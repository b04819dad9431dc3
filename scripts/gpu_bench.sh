#!/usr/bin/env bash
# GPU run of issue 8 (device machine: no install, PYTHONPATH = repo root). Correctness first:
#   1. the Triton kernels vs their twins and the CUDA end-to-end tests (full budget == SDPA, offload == resident);
#   2. kernel micro-benchmarks (scripts/gpu_kernels.py);
#   3. `kvdex bench` (it checks full budget == dense itself before timing).
# usage: bash scripts/gpu_bench.sh OUTDIR [extra kvdex bench arguments, e.g. --contexts 32k,128k --batches 1,8]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${1:?usage: gpu_bench.sh OUTDIR [bench args]}
shift
mkdir -p "$out"
python -m pytest tests/test_triton_kernels.py tests/test_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -4
python scripts/gpu_kernels.py 2>&1 | tee "$out/kernels.txt"
python -m kvdex.cli bench --shape llama3-8b --budget 2048 --out "$out/bench" "$@" 2>&1 | tee "$out/bench.txt"
