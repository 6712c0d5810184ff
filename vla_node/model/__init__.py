"""The network (no ROS imports): vision tower, LLM, action expert, configs, weights.

Configs import without torch; everything else is imported on first use.
"""
import importlib

from .config import (
    PRESETS,
    ActionExpertConfig,
    LLMConfig,
    ModelConfig,
    PromptConfig,
    RobotConfig,
    VisionConfig,
    get_preset,
)

_LAZY = {
    "VLAPolicy": ".policy", "Prompt": ".sequence", "PromptBuilder": ".sequence", "load_tokenizer": ".tokenizer",
    "CheckpointError": ".weights", "build_model": ".weights", "create_random_checkpoint": ".weights",
    "init_random_": ".weights", "load_checkpoint": ".weights", "load_weights_": ".weights",
    "save_checkpoint": ".weights", "TINY_TOKENIZER": ".weights", "resolve_checkpoint": ".convert",
}

__all__ = ["PRESETS", "ActionExpertConfig", "LLMConfig", "ModelConfig", "PromptConfig", "RobotConfig", "VisionConfig",
           "get_preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
