"""Compile the fused expert's kernels for the H200 (sm_90) with no GPU: every kernel configuration a
FusedExpert launches for one flow loop (the persistent loop, or each phase; with --inpaint also the
inpainting loop's launch a step, which an engine's warm-up runs too), through Triton's CUDA backend
and ptxas. Launches count as one configuration when Triton would key them alike (their constants and
the specialisation of their other arguments: integers of value 1 and multiples of 16), so the count
is the compiles a fresh machine's warm-up pays for. The interpreter accepts code the GPU compiler
rejects (it ran a kernel that read a plain Python global), so the suite runs this; --ptxas also
prints what each configuration costs a program: registers, spills, and in its SASS the CTA barriers,
shared-memory stores, tensor-core instructions and global loads (the counts are static: a loop's
body once).

    python scripts/compile_flow_kernel.py persistent [--entries 4] [--fp8] [--ptxas]
    python scripts/compile_flow_kernel.py per-phase --ptxas
    python scripts/compile_flow_kernel.py persistent --preset sim --dtype float32 --inpaint   # vla-sim's `fast`
"""
import argparse
import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
         torch.int32: "*i32", torch.int8: "*i8", torch.bool: "*i1"}
SASS_COUNTS = {"CTA barriers": r"BAR\.SYNC", "shared stores": r"\bSTS", "HMMA": r"HMMA", "global loads": r"\bLDG"}


def recorded_launches(mode: str, preset: str, dtype: torch.dtype, entries: int, keys: int, fp8: bool,
                      num_warps: int, inpaint: bool) -> list:
    """[(kernel, args, kwargs)] of one flow() call (and one with a known prefix: --inpaint),
    recorded instead of launched (meta tensors)."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    from vla_node.model import get_preset
    from vla_node.model.action_expert import ActionExpert, KnownActions
    from vla_node.runtime import fused_expert

    cfg = get_preset(preset).action
    fused_expert.FusedExpert.persistent = mode == "persistent"
    with torch.device("meta"):
        expert = ActionExpert(get_preset(preset)).to(dtype)
        depth, heads, hd = len(expert.blocks), cfg.heads, cfg.width // cfg.heads
        kv = [(torch.empty(entries, heads, keys, hd, dtype=dtype),) * 2 for _ in expert.blocks]
        mask = torch.empty(entries, 1, 1, keys, dtype=torch.bool)
        fused = fused_expert.FusedExpert(expert, fp8=fp8, tiling=fused_expert.Tiling(programs=132, num_warps=num_warps))
        steps = cfg.flow_steps   # step 1 reuses step 0's velocity (action caching): every phase runs
        inputs = fused_expert.FlowInputs(torch.empty(steps, depth, 9 * cfg.width, dtype=dtype),
                                         torch.empty(steps, 2 * cfg.width, dtype=dtype),
                                         torch.empty(steps, dtype=torch.int32), (-1, 0) + (-1,) * (steps - 2))
        noise = torch.empty(entries, cfg.horizon, cfg.action_dim)
        fused.flow(noise, inputs, kv, mask)
        if inpaint:
            known = KnownActions(torch.empty_like(noise), torch.empty(entries, cfg.horizon, 1, dtype=torch.bool))
            fused.flow(noise, inputs, kv, mask, known)
    return launches


def specialization(kernel, args, kwargs) -> tuple:
    """What Triton keys a launch's compile on: its constants, and for each other argument its type and
    what it is specialised on (a tensor: its dtype; an integer: value 1, a multiple of 16, or
    nothing; an argument marked do_not_specialize: nothing)."""
    params = [p for p in kernel.params if p.name not in kwargs]
    spec = []
    for param, value in zip(params, args):
        if isinstance(value, torch.Tensor):
            spec.append((TYPES[value.dtype], "D"))   # the launch's tensors are 16-byte aligned
        elif isinstance(value, TensorDescriptor):   # its type names the block: tensordesc<bf16[...]>
            spec.append((native_specialize_impl(BaseBackend, value, False, True, True)[0], ""))
        elif isinstance(value, float) or param.do_not_specialize:
            spec.append(("fp32" if isinstance(value, float) else "i32", ""))
        else:
            spec.append(native_specialize_impl(BaseBackend, value, False, True, True)[:2])
    constants = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
    return kernel.fn.__name__, constants, tuple(spec)


def configurations(launches: list) -> dict:
    """{specialization: the first launch of it}: the compiles the launches need."""
    unique = {}
    for kernel, args, kwargs in launches:
        unique.setdefault(specialization(kernel, args, kwargs), (kernel, args, kwargs))
    return unique


def compile_for_hopper(kernel, args, kwargs):
    """The kernel compiled for sm_90 as a launch with these arguments would specialise it."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_cooperative_grid") if k in kwargs}
    _, _, spec = specialization(kernel, args, kwargs)
    signature, attrs, constants, values = {}, {}, dict(kwargs), iter(zip(args, spec))
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name] = "constexpr"
            continue
        value, (kind, hint) = next(values)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = value
        elif hint == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options)


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
    ap.add_argument("--preset", default="molmobot-4b", help="model preset whose expert is compiled")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--entries", type=int, default=1, help="observations in the batch")
    ap.add_argument("--keys", type=int, default=891, help="context keys of the cross-attention")
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights (a superset of the bf16 paths)")
    ap.add_argument("--inpaint", action="store_true", help="also the inpainting loop (one launch a flow step)")
    ap.add_argument("--num-warps", type=int, default=fused_expert_default_warps(), help="warps per program")
    ap.add_argument("--ptxas", action="store_true", help="print registers, spills and SASS counts per kernel")
    args = ap.parse_args()
    launches = recorded_launches(args.mode, args.preset, getattr(torch, args.dtype), args.entries, args.keys,
                                 args.fp8, args.num_warps, args.inpaint)
    from vla_node.runtime.kernels.expert_flow import PHASE_NAMES
    unique = configurations(launches)
    for kernel, kargs, kwargs in unique.values():
        t0 = time.perf_counter()
        compiled = compile_for_hopper(kernel, kargs, kwargs)
        phase = int(getattr(kwargs["PHASE"], "value", kwargs["PHASE"]))
        name = "persistent" if phase < 0 else PHASE_NAMES[phase]
        report = f": {ptxas_report(compiled.asm['ptx'])}" if args.ptxas else ""
        print(f"{name:10s} B={args.entries} compiled in {time.perf_counter() - t0:.1f}s{report}", flush=True)
    print(f"{len(launches)} launches, {len(unique)} kernel configurations compiled for sm_90")


if __name__ == "__main__":
    main()
