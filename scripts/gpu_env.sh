# Sourced by the device scripts: the EGL loaders (.gl) and the wheels the GPU image lacks (.whl), both
# carried (18 MB of wheels; dm-control is not needed there). Made once on this machine with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform any \
#     mujoco==3.8.1 glfw pyopengl gym-aloha==0.1.5 gymnasium==1.4.0 farama-notifications rosbags==0.11.9 \
#     apsw backports.zstd lz4 ruamel.yaml ruamel.yaml.clib     (one name per call if one fails)
#   cd .gl && apt-get download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD MUJOCO_GL=egl PYTHONUNBUFFERED=1
[ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ] && \
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
OUT=${OUT:-out}; mkdir -p "$OUT"
# Closed loop, 50 held-out seeds on the GPU, 16 workers sharing it, so the latency is fixed in sim
# time ($LATENCY_MS: ms, or `alone`: each configuration timed alone first; $FIRST_SEED: the first of
# the 50 seeds; $PARAMS: the node's parameter file, default config/sim.yaml). $1: checkpoint, $2: time
# limit in s, $3: report under $OUT (its full log beside it).
evaluate() {
  timeout "$2" python3 -m vla_node.sim eval --checkpoint "$1" --configs "${EVAL_CONFIGS:-eager}" \
    --episodes 50 --first-seed "${FIRST_SEED:-1000}" --workers 16 --device cuda --dtype "${DTYPE:-float32}" --latency-ms "${LATENCY_MS:-40}" \
    ${PARAMS:+--params "$PARAMS"} --json "$OUT/$3" 2>&1 | grep -v Warning | tee "$OUT/${3%.json}.log" | grep "success \|alone\|rror\|configuration\| ms (" | tail -24
}
