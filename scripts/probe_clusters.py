"""How many programs of the CUDA expert kernel (kernels/expert_flow.cu at molmobot-4b's shapes,
one observation) the GPU holds at once in thread-block clusters of each size, beside the stand-in
kernel's answer that the plan uses (expert_flow_cuda.programs_held): the cross-attention's clusters
need every program resident (the persistent kernel's grid barriers).

    PYTHONPATH=$PWD python3 scripts/probe_clusters.py     # needs a CUDA GPU and cuda-python
"""
import types

import torch

from vla_node.runtime.fused_expert_cuda import SMEM_LIMIT, CudaTiling, plan_of
from vla_node.runtime.kernels.expert_flow_cuda import FlowKernel, _ok, clusters_held, programs_held

MOLMOBOT_4B = types.SimpleNamespace(width=768, heads=8, head_dim=96, mlp=3072, action_dim=8, depth=36)


def main():
    props = torch.cuda.get_device_properties(0)
    plan = plan_of(MOLMOBOT_4B, 1, 16, 892, props.multi_processor_count, CudaTiling(cluster=1))
    kernel = FlowKernel.get(plan.constants, 0, SMEM_LIMIT)
    d = kernel.driver
    non_portable = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED   # size 16
    _ok(d.cuFuncSetAttribute(kernel.function, non_portable, 1), "cuFuncSetAttribute")
    print(f"{props.name}: {props.multi_processor_count} SMs, {plan.smem} bytes of shared memory a program")
    for size in (1, 2, 4, 8, 16):
        clusters = clusters_held(kernel.function, plan.smem, size)
        stand_in = programs_held(0, size) if size <= 8 else "-"
        print(f"cluster size {size:2d}: {clusters} clusters = {clusters * size} programs (stand-in: {stand_in})")


if __name__ == "__main__":
    main()
