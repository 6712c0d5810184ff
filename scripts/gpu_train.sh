#!/usr/bin/env bash
# One device call (issue 14): scripted demonstrations on every core, vla-train on the GPU within a
# time budget, then the closed-loop evaluation; the checkpoint, curves and report come back under
# $OUT. carry: .whl (mujoco, gym-aloha, rosbags, ... for Python 3.12), .gl (EGL loader debs), and
# the INIT checkpoint folder when continuing a run from its weights. RESUME=1 continues from
# /tmp/sim_policy/train_state, which a machine still warm from the last call holds (with /tmp/demos).
#   EPISODES=100 BUDGET_S=430 [INIT=out/sim_policy | RESUME=1] [BATCH=64] [COMPILE=1] [EVAL_S=150]
#   [TESTS="test/test_fused_expert_cuda.py"] [EVAL_INIT=1 [EVAL_INIT_S=200]] [EMA=0.999] [CAUSAL=1 [OTHER_ATTENTION=1]] bash scripts/gpu_train.sh
# CAUSAL=1 trains causal image attention (--causal-images); with OTHER_ATTENTION=1 from an INIT
# checkpoint of bidirectional attention (--init-other-attention).
# EVAL_INIT=1 evaluates the INIT checkpoint (sim_eval_init.json) while the new run's steps keep the
# GPU busy and leave the CPU idle; the evaluation's latency is fixed in sim time, so sharing is safe.
set -uo pipefail
t0=$(date +%s)
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/train.log"
# CUDA tests ($TESTS: pytest files) while the demonstrations render on the CPU: the GPU is idle then.
[ -n "${TESTS:-}" ] && { timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -m cuda $TESTS > "$OUT/cuda_tests.log" 2>&1 & }
[ -f /tmp/demos/episodes.json ] || \
  python3 -m vla_node.sim record /tmp/demos --episodes "${EPISODES:-100}" --workers 16 2>&1 | tail -1 | tee -a "$OUT/train.log"
echo "demos done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
[ -n "${TESTS:-}" ] && { wait; tail -4 "$OUT/cuda_tests.log"; }
train() {  # $1: the time budget in s; the rest: extra vla-train arguments
  python3 -m vla_node.tools.train --bags /tmp/demos --params config/sim.yaml --preset sim --out /tmp/sim_policy \
    --steps "${STEPS:-40000}" --batch "${BATCH:-64}" --lr "${LR:-3e-4}" --warmup "${WARMUP:-500}" --device cuda \
    --workers 16 --seed "${SEED:-0}" ${INIT:+--init "$INIT"} ${RESUME:+--resume} ${EMA:+--ema-decay "$EMA"} \
    ${CAUSAL:+--causal-images} ${OTHER_ATTENTION:+--init-other-attention} --time-budget-s "$1" "${@:2}" 2>&1 \
    | grep -v Warning | tee -a "$OUT/train.log" | tail -14
}
[ -n "${EVAL_INIT:-}" ] && { ( timeout 400 sh -c "until grep -q s/step '$OUT/train.log'; do sleep 2; done"
  evaluate "$INIT" "${EVAL_INIT_S:-200}" sim_eval_init.json | sed 's/^/init checkpoint: /' ) & }
t_train=$(date +%s)
# COMPILE=1: the compiled step; if it fails, the rest of the budget trains eagerly.
train "${BUDGET_S:-430}" ${COMPILE:+--compile} || { [ -n "${COMPILE:-}" ] && \
  train $(( ${BUDGET_S:-430} - $(date +%s) + t_train )); }
for f in model.safetensors config.json train_log.jsonl train_curves.png; do cp /tmp/sim_policy/$f "$OUT/" 2>/dev/null; done
cp /tmp/sim_policy/train_state/state.json "$OUT/train_state.json" 2>/dev/null
echo "training done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
wait  # the INIT checkpoint's evaluation
[ "${EVAL_S:-0}" -gt 0 ] && evaluate /tmp/sim_policy "$EVAL_S" sim_eval.json
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
