"""The static-shape path: fixed buffers per window layout (a bucket), stages that read and write
only those buffers, so they can be compiled once and captured as CUDA graphs.

Stages per query: vision (new frames only, batched) -> prefill (LLM over the padded prompt,
plus the action expert's per-query context K/V when ctx_kv_once) -> action (the whole flow
loop). The instruction is padded at the end of the prompt: under the causal mask no real token
sees the padding, and the expert's cross-attention masks it.

A query holds one observation or a batch of several of one layout (PolicyEngine.predict_batch):
buffers and graphs are per (layout, batch size, instruction budget), batch sizes BATCH_SIZES up
to EngineConfig.max_batch, budgets EngineConfig.instruction_budgets; a batch runs in the
smallest size that holds it, its padding rows repeating its last entry (their outputs are
dropped), and the smallest budget that holds its longest instruction. The new frames of every
entry are encoded together, the prefill runs over [B, T] and the flow loop over [B, H, A].
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..model.action_expert import KnownActions, euler, flow_times
from .action_cache import MAX_ADAPTIVE_REUSE, FlowSchedule
from .bucket import Bucket
from .compile import compile_count, compile_regions
from .frame_store import FrameStore
from .fusion import BatchedContextKV, embed_from_store
from .graphs import capture
from .parts import EngineParts, require_finite
from .preprocess import DeviceStaging, preprocess_reference, resize_normalize
from .streaming import StreamBuffers
from .timing import StageTimer
from .types import BATCH_SIZES, Observation, WindowLayout

# cuBLAS picks other GEMM kernels for the LLM at 896 tokens (7 x 128) than at 897: tiles 176x128,
# 144x128 and 168x128 against 192x192, 128x152 and 128x184 (the kernels' names). DROID's 48-token tier
# made 897: at 896 the LLM stage took 11.77 ms against 12.30 on the H200, 11.99-12.02 against 12.45-12.55
# on an H100 (BENCHMARKS.md, thirty-fifth session). EngineConfig.tile_tiers trims a tier to a multiple of
# the tile where it costs this many tokens at most.
ROW_TILE, TILE_TRIM = 128, 4


def copy_rows(bucket_rows: torch.Tensor, rows: torch.Tensor) -> None:
    """A batch's rows into its bucket's buffer, the padding rows after them repeating the last one.
    Slices, not a list index: indexing a device tensor with a list uploads the index and waits for
    the device, here for the whole vision stage, with nothing queued behind it (the H100 trace of a
    DROID query: a 5.1 ms cudaStreamSynchronize, then the prefill launched onto an idle GPU)."""
    n = rows.shape[0]
    bucket_rows[:n].copy_(rows, non_blocking=True)
    bucket_rows[n:].copy_(rows[n - 1:].expand_as(bucket_rows[n:]), non_blocking=True)


class StaticRunner:
    def __init__(self, engine: EngineParts, steps: int, schedule: FlowSchedule):
        self.engine = engine
        self.steps, self.schedule = steps, schedule
        self.compiled_graphs = self.graph_captures = 0
        cfg, m, dev = engine.config, engine.model, engine.device
        mc = m.cfg
        self.size = mc.vision.image_size
        # One robot's streaming caches hold one window (the LLM's KV cache has one row): a
        # streaming engine runs one observation per query.
        self.batch_sizes = [s for s in BATCH_SIZES if s <= (1 if cfg.streaming_kv else cfg.max_batch)]
        most = self.batch_sizes[-1]
        self.buckets: dict[tuple[WindowLayout, int, int], Bucket] = {}   # by (layout, batch size, budget)
        layouts = engine.config.query_layouts
        # Where each layout's instruction starts: its budgets, and the LLM cache's length, end there.
        starts = {l: engine.prompts.build(len(l.cameras), l.frames, "x").instruction_start for l in layouts}
        self.budgets = {layout: self._layout_budgets(start) for layout, start in starts.items()}
        shortest, smallest = len(engine.prompts.instruction("x")), min(b[0] for b in self.budgets.values())
        if smallest < shortest:
            raise ValueError(f"instruction_tiers: {smallest} tokens hold no instruction (the chat turn of a "
                             f"one-letter one is {shortest})")
        self.max_images = max(layout.images for layout in layouts)
        # A batch's frames are planned together (none evicts another entry's), so the store holds
        # two of the largest batches.
        capacity = (max(cfg.vision_cache_frames, 2 * self.max_images * most) if cfg.vision_cache
                    else self.max_images * most)
        self.store = FrameStore(capacity, mc.vision.tokens_per_image, mc.llm.dim, engine.dtype, dev)
        # Vision runs in batches of these sizes (one graph each): a camera's worth of new frames
        # (a sliding window) and a whole window (a cold start), for each batch size.
        per_entry = {len(cfg.layout.cameras)} | {layout.images for layout in layouts}
        self.vision_batches = sorted({n * batch for n in per_entry for batch in self.batch_sizes})
        nb = self.vision_batches[-1]
        self.write_rows = {b: torch.full((b,), self.store.scratch_row, dtype=torch.long, device=dev)
                           for b in self.vision_batches}
        if cfg.gpu_preprocess:
            self.staging = DeviceStaging(nb, cfg.camera_height, cfg.camera_width, dev)
        else:
            self.pixels = torch.zeros((nb, 3, self.size, self.size), dtype=engine.dtype, device=dev)
        self.fused_expert = None
        if cfg.fused_expert:
            from .fused_expert import FusedExpert
            self.fused_expert = FusedExpert(m.expert, fp8=cfg.expert_fp8, backend=cfg.expert_kernel)
        self.mod_table = self.flow_inputs = None
        if cfg.ctx_kv_once:
            self._make_modulation_table()
        self.context_kv = BatchedContextKV(m.expert) if cfg.fused else m.expert.context_kv
        self.regions = compile_regions(m, pad_gemms=not cfg.unpadded_gemms) if cfg.compile else []
        # The query's small input copies on a stream of their own (EngineConfig.input_stream).
        self.input_stream = torch.cuda.Stream(dev) if cfg.input_stream else None
        self.embed_from_store = None
        if cfg.one_pass_embedding:
            self.embed_from_store = (torch.compile(embed_from_store, fullgraph=True, dynamic=False) if cfg.compile
                                     else embed_from_store)
        self.graphs_on = cfg.cuda_graphs
        self.vision_graphs: dict[str, torch.cuda.CUDAGraph] = {}  # shared by all buckets
        self.stream_bucket: Bucket | None = None  # whose KV the LLM caches hold
        self.stream_steps = 0
        self.expert_calls = 0
        self.cache_len = max(starts.values()) + cfg.max_instruction_tokens
        if cfg.streaming_kv:   # one row: what a streaming step reads
            m.llm.setup_caches(1, self.cache_len, engine.dtype, dev)

    def _layout_budgets(self, start: int) -> tuple[int, ...]:
        """EngineConfig.instruction_budgets for a prompt whose instruction starts at token `start`: under
        tile_tiers each tier below the longest makes its bucket a multiple of ROW_TILE tokens where that
        costs at most TILE_TRIM of them."""
        cfg = self.engine.config
        if not cfg.tile_tiers:
            return cfg.instruction_budgets
        tiers = [b - (start + b) % ROW_TILE if (start + b) % ROW_TILE <= TILE_TRIM else b
                 for b in cfg.instruction_budgets[:-1]]
        return (*sorted(set(tiers)), cfg.instruction_budgets[-1])

    def bucket(self, layout: WindowLayout, batch: int = 1, budget: Optional[int] = None) -> Bucket:
        """The bucket of `layout` at `batch` entries and instruction `budget` (None: the longest)."""
        key = (layout, batch, budget or self.budgets[layout][-1])
        if key not in self.buckets:
            b = self.buckets[key] = Bucket(self.engine, *key, self.cache_len)
            if self.engine.config.streaming_kv and layout.frames > 1:   # batch 1 (batch_sizes)
                b.stream = StreamBuffers(self.engine, b)
        return self.buckets[key]

    def budget_for(self, layout: WindowLayout, instructions: Sequence[str]) -> int:
        """The smallest of `layout`'s instruction budgets that holds the chat turn of each of
        `instructions`, which PolicyEngine.check_observation has held to max_instruction_tokens (the
        last budget)."""
        tokens = max(len(self.engine.prompts.instruction(text)) for text in instructions)
        return next(b for b in self.budgets[layout] if b >= tokens)

    def reset(self) -> None:
        self.store.clear()
        self.stream_bucket = None
        for b in self.buckets.values():
            if b.stream is not None:
                b.stream.last_ids = None

    @torch.inference_mode()
    def _make_modulation_table(self) -> None:
        """adaLN parameters of every flow step: they depend on t alone, so they are computed once
        (and, for the fused expert, packed with the schedule's reuse map)."""
        e = self.engine
        self.mod_table = [e.model.expert.modulations(torch.full((1,), t, device=e.device))
                          for t in flow_times(self.steps)]
        if self.fused_expert is not None:
            self.flow_inputs = self.fused_expert.schedule(self.mod_table, self.schedule.reuse_map)

    # -- stages: read and write only static buffers ------------------------------------------
    def _vision_stage(self, batch: int) -> None:
        e = self.engine
        if e.config.gpu_preprocess:
            pixels = resize_normalize(self.staging.dev[:batch], self.size).to(e.dtype)
        else:
            pixels = self.pixels[:batch]
        self.store.write(self.write_rows[batch], e.model.vision(pixels))

    def _prefill_stage(self, b: Bucket) -> None:
        m = self.engine.model
        if self.embed_from_store is not None:
            embeds = self.embed_from_store(m.llm.embed.weight, b.ids, self.store.tokens, b.frame_rows, b.slot_image)
        else:
            image_tokens = self.store.read(b.frame_rows).reshape(b.batch, -1, m.cfg.llm.dim)
            embeds = m.embed(b.ids, image_tokens, b.patch_positions)
        # Only a streaming bucket (batch 1: streaming is one robot's) writes the KV cache its steps read.
        # The fused context K/V reads every layer's output at once: the layers write them into one buffer.
        stacked = embeds.new_empty(m.cfg.llm.layers, *embeds.shape) if self.engine.config.fused else None
        b.hidden = m.llm(embeds, b.cos, b.sin, b.attn_mask, b.slots if b.stream is not None else None,
                         hidden_out=stacked)
        b.state_norm = m.normalize_state(b.state).to(self.engine.dtype)
        if self.mod_table is not None:
            b.kv = self.context_kv(b.hidden if stacked is None else stacked, b.state_norm)
            if b.stream is not None:  # the streaming step updates these in place
                b.stream.store_full(b.kv)
                b.kv = b.stream.kv

    def _stream_stage(self, b: Bucket) -> None:
        new_rows = b.frame_rows[-b.stream.cameras:]
        tokens = self.store.read(new_rows).reshape(1, -1, self.engine.model.cfg.llm.dim)
        b.stream.step(self.engine, b, tokens)

    def _velocity(self, b: Bucket, x: torch.Tensor, i: int) -> torch.Tensor:
        e, expert = self.engine, self.engine.model.expert
        if self.fused_expert is not None:
            return self.fused_expert.velocity(x.to(e.dtype), self.mod_table[i], b.kv, b.ctx_mask).float()
        if self.mod_table is not None:
            kv, mods = b.kv, self.mod_table[i]
        else:
            kv = expert.context_kv(b.hidden, b.state_norm)
            mods = expert.modulations(torch.full((1,), flow_times(self.steps)[i], device=e.device))
        return expert.velocity(x.to(e.dtype), mods, kv, b.ctx_mask).float()

    def _action_stage(self, b: Bucket, known: Optional[KnownActions]) -> torch.Tensor:
        """The whole flow loop with a static schedule (one graph; one kernel when fused) -> actions
        [1, H, A]. `known`: the bucket's buffers of the known prefix (b.known), or None."""
        if self.fused_expert is not None:
            return self.fused_expert.flow(b.noise, self.flow_inputs, b.kv, b.ctx_mask, known)
        return euler(lambda x, i: self._velocity(b, x, i), b.noise, self.steps, self.schedule.reuse_map, known)

    def _flow_step_stage(self, b: Bucket, i: int) -> None:
        """One computed flow step of the adaptive schedule (one graph per step)."""
        v = self._velocity(b, b.x, i)
        b.change.copy_((v - b.v_last).norm() / v.norm().clamp_min(1e-12))
        b.v_last.copy_(v)
        b.x.add_(v, alpha=1.0 / self.steps)

    def _adaptive_action(self, b: Bucket, known: Optional[KnownActions]) -> None:
        """Reuse the last velocity while it barely changes; the decision needs the change on the
        host, so each computed step is its own graph (the known prefix is inpainted between them)."""
        threshold, reused, change = self.schedule.adaptive_threshold, 0, float("inf")
        b.x.copy_(b.noise)
        for i, t in enumerate(flow_times(self.steps)):
            if known is not None:
                b.x.copy_(known.inpaint(b.x, b.noise, t))
            if i >= 2 and change < threshold and reused < MAX_ADAPTIVE_REUSE:
                b.x.add_(b.v_last, alpha=1.0 / self.steps)
                reused += 1
                continue
            self._run(b, f"step{i}", lambda: self._flow_step_stage(b, i))
            reused = 0
            if i >= 1:
                change = float(b.change)
            self.expert_calls += 1
        if known is not None:
            b.x.copy_(known.inpaint(b.x, b.noise, 1.0))
        b.out = b.x

    def _run(self, b: Bucket, name: str, fn: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        """Stage `name`: its graph replayed, or `fn` run; what it returns (a captured graph's
        output tensor holds each replay's result)."""
        graph = b.graphs.get(name) or self.vision_graphs.get(name)
        with torch.profiler.record_function(name):  # stage ranges in profiler traces
            if graph is not None:
                graph.replay()
                return b.graph_outputs.get(name)
            return fn()

    # -- a query --------------------------------------------------------------------------------
    def predict(self, observations: Sequence[Observation], noise: torch.Tensor, layout: WindowLayout,
                known: Optional[KnownActions] = None, budget: Optional[int] = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
        """One query of n observations of `layout` (noise [n, H, A]) -> (normalised actions
        [n, H, A], timings), in the bucket of the smallest batch size >= n (its padding rows
        repeat the last entry) and of instruction `budget` (None: the smallest that holds the
        instructions). `known` (PolicyEngine.known_actions, [n, H, ...]) is copied into the
        bucket's buffers, which the inpainting flow loop reads (one graph for every prefix length)."""
        e, n = self.engine, len(observations)
        size = next((s for s in self.batch_sizes if s >= n), None)
        if size is None or n < 1:
            raise ValueError(f"a query holds 1 to {self.batch_sizes[-1]} observations here, got {n}")
        b = self.bucket(layout, size, budget or self.budget_for(layout, [obs.instruction for obs in observations]))
        timer = StageTimer(e.device)
        queued = self._queued()
        windows = [list(obs.frame_ids) if (e.config.vision_cache and obs.frame_ids is not None)
                   else [None] * layout.images for obs in observations]
        # One plan for the batch's frames (entry after entry): no entry's rows are recycled for another's.
        rows, to_encode = self.store.plan([f for ids in windows for f in ids])
        timer.mark("preprocess")
        images = [image for obs in observations for image in obs.images]   # the plan's order
        for start in range(0, len(to_encode), self.vision_batches[-1]):
            chunk = to_encode[start:start + self.vision_batches[-1]]
            batch = next(s for s in self.vision_batches if s >= len(chunk))
            self._stage_frames([images[i] for i, _ in chunk], batch)
            rows_host = [row for _, row in chunk] + [self.store.scratch_row] * (batch - len(chunk))
            self.write_rows[batch].copy_(torch.tensor(rows_host), non_blocking=True)
            timer.mark("preprocess")
            self._run(b, f"vision{batch}", lambda: self._vision_stage(batch))
            timer.mark("vision")
        self._stage_inputs(b, observations, rows + rows[-layout.images:] * (size - n), noise, known, queued)
        if b.stream is not None and self.stream_bucket is b and b.stream.slides_from(windows[0]):
            self._run(b, "stream", lambda: self._stream_stage(b))
            self.stream_steps += 1
        else:
            self._run(b, "prefill", lambda: self._prefill_stage(b))
        if b.stream is not None:
            b.stream.last_ids = windows[0]
        self.stream_bucket = b
        timer.mark("llm")
        bucket_known = b.known if known is not None else None
        if self.schedule.adaptive_threshold is not None:
            self._adaptive_action(b, bucket_known)
        else:
            name = "action" if known is None else "inpaint"
            b.out = self._run(b, name, lambda: self._action_stage(b, bucket_known))
            self.expert_calls += self.schedule.expert_calls
        timer.mark("action")
        return b.out[:n].clone(), timer.total()

    def _queued(self) -> Optional[torch.cuda.Event]:
        """With the input stream: an event after the work queued so far (the last query's stages,
        which read the bucket's input buffers), which the input copies wait for."""
        if self.input_stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _stage_inputs(self, b: Bucket, observations: Sequence[Observation], rows: list[int], noise: torch.Tensor,
                      known: Optional[KnownActions], queued: Optional[torch.cuda.Event]) -> None:
        """The rest of the query's inputs into the bucket while the device encodes. With the input
        stream their copies run beside the vision stage, after `queued`, not between it and the
        prefill, which waits for them."""
        if self.input_stream is None:
            self._copy_inputs(b, observations, rows, noise, known)
            return
        main = torch.cuda.current_stream()
        self.input_stream.wait_event(queued)
        for made_on_main in (noise, *((known.values, known.known) if known is not None else ())):
            made_on_main.record_stream(self.input_stream)   # its memory is not reused before the copy
        with torch.cuda.stream(self.input_stream):
            self._copy_inputs(b, observations, rows, noise, known)
        main.wait_stream(self.input_stream)

    def _copy_inputs(self, b: Bucket, observations: Sequence[Observation], rows: list[int], noise: torch.Tensor,
                     known: Optional[KnownActions]) -> None:
        """Frame rows (each row's, padding included), instructions, states, noise, the known prefix."""
        e, n = self.engine, len(observations)
        b.frame_rows.copy_(torch.tensor(rows), non_blocking=True)
        entries = list(range(n)) + [n - 1] * (b.batch - n)   # each row's observation
        for row, j in enumerate(entries):
            b.set_instruction(e, observations[j].instruction, row)
        b.state.copy_(torch.cat([e.state_tensor(observations[j]) for j in entries]))
        copy_rows(b.noise, noise)
        if known is not None:
            copy_rows(b.known.values, known.values)
            copy_rows(b.known.known, known.known)

    def _stage_frames(self, images: list[np.ndarray], batch: int) -> None:
        """Frames of one vision batch into its input buffer (padding rows keep stale pixels and
        are written to the scratch row)."""
        if self.engine.config.gpu_preprocess:
            self.staging.upload(images)
        else:
            self.pixels[:len(images)].copy_(preprocess_reference(images, self.size))

    # -- warm-up ------------------------------------------------------------------------------
    def warmup(self) -> None:
        e = self.engine
        compiled_before = compile_count()
        for layout, size, budget in ((l, s, b) for l in e.config.query_layouts for s in self.batch_sizes
                                     for b in self.budgets[l]):
            b = self.bucket(layout, size, budget)
            name = f"bucket {layout.images} images" + (f" x{size}" if size > 1 else "") + f", instruction {budget}"
            t0 = time.perf_counter()
            with torch.inference_mode():
                # Two windows one frame time apart: a full prefill, then (streaming) a sliding step.
                for obs in self._warmup_windows(layout, budget):
                    # Not from the engine's generator: warm-up must not shift the noise stream,
                    # so engines of any mode with the same seed see the same noise per query.
                    require_finite(self.predict([obs] * size, torch.zeros_like(b.noise), layout, budget=budget)[0],
                                   e.config, name)
                nothing_known = KnownActions(torch.zeros_like(b.noise), torch.zeros_like(b.known.known))
                require_finite(self.predict([obs] * size, torch.zeros_like(b.noise), layout, nothing_known, budget)[0],
                               e.config, f"{name}, the inpainting loop")
                for batch in self.vision_batches:
                    self._vision_stage(batch)
            e.progress(f"{name} ({b.length} tokens): eager/compile pass {time.perf_counter() - t0:.1f}s")
            if self.graphs_on:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for batch in self.vision_batches:
                        name = f"vision{batch}"
                        if name not in self.vision_graphs:
                            self.vision_graphs[name], _ = self._capture(lambda: self._vision_stage(batch))
                    b.graphs["prefill"], _ = self._capture(lambda: self._prefill_stage(b))
                    if b.stream is not None:
                        b.graphs["stream"], _ = self._capture(lambda: self._stream_stage(b))
                    self._capture_action(b)
                    replayed = self.predict([obs] * size, torch.zeros_like(b.noise), layout, budget=budget)[0]
                require_finite(replayed, e.config, f"{name}, its CUDA graphs replayed")
                e.progress(f"{name}: captured {len(b.graphs)} CUDA graphs in "
                           f"{time.perf_counter() - t0:.1f}s")
        self.compiled_graphs = compile_count() - compiled_before
        self.compiled_at_ready = compile_count()
        if self.fused_expert is not None and self.fused_expert.barrier_timed_out():
            raise RuntimeError("the fused expert's grid barrier timed out during warm-up: not all of its programs "
                               "were resident on the GPU at once (another process sharing it?); its actions are "
                               "wrong: run without fused_expert")
        self.reset()
        self.expert_calls = self.stream_steps = 0

    def _warmup_windows(self, layout: WindowLayout, budget: int) -> list[Observation]:
        obs = self.engine.dummy_observation(layout)
        # The shortest instruction (budgets are checked to hold it) where the dummy's is too long.
        instruction = obs.instruction if len(self.engine.prompts.instruction(obs.instruction)) <= budget else "x"
        windows = []
        for shift in range(2):
            ids = [(cam, t + shift) for t in range(layout.frames) for cam in layout.cameras]
            windows.append(Observation(images=obs.images, state=obs.state, instruction=instruction, frame_ids=ids))
        return windows

    def _capture_action(self, b: Bucket) -> None:
        """The flow loop's graphs for the current schedule: for a static schedule one without and
        one with a known prefix (it reads b.known: every prefix length replays it), one per step
        for the adaptive one."""
        for name in [n for n in b.graphs if n in ("action", "inpaint") or n.startswith("step")]:
            del b.graphs[name]
        if self.schedule.adaptive_threshold is None:
            for name, known in (("action", None), ("inpaint", b.known)):
                b.graphs[name], b.graph_outputs[name] = self._capture(lambda: self._action_stage(b, known))
        else:
            for i in range(self.steps):
                b.graphs[f"step{i}"], _ = self._capture(lambda: self._flow_step_stage(b, i))

    def reschedule(self, steps: int, schedule: FlowSchedule) -> None:
        """New flow steps and/or action-cache schedule: new modulation table and flow-loop graphs
        (the compiled blocks are shape-independent of both, so no recompile)."""
        self.steps, self.schedule = steps, schedule
        if self.mod_table is not None:
            self._make_modulation_table()
        if self.graphs_on:
            with torch.inference_mode():
                for b in self.buckets.values():
                    if "prefill" in b.graphs:  # captured buckets only
                        self._capture_action(b)

    def _capture(self, fn: Callable[[], Optional[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph,
                                                                          Optional[torch.Tensor]]:
        """`fn` captured (runtime/graphs.capture): the graph and the output tensor it replays into."""
        self.graph_captures += 1
        return capture(fn, memset_kernels=self.engine.config.memset_kernels)

    def recompiles(self) -> int:
        return compile_count() - self.compiled_at_ready
