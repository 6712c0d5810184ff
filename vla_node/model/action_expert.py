"""Flow-matching DiT action expert.

One block per LLM layer. Per block: adaLN-Zero modulated self-attention over the action tokens,
cross-attention to that LLM layer's hidden states (one projection shared by all blocks, then
LayerNorm) plus one encoded robot-state token, then an MLP. The velocity field is integrated
with Euler from noise (t=0) to normalised actions (t=1).

The expert is split so the runtime can hoist work out of the flow loop without a second copy
of the maths: `context_kv` (depends on the query only), `modulations` (depends on t only) and
`velocity` (the per-step part).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ActionExpertConfig, ModelConfig
from .layers import FusableProjection

N_MODULATIONS = 9  # (shift, scale, gate) for self-attention, cross-attention and MLP
LN_EPS = 1e-6
CONTEXT_LN_EPS = 1e-5  # the context norm is a default nn.LayerNorm in the official model


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features [B, dim] of the flow time t [B] in [0, 1] (unscaled): frequencies
    exp(-ln(1e4) * i / (half - 1)), sines first."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32, device=t.device)
                      * (-math.log(10000.0) / max(half - 1, 1)))
    args = t.float()[:, None] * freqs[None, :]
    return F.pad(torch.cat([torch.sin(args), torch.cos(args)], dim=-1), (0, dim % 2))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class ExpertBlock(nn.Module):
    def __init__(self, cfg: ActionExpertConfig):
        super().__init__()
        w = cfg.width
        self.heads = cfg.heads
        self.ada = nn.Linear(w, N_MODULATIONS * w)
        self.norm1 = nn.LayerNorm(w, eps=LN_EPS, elementwise_affine=False)
        self.self_qkv = FusableProjection(w, {"q": w, "k": w, "v": w}, bias=True)
        self.self_out = nn.Linear(w, w)
        self.norm2 = nn.LayerNorm(w, eps=LN_EPS, elementwise_affine=False)
        self.cross_q = nn.Linear(w, w)
        self.cross_kv = FusableProjection(w, {"k": w, "v": w}, bias=True)
        self.cross_out = nn.Linear(w, w)
        self.norm3 = nn.LayerNorm(w, eps=LN_EPS, elementwise_affine=False)
        self.fc1 = nn.Linear(w, cfg.mlp)
        self.fc2 = nn.Linear(cfg.mlp, w)
        # attend(q, k, v, mask) with SDPA's meaning; the runtime may put a faster kernel here.
        self.attend = F.scaled_dot_product_attention

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, -1).transpose(1, 2)

    def token_kv(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K, V [B, heads, T, hd] of context tokens [B, T, w] (per token)."""
        k, v = self.cross_kv(tokens)
        return self._heads(k), self._heads(v)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, H, w] action tokens, mod [B, 9w], k/v from token_kv, ctx_mask [B|1, 1, 1, T] bool."""
        b, h, w = x.shape
        s1, c1, g1, s2, c2, g2, s3, c3, g3 = mod.chunk(N_MODULATIONS, dim=-1)
        q, sk, sv = (self._heads(y) for y in self.self_qkv(modulate(self.norm1(x), s1, c1)))
        y = self.attend(q, sk, sv, None)
        x = x + g1[:, None] * self.self_out(y.transpose(1, 2).reshape(b, h, w))
        q = self._heads(self.cross_q(modulate(self.norm2(x), s2, c2)))
        y = self.attend(q, k, v, ctx_mask)
        x = x + g2[:, None] * self.cross_out(y.transpose(1, 2).reshape(b, h, w))
        y = self.fc2(F.gelu(self.fc1(modulate(self.norm3(x), s3, c3))))
        return x + g3[:, None] * y


class ActionExpert(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.action
        self.cfg = a
        w = a.width
        self.time_mlp = nn.Sequential(nn.Linear(a.time_embed_dim, w), nn.SiLU(), nn.Linear(w, w))
        self.action_in = nn.Linear(a.action_dim, w)
        self.action_pos = nn.Parameter(torch.zeros(a.max_horizon, w))
        self.ctx_proj = nn.Linear(cfg.llm.dim, w, bias=False)
        self.ctx_norm = (nn.LayerNorm(w, eps=CONTEXT_LN_EPS, elementwise_affine=False) if a.context_norm
                         else nn.Identity())
        self.state_enc = nn.Linear(w, w)
        self.state_norm = nn.LayerNorm(w, eps=LN_EPS, elementwise_affine=False)
        self.blocks = nn.ModuleList(ExpertBlock(a) for _ in range(cfg.expert_depth))
        self.final_ada = nn.Linear(w, 2 * w)
        self.final_norm = nn.LayerNorm(w, eps=LN_EPS, elementwise_affine=False)
        self.action_out = nn.Linear(w, a.action_dim)

    def context_tokens(self, llm_hidden: torch.Tensor) -> torch.Tensor:
        """LLM hidden states [B, T, llm_dim] -> context tokens [B, T, w] (per token)."""
        return self.ctx_norm(self.ctx_proj(llm_hidden))

    def state_token(self, state: torch.Tensor) -> torch.Tensor:
        """The one context token encoding the normalised robot state: [B, state_dim] -> [B, 1, w]
        (the state zero-padded to the width, then Linear and LayerNorm)."""
        padded = F.pad(state, (0, self.cfg.width - state.shape[-1]))
        return self.state_norm(self.state_enc(padded))[:, None]

    def context_kv(self, llm_hidden: list[torch.Tensor],
                   state: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-block cross-attention K/V [B, heads, T+1, hd] over each LLM layer's context tokens
        followed by the state token (normalised state [B, state_dim])."""
        state_token = self.state_token(state)
        return [blk.token_kv(torch.cat([self.context_tokens(h), state_token], dim=1))
                for blk, h in zip(self.blocks, llm_hidden)]

    def modulations(self, t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """adaLN parameters for flow time t [B]: one [B, 9w] per block and the final [B, 2w]."""
        temb = F.silu(self.time_mlp(timestep_features(t, self.cfg.time_embed_dim).to(self.action_pos.dtype)))
        return [blk.ada(temb) for blk in self.blocks], self.final_ada(temb)

    def velocity(self, x: torch.Tensor, mods: tuple[list[torch.Tensor], torch.Tensor],
                 kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, H, action_dim] noisy normalised actions -> velocity [B, H, action_dim]."""
        block_mods, final_mod = mods
        h = self.action_in(x) + self.action_pos[:x.shape[1]]
        for blk, mod, (k, v) in zip(self.blocks, block_mods, kv):
            h = blk(h, mod, k, v, ctx_mask)
        shift, scale = final_mod.chunk(2, dim=-1)
        return self.action_out(modulate(self.final_norm(h), shift, scale))


VelocityFn = Callable[[torch.Tensor, int], torch.Tensor]


def flow_times(steps: int) -> list[float]:
    """Euler grid on [0, 1): t_i = i / steps."""
    return [i / steps for i in range(steps)]


@dataclass
class KnownActions:
    """Actions of a chunk fixed before it is sampled: real-time chunking by inpainting. While a
    chunk is inferred the robot runs what the previous chunk planned for those ticks, so the new
    one is made to start with exactly them and continue them. values [B, H, A] normalised (the
    rows not known: any finite value), known [B, H, 1] bool. Both are data, not shapes: one
    compiled graph or CUDA graph serves every prefix length."""
    values: torch.Tensor
    known: torch.Tensor

    def inpaint(self, x: torch.Tensor, noise: torch.Tensor, t: float) -> torch.Tensor:
        """x [B, H, A] at flow time t with its known rows where the training path puts them at t:
        x_t = (1 - t) * noise + t * action, from the same noise the loop started from (at t = 1
        the known values exactly). Torch ops only, no gradient: it stays inside a CUDA graph."""
        return torch.where(self.known, (1 - t) * noise + t * self.values, x)


def euler(velocity: VelocityFn, noise: torch.Tensor, steps: int,
          reuse: Optional[dict[int, int]] = None, known: Optional[KnownActions] = None) -> torch.Tensor:
    """Integrate dx/dt = velocity(x, step) from t=0 (noise) to t=1 with `steps` equal steps.
    `reuse` maps a step to an earlier computed step whose velocity it takes instead of calling
    `velocity` (action caching; the runtime validates the schedule). `known`: rows inpainted
    before every step and after the last, so the rest of the chunk is generated around them."""
    if steps < 1:
        raise ValueError(f"flow steps must be >= 1, got {steps}")
    dt = 1.0 / steps
    reuse = reuse or {}
    computed: dict[int, torch.Tensor] = {}
    x = noise
    for i, t in enumerate(flow_times(steps)):
        if known is not None:
            x = known.inpaint(x, noise, t)
        v = computed[reuse[i]] if i in reuse else velocity(x, i)
        computed[i] = v
        x = x + dt * v
    return x if known is None else known.inpaint(x, noise, 1.0)
