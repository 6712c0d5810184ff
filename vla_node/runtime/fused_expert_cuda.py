"""FusedExpert's CUDA backend: the flow loop on kernels/expert_flow.cu, one persistent launch.

    cuda = CudaFlow(fused)                          # weights re-laid out once, in fragment order
    buf = cuda.prepare(noise, steps, kv, ctx_mask)  # scratch of the shape; x and K/V copied in
    cuda.run(buf, inputs, euler, steps)             # the steps in one launch

What it takes (else `unsupported` says why and FusedExpert keeps the Triton kernel): a bf16
expert on a CUDA GPU (or on the CPU, where the same kernel source runs as a host build, slowly:
the suite's check of it), width and MLP multiples of 256 (each of 8 warps takes an even number of
k-steps), a head dim multiple of 16, horizons up to 32 (padded to tiles of 16 rows), at most 128
padded rows (8 observations of 16 actions). e4m3 weights (FusedExpert(fp8=True)): a byte an element
in the same order, made bf16 exactly at each product, a scale an output column in the epilogue.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ..model.action_expert import LN_EPS
from .fp8 import quantize
from .kernels.expert_flow_cuda import THREADS, FlowKernel, HostKernel, Params, available, programs_held
from .kernels.pack_kv import pack_kv

MAX_ROWS = 128
SMEM_LIMIT = 227 * 1024   # shared memory a program may have on sm_90 (opt-in maximum)
SPIN_LIMIT = 1 << 22   # polls of a grid barrier before it gives up (programs not all resident)
BLOCK_PHASES = ("qkv", "self", "self_out", "cross_q", "cross", "cross_out", "fc1", "fc2")
# The kernel's pointers to each stack of FusedExpert.stacks(): weights, biases, e4m3 scales
WEIGHTS, BIASES = ("wqkv", "wso", "wq", "wco", "w1", "w2"), ("bqkv", "bso", "bq", "bco", "b1", "b2")
SCALES = ("wsc_qkv", "wsc_so", "wsc_q", "wsc_co", "wsc_1", "wsc_2")
HOST_PROGRAMS = 8   # programs of the CPU build (fibers: 256 a program); at least the (entry, head) pairs
HOST_SMEM_LIMIT = 1 << 20   # the CPU build's shared memory is a host allocation: no sm_90 limit to fit


@dataclass(frozen=True)
class CudaTiling:
    """The kernel's measurement knobs (expert_flow.cu): how a barrier polls (0 acquire loads, 1
    atomic adds of 0, 2 relaxed loads and one fence, 3 a flag a program), per-segment timestamps,
    and `work` False: only the loads and barriers (the loop's synchronisation floor; wrong numbers).
    (4, each cluster's first program polling for the rest, was slower at every B on the H100: the
    loop 10.26 against 8.62 ms at B = 1: BENCHMARKS.md, twenty-ninth session.)"""
    poll: int = 0
    # the warp whose first lane polls a barrier (0 .. 7): thread 0 also issues a phase's loads
    # before the wait (weights, the first key tile, the epilogue's inputs), which queues its polls:
    # the last warp polls (H100: loop -2.2 % at B = 1, -1.3 % at B = 4, bit-identical)
    poll_warp: int = 7
    trace: bool = False
    work: bool = True
    # measurement: the cross-attention's programs merge their own warps' partials but not each
    # other's (what the merge across programs costs; wrong numbers)
    cross_cut: bool = False
    # measurement (trace): where the cross-attention phase puts its two marks. 0: once its queries
    # are made and once its warps are merged; 1: once its key tiles are done and once its warps are
    # merged; 2: once its first query fragments are made and once its first key tile's K has
    # arrived (its Q K^T issued)
    cross_marks: int = 0
    # the LayerNorm statistics stored tile-major (expert_flow.cu, stats_at): the statistics' reads
    # coalesced where 1-2 threads read a row. None: where entries >= 4 (on the H200 with epi_split 4
    # the loop 19.36 -> 18.58 ms at B = 4, 32.66 -> 27.20 at B = 8; at B = 1 9.40 -> 11.26:
    # BENCHMARKS.md, tenth session)
    stats_t: Optional[bool] = None
    # threads of a GEMV epilogue's (tile, row) item of 8 columns (1, 2 or 4): at 4, 4x the threads
    # sum the warps' partials and apply bias, gate and residual (at B = 1 a phase of one tile a
    # program has 16 items: 16 threads of 256 did it). Same numbers bit for bit; on the H200 the
    # loop 9.87 -> 9.40 ms at B = 1, 13.28 -> 12.91 at B = 2, unchanged at B = 4, 8
    epi_split: int = 4
    # output tiles of 8 columns a program takes in the LayerNorm linears (at least as many as
    # cover them): more a program, fewer programs read the residual stream. fc1_tpc None: 4 at
    # B <= 3 (on the H200 (132 SMs) 96 programs instead of 128, the loop 0.4-0.7 ms faster at B = 1,
    # ninth session; on the H100 the same as 3 at B = 1 to 3) and 0 from B = 4, where on the H100 the
    # 128 programs of 3 tiles were 1.9-3.5 % faster in two runs or more at B = 4, 6, 8 (B = 4 15.21-15.32
    # against 15.55-15.66 ms: fc1's release 2.25 -> 1.50 us; BENCHMARKS.md, forty-first session)
    qkv_tpc: int = 0
    cq_tpc: int = 0
    fc1_tpc: Optional[int] = None
    # the same for the phases that read a produced buffer (self_out and cross_out the attention
    # output, fc2 the MLP hidden, a group of fc2_split programs sharing its tiles): every program
    # reads all of its rows, so more tiles a program, fewer programs read them
    # (0: as few tiles as cover the outputs; co_tpc None: 2 at B <= 2, where on the H100 the loop
    # was 0.3-1.3 % faster in three runs, and 0 at B >= 4, where it was 2 % slower; more tiles for
    # self_out or fc2 were no faster at any B: BENCHMARKS.md, twenty-eighth session)
    so_tpc: int = 0
    co_tpc: Optional[int] = None
    fc2_tpc: int = 0
    # the cross-attention's programs of an (entry, head) launched as one thread-block cluster of
    # this many, merging their partials through distributed shared memory instead of global memory
    # and an atomic; the launch then has as many programs as the GPU holds in such clusters (the
    # H200: 120 in clusters of 4 or 8, 132 of 2). 0: the largest of 8, 4, 2 that holds every
    # (entry, head) (on the H200 the loop 10.8 -> 9.9 ms at B = 1, 36.5 -> 33.1 at B = 8:
    # BENCHMARKS.md, ninth session); 1: no clusters
    cluster: int = 0
    # an (entry, head)'s programs as this many clusters (with clusters): each cluster merges its
    # programs' partials in distributed shared memory, the pair's last program the clusters' through
    # global memory. Clusters of 4 and 8 hold 120 programs on an H100 or H200, so at B = 4 a pair
    # gets one cluster of 2 (64 of 132 programs at work, 28 key tiles each, up to 4 a warp one after
    # the other; at B = 1 and 2 also 64): 2 groups give B = 4 128 programs of 14 tiles. None: 2 where
    # the cluster is 2 and a pair's two fit (molmobot-4b on 132 SMs: B = 4), where on the H100 the loop
    # was 1.2-1.4 % faster in two runs (B = 4 14.81-14.83 against 15.00-15.01 ms: the key tiles 8.25 ->
    # 5.50 us a block, the merge 1.75 -> 3.75; larger clusters in groups were slower at B = 1 and 2:
    # BENCHMARKS.md, forty-second session; on the H200 14.41-14.45 against 14.85 with one group:
    # forty-fifth session), else 1
    cross_groups: Optional[int] = None
    # with clusters, every cross-attention program's partial merged by its pair's last program through
    # global memory (as without clusters), none in distributed shared memory: one merge instead of a
    # cluster's and then the groups' (at B = 4 with 2 groups the merge took 3.75 us a block against one
    # cluster's 1.75); the clusters then serve fc2's split alone. On the H200 slower at every B: the loop
    # 8.21 -> 9.23 ms at B = 1, 10.89 -> 11.64 at B = 2, 14.45 -> 14.91 at B = 4 (BENCHMARKS.md,
    # forty-fifth session)
    cross_global: bool = False
    # self_out computes its own warp's head of the self-attention (no self phase, one barrier less;
    # heads = 8 and head_dim = width / 8 only): every self_out program reads all of q, k, v
    fuse_self: bool = False
    # the self-attention computed by self_out's programs, each of a cross-attention cluster a share
    # of its (entry, head) items into its shared memory, self_out's A fragments read from there
    # (distributed shared memory): no self phase and its barrier, each item computed once a cluster
    # (every program of fuse_self computes all of them). Needs clusters and at most 8 items a
    # program (molmobot-4b: B <= 2). The same numbers bit for bit. On the H200 slower: the loop
    # 9.40 -> 9.49 ms at B = 1, 12.47 -> 12.72 at B = 2 (the items and the cluster barrier took
    # self_out 2 us, the self phase and its barrier 2.25: BENCHMARKS.md, tenth session)
    self_cluster: bool = False
    # the cross-attention's key tiles copied into shared memory by one bulk copy a block, issued
    # before the block's first phase (so they land while qkv .. self_out run); cross_programs:
    # programs per (entry, head) (0: a cluster's, else as few as fit). Off: on the H200 no faster
    # without clusters (sixth session) nor with them (the loop 8.66 -> 8.70 ms at B = 1, 11.31 ->
    # 11.19 at B = 2; B >= 4's tiles do not fit: BENCHMARKS.md, twenty-fourth session)
    kv_smem: bool = False
    cross_programs: int = 0
    # the LayerNorm phases read the residual stream's bf16 copy in A-fragment order (one 16-byte
    # load a k-step) instead of its fp32 values: half the bytes every program of those phases reads.
    # On the H200 the LayerNorm phases 1.75-2 us shorter each (BENCHMARKS.md, eighth session). Its row
    # tiles (and the statistics, and self_out's and cross_out's A operand) copied into shared memory by
    # the copy engine after each wait, a bulk copy or a cluster's multicast a row tile, were slower at
    # every B on the H200: the loop 8.21 -> 8.92-11.48 ms at B = 1, 14.45 -> 15.24-17.14 at B = 4, the
    # copies' wait holding even the dots (removed: BENCHMARKS.md, forty-fifth session)
    x_frags: bool = True
    # the cross-attention's queries folded into the qkv and self_out phases (expert_flow.cu, Part2):
    # no cross_q phase and its barrier; per schedule the host makes an M = Wq diag((1 + c2) g1) Wso
    # for every step and block (steps x depth x width^2 bf16: 425 MB at 10 steps of molmobot-4b).
    # With x_frags on the H200: the loop 12.5 -> 10.7 ms at B = 1, 24.2 -> 19.3 at B = 4
    fold_cross_q: bool = True
    # with fold_cross_q, the LayerNorms of qkv and fc1 folded into their epilogues (expert_flow.cu,
    # FOLD_LN): the dots read x (1 + c), each warp takes its rows' mean and M2 from the values in its
    # registers, and the epilogue applies rstd (. - mean rho) + delta, rho and delta made per schedule
    # (steps x depth x (6 width + 2 mlp) fp32: 2.8 MB at 10 steps of molmobot-4b). No program reads
    # the stored 8-column statistics of every row before its dots (at B = 4 49 KB a program, ~1.3 ms of
    # the loop's gap to 1.5x its B = 1 time in the forty-fifth session's anatomy). Untimed: off.
    fold_ln: bool = False
    # each GEMV phase's weights copied into shared memory by the copy engine (cp.async.bulk, two
    # buffers) while the phase before it runs, instead of loaded into registers by every thread
    # between its arrival and its wait (off where two buffers do not fit). None: at B = 1 (with
    # fc2's K unsplit). A program's 48 KB of weight loads hold its warps ~1.5-2 us wherever they are
    # issued (before a wait: that barrier's release); the copy engine holds none. On the H100 the loop
    # 9.06 -> 8.90 ms at B = 1 (qkv's release 2.00 -> 1.25 us, fc2's 1.75 -> 1.25), 11.89 -> 12.06
    # at B = 2 (fc2 unsplit); on the H200 9.40 -> 9.32 at B = 1 (BENCHMARKS.md, tenth and
    # twenty-fourth sessions)
    weights_smem: Optional[bool] = None
    # each GEMV phase's weights (a program's own tiles) pulled into L2 by the copy engine
    # (cp.async.bulk.prefetch.L2) from the start of the phase before it, and the cross-attention's
    # key tiles from the start of the block: the loads before a phase's wait then come from L2
    # (without weights_smem). On the H200 no faster: B = 1 / 2 / 4 / 8 9.38 / 12.56 / 18.25 / 27.47 ms
    # against 9.39 / 12.90 / 18.43 / 27.08 (BENCHMARKS.md, tenth session). 2: the key tiles only (on the
    # H100 slower: thread 0's bulk prefetch at the block's start held qkv's release, 2.00 -> 2.75 us,
    # when thread 0 also polled the barriers). 3: the key tiles only, from qkv's arrival (the self
    # phase reads no weights; at B = 4 a block's 11.6 MB of K/V were read inside the cross phase).
    # None: 3 at B <= 2, where on the H100 the loop was 1.3-2.1 % faster in two runs (B = 1 8.44-8.46
    # against 8.55-8.62 ms), and 0 from B = 4, where it was 1-3 % slower (BENCHMARKS.md, twenty-ninth session)
    l2_prefetch: Optional[int] = None
    # a GEMV phase's weights loaded into registers after its wait instead of between the arrival
    # before it and the wait. On the H100 qkv's, fc1's and fc2's releases 0.75-1.0 us shorter (the
    # loads in flight hold the barrier's release) and their work 1.25-1.5 us longer: the loop 9.06 ->
    # 9.48 ms at B = 1 (BENCHMARKS.md, twenty-fourth session)
    late_weights: bool = False
    # e4m3 weights (FusedExpert(fp8=True)) made bf16 once a phase, after its wait, and held in
    # registers as the bf16 kernel holds its weights, instead of at each use: once a row tile, i.e.
    # B times at horizon 16. On the H200 the e4m3 loop at B = 4 16.52 -> 16.20 ms (bf16's 15.41), at
    # B = 1 9.11 -> 9.15 (BENCHMARKS.md, twenty-sixth session)
    fp8_hold: bool = False
    # the cross-attention's warps load the next key tile's mask bits and pull its K/V into L2 while
    # the current tile computes (where a warp takes several tiles: B >= 2 at molmobot-4b's DROID
    # context). On the H100 the loop 11.85 -> 12.06 ms at B = 2, 15.94 -> 15.96 at B = 4, 22.27 ->
    # 21.95 at B = 8: a B = 4 warp's tiles still ~2 us each (BENCHMARKS.md, twenty-fourth session)
    kv_ahead: bool = False
    # the cross-attention's first key tile of a warp: its K loaded before the phase's wait, its V
    # after the queries are made, in flight while the tile's Q K^T and softmax run (without kv_smem).
    # None: where entries >= 2, where on the H100 the loop was 0.4 / 1.0 / 1.6 % faster at B = 2 / 4 / 8
    # in two runs each (B = 4 15.53-15.56 against 15.67-15.73 ms), and at B = 1 0.1-1.2 % slower
    # (8.47-8.54 against 8.44-8.47: BENCHMARKS.md, thirtieth session)
    v_late: Optional[bool] = None
    # k-steps of A fragments a warp loads at once in a GEMV phase (fc2's 24 k-steps a warp are 4
    # chunks of 6; the largest divisor of a warp's k-steps up to it): 12 and 24 no faster on the
    # H200 (fc2's dots at B = 4 are bound by every program reading all of the MLP hidden, not by
    # round trips). None: 3 at B = 4, where on the H100 the loop was 0.8-1.5 % faster in five runs
    # (15.00-15.15 against 15.21-15.32 ms), and 6 elsewhere (B = 3 the same, B = 6 and 8 0.3-0.5 %
    # slower at 3; BENCHMARKS.md, forty-first session): ptxas lays the whole loop out anew.
    # x_ahead: the LayerNorm phases' next row tile of residual values loaded before this one's dots:
    # on the H200 the loop 12.91 -> 12.78 ms at B = 2, 18.48 -> 18.37 at B = 4, 26.99 -> 26.35 at
    # B = 8 (BENCHMARKS.md, tenth session); B = 1 has one row tile. None: off at B = 3, where on the H100
    # the loop was 1.4-2.1 % faster off in one call (13.74-13.78 against 13.98-14.04 ms; unconfirmed), on
    # elsewhere (off at B = 2 1.0 % slower, at B = 6 and 8 3 %: BENCHMARKS.md, forty-second session)
    a_chunk: Optional[int] = None
    x_ahead: Optional[bool] = None
    # fc2's K split over this many programs of a cross-attention cluster (1, 2, 4 or 8; at most the
    # cluster, and a warp's part of K whole 16-byte loads): each program reads 1 / fc2_split of the
    # MLP hidden (at B = 4 every fc2 program read all 393 KB of it), the partial sums meet in
    # distributed shared memory (another order of fp32 sums). None: 2 where entries >= 2 (on the
    # H200 the loop 12.86 -> 12.49 ms at B = 2, 18.15 -> 17.74 at B = 4, 26.55 -> 25.95 at B = 8; at
    # B = 1 9.43 -> 9.56, and 4 no better than 2: BENCHMARKS.md, tenth session)
    fc2_split: Optional[int] = None
    # the cross-attention's warp partials stored in shared memory at a row stride of head_dim
    # padded to 8 banks mod 32 (at head_dim 96 the rows of a warp's store fell on one bank: 4-way
    # conflicts, 24 stores a warp). The same numbers bit for bit; on the H200 the loop 8.91 -> 8.60
    # ms at B = 1, 11.47 -> 11.21 at B = 2, 15.65 -> 15.34 at B = 4, 21.41 -> 21.23 at B = 8, the
    # same spills (BENCHMARKS.md, twenty-first session)
    cross_pad: bool = True

    def __post_init__(self):
        if self.cross_groups is not None and self.cross_groups < 1:
            raise ValueError(f"cross_groups: clusters an (entry, head) (at least 1), got {self.cross_groups}")
        if self.fc2_split not in (None, 1, 2, 4, 8):
            raise ValueError(f"fc2_split: 1, 2, 4 or 8 programs share fc2's K, got {self.fc2_split}")
        if (self.fc2_split or 1) > 1 and self.weights_smem:
            raise ValueError("fc2_split and weights_smem: a program's split weights are not one range to copy")
        if self.self_cluster and self.fuse_self:
            raise ValueError("self_cluster and fuse_self: two ways of one fusion, take one")
        if self.a_chunk is not None and self.a_chunk < 1:
            raise ValueError(f"a_chunk: k-steps of A fragments loaded at once (at least 1), got {self.a_chunk}")
        if self.l2_prefetch not in (None, 0, 1, 2, 3):
            raise ValueError(f"l2_prefetch: 0, 1 (weights and key tiles), 2 (key tiles) or 3 (key tiles after qkv), "
                             f"got {self.l2_prefetch}")
        if self.poll not in (0, 1, 2, 3):
            raise ValueError(f"poll: 0 .. 3 (how a barrier polls), got {self.poll}")
        if self.cross_marks not in (0, 1, 2):
            raise ValueError(f"cross_marks: 0, 1 or 2, got {self.cross_marks}")
        if not 0 <= self.poll_warp < THREADS // 32:
            raise ValueError(f"poll_warp: a warp of the program's {THREADS // 32}, got {self.poll_warp}")
        if self.epi_split not in (1, 2, 4):
            raise ValueError(f"epi_split: 1, 2 or 4 threads a GEMV epilogue's item of 8 columns, got {self.epi_split}")


def unsupported(fused) -> Optional[str]:
    """Why the CUDA kernel cannot run this expert (None: it can)."""
    if fused.dtype != torch.bfloat16:
        return f"the CUDA expert kernel runs bf16 weights, not {fused.dtype}"
    if fused.width % 256 or fused.mlp % 256 or fused.head_dim % 16:
        return (f"the CUDA expert kernel needs width and MLP multiples of 256 and a head dim multiple of 16, got "
                f"{fused.width}, {fused.mlp}, {fused.head_dim}")
    if fused.action_dim > 32:
        return f"the CUDA expert kernel takes at most 32 action dims, got {fused.action_dim}"
    return available(fused.qkv.weight.device.type)


def fragments_b(weight: torch.Tensor) -> torch.Tensor:
    """Stacked weights [depth, N, K] in the mma B-fragment order the kernel loads: [depth][N/8]
    [K/32][lane = 4 g + q][k-step s][half][e] with n = 8 tile + g, k = 32 p + 16 s + 8 half + 2 q + e
    (a lane's fragments of two k-steps: one 16-byte load, 8 bytes of e4m3 ones, passed as bytes)."""
    d, n, k = weight.shape
    if weight.dtype == torch.float8_e4m3fn:
        weight = weight.view(torch.uint8)
    return (weight.view(d, n // 8, 8, k // 32, 2, 2, 4, 2).permute(0, 1, 3, 2, 6, 4, 5, 7).contiguous())


class CudaFold(NamedTuple):
    """What the kernel's folds need of a flow schedule (CudaFlow.fold; expert_flow.cu, Part2 and LnFold)."""
    m: torch.Tensor                 # M = Wq diag((1 + c2) g1) Wso of every step and block, B-fragment order
    consts: torch.Tensor            # [steps, depth, 3, w] fp32: eps, rho, delta of the folded queries
    scales: Optional[torch.Tensor]  # e4m3 weights: m's scale a row [steps, depth, w]
    ln: Optional[torch.Tensor]      # fold_ln: [steps, depth, 6 w + 2 mlp] fp32 qkv's rho, delta, fc1's


@dataclass
class Plan:
    constants: tuple      # the kernel's -D constants (its cache key)
    programs: int
    smem: int
    key_tiles: int
    cpp: int              # programs per (entry, head) of the cross-attention
    tiles_per_cta: int


@dataclass
class Scratch:
    """Everything one shape's launches write (kernels/expert_flow.cu names the layouts)."""
    plan: Plan
    unfolded: Plan          # the plan for inputs without fold constants (one flow step's velocity)
    n_keys: int
    xa: torch.Tensor        # [B T, A] fp32 the actions being integrated
    vel: torch.Tensor       # [steps, B T, A] each computed step's velocity (bf16)
    x: torch.Tensor         # [rows, W] fp32 the residual stream (rows: B x horizon padded to 16s)
    xf: torch.Tensor        # its bf16 copy in A-fragment order (CudaTiling.x_frags; else unused)
    stats: torch.Tensor     # each 8-column tile's row mean and M2: [rows, W / 8, 2] (stats_t: [W / 8, rows, 2])
    qkv: torch.Tensor       # q, k in A-fragment order, then v in P V's B-fragment order (bf16)
    q: torch.Tensor         # cross-attention queries, A-fragment order
    y: torch.Tensor         # the self-attention's outputs, then the cross-attention's: A-fragment order
    hid: torch.Tensor       # the MLP hidden, A-fragment order
    f0: torch.Tensor        # [rows, W] fp32 x0 (1 + c2) Wq^T (fold_cross_q)
    sq: torch.Tensor        # x1 (1 + c2) Wq^T in A-fragment order, fp32 (fold_cross_q)
    opart: torch.Tensor     # cross-attention partials of each (entry, head)'s programs
    mlpart: torch.Tensor    # their maxima and sums
    counter: torch.Tensor   # int32 per (entry, head): its programs' arrivals, left at zero
    barrier: torch.Tensor   # int32 [1 + programs]: the arrival counter, then a flag a program
    error: torch.Tensor     # int32 [1], set when a grid barrier timed out (sticky)
    kv: torch.Tensor        # [depth, B, heads, key tiles, 2, 32, hd / 2] the packed context K/V
    mask: Optional[torch.Tensor] = None
    mask_stride: int = 0
    trace: Optional[torch.Tensor] = None   # int64 [programs, segments, (start, end, 2 marks)] with trace=True


def cross_cluster(t: CudaTiling, pairs: int, held: Callable[[int], int]) -> int:
    """The cross-attention's cluster size for `pairs` (entry, head) pairs (CudaTiling.cluster; 1:
    none), where held(c) programs fit on the GPU at once in clusters of c."""
    if t.cluster > 1:
        if t.cross_programs:
            raise ValueError("cross-attention clusters take no cross_programs (a cluster is a pair's programs)")
        if pairs * t.cluster > held(t.cluster):
            raise ValueError(f"cross-attention clusters of {t.cluster}: {pairs} (entry, head) pairs do not fit in the "
                             f"{held(t.cluster)} programs the GPU holds in such clusters")
        return t.cluster
    fits = [c for c in (8, 4, 2) if pairs * c <= held(c)]
    return fits[0] if t.cluster == 0 and fits and not t.cross_programs else 1


def check_shape(dims, t: CudaTiling, entries: int, tokens: int, rows: int, programs: int, cluster: int):
    self_items = rows // 16 * dims.heads
    if t.self_cluster and (cluster == 1 or self_items > 8 * cluster):
        raise ValueError(f"self_cluster: {self_items} self-attention items on clusters of {cluster} "
                         "(at most 8 a program)")
    if tokens > 32 or rows > MAX_ROWS:
        raise ValueError(f"the CUDA expert kernel takes horizons up to 32 and at most {MAX_ROWS} padded rows, "
                         f"got {entries} x {tokens}")
    if t.fold_ln and not t.fold_cross_q:
        raise ValueError("fold_ln folds qkv's and fc1's LayerNorms, with fold_cross_q (cross_q's has no constants)")
    if entries * dims.heads > programs:
        raise ValueError(f"the CUDA expert kernel needs a program per (entry, head) pair: {entries} x {dims.heads} "
                         f"on {programs} programs")


def weights_smem_of(t: CudaTiling, entries: int) -> bool:
    """Whether the GEMV phases' weights go through shared memory (CudaTiling.weights_smem; None: at
    B = 1 where fc2's K is not split)."""
    return t.weights_smem if t.weights_smem is not None else entries == 1 and (t.fc2_split or 1) == 1


def l2_prefetch_of(t: CudaTiling, entries: int) -> int:
    """What the copy engine pulls into L2 ahead (CudaTiling.l2_prefetch; None: the key tiles from
    qkv's arrival at B <= 2, nothing from B = 4)."""
    return int(t.l2_prefetch) if t.l2_prefetch is not None else 3 if entries <= 2 else 0


def fc2_split_of(t: CudaTiling, entries: int, cluster: int, mlp: int) -> int:
    """fc2's K split (CudaTiling.fc2_split): as asked, at most the cluster, and a warp's k-steps of
    its part in whole 16-byte pairs (mlp / 16 / split / 8 even)."""
    split = t.fc2_split or (2 if entries >= 2 and not weights_smem_of(t, entries) else 1)
    while split > 1 and (cluster % split or mlp % (256 * split)):
        split //= 2
    return split


def tiles_a_program(n: int, asked: int, first_part: int = 0, *, programs: int) -> int:
    """Output tiles of 8 a program for n outputs on `programs` programs: as asked, at least as many as
    cover them, and a divisor of the first part's tiles (fold_cross_q: a program's tiles are all in one part)."""
    c = max(asked, math.ceil(n / 8 / programs))
    while first_part and (first_part // 8) % c:
        c += 1
    return c


def cross_split(t: CudaTiling, key_tiles: int, tile_bytes: int, most: int, cluster: int,
                fits: Callable[[int, int], bool]) -> tuple[bool, int]:
    """Whether the cross-attention's key tiles go to shared memory (kv_smem), and its programs per
    (entry, head) (at most `most`): a cluster's, with kv_smem where the cluster's share of the tiles
    fits beside the rest; else with kv_smem as few as hold their tiles (an mbarrier, then the tiles)
    at most 4 tiles a warp; else as asked (cross_programs, without kv_smem) or enough that a warp
    takes one tile, loaded into registers before the phase's wait. fits(programs, kv_bytes): a
    program's shared memory holds the phases' scratch and kv_bytes of tiles."""
    def kv_bytes(c: int) -> int:
        return 16 + math.ceil(key_tiles / c) * tile_bytes
    if not t.kv_smem and t.cross_programs > most:
        raise ValueError(f"cross_programs {t.cross_programs}: the GPU's programs hold {most} for each (entry, head)")
    if cluster > 1:
        groups = t.cross_groups or (2 if cluster == 2 and 2 * cluster <= most else 1)
        if cluster * groups > most:
            raise ValueError(f"cross_groups {groups}: {cluster * groups} programs an (entry, head), "
                             f"the GPU's hold {most}")
        return t.kv_smem and fits(cluster * groups, kv_bytes(cluster * groups)), cluster * groups
    if (t.cross_groups or 1) > 1 or t.cross_global:
        raise ValueError("cross_groups and cross_global: ways of the cross-attention's clusters, and it runs "
                         "without clusters")
    for c in range(max(1, math.ceil(key_tiles / 32)), most + 1) if t.kv_smem else ():
        if (not t.cross_programs or c == t.cross_programs) and fits(c, kv_bytes(c)):
            return True, c
    return False, (not t.kv_smem and t.cross_programs) or max(1, min(math.ceil(key_tiles / 8), most))


def plan_of(dims, entries: int, tokens: int, n_keys: int, programs: int, tiling: CudaTiling = CudaTiling(),
            smem_limit: int = SMEM_LIMIT, held: Optional[Callable[[int], int]] = None) -> Plan:
    """The kernel's constants and launch shape for `dims` (a FusedExpert's width, heads, head_dim,
    mlp, action_dim, depth) on a GPU of `programs` SMs with `smem_limit` bytes of shared memory a
    program; held(c): the programs it holds at once in clusters of c (default: as many of the
    `programs` as make whole clusters)."""
    t, tok16 = tiling, 16 * math.ceil(tokens / 16)
    rows, pairs = entries * tok16, entries * dims.heads
    held = held or (lambda c: programs // c * c)
    cluster = cross_cluster(t, pairs, held)
    programs = held(cluster) if cluster > 1 else programs
    check_shape(dims, t, entries, tokens, rows, programs, cluster)
    tpr, key_tiles = 1, math.ceil(n_keys / 16)
    while tpr < 32 and tpr * 2 * rows <= THREADS:
        tpr *= 2
    tpc = functools.partial(tiles_a_program, programs=programs)
    w, fold = dims.width, int(t.fold_cross_q)
    so_stride = dims.head_dim + ((8 - dims.head_dim % 32) % 32 if t.cross_pad else 0)   # cross_pad
    qkv, so = tpc((3 + fold) * w, t.qkv_tpc, fold * 3 * w), tpc((1 + fold) * w, t.so_tpc, fold * w)
    cq, fc1 = tpc(w, t.cq_tpc), tpc(dims.mlp, (4 if entries <= 3 else 0) if t.fc1_tpc is None else t.fc1_tpc)
    co = tpc(w, (2 if entries <= 2 else 0) if t.co_tpc is None else t.co_tpc)
    split = fc2_split_of(t, entries, cluster, dims.mlp)
    fc2 = tiles_a_program(w, t.fc2_tpc, programs=programs // split)   # a group of `split` programs shares fc2's tiles
    # mean, rstd, the warps' partial sums, 16 floats a thread of epilogue inputs (fold_ln: and the
    # warps' (mean, M2) of every row)
    gemv = max(2 * rows + 8 * n * rows * 8 + 16 * THREADS for n in (qkv, so, cq, fc1, co, fc2))
    gemv += 16 * rows * t.fold_ln

    # the step boundary's: out's scratch, then its stage of bf16 inputs (expert_flow.cu, BSTAGE)
    a = dims.action_dim
    boundary = 4 * math.ceil((8 + 8 * a) / 4) + math.ceil(((4 + 2 * a) * w + a) / 2)

    def general(cpp: int) -> int:   # floats: the phases' scratch (the cross-attention's: its flag, x1's
        # row statistics, the warps' partials or the last program's copy of every program's, and with
        # fold_cross_q its stage of S, rho and delta), a multiple of 4
        stage = fold * (tok16 + 2) * dims.head_dim
        cross = 4 + 2 * tok16 + max(8 * (so_stride + 2), cpp * (dims.head_dim + 2)) * tok16 + stage
        return 4 * math.ceil(max(gemv, cross, boundary) / 4)
    # weights_smem: two buffers of the largest GEMV phase's weights of a program (K x 16 bytes a
    # tile, 8 in e4m3), after two mbarriers (16 bytes); off where they do not fit beside the rest
    fp8 = bool(getattr(dims, "fp8", False))   # e4m3 weights: 8 bytes a lane's two k-steps, not 16
    w_buf = (8 if fp8 else 16) * max([n * w for n in (qkv, so, cq, co, fc1)] + [fc2 * dims.mlp])
    w_bytes = 16 + 2 * w_buf if weights_smem_of(t, entries) else 0
    tile_bytes = 2 * 32 * dims.head_dim // 16 * 16
    cluster_region = 4 * max(tok16 * dims.head_dim + 2 * tok16, fc2 * rows * 8 if split > 1 else 0,
                             8 * dims.head_dim * 8 * t.self_cluster) if cluster > 1 else 0
    kv_smem, cpp = cross_split(t, key_tiles, tile_bytes, programs // pairs, cluster, lambda c, kv_bytes:
                               4 * general(c) + w_bytes + kv_bytes + cluster_region <= smem_limit)
    tiles_per_cta = math.ceil(key_tiles / cpp)
    gen = general(cpp)
    kv_bytes = 16 + tiles_per_cta * tile_bytes if kv_smem else 0
    if 4 * gen + w_bytes + kv_bytes > smem_limit:
        w_bytes = 0
    c_off = gen + (w_bytes + kv_bytes) // 4   # clusters: each program's merged partial
    # clusters: the cross-attention's merged partial, fc2's split sums [tiles][rows][8], the
    # self-attention items' fragments [8][head_dim / 16][32][4]
    smem = 4 * c_off + cluster_region
    if smem > smem_limit:
        raise ValueError(f"the CUDA expert kernel's plan needs {smem} bytes of shared memory, {smem_limit} a program")
    constants = dict(WIDTH=dims.width, HEADS=dims.heads, HDIM=dims.head_dim, MLPD=dims.mlp, ADIM=dims.action_dim,
                     TOK=tokens, TOK16=tok16, ENTRIES=entries, DEPTH=dims.depth, NPROG=programs, TPR=tpr,
                     SPIN_LIMIT=SPIN_LIMIT, POLL=t.poll, POLL_THREAD=32 * t.poll_warp, TRACE=int(t.trace),
                     WORK=int(t.work), QKV_TPC=qkv,
                     CQ_TPC=cq, FC1_TPC=fc1, FUSE_SELF=int(t.fuse_self), KV_SMEM=int(kv_smem),
                     KV_OFF=gen + w_bytes // 4, X_FRAGS=int(t.x_frags), SO_TPC=so, CO_TPC=co, FC2_TPC=fc2, FOLD_CQ=fold,
                     FOLD_LN=int(t.fold_ln),
                     CROSS_CUT=int(t.cross_cut), STATS_T=int(entries >= 4 if t.stats_t is None else t.stats_t),
                     EPI_SPLIT=t.epi_split, CLUSTER=cluster, CROSS_MARKS=t.cross_marks,
                     C_OFF=c_off, W_SMEM=int(w_bytes > 0), L2_PREFETCH=l2_prefetch_of(t, entries),
                     LATE_W=int(t.late_weights), KV_AHEAD=int(t.kv_ahead),
                     V_LATE=int((entries >= 2 if t.v_late is None else t.v_late) and not kv_smem),
                     A_CHUNK=(3 if entries == 4 else 6) if t.a_chunk is None else t.a_chunk,
                     X_AHEAD=int(entries != 3 if t.x_ahead is None else t.x_ahead), FC2_SPLIT=split,
                     SELF_CLUSTER=int(t.self_cluster), CROSS_GROUPS=cpp // cluster if cluster > 1 else 1,
                     CROSS_GLOBAL=int(t.cross_global),
                     W_OFF=gen, W_BUF=w_buf, SO_STRIDE=so_stride,
                     W_FP8=int(fp8), FP8_HOLD=int(fp8 and t.fp8_hold))
    return Plan(tuple(sorted(constants.items())), programs, smem, key_tiles, cpp, tiles_per_cta)


class CudaFlow:
    def __init__(self, fused, tiling: CudaTiling = CudaTiling()):
        if why := unsupported(fused):
            raise ValueError(why)
        e = fused.expert
        self.fused, self.tiling = fused, tiling
        # The kernel reads the weights as 16-byte fragments: copies, made once.
        self.weights = {name: fragments_b(stack.weight) for name, stack in zip(WEIGHTS, fused.stacks())}
        self.biases = {name: stack.bias for name, stack in zip(BIASES, fused.stacks())}
        # e4m3 weights: their scales [depth, N] (fp32), applied to each output column's sum
        self.scales = {name: stack.scale for name, stack in zip(SCALES, fused.stacks()) if stack.scale is not None}
        # the step boundary's inputs, copied (the kernel stages them in 4-byte pieces: aligned storage)
        self.io = {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in (
            ("win", e.action_in.weight), ("bin", e.action_in.bias), ("pos", e.action_pos),
            ("wout", e.action_out.weight), ("bout", e.action_out.bias))}
        self._scratch: dict[tuple, Scratch] = {}

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.scales.values()])

    def scratch(self, entries: int, tokens: int, n_keys: int, steps: int, device) -> Scratch:
        key = (entries, tokens, n_keys, steps, torch.device(device))
        if key not in self._scratch:
            f = self.fused
            device = torch.device(device)
            on_gpu = device.type == "cuda"
            programs = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else HOST_PROGRAMS
            limit = SMEM_LIMIT if on_gpu else HOST_SMEM_LIMIT
            held = functools.partial(programs_held, device.index or 0) if on_gpu else None
            plan = plan_of(f, entries, tokens, n_keys, programs, self.tiling, limit, held)
            unfolded = plan_of(f, entries, tokens, n_keys, programs,
                               dataclasses.replace(self.tiling, fold_cross_q=False, fold_ln=False), limit, held)
            rows = entries * dict(plan.constants)["TOK16"]
            w, tok16, pairs = f.width, rows // entries, entries * f.heads
            with torch.device(device):
                bf, f32 = dict(dtype=torch.bfloat16), dict(dtype=torch.float32)
                self._scratch[key] = Scratch(
                    plan=plan, unfolded=unfolded, n_keys=n_keys,
                    xa=torch.empty((entries * tokens, f.action_dim), **f32),
                    vel=torch.empty((steps, entries * tokens, f.action_dim), **bf),
                    x=torch.empty((rows, w), **f32), xf=torch.empty(rows * w, **bf),
                    stats=torch.empty(rows * w // 4, **f32), qkv=torch.empty(rows * 3 * w, **bf),
                    q=torch.empty(rows * w, **bf), y=torch.empty(rows * w, **bf),
                    hid=torch.empty(rows * f.mlp, **bf), f0=torch.empty((rows, w), **f32),
                    sq=torch.empty(rows * w, **f32),
                    opart=torch.empty(pairs * plan.cpp * tok16 * f.head_dim, **f32),
                    mlpart=torch.empty(pairs * plan.cpp * tok16 * 2, **f32),
                    counter=torch.zeros(pairs, dtype=torch.int32),
                    barrier=torch.zeros(1 + plan.programs, dtype=torch.int32),
                    error=torch.zeros(1, dtype=torch.int32),
                    kv=torch.empty((f.depth, entries, f.heads, plan.key_tiles, 2, 32, f.head_dim // 2), **bf))
        return self._scratch[key]

    def barrier_timed_out(self) -> bool:
        return any(bool(s.error.item()) for s in self._scratch.values())

    def prepare(self, x: torch.Tensor, steps: int, kv: list, ctx_mask: Optional[torch.Tensor]) -> Scratch:
        """The scratch for actions x [B, H, A], with x, the context K/V and the mask copied in."""
        n_keys = kv[0][0].shape[2]
        buf = self.scratch(x.shape[0], x.shape[1], n_keys, steps, x.device)
        pack_kv(kv, buf.kv)
        buf.xa.copy_(x.reshape(buf.xa.shape))
        if ctx_mask is None:
            buf.mask, buf.mask_stride = None, 0
        else:
            buf.mask = ctx_mask.reshape(ctx_mask.shape[0], -1).contiguous().view(torch.uint8)
            buf.mask_stride = n_keys if buf.mask.shape[0] > 1 else 0
        return buf

    def fold(self, mods: torch.Tensor) -> Optional[CudaFold]:
        """fold_cross_q's inputs of a schedule (None without it), for block modulations mods [steps,
        depth, 9w]: M = Wq diag((1 + c2) g1) Wso of every step and block in B-fragment order (model
        dtype; e4m3 with the expert's e4m3 weights, and then its scale a row [steps, depth, w]),
        and eps = M's bias (Wq diag((1 + c2) g1) bso), rho = (1 + c2) Wq^T and delta = s2 Wq^T + bq as
        [steps, depth, 3, w] fp32 (expert_flow.cu, Part2); with fold_ln the same rho and delta of qkv
        (c1, s1) and fc1 (c3, s3). Computed in float64 (of the weights the kernel reads), once a schedule."""
        if not self.tiling.fold_cross_q:
            return None
        f, w = self.fused, self.fused.width
        m = mods.double()
        gate1, scale2 = m[..., 2 * w:3 * w], 1 + m[..., 4 * w:5 * w]
        wq, wso = self.weights64(f.cross_q), self.weights64(f.self_out)
        gain = scale2 * gate1                                     # [steps, depth, w]
        eps = torch.einsum("sdm,dnm->sdn", gain * f.self_out.bias.double(), wq)   # (gain bso) Wq^T
        consts = torch.stack([eps, *self.ln_constants(f.cross_q, m, 3 * w)], dim=2)
        ln = self.ln_fold(m) if self.tiling.fold_ln else None
        wq_frags = self.weights["wq"]
        folded = torch.empty((len(gain), *wq_frags.shape), dtype=wq_frags.dtype, device=mods.device)
        scales = torch.empty((len(gain), f.depth, w), device=mods.device) if f.fp8 else None
        for step, g in enumerate(gain):   # one step's M at a time: float64 of one step only
            step_m = (wq * g[:, None, :]) @ wso
            if f.fp8:
                step_m, scale = quantize(step_m, rowwise=True)
                scales[step] = scale[..., 0]
            else:
                step_m = step_m.to(f.dtype)
            folded[step] = fragments_b(step_m)
        return CudaFold(folded, consts.float().contiguous(), scales, ln)

    def weights64(self, stack) -> torch.Tensor:
        """A Stack's weights of every block as the kernel reads them (e4m3: dequantised), float64 [depth, N, K]."""
        return torch.stack([stack.dequantized(j) for j in range(self.fused.depth)]).double()

    def ln_constants(self, stack, m: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rho = (1 + c) W^T and delta = s W^T + b [steps, depth, N] (float64) of the linear `stack`
        after a modulated LayerNorm whose shift s and scale c are m[..., at:at + w] and the w after."""
        w = self.fused.width
        shift, scale = m[..., at:at + w], m[..., at + w:at + 2 * w]
        weight = self.weights64(stack)
        return (torch.einsum("sdk,dnk->sdn", 1 + scale, weight),
                torch.einsum("sdk,dnk->sdn", shift, weight) + stack.bias.double())

    def ln_fold(self, m: torch.Tensor) -> torch.Tensor:
        """fold_ln's rho and delta (ln_constants) of qkv (c1, s1) and fc1 (c3, s3), for float64
        modulations m [steps, depth, 9w]: [steps, depth, 6w + 2 mlp] fp32."""
        f, w = self.fused, self.fused.width
        parts = [*self.ln_constants(f.qkv, m, 0), *self.ln_constants(f.fc1, m, 6 * w)]
        return torch.cat(parts, dim=-1).float().contiguous()

    def segment_names(self, reuse: tuple, folded: Optional[bool] = None) -> list[str]:
        """What each segment between two grid barriers of a launch over all steps runs (folded:
        whether the launch's inputs carry fold constants; default: the tiling's fold_cross_q)."""
        folded = self.tiling.fold_cross_q if folded is None else folded
        no_self = self.tiling.fuse_self or self.tiling.self_cluster
        phases = [p for p in BLOCK_PHASES if not (no_self and p == "self") and not (folded and p == "cross_q")]
        names = []
        for r in reuse:
            if r < 0:
                names += ["boundary"] + phases * self.fused.depth
        return names + ["boundary"]

    def run(self, buf: Scratch, inputs, euler: bool, steps: range) -> None:
        """Flow steps `steps` of inputs (FusedExpert's FlowInputs) in one launch."""
        folded = inputs.cuda_fold is not None
        plan = buf.plan if folded == self.tiling.fold_cross_q else buf.unfolded
        buf.barrier.zero_()
        segments = 1
        if self.tiling.trace:
            segments = len(self.segment_names(inputs.reuse_host[steps.start:steps.stop], folded))
            if buf.trace is None or buf.trace.shape[1] != segments:
                buf.trace = torch.zeros((plan.programs, segments, 4), dtype=torch.int64, device=buf.x.device)
        ptr = lambda t: t.data_ptr()   # noqa: E731
        or_kv = lambda t: ptr(t if t is not None else buf.kv)   # noqa: E731  (an input the launch does not read)
        fold = inputs.cuda_fold or CudaFold(None, None, None, None)
        p = Params(xa=ptr(buf.xa), vel=ptr(buf.vel), reuse=ptr(inputs.reuse),
                   **{k: ptr(v) for k, v in self.weights.items()}, **{k: ptr(v) for k, v in self.biases.items()},
                   **{k: ptr(v) for k, v in self.io.items()}, mods=ptr(inputs.mods), fmods=ptr(inputs.final_mods),
                   kv=ptr(buf.kv), mask=or_kv(buf.mask), fold_m=or_kv(fold.m), fold_c=or_kv(fold.consts),
                   fold_ln=or_kv(fold.ln), **{k: ptr(self.scales.get(k, buf.kv)) for k in SCALES},
                   wsc_fold=or_kv(fold.scales),
                   **{k: ptr(getattr(buf, k)) for k in ("x", "xf", "stats", "qkv", "q", "y", "hid", "f0", "sq",
                                                        "opart", "mlpart", "counter")},
                   bar=ptr(buf.barrier), err=ptr(buf.error),
                   trace=ptr(buf.trace) if buf.trace is not None else ptr(buf.counter), segments=segments,
                   n_keys=buf.n_keys, key_tiles=plan.key_tiles,
                   cpp=plan.cpp, tiles_per_cta=plan.tiles_per_cta, mask_stride=buf.mask_stride,
                   has_mask=int(buf.mask is not None), step_lo=steps.start, step_hi=steps.stop, euler=int(euler),
                   dt=1.0 / inputs.steps, eps=LN_EPS, scale=1.0 / math.sqrt(self.fused.head_dim))
        if buf.x.device.type == "cpu":
            HostKernel.get(plan.constants).launch(p, plan.programs, plan.smem)
            return
        kernel = FlowKernel.get(plan.constants, buf.x.device.index or 0, plan.smem)
        kernel.launch(p, plan.programs, plan.smem, torch.cuda.current_stream(buf.x.device).cuda_stream,
                      cooperative=self.fused.tiling.cooperative, cluster=dict(plan.constants)["CLUSTER"])
