"""Per-stage wall time of one query."""
from __future__ import annotations

import time

import torch


class StageTimer:
    """Time per stage of one query. On CUDA a mark records an event and the device is waited for
    once, in total(): the host queues each stage while the device still runs the one before it
    (waiting at every mark left the device idle for each stage's launch). A stage's time is then
    the device's, from the mark before (preprocess: the host's work, during which the device idles,
    and the uploads it queued). total() is wall time, from the timer's start to the device's end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: dict[str, float] = {}
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.start = self.last = time.perf_counter()
        self.start_event = self._event() if self.cuda else None

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, stage: str) -> None:
        if self.cuda:
            self.events.append((stage, self._event()))
            return
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + (now - self.last) * 1e3
        self.last = now

    def total(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            self.last = time.perf_counter()
            before = self.start_event
            for stage, event in self.events:
                self.times[stage] = self.times.get(stage, 0.0) + before.elapsed_time(event)
                before = event
        self.times["total"] = (self.last - self.start) * 1e3
        return self.times
