#!/usr/bin/env bash
# One device call (issue 22): why the persistent flow loop fails at 64 rows (4 observations).
# The loop at B = 4 persistent as shipped (the failure), the same with Hopper's wgmma disabled
# (DISABLE_MMA_V3: the dots of 64 rows are the only ones that take wgmma), memcheck on the
# persistent loop (barriers that give up after a few polls, so it ends under the sanitizer), and
# the batch timings (B = 1, 2, 4, 8, persistent). Logs under $OUT; the lines that matter last.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
c=scripts/check_fused_batches.py
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
say "persistent B=4, as shipped"
timeout 150 python3 $c --entries 4 --force-persistent 2>&1 | grep -v Warn | tee "$OUT/persistent.log"
say "persistent B=1,2,4,8 with DISABLE_MMA_V3=1"
DISABLE_MMA_V3=1 timeout 200 python3 $c --entries 4,8,1,2 --force-persistent 2>&1 | grep -v Warn \
  | tee "$OUT/no_mma_v3.log"
say "memcheck, persistent B=4, barriers give up after 2000 polls"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 200 "$SAN" --tool memcheck --print-limit 8 python3 $c --entries 4 --force-persistent --steps 1 \
  --spin-limit 2000 > "$OUT/memcheck.log" 2>&1
grep -v "^=========     \(Host Frame\|in \)" "$OUT/memcheck.log" | head -40
if [ -n "${BATCH_MMA_V3:-}" ]; then export DISABLE_MMA_V3=$BATCH_MMA_V3; fi
say "batch timings (DISABLE_MMA_V3=${DISABLE_MMA_V3:-unset})"
timeout 240 python3 scripts/bench_expert_gpu.py --out "$OUT" --budget-s 200 --parts batch --contexts 891 \
  --force-persistent 2>&1 | grep -v Warning > "$OUT/batch.log"; tail -12 "$OUT/batch.log"
say "total"
