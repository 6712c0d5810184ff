#!/usr/bin/env bash
# One device call (issue 22): the fused flow-loop kernel's CUDA tests, the expert benchmark (every
# variant against its floor, each phase alone, batches of 1-8) and vla-bench on the DROID query
# (eager, fast, fast+expert). Logs and JSON under $OUT; tables last.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
timeout "${TESTS_S:-150}" python3 -m pytest -q -rs -x -p no:cacheprovider -m cuda test/test_fused_expert.py 2>&1 \
  | tee "$OUT/tests.log" | tail -4
echo "tests done after $(( $(date +%s) - t0 )) s"
timeout "${EXPERT_S:-330}" python3 scripts/bench_expert_gpu.py --out "$OUT" --budget-s "${EXPERT_BUDGET_S:-280}" \
  ${EXPERT_ARGS:-} 2>&1 | grep -v Warning > "$OUT/expert.log"; tail -${EXPERT_TAIL:-32} "$OUT/expert.log"
echo "expert bench done after $(( $(date +%s) - t0 )) s"
if [ -n "${NCU:-}" ]; then
  NCUBIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  timeout "${NCU_S:-150}" "$NCUBIN" --clock-control none --profile-from-start off --launch-count 9 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats python3 scripts/ncu_expert.py \
    > "$OUT/ncu.txt" 2>&1
  grep -E "flow_kernel|Duration|DRAM Throughput|Registers Per|Warp Cycles Per Issued|spends" "$OUT/ncu.txt" \
    | grep -v "^==PROF" | sed "s/  */ /g" | cut -c1-230 | head -80
  echo "ncu done after $(( $(date +%s) - t0 )) s"
fi
for layout in ${LAYOUTS:-}; do
  timeout "${BENCH_S:-200}" python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout "$layout" \
    --iters 10 --dev-windows 3 --modes "${MODES:-eager,fast,fast+expert}" --json "$OUT/bench_4b_$layout.json" 2>&1 \
    | grep -v Warning > "$OUT/bench_$layout.log"; tail -12 "$OUT/bench_$layout.log"
  echo "vla-bench $layout done after $(( $(date +%s) - t0 )) s"
done
echo "total $(( $(date +%s) - t0 )) s"
