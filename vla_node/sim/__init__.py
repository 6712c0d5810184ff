"""The simulated task (no ROS, no torch here): gym-aloha's transfer-cube on MuJoCo (aloha), its
scripted expert (expert), demonstrations as bags (record), the closed loop without DDS
(closed_loop, eval) and the simulator as a ROS 2 node (node, which alone imports rclpy).
`vla-sim` (cli) is the command line."""
from pathlib import Path

# The policy trained for the task and shipped with the package (its README: how it was trained):
# what `vla-sim eval` and the demo run unless told otherwise.
SIM_POLICY = Path(__file__).resolve().parents[1] / "data" / "sim_policy"
