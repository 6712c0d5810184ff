"""The official MolmoBot flow-matching objective, batched.

For normalised actions a [B, H, A] and noise n: t ~ cutoff * Beta(alpha, beta) (the official
sampler: cutoff 0.999, Beta(1, 1.5)), x_t = (1 - t) n + t a, target velocity a - n, loss the mean
squared error of the expert's velocity over the chunk's real (unpadded) actions. The forward is
the inference forward (vision -> LLM with the prompt's mask -> per-layer context -> expert), so a
trained checkpoint runs unchanged in every engine mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import rope_tables
from .policy import VLAPolicy
from .sequence import Prompt


@dataclass(frozen=True)
class FlowTimeSampler:
    cutoff: float = 0.999
    alpha: float = 1.0
    beta: float = 1.5

    def __call__(self, batch: int, device) -> torch.Tensor:
        """t [batch] on `device`, from the global generator (seed it with torch.manual_seed)."""
        beta = torch.distributions.Beta(torch.tensor(self.alpha, device=device), torch.tensor(self.beta, device=device))
        return self.cutoff * beta.sample((batch,))


def flow_matching_loss(model: VLAPolicy, pixels: torch.Tensor, prompt: Prompt, state: torch.Tensor,
                       actions: torch.Tensor, pad: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """pixels [B * images, 3, S, S] in [-1, 1] (slot order per sample), prompt shared by the batch,
    state [B, S] raw, actions [B, H, A] raw, pad [B, H] bool (True: past the episode's end),
    t [B], noise [B, H, A]. Returns the scalar loss."""
    b = state.shape[0]
    cfg = model.cfg
    device = state.device
    tokens = model.vision(pixels).reshape(b, -1, cfg.llm.dim)
    ids = torch.tensor([prompt.ids], device=device).expand(b, -1)
    embeds = model.embed(ids, tokens, torch.tensor(prompt.patch_positions, device=device))
    cos, sin = rope_tables(cfg.llm.head_dim, torch.arange(len(prompt), device=device), cfg.llm.rope_theta)
    hidden = model.llm(embeds, cos, sin, model.attention_mask(prompt, device))
    kv = model.expert.context_kv(hidden, model.normalize_state(state).to(embeds.dtype))
    target_actions = model.normalize_actions(actions)
    tt = t[:, None, None]
    x_t = (1 - tt) * noise + tt * target_actions
    velocity = model.expert.velocity(x_t.to(embeds.dtype), model.expert.modulations(t), kv).float()
    err = (velocity - (target_actions - noise)) ** 2
    # As the official loss: padded actions count as zero error in the mean.
    return (err * (~pad).float()[:, :, None]).mean()
