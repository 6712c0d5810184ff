// CUDA's built-ins and expert_flow.cu's primitives for a host C++ compiler: the kernel's own
// source runs on the CPU, every program's threads as fibers on one CPU thread
// (kernels/expert_flow_cuda.py, host_library, builds it with g++; the suite checks it against
// the model's loop). Not fast: a check of the kernel's indexing, fragment layouts, merges and
// barriers where no GPU is.
//
// How the threads run: each CUDA thread is a fiber with its own stack. A fiber runs
// until it must wait (a warp's or a program's barrier, a poll of the grid barrier), then hands
// the CPU to the next fiber in the ring. Warp-wide operations (shuffles, votes, the tensor-core
// product) meet in the warp's exchange slots between two warp barriers, so each lane computes
// its result from every lane's operands, as the hardware does. One CPU thread: memory is
// sequentially consistent, so the acquire/release operations are plain loads and stores.
#pragma once

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

typedef unsigned int u32;
typedef unsigned short u16;

struct alignas(16) uint4 { u32 x, y, z, w; };
struct alignas(8) uint2 { u32 x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float __uint_as_float(u32 v) { float f; std::memcpy(&f, &v, 4); return f; }
inline u32 __float_as_uint(float f) { u32 v; std::memcpy(&v, &f, 4); return v; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline int min(int a, int b) { return a < b ? a : b; }
using std::erff;
using std::exp2f;
using std::fmaxf;

namespace cpu {

// A fiber's saved CPU state. x86-64: its stack pointer (the callee-saved registers are on its
// stack); elsewhere a ucontext (whose switch also saves the signal mask: a system call each).
#if defined(__x86_64__)
struct Context { void* sp = nullptr; };
extern "C" void vla_cpu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .hidden vla_cpu_switch
    .type vla_cpu_switch, @function
vla_cpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size vla_cpu_switch, .-vla_cpu_switch
)");
inline void switch_to(Context& from, Context& to) { vla_cpu_switch(&from.sp, to.sp); }
// A new fiber's stack, as vla_cpu_switch leaves one: six registers, then `entry` to return into
// (with the stack aligned as after a call).
inline bool start_context(Context& c, void* stack, size_t size, void (*entry)()) {
    auto top = (void**)(((uintptr_t)stack + size) & ~(uintptr_t)15);
    *--top = nullptr;            // entry's return address: it never returns
    *--top = (void*)entry;
    for (int i = 0; i < 6; ++i) *--top = nullptr;
    c.sp = top;
    return true;
}
#else
struct Context { ucontext_t uc; };
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline bool start_context(Context& c, void* stack, size_t size, void (*entry)()) {
    if (getcontext(&c.uc) != 0) return false;
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
    return true;
}
#endif

struct Index { unsigned x, y, z; };

// Fibers waiting at a barrier leave the run queue until the barrier releases them.
struct Barrier {
    unsigned arrived = 0, generation = 0;
    std::vector<unsigned> waiters;
};

struct Warp {        // a warp's barrier and exchange slots (two sets: operation n + 1 never
    Barrier barrier; // writes over what a lane of operation n has still to read)
    u32 slot[2][32][6];
    float product[2][16][8];   // mma: the warp's D = A B, computed once by its last lane to arrive
};

struct Program {     // a CUDA block
    Barrier barrier;
    Barrier cluster_barrier;   // the first program of a cluster: the cluster's barrier
    std::vector<float4> smem;
    std::vector<Warp> warps;
};

struct Fiber {
    Context context;
    void* stack = nullptr;
    Index thread, block;
    Program* program = nullptr;
};

struct Launch {      // the launch under way (one at a time on a CPU thread)
    std::vector<Fiber> fibers;
    std::vector<Program> programs;
    std::vector<unsigned> queue;   // runnable fibers, a ring of fibers.size() + 1 places
    size_t head = 0, tail = 0;
    unsigned current = 0;
    size_t live = 0;
    unsigned cluster = 1;          // programs of a cluster (consecutive programs)
    bool deadlocked = false;       // every unfinished fiber waits: the kernel cannot go on
    bool stuck = false;            // an mbarrier wait gave up: its copy was never issued
    Context caller;
    std::function<void()> body;

    void push(unsigned f) {
        queue[tail] = f;
        tail = (tail + 1) % queue.size();
    }
};

inline thread_local Launch* launch_now = nullptr;

inline Fiber& me() { return launch_now->fibers[launch_now->current]; }

// Run the next runnable fiber (the current one has queued itself, waits or is done); back to
// the launch's caller once none is left.
inline void run_next() {
    Launch& l = *launch_now;
    const unsigned from = l.current;
    if (l.head == l.tail) {
        l.deadlocked = l.live > 0;
        switch_to(l.fibers[from].context, l.caller);
        return;
    }
    const unsigned to = l.queue[l.head];
    l.head = (l.head + 1) % l.queue.size();
    if (to == from) return;
    l.current = to;
    switch_to(l.fibers[from].context, l.fibers[to].context);
}

inline void yield() {
    launch_now->push(launch_now->current);
    run_next();
}

inline void fiber_main() {
    launch_now->body();
    --launch_now->live;
    run_next();   // never returns: a finished fiber is not queued again
}

// Wait until `count` fibers have arrived; the last one runs `complete` first.
template <class F> inline void barrier(Barrier& b, unsigned count, F complete) {
    if (++b.arrived == count) {
        complete();
        b.arrived = 0;
        ++b.generation;
        for (unsigned f : b.waiters) launch_now->push(f);
        b.waiters.clear();
        return;
    }
    b.waiters.push_back(launch_now->current);
    run_next();
}

inline Warp& warp() { return me().program->warps[me().thread.x / 32]; }
inline unsigned lane() { return me().thread.x % 32; }

// Run `body` as `programs` x `threads` CUDA threads with `smem_bytes` of shared memory each, in
// clusters of `cluster` consecutive programs:
// 0 when done, -1 when the stacks could not be had, -2 when every thread waited for another, -3
// when an mbarrier wait gave up (the copy it waits for was never issued).
inline int launch(int programs, int threads, int smem_bytes, std::function<void()> body, int cluster = 1) {
    constexpr size_t STACK = 256 * 1024;
    Launch l;
    l.body = std::move(body);
    l.cluster = (unsigned)cluster;
    l.programs.resize(programs);
    for (Program& p : l.programs) {
        p.smem.assign((smem_bytes + 15) / 16, float4{0, 0, 0, 0});
        p.warps.resize((threads + 31) / 32);
    }
    l.fibers.resize((size_t)programs * threads);
    l.queue.resize(l.fibers.size() + 1);
    int status = 0;
    for (size_t i = 0; i < l.fibers.size(); ++i) {
        Fiber& f = l.fibers[i];
        f.block = {(unsigned)(i / threads), 0, 0};
        f.thread = {(unsigned)(i % threads), 0, 0};
        f.program = &l.programs[i / threads];
        f.stack = std::malloc(STACK);
        if (f.stack == nullptr || !start_context(f.context, f.stack, STACK, fiber_main)) {
            status = -1;
            break;
        }
        if (i > 0) l.push((unsigned)i);
    }
    if (status == 0) {
        Launch* outer = launch_now;
        launch_now = &l;
        l.live = l.fibers.size();
        l.current = 0;
        switch_to(l.caller, l.fibers[0].context);
        launch_now = outer;
        if (l.deadlocked) status = -2;
        else if (l.stuck) status = -3;
    }
    for (Fiber& f : l.fibers) std::free(f.stack);
    return status;
}

// Lane i's `v` into slot i; returns the warp's slots once every lane's is there. `complete` runs
// once, on them, before any lane reads.
template <class T, class F> inline const u32 (*exchange(const T& v, F complete))[6] {
    static_assert(sizeof(T) <= sizeof(Warp::slot[0][0]), "a slot holds 24 bytes");
    Warp& w = warp();
    const unsigned set = w.barrier.generation & 1u;
    std::memcpy(w.slot[set][lane()], &v, sizeof(T));
    barrier(w.barrier, 32, [&] { complete(w.slot[set], set); });
    return w.slot[set];
}
template <class T> inline const u32 (*exchange(const T& v))[6] {
    return exchange(v, [](const u32(*)[6], unsigned) {});
}
template <class T> inline T slot_value(const u32 (*slots)[6], unsigned l) {
    T v;
    std::memcpy(&v, slots[l], sizeof(T));
    return v;
}

inline float bf16_to_float(u16 v) { return __uint_as_float((u32)v << 16); }

inline u16 float_to_bf16(float f) {   // round to nearest even, as cvt.rn.bf16
    const u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);   // NaN stays NaN
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace cpu

#define threadIdx (cpu::me().thread)
#define blockIdx (cpu::me().block)

inline void __syncthreads() {
    cpu::Program& p = *cpu::me().program;
    cpu::barrier(p.barrier, (unsigned)(p.warps.size() * 32), [] {});
}

inline float __shfl_xor_sync(unsigned, float v, int mask) {
    return cpu::slot_value<float>(cpu::exchange(v), cpu::lane() ^ (unsigned)mask);
}

inline float __shfl_sync(unsigned, float v, int src) {
    return cpu::slot_value<float>(cpu::exchange(v), (unsigned)src & 31u);
}

inline bool __all_sync(unsigned, bool pred) {
    const auto slots = cpu::exchange((u32)pred);
    bool all = true;
    for (unsigned l = 0; l < 32; ++l) all &= cpu::slot_value<u32>(slots, l) != 0;
    return all;
}

inline int atomicExch(int* p, int v) { const int old = *p; *p = v; return old; }

// -- expert_flow.cu's primitives ------------------------------------------------------------------
inline uint4 ld_in16(const void* p) { return *(const uint4*)p; }
inline uint2 ld_in8(const void* p) { return *(const uint2*)p; }
inline u32 ld_in4(const void* p) { return *(const u32*)p; }
inline u32 ld_in1(const void* p) { return *(const unsigned char*)p; }
inline float4 ld_in_f4(const float* p) { return *(const float4*)p; }
inline float2 ld_in_f2(const float* p) { return *(const float2*)p; }
inline float ld_in_bf(const u16* p) { return cpu::bf16_to_float(*p); }
inline uint4 ld_cg16(const void* p) { return *(const uint4*)p; }
inline float2 ld_cg_f2(const float* p) { return *(const float2*)p; }
inline float4 ld_cg_f4(const float* p) { return *(const float4*)p; }
inline float ld_cg_f(const float* p) { return *p; }
inline float ld_cg_bf(const u16* p) { return cpu::bf16_to_float(*p); }

// Copies complete at once (a valid order of the asynchronous ones).
inline void cp_async16(void* dst, const void* src) { std::memcpy(dst, src, 16); }
inline void cp_async4(void* dst, const void* src) { std::memcpy(dst, src, 4); }
inline void cp_async_wait() {}
// The mbarrier holds how many of its phases completed; try_wait.parity(P) passes once the phase
// of parity P has.
inline void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    std::memcpy(dst, src, bytes);
    ++*bar;
}
// Every other fiber runs between two looks; a phase that does not complete after as many looks as
// any kernel could need (the copy it waits for was never issued) gives up: the launch fails (-3).
inline void mbar_wait(unsigned long long* bar, u32 parity) {
    for (long looks = 0; (*bar & 1u) == parity; ++looks) {
        if (looks > (1L << 16)) {
            cpu::launch_now->stuck = true;
            return;
        }
        cpu::yield();
    }
}
inline void mbar_init(unsigned long long* bar) { *bar = 0; }
inline void fence_proxy_async() {}
inline void prefetch_l2(const void*, u32) {}   // a hint: nothing to do on the host
inline void prefetch_line(const void*) {}

inline float* dynamic_smem() { return (float*)cpu::me().program->smem.data(); }

inline u32 pack_bf2(float lo, float hi) {
    return (u32)cpu::float_to_bf16(lo) | ((u32)cpu::float_to_bf16(hi) << 16);
}

// Per half in float, then rounded to bf16: as fma.rn.bf16x2 wherever a b + c is a float (the
// kernel's use, e4m3 values times 2^120).
inline u32 fma_bf2(u32 a, u32 b, u32 c) {
    auto half = [&](int sh) {
        const auto f = [&](u32 v) { return cpu::bf16_to_float((u16)(v >> sh)); };
        return (u32)cpu::float_to_bf16(std::fma(f(a), f(b), f(c))) << sh;
    };
    return half(0) | half(16);
}

// m16n8k16, row.col, bf16 operands, fp32 accumulators. Lane 4 g + q holds A (rows g, g + 8;
// columns 2q, 2q + 1 and 2q + 8, 2q + 9: registers (g, lo), (g + 8, lo), (g, hi), (g + 8, hi)),
// B (column g; rows 2q, 2q + 1 and 2q + 8, 2q + 9) and D (rows g, g + 8; columns 2q, 2q + 1).
inline void mma(float* d, uint4 a, u32 b0, u32 b1) {
    const u32 mine[6] = {a.x, a.y, a.z, a.w, b0, b1};
    cpu::Warp& w = cpu::warp();
    const unsigned set = w.barrier.generation & 1u;   // this operation's slots and product
    cpu::exchange(mine, [&](const u32 (*slots)[6], unsigned s) {
        auto elem = [](u32 reg, int e) { return cpu::bf16_to_float((u16)(e ? reg >> 16 : reg & 0xffffu)); };
        float A[16][16], B[16][8];
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, q = l % 4;
            for (int reg = 0; reg < 4; ++reg)
                for (int e = 0; e < 2; ++e) A[g + (reg & 1) * 8][2 * q + (reg >> 1) * 8 + e] = elem(slots[l][reg], e);
            for (int reg = 0; reg < 2; ++reg)
                for (int e = 0; e < 2; ++e) B[2 * q + reg * 8 + e][g] = elem(slots[l][4 + reg], e);
        }
        for (int r = 0; r < 16; ++r)
            for (int n = 0; n < 8; ++n) {
                float acc = 0.0f;
                for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][n];
                w.product[s][r][n] = acc;
            }
    });
    const int g = (int)cpu::lane() / 4, q = (int)cpu::lane() % 4;
    for (int i = 0; i < 4; ++i) d[i] += w.product[set][g + (i >> 1) * 8][2 * q + (i & 1)];
}

inline long long clock_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void st_release(u32* p, u32 v) { *p = v; }
inline void red_release_add(u32* p, u32 v) { *p += v; }
inline u32 atom_acq_rel_add(u32* p, u32 v) { const u32 old = *p; *p += v; return old; }
// A poll of the grid barrier: the other fibers run first (on one CPU thread, nothing else would).
inline u32 ld_acquire(const u32* p) { cpu::yield(); return *p; }
inline u32 atom_acquire_read(u32* p) { cpu::yield(); return *p; }
inline u32 ld_relaxed(const u32* p) { cpu::yield(); return *p; }
inline void fence_acq_rel() {}
// The cluster's programs: a barrier of all their threads; a peer's shared memory at p's offset.
inline cpu::Program& cluster_program(unsigned rank) {
    cpu::Launch& l = *cpu::launch_now;
    return l.programs[cpu::me().block.x / l.cluster * l.cluster + rank];
}
inline void cluster_sync() {
    cpu::Launch& l = *cpu::launch_now;
    cpu::barrier(cluster_program(0).cluster_barrier, l.cluster * (unsigned)(cpu::me().program->warps.size() * 32), [] {});
}
inline const char* peer_addr(const void* p, u32 rank) {
    const size_t offset = (const char*)p - (const char*)cpu::me().program->smem.data();
    return (const char*)cluster_program(rank).smem.data() + offset;
}
inline float ld_peer(const float* p, u32 rank) { return *(const float*)peer_addr(p, rank); }
inline uint4 ld_peer16(const void* p, u32 rank) {
    uint4 v;
    std::memcpy(&v, peer_addr(p, rank), 16);
    return v;
}
