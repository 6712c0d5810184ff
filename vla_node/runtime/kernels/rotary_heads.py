"""The LLM attention's q/k/v as heads in one pass (model.llm.rotary_heads): per token, q and k
through their per-head RMSNorm and RoPE and v as it is, read from the fused projection's output
once and written as contiguous [B, heads, T, head_dim], the layout the attention kernels read.

Compiled, the same work took three inductor kernels a layer on the H200 at DROID (10.8 us for q,
3.7 for k with its cache write, 6.1 for v's copies; BENCHMARKS.md, twelfth session's profile) for
~22 MB moved (~5 us at bandwidth), and fp32 attention kernels misread their strided views (the
fifteenth session). Behind `rotary_kernel` (off) until timed on the GPU. Runs on the CPU under
TRITON_INTERPRET=1 (the CI tests).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import nn

from ...model.llm import LLM


@triton.jit
def _norm_rope(X, W, Out, so, cos1, sin1, cos2, sin2, eps, n_heads,
               D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's heads: RMSNorm (fp32 statistics, rounded to the input dtype, times the weight
    rounded again, as model.layers.RMSNorm) then rotate-half RoPE in fp32. X at the token's first
    head (its heads D apart), Out at the token's row of head 0 (heads so apart)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h < n_heads)[:, None] & (d < HALF)[None, :]
    x1 = tl.load(X + h[:, None] * D + d[None, :], mask=ok, other=0.0)
    x2 = tl.load(X + h[:, None] * D + HALF + d[None, :], mask=ok, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + eps)[:, None]
    w1 = tl.load(W + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    y2 = (w2 * (f2 * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    tl.store(Out + h[:, None] * so + d[None, :], (y1 * cos1 - y2 * sin1).to(Out.dtype.element_ty), mask=ok)
    tl.store(Out + h[:, None] * so + HALF + d[None, :], (y2 * cos2 + y1 * sin2).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _token_tables(Cos, Sin, t, sct, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin, each as its two halves [1, BLOCK_HALF]."""
    d = tl.arange(0, BLOCK_HALF)
    cos1 = tl.load(Cos + t * sct + d, mask=d < HALF, other=0.0)[None, :]
    sin1 = tl.load(Sin + t * sct + d, mask=d < HALF, other=0.0)[None, :]
    cos2 = tl.load(Cos + t * sct + HALF + d, mask=d < HALF, other=0.0)[None, :]
    sin2 = tl.load(Sin + t * sct + HALF + d, mask=d < HALF, other=0.0)[None, :]
    return cos1, sin1, cos2, sin2


@triton.jit
def _rotary_heads(Q, K, V, QW, KW, Cos, Sin, QO, KO, VO, tokens, sqb, sqt, skb, skt, svb, svt, sct, eps,
                  H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)                   # (entry, token)
    b = pid // tokens
    t = pid % tokens
    cos1, sin1, cos2, sin2 = _token_tables(Cos, Sin, t, sct, HALF, BLOCK_HALF)
    # outputs [B, heads, T, D]: a head's rows T * D apart
    _norm_rope(Q + b * sqb + t * sqt, QW, QO + (b * H * tokens + t) * D, tokens * D, cos1, sin1, cos2, sin2, eps, H,
               D, HALF, BLOCK_H, BLOCK_HALF)
    _norm_rope(K + b * skb + t * skt, KW, KO + (b * KV * tokens + t) * D, tokens * D, cos1, sin1, cos2, sin2, eps,
               KV, D, HALF, BLOCK_KV, BLOCK_HALF)
    h = tl.arange(0, BLOCK_KV)
    c = tl.arange(0, BLOCK_D)
    ok = (h < KV)[:, None] & (c < D)[None, :]
    v = tl.load(V + b * svb + t * svt + h[:, None] * D + c[None, :], mask=ok, other=0.0)
    tl.store(VO + (b * KV * tokens + t) * D + h[:, None] * (tokens * D) + c[None, :], v, mask=ok)


@triton.jit
def _rotary_keys(K, KW, Cos, Sin, KO, tokens, skb, skt, sct, eps, KV: tl.constexpr, D: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid = tl.program_id(0)                   # (entry, token)
    b = pid // tokens
    t = pid % tokens
    cos1, sin1, cos2, sin2 = _token_tables(Cos, Sin, t, sct, HALF, BLOCK_HALF)
    _norm_rope(K + b * skb + t * skt, KW, KO + (b * KV * tokens + t) * D, tokens * D, cos1, sin1, cos2, sin2, eps,
               KV, D, HALF, BLOCK_KV, BLOCK_HALF)


def rotary_heads_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model.llm.rotary_heads in one pass: q [B, T, heads * D], k and v [B, T, kv_heads * D] (views
    of one fused output are fine: each token's heads contiguous), the q/k norms' weights [D] and eps,
    cos/sin [T, D] fp32. Returns q [B, heads, T, D], k and v [B, kv_heads, T, D], contiguous."""
    b, t, _ = q.shape
    d = q.shape[-1] // heads
    if d % 2 or any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)) or cos.stride() != sin.stride():
        raise ValueError("rotary_heads_kernel needs an even head_dim, contiguous last dims and cos/sin alike")
    qo = torch.empty((b, heads, t, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((b, kv_heads, t, d), dtype=k.dtype, device=k.device)
    vo = torch.empty((b, kv_heads, t, d), dtype=v.dtype, device=v.device)
    _rotary_heads[(b * t,)](q, k, v, q_weight, k_weight, cos, sin, qo, ko, vo, t,
                            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                            cos.stride(0), eps, H=heads, KV=kv_heads, D=d, HALF=d // 2,
                            BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
                            BLOCK_HALF=triton.next_power_of_2(d // 2), BLOCK_D=triton.next_power_of_2(d),
                            num_warps=4)
    return qo, ko, vo


@torch.library.custom_op("vla::rotary_heads", mutates_args=())
def _rotary_heads_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rotary_heads_kernel(q, k, v, q_weight, k_weight, cos, sin, heads, kv_heads, eps)


@_rotary_heads_op.register_fake
def _(q, k, v, q_weight, k_weight, cos, sin, heads, kv_heads, eps):
    b, t, _ = q.shape
    d = q.shape[-1] // heads
    return q.new_empty((b, heads, t, d)), k.new_empty((b, kv_heads, t, d)), v.new_empty((b, kv_heads, t, d))


def rotary_heads_one_pass(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model.llm.rotary_heads as one kernel (an opaque op to a compiled region; one eps for both
    norms, which use_rotary_kernel checked)."""
    return _rotary_heads_op(q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos.contiguous(), sin.contiguous(),
                            attn.heads, attn.kv_heads, attn.q_norm.eps)


def rotary_keys_kernel(k: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int,
                       eps: float) -> torch.Tensor:
    """rotary_heads_kernel's k alone: k [B, T, kv_heads * D] -> [B, kv_heads, T, D] contiguous."""
    b, t, _ = k.shape
    d = k.shape[-1] // kv_heads
    if d % 2 or any(x.stride(-1) != 1 for x in (k, cos, sin)) or cos.stride() != sin.stride():
        raise ValueError("rotary_keys_kernel needs an even head_dim, contiguous last dims and cos/sin alike")
    ko = torch.empty((b, kv_heads, t, d), dtype=k.dtype, device=k.device)
    _rotary_keys[(b * t,)](k, k_weight, cos, sin, ko, t, k.stride(0), k.stride(1), cos.stride(0), eps, KV=kv_heads,
                           D=d, HALF=d // 2, BLOCK_KV=triton.next_power_of_2(kv_heads),
                           BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=4)
    return ko


@torch.library.custom_op("vla::rotary_keys", mutates_args=())
def _rotary_keys_op(k: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int,
                    eps: float) -> torch.Tensor:
    return rotary_keys_kernel(k, k_weight, cos, sin, kv_heads, eps)


@_rotary_keys_op.register_fake
def _(k, k_weight, cos, sin, kv_heads, eps):
    b, t, _ = k.shape
    return k.new_empty((b, kv_heads, t, k.shape[-1] // kv_heads))


def rotary_keys_heads(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model.llm.rotary_heads for a pattern kernel that norms and rotates q itself (attend_rotating_q):
    k through its norm and RoPE in one pass; q and v as heads views of the projection, as they are."""
    b, t, _ = q.shape
    k = _rotary_keys_op(k, attn.k_norm.weight, cos.contiguous(), sin.contiguous(), attn.kv_heads, attn.k_norm.eps)
    return (q.view(b, t, attn.heads, attn.head_dim).transpose(1, 2), k,
            v.view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2))


def attend_rotating_q(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """model.llm.sdpa_attend's meaning through the pattern kernel (`mask`: the bucket's PatternAttention,
    with the rope tables of its queries), q still the projection's: the kernel applies attn's q norm and
    RoPE as it loads each query tile, once a program, where a pass of its own moved q twice through memory."""
    if getattr(mask, "rope_tables", None) is None:
        raise ValueError("q_rope_in_attention runs the full prefill's pattern kernel, with its queries' rope tables")
    return mask.attend(q, k, v, q_rope=(attn.q_norm.weight, *mask.rope_tables, attn.q_norm.eps))


def use_q_rope_in_attention(llm: LLM) -> int:
    """Every decoder layer: k alone through the rotary pass, q normed and rotated in the pattern kernel,
    v read where the projection wrote it (the full prefill's pattern kernel only: no KV cache)."""
    for layer in llm.layers:
        layer.attn.rotary_heads = rotary_keys_heads
        layer.attn.attend = functools.partial(attend_rotating_q, layer.attn)
    return len(llm.layers)


def use_rotary_kernel(llm: LLM) -> int:
    """Every decoder layer's rotary_heads as the one-pass kernel; returns how many layers."""
    for layer in llm.layers:
        if layer.attn.q_norm.eps != layer.attn.k_norm.eps:
            raise ValueError("the rotary kernel takes one eps for the q and k norms")
        layer.attn.rotary_heads = rotary_heads_one_pass
    return len(llm.layers)
