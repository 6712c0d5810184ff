"""ROS messages <-> arrays: camera images into RGB frame buffers, joint states into the model's
joint order, commands and trajectories out.

Every input check raises InputError with a sentence that names the problem; nothing is
written to the destination unless the message is usable. Images are copied exactly once: from
the message's buffer (a zero-copy numpy view) into the destination, converting the pixel format
in the same pass; compressed images are decoded, then copied once.
"""
from __future__ import annotations

import array
from typing import Sequence

import cv2
import numpy as np
from builtin_interfaces.msg import Duration as DurationMsg
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint


class InputError(ValueError):
    """A message the node cannot use; str() says why, in words for the log and /diagnostics."""


# encoding -> (channels, OpenCV conversion to RGB or None for a plain copy)
RAW_ENCODINGS = {
    "rgb8": (3, None),
    "bgr8": (3, cv2.COLOR_BGR2RGB),
    "rgba8": (4, cv2.COLOR_RGBA2RGB),
    "bgra8": (4, cv2.COLOR_BGRA2RGB),
    "mono8": (1, cv2.COLOR_GRAY2RGB),
}
COMPRESSED_FORMATS = ("jpeg", "jpg", "png")
# A compressed frame larger than this many times the raw frame (plus room for headers and
# metadata) is not a camera image: refused before decoding.
COMPRESSED_SIZE_FACTOR = 2
COMPRESSED_HEADROOM = 64 * 1024


def stamp_ns(stamp) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


def _check_size(height: int, width: int, out: np.ndarray) -> None:
    want_h, want_w = out.shape[:2]
    if (height, width) == (want_h, want_w):
        return
    if height * width > want_h * want_w:
        raise InputError(f"oversize image {width}x{height}, larger than camera_width x camera_height "
                         f"{want_w}x{want_h}")
    raise InputError(f"wrong image size {width}x{height}, expected camera_width x camera_height "
                     f"{want_w}x{want_h}")


def image_into(msg: Image, out: np.ndarray) -> None:
    """sensor_msgs/Image -> `out` (HxWx3 uint8 RGB)."""
    if msg.encoding not in RAW_ENCODINGS:
        raise InputError(f"unsupported encoding {msg.encoding!r} (supported: {', '.join(RAW_ENCODINGS)})")
    _check_size(msg.height, msg.width, out)
    channels, conversion = RAW_ENCODINGS[msg.encoding]
    row = msg.width * channels
    if msg.step < row:
        raise InputError(f"step {msg.step} is shorter than a row of {msg.width} {msg.encoding} pixels ({row} bytes)")
    expected = msg.step * msg.height
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if data.size < expected:
        raise InputError(f"truncated image data: {data.size} bytes, step x height is {expected}")
    if data.size > expected:
        raise InputError(f"image data of {data.size} bytes, step x height is {expected}")
    # A view with the row stride of the message: padding bytes at row ends are skipped in the copy.
    pixels = data.reshape(msg.height, msg.step)[:, :row].reshape(msg.height, msg.width, channels)
    if conversion is None:
        np.copyto(out, pixels)
    else:
        cv2.cvtColor(pixels, conversion, dst=out)


def compressed_into(msg: CompressedImage, out: np.ndarray) -> None:
    """sensor_msgs/CompressedImage (jpeg or png, any image_transport format string) -> `out`."""
    fmt = msg.format.lower()
    if not any(f in fmt for f in COMPRESSED_FORMATS):
        raise InputError(f"unsupported compressed format {msg.format!r} (supported: jpeg, png)")
    data = np.frombuffer(msg.data, dtype=np.uint8)
    limit = COMPRESSED_SIZE_FACTOR * out.size + COMPRESSED_HEADROOM
    if data.size > limit:
        raise InputError(f"oversize compressed image of {data.size} bytes, more than the {limit} bytes a "
                         f"{out.shape[1]}x{out.shape[0]} frame can need")
    decoded = cv2.imdecode(data, cv2.IMREAD_COLOR_RGB) if data.size else None
    if decoded is None:
        raise InputError(f"corrupt {msg.format} data: the image does not decode")
    _check_size(decoded.shape[0], decoded.shape[1], out)
    np.copyto(out, decoded)


def joint_positions(msg: JointState, names: Sequence[str]) -> np.ndarray:
    """Positions of `names`, in that order, from a JointState naming them in any order (other
    joints in the message are ignored)."""
    if len(msg.position) != len(msg.name):
        raise InputError(f"joint state has {len(msg.name)} names but {len(msg.position)} positions")
    index = {name: i for i, name in enumerate(msg.name)}
    missing = [n for n in names if n not in index]
    if len(missing) == len(names):
        raise InputError(f"joint state names none of the configured joints (unknown joints {list(msg.name)[:8]})")
    if missing:
        raise InputError(f"joint state lacks joints {missing}")
    q = np.array([msg.position[index[n]] for n in names], dtype=np.float64)
    bad = [n for n, x in zip(names, q) if not np.isfinite(x)]
    if bad:
        raise InputError(f"non-finite joint positions for {bad}")
    return q


def command_msg(command: np.ndarray) -> Float64MultiArray:
    return Float64MultiArray(data=command.tolist())


def joint_command_msg(names: Sequence[str], command: np.ndarray, stamp) -> JointState:
    msg = JointState(name=list(names), position=command.tolist())
    msg.header.stamp = stamp
    return msg


def trajectory_msg(names: Sequence[str], positions: np.ndarray, stamp, period_ns: int) -> JointTrajectory:
    """One point per control tick; the header stamp is when the first point executes."""
    msg = JointTrajectory(joint_names=list(names))
    msg.header.stamp = stamp
    points = []
    for i, q in enumerate(positions.astype(np.float64)):
        t = i * period_ns
        # array('d') is rclpy's fast path for float64[] (a list is checked value by value).
        points.append(JointTrajectoryPoint(positions=array.array("d", q.tobytes()),
                                           time_from_start=DurationMsg(sec=t // 1_000_000_000,
                                                                       nanosec=t % 1_000_000_000)))
    msg.points = points
    return msg
