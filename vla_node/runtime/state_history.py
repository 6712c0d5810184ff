"""Recent robot states by header stamp, so an observation pairs its frames with the state the
robot was in when they were taken (not the newest state at inference time, which can be a
camera period plus transport latency later). Shared by the node and the offline replay, so both
give the policy the same state for the same frames. numpy only."""
from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

# 2 s of joint states at 100 Hz: reaches back past the frames of any window still being formed.
DEFAULT_CAPACITY = 200


class StateHistory:
    """(stamp_ns, state) in arrival order, the last `capacity` of them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._entries: deque[tuple[int, np.ndarray]] = deque(maxlen=capacity)

    def add(self, stamp_ns: int, state: np.ndarray) -> None:
        self._entries.append((int(stamp_ns), state))

    def clear(self) -> None:
        self._entries.clear()

    def nearest(self, stamp_ns: int) -> Optional[tuple[int, np.ndarray]]:
        """(its stamp - stamp_ns, state) of the state stamped nearest `stamp_ns`: on a tie the later
        stamp, then the later arrival; None when there is none."""
        if not self._entries:
            return None
        stamp, state = min(reversed(self._entries), key=lambda e: (abs(e[0] - stamp_ns), -e[0]))
        return stamp - stamp_ns, state
