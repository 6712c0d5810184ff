"""Hold causes (faults) and rolling statistics for /diagnostics. No ROS publishing here."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Callable, Iterable, Optional

import numpy as np
from diagnostic_msgs.msg import KeyValue

# A source logs (and announces) at most this many changes ...
LOG_BURST = 10
LOG_WINDOW_S = 10.0   # ... in this many seconds; flush() sums up the rest once the window allows


class Faults:
    """Active hold causes, by source ("camera 'exo'", "joint_states", "estop", ...).

    A new or changed cause is logged once as a warning and announced once through `on_change`
    (the node publishes /diagnostics right away); its end is logged once. Repeating the same
    cause, e.g. every frame of a broken camera, logs nothing more. A source that flaps (causes
    alternating message by message, or set and cleared in turn) logs LOG_BURST changes per
    LOG_WINDOW_S and flush() sums up the others, so neither the log nor /diagnostics follows
    the message rate. Thread-safe: compressed frames are decoded off the executor thread.
    """

    def __init__(self, logger, on_change: Callable[[], None], clock: Callable[[], float] = time.monotonic):
        self._logger = logger
        self._on_change = on_change
        self._clock = clock
        self._active: dict[str, str] = {}
        self._lock = threading.Lock()
        self.events: Counter = Counter()   # how often each source started or changed a fault
        self._logged: dict[str, deque] = {}   # source -> clock() of its recent log lines
        self._quiet: Counter = Counter()      # source -> changes not logged since its last line
        self._last: dict[str, str] = {}       # source -> its latest cause, active or not

    def set(self, source: str, reason: str) -> None:
        with self._lock:
            if self._active.get(source) == reason:
                return
            self._active[source] = self._last[source] = reason
            self.events[source] += 1
            note = self._may_log(source)
        if note is not None:
            self._logger.warning(f"holding: {source}: {reason}{note}")
            self._on_change()

    def clear(self, source: str) -> None:
        with self._lock:
            reason = self._active.pop(source, None)
            note = self._may_log(source) if reason is not None else None
        if note is not None:
            self._logger.info(f"resolved: {source}: {reason}{note}")
            self._on_change()

    def _may_log(self, source: str) -> Optional[str]:
        """With the lock held: None if this change of `source` is only counted, else what to
        add to its log line."""
        times = self._logged.setdefault(source, deque())
        now = self._clock()
        while times and now - times[0] > LOG_WINDOW_S:
            times.popleft()
        if len(times) < LOG_BURST:
            times.append(now)
            quiet = self._quiet.pop(source, 0)
            return f" (after {quiet} changes not logged one by one)" if quiet else ""
        self._quiet[source] += 1
        return None

    def flush(self) -> None:
        """Log where each flapping source stands now, with how many changes went unlogged, once
        its window allows a line again (the node calls this every second)."""
        lines = []
        with self._lock:
            for source in list(self._quiet):
                times, now = self._logged[source], self._clock()
                while times and now - times[0] > LOG_WINDOW_S:
                    times.popleft()
                if len(times) >= LOG_BURST:
                    continue
                times.append(now)
                state = "holding" if source in self._active else "resolved"
                quiet = self._quiet.pop(source)
                lines.append(f"{state}: {source}: {self._last[source]} (after {quiet} changes not logged one by one)")
        for line in lines:
            self._logger.warning(line)
        if lines:
            self._on_change()

    def reset(self) -> None:
        """Forget every cause without a word: the inputs they came from are gone (cleanup)."""
        with self._lock:
            self._active.clear()
            self._quiet.clear()

    def active(self) -> dict[str, str]:
        with self._lock:
            return dict(self._active)

    def sources(self) -> set[str]:
        with self._lock:
            return set(self._active)

    def __bool__(self) -> bool:
        return bool(self._active)


class Rolling:
    """The last `size` samples of one quantity."""

    def __init__(self, size: int):
        self._values: deque = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)

    def newest(self) -> Optional[float]:
        return self._values[-1] if self._values else None

    def values(self) -> np.ndarray:
        # deque.copy() runs in C under the GIL: safe against appends from another thread.
        values = self._values.copy()
        return np.fromiter(values, dtype=np.float64, count=len(values))

    def percentiles(self, *q: float) -> Optional[np.ndarray]:
        values = self.values()
        return np.percentile(values, q) if len(values) else None


def key_values(pairs: Iterable[tuple[str, object]]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_text(v)) for k, v in pairs]


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def percentile_pairs(name: str, rolling: Rolling, unit: str = "ms") -> list[tuple[str, object]]:
    p = rolling.percentiles(50, 99, 100)
    if p is None:
        return [(f"{name}_{unit}", "no data")]
    return [(f"{name}_{unit}_p50", float(p[0])), (f"{name}_{unit}_p99", float(p[1])),
            (f"{name}_{unit}_max", float(p[2]))]
