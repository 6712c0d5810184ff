"""The action expert's velocity in 6 Triton launches per block (kernels/expert_block.py) instead
of ~14 library kernels: a drop-in for ActionExpert.velocity in the flow loop.

Per flow step: action_in (1 launch), per block qkv / self_out / cross / cross_out / fc1 / fc2
(6; 7 with project_in_attention=False, which runs the cross-attention's q projection as its own
linear), final LayerNorm + action_out (1). The residual stream and all intermediates stay in
fp32 scratch buffers made once per (batch, horizon, context length), so a call allocates only
its output and can be captured in a CUDA graph (no host syncs). Exposed as the custom op
`vla::fused_expert_velocity`, opaque to torch.compile.

Optional fp8: every block linear in e4m3 with an fp32 scale per output channel (runtime/fp8.py's
row-wise quantize), dequantised in the kernels; activations stay in the model dtype. It changes
the numbers: report its deviation (scripts/bench_expert_gpu.py does).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton

from ..model.action_expert import LN_EPS, ActionExpert, ExpertBlock
from ..model.layers import FusableProjection
from .fp8 import quantize
from .kernels.expert_block import (
    SplitScratch,
    Tiling,
    block_rows,
    cross_attention,
    cross_partials,
    head_linear,
    linear,
    linear_splits,
)


@dataclass
class KernelWeights:
    """One linear for the kernels: weight [N, K] as the module holds it (no copy) or in e4m3
    with scale [N] (fp32, per output channel)."""
    weight: torch.Tensor
    bias: torch.Tensor
    scale: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor, fp8: bool) -> "KernelWeights":
        if not fp8:
            return cls(weight.detach(), bias.detach())
        values, scale = quantize(weight.detach(), rowwise=True)
        return cls(values, bias.detach(), scale.reshape(-1).contiguous())

    def dequantized(self) -> torch.Tensor:
        return self.weight if self.scale is None else (self.weight.float() * self.scale[:, None])


def _projection(proj: FusableProjection) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused q/k/v weight: runtime.fusion's shared buffer when fused, else one concatenated
    copy made here (once)."""
    if proj.fused_weight is not None:
        return proj.fused_weight, proj.fused_bias
    linears = [getattr(proj, n) for n in proj.names]
    return torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears])


class BlockWeights:
    def __init__(self, blk: ExpertBlock, fp8: bool):
        self.qkv = KernelWeights.of(*_projection(blk.self_qkv), fp8)
        self.self_out = KernelWeights.of(blk.self_out.weight, blk.self_out.bias, fp8)
        self.cross_q = KernelWeights.of(blk.cross_q.weight, blk.cross_q.bias, fp8)
        self.cross_out = KernelWeights.of(blk.cross_out.weight, blk.cross_out.bias, fp8)
        self.fc1 = KernelWeights.of(blk.fc1.weight, blk.fc1.bias, fp8)
        self.fc2 = KernelWeights.of(blk.fc2.weight, blk.fc2.bias, fp8)

    def linears(self) -> list[KernelWeights]:
        return [self.qkv, self.self_out, self.cross_q, self.cross_out, self.fc1, self.fc2]


@dataclass
class Buffers:
    """Scratch of one (batch, horizon, context length): fp32 rows [batch * horizon, *]."""
    x: torch.Tensor          # the residual stream [M, w]
    qkv: torch.Tensor        # [M, 3w]
    q: torch.Tensor          # cross-attention queries [M, w] (project_in_attention=False)
    hidden: torch.Tensor     # GELU(fc1) [M, mlp]
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    scratch: SplitScratch


_INSTANCES: "weakref.WeakValueDictionary[int, FusedExpert]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


class FusedExpert:
    """expert.velocity on the fused kernels. Holds views of expert's weights (or their e4m3
    copies), so the expert must outlive it. Not re-entrant across streams: calls share scratch."""

    def __init__(self, expert: ActionExpert, fp8: bool = False, project_in_attention: bool = True,
                 tiling: Tiling = Tiling(), pdl: bool = False):
        cfg = expert.cfg
        self.expert, self.fp8, self.tiling, self.pdl = expert, fp8, tiling, pdl
        self.project_in_attention = project_in_attention
        self.width, self.heads, self.mlp, self.action_dim = cfg.width, cfg.heads, cfg.mlp, cfg.action_dim
        self.dtype = expert.action_pos.dtype
        self.blocks = [BlockWeights(blk, fp8) for blk in expert.blocks]
        self._buffers: dict[tuple, Buffers] = {}
        self.handle = next(_IDS)
        _INSTANCES[self.handle] = self

    def weight_bytes(self) -> int:
        """Bytes of block weights one flow step reads (plus scales)."""
        return sum(t.numel() * t.element_size() for b in self.blocks for lin in b.linears()
                   for t in (lin.weight, lin.scale) if t is not None)

    def velocity(self, x: torch.Tensor, mods: tuple[list[torch.Tensor], torch.Tensor],
                 kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As ActionExpert.velocity: x [B, H, action_dim] (fp32 or model dtype), mods from
        ActionExpert.modulations, kv from ActionExpert.context_kv ([B, heads, T+1, hd] each),
        ctx_mask [B|1, 1, 1, T+1] bool -> velocity [B, H, action_dim] in the model dtype."""
        block_mods, final_mod = mods
        return fused_expert_velocity(self.handle, x, list(block_mods), final_mod, [k for k, _ in kv],
                                     [v for _, v in kv], ctx_mask)

    def buffers(self, entries: int, tokens: int, n_keys: int, device) -> Buffers:
        """The scratch of a shape, made on its first call (warm up before capturing a graph, as the
        runner does, so it is not allocated inside the capture)."""
        key = (entries, tokens, n_keys, torch.device(device))
        if key not in self._buffers:
            m, w, t = entries * tokens, self.width, self.tiling
            # Split scratch for the largest launch: linears by K, self_out / cross_out by head.
            blk = self.blocks[0]
            tiles_parts = [(triton.cdiv(lin.weight.shape[0], t.block_n),
                            linear_splits(lin.weight.shape[0], lin.weight.shape[1], t) * t.block_n)
                           for lin in (blk.qkv, blk.cross_q, blk.fc1, blk.fc2, self.expert.action_out)]
            tiles_parts.append((triton.cdiv(w, t.head_block_n), self.heads * t.head_block_n))
            tiles = max(n for n, _ in tiles_parts)
            floats = max(n * per for n, per in tiles_parts) * block_rows(m)
            f32 = dict(dtype=torch.float32, device=device)
            self._buffers[key] = Buffers(
                x=torch.empty((m, w), **f32), qkv=torch.empty((m, 3 * w), **f32), q=torch.empty((m, w), **f32),
                hidden=torch.empty((m, self.mlp), **f32),
                partials=cross_partials(entries, self.heads, tokens, w // self.heads, n_keys, t, device),
                scratch=SplitScratch.create(tiles, floats, device))
        return self._buffers[key]

    def run(self, x: torch.Tensor, block_mods: list[torch.Tensor], final_mod: torch.Tensor,
            keys: list[torch.Tensor], values: list[torch.Tensor], ctx_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The launches of one velocity (the custom op's body)."""
        entries, tokens, _ = x.shape
        m, e = entries * tokens, self.expert
        buf = self.buffers(entries, tokens, keys[0].shape[2], x.device)
        mask = ctx_mask.reshape(ctx_mask.shape[0], -1).contiguous() if ctx_mask is not None else None
        opts = dict(compute=self.dtype, tiling=self.tiling, pdl=self.pdl)
        linear(x.contiguous().view(m, -1), e.action_in.weight, e.action_in.bias, buf.x, buf.scratch,
               residual=e.action_pos[:tokens], **opts)
        for j, (mod, k, v) in enumerate(zip(block_mods, keys, values)):
            for _, launch in self.block_stages(buf, j, mod, k, v, mask, tokens):
                launch()
        out = torch.empty((m, self.action_dim), dtype=self.dtype, device=x.device)
        linear(buf.x, e.action_out.weight, e.action_out.bias, out, buf.scratch, mod=final_mod, norm=(0, self.width),
               tokens=tokens, eps=LN_EPS, **opts)
        return out.view(entries, tokens, self.action_dim)

    def block_stages(self, buf: Buffers, j: int, mod: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: Optional[torch.Tensor], tokens: int) -> list[tuple[str, Callable[[], None]]]:
        """Block j's launches in order, named (the benchmark times each): mod [B|1, 9w] holds
        (shift, scale, gate) for self-attention, cross-attention and MLP; mask [B|1, T+1]."""
        blk, w, s, heads = self.blocks[j], self.width, buf.scratch, self.heads
        opts = dict(compute=self.dtype, tiling=self.tiling, pdl=self.pdl)
        stages = [
            ("qkv", lambda: linear(buf.x, blk.qkv.weight, blk.qkv.bias, buf.qkv, s, weight_scale=blk.qkv.scale,
                                   mod=mod, norm=(0, w), tokens=tokens, eps=LN_EPS, **opts)),
            ("self_out", lambda: head_linear(buf.x, blk.self_out.weight, blk.self_out.bias, mod, 2 * w, s, heads=heads,
                                             tokens=tokens, qkv=buf.qkv, weight_scale=blk.self_out.scale, **opts))]
        if self.project_in_attention:
            stages.append(("cross", lambda: cross_attention(
                buf.x, k, v, mask, buf.partials, tokens=tokens, q_weight=blk.cross_q.weight, q_bias=blk.cross_q.bias,
                q_scale=blk.cross_q.scale, mod=mod, norm=(3 * w, 4 * w), eps=LN_EPS, **opts)))
        else:
            stages.append(("cross_q", lambda: linear(buf.x, blk.cross_q.weight, blk.cross_q.bias, buf.q, s,
                                                     weight_scale=blk.cross_q.scale, mod=mod, norm=(3 * w, 4 * w),
                                                     tokens=tokens, eps=LN_EPS, **opts)))
            stages.append(("cross", lambda: cross_attention(buf.q, k, v, mask, buf.partials, tokens=tokens, **opts)))
        return stages + [
            ("cross_out", lambda: head_linear(buf.x, blk.cross_out.weight, blk.cross_out.bias, mod, 5 * w, s,
                                              heads=heads, tokens=tokens, partials=buf.partials,
                                              weight_scale=blk.cross_out.scale, **opts)),
            ("fc1", lambda: linear(buf.x, blk.fc1.weight, blk.fc1.bias, buf.hidden, s, weight_scale=blk.fc1.scale,
                                   mod=mod, norm=(6 * w, 7 * w), gelu=True, tokens=tokens, eps=LN_EPS, **opts)),
            ("fc2", lambda: linear(buf.hidden, blk.fc2.weight, blk.fc2.bias, buf.x, s, weight_scale=blk.fc2.scale,
                                   mod=mod, gate=8 * w, residual=buf.x, tokens=tokens, **opts))]


@torch.library.custom_op("vla::fused_expert_velocity", mutates_args=())
def fused_expert_velocity(handle: int, x: torch.Tensor, block_mods: list[torch.Tensor], final_mod: torch.Tensor,
                          keys: list[torch.Tensor], values: list[torch.Tensor],
                          ctx_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return _INSTANCES[handle].run(x, block_mods, final_mod, keys, values, ctx_mask)


@fused_expert_velocity.register_fake
def _(handle, x, block_mods, final_mod, keys, values, ctx_mask):
    expert = _INSTANCES[handle]
    return x.new_empty((x.shape[0], x.shape[1], expert.action_dim), dtype=expert.dtype)
