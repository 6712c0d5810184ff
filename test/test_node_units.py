"""The node's parts without DDS: message conversion, parameter validation, the frame buffer, the
chunk hand-over, the safety filter and fault reporting (fast; the tests over DDS are in the other
test_node_*; window choice and joint assembly in test_windows)."""
import logging
import math
import threading
import types

import cv2
import numpy as np
import pytest
from sensor_msgs.msg import CompressedImage, Image

from vla_node.ros import messages, params
from vla_node.ros.control import Plan, Request, SafetyFilter
from vla_node.ros.diagnostics import LOG_BURST, LOG_WINDOW_S, Faults, Key, NodeTelemetry, duration_in_words
from vla_node.ros.engine_protocol import Chunk
from vla_node.ros.executor import transition
from vla_node.ros.frames import FrameRing, SharedInputs, Window
from vla_node.ros.outputs import DIAGNOSTICS_PERIOD_S, ReportPacing
from vla_node.runtime import images
from vla_node.runtime.windows import InputError, Wait, WindowSpec

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
    images.image_into(raw(np.ascontiguousarray(source), encoding, pad), out)
    expected = np.repeat(img[..., :1], 3, axis=2) if encoding == "mono8" else img
    np.testing.assert_array_equal(out, expected)


def blocks() -> np.ndarray:
    """H x W RGB in 2x2 blocks of one colour: chroma subsampling and demosaicing keep their
    colours (nearly) exact, so a wrong byte or pattern order shows."""
    colours = np.random.default_rng(1).integers(30, 226, (H // 2, W // 2, 3), dtype=np.uint8)
    return np.kron(colours, np.ones((2, 2, 1), np.uint8))


PACKED_YUV = {"yuv422": cv2.COLOR_RGB2YUV_UYVY, "uyvy": cv2.COLOR_RGB2YUV_UYVY,
              "yuv422_yuy2": cv2.COLOR_RGB2YUV_YUYV, "yuyv": cv2.COLOR_RGB2YUV_YUYV}
YUV_TO_RGB = {"yuv422": cv2.COLOR_YUV2RGB_UYVY, "uyvy": cv2.COLOR_YUV2RGB_UYVY,
              "yuv422_yuy2": cv2.COLOR_YUV2RGB_YUYV, "yuyv": cv2.COLOR_YUV2RGB_YUYV}


@pytest.mark.parametrize("encoding", list(PACKED_YUV))
@pytest.mark.parametrize("pad", [0, 4])
def test_packed_yuv_converts_as_opencv_does(encoding, pad):
    """usb_cam publishes yuv422_yuy2 (YUYV) by default; sensor_msgs' yuv422 is UYVY."""
    img = blocks()
    packed = cv2.cvtColor(img, PACKED_YUV[encoding])                 # H x W x 2
    out = np.zeros((H, W, 3), np.uint8)
    images.image_into(raw(packed, encoding, pad), out)
    np.testing.assert_array_equal(out, cv2.cvtColor(packed, YUV_TO_RGB[encoding]))
    assert np.abs(out.astype(int) - img).max() <= 3                  # and the colours come back


# pattern -> which colour channel each of the 2x2 positions samples, and OpenCV's code for it
BAYER = {"bayer_rggb8": ([[0, 1], [1, 2]], cv2.COLOR_BayerRGGB2RGB), "bayer_bggr8": ([[2, 1], [1, 0]],
                                                                                     cv2.COLOR_BayerBGGR2RGB),
         "bayer_gbrg8": ([[1, 2], [0, 1]], cv2.COLOR_BayerGBRG2RGB), "bayer_grbg8": ([[1, 0], [2, 1]],
                                                                                     cv2.COLOR_BayerGRBG2RGB)}


@pytest.mark.parametrize("encoding", list(BAYER))
def test_bayer_mosaics_convert_as_opencv_does(encoding):
    channels, code = BAYER[encoding]
    flat = np.full((H, W, 3), (200, 90, 30), np.uint8)
    mosaic = np.zeros((H, W), np.uint8)
    for dy in (0, 1):
        for dx in (0, 1):
            mosaic[dy::2, dx::2] = flat[dy::2, dx::2, channels[dy][dx]]
    out = np.zeros((H, W, 3), np.uint8)
    images.image_into(raw(mosaic[..., None], encoding), out)
    np.testing.assert_array_equal(out, cv2.cvtColor(mosaic, code))
    np.testing.assert_array_equal(out[2:-2, 2:-2], flat[2:-2, 2:-2])   # a wrong pattern swaps red and blue


@pytest.mark.parametrize("encoding", ["mono16", "16UC1"])
@pytest.mark.parametrize("bigendian", [False, True])
def test_16_bit_mono_scales_to_8_bits_as_cv_bridge_does(encoding, bigendian):
    values = np.random.default_rng(2).integers(0, 65536, (H, W), dtype=np.uint16)
    values[0, :3] = (0, 32896, 65535)
    msg = raw(values.astype(">u2" if bigendian else "<u2").view(np.uint8).reshape(H, W, 2), encoding)
    msg.is_bigendian = bigendian
    out = np.zeros((H, W, 3), np.uint8)
    images.image_into(msg, out)
    np.testing.assert_array_equal(out, cv2.cvtColor(cv2.convertScaleAbs(values, alpha=255 / 65535),
                                                    cv2.COLOR_GRAY2RGB))
    assert out[0, :3, 0].tolist() == [0, 128, 255]


def test_a_fixed_latency_is_counted_in_control_ticks():
    values = defaults()
    assert params.validate(values, horizon=16).fixed_latency_ticks is None    # off
    values.update(fixed_latency_s=0.1, use_sim_time=True, control_rate_hz=50.0)
    assert params.validate(values, horizon=16).fixed_latency_ticks == 5


@pytest.mark.parametrize("change, match", [
    (dict(encoding="32FC1"), "unsupported encoding"),
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
        images.image_into(msg, out)
    assert (out == 9).all()


def test_compressed_png_is_exact_and_jpeg_decodes():
    img = rgb()
    out = np.zeros((H, W, 3), np.uint8)
    png = CompressedImage(format="bgr8; png compressed bgr8", data=cv2.imencode(".png", img[..., ::-1])[1].tobytes())
    images.compressed_into(png, out)
    np.testing.assert_array_equal(out, img)
    flat = np.full((H, W, 3), (200, 40, 10), np.uint8)
    jpeg = CompressedImage(format="jpeg", data=cv2.imencode(".jpg", flat[..., ::-1])[1].tobytes())
    images.compressed_into(jpeg, out)
    assert np.abs(out.astype(int) - flat).max() <= 3


@pytest.mark.parametrize("fmt, data, match", [
    ("jpeg", b"\xff\xd8not a jpeg at all", "corrupt"),
    ("jpeg", b"", "corrupt"),
    ("tiff", b"II*\x00", "unsupported compressed format"),
    ("jpeg", bytes(2 * H * W * 3 + images.COMPRESSED_HEADROOM + 1), "oversize compressed"),
])
def test_compressed_errors(fmt, data, match):
    with pytest.raises(InputError, match=match):
        images.compressed_into(CompressedImage(format=fmt, data=data), np.zeros((H, W, 3), np.uint8))


def test_compressed_wrong_size():
    big = CompressedImage(format="png", data=cv2.imencode(".png", np.zeros((H, W + 1, 3), np.uint8))[1].tobytes())
    with pytest.raises(InputError, match="oversize image"):
        images.compressed_into(big, np.zeros((H, W, 3), np.uint8))


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
    (dict(handover="blend"), r"handover must be one of \['rtc', 'average', 'inpaint'\], got 'blend'"),
    (dict(state_sync="latest"), "state_sync must be one of"),
    (dict(replan_threshold=17), "exceeds the model's horizon 16"),
    (dict(camera_topics=["/a"]), "camera_topics has 1 entries"),
    (dict(camera_names=["a", "a"]), "unique"),
    (dict(control_rate_hz=0.5), "outside"),
    (dict(instruction="x" * (params.MAX_INSTRUCTION_CHARS + 1)), "characters"),
    (dict(engine_mode="turbo"), "unknown mode 'turbo'"),
    (dict(model_preset="gpt5"), "unknown model preset 'gpt5'"),
    (dict(dtype="float16"), "dtype must be float32 or bfloat16"),
    (dict(fp8="e5m2"), "fp8 must be off, rowwise or tensorwise"),
    (dict(instruction_tiers=[48, 0]), r"instruction_tiers must be token counts >= 1, got \[48, 0\]"),
    (dict(streaming_kv=True, engine_mode="graphs"),
     "streaming_kv needs vision_cache and ctx_kv_once .*: engine_mode fast"),
    (dict(action_cache="5:7"), "can only reuse an earlier step"),
    (dict(action_cache="flashdrive"), "defined for 8 flow steps"),
    (dict(action_cache="adaptive:0.1"), "adaptive action cache needs static_shapes .*: engine_mode static or later"),
    (dict(fixed_latency_s=0.1), "fixed_latency_s needs use_sim_time: true"),
    (dict(fixed_latency_s=0.32, use_sim_time=True), "fixed_latency_s 0.32 is 16 control ticks, not less than the "
                                                    "model's horizon 16"),
])
def test_invalid_values_are_rejected_with_a_reason(change, match):
    values = defaults()
    values.update(change)
    with pytest.raises(params.SettingsError, match=match):
        params.validate(values, horizon=16)


@pytest.mark.parametrize("mode", ["rtc", "average", "inpaint"])
def test_every_handover_mode_is_accepted_and_described(mode):
    values = defaults()
    values["handover"] = mode
    assert params.validate(values, horizon=16).handover == mode
    assert mode in params.SPECS["handover"].description


@pytest.fixture
def ros_context():
    import rclpy
    context = rclpy.Context()
    rclpy.init(context=context)
    yield context
    context.try_shutdown()


def test_a_wrong_type_gets_the_same_sentence_at_start_up_and_at_run_time(ros_context):
    """rclpy's own words at run time were "Wrong parameter type, expected '3' got '2'"."""
    from rclpy.parameter import Parameter

    from vla_node.ros.node import VLANode

    sentence = "control_rate_hz must be a double, written with a decimal point (15.0, not 15)"
    with pytest.raises(params.SettingsError) as refused:
        VLANode("typed_at_start", context=ros_context, parameter_overrides=[Parameter("control_rate_hz", value=15)])
    assert str(refused.value) == sentence
    node = VLANode("typed_at_run_time", context=ros_context)
    try:
        for name, value, reason in [("control_rate_hz", 30, sentence),
                                    ("joint_lower_limits", [0] * 8, "joint_lower_limits must be a list of doubles"),
                                    ("replan_threshold", 8.0, "replan_threshold must be an integer"),
                                    ("handover", 1, "handover must be a string"),
                                    ("wait_for_history", "yes", "wait_for_history must be true or false"),
                                    ("model_preset", 3, "Trying to set a read-only parameter")]:
            before = node.get_parameter(name).value
            result = node.set_parameters([Parameter(name, value=value)])[0]
            assert not result.successful and result.reason.startswith(reason), (name, result.reason)
            assert node.get_parameter(name).value == before
        together = node.set_parameters_atomically([Parameter("control_rate_hz", value=30),
                                                   Parameter("blend_steps", value=2)])
        assert not together.successful and together.reason == sentence
        assert node.get_parameter("blend_steps").value == 4
        assert node.set_parameters([Parameter("control_rate_hz", value=30.0)])[0].successful
        assert node.settings.control_rate_hz == 30.0
    finally:
        node.destroy_node()


@pytest.mark.parametrize("publishers, lost, raw, hint", [
    (0, False, True, "; nothing publishes on /cam"),
    (1, False, True, ""),                       # not sent yet, or a gap: nothing to blame on the transport
    (1, True, False, "; /cam has a publisher, but its messages are lost on the way"),
    (1, True, True, "; /cam has a publisher, but its messages are lost on the way: Fast DDS's default transports drop "
                    "raw frames this large, start the camera publisher with FASTDDS_DEFAULT_PROFILES_FILE="),
])
def test_a_silent_input_blames_the_transport_only_for_messages_lost_since_its_newest(publishers, lost, raw, hint):
    from vla_node.ros.inputs import silence_hint
    text = silence_hint("/cam", publishers, lost, raw)
    assert text.startswith(hint) and bool(text) == bool(hint)


@pytest.mark.parametrize("seconds, words", [(0.001, "1 ms"), (0.0004, "0.4 ms"), (0.25, "250 ms"), (1.0, "1.000 s"),
                                            (9.995, "9.995 s")])
def test_steps_shorter_than_a_second_are_given_in_milliseconds(seconds, words):
    assert duration_in_words(seconds) == words


# -- the frame buffer -------------------------------------------------------------------------------
def ring(keep=8, cameras=("a", "b"), slop_ns=10):
    """The node's inputs without ROS (frames.SharedInputs: an InputTimeline over a FrameRing), one
    joint "j"; frames 1000 ns apart in the tests: the history frame is 3 frames back."""
    spec = WindowSpec(frames=2, offset_ns=3000, sync_slop_ns=slop_ns, state_slop_ns=0)
    return SharedInputs(list(cameras), ["j"], 2, 2, spec, keep,
                        bytearray(int(np.prod(FrameRing.shape_of(len(cameras), 2, 2, keep, spec.frames)))))


def put(r, camera, stamp, value=0):
    """A frame; for the first camera, a joint sample at its stamp too."""
    change = r.write(camera, stamp, stamp, lambda out: out.fill(value))
    if camera == 0:
        r.add_joint_states(stamp, ["j"], [1.0], stamp)
    return change


def test_window_takes_the_history_offset_back_and_matches_other_cameras_by_stamp():
    r = ring()
    for t in range(10):
        put(r, 0, 1000 * t, t)
        put(r, 1, 1000 * t + 7, 100 + t)          # 7 ns behind: within the slop
    w = r.take_window()
    assert isinstance(w, Window) and w.stamp_ns == 9000 and w.state_stamps_ns.tolist() == [9000]
    assert w.frame_ids == [("a", 6000), ("b", 6007), ("a", 9000), ("b", 9007)]
    assert [int(r.ring.pixels[s][0, 0, 0]) for s in w.slots] == [6, 106, 9, 109]
    r.unpin()
    r.configure(WindowSpec(frames=2, offset_ns=3000, sync_slop_ns=5, state_slop_ns=0), "frame")
    assert r.take_window() == Wait("camera 'b' has no frame within sync_slop_s of camera 'a'", sync=True)


def test_window_waits_for_the_other_camera_and_for_state():
    r = ring()
    for t in range(5):
        r.write(0, 1000 * t, 0, lambda out: None)
    assert r.take_window() == Wait("waiting for camera 'b'", sync=False)
    r.write(1, 4000, 0, lambda out: None)
    assert r.take_window() == Wait("no joint state for ['j'] yet", sync=False, lacks="state")


def test_newest_complete_window_wins_when_the_newest_frame_has_no_partner_yet():
    r = ring()
    for t in range(5):
        put(r, 0, 1000 * t)
        put(r, 1, 1000 * t)
    put(r, 0, 5000)                        # b's frame for t=5 is still on its way
    assert r.take_window().stamp_ns == 4000


def test_a_repeated_stamp_is_refused_before_any_copy_and_a_step_back_forgets_the_old_timeline():
    r = ring()
    put(r, 0, 1000, 1)
    with pytest.raises(InputError, match="repeated stamp"):
        r.write(0, 1000, 1000, lambda out: pytest.fail("copied"))
    put(r, 1, 1000)
    change = r.write(0, 500, 500, lambda out: out.fill(2))
    assert change.reason == "camera 'a' stamps stepped back" and change.back_ns == 500
    assert [f.stamp_ns for f in r.timeline.frames(0)] == [500] and not r.timeline.frames(1)


def test_unstamped_frames_are_refused_with_the_reason():
    r = ring()
    put(r, 0, 0)                           # a simulation's first frame, at time 0
    with pytest.raises(InputError, match=r"unstamped frames \(header.stamp 0\).*driver must set them"):
        r.write(0, 0, 2000, lambda out: pytest.fail("copied"))


def test_pinned_frames_are_never_overwritten():
    r = ring(keep=6)
    for t in range(4):
        put(r, 0, 1000 * t, t)
        put(r, 1, 1000 * t, t)
    w = r.take_window()
    pinned = {s: r.ring.pixels[s].copy() for s in w.slots}
    for t in range(4, 50):
        put(r, 0, 1000 * t, t % 250)
        put(r, 1, 1000 * t, t % 250)
    for s, pixels in pinned.items():
        np.testing.assert_array_equal(r.ring.pixels[s], pixels)
    r.unpin()


def test_a_frame_filled_across_forgetting_the_inputs_is_dropped():
    r = ring()
    put(r, 0, 5000)
    r.write(0, 6000, 6000, lambda out: r.forget())     # the clock jumped back while it was copied
    put(r, 0, 10)                                       # so its stamp does not refuse later frames
    assert r.newest_received_ns()[0] == 10
    assert [f.stamp_ns for f in r.timeline.frames(0)] == [10]


def test_forget_forgets_frames_and_stamps():
    r = ring()
    for t in range(5):
        put(r, 0, 1000 * t)
        put(r, 1, 1000 * t)
    r.forget()
    assert put(r, 0, 10) is None           # an earlier stamp is no step back after forgetting
    assert r.take_window() == Wait("waiting for camera 'b'", sync=False)


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


def test_a_flapping_source_logs_and_announces_a_few_changes_then_a_summary():
    """A gripper and an arm driver alternating on /joint_states made the node log 1203 warnings
    in 12 s and publish /diagnostics at ~100 Hz: each message changed the reason."""
    records, changes, now = [], [], [0.0]
    logger = logging.getLogger("test_flapping")
    logger.addHandler(type("Collect", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())
    logger.setLevel(logging.INFO)
    faults = Faults(logger, on_change=lambda: changes.append(1), clock=lambda: now[0])
    for k in range(200):                   # 100 Hz for 2 s, alternating causes
        now[0] = k / 100
        faults.set("joint_states", "lacks joints ['panda_gripper']" if k % 2 else "lacks joints ['panda_joint1']")
        faults.flush()
    assert len(records) == LOG_BURST and len(changes) == LOG_BURST
    now[0] = 12.0                          # the burst's window passed: where it stands, once
    faults.flush()
    assert records[-1].getMessage() == (f"holding: joint_states: lacks joints ['panda_gripper'] "
                                        f"(after {200 - LOG_BURST} changes not logged one by one)")
    faults.flush()
    assert len(records) == LOG_BURST + 1
    assert faults.active()["joint_states"] == "lacks joints ['panda_gripper']"   # /diagnostics has the latest
    faults.clear("joint_states")
    assert records[-1].getMessage() == "resolved: joint_states: lacks joints ['panda_gripper']"
    assert len(records) == len(changes) == LOG_BURST + 2


def test_a_flapping_sources_last_changes_reach_the_log_when_the_node_releases_its_inputs():
    records = []
    logger = logging.getLogger("test_flapping_release")
    logger.addHandler(type("Collect", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())
    logger.setLevel(logging.INFO)
    faults = Faults(logger, on_change=lambda: None, clock=lambda: 0.0)
    for k in range(LOG_BURST + 5):         # all within one window: the last 5 only counted
        if k % 2:
            faults.clear("sync")
        else:
            faults.set("sync", "frames out of step")
    faults.reset()                         # cleanup, shutdown, exit: before the window passed
    assert records[-1].getMessage() == "holding: sync: frames out of step (after 5 changes not logged one by one)"
    assert not faults.active()


def ticks_reported(commanding, period_s=0.02):
    """The control ticks (by index) after which ReportPacing sends a report, for a loop that
    commands at tick k if commanding(k), one tick every `period_s` of a fake clock; each report
    says "running" if its tick commanded."""
    now = [0.0]
    pacing, reported = ReportPacing(clock=lambda: now[0]), []
    pacing.sent(running=False)                # a report before the first tick: holding
    for k in range(1, 50 * 60):
        now[0] = k * period_s
        if commanding(k) is not None and pacing.due(commanding(k)):
            reported.append(k)
            pacing.sent(running=commanding(k))
    return reported


def test_the_tick_the_loop_resumes_or_starts_holding_is_reported_at_once():
    """/diagnostics said "running" up to a second after the loop commanded again (after a fault,
    after an activation's first wait), and "holding" up to a second after it held: only the period
    made a tick report. Ticks 1-9 hold, 10-29 command, 30-59 hold (a plan run out), then it stops."""
    def loop(k):
        return 10 <= k < 30 if k < 60 else None
    assert ticks_reported(loop) == [10, 30]


def test_a_hold_already_reported_and_the_wait_of_configure_follow_the_period():
    """A tick that holds after a fault's announcement said so (ReportPacing.sent between the
    ticks) is no change; without a tick (configure's waits: None) only the period counts."""
    now = [0.0]
    pacing = ReportPacing(clock=lambda: now[0])
    assert pacing.due(None)                  # nothing reported yet
    pacing.sent(running=True)
    now[0] = 0.01
    pacing.sent(running=False)               # a fault's announcement, between two ticks
    now[0] = 0.02
    assert not pacing.due(False) and not pacing.due(None)
    now[0] = 0.01 + DIAGNOSTICS_PERIOD_S
    assert pacing.due(None) and pacing.due(False)


def test_a_loop_that_flaps_between_holding_and_commanding_is_reported_near_the_period():
    """Holding and commanding by turns, tick by tick, for a minute at 50 Hz: LOG_BURST reports of
    a change per LOG_WINDOW_S, the rest one a period, within test_node_malformed's bound for a
    flapping input, not 3000."""
    reported = ticks_reported(lambda k: k % 2 == 0)
    span_s = (reported[-1] - reported[0]) * 0.02
    assert len(reported) <= span_s / DIAGNOSTICS_PERIOD_S + 1 + LOG_BURST * (1 + math.floor(span_s / LOG_WINDOW_S))
    assert reported[:LOG_BURST] == list(range(2, LOG_BURST + 2))     # the first changes at once (tick 1 holds)
    first_window = [k for k in reported if k * 0.02 <= LOG_WINDOW_S]
    assert len(first_window) <= LOG_BURST + LOG_WINDOW_S / DIAGNOSTICS_PERIOD_S


def test_diagnostics_report_the_batch_each_chunk_ran_in():
    """engine_batch_size: the last chunk's query (1 from a node's own engine), its largest since
    start-up; engine_batch_wait_ms_*: the wait for the batch to close."""
    telemetry = NodeTelemetry()
    assert Key.ENGINE_BATCH_SIZE not in dict(telemetry.pairs(0.02, False, "cpu"))
    actions = np.zeros((16, 8), np.float32)
    for size, wait_ms in ((2, 3.0), (1, 0.0)):
        telemetry.chunk(Request(0, 0, 0), Chunk(0, actions, actions, {}, batch_size=size, batch_wait_ms=wait_ms),
                        0.0)
    values = dict(telemetry.pairs(0.02, False, "cpu"))
    assert values[Key.ENGINE_BATCH_SIZE] == 1 and values[Key.ENGINE_BATCH_SIZE_MAX] == 2
    assert values[Key.ms(Key.ENGINE_BATCH_WAIT, "max")] == 3.0
    assert Chunk(0, actions, actions, {}).batch_size == 1   # what a node's own engine answers


def test_a_transition_holds_the_teardown_and_logs_what_it_raises():
    """executor.transition: destroy_node (another thread) waits for a transition under way, and an
    exception, which rclpy turns into errorprocessing without a word, reaches the log with its traceback."""
    class Node:
        def __init__(self):
            self.teardown, self.errors = threading.RLock(), []

        def get_logger(self):
            return types.SimpleNamespace(error=self.errors.append)

        @transition
        def on_configure(self, state):
            elsewhere = []
            t = threading.Thread(target=lambda: elsewhere.append(self.teardown.acquire(blocking=False)))
            t.start()
            t.join()
            assert elsewhere == [False]
            raise RuntimeError("no engine")

    node = Node()
    with pytest.raises(RuntimeError):
        node.on_configure(None)
    assert node.errors[0].startswith("on_configure raised:") and "RuntimeError: no engine" in node.errors[0]
    assert node.teardown.acquire(blocking=False)
