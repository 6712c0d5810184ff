"""Recent camera frames in one shared buffer, and the choice of the newest complete window.

Each camera owns a fixed set of slots in a buffer the engine process maps too, so a frame is
copied once (message -> slot) and the engine reads it in place. A window is the newest frame of
the first camera, its history frames `stride` frames apart, and for every other camera the frame
nearest in stamp to each of those, within `slop`. Slots of the window being inferred are pinned:
new frames go to other slots, so the engine never reads a frame that is being overwritten.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .messages import InputError

# Slots beyond the history span: frames of other cameras straddling the window's edges.
SYNC_MARGIN = 2


def slots_per_camera(frames: int, stride: int) -> int:
    """History span + margin + the pinned frames of one in-flight window."""
    return (frames - 1) * stride + 1 + SYNC_MARGIN + frames


@dataclass
class Frame:
    slot: int
    seq: int            # per camera, counts accepted frames
    stamp_ns: int       # header stamp
    received_ns: int    # node clock at arrival


@dataclass
class Window:
    slots: list[int]                  # slot order: oldest frame of every camera first, cameras in order
    frame_ids: list[tuple[str, int]]  # (camera, stamp_ns) per slot: the engine's frame identity
    stamp_ns: int                     # stamp of the newest frame of the first camera
    seq: int                          # its sequence number


@dataclass
class Wait:
    """Why no window can be formed now. `sync` is False while history is still filling."""
    reason: str
    sync: bool


@dataclass
class _Camera:
    name: str
    slots: list[int]
    frames: list[Frame] = field(default_factory=list)   # committed, oldest first
    next_seq: int = 0
    last_stamp_ns: Optional[int] = None


class FrameRing:
    def __init__(self, cameras: list[str], height: int, width: int, frames: int, stride: int, buffer):
        per_camera = slots_per_camera(frames, stride)
        self.shape = self.shape_of(len(cameras), height, width, frames, stride)
        self.pixels = np.ndarray(self.shape, dtype=np.uint8, buffer=buffer)
        self.frames, self.stride = frames, stride
        self._cameras = [_Camera(name, list(range(i * per_camera, (i + 1) * per_camera)))
                         for i, name in enumerate(cameras)]
        self._pinned: set[int] = set()
        self._generation = 0     # bumped by clear(): a frame being filled across it is dropped
        self._lock = threading.Lock()

    @staticmethod
    def shape_of(cameras: int, height: int, width: int, frames: int, stride: int) -> tuple[int, int, int, int]:
        return (cameras * slots_per_camera(frames, stride), height, width, 3)

    @staticmethod
    def nbytes(cameras: int, height: int, width: int, frames: int, stride: int) -> int:
        return int(np.prod(FrameRing.shape_of(cameras, height, width, frames, stride)))

    def write(self, camera: int, stamp_ns: int, received_ns: int, fill: Callable[[np.ndarray], None]) -> None:
        """Store one frame of `camera` (one writer per camera at a time). `fill(view)` writes the
        pixels and raises InputError for an unusable message: the frame is then dropped. A stamp
        not newer than the camera's previous frame is refused before any copy."""
        cam = self._cameras[camera]
        with self._lock:
            if cam.last_stamp_ns is not None and stamp_ns <= cam.last_stamp_ns:
                # No stamps in the text: the same cause must read the same to be logged once.
                raise InputError("out-of-order stamp: not newer than the camera's previous frame; dropped")
            slot = self._take_slot(cam)   # no longer a committed frame: no window can pick it
            generation = self._generation
        fill(self.pixels[slot])
        with self._lock:
            if generation != self._generation:
                return
            cam.frames.append(Frame(slot, cam.next_seq, stamp_ns, received_ns))
            cam.next_seq += 1
            cam.last_stamp_ns = stamp_ns

    def _take_slot(self, cam: _Camera) -> int:
        """A free slot, else the oldest unpinned frame's slot (that frame is forgotten)."""
        used = {f.slot for f in cam.frames}
        for slot in cam.slots:
            if slot not in used and slot not in self._pinned:
                return slot
        for i, f in enumerate(cam.frames):
            if f.slot not in self._pinned:
                del cam.frames[i]
                return f.slot
        raise RuntimeError("every frame slot is pinned")  # unreachable: slots_per_camera leaves room

    def take_window(self, slop_ns: int) -> Window | Wait:
        """The newest window whose frames are all present, pinned until unpin(); older reference
        frames are tried when the newest has no partner yet (its frame may still be on its way)."""
        with self._lock:
            ref = self._cameras[0]
            by_seq = {f.seq: f for f in ref.frames}
            need = (self.frames - 1) * self.stride
            reason = None
            for newest in reversed(ref.frames):
                times = [by_seq.get(newest.seq - k * self.stride) for k in range(self.frames - 1, -1, -1)]
                if any(f is None for f in times):
                    if reason is None:
                        reason = Wait(f"waiting for {need + 1} frames of camera {ref.name!r} (history)", sync=False)
                    continue
                picked = [[f] for f in times]
                missing = None
                for cam in self._cameras[1:]:
                    for k, f in enumerate(times):
                        match = _nearest(cam.frames, f.stamp_ns, slop_ns)
                        if match is None:
                            missing = cam.name
                            break
                        picked[k].append(match)
                    if missing:
                        break
                if missing:
                    reason = Wait(f"camera {missing!r} has no frame within sync_slop_s of camera {ref.name!r}",
                                  sync=True)
                    continue
                names = [c.name for c in self._cameras]
                flat = [(names[c], f) for row in picked for c, f in enumerate(row)]
                self._pinned = {f.slot for _, f in flat}
                return Window(slots=[f.slot for _, f in flat], frame_ids=[(n, f.stamp_ns) for n, f in flat],
                              stamp_ns=newest.stamp_ns, seq=newest.seq)
            return reason or Wait(f"waiting for camera {ref.name!r}", sync=False)

    def unpin(self) -> None:
        with self._lock:
            self._pinned = set()

    def newest_received_ns(self) -> list[Optional[int]]:
        with self._lock:
            return [c.frames[-1].received_ns if c.frames else None for c in self._cameras]

    def clear(self) -> None:
        """Forget every frame (a clock jump made their stamps meaningless). Pinned slots stay
        untouched until unpin(): the engine may still be reading them."""
        with self._lock:
            self._generation += 1
            for cam in self._cameras:
                cam.frames.clear()
                cam.last_stamp_ns = None


def _nearest(frames: list[Frame], stamp_ns: int, slop_ns: int) -> Optional[Frame]:
    best = min(frames, key=lambda f: abs(f.stamp_ns - stamp_ns), default=None)
    if best is None or abs(best.stamp_ns - stamp_ns) > slop_ns:
        return None
    return best
