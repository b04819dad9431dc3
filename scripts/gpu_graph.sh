#!/usr/bin/env bash
# Graph decoding for users and more policies (docs/benchmarks.md, "Graph decoding for users and more
# policies"). One part per call, each <= 5 minutes on the H200 (estimates):
#   tests    ~2 min   GPU tests: graph == eager for every graph policy (resident and offloaded), kvdex.generate
#                     with graphs == without (tokens, logits, Cache.stats() bookkeeping), the older graph tests
#   device   ~4 min   Llama-3-8B shape, 32k, batch 1, GPU-resident: eager vs graph ms/token for
#                     quest, chess, arkvale, prkv, snapkv, h2o, streaming, oracle
#   offload  ~3 min   the same, offloaded with a device page cache of 256 slots: quest, chess, arkvale, prkv
# usage: bash scripts/gpu_graph.sh PART [OUTDIR]     (repo root; OUTDIR default runs/graph)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
part=${1:?usage: gpu_graph.sh tests|device|offload [OUTDIR]}
out=${2:-runs/graph}
mkdir -p "$out"
B="python -m kvdex.cli bench --shape llama3-8b --contexts 32k --batches 1 --budget 2048 --graph --baselines none \
   --steps 60 --warmup 10 --split-steps 0 --check-context 2048"

summary() {  # graph vs eager ms/token per policy, from $1/bench.json
  python - "$1/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d.get("graph_check", []):
    print(f"check {c['method']:<26} max rel dlogit {c['max_rel']:.1e} {c['counts']} ok={c['ok']} {c.get('reason') or ''}")
rows = {r["method"]: r for r in d["results"]}
print(f"\n{'method':<22} {'eager ms':>9} {'graph ms':>9} {'graph p90':>9} {'graph mean':>10} {'speed-up':>8}  graph steps")
for m, r in rows.items():
    if m.endswith("+graph"):
        continue
    g = rows.get(m + "+graph")
    e = r.get("ms_median")
    if r["status"] != "ok" or g is None or g["status"] != "ok":
        print(f"{m:<22} {r['status']} / {None if g is None else g['status']}: {r.get('error') or (g or {}).get('error')}")
        continue
    print(f"{m:<22} {e:>9.2f} {g['ms_median']:>9.2f} {g['ms_p90']:>9.2f} {g['ms_mean']:>10.2f} "
          f"{e / g['ms_median']:>7.1f}x  {g.get('graph_counts')}")
if d.get("error"):
    print("ERROR:", d["error"])
PY
}

case $part in
tests)
  python -m pytest tests/test_graph.py tests/test_bench.py -q -m gpu -p no:cacheprovider 2>&1 | tail -25
  exit $? ;;
device)
  $B --policies quest,chess,arkvale,prkv,snapkv,h2o,streaming,oracle --storages device --out "$out/device" \
     2>&1 | grep -E "^(check|graph)" ; summary "$out/device" ;;
offload)
  $B --policies quest,chess,arkvale,prkv --storages offload --page-cache 256 --out "$out/offload" \
     2>&1 | grep -E "^(check|graph)" ; summary "$out/offload" ;;
*)
  echo "unknown part $part"; exit 2 ;;
esac
