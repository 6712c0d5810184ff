"""Recent camera frames in one shared buffer.

Each camera owns a fixed set of slots in a buffer the engine process maps too, so a frame is
copied once (message -> slot) and the engine reads it in place. Which frames are kept and which
make a window is decided by vla_node/runtime/timeline.py:InputTimeline, which the bag reader and
the simulator use too. Slots of the window being inferred are pinned: new frames go to other
slots, so the engine never reads a frame that is being overwritten.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from ..runtime.timeline import Change, InputTimeline
from ..runtime.windows import JointStates, Wait, WindowSpec


@dataclass
class Window:
    slots: list[int]                  # slot order: oldest frame time first, cameras in order within one
    frame_ids: list[tuple[str, int]]  # (camera, stamp_ns) per slot: the engine's frame identity
    stamp_ns: int                     # stamp of the newest frame of the first camera
    seq: int                          # its sequence number
    state: np.ndarray                 # [joints] the robot state that goes with it
    state_stamps_ns: np.ndarray       # [joints] the stamp of each joint's sample


class FrameRing:
    """Slot storage for the frames the node's InputTimeline keeps (runtime/timeline.py: which
    frames, which window), its lock, and the pinning of the window being inferred. Each camera
    has slots for its `keep` frames (windows.frames_to_keep), for the frames of a pinned window it
    has given up and for the frame being filled."""

    def __init__(self, cameras: int, height: int, width: int, keep: int, frames: int, buffer):
        slots_per_camera = self.slots_per_camera(keep, frames)
        self.shape = self.shape_of(cameras, height, width, keep, frames)
        self.pixels = np.ndarray(self.shape, dtype=np.uint8, buffer=buffer)
        self._slots = [list(range(i * slots_per_camera, (i + 1) * slots_per_camera)) for i in range(cameras)]
        self._pinned: set[int] = set()
        self._filling: set[int] = set()
        self.lock = threading.Lock()   # guards the slots and the timeline that names them

    @staticmethod
    def slots_per_camera(keep: int, frames: int) -> int:
        return keep + frames + 1

    @classmethod
    def shape_of(cls, cameras: int, height: int, width: int, keep: int, frames: int) -> tuple[int, int, int, int]:
        return (cameras * cls.slots_per_camera(keep, frames), height, width, 3)

    def claim(self, camera: int, kept: Iterable[int]) -> int:
        """A free slot of `camera` to fill (under `lock`): neither `kept` (the timeline's frames) nor
        pinned nor being filled; release() it after filling. There is one: see slots_per_camera."""
        used = set(kept) | self._pinned | self._filling
        slot = next(s for s in self._slots[camera] if s not in used)
        self._filling.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Filling `slot` is over (under `lock`): kept by the timeline, or free again."""
        self._filling.discard(slot)

    def pin(self, slots: Iterable[int]) -> None:
        """The window being inferred (under `lock`): its slots are not reused before unpin()."""
        self._pinned = set(slots)

    def unpin(self) -> None:
        with self.lock:
            self._pinned = set()


class SharedInputs:
    """The node's inputs without ROS: an InputTimeline whose frames live in a FrameRing's slots,
    thread-safe (camera frames are converted on the decoder thread, joint states and windows come
    on the executor's). What inputs.Inputs feeds from its subscriptions, and the tests feed from
    bags."""

    def __init__(self, cameras: list[str], joint_names: Sequence[str], height: int, width: int, spec: WindowSpec,
                 keep: int, buffer, state_sync: str = "frame"):
        self.ring = FrameRing(len(cameras), height, width, keep, spec.frames, buffer)
        self.timeline = InputTimeline(cameras, joint_names, spec, keep, state_sync)

    @property
    def joints(self) -> JointStates:
        """The joint assembler (thread-safe itself): newest(), received_ns(), unknown."""
        return self.timeline.joints

    def configure(self, spec: WindowSpec, state_sync: str) -> None:
        """Run-time parameters: sync_slop_s, state_slop_s, wait_for_history, state_sync."""
        with self.ring.lock:
            self.timeline.spec, self.timeline.state_sync = spec, state_sync

    def write(self, camera: int, stamp_ns: int, received_ns: int,
              fill: Callable[[np.ndarray], None]) -> Optional[Change]:
        """Store one frame of `camera` (one writer per camera at a time): `fill(view)` writes its
        pixels into a free slot and raises InputError for an unusable message; a frame the timeline
        refuses (InputError) is not filled. The timeline change it showed, if any. A frame whose
        fill spans the inputs being forgotten (another input's change, a clock jump) is dropped."""
        ring, timeline = self.ring, self.timeline
        with ring.lock:
            timeline.check_frame(camera, stamp_ns)
            slot = ring.claim(camera, (f.item for f in timeline.frames(camera)))
            generation = timeline.generation
        try:
            fill(ring.pixels[slot])
        except BaseException:
            with ring.lock:
                ring.release(slot)
            raise
        with ring.lock:
            ring.release(slot)
            if generation != timeline.generation:
                return None
            return timeline.add_frame(camera, stamp_ns, slot, received_ns)

    def add_joint_states(self, stamp_ns: int, names, positions, received_ns: int) -> tuple[int, Optional[Change]]:
        with self.ring.lock:
            return self.timeline.add_joint_states(stamp_ns, names, positions, received_ns)

    def take_window(self) -> Window | Wait:
        """The newest complete window, its frames pinned until unpin(); or why there is none."""
        ring = self.ring
        with ring.lock:
            picked = self.timeline.window()
            if isinstance(picked, Wait):
                return picked
            self.timeline.take(picked)
            slots = [f.item for _, f in picked.frames]
            ring.pin(slots)
            return Window(slots=slots, frame_ids=picked.frame_ids, stamp_ns=picked.reference.stamp_ns,
                          seq=picked.reference.seq, state=picked.state, state_stamps_ns=picked.state_stamps_ns)

    def unpin(self) -> None:
        self.ring.unpin()

    def forget(self) -> None:
        """Every frame, joint state and stamp remembered (the clock jumped back). Pinned slots stay
        untouched until unpin(): the engine may still be reading them."""
        with self.ring.lock:
            self.timeline.forget()

    def newest_received_ns(self) -> list[Optional[int]]:
        with self.ring.lock:
            return self.timeline.newest_received_ns()
