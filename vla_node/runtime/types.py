"""The engine's public data types: what goes in, what comes out, how it is configured."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Hashable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from ..model.config import get_preset
from .action_cache import is_adaptive


@dataclass(frozen=True)
class WindowLayout:
    """Which images make up one query. Slot order is time-major: the oldest frame of every
    camera first, the newest frame last; cameras in the order given."""
    cameras: tuple[str, ...] = ("exo", "wrist")
    frames: int = 2     # frames per camera: the current one and frames - 1 history frames
    stride: int = 8     # camera frames between consecutive history frames (t - k * stride)

    def __post_init__(self):
        if not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"cameras must be non-empty and unique, got {self.cameras}")
        if self.frames < 1 or self.stride < 1:
            raise ValueError(f"frames and stride must be >= 1, got frames={self.frames} stride={self.stride}")

    @property
    def images(self) -> int:
        return len(self.cameras) * self.frames

    def with_frames(self, frames: int) -> "WindowLayout":
        """The same cameras with fewer frame times: a window whose history does not exist yet."""
        return dataclasses.replace(self, frames=frames)


# Camera names of a checkpoint's window when the engine derives it: MolmoBot-DROID's two cameras.
DEFAULT_CAMERAS = {1: ("camera",), 2: ("exo", "wrist")}

LAYOUTS = {
    # MolmoBot-DROID: exterior + wrist camera, frames t-8 and t.
    "droid": WindowLayout(("exo", "wrist"), frames=2, stride=8),
    # The 8-image reference query (~1630 tokens with the 4B model).
    "8img": WindowLayout(("exo", "wrist"), frames=4, stride=8),
}


@dataclass
class Observation:
    # Frames in slot order, each HxWx3 uint8 RGB: layout.images of them, or at an episode's start
    # (history not there yet) cameras * k for the k newest frame times, 1 <= k < layout.frames.
    images: Sequence[np.ndarray]
    state: np.ndarray                     # [state_dim] raw robot state (joint positions, gripper)
    instruction: str
    stamp: float = 0.0                    # seconds; time of the newest frame
    # Identity of each image, e.g. (camera, stamp_ns): frames with the same id are the same
    # picture, which lets the vision cache and streaming reuse work. None: every image is new.
    # Ids must not repeat for different pictures: call engine.reset_stream() when the time
    # source restarts or jumps back (a replayed bag, a reset simulation; the node does this).
    frame_ids: Optional[Sequence[Hashable]] = None
    # [k, action_dim] raw (robot units), 1 <= k <= horizon: the chunk's first k actions, fixed in
    # advance (the inpaint hand-over: what the robot runs while this chunk is inferred). The
    # engine normalises them and pads them to the horizon with a mask, so k is data, never a shape.
    # None: nothing known, the chunk is sampled freely.
    known_actions: Optional[np.ndarray] = None


@dataclass
class ActionChunk:
    actions: np.ndarray                   # [horizon, action_dim] un-normalised, float32
    normalized: np.ndarray                # [horizon, action_dim] the model's output in [-1, 1] units
    stamp: float                          # the observation's stamp
    timings: dict[str, float] = field(default_factory=dict)  # ms per stage and "total"


@runtime_checkable
class Policy(Protocol):
    """What runs observations: PolicyEngine in this process, ros.engine_process.EngineProcess in
    its own (the node's), and whatever wraps either (the simulator's latency model)."""
    history_offset_s: float   # between the frame times of a window (the checkpoint's)

    def predict(self, obs: Observation) -> ActionChunk: ...
    def reset_stream(self) -> None: ...


def history_offset(parameter_s: float, checkpoint_s: float) -> float:
    """Seconds between a window's frame times: the history_offset_s parameter, or else (0: unset)
    the checkpoint's (its training data's). The node, the simulator and offline replay ask here."""
    return parameter_s or checkpoint_s


# Engine options that may change while the engine runs: PolicyEngine.reconfigure applies them,
# the node sends them on a parameter change (ros/params.py SPECS: not read_only).
RUNTIME_OPTIONS = ("action_cache",)

# The batch sizes a static engine keeps buffers (and CUDA graphs) for, up to EngineConfig.max_batch:
# a batch of n observations runs in the smallest one >= n, its padding rows repeating a real entry.
BATCH_SIZES = (1, 2, 4, 8)


# Engine features, cumulative in this order for the benchmark's ladder of modes. Each one is
# lossless by construction or proven equivalent by a test (see runtime/README in DESIGN.md).
LOSSLESS_FEATURES = ("static_shapes", "ctx_kv_once", "fused", "gelu_epilogue", "gpu_preprocess", "compile",
                     "unpadded_gemms", "aligned_patch_embedding", "flex_attention", "window_attention_ops",
                     "cuda_graphs", "workspace_free_gemms", "memset_kernels", "tile_tiers",
                     "tuned_gemms", "triton_attention", "triton_layer_norm", "add_norm_kernel", "pattern_kernel",
                     "rotary_kernel", "fused_expert", "vision_cache")
# Each mode of the ladder: the features the one before it has, plus these.
_LADDER = {
    "eager": (),
    "static": ("static_shapes",),
    "ctxkv": ("ctx_kv_once",),
    "fused": ("fused", "gelu_epilogue", "gpu_preprocess"),
    "compile": ("compile", "unpadded_gemms", "aligned_patch_embedding", "flex_attention", "pattern_kernel",
                "window_attention_ops"),
    "graphs": ("cuda_graphs", "workspace_free_gemms", "memset_kernels", "tile_tiers", "tuned_gemms"),
    "triton": ("triton_attention", "triton_layer_norm", "add_norm_kernel", "rotary_kernel"),
    "fast": ("fused_expert", "vision_cache"),
}
MODES: dict[str, tuple[str, ...]] = {}
for _mode, _adds in _LADDER.items():
    MODES[_mode] = (*(MODES[list(MODES)[-1]] if MODES else ()), *_adds)
# Rungs a CPU engine skips.
GPU_FEATURES = ("unpadded_gemms", "aligned_patch_embedding", "flex_attention", "window_attention_ops", "cuda_graphs",
                "workspace_free_gemms", "memset_kernels", "tile_tiers", "tuned_gemms",
                "triton_attention", "triton_layer_norm", "add_norm_kernel", "pattern_kernel", "rotary_kernel",
                "fused_expert")
# fused_expert joins the ladder at `fast`: on the H200 its persistent flow-loop kernel took the DROID
# action stage from 19.7 to 17.4 ms in one vla-bench run (BENCHMARKS.md); `triton` keeps the compiled
# blocks with the few-query attention kernel.


def _modes_with(*features: str) -> str:
    """The rungs of the ladder that have `features`: the last ones, since each adds to the one before."""
    modes = [m for m, has in MODES.items() if set(features) <= set(has)]
    return modes[0] if len(modes) == 1 else f"{modes[0]} or later"


@dataclass(frozen=True)
class EngineConfig:
    preset: str = "tiny"
    # Folder with config.json + model.safetensors + tokenizer; None: random weights.
    checkpoint: Optional[str] = None
    seed: int = 0                         # random weights (when no checkpoint) and the noise stream
    device: str = "cpu"
    dtype: str = "float32"                # float32 | bfloat16
    layout: Optional[WindowLayout] = None  # None: the checkpoint's own (its frames and obs_step_delta)
    extra_layouts: tuple[WindowLayout, ...] = ()  # further layouts a query may use (each a static bucket)
    camera_height: int = 480
    camera_width: int = 640
    flow_steps: Optional[int] = None      # None: the model's default
    # Token budget of the chat turn holding the instruction: the longest it may be (static shapes pad
    # to the smallest of it and instruction_tiers that holds it).
    max_instruction_tokens: int = 96
    # Shorter budgets, each a bucket of its own (static shapes; warmed up and captured with the rest):
    # a query runs in the smallest that holds its instructions, so a short instruction does not carry
    # the longest one's padding through every LLM layer and the expert's cross-attention. At or above
    # max_instruction_tokens a tier adds nothing. DROID `fast` on an H100: 27.9 -> 27.2 ms with a
    # 48-token bucket for a 40-token chat turn (BENCHMARKS.md, thirty-third session).
    instruction_tiers: tuple[int, ...] = (48,)
    # Lossless features (LOSSLESS_FEATURES), off = the eager reference.
    static_shapes: bool = False
    ctx_kv_once: bool = False
    fused: bool = False
    gelu_epilogue: bool = False           # the ViT's fc1 + GELU as one GEMM (runtime/fusion.linear_gelu_epilogue)
    gpu_preprocess: bool = False
    compile: bool = False
    # The compiled blocks' GEMMs at their own row counts: inductor's pad_mm pass off. Its compile-time
    # benchmark leaves out the copy that pads an input made by an op it cannot write into (our
    # kernels, cuDNN's attention), so it padded the ViT's 2916 rows to 2920 with a copy before each
    # of a block's four GEMMs (19 us a block at DROID on the H200): the DROID vision stage 6.06-6.13 ->
    # 5.60 ms on an H100 (BENCHMARKS.md, thirty-fifth session).
    unpadded_gemms: bool = False
    # The ViT's patch embedding with its K (588) zero-padded to a multiple of 8, the padding made in the
    # compiled copy that lays the patches out (runtime/fusion.AlignedPatchEmbedding): on an H100 the GEMM
    # 30.3 -> 10.9 us and the layout copy 11.8 -> 4.5 at DROID; a query within its runs' spread.
    aligned_patch_embedding: bool = False
    # The prefill's embeddings in one pass that reads the image tokens from the frame store
    # (runtime/fusion.embed_from_store; compiled with `compile`), not the model's embedding, the store's
    # read and index_add (28.6 us at DROID on an H100). Not yet timed on the GPU: off the ladder.
    one_pass_embedding: bool = False
    # A query's small input copies (frame rows, states, noise, instructions) on a CUDA stream of their
    # own, beside the vision stage: in stream order they were five copies between the vision and the
    # prefill graphs, 19 us of device time at DROID on an H100 (BENCHMARKS.md, forty-sixth session's
    # profile). Not yet timed on the GPU: off the ladder.
    input_stream: bool = False
    cuda_graphs: bool = False
    # cuBLAS's GEMMs without a workspace: no memset nodes in the captured graphs, each of which left
    # the GPU idle ~6 us (runtime/graphs.use_gemms_without_workspace; the process's first GEMM fixes it).
    workspace_free_gemms: bool = False
    # The captured graphs' memset nodes (cuDNN's ViT attention resets its workspace before each call)
    # as kernel nodes writing the same bytes (runtime/graph_memsets): the ViT's attention layers 1.4 us
    # faster each at DROID on an H100, a DROID query within its runs' spread (BENCHMARKS.md, forty-sixth
    # session).
    memset_kernels: bool = False
    # Each instruction tier below the longest trimmed by up to a few tokens so that its bucket is a
    # multiple of runtime/static.ROW_TILE tokens, where cuBLAS runs faster GEMMs for the LLM.
    tile_tiers: bool = False
    # The ViT's and the LLM's GEMMs at the cuBLASLt algorithm each shape runs fastest, timed at warm-up
    # against torch's (runtime/lt_gemm); off the GPU, or where none is faster, torch's GEMM. On an H100
    # DROID `fast` 26.37 -> 26.30, 26.38 -> 26.13 ms, 8 images 45.63 -> 45.23, 45.45 -> 45.09 (the ViT's
    # fc2 at 5832 rows 94.6 -> 81.0 us; BENCHMARKS.md, thirty-seventh session).
    tuned_gemms: bool = False
    flex_attention: bool = False          # LLM prefill attention through flex attention with a block mask (compiled)
    # The vision pool's one-query window attention as plain ops a compiled region fuses
    # (runtime/fusion.window_attention_ops), not SDPA: the DROID vision stage 5.77 -> 5.55 ms on the H200.
    window_attention_ops: bool = False
    # The prefill's pattern in one Triton flash-attention kernel that reads no mask and walks only the
    # key tiles the pattern shows each query tile (runtime/kernels/pattern_attention), for the full
    # prefill and the streaming step (instead of flex). On an H100 one layer's attention 43.7 us at
    # DROID against 79.9 for the compiled split it replaced (two causal cuDNN calls merged by their
    # log-sum-exps, removed since), 145.3 against 178.6 at 8 images; the DROID LLM stage 14.20 ->
    # 13.07 ms, the 8-image one 26.75 -> 26.16 (BENCHMARKS.md, twenty-second session).
    pattern_kernel: bool = False
    # The LLM attention's q/k norms, RoPE and head layout in one pass (runtime/kernels/rotary_heads):
    # the DROID LLM stage 14.15 -> 13.73 ms on the H200.
    rotary_kernel: bool = False
    # q's norm and RoPE in the pattern kernel as it loads each query tile (once a program), k's alone in
    # the rotary pass, v read where the projection wrote it (kernels/rotary_heads.use_q_rope_in_attention):
    # the rotary pass moved ~22 MB a layer at DROID (8.9 us on an H100), k's share is a sixth of it. Not
    # yet timed on the GPU: off the ladder.
    q_rope_in_attention: bool = False
    triton_attention: bool = False        # action-expert attention through runtime/kernels/few_query_attention
    triton_layer_norm: bool = False       # the ViT's and the context's LayerNorms in one pass (kernels/layer_norm)
    # The ViT blocks' residual adds and the LayerNorms after them in one pass each
    # (kernels/layer_norm.add_norm_one_pass): the DROID vision stage 5.77 -> 5.55 ms on the H200.
    add_norm_kernel: bool = False
    fused_expert: bool = False            # the whole flow loop in one persistent kernel (runtime/fused_expert)
    # Which kernel runs the fused loop: triton (kernels/expert_flow.py), cuda (kernels/expert_flow.cu,
    # compiled at start by NVRTC; bf16 or expert_fp8's e4m3 weights; runtime/fused_expert_cuda.py) or auto
    # (cuda on a Hopper GPU where it takes the expert, else triton).
    expert_kernel: str = "auto"
    vision_cache: bool = False
    vision_cache_frames: int = 64         # frames kept by the vision cache
    # Opt-in options that change the numbers (each reported with its deviation).
    streaming_kv: bool = False            # reuse surviving frames' LLM KV across sliding windows
    action_cache: str = ""                # flow-step velocity reuse schedule (runtime/action_cache.py)
    fp8: str = "off"                      # off | rowwise | tensorwise: e4m3 LLM linears
    expert_fp8: bool = False              # e4m3 action-expert weights (per output channel) in the fused expert
    # Observations one query may hold (PolicyEngine.predict_batch; the engine server's --max-batch):
    # one of BATCH_SIZES. A static engine keeps buffers and graphs for every batch size up to it.
    max_batch: int = 1

    def __post_init__(self):
        get_preset(self.preset)     # a known name (its weights are used when there is no checkpoint)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.flow_steps is not None and self.flow_steps < 1:
            raise ValueError(f"flow_steps must be >= 1, got {self.flow_steps}")
        if self.max_instruction_tokens < 1:
            raise ValueError("max_instruction_tokens must be >= 1")
        object.__setattr__(self, "instruction_tiers", tuple(self.instruction_tiers))  # lists from YAML or ROS
        if any(not isinstance(t, int) or t < 1 for t in self.instruction_tiers):
            raise ValueError(f"instruction_tiers must be token counts >= 1, got {list(self.instruction_tiers)}")
        if self.max_batch not in BATCH_SIZES:
            raise ValueError(f"max_batch must be one of {BATCH_SIZES}, got {self.max_batch}")
        if self.streaming_kv and not (self.vision_cache and self.ctx_kv_once):
            raise ValueError(f"streaming_kv needs vision_cache and ctx_kv_once (only new frames are encoded and "
                             f"prefilled): engine_mode {_modes_with('vision_cache', 'ctx_kv_once')}")
        if self.fp8 not in ("off", "rowwise", "tensorwise"):
            raise ValueError(f"fp8 must be off, rowwise or tensorwise, got {self.fp8!r}")
        for feature in ("cuda_graphs", "compile", "vision_cache", "flex_attention"):
            if getattr(self, feature) and not self.static_shapes:
                raise ValueError(f"{feature} needs static_shapes")
        if is_adaptive(self.action_cache) and not self.static_shapes:
            raise ValueError(f"the adaptive action cache needs static_shapes (its per-step buffers): engine_mode "
                             f"{_modes_with('static_shapes')}")
        if self.one_pass_embedding and not self.static_shapes:
            raise ValueError("one_pass_embedding needs static_shapes (it reads the frame store of the static buckets)")
        if self.q_rope_in_attention and not self.pattern_kernel:
            raise ValueError("q_rope_in_attention needs pattern_kernel (the kernel that norms and rotates q)")
        if self.q_rope_in_attention and self.streaming_kv:
            raise ValueError("q_rope_in_attention is the full prefill's pattern kernel only: not with streaming_kv")
        if self.input_stream and not self.static_shapes:
            raise ValueError("input_stream needs static_shapes (it stages the static buckets' inputs)")
        if self.memset_kernels and not self.cuda_graphs:
            raise ValueError("memset_kernels needs cuda_graphs (it edits the captured graphs)")
        if self.unpadded_gemms and not self.compile:
            raise ValueError("unpadded_gemms needs compile (it sets how the blocks are compiled)")
        if self.flex_attention and not self.compile:
            raise ValueError("flex_attention needs compile (uncompiled flex attention is a slow reference)")
        if self.pattern_kernel and not self.flex_attention:
            raise ValueError("pattern_kernel needs flex_attention (its device image flags and the layers' dispatch, "
                             "runtime/kernels/prefill_attention.flex_attend)")
        cams = {l.cameras for l in self.layouts}
        if len(cams) > 1:
            raise ValueError(f"all layouts must use the same cameras, got {sorted(cams)}")
        for feature in ("cuda_graphs", "workspace_free_gemms", "memset_kernels", "input_stream"):
            if getattr(self, feature) and not self.device.startswith("cuda"):
                raise ValueError(f"{feature} needs a CUDA device")
        for feature in ("triton_attention", "rotary_kernel", "fused_expert", "pattern_kernel", "q_rope_in_attention"):
            interpreted = os.environ.get("TRITON_INTERPRET") == "1"
            if getattr(self, feature) and not (self.device.startswith("cuda") or interpreted):
                raise ValueError(f"{feature} needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
        if self.fused_expert and not self.ctx_kv_once:
            raise ValueError("fused_expert needs ctx_kv_once (it takes the expert's context K/V once per query)")
        if self.expert_fp8 and not self.fused_expert:
            raise ValueError("expert_fp8 needs fused_expert (its kernels read the e4m3 weights)")
        if self.expert_kernel not in ("auto", "triton", "cuda"):
            raise ValueError(f"expert_kernel must be auto, triton or cuda, got {self.expert_kernel!r}")

    @classmethod
    def for_mode(cls, mode: str, **overrides) -> "EngineConfig":
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {list(MODES)}")
        flags = {f: f in MODES[mode] for f in LOSSLESS_FEATURES}
        if not str(overrides.get("device", "cpu")).startswith("cuda"):  # GPU-only rungs of the ladder
            flags.update(dict.fromkeys(GPU_FEATURES, False))
        flags.update(overrides)
        return cls(**flags)

    @property
    def layouts(self) -> tuple[WindowLayout, ...]:
        base = (self.layout,) if self.layout is not None else ()
        return base + tuple(l for l in self.extra_layouts if l != self.layout)

    @property
    def query_layouts(self) -> tuple[WindowLayout, ...]:
        """Every layout a query may have: the configured ones and, for an episode's start, each
        with fewer frame times (the official wrapper drops history that does not exist yet)."""
        out: list[WindowLayout] = []
        for layout in self.layouts:
            for frames in range(layout.frames, 0, -1):
                if layout.with_frames(frames) not in out:
                    out.append(layout.with_frames(frames))
        return tuple(out)

    @property
    def instruction_budgets(self) -> tuple[int, ...]:
        """The instruction token budgets a static engine keeps buckets for, shortest first: the tiers
        below max_instruction_tokens, then it."""
        tiers = {t for t in self.instruction_tiers if t < self.max_instruction_tokens}
        return (*sorted(tiers), self.max_instruction_tokens)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
