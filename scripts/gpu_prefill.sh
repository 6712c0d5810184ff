#!/usr/bin/env bash
# One device call (issue 22): the LLM prefill's attention ways side by side
# (bench_prefill_attention.py), the fused expert's CUDA tests, and the persistent loop under
# the tilings named by TILINGS (none: skipped), e.g. TILINGS="default:,ks8:key_splits=8". Logs under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
say "prefill attention"
timeout 540 python3 scripts/bench_prefill_attention.py --parts ${PARTS:-attention,layer} --json "$OUT/prefill_attention.json" 2>&1 | grep -v Warn \
  > "$OUT/prefill_attention.log"; tail -${TAIL:-22} "$OUT/prefill_attention.log"
[ -n "${TESTS:-}" ] && say "CUDA tests" && timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m cuda $TESTS \
  2>&1 | tee "$OUT/tests.log" | tail -4
[ -n "${TILINGS:-}" ] && say "tilings" && timeout 240 python3 scripts/bench_expert_gpu.py --out "$OUT" --parts tilings --contexts 891 --warm-jobs 3 \
  --tilings "$TILINGS" --tiling-entries 1,4 2>&1 | grep -v Warn \
  > "$OUT/tilings.log" && tail -8 "$OUT/tilings.log"
say "total"
