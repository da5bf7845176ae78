// commfuse's Hopper GEMM with a programmable epilogue. See GEMM-NOTES.md for the
// design, the measured versions and what each change bought.
//
// D = alpha * A B + beta * C (+ bias row), f32 accumulation, cast to the output type, each
// 128x256 (or 128x128, 128x64) tile sent to the address its route names (local D or a peer's buffer over NVLink),
// then a per-tile flag raised with release semantics at system scope.
//
// One block per SM, 384 threads in three warpgroups:
//   warpgroup 0, warp 0   the producer: TMA loads of A and B k-blocks into a ring of
//                         swizzled shared-memory stages, tracked by mbarriers (and, after a
//                         tile's last k-block, of the peers' partials the tile folds in);
//   warpgroup 0, warps 1-3 the storers: copy a finished tile from shared memory to its
//                         destination and raise its flag while the consumers already run the
//                         next tile's main loop (this is what hides NVLink stores);
//   warpgroups 1 and 2    the consumers: wgmma m64n256k16 on 64 rows each, then the epilogue
//                         arithmetic in registers and the staging of the tile in shared memory.
// The grid is persistent (any size up to the tile count: the SM cap) and takes tiles in the
// order of a caller-provided table, block b taking entries b, b + grid, b + 2 grid, ...
// Further builds of the same code (`Cfg` below) serve plans whose tiles have at most 64 rows
// (gemm_skinny_*: one consumer warpgroup and four stages) and plans of 128x64 tiles, where a
// skinny M over the 256-wide tiles would leave most SMs without a tile (gemm_narrow_*: 64 rows,
// one consumer warpgroup; gemm_narrow_tall_*: 128 rows on two; wgmma m64n64k16, 8 stages), and
// the main build's plans in clusters of two blocks that share each k-block of B by TMA
// multicast (gemm_pair_*: the host pairs up tiles of one column of tiles in the order).
#include "common.cuh"

namespace gemm {
constexpr int BM = 128;
constexpr int BN = 256;
constexpr int BK = 64;  // 64 16-bit elements = one 128-byte swizzle row
constexpr int STAGES = 3;
constexpr int A_STAGE_BYTES = BM * BK * 2;
constexpr int B_STAGE_BYTES = BN * BK * 2;
// The staged tile: 128 rows of 512 bytes (256 16-bit or 128 f32 elements) plus 16 bytes of
// padding, which makes the consumers' fragment stores free of bank conflicts.
constexpr int EPI_PITCH = 528;
constexpr int EPI_BYTES = BM * EPI_PITCH;
constexpr int THREADS = 384;
constexpr int STORERS = 96;
// The kernel's static shared memory (its call state, 48 bytes), padded by ptxas so that the
// dynamic area after it starts on the 1024-byte boundary it declares; mirrored by
// STATIC_SMEM_BYTES in mod.rs
constexpr int STATIC_SMEM_BYTES = 1024;
// the most dynamic shared memory a block can have beside it
constexpr int DYNAMIC_SMEM_LIMIT = 227 * 1024 - STATIC_SMEM_BYTES;
constexpr int SMEM_BYTES = STAGES * (A_STAGE_BYTES + B_STAGE_BYTES) + EPI_BYTES + 8 * (2 * STAGES + 2);
static_assert(SMEM_BYTES <= DYNAMIC_SMEM_LIMIT, "the stages and the staged tile must fit in shared memory");
}  // namespace gemm

// One build of the kernel: the rows it computes of each of the plan's tiles (BM rows; 64 in
// the short build's plans), the
// tile's width BN and the pipeline's depth. The main build: 128 rows on two consumer
// warpgroups, 256 columns, 3 stages. The skinny build, for plans whose tiles all have at most
// 64 rows (decode sizes; the host picks it, see mod.rs): one consumer warpgroup, a 64-row A box
// and staged tile, and the shared memory that frees spent on a fourth stage, so that more of B
// is in flight where the loads' latency is what bounds the GEMM. Both take the same 128x256
// tiles, orders, routes, bands and split tail. The narrow build, for plans of 128x64 tiles
// whose bands have at most 64 rows: one consumer warpgroup on 64x64 tiles (wgmma m64n64k16,
// 32 accumulators per thread) and 8 stages of 16 KiB, so that a skinny M over N = 8192 makes
// 128 tiles instead of 32 and every SM streams its share of B, with 64 KiB of it in flight.
// The narrow-tall build: the same 128x64 tiles, all 128 rows on two consumer warpgroups, 8
// stages of 24 KiB (M up to 128 in one band of tiles).
// The pair build: the main build's tiles and pipeline, its blocks in clusters of two whose
// units share their B columns: each block loads its own A and half of the B k-block, which
// TMA multicast writes into both blocks' stages, so that every SM reads 32 KiB of each k-block
// from L2 instead of 48.
// The mid build, for plans of 128x128 tiles: the main build's two consumer warpgroups on
// tiles half as wide (wgmma m64n128k16, 64 accumulators per thread) and five stages of 32 KiB,
// so that products of a few hundred to a few thousand rows make twice as many tiles (a
// fuller last wave, or whole-K tiles where the 256-wide ones would need a split tail) with
// 160 KiB in flight per SM instead of 144 (six stages do not fit beside the staged tile).
// The direct build, for plain GEMMs: the main build's tiles, each consumer warpgroup storing
// its half of a tile itself, box by box through two 8 KiB shared-memory boxes that the TMA
// engine writes into D (a tensor store), and the rest of the staged tile's shared memory spent
// on a fourth stage (192 KiB in flight). Tiles a box would overrun (a band that ends before
// M), accumulating GEMMs and f32 outputs store from registers instead.
// The narrow-sliced build: the narrow build's 64x64 tiles with their K loop sliced over two
// consumer warpgroups (CUTLASS's "sliced-K"): each takes every other k-block of a unit into
// accumulators of its own, so that two chains of dependent wgmmas run on an SM instead of
// one; the second hands its sums to the first through shared memory, which adds them and runs
// the epilogue.
// The ping-pong build, for plain GEMMs: 128x128 tiles, each consumer warpgroup computing whole
// tiles of its own (two m64n128k16 wgmmas a k16 step, 128 accumulators a thread), the two
// taking the block's units in turn, so that one warpgroup's epilogue (the direct build's
// boxes) runs while the other's main loop keeps the tensor cores busy; six stages of 32 KiB.
// The mid-direct build: the ping-pong build's tiles, stages and boxes with the two consumer
// warpgroups on each tile together (64 rows each, as in the mid build) instead of in turns.
template <int ROWS_, int BN_, int STAGES_, int CLUSTER_ = 1, bool DIRECT_ = false, int SLICES_ = 1,
          bool PINGPONG_ = false, int PLAIN_ = 0, int TILE_ROWS_ = gemm::BM>
struct Cfg {
    static constexpr int ROWS = ROWS_;          // rows of a tile this build computes
    // rows of the plan's tiles where the call names no row bands: BM, of which the 64-row
    // builds compute the first 64 (plans whose bands have no more), or 64 (the short build,
    // whose plans are cut in 64-row tiles)
    static constexpr int TILE_ROWS = TILE_ROWS_;
    static constexpr int BN = BN_;              // columns of a tile
    static constexpr int CONSUMERS = ROWS / 64;  // consumer warpgroups with rows of their own to compute
    // consumer warpgroups sharing each tile's rows, each on every SLICES-th k-block of a unit
    static constexpr int SLICES = SLICES_;
    // each consumer warpgroup on whole tiles of its own, the two taking a block's units in turn
    static constexpr bool PINGPONG = PINGPONG_;
    static constexpr int WARPGROUPS = PINGPONG ? 2 : CONSUMERS * SLICES;  // consumer warpgroups that run
    // 64-row halves of a tile one warpgroup computes (one m64 wgmma each a k16 step)
    static constexpr int HALVES = PINGPONG ? ROWS / 64 : 1;
    // warpgroups that wait for each stage (the arrivals its empty barrier counts in one block):
    // every one that runs, but in the ping-pong build only the one whose unit it is
    static constexpr int STAGE_READERS = PINGPONG ? 1 : WARPGROUPS;
    static constexpr int STAGES = STAGES_;
    // Registers a consumer thread takes (setmaxnreg) once the producer's warpgroup gives back
    // 112 a thread: 224, or 240 in the skinny build, whose one consumer warpgroup holds a
    // 256-wide tile's 128 accumulators alone (its third warpgroup computes nothing). With 224
    // its pass over staged partials spilled the tile loop's counter and the band's first row.
    // The wide ping-pong build's consumers hold a 128 x 192 tile's 192 accumulators each: 232,
    // with the producer's warpgroup down to 40.
    static constexpr bool WIDE = PINGPONG_ && BN_ == 192;  // the wide ping-pong build
    static constexpr int CONSUMER_REGS = ROWS_ == 64 && BN_ == 256 ? 240 : WIDE ? 232 : 224;
    static constexpr int PRODUCER_REGS = WIDE ? 40 : 56;
    static constexpr int CLUSTER = CLUSTER_;     // blocks sharing each B k-block (TMA multicast)
    // The consumers store the tile themselves: no staged tile, and storers that only count the
    // block finished and, for tiles with routes, raise their flags once the consumers' stores
    // are performed (raise_routed_flags; the 128 x 128 ping-pong build: plain GEMMs only)
    static constexpr bool DIRECT = DIRECT_;
    // whose consumers store tiles along routes (tile_dst, raise_routed_flags): the general and
    // the routed entries of the direct and the mid-direct build, and the wide ping-pong
    // build's routed ones (its general entries, compiled with the route's stores and the
    // fold of both halves, spilled 22 KiB of code where they spilled 156 bytes)
    static constexpr bool ROUTES_BY_CONSUMERS =
        DIRECT_ && (PINGPONG_ ? WIDE && PLAIN_ == 3 : PLAIN_ == 0 || PLAIN_ == 3);
    // The build's plain entries (`<entry>_plain`, 16-bit outputs): alpha times A times B into D
    // by the boxes' tensor stores, every other option of the parameters compiled out instead
    // of tested at run time (routes, folds, flags, bands, gathers, the split tail, the bias, C,
    // accumulation; the trace stays). The host launches them for the calls that ask for none
    // of those (`entry_for` in mod.rs). What the options cost such a call is code: the
    // narrow-deep bf16 entry is 4 736 SASS instructions, its plain one 1 208 (cuBLASLt's pick
    // at decode sizes about 850), and the set-up runs cold in the instruction cache.
    // (PLAIN_: 0 the general entries, 1 the plain ones, 2 the plain ones with the split tail,
    // `<entry>_plain_tail`, which the direct build also has for the large products whose
    // last wave is cut along K, and the narrow builds for their few tiles cut along K;
    // 3 the routed ones, below)
    static constexpr bool PLAIN = PLAIN_ == 1 || PLAIN_ == 2;
    // The direct build's routed entries (`<entry>_routed`, 16-bit outputs): what GEMM +
    // reduce-scatter asks for (routes, flags, folds, row bands, the bias, the split tail), the
    // options of the other operators compiled out (the all-gather's band waits and local rows,
    // beta C, D +=). Through the general entry a routed call ran 3 % slower than the plain
    // entry at 8192 x 8192 x 3584, its k-block rebuilding shared addresses under register
    // pressure.
    static constexpr bool ROUTED = PLAIN_ == 3;
    // whether the entry serves the all-gather's waits for rows and its local rows of A, and C
    // and D += (only the general entries)
    static constexpr bool GATHERS = PLAIN_ == 0;
    static constexpr bool READS_C = PLAIN_ == 0;
    // whether the entry shares out a last, partial wave by K ranges (the split tail)
    static constexpr bool SPLIT_TAIL = PLAIN_ != 1;
    // The direct build's boxes: 64 rows of 128 bytes (one swizzle row), two per consumer
    // warpgroup, so that one is filled while the TMA engine reads the other
    static constexpr int BOX_BYTES = 64 * 128;
    static constexpr int ACC = BN / 2;  // f32 accumulators per consumer thread and half (64 rows x BN / 128)
    // Whether the plain epilogue (stmatrix writes) also serves tiles that add the bias: not in
    // the skinny and the pair build, where it spilled 16 and 8 bytes a thread (they add the bias
    // pair by pair)
    static constexpr bool PLAIN_BIAS = !(ROWS == 64 && BN == 256) && CLUSTER == 1;
    static constexpr int A_STAGE_BYTES = ROWS * gemm::BK * 2;
    static constexpr int B_STAGE_BYTES = BN * gemm::BK * 2;
    static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
    // A staged row: BN 16-bit (or BN / 2 f32) elements plus 16 bytes of padding, which makes the
    // consumers' fragment stores free of bank conflicts (8 rows 4 banks apart)
    static constexpr int EPI_PITCH = BN * 2 + 16;
    static constexpr int EPI_BYTES = DIRECT ? WARPGROUPS * 2 * BOX_BYTES : ROWS * EPI_PITCH;
    // the sliced build's hand-over: the second warpgroup's f32 sums (64 rows x BN)
    static constexpr int SUMS_BYTES = SLICES > 1 ? 64 * BN * 4 : 0;
    // the dynamic area: no alignment slack, the area's start is declared 1024-byte aligned
    // the wide ping-pong build's fold: a barrier for each of a warpgroup's two box buffers,
    // which its partials' boxes land in (fold_through_boxes)
    static constexpr int FOLD_BARRIERS = PINGPONG && WIDE ? 4 : 0;
    static constexpr int SMEM_BYTES =
        STAGES * STAGE_BYTES + EPI_BYTES + SUMS_BYTES + 8 * (2 * STAGES + 2 + FOLD_BARRIERS);
    static_assert((STAGES * STAGE_BYTES + EPI_BYTES) % 16 == 0, "the sums are read and written as float4");
    static_assert(ROWS == 64 || ROWS == gemm::BM, "a build computes one or two 64-row halves of a tile");
    static_assert(BN == 64 || BN == 128 || BN == 192 || BN == 256, "a tile is one wgmma's N wide");
    // (a block is three warpgroups; one that computes nothing keeps the launch's 168)
    static_assert(WARPGROUPS * 128 * CONSUMER_REGS + (2 - WARPGROUPS) * 128 * 168 + 128 * PRODUCER_REGS <= 65536,
                  "the register file holds every warpgroup's");
    static_assert(SMEM_BYTES <= gemm::DYNAMIC_SMEM_LIMIT, "the stages and the staged tile must fit in shared memory");
    // 128-byte swizzled stages start on 1024-byte boundaries
    static_assert(A_STAGE_BYTES % 1024 == 0 && B_STAGE_BYTES % 1024 == 0, "stage alignment");
    // each block of a pair loads one half of B's rows ([N, K]: 128 of 256) or two of its four
    // 64-column boxes ([K, N]); both halves start on 1024-byte boundaries
    static_assert(CLUSTER == 1 || (CLUSTER == 2 && BN == 256), "pairs share a 256-wide B tile");
    // (the hand-over's named barriers count two warpgroups; plain GEMMs of 64-row tiles only)
    static_assert(SLICES == 1 || (SLICES == 2 && ROWS == 64 && CLUSTER == 1 && !DIRECT), "two slices of 64 rows");
    // (no split tail either: its partials are laid out as two warpgroups' halves of a tile)
    static_assert(!PINGPONG || (DIRECT && ROWS == gemm::BM && SLICES == 1 && CLUSTER == 1),
                  "ping-pong warpgroups store their own 128-row tiles");
    static_assert(!PLAIN || (DIRECT && CLUSTER == 1), "plain entries store their tiles by the consumers' boxes");
    static_assert(!ROUTED || ROUTES_BY_CONSUMERS, "routed entries are the direct builds' whose consumers store routes");
    static_assert(TILE_ROWS == gemm::BM || TILE_ROWS == ROWS, "a build computes whole tiles or their first 64 rows");
};
// A build's plain entries (Cfg::PLAIN; TAIL: with the split tail).
template <class C, bool TAIL = false>
using PlainOf = Cfg<C::ROWS, C::BN, C::STAGES, C::CLUSTER, C::DIRECT, C::SLICES, C::PINGPONG, TAIL ? 2 : 1, C::TILE_ROWS>;
// A direct build's routed entries (Cfg::ROUTED).
template <class C>
using RoutedOf = Cfg<C::ROWS, C::BN, C::STAGES, C::CLUSTER, C::DIRECT, C::SLICES, C::PINGPONG, 3, C::TILE_ROWS>;
using MainCfg = Cfg<gemm::BM, gemm::BN, gemm::STAGES>;
using SkinnyCfg = Cfg<64, gemm::BN, 4>;
// The narrow builds store their tiles themselves, as the direct build does (a 64 x 64 tile of
// a 16-bit output is one TMA box): staged, their storers copied a tile row by row, 64 bulk
// copies that the TMA engine took about 2.6 us to finish at the end of a decode-size call
using NarrowCfg = Cfg<64, 64, 8, 1, true>;
using NarrowTallCfg = Cfg<gemm::BM, 64, 8, 1, true>;
// The narrow build on twelve stages: at decode sizes the narrow build reads the weights at
// about half of HBM's bandwidth, and more stages put more of them in flight
using NarrowDeepCfg = Cfg<64, 64, 12, 1, true>;
// The narrow-deep build's stages, the K loop sliced over two consumer warpgroups: if one
// warpgroup's chain of wgmmas, not the loads, sets the narrow build's pace, two double it
using NarrowSlicedCfg = Cfg<64, 64, 12, 1, false, 2>;
using PairCfg = Cfg<gemm::BM, gemm::BN, gemm::STAGES, 2>;
using MidCfg = Cfg<gemm::BM, 128, 5>;
using DirectCfg = Cfg<gemm::BM, gemm::BN, 4, 1, true>;
using PingPongCfg = Cfg<gemm::BM, 128, 6, 1, true, 1, true>;
using MidDirectCfg = Cfg<gemm::BM, 128, 6, 1, true>;
// The wide ping-pong build: the ping-pong build's turns on tiles of 128 x 192 (two m64n192k16
// wgmmas a k16 step, 192 accumulators a thread), four stages of 40 KiB beside the four boxes.
// One warpgroup's epilogue runs under the other's main loop, as in cuBLASLt's fastest kernel
// at 8192 x 8192 x 3584 (128 x 176 tiles a warpgroup, GEMM-NOTES.md), while each k16 step
// reads 192 columns of B for 128 rows where the 128-wide ping-pong tile reads 128.
using PingPongWideCfg = Cfg<gemm::BM, 192, 4, 1, true, 1, true>;
// The short build: tiles of 64 rows x 128 (wgmma m64n128k16 on one consumer warpgroup, 64
// accumulators a thread), eight stages of 24 KiB, stored by the consumers' boxes. Where a
// product of a few hundred rows makes fewer tiles than SMs, cutting it in 64-row bands fills
// them with tiles that each run their whole K loop (256 x 4096: 128 tiles), with a wider
// wgmma than the narrow-tall build's 128 x 64 tiles of the same count, whose two m64n64
// chains read A and B from shared memory for half the work a byte
using ShortCfg = Cfg<64, 128, 8, 1, true, 1, false, 0, 64>;
// A tile's partial folded in through the pipeline (ROUTE_FOLD_TMA): boxes of the build's rows
// by 128 bytes (one swizzle row: 64 16-bit or 32 f32 columns), as many to a stage as its B
// buffer holds, in the ring's next stages after the tile's last k-block: in the main and the
// direct build, two boxes a stage, two stages a 16-bit partial (four for f32); in the skinny
// build, four boxes a stage, one stage a 16-bit partial (two for f32). The other builds read
// partials from global memory: the pair build takes no routes, the mid and the narrow builds
// serve plain GEMMs only.
template <class C, typename Out> struct FoldBoxes {
    static constexpr int COLS = 128 / sizeof(Out);  // columns of a box
    static constexpr int BOXES = C::BN / COLS;       // boxes of one partial
    static constexpr int BOX_BYTES = C::ROWS * 128;
    static constexpr int PER_STAGE = C::B_STAGE_BYTES / BOX_BYTES;
    static constexpr int STAGES = PER_STAGE > 0 ? (BOXES + PER_STAGE - 1) / PER_STAGE : 0;  // stages of one partial
    // (the 256-wide builds that take routes: the main, the direct and the skinny one)
    static constexpr bool STAGED = C::BN == gemm::BN && C::CLUSTER == 1 && !C::PINGPONG && !C::PLAIN;
};
static_assert(FoldBoxes<MainCfg, __nv_bfloat16>::STAGES == 2 && FoldBoxes<MainCfg, float>::STAGES == 4 &&
                  FoldBoxes<MainCfg, float>::STAGED && FoldBoxes<SkinnyCfg, __nv_bfloat16>::STAGED &&
                  FoldBoxes<SkinnyCfg, __nv_bfloat16>::STAGES == 1 && FoldBoxes<SkinnyCfg, float>::STAGES == 2 &&
                  !FoldBoxes<PairCfg, float>::STAGED &&
                  !FoldBoxes<MidDirectCfg, float>::STAGED,
              "the main, the direct and the skinny build fold through their stages");
static_assert(MainCfg::SMEM_BYTES == gemm::SMEM_BYTES && MainCfg::EPI_PITCH == gemm::EPI_PITCH,
              "the main build is the kernel's design");
// mirrored by SKINNY_SMEM_BYTES and NARROW_SMEM_BYTES in mod.rs
static_assert(SkinnyCfg::SMEM_BYTES == 197712, "layout mirrored by SKINNY_SMEM_BYTES in mod.rs");
static_assert(NarrowCfg::SMEM_BYTES == 147600, "layout mirrored by NARROW_SMEM_BYTES in mod.rs");
static_assert(NarrowTallCfg::SMEM_BYTES == 229520, "layout mirrored by NARROW_TALL_SMEM_BYTES in mod.rs");
static_assert(NarrowDeepCfg::SMEM_BYTES == 213200, "layout mirrored by NARROW_DEEP_SMEM_BYTES in mod.rs");
static_assert(NarrowSlicedCfg::SMEM_BYTES == 222416, "layout mirrored by NARROW_SLICED_SMEM_BYTES in mod.rs");
static_assert(PairCfg::SMEM_BYTES == MainCfg::SMEM_BYTES, "the pair build's layout is the main build's");
static_assert(MidCfg::SMEM_BYTES == 198752, "layout mirrored by MID_SMEM_BYTES in mod.rs");
static_assert(DirectCfg::SMEM_BYTES == 229456, "layout mirrored by DIRECT_SMEM_BYTES in mod.rs");
static_assert(PingPongCfg::SMEM_BYTES == 229488, "layout mirrored by PING_PONG_SMEM_BYTES in mod.rs");
static_assert(MidDirectCfg::SMEM_BYTES == PingPongCfg::SMEM_BYTES, "the mid-direct build's layout is the ping-pong build's");
static_assert(ShortCfg::SMEM_BYTES == 213136, "layout mirrored by SHORT_SMEM_BYTES in mod.rs");
static_assert(PingPongWideCfg::SMEM_BYTES == 196720, "layout mirrored by PING_PONG_WIDE_SMEM_BYTES in mod.rs");

// A CUtensorMap, passed by value inside the __grid_constant__ parameters.
struct __align__(128) TmaDesc {
    u64 opaque[16];
};

// Where one tile goes; mirrored by `TileRoute` in src/gemm.rs.
struct TileRoute {
    u64 dst;         // address of the tile's element (0, 0), possibly on a peer GPU (or, with
                     // ROUTE_DST_FROM_D, an offset in bytes from this call's D)
    u64 flag;        // address of the tile's flag word, 0 for none
    u64 flag_value;  // Set: the value stored; Add: the amount added; Epoch: unused
    u32 ld;          // leading dimension of the destination, in elements
    u32 flag_op;     // NOTIFY_SET, NOTIFY_ADD or FLAG_SET_EPOCH
    // Partials folded into this tile's epilogue (the reduce-scatter's owner tiles): fold_count
    // tiles of the output type at fold_src, fold_stride bytes apart, ld fold_ld; each is read
    // once its flag (fold_flag, then every fold_flag_stride bytes) holds this call's epoch.
    u64 fold_src;
    u64 fold_stride;
    u64 fold_flag;
    u32 fold_count;
    u32 fold_ld;
    u32 fold_flag_stride;
    u32 options;     // ROUTE_* bits
    // With ROUTE_FOLD_TMA: the row of GemmParams.fold_map where partial 0 of this tile starts
    // (its columns are the tile's), and the rows from one partial to the next
    u32 fold_row;
    u32 fold_row_step;
    // With ROUTE_DST_BOXES (the builds whose consumers store by boxes): the tensor map the
    // tile's 16-bit rows go out through, in global memory (0: GemmParams.d_map, with
    // ROUTE_DST_FROM_D), and where the tile's element (0, 0) lies in it (column, row)
    u64 dst_map;
    u32 dst_col;
    u32 dst_row;
};
static_assert(sizeof(TileRoute) == 96 && COMMFUSE_OFFSETOF(TileRoute, fold_src) == 32 &&
                  COMMFUSE_OFFSETOF(TileRoute, options) == 68 && COMMFUSE_OFFSETOF(TileRoute, fold_row) == 72 &&
                  COMMFUSE_OFFSETOF(TileRoute, dst_map) == 80 && COMMFUSE_OFFSETOF(TileRoute, dst_row) == 92,
              "layout mirrored by TileRoute in src/gemm.rs");
// TileRoute.flag_op beyond the plan's Set/Add: store this call's epoch (GemmParams.epoch)
constexpr u32 FLAG_SET_EPOCH = 2;
// TileRoute.options
constexpr u32 ROUTE_DST_FROM_D = 1;  // dst is an offset from GemmParams.d
constexpr u32 ROUTE_NO_BIAS = 2;     // this tile does not add the bias (a peer's partial)
// The tile's partials come into the pipeline's stages by TMA (GemmParams.fold_map, fold_row):
// the producer loads them after the tile's last k-block, and the consumers add them from
// shared memory (see fold_load); without it the consumers read them from global memory.
constexpr u32 ROUTE_FOLD_TMA = 4;
// The tile's rows go out by the consumers' tensor stores through the map at dst_map (the
// direct builds; see tile_dst); without it, from registers at dst and ld.
constexpr u32 ROUTE_DST_BOXES = 8;

// GemmParams.call_options
constexpr u32 CALLS_READ_ONLY = 1;

// A rank's count of its graph-safe calls (GemmParams.calls), in device memory; mirrored by
// `CallCounter` in src/gemm.rs. Zero when the operator is built.
struct CallCounter {
    u64 last;      // the number of the last call that finished
    u32 finished;  // blocks of the running call that have finished (reset by the last one)
    u32 pad;
};

// Mirrored by `GemmParams` in src/gemm.rs.
struct GemmParams {
    TmaDesc a;                 // A [M, K], box 64 (K) x 128 (M)
    TmaDesc b;                 // B [N, K]: box 64 x 256; B [K, N]: box 64 (N) x 64 (K)
    const u32* order;          // tile order: tile_count entries (the pair build's, paired: unit_count)
    const TileRoute* routes;   // per tile; null: local D, row-major, ld = N
    u64 d;                     // local D
    const void* c;             // C [M, N] in the output type (read when beta != 0)
    const void* bias;          // bias [N] in the output type, or null
    volatile ErrorRecord* err; // host-mapped; written when a pipeline wait times out
    u64 timeout_ns;
    u32 m, n, k;
    u32 tiles_n, tile_count;
    float alpha, beta;
    u32 accumulate;
    u32 rank;
    // The tail (src/gemm/tail.rs): the order's first `full_units` tiles are whole work units;
    // units from there on are `tail[u - full_units]`, K ranges of the remaining tiles shared out
    // so that the last waves keep every block busy. A tile's owner (the range from its first
    // k-block) sums its helpers' f32 partials from `workspace` once `counters[split]` shows
    // them all, then runs the epilogue.
    u32 full_units;
    u32 unit_count;
    u32 call_options;  // CALLS_* bits
    float4* workspace;  // one partial tile per helper, 32 float4 per consumer thread
    u32* counters;      // one per tile with helpers; its owner resets it for the next call
    const struct TailUnit* tail;
    // Row bands: band i covers rows bands[i] .. bands[i + 1] (at most BM rows), so that tiles
    // can start where another rank's chunk starts (the fused reduce-scatter); null: bands of
    // the build's Cfg::TILE_ROWS rows from row 0.
    const u32* bands;
    // This call's number (from 1): the value FLAG_SET_EPOCH flags store and folds wait for.
    u64 epoch;
    // Calls that may be captured into a CUDA graph and replayed: when not null, this call's
    // number is one more than the counter's last (read on the device, so that every replay is
    // a new call), `epoch` is unused, the tiles route by `routes` in calls of set 0 (odd
    // numbers) and by `routes_alt` in calls of set 1, and the block that finishes last advances
    // the counter.
    // With CALLS_READ_ONLY, `calls` is an operator's count of calls that work after the GEMM
    // on its stream advances (the flag steps' count): the GEMM reads its number from it and
    // leaves it alone.
    CallCounter* calls;
    const TileRoute* routes_alt;
    // All-gather + GEMM (null: nothing to wait for): band i's rows of A are loaded only once
    // the flag whose address is band_flags[i] (0: none, rows already here) holds at least this
    // call's number: the rows a peer copies into this rank's gather buffer.
    const u64* band_flags;
    // Rows [local_row0, local_row0 + local_rows) of A are loaded from a_local instead (its row
    // 0 is row local_row0): the caller's own chunk, never copied into the gather buffer.
    u32 local_row0, local_rows;
    // How long a flag wait (a band's rows, a fold's partials) lasts before it gives up; 0: half
    // the pipeline's bound (the longest any may last: the other roles' waits must not trap).
    u64 flag_timeout_ns;
    // The direct build: nonzero when d_map describes D (dense [M, N], ld N, box 64 rows x 128
    // bytes, 128-byte swizzle) for its tensor stores
    u32 d_tma;
    // nonzero when fold_map describes the buffer of the partials that routes with
    // ROUTE_FOLD_TMA fold in: rows of fold_ld elements, box the build's rows x 128 bytes,
    // 128-byte swizzle
    u32 fold_tma;
    // nonzero (F): once the producer has issued the loads of k-block kb1 - F of a unit that
    // folds through the pipeline (F - 1 loads left; of its first k-block where the unit has at
    // most F), it asks L2 for the unit's partials (fold_prefetch below)
    u32 fold_prefetch;
    // nonzero: when this many k-blocks of a unit are left to load, the producer asks L2 for
    // as many of its next unit's first k-blocks (A's and B's boxes), whose loads would
    // otherwise start only once the consumers free stages (prefetch_next_unit below)
    u32 next_prefetch;
    // Bytes of A's box (its rows x 128): the build's rows, or fewer where M is fewer (rounded up
    // to 8). The stage's rows past it keep stale values, which reach only accumulator rows past
    // M, never stored.
    u32 a_box_bytes;
    // Above 1: the blocks load their units' k-blocks in this many phases, block b starting
    // (b mod k_phases) / k_phases of the way into its unit's K range and wrapping around, so
    // that blocks reading the same A rows (decode sizes: all of them) ask L2 for k_phases
    // different k-blocks at a time instead of one. The consumers sum the stages in the order
    // they land (an f32 sum in another order).
    u32 k_phases;
    // Non-null: TRACE_EVENTS pairs (global timer ns, the SM's clock) per block, where its roles
    // stamp the points of `TraceEvent` (bench gemm --trace); null in every other call
    u64* trace;
    // Nonzero: a block loads the k-blocks of the units at odd places of its sequence (its
    // second, fourth, ... wave) from the unit's last k-block to its first, so that each such
    // unit starts on the K slices that the wave before read last, which L2 still holds where a
    // wave's operands do not all fit in it; the consumers sum the stages in that order
    u32 k_serpentine;
    TmaDesc a_local;
    TmaDesc d_map;
    TmaDesc fold_map;
};
static_assert(COMMFUSE_OFFSETOF(GemmParams, band_flags) == 416 && COMMFUSE_OFFSETOF(GemmParams, local_rows) == 428 &&
                  COMMFUSE_OFFSETOF(GemmParams, flag_timeout_ns) == 432 &&
                  COMMFUSE_OFFSETOF(GemmParams, d_tma) == 440 && COMMFUSE_OFFSETOF(GemmParams, a_local) == 512 &&
                  COMMFUSE_OFFSETOF(GemmParams, d_map) == 640 && COMMFUSE_OFFSETOF(GemmParams, fold_tma) == 444 &&
                  COMMFUSE_OFFSETOF(GemmParams, fold_prefetch) == 448 &&
                  COMMFUSE_OFFSETOF(GemmParams, next_prefetch) == 452 &&
                  COMMFUSE_OFFSETOF(GemmParams, a_box_bytes) == 456 &&
                  COMMFUSE_OFFSETOF(GemmParams, k_phases) == 460 && COMMFUSE_OFFSETOF(GemmParams, trace) == 464 &&
                  COMMFUSE_OFFSETOF(GemmParams, k_serpentine) == 472 &&
                  COMMFUSE_OFFSETOF(GemmParams, fold_map) == 768 && sizeof(GemmParams) == 896,
              "layout mirrored by GemmParams in src/gemm.rs");
static_assert(COMMFUSE_OFFSETOF(GemmParams, order) == 256 && COMMFUSE_OFFSETOF(GemmParams, m) == 312 &&
                  COMMFUSE_OFFSETOF(GemmParams, rank) == 344 && COMMFUSE_OFFSETOF(GemmParams, workspace) == 360 &&
                  COMMFUSE_OFFSETOF(GemmParams, counters) == 368 && COMMFUSE_OFFSETOF(GemmParams, tail) == 376 &&
                  COMMFUSE_OFFSETOF(GemmParams, bands) == 384 &&
                  COMMFUSE_OFFSETOF(GemmParams, epoch) == 392 && COMMFUSE_OFFSETOF(GemmParams, calls) == 400 &&
                  COMMFUSE_OFFSETOF(GemmParams, routes_alt) == 408,
              "layout mirrored by GemmParams in src/gemm.rs");
// The accumulator registers of one m64nNk16 wgmma (N / 2 per thread), as asm operands %0...
#define WGMMA_ACC_OPERANDS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_ACC_CONSTRAINTS_32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_ACC_OPERANDS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WGMMA_ACC_CONSTRAINTS_64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_ACC_OPERANDS_96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
// (the constraints of accumulators 64 .. 95: the 32-list of the array from d + 64)
#define WGMMA_ACC_CONSTRAINTS_96(d) WGMMA_ACC_CONSTRAINTS_64(d), WGMMA_ACC_CONSTRAINTS_32(((d) + 64))
#define WGMMA_ACC_OPERANDS_128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define WGMMA_ACC_CONSTRAINTS_128(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// ---- shared memory, mbarriers, TMA -------------------------------------------------------

// This call's number and tile routes, decided once per block (thread 0, before the block's
// first barrier) from GemmParams.epoch/routes or from the call counter; and the block's stop
// word, raised by the first of its waits that gives up (see pipeline_stalled). It lives in
// shared memory: unlike the error record's word in host memory, reading it is cheap.
struct CallState {
    u64 epoch;
    const TileRoute* routes;
    u32 stopped;
};
__shared__ CallState call_state;

// The direct builds' routed tiles whose flag waits for their stores (see stores_performed):
// per consumer warpgroup, whether its last such tile's stores are not yet known to be
// performed, and how many of its tiles with flags are (a count only its leader writes and the
// first storer reads; it never wraps, so no wait mistakes one tile for another).
struct RoutedStores {
    u32 pending[2];
    u32 performed[2];
};
__shared__ RoutedStores routed_stores;

// Whether a wait of this block gave up: its roles then stop waiting, store nothing more and
// raise no flag (a shared-memory load, read only where a wait has already failed to complete
// at once, once per tile by the storers, and at their flags).
__device__ __forceinline__ bool block_stopped() { return *(volatile u32*)&call_state.stopped != 0; }
__device__ __forceinline__ void stop_block() { *(volatile u32*)&call_state.stopped = 1u; }

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// This block's rank in its cluster (0 outside clusters).
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// An arrival on the mbarrier at the same shared-memory offset in the cluster's block `cta`
// (this block's own included). With the default (CTA-scope) semantics, as CUTLASS's cluster
// barrier arrives: what it orders is the consumers' wgmma reads of the stage, complete at
// their wait, before the partner's TMA overwrites it. Asked for `.release.cluster`, ptxas puts
// a GPU-wide fence (MEMBAR.ALL.GPU) before every arrival: twice per k-block, which took the
// pair build from the main build's speed to 60 % of it (one H200, 8192 x 8192 x 3584:
// docs/results/gemm/pair-fenced-1xH200-d631ba0/).
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(bar),
        "r"(cta)
        : "memory");
}

// Every thread of every block of the cluster (the blocks' shared memory and mbarriers are
// each other's: none may go before the other has stopped writing into it).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// A block that gave up waits, bounded and silently, for a copy it issued before it stopped
// (the barrier's phase `parity`): the copy would otherwise land in shared memory that may
// belong to another block by then. (A stall was already reported by the wait that gave up.)
__device__ __forceinline__ void mbar_drain(u32 bar, u32 parity, u64 timeout_ns) {
    const u64 start = global_timer_ns();
    while (!mbar_try_wait(bar, parity) && global_timer_ns() - start <= timeout_ns) {
    }
}

// What a stalled pipeline wait was waiting for (ErrorRecord.slot).
enum PipelineWait {
    WAIT_STAGE_EMPTY = 0,
    WAIT_STAGE_FULL = 1,
    WAIT_EPI_EMPTY = 2,
    WAIT_EPI_FULL = 3,
    WAIT_PARTIALS = 4,
    WAIT_FOLD_FLAG = 5,
    WAIT_BAND_FLAG = 6,
    WAIT_TURN = 7,  // the ping-pong build: the other warpgroup's main loop
    WAIT_FOLD_BOX = 8,  // the wide ping-pong build: a box of a partial it folds (fold_through_boxes)
};

// A pipeline wait that never completes is a bug (a lost TMA, a miscounted barrier): record
// which block waited for what at which tile (the first record of the launch wins) and raise
// the block's stop word. The kernel then ends on its own instead of hanging the GPU, and
// without a trap, which would take the whole CUDA context (every library's in the process)
// with it: every role goes on through its loop with the same control flow (so that every
// named barrier and warpgroup instruction still meets all of its threads), but each wait that
// does not complete at once returns, the producer issues no more loads, and the storers store
// nothing and raise no flag, so no peer takes this call's tiles for finished ones. The host
// reports the record (PreparedGemm::stall_report).
// One copy per role (ROLE 0: producer and storers, 1: consumers): a callee shared by both is
// register-allocated above the consumers' live registers and would overrun the 56 registers
// the producer warpgroup keeps after setmaxnreg; inlining it spills in the consumers.
template <int ROLE>
__device__ __noinline__ void pipeline_stalled(const GemmParams& p, u32 tile, u32 what, u32 parity) {
    if (atomicCAS_system((u32*)&p.err->flag, 0u, 2u) == 0u) {
        p.err->rank = p.rank;
        p.err->lane = blockIdx.x;
        p.err->step = tile;
        p.err->slot = what;
        p.err->expected = parity;
        p.err->seen = threadIdx.x;
        __threadfence_system();
        p.err->abort = 1;
    }
    stop_block();
}

// Waits for the phase of `bar` of this parity; false when it gave up instead: after the
// pipeline's timeout (recorded), or at once once the block's stop word is up.
template <int ROLE>
__device__ __forceinline__ bool mbar_wait(u32 bar, u32 parity, const GemmParams& p, u32 tile, u32 what) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 start = global_timer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (block_stopped()) return false;
        if (global_timer_ns() - start > p.timeout_ns) {
            pipeline_stalled<ROLE>(p, tile, what, parity);
            return false;
        }
    }
    return true;
}
constexpr int ROLE_WG0 = 0, ROLE_CONSUMER = 1;

// One 2D TMA box into shared memory; completion is counted in bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// Asks L2 for the box of `map` at (c0, c1): no shared memory, no barrier, nothing to wait for.
__device__ __forceinline__ void tma_prefetch_2d(const TmaDesc* map, int c0, int c1) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"((u64)map), "r"(c0), "r"(c1)
                 : "memory");
}

// tma_load_2d into the same shared-memory offset of every block of the cluster in `mask`,
// completing on the mbarrier at `bar`'s offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TmaDesc* map, u32 bar, int c0, int c1, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
        "%3}], [%4], %5;" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}

// Bulk copy of `bytes` (a multiple of 16) from shared memory to global memory, local or on a
// peer GPU, by the TMA engine: the issuing thread moves on at once.
__device__ __forceinline__ void bulk_store(u64 dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk copies have read their shared-memory source (the buffer may be refilled);
// bulk_wait_read_all_but<N>: all but its N most recent groups have.
template <int N> __device__ __forceinline__ void bulk_wait_read_all_but() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_read() { bulk_wait_read_all_but<0>(); }
// A box of shared memory into the tensor `map` describes at (c0, c1) (element coordinates,
// innermost first), by the TMA engine; what lies past the tensor's edges is not written.
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, u32 src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"((u64)map), "r"(c0),
                 "r"(c1), "r"(src)
                 : "memory");
}
// This thread's bulk copies are complete: their writes are performed.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// ---- wgmma ---------------------------------------------------------------------------------

// Shared-memory matrix descriptor for a 128-byte-swizzled operand: start address, leading and
// stride byte offsets (all in 16-byte units), layout type 1 = SWIZZLE_128B.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across wgmma issue and wait.
template <int ACC> __device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
    for (int i = 0; i < ACC; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename In, int N> struct Wgmma;

// d (+)= A B for one k16 step of an m64nNk16 wgmma (R = N / 2 accumulators per thread, operands
// %0..%R-1; then A's and B's descriptors, scale_d and TRANS_B); scale_d = 0 overwrites d.
// TRANS_B = 1: B is N-major ([K, N]).
#define COMMFUSE_WGMMA(IN_T, PTX_T, N, R, DA, DB, SCALE, TRANS)                                                \
    template <> struct Wgmma<IN_T, N> {                                                                       \
        template <int TRANS_B> static __device__ __forceinline__ void mma(float* d, u64 da, u64 db, u32 scale_d) { \
            asm volatile("{\n"                                                                                \
                         ".reg .pred p;\n"                                                                    \
                         "setp.ne.b32 p, " SCALE ", 0;\n"                                                     \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " " WGMMA_ACC_OPERANDS_##R \
                         ", " DA ", " DB ", p, 1, 1, 0, " TRANS ";\n"                                         \
                         "}\n"                                                                                \
                         : WGMMA_ACC_CONSTRAINTS_##R(d)                                                       \
                         : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B));                                    \
        }                                                                                                     \
    };
COMMFUSE_WGMMA(__nv_bfloat16, "bf16", 256, 128, "%128", "%129", "%130", "%131")
COMMFUSE_WGMMA(__half, "f16", 256, 128, "%128", "%129", "%130", "%131")
COMMFUSE_WGMMA(__nv_bfloat16, "bf16", 192, 96, "%96", "%97", "%98", "%99")
COMMFUSE_WGMMA(__half, "f16", 192, 96, "%96", "%97", "%98", "%99")
COMMFUSE_WGMMA(__nv_bfloat16, "bf16", 128, 64, "%64", "%65", "%66", "%67")
COMMFUSE_WGMMA(__half, "f16", 128, 64, "%64", "%65", "%66", "%67")
COMMFUSE_WGMMA(__nv_bfloat16, "bf16", 64, 32, "%32", "%33", "%34", "%35")
COMMFUSE_WGMMA(__half, "f16", 64, 32, "%32", "%33", "%34", "%35")

// ---- epilogue element helpers ------------------------------------------------------------------

template <typename Out> __device__ __forceinline__ void store_pair(unsigned char* p, float a, float b);
template <> __device__ __forceinline__ void store_pair<float>(unsigned char* p, float a, float b) {
    *(float2*)p = make_float2(a, b);
}
template <> __device__ __forceinline__ void store_pair<__nv_bfloat16>(unsigned char* p, float a, float b) {
    *(__nv_bfloat162*)p = __floats2bfloat162_rn(a, b);
}
template <> __device__ __forceinline__ void store_pair<__half>(unsigned char* p, float a, float b) {
    *(__half2*)p = __floats2half2_rn(a, b);
}

// Two f32 as one pair of 16-bit values, the first in the low half (the first column in memory).
template <typename Out> __device__ __forceinline__ u32 pack_pair(float a, float b);
template <> __device__ __forceinline__ u32 pack_pair<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const u32*>(&v);
}
template <> __device__ __forceinline__ u32 pack_pair<__half>(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const u32*>(&v);
}

// Four 8 × 8 matrices of 16-bit values into shared memory by one instruction: lane l gives the
// address of row l % 8 of matrix l / 8 (16 contiguous bytes), and register i holds the lane's
// pair of matrix i, at its row l / 4, columns 2 (l % 4) and the next: the layout in which an
// m64 wgmma leaves each 8 × 8 block of a warp's accumulators.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

// The plain epilogue (no beta·C) of a warp's 16 rows × 16 columns, accumulator groups j and
// j + 1 with both their row halves, written by one stmatrix: lane l addresses row
// 8 ((l / 8) % 2) + l % 8 of the warp's rows in column group j + l / 16 (`addr`). Alpha is
// applied only where SCALE (a GEMM with alpha 1 pays no multiply), the bias only where BIAS:
// the thread's first column of group j is `col` of D, and a column past N (whose value no store
// keeps) reads the bias at N - 1 = `last` instead, so that no element's code branches on N's
// edge. (f32 outputs never come here: plain_epilogue is false for them.)
template <typename Out, bool SCALE, bool BIAS>
__device__ __forceinline__ void stmatrix_groups(u32 addr, const float* acc, int j, float alpha, const Out* bias,
                                                u32 col, u32 last) {
    if constexpr (sizeof(Out) == 2) {
        const float* a = acc + j * 4;
        float2 b0 = make_float2(0.0f, 0.0f), b1 = b0;  // the bias of groups j and j + 1
        if constexpr (BIAS) {
            auto at = [&](u32 c) { return Elem<Out>::to_f32(bias[min(c, last)]); };
            b0 = make_float2(at(col), at(col + 1));
            b1 = make_float2(at(col + 8), at(col + 9));
        }
        // a[i]: row half (i / 2) % 2, column i % 2 of the pair, group j + i / 4
        auto v = [&](int i) {
            const float2 b = i < 4 ? b0 : b1;
            return (SCALE ? alpha * a[i] : a[i]) + (BIAS ? (i % 2 ? b.y : b.x) : 0.0f);
        };
        stmatrix_x4(addr, pack_pair<Out>(v(0), v(1)), pack_pair<Out>(v(2), v(3)), pack_pair<Out>(v(4), v(5)),
                    pack_pair<Out>(v(6), v(7)));
    }
}

// The plain epilogue of a warp's rows in column groups j0 .. j0 + 2 PAIRS - 1, PAIRS stmatrix:
// pair q at the address `addr(q)` gives for the lane; `col` is the thread's first column of
// group j0 in D, where the bias (p.bias) is read if BIAS.
template <typename Out, int PAIRS, bool SCALE, bool BIAS, typename Addr>
__device__ __forceinline__ void stmatrix_pairs(const GemmParams& p, const float* acc, int j0, u32 col, Addr addr) {
#pragma unroll
    for (int q = 0; q < PAIRS; ++q)
        stmatrix_groups<Out, SCALE, BIAS>(addr(q), acc, j0 + 2 * q, p.alpha, (const Out*)p.bias, col + 16 * q,
                                          p.n - 1);
}

// The same with alpha's multiply and the bias (`bias`: the tile adds it, and then alpha is 1,
// see plain_epilogue) decided once, outside the unrolled writes.
template <typename Out, int PAIRS, typename Addr>
__device__ __forceinline__ void stmatrix_plain(const GemmParams& p, const float* acc, int j0, bool bias, u32 col,
                                               Addr addr) {
    if (bias)
        stmatrix_pairs<Out, PAIRS, false, true>(p, acc, j0, col, addr);
    else if (p.alpha != 1.0f)
        stmatrix_pairs<Out, PAIRS, true, false>(p, acc, j0, col, addr);
    else
        stmatrix_pairs<Out, PAIRS, false, false>(p, acc, j0, col, addr);
}

// What lane l addresses for stmatrix_groups: its row of the warp's 16 (8 ((l / 8) % 2) + l % 8)
// and its column group of the two (l / 16); and l itself, whose accumulators' columns are
// 2 (l % 4) and the next of each group. The thread's index is read again behind an empty asm:
// derived from values kept through the main loop, the main build's address spilled.
struct StmatrixLane {
    u32 row, group, lane;
};
__device__ __forceinline__ StmatrixLane stmatrix_lane() {
    u32 t = threadIdx.x;
    asm volatile("" : "+r"(t));
    return {((t % 128) / 32) * 16 + 8 * ((t / 8) % 2) + t % 8, (t % 32) / 16, t % 32};
}

// Whether a tile's epilogue is the plain one (no beta·C, `has_c`; and where the tile adds the
// bias, `tile_bias`, a build with C::PLAIN_BIAS and alpha 1: the bias with alpha scaled as well
// spilled in the main build), decided once for the tile's writes from the uniform parameters:
// then no element's code tests for C, the bias or N's edge, and the writes go by stmatrix.
// 16-bit outputs only (stmatrix moves 16-bit values).
template <class C, typename Out>
__device__ __forceinline__ bool plain_epilogue(const GemmParams& p, bool has_c, bool tile_bias) {
    return sizeof(Out) == 2 && !has_c && (!tile_bias || (C::PLAIN_BIAS && p.alpha == 1.0f));
}

// 16 bytes of staged results added to 16 bytes of the destination, in f32.
template <typename Out> __device__ __forceinline__ uint4 add_vec(uint4 staged, uint4 old) {
    Out* s = (Out*)&staged;
    const Out* o = (const Out*)&old;
#pragma unroll
    for (int e = 0; e < (int)(16 / sizeof(Out)); ++e) s[e] = Elem<Out>::from_f32(Elem<Out>::to_f32(s[e]) + Elem<Out>::to_f32(o[e]));
    return staged;
}

// One unit of the tail (mirrors `TailUnit` in src/gemm/tail.rs): k-blocks [kb0, kb1) of
// `tile`; kb0 == kb1: none (the block has no more of the tail). A helper (kb0 > 0) leaves its
// partial in workspace slot `slot` and counts itself in at counters[split]; the owner (kb0 ==
// 0) waits for `helpers` of them and adds slots slot .. slot + helpers - 1 in that order.
struct TailUnit {
    u32 tile, kb0, kb1;
    u32 split;    // the tile's counter, or NO_SPLIT (no helpers)
    u32 slot;     // a helper's slot; an owner's first helper's
    u32 helpers;  // an owner's helpers; 0 for a helper
};
static_assert(sizeof(TailUnit) == 24, "layout mirrored by TailUnit in src/gemm/tail.rs");
constexpr u32 NO_SPLIT = 0xffffffffu;

// One work unit: a whole tile, or one K range of a tile of the tail.
struct Unit {
    u32 tile, tm, tn;
    u32 row0, rows;  // the tile's band: first row and row count
    u32 kb0, kb1;  // k-blocks [kb0, kb1)
    bool helper;   // a K range after a tile's first: leaves a partial, runs no epilogue
    bool empty;    // no work: the block has run out of the tail
    bool idle;     // the empty half of a pair (PAIR_IDLE): loads its share of B, computes nothing
};
// An order entry with this bit is the pair build's block without a tile of its own beside its
// partner's (an odd count of tiles in a column): the low bits name the partner's tile, whose B
// columns it loads its half of; it loads no A, computes and stores nothing.
constexpr u32 PAIR_IDLE = 0x80000000u;

// Unit u of the call; PAIR_IDLE entries exist only in the pair build's orders (elsewhere the
// bit is not looked at, so that the other builds' code is what it was).
template <class C> __device__ __forceinline__ Unit unit_at(const GemmParams& p, u32 u) {
    Unit w;
    u32 entry;
    if (!C::SPLIT_TAIL || u < p.full_units) {
        entry = p.order[u];
        w.kb0 = 0;
        w.kb1 = (p.k + gemm::BK - 1) / gemm::BK;
    } else {
        const TailUnit t = p.tail[u - p.full_units];
        entry = t.tile;
        w.kb0 = t.kb0;
        w.kb1 = t.kb1;
    }
    w.helper = w.kb0 != 0;
    w.empty = w.kb0 == w.kb1;
    w.idle = C::CLUSTER > 1 && (entry & PAIR_IDLE) != 0;
    w.tile = C::CLUSTER > 1 ? entry & ~PAIR_IDLE : entry;
    w.tm = w.tile / p.tiles_n;
    w.tn = w.tile % p.tiles_n;
    if (!C::PLAIN && p.bands != nullptr) {
        w.row0 = p.bands[w.tm];
        w.rows = p.bands[w.tm + 1] - w.row0;
    } else {
        w.row0 = w.tm * C::TILE_ROWS;
        w.rows = min(C::TILE_ROWS, (int)(p.m - w.row0));
    }
    return w;
}

// Waits (acquire, system scope) until `flag` holds at least this call's epoch; true once it
// does. A peer that never arrives is reported like a stalled pipeline wait (ErrorRecord.slot =
// `what`, step = tile, expected = epoch, seen = the flag's value) after flag_timeout_ns, at
// most half the pipeline's bound (the other roles' waits for this block should not run out
// while it waits here: the record then names the wait that caused it), and the block stops
// (see pipeline_stalled); it also gives up once the block's stop word or the launch's abort is up
// (recording this wait only where nothing was recorded before). The host's check says why.
__device__ __forceinline__ bool flag_wait(const GemmParams& p, const u64* flag, u32 tile, u32 what) {
    u64 seen = load_acquire_sys(flag);
    if (seen >= call_state.epoch) return true;
    const u64 start = global_timer_ns();
    const u64 limit = p.flag_timeout_ns != 0 ? p.flag_timeout_ns : p.timeout_ns / 2;
    for (u32 spins = 1;; ++spins) {
        seen = load_relaxed_sys(flag);
        if (seen >= call_state.epoch) {
            fence_acquire_sys();
            return true;
        }
        if ((spins & 255) == 0 &&
            (block_stopped() || waiter_check(p.err, global_timer_ns() - start, spins, limit) != GO_ON)) {
            stop_block();
            if (atomicCAS_system((u32*)&p.err->flag, 0u, 3u) == 0u) {
                p.err->rank = p.rank;
                p.err->lane = blockIdx.x;
                p.err->step = tile;
                p.err->slot = what;
                p.err->expected = call_state.epoch;
                p.err->seen = seen;
                __threadfence_system();
                p.err->abort = 1;
            }
            return false;
        }
    }
}

// All-gather + GEMM: waits until band `band`'s rows of A have landed (its flag, if it has
// one), then orders the TMA loads that follow (async proxy) after the rows the flag published
// (generic proxy: a peer's copy and release). False when the wait gave up.
__device__ __forceinline__ bool band_wait(const GemmParams& p, u32 band, u32 tile) {
    const u64* flag = (const u64*)p.band_flags[band];
    if (flag == nullptr) return true;
    const bool landed = flag_wait(p, flag, tile, WAIT_BAND_FLAG);
    asm volatile("fence.proxy.async.global;" ::: "memory");
    return landed;
}

// ---- where a call's time goes (bench gemm --trace) ---------------------------------------------

// The points a block's roles stamp when the call has a trace buffer: one thread of each role,
// the last unit's where a block runs several (the first stage's landing: the first unit's).
// Mirrored by `trace::EVENTS` in trace.rs.
enum TraceEvent : u32 {
    TRACE_ENTRY = 0,         // thread 0's first instruction
    TRACE_PRODUCER = 1,      // the producer, past the block's barrier and setmaxnreg
    TRACE_FIRST_LOAD = 2,    // the producer's unit: its entry read, about to issue its first load
    TRACE_FIRST_FULL = 3,    // the block's first unit's first stage has landed (trace_first_stage)
    TRACE_MAIN_DONE = 4,     // the first consumer warpgroup: its unit's last wgmma has completed
    TRACE_CONSUMER_END = 5,  // ... its last epilogue is done (the direct build: the stores performed)
    TRACE_PRODUCER_END = 6,  // the producer has seen its last loads land
    TRACE_STORER_END = 7,    // the storers' first thread: their last writes performed
    TRACE_EVENTS = 8
};

__device__ __forceinline__ void trace(const GemmParams& p, u32 event) {
    if (p.trace == nullptr) return;
    u64 clock;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(clock));
    u64* at = p.trace + 2 * (blockIdx.x * TRACE_EVENTS + event);
    at[0] = global_timer_ns();
    at[1] = clock;
}

// ---- the three roles ---------------------------------------------------------------------------

struct Smem {
    u32 a, b;                     // stage 0 of A and of B (shared-window addresses)
    unsigned char* epi;           // the staged tile
    float4* sums;                 // the sliced build's hand-over of the second warpgroup's sums
    u32 full, empty;              // mbarrier arrays, 8 bytes apart
    u32 epi_full, epi_empty;
    u32 fold_bars;                // the wide build's box buffers' barriers (Cfg::FOLD_BARRIERS)
};

// The producer's side of a fold through the pipeline (ROUTE_FOLD_TMA): for each of the tile's
// partials, waits for its flag, then loads it into the ring's next stages as boxes of the
// fold map, after the tile's last k-block, so that it lands while the consumers finish the
// tile's main loop. False when a wait gave up (the block stops; see flag_wait).
template <class C, typename Out>
__device__ __forceinline__ bool fold_load(const GemmParams& p, const Smem& s, const TileRoute& r, const Unit& c,
                                          u32& stage, u32& phase, u32& issued) {
    using F = FoldBoxes<C, Out>;
    for (u32 f = 0; f < r.fold_count; ++f) {
        const u64* flag = (const u64*)(r.fold_flag + (u64)f * r.fold_flag_stride);
        if (!flag_wait(p, flag, c.tile, WAIT_FOLD_FLAG)) return false;
        // the flag's acquire (generic proxy) before the loads of what it published (async proxy)
        asm volatile("fence.proxy.async.global;" ::: "memory");
        const int row = (int)(r.fold_row + f * r.fold_row_step);
#pragma unroll
        for (int st = 0; st < F::STAGES; ++st) {
            const u32 full = s.full + 8 * stage, empty = s.empty + 8 * stage;
            if (!mbar_wait<ROLE_WG0>(empty, phase ^ 1, p, c.tile, WAIT_STAGE_EMPTY)) return false;
            // (a partial's last stage may hold fewer boxes than fit)
            const int boxes = min(F::PER_STAGE, F::BOXES - st * F::PER_STAGE);
            mbar_expect_tx(full, boxes * F::BOX_BYTES);
#pragma unroll
            for (int b = 0; b < F::PER_STAGE; ++b) {
                if (b < boxes)
                    tma_load_2d(s.b + stage * C::B_STAGE_BYTES + b * F::BOX_BYTES, &p.fold_map, full,
                                c.tn * C::BN + (st * F::PER_STAGE + b) * F::COLS, row);
            }
            if (issued < C::STAGES) ++issued;
            if (++stage == C::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
    return true;
}

// The fold's partials asked of L2 ahead of fold_load (GemmParams.fold_prefetch): every SM of a
// wave ends its tile at about the same time, and without this all of them read their partials
// from HBM at once; asked for some k-blocks before the loop's end, those reads spread over
// them.
// Before the flag is up this may fetch a partial early: a peer's later writes land in this
// GPU's L2 (the point of coherence for its memory), so the line is updated, not stale, and
// fold_load still loads only after the flag.
template <class C, typename Out>
__device__ __forceinline__ void fold_prefetch(const GemmParams& p, const TileRoute& r, u32 tn) {
    using F = FoldBoxes<C, Out>;
    for (u32 f = 0; f < r.fold_count; ++f) {
        const int row = (int)(r.fold_row + f * r.fold_row_step);
#pragma unroll
        for (int b = 0; b < F::BOXES; ++b) tma_prefetch_2d(&p.fold_map, tn * C::BN + b * F::COLS, row);
    }
}

// Whether tile `tile` folds its partials in through the pipeline (in the unit that runs its
// epilogue: a whole tile or the owner of a tail tile): decided alike by the producer, which
// loads them, and the consumers, which take them from the stages.
template <class C, typename Out> __device__ __forceinline__ const TileRoute* staged_fold(const GemmParams& p, u32 tile) {
    if (C::PLAIN || !FoldBoxes<C, Out>::STAGED || p.fold_tma == 0 || call_state.routes == nullptr) return nullptr;
    const TileRoute* r = call_state.routes + tile;
    return r->fold_count != 0 && (r->options & ROUTE_FOLD_TMA) != 0 ? r : nullptr;
}

// Where a unit's rows of A are loaded from: the caller's own rows (all-gather + GEMM) from its
// A (a_local, whose row 0 is row local_row0), the rest from p.a.
struct ASource {
    const TmaDesc* map;
    u32 row;
};
template <class C> __device__ __forceinline__ ASource a_source(const GemmParams& p, u32 row0) {
    if (C::GATHERS && row0 - p.local_row0 < p.local_rows) return {&p.a_local, row0 - p.local_row0};
    return {&p.a, row0};
}

// The first k-blocks (GemmParams.next_prefetch of them) of this block's unit `u` asked of L2,
// A's box and B's, by the producer while it still loads the unit before. Not in a pair (its
// B boxes are halves) nor in an all-gather's GEMM (a band's rows may not have landed yet).
template <class C, bool B_KN> __device__ __forceinline__ void prefetch_next_unit(const GemmParams& p, u32 u) {
    if (C::CLUSTER > 1 || (C::GATHERS && p.band_flags != nullptr) || u >= p.unit_count) return;
    const Unit n = unit_at<C>(p, u);
    if (n.empty) return;
    const ASource a = a_source<C>(p, n.row0);
    const u32 end = min(n.kb1, n.kb0 + p.next_prefetch);
    for (u32 kb = n.kb0; kb < end; ++kb) {
        tma_prefetch_2d(a.map, kb * gemm::BK, a.row);
        if (B_KN) {
#pragma unroll
            for (int j = 0; j < C::BN / 64; ++j) tma_prefetch_2d(&p.b, n.tn * C::BN + 64 * j, kb * gemm::BK);
        } else {
            tma_prefetch_2d(&p.b, kb * gemm::BK, n.tn * C::BN);
        }
    }
}

template <class C, typename Out, bool B_KN>
__device__ void producer(const GemmParams& p, const Smem& s) {
    u32 stage = 0, phase = 0;
    u32 landed = 0xffffffffu;  // the last band whose rows this block saw land
    u32 issued = 0;            // stages loaded at least once (at most STAGES)
    bool live = true;          // false once a wait gave up: no more loads
    const u32 half = C::CLUSTER == 2 ? cluster_rank() : 0;  // this block's half of B
    trace(p, TRACE_PRODUCER);
    for (u32 i = blockIdx.x; live && i < p.unit_count; i += gridDim.x) {
        const Unit c = unit_at<C>(p, i);
        if (c.empty) continue;
        if (C::GATHERS && p.band_flags != nullptr && !c.idle && c.tm != landed) {
            if (!band_wait(p, c.tm, c.tile)) break;
            landed = c.tm;
        }
        const ASource a = a_source<C>(p, c.row0);
        // a direct build's routed tile: its tensor map (global memory) asked for ahead of the
        // consumers' stores
        if (C::ROUTES_BY_CONSUMERS && call_state.routes != nullptr && !c.helper && !c.idle) {
            const u64 map = call_state.routes[c.tile].dst_map;
            if (map != 0) asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
        }
        // the k-block after which this unit's partials are asked of L2 (none: past the loop)
        u32 prefetch_at = 0xffffffffu;
        if (!C::PLAIN && p.fold_prefetch != 0 && !c.helper && !c.idle && staged_fold<C, Out>(p, c.tile) != nullptr)
            prefetch_at = c.kb1 - min(p.fold_prefetch, c.kb1 - c.kb0);
        // the k-block at which the next unit's first k-blocks are asked of L2 (none: past the loop)
        const u32 next_at = p.next_prefetch == 0 ? 0xffffffffu : c.kb1 - min(p.next_prefetch, c.kb1 - c.kb0);
        // this block's phase of the K range (k_phases): the k-block it loads first, past kb0
        const u32 span = c.kb1 - c.kb0;
        // (per cluster: the two blocks of a pair load the same k-blocks, whose B they share)
        const u32 skew = p.k_phases > 1 ? (blockIdx.x / C::CLUSTER % p.k_phases) * span / p.k_phases : 0;
        // (the two blocks of a pair are at the same place of their sequences)
        const bool reverse = p.k_serpentine != 0 && (i / gridDim.x) % 2 == 1;
        trace(p, TRACE_FIRST_LOAD);
        for (u32 kb = c.kb0; kb < c.kb1; ++kb) {
            // the k-block this stage gets (kb itself unless the phases or the serpentine are on)
            u32 at = reverse ? c.kb1 - 1 - kb : kb - c.kb0;
            if (skew != 0) at = (at + skew) % span;
            const u32 kl = c.kb0 + at;
            const u32 full = s.full + 8 * stage, empty = s.empty + 8 * stage;
            if (!mbar_wait<ROLE_WG0>(empty, phase ^ 1, p, c.tile, WAIT_STAGE_EMPTY)) {
                live = false;
                break;
            }
            // out-of-bounds parts of a box are zero-filled and still counted in bytes; in a
            // pair, the partner's half of B lands here too and counts on this barrier
            mbar_expect_tx(full, c.idle ? C::B_STAGE_BYTES : p.a_box_bytes + C::B_STAGE_BYTES);
            const u32 a_dst = s.a + stage * C::A_STAGE_BYTES, b_dst = s.b + stage * C::B_STAGE_BYTES;
            if (!c.idle) tma_load_2d(a_dst, a.map, full, kl * gemm::BK, a.row);
            if (C::CLUSTER == 2) {
                // this block's half of the k-block's B, into both blocks' stages (their stage is
                // free: the empty barrier counts both blocks' consumers)
                if (B_KN) {
#pragma unroll
                    for (int j = 2 * half; j < 2 * half + 2; ++j)
                        tma_load_2d_multicast(b_dst + j * 8192, &p.b, full, c.tn * C::BN + 64 * j, kl * gemm::BK, 0x3);
                } else {
                    tma_load_2d_multicast(b_dst + half * (C::B_STAGE_BYTES / 2), &p.b, full, kl * gemm::BK,
                                          c.tn * C::BN + half * (C::BN / 2), 0x3);
                }
            } else if (B_KN) {
                // BN / 64 boxes of 64 (N) x 64 (K) side by side along N, 8 KiB each
#pragma unroll
                for (int j = 0; j < C::BN / 64; ++j)
                    tma_load_2d(b_dst + j * 8192, &p.b, full, c.tn * C::BN + 64 * j, kl * gemm::BK);
            } else {
                tma_load_2d(b_dst, &p.b, full, kl * gemm::BK, c.tn * C::BN);
            }
            if (issued < C::STAGES) ++issued;
            if (++stage == C::STAGES) {
                stage = 0;
                phase ^= 1;
            }
            if (kb == prefetch_at) fold_prefetch<C, Out>(p, *staged_fold<C, Out>(p, c.tile), c.tn);
            if (kb == next_at) prefetch_next_unit<C, B_KN>(p, i + gridDim.x);
        }
        if (!live) break;
        if (!c.helper && !c.idle) {
            if (const TileRoute* r = staged_fold<C, Out>(p, c.tile)) {
                if (!fold_load<C, Out>(p, s, *r, c, stage, phase, issued)) live = false;
            }
        }
    }
    // The consumers of a block that gave up no longer wait for every stage: wait here (bounded)
    // for the last load into each stage, which would otherwise land in shared memory that may
    // belong to another block by then. In a call that went well they have landed or are about
    // to: the consumers wait for them too.
    for (u32 j = 0; j < issued; ++j) {
        if (stage == 0) {
            stage = C::STAGES - 1;
            phase ^= 1;
        } else {
            --stage;
        }
        mbar_drain(s.full + 8 * stage, phase, p.timeout_ns);
    }
    trace(p, TRACE_PRODUCER_END);
}

// A consumer warpgroup is done with a stage: in a pair, with both blocks' copies of it (the
// partner's producer multicasts into this block's stage only once this block's consumers have
// let it go, and the other way round).
template <class C> __device__ __forceinline__ void release_stage(u32 empty) {
    if (C::CLUSTER == 1) {
        mbar_arrive(empty);
    } else {
#pragma unroll
        for (u32 cta = 0; cta < C::CLUSTER; ++cta) mbar_arrive_cluster(empty, cta);
    }
}

// A consumer warpgroup's turn on one stage without using it: wait for it to fill and let it go.
template <class C>
__device__ __forceinline__ void pass_stage(const GemmParams& p, const Smem& s, u32 tile, u32& stage, u32& phase,
                                           bool leader) {
    mbar_wait<ROLE_CONSUMER>(s.full + 8 * stage, phase, p, tile, WAIT_STAGE_FULL);
    if (leader) release_stage<C>(s.empty + 8 * stage);
    if (++stage == C::STAGES) {
        stage = 0;
        phase ^= 1;
    }
}

// The same on every stage of the unit.
template <class C>
__device__ __forceinline__ void pass_stages(const GemmParams& p, const Smem& s, const Unit& c, u32& stage, u32& phase,
                                            bool leader) {
    for (u32 kb = c.kb0; kb < c.kb1; ++kb) pass_stage<C>(p, s, c.tile, stage, phase, leader);
}

// Every consumer warpgroup of the build with rows of its own (named barrier 2): in the
// sliced build the first only, which alone finishes a tile.
template <class C> __device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 2, %0;" ::"n"(C::CONSUMERS * 128) : "memory");
}

// A tile of the tail with helpers meets them here (src/gemm/tail.rs). A helper leaves its f32
// partial tile in its workspace slot and counts itself in; the owner waits for all of them
// (acquire), adds their partials to its accumulators in slot order (results do not depend on
// timing) and returns true to run the epilogue. Returns false for helpers; true for a tile
// without helpers.
template <class C>
__device__ bool split_partials(const GemmParams& p, const TailUnit& t, u32 rows, float* acc) {
    // a helper is what every role takes for one (kb0 > 0: the host gives each a counter);
    // an owner without helpers has nothing to wait for
    if (t.kb0 == 0 && t.split == NO_SPLIT) return true;
    // 0..255 over both consumer warpgroups (0..127 in the skinny, the narrow and the short
    // builds, the sliced one's first warpgroup included, whose partials use the first half of
    // each workspace slot: the slots keep the main build's layout, which the host sizes them
    // for: workspace_slot_bytes in mod.rs)
    const u32 tid = threadIdx.x - 128;
    u32* counter = p.counters + t.split;
    // this thread's accumulators hold rows (tid / 32) * 16 + lane / 4 and 8 below; rows past
    // the tile's last are never stored, so their partials are neither written nor read (a
    // skinny M's split tiles move a fraction of a whole tile's)
    const bool rows_in = (tid / 32) * 16 + (tid % 32) / 4 < rows;
    if (t.kb0 != 0) {
        float4* slot = p.workspace + (size_t)t.slot * (C::ACC / 4) * 256;
        if (rows_in) {
#pragma unroll
            for (int j = 0; j < C::ACC / 4; ++j)
                slot[j * 256 + tid] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
        }
        consumers_sync<C>();
        if (tid == 0) {
            __threadfence();
            atomicAdd(counter, 1u);
        }
        return false;
    }
    if (tid == 0) {
        const u64 start = global_timer_ns();
        while (atomicAdd(counter, 0u) < t.helpers) {
            if (block_stopped()) break;
            if (global_timer_ns() - start > p.timeout_ns) {
                pipeline_stalled<ROLE_CONSUMER>(p, t.tile, WAIT_PARTIALS, t.helpers);
                break;
            }
        }
        __threadfence();
        *counter = 0;  // ready for the next call (kernel boundaries order it)
    }
    consumers_sync<C>();
    for (u32 h = 0; h < t.helpers && rows_in; ++h) {
        const float4* slot = p.workspace + (size_t)(t.slot + h) * (C::ACC / 4) * 256;
#pragma unroll
        for (int j = 0; j < C::ACC / 4; ++j) {
            const float4 v = __ldcg(&slot[j * 256 + tid]);
            acc[4 * j] += v.x;
            acc[4 * j + 1] += v.y;
            acc[4 * j + 2] += v.z;
            acc[4 * j + 3] += v.w;
        }
    }
    return true;
}

// One consumer warpgroup's 128 threads (named barriers 3 and 4; 1 is the storers', 2 both
// consumer warpgroups', 5 and 6 the sliced build's hand-over). The barrier's id is an
// immediate in each copy, so warpgroup `cw` picks its copy by a branch.
template <int ID> __device__ __forceinline__ void group_sync_at() {
    asm volatile("bar.sync %0, 128;" ::"n"(ID) : "memory");
}
__device__ __forceinline__ void consumer_group_sync(u32 cw) {
    if (cw == 0) group_sync_at<3>();
    else group_sync_at<4>();
}

// Whether any of the warpgroup's 128 threads at named barrier ID passes `mine`.
template <int ID> __device__ __forceinline__ bool group_any_at(u32 mine) {
    u32 any;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\nselp.u32 %0, 1, 0, q;\n}"
                 : "=r"(any)
                 : "r"(mine), "n"(ID)
                 : "memory");
    return any != 0;
}

// Whether the block has stopped, as every thread of consumer warpgroup `cw` then sees it (at
// the warpgroup's barrier): each thread's own read of the stop word could differ from its
// neighbours' (the word may go up between them), and a warp that went on alone would leave
// the warpgroup's barriers in the epilogue short.
__device__ __forceinline__ bool group_stopped(u32 cw) {
    const u32 mine = block_stopped() ? 1u : 0u;
    return cw == 0 ? group_any_at<3>(mine) : group_any_at<4>(mine);
}

// Waits until every flag of a fold holds this call's epoch (a partial that never comes: see
// flag_wait; the fold then goes on).
__device__ __forceinline__ void fold_wait(const GemmParams& p, const TileRoute& r, u32 tile, u32 cw) {
    for (u32 f = 0; f < r.fold_count; ++f) {
        const u64* flag = (const u64*)(r.fold_flag + (u64)f * r.fold_flag_stride);
        if (!flag_wait(p, flag, tile, WAIT_FOLD_FLAG)) return;
    }
}

// Two adjacent elements of a partial in one load through L2 only (4 bytes of a 16-bit type, 8
// of f32): the fold's loads, each of which fetches its rows' sectors from L2 again, move half
// the sectors of two 2-byte loads. `p` is aligned to the pair.
template <typename Out> __device__ __forceinline__ float2 ldcg_pair(const Out* p);
template <> __device__ __forceinline__ float2 ldcg_pair<float>(const float* p) {
    return __ldcg(reinterpret_cast<const float2*>(p));
}
template <> __device__ __forceinline__ float2 ldcg_pair<__nv_bfloat16>(const __nv_bfloat16* p) {
    // a bf16 is the upper half of the f32 of the same value; the lower address is the low half
    const unsigned int w = __ldcg(reinterpret_cast<const unsigned int*>(p));
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 ldcg_pair<__half>(const __half* p) {
    const unsigned int w = __ldcg(reinterpret_cast<const unsigned int*>(p));
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// Two adjacent elements of a partial from shared memory (u32 address), widened to f32.
template <typename Out> __device__ __forceinline__ float2 lds_pair(u32 at);
template <> __device__ __forceinline__ float2 lds_pair<float>(u32 at) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(at));
    return v;
}
template <> __device__ __forceinline__ float2 lds_pair<__nv_bfloat16>(u32 at) {
    u32 w;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w) : "r"(at));
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 lds_pair<__half>(u32 at) {
    u32 w;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w) : "r"(at));
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// A thread's pairs of a partial's box in shared memory (64 rows of 128 bytes, a row's 16-byte
// chunk c at c ^ (row % 8)) added to its accumulators of the box's 8-column groups (`acc`: the
// first group's four): `rows` is the box's row of the thread's first accumulator (its second
// is 8 rows on; both have row % 8 = lane / 4, so a warp's loads hit distinct banks).
template <typename Out> __device__ __forceinline__ void add_box_pairs(u32 rows, u32 lane, float* acc) {
    const u32 lane_byte = 2 * (lane % 4) * sizeof(Out);
#pragma unroll
    for (int g = 0; g < 128 / sizeof(Out) / 8; ++g) {
        const u32 byte = g * 8 * sizeof(Out) + lane_byte;
        const u32 at = rows + (((byte / 16) ^ (lane / 4)) * 16) + byte % 16;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 v = lds_pair<Out>(at + h * 8 * 128);
            acc[g * 4 + 2 * h] += v.x;
            acc[g * 4 + 2 * h + 1] += v.y;
        }
    }
}

// The wide ping-pong build's fold (its routed entries; the host marks every folding route
// ROUTE_FOLD_TMA): each partial of the tile in six boxes of 64 rows x 64 columns (two halves of
// three), each loaded by a TMA box of the fold map into one of the warpgroup's two box buffers,
// completing on that buffer's barrier (Smem::fold_bars), while the warpgroup adds the box before
// from the other; the boxes of all partials are one sequence, two in flight across a partial's
// end too. The copies come from one thread. Copied by cp.async (64 bytes a thread, each
// chunk's address and bounds beside the 192 accumulators), the fold made the routed entry spill
// in its k-loop too (nine local loads and stores a k-block); read with a load of four bytes
// each, a partial took 20-24 us, longer than the other warpgroup's main loop. The map's boxes
// are swizzled (a row's 16-byte chunk c at c ^ (row % 8)), so that a warp's eight rows read
// distinct banks; columns past N land as zeros, rows past the band's end as whatever the map
// holds there, added only to accumulator rows that are never stored. `tn`: the tile's column
// in tiles (not elements); `uses`: each buffer's barrier phases completed before this tile
// (the two in step), advanced past this tile's. Called by every thread of warpgroup `cw` once
// the leader has seen every partial's flag.
template <class C, typename Out>
__device__ __forceinline__ void fold_through_boxes(const GemmParams& p, const Smem& s, const TileRoute& r, u32 tile,
                                                   u32 tn, u32 cw, bool leader, u32& uses, float* acc) {
    static_assert(C::PINGPONG && C::HALVES == 2 && sizeof(Out) == 2, "a ping-pong warpgroup's whole 16-bit tile");
    constexpr int BOX_COLS = 64, PER_HALF = C::BN / BOX_COLS, BOXES = C::HALVES * PER_HALF;
    static_assert(BOXES % 2 == 0 && C::BOX_BYTES == 64 * 128, "a partial's boxes take both buffers in turn");
    const u32 lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const auto buffer = [&](int q) { return smem_u32(s.epi + (cw * 2 + q % 2) * C::BOX_BYTES); };
    const auto bar = [&](int q) { return s.fold_bars + 8 * (cw * 2 + q % 2); };
    // box q of partial f, by the leader, once every thread has read what its buffer held (the
    // sync before each issue; the generic reads before the async proxy's writes: the fence);
    // none once the block has stopped (a wait gave up), as the producer loads nothing more
    u32 issued = 0;  // (the leader's count)
    const auto issue = [&](u32 f, int q) {  // (q: the box within the partial)
        if (leader && !block_stopped()) {
            ++issued;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_expect_tx(bar(q), C::BOX_BYTES);
            tma_load_2d(buffer(q), &p.fold_map, bar(q), (int)(tn * C::BN + (q % PER_HALF) * BOX_COLS),
                        (int)(r.fold_row + f * r.fold_row_step + (q / PER_HALF) * 64));
        }
    };
    if (leader) {
        // the warpgroup's last tile's box stores have read the buffers; the flags' acquire
        // (generic proxy) before the loads of what they published (async proxy)
        bulk_wait_read();
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    consumer_group_sync(cw);
    issue(0, 0);
    issue(0, 1);
    // One loop over every box of every partial, not unrolled, so that the bounded wait is one
    // copy: unrolled six times a partial beside the 192 accumulators, its timer and stop checks
    // made ptxas spill (758 bytes of stores, one load and store a k-block), where this spills
    // less than the entry without the fold. Each box's adds have accumulators of their own
    // (registers: indices known at compile time), hence the switch.
    const u32 total = r.fold_count * BOXES;
    for (u32 n = 0; n < total; ++n) {
        const int q = (int)(n % BOXES);
        // box n has landed (its buffer's barrier at the phase of this use)
        mbar_wait<ROLE_CONSUMER>(bar(q), (uses + n / 2) & 1, p, tile, WAIT_FOLD_BOX);
        const u32 rows = buffer(q) + (warp * 16 + lane / 4) * 128;
        static_assert(PER_HALF == 3, "the switch names a half's three boxes");
        switch (q) {  // (half q / 3, box q % 3: its first 8-column group of the half's accumulators)
            case 0: add_box_pairs<Out>(rows, lane, acc + 0 * (BOX_COLS / 8) * 4); break;
            case 1: add_box_pairs<Out>(rows, lane, acc + 1 * (BOX_COLS / 8) * 4); break;
            case 2: add_box_pairs<Out>(rows, lane, acc + 2 * (BOX_COLS / 8) * 4); break;
            case 3: add_box_pairs<Out>(rows, lane, acc + C::ACC + 0 * (BOX_COLS / 8) * 4); break;
            case 4: add_box_pairs<Out>(rows, lane, acc + C::ACC + 1 * (BOX_COLS / 8) * 4); break;
            default: add_box_pairs<Out>(rows, lane, acc + C::ACC + 2 * (BOX_COLS / 8) * 4); break;
        }
        // every thread has read box n before box n + 2 takes its buffer
        consumer_group_sync(cw);
        if (n + 2 < total) issue((n + 2) / BOXES, (int)((n + 2) % BOXES));
    }
    // In a block that stopped, the waits return at once: the last two boxes the leader issued
    // may still be in flight, and land (bounded) before the buffers are left, which would
    // otherwise be another block's shared memory by then
    if (leader && block_stopped()) {
        for (u32 n = issued >= 2 ? issued - 2 : 0; n < issued; ++n) mbar_drain(bar(n % BOXES), (uses + n / 2) & 1, p.timeout_ns);
    }
    // every buffer's barrier completed half of the boxes' phases
    uses += total / 2;
}

// The consumers' side of a fold through the pipeline (fold_load): each of the tile's partials
// lies in the ring's next stages as swizzled boxes (a row's 16-byte chunk c at c ^ (row % 8));
// each thread adds its own pairs to its accumulators (alpha is 1 in a folding GEMM: the host
// checks), and the warpgroup lets each stage go once all of its threads have read it. A
// warpgroup's eight rows of a warp have distinct row % 8, so its loads hit distinct banks.
template <class C, typename Out>
__device__ __forceinline__ void fold_from_stages(const GemmParams& p, const Smem& s, const Unit& c, u32 count,
                                                 u32& stage, u32& phase, bool leader, u32 cw, float* acc) {
    using F = FoldBoxes<C, Out>;
    // the thread's index read here, where it is used: derived from threadIdx.x, the addresses
    // below were hoisted out of the tile loop and lived through the main loop, where ptxas
    // spilled the loop's counter
    u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const u32 lane = tid % 32, warp = (tid % 128) / 32;
    // this thread's rows of the box are row0 and row0 + 8, both with row % 8 = lane / 4
    const u32 row0 = cw * 64 + warp * 16 + lane / 4;
    for (u32 f = 0; f < count; ++f) {
#pragma unroll
        for (int st = 0; st < F::STAGES; ++st) {
            mbar_wait<ROLE_CONSUMER>(s.full + 8 * stage, phase, p, c.tile, WAIT_STAGE_FULL);
            const u32 rows = s.b + stage * C::B_STAGE_BYTES + row0 * 128;
#pragma unroll
            for (int b = 0; b < F::PER_STAGE; ++b) {
                const int box = st * F::PER_STAGE + b;
                // (the box's first 8-column group of the accumulators: box · COLS / 8)
                if (box < F::BOXES) add_box_pairs<Out>(rows + b * F::BOX_BYTES, lane, acc + box * (F::COLS / 8) * 4);
            }
            consumer_group_sync(cw);  // every thread of the warpgroup is done with the stage
            if (leader) release_stage<C>(s.empty + 8 * stage);
            if (++stage == C::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

// The epilogue's values of a thread's two adjacent accumulators (a0, a1) at row gr, columns gc
// and gc + 1 of D: alpha times them, plus beta·C and the bias where asked, read only within D.
template <typename Out>
__device__ __forceinline__ float2 epilogue_pair(const GemmParams& p, float a0, float a1, u32 gr, u32 gc,
                                                bool has_c, bool tile_bias, const Out* c_mat, const Out* bias) {
    float v0 = p.alpha * a0, v1 = p.alpha * a1;
    if (has_c && gr < p.m) {
        if (gc < p.n) v0 += p.beta * Elem<Out>::to_f32(c_mat[(size_t)gr * p.n + gc]);
        if (gc + 1 < p.n) v1 += p.beta * Elem<Out>::to_f32(c_mat[(size_t)gr * p.n + gc + 1]);
    }
    if (tile_bias) {
        if (gc < p.n) v0 += Elem<Out>::to_f32(bias[gc]);
        if (gc + 1 < p.n) v1 += Elem<Out>::to_f32(bias[gc + 1]);
    }
    return make_float2(v0, v1);
}

// The direct and the ping-pong build's epilogue: each consumer warpgroup stores 64 rows of a
// tile at a time, tile rows r0 .. r0 + 63, whose accumulators `acc` hold as one m64 wgmma
// leaves them; alpha, beta·C and the bias applied in registers, then into D by TMA tensor
// stores of shared-memory boxes (store_rows_by_boxes) where a box can serve them
// (boxes_serve), else from registers (store_rows_from_registers).
//
// Whether boxes of 64 columns can store tile rows r0 .. r0 + 63: where a box ends within this
// tile's rows or at M's edge (which the store clips; a band that ends before M would have the
// next band's rows written). 16-bit outputs only: with f32 (eight boxes a tile) the tile
// loop's counter spilled.
template <typename Out> __device__ __forceinline__ bool boxes_serve(const GemmParams& p, const Unit& c, u32 r0) {
    return sizeof(Out) == 2 && p.d_tma != 0 && r0 < c.rows && (r0 + 64 <= c.rows || c.row0 + c.rows == p.m);
}

// Where a tile's rows go by boxes: the tensor map, and the (column, row) in it of the tile's
// element (0, 0).
struct BoxTarget {
    const TmaDesc* map;
    u32 col, row;
};

// The rows by boxes, through warpgroup `wg`'s two box buffers (and its barrier), to `to` (the
// rows' first at `to.row + r0`).
template <class C, typename Out>
__device__ __forceinline__ void store_rows_by_boxes(const GemmParams& p, const Smem& s, const Unit& c, const float* acc,
                                                    u32 r0, u32 wg, u32 g_col0, bool leader, BoxTarget to) {
    const u32 lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const u32 wrow = warp * 16 + lane / 4;  // this thread's first row of the 64
    const u32 g_row0 = c.row0 + r0 + wrow;  // and of D
    constexpr int BOX_COLS = 128 / sizeof(Out);
    constexpr int GROUPS = BOX_COLS / 8;  // 8-column accumulator groups per box
#pragma unroll
    for (int bx = 0; bx < C::BN / BOX_COLS; ++bx) {
        if (g_col0 + bx * BOX_COLS >= p.n) break;
        // (the rows' boxes take the buffers in turn from the first: a count kept across
        // tiles would live through the main loop beside the accumulators)
        unsigned char* box = s.epi + (wg * 2 + bx % 2) * C::BOX_BYTES;
        // the store that read this buffer two boxes ago is done reading it; at the rows'
        // first box, every store before (the last tile's, issued a main loop ago, or the
        // ping-pong tile's other half's, which may have stopped short at N)
        if (leader) {
            if (bx == 0) bulk_wait_read();
            else bulk_wait_read_all_but<1>();
        }
        consumer_group_sync(wg);
        // read again from the parameters at each box, as the main build's passes do: a
        // flag or pointer kept across the boxes' barriers spilled in the f32 entries
        // (a peer's partial adds no bias: ROUTE_NO_BIAS)
        const bool box_c = C::READS_C && p.beta != 0.0f && p.c != nullptr,
                   box_bias = !C::PLAIN && p.bias != nullptr &&
                              (call_state.routes == nullptr || !(call_state.routes[c.tile].options & ROUTE_NO_BIAS));
        if (plain_epilogue<C, Out>(p, box_c, box_bias)) {
            // the lane's row and its 16-byte chunk, swizzled by the row (row % 8 is the lane's % 8)
            const StmatrixLane l = stmatrix_lane();
            const u32 row = smem_u32(box) + l.row * 128;
            const u32 col = g_col0 + bx * BOX_COLS + 2 * (l.lane % 4);  // of group bx · GROUPS
            stmatrix_plain<Out, GROUPS / 2>(p, acc, bx * GROUPS, box_bias, col, [&](int q) {
                return row + (((2 * q + l.group) ^ (l.row % 8)) * 16);
            });
        } else {
#pragma unroll
            for (int g = 0; g < GROUPS; ++g) {
                const int j = bx * GROUPS + g;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 col = j * 8 + 2 * (lane % 4);
                    const float2 v = epilogue_pair<Out>(p, acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1],
                                                        g_row0 + 8 * h, g_col0 + col, box_c, box_bias,
                                                        (const Out*)p.c, (const Out*)p.bias);
                    // the tensor map's 128-byte swizzle: a row's 16-byte chunk c sits at c ^ (row % 8),
                    // which also spreads the warp's eight rows over all banks
                    const u32 r = wrow + 8 * h, byte = (col - bx * BOX_COLS) * sizeof(Out);
                    store_pair<Out>(box + r * 128 + (((byte / 16) ^ (r % 8)) * 16) + byte % 16, v.x, v.y);
                }
            }
        }
        // the box is read by the TMA engine (async proxy): order the generic writes first
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        consumer_group_sync(wg);
        if (leader) {
            tma_store_2d(to.map, smem_u32(box), to.col + bx * BOX_COLS, to.row + r0);
            bulk_commit();
        }
    }
}

// The rows from registers: a thread's pairs of columns, each where it lies in the tile's rows
// and in the destination whose element (0, 0) of the tile is at `dst` (leading dimension `ld`).
template <class C, typename Out>
__device__ __forceinline__ void store_rows_from_registers(const GemmParams& p, const Unit& c, const float* acc, u32 r0,
                                                          u32 g_col0, bool tile_bias, u64 dst, u32 ld) {
    const u32 lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const u32 row0 = r0 + warp * 16 + lane / 4;  // the tile row of this thread's first accumulator
    const u32 g_row0 = c.row0 + row0;
    const Out* c_mat = (const Out*)p.c;
    const Out* bias = (const Out*)p.bias;
    const bool has_c = C::READS_C && p.beta != 0.0f && p.c != nullptr;
    // a thread's two columns start on an even column: where every row starts on a pair's
    // boundary (even ld, an aligned destination), one aligned store
    const bool pairs = (dst | (u64)ld * sizeof(Out)) % (2 * sizeof(Out)) == 0;
#pragma unroll
    for (int j = 0; j < C::BN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 col = j * 8 + 2 * (lane % 4);
            const u32 gr = g_row0 + 8 * h, gc = g_col0 + col;
            if (row0 + 8 * h >= c.rows || gc >= p.n) continue;
            const bool two = gc + 1 < p.n;
            const float2 v = epilogue_pair<Out>(p, acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1], gr, gc,
                                                has_c, tile_bias, c_mat, bias);
            float v0 = v.x, v1 = v.y;
            Out* at = (Out*)dst + (size_t)(row0 + 8 * h) * ld + col;
            if (C::READS_C && p.accumulate) {
                v0 += Elem<Out>::to_f32(at[0]);
                if (two) v1 += Elem<Out>::to_f32(at[1]);
            }
            if (pairs && two) {
                store_pair<Out>((unsigned char*)at, v0, v1);
            } else {
                at[0] = Elem<Out>::from_f32(v0);
                if (two) at[1] = Elem<Out>::from_f32(v1);
            }
        }
    }
}

// The route of the unit's tile (null: none), for its epilogue: in the builds that fold through
// their stages, read again from the tile's index hidden from the optimiser, so that neither it
// nor the pointer lives through the pass over the staged partials (kept from before the fold,
// ptxas spilled in the direct build's 16-bit entries).
template <class C, typename Out> __device__ __forceinline__ const TileRoute* tile_route(const Unit& c) {
    if (C::PLAIN || call_state.routes == nullptr) return nullptr;
    u32 tile = c.tile;
    if (FoldBoxes<C, Out>::STAGED) asm volatile("" : "+r"(tile));
    return call_state.routes + tile;
}

// Where a tile of the builds whose consumers store it goes: D's map at the tile's place, and
// D itself for the rows that boxes do not serve; or, for a tile with a route (GEMM +
// reduce-scatter: a peer's partial into its receive slot, or an own tile into D), the route's
// tensor map where it has one (ROUTE_DST_BOXES: 16-bit outputs; the map ends where the tile's
// rows and columns do, so that a ragged box writes nothing past them) and its address and
// leading dimension. (One call site of each store serves both: a second inlined copy of the
// boxes' loop made ptxas spill in the 16-bit entries.)
struct TileDst {
    BoxTarget to;
    u64 dst;       // the tile's element (0, 0), for the stores from registers
    u32 ld;
    bool routed;   // a route decides which rows go by boxes
    bool boxes;    // (routed) the route's rows go by boxes
};
template <class C, typename Out>
__device__ __forceinline__ TileDst tile_dst(const GemmParams& p, const Unit& c, const TileRoute* r, u32 g_col0) {
    if (!C::ROUTES_BY_CONSUMERS || r == nullptr)
        return {BoxTarget{&p.d_map, g_col0, c.row0}, p.d + ((u64)c.row0 * p.n + g_col0) * sizeof(Out), p.n, false,
                false};
    const bool boxes = sizeof(Out) == 2 && (r->options & ROUTE_DST_BOXES) != 0 && (r->dst_map != 0 || p.d_tma != 0);
    const TmaDesc* map = r->dst_map != 0 ? (const TmaDesc*)r->dst_map : &p.d_map;
    return {BoxTarget{map, r->dst_col, r->dst_row}, r->dst + ((r->options & ROUTE_DST_FROM_D) != 0 ? p.d : 0), r->ld,
            true, boxes};
}

// A routed tile's flag is not raised by the consumers that store it: the leader of each
// warpgroup marks its stores pending, counts them performed once it has waited for them
// (stores_performed, after the warpgroup's next main loop or at its end), and the first
// storer raises the flag once every warpgroup has (raise_routed_flags). So no warpgroup waits
// for its writes to land before its next main loop.

// The leader of consumer warpgroup `wg`: once its pending routed stores have written their
// bytes (the tensor stores it issued; the warpgroup's register stores were ordered before
// this by a barrier of the warpgroup), count them performed (release: the storer that reads
// the count raises the tile's flag after it).
__device__ __forceinline__ void stores_performed(u32 wg) {
    bulk_wait_all();
    // the TMA engine's writes (async proxy) before the generic release below
    asm volatile("fence.proxy.async.global;" ::: "memory");
    routed_stores.pending[wg] = 0;
    const u32 next = routed_stores.performed[wg] + 1;
    asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(smem_u32(&routed_stores.performed[wg])), "r"(next)
                 : "memory");
}

// Consumer warpgroup `cw`'s last routed tile with a flag, if its stores are still pending:
// counted performed (stores_performed) after a barrier of the warpgroup, which orders every
// thread's register stores of that tile before the leader's count. Called by every thread of
// the warpgroup.
template <class C> __device__ __forceinline__ void settle_routed_stores(u32 cw, bool leader) {
    if (!C::ROUTES_BY_CONSUMERS || call_state.routes == nullptr) return;
    consumer_group_sync(cw);
    if (leader && routed_stores.pending[cw]) stores_performed(cw);
}

// A tile's flag, raised as its route says (release, system scope: it carries the tile's stores
// that the raising thread has seen).
__device__ __forceinline__ void raise_flag(const TileRoute& r) {
    if (r.flag_op == FLAG_SET_EPOCH) store_release_sys((u64*)r.flag, call_state.epoch);
    else notify((u64*)r.flag, r.flag_value, r.flag_op);
}

// The first storer of a direct build's routed call: in the consumers' order of tiles, once
// every consumer warpgroup that stores a tile with a flag has counted it performed
// (stores_performed), raise its flag, so that a peer reads the tile only after all of its rows
// have landed. In the cooperative builds both warpgroups store each tile; in the wide
// ping-pong build the one whose turn the unit was (the units' turns as the consumers count
// them), so each warpgroup's count is of its own tiles. Bounded like a pipeline wait; a block
// that gave up raises no more flags.
template <class C> __device__ void raise_routed_flags(const GemmParams& p) {
    // (two counters, not an array a thread would keep in local memory)
    u32 tiles0 = 0, tiles1 = 0, turn = 0;
    for (u32 i = blockIdx.x; i < p.unit_count; i += gridDim.x) {
        const Unit c = unit_at<C>(p, i);
        if (c.empty) continue;  // (not a turn either)
        const u32 mine = C::PINGPONG ? turn++ % 2 : 0;
        if (c.helper || c.idle) continue;  // no epilogue: no stores
        const TileRoute& r = call_state.routes[c.tile];
        if (r.flag == 0) continue;
        const u32 count = mine == 0 ? ++tiles0 : ++tiles1;
        const u64 start = global_timer_ns();
        for (u32 w = C::PINGPONG ? mine : 0; w < (C::PINGPONG ? mine + 1 : C::WARPGROUPS); ++w) {
            u32 done;
            for (;;) {
                asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];"
                             : "=r"(done)
                             : "r"(smem_u32(&routed_stores.performed[w]))
                             : "memory");
                if (done >= count || block_stopped()) break;
                if (global_timer_ns() - start > p.timeout_ns) {
                    pipeline_stalled<ROLE_WG0>(p, c.tile, WAIT_EPI_FULL, count);
                    break;
                }
                // (its issue slots are the consumers' sub-partition's: a main loop's time to wait)
                __nanosleep(256);
            }
        }
        if (block_stopped()) return;
        // (the acquire above carries every warpgroup's stores; the release carries them on)
        raise_flag(r);
    }
}

// The ping-pong build's turn barrier of consumer warpgroup w: its leader arrives once it has
// waited for every stage of a unit, and the other warpgroup waits for that before it steps over
// the unit's stages. The builds that store tiles themselves have no staged tile, so these are
// its two barriers (epi_full, epi_empty: one arrival each).
__device__ __forceinline__ u32 turn_barrier(const Smem& s, u32 w) { return s.epi_full + 8 * w; }

// The sliced build's hand-over (named barriers 5 and 6, both consumer warpgroups): the
// second warpgroup waits until the first has taken the last tile's sums (SUMS_FREE) before it
// writes a tile's, then says they are there (SUMS_READY).
constexpr int SUMS_FREE = 5, SUMS_READY = 6;
template <int ID> __device__ __forceinline__ void slices_sync() {
    asm volatile("bar.sync %0, 256;" ::"n"(ID) : "memory");
}
template <int ID> __device__ __forceinline__ void slices_arrive() {
    asm volatile("bar.arrive %0, 256;" ::"n"(ID) : "memory");
}

template <class C, typename In, typename Out, bool B_KN>
__device__ void consumer(const GemmParams& p, const Smem& s, u32 cw) {
    constexpr int PASSES = sizeof(Out) / 2;  // f32 tiles are staged in two column halves
    constexpr int PASS_COLS = C::BN / PASSES;
    // which 64 rows of the tile this warpgroup computes (the first of its HALVES), and which of
    // a unit's k-blocks (those `slice` past a multiple of SLICES from the unit's first)
    const u32 half = C::SLICES > 1 || C::PINGPONG ? 0 : cw, slice = C::SLICES > 1 ? cw : 0;
    const u32 lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const u32 row0 = half * 64 + warp * 16 + lane / 4;  // this thread's first accumulator row
    const bool leader = threadIdx.x % 128 == 0;
    const Out* c_mat = (const Out*)p.c;
    const Out* bias = C::PLAIN ? nullptr : (const Out*)p.bias;
    u32 stage = 0, phase = 0, epi_phase = 0;
    constexpr int ACCS = C::HALVES * C::ACC;
    float acc[ACCS];
    // the hand-over's buffer starts free
    if (C::SLICES > 1 && slice == 0) slices_arrive<SUMS_FREE>();
    // (ping-pong) this block's units so far: warpgroup cw takes those where turn % 2 == cw; and
    // the phase of the other warpgroup's turn barrier it waits for next
    u32 turn = 0, turn_phase = 0;
    // (the wide build) the phases its box buffers' barriers completed (fold_through_boxes)
    u32 fold_uses = 0;
    for (u32 i = blockIdx.x; i < p.unit_count; i += gridDim.x) {
        const Unit c = unit_at<C>(p, i);
        if (c.empty) continue;
        if constexpr (C::PINGPONG) {
            if (turn++ % 2 != cw) {
                // The other warpgroup's unit: once it has had every stage of it (its turn barrier,
                // raised after its main loop), step over them. Not before: a wait for a stage of
                // this warpgroup's next unit whose fill a lap earlier (the other's) has not landed
                // would pass at once on the parity of the fill before that. So the main loops take
                // turns on the tensor cores, each warpgroup's epilogue under the other's.
                mbar_wait<ROLE_CONSUMER>(turn_barrier(s, 1 - cw), turn_phase, p, c.tile, WAIT_TURN);
                turn_phase ^= 1;
                const u32 at = stage + (c.kb1 - c.kb0);
                phase ^= (at / C::STAGES) & 1;
                stage = at % C::STAGES;
                continue;
            }
        }
        // The idle half of a pair takes its turn on every stage (its partner's consumers wait
        // for it to let each go) and has no tile to finish. A branch of its own: sharing the
        // one below, ptxas serialised the wgmmas (the zeroed accumulators then reach the next
        // tile's) or spilled (a flag kept through the main loop).
        if (c.idle) {
            pass_stages<C>(p, s, c, stage, phase, leader);
            continue;
        }
        // A warpgroup whose 64 rows all lie past the tile's last (M or a band ends within the
        // tile's first half) issues no matrix instruction: its accumulators stay zero and are
        // never stored (the storers stop at the tile's rows). It still takes its turn on every
        // stage, so the pipeline's barriers count as before. (Not in the ping-pong build, where
        // this branch's zeroed accumulators made ptxas spill: a band without rows runs its main
        // loop there, and nothing of it is stored.)
        if (!C::PINGPONG && half * 64 >= c.rows) {
#pragma unroll
            for (int j = 0; j < ACCS; ++j) acc[j] = 0.0f;
            pass_stages<C>(p, s, c, stage, phase, leader);
        } else {
            // a slice without a k-block of the unit (a unit of fewer k-blocks than slices) adds zeros
            if (C::SLICES > 1 && c.kb0 + slice >= c.kb1) {
#pragma unroll
                for (int j = 0; j < ACCS; ++j) acc[j] = 0.0f;
            }
            u32 prev = 0;
            for (u32 kb = c.kb0; kb < c.kb1; ++kb) {
                if (C::SLICES > 1 && (kb - c.kb0) % C::SLICES != slice) {
                    // Another slice's k-block: waited for and let go at once (each stage's empty
                    // barrier counts both warpgroups), so that this warpgroup sees every fill of
                    // the ring in order. Stepped over unseen, a stage whose fill a lap before was
                    // the other's (after a unit of an odd count of k-blocks) could pass this
                    // warpgroup's wait on the parity of the fill before that, loads landing in
                    // any order (ring_model.rs).
                    pass_stage<C>(p, s, c.tile, stage, phase, leader);
                    continue;
                }
                mbar_wait<ROLE_CONSUMER>(s.full + 8 * stage, phase, p, c.tile, WAIT_STAGE_FULL);
                const u32 a = s.a + stage * C::A_STAGE_BYTES + half * (64 * 128);
                const u32 b = s.b + stage * C::B_STAGE_BYTES;
                wgmma_fence();
                fence_acc<ACCS>(acc);
#pragma unroll
                for (int kk = 0; kk < gemm::BK / 16; ++kk) {
                    // A: K-major, 8-row groups 1024 bytes apart, a k16 step is 32 bytes along the row.
                    // B [N, K]: the same. B [K, N]: N-major, 64-column blocks 8 KiB apart (LBO),
                    // 8-row K groups 1024 bytes apart (SBO), a k16 step is 16 rows = 2048 bytes.
                    const u64 db = B_KN ? smem_desc(b + 2048 * kk, 8192, 1024) : smem_desc(b + 32 * kk, 16, 1024);
#pragma unroll
                    for (int h = 0; h < C::HALVES; ++h) {
                        // (a half's 64 rows of A are 8 KiB on)
                        const u64 da = smem_desc(a + h * (64 * 128) + 32 * kk, 16, 1024);
                        // (the slice's first k-block starts the sums afresh; the unsliced builds'
                        // test is kept as it was, whose code ptxas fits without a spill)
                        const bool first = C::SLICES == 1 ? kb == c.kb0 : kb < c.kb0 + C::SLICES;
                        Wgmma<In, C::BN>::template mma<B_KN ? 1 : 0>(acc + h * C::ACC, da, db, !first || kk != 0);
                    }
                }
                wgmma_commit();
                fence_acc<ACCS>(acc);
                // keep this k-block's wgmmas in flight; the previous one's stage can be refilled
                wgmma_wait<1>();
                fence_acc<ACCS>(acc);
                if ((C::SLICES == 1 ? kb > c.kb0 : kb >= c.kb0 + C::SLICES) && leader)
                    release_stage<C>(s.empty + 8 * prev);
                prev = stage;
                if (++stage == C::STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
            }
            // (ping-pong) every stage of this unit has been waited for: the other warpgroup's turn
            if (C::PINGPONG && leader) mbar_arrive(turn_barrier(s, cw));
            wgmma_wait<0>();
            fence_acc<ACCS>(acc);
            if (cw == 0 && leader) trace(p, TRACE_MAIN_DONE);
            if (leader && (C::SLICES == 1 || c.kb0 + slice < c.kb1)) release_stage<C>(s.empty + 8 * prev);
        }
        // The sliced build: the second warpgroup hands its sums over and goes on to its next
        // unit; the first adds them (in one fixed order, so results do not depend on timing)
        // and finishes the tile as the narrow build does. Thread t of a warpgroup holds the
        // same elements in both, so each moves its own as float4s at t, t + 128, ...: a warp
        // writes 512 contiguous bytes, free of bank conflicts.
        if constexpr (C::SLICES > 1) {
            const u32 t = threadIdx.x % 128;
            if (slice != 0) {
                slices_sync<SUMS_FREE>();
#pragma unroll
                for (int j = 0; j < C::ACC / 4; ++j)
                    s.sums[j * 128 + t] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
                slices_arrive<SUMS_READY>();
                continue;
            }
            slices_sync<SUMS_READY>();
#pragma unroll
            for (int j = 0; j < C::ACC / 4; ++j) {
                const float4 v = s.sums[j * 128 + t];
                acc[4 * j] += v.x;
                acc[4 * j + 1] += v.y;
                acc[4 * j + 2] += v.z;
                acc[4 * j + 3] += v.w;
            }
            slices_arrive<SUMS_FREE>();
        }
        // a tile of the tail with helpers: the entry read again here rather than kept through
        // the main loop
        // (no split tail in the ping-pong build: the host plans it none)
        if (!C::PINGPONG && C::SPLIT_TAIL && i >= p.full_units) {
            if (!split_partials<C>(p, p.tail[i - p.full_units], c.rows, acc)) continue;  // a helper: no epilogue
        }
        // The warpgroup's last routed tile with a flag (direct builds): its stores counted
        // performed here, after this tile's main loop and before its fold, never later. The
        // fold waits for peers' flags, and a peer's partial may wait in turn for this rank's
        // flag (its own fold): kept until this tile's epilogue, the two ranks' flags could
        // each wait for the other's. The stores were issued a main loop ago, so the wait is
        // short.
        settle_routed_stores<C>(cw, leader);
        // The tile's column, again from its index in the pair and the builds that fold through
        // their stages, where it is used (after the fold): kept from the unit's start it is one
        // more value live through the main loop beside the 128 accumulators, and ptxas spilled
        // it (beside the pair's remote arrivals, and beside the pass over staged partials; the
        // other builds keep it).
        const auto tile_column = [&]() {
            u32 tn = c.tn;
            if (C::CLUSTER > 1 || FoldBoxes<C, Out>::STAGED) {
                u32 tile = c.tile;
                asm volatile("" : "+r"(tile));
                tn = tile % p.tiles_n;
            }
            return tn;
        };

        // Partials folded in (the owner's tiles of GEMM + reduce-scatter): through the
        // pipeline's stages where the host described them by the fold map (the producer waited
        // for their flags), or else, once the leader has seen every peer's flag of this tile,
        // read from global memory. The owner computes its own tiles last, so in practice they
        // have long arrived and the wait is one look at each flag.
        const TileRoute* route = !C::PLAIN && call_state.routes != nullptr ? call_state.routes + c.tile : nullptr;
        const u32 fold_count = route != nullptr ? route->fold_count : 0;
        if (staged_fold<C, Out>(p, c.tile) != nullptr) {  // (helpers and idle halves went on above)
            fold_from_stages<C, Out>(p, s, c, fold_count, stage, phase, leader, cw, acc);
        } else if ((!C::PINGPONG || C::ROUTES_BY_CONSUMERS) && fold_count != 0) {
            // (the ping-pong builds fold only where they take routes: the wide build's routed
            // entries)
            if (leader) fold_wait(p, *route, c.tile, cw);
            consumer_group_sync(cw);
            // (the wide build through its boxes, by the fold map: the host marks its every
            // folding route ROUTE_FOLD_TMA or refuses the call; the other builds read partials
            // from global memory)
            if constexpr (C::PINGPONG && C::ROUTES_BY_CONSUMERS && sizeof(Out) == 2) {
                fold_through_boxes<C, Out>(p, s, *route, c.tile, tile_column(), cw, leader, fold_uses, acc);
            } else {
            // Added to the accumulators (alpha is 1 in a folding GEMM: the host checks) in one
            // pass per partial, outside the per-element epilogue below: a loop over the partials
            // inside it, unrolled 64 times, tripled the kernel's code and slowed every GEMM by
            // half (measured). Loads go through L2 only (.cg): an L1 line of two calls ago must
            // not stand in for the partial.
            const unsigned char* base = (const unsigned char*)route->fold_src;
            const u64 row_step = (u64)route->fold_ld * sizeof(Out);
            const u64 fold_stride = route->fold_stride;
            // columns left of this thread's first one
            const int lim = (int)p.n - (int)(tile_column() * C::BN) - (int)(2 * (lane % 4));
            // a thread's columns come in pairs; where every row of every partial starts on a
            // pair's boundary (the usual case: even ld and strides), a pair is one load
            const bool paired = ((u64)base | fold_stride | row_step) % (2 * sizeof(Out)) == 0;
            // (a ping-pong warpgroup's whole tile: its accumulators of each 64-row half, one pass
            // over the partials a half; one pass of both halves spilled the accumulators)
#pragma unroll
            for (int h = 0; h < C::HALVES; ++h) {
                // whether the thread's two rows of the half are in the band
                const u32 hr = row0 + h * 64;
                const bool in0 = hr < c.rows, in1 = hr + 8 < c.rows;
                float* ha = acc + h * C::ACC;
                for (u32 f = 0; f < fold_count; ++f) {
                    const Out* r0 = (const Out*)(base + f * fold_stride + hr * row_step) + 2 * (lane % 4);
                    const Out* r1 = (const Out*)((const unsigned char*)r0 + 8 * row_step);
                    // (issuing eight column groups' loads before adding any measured 3-5 % slower)
#pragma unroll
                    for (int j = 0; j < C::BN / 8; ++j) {
                        if (paired && j * 8 + 1 < lim) {
                            if (in0) {
                                const float2 v = ldcg_pair(r0 + j * 8);
                                ha[j * 4] += v.x;
                                ha[j * 4 + 1] += v.y;
                            }
                            if (in1) {
                                const float2 v = ldcg_pair(r1 + j * 8);
                                ha[j * 4 + 2] += v.x;
                                ha[j * 4 + 3] += v.y;
                            }
                            continue;
                        }
                        if (in0 && j * 8 < lim) ha[j * 4] += Elem<Out>::to_f32(__ldcg(r0 + j * 8));
                        if (in0 && j * 8 + 1 < lim) ha[j * 4 + 1] += Elem<Out>::to_f32(__ldcg(r0 + j * 8 + 1));
                        if (in1 && j * 8 < lim) ha[j * 4 + 2] += Elem<Out>::to_f32(__ldcg(r1 + j * 8));
                        if (in1 && j * 8 + 1 < lim) ha[j * 4 + 3] += Elem<Out>::to_f32(__ldcg(r1 + j * 8 + 1));
                    }
                }
            }
            }
        }
        // (the route read again, as the column above: see tile_route)
        const TileRoute* routed = tile_route<C, Out>(c);
        const bool tile_bias = bias != nullptr && (routed == nullptr || !(routed->options & ROUTE_NO_BIAS));

        // epilogue arithmetic in registers, then stage the tile for the storers
        const u32 g_row0 = c.row0 + row0, g_col0 = tile_column() * C::BN;
        if constexpr (C::DIRECT) {
            // a block that gave up stores nothing (its accumulators may be anything), decided
            // once for the warpgroup
            if (group_stopped(cw)) continue;
            // (counted performed after the next tile's main loop, or at the end)
            if (C::ROUTES_BY_CONSUMERS && routed != nullptr && leader && routed->flag != 0) routed_stores.pending[cw] = 1;
            // The unit again from the order where the build folds through its stages: its band
            // (and the loop's counter beside it) kept from the unit's start through the main
            // loop and the pass over the staged partials, ptxas spilled them in the direct
            // build's 16-bit entries.
            u32 at = i;
            if (FoldBoxes<C, Out>::STAGED) asm volatile("" : "+r"(at));
            const Unit e = FoldBoxes<C, Out>::STAGED ? unit_at<C>(p, at) : c;
            const TileDst to = tile_dst<C, Out>(p, e, routed, g_col0);
            // (the direct build's warpgroup stores its own 64 rows; a ping-pong warpgroup its
            // whole tile, half by half)
#pragma unroll
            for (int h = 0; h < C::HALVES; ++h) {
                const u32 r0 = (half + h) * 64;
                if (C::PLAIN || (to.routed ? to.boxes && r0 < e.rows : boxes_serve<Out>(p, e, r0)))
                    store_rows_by_boxes<C, Out>(p, s, e, acc + h * C::ACC, r0, cw, g_col0, leader, to.to);
                else
                    store_rows_from_registers<C, Out>(p, e, acc + h * C::ACC, r0, g_col0, tile_bias, to.dst, to.ld);
            }
            continue;
        }
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
            mbar_wait<ROLE_CONSUMER>(s.epi_empty, epi_phase ^ 1, p, c.tile, WAIT_EPI_EMPTY);
            // Decided here, per pass, from the uniform parameters rather than once before the tile
            // loop: a flag kept from the start lives through the main loop beside the 128
            // accumulators and was spilled to the stack under setmaxnreg 224 (f32 output).
            const bool has_c = p.beta != 0.0f && p.c != nullptr;
            if (plain_epilogue<C, Out>(p, has_c, tile_bias)) {
                // (16-bit: one pass) the lane's row of the staged tile, at its column group
                const StmatrixLane l = stmatrix_lane();
                const u32 row = smem_u32(s.epi) + (half * 64 + l.row) * C::EPI_PITCH + l.group * 16;
                stmatrix_plain<Out, C::BN / 16>(p, acc, 0, C::PLAIN_BIAS && tile_bias, g_col0 + 2 * (l.lane % 4),
                                                [&](int q) { return row + q * 32; });
            } else {
#pragma unroll
                for (int j = pass * PASS_COLS / 8; j < (pass + 1) * PASS_COLS / 8; ++j) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 col = j * 8 + 2 * (lane % 4);
                        const float2 v = epilogue_pair<Out>(p, acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1],
                                                            g_row0 + 8 * h, g_col0 + col, has_c, tile_bias, c_mat, bias);
                        store_pair<Out>(s.epi + (row0 + 8 * h) * C::EPI_PITCH + (col - pass * PASS_COLS) * sizeof(Out),
                                        v.x, v.y);
                    }
                }
            }
            // the staged tile is read by the TMA engine (async proxy): order our generic writes first
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            mbar_arrive(s.epi_full);
            epi_phase ^= 1;
        }
    }
    // the warpgroup's last routed tile with a flag
    settle_routed_stores<C>(cw, leader);
    // the direct build's boxes: no tensor store may still read shared memory or write D when
    // the block ends
    if (C::DIRECT && leader) bulk_wait_all();
    if (cw == 0 && leader) trace(p, TRACE_CONSUMER_END);
    // the first warpgroup's last word that the buffer is free, which no tile waits for: taken
    // here so that no barrier is left half arrived
    if (C::SLICES > 1 && slice != 0) slices_sync<SUMS_FREE>();
}

// The trace's "first stage full": the block's first unit with loads has its first k-block in
// stage 0 (the producer starts there), whose first fill is phase 0. Stamped by the first
// storer thread, which has nothing to store before that tile's epilogue, not by the consumers:
// a test in their k-loop, predicated off in every untraced call, still cost each k-block its
// special-register reads and their scoreboard waits ahead of the wgmmas. Bounded, and no stamp
// where the wait ends without the stage: a stall is the consumers' wait's to report.
template <class C> __device__ __forceinline__ void trace_first_stage(const GemmParams& p, const Smem& s) {
    for (u32 i = blockIdx.x; i < p.unit_count; i += gridDim.x) {
        if (unit_at<C>(p, i).empty) continue;
        const u64 start = global_timer_ns();
        while (!mbar_try_wait(s.full, 0)) {
            if (block_stopped() || global_timer_ns() - start > p.timeout_ns) return;
        }
        trace(p, TRACE_FIRST_FULL);
        return;
    }
}

__device__ __forceinline__ void storers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(gemm::STORERS) : "memory"); }

template <class C, typename Out>
__device__ void storer(const GemmParams& p, const Smem& s, u32 t) {
    constexpr int PASSES = sizeof(Out) / 2;
    constexpr int PASS_COLS = C::BN / PASSES;
    constexpr int VEC = 16 / sizeof(Out);  // elements per 16-byte store
    constexpr int UNITS = PASS_COLS / VEC;  // 16-byte units per staged row
    u32 epi_phase = 0;
    if (t == 0 && p.trace != nullptr) trace_first_stage<C>(p, s);
    if constexpr (C::ROUTES_BY_CONSUMERS) {
        if (t == 0 && call_state.routes != nullptr) raise_routed_flags<C>(p);
    }
    // (the direct builds' consumers store their tiles themselves, and the first storer raises
    // the flags of their routed tiles above: the storers only count the block finished below)
    for (u32 i = blockIdx.x; !C::DIRECT && i < p.unit_count; i += gridDim.x) {
        const Unit c = unit_at<C>(p, i);
        if (c.helper || c.empty || c.idle) continue;  // helpers and idle halves stage nothing
        TileRoute r;
        if (call_state.routes != nullptr) {
            r = call_state.routes[c.tile];
            if (r.options & ROUTE_DST_FROM_D) r.dst += p.d;
        } else {
            r.dst = p.d + ((u64)c.row0 * p.n + (u64)c.tn * C::BN) * sizeof(Out);
            r.ld = p.n;
            r.flag = 0;
        }
        const u32 rows = c.rows;
        const u32 cols = min(C::BN, (int)(p.n - c.tn * C::BN));
        const bool vec_ok = r.dst % 16 == 0 && ((u64)r.ld * sizeof(Out)) % 16 == 0;
        // Rows go out as TMA bulk copies (one per row and pass, issued by the first storer warp)
        // when they are whole 16-byte units; accumulation and ragged or unaligned rows take the
        // per-thread path.
        const bool bulk = vec_ok && !p.accumulate && cols % VEC == 0;
        for (int pass = 0; pass < PASSES; ++pass) {
            // a block that gave up stores nothing more (the staged tile may be anything)
            const bool store = mbar_wait<ROLE_WG0>(s.epi_full, epi_phase, p, c.tile, WAIT_EPI_FULL) && !block_stopped();
            const int pass_cols = min(PASS_COLS, (int)cols - pass * PASS_COLS);
            if (store && bulk) {
                if (t < 32 && pass_cols > 0) {
                    for (u32 row = t; row < rows; row += 32) {
                        bulk_store(r.dst + ((u64)row * r.ld + pass * PASS_COLS) * sizeof(Out),
                                   smem_u32(s.epi + row * C::EPI_PITCH), pass_cols * sizeof(Out));
                    }
                    bulk_commit();
                    bulk_wait_read();
                }
            } else if (store) {
                for (u32 u = t; u < C::ROWS * UNITS; u += gemm::STORERS) {
                    const u32 row = u / UNITS, unit = u % UNITS, col = pass * PASS_COLS + unit * VEC;
                    if (row >= rows || col >= cols) continue;
                    const unsigned char* src = s.epi + row * C::EPI_PITCH + unit * 16;
                    Out* dst = (Out*)r.dst + (size_t)row * r.ld + col;
                    if (vec_ok && col + VEC <= cols) {
                        uint4 v = *(const uint4*)src;
                        if (p.accumulate) v = add_vec<Out>(v, *(const uint4*)dst);
                        *(uint4*)dst = v;
                    } else {
                        for (u32 e = 0; e < VEC && col + e < cols; ++e) {
                            Out x = ((const Out*)src)[e];
                            if (p.accumulate) x = Elem<Out>::from_f32(Elem<Out>::to_f32(x) + Elem<Out>::to_f32(dst[e]));
                            dst[e] = x;
                        }
                    }
                }
            }
            storers_sync();  // every storer is done reading the staged tile
            if (t == 0) mbar_arrive(s.epi_empty);
            epi_phase ^= 1;
        }
        if (r.flag != 0 && t < 32) {
            if (bulk) {
                // the flag may only go up once the TMA engine's writes are performed
                bulk_wait_all();
                asm volatile("fence.proxy.async.global;" ::: "memory");
                __syncwarp();
            }
            // no flag of a block that gave up: no peer may take its tiles for finished ones
            if (t == 0 && !block_stopped()) {
                // the barrier (or the warp sync) above ordered every storer's stores before this
                // thread's release, which carries them (cumulativity): no separate fence, whose
                // sequentially consistent form (__threadfence_system) costs ~4 % at long K
                raise_flag(r);
            }
        }
    }
    if (t < 32) bulk_wait_all();  // no write may be in flight when the block ends
    if (t == 0) trace(p, TRACE_STORER_END);
    // The block that finishes last advances the call counter: every block read it (thread 0,
    // before the block's first barrier) before it counted itself finished here.
    if (t == 0 && p.calls != nullptr && (p.call_options & CALLS_READ_ONLY) == 0) {
        __threadfence();
        if (atomicAdd(&p.calls->finished, 1u) == gridDim.x - 1) {
            p.calls->finished = 0;
            *(volatile u64*)&p.calls->last = call_state.epoch;
        }
    }
}

template <class C, typename In, typename Out, bool B_KN>
__device__ __forceinline__ void gemm_kernel(const GemmParams& p) {
    // 128-byte swizzled stages must start on 1024-byte boundaries: declared, so that the area's
    // address is the symbol's, which ptxas rebuilds in a few uniform instructions where it
    // rematerialises a stage's address (rounded up at run time, the rebuild took a dozen more)
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* base = smem_raw;
    Smem s;
    s.a = smem_u32(base);
    s.b = s.a + C::STAGES * C::A_STAGE_BYTES;
    s.epi = base + C::STAGES * C::STAGE_BYTES;
    s.sums = (float4*)(s.epi + C::EPI_BYTES);
    s.full = smem_u32(s.epi + C::EPI_BYTES + C::SUMS_BYTES);
    s.empty = s.full + 8 * C::STAGES;
    s.epi_full = s.empty + 8 * C::STAGES;
    s.epi_empty = s.epi_full + 8;
    s.fold_bars = s.epi_empty + 8;
    if (threadIdx.x == 0) {
        trace(p, TRACE_ENTRY);
        for (int i = 0; i < C::STAGES; ++i) {
            mbar_init(s.full + 8 * i, 1);             // the producer's expect_tx arrival (+ the TMA bytes)
            // one arrival per warpgroup that reads the stage (of both blocks of a pair)
            mbar_init(s.empty + 8 * i, C::STAGE_READERS * C::CLUSTER);
        }
        // every consumer thread has staged its fragment (the ping-pong build: its warpgroup 0's
        // turn barrier, see turn_barrier)
        mbar_init(s.epi_full, C::PINGPONG ? 1 : C::CONSUMERS * 128);
        mbar_init(s.epi_empty, 1);   // the storers are done with the staged tile
        for (int i = 0; i < C::FOLD_BARRIERS; ++i) mbar_init(s.fold_bars + 8 * i, 1);  // the leader's expect_tx
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&p.a) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&p.b) : "memory");
        if (C::GATHERS && p.local_rows != 0) asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&p.a_local) : "memory");
        if (C::DIRECT && (C::PLAIN || p.d_tma != 0)) asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&p.d_map) : "memory");
        if ((FoldBoxes<C, Out>::STAGED || (C::WIDE && C::ROUTES_BY_CONSUMERS)) && p.fold_tma != 0)
            asm volatile("prefetch.tensormap [%0];" ::"l"((u64)&p.fold_map) : "memory");
        call_state.stopped = 0;
        routed_stores = RoutedStores{};
        if (p.calls != nullptr) {
            const u64 epoch = *(volatile const u64*)&p.calls->last + 1;
            call_state.epoch = epoch;
            call_state.routes = (epoch - 1) % 2 == 0 ? p.routes : p.routes_alt;  // set_of(epoch)
        } else {
            call_state.epoch = p.epoch;
            call_state.routes = p.routes;
        }
    }
    __syncthreads();
    // the partner multicasts into this block's stages and arrives on its barriers: not before
    // they are initialised
    if (C::CLUSTER > 1) cluster_sync();
    const u32 wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(C::PRODUCER_REGS) : "memory");
        if (threadIdx.x < 32) {
            if (threadIdx.x == 0) producer<C, Out, B_KN>(p, s);
        } else {
            storer<C, Out>(p, s, threadIdx.x - 32);
        }
    } else if (C::WARPGROUPS == 2 || wg == 1) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(C::CONSUMER_REGS) : "memory");
        // The skinny build hides the warpgroup's number from the optimiser: it is known to be 0
        // here, and ptxas, given that constant, spilled ~200 bytes in every skinny entry (in
        // the main build it is not known, nothing spills, and the code stays as it was).
        u32 cw = wg - 1;
        if (C::WARPGROUPS == 1) asm volatile("" : "+r"(cw));
        consumer<C, In, Out, B_KN>(p, s, cw);
    }
    // (the skinny build's third warpgroup has no rows to compute: it ends here, and no barrier
    // after the first counts it)
    // A block of a pair leaves only with its partner: until then the partner's loads may still
    // land in its stages and the partner's consumers arrive on its barriers. Every role's loop
    // ends, bounded, also where a wait gave up, so both blocks get here.
    if (C::CLUSTER > 1) cluster_sync();
}

#define COMMFUSE_GEMM_ENTRY(NAME, CFG, IN_T, OUT_T, KN)                                                 \
    extern "C" __global__ void __launch_bounds__(gemm::THREADS, 1) NAME(const __grid_constant__ GemmParams p) { \
        gemm_kernel<CFG, IN_T, OUT_T, KN>(p);                                                            \
    }
// One input type's six entries of a build: both B layouts, three output types.
#define COMMFUSE_GEMM_ENTRIES(PREFIX, IN, IN_T, CFG)                                      \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_nk_bf16, CFG, IN_T, __nv_bfloat16, false)           \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_kn_bf16, CFG, IN_T, __nv_bfloat16, true)            \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_nk_f16, CFG, IN_T, __half, false)                   \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_kn_f16, CFG, IN_T, __half, true)                    \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_nk_f32, CFG, IN_T, float, false)                    \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_kn_f32, CFG, IN_T, float, true)

// A direct build's plain entries (Cfg::PLAIN), 16-bit outputs only: <entry><SUFFIX>, the
// general entry's name with _plain (TAIL false) or _plain_tail (TAIL true).
#define COMMFUSE_GEMM_PLAIN_ENTRIES_AS(PREFIX, IN, IN_T, CFG, SUFFIX, TAIL)                                   \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_nk_bf16##SUFFIX, COMMFUSE_PLAIN_CFG(CFG, TAIL), IN_T, __nv_bfloat16, false) \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_kn_bf16##SUFFIX, COMMFUSE_PLAIN_CFG(CFG, TAIL), IN_T, __nv_bfloat16, true)  \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_nk_f16##SUFFIX, COMMFUSE_PLAIN_CFG(CFG, TAIL), IN_T, __half, false)         \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_kn_f16##SUFFIX, COMMFUSE_PLAIN_CFG(CFG, TAIL), IN_T, __half, true)
// (the comma of a template's arguments would split a macro argument)
#define COMMFUSE_PLAIN_CFG(CFG, TAIL) PlainOf<CFG, TAIL>
#define COMMFUSE_GEMM_PLAIN_ENTRIES(PREFIX, IN, IN_T, CFG) \
    COMMFUSE_GEMM_PLAIN_ENTRIES_AS(PREFIX, IN, IN_T, CFG, _plain, false)
#define COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(PREFIX, IN, IN_T, CFG) \
    COMMFUSE_GEMM_PLAIN_ENTRIES_AS(PREFIX, IN, IN_T, CFG, _plain_tail, true)
// A direct build's routed entries (Cfg::ROUTED), the output type the input's (a reduce-scatter's
// partials): <entry>_routed
#define COMMFUSE_GEMM_ROUTED_ENTRIES(PREFIX, IN, IN_T, CFG)                                        \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_nk_##IN##_routed, RoutedOf<CFG>, IN_T, IN_T, false) \
    COMMFUSE_GEMM_ENTRY(PREFIX##IN##_kn_##IN##_routed, RoutedOf<CFG>, IN_T, IN_T, true)

// The file compiles as one NVRTC program, or in parts side by side (ptxas takes minutes over
// all the entries on one core; the host compiles the parts in threads of their own):
// COMMFUSE_PART = 2 * build + input (input 0: bf16, 1: f16; builds in the order of
// `GemmVariant::ALL`) holds that build's entries for that input type, and the last part,
// GEMM_HELPER_PART, the helper kernels. Without COMMFUSE_PART, every entry.
#define GEMM_HELPER_PART 26
#ifdef COMMFUSE_PART
#define GEMM_IN_PART(PART) (COMMFUSE_PART == (PART))
#else
#define GEMM_IN_PART(PART) 1
#endif

// gemm_<input>_<B layout>_<output>: the main build; gemm_skinny_...: 128x256 tiles of at most
// 64 rows; gemm_narrow_...: 128x64 tiles of at most 64 rows; gemm_narrow_tall_...: 128x64 tiles;
// gemm_pair_...: the main build in clusters of two sharing B (launched with a cluster size of 2);
// gemm_mid_...: 128x128 tiles; gemm_direct_...: the main build's tiles on four stages, stored by
// the consumers (TMA tensor stores of shared-memory boxes); gemm_narrow_deep_...: the narrow
// build on twelve stages; gemm_narrow_sliced_...: the same with the K loop sliced over two
// consumer warpgroups; gemm_ping_pong_...: 128x128 tiles, whole tiles per consumer warpgroup;
// gemm_mid_direct_...: the same tiles, stages and boxes, both consumer warpgroups on each tile;
// gemm_short_...: 64x128 tiles on one consumer warpgroup
#if GEMM_IN_PART(0)
COMMFUSE_GEMM_ENTRIES(gemm_, bf16, __nv_bfloat16, MainCfg)
#endif
#if GEMM_IN_PART(1)
COMMFUSE_GEMM_ENTRIES(gemm_, f16, __half, MainCfg)
#endif
#if GEMM_IN_PART(2)
COMMFUSE_GEMM_ENTRIES(gemm_skinny_, bf16, __nv_bfloat16, SkinnyCfg)
#endif
#if GEMM_IN_PART(3)
COMMFUSE_GEMM_ENTRIES(gemm_skinny_, f16, __half, SkinnyCfg)
#endif
#if GEMM_IN_PART(4)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_, bf16, __nv_bfloat16, NarrowCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_narrow_, bf16, __nv_bfloat16, NarrowCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_narrow_, bf16, __nv_bfloat16, NarrowCfg)
#endif
#if GEMM_IN_PART(5)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_, f16, __half, NarrowCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_narrow_, f16, __half, NarrowCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_narrow_, f16, __half, NarrowCfg)
#endif
#if GEMM_IN_PART(6)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_tall_, bf16, __nv_bfloat16, NarrowTallCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_narrow_tall_, bf16, __nv_bfloat16, NarrowTallCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_narrow_tall_, bf16, __nv_bfloat16, NarrowTallCfg)
#endif
#if GEMM_IN_PART(7)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_tall_, f16, __half, NarrowTallCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_narrow_tall_, f16, __half, NarrowTallCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_narrow_tall_, f16, __half, NarrowTallCfg)
#endif
#if GEMM_IN_PART(8)
COMMFUSE_GEMM_ENTRIES(gemm_pair_, bf16, __nv_bfloat16, PairCfg)
#endif
#if GEMM_IN_PART(9)
COMMFUSE_GEMM_ENTRIES(gemm_pair_, f16, __half, PairCfg)
#endif
#if GEMM_IN_PART(10)
COMMFUSE_GEMM_ENTRIES(gemm_mid_, bf16, __nv_bfloat16, MidCfg)
#endif
#if GEMM_IN_PART(11)
COMMFUSE_GEMM_ENTRIES(gemm_mid_, f16, __half, MidCfg)
#endif
#if GEMM_IN_PART(12)
COMMFUSE_GEMM_ENTRIES(gemm_direct_, bf16, __nv_bfloat16, DirectCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_direct_, bf16, __nv_bfloat16, DirectCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_direct_, bf16, __nv_bfloat16, DirectCfg)
COMMFUSE_GEMM_ROUTED_ENTRIES(gemm_direct_, bf16, __nv_bfloat16, DirectCfg)
#endif
#if GEMM_IN_PART(13)
COMMFUSE_GEMM_ENTRIES(gemm_direct_, f16, __half, DirectCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_direct_, f16, __half, DirectCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_direct_, f16, __half, DirectCfg)
COMMFUSE_GEMM_ROUTED_ENTRIES(gemm_direct_, f16, __half, DirectCfg)
#endif
#if GEMM_IN_PART(14)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_deep_, bf16, __nv_bfloat16, NarrowDeepCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_narrow_deep_, bf16, __nv_bfloat16, NarrowDeepCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_narrow_deep_, bf16, __nv_bfloat16, NarrowDeepCfg)
#endif
#if GEMM_IN_PART(15)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_deep_, f16, __half, NarrowDeepCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_narrow_deep_, f16, __half, NarrowDeepCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_narrow_deep_, f16, __half, NarrowDeepCfg)
#endif
#if GEMM_IN_PART(16)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_sliced_, bf16, __nv_bfloat16, NarrowSlicedCfg)
#endif
#if GEMM_IN_PART(17)
COMMFUSE_GEMM_ENTRIES(gemm_narrow_sliced_, f16, __half, NarrowSlicedCfg)
#endif
#if GEMM_IN_PART(18)
COMMFUSE_GEMM_ENTRIES(gemm_ping_pong_, bf16, __nv_bfloat16, PingPongCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_ping_pong_, bf16, __nv_bfloat16, PingPongCfg)
#endif
#if GEMM_IN_PART(19)
COMMFUSE_GEMM_ENTRIES(gemm_ping_pong_, f16, __half, PingPongCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_ping_pong_, f16, __half, PingPongCfg)
#endif
#if GEMM_IN_PART(20)
COMMFUSE_GEMM_ENTRIES(gemm_mid_direct_, bf16, __nv_bfloat16, MidDirectCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_mid_direct_, bf16, __nv_bfloat16, MidDirectCfg)
#endif
#if GEMM_IN_PART(21)
COMMFUSE_GEMM_ENTRIES(gemm_mid_direct_, f16, __half, MidDirectCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_mid_direct_, f16, __half, MidDirectCfg)
#endif
#if GEMM_IN_PART(22)
COMMFUSE_GEMM_ENTRIES(gemm_short_, bf16, __nv_bfloat16, ShortCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_short_, bf16, __nv_bfloat16, ShortCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_short_, bf16, __nv_bfloat16, ShortCfg)
#endif
#if GEMM_IN_PART(23)
COMMFUSE_GEMM_ENTRIES(gemm_short_, f16, __half, ShortCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_short_, f16, __half, ShortCfg)
COMMFUSE_GEMM_PLAIN_TAIL_ENTRIES(gemm_short_, f16, __half, ShortCfg)
#endif

#if GEMM_IN_PART(24)
COMMFUSE_GEMM_ENTRIES(gemm_ping_pong_wide_, bf16, __nv_bfloat16, PingPongWideCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_ping_pong_wide_, bf16, __nv_bfloat16, PingPongWideCfg)
COMMFUSE_GEMM_ROUTED_ENTRIES(gemm_ping_pong_wide_, bf16, __nv_bfloat16, PingPongWideCfg)
#endif
#if GEMM_IN_PART(25)
COMMFUSE_GEMM_ENTRIES(gemm_ping_pong_wide_, f16, __half, PingPongWideCfg)
COMMFUSE_GEMM_PLAIN_ENTRIES(gemm_ping_pong_wide_, f16, __half, PingPongWideCfg)
COMMFUSE_GEMM_ROUTED_ENTRIES(gemm_ping_pong_wide_, f16, __half, PingPongWideCfg)
#endif

#if GEMM_IN_PART(GEMM_HELPER_PART)
// ---- a consumer of flagged tiles, for the GPU test of the release/acquire protocol -------------

// Mirrored by `SnapshotParams` in src/gemm.rs.
struct SnapshotParams {
    const u32* order;          // the GEMM's tile order: tiles are awaited in the order they are made
    u64 src;                   // the buffer the GEMM writes (row-major [M, N], on this GPU)
    u64 snap;                  // where the tiles are copied the moment their flag is seen
    u64 flags;                 // one u64 flag per tile, on this GPU
    u64 expected;              // a tile is ready when its flag >= expected
    volatile ErrorRecord* err;
    u64 timeout_ns;
    u32 m, n, tiles_n, tile_count, elem_bytes, rank;
};

// Block b takes order entries b, b + grid, ...: waits for the tile's flag (acquire, system
// scope), then copies the tile out. A tile read before all of its stores were visible shows up
// as a difference between `snap` and the final contents of `src`.
extern "C" __global__ void __launch_bounds__(256) tile_snapshot(const SnapshotParams p) {
    __shared__ int ready;
    for (u32 i = blockIdx.x; i < p.tile_count; i += gridDim.x) {
        const u32 t = p.order[i], tm = t / p.tiles_n, tn = t % p.tiles_n;
        if (threadIdx.x == 0)
            ready = wait_signal((const u64*)p.flags + t, CMP_GE, p.expected, p.timeout_ns, p.err, p.rank, blockIdx.x, i, t);
        __syncthreads();
        if (!ready) return;
        const u32 rows = min(gemm::BM, (int)(p.m - tm * gemm::BM));
        const u32 halves = min(gemm::BN, (int)(p.n - tn * gemm::BN)) * p.elem_bytes / 2;  // 2-byte words per row
        for (u32 idx = threadIdx.x; idx < rows * halves; idx += blockDim.x) {
            const u32 row = idx / halves, h = idx % halves;
            const u64 off = ((u64)(tm * gemm::BM + row) * p.n + tn * gemm::BN) * p.elem_bytes + 2 * h;
            *(unsigned short*)(p.snap + off) = *(const unsigned short*)(p.src + off);
        }
        __syncthreads();
    }
}

// ---- a kernel that holds SMs, for the GPU test of the split tail's residency ------------------

// Mirrored by `HoldParams` in src/gemm.rs; all three counters in host-mapped memory.
struct HoldParams {
    u32* arrived;        // blocks that have started
    u32* timed_out;      // blocks that ended at the bound instead of being released
    const u32* release;  // set by the host: every block ends
    u64 timeout_ns;      // how long a block holds its SM at most
};

// Each block (one per SM: the dynamic shared memory it is launched with leaves no room for a
// second one, nor for a GEMM block) counts itself in, then spins until the host releases it
// or the bound passes. Stands for another stream's kernel that keeps SMs busy while a GEMM
// is launched.
extern "C" __global__ void __launch_bounds__(32) hold_sms(const HoldParams p) {
    if (threadIdx.x != 0) return;
    atomicAdd_system(p.arrived, 1u);
    const u64 start = global_timer_ns();
    while (*(volatile const u32*)p.release == 0) {
        if (global_timer_ns() - start > p.timeout_ns) {
            atomicAdd_system(p.timed_out, 1u);
            return;
        }
    }
}

// ---- a side kernel that raises a fold's flags at a GEMM's pace, for the bench's paced fold rows -

// Mirrored by `PacedFlagsParams` in src/gemm/bench.rs.
struct PacedFlagsParams {
    u64* flags;         // count x tiles: partial f of tile t at flags[f * tiles + t]
    const u32* order;   // the GEMM's tile order
    u32 tiles, count;
    u32 per_wave;       // tiles of the order that one wave of the GEMM runs (its grid)
    u32 pad;
    u64 value;          // the call's number, stored into every flag
    u64 wave_ns;        // one wave's time (the same GEMM with its flags already up)
    u64 offset_ns;      // how long after its wave starts a tile's flags go up
};
static_assert(sizeof(PacedFlagsParams) == 56, "layout mirrored by PacedFlagsParams in src/gemm/bench.rs");

// One warp, beside a GEMM capped below the GPU's SMs: stands for the peers whose partials the
// GEMM folds in, each finishing its tile of wave w at w · wave_ns + offset_ns from the start,
// so that the fold finds its flags raised during the tile's own main loop rather than long
// before. Every wait is bounded by the last wave's time.
extern "C" __global__ void __launch_bounds__(32) raise_flags_paced(const PacedFlagsParams p) {
    const u64 start = __shfl_sync(0xffffffffu, global_timer_ns(), 0);
    for (u32 w = 0; w * p.per_wave < p.tiles; ++w) {
        const u64 at = start + w * p.wave_ns + p.offset_ns;
        // (asleep between looks: where the warp shares an SM with a GEMM block, it takes few of
        // its issue slots)
        while (global_timer_ns() < at) __nanosleep(500);
        const u32 end = min(p.tiles, (w + 1) * p.per_wave);
        for (u32 j = w * p.per_wave + threadIdx.x; j < end; j += 32) {
            const u32 t = p.order[j];
            for (u32 f = 0; f < p.count; ++f) store_release_sys(p.flags + (u64)f * p.tiles + t, p.value);
        }
    }
}
#endif  // GEMM_IN_PART(GEMM_HELPER_PART)
