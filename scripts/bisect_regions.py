"""Which compiled code moves a mode off eager: the mode's chunks against eager's (relative L2, worst
of 3 inputs) with every region compiled, then with each group of regions put back in eager in
turn (cumulative), then with one part of every decoder layer compiled alone (a module, or a
function the attention calls). For modes without CUDA graphs (`compile` and its ablations).

On the H200 it found an fp32 `compile` engine 4.5e-2 off eager: inductor's code (not aot_eager's)
for the decoder layers' attention as a whole, while each of its parts compiled alone was 1e-7;
with q/k/v made contiguous before the attention call, 1.2e-7 (BENCHMARKS.md, fifteenth session).

    python3 scripts/bisect_regions.py --mode compile --dtype float32 --llm-parts attn,mlp,rope,sdpa
    python3 scripts/bisect_regions.py --backend aot_eager                # decompositions, no codegen
    python3 scripts/bisect_regions.py --set pattern_kernel=0,window_attention_ops=0 --contiguous
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F

import vla_node.model.llm as llm_module
from vla_node.runtime import EngineConfig, PolicyEngine
from vla_node.runtime.compile import uncompile

GROUPS = {"vision": lambda m: [*m.vision.encoder.blocks, m.vision.pool, m.vision.projector],
          "llm": lambda m: list(m.llm.layers), "expert": lambda m: list(m.expert.blocks)}
# Functions the attention calls, by the name --llm-parts gives them: (owner, attribute).
FUNCTIONS = {"rope": (llm_module, "apply_rope"), "sdpa": (F, "scaled_dot_product_attention"),
             "cache.update": (llm_module.KVCache, "update")}


def chunks(engine: PolicyEngine, n: int = 3) -> list[np.ndarray]:
    a = engine.model_cfg.action
    return [engine.predict(engine.dummy_observation(seed=i), noise=torch.randn(
        (1, a.horizon, a.action_dim), generator=torch.Generator().manual_seed(i)).to(engine.device)).normalized
        for i in range(n)]


def rel(ref: list[np.ndarray], engine: PolicyEngine) -> str:
    return f"{max(float(np.linalg.norm(y - x) / np.linalg.norm(x)) for x, y in zip(ref, chunks(engine))):.2e}"


def compile_alone(engine: PolicyEngine, part: str, ref: list[np.ndarray]) -> str:
    """The chunks' deviation with `part` of every decoder layer compiled and the rest eager."""
    if part in FUNCTIONS:
        owner, name = FUNCTIONS[part]
        eager_fn = getattr(owner, name)
        setattr(owner, name, torch.compile(eager_fn, fullgraph=True, dynamic=False))
        try:
            return rel(ref, engine)
        finally:
            setattr(owner, name, eager_fn)
    modules = [layer.get_submodule(part) for layer in engine.model.llm.layers]
    for module in modules:
        module.compile(fullgraph=True, dynamic=False)
    try:
        return rel(ref, engine)
    finally:
        uncompile(modules)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="compile")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", default="", help="boolean config overrides, e.g. pattern_kernel=0,flex_attention=0")
    ap.add_argument("--backend", default="inductor", help="the regions' compile backend (aot_eager: no codegen)")
    ap.add_argument("--contiguous", action="store_true", help="q, k, v made contiguous before every LLM attention call")
    ap.add_argument("--llm-parts", default="", help="decoder-layer parts to compile alone afterwards: submodules "
                    f"(attn, mlp, attn.qkv, ...) or {sorted(FUNCTIONS)}")
    args = ap.parse_args()
    compile_module = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **kw: compile_module(self, backend=args.backend, **kw)
    base = {"device": args.device, "dtype": args.dtype, "preset": args.preset}
    print(f"fp32 matmul precision {torch.get_float32_matmul_precision()}, cuBLAS TF32 "
          f"{torch.backends.cuda.matmul.allow_tf32}, cuDNN TF32 {torch.backends.cudnn.allow_tf32}")
    ref = chunks(PolicyEngine(EngineConfig.for_mode("eager", **base)))
    overrides = {k: bool(int(v)) for k, v in (kv.split("=") for kv in args.set.split(",") if kv)}
    engine = PolicyEngine(EngineConfig.for_mode(args.mode, **base, **overrides))
    if args.contiguous:
        for layer in engine.model.llm.layers:
            layer.attn.attend = lambda q, k, v, mask, attend=layer.attn.attend: attend(
                q.contiguous(), k.contiguous(), v.contiguous(), mask)
    print(f"{args.mode} {overrides} ({args.backend}): every region compiled {rel(ref, engine)}")
    for name, group in GROUPS.items():
        uncompile(group(engine.model))
        print(f"  and {name} back in eager: {rel(ref, engine)}")
    for part in filter(None, args.llm_parts.split(",")):
        print(f"  only the decoder layers' {part} compiled: {compile_alone(engine, part, ref)}")


if __name__ == "__main__":
    main()
