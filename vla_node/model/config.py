"""Model dimensions and the checkpoint's robot/prompt settings. One dataclass per part, named
presets in one place (PRESETS). Imports without torch.

The official MolmoBot `config.yaml` maps onto these fields in `convert.py`; every value a
released checkpoint can change (dims, rope theta, ViT feature layers, prompt layout, attention
mode, frames and their spacing, flow steps, normalisation) lives here, never in the code.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

NORM_MODES = ("min_max", "quantiles", "quantile10", "mean_std")
ACTION_TYPES = ("absolute", "relative")


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 378
    patch_size: int = 14
    width: int = 1152
    heads: int = 16             # ViT heads; the 2x2 attention pooling uses the same heads
    mlp: int = 4304
    layers: int = 27            # layers in the checkpoint's ViT
    feature_layers: tuple[int, ...] = (24, 18)  # 0-based layer outputs, concatenated in this order
    norm_eps: float = 1e-6
    pool_window: int = 2

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

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
    vocab_size: int = 151936    # rows of the base embedding (Qwen3's, padded)
    extra_vocab: int = 128      # added rows after it: the image special tokens live there
    dim: int = 2560
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 9728
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096

    @property
    def embedding_rows(self) -> int:
        return self.vocab_size + self.extra_vocab


@dataclass(frozen=True)
class ActionExpertConfig:
    width: int = 768
    heads: int = 8
    mlp: int = 3072
    action_dim: int = 8
    state_dim: int = 8          # robot state values; zero-padded to `width` before the state encoder
    horizon: int = 16           # actions predicted per chunk
    max_horizon: int = 32       # rows of the learned action positions (the first `horizon` are used)
    flow_steps: int = 10
    time_embed_dim: int = 256   # sinusoidal features of t before the time MLP
    context_norm: bool = True   # LayerNorm (no affine) after the shared context projection


@dataclass(frozen=True)
class PromptConfig:
    """How the official preprocessor lays out a query (see sequence.py)."""
    max_images: int = 4                 # images of a full window: history windows are labelled from it
    single_frame: bool = False          # labels "Image k" (True) or "Image <frame> View <camera>" (False)
    bidirectional_images: bool = True   # image tokens attend to each other both ways ("image_tokens")
    chat_template: str = "<|im_start|>user\ndemo: {instruction}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class RobotConfig:
    """What the policy was trained on and how the official deployment post-processes its actions.
    The ROS node takes its parameter defaults from here."""
    frames: int = 2                     # frames per camera in a full window (n_obs_steps)
    obs_step_delta: int = 8             # control steps between consecutive frames of a window
    control_rate_hz: float = 15.0       # control rate of the training data
    executed_steps: int = 8             # actions of a chunk the official deployment executes
    action_norm: str = "quantiles"      # how actions were normalised to [-1, 1] (NORM_MODES)
    state_norm: str = "min_max"
    action_type: str = "absolute"       # "relative": the first `relative_dims` actions add the current state
    relative_dims: int = 0
    gripper_dims: tuple[int, ...] = ()  # action channels that command a gripper
    gripper_threshold: Optional[float] = None  # binarise those channels: > threshold -> high value, else low
    gripper_values: tuple[float, float] = (0.0, 1.0)   # (low, high) the binarised gripper takes
    max_joint_delta: tuple[float, ...] = ()  # per joint |target - current| per step; larger moves scale down

    def __post_init__(self):
        for name in ("action_norm", "state_norm"):
            if getattr(self, name) not in NORM_MODES:
                raise ValueError(f"{name} must be one of {NORM_MODES}, got {getattr(self, name)!r}")
        if self.action_type not in ACTION_TYPES:
            raise ValueError(f"action_type must be one of {ACTION_TYPES}, got {self.action_type!r}")
        if self.frames < 1 or self.obs_step_delta < 1 or self.control_rate_hz <= 0:
            raise ValueError("frames and obs_step_delta must be >= 1 and control_rate_hz > 0")

    @property
    def history_offset_s(self) -> float:
        """Time between consecutive frames of a window, as in training."""
        return self.obs_step_delta / self.control_rate_hz


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vision: VisionConfig = field(default_factory=VisionConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    action: ActionExpertConfig = field(default_factory=ActionExpertConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    robot: RobotConfig = field(default_factory=RobotConfig)
    projector_hidden: int = 9728  # SwiGLU hidden width of the vision -> LLM projector

    def __post_init__(self):
        v, a = self.vision, self.action
        if self.vision.layers_run > self.vision.layers:
            raise ValueError(f"feature layer {max(v.feature_layers)} >= ViT depth {v.layers}")
        if self.llm.heads % self.llm.kv_heads:
            raise ValueError(f"heads {self.llm.heads} not a multiple of kv_heads {self.llm.kv_heads}")
        if a.width % a.heads:
            raise ValueError(f"action width {a.width} not a multiple of heads {a.heads}")
        if v.width % v.heads:
            raise ValueError(f"vision width {v.width} not a multiple of heads {v.heads}")
        if a.state_dim > a.width:
            raise ValueError(f"state_dim {a.state_dim} exceeds the action expert width {a.width}")
        if a.horizon > a.max_horizon:
            raise ValueError(f"horizon {a.horizon} exceeds max_horizon {a.max_horizon}")
        r = self.robot
        if any(d >= a.action_dim for d in r.gripper_dims) or r.relative_dims > min(a.action_dim, a.state_dim):
            raise ValueError("gripper_dims / relative_dims outside the action")
        if r.max_joint_delta and len(r.max_joint_delta) > a.action_dim:
            raise ValueError("max_joint_delta has more values than the action has channels")

    @property
    def expert_depth(self) -> int:
        """One action-expert block per LLM layer (the official `per_layer` mode)."""
        return self.llm.layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        def part(kind, key):
            values = dict(d.get(key, {}))
            for f in dataclasses.fields(kind):  # JSON lists back to the tuples the dataclasses hold
                if isinstance(values.get(f.name), list):
                    values[f.name] = tuple(values[f.name])
            unknown = set(values) - {f.name for f in dataclasses.fields(kind)}
            if unknown:
                raise ValueError(f"config.json: unknown {key} setting(s) {sorted(unknown)}")
            return kind(**values)

        return cls(name=d["name"], vision=part(VisionConfig, "vision"), llm=part(LLMConfig, "llm"),
                   action=part(ActionExpertConfig, "action"), prompt=part(PromptConfig, "prompt"),
                   robot=part(RobotConfig, "robot"), projector_hidden=d.get("projector_hidden", 9728))


# Franka Panda (the DROID robot) joint limits (rad) and the gripper opening in [0, 1]: the node's
# default command limits, and the statistics of random-weight checkpoints whose action is 8-D.
FRANKA_LOW = (-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973, 0.0)
FRANKA_HIGH = (2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973, 1.0)

# The official MolmoBot-DROID deployment (molmo_spaces / real-robot configs): 8-D absolute joint
# positions + gripper on the 0-255 scale, binarised at 128, at most 0.2 rad per joint per step.
DROID_ROBOT = RobotConfig(frames=2, obs_step_delta=8, control_rate_hz=15.0, executed_steps=8,
                          action_norm="quantiles", state_norm="min_max", action_type="absolute",
                          gripper_dims=(7,), gripper_threshold=128.0, gripper_values=(0.0, 255.0),
                          max_joint_delta=(0.2,) * 7)

PRESETS: dict[str, ModelConfig] = {
    # MolmoBot-DROID: SigLIP2-so400m ViT -> Qwen3-4B -> 36-block DiT flow-matching expert.
    "molmobot-4b": ModelConfig(name="molmobot-4b", robot=DROID_ROBOT),
    # CI / CPU default: the dims of the official toy checkpoint in shared/golden (98 px / 14 = 7x7
    # patches, padded to 8x8 for 2x2 pooling -> 16 tokens per image; 320 + 128 vocabulary rows).
    "tiny": ModelConfig(
        name="tiny",
        vision=VisionConfig(image_size=98, patch_size=14, width=64, heads=4, mlp=128, layers=4, feature_layers=(2, 1)),
        llm=LLMConfig(vocab_size=320, extra_vocab=128, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128,
                      max_seq_len=1024),
        action=ActionExpertConfig(width=64, heads=4, mlp=128, time_embed_dim=32),
        robot=RobotConfig(action_norm="min_max"),
        projector_hidden=128,
    ),
    # The policy trained for the simulated ALOHA transfer-cube task (vla-train, vla-sim): two
    # 320x240 cameras stretched to 224 px (16x16 patches -> 64 tokens per image), frames 0.16 s
    # apart, 14 joints at 50 Hz, chunks of 32 actions; 7.6 M parameters (15 MB in bf16: one file a
    # GPU run can hand back, and within the 25 MB the repository ships).
    "sim": ModelConfig(
        name="sim",
        vision=VisionConfig(image_size=224, patch_size=14, width=128, heads=4, mlp=512, layers=6,
                            feature_layers=(5, 3)),
        llm=LLMConfig(vocab_size=320, extra_vocab=128, dim=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=512,
                      max_seq_len=1024),
        action=ActionExpertConfig(width=192, heads=4, mlp=768, action_dim=14, state_dim=14, horizon=32, max_horizon=32,
                                  time_embed_dim=64),
        robot=RobotConfig(frames=2, obs_step_delta=8, control_rate_hz=50.0, executed_steps=16, action_norm="min_max",
                          state_norm="min_max"),
        projector_hidden=512,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
