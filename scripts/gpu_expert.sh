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
  ${EXPERT_ARGS:-} 2>&1 | grep -v Warning > "$OUT/expert.log"; tail -32 "$OUT/expert.log"
echo "expert bench done after $(( $(date +%s) - t0 )) s"
if [ -n "${MODES:-}" ]; then
  timeout "${BENCH_S:-200}" python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout "${LAYOUT:-droid}" \
    --iters 10 --dev-windows 3 --modes "$MODES" --json "$OUT/bench_4b_${LAYOUT:-droid}.json" 2>&1 \
    | grep -v Warning > "$OUT/bench.log"; tail -14 "$OUT/bench.log"
fi
echo "total $(( $(date +%s) - t0 )) s"
