// The action expert's flow loop as one persistent CUDA kernel, compiled at run time by NVRTC
// (kernels/expert_flow_cuda.py builds and launches it; FusedExpert(backend="cuda") uses it).
//
// Why CUDA C++ and not Triton: at M = 16 rows the Triton kernel's phases each took 3-4 us for
// 0.3-1.1 us of bytes, the time going to operand staging through shared memory and barrier
// broadcasts that Triton's language cannot reach (BENCHMARKS.md, issue 22). Here every
// operand of a tensor-core mma is loaded straight into the registers it is used in:
//   - weights are re-laid out once at load time in the mma's B-fragment order, so a lane's
//     fragments of two k-steps are one 16-byte load, a warp's a contiguous 512 bytes;
//   - activations that the kernel produces for a later dot (attention outputs, the MLPD hidden,
//     the cross-attention queries, q/k of the self-attention) are stored by their producer in
//     the consumer's A-fragment order (one 16-byte load per lane and k-step), and the values of
//     the self-attention are stored in the B-fragment order of P @ V;
//   - the context K/V are packed per query (by the host) in the B-fragment orders of Q K^T and
//     P V: one 16-byte load per lane and k-step, straight from memory, no shared memory.
// One program (256 threads) per SM; the phases of a block are separated by grid barriers (an
// arrival counter polled by one thread); a phase's weights (and the cross-attention's first
// keys) are loaded between this program's arrival at the barrier before it and its wait, so
// their memory latency runs while the other programs finish. Sums over warps, programs and key
// splits run in a fixed order: graph replays are bit-identical.
//
// Phases of block j at flow step i (rows: ENTRIES x TOK16 padded tokens, MT tiles of 16):
//   qkv       LN1 + modulate(x) @ Wqkv^T + b  -> q, k (A-fragment order), v (PV B-fragments)
//   self      per (entry, head, query tile) one warp: softmax(q k^T) v -> y (A-fragment order)
//   self_out  x += g1 (y @ Wso^T + b), and each 8-column tile's row mean and M2
//   cross_q   LN2 + modulate(x) @ Wq^T + b    -> q (A-fragment order); with FOLD_CQ no such phase:
//             qkv and self_out compute what the cross-attention's programs make q from (Part2)
//   cross     per (entry, head) CPP programs over its key tiles, one warp a tile at a time;
//             warps merged in the program, programs by the last to arrive -> y (self_out has read
//             it: a barrier between them)
//   cross_out x += g2 (y @ Wco^T + b)
//   fc1       LN3 + modulate(x) @ W1^T + b, GELU -> hid (A-fragment order)
//   fc2       x += g3 (hid @ W2^T + b)
// and per step, for the rows a program owns: out (final LN + modulate -> action_out -> v, and
// the Euler update), reuse (action caching: actions += dt v of an earlier step) and in (x =
// action_in(actions) + pos), their inputs other than x staged into shared memory before the
// step's last wait. A GEMV phase gives each program TPC tiles of 8 output columns
// and each of its 8 warps an eighth of K; the warps' partial sums meet in shared memory.
//
// Compile-time constants (-D): WIDTH HEADS HDIM MLPD ADIM TOK TOK16 ENTRIES DEPTH NPROG TPR SPIN_LIMIT,
// the LayerNorm linears' tiles a program (QKV_TPC CQ_TPC FC1_TPC) and the others' (SO_TPC CO_TPC,
// FC2_TPC a group of FC2_SPLIT programs'), FOLD_CQ (the cross-attention's queries folded into qkv
// and self_out: no cross_q phase; see Part2), FOLD_LN (with FOLD_CQ: the LayerNorms of qkv and fc1
// folded into their dots' epilogues: see LnFold),
// CROSS_GROUPS (with CLUSTER: an (entry, head)'s programs as that many clusters, merged by its last program),
// CROSS_GLOBAL (with CLUSTER: every program's partial merged by the pair's last program through global memory,
// none in distributed shared memory; the clusters then serve fc2's split alone),
// KV_SMEM (the cross-attention's key tiles copied into shared memory at KV_OFF floats, ahead of
// their use), FUSE_SELF and X_FRAGS (the LayerNorm phases read the residual stream's bf16 copy
// in A-fragment order, xf),
// W_SMEM (each GEMV phase's weights copied into one of two W_BUF-byte buffers at W_OFF floats by the
// copy engine while the phase before it runs, instead of loaded into registers before its wait),
// SELF_CLUSTER (the self-attention computed by self_out's clusters: FROM_CLUSTER), FC2_SPLIT (fc2's
// K split over that many programs of a cluster, partial sums through distributed shared memory at
// C_OFF: each program reads 1 / FC2_SPLIT of the MLP hidden), A_CHUNK (k-steps of A fragments a warp
// loads at once: one L2 round trip each chunk), X_AHEAD (a LayerNorm phase loads the next row tile's
// residual values before the dots of this one), L2_PREFETCH (1: each GEMV phase's weights pulled into
// L2 by the copy engine from the start of the phase before it, the cross-attention's key tiles from
// the start of the block; 2: only the key tiles; 3: only the key tiles, from qkv's arrival),
// V_LATE (without KV_SMEM: a cross-attention warp's first key tile's K loaded before the phase's wait,
// its V after the queries are made, in flight while the tile's Q K^T and softmax run), KV_AHEAD (the
// cross-attention's warps load a key tile's mask bits and pull its K/V into L2 a tile ahead: a warp of
// several tiles waited a round trip for each tile's K/V and then another for its mask), LATE_W (a
// GEMV phase's weights loaded into registers after its wait instead of before: what their loads cost
// the barrier's release), STATS_T
// (the LayerNorm statistics stored tile-major: stats_at), EPI_SPLIT (threads of a GEMV epilogue's
// (tile, row) item: 1, 2 or 4, each 8 / EPI_SPLIT of its columns), CLUSTER (the cross-attention's
// programs of an (entry, head) are a thread-block cluster of that many and merge their partials
// through distributed shared memory, each program's at C_OFF floats; 1: through global memory, the
// last program to arrive merging), and the measurement knobs POLL (how a barrier polls), TRACE
// (per-segment timestamps), WORK (0: every phase's loads and barriers without its arithmetic and
// stores: the loop's floor of synchronisation), POLL_THREAD (the thread that polls a barrier's
// counter), CROSS_CUT (1: the cross-attention's programs merge
// no partials but their own: the merge's cost; wrong numbers) and CROSS_MARKS (where the
// cross-attention's two trace marks go: CudaTiling.cross_marks).
// SO_STRIDE: the row stride (floats) of the cross-attention's warp partials in shared memory (HDIM,
// or padded so that a store's rows g = 0..3 fall on different banks: head_dim 96 put them all on one).
// W_FP8: the GEMV weights in e4m3 (fragments_b's order, a byte an element) with a scale a column
// (wsc_*), made bf16 exactly in registers at each mma and scaled in the epilogue: half the bytes.
// FP8_HOLD (with W_FP8): made bf16 once a phase, after its wait, and held (a bf16 kernel's registers),
// instead of at each use (once a row tile: MT times).

typedef unsigned int u32;
typedef unsigned short u16;

#define NTHREADS 256
#define NWARPS 8
#define MP (ENTRIES * TOK16)          // padded rows
#define MT (MP / 16)                // row tiles of 16
#define KS_W (WIDTH / 16)               // k-steps of a width-K dot
#define KS_MLP (MLPD / 16)
#define NT_W (WIDTH / 8)                // 8-column tiles of the residual stream (LN statistics)
#define HK (HDIM / 16)                // k-steps of a head
#define NEG (-1.0e30f)
#define LOG2E 1.4426950408889634f

// A lane's B fragments of two k-steps of a weight matrix (fragments_b's order): 8 bf16, or with
// W_FP8 8 e4m3 values.
#if W_FP8
typedef uint2 wfrag;
#else
typedef uint4 wfrag;
#endif

struct Params {
    float* xa; u16* vel; const int* reuse;
    const wfrag* wqkv; const u16* bqkv; const wfrag* wso; const u16* bso;
    const wfrag* wq; const u16* bq; const wfrag* wco; const u16* bco;
    const wfrag* w1; const u16* b1; const wfrag* w2; const u16* b2;
    const u16* win; const u16* bin; const u16* pos; const u16* wout; const u16* bout;
    const u16* mods; const u16* fmods; const uint4* kv; const unsigned char* mask;
    const wfrag* fold_m; const float* fold_c; const float* fold_ln;
    // W_FP8: each weight matrix's scale a column, [depth][N] (fold_m's [steps][depth][WIDTH])
    const float* wsc_qkv; const float* wsc_so; const float* wsc_q; const float* wsc_co; const float* wsc_1;
    const float* wsc_2; const float* wsc_fold;
    float* x; u16* xf; float* stats; u16* qkv; u16* q; u16* y; u16* hid; float* f0; float* sq;
    float* opart; float* mlpart;
    u32* counter; u32* bar; int* err; long long* trace;
    int n_keys, key_tiles, cpp, tiles_per_cta, mask_stride, has_mask, step_lo, step_hi, euler, segments;
    float dt, eps, scale;
};

// -- primitives ----------------------------------------------------------------------------------
// Everything written in PTX, by name. VLA_CPU: kernels/cuda_on_cpu.h defines the same functions
// (and CUDA's built-ins) for the host build, which runs every program's threads as fibers on one
// CPU thread: the suite's CPU check of this kernel (kernels/expert_flow_cuda.py, host_library).
#ifndef VLA_CPU
// Inputs that never change within a launch: the read-only path. `volatile` keeps a prefetch
// where it is written (before a barrier wait), not sunk to its first use.
__device__ __forceinline__ uint4 ld_in16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint2 ld_in8(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ float4 ld_in_f4(const float* p) {
    float4 r;
    asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ float2 ld_in_f2(const float* p) {
    float2 r;
    asm volatile("ld.global.nc.v2.f32 {%0,%1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ld_in4(const void* p) {
    u32 r;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ld_in1(const void* p) {
    unsigned short r;
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ float ld_in_bf(const u16* p) {
    unsigned short r;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return __uint_as_float(((u32)r) << 16);
}
// What this launch writes and reads back: L2 only (the SM's L1 is not coherent across SMs).
__device__ __forceinline__ uint4 ld_cg16(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ float2 ld_cg_f2(const float* p) {
    float2 r;
    asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ float4 ld_cg_f4(const float* p) {
    float4 r;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ float ld_cg_f(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ float ld_cg_bf(const u16* p) {
    unsigned short r;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return __uint_as_float(((u32)r) << 16);
}

// Asynchronous copies into shared memory (no registers held while they fly).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}
// One bulk copy (the copy engine, no threads held) of `bytes` into shared memory, completing on
// the mbarrier `bar` (KV_SMEM: a program's key tiles of a block, issued phases ahead of their use).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) {
    asm volatile("{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; "
                 "@!done bra WAIT_%=; }" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// L2_PREFETCH: `bytes` from src pulled into L2 by the copy engine (no registers, no shared memory,
// nothing to wait for), so the loads that follow a phase later find them there.
__device__ __forceinline__ void prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// The 128-byte line at src pulled into L2 (a hint: no registers, nothing to wait for).
__device__ __forceinline__ void prefetch_line(const void* src) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(src));
}
// Shared memory that generic loads read before, written next by the copy engine (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The program's dynamic shared memory.
__device__ __forceinline__ float* dynamic_smem() {
    extern __shared__ float4 smem4[];
    return (float*)smem4;
}

// Round to nearest even, two floats into one bf16 pair (lo in the low half).
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// a b + c of two bf16 pairs, rounded to nearest even (subnormals kept).
__device__ __forceinline__ u32 fma_bf2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// d += a b: one m16n8k16 bf16 tensor-core product (fp32 accumulators).
__device__ __forceinline__ void mma(float* d, uint4 a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ long long clock_ns() {
    long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// The grid barrier's memory operations (gpu scope).
__device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_release_add(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 atom_acq_rel_add(u32* p, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 atom_acquire_read(u32* p) {   // an atomic add of 0
    u32 v;
    asm volatile("atom.acquire.gpu.global.add.u32 %0, [%1], 0;" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_relaxed(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// CLUSTER: the programs of a cluster (CLUSTER consecutive programs) at one barrier: what each wrote
// to its shared memory before is what the others read after.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// p's place in the shared memory of the cluster's program `rank` (distributed shared memory).
__device__ __forceinline__ u32 peer_addr(const void* p, u32 rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    return a;
}
// The float, or the 16 bytes, at p's place in the shared memory of the cluster's program `rank`.
__device__ __forceinline__ float ld_peer(const float* p, u32 rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ uint4 ld_peer16(const void* p, u32 rank) {
    uint4 v;
    asm volatile("ld.shared::cluster.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
#endif   // VLA_CPU

// -- numbers -----------------------------------------------------------------------------------
__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u16 to_bf(float v) { return (u16)(pack_bf2(v, 0.0f) & 0xffffu); }
__device__ __forceinline__ float round_bf(float v) { return bf_lo(pack_bf2(v, 0.0f)); }

// Two e4m3 values (the top bytes of t's halves) as a bf16 pair, exactly: sign in place, exponent and
// mantissa 4 bits down (a bf16 of the value times 2^-120, subnormal where the e4m3 one is), then times
// 2^120 (exact).
__device__ __forceinline__ u32 bf2_of_e4m3(u32 t) {
    return fma_bf2((t & 0x80008000u) | ((t & 0x7f007f00u) >> 4), 0x7b807b80u, 0x80008000u);
}

// This program's weights of two k-steps: their read-only load, and k-step `odd`'s two B registers
// (bf16 pairs: rows 2q, 2q + 1 and 2q + 8, 2q + 9 of the lane's column).
__device__ __forceinline__ uint4 ld_w(const uint4* p) { return ld_in16(p); }
__device__ __forceinline__ uint2 ld_w(const uint2* p) { return ld_in8(p); }
__device__ __forceinline__ void b_regs(const uint4& w, int odd, u32& b0, u32& b1) {
    b0 = odd ? w.z : w.x;
    b1 = odd ? w.w : w.y;
}
__device__ __forceinline__ void b_regs(const uint2& w, int odd, u32& b0, u32& b1) {   // bytes e0 e1 e2 e3
    const u32 v = odd ? w.y : w.x;
    b0 = bf2_of_e4m3(((v & 0xffu) << 8) | ((v & 0xff00u) << 16));
    b1 = bf2_of_e4m3(((v >> 8) & 0xff00u) | (v & 0xff000000u));
}

// Offset (bf16 elements) of element (r, c) of a [MP, cols] matrix stored in A-fragment order:
// [row tile][k-step][lane][4 registers][2]. Register 0: (row g, cols 2q, 2q+1), 1: (row g + 8,
// 2q), 2: (g, 2q + 8), 3: (g + 8, 2q + 8), lane = 4 g + q (the m16n8k16 A operand).
__device__ __forceinline__ int afrag_offset(int r, int c, int ksteps) {
    int rr = r & 15, cc = c & 15;
    int lane = (rr & 7) * 4 + ((cc & 7) >> 1);
    int reg = (cc >> 3) * 2 + (rr >> 3);
    return ((((r >> 4) * ksteps + (c >> 4)) * 32 + lane) * 4 + reg) * 2 + (cc & 1);
}

// -- grid barrier --------------------------------------------------------------------------------
struct Sync {
    u32 arrivals;   // this program's arrivals so far (every program arrives at every barrier)
    int failed;     // thread 0: a wait gave up (programs not all resident): stop waiting
    u32 kv_parity;  // KV_SMEM: the phase of the K/V copy's mbarrier that the next wait waits for
    u32 w_phase;    // W_SMEM: GEMV phases so far (phase n reads weight buffer n & 1)
    u32 w_parity;   // W_SMEM: bit b, the phase of buffer b's mbarrier that its next wait waits for
};

// TRACE: per program and segment, its start (0: its wait's end), end (1: its arrival) and two
// marks inside (2, 3: a GEMV phase's statistics read and its dot products done; the
// cross-attention's queries made and its program's own merge done).
__device__ __forceinline__ void trace_mark(const Params& p, const Sync& s, int mark) {
    if (TRACE && threadIdx.x == 0 && (int)s.arrivals < p.segments)
        p.trace[((size_t)blockIdx.x * p.segments + s.arrivals) * 4 + mark] = clock_ns();
}

__device__ __forceinline__ void grid_arrive(const Params& p, Sync& s) {
    __syncthreads();
    trace_mark(p, s, 1);
    s.arrivals++;
    if (threadIdx.x == 0) {
        if (POLL == 3) st_release(p.bar + 1 + blockIdx.x, s.arrivals);   // this program's own flag: its arrivals so far
        else red_release_add(p.bar, 1u);
    }
}

// POLL 0: acquire loads of one counter; 1: atomic adds of 0 with acquire; 2: relaxed loads, one
// fence after; 3: a flag per program (no atomics), read by warp 0's lanes.
__device__ __forceinline__ u32 poll(const Params& p) {
    if (POLL == 0) return ld_acquire(p.bar);
    if (POLL == 1) return atom_acquire_read(p.bar);
    return ld_relaxed(p.bar);
}

__device__ __forceinline__ void grid_wait(const Params& p, Sync& s) {
    if (POLL == 3) {
        if (threadIdx.x < 32 && !s.failed) {
            int spins = 0;
            while (true) {
                bool here = true;
                for (int c = threadIdx.x; c < NPROG; c += 32) here &= ld_relaxed(p.bar + 1 + c) >= s.arrivals;
                if (__all_sync(0xffffffffu, here)) break;
                if (++spins > SPIN_LIMIT) {
                    if (threadIdx.x == 0) atomicExch(p.err, 1);
                    s.failed = 1;
                    break;
                }
            }
            fence_acq_rel();
        }
        __syncthreads();
        trace_mark(p, s, 0);
        return;
    }
    if (threadIdx.x == POLL_THREAD && !s.failed) {
        const u32 target = s.arrivals * NPROG;
        int spins = 0;
        while (poll(p) < target) {
            if (++spins > SPIN_LIMIT) {
                atomicExch(p.err, 1);
                s.failed = 1;
                break;
            }
        }
        if (POLL == 2) fence_acq_rel();
    }
    __syncthreads();
    trace_mark(p, s, 0);
}

// -- block reductions ------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the program's threads, in a fixed order (scratch: NWARPS floats).
__device__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < NWARPS; ++w) s += scratch[w];
    return s;
}

// Where row r's (mean, M2) of 8-column tile t is: stats [MP][NT_W][2], or with STATS_T
// [NT_W][MP][2] (a warp's threads of consecutive rows then read consecutive bytes: at B >= 4, 1-2
// threads a row, the other order has each lane of a load in another row).
__device__ __forceinline__ int stats_at(int r, int t) { return (STATS_T ? t * MP + r : r * NT_W + t) * 2; }

// LayerNorm mean and 1/std of rows row0 .. row0 + rows - 1 from their 8-column tiles' (mean, M2)
// (Chan's formula, equal counts): into mean[rows], rstd[rows] in shared memory. TPR threads a row.
__device__ void row_stats(const Params& p, float* mean, float* rstd, int row0 = 0, int rows = MP) {
    constexpr int PER = (NT_W + TPR - 1) / TPR;
    // a local base and each address taken outside the select below: with the loads' address folded into
    // it, ptxas spills 20 bytes instead of 12 at B = 4 on sm_90 (212 instead of 200 at B = 8)
    const float* stats = p.stats;
    const int lane_in_row = threadIdx.x % TPR;
    for (int base = 0; base < rows; base += NTHREADS / TPR) {
        const int rr = base + threadIdx.x / TPR, r = row0 + rr;
        const bool ok = rr < rows;
        float tm[PER], t2[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int t = lane_in_row + u * TPR;
            const bool here = ok && t < NT_W;
            const float* at = stats + stats_at(r, t);
            const float2 st = here ? ld_cg_f2(at) : make_float2(0.0f, 0.0f);
            tm[u] = st.x;
            t2[u] = st.y;
        }
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < PER; ++u) sum += tm[u];
        for (int o = TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float mu = sum / NT_W;
        float m2 = 0.0f;
#pragma unroll
        for (int u = 0; u < PER; ++u)
            if (lane_in_row + u * TPR < NT_W) m2 += t2[u] + 8.0f * (tm[u] - mu) * (tm[u] - mu);
        for (int o = TPR / 2; o > 0; o >>= 1) m2 += __shfl_xor_sync(0xffffffffu, m2, o);
        if (ok && lane_in_row == 0) {
            mean[rr] = mu;
            rstd[rr] = rsqrtf(m2 / WIDTH + p.eps);
        }
    }
}

// FOLD_LN: rows' mean and 1/std from the warps' (mean, M2) over their k-ranges (ln_warp_stats), merged
// in warp order (Chan's formula, equal counts: WIDTH / NWARPS columns a warp), into mean[MP], rstd[MP].
__device__ void ln_row_stats(const float* wstats, float* mean, float* rstd, float eps) {
    for (int r = threadIdx.x; r < MP; r += NTHREADS) {
        float mu = 0.0f, m2 = 0.0f;
        for (int w = 0; w < NWARPS; ++w) mu += wstats[(w * MP + r) * 2];
        mu /= NWARPS;
        for (int w = 0; w < NWARPS; ++w) {
            const float d = wstats[(w * MP + r) * 2] - mu;
            m2 += wstats[(w * MP + r) * 2 + 1] + (float)(WIDTH / NWARPS) * d * d;
        }
        mean[r] = mu;
        rstd[r] = rsqrtf(m2 / WIDTH + eps);
    }
}

// A thread's CPT consecutive columns (2, 4 or 8; aligned to their size), read through the read-only
// path (the launch's inputs), L2 (what it wrote) or from shared memory; bf16 values read as floats.
enum Path { READ_ONLY, L2, SHARED };
template <int PATH> __device__ __forceinline__ float2 ld_f2(const float* p) {
    if constexpr (PATH == READ_ONLY) return ld_in_f2(p);
    else if constexpr (PATH == L2) return ld_cg_f2(p);
    else return *(const float2*)p;
}
template <int PATH> __device__ __forceinline__ float4 ld_f4(const float* p) {
    if constexpr (PATH == READ_ONLY) return ld_in_f4(p);
    else if constexpr (PATH == L2) return ld_cg_f4(p);
    else return *(const float4*)p;
}
template <int CPT, int PATH> __device__ __forceinline__ void ld_cols(const float* p, float* v) {
    if constexpr (CPT == 2) {
        const float2 a = ld_f2<PATH>(p);
        v[0] = a.x; v[1] = a.y;
    } else {
        for (int k = 0; k < CPT; k += 4) {
            const float4 a = ld_f4<PATH>(p + k);
            v[k] = a.x; v[k + 1] = a.y; v[k + 2] = a.z; v[k + 3] = a.w;
        }
    }
}
template <int CPT, int PATH> __device__ __forceinline__ void ld_bf_cols(const u16* p, float* v) {
    static_assert(PATH != L2, "bf16 columns are inputs or shared memory");
    u32 w[4];
    if constexpr (CPT == 8) {
        const uint4 a = PATH == READ_ONLY ? ld_in16(p) : *(const uint4*)p;
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    } else {
        for (int k = 0; k < CPT / 2; ++k) w[k] = PATH == READ_ONLY ? ld_in4(p + 2 * k) : *(const u32*)(p + 2 * k);
    }
    for (int k = 0; k < CPT; ++k) v[k] = (k & 1) ? bf_hi(w[k >> 1]) : bf_lo(w[k >> 1]);
}
template <int CPT> __device__ __forceinline__ void st_cols(float* p, const float* v) {
    if constexpr (CPT == 2) *(float2*)p = make_float2(v[0], v[1]);
    else
        for (int k = 0; k < CPT; k += 4) *(float4*)(p + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
}

// Row r's columns c0 .. c0 + CPT - 1 (final values; the item's EPI_SPLIT threads hold its 8 columns
// of tile c0 / 8, consecutive lanes), and with STATS the tile's mean and M2, summed in column order by
// its first thread (FOLD_LN: only the cross-attention reads them, of self_out's x). Every thread of
// the warp calls it (the gather shuffles).
template <int CPT, bool STATS = true>
__device__ __forceinline__ void store_x(const Params& p, int r, int c0, const float* v) {
    constexpr int Q = 8 / CPT;
    const int lane = threadIdx.x & 31, first = lane & ~(Q - 1);
    float gathered[Q > 1 ? 8 : 1];
    const float* all = v;
    if constexpr (Q > 1 && STATS) {
        for (int k = 0; k < CPT; ++k) gathered[k] = v[k];
        for (int j = 1; j < Q; ++j)
            for (int k = 0; k < CPT; ++k) gathered[j * CPT + k] = __shfl_sync(0xffffffffu, v[k], first + j);
        all = gathered;
    }
    st_cols<CPT>(p.x + r * WIDTH + c0, v);
    if (X_FRAGS)
        for (int k = 0; k < CPT; k += 2) *(u32*)(p.xf + afrag_offset(r, c0 + k, KS_W)) = pack_bf2(v[k], v[k + 1]);
    if (!STATS || lane != first) return;
    float mu = 0.0f;
    for (int k = 0; k < 8; ++k) mu += all[k];
    mu *= 0.125f;
    float m2 = 0.0f;
    for (int k = 0; k < 8; ++k) m2 += (all[k] - mu) * (all[k] - mu);
    *(float2*)(p.stats + stats_at(r, c0 >> 3)) = make_float2(mu, m2);
}

// -- attention -----------------------------------------------------------------------------------
// Online softmax of one 16-key tile for a warp's 16 query rows (rows g and g + 8 of its lane):
// scores s[nt][4] (log2 domain, invalid keys already NEG and flagged), running max m, sum l,
// output o[HDIM/8][4]; P as an A fragment for the P @ V product.
__device__ __forceinline__ uint4 softmax_tile(float (&s)[2][4], const bool (&ok)[2][4], float (&m)[2], float (&l)[2],
                                              float (&o)[HDIM / 8][4]) {
    float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
    }
    float n0 = fmaxf(m[0], mx0), n1 = fmaxf(m[1], mx1);
    float c0 = exp2f(m[0] - n0), c1 = exp2f(m[1] - n1);
    m[0] = n0;
    m[1] = n1;
    float pr[2][4];
    for (int nt = 0; nt < 2; ++nt)
        for (int k = 0; k < 4; ++k) pr[nt][k] = ok[nt][k] ? exp2f(s[nt][k] - (k < 2 ? n0 : n1)) : 0.0f;
    l[0] = l[0] * c0 + pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1];
    l[1] = l[1] * c1 + pr[0][2] + pr[0][3] + pr[1][2] + pr[1][3];
#pragma unroll
    for (int dn = 0; dn < HDIM / 8; ++dn) {
        o[dn][0] *= c0; o[dn][1] *= c0; o[dn][2] *= c1; o[dn][3] *= c1;
    }
    return make_uint4(pack_bf2(pr[0][0], pr[0][1]), pack_bf2(pr[0][2], pr[0][3]), pack_bf2(pr[1][0], pr[1][1]),
                      pack_bf2(pr[1][2], pr[1][3]));
}

__device__ __forceinline__ void pv(float (&o)[HDIM / 8][4], uint4 pa, const uint4* v) {
#pragma unroll
    for (int u = 0; u < HK; ++u) {
        mma(o[2 * u], pa, v[u].x, v[u].y);
        mma(o[2 * u + 1], pa, v[u].z, v[u].w);
    }
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Self-attention of (entry b, head h, query tile qm) on one warp: its output rows as the A
// fragments of the head's HK k-steps (normalised, bf16), for y or straight into self_out's dot.
__device__ __forceinline__ void self_attend(const Params& p, int b, int h, int qm, uint4 (&out)[HK]) {
    const int lane = threadIdx.x & 31, q = lane & 3, qtiles = TOK16 / 16, mt = b * qtiles + qm;
    const float scale = p.scale * LOG2E;
    uint4 qa[HK];
    for (int ks = 0; ks < HK; ++ks) qa[ks] = ld_cg16((const uint4*)p.qkv + ((mt * 2 * KS_W + h * HK + ks) * 32 + lane));
    float m[2] = {NEG, NEG}, l[2] = {0.0f, 0.0f}, o[HDIM / 8][4];
    for (int dn = 0; dn < HDIM / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    for (int kt = 0; kt < qtiles; ++kt) {
        const int km = b * qtiles + kt;
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        for (int ks = 0; ks < HK; ++ks) {
            // k in A-fragment order: registers (0, 2) are key rows 0-7's B fragment, (1, 3) rows 8-15's.
            uint4 k = ld_cg16((const uint4*)p.qkv + ((km * 2 * KS_W + KS_W + h * HK + ks) * 32 + lane));
            mma(sc[0], qa[ks], k.x, k.z);
            mma(sc[1], qa[ks], k.y, k.w);
        }
        bool ok[2][4];
        for (int nt = 0; nt < 2; ++nt)
            for (int k = 0; k < 4; ++k) {
                ok[nt][k] = kt * 16 + nt * 8 + 2 * q + (k & 1) < TOK;
                sc[nt][k] = ok[nt][k] ? sc[nt][k] * scale : NEG;
            }
        uint4 pa = softmax_tile(sc, ok, m, l, o);
        uint4 v[HK];
        const uint4* vsrc = (const uint4*)(p.qkv + MP * 2 * WIDTH) + ((km * HEADS + h) * 32 + lane) * HK;
        for (int u = 0; u < HK; ++u) v[u] = ld_cg16(vsrc + u);
        pv(o, pa, v);
    }
    const float inv0 = 1.0f / quad_sum(l[0]), inv1 = 1.0f / quad_sum(l[1]);
    for (int u = 0; u < HK; ++u)
        out[u] = make_uint4(pack_bf2(o[2 * u][0] * inv0, o[2 * u][1] * inv0),
                            pack_bf2(o[2 * u][2] * inv1, o[2 * u][3] * inv1),
                            pack_bf2(o[2 * u + 1][0] * inv0, o[2 * u + 1][1] * inv0),
                            pack_bf2(o[2 * u + 1][2] * inv1, o[2 * u + 1][3] * inv1));
}

// -- the GEMV phases -------------------------------------------------------------------------------
// The residual stream's values of one k-step of a warp's A fragment (a LayerNorm's source): fp32
// pairs (registers 0-3: rows g, g + 8 x columns 2q, 2q + 8), or with X_FRAGS the stream's bf16
// copy in A-fragment order, one 16-byte load (half the bytes that every program of a LayerNorm
// phase reads; the LayerNorm of bf16 values is what the model's bf16 eager loop computes).
#if X_FRAGS
typedef uint4 XRaw;
__device__ __forceinline__ float2 x_pair(const XRaw& raw, int reg) {
    const u32 v = reg == 0 ? raw.x : reg == 1 ? raw.y : reg == 2 ? raw.z : raw.w;
    return make_float2(bf_lo(v), bf_hi(v));
}
#else
struct XRaw { float2 v[4]; };
__device__ __forceinline__ float2 x_pair(const XRaw& raw, int reg) { return raw.v[reg]; }
#endif

// FROM_SELF (FUSE_SELF): self_out's A fragments are its own warp's head of the self-attention
// (warp w's k-range is head w's columns), so the self phase and its barrier go. FROM_CLUSTER
// (SELF_CLUSTER): each program of a cluster computes a share of the self-attention's (entry, head,
// query tile) items into its shared memory, and self_out's warps read their A fragments from the
// program that holds them (distributed shared memory): the self phase and its barrier go, and each
// item is computed once a cluster.
enum Source { FROM_X_LN, FROM_FRAGS, FROM_SELF, FROM_CLUSTER };

// SELF_CLUSTER: item i (of (entry, head, query tile), in y's order) is warp i / CLUSTER's of the
// cluster's program i % CLUSTER; its fragments [HK][32 lanes] at C_OFF floats in that program.
__device__ __forceinline__ uint4* self_slot(float* smem, int i) { return (uint4*)(smem + C_OFF) + i / CLUSTER * HK * 32; }
__device__ void self_items(const Params& p, float* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, qtiles = TOK16 / 16;
    const int item = warp * CLUSTER + blockIdx.x % CLUSTER;
    if (item < ENTRIES * HEADS * qtiles) {
        const int b = item / (HEADS * qtiles), h = item / qtiles % HEADS, qm = item % qtiles;
        uint4 out[HK];
        self_attend(p, b, h, qm, out);
        uint4* dst = self_slot(smem, item) + lane;
        for (int u = 0; u < HK; ++u) dst[u * 32] = out[u];
    }
}
enum Epilogue { TO_QKV, TO_FRAGS, TO_FRAGS_GELU, TO_RESIDUAL };

// The largest chunk of at most `most` k-steps that divides a warp's k steps.
constexpr int whole_chunk(int ksteps, int most) {
    int c = ksteps < most ? ksteps : most;
    while (ksteps % c) --c;
    return c;
}

// SPLIT > 1 (FC2_SPLIT): K split over SPLIT consecutive programs of a cluster (a group), each
// reading 1 / SPLIT of the activations: a program's partial sums of its group's TPC tiles over its
// part of K, reduced through distributed shared memory by the program whose epilogue takes a tile.
template <int N, int K, int TPCX, int SPLIT = 1> struct Shape {
    static constexpr int NT8 = N / 8;                   // output tiles of 8 columns
    static constexpr int KS = K / 16;
    static constexpr int KSW = KS / SPLIT / NWARPS;     // k-steps of one warp
    static constexpr int KP = KSW / 2;                  // 16-byte weight loads per (tile, lane)
    // tiles of one program (of its group): TPCX, or as few as reach every output tile
    static constexpr int TPC = TPCX ? TPCX : (NT8 + NPROG / SPLIT - 1) / (NPROG / SPLIT);
    static constexpr int OWN = (TPC + SPLIT - 1) / SPLIT;   // tiles whose epilogue the program runs
    static_assert(SPLIT == 1 || (CLUSTER % SPLIT == 0 && KSW % 2 == 0),
                  "SPLIT: whole groups in a cluster, k-pairs a warp");
    __device__ static int t0() { return blockIdx.x / SPLIT * TPC; }         // the group's first tile
    __device__ static int rank() { return blockIdx.x % SPLIT; }
    __device__ static int own(int tt) { return rank() + tt * SPLIT; }       // the group's tile of own tile tt
};

// W_SMEM: a program's weights of one GEMV phase (its tiles, contiguous in B-fragment order; the
// second part's from w2), streamed by the copy engine into one of two shared-memory buffers while
// the phase before it runs, so the weight loads hold no thread and no load queue at a barrier.
struct WRef {
    const wfrag* p;
    u32 bytes;      // 0: the program has no tiles in the phase
};
// A program's first weights of a phase: its (group's) first tile, in the second part's matrix w2 from
// output NA on, from its part of K (SPLIT).
template <int N, int K, int TPCX, int NA = N, int SPLIT = 1>
__device__ __forceinline__ const wfrag* first_weights(const wfrag* wf, const wfrag* w2) {
    typedef Shape<N, K, TPCX, SPLIT> S;
    const int t0 = S::t0();
    const wfrag* w = NA < N && t0 >= NA / 8 ? w2 + (size_t)(t0 - NA / 8) * K : wf + (size_t)t0 * K;
    return w + S::rank() * (S::KS / SPLIT / 2) * 32;
}
template <int N, int K, int TPCX, int NA = N, int SPLIT = 1>
__device__ __forceinline__ WRef wref(const wfrag* wf, const wfrag* w2) {
    typedef Shape<N, K, TPCX> S;
    const int t0 = S::t0();
    if (t0 >= S::NT8 || SPLIT > 1) return {nullptr, 0u};   // SPLIT: a program's weights are not one range
    return {first_weights<N, K, TPCX, NA>(wf, w2), (u32)(min(S::TPC, S::NT8 - t0) * K * sizeof(wfrag))};
}

// The weight buffers at W_OFF floats: two mbarriers (padded to 16 bytes), then two of W_BUF bytes.
__device__ __forceinline__ unsigned long long* w_bar(float* smem, int b) { return (unsigned long long*)(smem + W_OFF) + b; }
__device__ __forceinline__ wfrag* w_buf(float* smem, int b) { return (wfrag*)(smem + W_OFF + 4 + b * (W_BUF / 4)); }

// Thread 0 starts the copy of r into the buffer of GEMV phase w_phase + ahead (free: its last
// reader, phase w_phase + ahead - 2, has ended).
// L2_PREFETCH (without W_SMEM): the copy engine pulls them into L2 instead, for the register loads.
__device__ __forceinline__ void w_issue(Sync& s, float* smem, const WRef& r, int ahead) {
    if (L2_PREFETCH == 1 && !W_SMEM && threadIdx.x == 0 && r.bytes) prefetch_l2(r.p, r.bytes);
    if (!W_SMEM || threadIdx.x != 0 || r.bytes == 0) return;
    const int b = (s.w_phase + ahead) & 1;
    fence_proxy_async();
    bulk_copy(w_buf(smem, b), r.p, r.bytes, w_bar(smem, b));
}

// This GEMV phase's buffer once its copy has landed.
__device__ __forceinline__ const wfrag* w_take(Sync& s, float* smem) {
    const int b = s.w_phase & 1;
    mbar_wait(w_bar(smem, b), (s.w_parity >> b) & 1u);
    s.w_parity ^= 1u << b;
    return w_buf(smem, b);
}

// FOLD_CQ: the cross-attention's queries folded into the phases before it. With x1 = x0 + g1
// (y Wso^T + bso) and q = (LN(x1) (1 + c2) + s2) Wq^T + bq (c2, s2: the step's scale and shift),
//   q = rstd1 (x1 (1 + c2) Wq^T - mean1 rho) + delta,   rho = (1 + c2) Wq^T, delta = s2 Wq^T + bq,
//   x1 (1 + c2) Wq^T = F0 + y M + eps,                  M = Wq diag((1 + c2) g1) Wso, eps = M's bias,
//   F0 = x0 (1 + c2) Wq^T = (LN(x0) (1 + c2) Wq^T) / rstd0 + mean0 rho,
// so the qkv phase computes F0 as its second part (the tiles after q, k, v: LN(x0) scaled by 1 + c2,
// no shift, the weights Wq), the self_out phase S = F0 + y M + eps as its second part (the tiles
// after Wso's, the weights M of the step and block), and the cross-attention's programs q from S
// and x1's statistics: the cross_q phase and its barrier go. M, eps, rho, delta depend on the
// flow step's modulations only: the host makes them once per schedule (fold_m [steps][depth] in
// B-fragment order, fold_c [steps][depth][eps, rho, delta][WIDTH] fp32).
// A phase's second part: its weights (indexed from the part's first tile), the step and block's
// fold constants, and (LayerNorm sources) the offset of the scale it modulates with (no shift).
struct Part2 {
    const wfrag* w;
    const float* fc;
    int scale_off;
    const float* wsc;   // W_FP8: w's scale a column
};

// FOLD_LN: a LayerNorm phase's normalisation folded into its epilogue. With a = 1 + c and s the
// step's scale and shift, (LN(x) a + s) W^T + b = rstd (x a W^T - mean rho) + delta, where
// rho = a W^T and delta = s W^T + b: the dots read x a (one product an element), each warp takes
// its rows' mean and M2 over its k-range from the same values while they are in its registers
// (ln_partial_stats), and the epilogue merges the warps' (ln_row_stats) and applies the rest. So a
// program no longer reads every row's 8-column statistics (49 KB at B = 4) nor waits for them
// before its dots, and only self_out's x has its 8-column statistics stored (for the cross-attention's
// queries). The statistics are of the values the dots read (with X_FRAGS the residual's
// bf16 copy: what the model's bf16 eager loop normalises). rho and delta depend on the step's
// modulations only: the host makes them once a schedule, fold_ln [steps][depth][LN_C] fp32 (qkv's
// rho [3 WIDTH] and delta [3 WIDTH], then fc1's rho [MLPD] and delta [MLPD]). qkv's second part
// (FOLD_CQ's F0 = x0 (1 + c2) Wq^T) is then its dot alone.
#define LN_C (6 * WIDTH + 2 * MLPD)
#if FOLD_LN && !FOLD_CQ
#error "FOLD_LN folds qkv's and fc1's LayerNorms; with FOLD_CQ off cross_q's would need its own constants"
#endif

// FOLD_LN: the warps' per-row (mean, M2) over their k-ranges [NWARPS][MP][2], after the epilogue's inputs.
__device__ __forceinline__ float* ln_warp_stats(float* pre) { return pre + 16 * NTHREADS; }

// y = src @ Wf^T (+ epilogue): Wf in B-fragment order [N/8][K/32][lane][8]; src the LN-modulated
// residual stream (mod_shift/mod_scale: offsets in the step's block modulations) or a matrix in
// A-fragment order. wr: this program's weights, loaded by gemv_weights before the wait. Output
// columns from NA on are the second part (FOLD_CQ; a program's tiles are all in one part).
template <int N, int K, int EPI, int TPCX, int NA = N, int SPLIT = 1> struct Gemv {
    typedef Shape<N, K, TPCX, SPLIT> S;
    static constexpr int NA8 = NA / 8;
    static_assert(NA == N || NA8 % S::TPC == 0, "a program's tiles are all in one part");
    wfrag wr[S::TPC][S::KP];
    uint4 held[FP8_HOLD ? S::TPC : 1][FP8_HOLD ? S::KP : 1];   // FP8_HOLD: wr made bf16
    u32 shift[S::KSW][2], scale[S::KSW][2];
    // pre: this thread's slot of 16 floats in shared memory for the epilogue's inputs of its first
    // (tile, row): bias, gate and the residual's old values (written two or more barriers before
    // this phase, so copied in before its wait); in the second part rho (qkv) or eps and F0 (self_out);
    // with LNF (FOLD_LN's phases) rho and delta instead of the bias, from ln (the phase's fold_ln).
    template <bool LNF>
    __device__ __forceinline__ void load(const Params& p, const wfrag* wf, const u16* bias, const u16* mod,
                                         int shift_off, int scale_off, int gate_off, bool modulated, float* pre,
                                         const Part2& p2, const float* ln) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int t0 = S::t0();
        const bool second = NA < N && t0 >= NA8;
        // Item threadIdx.x / EPI_SPLIT's 16 floats, its 4 chunks of 16 bytes shared by its threads.
        constexpr int CHUNKS = 4 / EPI_SPLIT;
        const int item = threadIdx.x / EPI_SPLIT, tt = item / MP, r = item % MP, tg = S::own(tt), c0 = (t0 + tg) * 8;
        const int ch0 = threadIdx.x % EPI_SPLIT * CHUNKS;
        float* slot = pre + item * 16;
#pragma unroll
        for (int j = 0; j < CHUNKS && tt < S::OWN && tg < S::TPC && t0 + tg < S::NT8; ++j) {
            const int ch = ch0 + j, c = c0 - NA + (ch & 1) * 4;
            if (second && EPI == TO_QKV) {
                if (ch < 2 && !FOLD_LN) cp_async16(slot + 4 * ch, p2.fc + WIDTH + c);
            } else if (LNF) {   // rho, then delta
                cp_async16(slot + 4 * ch, ln + (ch >> 1) * NA + c0 + (ch & 1) * 4);
            } else if (second) {
                if (ch < 2) cp_async16(slot + 4 * ch, p2.fc + c);
                // F0 is the qkv phase's: one barrier back without a self phase, read after the wait
                else if (!FUSE_SELF && !SELF_CLUSTER) cp_async16(slot + 4 * ch, p.f0 + r * WIDTH + c);
            } else if (ch == 0) {
                cp_async16(slot, bias + c0);
            } else if (EPI == TO_RESIDUAL) {
                const float* old = p.x + r * WIDTH + c0 + (ch - 2) * 4;
                cp_async16(slot + 4 * ch, ch == 1 ? (const void*)(mod + gate_off + c0) : old);
            }
        }
        if (!LATE_W) load_w(wf, p2);
        if (modulated && t0 < S::NT8) {
            const int q = lane & 3;
            const int so = second ? p2.scale_off : scale_off;
#pragma unroll
            for (int ks = 0; ks < S::KSW; ++ks) {
                int c = (warp * S::KSW + ks) * 16 + 2 * q;
                shift[ks][0] = second || LNF ? 0u : ld_in4(mod + shift_off + c);
                shift[ks][1] = second || LNF ? 0u : ld_in4(mod + shift_off + c + 8);
                scale[ks][0] = ld_in4(mod + so + c);
                scale[ks][1] = ld_in4(mod + so + c + 8);
            }
        }
    }

    // This program's weights into registers (without W_SMEM): before the phase's wait, or with
    // LATE_W after it.
    __device__ __forceinline__ void load_w(const wfrag* wf, const Part2& p2) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t0 = S::t0();
        const wfrag* w = first_weights<N, K, TPCX, NA, SPLIT>(wf, p2.w);
#pragma unroll
        for (int tt = 0; tt < S::TPC && !W_SMEM; ++tt)
#pragma unroll
            for (int kp = 0; kp < S::KP; ++kp)
                wr[tt][kp] = t0 + tt < S::NT8 ? ld_w(w + ((tt * (S::KS / 2) + warp * S::KP + kp) * 32 + lane))
                                              : wfrag{};
    }

    // W_SMEM: this program's weights from its buffer (the same order as in memory, from its first tile).
    __device__ __forceinline__ void load_smem(const wfrag* buf) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t0 = blockIdx.x * S::TPC;
#pragma unroll
        for (int tt = 0; tt < S::TPC; ++tt)
#pragma unroll
            for (int kp = 0; kp < S::KP; ++kp)
                wr[tt][kp] = t0 + tt < S::NT8 ? buf[(tt * (S::KS / 2) + warp * S::KP + kp) * 32 + lane] : wfrag{};
    }

    // FP8_HOLD: this program's e4m3 weights as bf16, each fragment pair once.
    __device__ __forceinline__ void hold() {
        if constexpr (!FP8_HOLD) return;
#pragma unroll
        for (int tt = 0; tt < S::TPC; ++tt)
#pragma unroll
            for (int kp = 0; kp < S::KP; ++kp) {
                u32 b[4];
                b_regs(wr[tt][kp], 0, b[0], b[1]);
                b_regs(wr[tt][kp], 1, b[2], b[3]);
                held[tt][kp] = make_uint4(b[0], b[1], b[2], b[3]);
            }
    }

    // The residual stream's values of this warp's A fragments of row tile mt (LN sources).
    __device__ __forceinline__ void load_x(const Params& p, int mt, XRaw (&raw)[S::KSW]) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#if X_FRAGS
#pragma unroll
        for (int ks = 0; ks < S::KSW; ++ks)
            raw[ks] = ld_cg16((const uint4*)p.xf + ((mt * KS_W + warp * S::KSW + ks) * 32 + lane));
#else
        const int g = lane >> 2, q = lane & 3, r0 = mt * 16 + g, r1 = r0 + 8;
#pragma unroll
        for (int ks = 0; ks < S::KSW; ++ks) {
            const int c = (warp * S::KSW + ks) * 16 + 2 * q;
            raw[ks].v[0] = ld_cg_f2(p.x + r0 * WIDTH + c);
            raw[ks].v[1] = ld_cg_f2(p.x + r1 * WIDTH + c);
            raw[ks].v[2] = ld_cg_f2(p.x + r0 * WIDTH + c + 8);
            raw[ks].v[3] = ld_cg_f2(p.x + r1 * WIDTH + c + 8);
        }
#endif
    }

    // The A fragment of k-step ks (of this warp's) of row tile mt: from frags, or LN + modulate
    // of the residual values raw.
    template <int SRC>
    __device__ __forceinline__ uint4 a_frag(const u16* frags, int src_ksteps, int mt, int ks,
                                            const XRaw (&raw)[S::KSW], const float* mean, const float* rstd) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
        if (SRC == FROM_CLUSTER) {   // k-step ks of head h of row tile mt: item (b, h, qm)'s fragment u
            const int kg = warp * S::KSW + ks, h = kg / HK, u = kg % HK, qtiles = TOK16 / 16;
            const int item = (mt / qtiles * HEADS + h) * qtiles + mt % qtiles;
            return ld_peer16(self_slot(dynamic_smem(), item) + u * 32 + lane, item % CLUSTER);
        }
        if (SRC != FROM_X_LN)
            return ld_cg16((const uint4*)frags +
                           ((mt * src_ksteps + S::rank() * (S::KS / SPLIT) + warp * S::KSW + ks) * 32 + lane));
        const int r0 = mt * 16 + g, r1 = r0 + 8;
        // (FOLD_LN reads neither; the statements in this order: moved below its return, the default's
        // loop compiled to other instructions at B = 1 and 2)
        const float m0 = FOLD_LN ? 0.0f : mean[r0], s0 = FOLD_LN ? 1.0f : rstd[r0];
        const float m1 = FOLD_LN ? 0.0f : mean[r1], s1 = FOLD_LN ? 1.0f : rstd[r1];
        const float2 x00 = x_pair(raw[ks], 0), x10 = x_pair(raw[ks], 1), x01 = x_pair(raw[ks], 2), x11 = x_pair(raw[ks], 3);
        float sh0 = bf_lo(shift[ks][0]), sh1 = bf_hi(shift[ks][0]), sh2 = bf_lo(shift[ks][1]), sh3 = bf_hi(shift[ks][1]);
        float sc0 = 1.0f + bf_lo(scale[ks][0]), sc1 = 1.0f + bf_hi(scale[ks][0]);
        float sc2 = 1.0f + bf_lo(scale[ks][1]), sc3 = 1.0f + bf_hi(scale[ks][1]);
        if (FOLD_LN)   // x (1 + c): the normalisation is the epilogue's
            return make_uint4(pack_bf2(x00.x * sc0, x00.y * sc1), pack_bf2(x10.x * sc0, x10.y * sc1),
                              pack_bf2(x01.x * sc2, x01.y * sc3), pack_bf2(x11.x * sc2, x11.y * sc3));
        return make_uint4(pack_bf2((x00.x - m0) * s0 * sc0 + sh0, (x00.y - m0) * s0 * sc1 + sh1),
                          pack_bf2((x10.x - m1) * s1 * sc0 + sh0, (x10.y - m1) * s1 * sc1 + sh1),
                          pack_bf2((x01.x - m0) * s0 * sc2 + sh2, (x01.y - m0) * s0 * sc3 + sh3),
                          pack_bf2((x11.x - m1) * s1 * sc2 + sh2, (x11.y - m1) * s1 * sc3 + sh3));
    }

    __device__ static bool second_part() { return NA < N && S::t0() >= NA8; }
    // The epilogue's inputs (pre) after the warps' partial sums red [NWARPS][TPC][MP][8].
    __device__ static float* pre_of(float* red) { return red + NWARPS * S::TPC * MP * 8; }

    // FOLD_LN: this warp's (mean, M2) of row tile mt's rows over its k-range, from raw (the values
    // its dots read) into wstats (ln_warp_stats): a lane's values of its two rows two-pass, then the
    // quad's lanes (a row's) merged by Chan's formula (equal counts; every lane gets the same sums).
    __device__ __forceinline__ void ln_partial_stats(int mt, const XRaw (&raw)[S::KSW], float* wstats) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        float n = 4.0f * S::KSW, mean[2] = {0.0f, 0.0f}, m2[2] = {0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < S::KSW; ++ks)
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {   // registers 0, 2: row g; 1, 3: row g + 8
                const float2 v = x_pair(raw[ks], reg);
                mean[reg & 1] += v.x + v.y;
            }
        mean[0] /= n;
        mean[1] /= n;
#pragma unroll
        for (int ks = 0; ks < S::KSW; ++ks)
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {
                const float2 v = x_pair(raw[ks], reg);
                const float d0 = v.x - mean[reg & 1], d1 = v.y - mean[reg & 1];
                m2[reg & 1] += d0 * d0 + d1 * d1;
            }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float om = __shfl_xor_sync(0xffffffffu, mean[h], o), o2 = __shfl_xor_sync(0xffffffffu, m2[h], o);
                const float d = mean[h] - om;
                m2[h] = (m2[h] + o2) + d * d * (0.5f * n);
                mean[h] = (mean[h] + om) * 0.5f;
            }
            n *= 2.0f;
        }
        if ((lane & 3) == 0)
            for (int h = 0; h < 2; ++h)
                *(float2*)(wstats + (warp * MP + mt * 16 + (lane >> 2) + 8 * h) * 2) = make_float2(mean[h], m2[h]);
    }

    // The warps' partial sums of this program's tiles into red[warp][tile][row][8]: per row
    // tile, the A fragments of KC k-steps (A_CHUNK, at most a warp's) loaded together, each used by
    // every tile. raw: row tile 0's residual values (LN sources), loaded before the statistics.
    template <int SRC>
    __device__ __forceinline__ void partials(const Params& p, const u16* frags, int src_ksteps, float* red,
                                             const float* mean, const float* rstd, XRaw (&raw)[S::KSW]) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
        constexpr int KC = whole_chunk(S::KSW, A_CHUNK);
        const bool ln_stats = FOLD_LN && SRC == FROM_X_LN && !second_part();
        for (int mt = 0; mt < MT; ++mt) {
            if (SRC == FROM_X_LN && mt > 0 && !X_AHEAD) load_x(p, mt, raw);
            if (ln_stats) ln_partial_stats(mt, raw, ln_warp_stats(pre_of(red)));
            uint4 att[HK];
            if (SRC == FROM_SELF) self_attend(p, mt / (TOK16 / 16), warp, mt % (TOK16 / 16), att);
            float acc[S::TPC][4];
#pragma unroll
            for (int tt = 0; tt < S::TPC; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.0f;
#pragma unroll
            for (int k0 = 0; k0 < S::KSW; k0 += KC) {
                uint4 a[KC];
#pragma unroll
                for (int k = 0; k < KC; ++k)
                    a[k] = SRC == FROM_SELF ? att[(k0 + k) % HK] : a_frag<SRC>(frags, src_ksteps, mt, k0 + k, raw, mean, rstd);
                // X_AHEAD: the next row tile's values in flight during this one's dots (raw is free now)
                if (X_AHEAD && SRC == FROM_X_LN && k0 + KC == S::KSW && mt + 1 < MT) load_x(p, mt + 1, raw);
#pragma unroll
                for (int k = 0; k < KC; ++k) {
                    const int ks = k0 + k;
#pragma unroll
                    for (int tt = 0; tt < S::TPC; ++tt) {
                        u32 b0, b1;
                        if constexpr (FP8_HOLD) b_regs(held[tt][ks >> 1], ks & 1, b0, b1);
                        else b_regs(wr[tt][ks >> 1], ks & 1, b0, b1);
                        mma(acc[tt], a[k], b0, b1);
                    }
                }
            }
#pragma unroll
            for (int tt = 0; tt < S::TPC; ++tt) {
                float* dst = red + ((warp * S::TPC + tt) * MP + mt * 16 + g) * 8 + 2 * q;
                *(float2*)dst = make_float2(acc[tt][0], acc[tt][1]);
                *(float2*)(dst + 8 * 8) = make_float2(acc[tt][2], acc[tt][3]);
            }
        }
    }

    // SPLIT: the program's partial sums of its group's tiles, its warps summed in order, into
    // red_k [TPC][MP][8] (the cluster region at C_OFF, which no phase writes before its wait).
    __device__ __forceinline__ void split_sums(const float* red, float* red_k) {
        for (int e = threadIdx.x; e < S::TPC * MP * 8; e += NTHREADS) {
            const int tt = e / (MP * 8), rc = e % (MP * 8);
            float v = 0.0f;
            for (int w = 0; w < NWARPS; ++w) v += red[(w * S::TPC + tt) * MP * 8 + rc];
            red_k[e] = v;
        }
    }

    // The epilogue: EPI_SPLIT threads (consecutive lanes) an item (tile, row) of 8 columns, each
    // CPT of them, the warps (SPLIT: the group's programs, red_k) summed in order. Its first items'
    // inputs are in pre (loaded before the wait; visible: gemv_phase waits for the copies before the
    // barrier that precedes this). A warp's threads agree on every loop exit (where EPI_SPLIT > 1 the
    // count is a multiple of 32 and a warp's 32 / EPI_SPLIT items lie in one tile): store_x's
    // shuffles see the whole warp.
    template <bool LNF>
    __device__ __forceinline__ void epilogue(const Params& p, const float* red, const float* red_k, const u16* bias, u16* out,
                                             const u16* mod, int gate_off, const float* pre, const float* mean,
                                             const float* rstd, const Part2& p2, const float* wsc, const float* ln) {
        constexpr int CPT = 8 / EPI_SPLIT;
        const int t0 = S::t0(), k0 = threadIdx.x % EPI_SPLIT * CPT;
        const float* slot = pre + threadIdx.x / EPI_SPLIT * 16;   // this thread's first item's inputs
#pragma unroll 1   // an item at a time: unrolled, the items' registers spill
        for (int sub = threadIdx.x; sub < S::OWN * MP * EPI_SPLIT; sub += NTHREADS) {
            const int idx = sub / EPI_SPLIT, tt = S::own(idx / MP), r = idx % MP, tile = t0 + tt;
            if (tt >= S::TPC || tile >= S::NT8) continue;
            const int ct = tile * 8, c0 = ct + k0;   // the tile's first column, this thread's
            const bool first = sub == threadIdx.x;
            float v[CPT];
            for (int k = 0; k < CPT; ++k) v[k] = 0.0f;
            if (SPLIT > 1) {   // the group's programs' sums (split_sums), in order
                const u32 rank0 = blockIdx.x % CLUSTER - S::rank();
                for (int c = 0; c < SPLIT; ++c)
                    for (int k = 0; k < CPT; ++k) v[k] += ld_peer(red_k + (tt * MP + r) * 8 + k0 + k, rank0 + c);
            }
            for (int w = 0; w < NWARPS && SPLIT == 1; ++w) {
                float a[CPT];
                ld_cols<CPT, SHARED>(red + ((w * S::TPC + tt) * MP + r) * 8 + k0, a);
                for (int k = 0; k < CPT; ++k) v[k] += a[k];
            }
            if (W_FP8) {   // the columns' e4m3 scales
                float sc[CPT];
                ld_cols<CPT, READ_ONLY>(NA < N && t0 >= NA8 ? p2.wsc + (c0 - NA) : wsc + c0, sc);
                for (int k = 0; k < CPT; ++k) v[k] *= sc[k];
            }
            if (NA < N && t0 >= NA8) {   // the second part (FOLD_CQ; all of the program's tiles)
                const int c = c0 - NA;
                if (EPI == TO_QKV) {   // F0 = LN(x0) (1 + c2) Wq^T / rstd0 + mean0 rho (FOLD_LN: the dot)
                    if (!FOLD_LN) {
                        float rho[CPT];
                        if (first) ld_cols<CPT, SHARED>(slot + k0, rho);
                        else ld_cols<CPT, READ_ONLY>(p2.fc + WIDTH + c, rho);
                        for (int k = 0; k < CPT; ++k) v[k] = v[k] / rstd[r] + mean[r] * rho[k];
                    }
                    float* f0 = p.f0 + r * WIDTH + c;
                    for (int k = 0; k < CPT; k += 2) *(float2*)(f0 + k) = make_float2(v[k], v[k + 1]);
                } else {               // S = F0 + y M + eps, in A-fragment order
                    float e[CPT], f[CPT];
                    if (first) ld_cols<CPT, SHARED>(slot + k0, e);
                    else ld_cols<CPT, READ_ONLY>(p2.fc + c, e);
                    if (first && !FUSE_SELF && !SELF_CLUSTER) ld_cols<CPT, SHARED>(slot + 8 + k0, f);
                    else ld_cols<CPT, L2>(p.f0 + r * WIDTH + c, f);
                    for (int k = 0; k < CPT; k += 2)
                        *(float2*)(p.sq + afrag_offset(r, c + k, KS_W)) = make_float2(v[k] + (e[k] + f[k]),
                                                                                      v[k + 1] + (e[k + 1] + f[k + 1]));
                }
                continue;
            }
            if (LNF) {   // rstd (x a W^T - mean rho) + delta
                float rho[CPT], delta[CPT];
                if (first) {
                    ld_cols<CPT, SHARED>(slot + k0, rho);
                    ld_cols<CPT, SHARED>(slot + 8 + k0, delta);
                } else {
                    ld_cols<CPT, READ_ONLY>(ln + c0, rho);
                    ld_cols<CPT, READ_ONLY>(ln + NA + c0, delta);
                }
                for (int k = 0; k < CPT; ++k) v[k] = rstd[r] * (v[k] - mean[r] * rho[k]) + delta[k];
            } else {
                float b[CPT];
                if (first) ld_bf_cols<CPT, SHARED>((const u16*)slot + k0, b);
                else ld_bf_cols<CPT, READ_ONLY>(bias + c0, b);
                for (int k = 0; k < CPT; ++k) v[k] += b[k];
            }
            if (EPI == TO_RESIDUAL) {
                float g[CPT], old[CPT];
                if (first) {
                    ld_bf_cols<CPT, SHARED>((const u16*)(slot + 4) + k0, g);
                    ld_cols<CPT, SHARED>(slot + 8 + k0, old);
                } else {
                    ld_bf_cols<CPT, READ_ONLY>(mod + gate_off + c0, g);
                    ld_cols<CPT, L2>(p.x + r * WIDTH + c0, old);
                }
                for (int k = 0; k < CPT; ++k) v[k] = old[k] + g[k] * v[k];
                store_x<CPT, !FOLD_LN || (NA < N)>(p, r, c0, v);   // FOLD_LN: self_out's (x1's) alone
            } else if (EPI == TO_QKV && ct >= 2 * WIDTH) {
                // v of head h in the B-fragment order of P @ V: [row tile][head][lane][HDIM/8][2][2] with
                // (key = half 8 + 2 q + e, d = 8 dn + g) of the tile's 16 keys.
                const int h = (ct - 2 * WIDTH) / HDIM, d0 = (ct - 2 * WIDTH) % HDIM, kk = r & 15;
                const int half = kk >> 3, qq = (kk & 7) >> 1, e = kk & 1, dn = d0 >> 3;
                u16* vb = out + MP * 2 * WIDTH + ((r >> 4) * HEADS + h) * 32 * (HDIM / 2);
                for (int k = 0; k < CPT; ++k)
                    vb[((k0 + k) * 4 + qq) * (HDIM / 2) + dn * 4 + half * 2 + e] = to_bf(v[k]);
            } else {
                if (EPI == TO_FRAGS_GELU)
                    for (int k = 0; k < CPT; ++k) v[k] = 0.5f * v[k] * (1.0f + erff(v[k] * 0.7071067811865476f));
                const int cols = EPI == TO_QKV ? 2 * WIDTH : N;
                for (int k = 0; k < CPT; k += 2)
                    *(u32*)(out + afrag_offset(r, c0 + k, cols / 16)) = pack_bf2(v[k], v[k + 1]);
            }
        }
    }
};

// One GEMV phase of block j: weights (and the epilogue's inputs) before the wait, then the dot.
template <int N, int K, int SRC, int EPI, int TPCX = 0, int NA = N, int SPLIT = 1>
__device__ __forceinline__ void gemv_phase(const Params& p, Sync& s, float* smem, const wfrag* wf, const float* wsc,
                                           const u16* bias,
                                           const u16* mod, int shift_off, int scale_off, int gate_off,
                                           const u16* frags, int src_ksteps, u16* out, const Part2& p2 = Part2{},
                                           const WRef& next_w = WRef{nullptr, 0u}, const float* ln = nullptr) {
    typedef Shape<N, K, TPCX, SPLIT> S;
    typedef Gemv<N, K, EPI, TPCX, NA, SPLIT> G;
    constexpr bool LNF = FOLD_LN && SRC == FROM_X_LN;   // the LayerNorm in the epilogue (ln: rho, delta)
    static_assert(SPLIT == 1 || (SRC == FROM_FRAGS && NA == N && !W_SMEM), "SPLIT: dots of stored fragments only");
    G gemv;
    w_issue(s, smem, next_w, 1);   // W_SMEM: the next GEMV phase's weights stream in while this one runs
    float* mean = smem;
    float* rstd = smem + MP;
    float* red = smem + 2 * MP;
    float* pre = G::pre_of(red);                   // the epilogue's inputs: 16 floats an item of its first round
    float* red_k = smem + C_OFF;                   // SPLIT: the program's sums for its group
    gemv.template load<LNF>(p, wf, bias, mod, shift_off, scale_off, gate_off, SRC == FROM_X_LN, pre, p2, ln);
    grid_wait(p, s);
    if (LATE_W) gemv.load_w(wf, p2);
    if (SRC == FROM_CLUSTER && WORK) {   // every program of the cluster: its items, then the barrier
        self_items(p, smem);
        cluster_sync();
    }
    const bool active = S::t0() < S::NT8;
    if (W_SMEM && active) gemv.load_smem(w_take(s, smem));
    if (FP8_HOLD && active) gemv.hold();
    if (WORK && SPLIT > 1) {   // every program of the cluster meets at its barrier
        trace_mark(p, s, 2);
        if (active) {
            XRaw raw[S::KSW];   // unused: the fragments' dots read no residual values
            gemv.template partials<SRC>(p, frags, src_ksteps, red, mean, rstd, raw);
            __syncthreads();
            gemv.split_sums(red, red_k);
        }
        cp_async_wait();
        cluster_sync();
        trace_mark(p, s, 3);
        if (active) gemv.template epilogue<false>(p, red, red_k, bias, out, mod, gate_off, pre, mean, rstd, p2, wsc, ln);
    } else if (WORK && active) {
        XRaw raw[S::KSW];
        if (SRC == FROM_X_LN) {   // row tile 0's values in flight while the statistics load
            gemv.load_x(p, 0, raw);
            if (!FOLD_LN) {
                row_stats(p, mean, rstd);
                __syncthreads();
            }
        }
        trace_mark(p, s, 2);
        gemv.template partials<SRC>(p, frags, src_ksteps, red, mean, rstd, raw);
        cp_async_wait();   // pre: an item's inputs came through its threads' copies
        __syncthreads();
        if (LNF && !G::second_part()) {   // the rows' statistics from the warps' (partials)
            ln_row_stats(ln_warp_stats(pre), mean, rstd, p.eps);
            __syncthreads();
        }
        trace_mark(p, s, 3);
        gemv.template epilogue<LNF>(p, red, red_k, bias, out, mod, gate_off, pre, mean, rstd, p2, wsc, ln);
    }
    cp_async_wait();
    s.w_phase++;
    grid_arrive(p, s);
}

// Self-attention: one warp per (entry, head, query tile), warps spread over the programs first.
__device__ void self_phase(const Params& p, Sync& s) {
    grid_wait(p, s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int item = warp * NPROG + blockIdx.x, qtiles = TOK16 / 16;
    if (WORK && item < ENTRIES * HEADS * qtiles) {
        const int b = item / (HEADS * qtiles), h = (item / qtiles) % HEADS, qm = item % qtiles;
        uint4 out[HK];
        self_attend(p, b, h, qm, out);
        uint4* dst = (uint4*)p.y + (((b * qtiles + qm) * KS_W + h * HK) * 32 + lane);
        for (int u = 0; u < HK; ++u) dst[u * 32] = out[u];
    }
    grid_arrive(p, s);
}

// Flash-decoding merge weights of n partials per row: m [n][TOK16] (log2 maxima) becomes each
// partial's weight exp2(m - max), l [n][TOK16] (sums): l[row] becomes the merged sum and
// l[TOK16 + row] the merged maximum (each row's slots are its own thread's; n >= 2). Ends with
// __syncthreads.
__device__ void merge_weights(float* m, float* l, int n) {
    if (threadIdx.x < TOK16) {
        const int row = threadIdx.x;
        float mx = NEG;
        for (int c = 0; c < n; ++c) mx = fmaxf(mx, m[c * TOK16 + row]);
        float sum = 0.0f;
        for (int c = 0; c < n; ++c) {
            const float f = exp2f(m[c * TOK16 + row] - mx);
            m[c * TOK16 + row] = f;
            sum += f * l[c * TOK16 + row];
        }
        l[row] = sum;
        l[TOK16 + row] = mx;
    }
    __syncthreads();
}

// Where key tile `tile` of (entry b, head h) in block j starts in p.kv, in lanes' fragment rows of
// HK 16-byte loads: its K then its V, 32 rows each (host-packed, kernels/pack_kv.py).
#define KV_TILE_BYTES (2 * 32 * HK * 16)
__device__ __forceinline__ size_t kv_tile(const Params& p, int j, int b, int h, int tile) {
    return (((size_t)(j * ENTRIES + b) * HEADS + h) * p.key_tiles + tile) * 2 * 32;
}

// The K (half 0) or V (half 1) fragments of key tile `tile` of (entry b, head h) in block j: HK
// 16-byte loads a lane.
__device__ __forceinline__ void load_half(const Params& p, int j, int b, int h, int tile, int half, uint4* dst) {
    const uint4* src = p.kv + (kv_tile(p, j, b, h, tile) + (threadIdx.x & 31)) * HK + half * 32 * HK;
    for (int u = 0; u < HK; ++u) dst[u] = ld_in16(src + u);
}
__device__ __forceinline__ void load_kv(const Params& p, int j, int b, int h, int tile, uint4* kv) {
    load_half(p, j, b, h, tile, 0, kv);
    load_half(p, j, b, h, tile, 1, kv + HK);
}

// KV_SMEM: this program's key tiles of block j copied into shared memory (one bulk copy,
// thread 0), issued before the block's first phase: they land while qkv .. cross_q run. Else
// with L2_PREFETCH 1 or 2 pulled into L2 as early, with 3 from qkv's arrival on (after_qkv: the
// self-attention reads no weights, so the tiles do not queue behind qkv's in the HBM).
__device__ __forceinline__ void kv_prefetch(const Params& p, float* smem, int j, bool after_qkv) {
    const int pair = blockIdx.x / p.cpp, part = blockIdx.x % p.cpp;
    const int first = part * p.tiles_per_cta, tiles = min(p.tiles_per_cta, p.key_tiles - first);
    const bool at_start = KV_SMEM || L2_PREFETCH == 1 || L2_PREFETCH == 2;
    const bool now = after_qkv ? !KV_SMEM && L2_PREFETCH == 3 : at_start;
    if (!now || threadIdx.x != 0 || pair >= ENTRIES * HEADS || tiles <= 0) return;
    const int b = pair / HEADS, h = pair % HEADS;
    const uint4* src = p.kv + kv_tile(p, j, b, h, first) * HK;
    if (KV_SMEM) {   // over the tiles the last block's cross-attention read with generic loads
        fence_proxy_async();
        bulk_copy(smem + KV_OFF + 4, src, (u32)tiles * KV_TILE_BYTES, (unsigned long long*)(smem + KV_OFF));
    }
    else prefetch_l2(src, (u32)tiles * KV_TILE_BYTES);
}

// KV_AHEAD: key tile `tile` of (entry b, head h) in block j pulled into L2 a tile ahead of its
// loads, a 128-byte line a lane.
__device__ __forceinline__ void kv_lines_l2(const Params& p, int j, int b, int h, int tile) {
    const char* src = (const char*)(p.kv + kv_tile(p, j, b, h, tile) * HK);
    for (int line = threadIdx.x & 31; line < KV_TILE_BYTES / 128; line += 32) prefetch_line(src + line * 128);
}

// Which of key tile `tile`'s keys a lane's scores (nt, e) are valid for entry b (in range, not
// masked): bit 2 nt + e. Read-only inputs, so loaded before a barrier's wait.
__device__ __forceinline__ u32 key_bits(const Params& p, int b, int tile) {
    const int q = threadIdx.x & 3;
    u32 bits = 0;
    for (int nt = 0; nt < 2; ++nt)
        for (int e = 0; e < 2; ++e) {
            const int key = tile * 16 + nt * 8 + 2 * q + e;
            if (key < p.n_keys && (!p.has_mask || ld_in1(p.mask + b * p.mask_stride + key))) bits |= 1u << (2 * nt + e);
        }
    return bits;
}

// FOLD_CQ: what the queries of (entry b, head h) are made from, copied into shared memory
// (cp.async: no registers held): rho and delta of the head's columns (constants: issued before the
// phase's wait), and S of its rows in A-fragment order [query tile][k-step][lane][8] (after it).
// stage: [TOK16 / 16][HK][32][8] S, then [HDIM] rho, [HDIM] delta.
__device__ __forceinline__ void stage_fold_constants(const float* fc, int h, float* stage) {
    float* dst = stage + (TOK16 / 16) * HK * 256;
    for (int k = threadIdx.x; k < HDIM / 2; k += NTHREADS)   // 16-byte chunks: HDIM / 4 of rho, then of delta
        cp_async16(dst + 4 * k, fc + (k < HDIM / 4 ? WIDTH + 4 * k : 2 * WIDTH + 4 * (k - HDIM / 4)) + h * HDIM);
}
__device__ __forceinline__ void stage_fold_s(const Params& p, int b, int h, float* stage) {
    for (int k = threadIdx.x; k < (TOK16 / 16) * HK * 64; k += NTHREADS) {
        const int qm = k / (HK * 64), ks = (k / 64) % HK, chunk = k % 64, mt = b * (TOK16 / 16) + qm;
        cp_async16(stage + 4 * k, p.sq + ((mt * KS_W + h * HK + ks) * 32) * 8 + 4 * chunk);
    }
}

// FOLD_CQ: the A fragments of the cross-attention's queries of (entry b, head h, query tile qm),
// q = rstd1 (S - mean1 rho) + delta (see Part2), from the stage (stage_fold_*) and x1's row
// statistics mean[TOK16], rstd[TOK16], all in shared memory.
__device__ __forceinline__ void folded_queries(const float* stage, int qm, const float* mean, const float* rstd,
                                               uint4 (&qa)[HK]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int r0 = qm * 16 + g, r1 = r0 + 8;
    const float m0 = mean[r0], s0 = rstd[r0], m1 = mean[r1], s1 = rstd[r1];
    const float* rho = stage + (TOK16 / 16) * HK * 256;
    const float* delta = rho + HDIM;
#pragma unroll
    for (int ks = 0; ks < HK; ++ks) {
        const float* src = stage + ((qm * HK + ks) * 32 + lane) * 8;
        const float4 lo = *(const float4*)src, hi = *(const float4*)(src + 4);   // (r0, c), (r1, c), (r0, c + 8), (r1, c + 8)
        const int c = ks * 16 + 2 * q;
        const float2 rho0 = *(const float2*)(rho + c), rho1 = *(const float2*)(rho + c + 8);
        const float2 d0 = *(const float2*)(delta + c), d1 = *(const float2*)(delta + c + 8);
        qa[ks] = make_uint4(pack_bf2((lo.x - m0 * rho0.x) * s0 + d0.x, (lo.y - m0 * rho0.y) * s0 + d0.y),
                            pack_bf2((lo.z - m1 * rho0.x) * s1 + d0.x, (lo.w - m1 * rho0.y) * s1 + d0.y),
                            pack_bf2((hi.x - m0 * rho1.x) * s0 + d1.x, (hi.y - m0 * rho1.y) * s0 + d1.y),
                            pack_bf2((hi.z - m1 * rho1.x) * s1 + d1.x, (hi.w - m1 * rho1.y) * s1 + d1.y));
    }
}

// The pair's last program to arrive merges its n partials in global memory (each program's, or
// with cross groups each cluster's: opart [n][TOK16][HDIM], mlpart [n][TOK16][max, sum]) into y, in
// order; every program of the pair arrives once. scratch: shared memory for n partials; flag: an int.
__device__ void merge_by_the_last(const Params& p, float* scratch, int* flag, int pair, int n, int b, int h) {
    __syncthreads();
    if (threadIdx.x == 0)   // releases this program's partial, acquires the others'
        *flag = atom_acq_rel_add(p.counter + pair, 1u) == (u32)(p.cpp - 1);
    __syncthreads();
    if (!*flag) return;
    // All of them copied in at once (one round trip).
    float* gpart = scratch;                             // [n][TOK16][HDIM]
    float* gm = scratch + n * TOK16 * HDIM;             // [n][TOK16] max, then weight
    float* gl = gm + n * TOK16;                         // [n][TOK16] sum
    const float* src = p.opart + (size_t)pair * n * TOK16 * HDIM;
    for (int k = threadIdx.x; k < n * TOK16 * HDIM / 4; k += NTHREADS) cp_async16(gpart + 4 * k, src + 4 * k);
    const float* src_ml = p.mlpart + (size_t)pair * n * TOK16 * 2;
    for (int k = threadIdx.x; k < n * TOK16; k += NTHREADS) {
        gm[k] = ld_cg_f(src_ml + 2 * k);
        gl[k] = ld_cg_f(src_ml + 2 * k + 1);
    }
    cp_async_wait();
    __syncthreads();
    merge_weights(gm, gl, n);
    for (int e = threadIdx.x; e < TOK16 * HDIM; e += NTHREADS) {
        const int row = e / HDIM, d = e % HDIM;
        float acc = 0.0f;
        for (int c = 0; c < n; ++c) acc += gm[c * TOK16 + row] * gpart[(c * TOK16 + row) * HDIM + d];
        p.y[afrag_offset(b * TOK16 + row, h * HDIM + d, KS_W)] = to_bf(acc / gl[row]);
    }
    if (threadIdx.x == 0) p.counter[pair] = 0;
}

// Cross-attention of block j over the context K/V: (entry, head) pairs, p.cpp programs each,
// p.tiles_per_cta key tiles a program, warp w its tiles w, w + 8, ... fc: the step and block's
// fold constants (FOLD_CQ).
__device__ void cross_phase(const Params& p, Sync& s, float* smem, int j, const float* fc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int pair = blockIdx.x / p.cpp, part = blockIdx.x % p.cpp;
    const bool active = pair < ENTRIES * HEADS;
    const int b = pair / HEADS, h = pair % HEADS;
    const int tile_lo = part * p.tiles_per_cta + warp;
    const int tile_hi = min((part + 1) * p.tiles_per_cta, p.key_tiles);
    uint4 kv[2 * HK];
    if (!KV_SMEM && active && tile_lo < tile_hi) {   // V_LATE: its V after the wait
        if (V_LATE) load_half(p, j, b, h, tile_lo, 0, kv);
        else load_kv(p, j, b, h, tile_lo, kv);
    }
    const u32 first_bits = active && tile_lo < tile_hi ? key_bits(p, b, tile_lo) : 0u;
    // FOLD_CQ's stage: after the region the last program's merge may use (cpp partials)
    const int partials = NWARPS * (SO_STRIDE + 2) > p.cpp * (HDIM + 2) ? NWARPS * (SO_STRIDE + 2) : p.cpp * (HDIM + 2);
    float* stage = smem + 4 + 2 * TOK16 + partials * TOK16;
    if (FOLD_CQ && WORK && active) stage_fold_constants(fc, h, stage);
    grid_wait(p, s);
    const uint4* kvs = (const uint4*)(smem + KV_OFF + 4);   // KV_SMEM: this program's tiles, from kv_prefetch
    if (KV_SMEM && active && part * p.tiles_per_cta < p.key_tiles) {
        mbar_wait((unsigned long long*)(smem + KV_OFF), s.kv_parity);
        s.kv_parity ^= 1u;
    }
    if (WORK && active) {
        int* flag = (int*)smem;
        float* qmean = smem + 4;                            // FOLD_CQ: x1's row statistics of entry b
        float* qrstd = qmean + TOK16;
        float* so = qrstd + TOK16;                          // [NWARPS][TOK16][SO_STRIDE] warp partials
        float* sm = so + NWARPS * TOK16 * SO_STRIDE;        // [NWARPS][TOK16] max, then sum
        float* sl = sm + NWARPS * TOK16;
        const float scale = p.scale * LOG2E;
        if (FOLD_CQ) {   // S copied in while the statistics load
            stage_fold_s(p, b, h, stage);
            row_stats(p, qmean, qrstd, b * TOK16, TOK16);
            cp_async_wait();
            __syncthreads();
        }
        if (CROSS_MARKS == 0) trace_mark(p, s, 2);
        for (int qm = 0; qm < TOK16 / 16; ++qm) {
            const int mt = b * (TOK16 / 16) + qm;
            uint4 qa[HK];
            if (FOLD_CQ) folded_queries(stage, qm, qmean, qrstd, qa);
            else
                for (int ks = 0; ks < HK; ++ks) qa[ks] = ld_cg16((const uint4*)p.q + ((mt * KS_W + h * HK + ks) * 32 + lane));
            if (CROSS_MARKS == 2 && qm == 0) trace_mark(p, s, 2);
            float m[2] = {NEG, NEG}, l[2] = {0.0f, 0.0f}, o[HDIM / 8][4];
            for (int dn = 0; dn < HDIM / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
            u32 bits_next = first_bits;   // KV_AHEAD: the next tile's, loaded a tile ahead
            for (int tile = tile_lo; tile < tile_hi; tile += NWARPS) {
                u32 bits = bits_next;
                if (KV_AHEAD) {   // the next tile's mask and K/V on their way while this one computes
                    const int next = tile + NWARPS;
                    bits_next = next < tile_hi ? key_bits(p, b, next) : first_bits;   // (the next query tile's first)
                    if (!KV_SMEM && next < tile_hi) kv_lines_l2(p, j, b, h, next);
                }
                if (KV_SMEM) {
                    const uint4* src = kvs + ((tile - part * p.tiles_per_cta) * 2 * 32 + lane) * HK;
                    for (int u = 0; u < HK; ++u) kv[u] = src[u];
                    for (int u = 0; u < HK; ++u) kv[HK + u] = src[32 * HK + u];
                } else if (qm > 0 || tile != tile_lo) {
                    load_kv(p, j, b, h, tile, kv);
                } else if (V_LATE) {   // the first tile's V: in flight while its Q K^T and softmax run
                    load_half(p, j, b, h, tile, 1, kv + HK);
                }
                float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
                for (int ks = 0; ks < HK; ++ks) {
                    mma(sc[0], qa[ks], kv[ks].x, kv[ks].y);
                    mma(sc[1], qa[ks], kv[ks].z, kv[ks].w);
                }
                if (CROSS_MARKS == 2 && qm == 0 && tile == tile_lo) trace_mark(p, s, 3);
                if (!KV_AHEAD && tile != tile_lo) bits = key_bits(p, b, tile);
                bool ok[2][4];
                for (int nt = 0; nt < 2; ++nt)
                    for (int k = 0; k < 4; ++k) {
                        ok[nt][k] = (bits >> (2 * nt + (k & 1))) & 1u;
                        sc[nt][k] = ok[nt][k] ? sc[nt][k] * scale : NEG;
                    }
                uint4 pa = softmax_tile(sc, ok, m, l, o);
                pv(o, pa, kv + HK);
            }
            l[0] = quad_sum(l[0]);
            l[1] = quad_sum(l[1]);
            const int r0 = qm * 16 + g;
            for (int dn = 0; dn < HDIM / 8; ++dn) {
                *(float2*)(so + (warp * TOK16 + r0) * SO_STRIDE + dn * 8 + 2 * q) = make_float2(o[dn][0], o[dn][1]);
                *(float2*)(so + (warp * TOK16 + r0 + 8) * SO_STRIDE + dn * 8 + 2 * q) = make_float2(o[dn][2], o[dn][3]);
            }
            if (q == 0) {
                sm[warp * TOK16 + r0] = m[0];
                sm[warp * TOK16 + r0 + 8] = m[1];
                sl[warp * TOK16 + r0] = l[0];
                sl[warp * TOK16 + r0 + 8] = l[1];
            }
        }
        if (CROSS_MARKS == 1) trace_mark(p, s, 2);
        __syncthreads();
        // The program's warps merged (each row's weights once: sm becomes them, sl the sum); with
        // one program a pair, straight into y.
        merge_weights(sm, sl, NWARPS);
        for (int e = threadIdx.x; e < TOK16 * HDIM; e += NTHREADS) {
            const int row = e / HDIM, d = e % HDIM;
            float acc = 0.0f;
            for (int w = 0; w < NWARPS; ++w) acc += sm[w * TOK16 + row] * so[(w * TOK16 + row) * SO_STRIDE + d];
            if (p.cpp == 1) {
                p.y[afrag_offset(b * TOK16 + row, h * HDIM + d, KS_W)] = to_bf(acc / sl[row]);
            } else if (CLUSTER > 1 && !CROSS_GLOBAL) {   // for the cluster's merge: a region no other phase writes
                float* cpart = smem + C_OFF;
                cpart[e] = acc;
                if (d == 0) {
                    cpart[TOK16 * HDIM + 2 * row] = sl[TOK16 + row];
                    cpart[TOK16 * HDIM + 2 * row + 1] = sl[row];
                }
            } else {
                const int at = (pair * p.cpp + part) * TOK16 + row;
                p.opart[at * HDIM + d] = acc;
                if (d == 0) {
                    p.mlpart[at * 2] = sl[TOK16 + row];
                    p.mlpart[at * 2 + 1] = sl[row];
                }
            }
        }
        if (CROSS_MARKS != 2) trace_mark(p, s, 3);
        if (CLUSTER > 1 && !CROSS_CUT && !CROSS_GLOBAL) {
            // A cluster's programs (the pair's, or with groups one of its clusters): after its barrier
            // each merges its share of the outputs from every program's partial in distributed shared
            // memory (programs in order; merge_weights' arithmetic a row at a time, so a peer's maxima,
            // sums and outputs are loaded together). With groups the cluster's merged partial goes to
            // global memory, for the pair's last program to merge with its other clusters'.
            cluster_sync();
            const float* cpart = smem + C_OFF;
            const int rank = part % CLUSTER;
            constexpr int SHARE = (TOK16 * HDIM + CLUSTER - 1) / CLUSTER;
            for (int e = rank * SHARE + threadIdx.x; e < min((rank + 1) * SHARE, TOK16 * HDIM); e += NTHREADS) {
                const int row = e / HDIM, d = e % HDIM;
                float m[CLUSTER], o[CLUSTER], l[CLUSTER], mx = NEG;
#pragma unroll
                for (int c = 0; c < CLUSTER; ++c) {
                    m[c] = ld_peer(cpart + TOK16 * HDIM + 2 * row, c);
                    l[c] = ld_peer(cpart + TOK16 * HDIM + 2 * row + 1, c);
                    o[c] = ld_peer(cpart + e, c);
                }
                for (int c = 0; c < CLUSTER; ++c) mx = fmaxf(mx, m[c]);
                float sum = 0.0f, acc = 0.0f;
                for (int c = 0; c < CLUSTER; ++c) {
                    const float f = exp2f(m[c] - mx);
                    sum += f * l[c];
                    acc += f * o[c];
                }
                if (CROSS_GROUPS == 1) {
                    p.y[afrag_offset(b * TOK16 + row, h * HDIM + d, KS_W)] = to_bf(acc / sum);
                } else {
                    const int at = (pair * CROSS_GROUPS + part / CLUSTER) * TOK16 + row;
                    p.opart[at * HDIM + d] = acc;
                    if (d == 0) {
                        p.mlpart[at * 2] = mx;
                        p.mlpart[at * 2 + 1] = sum;
                    }
                }
            }
            if (CROSS_GROUPS > 1) merge_by_the_last(p, so, flag, pair, CROSS_GROUPS, b, h);
        } else if (p.cpp > 1 && !CROSS_CUT) {
            merge_by_the_last(p, so, flag, pair, p.cpp, b, h);
        }
    }
    grid_arrive(p, s);
}

// -- the step boundary: rows owned by a program ---------------------------------------------------
// What a row's boundary reads that no phase of the step writes is copied into shared memory at
// BSTAGE floats (cp.async: no registers held), for a program's first row before the wait for the
// step's last barrier, so that after it only x comes from L2 (each of the loads after the wait was
// a round trip of its own: the boundary took ~9 us a step at B = 1). Stage, bf16: the final
// modulation of step `done` (shift, scale: [2][WIDTH]) and action_out's weights [ADIM][WIDTH] and
// bias [ADIM] (out); action_in's weights [WIDTH][ADIM] and bias [WIDTH] and the token's position
// [WIDTH] (in). The row's actions are read after the wait beside x (the same round trip).
static_assert(WIDTH % 2 == 0 && ADIM % 2 == 0, "the boundary's stage copies bf16 pairs");
constexpr int BSTAGE = (NWARPS + NWARPS * ADIM + 3) / 4 * 4;   // after out's scratch
constexpr int ST_FMOD = 0, ST_WOUT = 2 * WIDTH, ST_BOUT = (2 + ADIM) * WIDTH, ST_WIN = ST_BOUT + ADIM,
              ST_BIN = ST_WIN + WIDTH * ADIM, ST_POS = ST_BIN + WIDTH;
__device__ __forceinline__ float st_bf(const float* smem, int at) {
    return __uint_as_float(((u32)((const u16*)(smem + BSTAGE))[at]) << 16);
}

// Row r's stage (a row the program owns: boundary's call).
__device__ __forceinline__ void stage_row_inputs(const Params& p, float* smem, int done, int next, int r) {
    if (r % TOK16 >= TOK) return;   // padding rows read nothing
    u16* stage = (u16*)(smem + BSTAGE);
    auto copy = [&](int at, const u16* src, int n) {
        for (int k = threadIdx.x; k < n / 2; k += NTHREADS) cp_async4(stage + at + 2 * k, src + 2 * k);
    };
    if (done >= 0) {
        copy(ST_FMOD, p.fmods + done * 2 * WIDTH, 2 * WIDTH);
        copy(ST_WOUT, p.wout, ADIM * WIDTH);
        copy(ST_BOUT, p.bout, ADIM);
    }
    if (next >= 0) {
        copy(ST_WIN, p.win, WIDTH * ADIM);
        copy(ST_BIN, p.bin, WIDTH);
        copy(ST_POS, p.pos + (r % TOK16) * WIDTH, WIDTH);
    }
}

// out: v = action_out(LN(x) (1 + scale) + shift) rounded to the model dtype (as the reference
// loop rounds it) into vel[i]; with euler, actions += dt v (thread a's xa, and the row's in p.xa).
__device__ __forceinline__ void out_row(const Params& p, float* smem, int i, int r, int vr, float& xa) {
    float* scratch = smem;                  // NWARPS
    float* part = smem + NWARPS;            // [NWARPS][ADIM]
    float xs[(WIDTH + NTHREADS - 1) / NTHREADS];
    float sum = 0.0f;
    for (int u = 0; u * NTHREADS < WIDTH; ++u) {
        const int c = u * NTHREADS + threadIdx.x;
        xs[u] = c < WIDTH ? ld_cg_f(p.x + r * WIDTH + c) : 0.0f;
        sum += xs[u];
    }
    const float mu = block_sum(sum, scratch) / WIDTH;
    float sq = 0.0f;
    for (int u = 0; u * NTHREADS < WIDTH; ++u) {
        const int c = u * NTHREADS + threadIdx.x;
        if (c < WIDTH) sq += (xs[u] - mu) * (xs[u] - mu);
    }
    const float rs = rsqrtf(block_sum(sq, scratch) / WIDTH + p.eps);
    float acc[ADIM];
    for (int a = 0; a < ADIM; ++a) acc[a] = 0.0f;
    for (int u = 0; u * NTHREADS < WIDTH; ++u) {
        const int c = u * NTHREADS + threadIdx.x;
        if (c >= WIDTH) continue;
        const float hm = round_bf((xs[u] - mu) * rs * (1.0f + st_bf(smem, ST_FMOD + WIDTH + c)) +
                                  st_bf(smem, ST_FMOD + c));
        for (int a = 0; a < ADIM; ++a) acc[a] += hm * st_bf(smem, ST_WOUT + a * WIDTH + c);
    }
    __syncthreads();
    for (int a = 0; a < ADIM; ++a) {
        const float v = warp_sum(acc[a]);
        if ((threadIdx.x & 31) == 0) part[(threadIdx.x >> 5) * ADIM + a] = v;
    }
    __syncthreads();
    if (threadIdx.x < ADIM) {
        const int a = threadIdx.x;
        float v = st_bf(smem, ST_BOUT + a);
        for (int w = 0; w < NWARPS; ++w) v += part[w * ADIM + a];
        const u16 vb = to_bf(v);
        p.vel[(i * ENTRIES * TOK + vr) * ADIM + a] = vb;
        if (p.euler) {
            xa += p.dt * __uint_as_float(((u32)vb) << 16);
            p.xa[vr * ADIM + a] = xa;
        }
    }
    __syncthreads();
}

// in: x = action_in(actions) + pos (padding rows: 0), each 8-column tile with its statistics.
__device__ __forceinline__ void in_row(const Params& p, float* smem, int r, int tok, float xa_own) {
    float* xa = smem;   // [ADIM]
    __syncthreads();
    if (threadIdx.x < ADIM) xa[threadIdx.x] = tok < TOK ? xa_own : 0.0f;
    __syncthreads();
    for (int t = threadIdx.x; t < NT_W; t += NTHREADS) {
        float v[8];
        for (int k = 0; k < 8; ++k) {
            const int c = t * 8 + k;
            float acc = 0.0f;
            if (tok < TOK) {
                acc = st_bf(smem, ST_BIN + c) + st_bf(smem, ST_POS + c);
                for (int a = 0; a < ADIM; ++a) acc += xa[a] * st_bf(smem, ST_WIN + c * ADIM + a);
            }
            v[k] = acc;
        }
        store_x<8, !FOLD_LN>(p, r, t * 8, v);
    }
}

// The boundary before step `next` (-1: none) after computed step `done` (-1: none, and no barrier
// to wait for): for each owned row, out of `done`, the reused steps between them, and in of `next`.
// Each row's inputs are staged first: the first row's before the wait for the step's last barrier.
__device__ __forceinline__ void boundary(const Params& p, Sync& s, float* smem, int done, int first_reuse, int next,
                                         int stop) {
    for (int r = blockIdx.x;; r += NPROG) {
        const bool owned = WORK && r < MP;
        if (owned) stage_row_inputs(p, smem, done, next, r);
        if (r == blockIdx.x && done >= 0) grid_wait(p, s);
        if (!owned) return;
        cp_async_wait();
        __syncthreads();
        const int b = r / TOK16, tok = r % TOK16, vr = b * TOK + tok;
        float xa = threadIdx.x < ADIM && tok < TOK ? ld_cg_f(p.xa + vr * ADIM + threadIdx.x) : 0.0f;   // action a
        if (done >= 0 && tok < TOK) out_row(p, smem, done, r, vr, xa);
        for (int i = first_reuse; i < stop; ++i) {
            if (tok < TOK && threadIdx.x < ADIM && p.euler) {
                const int src = p.reuse[i];
                const float v = ld_cg_bf(p.vel + (src * ENTRIES * TOK + vr) * ADIM + threadIdx.x);
                xa += p.dt * v;
                p.xa[vr * ADIM + threadIdx.x] = xa;
            }
        }
        if (next >= 0) in_row(p, smem, r, tok, xa);
        __syncthreads();   // the stage is free for the next row's
    }
}

// The step the loop computes after step i - 1 (reused steps before it skipped; -1: none), and in
// `stop` where the reused steps before it end.
__device__ __forceinline__ int step_after(const Params& p, int i, int& stop) {
    while (i < p.step_hi && p.reuse[i] >= 0) ++i;
    stop = i;
    return i < p.step_hi ? i : -1;
}

// -- the loop --------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) expert_flow(const Params p) {
    float* smem = dynamic_smem();
    Sync s = {0u, 0, 0u, 0u, 0u};
    trace_mark(p, s, 0);
    if (KV_SMEM && threadIdx.x == 0) mbar_init((unsigned long long*)(smem + KV_OFF));
    if (W_SMEM && threadIdx.x == 0) {
        mbar_init(w_bar(smem, 0));
        mbar_init(w_bar(smem, 1));
    }
    __syncthreads();
    // The weights of each GEMV phase of block j at step i (W_SMEM streams each in during the phase before it)
    constexpr int QKV_N = (3 + FOLD_CQ) * WIDTH, SO_N = (1 + FOLD_CQ) * WIDTH;
    constexpr size_t WW = (size_t)WIDTH * WIDTH / 8, WM = (size_t)WIDTH * MLPD / 8;   // wfrags of a block's matrix
    auto qkv_w = [&](int i, int j) {
        return wref<QKV_N, WIDTH, QKV_TPC, 3 * WIDTH>(p.wqkv + j * 3 * WW, p.wq + j * WW);
    };
    auto so_w = [&](int i, int j) {
        return wref<SO_N, WIDTH, SO_TPC, WIDTH>(p.wso + j * WW,
                                                FOLD_CQ ? p.fold_m + ((size_t)i * DEPTH + j) * WW : nullptr);
    };
    auto cq_w = [&](int j) { return wref<WIDTH, WIDTH, CQ_TPC>(p.wq + j * WW, nullptr); };
    auto co_w = [&](int j) { return wref<WIDTH, WIDTH, CO_TPC>(p.wco + j * WW, nullptr); };
    auto fc1_w = [&](int j) { return wref<MLPD, WIDTH, FC1_TPC>(p.w1 + j * WM, nullptr); };
    auto fc2_w = [&](int j) { return wref<WIDTH, MLPD, FC2_TPC, WIDTH, FC2_SPLIT>(p.w2 + j * WM, nullptr); };
    // Steps step_lo .. step_hi - 1; a reused step (reuse[i] >= 0) only updates the actions.
    int done = -1, i = p.step_lo, stop;
    int next = step_after(p, i, stop);
    while (true) {
        if (next >= 0) w_issue(s, smem, qkv_w(next, 0), 0);   // W_SMEM: the step's first weights
        boundary(p, s, smem, done, i, next, stop);   // after the wait for the step before's last barrier
        if (next < 0) {
            __syncthreads();
            trace_mark(p, s, 1);
            break;
        }
        grid_arrive(p, s);
        const u16* mods = p.mods + (size_t)next * DEPTH * 9 * WIDTH;
        for (int j = 0; j < DEPTH; ++j) {
            const u16* mod = mods + j * 9 * WIDTH;
            // FOLD_CQ: the step and block's M and fold constants; qkv and self_out gain a second part
            const size_t sj = (size_t)next * DEPTH + j;
            const float* fc = FOLD_CQ ? p.fold_c + sj * 3 * WIDTH : nullptr;
            const float* ln = FOLD_LN ? p.fold_ln + sj * LN_C : nullptr;   // qkv's rho and delta, then fc1's
            const Part2 f0_part = {p.wq + j * WW, fc, 4 * WIDTH, p.wsc_q + j * WIDTH};
            const Part2 s_part = {FOLD_CQ ? p.fold_m + sj * WW : nullptr, fc, 0,
                                  FOLD_CQ ? p.wsc_fold + sj * WIDTH : nullptr};
            const WRef none = {nullptr, 0u};
            kv_prefetch(p, smem, j, false);
            gemv_phase<QKV_N, WIDTH, FROM_X_LN, TO_QKV, QKV_TPC, 3 * WIDTH>(
                p, s, smem, p.wqkv + j * 3 * WW, p.wsc_qkv + j * 3 * WIDTH,
                p.bqkv + j * 3 * WIDTH, mod, 0, WIDTH, 0, nullptr, 0, p.qkv, f0_part,
                so_w(next, j), ln);
            kv_prefetch(p, smem, j, true);
#if FUSE_SELF
            static_assert(HEADS == NWARPS && HDIM * NWARPS == WIDTH, "FUSE_SELF: warp w's k-range is head w");
            gemv_phase<SO_N, WIDTH, FROM_SELF, TO_RESIDUAL, SO_TPC, WIDTH>(
                p, s, smem, p.wso + j * WW, p.wsc_so + j * WIDTH,
                p.bso + j * WIDTH, mod, 0, 0, 2 * WIDTH, nullptr, 0, nullptr, s_part,
                FOLD_CQ ? co_w(j) : cq_w(j));
#elif SELF_CLUSTER
            gemv_phase<SO_N, WIDTH, FROM_CLUSTER, TO_RESIDUAL, SO_TPC, WIDTH>(
                p, s, smem, p.wso + j * WW, p.wsc_so + j * WIDTH,
                p.bso + j * WIDTH, mod, 0, 0, 2 * WIDTH, nullptr, KS_W, nullptr, s_part,
                FOLD_CQ ? co_w(j) : cq_w(j));
#else
            self_phase(p, s);
            gemv_phase<SO_N, WIDTH, FROM_FRAGS, TO_RESIDUAL, SO_TPC, WIDTH>(
                p, s, smem, p.wso + j * WW, p.wsc_so + j * WIDTH,
                p.bso + j * WIDTH, mod, 0, 0, 2 * WIDTH, p.y, KS_W, nullptr, s_part,
                FOLD_CQ ? co_w(j) : cq_w(j));
#endif
            if (!FOLD_CQ)
                gemv_phase<WIDTH, WIDTH, FROM_X_LN, TO_FRAGS, CQ_TPC>(
                    p, s, smem, p.wq + j * WW, p.wsc_q + j * WIDTH,
                    p.bq + j * WIDTH, mod, 3 * WIDTH, 4 * WIDTH, 0, nullptr, 0, p.q, Part2{},
                    co_w(j));
            cross_phase(p, s, smem, j, fc);
            gemv_phase<WIDTH, WIDTH, FROM_FRAGS, TO_RESIDUAL, CO_TPC>(
                p, s, smem, p.wco + j * WW, p.wsc_co + j * WIDTH,
                p.bco + j * WIDTH, mod, 0, 0, 5 * WIDTH, p.y, KS_W, nullptr, Part2{},
                fc1_w(j));
            gemv_phase<MLPD, WIDTH, FROM_X_LN, TO_FRAGS_GELU, FC1_TPC>(
                p, s, smem, p.w1 + j * WM, p.wsc_1 + j * MLPD,
                p.b1 + j * MLPD, mod, 6 * WIDTH, 7 * WIDTH, 0, nullptr, 0, p.hid, Part2{},
                fc2_w(j), FOLD_LN ? ln + 6 * WIDTH : nullptr);
            gemv_phase<WIDTH, MLPD, FROM_FRAGS, TO_RESIDUAL, FC2_TPC, WIDTH, FC2_SPLIT>(
                p, s, smem, p.w2 + j * WM, p.wsc_2 + j * WIDTH,
                p.b2 + j * WIDTH, mod, 0, 0, 8 * WIDTH, p.hid, KS_MLP, nullptr, Part2{},
                j + 1 < DEPTH ? qkv_w(next, j + 1) : none);
        }
        done = next;
        i = stop + 1;
        next = step_after(p, i, stop);
    }
}

#ifdef VLA_CPU
// The host build's entry: `programs` programs of NTHREADS threads, run as fibers (cuda_on_cpu.h).
extern "C" int expert_flow_host(const Params* p, int programs, int smem_bytes) {
    return cpu::launch(programs, NTHREADS, smem_bytes, [p] { expert_flow(*p); }, CLUSTER);
}
#endif
