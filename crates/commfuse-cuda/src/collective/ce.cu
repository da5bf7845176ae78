// The device side of the copy-engine (CE) collectives for large messages (src/ce.rs): the bytes
// cross NVLink by the copy engines (cuMemcpyPeerAsync on side streams), and every flag is
// written by a side stream itself after its copy (cuStreamWriteValue64, which fences the copy
// before the flag). The SMs only reduce: this file holds the reduction, which waits for each
// sender's copy of a sub-chunk before folding it in, so that the reduction of one sub-chunk
// overlaps the copies of the next; and a small wait for the flags that end a call.
#include "common.cuh"

// Mirrored by `CeReduceArgs` in src/ce.rs.
struct CeReduceArgs {
    const void* input;    // this rank's own chunk of its input
    const void* scratch;  // this call's set of the receive buffer: sender q's copy at q * pitch
    void* output;         // where the reduced chunk goes
    const u64* flags;     // this call's set of arrival flags: [world][subs], raised to `epoch`
    ErrorRecord* err;     // host-mapped
    u64 timeout_ns;
    u64 epoch;            // this call's number (from 1)
    u64 len;              // elements of the chunk
    u64 pitch;            // elements between two senders' copies in scratch
    u64 sub;              // elements per sub-chunk
    u32 subs;             // sub-chunks of the chunk (flags per sender)
    u32 world;
    u32 rank;
    u32 vec;              // 1: input, scratch and output on 16 bytes, pitch and sub whole vectors
};
static_assert(sizeof(CeReduceArgs) == 96 && COMMFUSE_OFFSETOF(CeReduceArgs, subs) == 80,
              "layout mirrored in src/ce.rs");

// Mirrored by `CeWaitArgs` in src/ce.rs.
struct CeWaitArgs {
    const u64* flags;  // `per_sender` flags per sender, each raised to `epoch`
    ErrorRecord* err;
    u64 timeout_ns;
    u64 epoch;
    u32 world;
    u32 rank;
    u32 lane;          // what the flags are, for the record (LANE_* in src/ce.rs)
    u32 per_sender;
};
static_assert(sizeof(CeWaitArgs) == 48, "layout mirrored in src/ce.rs");

// Element j of a 16-byte vector of T, and the bits of a T, by register moves only (no address
// of a local is taken: ptxas would put it on the stack).
__device__ __forceinline__ u32 word_of(const uint4& v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}
template <typename T> struct Bits;
template <> struct Bits<float> {
    static __device__ __forceinline__ float lane(const uint4& v, int j) { return __uint_as_float(word_of(v, j)); }
    static __device__ __forceinline__ u32 of(float x) { return __float_as_uint(x); }
};
template <> struct Bits<__nv_bfloat16> {
    static __device__ __forceinline__ float lane(const uint4& v, int j) {
        const u32 w = word_of(v, j / 2);
        return __bfloat162float(__ushort_as_bfloat16((unsigned short)((j & 1) ? w >> 16 : w & 0xffffu)));
    }
    static __device__ __forceinline__ u32 of(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
template <> struct Bits<__half> {
    static __device__ __forceinline__ float lane(const uint4& v, int j) {
        const u32 w = word_of(v, j / 2);
        return __half2float(__ushort_as_half((unsigned short)((j & 1) ? w >> 16 : w & 0xffffu)));
    }
    static __device__ __forceinline__ u32 of(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// The V floats of acc as a 16-byte vector of T.
template <typename T, int V>
__device__ __forceinline__ uint4 pack(const float* acc) {
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (V == 4) w[k] = Bits<T>::of(acc[k]);
        else w[k] = Bits<T>::of(acc[2 * k]) | (Bits<T>::of(acc[2 * k + 1]) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Reduces the chunk sub-chunk by sub-chunk, in rank order (the rank's own input in its place),
// each once every sender's flag of it carries this call's epoch. The copies land by another
// engine's writes: scratch is read at L2 (ld.global.cg), never from an L1 line of an earlier call.
template <typename T, int OP>
__device__ void ce_reduce(const CeReduceArgs& a) {
    constexpr int V = 16 / sizeof(T);
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    const T* in = reinterpret_cast<const T*>(a.input);
    const T* scratch = reinterpret_cast<const T*>(a.scratch);
    T* out = reinterpret_cast<T*>(a.output);
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 threads = (u64)gridDim.x * blockDim.x;
    for (u32 s = 0; s < a.subs; ++s) {
        // one thread per block waits for every sender's copy of sub-chunk s; the block barrier
        // passes its acquire on to the block
        if (threadIdx.x == 0) {
            for (u32 q = 0; q < a.world && !failed; ++q)
                if (q != a.rank &&
                    !wait_signal(a.flags + (u64)q * a.subs + s, CMP_GE, a.epoch, a.timeout_ns, a.err,
                                 a.rank, blockIdx.x, q, s))
                    failed = 1;
        }
        __syncthreads();
        if (failed) return;
        const u64 lo = (u64)s * a.sub, hi = min(a.len, lo + a.sub);
        const u64 vec_end = a.vec && hi > lo ? lo + (hi - lo) / V * V : lo;
        for (u64 i = lo + tid * V; i < vec_end; i += threads * V) {
            float acc[V];
            for (u32 q = 0; q < a.world; ++q) {
                const uint4 raw = q == a.rank ? *reinterpret_cast<const uint4*>(in + i)
                                              : __ldcg(reinterpret_cast<const uint4*>(scratch + q * a.pitch + i));
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float x = Bits<T>::lane(raw, j);
                    acc[j] = q == 0 ? x : combine<OP>(acc[j], x);
                }
            }
            *reinterpret_cast<uint4*>(out + i) = pack<T, V>(acc);
        }
        // what is not on 16 bytes, element by element
        for (u64 i = (hi > vec_end ? vec_end : hi) + tid; i < hi; i += threads) {
            float acc = 0.f;
            for (u32 q = 0; q < a.world; ++q) {
                const float x = Elem<T>::to_f32(q == a.rank ? in[i] : __ldcg(scratch + q * a.pitch + i));
                acc = q == 0 ? x : combine<OP>(acc, x);
            }
            out[i] = Elem<T>::from_f32(acc);
        }
    }
}

#define COMMFUSE_CE_REDUCE(NAME, T, OP) \
    extern "C" __global__ void __launch_bounds__(512) NAME(const CeReduceArgs args) { ce_reduce<T, OP>(args); }

// ce_reduce_<type>_<op>
COMMFUSE_EACH_TYPE_AND_OP(COMMFUSE_CE_REDUCE, ce_reduce)

// Waits until every peer's flags carry this call's epoch (a thread per flag; the record names
// the sender and which of its flags).
extern "C" __global__ void __launch_bounds__(64) ce_wait(const CeWaitArgs a) {
    for (u32 i = threadIdx.x; i < a.world * a.per_sender; i += blockDim.x) {
        const u32 q = i / a.per_sender, piece = i % a.per_sender;
        if (q != a.rank &&
            !wait_signal(a.flags + i, CMP_GE, a.epoch, a.timeout_ns, a.err, a.rank, a.lane, q, piece))
            return;
    }
}

