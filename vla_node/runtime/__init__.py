"""How to run the model fast (no ROS imports): the engine and its switchable speed features."""
from .engine import EngineStats, PolicyEngine
from .types import LAYOUTS, LOSSLESS_FEATURES, MODES, ActionChunk, EngineConfig, Observation, WindowLayout

__all__ = ["EngineStats", "PolicyEngine", "LAYOUTS", "LOSSLESS_FEATURES", "MODES", "ActionChunk", "EngineConfig",
           "Observation", "WindowLayout"]
