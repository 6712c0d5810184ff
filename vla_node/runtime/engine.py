"""PolicyEngine: one API for the node, the benchmark, the replay evaluator and the tests.

    engine = PolicyEngine(config)        # load weights + tokenizer, build buffers on the device
    engine.warmup()                      # compile / capture once, with progress output
    chunk = engine.predict(observation)  # -> ActionChunk(actions[H, A], stamp, timings)
    chunks = engine.predict_batch([a, b], generators=[ga, gb])   # one query for several robots

With every feature off this is the eager reference: plain module calls, dynamic shapes, the
action expert's context recomputed at every flow step. Every fast path is compared to it.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..model import (
    TINY_TOKENIZER,
    PromptBuilder,
    build_model,
    get_preset,
    init_random_,
    load_checkpoint,
    load_tokenizer,
    resolve_checkpoint,
)
from ..model.action_expert import KnownActions, euler, flow_times
from ..model.layers import rope_tables
from ..model.policy import denormalize
from .action_cache import FlowSchedule, is_adaptive
from .fp8 import quantize_llm_
from .fusion import fuse_projections, use_aligned_patch_embedding, use_gelu_epilogues, use_window_attention_ops
from .images import check_frames
from .parts import EngineParts, Progress, require_finite
from .preprocess import preprocess_reference
from .timing import StageTimer
from .types import DEFAULT_CAMERAS, RUNTIME_OPTIONS, ActionChunk, EngineConfig, Observation, WindowLayout


@dataclass
class EngineStats:
    ready_s: float = 0.0          # warm-up wall time (compile + capture)
    compiled_graphs: int = 0      # dynamo graphs compiled during warm-up
    recompiles: int = 0           # dynamo graphs compiled after warm-up (should stay 0)
    graph_captures: int = 0
    queries: int = 0
    fp8_weight_bytes: int = 0


class PolicyEngine:
    def __init__(self, config: EngineConfig, progress: Optional[Progress] = None):
        self.config = config
        self.progress = progress or (lambda msg: None)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {config.device} requested but CUDA is not available")
        self.dtype = getattr(torch, config.dtype)
        if config.workspace_free_gemms:   # before any GEMM of this process, or it does nothing
            from .graphs import use_gemms_without_workspace
            use_gemms_without_workspace()
        t0 = time.perf_counter()
        if config.checkpoint:
            folder = resolve_checkpoint(config.checkpoint, self.progress)  # official folders: converted once
            self.model = load_checkpoint(folder, self.device, self.dtype)
            tokenizer_dir = folder
        else:
            cfg = get_preset(config.preset)
            # Random weights were trained on nothing: let the prompt label windows of any size.
            max_images = max([cfg.prompt.max_images] + [l.images for l in config.layouts])
            cfg = dataclasses.replace(cfg, prompt=dataclasses.replace(cfg.prompt, max_images=max_images))
            self.model = init_random_(build_model(cfg, self.device, self.dtype), config.seed)
            tokenizer_dir = TINY_TOKENIZER
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.model_cfg = self.model.cfg
        # Chunks are denormalised on the host: one copy from the device instead of two copies and
        # five one-block kernels, each launched by the host after the last (the same fp32 ops).
        self.action_stats = self.model.action_stats.float().cpu()
        if self.model_cfg.llm.embedding_rows < len(self.tokenizer):
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens, the model's embedding "
                             f"{self.model_cfg.llm.embedding_rows} rows")
        self.prompts = PromptBuilder(self.tokenizer, self.model_cfg)
        if config.layout is None:  # the checkpoint's own window: its frames and their spacing
            cams = self.model_cfg.prompt.max_images // self.model_cfg.robot.frames
            self.config = config = config.replace(layout=WindowLayout(
                DEFAULT_CAMERAS.get(cams, tuple(f"camera{i}" for i in range(cams))), self.model_cfg.robot.frames,
                self.model_cfg.robot.obs_step_delta))
        self.flow_steps = config.flow_steps or self.model_cfg.action.flow_steps
        self.schedule = FlowSchedule.parse(config.action_cache, self.flow_steps)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.stats = EngineStats()
        if config.fused:
            fuse_projections(self.model)
        if config.gelu_epilogue:
            use_gelu_epilogues(self.model)
        if config.window_attention_ops:
            use_window_attention_ops(self.model)
        if config.aligned_patch_embedding:
            use_aligned_patch_embedding(self.model, compiled=config.compile)
        if config.fp8 != "off":
            self.stats.fp8_weight_bytes = quantize_llm_(self.model, config.fp8)
        if config.tuned_gemms:   # after fusion and fp8: it takes over the fused GEMMs, leaves e4m3 ones
            from .lt_gemm import use_tuned_gemms
            use_tuned_gemms(self.model)
        if config.triton_attention:
            from .kernels.few_query_attention import few_query_attention
            for block in self.model.expert.blocks:
                block.attend = few_query_attention
        if config.rotary_kernel:
            from .kernels.rotary_heads import use_rotary_kernel
            use_rotary_kernel(self.model.llm)
        if config.triton_layer_norm:
            from .kernels.layer_norm import use_triton_layer_norms
            use_triton_layer_norms(self.model)
        if config.add_norm_kernel:
            from .kernels.layer_norm import use_add_norm_kernel
            use_add_norm_kernel(self.model)
        if config.flex_attention:
            from .kernels.prefill_attention import flex_attend
            for layer in self.model.llm.layers:
                layer.attn.attend = flex_attend
        if config.q_rope_in_attention:   # after flex_attention: it sets the layers' attend too
            from .kernels.rotary_heads import use_q_rope_in_attention
            use_q_rope_in_attention(self.model.llm)
        self.parts = EngineParts(self.model, self.prompts, config, self.device, self.dtype, self.progress)
        self.static = None
        if config.static_shapes:
            from .static import StaticRunner
            self.static = StaticRunner(self.parts, self.flow_steps, self.schedule)
        self.progress(f"loaded {self.model_cfg.name} on {self.device} ({config.dtype}) in "
                      f"{time.perf_counter() - t0:.1f}s")

    # -- public API ---------------------------------------------------------------------------
    @property
    def layout(self) -> WindowLayout:
        return self.config.layout

    @property
    def streamed_queries(self) -> int:
        """Queries since warm-up whose LLM stage was a streaming step (streaming_kv reused the
        surviving frames' KV): 0 when windows never slide by whole frames between queries."""
        return self.static.stream_steps if self.static is not None else 0

    @property
    def history_offset_s(self) -> float:
        """Seconds between consecutive frame times of a window, as in the training data."""
        return self.model_cfg.robot.history_offset_s

    def query_layout(self, obs: Observation, layout: WindowLayout) -> WindowLayout:
        """The layout of this query: `layout`, or fewer frame times at an episode's start."""
        cams = len(layout.cameras)
        n = len(obs.images)
        if n % cams or not 1 <= n // cams <= layout.frames:
            raise ValueError(f"expected {layout.images} images for the window layout (or {cams} per frame time at "
                             f"an episode's start), got {n}")
        return layout.with_frames(n // cams)

    def warmup(self) -> EngineStats:
        """Compile and capture every stage of every bucket now, so no query pays for it."""
        t0 = time.perf_counter()
        if self.static is not None:
            self.static.warmup()
            self.stats.compiled_graphs = self.static.compiled_graphs
            self.stats.graph_captures = self.static.graph_captures
        else:  # zero noise: warm-up must not advance the engine's noise stream
            a = self.model_cfg.action
            chunk = self.predict(self.dummy_observation(), noise=torch.zeros((1, a.horizon, a.action_dim),
                                                                            device=self.device))
            require_finite(torch.from_numpy(chunk.normalized), self.config, "the eager pass")
        self.stats.ready_s = time.perf_counter() - t0
        self.stats.queries = 0
        if self.config.tuned_gemms and self.device.type == "cuda":
            from .lt_gemm import TUNED
            if TUNED.file_error:   # the choices are still made, but timed again at every start
                self.progress(f"tuned_gemms: {TUNED.file} {TUNED.file_error}")
        self.progress(f"ready in {self.stats.ready_s:.1f}s ({self.stats.compiled_graphs} compiled graphs, "
                      f"{self.stats.graph_captures} CUDA graphs)")
        return self.stats

    def predict(self, obs: Observation, noise: Optional[torch.Tensor] = None,
                layout: Optional[WindowLayout] = None, generator: Optional[torch.Generator] = None) -> ActionChunk:
        """The chunk for `obs`; without `noise` [1, H, A], the flow starts from noise drawn from
        `generator` (default: the engine's own stream), after the observation passed its checks.
        A batch of one (predict_batch)."""
        return self.predict_batch([obs], noise, layout, [generator])[0]

    def predict_batch(self, observations: Sequence[Observation], noise: Optional[torch.Tensor] = None,
                      layout: Optional[WindowLayout] = None,
                      generators: Optional[Sequence[Optional[torch.Generator]]] = None) -> list[ActionChunk]:
        """The chunks of observations of one layout bucket (equal batch_key), as one query: the new
        frames of all of them encoded together, one prefill over [B, T], the flow loop over
        [B, H, A]. Each entry gets what predict() gives it alone, to rounding: its own noise
        (`noise` [B, H, A], or drawn from its generator, default the engine's stream, once every
        observation passed its checks), known actions, state and instruction. A ValueError names
        an observation the engine cannot use, and nothing runs."""
        n = len(observations)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"a batch holds 1 to {self.max_batch} observations (max_batch; 1 with streaming_kv or "
                             f"the adaptive action cache), got {n}")
        layout = layout or self.layout
        if layout not in self.config.layouts:
            raise ValueError(f"layout {layout} is not one of the engine's layouts (EngineConfig.layout / "
                             "extra_layouts)")
        layouts = [self.query_layout(obs, layout) for obs in observations]
        if len(set(layouts)) > 1:
            raise ValueError(f"the observations of a batch must have one layout, got {sorted(set(layouts), key=str)}")
        layout = layouts[0]
        for obs in observations:
            self.check_observation(obs, layout)
        if noise is None:
            noise = torch.cat([self.draw_noise(g) for g in (generators or [None] * n)])
        if noise.shape[0] != n:
            raise ValueError(f"noise must be [{n}, horizon, action_dim] for {n} observations, got {tuple(noise.shape)}")
        with torch.inference_mode():
            known = self.known_actions(observations)
            if self.static is not None:
                normalized, timings = self.static.predict(observations, noise, layout, known)
            else:
                normalized, timings = self._predict_reference(observations, noise, layout, known)
        self.stats.queries += n
        normalized = normalized.cpu().float()
        actions = denormalize(normalized, self.action_stats, self.model_cfg.robot.action_norm).numpy()
        normalized = normalized.numpy()
        return [ActionChunk(actions=actions[j], normalized=normalized[j], stamp=obs.stamp, timings=dict(timings))
                for j, obs in enumerate(observations)]

    @property
    def max_batch(self) -> int:
        """Observations one query may hold now: EngineConfig.max_batch, but 1 under streaming_kv
        (the LLM's KV cache holds one robot's window) and under the adaptive action cache (whether
        a step reuses a velocity is decided on the whole batch's change)."""
        if self.config.streaming_kv or self.schedule.adaptive_threshold is not None:
            return 1
        return self.config.max_batch

    def batch_key(self, obs: Observation, layout: Optional[WindowLayout] = None,
                  options: Optional[Mapping[str, object]] = None) -> Optional[Hashable]:
        """What a query must share with others to run in one predict_batch: its layout bucket and
        the run-time options it runs with (`options`: RUNTIME_OPTIONS -> value; default the
        engine's). None: it runs alone, as max_batch says, or because its instruction types an
        image special token (its prefill mask is its own: the static buckets share one). Raises
        predict()'s ValueError for an observation the engine cannot use."""
        query = self.query_layout(obs, layout or self.layout)
        self.check_observation(obs, query)
        options = {k: getattr(self.config, k) for k in RUNTIME_OPTIONS} | dict(options or {})
        if self.config.streaming_kv or is_adaptive(str(options.get("action_cache", ""))):
            return None
        if self.model_cfg.prompt.bidirectional_images and \
                self.prompts.bidirectional_ids.intersection(self.prompts.instruction(obs.instruction)):
            return None
        return query, tuple(sorted(options.items()))

    def set_flow(self, steps: Optional[int] = None, action_cache: Optional[str] = None) -> None:
        """Change the flow steps and/or the action-cache schedule between queries. Invalid values
        raise ValueError and change nothing. Re-captures the flow loop's CUDA graphs (no recompile)."""
        steps = steps or self.flow_steps
        spec = self.config.action_cache if action_cache is None else action_cache
        config = self.config.replace(flow_steps=steps, action_cache=spec)   # EngineConfig's rules
        schedule = FlowSchedule.parse(spec, steps)
        self.flow_steps, self.schedule, self.config = steps, schedule, config
        if self.static is not None:
            self.static.reschedule(steps, schedule)
            self.stats.graph_captures = self.static.graph_captures

    def reconfigure(self, changes: Mapping[str, object]) -> EngineConfig:
        """Apply run-time options (RUNTIME_OPTIONS: name -> value) between queries; the
        configuration in effect afterwards. An unknown or invalid one raises ValueError and
        changes nothing."""
        unknown = sorted(set(changes) - set(RUNTIME_OPTIONS))
        if unknown:
            raise ValueError(f"{unknown} cannot change while the engine runs; run-time options: "
                             f"{list(RUNTIME_OPTIONS)}")
        if "action_cache" in changes:
            self.set_flow(action_cache=changes["action_cache"])
        return self.config

    def weight_bytes(self) -> int:
        """Bytes of weights the model holds (fp8 weights count at one byte; with expert_fp8 the
        expert's e4m3 copies are what the flow loop reads, its bf16 weights stay for the context)."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def draw_noise(self, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        a = self.model_cfg.action
        return torch.randn((1, a.horizon, a.action_dim), generator=generator or self.generator, device=self.device)

    def reset_stream(self) -> None:
        """Forget everything carried between calls (a new episode or robot), the noise stream
        included: it restarts from config.seed, so that an episode's chunks depend on its own
        observations only, not on how many queries the episodes before it made (in `vla-sim eval`
        on which worker ran them, and in what order)."""
        if self.static is not None:
            self.static.reset()
        self.generator.manual_seed(self.config.seed)

    def close(self) -> None:
        """Release the model and device memory."""
        self.static = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_observation(self, obs: Observation, layout: WindowLayout) -> None:
        """Clear errors for inputs the model cannot use; nothing is run on them."""
        c = self.config
        check_frames(obs.images, layout.images, c.camera_height, c.camera_width)
        state = np.asarray(obs.state)
        if state.shape != (self.model_cfg.action.state_dim,):
            raise ValueError(f"state must have {self.model_cfg.action.state_dim} values, got shape {state.shape}")
        if not np.all(np.isfinite(state)):
            raise ValueError("state has non-finite values")
        n = len(self.prompts.instruction(obs.instruction))
        if n > c.max_instruction_tokens:
            raise ValueError(f"instruction is {n} tokens, the budget is {c.max_instruction_tokens} "
                             f"(max_instruction_tokens)")
        if obs.frame_ids is not None and len(obs.frame_ids) != layout.images:
            raise ValueError(f"frame_ids must name {layout.images} frames, got {len(obs.frame_ids)}")
        if obs.known_actions is not None:
            a, shape = self.model_cfg.action, np.shape(obs.known_actions)
            if len(shape) != 2 or shape[1] != a.action_dim or not 1 <= shape[0] <= a.horizon:
                raise ValueError(f"known_actions must be [k, {a.action_dim}] with 1 <= k <= {a.horizon} (the "
                                 f"horizon), got shape {shape}")
            if not np.all(np.isfinite(obs.known_actions)):
                raise ValueError("known_actions has non-finite values")

    def dummy_observation(self, layout: Optional[WindowLayout] = None, seed: int = 0) -> Observation:
        return self.parts.dummy_observation(layout, seed)

    def state_tensor(self, obs: Observation) -> torch.Tensor:
        return self.parts.state_tensor(obs)

    def known_actions(self, observations: Sequence[Observation]) -> Optional[KnownActions]:
        """The observations' fixed first actions in the model's units, the inverse of the
        denormalisation predict() applies to its output: values [B, H, A] padded with zeros, and
        the mask of the rows known (none for an entry without them: its rows are sampled freely,
        exactly as without a prefix). None when no entry has any."""
        if all(obs.known_actions is None for obs in observations):
            return None
        a = self.model_cfg.action
        values = torch.zeros((len(observations), a.horizon, a.action_dim), device=self.device)
        counts = torch.zeros((len(observations), 1, 1), dtype=torch.long, device=self.device)
        for j, obs in enumerate(observations):
            if obs.known_actions is not None:
                rows = torch.as_tensor(np.asarray(obs.known_actions, dtype=np.float32), device=self.device)
                values[j, :len(rows)] = self.model.normalize_actions(rows)
                counts[j] = len(rows)
        known = torch.arange(a.horizon, device=self.device)[None, :, None] < counts
        return KnownActions(values, known)

    # -- the eager reference ------------------------------------------------------------------
    def _predict_reference(self, observations: Sequence[Observation], noise: torch.Tensor, layout: WindowLayout,
                           known: Optional[KnownActions]):
        """-> (normalised actions [B, H, A], timings). Prompts of one batch differ in their
        instruction's length: the shorter ones are padded at the end, where no real token sees the
        padding (causal mask) and the expert's cross-attention masks it; one alone runs unpadded."""
        m, cfg, timer, n = self.model, self.model_cfg, StageTimer(self.device), len(observations)
        images = [image for obs in observations for image in obs.images]
        pixels = preprocess_reference(images, cfg.vision.image_size).to(self.device, self.dtype)
        timer.mark("preprocess")
        image_tokens = m.vision(pixels).reshape(n, -1, cfg.llm.dim)
        timer.mark("vision")
        prompts = [self.prompts.build(len(layout.cameras), layout.frames, obs.instruction) for obs in observations]
        length = max(len(p) for p in prompts)
        ids = torch.full((n, length), self.prompts.pad_id, dtype=torch.long)
        masks = torch.ones((n, 1, length, length), dtype=torch.bool).tril()
        ctx_mask = torch.ones((n, 1, 1, length + 1), dtype=torch.bool)   # + the state token
        for j, prompt in enumerate(prompts):
            ids[j, :len(prompt)] = torch.tensor(prompt.ids)
            masks[j, 0, :len(prompt), :len(prompt)] = m.attention_mask(prompt, "cpu")
            ctx_mask[j, ..., len(prompt):length] = False
        same = all(torch.equal(masks[0], mask) for mask in masks)
        mask = (masks[0, 0] if same else masks).to(self.device)
        ctx_mask = None if all(len(p) == length for p in prompts) else ctx_mask.to(self.device)
        patch_positions = torch.tensor(prompts[0].patch_positions, device=self.device)   # one layout: the same
        embeds = m.embed(ids.to(self.device), image_tokens, patch_positions)
        cos, sin = rope_tables(cfg.llm.head_dim, torch.arange(length, device=self.device), cfg.llm.rope_theta)
        hidden = m.llm(embeds, cos, sin, mask)
        timer.mark("llm")
        state = m.normalize_state(torch.cat([self.state_tensor(obs) for obs in observations])).to(self.dtype)
        times = flow_times(self.flow_steps)

        def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
            t = torch.full((1,), times[i], device=self.device)   # [1, ...] modulations: every entry's
            kv = m.expert.context_kv(hidden, state)  # recomputed every step: the uncached reference
            return m.expert.velocity(x.to(self.dtype), m.expert.modulations(t), kv, ctx_mask).float()

        normalized = euler(velocity, noise.float(), self.flow_steps, self.schedule.reuse_map, known)
        timer.mark("action")
        return normalized, timer.total()
