"""LayerNorm over the last dim in one pass: a program normalises BLOCK_M whole rows held in registers
(fp32 statistics, two-pass variance from the registers), reading each row once and writing it once.

On the H200 the ViT's LayerNorm over [4 x 729, 1152] bf16 took 14.8 us compiled by inductor (a
looped reduction) and 9.6 eager, for 13.4 MB moved (3.1 us at bandwidth), 25 blocks x 2 a query;
the expert's context norm over [36 x 891, 768] 69 us eager (scripts/bench_vision_ops.py,
BENCHMARKS.md). `TritonLayerNorm` takes an nn.LayerNorm's place (the `triton_layer_norm` rung);
compiled regions see it as one opaque op. With a residual, the same pass first adds it (the ViT
block's x + attention before norm2, and x + the block before's MLP output before norm1:
model.vision.add_norm, `add_norm_kernel`), where compiled each add was a pass of its own (6.1-6.3 us
a block at DROID, the twelfth session's profile) before the norm read its output again.
Runs on the CPU under TRITON_INTERPRET=1 (the CI tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _layer_norm_rows(X, D, Sum, W, B, Out, rows, n, sx, so, per, sg, eps,
                     AFFINE: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """RESIDUAL: the rows normalised are X + D (rounded to X's dtype, as the add it replaces), also
    written to Sum (rows sx apart, as X and D). Out row r at (r // per) sg + (r % per) so."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    ok = (r < rows)[:, None] & (c < n)[None, :]
    at = r.to(tl.int64)[:, None] * sx + c[None, :]
    x = tl.load(X + at, mask=ok, other=0.0)
    if RESIDUAL:
        x = (x.to(tl.float32) + tl.load(D + at, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(Sum + at, x, mask=ok)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / n
    d = tl.where(ok, x - mean[:, None], 0.0)
    y = d * tl.rsqrt(tl.sum(d * d, axis=1) / n + eps)[:, None]
    if AFFINE:
        w = tl.load(W + c, mask=c < n, other=0.0).to(tl.float32)
        b = tl.load(B + c, mask=c < n, other=0.0).to(tl.float32)
        y = y * w[None, :] + b[None, :]
    out_at = (r // per).to(tl.int64) * sg + (r % per).to(tl.int64) * so
    tl.store(Out + out_at[:, None] + c[None, :], y.to(Out.dtype.element_ty), mask=ok)


def layer_norm_into(x: torch.Tensor, out: torch.Tensor, weight: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], eps: float,
                    residual: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """out[i] = LayerNorm(x[i]) for the rows of x [rows, n] (last dim contiguous) into out [rows, n]
    (any row stride, last dim contiguous: a slice of a wider buffer), or into out [groups, per, n]
    (rows in order, any strides but the last: the rows of a buffer with other rows between groups).
    residual (delta, total), both of x's shape and strides: the rows normalised are x + delta,
    written to total too. Returns out."""
    rows, n = x.shape
    groups, per = (1, rows) if out.dim() == 2 else out.shape[:2]
    if x.stride(1) != 1 or out.stride(-1) != 1 or out.dim() not in (2, 3) or (groups * per, out.shape[-1]) != (rows, n):
        raise ValueError(f"layer_norm_into needs rows with a contiguous last dim and out of x's rows, "
                         f"got {tuple(x.shape)} / {tuple(out.shape)}")
    if residual is not None and any(t.shape != x.shape or t.stride() != x.stride() for t in residual):
        raise ValueError("layer_norm_into's residual and its total need x's shape and strides")
    delta, total = residual if residual is not None else (x, x)
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 4096 // block_n))   # ~4096 values a program: registers, not spills
    affine = weight is not None
    _layer_norm_rows[(triton.cdiv(rows, block_m),)](
        x, delta, total, weight if affine else x, bias if affine else x, out, rows, n, x.stride(0), out.stride(-2),
        per, out.stride(0) if out.dim() == 3 else 0, eps, AFFINE=affine, RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_n <= 1024 else 8)
    return out


@torch.library.custom_op("vla::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   eps: float) -> torch.Tensor:
    if not x.is_cuda:   # the engine's CPU runs never take this rung; a traced CPU call stays exact
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    rows = x.reshape(-1, x.shape[-1])
    return layer_norm_into(rows, torch.empty_like(rows), weight, bias, eps).view(x.shape)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


class TritonLayerNorm(nn.Module):
    """Takes an nn.LayerNorm's place and parameters (the state_dict keys stay the same)."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        if len(norm.normalized_shape) != 1 or (norm.weight is None) != (norm.bias is None):
            raise ValueError("TritonLayerNorm normalises the last dim, with both affine parameters or neither")
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _layer_norm_op(x.contiguous(), self.weight, self.bias, self.eps)


def norm_into(norm: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = norm(x) for x [..., n] into out of x's shape whose leading dims but the last two merge
    (a slice of a wider buffer): a TritonLayerNorm on CUDA writes it in its one pass, where the norm
    and a strided copy took 69 + 69 us at DROID on the H200 (the expert's context tokens, the twelfth
    session's profile); any other norm (nn.LayerNorm, nn.Identity, on the CPU) runs, then a copy."""
    if isinstance(norm, TritonLayerNorm) and x.is_cuda:
        layer_norm_into(x.contiguous().view(-1, x.shape[-1]), out.view(-1, *out.shape[-2:]), norm.weight, norm.bias,
                        norm.eps)
    else:
        out.copy_(norm(x))


@torch.library.custom_op("vla::add_layer_norm", mutates_args=())
def _add_layer_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not x.is_cuda:   # an engine on the CPU: the model's two ops, exactly (the kernel's CPU test interprets it)
        total = x + delta
        return total, F.layer_norm(total, total.shape[-1:], weight, bias, eps)
    rows, deltas = x.reshape(-1, x.shape[-1]), delta.reshape(-1, x.shape[-1])
    total = torch.empty_like(rows)
    out = layer_norm_into(rows, torch.empty_like(rows), weight, bias, eps, (deltas, total))
    return total.view(x.shape), out.view(x.shape)


@_add_layer_norm_op.register_fake
def _(x, delta, weight, bias, eps):
    return torch.empty_like(x), torch.empty_like(x)


def add_norm_one_pass(x: torch.Tensor, delta: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """model.vision.add_norm as one kernel (an opaque op to a compiled region): x + delta and its
    LayerNorm, each row read once. `norm`: an nn.LayerNorm or TritonLayerNorm."""
    return _add_layer_norm_op(x.contiguous(), delta.contiguous(), norm.weight, norm.bias, norm.eps)


def use_add_norm_kernel(model: nn.Module) -> int:
    """Every ViT block's add_norm as the one-pass kernel (both of its norms, but norm1 where the
    block takes the stream whole: the first block, and the one after each feature layer); returns
    how many blocks."""
    for block in model.vision.encoder.blocks:
        block.add_norm = add_norm_one_pass
    return len(model.vision.encoder.blocks)


def use_triton_layer_norms(model: nn.Module) -> int:
    """The ViT blocks' norms and the expert's context norm as TritonLayerNorm; returns how many."""
    swaps = [(blk, name) for blk in model.vision.encoder.blocks for name in ("norm1", "norm2")]
    if isinstance(model.expert.ctx_norm, nn.LayerNorm):
        swaps.append((model.expert, "ctx_norm"))
    for owner, name in swaps:
        setattr(owner, name, TritonLayerNorm(getattr(owner, name)))
    return len(swaps)
