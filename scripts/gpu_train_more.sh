#!/usr/bin/env bash
# Continue a vla-train run on a machine that still holds /tmp/demos and /tmp/sim_policy (the same
# lease), then evaluate the policy closed loop: STEPS total, BUDGET_S for training.
set -uo pipefail
t0=$(date +%s)
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD MUJOCO_GL=egl PYTHONUNBUFFERED=1
[ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ] && \
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
OUT=${OUT:-out}; mkdir -p "$OUT"
[ -d /tmp/sim_policy/train_state ] || { echo "no /tmp/sim_policy/train_state on this machine"; exit 1; }
python3 -m vla_node.tools.train --bags /tmp/demos --params config/sim.yaml --preset sim --out /tmp/sim_policy \
  --steps "${STEPS:-8000}" --batch 64 --lr 3e-4 --device cuda --workers 16 --seed 0 --resume \
  --time-budget-s "${BUDGET_S:-340}" 2>&1 | grep -v Warning | tee "$OUT/train_more.log" | tail -12
for f in model.safetensors config.json train_log.jsonl train_curves.png; do cp /tmp/sim_policy/$f "$OUT/"; done
cp /tmp/sim_policy/train_state/state.json "$OUT/train_state.json"
echo "training done after $(( $(date +%s) - t0 )) s"
timeout "${EVAL_S:-200}" python3 -m vla_node.sim eval --checkpoint /tmp/sim_policy --configs eager --episodes 50 \
  --workers 16 --device cuda --dtype float32 --json "$OUT/sim_eval_eager.json" 2>&1 | grep -v Warning \
  | grep "success \|report\|Error\|error" | tail -5
echo "total $(( $(date +%s) - t0 )) s"
