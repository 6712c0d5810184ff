#!/usr/bin/env bash
# Device calls for issue 22: the CUDA flow-loop kernel (kernels/expert_flow.cu) as the engine
# runs it (the default expert_kernel auto on Hopper), its variants and its anatomy. Logs
# and JSON under $OUT; each part's table last in its log. Parts, in the order given:
#   variants  the loop under CudaTiling variants ($VARIANTS; fp8=1 in one: e4m3 weights) at B = $VENTRIES (1,2,4)
#             and the anatomy of $ANATOMY's tilings at B = $ANAT_ENTRIES (1), within $VTIMEOUT s (360)
#   tests     the CUDA tests of the kernel (pytest -m cuda test/test_fused_expert_cuda.py) within $TTIMEOUT s (180)
#   fastpath  the kernels' tests (test_kernels, natively), then the engine's other CUDA tests (test_fast_path,
#             test_options, test_engine_batch, test_instruction_tiers; each case compiles its engines: ~5 min
#             warm, ~8 on a fresh machine: a call of its own there) within $FTIMEOUT s (500); the log names
#             each case as it passes, so a timeout still shows how far it came
#   trims     the CUDA tests of one_pass_embedding, input_stream and q_rope_in_attention alone (test_kernels,
#             test_fast_path, -k) within $RTIMEOUT s (200): fastpath holds them among the rest
#   check     the default kernel at B = 1, 2, 4, 8 against the fp32 expert (action caching,
#             inpainting, 50 replays), two context lengths replayed A-B-A, the anatomy at B = 1, 4
#   probe     clusters of the kernel the GPU holds at once (scripts/probe_clusters.py)
#   bench     vla-bench DROID: $BENCH_MODES (eager,fast; on Hopper fast takes the CUDA loop: expert_kernel auto)
#   soak      vla-soak engine, fast, 1000 queries (recompiles, memory)
#   bench8    vla-bench 8 images: $BENCH8_MODES (fast)
#             (both benches take $BENCH_ARGS too, e.g. "--frames pageable")
#   profile   one warm DROID $PROFILE_MODE (fast) query's kernels under the CUDA profiler (scripts/profile_query.py)
#   embedding the prefill's embeddings as the engine makes them by default against one_pass_embedding's one pass
#             (scripts/bench_prefill_embedding.py), DROID and 8 images, each in a CUDA graph
#   ab        two modes in one process, their queries paired A B B A (scripts/ab_query.py): $AB_A (fast) against
#             $AB_B (fast+embedpass+inputstream+qrope) at $AB_LAYOUT (droid), $AB_PAIRS (40) pairs
#   uploads   the camera frames' host-to-device bandwidth on 1, 2, 4 streams and as one copy (scripts/bench_uploads.py)
#   attention the prefill's pattern kernel at every tiling of scripts/bench_prefill_attention.py, DROID and 8 images
#   ncu       Nsight Compute (clocks left alone): the pattern kernel at DROID at $NCU_TILES ("64x64 w4 s3 tma", its
#             default; speed of light, memory, warp stalls, occupancy, stall sampling by instruction), within $NTIMEOUT s
#             (150) each. Not the loop: ncu 2025.3 cannot profile expert_flow's cooperative cluster launch (LaunchFailed
#             under kernel and application replay on the H100, thirty-second session)
#   algos     cuBLASLt's algorithms for the query's GEMMs, each timed against torch's (scripts/bench_gemm_algos.py)
#   tuned     the CUDA tests of tuned_gemms (test/test_lt_gemm.py; the chosen algorithms print with -s)
#   gemms     the query's GEMMs under cuBLAS settings $GEMM_SETTINGS (default,lt: cuBLASLt preferred;
#             scripts/bench_gemm_gaps.py)
#   h200      bench and bench8 where the card is an H200 (the issue's must-show card), else nothing: a call
#             that may land on either kind of card ends with it
#   cache     the compile caches (inductor's, Triton's, ours: tuned GEMM choices, NVRTC builds) as
#             $OUT/compile_cache_<card>.tar.xz.aa, .ab, ... (15 MiB pieces: the device returns files of <= 16 MiB).
#             Kept here in .compile_cache/ (ignored) and named in run's carry, the pieces are unpacked before the
#             first part: a fresh machine then skips the compiles (~130-240 s for molmobot-4b `fast`) that the
#             call they came from made
#   OUT=dir PARTS="tests check probe bench soak" bash scripts/gpu_cuda_expert.sh   (one call, <= 10 min; the
#   first compile of molmobot-4b `fast` on a fresh machine takes ~130-240 s, soak then reuses it)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
PARTS=${PARTS:-tests check probe bench soak}
VARIANTS=${VARIANTS:-"default:,unfolded:fold_cross_q=0,fp32ln:x_frags=0,fuse_self:fuse_self=1"}
ANATOMY=${ANATOMY:-"default:,unfolded:fold_cross_q=0+x_frags=0"}
VENTRIES=${VENTRIES:-1,2,4}; ANAT_ENTRIES=${ANAT_ENTRIES:-1}
t0=$(date +%s)
for cache in $(ls .compile_cache/*.tar.xz.* 2>/dev/null | sed 's/\.[^.]*$//' | sort -u); do
  cat "$cache".* | xz -d | tar -C / -x && echo "unpacked $cache"
done
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
run_part() {
  case $1 in
    variants) say "CUDA kernel variants B=$VENTRIES + anatomy B=$ANAT_ENTRIES"
      timeout "${VTIMEOUT:-360}" python3 scripts/check_cuda_expert.py --entries 1,4 --backends cuda --variants "$VARIANTS" \
        --variant-entries "$VENTRIES" --anatomy "$ANAT_ENTRIES" --anatomy-tilings "$ANATOMY" --out "$OUT" 2>&1 | grep -av Warn \
        > "$OUT/variants.log"; grep -a "^variant\|^anatomy\|^  \|^cuda" "$OUT/variants.log" | tail -60 ;;
    tests) say "CUDA tests"
      timeout "${TTIMEOUT:-180}" python3 -m pytest -q -rs -p no:cacheprovider -m cuda test/test_fused_expert_cuda.py 2>&1 \
        | tee "$OUT/tests.log" | tail -3 ;;
    fastpath) say "the engine's CUDA tests and the kernels'"
      timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -W ignore test/test_kernels.py 2>&1 \
        | tee "$OUT/kernels.log" | grep -a "passed\|failed\|^FAILED\|^E " | tail -6
      timeout "${FTIMEOUT:-500}" python3 -m pytest -v -rs -p no:cacheprovider -W ignore -p no:logging -m cuda \
        test/test_fast_path.py test/test_options.py test/test_engine_batch.py test/test_instruction_tiers.py 2>&1 \
        | tee "$OUT/fastpath.log" | grep -a "passed\|failed\|^FAILED\|^E " | tail -12 ;;
    trims) say "the CUDA tests of one_pass_embedding, input_stream, q_rope_in_attention"
      timeout "${RTIMEOUT:-200}" python3 -m pytest -v -rs -p no:cacheprovider -W ignore -p no:logging -m cuda \
        test/test_kernels.py test/test_fast_path.py -k "q_rope or norms_and_rotates or input_stream or one_pass or never_waits" \
        2>&1 | tee "$OUT/trims.log" | grep -a "PASS\|FAIL\|passed\|failed\|^E " | tail -16 ;;
    check) say "CUDA kernel B=1,2,4,8, A-B-A, anatomy B=1,4"
      timeout 150 python3 scripts/check_cuda_expert.py --entries 1,2,4,8 --backends cuda --aba 1738 --anatomy 1,4 \
        --out "$OUT" 2>&1 | grep -av Warn > "$OUT/check.log"; grep -a "A-B-A\|^anatomy\|^  \|^cuda" "$OUT/check.log" ;;
    algos) say "cuBLASLt's algorithms for the query's GEMMs"
      timeout 300 python3 scripts/bench_gemm_algos.py --json "$OUT/gemm_algos.json" 2>&1 | grep -av Warn \
        > "$OUT/gemm_algos.log"; tail -20 "$OUT/gemm_algos.log" ;;
    tuned) say "tuned_gemms' CUDA tests"
      timeout 200 python3 -m pytest -q -s -rs -p no:cacheprovider -W ignore -p no:logging -m cuda test/test_lt_gemm.py \
        2>&1 | tee "$OUT/tuned.log" | grep -a "passed\|failed\|^FAILED\|^E " | tail -6 ;;
    probe) say "clusters held at once"
      timeout 30 python3 scripts/probe_clusters.py 2>&1 | tee "$OUT/probe.log" | tail -6 ;;
    bench) say "vla-bench DROID: ${BENCH_MODES:-eager,fast}"
      timeout "${BENCH_TIMEOUT:-300}" python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout droid \
        --iters 10 --dev-windows 3 --modes "${BENCH_MODES:-eager,fast}" ${BENCH_ARGS:-} --json "$OUT/bench_droid.json" 2>&1 \
        | grep -av Warning > "$OUT/bench_droid.log"; grep -a "tuned_gemms:" "$OUT/bench_droid.log"
      tail -9 "$OUT/bench_droid.log" ;;
    soak) say "vla-soak engine, fast, 1000 queries"
      timeout 200 python3 -m vla_node.tools.soak engine --preset molmobot-4b --device cuda --mode fast \
        --queries 1000 --json "$OUT/soak_fast.json" 2>&1 | grep -av Warning > "$OUT/soak.log"; tail -8 "$OUT/soak.log" ;;
    bench8) say "vla-bench 8 images: ${BENCH8_MODES:-fast}"
      timeout 400 python3 -m vla_node.tools.bench --preset molmobot-4b --device cuda --layout 8img --iters 10 \
        --dev-windows 1 --modes "${BENCH8_MODES:-fast}" ${BENCH_ARGS:-} --json "$OUT/bench_8img.json" 2>&1 \
        | grep -av Warning > "$OUT/bench_8img.log"; grep -a "tuned_gemms:" "$OUT/bench_8img.log"
      tail -6 "$OUT/bench_8img.log" ;;
    profile) say "one DROID ${PROFILE_MODE:-fast} query's kernels"
      timeout 200 python3 scripts/profile_query.py --mode "${PROFILE_MODE:-fast}" --layout droid --out "$OUT" 2>&1 \
        | grep -av Warning > "$OUT/profile_droid.log"; grep -a "stages ms" "$OUT/profile_droid.log" | tail -1
      tail -42 "$OUT/profile_droid.log" ;;
    embedding) say "the prefill's embeddings: as by default against one pass over the frame store"
      timeout 150 python3 scripts/bench_prefill_embedding.py --layouts droid,8img --json "$OUT/embedding.json" 2>&1 \
        | grep -av Warn > "$OUT/embedding.log"; tail -4 "$OUT/embedding.log" ;;
    ab) say "A/B in one process, queries paired: ${AB_A:-fast} against ${AB_B:-fast+embedpass+inputstream+qrope}"
      timeout "${AB_TIMEOUT:-400}" python3 scripts/ab_query.py --a "${AB_A:-fast}" --b "${AB_B:-fast+embedpass+inputstream+qrope}" \
        --layout "${AB_LAYOUT:-droid}" --pairs "${AB_PAIRS:-40}" --json "$OUT/ab_${AB_LAYOUT:-droid}.json" 2>&1 \
        | grep -av Warn > "$OUT/ab_${AB_LAYOUT:-droid}.log"; tail -8 "$OUT/ab_${AB_LAYOUT:-droid}.log" ;;
    uploads) say "the frames' uploads: one stream, 2 and 4 streams, one copy"
      timeout 60 python3 scripts/bench_uploads.py --frames 4,8 --json "$OUT/uploads.json" 2>&1 | tee "$OUT/uploads.log" \
        | tail -4 ;;
    attention) say "the pattern kernel's tilings"
      timeout 240 python3 scripts/bench_prefill_attention.py --parts attention --layouts droid,8img \
        --ways "pattern kernel" --json "$OUT/attention.json" 2>&1 | grep -av Warn > "$OUT/attention.log"
      tail -20 "$OUT/attention.log" ;;
    ncu) say "Nsight Compute: the pattern kernel at DROID"
      ncu=(ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
           --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,lts__t_bytes.sum.per_second")
      IFS=, read -ra tilings <<< "${NCU_TILES:-64x64 w4 s3 tma}"
      for tiles in "${tilings[@]}"; do
        timeout "${NTIMEOUT:-150}" "${ncu[@]}" -k regex:_pattern_attention -c 1 python3 scripts/bench_prefill_attention.py \
          --parts attention --layouts droid --ways "$tiles" > "$OUT/ncu_pattern_${tiles// /_}.log" 2>&1
        grep -a "Duration\|Throughput\|Registers\|Achieved Occ\|stalled" "$OUT/ncu_pattern_${tiles// /_}.log" | head -40
      done ;;
    gemms) say "GEMMs under cuBLAS settings ${GEMM_SETTINGS:-default,lt}"
      timeout 300 python3 scripts/bench_gemm_gaps.py --settings "${GEMM_SETTINGS:-default,lt}" \
        --json "$OUT/gemms.json" 2>&1 | grep -av Warn > "$OUT/gemms.log"; tail -30 "$OUT/gemms.log" ;;
    cache) say "the compile caches as xz pieces of 15 MiB"
      card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' _)
      tar -C / -cf - tmp/torchinductor_root root/.cache/vla_node root/.triton 2>/dev/null | xz -T0 -3 \
        | split -b 15M - "$OUT/compile_cache_$card.tar.xz."
      du -sh /tmp/torchinductor_root /root/.cache/vla_node /root/.triton "$OUT"/compile_cache_* 2>/dev/null ;;
    h200) if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then run_part bench; run_part bench8
          else say "h200: not an H200 ($(nvidia-smi --query-gpu=name --format=csv,noheader)), bench and bench8 skipped"; fi ;;
    *) say "unknown part $1" ;;
  esac
}
for part in $PARTS; do run_part "$part"; done
rm -f "$OUT"/*.png   # the device returns at most 8 files a call: the logs and JSON, not the benches' plots
say "total"
