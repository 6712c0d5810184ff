"""Qwen3-style decoder: RMSNorm, GQA with per-head q/k RMSNorm, RoPE, SwiGLU, no bias.

The policy reads every layer's hidden states (one action-expert block per LLM layer), so the
forward returns the output of each layer rather than logits; there is no LM head.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import LLMConfig
from .layers import FusableProjection, RMSNorm, SwiGLU, apply_rope


class KVCache(nn.Module):
    """Keys (after RoPE) and values of one layer for `max_len` slots, written at given positions.
    Buffers are allocated once; `update` writes in place and returns the whole cache, so shapes
    never change between calls."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, slots, k)
        self.v.index_copy_(2, slots, v)
        return self.k, self.v


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KV, S, D] (grouped heads); mask [T, S] bool or None (causal)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def rotary_heads(attn: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections [B, T, heads * head_dim] as heads [B, heads, T, head_dim]: q and k through
    their per-head RMSNorm and RoPE (cos/sin [T, head_dim]), v as it is."""
    b, t, _ = q.shape
    q = apply_rope(attn.q_norm(q.view(b, t, attn.heads, attn.head_dim)).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_norm(k.view(b, t, attn.kv_heads, attn.head_dim)).transpose(1, 2), cos, sin)
    return q, k, v.view(b, t, attn.kv_heads, attn.head_dim).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.qkv = FusableProjection(cfg.dim, {"q": cfg.heads * cfg.head_dim,
                                               "k": cfg.kv_heads * cfg.head_dim,
                                               "v": cfg.kv_heads * cfg.head_dim}, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.cache: Optional[KVCache] = None
        # attend(q, k, v, mask) as sdpa_attend; the runtime may put a faster kernel here, with a
        # mask object of its own (runtime/kernels/prefill_attention.py).
        self.attend = sdpa_attend
        # rotary_heads(self, q, k, v, cos, sin) with that function's meaning; the runtime may put one
        # kernel here (runtime/kernels/rotary_heads.py).
        self.rotary_heads = rotary_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None, attend_cache: bool = False) -> torch.Tensor:
        """Self-attention of x [B, T, dim]. `mask` [T, S] bool (True: may attend), None: causal.
        With a cache, x's keys/values are also written at `slots`; with `attend_cache` x attends
        to the whole cache (S = its length) instead of to its own keys only (S = T)."""
        b, t, _ = x.shape
        q, k, v = self.rotary_heads(self, *self.qkv(x), cos, sin)
        if self.cache is not None and slots is not None:
            cache_k, cache_v = self.cache.update(slots, k, v)
            if attend_cache:
                k, v = cache_k, cache_v
        y = self.attend(q, k, v, mask)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None, attend_cache: bool = False,
                mlp_out: Optional[torch.Tensor] = None,
                keep: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream x + mlp_out (the layer before's MLP output, or None) -> (that sum, the
        layer before's output; this layer's stream before its MLP output; that output): the layer's
        output is the sum of the last two. Each add is left to the norm after it, so that a compiled
        layer makes the two one pass. `keep` [B, T, dim]: where that sum is written (LLM.forward's
        hidden_out), by the same pass."""
        if mlp_out is not None:
            x = x + mlp_out
            if keep is not None:
                x = keep.copy_(x)
        x_in = x
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, slots, attend_cache)
        return x_in, x, self.mlp(self.mlp_norm(x))


class LLM(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        # The base vocabulary and the added rows (image special tokens) as one table.
        self.embed = nn.Embedding(cfg.embedding_rows, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))

    def setup_caches(self, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        for layer in self.layers:
            layer.attn.cache = KVCache(batch, self.cfg.kv_heads, max_len, self.cfg.head_dim, dtype, device)

    def drop_caches(self) -> None:
        for layer in self.layers:
            layer.attn.cache = None

    def forward(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None, attend_cache: bool = False,
                hidden_out: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """embeds [B, T, dim]; cos/sin [T, head_dim] for the tokens' positions; mask and cache
        use as in Attention.forward. Returns the output hidden state of every layer, each
        [B, T, dim] (before any final norm: the action expert reads these). `hidden_out` [layers,
        B, T, dim]: the layers write their outputs there as they make them, and the returned
        states are its rows (a consumer of all of them at once then needs no stack of its own)."""
        hidden = []
        x, mlp_out = embeds, None
        for i, layer in enumerate(self.layers):
            keep = hidden_out[i - 1] if hidden_out is not None and i else None
            x_in, x, mlp_out = layer(x, cos, sin, mask, slots, attend_cache, mlp_out=mlp_out, keep=keep)
            if i:   # the layer before's output, which this one added
                hidden.append(x_in)
        hidden.append(x + mlp_out if hidden_out is None else torch.add(x, mlp_out, out=hidden_out[-1]))
        return hidden
