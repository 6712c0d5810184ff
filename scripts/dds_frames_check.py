"""How 640x480 camera frames cross Fast DDS between two processes on this machine: raw rgb8
frames (how many arrive, with vla_node's transport profile and with Fast DDS's defaults), and
with --compressed the JPEG frames a robot without a GPU would send to a node on the GPU host (the
JPEG size, the publisher's encode time, the latency from the frame's stamp to the subscriber
holding it decoded by the node's own decoder, and the decode time).

    python scripts/dds_frames_check.py                       # raw frames, both profiles
    python scripts/dds_frames_check.py --compressed [--quality 85]

Publishes 150 frames on each of two topics at 30 Hz (15 Hz with --compressed, DROID's rate;
sensor-data QoS, as camera drivers do) from one process to a subscriber in another. The
compressed frames are the sample bag's rendered scene with camera-like noise (sigma 3), so that
they compress like a camera's rather than like flat colour. One machine: loopback, no network.
"""
import argparse
import os
import subprocess
import sys
import time

FRAMES, TOPICS = 150, ("/dds_check/a", "/dds_check/b")


def frames(compressed: bool, quality: int):
    """What each topic publishes, in order: raw bytes, or (JPEG bytes, encode ms)."""
    import numpy as np
    if not compressed:
        data = np.random.default_rng(0).integers(0, 255, 480 * 640 * 3, dtype=np.uint8).tobytes()
        return [data] * FRAMES
    import cv2

    from vla_node.tools.sample_scene import render_exo
    rng = np.random.default_rng(0)
    out = []
    for i in range(FRAMES):
        rgb = np.clip(render_exo(i / 15.0).astype(np.float32) + rng.normal(0, 3, (480, 640, 3)), 0, 255)
        bgr = cv2.cvtColor(rgb.astype(np.uint8), cv2.COLOR_RGB2BGR)
        t = time.perf_counter()
        ok, jpeg = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        out.append((jpeg.tobytes(), 1e3 * (time.perf_counter() - t)))
    return out


def publish(compressed: bool, quality: int) -> None:
    import numpy as np
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage, Image
    payloads = frames(compressed, quality)
    rclpy.init()
    node = rclpy.create_node("dds_check_pub")
    pubs = [node.create_publisher(CompressedImage if compressed else Image, t, qos_profile_sensor_data) for t in TOPICS]
    deadline = time.monotonic() + 20
    while any(p.get_subscription_count() == 0 for p in pubs) and time.monotonic() < deadline:
        time.sleep(0.05)
    period = 1 / (15.0 if compressed else 30.0)
    for payload in payloads:
        for p in pubs:
            if compressed:
                msg = CompressedImage(format="rgb8; jpeg compressed bgr8")
                msg.data = payload[0]
            else:
                msg = Image(height=480, width=640, encoding="rgb8", step=640 * 3)
                msg.data = payload
            now = time.time_ns()
            msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 10**9)
            p.publish(msg)
        time.sleep(period)
    if compressed:
        sizes = np.array([len(j) for j, _ in payloads]) / 1024
        encode = np.array([ms for _, ms in payloads])
        print(f"jpeg q{quality}: {np.median(sizes):.1f} KiB a frame, encode {np.median(encode):.2f} ms p50 "
              f"{np.percentile(encode, 99):.2f} p99", flush=True)
    time.sleep(1.0)
    node.destroy_node()
    rclpy.shutdown()


def subscribe(compressed: bool) -> None:
    import numpy as np
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import CompressedImage, Image

    from vla_node.runtime import images
    rclpy.init()
    node = rclpy.create_node("dds_check_sub")
    got = {t: 0 for t in TOPICS}
    latency, decode = [], []

    def on_frame(msg, topic):
        got[topic] += 1
        t = time.perf_counter()
        images.decode(msg)   # the node's own conversion to HxWx3 RGB
        decode.append(1e3 * (time.perf_counter() - t))
        latency.append((time.time_ns() - (msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec)) / 1e6)
    for t in TOPICS:
        node.create_subscription(CompressedImage if compressed else Image, t, lambda m, t=t: on_frame(m, t),
                                 qos_profile_sensor_data)
    deadline = time.monotonic() + FRAMES / (15.0 if compressed else 30.0) + 8
    while time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    line = " ".join(f"{t}: {n}/{FRAMES}" for t, n in got.items())
    if latency:
        line += (f"; stamp to decoded {np.median(latency):.2f} ms p50 {np.percentile(latency, 99):.2f} p99, "
                 f"decode {np.median(decode):.2f} ms p50")
    print(line, flush=True)
    node.destroy_node()
    rclpy.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="", choices=("", "pub", "sub"), help=argparse.SUPPRESS)
    ap.add_argument("--compressed", action="store_true")
    ap.add_argument("--quality", type=int, default=85)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    if args.role == "pub":
        return publish(args.compressed, args.quality)
    if args.role == "sub":
        return subscribe(args.compressed)
    from vla_node.tools.node_process import FRAME_TRANSPORT_PROFILE, ros_domain
    mode = ["--compressed", "--quality", str(args.quality)] if args.compressed else []
    for label, profile in (("vla_node profile", str(FRAME_TRANSPORT_PROFILE)), ("Fast DDS defaults", None)):
        env = dict(os.environ, ROS_DOMAIN_ID=ros_domain())
        env.pop("FASTDDS_BUILTIN_TRANSPORTS", None)
        env.pop("FASTDDS_DEFAULT_PROFILES_FILE", None)
        if profile:
            env["FASTDDS_DEFAULT_PROFILES_FILE"] = profile
        sub = subprocess.Popen([sys.executable, __file__, "sub", *mode], env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        pub = subprocess.run([sys.executable, __file__, "pub", *mode], env=env, check=True, stdout=subprocess.PIPE,
                             text=True)
        encoded = f"\n{'':18s} {pub.stdout.strip()}" if pub.stdout else ""
        print(f"{label:18s} {sub.communicate()[0].strip()}{encoded}")


if __name__ == "__main__":
    main()
