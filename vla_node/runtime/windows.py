"""What the policy is shown: which camera frames make one window and which robot state goes with
it. The one window picker and the one joint assembler, used through runtime/timeline.py by the
node, the bag reader and the simulator, so that they hand the engine the same observation for the
same input. numpy only.

A window has up to `frames` frame times, `offset` apart (a time: the checkpoint's training step,
e.g. 8 steps at 15 Hz = 533 ms, whatever the cameras' rate), oldest first. The newest frame time
is a frame of the first camera (the reference); each history time takes the first camera's frame
stamped nearest it; every other camera contributes its frame nearest in stamp to the first
camera's, within the sync slop. The robot state is assembled per joint, by name, across
messages (an arm driver and a gripper driver often publish separately on one topic): each
joint's sample stamped nearest the newest frame, within the state slop.

Choices are final once made: a frame of another camera within half the slop of the reference,
or the nearest once that camera's next frame has arrived; a joint's sample once a later one has
arrived. So whenever a window is formed (the node: when the plan runs low; the bag reader: when
the window completes) it is the same window.

Timelines never mix: runtime/timeline.py:InputTimeline, which every caller feeds, decides when the
inputs' timeline changed and forgets every source's history then (JointStates alone raises
StampStep for a joint's stamp stepping back).
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import numpy as np

# Defaults of the node's parameters that the bag reader shares.
SYNC_SLOP_S = 0.02
STATE_SLOP_S = 0.05
MAX_CAMERA_RATE_HZ = 30.0
# The node's default joint_names: a Franka Panda (the DROID robot), 7 arm joints and the gripper.
PANDA_JOINTS = tuple(f"panda_joint{i}" for i in range(1, 8)) + ("panda_gripper",)

# Frames kept beyond the history span: another camera's frames straddling the window's edges ...
SYNC_MARGIN = 2
# ... and the frames of this much time more: a window formed this long after its newest frame (the
# node forms it when its plan runs low, maybe while another camera stalls) still finds the frames it
# had when it completed. Longer than that a stalled camera holds the node (input_timeout_s).
LATENESS_S = 0.5
# Intervals of the first camera's recent frames whose median is its frame interval.
INTERVAL_SAMPLES = 16
# A window ends with one of the first camera's newest frames: the newest one's partner frame or a
# later joint sample may still be on its way. Older ones are stale (a stalled input holds instead).
REFERENCE_TRIES = 3
# Per joint: 1 s of samples at 1 kHz, reaching back past the frames of any window being formed.
JOINT_CAPACITY = 1000


class InputError(ValueError):
    """A message that cannot be used; str() says why, in words for the log and /diagnostics."""


class StampStep(Exception):
    """A source's stamps went back: its timeline restarted. Nothing of the message was kept."""

    def __init__(self, source: str, back_ns: int):
        super().__init__(f"{source} stamps stepped back by {back_ns / 1e9:.3f} s")
        self.source, self.back_ns = source, back_ns


@dataclass(frozen=True)
class WindowSpec:
    frames: int                     # frame times per window (the layout's frames per camera)
    offset_ns: int                  # between consecutive frame times
    sync_slop_ns: int               # another camera's frame vs the first camera's
    state_slop_ns: int              # a joint's sample vs the newest frame
    wait_for_history: bool = False  # False: until history exists, a window holds the newest times only

    @classmethod
    def of(cls, frames: int, offset_s: float, sync_slop_s: float = SYNC_SLOP_S, state_slop_s: float = STATE_SLOP_S,
           wait_for_history: bool = False) -> "WindowSpec":
        return cls(frames, round(offset_s * 1e9), round(sync_slop_s * 1e9), round(state_slop_s * 1e9),
                   wait_for_history)

    @property
    def span_ns(self) -> int:
        return (self.frames - 1) * self.offset_ns


@dataclass
class Wait:
    """Why no window can be formed now. `sync` is False while inputs are still arriving (history
    filling, a partner frame on its way); True when they are out of step (a fault if it lasts).
    `lacks`: "camera", "history" or "state"."""
    reason: str
    sync: bool
    lacks: str = "camera"


Rows = list[list[int]]   # [frame time, oldest first][camera]: index into that camera's stamps
State = TypeVar("State")


def frames_to_keep(frames: int, offset_s: float, max_rate_hz: float) -> int:
    """Frames of one camera to keep: the history span and LATENESS_S at max_rate_hz, the newest
    frame, SYNC_MARGIN and `frames` more. The node and the bag reader keep this many and give up
    the same ones (evict), so they pick the same windows."""
    return math.ceil(((frames - 1) * offset_s + LATENESS_S) * max_rate_hz - 1e-9) + 1 + SYNC_MARGIN + frames


def evict(stamps: Sequence[int], span_ns: int) -> int:
    """Which of a full camera's frames (stamps ascending) to give up for a new one: the oldest if
    no window can use it any more (more than two frame intervals before the oldest history time of
    a window LATENESS_S old); else the one, neither the oldest nor one of the newest two, whose
    removal leaves the smallest gap: a camera faster than its buffer was sized for keeps all recent
    frames and an evenly thinned history. Stamps alone decide: the node and the bag reader give up
    the same frames."""
    interval = frame_interval_ns(stamps, len(stamps) - 1) or 0
    if stamps[0] < stamps[-1] - round(LATENESS_S * 1e9) - span_ns - 2 * interval or len(stamps) < 4:
        return 0
    gaps = [stamps[i + 1] - stamps[i - 1] for i in range(1, len(stamps) - 2)]
    return 1 + gaps.index(min(gaps))


def frame_interval_ns(stamps: Sequence[int], upto: int) -> Optional[int]:
    """Median interval of the frames up to index `upto` (the last INTERVAL_SAMPLES of them)."""
    first = max(0, upto - INTERVAL_SAMPLES)
    if upto - first < 1:
        return None
    return int(np.median(np.diff(np.asarray(stamps[first:upto + 1], np.int64))))


# _partner's answers other than an index
PENDING = -1       # the camera's next frame may still be the one (or the nearest)
OUT_OF_STEP = -2   # its frames around the time are all farther than the slop
BEHIND = -3        # its newest frame is more than LATENESS_S older: stopped, or stamped on a clock behind


def _partner(stamps: Sequence[int], t: int, slop_ns: int) -> int:
    """Index of another camera's frame that goes with a first-camera frame stamped t, or
    PENDING / OUT_OF_STEP. A found frame is final: frames of one camera arrive in stamp order."""
    i = bisect.bisect_right(stamps, t)
    before = i - 1 if i > 0 else None
    after = i if i < len(stamps) else None
    if before is not None and t - stamps[before] <= slop_ns // 2:
        return before   # a later frame could only be nearer if frames came less than the slop apart
    if after is None:
        return PENDING if before is None or t - stamps[before] <= LATENESS_S * 1e9 + slop_ns else BEHIND
    nearest = after if before is None or stamps[after] - t <= t - stamps[before] else before
    return nearest if abs(stamps[nearest] - t) <= slop_ns else OUT_OF_STEP


def _history_frame(stamps: Sequence[int], r: int, target: int) -> Optional[int]:
    """The first camera's frame (index <= r) stamped nearest `target`, once frames exist on both
    sides of it (at episode start the target precedes the first frame) and unless it lies in a
    gap (nearest farther than the camera's frame interval)."""
    interval = frame_interval_ns(stamps, r)
    i = bisect.bisect_right(stamps, target, 0, r + 1)   # stamps[i - 1] <= target < stamps[i]
    if interval is None or i == 0 or i > r:
        return None
    nearest = i if stamps[i] - target < target - stamps[i - 1] else i - 1
    return nearest if abs(stamps[nearest] - target) <= interval else None


def _row(cameras: Sequence[Sequence[int]], names: Sequence[str], i: int, slop_ns: int) -> list[int] | Wait:
    """The first camera's frame i and every other camera's frame that goes with it."""
    row = [i]
    for c in range(1, len(cameras)):
        j = _partner(cameras[c], cameras[0][i], slop_ns)
        if j == OUT_OF_STEP:
            return Wait(f"camera {names[c]!r} has no frame within sync_slop_s of camera {names[0]!r}", sync=True)
        if j == BEHIND:   # no "waiting" while its frames keep coming, stamped on a clock behind
            return Wait(f"camera {names[c]!r} has no frame within sync_slop_s of camera {names[0]!r}, its newest is "
                        f"over {LATENESS_S:g} s older: stopped, or stamped on a clock behind", sync=True)
        if j == PENDING:
            return Wait(f"waiting for camera {names[c]!r}", sync=False)
        row.append(j)
    return row


def window_at(cameras: Sequence[Sequence[int]], names: Sequence[str], r: int, spec: WindowSpec) -> Rows | Wait:
    """The window whose newest frame is the first camera's frame r. `cameras[c]`: that camera's
    frame stamps (ns, ascending). Without wait_for_history a window holds the k newest frame
    times that every camera has (k >= 1), as the policy's own wrapper does at episode start."""
    ref = cameras[0]
    rows = []
    for k in range(spec.frames):
        i = r if k == 0 else _history_frame(ref, r, ref[r] - k * spec.offset_ns)
        row = _row(cameras, names, i, spec.sync_slop_ns) if i is not None else \
            Wait(f"camera {names[0]!r} has no frame there yet", sync=False)
        if not isinstance(row, Wait):
            rows.append(row)
        elif k == 0:
            return row
        elif spec.wait_for_history:
            return Wait(f"waiting for history at t - {k * spec.offset_ns / 1e9:.3f} s: {row.reason}", sync=False,
                        lacks="history")
        else:
            break
    return rows[::-1]


def pick_window(cameras: Sequence[Sequence[int]], names: Sequence[str], spec: WindowSpec,
                state: Callable[[int], State | Wait]) -> tuple[int, Rows, State] | Wait:
    """The newest complete window and its state: (reference index, rows, state(stamp)). The
    first camera's REFERENCE_TRIES newest frames are tried, newest first. Else why not: the
    newest frame's reason, unless an older one got further (its frames complete, or its partner
    settled out of step): a frame still on its way is no news, the older frame's reason is."""
    ref = cameras[0]
    if not ref:
        return Wait(f"waiting for camera {names[0]!r}", sync=False)
    reason, progress = None, -1
    for r in range(len(ref) - 1, max(-1, len(ref) - 1 - REFERENCE_TRIES), -1):
        rows = window_at(cameras, names, r, spec)
        observed = state(ref[r]) if not isinstance(rows, Wait) else rows
        if not isinstance(observed, Wait):
            return r, rows, observed
        got = 2 if observed is not rows else int(observed.sync)
        if got > progress:
            reason, progress = observed, got
    return reason


# -- joints ---------------------------------------------------------------------------------------
def reorder_joints(names: Sequence[str], positions: Sequence[float], wanted: Sequence[str]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The joints of `wanted` that a message names, in any order and among other joints:
    (their indices in `wanted`, their positions). Raises InputError for a malformed message or
    a non-finite position of a wanted joint."""
    if len(positions) != len(names):
        raise InputError(f"joint state has {len(names)} names but {len(positions)} positions")
    where = {name: i for i, name in enumerate(wanted)}
    named = [n for n in names if n in where]
    if len(set(named)) < len(named):   # which of its positions is the joint's? Neither can be trusted.
        raise InputError(f"joint state names {sorted({n for n in named if named.count(n) > 1})} more than once")
    picked = [(where[n], i) for i, n in enumerate(names) if n in where]
    index = np.array([w for w, _ in picked], np.int64)
    values = np.array([positions[i] for _, i in picked], np.float64)
    bad = [wanted[w] for w, x in zip(index, values) if not np.isfinite(x)]
    if bad:
        raise InputError(f"non-finite joint positions for {bad}")
    return index, values


class JointStates:
    """Recent samples of each joint of `names` by header stamp, assembled across messages.
    Thread-safe: the node forgets them from its decoder thread when a camera's stamps step back."""

    def __init__(self, names: Sequence[str], capacity: int = JOINT_CAPACITY):
        self.names = tuple(names)
        self.capacity = capacity
        self._lock = threading.Lock()
        self.clear()
        self._received: list[Optional[int]] = [None] * len(self.names)   # kept by clear(): inputs still arrive
        self.unknown: tuple[str, ...] = ()   # the joints of the latest message naming none of `names`

    def clear(self) -> None:
        """Forget every sample (their stamps belong to a timeline that ended)."""
        with self._lock:
            self._stamps: list[list[int]] = [[] for _ in self.names]
            self._values: list[list[float]] = [[] for _ in self.names]

    def add(self, stamp_ns: int, names: Sequence[str], positions: Sequence[float], received_ns: int = 0,
            source: str = "joint_states") -> int:
        """Store a message's samples of the configured joints; returns how many it named. Raises
        InputError (nothing stored) or StampStep (a named joint has a later sample already)."""
        index, values = reorder_joints(names, positions, self.names)
        if not len(index):
            self.unknown = tuple(names)
            return 0
        with self._lock:
            for w in index:
                if self._stamps[w] and stamp_ns < self._stamps[w][-1]:
                    raise StampStep(f"{source} ({self.names[w]})", self._stamps[w][-1] - stamp_ns)
            for w, x in zip(index, values):
                stamps, samples = self._stamps[w], self._values[w]
                if stamps and stamps[-1] == stamp_ns:   # the same stamp again: the later message wins
                    samples[-1] = float(x)
                else:
                    stamps.append(stamp_ns)
                    samples.append(float(x))
                    if len(stamps) > 2 * self.capacity:
                        del stamps[:self.capacity], samples[:self.capacity]
                self._received[w] = received_ns
        return len(index)

    def drop_from(self, joint: int, stamp_ns: int) -> int:
        """Forget the samples of joint index `joint` stamped at or after `stamp_ns` (they belong to
        a timeline that ended for it); how many."""
        with self._lock:
            stamps, samples = self._stamps[joint], self._values[joint]
            keep = bisect.bisect_left(stamps, stamp_ns)
            dropped = len(stamps) - keep
            del stamps[keep:], samples[keep:]
            return dropped

    def at(self, stamp_ns: int, slop_ns: int) -> tuple[np.ndarray, np.ndarray] | Wait:
        """(positions, their stamps) [joints]: each joint's sample stamped nearest `stamp_ns`,
        taken once a later sample exists (one exactly at it too); or why there is none yet."""
        positions, stamps = np.zeros(len(self.names)), np.zeros(len(self.names), np.int64)
        never, pending = [], []
        # No sample within the slop: none after it although one was due (stopped), samples before and
        # after it (a gap, or samples always farther apart than twice the slop: sparse), only after.
        stopped, gap, sparse, later = [], [], [], []
        with self._lock:
            for w, (times, samples) in enumerate(zip(self._stamps, self._values)):
                if not times:
                    never.append(self.names[w])
                    continue
                i = bisect.bisect_left(times, stamp_ns)
                if i < len(times) and times[i] == stamp_ns:
                    j = i
                elif i == len(times):   # nothing after it yet: a later sample may be nearer, or is due (a slow joint)
                    behind = stamp_ns - times[-1]   # the median interval only when the slop alone says stopped
                    due = behind <= slop_ns or behind <= slop_ns + (frame_interval_ns(times, len(times) - 1) or 0)
                    (pending if due else stopped).append(self.names[w])
                    continue
                else:
                    j = i if i == 0 or times[i] - stamp_ns <= stamp_ns - times[i - 1] else i - 1
                    if abs(times[j] - stamp_ns) > slop_ns:
                        if i == 0:
                            later.append(self.names[w])
                        else:
                            interval = frame_interval_ns(times, i) or 0
                            (sparse if interval > 2 * slop_ns else gap).append(self.names[w])
                        continue
                positions[w], stamps[w] = samples[j], times[j]
        if never:
            hint = f" (the latest message named only {list(self.unknown)[:8]})" if self.unknown else ""
            return Wait(f"no joint state for {never} yet{hint}", sync=False, lacks="state")
        # No number that changes from call to call in the texts: a fault is logged again when it changes.
        # A joint whose messages stopped and one stamped on a clock behind the cameras' look the same
        # here; input_timeout_s tells them apart later (a stale input), so both are named.
        within = f"stamped within state_slop_s ({slop_ns / 1e6:g} ms) of the frames"
        clocks = "stamped on another clock than the cameras? (state_sync newest ignores stamps)"
        if stopped:
            return Wait(f"no joint state{self._of(stopped)} {within} and none after them yet: stopped, or "
                        f"{clocks}", sync=True, lacks="state")
        if later:
            return Wait(f"no joint state{self._of(later)} {within}, the earliest is after them: {clocks}",
                        sync=True, lacks="state")
        if sparse:
            return Wait(f"no joint state{self._of(sparse)} {within}: its messages come more than twice "
                        f"state_slop_s apart (raise state_slop_s)", sync=True, lacks="state")
        if gap:
            return Wait(f"no joint state{self._of(gap)} {within}: a gap in the messages around them", sync=True,
                        lacks="state")
        if pending:
            return Wait(f"waiting for a joint state{self._of(pending)} stamped after the frames", sync=False,
                        lacks="state")
        return positions, stamps

    def _of(self, names: list[str]) -> str:
        return "" if len(names) == len(self.names) else f" for {names}"

    def newest(self) -> Optional[np.ndarray]:
        """Each joint's newest sample [joints]; None until every joint has one."""
        with self._lock:
            if not all(self._values):
                return None
            return np.array([samples[-1] for samples in self._values])

    def received_ns(self) -> list[Optional[int]]:
        """Per joint, when its newest sample arrived (None: never)."""
        with self._lock:
            return list(self._received)
