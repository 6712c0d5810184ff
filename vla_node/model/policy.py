"""The whole VLA: vision tower -> LLM -> action expert, and the [-1, 1] normalisation of
actions and state with statistics stored in the checkpoint."""
from __future__ import annotations

import torch
from torch import nn

from .action_expert import ActionExpert
from .config import ModelConfig
from .llm import LLM
from .sequence import Prompt
from .vision import VisionTower

# Franka Panda joint limits (rad) + gripper opening [0, 1]: the DROID robot. Used as the
# statistics of random-weight checkpoints whose action/state is 8-D; otherwise [-1, 1].
FRANKA_LOW = (-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973, 0.0)
FRANKA_HIGH = (2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973, 1.0)


def default_bounds(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if dim == len(FRANKA_LOW):
        return torch.tensor(FRANKA_LOW, dtype=torch.float32), torch.tensor(FRANKA_HIGH, dtype=torch.float32)
    return -torch.ones(dim, dtype=torch.float32), torch.ones(dim, dtype=torch.float32)


class VLAPolicy(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTower(cfg)
        self.llm = LLM(cfg.llm)
        self.expert = ActionExpert(cfg)
        a = cfg.action
        # Persistent: the statistics travel with the weights. Kept in fp32 whatever the model dtype.
        for name, dim in (("action", a.action_dim), ("state", a.state_dim)):
            low, high = default_bounds(dim)
            self.register_buffer(f"{name}_low", low)
            self.register_buffer(f"{name}_high", high)

    def normalize_state(self, state: torch.Tensor) -> torch.Tensor:
        return _to_unit(state, self.state_low, self.state_high)

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return _to_unit(actions, self.action_low, self.action_high)

    def denormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return (actions.float() + 1) * 0.5 * (self.action_high - self.action_low) + self.action_low

    def patch_positions(self, prompt: Prompt, device) -> torch.Tensor:
        """Sequence index of every <im_patch> token, in slot order: [images * tokens_per_image]."""
        n = self.cfg.vision.tokens_per_image
        starts = torch.tensor([prompt.patch_start(s) for s in range(prompt.images)], device=device)
        return (starts[:, None] + torch.arange(n, device=device)).reshape(-1)

    def embed(self, ids: torch.Tensor, image_tokens: torch.Tensor, patch_positions: torch.Tensor) -> torch.Tensor:
        """ids [B, T]; image_tokens [B, images * tokens_per_image, dim] added at patch_positions."""
        return self.llm.embed(ids).index_add(1, patch_positions, image_tokens.to(self.llm.embed.weight.dtype))


def _to_unit(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    return 2 * (x.float() - low) / (high - low) - 1
