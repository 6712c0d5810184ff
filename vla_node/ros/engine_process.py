"""The policy engine in its own process.

Why a process: torch's Python-level work holds the GIL for milliseconds at a time, which
delays a control timer in the same process by 2-4 ms (p99) on a 2-core machine; a separate,
niced process leaves the node's interpreter to the control loop (BENCHMARKS.md, "ROS node").

A node can instead attach to a shared engine server (engine_server.py, `vla-engine-server`): the
same messages cross its Unix socket, after an Attach that carries the node's configuration, and
the server serves every attached node from one engine. EngineProcess is the node's side of both.

Frames travel through shared memory (an anonymous memfd both processes map): the node writes
each camera frame into a slot once and the engine reads it in place. The buffer is made after the
engine is ready, because its size follows the checkpoint's history offset (EngineInfo). The worker
is built from the node's frozen EngineConfig (validated when the parameters were); what crosses
the pipe are the messages of engine_protocol.py, and the worker runs engine_server's serving loop
with one session. Only one request is in flight at a time, so nothing queues.
The worker exits when its pipe closes or its parent dies, and cleanup joins it, so closing the
engine really frees its memory (device memory included). Ending it is bounded (stop_worker): a
serving worker is asked to end and given STOP_GRACE_S, a worker still loading is killed at once.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Client
from typing import Callable, Optional

import numpy as np

from ..runtime.images import check_frames
from ..runtime.types import ActionChunk, EngineConfig, Observation
from .engine_protocol import (
    STARTING,
    Answer,
    Attach,
    Chunk,
    Close,
    Failed,
    FrameBuffer,
    Predict,
    Progress,
    Ready,
    Reconfigure,
    Reconfigured,
    Rejected,
    ResetStream,
    Stage,
    StartFailed,
    WorkerOptions,
)
from .engine_server import worker_main

# A serving worker asked to end finishes the prediction under way and exits: 0.5-0.6 s for the
# tiny model on the idle 2-core VM, most of it torch's teardown. One that takes longer (a niced
# worker on a busy machine) is killed: ending the node must not wait on it (issue 18: a node still
# there 20 s after Ctrl-C).
STOP_GRACE_S = 2.0
KILLED_EXIT_S = 5.0   # a killed process is gone within milliseconds; this only bounds the wait
READY_POLL_S = 0.5    # start(): how often the wait for "ready" looks up (waiting() runs between)



class EngineError(RuntimeError):
    """The engine could not start, failed, or its process is gone; str() is the reason, `trace`
    the worker's traceback when it raised (empty otherwise)."""

    def __init__(self, reason: str, trace: str = ""):
        super().__init__(reason)
        self.trace = trace


@dataclass
class EngineInfo:
    pid: int
    horizon: int
    action_dim: int
    state_dim: int
    description: str
    history_offset_s: float    # between consecutive frame times of a window, from the checkpoint
    robot: dict                # the checkpoint's RobotConfig: its deployment's action post-processing

class EngineProcess:
    """The engine's worker process, from configure to cleanup: across the loss of a worker (it
    died or cannot be reached) and its replacement by another one, which maps the same frames.
    With `server` (a socket path) the worker is a session of that engine server: started is
    attached, ended is detached, and a lost server is attached to again."""

    def __init__(self, config: EngineConfig, worker: WorkerOptions, server: str = ""):
        # What a worker is built from; its action_cache is the schedule the engine accepted last.
        self.config = config
        self.worker = worker
        self.server = server
        self.frames: Optional[mmap.mmap] = None
        # Kept open until close(): a worker started again after a crash maps the same frames, so
        # the node's frame ring lives on across an engine restart.
        self._frames_fd: Optional[int] = None
        self._frames_shape: tuple[int, ...] = ()
        self._conn = None
        self._process = None
        self._spawned = False                   # spawn() ran since the last stop_worker()
        self._attach_error = ""                 # why the server could not be reached, while it cannot
        self._warm = False                      # the worker said "ready": it reads messages
        self._deadline = 0.0
        self._timeout_s = 0.0
        self.info: Optional[EngineInfo] = None  # the last worker's, once it was ready
        self._next_id = 0                       # predict()'s own request ids (below the node's: negative)
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
        return self.wait_ready(progress, stage, waiting)

    def wait_ready(self, progress: Callable[[str], None], stage: Callable[[str], None],
                   waiting: Callable[[], None]) -> EngineInfo:
        """After spawn(): wait until the engine is loaded and warm, as start() does (several engines
        spawned first warm up together)."""
        while (info := self.check_ready(progress, stage)) is None:
            waiting()
            if self._conn is not None:
                self._conn.poll(READY_POLL_S)
            else:   # the server's socket is not there yet
                time.sleep(READY_POLL_S)
        return info

    def spawn(self, timeout_s: float) -> None:
        """Start a worker (or attach to the server) without waiting for it: check_ready() says when
        it is warm. A server not listening yet is waited for, up to the same timeout: a launch may
        start the server and its nodes together."""
        self._spawned = True
        if self.server:
            self._attach()
        else:
            ctx = mp.get_context("spawn")   # never fork a process that runs DDS threads
            self._conn, child = ctx.Pipe()
            self._process = ctx.Process(target=worker_main, args=(child, self.config, self.worker),
                                        name="vla_node_engine", daemon=True)
            self._process.start()
            child.close()
        self._warm = False
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s

    def _attach(self) -> bool:
        """Connect to the server and ask for the engine; False while nobody listens there."""
        try:
            self._conn = Client(self.server, family="AF_UNIX")
        except OSError as e:
            self._attach_error = e.strerror or str(e)
            return False
        self._conn.send(Attach(self.config, self.worker))
        return True

    def check_ready(self, progress: Callable[[str], None],
                    stage: Callable[[str], None] = lambda _: None) -> Optional[EngineInfo]:
        """Without blocking: the engine's description once it is loaded and warm, None while it
        is starting (its progress messages go to `progress`, the stages it enters to `stage`).
        Raises EngineError when the worker failed, exited or missed the start timeout."""
        if self.server and self._conn is None and not self._attach():
            if time.monotonic() > self._deadline:
                raise EngineError(f"no engine server at {self.server} ({self._attach_error}) within "
                                  f"{self._timeout_s:.0f} s (engine_start_timeout_s)")
            return None
        # Before reading: a worker that reports, then exits, is heard (a server's end is the socket's).
        alive = self._process is None or self._process.is_alive()
        while self._conn.poll():
            match self._receive():
                case Progress(message=message):
                    progress(message)
                case Stage(name=name):
                    stage(name)
                case StartFailed(reason=reason, trace=trace):
                    raise EngineError(reason, trace)
                case Ready() as ready:
                    self._warm = True
                    self.config = ready.config
                    self.info = EngineInfo(ready.pid, ready.horizon, ready.action_dim, ready.state_dim,
                                           ready.description, ready.history_offset_s, ready.robot)
                    return self.info
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
        self._send(FrameBuffer(self._frames_shape))
        reduction.send_handle(self._conn, self._frames_fd, self.info.pid)

    def _broken(self) -> EngineError:
        """The error for a connection that broke, sending or receiving: which end went away (a
        worker killed mid-send breaks the pipe before a poll sees it exit; both say the same)."""
        if self._process is None:
            return EngineError(f"engine server {self.server} closed the connection")
        self._process.join(1.0)
        return EngineError(f"engine process exited (code {self._process.exitcode})")

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._broken() from None

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except OSError:
            raise self._broken() from None

    def submit(self, request: Predict) -> None:
        """Send one observation (its frames already in the shared buffer); poll() answers it.
        Raises EngineError if the worker is gone."""
        self._send(request)

    def reset_stream(self) -> None:
        self._send(ResetStream())

    def reconfigure(self, changes: dict) -> None:
        """Change run-time options between predictions; poll() returns the Reconfigured answer,
        and `config` is the engine's configuration from then on (unchanged after an error)."""
        self._send(Reconfigure(dict(changes)))

    def poll(self, timeout_s: float = 0.0) -> Optional[Answer]:
        """An answer if one is waiting or comes within timeout_s. Raises EngineError if the worker
        died."""
        if not self._conn.poll(timeout_s):
            return None
        answer = self._receive()
        if isinstance(answer, Reconfigured):
            self.config = answer.config
        return answer

    # -- the Policy protocol (runtime.types.Policy), without the node -----------------------------
    @property
    def history_offset_s(self) -> float:
        return self.info.history_offset_s

    def predict(self, obs: Observation, timeout_s: float = 600.0) -> ActionChunk:
        """One observation through the process boundary, blocking: request() and answer(). Raises
        ValueError for an observation the engine rejects (as PolicyEngine.predict does), EngineError
        if it failed, died or did not answer in timeout_s. Not beside the node's requests: answers
        to those would be dropped."""
        answer = self.answer(self.request(obs), timeout_s)
        return ActionChunk(actions=answer.actions, normalized=answer.normalized, stamp=obs.stamp,
                           timings=dict(answer.timings))

    def request(self, obs: Observation) -> int:
        """Send one observation without waiting: its images are copied into the shared frames
        (made here if share_frames() has not been called); its request id, for answer()."""
        c = self.config
        slots = max(layout.images for layout in c.layouts) if c.layouts else len(obs.images)
        if len(obs.images) > slots:
            raise ValueError(f"expected at most {slots} images for the window layouts, got {len(obs.images)}")
        check_frames(obs.images, len(obs.images), c.camera_height, c.camera_width)   # what the slots hold
        if self.frames is None:
            self.share_frames((slots, c.camera_height, c.camera_width, 3))
        pixels = np.ndarray(self._frames_shape, dtype=np.uint8, buffer=self.frames)
        for slot, image in enumerate(obs.images):
            pixels[slot] = image
        self._next_id -= 1
        request_id = self._next_id
        frame_ids = list(obs.frame_ids) if obs.frame_ids is not None else None
        known = None if obs.known_actions is None else np.asarray(obs.known_actions, np.float32)
        self.submit(Predict(request_id, list(range(len(obs.images))), frame_ids, np.asarray(obs.state, np.float32),
                            obs.instruction, obs.stamp, known, time.perf_counter()))
        return request_id

    def answer(self, request_id: int, timeout_s: float = 600.0) -> Chunk:
        """The engine's Chunk for request() `request_id` (other answers are dropped); raises as
        predict() does."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.poll(max(0.0, deadline - time.monotonic()))
            if answer is None:
                raise EngineError(f"no answer from the engine process within {timeout_s:g} s")
            if getattr(answer, "request_id", None) != request_id:
                continue
            match answer:
                case Chunk():
                    return answer
                case Rejected(reason=reason):
                    raise ValueError(reason)
                case Failed(reason=reason, trace=trace):
                    raise EngineError(reason, trace)

    # -- losing the worker, and replacing it ---------------------------------------------------
    def lose(self, reason: str, restart_s: float) -> None:
        """The worker died or cannot be reached: end it, keeping the shared frames (the frame ring
        keeps writing into them); with restart_s > 0 a new one is started that long from now."""
        self.stop_worker()
        self.lost = reason
        self.restart_due = time.monotonic() + restart_s if restart_s else None
        self.restart_attempt = 1 if restart_s else 0

    def step_restart(self, timeout_s: float, retry_s: float, progress: Callable[[str], None]) -> Optional[EngineInfo]:
        """Replace a lost worker without blocking (call it periodically): respawn it when due, poll
        it until warm, hand it the frames. Its description once it serves, None until then;
        EngineError when this attempt failed (the next one starts retry_s later)."""
        if not self._spawned:
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
        warm, so it is killed at once. A server's session is only ended (Close, then the socket)."""
        self._spawned = False
        if self._process is None and self._conn is not None and self._warm:
            try:
                self._conn.send(Close())
            except OSError:
                pass
        if self._process is not None:
            if self._process.is_alive() and self._warm:
                try:
                    self._conn.send(Close())
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

