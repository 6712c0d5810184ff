"""How to run the model fast (no ROS imports): the engine and its switchable speed features.

The configuration types import without torch (the ROS node validates parameters with them);
the engine itself, which needs torch, is imported on first use.
"""
import importlib

from .types import LAYOUTS, LOSSLESS_FEATURES, MODES, ActionChunk, EngineConfig, Observation, WindowLayout

_LAZY = {"PolicyEngine": ".engine", "EngineStats": ".engine"}

__all__ = ["EngineStats", "PolicyEngine", "LAYOUTS", "LOSSLESS_FEATURES", "MODES", "ActionChunk", "EngineConfig",
           "Observation", "WindowLayout"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
