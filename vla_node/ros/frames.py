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

from ..runtime.windows import InputError, StampStep, Wait, WindowSpec, evict, pick_window


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
    def __init__(self, cameras: list[str], height: int, width: int, spec: WindowSpec, slots_per_camera: int,
                 buffer):
        self.shape = self.shape_of(len(cameras), height, width, slots_per_camera)
        self.pixels = np.ndarray(self.shape, dtype=np.uint8, buffer=buffer)
        self.spec = spec
        self._cameras = [_Camera(name, list(range(i * slots_per_camera, (i + 1) * slots_per_camera)))
                         for i, name in enumerate(cameras)]
        self._pinned: set[int] = set()
        self._generation = 0     # bumped by clear(): a frame being filled across it is dropped
        self._lock = threading.Lock()

    @staticmethod
    def shape_of(cameras: int, height: int, width: int, slots_per_camera: int) -> tuple[int, int, int, int]:
        return (cameras * slots_per_camera, height, width, 3)

    def write(self, camera: int, stamp_ns: int, received_ns: int, fill: Callable[[np.ndarray], None]) -> None:
        """Store one frame of `camera` (one writer per camera at a time). `fill(view)` writes the
        pixels and raises InputError for an unusable message: the frame is then dropped. Before
        any copy, a stamp older than the camera's previous frame raises StampStep (its timeline
        restarted: the caller forgets every input) and a repeated one is refused."""
        cam = self._cameras[camera]
        with self._lock:
            if cam.last_stamp_ns is not None and stamp_ns < cam.last_stamp_ns:
                raise StampStep(f"camera {cam.name!r}", cam.last_stamp_ns - stamp_ns)
            if stamp_ns == cam.last_stamp_ns:
                raise InputError("repeated stamp: the same as the camera's previous frame; dropped")
            slot = self._take_slot(cam, stamp_ns)   # no longer a committed frame: no window can pick it
            generation = self._generation
        fill(self.pixels[slot])
        with self._lock:
            if generation != self._generation:
                return
            cam.frames.append(Frame(slot, cam.next_seq, stamp_ns, received_ns))
            cam.next_seq += 1
            cam.last_stamp_ns = stamp_ns
            cam.received_ns = received_ns

    def _take_slot(self, cam: _Camera, stamp_ns: int) -> int:
        """A free slot, else the slot of the frame windows.evict gives up (forgotten)."""
        used = {f.slot for f in cam.frames}
        for slot in cam.slots:
            if slot not in used and slot not in self._pinned:
                return slot
        i = evict([f.stamp_ns for f in cam.frames], [f.slot in self._pinned for f in cam.frames],
                  self.spec.span_ns)
        if i < 0:
            raise RuntimeError("every frame slot is pinned")  # unreachable: the slots leave room for a window
        return cam.frames.pop(i).slot

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
