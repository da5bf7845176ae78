// The reducing half of GEMM + reduce-scatter; kernels/gemm.cu is the computing half.
//
// Every rank's GEMM stores each tile of the output rows that rank `o` owns into o's receive
// buffer (one slot per sender, over NVLink for peers) and raises the tile's flag there. On o, a
// few blocks of this kernel run beside the GEMM (on a second stream, on SMs the GEMM leaves
// free): they take o's tiles in the order the senders produce them, wait until every sender's
// flag of the tile is up, and sum the P partials in f32 in rank order (so the result does not
// depend on arrival order) with the bias, into the caller's output.
//
// Flags hold the number of the call that last raised them (the GEMM's epilogue stores the call's
// epoch after each tile), so a wait for "at least this call's epoch" needs no clearing between
// calls and no count of how many tiles each M had. Two rows (and two sets of receive slots)
// serve alternate calls.
#include "common.cuh"

// One tile of this rank's chunk, rows relative to the chunk's first row. Mirrored by
// `ReduceTile` in src/gemm_rs.rs.
struct ReduceTile {
    u32 row0;
    u32 rows;
    u32 col0;
    u32 cols;
};

// Mirrored by `GemmRsReduceArgs` in src/gemm_rs.rs.
struct GemmRsReduceArgs {
    u64 partials[COMMFUSE_MAX_RANKS];    // per sender (rank order): its partial of this chunk, ld = n
    u64 peer_flags[COMMFUSE_MAX_RANKS];  // every rank's flag row of this call's set
    u64 out;                             // the caller's output, [chunk rows, n], ld = out_ld
    u64 bias;                            // [n] in the output type, 0 for none
    const ReduceTile* tiles;             // this chunk's tiles in the order senders make them
    u64* flags;                          // this rank's flag row of this call's set
    ErrorRecord* err;                    // host-mapped
    u64 timeout_ns;
    u64 epoch;                           // this call's number: flags of this call hold it
    u32 world;
    u32 tile_count;                      // tiles to reduce here (0: the epilogue folded them)
    u32 stride;                          // flag columns per sender slot
    u32 n;
    u32 out_ld;
    u32 rank;
    u32 owners_with_rows;                // min(M, P): ranks from here on own no rows this call
    u32 rowless;                         // 1 when this rank owns no rows this call
    // A call numbered on the device (launched after the GEMM, which advanced the counter to
    // this call's number): when not null, `epoch` is the counter's `last` and `flags` and
    // `peer_flags` are set 0's rows, set 1's being `set_words` flags further; null: as given.
    const u64* calls;
    u64 set_words;
};
static_assert(COMMFUSE_OFFSETOF(GemmRsReduceArgs, out) == 16 * COMMFUSE_MAX_RANKS, "layout mirrored in gemm_rs.rs");
static_assert(COMMFUSE_OFFSETOF(GemmRsReduceArgs, epoch) == 16 * COMMFUSE_MAX_RANKS + 48,
              "layout mirrored in gemm_rs.rs");
static_assert(COMMFUSE_OFFSETOF(GemmRsReduceArgs, rank) == 16 * COMMFUSE_MAX_RANKS + 76, "layout mirrored in gemm_rs.rs");
static_assert(sizeof(GemmRsReduceArgs) == 16 * COMMFUSE_MAX_RANKS + 104 &&
                  COMMFUSE_OFFSETOF(GemmRsReduceArgs, calls) == 16 * COMMFUSE_MAX_RANKS + 88,
              "layout mirrored in gemm_rs.rs");

constexpr int REDUCE_THREADS = 512;

// The receive slot (and flag column block) of `sender`'s partials on `owner`
// (commfuse_core::fused::gemm_rs::GemmRsSchedule::slot_of).
__device__ __forceinline__ u32 slot_of(u32 sender, u32 owner, u32 world) { return (sender + world - owner - 1) % world; }

// 16-byte units each thread keeps in flight per source: the reduction is bound by memory
// latency, not bandwidth, unless every thread has several loads outstanding (one unit per thread
// at a time measured ~10 GB/s per block on H200; the first version).
constexpr int UNITS_IN_FLIGHT = 8;

template <typename Out>
__device__ __forceinline__ void reduce_tile(const GemmRsReduceArgs& a, const ReduceTile& t) {
    constexpr int VEC = 16 / sizeof(Out);
    constexpr int U = UNITS_IN_FLIGHT;
    const Out* bias = reinterpret_cast<const Out*>(a.bias);
    bool aligned = (a.n * sizeof(Out)) % 16 == 0 && (a.out_ld * sizeof(Out)) % 16 == 0 && t.col0 % VEC == 0 &&
                   a.out % 16 == 0 && t.cols % VEC == 0;
    for (u32 q = 0; q < a.world; ++q) aligned &= a.partials[q] % 16 == 0;
    if (aligned) {
        const u32 units = t.cols / VEC;  // 16-byte units per row
        const u32 total = t.rows * units;
        for (u32 base = 0; base < total; base += U * blockDim.x) {
            float acc[U][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[u][j] = 0.0f;
            for (u32 q = 0; q < a.world; ++q) {
                const Out* src = reinterpret_cast<const Out*>(a.partials[q]);
                uint4 raw[U];
                // every load of this source first, then the arithmetic: U loads in flight
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const u32 idx = base + u * blockDim.x + threadIdx.x;
                    if (idx < total) {
                        const u32 row = t.row0 + idx / units, col = t.col0 + (idx % units) * VEC;
                        // through L2 only (.cg): an L1 line of two calls ago must not stand in
                        raw[u] = __ldcg(reinterpret_cast<const uint4*>(src + (u64)row * a.n + col));
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const Out* x = reinterpret_cast<const Out*>(&raw[u]);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[u][j] += Elem<Out>::to_f32(x[j]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 idx = base + u * blockDim.x + threadIdx.x;
                if (idx >= total) continue;
                const u32 row = t.row0 + idx / units, col = t.col0 + (idx % units) * VEC;
                uint4 packed;
                Out* o = reinterpret_cast<Out*>(&packed);
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    o[j] = Elem<Out>::from_f32(bias != nullptr ? acc[u][j] + Elem<Out>::to_f32(bias[col + j]) : acc[u][j]);
                *reinterpret_cast<uint4*>(reinterpret_cast<Out*>(a.out) + (u64)row * a.out_ld + col) = packed;
            }
        }
    } else {
        for (u32 idx = threadIdx.x; idx < t.rows * t.cols; idx += blockDim.x) {
            const u32 row = t.row0 + idx / t.cols, col = t.col0 + idx % t.cols;
            float acc = 0.0f;
            for (u32 q = 0; q < a.world; ++q)
                acc += Elem<Out>::to_f32(__ldcg(reinterpret_cast<const Out*>(a.partials[q]) + (u64)row * a.n + col));
            if (bias != nullptr) acc += Elem<Out>::to_f32(bias[col]);
            reinterpret_cast<Out*>(a.out)[(u64)row * a.out_ld + col] = Elem<Out>::from_f32(acc);
        }
    }
}

template <typename Out>
__device__ void gemm_rs_reduce(const GemmRsReduceArgs& a) {
    __shared__ int ready;
    // this call's number, and the offset of its set's flag rows from the rows given
    const u64 epoch = a.calls != nullptr ? *(volatile const u64*)a.calls : a.epoch;
    const u64 set_off = a.calls != nullptr ? (epoch - 1) % 2 * a.set_words : 0;
    u64* const flags = a.flags + set_off;
    // When M < P some ranks own no rows. Such a rank's call would wait for nobody and could run
    // into its next call on the same set while a peer still reads that set's partials, so every
    // rank tells each of them that its part of this call is under way (this kernel runs after
    // the rank's previous call), and they wait for all P of these (column 0 of each slot: they
    // have no tile 0) before ending the call.
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        for (u32 o = a.owners_with_rows; o < a.world; ++o)
            store_release_sys((u64*)a.peer_flags[o] + set_off + (u64)slot_of(a.rank, o, a.world) * a.stride, epoch);
        if (a.rowless) {
            ready = 1;
            for (u32 q = 0; q < a.world && ready; ++q)
                ready = wait_signal(flags + (u64)q * a.stride, CMP_GE, epoch, a.timeout_ns, a.err, a.rank, blockIdx.x, 0,
                                    q * a.stride);
        }
    }
    for (u32 i = blockIdx.x; i < a.tile_count; i += gridDim.x) {
        // one thread waits for every sender's flag of the tile (acquire), then the block reads
        if (threadIdx.x == 0) {
            ready = 1;
            for (u32 q = 0; q < a.world && ready; ++q) {
                const u32 col = slot_of(q, a.rank, a.world) * a.stride + i;
                ready = wait_signal(flags + col, CMP_GE, epoch, a.timeout_ns, a.err, a.rank, blockIdx.x, i, col);
            }
        }
        __syncthreads();
        if (!ready) return;
        reduce_tile<Out>(a, a.tiles[i]);
        __syncthreads();  // `ready` is rewritten for the next tile
    }
}

#define COMMFUSE_GEMM_RS_REDUCE(NAME, OUT) \
    extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) NAME(const GemmRsReduceArgs args) { gemm_rs_reduce<OUT>(args); }

COMMFUSE_GEMM_RS_REDUCE(gemm_rs_reduce_f32, float)
COMMFUSE_GEMM_RS_REDUCE(gemm_rs_reduce_bf16, __nv_bfloat16)
COMMFUSE_GEMM_RS_REDUCE(gemm_rs_reduce_f16, __half)

// ---- the ring path's flags (commfuse_core::fused::ring_rs) -------------------------------------
//
// The overlapped path runs library GEMMs and copy-engine copies on streams; what orders them
// across GPUs is this one-thread kernel, queued between them: it waits (acquire, bounded) until
// a flag of this rank compares true, then raises a flag (release, system scope), usually on a
// peer. Queued after a copy on the same stream, the raise comes after the copied bytes have
// landed; queued before a GEMM, the wait holds the GEMM back until its C term has arrived.

// Mirrored by `FlagArgs` in src/flag_step.rs.
struct RingFlagArgs {
    const u64* wait;    // this rank's flag to wait on, or null
    u64 wait_value;
    u64* raise;         // the flag to raise (any GPU), or null
    u64 raise_value;
    ErrorRecord* err;   // host-mapped
    u64 timeout_ns;
    u32 wait_cmp;       // CMP_EQ or CMP_GE
    u32 rank;
    u32 step;           // for the diagnosis: the ring step and flag index waited on
    u32 index;
    // Calls numbered on the device (a CUDA graph may replay them): when not null, both values
    // are added to the rank's count of finished calls (so 1 means "this call"), and a step
    // with FLAG_ADVANCE, the call's last, counts the call finished.
    u64* calls;
};
static_assert(sizeof(RingFlagArgs) == 72 && COMMFUSE_OFFSETOF(RingFlagArgs, wait_cmp) == 48 &&
                  COMMFUSE_OFFSETOF(RingFlagArgs, calls) == 64,
              "layout mirrored in flag_step.rs");

// RingFlagArgs.wait_cmp: the comparison in the low byte; this bit raises before waiting (a
// rank's end-of-call "done" raised on one peer and awaited from another, in one launch).
constexpr u32 FLAG_RAISE_FIRST = 0x100;
// RingFlagArgs.wait_cmp: after its wait and raise, the step advances RingFlagArgs.calls.
constexpr u32 FLAG_ADVANCE = 0x200;

extern "C" __global__ void __launch_bounds__(32) ring_flag(const RingFlagArgs a) {
    if (threadIdx.x != 0) return;
    const u64 base = a.calls != nullptr ? *(volatile const u64*)a.calls : 0;
    const bool raise_first = (a.wait_cmp & FLAG_RAISE_FIRST) != 0;
    if (raise_first && a.raise != nullptr) store_release_sys(a.raise, base + a.raise_value);
    if (a.wait != nullptr && !wait_signal(a.wait, a.wait_cmp & 0xffu, base + a.wait_value, a.timeout_ns, a.err, a.rank,
                                          0, a.step, a.index))
        return;  // recorded; raising now would let a peer run on
    if (!raise_first && a.raise != nullptr) store_release_sys(a.raise, base + a.raise_value);
    if ((a.wait_cmp & FLAG_ADVANCE) != 0 && a.calls != nullptr) *(volatile u64*)a.calls = base + 1;
}
