"""One flow step of the full-size expert on the per-phase kernels, for Nsight Compute: the
second run is profiled (the first compiles), so

    ncu --clock-control none --profile-from-start off --launch-count 9 --section SpeedOfLight \\
        --section WarpStateStats python3 scripts/ncu_expert.py

reports the step's `in` phase and block 0's seven phases, each with its duration, DRAM
throughput and where its warps stall. Random bf16 weights, the DROID context (891 tokens)."""
import torch

from vla_node.model import get_preset, init_random_
from vla_node.model.action_expert import ActionExpert
from vla_node.runtime.fused_expert import FusedExpert, Tiling


def main():
    cfg = get_preset("molmobot-4b")
    with torch.device("cuda"):
        expert = init_random_(ActionExpert(cfg).eval().requires_grad_(False)).to(torch.bfloat16)
    tokens = 891
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = [torch.randn(1, tokens, cfg.llm.dim, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in expert.blocks]
    state = torch.rand(1, cfg.action.state_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, tokens + 1, dtype=torch.bool, device="cuda")
    noise = torch.randn(1, cfg.action.horizon, cfg.action.action_dim, device="cuda", generator=g)
    with torch.inference_mode():
        kv = expert.context_kv(hidden, state)
        fused = FusedExpert(expert, tiling=Tiling(persistent=False))
        inputs = fused.schedule([expert.modulations(torch.zeros(1, device="cuda"))])
        fused.flow(noise, inputs, kv, mask)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fused.flow(noise, inputs, kv, mask)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
