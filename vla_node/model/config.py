"""Model dimensions. One dataclass per part, named presets in one place (PRESETS)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 378
    patch_size: int = 14
    width: int = 1152
    heads: int = 16
    mlp: int = 4304
    layers: int = 27            # layers in the checkpoint's ViT
    feature_layers: tuple[int, ...] = (24, 18)  # 0-based layer outputs, concatenated in this order
    norm_eps: float = 1e-6
    pool_heads: int = 16        # attention pooling over 2x2 windows
    pool_window: int = 2

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def layers_run(self) -> int:
        """Only the layers up to the deepest feature layer are computed."""
        return max(self.feature_layers) + 1

    @property
    def feature_dim(self) -> int:
        return self.width * len(self.feature_layers)

    @property
    def pooled_grid(self) -> int:
        return -(-self.grid // self.pool_window)  # the grid is padded up to a multiple of the window

    @property
    def tokens_per_image(self) -> int:
        return self.pooled_grid ** 2


@dataclass(frozen=True)
class LLMConfig:
    vocab_size: int = 151936
    dim: int = 2560
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 9728
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096


@dataclass(frozen=True)
class ActionExpertConfig:
    width: int = 768
    heads: int = 8
    mlp: int = 3072
    action_dim: int = 8
    state_dim: int = 8
    horizon: int = 16
    flow_steps: int = 10
    time_embed_dim: int = 256   # sinusoidal features before the time MLP
    norm_eps: float = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vision: VisionConfig = field(default_factory=VisionConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    action: ActionExpertConfig = field(default_factory=ActionExpertConfig)
    projector_hidden: int = 9728  # SwiGLU hidden width of the vision -> LLM projector

    def __post_init__(self):
        if self.vision.layers_run > self.vision.layers:
            raise ValueError(f"feature layer {max(self.vision.feature_layers)} >= ViT depth {self.vision.layers}")
        if self.llm.heads % self.llm.kv_heads:
            raise ValueError(f"heads {self.llm.heads} not a multiple of kv_heads {self.llm.kv_heads}")
        if self.action.width % self.action.heads:
            raise ValueError(f"action width {self.action.width} not a multiple of heads {self.action.heads}")
        if self.vision.width % self.vision.heads or self.vision.width % self.vision.pool_heads:
            raise ValueError("vision width must be a multiple of heads and pool_heads")

    @property
    def expert_depth(self) -> int:
        """One action-expert block per LLM layer."""
        return self.llm.layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        vision = dict(d.get("vision", {}))
        if "feature_layers" in vision:
            vision["feature_layers"] = tuple(vision["feature_layers"])
        return cls(
            name=d["name"],
            vision=VisionConfig(**vision),
            llm=LLMConfig(**d.get("llm", {})),
            action=ActionExpertConfig(**d.get("action", {})),
            projector_hidden=d.get("projector_hidden", 9728),
        )


PRESETS: dict[str, ModelConfig] = {
    # MolmoBot-DROID: SigLIP2-so400m ViT -> Qwen3-4B -> 36-block DiT flow-matching expert.
    "molmobot-4b": ModelConfig(name="molmobot-4b"),
    # CI / CPU default: the same structure at widths a 2-core machine runs at >= 10 Hz.
    # 98 px / 14 = 7x7 patches, padded to 8x8 for 2x2 pooling -> 16 tokens per image.
    "tiny": ModelConfig(
        name="tiny",
        vision=VisionConfig(image_size=98, patch_size=14, width=64, heads=4, mlp=128, layers=4,
                            feature_layers=(2, 1), pool_heads=4),
        llm=LLMConfig(vocab_size=512, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128,
                      rope_theta=10_000.0, max_seq_len=1024),
        action=ActionExpertConfig(width=64, heads=4, mlp=128, time_embed_dim=32),
        projector_hidden=128,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
