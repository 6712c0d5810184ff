#!/usr/bin/env bash
# One device call: the CUDA tests and the H200 benchmarks. Usage (on the GPU machine):
#   bash scripts/gpu_sweep.sh [what...]   what: tests bench8 benchdroid (default: all)
# Writes logs and JSON/PNG under $OUT (or out/ when unset); the tables print last.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${*:-tests bench8 benchdroid}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
for w in $what; do
  case $w in
    tests) timeout 240 python3 -m pytest -q -rs -x test/test_fast_path.py -k "gpu or fast or graph or buckets" 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
    bench8) timeout 420 python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout 8img \
              --modes "${MODES8:-eager,static,ctxkv,fused,compile,graphs,fast}" --baseline --json "$OUT/bench_4b_8img.json" 2>&1 | tee "$OUT/bench8.log" | grep -v Warning | tail -14 ;;
    benchdroid) timeout 300 python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout droid \
              --modes eager,fast --json "$OUT/bench_4b_droid.json" 2>&1 | tee "$OUT/benchdroid.log" | tail -6 ;;
  esac
done
