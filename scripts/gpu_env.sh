# Sourced by the device scripts: the EGL loaders (.gl) and the wheels the GPU image lacks (.whl:
# mujoco, glfw, pyopengl, gym-aloha, gymnasium, farama-notifications, rosbags, apsw, backports.zstd,
# lz4, ruamel.yaml(.clib), for Python 3.12; `pip download` commands in BENCHMARKS.md), both carried.
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD MUJOCO_GL=egl PYTHONUNBUFFERED=1
[ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ] && \
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
OUT=${OUT:-out}; mkdir -p "$OUT"
