#!/usr/bin/env bash
# One device call (issues 10, 13): the CUDA tests, the fused action-expert kernels against the
# eager and compiled expert, and the mode ladder on the 8-image molmobot-4b query beside the
# transformers ViT+LLM baseline. Logs and JSON under $OUT; tables last.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
timeout "${TESTS_S:-120}" python3 -m pytest -q -rs -x -p no:cacheprovider -m cuda test/test_fast_path.py test/test_options.py \
  test/test_kernels.py test/test_fused_expert.py 2>&1 | tee "$OUT/tests.log" | tail -4
echo "tests done after $(( $(date +%s) - t0 )) s"
timeout "${EXPERT_S:-120}" python3 scripts/bench_expert_gpu.py --out "$OUT" --budget-s "${EXPERT_BUDGET_S:-80}" 2>&1 \
  | grep -v Warning > "$OUT/expert.log"; tail -16 "$OUT/expert.log"
echo "expert bench done after $(( $(date +%s) - t0 )) s"
timeout "${BENCH_S:-210}" python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout 8img --iters 10 \
  --dev-windows 3 --modes "${MODES8:-eager,graphs,triton,fast,fast+expert}" --baseline --json "$OUT/bench_4b_8img.json" 2>&1 \
  | grep -v Warning > "$OUT/bench8.log"; tail -16 "$OUT/bench8.log"
echo "total $(( $(date +%s) - t0 )) s"
