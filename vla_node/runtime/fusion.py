"""Fewer GEMMs and passes: fused q/k/v and gate/up projections, the action expert's context K/V
of every block in three batched ones, and the ViT's MLP input with its GELU in the GEMM's epilogue.

The separate nn.Linear weights become views into one concatenated buffer, so the model's
state_dict (and any checkpoint saved from it) keeps the separate keys and the memory is not
doubled. The fused projections are exact (each output row is the same dot product as before); the
batched context K/V and the GELU epilogue equal the per-block and two-pass ops up to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.action_expert import ActionExpert
from ..model.layers import FusableProjection
from ..model.vision import ViTBlock, patchify
from .kernels.layer_norm import norm_into


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


class BatchedContextKV:
    """ActionExpert.context_kv for every block at once: the shared context projection and its norm
    over all layers' hidden states in one GEMM and one pass, each block's K/V projection (bias
    included) as one batched GEMM. Per block these were 4 launches (36 x 21 us at DROID on the H200,
    BENCHMARKS.md). The bias rides in the GEMM as a weight column against a column of ones (the
    tokens' rows padded to 16 bytes): a broadcast add after it, or a bias copied into its output
    before it, took 85-107 us. Same sums, in another order: equal to the per-block K/V up to rounding.
    The blocks' cross_kv weights become views of the one buffer (memory not doubled)."""

    PAD = 8  # the ones column and 7 zero columns: rows of w + 8 bf16 stay 16-byte aligned

    @torch.no_grad()
    def __init__(self, expert: ActionExpert):
        self.expert = expert
        w = expert.cfg.width
        projections = [blk.cross_kv for blk in expert.blocks]
        self.weight = projections[0].k.weight.new_zeros((len(projections), 2 * w, w + self.PAD))
        self.tokens: dict[tuple, torch.Tensor] = {}
        for proj, rows in zip(projections, self.weight):
            rows[:, :w] = torch.cat([proj.k.weight, proj.v.weight])
            rows[:, w] = torch.cat([proj.k.bias, proj.v.bias])
            proj.k.weight, proj.v.weight = nn.Parameter(rows[:w, :w], False), nn.Parameter(rows[w:, :w], False)
            if proj.fused_weight is not None:
                proj.fused_weight = rows[:, :w]

    def _tokens(self, blocks: int, b: int, t: int) -> torch.Tensor:
        """The GEMM's rows [blocks, b, t + 1, width + PAD] of a shape, kept (a static buffer, so the
        ones column is written once, not filled every query: 16.5 us at DROID on the H200); the
        calls write every token's first `width` columns. A normal tensor, not an inference one:
        calls inside and outside inference mode may write it."""
        key = (blocks, b, t)
        if key not in self.tokens:
            with torch.inference_mode(False):
                tokens = self.weight.new_zeros((blocks, b, t + 1, self.weight.shape[-1]))
                tokens[..., self.expert.cfg.width] = 1.0   # every token's (1, 0, ..., 0) past its width
            self.tokens[key] = tokens
        return self.tokens[key]

    def __call__(self, llm_hidden: torch.Tensor | list[torch.Tensor],
                 state: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """llm_hidden: the layers' outputs, [layers, B, T, dim] (LLM.forward's hidden_out, which the
        layers wrote as they went) or a list of [B, T, dim] (stacked here: 85 us at DROID on the H200)."""
        stacked = llm_hidden if isinstance(llm_hidden, torch.Tensor) else torch.stack(llm_hidden)
        blocks, b, t, _ = stacked.shape
        w, e = self.expert.cfg.width, self.expert
        tokens = self._tokens(blocks, b, t)
        norm_into(e.ctx_norm, e.ctx_proj(stacked), tokens[:, :, :t, :w])
        tokens[:, :, t, :w] = e.state_token(state)[:, 0]
        kv = torch.bmm(tokens.view(blocks, b * (t + 1), -1), self.weight.transpose(1, 2)).view(blocks, b, t + 1, 2 * w)
        return [(blk._heads(kv[i, ..., :w]), blk._heads(kv[i, ..., w:])) for i, blk in enumerate(self.expert.blocks)]


def addmm_gelu(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(rows @ weight^T + bias) of rows [N, in]: on the GPU cuBLASLt's GELU_BIAS epilogue, the
    tanh GELU of the fp32 sums. Half types only: the engine's GPU dtype, the one measured against fp32
    on the H200 (an fp32 engine keeps the two passes)."""
    if rows.is_cuda and rows.dtype != torch.float32:
        return torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return F.gelu(F.linear(rows, weight, bias), approximate="tanh")  # the CPU's _addmm_activation is erf-GELU


@torch.library.custom_op("vla::linear_gelu", mutates_args=())
def _linear_gelu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return addmm_gelu(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


@_linear_gelu_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear_gelu_epilogue(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """model.layers.linear_gelu as one GEMM. Compiled, the ViT's fc1 took a bias copy into its output,
    a GEMM adding onto it and a GELU pass: 91 us a block at DROID on the H200 (BENCHMARKS.md)."""
    return _linear_gelu_op(x.contiguous(), linear.weight, linear.bias)


def use_gelu_epilogues(model: nn.Module) -> int:
    """Every ViT block's fc1 + GELU as one GEMM; returns how many blocks."""
    blocks = [m for m in model.modules() if isinstance(m, ViTBlock)]
    for block in blocks:
        block.fc1_gelu = linear_gelu_epilogue
    return len(blocks)


class AlignedPatchEmbedding:
    """model.vision.embed_patches with the GEMM's K zero-padded to a multiple of 8: 3 * 14 * 14 = 588
    makes rows of 1176 bytes, which only cuBLAS's 2-byte-aligned kernels take (a cutlass sm80 kernel of
    30.3 us at DROID on an H100 against a 5 us floor; at K = 592 an sm90 kernel of 10.9, BENCHMARKS.md,
    forty-sixth session). The weight is padded once; the patches are padded in the copy that lays them
    out (compiled: one kernel). Zeros add nothing: the same sums, in whatever order the aligned GEMM
    takes them."""

    def __init__(self, linear: nn.Linear, compiled: bool = True):
        self.pad = -linear.in_features % 8
        self.weight = F.pad(linear.weight.detach(), (0, self.pad))
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.run = torch.compile(self._embed, fullgraph=True, dynamic=False) if compiled else self._embed

    def _embed(self, pixels: torch.Tensor, patch: int) -> torch.Tensor:
        return F.linear(F.pad(patchify(pixels, patch), (0, self.pad)), self.weight, self.bias)

    def __call__(self, pixels: torch.Tensor, linear: nn.Linear, patch: int) -> torch.Tensor:
        return self.run(pixels, patch)


def use_aligned_patch_embedding(model: nn.Module, compiled: bool = True) -> None:
    """The vision encoder's patch embedding as AlignedPatchEmbedding (after the weights are loaded)."""
    encoder = model.vision.encoder
    encoder.embed_patches = AlignedPatchEmbedding(encoder.patch_embed, compiled)


def embed_from_store(weight: torch.Tensor, ids: torch.Tensor, store: torch.Tensor, frame_rows: torch.Tensor,
                     slot_image: torch.Tensor) -> torch.Tensor:
    """VLAPolicy.embed of the frame store's rows in one pass (compiled: one kernel): each slot's token
    embedding plus, where the prompt has a patch, that image token read from the store. ids [B, T];
    store [rows, tokens_per_image, dim]; frame_rows [B * images], entry-major; slot_image [T]: the
    index of each slot's token among an entry's image tokens, or -1. As four kernels (the embedding,
    the store's read and its copy, index_add) 28.6 us at DROID on an H100 (BENCHMARKS.md, forty-sixth
    session's profile). Exact: an image slot is one add of the same two values, as index_add's
    (patch positions are distinct)."""
    batch, per_image = ids.shape[0], store.shape[1]
    token = slot_image.clamp_min(0)
    rows = frame_rows.view(batch, -1)[:, token // per_image]         # [B, T]
    image = store[rows, token % per_image]                           # [B, T, dim]
    text = F.embedding(ids, weight)
    return torch.where((slot_image >= 0)[:, None], text + image.to(text.dtype), text)


def window_attention_ops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """model.vision.window_sdpa as plain ops in fp32 (a product and a sum over the head dim, a
    softmax over the window's few keys, a weighted sum), which a compiled region fuses into a few
    passes over k and v: SDPA ran one cuDNN kernel of 152 us at DROID on the H200 for 784 problems
    of one query and four keys (an sm80 kernel of 64 x 32 tiles; the twelfth session's profile),
    ~14 MB of keys and values (~3.5 us at bandwidth)."""
    scores = (q.float() * k.float()).sum(-1) * q.shape[-1] ** -0.5          # [N, heads, w]
    weights = scores.masked_fill(~mask[:, :, 0], float("-inf")).softmax(-1)
    return (weights[..., None] * v.float()).sum(-2, keepdim=True).to(q.dtype)


def use_window_attention_ops(model: nn.Module) -> None:
    """The vision pool's window attention as window_attention_ops."""
    model.vision.pool.attend = window_attention_ops
