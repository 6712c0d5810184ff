"""How many raw 640x480 rgb8 frames Fast DDS delivers between two processes on this machine.

    python scripts/dds_frames_check.py            # with vla_node's profile, then Fast DDS's defaults

Publishes 150 frames on each of two topics at 30 Hz (sensor-data QoS, as camera drivers do) from
one process to a subscriber in another, and prints what arrived.
"""
import os
import subprocess
import sys
import time

FRAMES, TOPICS, RATE_HZ = 150, ("/dds_check/a", "/dds_check/b"), 30.0


def publish() -> None:
    import numpy as np
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image
    rclpy.init()
    node = rclpy.create_node("dds_check_pub")
    pubs = [node.create_publisher(Image, t, qos_profile_sensor_data) for t in TOPICS]
    data = np.random.default_rng(0).integers(0, 255, 480 * 640 * 3, dtype=np.uint8).tobytes()
    deadline = time.monotonic() + 20
    while any(p.get_subscription_count() == 0 for p in pubs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(FRAMES):
        for p in pubs:
            msg = Image(height=480, width=640, encoding="rgb8", step=640 * 3)
            msg.data = data
            p.publish(msg)
        time.sleep(1 / RATE_HZ)
    time.sleep(1.0)
    node.destroy_node()
    rclpy.shutdown()


def subscribe() -> None:
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image
    rclpy.init()
    node = rclpy.create_node("dds_check_sub")
    got = {t: 0 for t in TOPICS}
    for t in TOPICS:
        node.create_subscription(Image, t, lambda m, t=t: got.__setitem__(t, got[t] + 1), qos_profile_sensor_data)
    deadline = time.monotonic() + FRAMES / RATE_HZ + 8
    while time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    print(" ".join(f"{t}: {n}/{FRAMES}" for t, n in got.items()), flush=True)
    node.destroy_node()
    rclpy.shutdown()


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from vla_node.tools.node_process import FRAME_TRANSPORT_PROFILE, ros_domain
    for label, profile in (("vla_node profile", str(FRAME_TRANSPORT_PROFILE)), ("Fast DDS defaults", None)):
        env = dict(os.environ, ROS_DOMAIN_ID=ros_domain())
        env.pop("FASTDDS_BUILTIN_TRANSPORTS", None)
        env.pop("FASTDDS_DEFAULT_PROFILES_FILE", None)
        if profile:
            env["FASTDDS_DEFAULT_PROFILES_FILE"] = profile
        sub = subprocess.Popen([sys.executable, __file__, "sub"], env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run([sys.executable, __file__, "pub"], env=env, check=True)
        print(f"{label:18s} {sub.communicate()[0].strip()}")


if __name__ == "__main__":
    {"pub": publish, "sub": subscribe}.get(sys.argv[1] if len(sys.argv) > 1 else "", main)()
