"""SigLIP2-style ViT, 2x2 attention pooling and the SwiGLU projector to the LLM width.

An image is encoded on its own (no cross-image attention), so a frame's tokens depend on
that frame alone: the runtime's per-frame vision cache relies on this.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, VisionConfig
from .layers import FusableProjection, SwiGLU, linear_gelu


class ViTAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = FusableProjection(cfg.width, {"q": cfg.width, "k": cfg.width, "v": cfg.width}, bias=True)
        self.out = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def add_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after a sublayer, x + delta, and the next sublayer's input, its norm."""
    x = x + delta
    return x, norm(x)


class ViTBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.attn = ViTAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.width, cfg.mlp)
        self.fc2 = nn.Linear(cfg.mlp, cfg.width)
        # fc1_gelu(x, fc1) with linear_gelu's meaning and add_norm(x, delta, norm) with add_norm's;
        # the runtime may put one GEMM, and one kernel, here.
        self.fc1_gelu = linear_gelu
        self.add_norm = add_norm

    def forward(self, x: torch.Tensor, mlp_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + mlp_out (the block before's MLP output, or None) -> (this block's
        stream before its MLP output, that output): the block's output is their sum. Each add is
        left to the norm after it, so that the runtime can make the two one pass."""
        x, h = (x, self.norm1(x)) if mlp_out is None else self.add_norm(x, mlp_out, self.norm1)
        x, h = self.add_norm(x, self.attn(h), self.norm2)
        return x, self.fc2(self.fc1_gelu(h, self.fc1))


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, 3, S, S] -> [B, (S/patch)^2, patch*patch*3]: patches in row-major order, each flattened
    as (row, column, channel), the layout the official patch embedding was trained on."""
    b, c, s, _ = pixels.shape
    g = s // patch
    return pixels.view(b, c, g, patch, g, patch).permute(0, 2, 4, 3, 5, 1).reshape(b, g * g, patch * patch * c)


def embed_patches(pixels: torch.Tensor, linear: nn.Linear, patch: int) -> torch.Tensor:
    """[B, 3, S, S] -> [B, (S/patch)^2, width]: each patch through the patch embedding."""
    return linear(patchify(pixels, patch))


class VisionEncoder(nn.Module):
    """Patch embedding + learned positions + the first `layers_run` blocks; returns the
    configured layers' outputs concatenated on the channel axis: [B, grid*grid, feature_dim]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(3 * cfg.patch_size ** 2, cfg.width)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.grid * cfg.grid, cfg.width))
        # embed_patches(pixels, patch_embed, patch) with embed_patches' meaning; the runtime may align its GEMM here.
        self.embed_patches = embed_patches
        # Layers past the deepest feature layer are never run, so they are not built either.
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.layers_run))

    def layer_outputs(self, pixels: torch.Tensor, layers: Optional[Sequence[int]] = None) -> dict[int, torch.Tensor]:
        """pixels: [B, 3, S, S] normalised to [-1, 1]. Output of each block in `layers` (default:
        every block that runs), by block index."""
        size = self.cfg.image_size
        if pixels.dim() != 4 or pixels.shape[1] != 3 or pixels.shape[-2:] != (size, size):
            raise ValueError(f"vision encoder expects images [B, 3, {size}, {size}], got {tuple(pixels.shape)}")
        layers = range(len(self.blocks)) if layers is None else layers
        x, mlp_out = self.embed_patches(pixels, self.patch_embed, self.cfg.patch_size) + self.pos_embed, None
        outs = {}
        for i, block in enumerate(self.blocks):
            x, mlp_out = block(x, mlp_out)
            if i in layers:   # the block's output, which the next block then takes whole
                x, mlp_out = x + mlp_out, None
                outs[i] = x
        return outs

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        outs = self.layer_outputs(pixels, self.cfg.feature_layers)
        return torch.cat([outs[i] for i in self.cfg.feature_layers], dim=-1)


def pooling_windows(grid: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the patches in each window of the grid padded to a multiple of `window`, and
    which of them are real. Returns idx [windows, window^2] (padding points at patch 0) and
    valid [windows, window^2] (bool)."""
    pooled = -(-grid // window)
    rows = torch.arange(pooled * window).view(pooled, window)
    r = rows[:, None, :, None].expand(pooled, pooled, window, window)
    c = rows[None, :, None, :].expand(pooled, pooled, window, window)
    valid = (r < grid) & (c < grid)
    idx = torch.where(valid, r * grid + c, torch.zeros_like(r))
    n = pooled * pooled
    return idx.reshape(n, window * window), valid.reshape(n, window * window)


def window_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each window's query [N, heads, 1, d] over its patches' keys/values [N, heads, w, d]; mask
    [N, 1, 1, w] (True: a real patch)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class AttentionPool(nn.Module):
    """Multi-head attention over each 2x2 window with the mean of the window's real patches as
    the query (the padding row/column of the 27 -> 28 grid is masked out). Heads as in the ViT."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.heads
        d_in, d = cfg.feature_dim, cfg.width
        self.q = nn.Linear(d_in, d)
        self.kv = FusableProjection(d_in, {"k": d, "v": d}, bias=True)
        self.out = nn.Linear(d, d)
        idx, valid = pooling_windows(cfg.grid, cfg.pool_window)
        # Built once at construction, on whatever device the module moves to.
        self.register_buffer("window_idx", idx, persistent=False)
        self.register_buffer("window_valid", valid, persistent=False)
        # attend(q, k, v, mask) with window_sdpa's meaning; the runtime may put plain ops here.
        self.attend = window_sdpa

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, grid*grid, feature_dim] -> [B, windows, width]."""
        b, _, d_in = feats.shape
        n, w = self.window_idx.shape
        windows = feats[:, self.window_idx.reshape(-1)].view(b, n, w, d_in)
        valid = self.window_valid.to(feats.dtype)
        mean = (windows * valid[None, :, :, None]).sum(2) / valid.sum(1)[None, :, None]
        q = self.q(mean).view(b * n, 1, self.heads, -1).transpose(1, 2)
        k, v = (y.view(b * n, w, self.heads, -1).transpose(1, 2) for y in self.kv(windows))
        mask = self.window_valid[None, None, :, None, :].expand(b, 1, n, 1, w).reshape(b * n, 1, 1, w)
        y = self.attend(q, k, v, mask)
        return self.out(y.reshape(b, n, -1))


class VisionTower(nn.Module):
    """pixels [B, 3, S, S] -> LLM-width image tokens [B, tokens_per_image, llm_dim]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.encoder = VisionEncoder(cfg.vision)
        self.pool = AttentionPool(cfg.vision)
        self.projector = SwiGLU(cfg.vision.width, cfg.projector_hidden, cfg.llm.dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.pool(self.encoder(pixels)))
