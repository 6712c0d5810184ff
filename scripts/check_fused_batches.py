"""The fused expert's flow loop at full size for batches of observations, against the fp32
expert with the same weights: whether each batch runs (no illegal access, no barrier timeout)
and its error. Run under compute-sanitizer with --per-phase to find which phase reads or writes
out of bounds (the persistent loop spins at barriers, which the sanitizer slows to a crawl).

    PYTHONPATH=$PWD python3 scripts/check_fused_batches.py --entries 1,2,4,8 [--per-phase] [--no-hoist] [--steps 10]

--spin-limit N lets barriers give up after N polls, so the persistent loop finishes under
compute-sanitizer (with wrong numbers, but the same addresses).
"""
import argparse

import torch
from bench_expert_gpu import random_expert, rel  # scripts/

from vla_node.model import get_preset
from vla_node.model.action_expert import euler, flow_times
from vla_node.runtime import fused_expert
from vla_node.runtime.fused_expert import FusedExpert, Tiling


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=891)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--per-phase", action="store_true", help="one launch per phase instead of the persistent loop")
    ap.add_argument("--no-hoist", action="store_true", help="each phase's weights loaded after its barrier wait")
    ap.add_argument("--spin-limit", type=int, default=0, help="polls before a barrier gives up (0: the default)")
    args = ap.parse_args()
    if args.spin_limit:
        fused_expert.SPIN_LIMIT = args.spin_limit
    cfg = get_preset("molmobot-4b")
    expert, truth = random_expert(cfg, "cuda")
    fused = FusedExpert(expert, tiling=Tiling(persistent=not args.per_phase, hoist=not args.no_hoist))
    times = [torch.full((1,), t, device="cuda") for t in flow_times(args.steps)]
    for entries in (int(e) for e in args.entries.split(",")):
        g = torch.Generator(device="cuda").manual_seed(entries)
        hidden = [torch.randn(entries, args.tokens, cfg.llm.dim, device="cuda", generator=g) for _ in expert.blocks]
        state = torch.rand(entries, cfg.action.state_dim, device="cuda", generator=g) * 2 - 1
        mask = torch.ones(entries, 1, 1, args.tokens + 1, dtype=torch.bool, device="cuda")
        mask[..., args.tokens - args.tokens // 10:args.tokens] = False
        noise = torch.randn(entries, cfg.action.horizon, cfg.action.action_dim, device="cuda", generator=g)
        kv = expert.context_kv([h.bfloat16() for h in hidden], state.bfloat16())
        mods = [expert.modulations(t) for t in times]
        with torch.inference_mode():
            truth_kv, truth_mods = truth.context_kv(hidden, state), [truth.modulations(t) for t in times]
            want = euler(lambda x, i: truth.velocity(x, truth_mods[i], truth_kv, mask), noise, args.steps)
            try:
                got = fused.flow(noise, fused.schedule(mods), kv, mask).clone()
                torch.cuda.synchronize()
            except Exception as e:  # an illegal access poisons the context: report and stop
                print(f"B={entries}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                return
        err = rel(got, want)
        print(f"B={entries}: rel err {err:.2e} against the fp32 expert, barrier timed out: "
              f"{fused.barrier_timed_out()}", flush=True)


if __name__ == "__main__":
    main()
