#!/usr/bin/env bash
# One device call (issue 14): scripted demonstrations on every core, then vla-train on the GPU
# within a time budget; the checkpoint and the curves come back under $OUT.
#   carry: .whl (mujoco, gym-aloha, rosbags, ... for Python 3.12) and .gl (EGL loader debs)
#   EPISODES=100 BUDGET_S=430 bash scripts/gpu_train.sh
set -uo pipefail
t0=$(date +%s)
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD MUJOCO_GL=egl PYTHONUNBUFFERED=1
[ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ] && \
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/train.log"
python3 -m vla_node.sim record /tmp/demos --episodes "${EPISODES:-100}" --workers 16 2>&1 | tail -3 | tee -a "$OUT/train.log"
echo "demos done after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
python3 -m vla_node.tools.train --bags /tmp/demos --params config/sim.yaml --preset sim --out /tmp/sim_policy \
  --steps "${STEPS:-40000}" --batch "${BATCH:-64}" --lr 3e-4 --device cuda --workers 16 --seed 0 \
  --time-budget-s "${BUDGET_S:-430}" 2>&1 | grep -v Warning | tee -a "$OUT/train.log" | tail -25
for f in model.safetensors config.json tokenizer.json tokenizer_config.json train_log.jsonl train_curves.png; do
  cp /tmp/sim_policy/$f "$OUT/" 2>/dev/null
done
cp /tmp/sim_policy/train_state/state.json "$OUT/train_state.json" 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
