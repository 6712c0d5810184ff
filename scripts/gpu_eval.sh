#!/usr/bin/env bash
# One device call (issue 19): configurations of a checkpoint in the closed loop on 50 held-out seeds,
# each one's latency measured alone (one process, nothing else on the GPU) and then fixed in sim time
# for the 16 workers that share the GPU for the physics. carry: .whl, .gl, the checkpoint folder.
#   CHECKPOINT=out/run7 CONFIGS="eager,fast" [EVAL_S=300] [DTYPE=float32] [FIRST_SEED=1000] [LATENCY_MS=alone]
#   bash scripts/gpu_eval.sh          (LATENCY_MS=40: the latency fixed instead of measured)
set -uo pipefail
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
EVAL_CONFIGS=$CONFIGS LATENCY_MS=${LATENCY_MS:-alone} evaluate "$CHECKPOINT" "${EVAL_S:-300}" sim_eval_configs.json
