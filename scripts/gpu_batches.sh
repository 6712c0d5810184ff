#!/usr/bin/env bash
# One device call (issue 22): the fused flow loop for batches of 1-8 observations. The loop
# persistent at B = 1, 2, 4, 8 against the fp32 expert, memcheck on the persistent loop at B = 4
# (barriers that give up after a few polls, so it ends under the sanitizer), the kernel's CUDA
# tests, and the batch timings. Logs under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
c=scripts/check_fused_batches.py
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
say "persistent B=1,2,4,8"
timeout 200 python3 $c --entries 4,8,1,2 2>&1 | grep -v Warn | tee "$OUT/batches.log"
say "memcheck, persistent B=4, barriers give up after 2000 polls"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 200 "$SAN" --tool memcheck --print-limit 8 python3 $c --entries 4 --steps 1 --spin-limit 2000 \
  > "$OUT/memcheck.log" 2>&1
grep -v "^=========     \(Host Frame\|in \)" "$OUT/memcheck.log" | head -12
say "CUDA tests of the kernel"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m cuda test/test_fused_expert.py 2>&1 \
  | tee "$OUT/tests.log" | tail -3
say "batch timings"
timeout 240 python3 scripts/bench_expert_gpu.py --out "$OUT" --budget-s 200 --parts ${PARTS:-batch} --contexts 891 \
  2>&1 | grep -v Warning > "$OUT/batch.log"; tail -${TAIL:-12} "$OUT/batch.log"
say "total"
