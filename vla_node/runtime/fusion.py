"""Fused q/k/v and gate/up projections: one GEMM instead of several.

The separate nn.Linear weights become views into one concatenated buffer, so the model's
state_dict (and any checkpoint saved from it) keeps the separate keys and the memory is not
doubled. Exact: each output row is the same dot product as before.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.layers import FusableProjection


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every FusableProjection in `model`; returns how many were fused."""
    count = 0
    for module in model.modules():
        if not isinstance(module, FusableProjection) or module.fused_weight is not None:
            continue
        linears = [getattr(module, n) for n in module.names]
        weight = torch.cat([lin.weight for lin in linears], dim=0)
        bias = torch.cat([lin.bias for lin in linears], dim=0) if linears[0].bias is not None else None
        start = 0
        for lin, size in zip(linears, module.sizes):
            lin.weight = nn.Parameter(weight[start:start + size], requires_grad=False)
            if bias is not None:
                lin.bias = nn.Parameter(bias[start:start + size], requires_grad=False)
            start += size
        module.fused_weight, module.fused_bias = weight, bias
        count += 1
    return count
