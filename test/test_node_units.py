"""The node's parts without DDS: message conversion, parameter validation, frame windows, the
chunk hand-over and the safety filter (fast; the tests over DDS are in the other test_node_*)."""
import logging

import cv2
import numpy as np
import pytest
from sensor_msgs.msg import CompressedImage, Image, JointState

from vla_node.ros import messages, params
from vla_node.ros.control import Plan, SafetyFilter
from vla_node.ros.diagnostics import Faults
from vla_node.ros.frames import FrameRing, Wait, Window
from vla_node.ros.messages import InputError
from vla_node.runtime.state_history import StateHistory

H, W = 6, 8


def rgb():
    return np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)


def raw(pixels: np.ndarray, encoding: str, pad: int = 0) -> Image:
    h, w = pixels.shape[:2]
    rows = pixels.reshape(h, -1)
    data = np.concatenate([rows, np.zeros((h, pad), np.uint8)], axis=1) if pad else rows
    return Image(height=h, width=w, encoding=encoding, step=rows.shape[1] + pad, data=data.tobytes())


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8", "mono8"])
@pytest.mark.parametrize("pad", [0, 5])
def test_raw_encodings_convert_to_rgb(encoding, pad):
    img = rgb()
    source = {"rgb8": img, "bgr8": img[..., ::-1], "rgba8": np.dstack([img, np.full((H, W), 7, np.uint8)]),
              "bgra8": np.dstack([img[..., ::-1], np.full((H, W), 7, np.uint8)]), "mono8": img[..., 0]}[encoding]
    out = np.zeros((H, W, 3), np.uint8)
    messages.image_into(raw(np.ascontiguousarray(source), encoding, pad), out)
    expected = np.repeat(img[..., :1], 3, axis=2) if encoding == "mono8" else img
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("change, match", [
    (dict(encoding="yuv422"), "unsupported encoding"),
    (dict(height=H - 1), "wrong image size"),
    (dict(width=W * 2, step=W * 6), "oversize image"),
    (dict(step=W * 3 - 1), "step"),
    (dict(data=bytes(H * W * 3 - 10)), "truncated"),
    (dict(data=bytes(H * W * 3 + 10)), "bytes, step x height"),
])
def test_raw_errors_leave_the_destination_untouched(change, match):
    msg = raw(rgb(), "rgb8")
    for k, v in change.items():
        setattr(msg, k, v)
    out = np.full((H, W, 3), 9, np.uint8)
    with pytest.raises(InputError, match=match):
        messages.image_into(msg, out)
    assert (out == 9).all()


def test_compressed_png_is_exact_and_jpeg_decodes():
    img = rgb()
    out = np.zeros((H, W, 3), np.uint8)
    png = CompressedImage(format="bgr8; png compressed bgr8", data=cv2.imencode(".png", img[..., ::-1])[1].tobytes())
    messages.compressed_into(png, out)
    np.testing.assert_array_equal(out, img)
    flat = np.full((H, W, 3), (200, 40, 10), np.uint8)
    jpeg = CompressedImage(format="jpeg", data=cv2.imencode(".jpg", flat[..., ::-1])[1].tobytes())
    messages.compressed_into(jpeg, out)
    assert np.abs(out.astype(int) - flat).max() <= 3


@pytest.mark.parametrize("fmt, data, match", [
    ("jpeg", b"\xff\xd8not a jpeg at all", "corrupt"),
    ("jpeg", b"", "corrupt"),
    ("tiff", b"II*\x00", "unsupported compressed format"),
    ("jpeg", bytes(2 * H * W * 3 + messages.COMPRESSED_HEADROOM + 1), "oversize compressed"),
])
def test_compressed_errors(fmt, data, match):
    with pytest.raises(InputError, match=match):
        messages.compressed_into(CompressedImage(format=fmt, data=data), np.zeros((H, W, 3), np.uint8))


def test_compressed_wrong_size():
    big = CompressedImage(format="png", data=cv2.imencode(".png", np.zeros((H, W + 1, 3), np.uint8))[1].tobytes())
    with pytest.raises(InputError, match="oversize image"):
        messages.compressed_into(big, np.zeros((H, W, 3), np.uint8))


def test_joint_states_are_reordered_and_extra_joints_ignored():
    msg = JointState(name=["b", "x", "a"], position=[2.0, 9.0, 1.0])
    np.testing.assert_array_equal(messages.joint_positions(msg, ["a", "b"]), [1.0, 2.0])


@pytest.mark.parametrize("names, positions, match", [
    (["a"], [1.0], "lacks joints \\['b'\\]"),
    (["p", "q"], [1.0, 2.0], "none of the configured joints"),
    (["a", "b"], [1.0, float("nan")], "non-finite joint positions for \\['b'\\]"),
    (["a", "b"], [float("inf"), 1.0], "non-finite"),
    (["a", "b"], [1.0], "2 names but 1 positions"),
])
def test_joint_state_errors(names, positions, match):
    with pytest.raises(InputError, match=match):
        messages.joint_positions(JointState(name=names, position=positions), ["a", "b"])


def test_trajectory_times_follow_the_control_period():
    traj = messages.trajectory_msg(["a", "b"], np.arange(6.0).reshape(3, 2), messages.JointTrajectory().header.stamp,
                                   period_ns=1_500_000_000)
    assert [(p.time_from_start.sec, p.time_from_start.nanosec) for p in traj.points] == [(0, 0), (1, 5e8), (3, 0)]
    assert list(traj.points[2].positions) == [4.0, 5.0]


# -- parameters -----------------------------------------------------------------------------------
def defaults():
    return {name: spec.default for name, spec in params.SPECS.items()}


def test_defaults_are_valid_and_every_parameter_has_a_descriptor():
    s = params.validate(defaults(), horizon=16)
    assert s.control_period_s == pytest.approx(0.02)
    for name, spec in params.SPECS.items():
        d = spec.descriptor(name)
        assert d.description and d.type != 0
        assert bool(d.integer_range or d.floating_point_range) == (spec.range is not None)


@pytest.mark.parametrize("change, match", [
    (dict(joint_lower_limits=[1.0] * 8), "below joint_upper_limits"),
    (dict(max_step_per_tick=[0.1] * 7), "max_step_per_tick has 7 values"),
    (dict(max_step_per_tick=[0.0] * 8), "> 0"),
    (dict(joint_upper_limits=[float("nan")] * 8), "finite"),
    (dict(handover="blend"), "handover must be one of"),
    (dict(state_sync="latest"), "state_sync must be one of"),
    (dict(replan_threshold=17), "exceeds the model's horizon 16"),
    (dict(camera_topics=["/a"]), "camera_topics has 1 entries"),
    (dict(camera_names=["a", "a"]), "unique"),
    (dict(control_rate_hz=0.5), "outside"),
    (dict(instruction="x" * (params.MAX_INSTRUCTION_CHARS + 1)), "characters"),
    (dict(engine_mode="turbo"), "engine_mode must be one of"),
    (dict(model_preset="gpt5"), "model_preset must be one of"),
    (dict(dtype="float16"), "dtype must be float32 or bfloat16"),
    (dict(fp8="e5m2"), "fp8 must be off, rowwise or tensorwise"),
    (dict(streaming_kv=True, engine_mode="graphs"), "streaming_kv needs engine_mode fast"),
    (dict(action_cache="5:7"), "can only reuse an earlier step"),
    (dict(action_cache="flashdrive"), "defined for 8 flow steps"),
    (dict(action_cache="adaptive:0.1"), "adaptive action_cache needs an engine_mode with static shapes"),
])
def test_invalid_values_are_rejected_with_a_reason(change, match):
    values = defaults()
    values.update(change)
    with pytest.raises(params.SettingsError, match=match):
        params.validate(values, horizon=16)


# -- frame windows ----------------------------------------------------------------------------------
def ring(frames=2, stride=3, cameras=("a", "b")):
    nbytes = FrameRing.nbytes(len(cameras), 2, 2, frames, stride)
    return FrameRing(list(cameras), 2, 2, frames, stride, bytearray(nbytes))


def put(r, camera, stamp, value=0):
    r.write(camera, stamp, stamp, lambda out: out.fill(value))


def test_window_takes_history_stride_frames_back_and_matches_other_cameras_by_stamp():
    r = ring()
    for t in range(10):
        put(r, 0, 1000 * t, t)
        put(r, 1, 1000 * t + 7, 100 + t)          # 7 ns behind: within the slop
    w = r.take_window(slop_ns=10)
    assert isinstance(w, Window) and w.stamp_ns == 9000
    assert w.frame_ids == [("a", 6000), ("b", 6007), ("a", 9000), ("b", 9007)]
    assert [int(r.pixels[s][0, 0, 0]) for s in w.slots] == [6, 106, 9, 109]
    assert isinstance(r.take_window(slop_ns=5), Wait) and r.take_window(slop_ns=5).sync


def test_window_waits_for_history_then_for_the_other_camera():
    r = ring()
    put(r, 0, 0)
    put(r, 0, 1000)
    assert not r.take_window(10).sync      # history still filling: not a fault
    for t in range(2, 5):
        put(r, 0, 1000 * t)
    assert r.take_window(10).sync          # camera b never sent a frame


def test_newest_complete_window_wins_when_the_newest_frame_has_no_partner_yet():
    r = ring()
    for t in range(5):
        put(r, 0, 1000 * t)
        put(r, 1, 1000 * t)
    put(r, 0, 5000)                        # b's frame for t=5 is still on its way
    assert r.take_window(10).stamp_ns == 4000


def test_out_of_order_frames_are_refused_before_any_copy():
    r = ring()
    put(r, 0, 1000, 1)
    with pytest.raises(InputError, match="out-of-order"):
        put(r, 0, 1000, 2)
    with pytest.raises(InputError, match="out-of-order"):
        r.write(0, 500, 500, lambda out: pytest.fail("copied"))


def test_pinned_frames_are_never_overwritten():
    r = ring(frames=2, stride=1)
    for t in range(3):
        put(r, 0, t, t)
        put(r, 1, t, t)
    w = r.take_window(0)
    pinned = {s: r.pixels[s].copy() for s in w.slots}
    for t in range(3, 50):
        put(r, 0, t, t % 250)
        put(r, 1, t, t % 250)
    for s, pixels in pinned.items():
        np.testing.assert_array_equal(r.pixels[s], pixels)
    r.unpin()


def test_a_frame_filled_across_a_clear_is_dropped():
    r = ring()
    put(r, 0, 5000)
    r.write(0, 6000, 6000, lambda out: r.clear())      # the clock jumped back while it was copied
    put(r, 0, 10)                                       # so its stamp does not refuse later frames
    assert r.newest_received_ns()[0] == 10


def test_clear_forgets_frames_and_stamps():
    r = ring()
    for t in range(5):
        put(r, 0, 1000 * t)
        put(r, 1, 1000 * t)
    r.clear()
    put(r, 0, 10)                          # an earlier stamp is fine after a clock jump
    assert not r.take_window(10).sync


# -- robot state by stamp ----------------------------------------------------------------------------
def test_state_history_gives_the_state_stamped_nearest_the_frame():
    states = StateHistory(capacity=3)
    assert states.nearest(100) is None
    for stamp in (10, 20, 30, 40):                  # 10 falls out of the history
        states.add(stamp, np.array([stamp]))
    assert states.nearest(26)[0] == 4 and states.nearest(26)[1][0] == 30
    assert states.nearest(25)[1][0] == 30           # a tie goes to the later state
    assert states.nearest(0)[0] == 20               # only what is kept: the nearest is 20 after it
    assert states.nearest(1000)[0] == 40 - 1000
    states.add(40, np.array([41]))                  # the same stamp again: the later message
    assert states.nearest(40)[1][0] == 41
    states.clear()
    assert states.nearest(30) is None


# -- hand-over and safety -----------------------------------------------------------------------------
def test_rtc_keeps_the_frozen_actions_and_blends_the_rest():
    plan = Plan()
    plan.hand_over(np.zeros((16, 1)), first_tick=1, now_tick=0, mode="rtc", freeze=0, blend_steps=0, weight=0)
    assert plan.remaining(0) == 16
    # Sent after tick 8 (chunk from tick 9), arrived after tick 10, latency 3 ticks, blend 3.
    plan.hand_over(np.ones((16, 1)), first_tick=9, now_tick=10, mode="rtc", freeze=3, blend_steps=3, weight=0)
    assert plan.start == 11
    got = [plan.action(t)[0] for t in range(11, 17)]
    np.testing.assert_allclose(got, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0])   # tick 11 frozen, 12-14 blend
    assert plan.action(24)[0] == 1.0 and plan.action(25) is None


def test_average_mode_and_chunks_from_the_past():
    plan = Plan()
    plan.hand_over(np.zeros((4, 1)), first_tick=1, now_tick=0, mode="average", freeze=0, blend_steps=0, weight=0)
    plan.hand_over(np.ones((4, 1)), first_tick=3, now_tick=2, mode="average", freeze=0, blend_steps=0, weight=0.25)
    np.testing.assert_allclose([plan.action(t)[0] for t in (3, 4, 5, 6)], [0.25, 0.25, 1.0, 1.0])
    before = plan.actions.copy()
    assert not plan.hand_over(np.full((2, 1), 5.0), first_tick=1, now_tick=4, mode="rtc", freeze=0, blend_steps=0,
                              weight=0)
    np.testing.assert_array_equal(plan.actions, before)   # entirely in the past: ignored


def test_safety_clamps_to_limits_then_limits_the_step():
    f = SafetyFilter([-1.0, 0.0], [1.0, 1.0], [0.1, 0.5])
    np.testing.assert_allclose(f(np.array([5.0, -3.0]), None), [1.0, 0.0])
    np.testing.assert_allclose(f(np.array([5.0, 1.0]), np.array([0.0, 0.0])), [0.1, 0.5])
    np.testing.assert_allclose(f.rollout(np.array([[1.0, 1.0]] * 3), np.zeros(2)),
                               [[0.1, 0.5], [0.2, 1.0], [0.3, 1.0]])


def test_faults_are_logged_once_per_cause():
    records = []
    logger = logging.getLogger("test_faults")
    logger.addHandler(type("Collect", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())
    logger.setLevel(logging.INFO)
    changes = []
    faults = Faults(logger, on_change=lambda: changes.append(1))
    for _ in range(50):
        faults.set("camera 'a'", "corrupt jpeg")
    faults.set("camera 'a'", "wrong size")
    faults.clear("camera 'a'")
    faults.clear("camera 'a'")
    assert [r.getMessage() for r in records] == ["holding: camera 'a': corrupt jpeg", "holding: camera 'a': wrong size",
                                                 "resolved: camera 'a': wrong size"]
    assert len(changes) == 3 and faults.events["camera 'a'"] == 2 and not faults
