"""The action expert's flow loop on one fused Triton kernel (kernels/expert_flow.py): a drop-in
for the reference loop (model.action_expert.euler over ActionExpert.velocity).

    fused = FusedExpert(expert)                           # weights stacked once per kind
    inputs = fused.schedule(mod_table, reuse)             # per flow-step schedule, once
    actions = fused.flow(noise, inputs, kv, ctx_mask)     # the whole loop, one launch
    v = fused.velocity(x, mods, kv, ctx_mask)             # one step (adaptive action caching)

On the GPU the loop is one persistent launch of one program per SM (grid barriers between a
block's phases); with Tiling(persistent=False), and always under TRITON_INTERPRET, every phase
is its own launch. Both compute the same thing in the same order. Scratch is made once per
(batch, context length), so calls allocate nothing but what they return and can be captured
in a CUDA graph.

Weights: each kind's weights of all blocks stacked into one [depth, N, K] tensor (a copy: the
kernel indexes block j at a fixed stride), bf16/fp32 as the model, or e4m3 with an fp32 scale per
output channel (opt-in: it changes the numbers; scripts/bench_expert_gpu.py reports by how much).
"""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import triton

from ..model.action_expert import LN_EPS, ActionExpert, KnownActions, flow_times
from ..model.layers import FusableProjection
from .fp8 import quantize
from .kernels.expert_flow import (
    CROSS,
    CROSS_OUT,
    CROSS_Q,
    FC1,
    FC2,
    IN,
    OUT,
    PERSISTENT,
    PHASE_NAMES,
    QKV,
    REUSE,
    SELF,
    flow_kernel,
    phase_kernel,
)

if TYPE_CHECKING:
    from .fused_expert_cuda import CudaFold

BLOCK_PHASES = (QKV, SELF, CROSS_Q, CROSS, CROSS_OUT, FC1, FC2)
MAX_ROWS = 128          # batch entries x horizon the kernel takes (8 observations of 16 actions)
SPIN_LIMIT = 1 << 22    # polls of a grid barrier before it gives up (~seconds): see flow_kernel
# Every dot of the kernel takes one batch entry's rows (a tile of BLOCK_H >= horizon rows), so a
# batch costs loops, not larger tiles. Tiles of 64 rows or more would compile to Hopper's wgmma,
# which in the persistent loop's code (Triton 3.6) read shared memory out of range on the H200
# (memcheck, the self-attention's p @ v; fine with DISABLE_MMA_V3=1 and in per-phase launches,
# BENCHMARKS.md, issue 22): horizons above this run one launch per phase.
PERSISTENT_MAX_TOKENS = 32
BACKENDS = ("auto", "triton", "cuda")


@dataclass(frozen=True)
class Tiling:
    """How the work is cut. `programs` 0: one per SM (the GPU), 5 under the interpreter."""
    programs: int = 0
    x_tile: int = 64          # columns of the residual stream per tile (its writers, the LN statistics)
    block_k: int = 256        # K chunk of the LayerNorm linears (at most four chunks a row: larger if needed)
    fc2_block_k: int = 128
    block_keys: int = 128     # keys of a chunk: the plan makes one chunk cover a key split when it can
    key_splits: int = 0       # key splits per (entry, head) of the cross-attention; 0: as many as fill the programs
    num_warps: int = 8
    persistent: bool = True   # one launch per loop (GPU only); False: one launch per phase
    # Load each phase's first weights between a program's arrival at the barrier before it and
    # its wait (persistent only): their memory latency runs while the other programs finish.
    hoist: bool = True
    cooperative: bool = True  # a cooperative launch: CUDA guarantees every program is resident
    # Each program's start and end time of every phase (globaltimer ns) into Buffers.trace
    # (persistent only): what the benchmark's anatomy table reads.
    trace: bool = False


def interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _projection(proj: FusableProjection) -> tuple[torch.Tensor, torch.Tensor]:
    if proj.fused_weight is not None:
        return proj.fused_weight, proj.fused_bias
    linears = [getattr(proj, n) for n in proj.names]
    return torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears])


@dataclass
class Stack:
    """One kind of linear of every block: weight [depth, N, K], bias [depth, N], scale [depth, N]
    (fp32, e4m3 only; else None)."""
    weight: torch.Tensor
    bias: torch.Tensor
    scale: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, pairs: list[tuple[torch.Tensor, torch.Tensor]], fp8: bool) -> "Stack":
        weight = torch.stack([w.detach() for w, _ in pairs]).contiguous()
        bias = torch.stack([b.detach() for _, b in pairs]).contiguous()
        if not fp8:
            return cls(weight, bias)
        values, scale = quantize(weight, rowwise=True)
        return cls(values.contiguous(), bias, scale.reshape(weight.shape[:2]).contiguous())

    def dequantized(self, j: int) -> torch.Tensor:
        w = self.weight[j]
        return w if self.scale is None else w.float() * self.scale[j][:, None]


@dataclass
class FlowInputs:
    """What one flow schedule gives the kernel: modulations of every step and block [steps,
    depth, 9w] and of the final layer [steps, 2w] (model dtype), and per step the step whose
    velocity it reuses or -1 (int32 on the device, and on the host for the per-phase loop).
    cuda_fold: what the CUDA kernel's folded cross-attention queries (and LayerNorms) need of the
    schedule (fused_expert_cuda.CudaFlow.fold; None: the kernel runs the cross_q phase)."""
    mods: torch.Tensor
    final_mods: torch.Tensor
    reuse: torch.Tensor
    reuse_host: tuple[int, ...]
    cuda_fold: Optional[CudaFold] = None

    @property
    def steps(self) -> int:
        return len(self.reuse_host)


@dataclass
class Buffers:
    """Scratch of one (batch entries, context keys): everything the kernel writes."""
    plan: dict
    xa: torch.Tensor       # [M, A] fp32 the actions being integrated
    vel: torch.Tensor      # [steps, M, A] each computed step's velocity (model dtype)
    x: torch.Tensor        # [M, w] fp32 the residual stream
    stats: torch.Tensor    # [2, x tiles, BLOCK_M] per tile mean and M2
    qkv: torch.Tensor      # [M, 3w]
    q: torch.Tensor        # [M, w] cross-attention queries
    y: torch.Tensor        # [M, w] cross-attention output
    hidden: torch.Tensor   # [M, mlp]
    o_part: torch.Tensor   # cross-attention partials [entries * heads * splits, BLOCK_H, BLOCK_D]
    m_part: torch.Tensor
    l_part: torch.Tensor
    part: torch.Tensor     # x-tile partial sums (over heads or K splits)
    counter: torch.Tensor  # int32, left at zero by every phase
    barrier: torch.Tensor  # int32 [1], zeroed before each persistent launch
    error: torch.Tensor    # int32 [1], set when a grid barrier timed out (sticky)
    kv: torch.Tensor       # [depth, 2, entries, heads, keys, hd] the context K/V, packed per call
    trace: Optional[torch.Tensor] = None  # int64 [programs, segments, 2] with Tiling(trace=True)


_INSTANCES: "weakref.WeakValueDictionary[int, FusedExpert]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


class FusedExpert:
    """The expert's flow loop on the fused kernel. Not re-entrant across streams: calls share
    scratch. The weights are copies: the expert may change afterwards without effect."""

    def __init__(self, expert: ActionExpert, fp8: bool = False, tiling: Tiling = Tiling(), backend: str = "triton",
                 cuda_tiling=None):
        if backend not in BACKENDS:
            raise ValueError(f"fused expert backend must be one of {BACKENDS}, got {backend!r}")
        cfg = expert.cfg
        self.expert, self.fp8, self.tiling = expert, fp8, tiling
        self.width, self.heads, self.mlp, self.action_dim = cfg.width, cfg.heads, cfg.mlp, cfg.action_dim
        self.head_dim = cfg.width // cfg.heads
        if self.width % 16 or self.head_dim % 8:
            raise ValueError(f"the fused expert needs a width divisible by 16 and head_dim by 8, got {self.width} "
                             f"and {self.head_dim}")
        self.depth = len(expert.blocks)
        self.dtype = expert.action_pos.dtype
        blocks = expert.blocks
        self.qkv = Stack.of([_projection(b.self_qkv) for b in blocks], fp8)
        self.self_out = Stack.of([(b.self_out.weight, b.self_out.bias) for b in blocks], fp8)
        self.cross_q = Stack.of([(b.cross_q.weight, b.cross_q.bias) for b in blocks], fp8)
        self.cross_out = Stack.of([(b.cross_out.weight, b.cross_out.bias) for b in blocks], fp8)
        self.fc1 = Stack.of([(b.fc1.weight, b.fc1.bias) for b in blocks], fp8)
        self.fc2 = Stack.of([(b.fc2.weight, b.fc2.bias) for b in blocks], fp8)
        self._buffers: dict[tuple, Buffers] = {}
        # backend "cuda": the loop on kernels/expert_flow.cu (fused_expert_cuda.py), "triton": Triton's,
        # "auto": the CUDA kernel on a Hopper GPU (where it is measured and tested) for an expert it
        # takes, else Triton's.
        self.cuda = None
        if backend == "auto":
            from .fused_expert_cuda import unsupported
            device = self.qkv.weight.device
            hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            backend = "cuda" if hopper and unsupported(self) is None else "triton"
        self.backend = backend
        if backend == "cuda":
            from .fused_expert_cuda import CudaFlow, CudaTiling
            self.cuda = CudaFlow(self, cuda_tiling or CudaTiling())
        self.handle = next(_IDS)
        _INSTANCES[self.handle] = self

    def stacks(self) -> list[Stack]:
        return [self.qkv, self.self_out, self.cross_q, self.cross_out, self.fc1, self.fc2]

    def weight_bytes(self) -> int:
        """Bytes of block weights (and scales) one flow step reads."""
        return sum(t.numel() * t.element_size() for s in self.stacks() for t in (s.weight, s.scale) if t is not None)

    @property
    def persistent(self) -> bool:
        return self.tiling.persistent and not interpreting()

    def runs_persistent(self, buf: Buffers) -> bool:
        """Whether a call with these buffers is one persistent launch (else one per phase)."""
        return self.persistent and buf.plan["BLOCK_H"] <= PERSISTENT_MAX_TOKENS

    # -- inputs --------------------------------------------------------------------------------
    def schedule(self, mod_table: list, reuse: Optional[dict[int, int]] = None) -> FlowInputs:
        """FlowInputs of ActionExpert.modulations per flow step (mod_table[i] = (block mods
        [1, 9w] each, final [1, 2w])) and an action-cache reuse map {step: computed step}."""
        reuse = reuse or {}
        host = tuple(reuse.get(i, -1) for i in range(len(mod_table)))
        device = mod_table[0][1].device
        mods = torch.stack([torch.cat(blocks) for blocks, _ in mod_table]).contiguous()
        return FlowInputs(mods, torch.cat([final for _, final in mod_table]).contiguous(),
                          torch.tensor(host, dtype=torch.int32, device=device), host,
                          self.cuda.fold(mods) if self.cuda is not None else None)

    def _compute_dtype(self) -> torch.dtype:
        """Of the intermediates the dots read: the dots' operand type (fp32 under the interpreter)."""
        return torch.float32 if interpreting() else self.dtype

    def _programs(self, device) -> int:
        if self.tiling.programs:
            return self.tiling.programs
        if interpreting() or torch.device(device).type != "cuda":
            return 5
        return torch.cuda.get_device_properties(device).multi_processor_count

    def _plan(self, entries: int, tokens: int, n_keys: int, device) -> dict:
        """The kernel's tiling constants for a shape."""
        t, w, m = self.tiling, self.width, entries * tokens
        if m > MAX_ROWS:
            raise ValueError(f"the fused expert takes at most {MAX_ROWS} rows (batch * horizon), got {m}")
        programs = self._programs(device)
        block_m = _pow2(m)
        # K chunks of BK columns (a power of two dividing the width), at most four: their loads are
        # issued together (kernels/expert_flow.py). block_k, or the smallest chunk that makes four.
        chunks = [c for c in (16 << i for i in range(8)) if w % c == 0 and w // c <= 4]
        if not chunks:
            raise ValueError(f"the fused expert needs a width that is at most 4 chunks of a power of two, got {w}")
        bk = max([c for c in chunks if c <= t.block_k] or chunks[:1])
        xt = min(t.x_tile, _pow2(w))
        nt = triton.cdiv(w, xt)

        def cols(n: int) -> tuple[int, int]:
            c = triton.cdiv(n, programs)
            return c, _pow2(c)

        fc2_splits = max(1, programs // nt)
        fc2_k = 16 * triton.cdiv(triton.cdiv(self.mlp, fc2_splits), 16)
        fc2_splits = triton.cdiv(self.mlp, fc2_k)
        key_splits = t.key_splits or 1 << max(0, (programs // (entries * self.heads)).bit_length() - 1)
        keys_per_split = 8 * triton.cdiv(triton.cdiv(n_keys, key_splits), 8)  # 16-byte aligned rows
        (qkv_cols, qkv_bn), (cq_cols, cq_bn), (fc1_cols, fc1_bn) = cols(3 * w), cols(w), cols(self.mlp)
        return dict(
            programs=programs, keys_per_split=keys_per_split,
            ENTRIES=entries, W=w, HEADS=self.heads, HD=self.head_dim, MLP=self.mlp, A=self.action_dim,
            TOKENS=tokens, DEPTH=self.depth, XT=xt, NT=nt, NT_P2=_pow2(nt, 2), BLOCK_M=block_m,
            BLOCK_H=_pow2(tokens), BLOCK_D=_pow2(self.head_dim), BLOCK_A=_pow2(self.action_dim), BK=bk,
            QKV_COLS=qkv_cols, QKV_BN=qkv_bn, CQ_COLS=cq_cols, CQ_BN=cq_bn, FC1_COLS=fc1_cols, FC1_BN=fc1_bn,
            FC2_SPLITS=fc2_splits, FC2_K=fc2_k,
            FC2_BK=max(min(t.fc2_block_k, _pow2(fc2_k)), _pow2(triton.cdiv(fc2_k, 4))),  # at most four chunks
            KEY_SPLITS=key_splits, BLOCK_KEYS=min(t.block_keys, _pow2(keys_per_split)))

    def buffers(self, entries: int, tokens: int, n_keys: int, steps: int, device) -> Buffers:
        """The scratch of a shape, made on its first call (warm up before capturing a graph, as
        the runner does, so nothing is allocated inside the capture)."""
        key = (entries, tokens, n_keys, steps, torch.device(device))
        if key not in self._buffers:
            plan = self._plan(entries, tokens, n_keys, device)
            m, w, heads, a = entries * tokens, self.width, self.heads, self.action_dim
            parts = entries * heads * plan["KEY_SPLITS"] * plan["BLOCK_H"]
            inner = self._compute_dtype()
            with torch.device(device):
                f32 = dict(dtype=torch.float32)
                self._buffers[key] = Buffers(
                    plan=plan, xa=torch.empty((m, a), **f32), vel=torch.empty((steps, m, a), dtype=self.dtype),
                    x=torch.empty((m, w), **f32), stats=torch.empty((2, plan["NT"], plan["BLOCK_M"]), **f32),
                    qkv=torch.empty((m, 3 * w), dtype=inner), q=torch.empty((m, w), dtype=inner),
                    y=torch.empty((m, w), dtype=inner), hidden=torch.empty((m, self.mlp), dtype=inner),
                    o_part=torch.empty((parts, plan["BLOCK_D"]), **f32), m_part=torch.empty(parts, **f32),
                    l_part=torch.empty(parts, **f32),
                    part=torch.empty(plan["NT"] * max(heads, plan["FC2_SPLITS"]) * plan["BLOCK_M"] * plan["XT"],
                                     **f32),
                    counter=torch.zeros(max(plan["NT"], entries * heads), dtype=torch.int32),
                    barrier=torch.zeros(1, dtype=torch.int32), error=torch.zeros(1, dtype=torch.int32),
                    kv=torch.empty((self.depth, 2, entries, heads, n_keys, self.head_dim), dtype=self.dtype))
        return self._buffers[key]

    def barrier_timed_out(self) -> bool:
        """Whether a persistent launch ever gave up waiting at a grid barrier (its programs were
        not all resident: the results of that launch are wrong). Syncs: call it after warm-up."""
        return (any(bool(b.error.item()) for b in self._buffers.values())
                or (self.cuda is not None and self.cuda.barrier_timed_out()))

    # -- calls ---------------------------------------------------------------------------------
    def flow(self, noise: torch.Tensor, inputs: FlowInputs, kv: list[tuple[torch.Tensor, torch.Tensor]],
             ctx_mask: Optional[torch.Tensor] = None, known: Optional[KnownActions] = None) -> torch.Tensor:
        """The Euler loop of ActionExpert from noise [B, H, A] (fp32) over inputs.steps steps:
        kv from ActionExpert.context_kv ([B, heads, T+1, hd] each), ctx_mask [B|1, 1, 1, T+1]
        bool -> actions [B, H, A] fp32 (a view of scratch, valid until the next call).
        `known` (real-time chunking by inpainting): the loop runs one step per launch and the known
        rows are inpainted between them with torch ops (capturable), as model.action_expert.euler
        does; without it the loop stays one launch."""
        buf = self.prepare(noise, inputs.steps, kv, ctx_mask)
        if known is None:
            self._run(buf, inputs, ctx_mask, euler=True)
            return buf.xa.view(noise.shape)
        if self.tiling.trace and self.cuda is None:
            raise ValueError("Tiling(trace=True) times the loop's one launch; with known actions it runs one per step")
        actions = buf.xa.view(noise.shape)
        for i, t in enumerate(flow_times(inputs.steps)):
            actions.copy_(known.inpaint(actions, noise, t))
            self._run(buf, inputs, ctx_mask, euler=True, steps=range(i, i + 1))
        actions.copy_(known.inpaint(actions, noise, 1.0))
        return actions

    def velocity(self, x: torch.Tensor, mods: tuple[list[torch.Tensor], torch.Tensor],
                 kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As ActionExpert.velocity: x [B, H, A], mods from ActionExpert.modulations -> velocity
        [B, H, A] in the model dtype."""
        block_mods, final_mod = mods
        return fused_expert_velocity(self.handle, x, list(block_mods), final_mod, [k for k, _ in kv],
                                     [v for _, v in kv], ctx_mask)

    def prepare(self, x: torch.Tensor, steps: int, kv: list, ctx_mask: Optional[torch.Tensor] = None):
        """The scratch for actions x [B, H, A], with x and the context K/V copied in (K and V of
        every block into the kernel's layout in one batched copy): Buffers, or the CUDA
        backend's Scratch."""
        if self.cuda is not None:
            return self.cuda.prepare(x, steps, kv, ctx_mask)
        buf = self.buffers(x.shape[0], x.shape[1], kv[0][0].shape[2], steps, x.device)
        torch.stack([t for pair in kv for t in pair], out=buf.kv.view(-1, *buf.kv.shape[2:]))
        buf.xa.copy_(x.reshape(buf.xa.shape))
        return buf

    def _run(self, buf: Buffers, inputs: FlowInputs, ctx_mask: Optional[torch.Tensor], euler: bool,
             steps: Optional[range] = None) -> None:
        """Flow steps `steps` (default: all) in one persistent launch (its barrier counts from zero
        per launch), or one launch per phase."""
        steps = steps or range(inputs.steps)
        if self.cuda is not None:
            self.cuda.run(buf, inputs, euler, steps)
            return
        if self.runs_persistent(buf):
            buf.barrier.zero_()
            if self.tiling.trace:
                shape = (buf.plan["programs"], self.segments(inputs), 2)
                if buf.trace is None or buf.trace.shape != shape:
                    buf.trace = torch.zeros(shape, dtype=torch.int64, device=buf.x.device)
            self._launch(buf, inputs, ctx_mask, PERSISTENT, steps.start, steps.stop, 0, euler)
            return
        for _, _, launch in self.phase_launches(buf, inputs, ctx_mask, euler, steps):
            launch()

    def segments(self, inputs: FlowInputs) -> int:
        """Phases of the persistent loop, a grid barrier after each (a reused step: one)."""
        return sum(1 if r >= 0 else 2 + len(BLOCK_PHASES) * self.depth for r in inputs.reuse_host)

    def phase_launches(self, buf: Buffers, inputs: FlowInputs, ctx_mask: Optional[torch.Tensor],
                       euler: bool = True,
                       steps: Optional[range] = None) -> list[tuple[str, int, Callable[[], None]]]:
        """Flow steps `steps` (default: all) as one launch per phase, in order, each named (phase,
        block): what the persistent kernel runs between its barriers (the benchmark times each
        phase alone)."""
        calls = []

        def add(phase, step: int, block: int = 0) -> None:
            calls.append((PHASE_NAMES[phase], block,
                          lambda: self._launch(buf, inputs, ctx_mask, phase, step, step + 1, block, euler)))

        for i in steps or range(inputs.steps):
            if inputs.reuse_host[i] >= 0:
                add(REUSE, i)
                continue
            add(IN, i)
            for j in range(self.depth):
                for phase in BLOCK_PHASES:
                    add(phase, i, j)
            add(OUT, i)
        return calls

    def _launch(self, buf: Buffers, inputs: FlowInputs, ctx_mask: Optional[torch.Tensor], phase, lo: int, hi: int,
                block: int, euler: bool) -> None:
        e, plan, t = self.expert, buf.plan, self.tiling
        mask = ctx_mask.reshape(ctx_mask.shape[0], -1) if ctx_mask is not None else None
        constants = {k: v for k, v in plan.items() if k.isupper()}
        dot = torch.float32 if interpreting() or self.dtype == torch.float32 else self.dtype
        options = dict(num_warps=t.num_warps, num_stages=1)
        if phase == PERSISTENT and t.cooperative and _has_cooperative_launch():
            options["launch_cooperative_grid"] = True
        scales = [s.scale if s.scale is not None else s.bias for s in self.stacks()]
        weights = [x for s, scale in zip(self.stacks(), scales) for x in (s.weight, s.bias, scale)]
        kernel = flow_kernel if phase == PERSISTENT else phase_kernel
        kernel[(plan["programs"],)](
            buf.xa, buf.vel, inputs.reuse, *weights,
            e.action_in.weight, e.action_in.bias, e.action_pos, e.action_out.weight, e.action_out.bias,
            inputs.mods, inputs.final_mods, buf.kv, mask if mask is not None else buf.kv,
            buf.kv.shape[4] if mask is not None and mask.shape[0] > 1 else 0,
            buf.x, buf.stats, buf.qkv, buf.q, buf.y, buf.hidden, buf.o_part, buf.m_part, buf.l_part, buf.part,
            buf.counter, buf.barrier, buf.error, buf.trace if buf.trace is not None else buf.counter,
            buf.xa.shape[0], buf.kv.shape[4], plan["keys_per_split"], lo, hi, block, 1.0 / inputs.steps, LN_EPS,
            1.0 / math.sqrt(self.head_dim),
            PHASE=phase, EULER=euler, HAS_MASK=mask is not None, DOT=_triton_dtype(dot),
            PREC="ieee" if dot == torch.float32 else "tf32", SCALED=self.fp8,
            HOIST=t.hoist, SPIN_LIMIT=SPIN_LIMIT, TRACE=t.trace and phase == PERSISTENT,
            SEGMENTS=self.segments(inputs) if t.trace else 1, **constants, **options)

    def run_velocity(self, x: torch.Tensor, block_mods: list[torch.Tensor], final_mod: torch.Tensor,
                     keys: list[torch.Tensor], values: list[torch.Tensor],
                     ctx_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """One flow step's velocity (the custom op's body)."""
        inputs = FlowInputs(torch.cat(block_mods).unsqueeze(0), final_mod.reshape(1, -1),
                            self._no_reuse(x.device), (-1,))
        buf = self.prepare(x, 1, list(zip(keys, values)), ctx_mask)
        self._run(buf, inputs, ctx_mask, euler=False)
        return buf.vel[0].view(x.shape).clone()

    def _no_reuse(self, device) -> torch.Tensor:
        if not hasattr(self, "_reuse_none"):
            self._reuse_none = torch.full((1,), -1, dtype=torch.int32, device=device)
        return self._reuse_none


def _triton_dtype(dtype: torch.dtype):
    import triton.language as tl
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _has_cooperative_launch() -> bool:
    """Whether this Triton can launch a cooperative grid (3.3 and later)."""
    from triton.backends.nvidia.compiler import CUDAOptions
    return "launch_cooperative_grid" in CUDAOptions.__dataclass_fields__


@torch.library.custom_op("vla::fused_expert_velocity", mutates_args=())
def fused_expert_velocity(handle: int, x: torch.Tensor, block_mods: list[torch.Tensor], final_mod: torch.Tensor,
                          keys: list[torch.Tensor], values: list[torch.Tensor],
                          ctx_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return _INSTANCES[handle].run_velocity(x, block_mods, final_mod, keys, values, ctx_mask)


@fused_expert_velocity.register_fake
def _(handle, x, block_mods, final_mod, keys, values, ctx_mask):
    expert = _INSTANCES[handle]
    return x.new_empty((x.shape[0], x.shape[1], expert.action_dim), dtype=expert.dtype)
