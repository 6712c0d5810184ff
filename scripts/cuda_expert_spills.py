"""Registers and spills of the CUDA expert kernel (kernels/expert_flow.cu) for molmobot-4b on the
H200 (sm_90, 132 SMs), compiled by NVRTC with no GPU: a change that pushes a phase's weights out of
registers shows here before any device time is spent. --source compares another version of the
kernel under the same constants (e.g. `git show REV:vla_node/runtime/kernels/expert_flow.cu`).

    PYTHONPATH=$PWD python3 scripts/cuda_expert_spills.py [--entries 1,2,4,8] \
        [--tilings "default:,e4:epi_split=4,e4m3:fp8=1"] [--source OLD.cu]
"""
import argparse
import re
import types
from pathlib import Path

from check_cuda_expert import tilings  # scripts/: the variant syntax of the GPU sweep

from vla_node.model import get_preset
from vla_node.runtime.fused_expert_cuda import plan_of
from vla_node.runtime.kernels.expert_flow_cuda import HOPPER_HELD, nvrtc_compile

H200_SMS, DROID_KEYS = 132, 892


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
            for label, source in sources:
                _, log = nvrtc_compile(constants, "sm_90", verbose=True, source=source)
                regs = re.search(r"Used (\d+) registers", log).group(1)
                spill = re.search(r"(\d+) bytes spill stores", log).group(1)
                rows.append(f"| {entries} | {name} | {label} | {regs} | {spill} |")
    print("| B | tiling | source | registers | bytes spilled |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
