#!/usr/bin/env bash
# One device call (issue 22): the CUDA flow-loop kernel (kernels/expert_flow.cu) as the engine
# would run it, for deciding whether `expert_kernel` cuda becomes the default: its checks at
# B = 1, 2, 4, 8 with the per-phase anatomy, the CUDA tests of both kernels and the batched
# engine, 1000 queries of `fast+cudaexpert` under vla-soak (recompiles, memory), and the DROID and
# 8-image queries beside `fast`. Logs and JSON under $OUT; each part's table last in its log.
#   OUT=dir PARTS="variants tests" bash scripts/gpu_cuda_expert.sh   (the CudaTiling variants, then the tests)
#   OUT=dir PARTS="check tests" bash scripts/gpu_cuda_expert.sh   (one call, <= 9 min; a fresh machine
#   then PARTS=soak, then PARTS=bench: each part's timeouts keep it inside one 10-minute call; the
#   first compile of molmobot-4b `fast` on a fresh machine takes ~130-240 s a mode)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
PARTS=${PARTS:-check tests soak bench}
# part "variants": the loop under CudaTiling variants at B = 1, 2, 4 (error against the fp32 expert,
# time, difference to the default) and the anatomy of two of them at B = 1
VARIANTS=${VARIANTS:-"default:,xf:x_frags=1,fold:fold_cross_q=1,foldxf:fold_cross_q=1+x_frags=1,foldxfself:fold_cross_q=1+x_frags=1+fuse_self=1,foldxfq4:fold_cross_q=1+x_frags=1+qkv_tpc=4,foldxfq6:fold_cross_q=1+x_frags=1+qkv_tpc=6,foldxff6:fold_cross_q=1+x_frags=1+fc1_tpc=6"}
ANATOMY=${ANATOMY:-"default:,foldxf:fold_cross_q=1+x_frags=1"}
t0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
for part in $PARTS; do
  case $part in
    check) say "CUDA kernel B=1,2,4,8 + anatomy"
      timeout 240 python3 scripts/check_cuda_expert.py --entries 1,2,4,8 --backends cuda,triton --anatomy 1,4 \
        --out "$OUT" 2>&1 | grep -av Warn > "$OUT/check.log"; tail -14 "$OUT/check.log" ;;
    variants) say "CUDA kernel variants B=1,2,4 + anatomy B=1"
      timeout 360 python3 scripts/check_cuda_expert.py --entries 1,4 --backends cuda --variants "$VARIANTS" \
        --variant-entries 1,2,4 --anatomy 1 --anatomy-tilings "$ANATOMY" --out "$OUT" 2>&1 | grep -av Warn \
        > "$OUT/variants.log"; grep -a "^variant\|^anatomy\|^  \|^cuda" "$OUT/variants.log" | tail -60 ;;
    tests) say "CUDA tests"
      timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m cuda test/test_fused_expert_cuda.py \
        test/test_fused_expert.py test/test_engine_batch.py 2>&1 | tee "$OUT/tests.log" | tail -3 ;;
    soak) say "vla-soak engine, fast+cudaexpert, 1000 queries"
      timeout 420 python3 -m vla_node.tools.soak engine --preset molmobot-4b --device cuda --mode fast+cudaexpert \
        --queries 1000 --json "$OUT/soak_cudaexpert.json" 2>&1 | grep -av Warning > "$OUT/soak.log"; tail -8 "$OUT/soak.log" ;;
    bench) say "vla-bench DROID and 8 images, fast against fast+cudaexpert"
      for layout in droid 8img; do
        timeout 540 python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout $layout --iters 10 \
          --dev-windows 3 --modes eager,fast,fast+cudaexpert --json "$OUT/bench_$layout.json" 2>&1 \
          | grep -av Warning > "$OUT/bench_$layout.log"; tail -9 "$OUT/bench_$layout.log"
      done ;;
  esac
done
say "total"
