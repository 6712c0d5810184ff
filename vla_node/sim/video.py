"""Episode videos: the first camera beside a panel of the commanded joints.

MP4 (H.264 through imageio's ffmpeg plugin) when imageio-ffmpeg is installed, else GIF (imageio
with Pillow): the GPU machine has imageio but no ffmpeg.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import cv2
import numpy as np

PANEL_WIDTH = 220
BAR_COLOURS = {"command": (40, 160, 255), "state": (255, 255, 255)}


def annotate(image: np.ndarray, command: Optional[np.ndarray], state: np.ndarray, names: Sequence[str],
             lower: np.ndarray, upper: np.ndarray, caption: str) -> np.ndarray:
    """image [H, W, 3] RGB -> [H, W + PANEL_WIDTH, 3]: one row per joint, its command as a bar
    (None: the loop held, nothing commanded) and its measured position as a tick, both on the
    joint's command range; `caption` above the picture."""
    height = image.shape[0]
    panel = np.full((height, PANEL_WIDTH, 3), 30, np.uint8)
    row = height / (len(names) + 1)
    left, right = 78, PANEL_WIDTH - 6

    def x(value: float, j: int) -> int:
        f = (value - lower[j]) / max(upper[j] - lower[j], 1e-9)
        return int(left + np.clip(f, 0.0, 1.0) * (right - left))

    for j, name in enumerate(names):
        y = int((j + 1) * row)
        label = name.replace("left_arm_", "L ").replace("right_arm_", "R ")[:12]
        cv2.putText(panel, label, (2, y + 3), cv2.FONT_HERSHEY_PLAIN, 0.7, (200, 200, 200), 1)
        cv2.line(panel, (left, y), (right, y), (80, 80, 80), 1)
        if command is not None:
            cv2.rectangle(panel, (x(0.0 if lower[j] <= 0 <= upper[j] else lower[j], j), y - 3),
                          (x(command[j], j), y + 3), BAR_COLOURS["command"], -1)
        cv2.line(panel, (x(state[j], j), y - 5), (x(state[j], j), y + 5), BAR_COLOURS["state"], 1)
    frame = np.concatenate([image, panel], axis=1)
    cv2.putText(frame, caption, (4, 14), cv2.FONT_HERSHEY_PLAIN, 0.9, (255, 255, 0), 1)
    return frame


def write_video(path: str | Path, frames: Sequence[np.ndarray], fps: float) -> Path:
    """Write RGB frames; `path`'s suffix is replaced by .mp4 or .gif (whichever this machine can
    write). Returns the path written."""
    import imageio.v2 as imageio
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        path = path.with_suffix(".gif")
        imageio.mimsave(path, list(frames), duration=1000.0 / fps, loop=0)
        return path
    path = path.with_suffix(".mp4")
    # macro_block_size 1: any frame size (the panel makes widths that are not multiples of 16).
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=7, macro_block_size=1) as writer:
        for frame in frames:
            writer.append_data(frame)
    return path
