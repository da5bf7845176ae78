// The low-latency (LL) all-reduce for small messages (commfuse_sim::protocol's ll_* on the
// simulator, where loom checks it): every 4 bytes of a rank's input travel with the call's
// sequence number in one 8-byte line, stored straight into each peer's LL buffer over NVLink.
// An 8-byte store is seen whole or not at all, so a receiver that reads a line carrying this
// call's number holds its data: one NVLink trip, no separate flag, no fence between data and
// flag, nothing cleared between calls.
//
// One-shot: every rank writes its whole input to every peer, then reduces all P inputs itself,
// in rank order (so every rank gets the same bits); as a reduce-scatter, each peer gets only its
// chunk and each rank reduces only its own; as an all-gather, every rank writes its chunk to
// every peer and each rank copies every peer's chunk out of its buffer into its output. Lines of alternate calls go to alternate
// halves (parity) of the buffer: a peer can only be one call ahead of this rank (it cannot
// finish call n + 1 before this rank has written its lines of n + 1, which it does after it
// finished reading those of n), so its lines of n + 1 land in the other half and those of n + 2,
// the next into this half, only once this rank is done with n.
//
// The call's number is read from the rank's counters on the device (one per block: each block
// reads and advances its own, so they move in step without any atomic), so calls may be
// captured into a CUDA graph and replayed. Each thread moves two lines per 16-byte store (each
// 8-byte half is still seen whole or not at all).
#include "common.cuh"

// Mirrored by `LlArgs` in src/ll.rs.
struct LlArgs {
    u64 bufs[COMMFUSE_MAX_RANKS];  // every rank's LL buffer as this GPU addresses it: [2
                                   // parities][world senders][words rounded up to even] lines
    const void* input;             // this rank's `count` elements
    void* output;                  // `count` elements, or this rank's chunk of them (reduce-scatter)
    u64* calls;                    // this rank's counters: the last call each block finished
    ErrorRecord* err;              // host-mapped
    u64 timeout_ns;
    u32 count;                     // elements of each rank's input (all-gather: of the output)
    u32 words;                     // 4-byte words a sender sends at most: ceil(count * size / 4)
                                   // (all-gather: of the longest chunk)
    u32 world;
    u32 rank;
    u32 mode;                      // LL_ALL_REDUCE, LL_REDUCE_SCATTER (rank q keeps its chunk)
                                   // or LL_ALL_GATHER (rank q gives its chunk)
    u32 pad;
};
static_assert(sizeof(LlArgs) == 8 * COMMFUSE_MAX_RANKS + 64 &&
                  COMMFUSE_OFFSETOF(LlArgs, timeout_ns) == 8 * COMMFUSE_MAX_RANKS + 32,
              "layout mirrored in src/ll.rs");

// LlArgs::mode
constexpr u32 LL_ALL_REDUCE = 0, LL_REDUCE_SCATTER = 1, LL_ALL_GATHER = 2;
static_assert(LL_ALL_REDUCE == 0 && LL_REDUCE_SCATTER == 1 && LL_ALL_GATHER == 2,
              "mirrored by mode() in src/ll.rs");

__device__ __forceinline__ void store_lines(u64* p, u64 a, u64 b) {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

__device__ __forceinline__ void store_line(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void load_lines(const u64* p, u64* a, u64* b) {
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(*a), "=l"(*b) : "l"(p) : "memory");
}

// Word `i` of this rank's input of `count` elements; the last word of an odd count of 2-byte
// elements is padded.
template <typename T>
__device__ __forceinline__ u32 input_word(const LlArgs& a, u32 i, u32 count) {
    if (sizeof(T) == 4 || 2 * i + 1 < count) return reinterpret_cast<const u32*>(a.input)[i];
    return reinterpret_cast<const unsigned short*>(a.input)[2 * i];
}

// Lines between two senders' regions of a buffer: the words rounded up to even, so that every
// pair of lines starts on 16 bytes.
__device__ __forceinline__ u64 pitch(const LlArgs& a) { return (a.words + 1) & ~1u; }

// Where sender q's line of word i is in `buf`, in the half of call `seq`.
__device__ __forceinline__ u64 line_index(const LlArgs& a, u32 q, u32 i, u32 seq) {
    return ((u64)(seq & 1) * a.world + q) * pitch(a) + i;
}

// Waits until sender q's lines of words i (and i + 1 unless `one`) carry `seq`; their data, or
// false when the wait gave up (recorded: rank, block, sender as step, word as slot, expected
// and seen numbers).
__device__ __forceinline__ bool receive(const LlArgs& a, u32 q, u32 i, bool one, u32 seq, u32* w0, u32* w1) {
    const u64* line = reinterpret_cast<const u64*>(a.bufs[a.rank]) + line_index(a, q, i, seq);
    u64 x, y = (u64)seq << 32;
    const u64 start = global_timer_ns();
    for (u32 spins = 0;; ++spins) {
        if (one) x = load_relaxed_sys(line);
        else load_lines(line, &x, &y);
        if ((u32)(x >> 32) == seq && (u32)(y >> 32) == seq) {
            *w0 = (u32)x;
            *w1 = (u32)y;
            return true;
        }
        if ((spins & 255) == 255) {
            const GiveUp why = waiter_check(a.err, global_timer_ns() - start, spins, a.timeout_ns);
            if (why == ABORTED) return false;
            if (why == TIMED_OUT) {
                if (cas_sys(&a.err->flag, 0u, 1u) == 0u) {
                    a.err->rank = a.rank;
                    a.err->lane = blockIdx.x;
                    a.err->step = q;
                    a.err->slot = (u32)(x >> 32) == seq ? i + 1 : i;
                    a.err->expected = seq;
                    a.err->seen = ((u32)(x >> 32) == seq ? y : x) >> 32;
                    store_release_sys_u32(&a.err->abort, 1u);
                }
                return false;
            }
        }
    }
}

template <typename T, int OP>
__device__ __forceinline__ void fold_word(float* acc, u32 w, bool first) {
    constexpr int PER_WORD = 4 / sizeof(T);
    const T* x = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int j = 0; j < PER_WORD; ++j)
        acc[j] = first ? Elem<T>::to_f32(x[j]) : combine<OP>(acc[j], Elem<T>::to_f32(x[j]));
}

// Rank q's chunk of `count` elements as the collectives split them
// (commfuse_core::op::chunk_range: the first count mod P chunks one element longer).
__device__ __forceinline__ void chunk_range(const LlArgs& a, u32 q, u32* e0, u32* e1) {
    const u32 base = a.count / a.world, extra = a.count % a.world;
    *e0 = q * base + min(q, extra);
    *e1 = *e0 + base + (q < extra ? 1u : 0u);
}

// The elements rank q reduces: all of them, or (reduce-scatter) its chunk.
__device__ __forceinline__ void chunk_of(const LlArgs& a, u32 q, u32* e0, u32* e1) {
    if (a.mode == LL_ALL_REDUCE) {
        *e0 = 0;
        *e1 = a.count;
        return;
    }
    chunk_range(a, q, e0, e1);
}

// The word pairs that carry elements [e0, e1): from the even word at or below the first (pairs
// start on 16 bytes; a word of the chunk before may come along, unread) to the word past the
// last.
template <typename T>
__device__ __forceinline__ void pairs_of(u32 e0, u32 e1, u32* lo, u32* hi) {
    *lo = (u32)((u64)e0 * sizeof(T) / 4) & ~1u;
    *hi = (u32)(((u64)e1 * sizeof(T) + 3) / 4);
}

// The elements of word i that lie in [e0, e1), into the output at their place less e0.
template <typename T>
__device__ __forceinline__ void store_word(const LlArgs& a, u32 i, const float* acc, u32 e0, u32 e1) {
    constexpr int PER_WORD = 4 / sizeof(T);
    T* out = reinterpret_cast<T*>(a.output);
#pragma unroll
    for (int j = 0; j < PER_WORD; ++j) {
        const u32 e = PER_WORD * i + j;
        if (e >= e0 && e < e1) out[e - e0] = Elem<T>::from_f32(acc[j]);
    }
}

// What both call bodies start with: the wait for the kernel before this one on the stream, the
// call's number (the block's counter + 1, read by one thread and handed to the block through
// `seq_shared`; `failed` cleared), and this thread's first word pair and its stride over the
// grid.
struct LlCall {
    u32 seq, first, stride;
};
__device__ __forceinline__ LlCall ll_begin(const LlArgs& a, u32& seq_shared, int& failed) {
    // launched programmatically (src/ll.rs): the previous call's kernel on this stream may still
    // run, and it writes this block's counter, the buffer half of call n + 2 and maybe our input
    wait_for_prior_grid();
    allow_next_grid();
    if (threadIdx.x == 0) {
        seq_shared = (u32)(*(volatile const u64*)(a.calls + blockIdx.x) + 1);
        failed = 0;
    }
    __syncthreads();
    return {seq_shared, 2 * (blockIdx.x * blockDim.x + threadIdx.x), 2 * gridDim.x * blockDim.x};
}

// And end with: this block's call is done, its counter moves on (every block's moves once per
// call) — unless a wait gave up.
__device__ __forceinline__ void ll_end(const LlArgs& a, u32 seq, const int& failed) {
    __syncthreads();
    if (threadIdx.x == 0 && !failed) *(volatile u64*)(a.calls + blockIdx.x) = seq;
}

template <typename T, int OP>
__device__ void ll_all_reduce(const LlArgs& a) {
    constexpr int PER_WORD = 4 / sizeof(T);
    __shared__ u32 seq_shared;
    __shared__ int failed;
    const LlCall c = ll_begin(a, seq_shared, failed);
    const u32 seq = c.seq, stride = c.stride, first = c.first;
    const u64 tag = (u64)seq << 32;
    // send: two words per thread to every peer (all of them, or the peer's chunk), all stores
    // in flight before any wait
    for (u32 d = 1; d < a.world; ++d) {
        const u32 q = (a.rank + d) % a.world;
        u32 e0, e1, lo, hi;
        chunk_of(a, q, &e0, &e1);
        pairs_of<T>(e0, e1, &lo, &hi);
        for (u32 i = lo + first; i < hi; i += stride) {
            const bool one = i + 1 >= hi;
            const u64 l0 = tag | input_word<T>(a, i, a.count);
            u64* dst = reinterpret_cast<u64*>(a.bufs[q]) + line_index(a, a.rank, i, seq);
            if (one) store_line(dst, l0);
            else store_lines(dst, l0, tag | input_word<T>(a, i + 1, a.count));
        }
    }
    // receive and reduce this rank's elements, in rank order
    u32 e0, e1, lo, hi;
    chunk_of(a, a.rank, &e0, &e1);
    pairs_of<T>(e0, e1, &lo, &hi);
    for (u32 i = lo + first; i < hi; i += stride) {
        const bool one = i + 1 >= hi;
        float acc0[PER_WORD], acc1[PER_WORD];
        for (u32 q = 0; q < a.world; ++q) {
            u32 w0, w1 = 0;
            if (q == a.rank) {
                w0 = input_word<T>(a, i, a.count);
                if (!one) w1 = input_word<T>(a, i + 1, a.count);
            } else if (!receive(a, q, i, one, seq, &w0, &w1)) {
                failed = 1;
                break;
            }
            fold_word<T, OP>(acc0, w0, q == 0);
            fold_word<T, OP>(acc1, w1, q == 0);
        }
        if (failed) break;
        store_word<T>(a, i, acc0, e0, e1);
        if (!one) store_word<T>(a, i + 1, acc1, e0, e1);
    }
    ll_end(a, seq, failed);
}

// The all-gather: this rank's chunk (its whole input) to every peer, then every rank's chunk
// into the output at its place — its own from its input, a peer's from the lines it sent.
template <typename T>
__device__ void ll_all_gather(const LlArgs& a) {
    constexpr int PER_WORD = 4 / sizeof(T);
    __shared__ u32 seq_shared;
    __shared__ int failed;
    const LlCall c = ll_begin(a, seq_shared, failed);
    const u32 seq = c.seq, stride = c.stride, first = c.first;
    const u64 tag = (u64)seq << 32;
    u32 m0, m1;
    chunk_range(a, a.rank, &m0, &m1);
    const u32 mine = m1 - m0, my_words = (u32)(((u64)mine * sizeof(T) + 3) / 4);
    for (u32 d = 1; d < a.world; ++d) {
        const u32 q = (a.rank + d) % a.world;
        for (u32 i = first; i < my_words; i += stride) {
            const u64 l0 = tag | input_word<T>(a, i, mine);
            u64* dst = reinterpret_cast<u64*>(a.bufs[q]) + line_index(a, a.rank, i, seq);
            if (i + 1 >= my_words) store_line(dst, l0);
            else store_lines(dst, l0, tag | input_word<T>(a, i + 1, mine));
        }
    }
    T* out = reinterpret_cast<T*>(a.output);
    for (u32 q = 0; q < a.world && !failed; ++q) {
        u32 e0, e1;
        chunk_range(a, q, &e0, &e1);
        const u32 len = e1 - e0, words = (u32)(((u64)len * sizeof(T) + 3) / 4);
        for (u32 i = first; i < words; i += stride) {
            const bool one = i + 1 >= words;
            u32 w[2] = {0, 0};
            if (q == a.rank) {
                w[0] = input_word<T>(a, i, len);
                if (!one) w[1] = input_word<T>(a, i + 1, len);
            } else if (!receive(a, q, i, one, seq, &w[0], &w[1])) {
                failed = 1;
                break;
            }
            const T* x = reinterpret_cast<const T*>(w);
#pragma unroll
            for (int j = 0; j < 2 * PER_WORD; ++j) {
                const u32 e = PER_WORD * i + j;
                if (e < len) out[e0 + e] = x[j];
            }
        }
    }
    ll_end(a, seq, failed);
}

#define COMMFUSE_LL(NAME, T, OP)                                                        \
    extern "C" __global__ void __launch_bounds__(512) NAME(const LlArgs args) {         \
        if (args.mode == LL_ALL_GATHER) ll_all_gather<T>(args);                         \
        else ll_all_reduce<T, OP>(args);                                                \
    }

// ll_all_reduce_<type>_<op>: every mode (an all-gather's op is not used)
COMMFUSE_EACH_TYPE_AND_OP(COMMFUSE_LL, ll_all_reduce)
