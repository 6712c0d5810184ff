"""What crosses the boundary between a node and its engine's process (its own worker, or the
engine server's session): small frozen dataclasses, matched by type on both sides, over a pipe or
a Unix socket (Predict -> Chunk | Rejected | Failed, Reconfigure -> Reconfigured, ...); an error
crosses with its traceback. The frames do not cross here: they are in shared memory (FrameBuffer
names them once, its file descriptor follows). No ROS and no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ..runtime.types import EngineConfig

# The stages of an engine's start, as /diagnostics reports them during configure.
STARTING = "starting the engine process"
LOADING = "loading weights"
WARMING_UP = "warming up (compiling and capturing, as engine_mode asks)"
# Tests: a worker whose environment names a file here waits for the file to exist before warming up,
# so that a test can look at the node while it configures for as long as it needs.
WARMUP_GATE_ENV = "VLA_NODE_TEST_WARMUP_GATE"

# Node -> worker.
@dataclass(frozen=True)
class Attach:
    """The first message to an engine server: the engine this node wants (its parameters')."""
    config: "EngineConfig"
    worker: "WorkerOptions"


@dataclass(frozen=True)
class FrameBuffer:
    """The shared frames (their file descriptor follows on the pipe): uint8 `shape`."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Predict:
    request_id: int
    slots: list[int]            # the window's frames in the shared buffer, in slot order
    frame_ids: Optional[list]   # (camera, stamp_ns) per slot: the engine's frame identity; None: all new
    state: np.ndarray           # [state_dim] float32
    instruction: str
    stamp: float                # seconds: the newest frame's
    known_actions: Optional[np.ndarray] = None   # [k, action_dim] float32: Observation.known_actions
    sent_at: float = 0.0        # time.perf_counter() when the node sent it (one clock on one machine)


@dataclass(frozen=True)
class ResetStream:
    """A new timeline: the engine forgets what it carries between queries."""


@dataclass(frozen=True)
class Reconfigure:
    """Change run-time options (runtime.types.RUNTIME_OPTIONS) between predictions."""
    changes: dict


@dataclass(frozen=True)
class Close:
    """End the worker once the prediction under way is done."""


# Worker -> node.
@dataclass(frozen=True)
class Progress:
    message: str


@dataclass(frozen=True)
class Stage:
    name: str                   # STARTING, LOADING, WARMING_UP


@dataclass(frozen=True)
class StartFailed:
    reason: str                 # one line: for /diagnostics and configure's answer
    trace: str                  # the worker's traceback: the node logs it once


@dataclass(frozen=True)
class Ready:
    pid: int                    # the engine's process (a node's own worker, or the engine server)
    horizon: int
    action_dim: int
    state_dim: int
    description: str
    history_offset_s: float
    robot: dict
    config: EngineConfig        # what the engine runs: the node mirrors this, not its own copy


@dataclass(frozen=True)
class Chunk:
    request_id: int
    actions: np.ndarray         # [horizon, action_dim] float32
    normalized: np.ndarray      # [horizon, action_dim] the model's output in [-1, 1]
    timings: dict
    received_at: float = 0.0    # time.perf_counter() in the worker: request received ...
    predict_ms: float = 0.0     # ... engine.predict() wall time
    sent_at: float = 0.0        # ... result sent
    queued_ms: float = 0.0      # from the node's send to predict()'s start (Predict.sent_at)
    memory: Optional[tuple] = None   # (allocated, reserved) device bytes; None on the CPU
    batch_size: int = 1         # observations of the query it ran in (an engine server batches several nodes')
    batch_wait_ms: float = 0.0  # from its arrival to its batch closing (the server's batching window)


@dataclass(frozen=True)
class Rejected:
    """The engine's verdict on the observation (its ValueError): nothing ran."""
    request_id: int
    reason: str


@dataclass(frozen=True)
class Failed:
    """The engine raised while predicting."""
    request_id: int
    reason: str
    trace: str


@dataclass(frozen=True)
class Reconfigured:
    """The answer to Reconfigure: the configuration in effect now (unchanged after an error)."""
    config: EngineConfig
    error: str = ""
    trace: str = ""


Answer = Union[Chunk, Rejected, Failed, Reconfigured]   # what poll() returns


def reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class WorkerOptions:
    """How the engine's process runs, beside what it runs (EngineConfig)."""
    mode: str           # the engine_mode the config was built from (for its description)
    threads: int        # torch CPU threads; 0: torch's default
    nice: int           # niceness added to the process
