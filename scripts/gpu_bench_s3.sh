#!/usr/bin/env bash
# Issue 8, third GPU session: device page cache, chunked prefill, batch 8, 512k, real-model hit rate.
# One part per call (each well under 9 minutes on the H200; estimates from docs/benchmarks.md):
#   tests  ~2 min   GPU tests of the page cache, chunked prefill, bench, kernels, offload == resident
#   pc     ~4 min   32k/128k batch 1, quest offloaded + CUDA graph: no page cache / cache 256 / cache 256 + fused bookkeeping
#   b8a    ~3 min   batch 8 at 32k: quest resident / offloaded (page cache) + graph vs transformers' DynamicCache
#   b8b    ~4 min   batch 8 at 64k: the same (128k x 8 does not fit: 128 GiB of bf16 KV, see docs/benchmarks.md)
#   b8c    ~6 min   batch 8 at 128k, offloaded + graph + page cache (128 GiB of host KV: needs a host of >= 256 GiB)
#   b512   ~6 min   512k batch 1, offloaded + graph + page cache, chunked prefill (32k tokens a forward)
#   real   ~4 min   page-cache hit rate: Qwen2.5-Coder-0.5B GGUF on essay text vs random weights of its shape
# usage: bash scripts/gpu_bench_s3.sh PART [OUTDIR]     (repo root; OUTDIR default runs/s3)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
part=${1:?usage: gpu_bench_s3.sh tests|pc|b8a|b8b|b8c|b512|real [OUTDIR]}
out=${2:-runs/s3}
mkdir -p "$out"
MODEL=${KVDEX_GPU_MODEL:-/tmp/m/qwen.gguf}
TEXT=${KVDEX_GPU_TEXT:-/tmp/m/evaldata/haystack/PaulGrahamEssays.json}
B="python -m kvdex.cli bench --budget 2048 --steps 100 --warmup 10"

summary() {  # a short table of every bench.json under $out/$part
  python - "$out/$part" <<'EOF'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).rglob("bench.json")):
    d = json.loads(f.read_text())
    for r in d.get("results", []):
        rows.append((f.parent.name, d["config"]["shape"], r.get("page_cache", "-"), r))
print(f"\n{'run':<10} {'shape':<14} {'method':<20} {'ctx':>6} {'b':>2} {'ms/tok':>7} {'p90':>7} {'tok/s':>8} "
      f"{'prefill s':>9} {'pre GB':>6} {'dec GB':>6} {'H2D MB':>7} {'pc':>4} {'pc hit':>6}")
for run, shape, pc, r in rows:
    head = f"{run:<10} {shape:<14} {r['method']:<20} {r['context']:>6} {r['batch']:>2}"
    if r["status"] != "ok":
        print(f"{head} {r['status']}: {r.get('error', '')[:70]}")
        continue
    f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
    print(f"{head} {r['ms_median']:>7.2f} {r['ms_p90']:>7.2f} {r['tokens_per_s']:>8.1f} {r['prefill_s']:>9.1f} "
          f"{f(r.get('prefill_peak_device_gb'), '.1f'):>6} {f(r.get('decode_peak_device_gb'), '.1f'):>6} "
          f"{r['h2d_bytes_per_step'] / 1e6:>7.1f} {pc:>4} {f(r.get('page_cache_hit_rate'), '.3f'):>6}")
EOF
}

case $part in
tests)
  python -m pytest tests/test_page_cache.py tests/test_chunked_prefill.py tests/test_bench.py tests/test_gpu.py \
    tests/test_triton_kernels.py -q -p no:cacheprovider 2>&1 | tail -15
  exit $? ;;
pc)
  $B --shape llama3-8b --contexts 32k,128k --batches 1 --policies quest --storages offload --graph-only \
     --baselines none --split-steps 0 --out "$out/pc/nocache" 2>&1 | grep -v "^ *$" | tail -4
  $B --shape llama3-8b --contexts 32k,128k --batches 1 --policies quest --storages offload --graph-only \
     --baselines none --split-steps 0 --page-cache 256 --out "$out/pc/cache256" 2>&1 | grep -v "^ *$" | tail -4
  KVDEX_PC_FUSED=1 $B --shape llama3-8b --contexts 32k,128k --batches 1 --policies quest --storages offload \
     --graph-only --baselines none --split-steps 0 --page-cache 256 --out "$out/pc/cache256fused" 2>&1 \
     | grep -v "^ *$" | tail -4 ;;
b8a|b8b)
  ctx=$([ "$part" = b8a ] && echo 32k || echo 64k)
  $B --shape llama3-8b --contexts "$ctx" --batches 8 --policies quest --storages device,offload --graph-only \
     --baselines hf/dynamic --split-steps 0 --page-cache 256 --prefill-chunk 8192 --out "$out/$part/run" \
     2>&1 | grep -v "^ *$" | tail -6 ;;
b8c)
  $B --shape llama3-8b --contexts 128k --batches 8 --policies quest --storages offload --graph-only \
     --baselines hf/dynamic --split-steps 0 --page-cache 256 --prefill-chunk 16384 --out "$out/b8c/run" \
     2>&1 | grep -v "^ *$" | tail -6 ;;
b512)
  $B --shape llama3-8b --contexts 512k --batches 1 --policies quest --storages offload --graph-only \
     --baselines none --split-steps 0 --page-cache 256 --prefill-chunk 32768 --out "$out/b512/run" \
     2>&1 | grep -v "^ *$" | tail -4 ;;
real)
  if ! python -c "import gguf" 2>/dev/null; then echo "the gguf package is missing: cannot load $MODEL"; exit 1; fi
  for budget in 2048 512; do
    python -m kvdex.cli bench --model "$MODEL" --text "$TEXT" --contexts 30k --batches 1 --budget $budget \
      --policies quest --storages offload --baselines none --steps 100 --warmup 10 --split-steps 10 \
      --page-cache 256 --out "$out/real/real-$budget" 2>&1 | grep -v "^ *$" | tail -3
    python -m kvdex.cli bench --shape qwen2.5-0.5b --contexts 30k --batches 1 --budget $budget \
      --policies quest --storages offload --baselines none --steps 100 --warmup 10 --split-steps 10 \
      --page-cache 256 --out "$out/real/random-$budget" 2>&1 | grep -v "^ *$" | tail -3
  done ;;
*)
  echo "unknown part $part (tests|pc|b8a|b8b|b8c|b512|real)"; exit 2 ;;
esac
summary
