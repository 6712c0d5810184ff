"""Recent camera frames in one shared buffer, and the newest complete window of them.

Each camera owns a fixed set of slots in a buffer the engine process maps too, so a frame is
copied once (message -> slot) and the engine reads it in place. Which frames make a window is
decided by vla_node/runtime/windows.py, which the bag reader uses too. Slots of the window being
inferred are pinned: new frames go to other slots, so the engine never reads a frame that is
being overwritten.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..runtime.windows import Wait, WindowSpec, check_frame_stamp, evict, pick_window


@dataclass
class Frame:
    slot: int
    seq: int            # per camera, counts accepted frames
    stamp_ns: int       # header stamp
    received_ns: int    # node clock at arrival


@dataclass
class Window:
    slots: list[int]                  # slot order: oldest frame time first, cameras in order within one
    frame_ids: list[tuple[str, int]]  # (camera, stamp_ns) per slot: the engine's frame identity
    stamp_ns: int                     # stamp of the newest frame of the first camera
    seq: int                          # its sequence number
    state: np.ndarray                 # [joints] the robot state that goes with it
    state_stamps_ns: np.ndarray       # [joints] the stamp of each joint's sample


@dataclass
class _Camera:
    name: str
    slots: list[int]
    frames: list[Frame] = field(default_factory=list)   # committed, oldest first
    next_seq: int = 0
    last_stamp_ns: Optional[int] = None
    received_ns: Optional[int] = None   # arrival of its newest frame (kept by clear(): the camera still sends)


class FrameRing:
    """Each camera keeps `keep` frames (windows.frames_to_keep) and has slots for them, for the
    frames of a pinned window it has given up and for the frame being filled."""

    def __init__(self, cameras: list[str], height: int, width: int, spec: WindowSpec, keep: int, buffer):
        slots_per_camera = self.slots_per_camera(keep, spec.frames)
        self.shape = self.shape_of(len(cameras), height, width, keep, spec.frames)
        self.pixels = np.ndarray(self.shape, dtype=np.uint8, buffer=buffer)
        self.spec = spec
        self.keep = keep
        self._cameras = [_Camera(name, list(range(i * slots_per_camera, (i + 1) * slots_per_camera)))
                         for i, name in enumerate(cameras)]
        self._pinned: set[int] = set()
        self._generation = 0     # bumped by clear(): a frame being filled across it is dropped
        self._lock = threading.Lock()

    @staticmethod
    def slots_per_camera(keep: int, frames: int) -> int:
        return keep + frames + 1

    @classmethod
    def shape_of(cls, cameras: int, height: int, width: int, keep: int, frames: int) -> tuple[int, int, int, int]:
        return (cameras * cls.slots_per_camera(keep, frames), height, width, 3)

    def write(self, camera: int, stamp_ns: int, received_ns: int, fill: Callable[[np.ndarray], None]) -> None:
        """Store one frame of `camera` (one writer per camera at a time). `fill(view)` writes the
        pixels and raises InputError for an unusable message: the frame is then dropped. Before
        any copy, windows.check_frame_stamp raises StampStep for a stamp older than the camera's
        previous frame (its timeline restarted: the caller forgets every input) and refuses an
        unstamped or repeated one. A camera holding `keep` frames gives up the one windows.evict
        names as the new one is committed: the one the bag reader gives up, pinned or not (a
        pinned slot is not reused before unpin())."""
        cam = self._cameras[camera]
        with self._lock:
            check_frame_stamp(f"camera {cam.name!r}", cam.last_stamp_ns, stamp_ns)
            used = {f.slot for f in cam.frames} | self._pinned
            slot = next(s for s in cam.slots if s not in used)   # there is one: see slots_per_camera
            generation = self._generation
        fill(self.pixels[slot])
        with self._lock:
            if generation != self._generation:
                return
            if len(cam.frames) >= self.keep:
                del cam.frames[evict([f.stamp_ns for f in cam.frames], self.spec.span_ns)]
            cam.frames.append(Frame(slot, cam.next_seq, stamp_ns, received_ns))
            cam.next_seq += 1
            cam.last_stamp_ns = stamp_ns
            cam.received_ns = received_ns

    def take_window(self, state: Callable[[int], tuple[np.ndarray, np.ndarray] | Wait]) -> Window | Wait:
        """The newest complete window (windows.pick_window) with `state(stamp)` = (positions,
        their stamps) for its newest frame, pinned until unpin()."""
        with self._lock:
            cameras = self._cameras
            picked = pick_window([[f.stamp_ns for f in c.frames] for c in cameras], [c.name for c in cameras],
                                 self.spec, state)
            if isinstance(picked, Wait):
                return picked
            r, rows, (positions, stamps) = picked
            flat = [(cameras[c].name, cameras[c].frames[i]) for row in rows for c, i in enumerate(row)]
            self._pinned = {f.slot for _, f in flat}
            newest = cameras[0].frames[r]
            return Window(slots=[f.slot for _, f in flat], frame_ids=[(n, f.stamp_ns) for n, f in flat],
                          stamp_ns=newest.stamp_ns, seq=newest.seq, state=positions, state_stamps_ns=stamps)

    def unpin(self) -> None:
        with self._lock:
            self._pinned = set()

    def newest_received_ns(self) -> list[Optional[int]]:
        with self._lock:
            return [c.received_ns for c in self._cameras]

    def clear(self) -> None:
        """Forget every frame (their stamps belong to a timeline that ended). Pinned slots stay
        untouched until unpin(): the engine may still be reading them."""
        with self._lock:
            self._generation += 1
            for cam in self._cameras:
                cam.frames.clear()
                cam.last_stamp_ns = None
