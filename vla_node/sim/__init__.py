"""The simulated task (no ROS, no torch here): gym-aloha's transfer-cube on MuJoCo (aloha), its
scripted expert (expert), demonstrations as bags (record), the closed loop without DDS
(closed_loop, eval) and the simulator as a ROS 2 node (node, which alone imports rclpy).
`vla-sim` (cli) is the command line."""
