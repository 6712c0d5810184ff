"""The network (no ROS imports): vision tower, LLM, action expert, configs, weights."""
from .config import PRESETS, ActionExpertConfig, LLMConfig, ModelConfig, VisionConfig, get_preset
from .policy import VLAPolicy
from .sequence import Prompt, PromptBuilder, load_tokenizer
from .weights import (CheckpointError, build_model, create_random_checkpoint, init_random_, load_checkpoint,
                      load_weights_, save_checkpoint, TINY_TOKENIZER)

__all__ = ["PRESETS", "ActionExpertConfig", "LLMConfig", "ModelConfig", "VisionConfig", "get_preset", "VLAPolicy",
           "Prompt", "PromptBuilder", "load_tokenizer", "CheckpointError", "build_model", "create_random_checkpoint",
           "init_random_", "load_checkpoint", "load_weights_", "save_checkpoint", "TINY_TOKENIZER"]
