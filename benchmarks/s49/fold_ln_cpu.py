"""fold_ln on the CUDA kernel's CPU build (the suite's small expert: width 256, 2 heads, MLP 512):
each loop's relative L2 distance from the fp32 truth, beside the default kernel's and the bf16 eager
loop's, on the random expert (B = 1, 2, 3; 4 flow steps) and on a residual stream far from zero mean
(action_pos + 4; B = 3, 10 steps), where rho and delta matter: there also with rho 1 % off and rho 0,
to show what the tests' bounds catch.

    ROS_LOG_DIR=/tmp/roslog TRITON_INTERPRET=1 PYTHONPATH=$PWD:$PWD/test python3 benchmarks/s49/fold_ln_cpu.py
"""
import torch

from test_fused_expert_cuda import flow_case, fp32_twin, small_expert
from vla_node.runtime import fused_expert_cuda
from vla_node.runtime.fused_expert import FusedExpert
from vla_node.runtime.fused_expert_cuda import CudaTiling


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main():
    print("| stream | B | steps | eager | default | fold_ln | fold_ln, rho 1 % off | fold_ln, rho 0 |")
    print("|---|---|---|---|---|---|---|---|")
    exact = fused_expert_cuda.CudaFlow.ln_fold
    for far, entries, steps in ((False, 1, 4), (False, 2, 4), (False, 3, 4), (True, 3, 10)):
        cfg, e, _ = small_expert("cpu")
        if far:
            with torch.no_grad():
                e.action_pos += 4.0
        run = flow_case(cfg, e, fp32_twin(e), entries=entries, steps=steps, device="cpu")
        default, want, eager = run(FusedExpert(e, backend="cuda"))
        cells = [rel(eager, want), rel(default, want)]
        for rho_scale in (1.0, 1.01, 0.0) if far else (1.0,):
            def ln_fold(self, m, rho_scale=rho_scale):
                ln = exact(self, m)
                w, mlp = self.fused.width, self.fused.mlp
                ln[..., :3 * w] *= rho_scale
                ln[..., 6 * w:6 * w + mlp] *= rho_scale
                return ln
            fused_expert_cuda.CudaFlow.ln_fold = ln_fold
            got, _, _ = run(FusedExpert(e, backend="cuda", cuda_tiling=CudaTiling(fold_ln=True)))
            cells.append(rel(got, want))
        fused_expert_cuda.CudaFlow.ln_fold = exact
        cells = [f"{c:.2e}" for c in cells] + ["-"] * (5 - len(cells))
        print(f"| {'action_pos + 4' if far else 'random'} | {entries} | {steps} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
