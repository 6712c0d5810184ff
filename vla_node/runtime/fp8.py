"""fp8 (e4m3) linears for the LLM: weights quantised once, activations quantised per call
(dynamic), one scaled GEMM (`torch._scaled_mm`, Hopper tensor cores). Opt-in: it changes the
numbers, and the benchmark reports the deviation beside the speedup.

Scaling: "rowwise" (a scale per token and per output channel; best at prefill sizes on the
H200) or "tensorwise" (one scale each; best at small token counts). Under torch.compile the
activation amax, scale and cast fuse into the surrounding kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..model.layers import FusableProjection

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
SCALINGS = ("rowwise", "tensorwise")


def quantize(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 values, fp32 scale) with x ~= values * scale; scale [..., 1] per row
    or a scalar."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if rowwise else xf.abs().amax()
    scale = amax.clamp_min(1e-12) / E4M3_MAX
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


class Fp8Linear(nn.Module):
    """y = x @ W^T + b with W in e4m3; optionally split into several outputs (a fused q/k/v or
    gate/up projection), so it replaces a Linear or a FusableProjection in place."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], scaling: str,
                 split: Optional[tuple[int, ...]] = None):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling must be one of {SCALINGS}, got {scaling!r}")
        self.rowwise = scaling == "rowwise"
        w_q, w_scale = quantize(weight, self.rowwise)
        self.register_buffer("weight_fp8", w_q)
        # _scaled_mm takes the weight scale as [1, N] (rowwise) or a scalar.
        self.register_buffer("weight_scale", w_scale.reshape(1, -1) if self.rowwise else w_scale)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)
        self.out_dtype = weight.dtype
        self.split = split

    @classmethod
    def from_linear(cls, lin: nn.Linear, scaling: str) -> "Fp8Linear":
        return cls(lin.weight.detach(), lin.bias, scaling)

    @classmethod
    def from_projection(cls, proj: FusableProjection, scaling: str) -> "Fp8Linear":
        linears = [getattr(proj, n) for n in proj.names]
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
        return cls(weight, bias, scaling, split=proj.sizes)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x_q, x_scale = quantize(x.reshape(-1, shape[-1]), self.rowwise)
        y = torch._scaled_mm(x_q, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale,
                             bias=self.bias, out_dtype=self.out_dtype)
        y = y.reshape(*shape[:-1], -1)
        return y.split(self.split, dim=-1) if self.split else y

    def weight_bytes(self) -> int:
        return self.weight_fp8.numel() + self.weight_scale.numel() * 4


def quantize_llm_(model: nn.Module, scaling: str = "rowwise") -> int:
    """Replace every linear of every LLM layer (q/k/v, o, gate/up, down) by an Fp8Linear,
    freeing the bf16 weights. Returns the bytes of fp8 weights now held."""
    total = 0
    for layer in model.llm.layers:
        for parent, name in ((layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down")):
            module = getattr(parent, name)
            fp8 = (Fp8Linear.from_projection(module, scaling) if isinstance(module, FusableProjection)
                   else Fp8Linear.from_linear(module, scaling))
            setattr(parent, name, fp8)
            total += fp8.weight_bytes()
    return total
