"""The whole VLA: vision tower -> LLM -> action expert, the prompt's attention pattern, and the
[-1, 1] normalisation of actions and state with statistics stored in the checkpoint."""
from __future__ import annotations

import torch
from torch import nn

from .action_expert import ActionExpert
from .config import FRANKA_HIGH, FRANKA_LOW, ModelConfig
from .llm import LLM
from .sequence import Prompt
from .vision import VisionTower

NORM_EPS = 1e-6  # the official normaliser's floor on the statistics' spread


def default_stats(dim: int) -> torch.Tensor:
    """[2, dim] bounds used by random-weight checkpoints (min_max or quantile modes): the Franka
    limits when 8-D, otherwise [-1, 1]."""
    if dim == len(FRANKA_LOW):
        return torch.tensor([FRANKA_LOW, FRANKA_HIGH], dtype=torch.float32)
    return torch.stack([-torch.ones(dim), torch.ones(dim)]).float()


def normalize(x: torch.Tensor, stats: torch.Tensor, mode: str) -> torch.Tensor:
    """x in robot units -> [-1, 1] units. stats [2, dim]: (min, max), (q01, q99), (q10, q90) or
    (mean, std) by mode, as the official RobotPreprocessor."""
    x = x.float()
    if mode == "mean_std":
        return (x - stats[0]) / stats[1].clamp_min(NORM_EPS)
    return 2 * (x - stats[0]) / (stats[1] - stats[0]).clamp_min(NORM_EPS) - 1


def denormalize(x: torch.Tensor, stats: torch.Tensor, mode: str) -> torch.Tensor:
    """The inverse of `normalize`, as the official RobotPostprocessor (no floor, no clipping)."""
    x = x.float()
    if mode == "mean_std":
        return x * stats[1] + stats[0]
    return (x + 1) * (stats[1] - stats[0]) / 2 + stats[0]


class VLAPolicy(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTower(cfg)
        self.llm = LLM(cfg.llm)
        self.expert = ActionExpert(cfg)
        a = cfg.action
        # Persistent: the statistics travel with the weights. Kept in fp32 whatever the model dtype.
        self.register_buffer("action_stats", default_stats(a.action_dim))
        self.register_buffer("state_stats", default_stats(a.state_dim))

    def normalize_state(self, state: torch.Tensor) -> torch.Tensor:
        return normalize(state, self.state_stats, self.cfg.robot.state_norm)

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return normalize(actions, self.action_stats, self.cfg.robot.action_norm)

    def denormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return denormalize(actions, self.action_stats, self.cfg.robot.action_norm)

    def attention_mask(self, prompt: Prompt, device) -> torch.Tensor:
        """[T, T] bool: causal, and with bidirectional image attention every image special token
        also sees every other one (later images included)."""
        t = len(prompt)
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        if self.cfg.prompt.bidirectional_images:
            image = torch.tensor(prompt.image_token, device=device)
            mask |= image[:, None] & image[None, :]
        return mask

    def embed(self, ids: torch.Tensor, image_tokens: torch.Tensor, patch_positions: torch.Tensor) -> torch.Tensor:
        """ids [B, T]; image_tokens [B, images * tokens_per_image, dim] added at patch_positions."""
        return self.llm.embed(ids).index_add(1, patch_positions, image_tokens.to(self.llm.embed.weight.dtype))
