"""Action caching: reuse a computed flow step's velocity for later steps instead of running the
action expert again (opt-in; it changes the actions, and the benchmark prints by how much).

Schedules, as a string (the ROS parameter `action_cache` takes the same):
    ""                 every step computed (plain Euler)
    "flashdrive"       8 steps; steps 3-6 reuse step 2's velocity (FlashDrive)
    "3-6:2" / "4:3,5:3"  explicit: step (or inclusive range) : computed step it reuses
    "adaptive:0.05"    reuse the last velocity while the relative change between the last two
                       computed velocities ||v_k - v_j|| / ||v_k|| stays below 0.05, at most
                       MAX_ADAPTIVE_REUSE steps in a row
Steps are 0-based. Imports without torch, so the ROS node validates schedules itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MAX_ADAPTIVE_REUSE = 4


@dataclass(frozen=True)
class FlowSchedule:
    steps: int
    reuse: tuple[tuple[int, int], ...] = ()   # (step, computed step whose velocity it takes)
    adaptive_threshold: Optional[float] = None

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"flow steps must be >= 1, got {self.steps}")
        seen = set()
        for step, source in self.reuse:
            if not 0 <= step < self.steps:
                raise ValueError(f"action cache: step {step} is outside 0..{self.steps - 1}")
            if step in seen:
                raise ValueError(f"action cache: step {step} is given twice")
            if not 0 <= source < step:
                raise ValueError(f"action cache: step {step} can only reuse an earlier step, not {source}")
            seen.add(step)
        for step, source in self.reuse:
            if source in seen:
                raise ValueError(f"action cache: step {step} reuses step {source}, which is itself reused")
        if self.adaptive_threshold is not None:
            if self.reuse:
                raise ValueError("action cache: adaptive and a static schedule are exclusive")
            if not 0.0 < self.adaptive_threshold < 1.0:
                raise ValueError(f"action cache: adaptive threshold must be in (0, 1), got {self.adaptive_threshold}")

    @classmethod
    def parse(cls, spec: str, steps: int) -> "FlowSchedule":
        spec = _normal(spec)
        if spec in ("", "none", "off"):
            return cls(steps)
        if spec == "flashdrive":
            if steps != 8:
                raise ValueError(f"action cache 'flashdrive' is defined for 8 flow steps, not {steps}")
            return cls(steps, tuple((s, 2) for s in range(3, 7)))
        if is_adaptive(spec):
            try:
                threshold = float(spec.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"action cache: cannot read the threshold in {spec!r}") from None
            return cls(steps, adaptive_threshold=threshold)
        pairs = []
        for item in spec.split(","):
            try:
                target, source = item.split(":")
                lo, _, hi = target.partition("-")
                pairs += [(s, int(source)) for s in range(int(lo), int(hi or lo) + 1)]
            except ValueError:
                raise ValueError(f"action cache: cannot read {item!r} (expected 'step:source' or "
                                 f"'first-last:source', e.g. '3-6:2')") from None
        return cls(steps, tuple(pairs))

    @property
    def reuse_map(self) -> dict[int, int]:
        return dict(self.reuse)

    @property
    def expert_calls(self) -> Optional[int]:
        """Action-expert forwards per query (None: decided at run time)."""
        return None if self.adaptive_threshold is not None else self.steps - len(self.reuse)


def _normal(spec: str) -> str:
    return (spec or "").strip().lower()


def is_adaptive(spec: str) -> bool:
    """Whether a schedule string asks for the adaptive cache (valid or not, whatever the steps)."""
    return _normal(spec).startswith("adaptive:")
