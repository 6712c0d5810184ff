"""The ROS 2 layer: the vla_node lifecycle node and what it is made of (parameters, message
conversion, frame windows, the engine process, chunk execution, safety, diagnostics).

Only the engine process imports the runtime (and torch); the node process stays light so its
control loop keeps time."""
from pathlib import Path

# Fast DDS transports that carry raw camera frames between processes (its defaults drop most).
FRAME_TRANSPORT_PROFILE = Path(__file__).resolve().parents[1] / "data" / "fastdds_large_frames.xml"
