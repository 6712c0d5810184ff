"""Per-stage wall time of one query."""
from __future__ import annotations

import time

import torch


class StageTimer:
    """Wall time per stage; on CUDA each mark waits for the device so stages are attributed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: dict[str, float] = {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, stage: str) -> None:
        now = self._now()
        self.times[stage] = self.times.get(stage, 0.0) + (now - self.last) * 1e3
        self.last = now

    def total(self) -> dict[str, float]:
        self.times["total"] = (self.last - self.start) * 1e3
        return self.times
