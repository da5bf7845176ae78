// The low-latency (LL) all-reduce, reduce-scatter and all-gather for small messages
// (commfuse_sim::protocol's ll_* on the simulator, where loom checks the protocol): a rank's
// words travel with the call's sequence number in the same store, straight into each peer's LL
// buffer over NVLink. A receiver that reads a line carrying this call's number holds its data:
// one NVLink trip, no separate flag, no fence between data and flag, nothing cleared between
// calls. Each thread moves one 16-byte unit per store, in one of two line formats (template
// parameter K, the data words per unit):
//
//   LL   (K = 2): two 8-byte lines {word, number}. An 8-byte store is seen whole or not at
//                 all, so each line is checked on its own: half of every byte moved is data.
//   LL16 (K = 3): one 16-byte line {word, word, word, number}, moved by a scalar 128-bit store
//                 and load (st/ld .b128, one memory operation each): three quarters data, for
//                 the sizes where the bytes on the link, not latency, set the time.
//
// One-shot: every rank writes its whole input to every peer, then reduces all P inputs itself,
// in rank order (so every rank gets the same bits); as a reduce-scatter, each peer gets only its
// chunk and each rank reduces only its own; as an all-gather, every rank writes its chunk to
// every peer and each rank copies every peer's chunk out of its buffer into its output. Lines
// of alternate calls go to alternate halves (parity) of the buffer: a peer can only be one call
// ahead of this rank (it cannot finish call n + 1 before this rank has written its lines of
// n + 1, which it does after it finished reading those of n), so its lines of n + 1 land in the
// other half and those of n + 2, the next into this half, only once this rank is done with n.
//
// The call's number is read from the rank's counters on the device (one per block: each block
// reads and advances its own, so they move in step without any atomic), so calls may be
// captured into a CUDA graph and replayed.
#include "common.cuh"

// Mirrored by `LlArgs` in src/ll.rs.
struct LlArgs {
    u64 bufs[COMMFUSE_MAX_RANKS];  // every rank's LL buffer as this GPU addresses it: [2
                                   // parities][world senders][ceil(words / K)] 16-byte units
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

// The 16-byte store unit of line format K: its data words and the call's number, packed into
// the two 64-bit halves of one 128-bit access.
template <int K>
struct Unit;

template <>
struct Unit<2> {  // LL: two 8-byte lines, each {word, number}
    static __device__ __forceinline__ void pack(const u32 (&w)[2], u32 seq, u64* x, u64* y) {
        *x = (u64)seq << 32 | w[0];
        *y = (u64)seq << 32 | w[1];
    }
    static __device__ __forceinline__ bool holds(u64 x, u64 y, u32 seq) {
        return (u32)(x >> 32) == seq && (u32)(y >> 32) == seq;
    }
    static __device__ __forceinline__ void unpack(u64 x, u64 y, u32 (&w)[2]) {
        w[0] = (u32)x;
        w[1] = (u32)y;
    }
    // the first word whose line does not carry `seq`, and the number that line carries
    static __device__ __forceinline__ u32 stale_word(u64 x, u32 seq) { return (u32)(x >> 32) == seq ? 1 : 0; }
    static __device__ __forceinline__ u32 seen(u64 x, u64 y, u32 seq) {
        return (u32)(((u32)(x >> 32) == seq ? y : x) >> 32);
    }
};

template <>
struct Unit<3> {  // LL16: one 16-byte line {word, word, word, number}
    static __device__ __forceinline__ void pack(const u32 (&w)[3], u32 seq, u64* x, u64* y) {
        *x = (u64)w[1] << 32 | w[0];
        *y = (u64)seq << 32 | w[2];
    }
    static __device__ __forceinline__ bool holds(u64, u64 y, u32 seq) { return (u32)(y >> 32) == seq; }
    static __device__ __forceinline__ void unpack(u64 x, u64 y, u32 (&w)[3]) {
        w[0] = (u32)x;
        w[1] = (u32)(x >> 32);
        w[2] = (u32)y;
    }
    static __device__ __forceinline__ u32 stale_word(u64, u32) { return 0; }
    static __device__ __forceinline__ u32 seen(u64, u64 y, u32) { return (u32)(y >> 32); }
};

// One unit as a single 128-bit store or load at system scope.
__device__ __forceinline__ void store_unit(u64* p, u64 x, u64 y) {
    asm volatile("{\n\t.reg .b128 t;\n\tmov.b128 t, {%1, %2};\n\tst.relaxed.sys.global.b128 [%0], t;\n\t}" ::"l"(p), "l"(x), "l"(y)
                 : "memory");
}

__device__ __forceinline__ void load_unit(const u64* p, u64* x, u64* y) {
    asm volatile("{\n\t.reg .b128 t;\n\tld.relaxed.sys.global.b128 t, [%2];\n\tmov.b128 {%0, %1}, t;\n\t}" : "=l"(*x), "=l"(*y) : "l"(p)
                 : "memory");
}

// Word `i` of this rank's input of `count` elements: 0 past its last word, and the last word
// of an odd count of 2-byte elements padded. A 2-byte input need only be 2-byte aligned (a
// tensor view may start one element into a word): then the word is read as two halves.
template <typename T>
__device__ __forceinline__ u32 input_word(const LlArgs& a, u32 i, u32 count) {
    const u64 e = (u64)i * (4 / sizeof(T));
    if (e >= count) return 0;
    const unsigned short* half = reinterpret_cast<const unsigned short*>(a.input);
    if (sizeof(T) == 2 && e + 1 >= count) return half[2 * i];
    if (sizeof(T) == 4 || ((u64)a.input & 3) == 0) return reinterpret_cast<const u32*>(a.input)[i];
    return (u32)half[2 * i + 1] << 16 | half[2 * i];
}

// Element j of the 4 / sizeof(T) elements a word holds (the first in its low bytes), taken
// from the register without going through memory.
template <typename T>
__device__ __forceinline__ T word_element(u32 w, int j) {
    if constexpr (sizeof(T) == 4) {
        return __uint_as_float(w);
    } else {
        const unsigned short bits = (unsigned short)(w >> (16 * j));
        T t;
        memcpy(&t, &bits, sizeof(T));
        return t;
    }
}

// Words `K u .. K u + K - 1` of this rank's input of `count` elements.
template <typename T, int K>
__device__ __forceinline__ void input_unit(const LlArgs& a, u32 u, u32 count, u32 (&w)[K]) {
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = input_word<T>(a, K * u + j, count);
}

// Units between two senders' regions of a buffer: what the longest message takes.
template <int K>
__device__ __forceinline__ u64 pitch(const LlArgs& a) { return (a.words + K - 1) / K; }

// Where sender q's unit u is in `buf` (as 8-byte words), in the half of call `seq`.
template <int K>
__device__ __forceinline__ u64 unit_offset(const LlArgs& a, u32 q, u32 u, u32 seq) {
    return 2 * (((u64)(seq & 1) * a.world + q) * pitch<K>(a) + u);
}

// Waits until sender q's unit u carries `seq`; its words, or false when the wait gave up
// (recorded: rank, block, sender as step, the first stale word as slot, expected and seen
// numbers).
template <int K>
__device__ __forceinline__ bool receive(const LlArgs& a, u32 q, u32 u, u32 seq, u32 (&w)[K]) {
    const u64* unit = reinterpret_cast<const u64*>(a.bufs[a.rank]) + unit_offset<K>(a, q, u, seq);
    u64 x, y;
    const u64 start = global_timer_ns();
    for (u32 spins = 0;; ++spins) {
        load_unit(unit, &x, &y);
        if (Unit<K>::holds(x, y, seq)) {
            Unit<K>::unpack(x, y, w);
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
                    a.err->slot = K * u + Unit<K>::stale_word(x, seq);
                    a.err->expected = seq;
                    a.err->seen = Unit<K>::seen(x, y, seq);
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
#pragma unroll
    for (int j = 0; j < PER_WORD; ++j) {
        const float x = Elem<T>::to_f32(word_element<T>(w, j));
        acc[j] = first ? x : combine<OP>(acc[j], x);
    }
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

// The units that carry elements [e0, e1): from the unit holding the first (a word or unit of
// the chunk before may come along, unread) to the unit past the last — and at least one, for
// an empty chunk too. Every receiver must wait on every sender in every call: the parity halves
// are safe only because a rank cannot finish call n + 1 before each peer has sent (so begun)
// it; were an empty chunk's unit left out, the rank that receives nothing from it would wait
// on nobody, could run two calls ahead and overwrite a half its peer still reads. (The extra
// unit's elements lie outside the chunk: never written.)
template <typename T, int K>
__device__ __forceinline__ void units_of(const LlArgs& a, u32 e0, u32 e1, u32* lo, u32* hi) {
    *lo = (u32)((u64)e0 * sizeof(T) / 4) / K;
    *hi = (u32)((((u64)e1 * sizeof(T) + 3) / 4 + K - 1) / K);
    if (*hi <= *lo) {
        *lo = min(*lo, (u32)pitch<K>(a) - 1);
        *hi = *lo + 1;
    }
}

// The units of a chunk of `len` elements counted from its start (the all-gather's): at least
// one, as in units_of.
template <typename T, int K>
__device__ __forceinline__ u32 chunk_units(u32 len) {
    return max(1u, (u32)((((u64)len * sizeof(T) + 3) / 4 + K - 1) / K));
}

// Word j of a unit's reduced values `acc` (PER_WORD floats per word), converted back to T and
// packed as the input was.
template <typename T, int K>
__device__ __forceinline__ u32 packed_word(const float (&acc)[K][4 / sizeof(T)], int j) {
    if constexpr (sizeof(T) == 4) {
        return __float_as_uint(acc[j][0]);
    } else {
        const T lo = Elem<T>::from_f32(acc[j][0]), hi = Elem<T>::from_f32(acc[j][1]);
        unsigned short l, h;
        memcpy(&l, &lo, 2);
        memcpy(&h, &hi, 2);
        return (u32)h << 16 | l;
    }
}

// Unit u's reduced words into the output: those of its elements that lie in [e0, e1), at their
// place less e0. A unit wholly inside, on a word boundary of a 4-byte aligned output, goes as
// K word stores; one at a chunk's edge (or into an output a 2-byte element off) element by
// element.
template <typename T, int K>
__device__ __forceinline__ void store_unit_words(const LlArgs& a, u32 u, const u32 (&w)[K], u32 e0, u32 e1) {
    constexpr u32 PER_WORD = 4 / sizeof(T);
    const u32 first = K * PER_WORD * u;
    if (e0 % PER_WORD == 0 && first >= e0 && first + K * PER_WORD <= e1 && ((u64)a.output & 3) == 0) {
        u32* out = reinterpret_cast<u32*>(a.output) + (first - e0) / PER_WORD;
#pragma unroll
        for (int j = 0; j < K; ++j) out[j] = w[j];
        return;
    }
    T* out = reinterpret_cast<T*>(a.output);
#pragma unroll 1
    for (u32 j = 0; j < K * PER_WORD; ++j) {
        const u32 e = first + j, k = j / PER_WORD;
        // the word by selects, not an index (which would put `w` in local memory)
        const u32 word = k == 0 ? w[0] : (K > 2 && k == 2 ? w[K - 1] : w[1]);
        if (e >= e0 && e < e1) out[e - e0] = word_element<T>(word, j % PER_WORD);
    }
}

// What both call bodies start with: the wait for the kernel before this one on the stream, the
// call's number (the block's counter + 1, read by one thread and handed to the block through
// `seq_shared`; `failed` cleared), and this thread's first unit and its stride over the grid.
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
    return {seq_shared, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x};
}

// And end with: this block's call is done, its counter moves on (every block's moves once per
// call) — unless a wait gave up.
__device__ __forceinline__ void ll_end(const LlArgs& a, u32 seq, const int& failed) {
    __syncthreads();
    if (threadIdx.x == 0 && !failed) *(volatile u64*)(a.calls + blockIdx.x) = seq;
}

template <typename T, int OP, int K>
__device__ void ll_all_reduce(const LlArgs& a) {
    constexpr int PER_WORD = 4 / sizeof(T);
    __shared__ u32 seq_shared;
    __shared__ int failed;
    const LlCall c = ll_begin(a, seq_shared, failed);
    const u32 seq = c.seq, stride = c.stride, first = c.first;
    // send: one unit per thread and store to every peer (all of it, or the peer's chunk), all
    // stores in flight before any wait
    for (u32 d = 1; d < a.world; ++d) {
        const u32 q = (a.rank + d) % a.world;
        u32 e0, e1, lo, hi;
        chunk_of(a, q, &e0, &e1);
        units_of<T, K>(a, e0, e1, &lo, &hi);
        for (u32 u = lo + first; u < hi; u += stride) {
            u32 w[K];
            input_unit<T, K>(a, u, a.count, w);
            u64 x, y;
            Unit<K>::pack(w, seq, &x, &y);
            store_unit(reinterpret_cast<u64*>(a.bufs[q]) + unit_offset<K>(a, a.rank, u, seq), x, y);
        }
    }
    // receive and reduce this rank's elements, in rank order
    u32 e0, e1, lo, hi;
    chunk_of(a, a.rank, &e0, &e1);
    units_of<T, K>(a, e0, e1, &lo, &hi);
    for (u32 u = lo + first; u < hi; u += stride) {
        float acc[K][PER_WORD];
        for (u32 q = 0; q < a.world; ++q) {
            u32 w[K];
            if (q == a.rank) {
                input_unit<T, K>(a, u, a.count, w);
            } else if (!receive<K>(a, q, u, seq, w)) {
                failed = 1;
                break;
            }
#pragma unroll
            for (int j = 0; j < K; ++j) fold_word<T, OP>(acc[j], w[j], q == 0);
        }
        if (failed) break;
        u32 w[K];
#pragma unroll
        for (int j = 0; j < K; ++j) w[j] = packed_word<T, K>(acc, j);
        store_unit_words<T, K>(a, u, w, e0, e1);
    }
    ll_end(a, seq, failed);
}

// The all-gather: this rank's chunk (its whole input) to every peer, then every rank's chunk
// into the output at its place — its own from its input, a peer's from the lines it sent.
template <typename T, int K>
__device__ void ll_all_gather(const LlArgs& a) {
    constexpr int PER_WORD = 4 / sizeof(T);
    __shared__ u32 seq_shared;
    __shared__ int failed;
    const LlCall c = ll_begin(a, seq_shared, failed);
    const u32 seq = c.seq, stride = c.stride, first = c.first;
    u32 m0, m1;
    chunk_range(a, a.rank, &m0, &m1);
    const u32 mine = m1 - m0, my_units = chunk_units<T, K>(mine);
    for (u32 d = 1; d < a.world; ++d) {
        const u32 q = (a.rank + d) % a.world;
        for (u32 u = first; u < my_units; u += stride) {
            u32 w[K];
            input_unit<T, K>(a, u, mine, w);
            u64 x, y;
            Unit<K>::pack(w, seq, &x, &y);
            store_unit(reinterpret_cast<u64*>(a.bufs[q]) + unit_offset<K>(a, a.rank, u, seq), x, y);
        }
    }
    T* out = reinterpret_cast<T*>(a.output);
    for (u32 q = 0; q < a.world && !failed; ++q) {
        u32 e0, e1;
        chunk_range(a, q, &e0, &e1);
        const u32 len = e1 - e0, units = chunk_units<T, K>(len);
        for (u32 u = first; u < units; u += stride) {
            u32 w[K];
            if (q == a.rank) {
                input_unit<T, K>(a, u, len, w);
            } else if (!receive<K>(a, q, u, seq, w)) {
                failed = 1;
                break;
            }
#pragma unroll
            for (int j = 0; j < K * PER_WORD; ++j) {
                const u32 e = K * PER_WORD * u + j;
                if (e < len) out[e0 + e] = word_element<T>(w[j / PER_WORD], j % PER_WORD);
            }
        }
    }
    ll_end(a, seq, failed);
}

#define COMMFUSE_LL(NAME, T, OP)                                                        \
    extern "C" __global__ void __launch_bounds__(512) NAME(const LlArgs args) {         \
        if (args.mode == LL_ALL_GATHER) ll_all_gather<T, 2>(args);                      \
        else ll_all_reduce<T, OP, 2>(args);                                             \
    }
#define COMMFUSE_LL16(NAME, T, OP)                                                      \
    extern "C" __global__ void __launch_bounds__(512) NAME(const LlArgs args) {         \
        if (args.mode == LL_ALL_GATHER) ll_all_gather<T, 3>(args);                      \
        else ll_all_reduce<T, OP, 3>(args);                                             \
    }

// ll_all_reduce_<type>_<op> (8-byte lines) and ll16_all_reduce_<type>_<op> (16-byte lines):
// every mode (an all-gather's op is not used)
COMMFUSE_EACH_TYPE_AND_OP(COMMFUSE_LL, ll_all_reduce)
COMMFUSE_EACH_TYPE_AND_OP(COMMFUSE_LL16, ll16_all_reduce)
