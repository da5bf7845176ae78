// The plan interpreter: every collective of commfuse runs as this kernel reading its rank's
// plan (the same steps the checker verified and the simulator runs) from a device table.
//
// One block per lane. A step's regions are cut into lanes by position (element i of a region
// belongs to lane i / lane_len) and each lane has its own signal slots, so a lane runs the
// whole plan on its slice without ever waiting for another block of its own GPU; the checker
// guarantees that overlapping regions start together, which makes the slices independent.
// Waits are one thread spinning (acquire, system scope) then a block barrier; notifies are a
// block barrier (every thread's stores done) then one release add at system scope.
#include "common.cuh"

// Mirrored by `DeviceRegion`, `DeviceStep` and `PlanArgs` in src/plan_table.rs.
struct DeviceRegion {
    u64 ptr;  // address of the region's element 0, on whichever GPU holds it
    u64 len;  // elements
};

enum StepKind { STEP_WAIT = 0, STEP_NOTIFY = 1, STEP_COPY = 2, STEP_REDUCE = 3 };

struct DeviceStep {
    u32 kind;
    u32 slot;       // wait/notify: slot index within a lane (row * cols + col)
    u32 peer;       // notify: target rank
    u32 nsrc;
    u64 value;      // wait: expected (relative to the epoch base); notify: amount added
    u32 src_begin;  // sources at regions[src_begin ..], destinations at regions[dst_begin ..]
    u32 ndst;
    u32 dst_begin;
    u32 cmp;        // wait: CMP_EQ or CMP_GE (a plan's Set notifies arrive as adds on the base)
    u64 len;        // elements of every region of the step
};

struct PlanArgs {
    const DeviceStep* steps;
    const DeviceRegion* regions;
    u64* pads[COMMFUSE_MAX_RANKS];  // every rank's signal pad: [lane][slot] counters
    u64* bases;                      // this rank's epoch bases: [lane][slot]
    const u64* increments;           // per slot, what one call adds
    ErrorRecord* error;              // host-mapped
    u64 lane_len;
    u64 timeout_ns;
    u32 nsteps;
    u32 rank;
    u32 slots;
    u32 pad;
};

constexpr int VEC_BYTES = 16;

template <typename T> struct alignas(16) Vec {
    static constexpr int N = VEC_BYTES / sizeof(T);
    T v[N];
};

template <typename T> __device__ __forceinline__ const Vec<T>* vec_at(const DeviceRegion& r, u64 begin) {
    return reinterpret_cast<const Vec<T>*>(reinterpret_cast<const T*>(r.ptr) + begin);
}

template <typename T> __device__ __forceinline__ Vec<T>* vec_at_mut(const DeviceRegion& r, u64 begin) {
    return reinterpret_cast<Vec<T>*>(reinterpret_cast<T*>(r.ptr) + begin);
}

// Every destination of a step gets the same values: one read of the sources, ndst writes.
template <typename T, int OP>
__device__ void reduce_slice(const PlanArgs& a, const DeviceStep& s, u64 begin, u64 n) {
    constexpr int N = Vec<T>::N;
    const DeviceRegion* srcs = a.regions + s.src_begin;
    const DeviceRegion* dsts = a.regions + s.dst_begin;
    bool aligned = true;
    for (u32 k = 0; k < s.nsrc; ++k) aligned &= ((srcs[k].ptr + begin * sizeof(T)) % VEC_BYTES) == 0;
    for (u32 k = 0; k < s.ndst; ++k) aligned &= ((dsts[k].ptr + begin * sizeof(T)) % VEC_BYTES) == 0;
    u64 done = 0;
    if (aligned) {
        const u64 nv = n / N;
        const u64 stride = blockDim.x;
        // two vectors per thread per round, every source's loads issued before the arithmetic
        u64 i = threadIdx.x;
        for (; i + stride < nv; i += 2 * stride) {
            float acc0[N], acc1[N];
            const Vec<T>* s0 = vec_at<T>(srcs[0], begin);
            Vec<T> x0 = s0[i], x1 = s0[i + stride];
#pragma unroll
            for (int j = 0; j < N; ++j) {
                acc0[j] = Elem<T>::to_f32(x0.v[j]);
                acc1[j] = Elem<T>::to_f32(x1.v[j]);
            }
            for (u32 k = 1; k < s.nsrc; ++k) {
                const Vec<T>* sk = vec_at<T>(srcs[k], begin);
                Vec<T> y0 = sk[i], y1 = sk[i + stride];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    acc0[j] = combine<OP>(acc0[j], Elem<T>::to_f32(y0.v[j]));
                    acc1[j] = combine<OP>(acc1[j], Elem<T>::to_f32(y1.v[j]));
                }
            }
            Vec<T> o0, o1;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                o0.v[j] = Elem<T>::from_f32(acc0[j]);
                o1.v[j] = Elem<T>::from_f32(acc1[j]);
            }
            for (u32 k = 0; k < s.ndst; ++k) {
                Vec<T>* d = vec_at_mut<T>(dsts[k], begin);
                d[i] = o0;
                d[i + stride] = o1;
            }
        }
        for (; i < nv; i += stride) {
            float acc[N];
            Vec<T> x = vec_at<T>(srcs[0], begin)[i];
#pragma unroll
            for (int j = 0; j < N; ++j) acc[j] = Elem<T>::to_f32(x.v[j]);
            for (u32 k = 1; k < s.nsrc; ++k) {
                Vec<T> y = vec_at<T>(srcs[k], begin)[i];
#pragma unroll
                for (int j = 0; j < N; ++j) acc[j] = combine<OP>(acc[j], Elem<T>::to_f32(y.v[j]));
            }
            Vec<T> out;
#pragma unroll
            for (int j = 0; j < N; ++j) out.v[j] = Elem<T>::from_f32(acc[j]);
            for (u32 k = 0; k < s.ndst; ++k) vec_at_mut<T>(dsts[k], begin)[i] = out;
        }
        done = nv * N;
    }
    for (u64 i = done + threadIdx.x; i < n; i += blockDim.x) {
        float acc = Elem<T>::to_f32(reinterpret_cast<const T*>(srcs[0].ptr)[begin + i]);
        for (u32 k = 1; k < s.nsrc; ++k)
            acc = combine<OP>(acc, Elem<T>::to_f32(reinterpret_cast<const T*>(srcs[k].ptr)[begin + i]));
        const T out = Elem<T>::from_f32(acc);
        for (u32 k = 0; k < s.ndst; ++k) reinterpret_cast<T*>(dsts[k].ptr)[begin + i] = out;
    }
}

template <typename T>
__device__ void copy_slice(const PlanArgs& a, const DeviceStep& s, u64 begin, u64 n) {
    const DeviceRegion* dsts = a.regions + s.dst_begin;
    const char* src = reinterpret_cast<const char*>(a.regions[s.src_begin].ptr) + begin * sizeof(T);
    bool aligned = reinterpret_cast<u64>(src) % VEC_BYTES == 0;
    for (u32 k = 0; k < s.ndst; ++k) aligned &= (dsts[k].ptr + begin * sizeof(T)) % VEC_BYTES == 0;
    const u64 bytes = n * sizeof(T);
    u64 done = 0;
    if (aligned) {
        const u64 nv = bytes / VEC_BYTES;
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        u64 i = threadIdx.x;
        const u64 stride = blockDim.x;
        // two 16-byte loads in flight per thread before the stores
        for (; i + stride < nv; i += 2 * stride) {
            const uint4 x = s4[i];
            const uint4 y = s4[i + stride];
            for (u32 k = 0; k < s.ndst; ++k) {
                uint4* d4 = reinterpret_cast<uint4*>(reinterpret_cast<char*>(dsts[k].ptr) + begin * sizeof(T));
                d4[i] = x;
                d4[i + stride] = y;
            }
        }
        for (; i < nv; i += stride) {
            const uint4 x = s4[i];
            for (u32 k = 0; k < s.ndst; ++k)
                reinterpret_cast<uint4*>(reinterpret_cast<char*>(dsts[k].ptr) + begin * sizeof(T))[i] = x;
        }
        done = nv * VEC_BYTES;
    }
    for (u64 i = done / sizeof(T) + threadIdx.x; i < n; i += blockDim.x) {
        const T x = reinterpret_cast<const T*>(src)[i];
        for (u32 k = 0; k < s.ndst; ++k) reinterpret_cast<T*>(dsts[k].ptr)[begin + i] = x;
    }
}

template <typename T, int OP>
__device__ void run_plan(const PlanArgs& a) {
    const u32 lane = blockIdx.x;
    u64* bases = a.bases + (u64)lane * a.slots;
    u64* my_pad = a.pads[a.rank] + (u64)lane * a.slots;
    __shared__ int give_up;
    if (threadIdx.x == 0) give_up = 0;
    const u64 begin = (u64)lane * a.lane_len;
    for (u32 i = 0; i < a.nsteps; ++i) {
        const DeviceStep s = a.steps[i];
        switch (s.kind) {
        case STEP_WAIT:
            if (threadIdx.x == 0)
                give_up = !wait_signal(my_pad + s.slot, s.cmp, bases[s.slot] + s.value, a.timeout_ns, a.error,
                                       a.rank, lane, i, s.slot);
            __syncthreads();
            if (give_up) return;
            break;
        case STEP_NOTIFY:
            __syncthreads();
            // a slot is set at most once per call (checked), so Set is an add on the epoch base
            if (threadIdx.x == 0) notify(a.pads[s.peer] + (u64)lane * a.slots + s.slot, s.value, NOTIFY_ADD);
            break;
        case STEP_COPY:
        case STEP_REDUCE:
            if (begin < s.len) {
                const u64 n = min(a.lane_len, s.len - begin);
                if (s.kind == STEP_COPY) copy_slice<T>(a, s, begin, n);
                else reduce_slice<T, OP>(a, s, begin, n);
            }
            break;
        }
    }
    __syncthreads();
    // the next call counts from here: advance this lane's epoch bases
    for (u32 k = threadIdx.x; k < a.slots; k += blockDim.x) bases[k] += a.increments[k];
}

#define COMMFUSE_PLAN_KERNEL(NAME, T, OP) \
    extern "C" __global__ void __launch_bounds__(512) NAME(const PlanArgs args) { run_plan<T, OP>(args); }

// plan_<type>_<op>
COMMFUSE_EACH_TYPE_AND_OP(COMMFUSE_PLAN_KERNEL, plan)
