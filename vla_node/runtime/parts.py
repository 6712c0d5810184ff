"""What the fast path needs of a loaded engine, frozen: the runner and the streaming buffers take
this instead of the engine itself, so `engine.py` -> `static.py` -> `streaming.py` import in one
direction only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..model.policy import VLAPolicy, denormalize
from ..model.sequence import PromptBuilder
from .types import EngineConfig, Observation, WindowLayout

Progress = Callable[[str], None]


def require_finite(actions: torch.Tensor, config: EngineConfig, what: str) -> None:
    """Warm-up's check of its own queries' (normalised) actions: non-finite weights, or a feature
    broken on this device and dtype (fp32 attention once ran a half-precision-only kernel, NaN
    without an error), fail the start in one line instead of having every chunk refused later."""
    if not bool(torch.isfinite(actions).all()):
        raise RuntimeError(f"warm-up gave non-finite actions ({what}; {config.dtype} on {config.device}): the "
                           "checkpoint's weights are not finite, or a feature of this engine mode is broken on this "
                           "device (a lower engine mode, e.g. fused, or the other dtype tells which)")


@dataclass(frozen=True)
class EngineParts:
    model: VLAPolicy
    prompts: PromptBuilder
    config: EngineConfig        # layout resolved (never None)
    device: torch.device
    dtype: torch.dtype
    progress: Progress

    def state_tensor(self, obs: Observation) -> torch.Tensor:
        """The observation's raw state as [1, state_dim] fp32 on the device. Its upload does not wait
        for the device (a pageable host buffer is staged before the call returns): a static query
        stages it while the vision stage runs."""
        state = torch.from_numpy(np.array(obs.state, dtype=np.float32))[None]
        return state.to(self.device, non_blocking=True)

    def dummy_observation(self, layout: Optional[WindowLayout] = None, seed: int = 0) -> Observation:
        """Random frames and a state inside the checkpoint's statistics (warm-up, benchmarks)."""
        layout = layout or self.config.layout
        rng = np.random.default_rng(seed)
        c, mc = self.config, self.model.cfg
        images = [rng.integers(0, 256, (c.camera_height, c.camera_width, 3), dtype=np.uint8)
                  for _ in range(layout.images)]
        unit = torch.from_numpy(rng.uniform(-1, 1, mc.action.state_dim))
        state = denormalize(unit, self.model.state_stats.cpu(), mc.robot.state_norm).numpy()
        return Observation(images=images, state=state, instruction="pick up the red cup and put it in the bowl")
