"""How many thread-block clusters of the CUDA expert kernel (kernels/expert_flow.cu at molmobot-4b's
shapes, one observation) the GPU holds at once, per cluster size: whether a cluster of programs
per (entry, head) could merge the cross-attention's partials through distributed shared memory
with every program still resident (the persistent kernel's grid barriers need them all).

    PYTHONPATH=$PWD python3 scripts/probe_clusters.py     # needs a CUDA GPU and cuda-python
"""
import types

import torch

from vla_node.runtime.fused_expert_cuda import SMEM_LIMIT, plan_of
from vla_node.runtime.kernels.expert_flow_cuda import THREADS, FlowKernel, _ok

MOLMOBOT_4B = types.SimpleNamespace(width=768, heads=8, head_dim=96, mlp=3072, action_dim=8, depth=36)


def main():
    props = torch.cuda.get_device_properties(0)
    plan = plan_of(MOLMOBOT_4B, 1, 16, 892, props.multi_processor_count)
    kernel = FlowKernel.get(plan.constants, 0, SMEM_LIMIT)
    d = kernel.driver
    non_portable = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED   # size 16
    _ok(d.cuFuncSetAttribute(kernel.function, non_portable, 1), "cuFuncSetAttribute")
    print(f"{props.name}: {props.multi_processor_count} SMs, {plan.smem} bytes of shared memory a program")
    for size in (1, 2, 4, 8, 16):
        config = d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = size * (128 // size), 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
        config.sharedMemBytes = plan.smem
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = size, 1, 1
        config.attrs = [attr]
        config.numAttrs = 1
        err, clusters = d.cuOccupancyMaxActiveClusters(kernel.function, config)
        held = f"{clusters} clusters = {clusters * size} programs" if int(err) == 0 else f"error {err!r}"
        print(f"cluster size {size:2d}: {held}")


if __name__ == "__main__":
    main()
