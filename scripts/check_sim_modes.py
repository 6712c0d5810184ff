"""Engine modes on the shipped simulation policy against eager, on the GPU: each mode's chunks for
the same observations and noise (relative L2, non-finite values), then one closed-loop episode
at a fixed latency (success, queries, refused chunks). Finds which feature breaks a checkpoint
whose shapes the suite's random presets do not cover (horizon 32, 14 joints, head_dim 48).

    source scripts/gpu_env.sh
    python3 scripts/check_sim_modes.py --configs "graphs,triton,fast,fast:expert_kernel=triton"
"""
import argparse

import numpy as np
import torch

from vla_node.runtime import PolicyEngine
from vla_node.sim.aloha import TransferCube
from vla_node.sim.closed_loop import ClosedLoop
from vla_node.sim.eval import _engine_config, _render_and_settings
from vla_node.tools.offline import ConfigSpec, parse_configs


def engine_for(spec: ConfigSpec, args) -> PolicyEngine:
    """The engine `vla-sim eval` builds for `spec` (its settings, cameras and image size)."""
    render, settings = _render_and_settings(args)
    return PolicyEngine(_engine_config(args, spec, settings, render), progress=lambda m: print(f"  {m}", flush=True))


def chunks(engine: PolicyEngine, n: int) -> list[np.ndarray]:
    a = engine.model_cfg.action
    out = []
    for i in range(n):
        noise = torch.randn((1, a.horizon, a.action_dim), generator=torch.Generator().manual_seed(i)).to(engine.device)
        out.append(engine.predict(engine.dummy_observation(seed=i), noise=noise).normalized)
    return out


def first_non_finite(engine: PolicyEngine) -> str:
    """The first module (in call order) whose output holds a non-finite value while its inputs hold
    none, over one query: where the NaN starts (uncompiled modules only)."""
    found = []

    def hook(module, inputs, output, name=None):
        tensors = lambda xs: [x for x in xs if torch.is_tensor(x) and x.is_floating_point()]  # noqa: E731
        outs = tensors(output if isinstance(output, (tuple, list)) else [output])
        if not found and any(not torch.isfinite(o).all() for o in outs) and \
                all(torch.isfinite(i).all() for i in tensors(inputs)):
            found.append(f"{name} ({type(module).__name__}, input shapes {[tuple(i.shape) for i in tensors(inputs)]})")

    handles = [m.register_forward_hook(lambda mod, i, o, n=n: hook(mod, i, o, n))
               for n, m in engine.model.named_modules()]
    try:
        chunks(engine, 1)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else "no module's output"


def episode(engine: PolicyEngine, args) -> str:
    """One closed-loop episode (args.episode_seed, at args.latency_ms fixed); "" for none."""
    if args.episode_seed < 0:
        return ""
    render, settings = _render_and_settings(args)
    with TransferCube(render) as env:
        r = ClosedLoop(env, engine, settings, latency_s=args.latency_ms / 1e3).run(args.episode_seed)
    return (f"{'success' if r.success else 'fail'} reward {r.max_reward} ticks {r.ticks} queries {r.queries} "
            f"chunks {r.chunks} late {r.late_chunks} non-finite {r.non_finite_chunks} discarded {r.discarded}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="vla_node/data/sim_policy")
    ap.add_argument("--params", default="config/sim.yaml")
    ap.add_argument("--configs", default="graphs,triton,fast")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--inputs", type=int, default=3)
    ap.add_argument("--episode-seed", type=int, default=1000, help="the closed-loop episode's seed (-1: none)")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    args = ap.parse_args()
    # What vla-sim eval's engine and renderer read besides: the checkpoint's own cameras and size, seed 0.
    args.preset, args.seed, args.overrides = "sim", 0, []
    args.cameras = args.height = args.width = None
    args.shadows = False
    eager = engine_for(parse_configs("eager")[0], args)
    reference = chunks(eager, args.inputs)
    rows = [("eager", 0.0, 0, episode(eager, args))]
    del eager
    for spec in parse_configs(args.configs):
        print(f"[{spec.label}]", flush=True)
        engine = engine_for(spec, args)
        engine.warmup()
        got = chunks(engine, args.inputs)
        err = max(float(np.linalg.norm(g - r) / np.linalg.norm(r)) for g, r in zip(got, reference))
        bad = sum(int((~np.isfinite(g)).sum()) for g in got)
        if bad and not engine.config.compile:
            print(f"[{spec.label}] the first non-finite output: {first_non_finite(engine)}", flush=True)
        run = episode(engine, args)
        rows.append((spec.label, err, bad, run))
        print(f"[{spec.label}] rel L2 {err:.2e}, non-finite {bad}, {run}", flush=True)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"\n{'config':34} {'rel L2 vs eager':>16} {'non-finite':>10}  "
          f"episode seed {args.episode_seed} at {args.latency_ms:g} ms")
    for label, err, bad, run in rows:
        print(f"{label:34} {err:16.2e} {bad:10d}  {run}")


if __name__ == "__main__":
    main()
