"""vla_node: real-time vision-language-action policies for ROS 2."""
__version__ = "0.1.0"
