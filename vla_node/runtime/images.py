"""Camera images as ROS drivers publish them -> HxWx3 uint8 RGB, for the node and the bag reader.

Works on any object with the fields of sensor_msgs/Image (height, width, encoding, is_bigendian,
step, data) or CompressedImage (format, data): rclpy's messages and rosbags' alike. Every check
raises InputError with a sentence that names the problem; nothing is written to the destination
unless the message is usable. A raw image is copied once, from the message's buffer (a zero-copy
view) into the destination, converting the pixel format in the same pass.

Encodings: the colour and mono ones, packed YUV 4:2:2 (usb_cam's default), Bayer mosaics and
16-bit mono/depth. With a ROS install's cv_bridge they are converted by cv_bridge, which the
design names as the converter ROS users know; without it by OpenCV with the conversions
cv_bridge uses (test_node_units checks each against OpenCV's own).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import cv2
import numpy as np

from .windows import InputError


def check_frames(images: Sequence[np.ndarray], count: int, height: int, width: int) -> None:
    """ValueError naming the image that the engine cannot take: `count` HxWx3 uint8 arrays."""
    if len(images) != count:
        raise ValueError(f"expected {count} images for the window layout, got {len(images)}")
    for i, img in enumerate(images):
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8:
            raise ValueError(f"image {i}: expected a uint8 numpy array, got {type(img).__name__} "
                             f"{getattr(img, 'dtype', '')}")
        if img.shape != (height, width, 3):
            raise ValueError(f"image {i}: expected shape ({height}, {width}, 3), got {img.shape}")


try:   # a ROS install's cv_bridge; not on PyPI
    from cv_bridge import CvBridge
except ImportError:
    CvBridge = None


@dataclass(frozen=True)
class RawFormat:
    channels: int
    dtype: type                   # np.uint8 or np.uint16 per channel
    to_rgb: Optional[int]         # OpenCV conversion after any rescaling; None: a plain copy


# 16-bit images are brought to 8 bits as cv_bridge does it (x 255 / 65535), then to RGB.
RAW_FORMATS = {
    "rgb8": RawFormat(3, np.uint8, None),
    "bgr8": RawFormat(3, np.uint8, cv2.COLOR_BGR2RGB),
    "rgba8": RawFormat(4, np.uint8, cv2.COLOR_RGBA2RGB),
    "bgra8": RawFormat(4, np.uint8, cv2.COLOR_BGRA2RGB),
    "mono8": RawFormat(1, np.uint8, cv2.COLOR_GRAY2RGB),
    "mono16": RawFormat(1, np.uint16, cv2.COLOR_GRAY2RGB),
    "16UC1": RawFormat(1, np.uint16, cv2.COLOR_GRAY2RGB),
    # sensor_msgs' yuv422 is UYVY byte order; yuv422_yuy2 (usb_cam's default) and yuyv are YUYV.
    "yuv422": RawFormat(2, np.uint8, cv2.COLOR_YUV2RGB_UYVY),
    "uyvy": RawFormat(2, np.uint8, cv2.COLOR_YUV2RGB_UYVY),
    "yuv422_yuy2": RawFormat(2, np.uint8, cv2.COLOR_YUV2RGB_YUYV),
    "yuyv": RawFormat(2, np.uint8, cv2.COLOR_YUV2RGB_YUYV),
    "bayer_rggb8": RawFormat(1, np.uint8, cv2.COLOR_BayerRGGB2RGB),
    "bayer_bggr8": RawFormat(1, np.uint8, cv2.COLOR_BayerBGGR2RGB),
    "bayer_gbrg8": RawFormat(1, np.uint8, cv2.COLOR_BayerGBRG2RGB),
    "bayer_grbg8": RawFormat(1, np.uint8, cv2.COLOR_BayerGRBG2RGB),
}
# Those cv_bridge converts to rgb8 in every ROS 2 release (16UC1 it refuses: not a colour format).
BRIDGE_ENCODINGS = {"bgr8", "rgba8", "bgra8", "mono8", "mono16", "yuv422", "bayer_rggb8", "bayer_bggr8",
                    "bayer_gbrg8", "bayer_grbg8"}
COMPRESSED_FORMATS = ("jpeg", "jpg", "png")
# A compressed frame larger than this many times the raw frame (plus room for headers and
# metadata) is not a camera image: refused before decoding.
COMPRESSED_SIZE_FACTOR = 2
COMPRESSED_HEADROOM = 64 * 1024

_bridge = CvBridge() if CvBridge is not None else None


def _check_size(height: int, width: int, out: np.ndarray) -> None:
    want_h, want_w = out.shape[:2]
    if (height, width) == (want_h, want_w):
        return
    if height * width > want_h * want_w:
        raise InputError(f"oversize image {width}x{height}, larger than camera_width x camera_height "
                         f"{want_w}x{want_h}")
    raise InputError(f"wrong image size {width}x{height}, expected camera_width x camera_height "
                     f"{want_w}x{want_h}")


def _raw_format(encoding: str) -> RawFormat:
    if encoding not in RAW_FORMATS:
        raise InputError(f"unsupported encoding {encoding!r} (supported: {', '.join(RAW_FORMATS)})")
    return RAW_FORMATS[encoding]


def _raw_pixels(msg) -> np.ndarray:
    """sensor_msgs/Image -> a view of its pixels [H, W, channels] in the message's own format
    (row padding skipped, byte order made native). Raises InputError for an unusable message."""
    f = _raw_format(msg.encoding)
    dtype = np.dtype(f.dtype).newbyteorder(">" if msg.is_bigendian else "<")
    row = msg.width * f.channels * dtype.itemsize
    if msg.step < row:
        raise InputError(f"step {msg.step} is shorter than a row of {msg.width} {msg.encoding} pixels ({row} bytes)")
    expected = msg.step * msg.height
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if data.size < expected:
        raise InputError(f"truncated image data: {data.size} bytes, step x height is {expected}")
    if data.size > expected:
        raise InputError(f"image data of {data.size} bytes, step x height is {expected}")
    # A view with the row stride of the message: padding bytes at row ends are skipped in the copy.
    pixels = data.reshape(msg.height, msg.step)[:, :row].view(dtype).reshape(msg.height, msg.width, f.channels)
    return pixels.astype(pixels.dtype.newbyteorder("="), copy=False)


def image_into(msg, out: np.ndarray) -> None:
    """sensor_msgs/Image -> `out` (HxWx3 uint8 RGB)."""
    f = _raw_format(msg.encoding)
    _check_size(msg.height, msg.width, out)
    pixels = _raw_pixels(msg)   # every check before anything is written
    if _bridge is not None and msg.encoding in BRIDGE_ENCODINGS:
        np.copyto(out, _bridge.imgmsg_to_cv2(msg, "rgb8"))
        return
    if f.channels == 1:   # OpenCV takes one channel as HxW (packed YUV as HxWx2)
        pixels = pixels[..., 0]
    if f.dtype is np.uint16:
        pixels = cv2.convertScaleAbs(pixels, alpha=255.0 / 65535.0)
    if f.to_rgb is None:
        np.copyto(out, pixels)
    else:
        cv2.cvtColor(pixels, f.to_rgb, dst=out)


def compressed_into(msg, out: np.ndarray) -> None:
    """sensor_msgs/CompressedImage (jpeg or png, any image_transport format string) -> `out`."""
    decoded = decode_compressed(msg, limit=COMPRESSED_SIZE_FACTOR * out.size + COMPRESSED_HEADROOM,
                                frame=f"{out.shape[1]}x{out.shape[0]}")
    _check_size(decoded.shape[0], decoded.shape[1], out)
    np.copyto(out, decoded)


def decode_compressed(msg, limit: Optional[int] = None, frame: str = "") -> np.ndarray:
    fmt = msg.format.lower()
    if not any(f in fmt for f in COMPRESSED_FORMATS):
        raise InputError(f"unsupported compressed format {msg.format!r} (supported: jpeg, png)")
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if limit is not None and data.size > limit:
        raise InputError(f"oversize compressed image of {data.size} bytes, more than the {limit} bytes a "
                         f"{frame} frame can need")
    decoded = cv2.imdecode(data, cv2.IMREAD_COLOR_RGB) if data.size else None
    if decoded is None:
        raise InputError(f"corrupt {msg.format} data: the image does not decode")
    return decoded


def decode(msg) -> np.ndarray:
    """Image or CompressedImage -> a new HxWx3 uint8 RGB array of the message's size."""
    if hasattr(msg, "format"):
        return decode_compressed(msg)
    out = np.empty((msg.height, msg.width, 3), np.uint8)
    image_into(msg, out)
    return out
