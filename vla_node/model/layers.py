"""Building blocks shared by the ViT, the LLM and the action expert."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like Qwen3, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusableProjection(nn.Module):
    """Several linear maps of the same input (q/k/v, or gate/up), stored separately in the
    checkpoint. `runtime.fusion` may give them one shared weight; forward then runs one GEMM."""

    def __init__(self, in_dim: int, out_dims: dict[str, int], bias: bool):
        super().__init__()
        for name, out in out_dims.items():
            self.add_module(name, nn.Linear(in_dim, out, bias=bias))
        self.names = tuple(out_dims)
        self.sizes = tuple(out_dims.values())
        # Plain attributes, not parameters: the checkpoint keys stay the separate ones.
        self.fused_weight: Optional[torch.Tensor] = None
        self.fused_bias: Optional[torch.Tensor] = None
        self.fused_linear = F.linear   # the fused GEMM (runtime.lt_gemm may choose its algorithm)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused_weight is not None:
            return self.fused_linear(x, self.fused_weight, self.fused_bias).split(self.sizes, dim=-1)
        return tuple(getattr(self, n)(x) for n in self.names)


def linear_gelu(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """tanh-GELU(linear(x)): the ViT's MLP input (runtime.fusion may run it as one GEMM)."""
    return F.gelu(linear(x), approximate="tanh")


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None):
        super().__init__()
        self.gate_up = FusableProjection(dim, {"gate": hidden, "up": hidden}, bias=False)
        self.down = nn.Linear(hidden, out_dim or dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(F.silu(gate) * up)


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), head_dim] in fp32 (Qwen3 / HF rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, head_dim] (fp32). Rotation in fp32, result in x.dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
