#!/usr/bin/env bash
# One device call: the CUDA tests and the H200 benchmarks. Usage (on the GPU machine):
#   bash scripts/gpu_sweep.sh [what...]   what: tests bench8 fp8 streamdroid stream8 (default: all)
# Writes logs and JSON/PNG under $OUT (or out/ when unset); the tables print last.
set -uo pipefail
# Packages missing there (rosbags for the rendered stream scene) travel as wheels in .whl/,
# installed to /tmp/site by the calling command (see BENCHMARKS.md).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${*:-tests bench8 fp8 streamdroid stream8}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
for w in $what; do
  case $w in
    tests) timeout ${TESTS_S:-250} python3 -m pytest -q -rs -p no:cacheprovider -m cuda test/test_fast_path.py test/test_options.py \
              test/test_kernels.py 2>&1 | tee "$OUT/tests.log" | tail -8 ;;
    bench8) timeout ${BENCH_S:-330} python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout 8img \
              --modes "${MODES8:-eager,compile,graphs,triton,fast}" --baseline --json "$OUT/bench_4b_8img.json" 2>&1 | tee "$OUT/bench8.log" | grep -v Warning | tail -12 ;;
    fp8) timeout ${BENCH_S:-330} python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout 8img \
              --modes "${MODESFP8:-eager,fast,fast+fp8,fast+fp8t}" --json "$OUT/bench_4b_8img_fp8.json" 2>&1 | tee "$OUT/fp8.log" | grep -v Warning | tail -8 ;;
    streamdroid) timeout ${BENCH_S:-330} python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout droid --stream 50 \
              --modes "${MODESSTREAM:-eager,fast,fast+stream,fast+fp8t,fast+cache,fast+steps8,fast+adaptive,fast+stream+fp8t,fast+stream+fp8t+cache}" \
              --json "$OUT/stream_4b_droid.json" 2>&1 | tee "$OUT/streamdroid.log" | grep -v Warning | tail -13 ;;
    stream8) timeout ${BENCH_S:-330} python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout 8img --stream 50 \
              --modes "${MODESSTREAM8:-eager,fast,fast+stream,fast+stream+fp8t+cache}" \
              --json "$OUT/stream_4b_8img.json" 2>&1 | tee "$OUT/stream8.log" | grep -v Warning | tail -8 ;;
  esac
done
