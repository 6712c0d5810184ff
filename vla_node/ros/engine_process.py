"""The policy engine in its own process.

Why a process: torch's Python-level work holds the GIL for milliseconds at a time, which
delays a control timer in the same process by 2-4 ms (p99) on a 2-core machine; a separate,
niced process leaves the node's interpreter to the control loop (BENCHMARKS.md, "ROS node").

Frames travel through shared memory (an anonymous memfd both processes map): the node writes
each camera frame into a slot once and the engine reads it in place. The buffer is made after the
engine is ready, because its size follows the checkpoint's history offset (EngineInfo). The worker
is built from the node's frozen EngineConfig (validated when the parameters were); requests and
results are small pickled tuples on a pipe. Only one request is in flight at a time, so nothing
queues.
The worker exits when its pipe closes or its parent dies, and cleanup joins it, so closing the
engine really frees its memory (device memory included). Ending it is bounded (stop_worker): a
serving worker is asked to end and given STOP_GRACE_S, a worker still loading is killed at once.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Callable, Optional

import numpy as np

from ..runtime.types import EngineConfig

# A serving worker asked to end finishes the prediction under way and exits: 0.5-0.6 s for the
# tiny model on the idle 2-core VM, most of it torch's teardown. One that takes longer (a niced
# worker on a busy machine) is killed: ending the node must not wait on it (issue 18: a node still
# there 20 s after Ctrl-C).
STOP_GRACE_S = 2.0
KILLED_EXIT_S = 5.0   # a killed process is gone within milliseconds; this only bounds the wait
READY_POLL_S = 0.5    # start(): how often the wait for "ready" looks up (waiting() runs between)

# The stages of an engine's start, as /diagnostics reports them during configure.
STARTING = "starting the engine process"
LOADING = "loading weights"
WARMING_UP = "warming up (compiling and capturing, as engine_mode asks)"
# Tests: a worker whose environment names a file here waits for the file to exist before warming up,
# so that a test can look at the node while it configures for as long as it needs.
WARMUP_GATE_ENV = "VLA_NODE_TEST_WARMUP_GATE"


class EngineError(RuntimeError):
    """The engine could not start, or its process is gone; str() is the reason."""


@dataclass
class EngineInfo:
    pid: int
    horizon: int
    action_dim: int
    state_dim: int
    description: str
    history_offset_s: float    # between consecutive frame times of a window, from the checkpoint
    robot: dict                # the checkpoint's RobotConfig: its deployment's action post-processing


@dataclass
class Result:
    request_id: int
    kind: str                  # "chunk", "rejected" (bad observation), "failed" (engine error), "schedule"
    actions: Optional[np.ndarray] = None
    timings: Optional[dict] = None
    reason: str = ""
    received_at: float = 0.0   # time.perf_counter() in the worker: request received ...
    predict_ms: float = 0.0    # ... engine.predict() wall time
    sent_at: float = 0.0       # ... result sent
    memory: Optional[tuple] = None   # (allocated, reserved) device bytes; None on the CPU


@dataclass(frozen=True)
class WorkerOptions:
    """How the engine's process runs, beside what it runs (EngineConfig)."""
    mode: str           # the engine_mode the config was built from (for its description)
    threads: int        # torch CPU threads; 0: torch's default
    nice: int           # niceness added to the process


class EngineProcess:
    """The engine's worker process, from configure to cleanup: across the loss of a worker (it
    died or cannot be reached) and its replacement by another one, which maps the same frames."""

    def __init__(self, config: EngineConfig, worker: WorkerOptions):
        # What a worker is built from; its action_cache is the schedule the engine accepted last.
        self.config = config
        self.worker = worker
        self.frames: Optional[mmap.mmap] = None
        # Kept open until close(): a worker started again after a crash maps the same frames, so
        # the node's frame ring lives on across an engine restart.
        self._frames_fd: Optional[int] = None
        self._frames_shape: tuple[int, ...] = ()
        self._conn = None
        self._process = None
        self._warm = False                      # the worker said "ready": it reads messages
        self._deadline = 0.0
        self._timeout_s = 0.0
        self._schedules: deque[str] = deque()   # sent to the worker, not answered yet
        self.lost: Optional[str] = None         # why the last worker was lost; None while one serves
        self.restart_due: Optional[float] = None   # time.monotonic() of the next start; None: none planned
        self.restart_attempt = 0

    def start(self, timeout_s: float, progress: Callable[[str], None], stage: Callable[[str], None],
              waiting: Callable[[], None]) -> EngineInfo:
        """Spawn the worker and wait until the engine is loaded and warm: its progress lines go to
        `progress`, each stage it enters (STARTING, LOADING, WARMING_UP) to `stage`, and `waiting`
        runs at least every READY_POLL_S meanwhile (it may end the wait by raising). Raises
        EngineError with the worker's reason (a bad checkpoint, an unknown mode, ...)."""
        stage(STARTING)
        self.spawn(timeout_s)
        while (info := self.check_ready(progress, stage)) is None:
            waiting()
            self._conn.poll(READY_POLL_S)
        return info

    def spawn(self, timeout_s: float) -> None:
        """Start a worker without waiting for it: check_ready() says when it is warm."""
        ctx = mp.get_context("spawn")   # never fork a process that runs DDS threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_worker_main, args=(child, self.config, self.worker),
                                    name="vla_node_engine", daemon=True)
        self._process.start()
        self._warm = False
        child.close()
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def check_ready(self, progress: Callable[[str], None],
                    stage: Callable[[str], None] = lambda _: None) -> Optional[EngineInfo]:
        """Without blocking: the engine's description once it is loaded and warm, None while it
        is starting (its progress messages go to `progress`, the stages it enters to `stage`).
        Raises EngineError when the worker failed, exited or missed the start timeout."""
        alive = self._process.is_alive()   # before reading: a worker that reports, then exits, is heard
        while self._conn.poll():
            kind, payload = self._receive()
            if kind == "progress":
                progress(payload)
            elif kind == "stage":
                stage(payload)
            elif kind == "error":
                raise EngineError(payload)
            elif kind == "ready":
                self._warm = True
                return EngineInfo(pid=self._process.pid, **payload)
        if not alive:
            raise EngineError(f"engine process exited with code {self._process.exitcode} while starting")
        if time.monotonic() > self._deadline:
            raise EngineError(f"engine not ready after {self._timeout_s:.0f} s (engine_start_timeout_s)")
        return None

    def share_frames(self, shape: tuple[int, ...]) -> mmap.mmap:
        """After start(): the frame buffer (uint8 `shape`), mapped here and in the worker."""
        nbytes = int(np.prod(shape))
        fd = os.memfd_create("vla_node_frames")
        try:
            os.ftruncate(fd, nbytes)
            self.frames = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self._frames_fd, self._frames_shape = fd, tuple(shape)
        self.send_frames()
        return self.frames

    def send_frames(self) -> None:
        """Give the worker the frame buffer: after share_frames(), and to a worker started again."""
        self._conn.send(("frames", self._frames_shape))
        reduction.send_handle(self._conn, self._frames_fd, self._process.pid)

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join(1.0)
            raise EngineError(f"engine process exited (code {self._process.exitcode})") from None

    def submit(self, request_id: int, slots: list[int], frame_ids: list, state: np.ndarray, instruction: str,
               stamp: float) -> None:
        self._conn.send(("predict", (request_id, slots, frame_ids, state, instruction, stamp)))

    def reset_stream(self) -> None:
        self._conn.send(("reset", None))

    def set_action_cache(self, schedule: str) -> None:
        """Applied between predictions; the answer comes back from poll() as kind "schedule"
        (reason empty: accepted, and config.action_cache is this schedule from then on)."""
        self._conn.send(("schedule", schedule))
        self._schedules.append(schedule)

    def poll(self, timeout_s: float = 0.0) -> Optional[Result]:
        """A result if one is waiting or comes within timeout_s. Raises EngineError if the worker
        died."""
        if not self._conn.poll(timeout_s):
            return None
        kind, payload = self._receive()
        result = Result(kind=kind, **payload)
        if kind == "schedule":
            schedule = self._schedules.popleft()
            if not result.reason:
                self.config = self.config.replace(action_cache=schedule)
        return result

    # -- losing the worker, and replacing it ---------------------------------------------------
    def lose(self, reason: str, restart_s: float) -> None:
        """The worker died or cannot be reached: end it, keeping the shared frames (the frame ring
        keeps writing into them); with restart_s > 0 a new one is started that long from now."""
        self.stop_worker()
        self._schedules.clear()
        self.lost = reason
        self.restart_due = time.monotonic() + restart_s if restart_s else None
        self.restart_attempt = 1 if restart_s else 0

    def step_restart(self, timeout_s: float, retry_s: float, progress: Callable[[str], None]) -> Optional[EngineInfo]:
        """Replace a lost worker without blocking (call it periodically): respawn it when due, poll
        it until warm, hand it the frames. Its description once it serves, None until then;
        EngineError when this attempt failed (the next one starts retry_s later)."""
        if self._process is None:
            if time.monotonic() < self.restart_due:
                return None
            progress(f"restarting the engine (attempt {self.restart_attempt})")
            self.spawn(timeout_s)
        try:
            info = self.check_ready(progress)
            if info is not None:
                self.send_frames()
        except (EngineError, OSError) as e:
            self.stop_worker()
            self.restart_attempt += 1
            self.restart_due = time.monotonic() + retry_s
            raise EngineError(str(e)) from None
        if info is not None:
            self.lost, self.restart_due = None, None
        return info

    def stop_worker(self) -> None:
        """End the worker within STOP_GRACE_S + KILLED_EXIT_S; the shared frames stay for the next one.
        A serving worker is asked to end (it finishes the prediction under way) and killed if it
        has not after STOP_GRACE_S; one still loading or warming up reads no message before it is
        warm, so it is killed at once."""
        if self._process is not None:
            if self._process.is_alive() and self._warm:
                try:
                    self._conn.send(("close", None))
                except OSError:
                    pass
                self._process.join(STOP_GRACE_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(KILLED_EXIT_S)
            if self._process.exitcode is not None:
                self._process.close()
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """End the worker and release the shared frames."""
        self.stop_worker()
        if self._frames_fd is not None:
            os.close(self._frames_fd)
            self._frames_fd = None
        if self.frames is not None:
            self.frames.close()
            self.frames = None


# -- the worker process -------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the node process dies, even mid-prediction."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass   # not Linux: the closed pipe still ends the worker after its current prediction


def _worker_main(conn, config: EngineConfig, worker: WorkerOptions) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the node decides
    if worker.nice:
        os.nice(worker.nice)
    try:
        engine = _load_engine(conn, config, worker)
    except Exception as e:   # every start-up failure becomes the configure transition's reason
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        kind, shape = conn.recv()   # ("frames", shape) and the buffer's file descriptor, or "close"
        fd = reduction.recv_handle(conn) if kind == "frames" else None
    except (EOFError, OSError):
        fd = None   # the node is gone
    if fd is None:
        engine.close()
        return
    frames = mmap.mmap(fd, 0)
    os.close(fd)
    pixels = np.ndarray(shape, dtype=np.uint8, buffer=frames)
    try:
        _serve(conn, engine, pixels)
    finally:
        engine.close()
        del pixels
        frames.close()


def _load_engine(conn, config: EngineConfig, worker: WorkerOptions):
    import torch

    if worker.threads:
        torch.set_num_threads(worker.threads)
    from ..runtime import PolicyEngine

    conn.send(("stage", LOADING))
    engine = PolicyEngine(config, progress=lambda message: conn.send(("progress", message)))
    conn.send(("stage", WARMING_UP))
    if gate := os.environ.get(WARMUP_GATE_ENV):
        while not os.path.exists(gate):
            time.sleep(0.05)
    engine.warmup()
    a = engine.model_cfg.action
    conn.send(("ready", dict(horizon=a.horizon, action_dim=a.action_dim, state_dim=a.state_dim,
                             description=f"{engine.model_cfg.name} {worker.mode} on {engine.device}",
                             history_offset_s=engine.history_offset_s,
                             robot=dataclasses.asdict(engine.model_cfg.robot))))
    return engine


def _serve(conn, engine, pixels: np.ndarray) -> None:
    from ..runtime import Observation

    cuda = engine.device.type == "cuda"
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return   # the node is gone
        received = time.perf_counter()
        if kind == "close":
            return
        if kind == "reset":
            engine.reset_stream()
        elif kind == "schedule":
            try:
                engine.set_flow(action_cache=payload)
                conn.send(("schedule", dict(request_id=-1, reason="")))
            except Exception as e:
                conn.send(("schedule", dict(request_id=-1, reason=f"{type(e).__name__}: {e}")))
        elif kind == "predict":
            request_id, slots, frame_ids, state, instruction, stamp = payload
            obs = Observation(images=[pixels[s] for s in slots], state=state, instruction=instruction,
                              stamp=stamp, frame_ids=frame_ids)
            t0 = time.perf_counter()
            try:
                chunk = engine.predict(obs)
            except ValueError as e:   # the engine's verdict on the inputs
                conn.send(("rejected", dict(request_id=request_id, reason=str(e))))
                continue
            except Exception as e:
                conn.send(("failed", dict(request_id=request_id, reason=f"{type(e).__name__}: {e}")))
                continue
            predict_ms = (time.perf_counter() - t0) * 1e3
            memory = None
            if cuda:
                import torch
                memory = (torch.cuda.memory_allocated(engine.device), torch.cuda.memory_reserved(engine.device))
            conn.send(("chunk", dict(request_id=request_id, actions=chunk.actions, timings=chunk.timings,
                                     received_at=received, predict_ms=predict_ms, sent_at=time.perf_counter(),
                                     memory=memory)))
