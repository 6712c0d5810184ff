"""What the node reports on /diagnostics: hold causes (Faults), its statistics (NodeTelemetry)
and the names of the values (Key), which the bench, the live replay summary and the tests read
back. No ROS here: the tools import it without rclpy."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from enum import Enum
from typing import Callable, Optional

import numpy as np

# A source logs (and announces) at most this many changes ...
LOG_BURST = 10
LOG_WINDOW_S = 10.0   # ... in this many seconds; flush() sums up the rest once the window allows


def burst_allows(times: deque, now: float) -> bool:
    """Whether one more announcement fits in LOG_BURST per LOG_WINDOW_S, `times` holding the
    clock of the recent ones (oldest first; those out of the window are dropped). If it fits it is
    counted: `now` appended."""
    while times and now - times[0] > LOG_WINDOW_S:
        times.popleft()
    if len(times) >= LOG_BURST:
        return False
    times.append(now)
    return True


class FaultSource(str, Enum):
    """Where a hold cause comes from: the keys of Faults (cameras are named: camera(name), and a
    silent input is stale(source)). A str, so that logs, /diagnostics and the tests read its value."""
    ENGINE = "engine"              # the engine process: lost, rejected or failed an observation, no answer
    OUTPUT = "output"              # a chunk with non-finite actions
    SYNC = "sync"                  # the inputs out of step for longer than input_timeout_s
    CLOCK = "clock"                # the node's clock jumped back
    TIMELINE = "timeline"          # the inputs' timeline changed (runtime/timeline.py)
    JOINT_STATES = "joint_states"  # a malformed joint state message
    INSTRUCTION = "instruction"    # an empty or refused instruction
    ESTOP = "estop"                # the e-stop is engaged

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @staticmethod
    def camera(name: str) -> str:
        return f"camera {name!r}"

    @staticmethod
    def stale(source: str) -> str:
        """An input silent for longer than input_timeout_s."""
        return f"{source} stale"


def duration_in_words(seconds: float) -> str:
    """"1 ms", "250 ms", "1.500 s": a step of a millisecond is not "0.000 s"."""
    return f"{seconds * 1e3:.3g} ms" if abs(seconds) < 1.0 else f"{seconds:.3f} s"


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
        if burst_allows(self._logged.setdefault(source, deque()), self._clock()):
            quiet = self._quiet.pop(source, 0)
            return f" (after {quiet} changes not logged one by one)" if quiet else ""
        self._quiet[source] += 1
        return None

    def flush(self, final: bool = False) -> None:
        """Log where each flapping source stands now, with how many changes went unlogged, once
        its window allows a line again (the node calls this every second), or at once if `final`."""
        lines = []
        with self._lock:
            for source in list(self._quiet):
                times, now = self._logged[source], self._clock()
                if not burst_allows(times, now):
                    if not final:
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
        """Forget every cause: the inputs they came from are gone (cleanup). The standing of a
        flapping source is logged first: its last changes would otherwise never reach the log."""
        self.flush(final=True)
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


STAGES = ("preprocess", "vision", "llm", "action", "total")   # the engine's timings, ms each
# What the node adds to engine.predict() per observation: choosing and sending the window, the
# hop to the worker, the worker's wrapping around predict(), taking the answer in.
OVERHEAD_PARTS = ("send", "to_worker", "worker", "take")
STATS_WINDOW = 1000     # samples in the loop's rolling statistics (20 s of ticks at 50 Hz)
TIMING_WINDOW = 200     # samples in each per-chunk statistic


class Key:
    """The /diagnostics key names: the node writes them, `vla-bench node`, `vla-replay live`'s
    summary, the demo, the soak test and the tests read them from here.

    A statistic in ms is reported as ms(name, q) = "{name}_ms_{q}" for q in p50, p99, max
    ("{name}_ms": "no data" before its first sample); command_period only as p50.
    """
    STATE = "state"
    HOLD = "hold"
    FAULTS = "faults"                   # "source: reason; ..." or "none"
    HOLDS_BY_CAUSE = "holds_by_cause"   # "source=count, ..." or "none": how often each fault began
    CONFIGURE_ERROR = "configure_error"
    CONFIGURE_STAGE = "configure_stage"   # while configuring: engine_protocol.STARTING, LOADING, ...
    ENGINE = "engine"
    ENGINE_PID = "engine_pid"
    ENGINE_SERVER = "engine_server"     # the socket of the shared engine server the node attached to
    # Observations in the engine's query that answered the last chunk (an engine server batches
    # several nodes' queries; a node's own engine runs 1), and the largest since start-up.
    ENGINE_BATCH_SIZE = "engine_batch_size"
    ENGINE_BATCH_SIZE_MAX = "engine_batch_size_max"
    HORIZON = "horizon"
    ENGINE_RESTART = "engine_restart"   # while one is under way: "attempt n"
    CONTROL_RATE_HZ = "control_rate_hz"
    TICKS = "ticks"
    LATENCY_TICKS_MAX = "latency_ticks_max"
    FRAMES_DROPPED_UNCONVERTED = "frames_dropped_unconverted"
    GPU_MEMORY = "gpu_memory"           # "n/a (device cpu)" or, on CUDA, the two below
    GPU_MEMORY_ALLOCATED_MIB = "gpu_memory_allocated_mib"
    GPU_MEMORY_RESERVED_MIB = "gpu_memory_reserved_mib"
    # Counters since start-up.
    CHUNKS = "chunks"                   # taken into the plan (each published a trajectory)
    LATE_CHUNKS = "late_chunks"         # arrived after their last action's tick: dropped
    REQUESTS = "requests"
    REJECTED = "rejected"               # observations the engine refused
    DISCARDED = "discarded"             # stale chunks: requested before a hold, reset or new timeline
    OBSERVATIONS_DROPPED = "observations_dropped"
    PLAN_UNDERRUNS = "plan_underruns"
    ENGINE_RESTARTS = "engine_restarts"  # engine processes that replaced a lost one (engine_restart_s)
    COUNTERS = (CHUNKS, LATE_CHUNKS, REQUESTS, REJECTED, DISCARDED, OBSERVATIONS_DROPPED, PLAN_UNDERRUNS,
                ENGINE_RESTARTS)
    # Statistics (ms).
    COMMAND_PERIOD = "command_period"   # between control ticks (the node's clock)
    COMMAND_JITTER = "command_jitter"   # |period - control period|; not on simulated time
    ENGINE_PREDICT = "engine_predict"   # engine.predict() wall time in the engine process
    # From the node's send to the engine starting the query: the transfer and, on a shared engine
    # server, the wait behind other nodes' queries (which node_overhead's to_worker then holds too).
    ENGINE_QUEUE = "engine_queue"
    # From the query's arrival at the engine server to its batch closing (the batching window; part of engine_queue).
    ENGINE_BATCH_WAIT = "engine_batch_wait"
    ROUND_TRIP = "round_trip"           # request sent -> chunk taken
    NODE_OVERHEAD = "node_overhead"     # the sum of OVERHEAD_PARTS
    TRAJECTORY_PUBLISH = "trajectory_publish"
    FRAME_INGEST = "frame_ingest"       # a camera frame into the frame buffer

    @staticmethod
    def ms(name: str, q: str) -> str:
        return f"{name}_ms_{q}"

    @staticmethod
    def engine_stage(stage: str) -> str:
        """The statistic of one of STAGES."""
        return f"engine_{stage}"

    @staticmethod
    def overhead_part(part: str) -> str:
        """The statistic of one of OVERHEAD_PARTS."""
        return f"node_overhead_{part}"

    @staticmethod
    def input_age(source: str) -> str:
        """Seconds since a camera's (by name) or the joint states' ("joint_states") newest input."""
        return f"input_age_s.{source}"


OK, WARN, ERROR = 0, 1, 2      # diagnostic_msgs/DiagnosticStatus levels
RUNNING = "running"            # summary()'s message while the control loop commands (level OK)


def summary(state: str, configure_error: str, faults: dict[str, str], hold: Optional[str],
            stage: str = "") -> tuple[int, str]:
    """The node's /diagnostics level and message: the stage of a configure under way, a failed
    configure, the faults, the lifecycle state if not active, the control loop's hold, else
    "running"."""
    if state == "configuring":
        return WARN, f"configuring: {stage}"
    if configure_error and state == "unconfigured":
        return ERROR, f"configure failed: {configure_error}"
    if faults:
        return ERROR, "holding: " + "; ".join(f"{k}: {v}" for k, v in sorted(faults.items()))
    if state != "active":
        return WARN, f"holding: {state}"
    if hold is not None:
        return WARN, f"holding: {hold}"
    return OK, RUNNING


def status_pairs(state: str, configure_error: str, faults: dict[str, str], hold: Optional[str],
                 events: Counter, stage: str = "") -> list[tuple[str, object]]:
    """/diagnostics values of summary()'s inputs; `events`: how often each fault source began
    (Faults.events)."""
    values = [(Key.STATE, state), (Key.HOLD, hold or "no"),
              (Key.FAULTS, "; ".join(f"{k}: {v}" for k, v in sorted(faults.items())) or "none"),
              (Key.HOLDS_BY_CAUSE, ", ".join(f"{k}={n}" for k, n in sorted(events.items())) or "none")]
    if state == "configuring":
        values.append((Key.CONFIGURE_STAGE, stage))
    if configure_error:
        values.append((Key.CONFIGURE_ERROR, configure_error))
    return values


class NodeTelemetry:
    """The node's statistics: control ticks, per-chunk timings, counters."""

    def __init__(self):
        self.loop = Rolling(STATS_WINDOW)          # control tick start times (time.perf_counter(), s)
        self.stage_ms = {s: Rolling(TIMING_WINDOW) for s in STAGES}
        self.predict_ms = Rolling(TIMING_WINDOW)
        self.queue_ms = Rolling(TIMING_WINDOW)
        self.batch_wait_ms = Rolling(TIMING_WINDOW)
        self.batch_size: Optional[int] = None    # of the last chunk's query
        self.batch_size_max = 0
        self.round_trip_ms = Rolling(TIMING_WINDOW)
        self.overhead_ms = Rolling(TIMING_WINDOW)
        self.overhead_parts_ms = {part: Rolling(TIMING_WINDOW) for part in OVERHEAD_PARTS}
        self.trajectory_ms = Rolling(TIMING_WINDOW)   # building + publishing ~/joint_trajectory, after the plan
        self.ingest_ms = Rolling(STATS_WINDOW)
        self.counts = dict.fromkeys(Key.COUNTERS, 0)
        self.memory: Optional[tuple] = None      # (allocated, reserved) device bytes of the last chunk

    def tick(self, started: float) -> None:
        self.loop.add(started)

    def chunk(self, request, result, arrived: float) -> None:
        """Timings of an answered request (control.Request) whose chunk (engine_protocol.Chunk)
        the control loop has taken or dropped as late; `arrived`: when the loop had it (read from
        the pipe, after any wait a fixed latency makes)."""
        for stage in STAGES:
            if stage in result.timings:
                self.stage_ms[stage].add(result.timings[stage])
        self.predict_ms.add(result.predict_ms)
        self.queue_ms.add(result.queued_ms)
        self.batch_wait_ms.add(result.batch_wait_ms)
        self.batch_size = result.batch_size
        self.batch_size_max = max(self.batch_size_max, result.batch_size)
        self.round_trip_ms.add((arrived - request.sent_at) * 1e3)
        # Not the wait for the next tick, which is scheduling, not work; the trajectory message
        # is built after and timed apart.
        parts = dict(send=request.send_ms, to_worker=(result.received_at - request.sent_at) * 1e3,
                     worker=(result.sent_at - result.received_at) * 1e3 - result.predict_ms,
                     take=(time.perf_counter() - arrived) * 1e3)
        for part, ms in parts.items():
            self.overhead_parts_ms[part].add(ms)
        self.overhead_ms.add(sum(parts.values()))
        self.memory = result.memory

    def pairs(self, control_period_s: float, sim_time: bool, device: str) -> list[tuple[str, object]]:
        """(key, value) of every statistic and counter; jitter only on the wall clock."""
        values = self._loop_pairs(control_period_s, sim_time)
        for stage in STAGES:
            values += percentile_pairs(Key.engine_stage(stage), self.stage_ms[stage])
        values += percentile_pairs(Key.ENGINE_PREDICT, self.predict_ms)
        values += percentile_pairs(Key.ENGINE_QUEUE, self.queue_ms)
        values += percentile_pairs(Key.ENGINE_BATCH_WAIT, self.batch_wait_ms)
        if self.batch_size is not None:
            values += [(Key.ENGINE_BATCH_SIZE, self.batch_size), (Key.ENGINE_BATCH_SIZE_MAX, self.batch_size_max)]
        values += percentile_pairs(Key.ROUND_TRIP, self.round_trip_ms)
        values += percentile_pairs(Key.NODE_OVERHEAD, self.overhead_ms)
        for part, rolling in self.overhead_parts_ms.items():
            values += percentile_pairs(Key.overhead_part(part), rolling)
        values += percentile_pairs(Key.TRAJECTORY_PUBLISH, self.trajectory_ms)
        values += percentile_pairs(Key.FRAME_INGEST, self.ingest_ms)
        values += list(self.counts.items())
        if self.memory is not None:
            values += [(Key.GPU_MEMORY_ALLOCATED_MIB, self.memory[0] / 2**20),
                       (Key.GPU_MEMORY_RESERVED_MIB, self.memory[1] / 2**20)]
        else:
            values.append((Key.GPU_MEMORY, f"n/a (device {device})"))
        return values

    def _loop_pairs(self, control_period_s: float, sim_time: bool) -> list:
        if len(self.loop) < 3:
            return [(f"{Key.COMMAND_PERIOD}_ms", "no data")]
        periods = np.diff(self.loop.values()) * 1e3
        pairs = [(Key.ms(Key.COMMAND_PERIOD, "p50"), float(np.percentile(periods, 50)))]
        if not sim_time:
            jitter = np.abs(periods - control_period_s * 1e3)
            q = np.percentile(jitter, [50, 99])
            pairs += [(Key.ms(Key.COMMAND_JITTER, "p50"), float(q[0])),
                      (Key.ms(Key.COMMAND_JITTER, "p99"), float(q[1])),
                      (Key.ms(Key.COMMAND_JITTER, "max"), float(jitter.max()))]
        return pairs


def percentile_pairs(name: str, rolling: Rolling) -> list[tuple[str, object]]:
    p = rolling.percentiles(50, 99, 100)
    if p is None:
        return [(f"{name}_ms", "no data")]
    return [(Key.ms(name, "p50"), float(p[0])), (Key.ms(name, "p99"), float(p[1])), (Key.ms(name, "max"), float(p[2]))]
