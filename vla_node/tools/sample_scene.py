"""The sample recording's scene as pure functions of time: a Franka-like arm picks up a red cup
and puts it in a bowl (joint keyframes), drawn flat-shaded from an exterior and a wrist camera
(640x480). sample_bag.py writes it into bags; benchmarks render it without any bag dependency.
"""
from __future__ import annotations

import cv2
import numpy as np

CAMERA_HZ = 15.0

# Joint-space keyframes (7 joints rad, gripper opening 1 = open .. 0 = closed) at these times (s):
# home, above the cup, at the cup, gripper closed, lifted, above the bowl, released, back up.
KEY_TIMES = (0.0, 1.4, 2.2, 2.7, 3.4, 4.6, 5.1, 6.0)
KEY_POSES = np.array([
    [0.00, -0.50, 0.00, -2.20, 0.00, 1.70, 0.78, 1.0],
    [0.35, -0.15, 0.05, -2.00, 0.02, 1.85, 0.80, 1.0],
    [0.35, 0.25, 0.05, -1.75, 0.02, 2.00, 0.80, 1.0],
    [0.35, 0.25, 0.05, -1.75, 0.02, 2.00, 0.80, 0.0],
    [0.30, -0.10, 0.05, -2.05, 0.02, 1.90, 0.80, 0.0],
    [-0.30, 0.10, -0.05, -1.85, -0.02, 1.95, 0.75, 0.0],
    [-0.30, 0.10, -0.05, -1.85, -0.02, 1.95, 0.75, 1.0],
    [-0.20, -0.40, -0.03, -2.20, 0.00, 1.75, 0.78, 1.0],
])
GRASP_SPAN = (2.7, 5.1)   # the cup is in the gripper between these times


def joint_positions(t: float) -> np.ndarray:
    """The arm's 8-D state at time t (s): minimum-jerk blends between keyframes, holding the
    last pose after the end."""
    t = float(np.clip(t, KEY_TIMES[0], KEY_TIMES[-1]))
    i = min(int(np.searchsorted(KEY_TIMES, t, side="right")) - 1, len(KEY_TIMES) - 2)
    u = (t - KEY_TIMES[i]) / (KEY_TIMES[i + 1] - KEY_TIMES[i])
    s = u ** 3 * (10 - 15 * u + 6 * u ** 2)
    return (KEY_POSES[i] + s * (KEY_POSES[i + 1] - KEY_POSES[i])).astype(np.float64)


def joint_velocities(t: float, dt: float = 1e-3) -> np.ndarray:
    return (joint_positions(t + dt) - joint_positions(t - dt)) / (2 * dt)


# -- drawing ------------------------------------------------------------------------------------
WIDTH, HEIGHT = 640, 480
BASE_PX = np.array([150.0, 400.0])
LINKS_PX = (170.0, 150.0, 70.0)


def arm_points(q: np.ndarray) -> np.ndarray:
    """Side-view joint positions (pixels) of the arm: a planar chain driven by joints 2, 4 and 6,
    swung sideways by joint 1. [4, 2]: base, elbow, wrist, tool tip."""
    angles = np.cumsum([-np.pi / 2 + q[1], np.pi + q[3] + 0.5, q[5] - 1.2])
    swing = 1.0 + 1.2 * q[0]
    points = [BASE_PX]
    for length, angle in zip(LINKS_PX, angles):
        step = length * np.array([np.cos(angle) * swing, np.sin(angle)])
        points.append(points[-1] + step)
    return np.array(points)


def tool_tip(t: float) -> np.ndarray:
    return arm_points(joint_positions(t))[-1]


def cup_position(t: float) -> np.ndarray:
    """Pixel position of the cup in the exterior view: on the table, in the gripper, in the bowl."""
    if t < GRASP_SPAN[0]:
        return tool_tip(GRASP_SPAN[0]) + [0.0, 18.0]
    if t <= GRASP_SPAN[1]:
        return tool_tip(t) + [0.0, 18.0]
    return tool_tip(GRASP_SPAN[1]) + [0.0, 30.0]


def bowl_position() -> np.ndarray:
    return tool_tip(GRASP_SPAN[1]) + [0.0, 42.0]


def _background(table_top: int, table_rgb, wall_rgb) -> np.ndarray:
    img = np.empty((HEIGHT, WIDTH, 3), np.uint8)
    img[:table_top] = wall_rgb
    img[table_top:] = table_rgb
    # A soft horizontal shading band: looks like light falloff, costs JPEG almost nothing.
    shade = np.linspace(1.0, 0.8, HEIGHT - table_top)[:, None, None]
    img[table_top:] = (img[table_top:] * shade).astype(np.uint8)
    return img


def _draw_cup(img, center, scale=1.0):
    x, y = (int(round(v)) for v in center)
    w, h = int(16 * scale), int(28 * scale)
    cv2.rectangle(img, (x - w, y - h), (x + w, y + h), (200, 30, 35), -1, cv2.LINE_AA)
    cv2.ellipse(img, (x, y - h), (w, max(1, h // 4)), 0, 0, 360, (230, 80, 80), -1, cv2.LINE_AA)


def _draw_bowl(img, center, scale=1.0):
    x, y = (int(round(v)) for v in center)
    cv2.ellipse(img, (x, y), (int(50 * scale), int(22 * scale)), 0, 0, 360, (40, 70, 190), -1, cv2.LINE_AA)
    cv2.ellipse(img, (x, y - int(6 * scale)), (int(40 * scale), int(13 * scale)), 0, 0, 360, (25, 45, 130), -1,
                cv2.LINE_AA)


def render_exo(t: float) -> np.ndarray:
    q = joint_positions(t)
    img = _background(260, (150, 115, 80), (205, 210, 215))
    _draw_bowl(img, bowl_position())
    points = arm_points(q)
    cv2.rectangle(img, (int(BASE_PX[0]) - 40, int(BASE_PX[1])), (int(BASE_PX[0]) + 40, HEIGHT), (60, 60, 65), -1)
    for a, b, width in zip(points[:-1], points[1:], (34, 26, 18)):
        cv2.line(img, tuple(int(v) for v in a), tuple(int(v) for v in b), (235, 235, 235), width, cv2.LINE_AA)
    for p in points[:-1]:
        cv2.circle(img, tuple(int(v) for v in p), 16, (70, 70, 75), -1, cv2.LINE_AA)
    tip = points[-1]
    opening = 6 + 16 * q[7]
    for side in (-1, 1):
        x = int(tip[0] + side * opening)
        cv2.line(img, (x, int(tip[1]) - 10), (x, int(tip[1]) + 22), (90, 90, 95), 6, cv2.LINE_AA)
    _draw_cup(img, cup_position(t))
    return img


def render_wrist(t: float) -> np.ndarray:
    """Looking down from the gripper: the table slides by as the tool moves; cup and bowl appear
    when under it; the two fingers frame the bottom of the image."""
    q = joint_positions(t)
    tip = tool_tip(t)
    img = _background(0, (160, 125, 88), (0, 0, 0))
    zoom = 3.0

    def to_view(p):
        return (np.asarray(p) - tip) * zoom + [WIDTH / 2, HEIGHT * 0.55]

    for k in range(-6, 7):   # table planks: motion cues for the wrist view
        x = int((k * 60 - tip[0] * zoom) % (WIDTH + 60)) - 30
        cv2.line(img, (x, 0), (x, HEIGHT), (135, 100, 70), 3)
    _draw_bowl(img, to_view(bowl_position()), zoom)
    if not GRASP_SPAN[0] <= t <= GRASP_SPAN[1]:
        _draw_cup(img, to_view(cup_position(t)), zoom * 0.8)
    else:
        _draw_cup(img, (WIDTH / 2, HEIGHT * 0.75), 2.2)
    opening = 70 + 170 * q[7]
    for side in (-1, 1):
        x = int(WIDTH / 2 + side * opening)
        cv2.rectangle(img, (x - 28, int(HEIGHT * 0.62)), (x + 28, HEIGHT), (80, 80, 85), -1)
    return img


RENDERERS = {"exo": render_exo, "wrist": render_wrist}
