"""Compile the fused expert's kernels for the H200 (sm_90) with no GPU: every kernel configuration a
full-size molmobot-4b FusedExpert launches (the persistent loop, or each phase), through Triton's
CUDA backend and ptxas. The interpreter accepts code the GPU compiler rejects (it ran a kernel
that read a plain Python global), so the suite runs this; --ptxas also prints what each
configuration costs a program: registers, spills, and in its SASS the CTA barriers, shared-memory
stores, tensor-core instructions and global loads (the counts are static: a loop's body once).

    python scripts/compile_flow_kernel.py persistent [--entries 4] [--fp8] [--ptxas]
    python scripts/compile_flow_kernel.py per-phase --ptxas
"""
import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv", torch.int32: "*i32",
         torch.bool: "*i1"}
SASS_COUNTS = {"CTA barriers": r"BAR\.SYNC", "shared stores": r"\bSTS", "HMMA": r"HMMA", "global loads": r"\bLDG"}


def recorded_launches(mode: str, entries: int, fp8: bool, num_warps: int) -> dict:
    """{phase: (kernel, args, kwargs)} of one flow() call, recorded instead of launched (meta tensors)."""
    launches = {}

    def record(self, *args, grid, warmup, **kwargs):
        phase = kwargs["PHASE"]
        launches.setdefault(int(getattr(phase, "value", phase)), (self, args, kwargs))

    JITFunction.run = record
    from vla_node.model import get_preset
    from vla_node.model.action_expert import ActionExpert
    from vla_node.runtime import fused_expert

    fused_expert.FusedExpert.persistent = mode == "persistent"
    with torch.device("meta"):
        expert = ActionExpert(get_preset("molmobot-4b")).to(torch.bfloat16)
        kv = [(torch.empty(entries, 8, 891, 96, dtype=torch.bfloat16),) * 2 for _ in expert.blocks]
        mask = torch.empty(entries, 1, 1, 891, dtype=torch.bool)
        fused = fused_expert.FusedExpert(expert, fp8=fp8, tiling=fused_expert.Tiling(programs=132, num_warps=num_warps))
        inputs = fused_expert.FlowInputs(torch.empty(2, 36, 9 * 768, dtype=torch.bfloat16),
                                         torch.empty(2, 2 * 768, dtype=torch.bfloat16),
                                         torch.empty(2, dtype=torch.int32), (-1, 0))
        fused.flow(torch.empty(entries, 16, 8), inputs, kv, mask)
    return launches


def compile_for_hopper(kernel, args, kwargs):
    """The kernel compiled for sm_90, with the divisibility a launch would specialise on (tensors and
    integers that are multiples of 16)."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_cooperative_grid") if k in kwargs}
    signature, attrs, values = {}, {}, iter(args)
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name] = "constexpr"
            continue
        value = next(values)
        if isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
        if isinstance(value, torch.Tensor) or (isinstance(value, int) and value and value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return compile(ASTSource(kernel, signature, kwargs, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str) -> str:
    """Registers and spills (ptxas -v) and the SASS counts of one kernel's PTX."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(p for p in (os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                              check=True)
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    counts = ", ".join(f"{len(re.findall(pattern, sass))} {name}" for name, pattern in SASS_COUNTS.items())
    return f"{regs.group(1)} registers, {spills.group(1)}/{spills.group(2)} bytes spilled (stores/loads); {counts}"


def fused_expert_default_warps() -> int:
    from vla_node.runtime.fused_expert import Tiling
    return Tiling().num_warps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("persistent", "per-phase"))
    ap.add_argument("--entries", type=int, default=1, help="observations in the batch")
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights (a superset of the bf16 paths)")
    ap.add_argument("--num-warps", type=int, default=fused_expert_default_warps(), help="warps per program")
    ap.add_argument("--ptxas", action="store_true", help="print registers, spills and SASS counts per kernel")
    args = ap.parse_args()
    launches = recorded_launches(args.mode, args.entries, args.fp8, args.num_warps)
    from vla_node.runtime.kernels.expert_flow import PHASE_NAMES
    for phase, (kernel, kargs, kwargs) in launches.items():
        compiled = compile_for_hopper(kernel, kargs, kwargs)
        if args.ptxas:
            name = "persistent" if phase < 0 else PHASE_NAMES[phase]
            print(f"{name:10s} B={args.entries}: {ptxas_report(compiled.asm['ptx'])}", flush=True)
    print(len(launches), "kernel configurations compiled for sm_90")


if __name__ == "__main__":
    main()
