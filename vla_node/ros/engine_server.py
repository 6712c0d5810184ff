"""One engine for several nodes: the serving loop of an engine's process, and `vla-engine-server`.

A node's own engine process (engine_process.py) runs this loop with one session, on its pipe. The
engine server runs it for every node attached to its Unix socket: one process owns the engine (one
copy of the weights) and each node is a session of its own, with its own frames (the memfd it
shared), noise stream (seeded by its own `seed`, so a robot gets the noise an engine of its own
would give it), vision-cache entries (its frame ids are kept apart from the others') and
run-time options (applied to the engine before each of its queries).

Batching: when a Predict arrives, the server reads the other sessions' Predicts that arrive
within the batching window (--batch-window-ms; it stops waiting as soon as every session has
one in), checks each observation on its own (a bad one is Rejected, the others go on), and runs
those that can share a query (PolicyEngine.batch_key: one layout bucket, the same run-time
options, nothing that holds one robot's state alone, such as streaming_kv) as one
PolicyEngine.predict_batch of up to --max-batch; the others in batches of their own, one after the
other in the order they arrived. Each answer says the batch size it ran in, how long it waited for
its batch to close and how long behind other work. A node's own engine process runs the same loop
with one session and no window: its batches are of one.

The engine is built when the first node attaches, from that node's configuration; a node whose
configuration differs (beyond its run-time options and seed) is refused in one line naming the
fields. A node that disappears, or sends what is not a message, loses its session and nothing
else; the server runs until it is stopped (SIGTERM, Ctrl-C) and then removes its socket.

    vla-engine-server --socket /tmp/vla_engine.sock [--batch-window-ms 2] [--max-batch 8]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import itertools
import mmap
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Optional

import numpy as np

from ..runtime.types import BATCH_SIZES, RUNTIME_OPTIONS, EngineConfig, Observation
from .engine_protocol import (
    LOADING,
    WARMING_UP,
    WARMUP_GATE_ENV,
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
    reason,
)

# Fields two nodes may set apart and still share an engine: each session applies its own, and
# max_batch is the server's (--max-batch).
PER_SESSION = ("seed", "max_batch", *RUNTIME_OPTIONS)
BATCH_WINDOW_MS = 2.0   # a robot alone is never held (below); at 15 Hz a chunk every 533 ms has room for it


@dataclass
class Session:
    """One node's state in the engine's process."""
    conn: Connection
    key: int                    # kept in its frame ids: two robots' (camera, stamp) may coincide
    generator: object           # torch.Generator: its noise stream
    options: dict               # its run-time options (RUNTIME_OPTIONS -> value)
    frames: list = field(default_factory=list)   # the frame buffers it shared (mmap)
    pixels: Optional[np.ndarray] = None          # the last one, as uint8 frames
    page_locked: list = field(default_factory=list)   # those of its pixels registered page-locked


@dataclass
class Queued:
    """A Predict read from its session, waiting for its batch to run."""
    session: Session
    request: Predict
    received: float             # time.perf_counter() when the server read it
    observation: Optional[Observation] = None



def differences(a: EngineConfig, b: EngineConfig) -> list[str]:
    """The fields in which two nodes' engines differ, beyond what each session sets for itself."""
    return [f"{f.name} {getattr(a, f.name)!r} against {getattr(b, f.name)!r}" for f in dataclasses.fields(a)
            if f.name not in PER_SESSION and getattr(a, f.name) != getattr(b, f.name)]


class Serving:
    """The sessions of one engine and the loop that answers them. With a listening socket, new
    nodes attach (the first one's configuration builds the engine); without one, the loop ends
    when its last session does (a node's own worker)."""

    def __init__(self, engine=None, config: Optional[EngineConfig] = None, description: str = "",
                 listener: Optional[socket.socket] = None, log=lambda message: None, batch_window_ms: float = 0.0,
                 max_batch: int = 1):
        self.engine, self.config, self.description = engine, config, description
        self.listener, self.log = listener, log
        self.batch_window_s, self.max_batch = batch_window_ms / 1e3, max_batch
        self.sessions: dict[Connection, Session] = {}
        self.pending: list[Connection] = []     # connected, Attach not read yet
        self._keys = itertools.count()

    def add(self, conn: Connection, config: EngineConfig, generator) -> Session:
        session = Session(conn, next(self._keys), generator, {k: getattr(config, k) for k in RUNTIME_OPTIONS})
        self.sessions[conn] = session
        return session

    def run(self) -> None:
        while self.sessions or self.listener is not None:
            waiting = [*self.sessions, *self.pending] + ([self.listener] if self.listener is not None else [])
            predicts: list[Queued] = []
            for ready_one in wait(waiting):
                if ready_one is self.listener:
                    self.pending.append(Connection(self.listener.accept()[0].detach()))
                elif ready_one in self.pending:
                    self.pending.remove(ready_one)
                    self._attach(ready_one)
                elif ready_one in self.sessions:
                    predicts += self._handle(self.sessions[ready_one])
            if predicts:
                self._serve(self._gather(predicts))

    # -- attaching ------------------------------------------------------------------------------
    def _attach(self, conn: Connection) -> None:
        try:
            message = conn.recv()
        except Exception:   # gone, or not one of ours
            conn.close()
            return
        if not isinstance(message, Attach):
            self.log(f"a connection sent {type(message).__name__} before Attach: closed")
            conn.close()
            return
        try:
            if self.engine is None:
                config = message.config.replace(max_batch=self.max_batch)
                self.engine, self.description = load_engine(conn, config, message.worker)
                self.config = message.config
                self.log(f"engine ready: {self.description}")
            elif diff := differences(self.config, message.config):
                conn.send(StartFailed(f"the engine server runs another engine ({'; '.join(diff)}): give this node "
                                      "the same engine parameters, or its own engine (engine_server empty)", ""))
                conn.close()
                return
            else:
                conn.send(ready(self.engine, self.description))
        except Exception as e:   # the engine could not be built (or the node left meanwhile)
            self.log(f"engine start failed: {reason(e)}")
            try:
                conn.send(StartFailed(reason(e), traceback.format_exc()))
            except OSError:
                pass
            conn.close()
            return
        import torch

        generator = torch.Generator(device=self.engine.device).manual_seed(message.config.seed)
        self.add(conn, message.config, generator)
        self.log(f"session {self.sessions[conn].key} attached ({len(self.sessions)} now)")

    # -- one message of a session ---------------------------------------------------------------
    def _handle(self, session: Session) -> list[Queued]:
        """Read one message of `session` and act on it; a Predict is returned, to be batched."""
        try:
            message = session.conn.recv()
        except (EOFError, OSError):
            self.drop(session)   # the node is gone
            return []
        except Exception as e:   # not a message of ours
            self.drop(session, f"unreadable message ({reason(e)})")
            return []
        received = time.perf_counter()
        match message:
            case Close():
                self.drop(session)
            case FrameBuffer(shape=shape):   # its file descriptor follows
                try:
                    fd = reduction.recv_handle(session.conn)
                    session.frames.append(mmap.mmap(fd, 0))
                    os.close(fd)
                    session.pixels = np.ndarray(shape, dtype=np.uint8, buffer=session.frames[-1])
                    if self.engine.device.type == "cuda":   # frames upload straight from it, not copied first
                        from ..runtime.preprocess import page_lock

                        if page_lock(session.pixels):
                            session.page_locked.append(session.pixels)
                except (OSError, TypeError, ValueError) as e:
                    self.drop(session, f"bad frame buffer ({reason(e)})")
            case ResetStream():
                self.engine.reset_stream()   # every session's cached frames: costs the others a re-encode
                session.generator.manual_seed(session.generator.initial_seed())   # its noise, as PolicyEngine's
            case Reconfigure(changes=changes):
                self._send(session, self._reconfigure(session, changes))
            case Predict() as request:
                return [Queued(session, request, received)]
            case _:
                self.drop(session, f"unexpected message {type(message).__name__}")
        return []

    def _send(self, session: Session, answer) -> None:
        try:
            session.conn.send(answer)
        except OSError:
            self.drop(session)

    def _apply_options(self, session: Session) -> None:
        """The engine runs this session's run-time options from here on."""
        changes = {k: v for k, v in session.options.items() if getattr(self.engine.config, k) != v}
        if changes:
            self.engine.reconfigure(changes)

    def _reconfigure(self, session: Session, changes: dict) -> Reconfigured:
        try:
            self._apply_options(session)
            config = self.engine.reconfigure(changes)
        except Exception as e:   # refused: the session's options stay
            return Reconfigured(self.engine.config, reason(e), traceback.format_exc())
        session.options = {k: getattr(config, k) for k in RUNTIME_OPTIONS}
        return Reconfigured(config)

    # -- batches --------------------------------------------------------------------------------
    def _gather(self, queued: list[Queued]) -> list[Queued]:
        """`queued` and the Predicts of the other sessions that arrive within the batching window
        of the first one's arrival: polls of their connections, never a blocking read of one.
        It ends early once every session has one in, or max_batch are in; with one session
        (a node's own worker) it ends at once. Other messages read meanwhile are acted on."""
        if self.batch_size() <= 1 or self.engine.config.streaming_kv:   # nothing would join it
            return queued
        deadline = min(q.received for q in queued) + self.batch_window_s
        while len(queued) < self.batch_size():
            busy = {q.session.conn for q in queued}   # a node has one request in flight
            others = [conn for conn in self.sessions if conn not in busy]
            if not others:
                break
            ready = wait(others, max(0.0, deadline - time.perf_counter()))
            if not ready:
                break
            for conn in ready:
                if conn in self.sessions:
                    queued += self._handle(self.sessions[conn])
        return queued

    def _serve(self, queued: list[Queued]) -> None:
        """Check every request on its own (one bad observation is Rejected alone), then run them
        in batches of one batch_key, in the order they arrived."""
        closed = time.perf_counter()
        groups: dict[object, list[Queued]] = {}
        for q in queued:
            try:
                q.observation = self._observation(q.session, q.request)
                key = self.engine.batch_key(q.observation, options=q.session.options)
            except ValueError as e:   # the engine's verdict on the inputs
                self._send(q.session, Rejected(q.request.request_id, str(e)))
                continue
            except Exception as e:
                self._send(q.session, Failed(q.request.request_id, reason(e), traceback.format_exc()))
                continue
            # Apart (key None): streaming_kv, the adaptive action cache, a prefill mask of its own.
            groups.setdefault(id(q) if key is None else key, []).append(q)
        size = self.batch_size()
        for group in groups.values():
            for start in range(0, len(group), size):
                self._predict(group[start:start + size], closed)

    def batch_size(self) -> int:
        """The largest batch: the server's max_batch, as far as the engine was built for it (a
        node's own worker: 1)."""
        return max(1, min(self.max_batch, self.engine.config.max_batch))

    def _observation(self, session: Session, p: Predict) -> Observation:
        if session.pixels is None:
            raise ValueError("no frame buffer shared yet")
        if not all(isinstance(s, (int, np.integer)) and 0 <= s < len(session.pixels) for s in p.slots):
            raise ValueError(f"slots {p.slots} are not frames of the {len(session.pixels)}-frame buffer")
        ids = None if p.frame_ids is None else [None if f is None else (session.key, f) for f in p.frame_ids]
        return Observation(images=[session.pixels[s] for s in p.slots], state=p.state, instruction=p.instruction,
                           stamp=p.stamp, frame_ids=ids, known_actions=p.known_actions)

    def _predict(self, batch: list[Queued], closed: float) -> None:
        """One query of `batch` (one batch_key: one layout, one set of run-time options); each
        answer goes to its session (one that is gone is dropped, the others get theirs)."""
        started = time.perf_counter()
        try:
            self._apply_options(batch[0].session)
            t0 = time.perf_counter()
            chunks = self.engine.predict_batch([q.observation for q in batch],
                                               generators=[q.session.generator for q in batch])
        except ValueError as e:   # checked one by one already: each gets its own verdict alone
            if len(batch) > 1:
                for q in batch:
                    self._predict([q], closed)
                return
            self._send(batch[0].session, Rejected(batch[0].request.request_id, str(e)))
            return
        except Exception as e:
            for q in batch:
                self._send(q.session, Failed(q.request.request_id, reason(e), traceback.format_exc()))
            return
        predict_ms = (time.perf_counter() - t0) * 1e3
        memory = None
        if self.engine.device.type == "cuda":
            import torch
            memory = (torch.cuda.memory_allocated(self.engine.device), torch.cuda.memory_reserved(self.engine.device))
        for q, chunk in zip(batch, chunks):
            queued_ms = (started - (q.request.sent_at or q.received)) * 1e3
            self._send(q.session, Chunk(q.request.request_id, chunk.actions, chunk.normalized, chunk.timings,
                                        received_at=q.received, predict_ms=predict_ms, sent_at=time.perf_counter(),
                                        queued_ms=queued_ms, memory=memory, batch_size=len(batch),
                                        batch_wait_ms=max(0.0, closed - q.received) * 1e3))

    # -- ending ---------------------------------------------------------------------------------
    def drop(self, session: Session, reason: str = "") -> None:
        """End a session (its node left, or sent what the server cannot take): nothing else changes."""
        self.sessions.pop(session.conn, None)
        session.conn.close()
        _close_frames(session)
        if self.listener is not None:
            self.log(f"session {session.key} ended{': ' + reason if reason else ''} ({len(self.sessions)} left)")

    def close(self) -> None:
        for session in list(self.sessions.values()):
            self.sessions.pop(session.conn)
            session.conn.close()
            _close_frames(session)
        if self.engine is not None:
            self.engine.close()


def _close_frames(session: Session) -> None:
    if session.page_locked:
        from ..runtime.preprocess import page_unlock

        for pixels in session.page_locked:
            page_unlock(pixels)
    session.page_locked.clear()
    session.pixels = None
    for buffer in session.frames:
        try:
            buffer.close()
        except BufferError:   # a view of it is still alive (an exception's frame): exiting frees it
            pass


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the node process dies, even mid-prediction."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass   # not Linux: the closed pipe still ends the worker after its current prediction


def worker_main(conn, config: EngineConfig, worker: WorkerOptions) -> None:
    """A node's own engine process: one session, on its pipe."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the node decides
    try:
        engine, description = load_engine(conn, config, worker)
    except Exception as e:   # every start-up failure becomes the configure transition's reason
        conn.send(StartFailed(reason(e), traceback.format_exc()))
        return
    serving = Serving(engine, config, description)
    serving.add(conn, config, engine.generator)   # one session, on the pipe: the engine's own noise stream
    try:
        serving.run()   # until the node is gone or sends Close
    finally:
        serving.close()


def load_engine(conn, config: EngineConfig, worker: WorkerOptions):
    """Build and warm up the engine, reporting each stage and the progress on `conn`, then Ready;
    the engine and its description."""
    import torch

    if worker.nice:
        os.nice(worker.nice)
    if worker.threads:
        torch.set_num_threads(worker.threads)
    from ..runtime import PolicyEngine

    conn.send(Stage(LOADING))
    engine = PolicyEngine(config, progress=lambda message: conn.send(Progress(message)))
    conn.send(Stage(WARMING_UP))
    if gate := os.environ.get(WARMUP_GATE_ENV):
        while not os.path.exists(gate):
            time.sleep(0.05)
    engine.warmup()
    description = f"{engine.model_cfg.name} {worker.mode} on {engine.device}"
    conn.send(ready(engine, description))
    return engine, description


def ready(engine, description: str) -> Ready:
    """What a node learns of the engine once it serves."""
    a = engine.model_cfg.action
    return Ready(pid=os.getpid(), horizon=a.horizon, action_dim=a.action_dim, state_dim=a.state_dim,
                 description=description, history_offset_s=engine.history_offset_s,
                 robot=dataclasses.asdict(engine.model_cfg.robot), config=engine.config)


def listen(path: str) -> socket.socket:
    """The server's socket at `path` (only this user may connect): a stale one of a server that is
    gone is replaced; a live one is an error."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise SystemExit(f"vla-engine-server: a server already listens at {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(16)
    return listener


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vla-engine-server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", required=True, help="Unix socket path the nodes name in their engine_server "
                                                    "parameter")
    ap.add_argument("--batch-window-ms", type=float, default=BATCH_WINDOW_MS,
                    help="how long a Predict waits for other nodes' Predicts to batch with (0: only those already "
                         "there; a node alone never waits; default %(default)s)")
    ap.add_argument("--max-batch", type=int, default=BATCH_SIZES[-1], choices=BATCH_SIZES,
                    help="observations one batched query holds (static engines keep buffers and CUDA graphs for "
                         "each batch size up to it; default %(default)s)")
    args = ap.parse_args(argv)
    if args.batch_window_ms < 0:
        ap.error("--batch-window-ms must be >= 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # stopped: the finally below removes the socket
    listener = listen(args.socket)
    log = lambda message: print(f"vla-engine-server: {message}", flush=True)  # noqa: E731
    serving = Serving(listener=listener, log=log, batch_window_ms=args.batch_window_ms, max_batch=args.max_batch)
    log(f"listening at {args.socket} (pid {os.getpid()}; batching window {args.batch_window_ms:g} ms, "
        f"batches of up to {args.max_batch})")
    try:
        serving.run()
    except KeyboardInterrupt:
        pass
    finally:
        serving.close()
        listener.close()
        if os.path.exists(args.socket):
            os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
