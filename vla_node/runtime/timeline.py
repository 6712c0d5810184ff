"""The input state machine around the window picker (runtime/windows.py), once for its three
callers: the node's input adapter (ros/inputs.py, whose frames live in ros/frames.py:FrameRing's
shared slots), the bag reader (tools/bag_io.py:ObservationStream) and the simulator's closed loop
(sim/closed_loop.py). numpy only, message-driven:

    add_frame(camera, stamp, item)            a camera frame (`item`: its slot, or its pixels)
    add_joint_states(stamp, names, positions) a joint state message, joints by name
    window()                                  the newest complete window (Picked), or why none (Wait)
    take(picked)                              the caller uses it: frames never used before it are counted

Which frames are kept and given up (windows.evict), which window is new, the robot state that goes
with it (state_sync "frame": each joint's sample nearest the frame, or "newest") and the counts of
what became of every frame of the first camera are decided here, so the node, offline replay and
the simulator show the policy the same observation for the same input.

The timeline rule. A timeline changes (a recorded simulation reset, an NTP step, a restarted driver,
or two recordings whose messages interleave) when
  1. a source's stamps step back (a source: a camera, or one joint);
  2. a joint's sample repeats the stamp of its previous sample with another value (joint states on
     exact 10 ms stamps: the new timeline's sample would silently replace the old one's);
  3. after a step back by D (at least AMBIGUOUS_STEP_S) to a new timeline, a source that has
     delivered samples of the new timeline delivers one nearer the old timeline than the new one
     (more than D / 2 ahead of the new timeline's newest stamp): its stamps step back and forth,
     the old timeline is being delivered again (both clocks' messages alternate, or a source's
     clock stepped back for a while and came back).
Every change forgets every frame and joint sample (their stamps belong to another timeline) and
keeps the message that showed it; a change by rule 3 is no new fault (Change.announce: the fault
of the step stands until a window is taken). After a step, another source's own step back onto the
new timeline is the same change, not a new one: that source's samples of the old timeline are
dropped, the others' kept. Where the change cannot tell the old timeline's stamps from the new
one's (rule 2, or a step back by less than AMBIGUOUS_STEP_S), messages of the old timeline may
still follow unnoticed, stamped near the newest stamp seen: windows then hold until their oldest
frame is stamped a history span after it (every source monotonic again for at least the history
span). No window ever holds samples from two timelines.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

import numpy as np

from .windows import InputError, JointStates, Wait, WindowSpec, evict, pick_window, reorder_joints, window_at

# A step back shorter than this leaves the two timelines' stamps too close to tell apart by how far
# a sample lies from each (rule 3 needs the jump of D / 2 to exceed a source's largest gap between
# samples: a camera dropout of LATENESS_S): such a change holds windows for a history span.
AMBIGUOUS_STEP_S = 0.25
STATE_SYNC_MODES = ("frame", "newest")


@dataclass
class Frame:
    stamp_ns: int       # header stamp
    seq: int            # per camera, counts accepted frames
    item: Any           # the caller's: a slot of the node's frame ring, the pixels for the bag reader
    received_ns: int    # the caller's clock at arrival


# Change.rule
STEPPED_BACK, REPEATED, RETURNED = 1, 2, 3


@dataclass(frozen=True)
class Change:
    """A timeline change, and the message that showed it (kept, as the first of the new one)."""
    source: str         # "camera 'exo'", "joint_states (panda_joint1)"
    rule: int           # STEPPED_BACK, REPEATED or RETURNED (the rules above)
    back_ns: int = 0    # STEPPED_BACK: by how much

    @property
    def reason(self) -> str:
        """In words, without the size of the step (ros/inputs.py adds it in its words)."""
        return {STEPPED_BACK: f"{self.source} stamps stepped back",
                REPEATED: f"{self.source} repeated a stamp with another value",
                RETURNED: f"{self.source} stamps returned to the timeline before the step"}[self.rule]

    @property
    def announce(self) -> bool:
        """A new hold cause: not a return to the timeline before a step (that step's cause stands)."""
        return self.rule != RETURNED

    @property
    def ambiguous(self) -> bool:
        """The old timeline's stamps lie too near the new one's to tell its late messages apart."""
        return self.rule == REPEATED or self.rule == STEPPED_BACK and self.back_ns < AMBIGUOUS_STEP_S * 1e9


@dataclass
class Picked:
    """A window: frames in slot order (oldest frame time first, cameras in order within one), the
    first camera's newest frame, and the robot state that goes with it."""
    frames: list[tuple[str, Frame]]
    reference: Frame
    state: np.ndarray               # [joints] positions
    state_stamps_ns: np.ndarray     # [joints] the stamp of each joint's sample (0 with state_sync newest)
    frame_times: int                # fewer than spec.frames: history does not exist yet
    new_timeline: bool              # the first window taken since a timeline change

    @property
    def frame_ids(self) -> list[tuple[str, int]]:
        return [(name, f.stamp_ns) for name, f in self.frames]


@dataclass
class TimelineCounts:
    """What became of each frame of the first camera that no window taken ended with, and more."""
    first_camera_frames: int = 0
    frames_without_history: int = 0       # wait_for_history: its history frames were missing
    frames_without_sync: int = 0          # another camera has no frame within sync_slop_s
    frames_without_state: int = 0         # a joint has no sample within state_slop_s of the frame
    frames_superseded: int = 0            # a newer frame's window was taken instead
    frames_settling: int = 0              # stamped before a timeline change settled
    timeline_restarts: int = 0            # timeline changes: every input before was forgotten
    joint_states_refused: int = 0         # malformed joint state messages
    frames_refused: int = 0               # unstamped frames, a repeated stamp
    old_timeline_dropped: int = 0         # a source's samples of the timeline before a step, once it joined the new one

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Wait.lacks -> the counter of frames skipped for it
_SKIPPED = {"history": "frames_without_history", "camera": "frames_without_sync", "state": "frames_without_state",
            "timeline": "frames_settling"}


@dataclass
class _Sources:
    """What the timeline rule remembers of every source, across forgetting the inputs."""
    last: dict[str, int] = field(default_factory=dict)           # newest stamp accepted
    value: dict[str, float] = field(default_factory=dict)        # joints: the value at it
    step_ns: int = 0              # a step back under way (rule 3): by how much; 0: none
    newest: int = 0               # ... the new timeline's newest stamp
    joined: set = field(default_factory=set)                     # ... the sources that delivered samples of it
    recent: int = 0               # the newest stamp accepted since the latest change

    def new_like(self, stamp_ns: int) -> bool:
        """Nearer the new timeline than the old one (a step under way)."""
        return stamp_ns <= self.newest + self.step_ns // 2


class InputTimeline:
    """Frames of `cameras` (the first is the reference: a window ends with one of its frames) and
    joint states of `joint_names`, `keep` frames per camera (windows.frames_to_keep). Not
    thread-safe: the node calls it under its frame ring's lock. `spec` and `state_sync` may be
    replaced at any time (run-time parameters)."""

    def __init__(self, cameras: Sequence[str], joint_names: Sequence[str], spec: WindowSpec, keep: int,
                 state_sync: str = "frame"):
        if state_sync not in STATE_SYNC_MODES:
            raise ValueError(f"state_sync must be one of {list(STATE_SYNC_MODES)}, got {state_sync!r}")
        self.cameras = tuple(cameras)
        self.spec, self.keep, self.state_sync = spec, keep, state_sync
        self.joints = JointStates(joint_names)
        self.counts = TimelineCounts()
        self.generation = 0             # bumped whenever the inputs are forgotten
        self._frames: list[list[Frame]] = [[] for _ in self.cameras]
        self._next_seq = [0] * len(self.cameras)
        self._received: list[Optional[int]] = [None] * len(self.cameras)   # kept by forget(): still sending
        self._sources = _Sources()
        self._settle_ns = 0             # windows' frames stamped at or after this (a change settling)
        self._taken_ns: Optional[int] = None   # the first camera's frame the last window taken ended with
        self._new_timeline = False
        self._joint_sources: dict[int, str] = {}   # joint index -> its source's name (the topic's, per joint)

    # -- messages -------------------------------------------------------------------------------
    def check_frame(self, camera: int, stamp_ns: int) -> None:
        """InputError for a frame to drop, before anything is done with it: unstamped, or the
        camera's previous stamp again (a first frame stamped 0 is a simulation's at its start)."""
        last = self._sources.last.get(self._camera(camera))
        if stamp_ns == last == 0:
            raise InputError("unstamped frames (header.stamp 0): frames are paired and timed by their stamps, the "
                             "camera driver must set them")
        if stamp_ns == last:
            raise InputError("repeated stamp: the same as the camera's previous frame; dropped")

    def add_frame(self, camera: int, stamp_ns: int, item: Any, received_ns: int = 0) -> Optional[Change]:
        """Keep a frame (InputError: dropped, counted); the Change it showed, if any."""
        try:
            self.check_frame(camera, stamp_ns)
        except InputError:
            self.counts.frames_refused += 1
            raise
        source = self._camera(camera)
        change, joining = self._judge([source], stamp_ns)
        if change is not None:
            self._change(change, stamp_ns)
        frames = self._frames[camera]
        if joining:       # its frames of the old timeline
            self._joined(stamp_ns)
            old = [i for i, f in enumerate(frames) if f.stamp_ns >= stamp_ns]
            self.counts.old_timeline_dropped += len(old)
            frames[:] = [f for f in frames if f.stamp_ns < stamp_ns]
        if len(frames) >= self.keep:
            i = evict([f.stamp_ns for f in frames], self.spec.span_ns)
            if camera == 0:
                self._count_unused(i)
            del frames[i]
        frames.append(Frame(stamp_ns, self._next_seq[camera], item, received_ns))
        self._next_seq[camera] += 1
        self._received[camera] = received_ns
        self._accepted(source, stamp_ns)
        self.counts.first_camera_frames += camera == 0
        return change

    def add_joint_states(self, stamp_ns: int, names: Sequence[str], positions: Sequence[float],
                         received_ns: int = 0, source: str = "joint_states") -> tuple[int, Optional[Change]]:
        """Keep a message's samples of the configured joints (InputError: nothing kept, counted):
        (how many joints it named, the Change it showed)."""
        try:
            index, values = reorder_joints(names, positions, self.joints.names)
        except InputError:
            self.counts.joint_states_refused += 1
            raise
        if not len(index):
            self.joints.add(stamp_ns, names, positions, received_ns)   # notes the joints it named instead
            return 0, None
        joints = [f"{source} ({self.joints.names[w]})" for w in index]
        self._joint_sources.update(zip(index.tolist(), joints))
        change, joining = self._judge(joints, stamp_ns, values)
        if change is not None:
            self._change(change, stamp_ns)
        for k, name in enumerate(joints):
            if name in joining:      # its samples of the old timeline
                self._joined(stamp_ns)
                self.counts.old_timeline_dropped += self.joints.drop_from(int(index[k]), stamp_ns)
        self.joints.add(stamp_ns, names, positions, received_ns, source)
        for name, x in zip(joints, values):
            self._accepted(name, stamp_ns, float(x))
        return len(index), change

    def forget(self) -> None:
        """Every frame and joint sample and what the rule remembers (the clock jumped back: every
        stamp is from the future now); the next window is an episode start's."""
        self._forget_inputs()
        self._sources = _Sources()
        self._settle_ns = 0
        self._taken_ns = None

    # -- the timeline rule ----------------------------------------------------------------------
    def _judge(self, sources: list[str], stamp_ns: int, values: Optional[np.ndarray] = None):
        """(the Change a message of `sources` shows or None, the sources it makes join a step under way)."""
        s = self._sources
        joining = []
        for k, source in enumerate(sources):
            last = s.last.get(source)
            if s.step_ns:
                new_like = s.new_like(stamp_ns)
                if source in s.joined and not new_like:
                    return Change(source, RETURNED), []
                if source not in s.joined and new_like and last is not None and stamp_ns < last:
                    joining.append(source)     # its own step onto the new timeline: the same change
                    continue
            if last is not None and stamp_ns < last:
                return Change(source, STEPPED_BACK, last - stamp_ns), []
            if values is not None and last == stamp_ns and s.value.get(source) != float(values[k]):
                return Change(source, REPEATED), []
        return None, joining

    def _change(self, change: Change, stamp_ns: int) -> None:
        """Forget the inputs of the old timeline; the message that showed the change is kept."""
        s = self._sources
        newest = max(stamp_ns, s.recent)
        s.step_ns, s.joined, s.recent = 0, set(), stamp_ns
        if change.ambiguous:         # late messages of the old timeline may follow unnoticed
            self._settle_ns = max(self._settle_ns, newest + self.spec.span_ns)
        elif change.rule == STEPPED_BACK:   # rule 3 tells the two timelines apart from now on
            s.step_ns, s.newest = change.back_ns, stamp_ns
            self._settle_ns = 0
        else:
            self._settle_ns = 0
        self._count_unused(len(self._frames[0]))
        self._forget_inputs()
        self.counts.timeline_restarts += 1
        self._new_timeline = True

    def _joined(self, stamp_ns: int) -> None:
        """A source joined the step under way: a window of the old timeline taken meanwhile is no
        measure of which window is new."""
        if self._taken_ns is not None and self._taken_ns >= stamp_ns:
            self._taken_ns = None
            self._new_timeline = True

    def _accepted(self, source: str, stamp_ns: int, value: Optional[float] = None) -> None:
        s = self._sources
        s.last[source] = stamp_ns
        s.recent = max(s.recent, stamp_ns)
        if value is not None:
            s.value[source] = value
        if s.step_ns and s.new_like(stamp_ns):
            s.joined.add(source)
            s.newest = max(s.newest, stamp_ns)

    def _forget_inputs(self) -> None:
        for frames in self._frames:
            frames.clear()
        self.joints.clear()
        self.generation += 1
        self._taken_ns = None

    # -- windows --------------------------------------------------------------------------------
    def window(self) -> Picked | Wait:
        """The newest complete window (windows.pick_window) of the frames stamped after a change
        settled, with the robot state for its newest frame; or why there is none."""
        start = [self._first_settled(c) for c in range(len(self.cameras))]
        stamps = [[f.stamp_ns for f in frames[k:]] for frames, k in zip(self._frames, start)]
        picked = pick_window(stamps, self.cameras, self.spec, self._state)
        if isinstance(picked, Wait):
            if self._settle_ns and self._frames[0] and not stamps[0]:
                return Wait("timeline: waiting for the inputs to be monotonic for the history span after a timeline "
                            "change", sync=False, lacks="timeline")
            return picked
        r, rows, (positions, state_stamps) = picked
        frames = [(self.cameras[c], self._frames[c][start[c] + i]) for row in rows for c, i in enumerate(row)]
        return Picked(frames, self._frames[0][start[0] + r], positions, state_stamps, len(rows), self._new_timeline)

    def is_new(self, picked: Picked) -> bool:
        """Whether `picked` ends with a later first-camera frame than the last window taken."""
        return self._taken_ns is None or picked.reference.stamp_ns > self._taken_ns

    def take(self, picked: Picked) -> None:
        """The caller uses `picked`: the first camera's frames before it that no window taken
        ended with are counted by why."""
        frames = self._frames[0]
        r = next(i for i, f in enumerate(frames) if f is picked.reference)
        self._count_unused(r)
        self._taken_ns = picked.reference.stamp_ns
        self._new_timeline = False

    def finish(self) -> None:
        """The input ended: count the first camera's frames no window taken ended with."""
        self._count_unused(len(self._frames[0]))

    def _first_settled(self, camera: int) -> int:
        frames = self._frames[camera]
        return next((i for i, f in enumerate(frames) if f.stamp_ns >= self._settle_ns), len(frames))

    def _state(self, frame_stamp_ns: int) -> tuple[np.ndarray, np.ndarray] | Wait:
        if self.state_sync == "frame":
            return self.joints.at(frame_stamp_ns, self.spec.state_slop_ns)
        newest = self.joints.newest()
        if newest is None:
            return Wait("no joint state for every joint of joint_names yet", sync=False, lacks="state")
        s = self._sources
        if s.step_ns and any((self._joint_sources.get(w) in s.joined) != s.new_like(frame_stamp_ns)
                             for w in range(len(newest))):   # newest ignores stamps: a step's two sides apart
            return Wait("timeline: a joint's newest sample is of the other timeline than the frames", sync=False,
                        lacks="timeline")
        return newest, np.zeros(len(newest), np.int64)

    def _count_unused(self, upto: int) -> None:
        """Count the first camera's frames before index `upto` that no window taken ended with."""
        frames = self._frames[0]
        stamps = [f.stamp_ns for f in frames]
        for i in range(upto):
            if self._taken_ns is not None and stamps[i] <= self._taken_ns:
                continue
            if stamps[i] < self._settle_ns:
                wait = Wait("", sync=False, lacks="timeline")
            else:
                rows = window_at([[f.stamp_ns for f in c] for c in self._frames], self.cameras, i, self.spec)
                wait = rows if isinstance(rows, Wait) else self._state(stamps[i])
            name = _SKIPPED[wait.lacks] if isinstance(wait, Wait) else "frames_superseded"
            setattr(self.counts, name, getattr(self.counts, name) + 1)

    # -- what the node reports --------------------------------------------------------------------
    def frames(self, camera: int) -> list[Frame]:
        return self._frames[camera]

    def newest_received_ns(self) -> list[Optional[int]]:
        return list(self._received)

    def _camera(self, camera: int) -> str:
        return f"camera {self.cameras[camera]!r}"
