"""Registers and spills of the CUDA expert kernel (kernels/expert_flow.cu) for molmobot-4b on the
H200 (sm_90, 132 SMs), compiled by NVRTC with no GPU: a change that pushes a phase's weights out of
registers shows here before any device time is spent. --source compares another version of the
kernel under the same constants (e.g. `git show REV:vla_node/runtime/kernels/expert_flow.cu`): its
registers and spills, and how many of its instructions differ from this version's (nvdisasm, the
kernel parameters' constant-bank offsets masked: a field added to Params moves them all), so that a
change meant to leave a build alone can be shown to.

    PYTHONPATH=$PWD python3 scripts/cuda_expert_spills.py [--entries 1,2,4,8] \
        [--tilings "default:,e4:epi_split=4,e4m3:fp8=1"] [--source OLD.cu]
"""
import argparse
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import triton
from check_cuda_expert import tilings  # scripts/: the variant syntax of the GPU sweep

from vla_node.model import get_preset
from vla_node.runtime.fused_expert_cuda import plan_of
from vla_node.runtime.kernels.expert_flow_cuda import HOPPER_HELD, nvrtc_compile

H200_SMS, DROID_KEYS = 132, 892


def instructions(cubin: bytes) -> list[str]:
    """The cubin's SASS, an instruction a line, addresses dropped and the parameters' constant-bank
    offsets masked. nvdisasm: on PATH or Triton's copy."""
    nvdisasm = shutil.which("nvdisasm") or str(Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()
             if line.strip().startswith("/*")]
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][param]", line) for line in lines]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="1,2,4,8")
    ap.add_argument("--tilings", default="default:")
    ap.add_argument("--source", type=Path, help="another expert_flow.cu, compiled beside this one")
    args = ap.parse_args()
    cfg = get_preset("molmobot-4b")
    a = cfg.action
    dims = types.SimpleNamespace(width=a.width, heads=a.heads, head_dim=a.width // a.heads, mlp=a.mlp,
                                 action_dim=a.action_dim, depth=cfg.llm.layers)
    sources = [("this", None)] + ([(args.source.name, args.source.read_bytes())] if args.source else [])
    rows = []
    for entries in (int(e) for e in args.entries.split(",")):
        for name, tiling, fp8 in tilings(args.tilings):
            constants = dict(plan_of(types.SimpleNamespace(**vars(dims), fp8=fp8), entries, tokens=a.horizon,
                                     n_keys=DROID_KEYS, programs=H200_SMS, tiling=tiling,
                                     held=HOPPER_HELD.__getitem__).constants)   # the plans the GPU runs
            this = None
            for label, source in sources:
                cubin, log = nvrtc_compile(constants, "sm_90", verbose=True, source=source)
                regs = re.search(r"Used (\d+) registers", log).group(1)
                spill = re.search(r"(\d+) bytes spill stores", log).group(1)
                sass = instructions(cubin) if args.source else []
                if this is None:
                    this, differ = sass, "-"
                else:
                    differ = f"{sum(a != b for a, b in zip(sass, this))} of {len(sass)} (this: {len(this)})"
                rows.append(f"| {entries} | {name} | {label} | {regs} | {spill} | {differ} |")
    print("| B | tiling | source | registers | bytes spilled | instructions unlike this |\n|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
