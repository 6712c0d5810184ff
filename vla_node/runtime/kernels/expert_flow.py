"""The action expert's flow loop as one persistent Triton kernel (or one launch per phase).

Why: at batch 1 the expert's 36 blocks x 10 flow steps are 360 blocks of ~16 MB of weights
each (~3.8 us at 4.3 TB/s), and on the H200 every kernel launch costs ~2.5-3 us of latency
however few bytes it reads. So the whole loop runs in one launch of one program per SM; the
phases of a block are separated by grid barriers (an arrival counter each program polls; 0.87
us each on the H200), and each phase spreads its weights evenly over all programs. A program
loads its next phase's weights between its arrival and its wait (HOIST): they do not depend on
the barrier, so their memory latency overlaps the other programs' work. phase_kernel runs the
same phases one per launch (PHASE): the host's loop (and the CPU interpreter, which runs
programs one after another and so cannot spin) puts the launch boundary where the barrier
would be. Measured (BENCHMARKS.md, issue 22): a phase takes 5-10 us whatever its bytes, a chain
of dependent memory round trips, so the loop is ~10x its bandwidth floor.

Phases of one block j at flow step i (M rows = batch entries x horizon tokens; w width). Every
dot takes one entry's rows (a tile of BLOCK_H rows) with the item's weights held in registers, so
a batch adds loops over entries and reads the weights once, and no tile grows with the batch:

    qkv     x -> LN1 + modulate -> QKV [M, 3w]                 items: column ranges
    self    self-attention of head h -> y_h W_so[cols, h]^T     items: (x tile, head); the last
            head to arrive sums the heads in order: x += g1 (. + b), and the tile's LN stats
    cross_q x -> LN2 + modulate -> Q [M, w]                    items: column ranges
    cross   flash-decoding partials of (entry, head, key split); the last split of an
            (entry, head) merges them -> Y [M, w]
    cross_out  y_h W_co[cols, h]^T, heads summed as in self:  x += g2 (. + b)
    fc1     x -> LN3 + modulate -> GELU -> HID [M, mlp]         items: column ranges
    fc2     HID[k split] W2[cols, k split]^T, splits summed:   x += g3 (. + b)

and per step: `in` (x = action_in(actions) + pos, once) and `out` (final LN + modulate ->
action_out -> v, and the Euler update actions += dt v), or `reuse` (actions += dt v_r of an
earlier step: action caching). The residual stream x stays fp32; each x tile's writer stores
its per-row mean and M2, which the LayerNorms combine (Chan's formula) instead of re-reading
x twice. Sums over heads and splits run in a fixed order (a counter picks the last arrival,
which adds every part), so graph replays are bit-identical. Everything the kernel writes and
reads back within the launch is loaded with .cg (L2, not the SM's incoherent L1).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .few_query_attention import attend_chunk, attend_keys, load_keys, merge_partials, softmax_start

INV_SQRT2 = tl.constexpr(0.7071067811865476)

# Phase numbers (phase_kernel's PHASE; flow_kernel's is PERSISTENT, the whole loop); a block's
# phases are QKV .. FC2, in this order.
PERSISTENT = tl.constexpr(-1)
IN, QKV, SELF, CROSS_Q, CROSS, CROSS_OUT, FC1, FC2, OUT, REUSE = (tl.constexpr(p) for p in range(10))
PHASE_NAMES = ("in", "qkv", "self", "cross_q", "cross", "cross_out", "fc1", "fc2", "out", "reuse")


@triton.jit
def _clock_ns(like):
    """The GPU's global timer in ns (comparable across SMs), as a scalar like `like`."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False,
                                     pack=1)

@triton.jit
def _grid_arrive(Bar):
    """This program's arrival at the next grid barrier (its stores before it are released)."""
    tl.debug_barrier()
    tl.atomic_add(Bar, 1, sem="release", scope="gpu")


@triton.jit
def _grid_wait(Bar, Err, target, SPIN_LIMIT: tl.constexpr):
    """Wait until `target` arrivals (barrier k of a launch: k * programs; the counter is zeroed
    before the launch). A wait that outlasts SPIN_LIMIT polls (programs not all resident) sets
    Err and stops waiting, here and at every later barrier of the launch: a wrong result the
    host detects instead of a hung GPU. Polls are atomic adds of 0: on the H200 they release a
    loop 1 ms sooner than acquire loads (13.9 against 14.9 ms). Arrive and wait are apart so a
    program can load its next weights in between."""
    failed = tl.atomic_add(Err, 0, sem="relaxed", scope="gpu")
    seen = tl.atomic_add(Bar, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT) & (failed == 0):
        seen = tl.atomic_add(Bar, 0, sem="acquire", scope="gpu")
        spins += 1
    if (seen < target) & (failed == 0):
        tl.atomic_xchg(Err, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _row_stats(Stats, rows, row_ok, eps, W: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """LayerNorm mean and 1/std of x's rows (a row tile) from its tiles' (mean, M2) (Chan's formula)."""
    t = tl.arange(0, NT_P2)
    t_ok = t < NT
    count = tl.where(t_ok, tl.minimum(XT, W - t * XT), 0).to(tl.float32)
    offs = t[:, None] * BLOCK_M + rows[None, :]
    ok = t_ok[:, None] & row_ok[None, :]
    tile_mean = tl.load(Stats + offs, mask=ok, other=0.0, cache_modifier=".cg")
    tile_m2 = tl.load(Stats + NT * BLOCK_M + offs, mask=ok, other=0.0, cache_modifier=".cg")
    mean = tl.sum(count[:, None] * tile_mean, 0) / W
    d = tile_mean - mean[None, :]
    m2 = tl.sum(tile_m2 + count[:, None] * d * d, 0)
    return mean, tl.rsqrt(m2 / W + eps)


@triton.jit
def _store_x_tile(x, ok, X, Stats, t, rows, row_ok, cols, W: tl.constexpr, NT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows `rows` of x tile t [rows, XT] (final values) and their mean and M2 over its valid columns."""
    tl.store(X + rows[:, None] * W + cols[None, :], x, mask=ok)
    count = tl.maximum(tl.sum(ok.to(tl.float32), 1), 1.0)
    mean = tl.sum(tl.where(ok, x, 0.0), 1) / count
    d = tl.where(ok, x - mean[:, None], 0.0)
    tl.store(Stats + t * BLOCK_M + rows, mean, mask=row_ok)
    tl.store(Stats + (NT + t) * BLOCK_M + rows, tl.sum(d * d, 1), mask=row_ok)


@triton.jit
def _chunk_weights(Wt, w_stride, k0, k_hi, cols, col_ok, BK: tl.constexpr):
    """Weight rows cols, columns k0 .. k0 + BK (clipped at k_hi): [BN, BK]."""
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(Wt + cols[:, None] * w_stride + offs_k[None, :], mask=col_ok[:, None] & (offs_k < k_hi)[None, :],
                   other=0.0)


@triton.jit
def _weights(Wt, w_stride, k_lo, k_hi, cols, col_ok, KC: tl.constexpr, BK: tl.constexpr):
    """The KC (<= 4) K chunks of BK of weight rows cols from k_lo: four [BN, BK] (the unused
    repeat the first). Loaded before a phase's barrier wait: they do not depend on it."""
    tl.static_assert(KC <= 4, "at most four K chunks (the plan picks the chunk size)")
    w0 = _chunk_weights(Wt, w_stride, k_lo, k_hi, cols, col_ok, BK)
    w1, w2, w3 = w0, w0, w0
    if KC > 1:
        w1 = _chunk_weights(Wt, w_stride, k_lo + BK, k_hi, cols, col_ok, BK)
    if KC > 2:
        w2 = _chunk_weights(Wt, w_stride, k_lo + 2 * BK, k_hi, cols, col_ok, BK)
    if KC > 3:
        w3 = _chunk_weights(Wt, w_stride, k_lo + 3 * BK, k_hi, cols, col_ok, BK)
    return w0, w1, w2, w3


@triton.jit
def _chunk_inputs(Src, src_stride, k0, k_hi, rows, row_ok, ModRow, shift_off, scale_off, LN: tl.constexpr,
                  BK: tl.constexpr):
    """The inputs of one K chunk: src rows [rows, BK], and with LN the modulation's shift and
    scale (for every row)."""
    offs_k = k0 + tl.arange(0, BK)
    a = tl.load(Src + rows[:, None] * src_stride + offs_k[None, :], mask=row_ok[:, None] & (offs_k < k_hi)[None, :],
                other=0.0, cache_modifier=".cg")
    if LN:  # loaded per row, in a's layout: a broadcast of a [BK] load would pass through shared memory
        m = ModRow + offs_k[None, :] + 0 * rows[:, None]
        shift = tl.load(m + shift_off).to(tl.float32)
        scale = tl.load(m + scale_off).to(tl.float32)
    else:
        shift = tl.zeros([1, BK], tl.float32)
        scale = shift
    return a, shift, scale


@triton.jit
def _chunk_dot(acc, a, w, shift, scale, mean, rstd, row_ok, LN: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """acc += prologue(a) @ w^T; the prologue is LayerNorm + modulate with LN, else a as it is."""
    if LN:
        a = tl.where(row_ok[:, None], (a - mean[:, None]) * rstd[:, None] * (1.0 + scale) + shift, 0.0)
    return acc + tl.dot(a.to(DOT), tl.trans(w.to(DOT)), input_precision=PREC)


@triton.jit
def _rows_dot(Src, src_stride, k_lo, k_hi, rows, row_ok, w0, w1, w2, w3, ModRow, shift_off, scale_off, Stats, eps,
              LN: tl.constexpr, KC: tl.constexpr, W: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr,
              NT_P2: tl.constexpr, BLOCK_M: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              DOT: tl.constexpr, PREC: tl.constexpr):
    """prologue(src[rows, k_lo:k_hi]) @ w^T for the weights' KC chunks w0.. (_weights): [R, BN]
    fp32; the prologue with LN: LayerNorm from the x tiles' Stats, then modulate. Every chunk's
    loads are issued before anything waits for one (the statistics, the first dot): a dot's
    operands pass through shared memory behind a CTA barrier, and a load written after it waits
    for it (one memory latency per chunk: the qkv phase took 8.4 us for 3.5 MB)."""
    a0, s0, c0 = _chunk_inputs(Src, src_stride, k_lo, k_hi, rows, row_ok, ModRow, shift_off, scale_off, LN, BK)
    a1, s1, c1 = a0, s0, c0
    a2, s2, c2 = a0, s0, c0
    a3, s3, c3 = a0, s0, c0
    if KC > 1:
        a1, s1, c1 = _chunk_inputs(Src, src_stride, k_lo + BK, k_hi, rows, row_ok, ModRow, shift_off, scale_off, LN,
                                   BK)
    if KC > 2:
        a2, s2, c2 = _chunk_inputs(Src, src_stride, k_lo + 2 * BK, k_hi, rows, row_ok, ModRow, shift_off, scale_off,
                                   LN, BK)
    if KC > 3:
        a3, s3, c3 = _chunk_inputs(Src, src_stride, k_lo + 3 * BK, k_hi, rows, row_ok, ModRow, shift_off, scale_off,
                                   LN, BK)
    if LN:
        mean, rstd = _row_stats(Stats, rows, row_ok, eps, W, XT, NT, NT_P2, BLOCK_M)
    else:
        mean = tl.zeros([R], tl.float32)
        rstd = mean
    acc = _chunk_dot(tl.zeros([R, BN], tl.float32), a0, w0, s0, c0, mean, rstd, row_ok, LN, DOT, PREC)
    if KC > 1:
        acc = _chunk_dot(acc, a1, w1, s1, c1, mean, rstd, row_ok, LN, DOT, PREC)
    if KC > 2:
        acc = _chunk_dot(acc, a2, w2, s2, c2, mean, rstd, row_ok, LN, DOT, PREC)
    if KC > 3:
        acc = _chunk_dot(acc, a3, w3, s3, c3, mean, rstd, row_ok, LN, DOT, PREC)
    return acc


@triton.jit
def _ln_gemv(X, Stats, ModRow, shift_off, scale_off, w0, w1, w2, w3, Bias, WScale, cols, col_ok, rows, row_ok, eps,
             W: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr, BLOCK_M: tl.constexpr,
             R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
             SCALED: tl.constexpr):
    """(LayerNorm(x[rows]) * (1 + scale) + shift) @ Wt[cols]^T (* w_scale) + bias: [R, BN] fp32,
    w0.. the rows cols of Wt [N, W] (_weights over all of W; BK divides W)."""
    bias = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)  # in flight with the inputs
    if SCALED:
        w_scale = tl.load(WScale + cols, mask=col_ok, other=0.0)
    acc = _rows_dot(X, W, 0, W, rows, row_ok, w0, w1, w2, w3, ModRow, shift_off, scale_off, Stats, eps,
                    True, W // BK, W, XT, NT, NT_P2, BLOCK_M, R, BN, BK, DOT, PREC)
    if SCALED:
        acc *= w_scale[None, :]
    return acc + bias[None, :]


@triton.jit
def _linear_weights(Wt, item, n_cols, N: tl.constexpr, K: tl.constexpr, COLS: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """The weights of item `item` (COLS output columns) of a column-range phase: the rows below
    n_cols (N, or 0 to load none)."""
    lane = tl.arange(0, BN)
    cols = item * COLS + lane
    return _weights(Wt, K, 0, K, cols, (lane < COLS) & (cols < n_cols), K // BK, BK)


@triton.jit
def _ln_linear_phase(X, Stats, ModRow, shift_off, scale_off, Wt, Bias, WScale, Out, w0, w1, w2, w3, pid, nprog, qi,
                     tok_ok, eps, N: tl.constexpr, COLS: tl.constexpr, GELU: tl.constexpr, ENTRIES: tl.constexpr,
                     TOKENS: tl.constexpr, W: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     DOT: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    """Out [M, N] = act(LN-modulated x @ Wt^T + b): items of COLS output columns (qkv, cross_q,
    fc1), each entry's rows in turn with the item's weights; w0.. are the weights of this
    program's first item (item pid)."""
    lane = tl.arange(0, BN)
    for item in range(pid, tl.cdiv(N, COLS), nprog):
        if item != pid:
            w0, w1, w2, w3 = _linear_weights(Wt, item, N, N, W, COLS, BN, BK)
        cols = item * COLS + lane
        col_ok = (lane < COLS) & (cols < N)
        for b in range(ENTRIES):
            rows = b * TOKENS + qi
            y = _ln_gemv(X, Stats, ModRow, shift_off, scale_off, w0, w1, w2, w3, Bias, WScale, cols, col_ok, rows,
                         tok_ok, eps, W, XT, NT, NT_P2, BLOCK_M, BLOCK_H, BN, BK, DOT, PREC, SCALED)
            if GELU:  # exact (erf) GELU, as nn.functional.gelu
                y = 0.5 * y * (1.0 + tl.math.erf(y * INV_SQRT2))
            tl.store(Out + rows[:, None] * N + cols[None, :], y.to(Out.dtype.element_ty),
                     mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit
def _store_part(acc, t, part, PARTS: tl.constexpr, Part, rows, row_ok, XT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows `rows` of part `part` of x tile t's update [rows, XT] (_finish_x adds the parts)."""
    lane = tl.arange(0, XT)
    tl.store(Part + (t * PARTS + part) * (BLOCK_M * XT) + rows[:, None] * XT + lane[None, :], acc,
             mask=row_ok[:, None])


@triton.jit
def _finish_x(t, PARTS: tl.constexpr, Part, Counter, X, Stats, Bias, WScale, ModRow, gate_off, M,
              W: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr, BLOCK_M: tl.constexpr, SCALED: tl.constexpr):
    """After this program stored its part of x tile t's update (_store_part, every row): the last
    of its PARTS to arrive adds them in order, x += gate * (sum * w_scale + bias), and stores the
    tile with its LN stats. Elementwise over all rows at once (no dot: any number of rows)."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    lane = tl.arange(0, XT)
    offs = rows[:, None] * XT + lane[None, :]
    cols = t * XT + lane
    col_ok = cols < W
    ok = row_ok[:, None] & col_ok[None, :]
    # What does not depend on the other parts (x is this phase's input) is loaded before the
    # counter: off the last arrival's chain of round trips.
    bias = tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)
    gate = tl.load(ModRow + gate_off + cols, mask=col_ok, other=0.0).to(tl.float32)
    x = tl.load(X + rows[:, None] * W + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    if SCALED:
        w_scale = tl.load(WScale + cols, mask=col_ok, other=0.0)
    tl.debug_barrier()  # the whole part is written before this program arrives
    if tl.atomic_add(Counter + t, 1, sem="acq_rel", scope="gpu") == PARTS - 1:
        total = tl.zeros([BLOCK_M, XT], tl.float32)
        for p in tl.static_range(PARTS):
            total += tl.load(Part + (t * PARTS + p) * (BLOCK_M * XT) + offs, mask=ok, other=0.0,
                             cache_modifier=".cg")
        tl.store(Counter + t, 0)
        if SCALED:
            total *= w_scale[None, :]
        _store_x_tile(x + gate[None, :] * (total + bias[None, :]), ok, X, Stats, t, rows, row_ok, cols, W, NT,
                      BLOCK_M)


@triton.jit
def _self_attention(Qkv, rows, row_ok, h, scale, offs_d, d_ok, W: tl.constexpr, HD: tl.constexpr,
                    DOT: tl.constexpr, PREC: tl.constexpr):
    """Softmax attention of head h among rows `rows` (one batch entry's): [rows, BLOCK_D] fp32."""
    ok = row_ok[:, None] & d_ok[None, :]
    base = Qkv + rows[:, None] * (3 * W) + h * HD + offs_d[None, :]
    q = tl.load(base, mask=ok, other=0.0, cache_modifier=".cg")
    k = tl.load(base + W, mask=ok, other=0.0, cache_modifier=".cg")
    v = tl.load(base + 2 * W, mask=ok, other=0.0, cache_modifier=".cg")
    s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PREC) * scale
    s = tl.where(row_ok[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l = tl.sum(p, 1)
    return tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC) / tl.where(l == 0, 1.0, l)[:, None]


@triton.jit
def _head_out_weights(Wo, item, n_cols, W: tl.constexpr, HEADS: tl.constexpr, HD: tl.constexpr, XT: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Wo[x tile's columns, head's inputs] of item (x tile, head) [XT, BLOCK_D]: the columns
    below n_cols (W, or 0 to load none)."""
    offs_d = tl.arange(0, BLOCK_D)
    cols = (item // HEADS) * XT + tl.arange(0, XT)
    return tl.load(Wo + cols[:, None] * W + (item % HEADS) * HD + offs_d[None, :],
                   mask=(cols < n_cols)[:, None] & (offs_d < HD)[None, :], other=0.0)


@triton.jit
def _head_out_phase(Src, Wo, Bias, WScale, Part, Counter, X, Stats, ModRow, gate_off, w, pid, nprog, qi, tok_ok, M,
                    scale, ATTEND: tl.constexpr, ENTRIES: tl.constexpr, W: tl.constexpr, HEADS: tl.constexpr,
                    HD: tl.constexpr, TOKENS: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                    SCALED: tl.constexpr):
    """x += gate * (y @ Wo^T + b) with items (x tile, head): y_h is the self-attention of the
    fused q/k/v rows Src (ATTEND) or the merged cross-attention rows Src [M, w]; w is the
    weight slice of this program's first item."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    for item in range(pid, HEADS * NT, nprog):
        if item != pid:
            w = _head_out_weights(Wo, item, W, W, HEADS, HD, XT, BLOCK_D)
        h = item % HEADS
        t = item // HEADS
        for b in range(ENTRIES):
            rows = b * TOKENS + qi
            if ATTEND:
                y = _self_attention(Src, rows, tok_ok, h, scale, offs_d, d_ok, W, HD, DOT, PREC)
            else:
                y = tl.load(Src + rows[:, None] * W + h * HD + offs_d[None, :], mask=tok_ok[:, None] & d_ok[None, :],
                            other=0.0, cache_modifier=".cg")
            acc = tl.dot(y.to(DOT), tl.trans(w.to(DOT)), input_precision=PREC)
            _store_part(acc, t, h, HEADS, Part, rows, tok_ok, XT, BLOCK_M)
        _finish_x(t, HEADS, Part, Counter, X, Stats, Bias, WScale, ModRow, gate_off, M, W, XT, NT, BLOCK_M, SCALED)


@triton.jit
def _cross_keys(KVj, Mask, msb, item, live, n_keys, keys_per_split, ENTRIES: tl.constexpr, HEADS: tl.constexpr,
                HD: tl.constexpr, KEY_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                HAS_MASK: tl.constexpr):
    """The first BLOCK_KEYS keys of item (entry, head, key split)'s split of KVj: K, V and which
    count (load_keys; none unless live)."""
    offs_d = tl.arange(0, BLOCK_D)
    bh = item // KEY_SPLITS
    lo = (item % KEY_SPLITS) * keys_per_split
    head = bh * n_keys * HD
    return load_keys(KVj + head, KVj + ENTRIES * HEADS * n_keys * HD + head, Mask + (bh // HEADS) * msb, HD, HD, lo,
                     lo + keys_per_split * live, n_keys, offs_d, offs_d < HD, BLOCK_KEYS, HAS_MASK)


@triton.jit
def _cross_phase(Q, KVj, Mask, msb, OPart, MPart, LPart, Counter, Y, k0, v0, ok0, pid, nprog, n_keys,
                 keys_per_split, scale, ENTRIES: tl.constexpr, W: tl.constexpr, HEADS: tl.constexpr,
                 HD: tl.constexpr, TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 KEY_SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr, HAS_MASK: tl.constexpr, DOT: tl.constexpr):
    """Cross-attention of Q over block j's keys KVj [2, entries, heads, T, hd]: items (entry,
    head, key split) make flash-decoding partials; the last split of an (entry, head) merges
    them into Y. k0, v0, ok0: the first key chunk of this program's first item (_cross_keys)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    qi = tl.arange(0, BLOCK_H)
    q_ok = qi < TOKENS
    for item in range(pid, ENTRIES * HEADS * KEY_SPLITS, nprog):
        if item != pid:
            k0, v0, ok0 = _cross_keys(KVj, Mask, msb, item, 1, n_keys, keys_per_split, ENTRIES, HEADS, HD,
                                      KEY_SPLITS, BLOCK_D, BLOCK_KEYS, HAS_MASK)
        split = item % KEY_SPLITS
        bh = item // KEY_SPLITS
        b = bh // HEADS
        h = bh % HEADS
        qrows = b * TOKENS + qi
        ok = q_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + qrows[:, None] * W + h * HD + offs_d[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        head = bh * n_keys * HD
        lo = split * keys_per_split
        acc, m_i, l_i = softmax_start(BLOCK_H, BLOCK_D)
        acc, m_i, l_i = attend_chunk(q.to(DOT), k0, v0, ok0, scale, acc, m_i, l_i)
        acc, m_i, l_i = attend_keys(q.to(DOT), KVj + head, KVj + ENTRIES * HEADS * n_keys * HD + head,
                                    Mask + b * msb, HD, HD, lo + BLOCK_KEYS, lo + keys_per_split, n_keys, scale,
                                    offs_d, d_ok, acc, m_i, l_i, BLOCK_KEYS, HAS_MASK)
        base = (bh * KEY_SPLITS + split) * BLOCK_H
        tl.store(OPart + (base + qi)[:, None] * BLOCK_D + offs_d[None, :], acc)
        tl.store(MPart + base + qi, m_i)
        tl.store(LPart + base + qi, l_i)
        tl.debug_barrier()
        if tl.atomic_add(Counter + bh, 1, sem="acq_rel", scope="gpu") == KEY_SPLITS - 1:
            y = merge_partials(OPart, MPart, LPart, bh * KEY_SPLITS * BLOCK_H + qi, BLOCK_H, offs_d, d_ok,
                               KEY_SPLITS, BLOCK_D)
            tl.store(Counter + bh, 0)
            tl.store(Y + qrows[:, None] * W + h * HD + offs_d[None, :], y.to(Y.dtype.element_ty), mask=ok)



@triton.jit
def _fc2_weights(W2, item, n_cols, W: tl.constexpr, MLP: tl.constexpr, XT: tl.constexpr, SPLITS: tl.constexpr,
                 SPLIT_K: tl.constexpr, BK: tl.constexpr):
    """W2[x tile's columns, K split] of item (x tile, K split): the columns below n_cols (W, or 0)."""
    cols = (item // SPLITS) * XT + tl.arange(0, XT)
    k_lo = (item % SPLITS) * SPLIT_K
    return _weights(W2, MLP, k_lo, tl.minimum(k_lo + SPLIT_K, MLP), cols, cols < n_cols, (SPLIT_K + BK - 1) // BK,
                    BK)


@triton.jit
def _fc2_phase(Hid, W2, Bias, WScale, Part, Counter, X, Stats, ModRow, gate_off, w0, w1, w2, w3, pid, nprog, qi,
               tok_ok, M, ENTRIES: tl.constexpr, TOKENS: tl.constexpr, W: tl.constexpr, MLP: tl.constexpr,
               XT: tl.constexpr, NT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
               SPLITS: tl.constexpr, SPLIT_K: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
               PREC: tl.constexpr, SCALED: tl.constexpr):
    """x += gate * (HID @ W2^T + b): items (x tile, K split of SPLIT_K), splits summed in order;
    w0.. are the weights of this program's first item."""
    for item in range(pid, NT * SPLITS, nprog):
        if item != pid:
            w0, w1, w2, w3 = _fc2_weights(W2, item, W, W, MLP, XT, SPLITS, SPLIT_K, BK)
        split = item % SPLITS
        t = item // SPLITS
        k_lo = split * SPLIT_K
        for b in range(ENTRIES):
            rows = b * TOKENS + qi
            acc = _rows_dot(Hid, MLP, k_lo, tl.minimum(k_lo + SPLIT_K, MLP), rows, tok_ok, w0, w1, w2, w3, W2, 0, 0,
                            Stats, 0.0, False, (SPLIT_K + BK - 1) // BK, W, XT, NT, 2, BLOCK_M, BLOCK_H, XT, BK, DOT,
                            PREC)
            _store_part(acc, t, split, SPLITS, Part, rows, tok_ok, XT, BLOCK_M)
        _finish_x(t, SPLITS, Part, Counter, X, Stats, Bias, WScale, ModRow, gate_off, M, W, XT, NT, BLOCK_M, SCALED)


@triton.jit
def _in_phase(XA, Win, Bin, Pos, X, Stats, pid, nprog, qi, tok_ok, ENTRIES: tl.constexpr,
              W: tl.constexpr, A: tl.constexpr, TOKENS: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """x = action_in(actions) + pos, tile by tile (each entry's rows in turn), with its LN stats."""
    offs_a = tl.arange(0, BLOCK_A)
    a_ok = offs_a < A
    lane = tl.arange(0, XT)
    for t in range(pid, NT, nprog):
        cols = t * XT + lane
        col_ok = cols < W
        w = tl.load(Win + cols[:, None] * A + offs_a[None, :], mask=col_ok[:, None] & a_ok[None, :], other=0.0)
        bias = tl.load(Bin + cols, mask=col_ok, other=0.0).to(tl.float32)
        ok = tok_ok[:, None] & col_ok[None, :]
        pos = tl.load(Pos + qi[:, None] * W + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        for b in range(ENTRIES):
            rows = b * TOKENS + qi
            a = tl.load(XA + rows[:, None] * A + offs_a[None, :], mask=tok_ok[:, None] & a_ok[None, :], other=0.0,
                        cache_modifier=".cg")
            y = tl.dot(a.to(DOT), tl.trans(w.to(DOT)), input_precision=PREC) + bias[None, :] + pos
            _store_x_tile(y, ok, X, Stats, t, rows, tok_ok, cols, W, NT, BLOCK_M)


@triton.jit
def _out_phase(X, Stats, FModRow, Wout, Bout, XA, VelOut, pid, qi, tok_ok, dt, eps, EULER: tl.constexpr,
               ENTRIES: tl.constexpr, TOKENS: tl.constexpr, W: tl.constexpr, A: tl.constexpr, XT: tl.constexpr,
               NT: tl.constexpr, NT_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_A: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """v = action_out(LN(x) * (1 + scale) + shift) in the model dtype (as the reference loop
    rounds it), and with EULER actions += dt * v. One program: it is 8 outputs a row."""
    if pid == 0:
        offs_a = tl.arange(0, BLOCK_A)
        a_ok = offs_a < A
        w0, w1, w2, w3 = _weights(Wout, W, 0, W, offs_a, a_ok, W // BK, BK)
        ok = tok_ok[:, None] & a_ok[None, :]
        for b in range(ENTRIES):
            rows = b * TOKENS + qi
            v = _ln_gemv(X, Stats, FModRow, 0, W, w0, w1, w2, w3, Bout, Bout, offs_a, a_ok, rows, tok_ok, eps,
                         W, XT, NT, NT_P2, BLOCK_M, BLOCK_H, BLOCK_A, BK, DOT, PREC, False)
            v = v.to(VelOut.dtype.element_ty)
            offs = rows[:, None] * A + offs_a[None, :]
            tl.store(VelOut + offs, v, mask=ok)
            if EULER:
                xa = tl.load(XA + offs, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(XA + offs, xa + dt * v.to(tl.float32), mask=ok)


@triton.jit
def _reuse_phase(XA, Vel, pid, rows, row_ok, dt, A: tl.constexpr, BLOCK_A: tl.constexpr):
    """actions += dt * v of an earlier step (action caching)."""
    if pid == 0:
        offs_a = tl.arange(0, BLOCK_A)
        ok = row_ok[:, None] & (offs_a < A)[None, :]
        offs = rows[:, None] * A + offs_a[None, :]
        v = tl.load(Vel + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        xa = tl.load(XA + offs, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(XA + offs, xa + dt * v, mask=ok)


@triton.jit
def _phase_weights(phase: tl.constexpr, j, pid, Wqkv, Wso, Wq, Wco, W1, W2, KV, Mask, msb, n_keys, keys_per_split,
                   ENTRIES: tl.constexpr, W: tl.constexpr, HEADS: tl.constexpr, HD: tl.constexpr, MLP: tl.constexpr,
                   DEPTH: tl.constexpr, XT: tl.constexpr, BLOCK_D: tl.constexpr, BK: tl.constexpr,
                   QKV_COLS: tl.constexpr, QKV_BN: tl.constexpr, CQ_COLS: tl.constexpr, CQ_BN: tl.constexpr,
                   FC1_COLS: tl.constexpr, FC1_BN: tl.constexpr, FC2_SPLITS: tl.constexpr, FC2_K: tl.constexpr,
                   FC2_BK: tl.constexpr, KEY_SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                   HAS_MASK: tl.constexpr):
    """What this program's first item in phase `phase` of block j reads that no earlier phase
    writes (none for j = DEPTH, the block after the last): the weights, as _weights, or for the
    cross-attention its first key chunk (_cross_keys); a placeholder for the other phases."""
    live = tl.where(j < DEPTH, 1, 0)
    if phase == QKV:
        return _linear_weights(Wqkv + j * (3 * W * W), pid, live * 3 * W, 3 * W, W, QKV_COLS, QKV_BN, BK)
    elif phase == CROSS_Q:
        return _linear_weights(Wq + j * (W * W), pid, live * W, W, W, CQ_COLS, CQ_BN, BK)
    elif phase == FC1:
        return _linear_weights(W1 + j * (MLP * W), pid, live * MLP, MLP, W, FC1_COLS, FC1_BN, BK)
    elif phase == FC2:
        return _fc2_weights(W2 + j * (W * MLP), pid, live * W, W, MLP, XT, FC2_SPLITS, FC2_K, FC2_BK)
    elif phase == SELF:
        w = _head_out_weights(Wso + j * (W * W), pid, live * W, W, HEADS, HD, XT, BLOCK_D)
        return w, w, w, w
    elif phase == CROSS_OUT:
        w = _head_out_weights(Wco + j * (W * W), pid, live * W, W, HEADS, HD, XT, BLOCK_D)
        return w, w, w, w
    elif phase == CROSS:
        k, v, ok = _cross_keys(KV + j * (2 * ENTRIES * HEADS * n_keys * HD), Mask, msb, pid,
                               live * tl.where(pid < ENTRIES * HEADS * KEY_SPLITS, 1, 0), n_keys, keys_per_split,
                               ENTRIES, HEADS, HD, KEY_SPLITS, BLOCK_D, BLOCK_KEYS, HAS_MASK)
        return k, v, ok, ok
    else:
        none = tl.zeros([16, 16], tl.float32)
        return none, none, none, none


@triton.jit
def _block_phase(phase: tl.constexpr, i, j, pid, nprog, qi, tok_ok, M, w0, w1, w2, w3,
                 Wqkv, Bqkv, Sqkv, Wso, Bso, Sso, Wq, Bq, Sq, Wco, Bco, Sco, W1, B1, S1, W2, B2, S2,
                 Mods, KV, Mask, msb, X, Stats, QkvBuf, Q, Y, Hid, OPart, MPart, LPart, Part, Counter,
                 n_keys, keys_per_split, eps, attn_scale,
                 ENTRIES: tl.constexpr, W: tl.constexpr, HEADS: tl.constexpr, HD: tl.constexpr, MLP: tl.constexpr,
                 TOKENS: tl.constexpr, DEPTH: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr,
                 NT_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BK: tl.constexpr, QKV_COLS: tl.constexpr, QKV_BN: tl.constexpr, CQ_COLS: tl.constexpr,
                 CQ_BN: tl.constexpr, FC1_COLS: tl.constexpr, FC1_BN: tl.constexpr, FC2_SPLITS: tl.constexpr,
                 FC2_K: tl.constexpr, FC2_BK: tl.constexpr, KEY_SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                 HAS_MASK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    """Phase `phase` of block j at flow step i; w0.. from _phase_weights(phase, j)."""
    mod = Mods + (i * DEPTH + j) * (9 * W)
    if phase == QKV:
        _ln_linear_phase(X, Stats, mod, 0, W, Wqkv + j * (3 * W * W), Bqkv + j * 3 * W, Sqkv + j * 3 * W, QkvBuf,
                         w0, w1, w2, w3, pid, nprog, qi, tok_ok, eps, 3 * W, QKV_COLS, False, ENTRIES, TOKENS, W,
                         XT, NT, NT_P2, BLOCK_M, BLOCK_H, QKV_BN, BK, DOT, PREC, SCALED)
    elif phase == SELF:
        _head_out_phase(QkvBuf, Wso + j * (W * W), Bso + j * W, Sso + j * W, Part, Counter, X, Stats, mod, 2 * W,
                        w0, pid, nprog, qi, tok_ok, M, attn_scale, True, ENTRIES, W, HEADS, HD, TOKENS, XT, NT,
                        BLOCK_M, BLOCK_D, DOT, PREC, SCALED)
    elif phase == CROSS_Q:
        _ln_linear_phase(X, Stats, mod, 3 * W, 4 * W, Wq + j * (W * W), Bq + j * W, Sq + j * W, Q,
                         w0, w1, w2, w3, pid, nprog, qi, tok_ok, eps, W, CQ_COLS, False, ENTRIES, TOKENS, W, XT, NT,
                         NT_P2, BLOCK_M, BLOCK_H, CQ_BN, BK, DOT, PREC, SCALED)
    elif phase == CROSS:
        _cross_phase(Q, KV + j * (2 * ENTRIES * HEADS * n_keys * HD), Mask, msb, OPart, MPart, LPart, Counter, Y,
                     w0, w1, w2, pid, nprog, n_keys, keys_per_split, attn_scale, ENTRIES, W, HEADS, HD, TOKENS,
                     BLOCK_H, BLOCK_D, KEY_SPLITS, BLOCK_KEYS, HAS_MASK, DOT)
    elif phase == CROSS_OUT:
        _head_out_phase(Y, Wco + j * (W * W), Bco + j * W, Sco + j * W, Part, Counter, X, Stats, mod, 5 * W,
                        w0, pid, nprog, qi, tok_ok, M, attn_scale, False, ENTRIES, W, HEADS, HD, TOKENS, XT, NT,
                        BLOCK_M, BLOCK_D, DOT, PREC, SCALED)
    elif phase == FC1:
        _ln_linear_phase(X, Stats, mod, 6 * W, 7 * W, W1 + j * (MLP * W), B1 + j * MLP, S1 + j * MLP, Hid,
                         w0, w1, w2, w3, pid, nprog, qi, tok_ok, eps, MLP, FC1_COLS, True, ENTRIES, TOKENS, W, XT,
                         NT, NT_P2, BLOCK_M, BLOCK_H, FC1_BN, BK, DOT, PREC, SCALED)
    elif phase == FC2:
        _fc2_phase(Hid, W2 + j * (W * MLP), B2 + j * W, S2 + j * W, Part, Counter, X, Stats, mod, 8 * W,
                   w0, w1, w2, w3, pid, nprog, qi, tok_ok, M, ENTRIES, TOKENS, W, MLP, XT, NT, BLOCK_M, BLOCK_H,
                   FC2_SPLITS, FC2_K, FC2_BK, DOT, PREC, SCALED)


@triton.jit
def _sync(NEXT: tl.constexpr, jn, segment, pid, Bar, Err, Trace, target, Wqkv, Wso, Wq, Wco, W1, W2, KV, Mask, msb,
          n_keys, keys_per_split, ENTRIES: tl.constexpr, W: tl.constexpr, HEADS: tl.constexpr, HD: tl.constexpr,
          MLP: tl.constexpr, DEPTH: tl.constexpr, XT: tl.constexpr, BLOCK_D: tl.constexpr, BK: tl.constexpr,
          QKV_COLS: tl.constexpr, QKV_BN: tl.constexpr, CQ_COLS: tl.constexpr, CQ_BN: tl.constexpr,
          FC1_COLS: tl.constexpr, FC1_BN: tl.constexpr, FC2_SPLITS: tl.constexpr, FC2_K: tl.constexpr,
          FC2_BK: tl.constexpr, KEY_SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr, HAS_MASK: tl.constexpr,
          HOIST: tl.constexpr, SPIN_LIMIT: tl.constexpr, TRACE: tl.constexpr, SEGMENTS: tl.constexpr):
    """The grid barrier that ends this program's segment `segment` (a phase) and starts the next,
    phase NEXT of block jn: its weights (_phase_weights) are loaded between this program's
    arrival and its wait with HOIST (they do not depend on the barrier, so their memory latency
    runs while the other programs finish), else after. TRACE: the segment's start and end times
    (globaltimer ns) into Trace [programs, SEGMENTS, 2]."""
    if TRACE:
        tl.store(Trace + (pid * SEGMENTS + segment) * 2 + 1, _clock_ns(pid))
    _grid_arrive(Bar)
    if HOIST:
        w0, w1, w2, w3 = _phase_weights(NEXT, jn, pid, Wqkv, Wso, Wq, Wco, W1, W2, KV, Mask, msb, n_keys,
                                        keys_per_split, ENTRIES, W, HEADS, HD, MLP, DEPTH, XT, BLOCK_D, BK, QKV_COLS,
                                        QKV_BN, CQ_COLS, CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS, FC2_K, FC2_BK,
                                        KEY_SPLITS, BLOCK_KEYS, HAS_MASK)
    _grid_wait(Bar, Err, target, SPIN_LIMIT)
    if not HOIST:
        w0, w1, w2, w3 = _phase_weights(NEXT, jn, pid, Wqkv, Wso, Wq, Wco, W1, W2, KV, Mask, msb, n_keys,
                                        keys_per_split, ENTRIES, W, HEADS, HD, MLP, DEPTH, XT, BLOCK_D, BK, QKV_COLS,
                                        QKV_BN, CQ_COLS, CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS, FC2_K, FC2_BK,
                                        KEY_SPLITS, BLOCK_KEYS, HAS_MASK)
    if TRACE:
        tl.store(Trace + (pid * SEGMENTS + segment + 1) * 2, _clock_ns(pid))
    return w0, w1, w2, w3


@triton.jit
def _program_rows(M, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program, the programs, every row (elementwise work) and one entry's rows (b * TOKENS +
    qi: the tiles of every dot, whatever the batch), each with its mask."""
    rows = tl.arange(0, BLOCK_M)
    qi = tl.arange(0, BLOCK_H)
    return tl.program_id(0), tl.num_programs(0), rows, rows < M, qi, qi < TOKENS


# Triton compiles a kernel once per specialisation of its integer arguments (value 1, multiples of
# 16): the step range and block index would make the inpainting loop's launches a step (steps 0-1,
# 1-2, 2-3 ...) and the per-phase launches' blocks compile apart from the loop's one launch (4
# configurations of the persistent kernel a bucket, ~22 s each for the sim expert in fp32:
# scripts/compile_flow_kernel.py --inpaint). They only offset loads and bound loops.
UNSPECIALIZED = ("step_lo", "step_hi", "block")


@triton.jit(do_not_specialize=UNSPECIALIZED)
def flow_kernel(XA, Vel, Reuse, Wqkv, Bqkv, Sqkv, Wso, Bso, Sso, Wq, Bq, Sq, Wco, Bco, Sco, W1, B1, S1, W2, B2, S2,
                Win, Bin, Pos, Wout, Bout, Mods, FMods, KV, Mask, msb,
                X, Stats, QkvBuf, Q, Y, Hid, OPart, MPart, LPart, Part, Counter, Bar, Err, Trace,
                M, n_keys, keys_per_split, step_lo, step_hi, block, dt, eps, attn_scale,
                PHASE: tl.constexpr, EULER: tl.constexpr, ENTRIES: tl.constexpr, W: tl.constexpr,
                HEADS: tl.constexpr, HD: tl.constexpr, MLP: tl.constexpr, A: tl.constexpr, TOKENS: tl.constexpr,
                DEPTH: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_A: tl.constexpr,
                BK: tl.constexpr, QKV_COLS: tl.constexpr, QKV_BN: tl.constexpr, CQ_COLS: tl.constexpr,
                CQ_BN: tl.constexpr, FC1_COLS: tl.constexpr, FC1_BN: tl.constexpr, FC2_SPLITS: tl.constexpr,
                FC2_K: tl.constexpr, FC2_BK: tl.constexpr, KEY_SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                HAS_MASK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr,
                HOIST: tl.constexpr, SPIN_LIMIT: tl.constexpr, TRACE: tl.constexpr, SEGMENTS: tl.constexpr):
    """Flow steps step_lo .. step_hi - 1 of the expert on actions XA [M, A] in one persistent launch
    (fp32, updated in place when EULER; Vel [steps, M, A] gets each computed step's velocity;
    Reuse [steps]: int32, -1 or the step whose velocity a step takes, read on the device).
    phase_kernel takes the same arguments and runs one phase."""
    pid, nprog, rows, row_ok, qi, tok_ok = _program_rows(M, TOKENS, BLOCK_M, BLOCK_H)
    if TRACE:
        tl.store(Trace + pid * SEGMENTS * 2, _clock_ns(pid))
    seg = 0  # segments ended = grid barriers passed
    for i in range(step_lo, step_hi):
        source = tl.load(Reuse + i)
        if source >= 0:
            _reuse_phase(XA, Vel + source * M * A, pid, rows, row_ok, dt, A, BLOCK_A)
        else:
            _in_phase(XA, Win, Bin, Pos, X, Stats, pid, nprog, qi, tok_ok, ENTRIES, W, A, TOKENS, XT, NT,
                      BLOCK_M, BLOCK_A, DOT, PREC)
            q0, q1, q2, q3 = _sync(QKV, 0, seg, pid, Bar, Err, Trace, (seg + 1) * nprog, Wqkv, Wso, Wq, Wco, W1, W2,
                                   KV, Mask, msb, n_keys, keys_per_split, ENTRIES, W, HEADS, HD, MLP, DEPTH, XT,
                                   BLOCK_D, BK, QKV_COLS, QKV_BN, CQ_COLS, CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS,
                                   FC2_K, FC2_BK, KEY_SPLITS, BLOCK_KEYS, HAS_MASK, HOIST, SPIN_LIMIT, TRACE,
                                   SEGMENTS)
            seg += 1
            for j in range(DEPTH):
                # The phases unrolled: each holds its own preloaded registers (QKV's carried
                # from the previous block's last barrier).
                for phase in tl.static_range(QKV, FC2 + 1):
                    if phase != QKV:
                        w0, w1, w2, w3 = _sync(phase, j, seg, pid, Bar, Err, Trace, (seg + 1) * nprog, Wqkv, Wso,
                                               Wq, Wco, W1, W2, KV, Mask, msb, n_keys, keys_per_split, ENTRIES, W,
                                               HEADS, HD, MLP, DEPTH, XT, BLOCK_D, BK, QKV_COLS, QKV_BN, CQ_COLS,
                                               CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS, FC2_K, FC2_BK, KEY_SPLITS,
                                               BLOCK_KEYS, HAS_MASK, HOIST, SPIN_LIMIT, TRACE, SEGMENTS)
                        seg += 1
                    else:
                        w0, w1, w2, w3 = q0, q1, q2, q3
                    _block_phase(phase, i, j, pid, nprog, qi, tok_ok, M, w0, w1, w2, w3,
                                 Wqkv, Bqkv, Sqkv, Wso, Bso, Sso, Wq, Bq, Sq, Wco, Bco, Sco, W1, B1, S1, W2, B2,
                                 S2, Mods, KV, Mask, msb, X, Stats, QkvBuf, Q, Y, Hid, OPart, MPart, LPart, Part,
                                 Counter, n_keys, keys_per_split, eps, attn_scale, ENTRIES, W, HEADS, HD, MLP,
                                 TOKENS, DEPTH, XT, NT, NT_P2, BLOCK_M, BLOCK_H, BLOCK_D, BK, QKV_COLS, QKV_BN,
                                 CQ_COLS, CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS, FC2_K, FC2_BK, KEY_SPLITS,
                                 BLOCK_KEYS, HAS_MASK, DOT, PREC, SCALED)
                q0, q1, q2, q3 = _sync(QKV, j + 1, seg, pid, Bar, Err, Trace, (seg + 1) * nprog, Wqkv, Wso, Wq, Wco,
                                       W1, W2, KV, Mask, msb, n_keys, keys_per_split, ENTRIES, W, HEADS, HD, MLP,
                                       DEPTH, XT, BLOCK_D, BK, QKV_COLS, QKV_BN, CQ_COLS, CQ_BN, FC1_COLS, FC1_BN,
                                       FC2_SPLITS, FC2_K, FC2_BK, KEY_SPLITS, BLOCK_KEYS, HAS_MASK, HOIST,
                                       SPIN_LIMIT, TRACE, SEGMENTS)
                seg += 1
            _out_phase(X, Stats, FMods + i * (2 * W), Wout, Bout, XA, Vel + i * M * A, pid, qi, tok_ok, dt, eps,
                       EULER, ENTRIES, TOKENS, W, A, XT, NT, NT_P2, BLOCK_M, BLOCK_H, BLOCK_A, BK, DOT, PREC)
        _sync(IN, 0, seg, pid, Bar, Err, Trace, (seg + 1) * nprog, Wqkv, Wso, Wq, Wco, W1, W2, KV, Mask, msb,
              n_keys, keys_per_split, ENTRIES, W, HEADS, HD, MLP, DEPTH, XT, BLOCK_D, BK, QKV_COLS, QKV_BN, CQ_COLS,
              CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS, FC2_K, FC2_BK, KEY_SPLITS, BLOCK_KEYS, HAS_MASK, HOIST,
              SPIN_LIMIT, TRACE, SEGMENTS)
        seg += 1


@triton.jit(do_not_specialize=UNSPECIALIZED)
def phase_kernel(XA, Vel, Reuse, Wqkv, Bqkv, Sqkv, Wso, Bso, Sso, Wq, Bq, Sq, Wco, Bco, Sco, W1, B1, S1, W2, B2, S2,
                Win, Bin, Pos, Wout, Bout, Mods, FMods, KV, Mask, msb,
                X, Stats, QkvBuf, Q, Y, Hid, OPart, MPart, LPart, Part, Counter, Bar, Err, Trace,
                M, n_keys, keys_per_split, step_lo, step_hi, block, dt, eps, attn_scale,
                PHASE: tl.constexpr, EULER: tl.constexpr, ENTRIES: tl.constexpr, W: tl.constexpr,
                HEADS: tl.constexpr, HD: tl.constexpr, MLP: tl.constexpr, A: tl.constexpr, TOKENS: tl.constexpr,
                DEPTH: tl.constexpr, XT: tl.constexpr, NT: tl.constexpr, NT_P2: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_A: tl.constexpr,
                BK: tl.constexpr, QKV_COLS: tl.constexpr, QKV_BN: tl.constexpr, CQ_COLS: tl.constexpr,
                CQ_BN: tl.constexpr, FC1_COLS: tl.constexpr, FC1_BN: tl.constexpr, FC2_SPLITS: tl.constexpr,
                FC2_K: tl.constexpr, FC2_BK: tl.constexpr, KEY_SPLITS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                HAS_MASK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr,
                HOIST: tl.constexpr, SPIN_LIMIT: tl.constexpr, TRACE: tl.constexpr, SEGMENTS: tl.constexpr):
    """Phase PHASE of flow step step_lo (and block `block`) as its own launch: flow_kernel's work
    between two of its grid barriers (the host's loop puts the launch boundary there)."""
    pid, nprog, rows, row_ok, qi, tok_ok = _program_rows(M, TOKENS, BLOCK_M, BLOCK_H)
    if PHASE == IN:
        _in_phase(XA, Win, Bin, Pos, X, Stats, pid, nprog, qi, tok_ok, ENTRIES, W, A, TOKENS, XT, NT, BLOCK_M,
                  BLOCK_A, DOT, PREC)
    elif PHASE == OUT:
        _out_phase(X, Stats, FMods + step_lo * (2 * W), Wout, Bout, XA, Vel + step_lo * M * A, pid, qi, tok_ok, dt,
                   eps, EULER, ENTRIES, TOKENS, W, A, XT, NT, NT_P2, BLOCK_M, BLOCK_H, BLOCK_A, BK, DOT, PREC)
    elif PHASE == REUSE:
        _reuse_phase(XA, Vel + tl.load(Reuse + step_lo) * M * A, pid, rows, row_ok, dt, A, BLOCK_A)
    else:
        w0, w1, w2, w3 = _phase_weights(PHASE, block, pid, Wqkv, Wso, Wq, Wco, W1, W2, KV, Mask, msb, n_keys,
                                        keys_per_split, ENTRIES, W, HEADS, HD, MLP, DEPTH, XT, BLOCK_D, BK, QKV_COLS,
                                        QKV_BN, CQ_COLS, CQ_BN, FC1_COLS, FC1_BN, FC2_SPLITS, FC2_K, FC2_BK,
                                        KEY_SPLITS, BLOCK_KEYS, HAS_MASK)
        _block_phase(PHASE, step_lo, block, pid, nprog, qi, tok_ok, M, w0, w1, w2, w3,
                     Wqkv, Bqkv, Sqkv, Wso, Bso, Sso, Wq, Bq, Sq, Wco, Bco, Sco, W1, B1, S1, W2, B2, S2,
                     Mods, KV, Mask, msb, X, Stats, QkvBuf, Q, Y, Hid, OPart, MPart, LPart, Part, Counter,
                     n_keys, keys_per_split, eps, attn_scale, ENTRIES, W, HEADS, HD, MLP, TOKENS, DEPTH, XT, NT,
                     NT_P2, BLOCK_M, BLOCK_H, BLOCK_D, BK, QKV_COLS, QKV_BN, CQ_COLS, CQ_BN, FC1_COLS, FC1_BN,
                     FC2_SPLITS, FC2_K, FC2_BK, KEY_SPLITS, BLOCK_KEYS, HAS_MASK, DOT, PREC, SCALED)
