// commfuse device primitives: signals with release/acquire semantics at system scope, bounded
// spin-waits that report where they got stuck, and element conversions. Shared by every kernel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long u64;
typedef unsigned int u32;

// The largest world (commfuse_core::MAX_WORLD_SIZE), passed by the compiler options of
// src/nvrtc.rs so that there is one such constant; the Rust mirrors of the kernels' parameter
// structs size their per-rank arrays with it too, and the static_asserts check the layouts.
#ifndef COMMFUSE_MAX_RANKS
#error "compile with -DCOMMFUSE_MAX_RANKS=<commfuse_core::MAX_WORLD_SIZE> (src/nvrtc.rs does)"
#endif

// Byte offset of a member, as a constant expression: NVRTC has no <cstddef> and (before 13.4)
// no __builtin_offsetof, and EDG's __INTADDR__ makes the null-pointer form constant. Kernel
// parameter structs check their Rust mirrors' offsets with it.
#define COMMFUSE_OFFSETOF(T, member) ((unsigned long long)__INTADDR__(&((T*)0)->member))

// Written by the first wait that times out; host-mapped, so the host reads it after (or
// without) the kernel finishing. Mirrored by `ErrorRecord` in src/plan_table.rs.
struct ErrorRecord {
    u32 flag;      // 0: no error; 1: a wait timed out
    u32 abort;     // raised with flag: every other waiter gives up
    u32 rank;
    u32 lane;
    u32 step;
    u32 slot;
    u64 expected;
    u64 seen;
};

__device__ __forceinline__ u64 load_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A release at system scope: the caller's stores, and (by cumulativity through the block
// barrier that precedes every notify) the stores of its whole block, become visible to any
// thread that acquires the new value. No separate fence: red.release is one already, and the
// extra fence.acq_rel.sys cost latency on every signal.
__device__ __forceinline__ void add_release_sys(u64* p, u64 v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 load_relaxed_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The error record lives in host memory mapped into every GPU, and waiters on several GPUs (and
// the host, which raises `abort` to stop a failed call) race on it: its atomics and polls must
// be system scope. A device-scope atomicCAS only orders the GPUs' own threads.
__device__ __forceinline__ u32 cas_sys(volatile u32* p, u32 expected, u32 desired) {
    u32 old;
    asm volatile("atom.cas.sys.relaxed.b32 %0, [%1], %2, %3;"
                 : "=r"(old)
                 : "l"((u32*)p), "r"(expected), "r"(desired)
                 : "memory");
    return old;
}

__device__ __forceinline__ u32 load_relaxed_sys_u32(const volatile u32* p) {
    u32 v;
    asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"((const u32*)p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys_u32(volatile u32* p, u32 v) {
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"((u32*)p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acquire_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Programmatic dependent launch (Hopper). A kernel launched with programmatic stream
// serialization (driver.rs `Function::launch_programmatic`) may start while the kernel before
// it on the stream is still running: its blocks must wait here before they touch anything that
// kernel writes or reads — this returns once that kernel has completed and its memory
// operations are visible (at once where it was launched the ordinary way).
__device__ __forceinline__ void wait_for_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next kernel on the stream, if it was launched programmatically, be scheduled now
// (its blocks then wait in wait_for_prior_grid until this grid completes): its launch overlaps
// this grid's work. Called once a block is past its own wait, so at most two grids of a chain
// are ever resident.
__device__ __forceinline__ void allow_next_grid() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ void store_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The signal comparisons of the plan model (commfuse_core::Cmp).
enum SignalCmp { CMP_EQ = 0, CMP_GE = 1 };
// How a notify changes the slot (commfuse_core::NotifyOp).
enum SignalOp { NOTIFY_SET = 0, NOTIFY_ADD = 1 };

__device__ __forceinline__ bool holds(u32 cmp, u64 seen, u64 expected) {
    return cmp == CMP_EQ ? seen == expected : seen >= expected;
}

// notify: release at system scope; Set stores, Add adds.
__device__ __forceinline__ void notify(u64* slot, u64 value, u32 op) {
    if (op == NOTIFY_SET) store_release_sys(slot, value);
    else add_release_sys(slot, value);
}

// When a waiter reads the host-mapped abort word: only once it has waited ABORT_POLL_NS, and
// then once per ABORT_POLL_SPINS polls. The word lives in host memory, so every read crosses
// PCIe: with every waiting thread reading it every 256 polls, thousands of spinning threads
// flooded the GPU's PCIe link, and the GPU's front end (which fetches the next launches and
// stream operations from host memory) fell behind — calls then took a millisecond where they
// take microseconds (CHANGELOG.md, "Device waits read host memory rarely"). A wait that ends sooner never reads it.
constexpr u64 ABORT_POLL_NS = 200000;
constexpr u32 ABORT_POLL_SPINS = 1u << 14;

// waiter_check: a waiter's periodic check (every 256 polls, after `waited` ns and `spins`
// polls): GO_ON, ABORTED when the abort was raised, or TIMED_OUT past timeout_ns. Keeps no
// state, so that no wait loop holds one more live register for it.
enum GiveUp { GO_ON = 0, ABORTED = 1, TIMED_OUT = 2 };
__device__ __forceinline__ GiveUp waiter_check(const volatile ErrorRecord* err, u64 waited, u32 spins, u64 timeout_ns) {
    // called once per 256 polls, so once per ABORT_POLL_SPINS polls the low bits fall below 256
    if (waited >= ABORT_POLL_NS && (spins & (ABORT_POLL_SPINS - 1)) < 256 && load_relaxed_sys_u32(&err->abort))
        return ABORTED;
    return waited > timeout_ns ? TIMED_OUT : GO_ON;
}

// Spins until the slot compares true with `expected` (acquire, system scope). Gives up after
// timeout_ns, recording rank, lane, step, slot, expected and seen value, or when another waiter
// already gave up. Returns false when it gave up.
__device__ __forceinline__ bool wait_signal(const u64* slot, u32 cmp, u64 expected, u64 timeout_ns, volatile ErrorRecord* err,
                            u32 rank, u32 lane, u32 step, u32 slot_index) {
    u64 seen = load_acquire_sys(slot);
    if (holds(cmp, seen, expected)) return true;
    const u64 start = global_timer_ns();
    for (u32 spins = 1;; ++spins) {
        // poll with relaxed loads, then one fence makes the observed release an acquire
        seen = load_relaxed_sys(slot);
        if (holds(cmp, seen, expected)) {
            fence_acquire_sys();
            return true;
        }
        if ((spins & 255) == 0) {
            const GiveUp why = waiter_check(err, global_timer_ns() - start, spins, timeout_ns);
            if (why == ABORTED) return false;
            if (why == TIMED_OUT) {
                // the first waiter to give up, on any GPU, writes the record
                if (cas_sys(&err->flag, 0u, 1u) == 0u) {
                    err->rank = rank;
                    err->lane = lane;
                    err->step = step;
                    err->slot = slot_index;
                    err->expected = expected;
                    err->seen = seen;
                    // release: whoever sees the abort also sees the fields above
                    store_release_sys_u32(&err->abort, 1u);
                }
                return false;
            }
        }
    }
}

template <typename T> struct Elem;
template <> struct Elem<float> {
    static __device__ __forceinline__ float to_f32(float x) { return x; }
    static __device__ __forceinline__ float from_f32(float x) { return x; }
};
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_f32(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Elem<__half> {
    static __device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_f32(float x) { return __float2half_rn(x); }
};

enum ReduceOp { OP_SUM = 0, OP_MAX = 1, OP_MIN = 2, OP_PROD = 3 };

// Instantiates ENTRY(PREFIX_<type>_<op>, T, OP) for every element type and reduce op: the kernel
// names the Rust side looks up (plan_kernel in src/backend.rs, src/ll.rs).
#define COMMFUSE_EACH_TYPE_AND_OP(ENTRY, PREFIX)             \
    ENTRY(PREFIX##_f32_sum, float, OP_SUM)                   \
    ENTRY(PREFIX##_f32_max, float, OP_MAX)                   \
    ENTRY(PREFIX##_f32_min, float, OP_MIN)                   \
    ENTRY(PREFIX##_f32_prod, float, OP_PROD)                 \
    ENTRY(PREFIX##_bf16_sum, __nv_bfloat16, OP_SUM)          \
    ENTRY(PREFIX##_bf16_max, __nv_bfloat16, OP_MAX)          \
    ENTRY(PREFIX##_bf16_min, __nv_bfloat16, OP_MIN)          \
    ENTRY(PREFIX##_bf16_prod, __nv_bfloat16, OP_PROD)        \
    ENTRY(PREFIX##_f16_sum, __half, OP_SUM)                  \
    ENTRY(PREFIX##_f16_max, __half, OP_MAX)                  \
    ENTRY(PREFIX##_f16_min, __half, OP_MIN)                  \
    ENTRY(PREFIX##_f16_prod, __half, OP_PROD)

template <int OP> __device__ __forceinline__ float combine(float a, float b) {
    if (OP == OP_SUM) return a + b;
    if (OP == OP_MAX) return fmaxf(a, b);
    if (OP == OP_MIN) return fminf(a, b);
    return a * b;
}
