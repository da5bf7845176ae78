//! Our Hopper GEMM (`gemm.cu`, beside this module) on one GPU: a [`GemmPlan`] (problem, tile
//! order, destinations, flags, epilogue) becomes TMA descriptors, a tile-order table and a
//! per-tile route table (destination address and leading dimension, flag address and value) in
//! device memory, and one launch of a persistent grid capped at any number of SMs.
//!
//! Destinations on other GPUs are addresses in their memory as this GPU sees it (peer access
//! enabled): the storer warps' stores then cross NVLink and the flag is raised there.
//!
//! Beside it: `GEMM-NOTES.md` (the kernel's design and what each version measured) and
//! [`bench`](mod@bench), its bench beside cuBLASLt, with the float64 reference GEMM on the
//! device (`reference_gemm.cu`) that the GEMM benches check every output element against.

pub mod bench;
#[cfg(test)]
mod ring_model;
pub mod tail;
pub mod trace;

pub use tail::{plan_tail, tail_split, TailChoice, TailMode, TailPlan, TailUnit, TAIL_ENV};

use crate::backend::plan_table::ErrorRecord;
use crate::error::CudaError;
use crate::sys::driver::{
    copy_2d, tensor_map_2d, CallOrder, DeviceMemory, Function, Gpu, MappedHost, Module, Stream,
};
use crate::sys::host_sync::poll_until;
use crate::sys::nvrtc;
use bytemuck::{Pod, Zeroable};
use commfuse_core::gemm::{BLayout, Epilogue, GemmPlan, GemmProblem, TileShape};
use commfuse_core::plan::{NotifyOp, Slot};
use commfuse_core::DType;
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

/// The kernel's output tile (the main and the skinny build, and every fused operator's).
pub const TILE: TileShape = commfuse_core::gemm::KERNEL_TILE;
/// The narrow builds' tile: where a skinny M over [`TILE`]s would leave most SMs without a
/// tile, a quarter of their width makes four times as many (N = 8192: 128 instead of 32).
pub const NARROW_TILE: TileShape = TileShape { m: 128, n: 64 };
/// The mid build's tile: half as wide as [`TILE`], twice as many tiles for products of a few
/// hundred to a few thousand rows.
pub const MID_TILE: TileShape = TileShape { m: 128, n: 128 };
/// The short build's tile: a [`MID_TILE`]'s width on 64 rows, for products of a few hundred
/// rows whose wider tiles would leave SMs idle (256 × 4096: 128 tiles, each with its whole K
/// loop).
pub const SHORT_TILE: TileShape = TileShape { m: 64, n: 128 };
/// The wide ping-pong build's tile: each consumer warpgroup computes a whole tile of 128 rows
/// and 192 columns (192 accumulators a thread), the two taking turns, so that one's epilogue
/// runs under the other's main loop (cuBLASLt's fastest kernel at 8192 × 8192 × 3584 works so
/// on tiles of 128 × 176).
pub const WIDE_TILE: TileShape = TileShape { m: 128, n: 192 };

/// Whether the wide ping-pong build takes the routes of a GEMM + reduce-scatter whose output
/// is `output` from `input`, in rows of `n` elements: its routed entries store an output of the
/// input's 16-bit type, and its fold loads the partials by a tensor map, which needs rows of
/// whole 16-byte units.
pub fn wide_routes_fit(input: DType, output: DType, n: usize) -> bool {
    output == input && output.size() == 2 && (n * output.size()).is_multiple_of(16)
}
const THREADS: u32 = 384;
const STAGES: u32 = 3;
/// K depth of one pipeline stage (one 128-byte swizzle row of 16-bit elements).
const BK: usize = 64;
/// Mirrors `gemm::STATIC_SMEM_BYTES` in gemm.cu: the kernel's static shared memory (its call
/// state), padded so that the dynamic area after it starts on a 1024-byte boundary.
const STATIC_SMEM_BYTES: u32 = 1024;
/// The most dynamic shared memory a block of the kernel can have beside its static area.
const DYNAMIC_SMEM_LIMIT: u32 = 227 * 1024 - STATIC_SMEM_BYTES;
// the largest builds' areas fit beside it (and every build's: a unit test)
const _: () = assert!(
    SMEM_BYTES <= DYNAMIC_SMEM_LIMIT
        && NARROW_TALL_SMEM_BYTES <= DYNAMIC_SMEM_LIMIT
        && DIRECT_SMEM_BYTES <= DYNAMIC_SMEM_LIMIT
        && PING_PONG_SMEM_BYTES <= DYNAMIC_SMEM_LIMIT
        && PING_PONG_WIDE_SMEM_BYTES <= DYNAMIC_SMEM_LIMIT
);
/// Mirrors `Cfg::SMEM_BYTES` in gemm.cu for a build of `rows` × `cols` tiles and `stages`
/// stages: the stages, the staged tile (rows of 2 · `cols` + 16 bytes) and the mbarriers (the
/// dynamic area).
const fn smem_bytes(rows: usize, cols: usize, stages: u32) -> u32 {
    stages * ((rows + cols) * BK * 2) as u32
        + rows as u32 * (2 * cols as u32 + 16)
        + 8 * (2 * stages + 2)
}
/// Mirrors `Cfg::SMEM_BYTES` of a build whose consumers store their tiles themselves
/// ([`GemmVariant::stores_directly`]): [`smem_bytes`] with two boxes a consumer warpgroup
/// (one per 64 rows) instead of the staged tile.
const fn direct_smem_bytes(rows: usize, cols: usize, stages: u32) -> u32 {
    smem_bytes(rows, cols, stages) - rows as u32 * (2 * cols as u32 + 16)
        + (rows / 64 * 2 * DIRECT_BOX.0 * DIRECT_BOX.1) as u32
}
/// Mirrors `gemm::SMEM_BYTES` in gemm.cu.
const SMEM_BYTES: u32 = smem_bytes(TILE.m, TILE.n, STAGES);
/// Rows of a tile the skinny and the narrow build compute (`SkinnyCfg`, `NarrowCfg` in
/// gemm.cu): plans whose tiles all have at most this many rows can run on them.
pub const SKINNY_ROWS: usize = 64;
const SKINNY_STAGES: u32 = 4;
/// Mirrors `SkinnyCfg::SMEM_BYTES` in gemm.cu: a 64-row A box per stage, four stages, a 64-row
/// staged tile.
const SKINNY_SMEM_BYTES: u32 = smem_bytes(SKINNY_ROWS, TILE.n, SKINNY_STAGES);
/// Stages of the narrow builds: 16 KiB each (24 KiB with 128 rows), eight keep 64 KiB of B in
/// flight per SM.
const NARROW_STAGES: u32 = 8;
/// Mirrors `NarrowCfg::SMEM_BYTES` in gemm.cu.
const NARROW_SMEM_BYTES: u32 = direct_smem_bytes(SKINNY_ROWS, NARROW_TILE.n, NARROW_STAGES);
/// Mirrors `NarrowTallCfg::SMEM_BYTES` in gemm.cu.
const NARROW_TALL_SMEM_BYTES: u32 = direct_smem_bytes(NARROW_TILE.m, NARROW_TILE.n, NARROW_STAGES);
/// Stages of the narrow-deep build: twelve of 16 KiB (thirteen fit).
const NARROW_DEEP_STAGES: u32 = 12;
/// Mirrors `NarrowDeepCfg::SMEM_BYTES` in gemm.cu.
const NARROW_DEEP_SMEM_BYTES: u32 =
    direct_smem_bytes(SKINNY_ROWS, NARROW_TILE.n, NARROW_DEEP_STAGES);
/// Mirrors `NarrowSlicedCfg::SMEM_BYTES` in gemm.cu: the narrow-deep build's stages with a
/// staged tile, and the second warpgroup's f32 sums of a 64 × 64 tile, handed over through
/// shared memory.
const NARROW_SLICED_SMEM_BYTES: u32 = smem_bytes(SKINNY_ROWS, NARROW_TILE.n, NARROW_DEEP_STAGES)
    + (SKINNY_ROWS * NARROW_TILE.n * 4) as u32;
/// Stages of the mid build: 32 KiB each; a sixth does not fit beside the staged tile.
const MID_STAGES: u32 = 5;
/// Mirrors `MidCfg::SMEM_BYTES` in gemm.cu.
const MID_SMEM_BYTES: u32 = smem_bytes(MID_TILE.m, MID_TILE.n, MID_STAGES);
/// Stages of the direct build: the staged tile's shared memory makes the fourth.
const DIRECT_STAGES: u32 = 4;
/// The direct build's boxes (`DirectCfg::BOX_BYTES`): 64 rows of 128 bytes, the tensor store's
/// unit; two per consumer warpgroup.
const DIRECT_BOX: (usize, usize) = (64, 128);
/// Mirrors `DirectCfg::SMEM_BYTES` in gemm.cu.
const DIRECT_SMEM_BYTES: u32 = direct_smem_bytes(TILE.m, TILE.n, DIRECT_STAGES);

/// Stages of the ping-pong build: 32 KiB each (a [`MID_TILE`]'s k-block), beside four boxes.
const PING_PONG_STAGES: u32 = 6;
/// Mirrors `PingPongCfg::SMEM_BYTES` in gemm.cu.
const PING_PONG_SMEM_BYTES: u32 = direct_smem_bytes(MID_TILE.m, MID_TILE.n, PING_PONG_STAGES);
/// Stages of the wide ping-pong build: 40 KiB each (a [`WIDE_TILE`]'s k-block), beside four
/// boxes; a fifth does not fit.
const PING_PONG_WIDE_STAGES: u32 = 4;
/// Mirrors `PingPongWideCfg::SMEM_BYTES` in gemm.cu (with the barriers of its four box
/// buffers, `Cfg::FOLD_BARRIERS`).
const PING_PONG_WIDE_SMEM_BYTES: u32 =
    direct_smem_bytes(WIDE_TILE.m, WIDE_TILE.n, PING_PONG_WIDE_STAGES) + 8 * 4;
/// Stages of the short build: 24 KiB each (a [`SHORT_TILE`]'s k-block), beside two boxes.
const SHORT_STAGES: u32 = 8;
/// Mirrors `ShortCfg::SMEM_BYTES` in gemm.cu.
const SHORT_SMEM_BYTES: u32 = direct_smem_bytes(SHORT_TILE.m, SHORT_TILE.n, SHORT_STAGES);

/// Which build of the kernel a [`PreparedGemm`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmVariant {
    /// All 128 rows of each [`TILE`], two consumer warpgroups, 3 pipeline stages
    Main,
    /// The first [`SKINNY_ROWS`] rows of each [`TILE`], one consumer warpgroup, 4 stages: for
    /// plans whose tiles have no more rows (decode sizes), where the main build's second
    /// warpgroup and half of each A stage would stay empty
    Skinny,
    /// The first [`SKINNY_ROWS`] rows of each [`NARROW_TILE`] (wgmma m64n64k16), one consumer
    /// warpgroup, 8 stages: plans of narrow tiles whose bands have no more rows. The narrow
    /// builds' consumers store their tiles themselves, as the direct build's do (plain GEMMs)
    Narrow,
    /// All 128 rows of each [`NARROW_TILE`], two consumer warpgroups, 8 stages
    NarrowTall,
    /// The main build in clusters of [`PAIR`] blocks whose tiles share their columns: each
    /// block loads its A and half of the k-block's B, which TMA multicast writes into both
    /// blocks' stages, so that an SM reads 32 KiB of each k-block from L2 instead of 48. The
    /// host pairs the order's tiles column by column ([`pair_order`]); no split tail
    Pair,
    /// All 128 rows of each [`MID_TILE`] (wgmma m64n128k16), two consumer warpgroups, 5 stages
    Mid,
    /// The main build whose consumer warpgroups store their tiles into D themselves, each
    /// through two boxes of shared memory that TMA tensor stores write out (from registers
    /// where a box would overrun the tile's band, or where D is added to), with the rest of
    /// the staged tile's shared memory spent on a fourth stage: plain GEMMs only (no routes or
    /// gather)
    Direct,
    /// The narrow build on [`NARROW_DEEP_STAGES`] stages instead of 8: more of the weights'
    /// bytes in flight at decode sizes, where the narrow build reads them at about half of
    /// HBM's bandwidth
    NarrowDeep,
    /// The narrow-deep build with each unit's K loop sliced over two consumer warpgroups, each
    /// on every other k-block into sums of its own, which the second hands to the first
    /// through shared memory before the epilogue: two chains of dependent wgmmas per SM where
    /// the narrow builds run one
    NarrowSliced,
    /// [`MID_TILE`]s, each consumer warpgroup computing whole tiles of its own (two m64n128k16
    /// wgmmas a k16 step), the two taking a block's units in turn, so that one's epilogue (the
    /// direct build's, from its own boxes) runs under the other's main loop; six stages of
    /// 32 KiB. Plain GEMMs only, and no split tail
    PingPong,
    /// The ping-pong build's tiles, stages and boxes with both consumer warpgroups on each
    /// tile (64 rows each, as in the mid build) instead of in turns: plain GEMMs and gathers
    MidDirect,
    /// [`SHORT_TILE`]s (wgmma m64n128k16) on one consumer warpgroup, [`SHORT_STAGES`] stages,
    /// stored by the consumers' boxes: plain GEMMs and gathers
    Short,
    /// The ping-pong build on [`WIDE_TILE`]s (two m64n192k16 wgmmas a k16 step, 192
    /// accumulators a thread), four stages of 40 KiB: plain GEMMs, and routes through its
    /// routed entries ([`GemmVariant::general_entry_takes_routes`]); no gather, no split tail
    PingPongWide,
}

/// Blocks in a cluster of the pair build.
pub const PAIR: u32 = 2;

impl GemmVariant {
    /// Every build, in the order of their entry points in gemm.cu.
    pub const ALL: [GemmVariant; 13] = [
        GemmVariant::Main,
        GemmVariant::Skinny,
        GemmVariant::Narrow,
        GemmVariant::NarrowTall,
        GemmVariant::Pair,
        GemmVariant::Mid,
        GemmVariant::Direct,
        GemmVariant::NarrowDeep,
        GemmVariant::NarrowSliced,
        GemmVariant::PingPong,
        GemmVariant::MidDirect,
        GemmVariant::Short,
        GemmVariant::PingPongWide,
    ];

    /// Rows of the build's A stage (its largest A box) and of the staged tile.
    fn rows(self) -> usize {
        match self {
            GemmVariant::Main
            | GemmVariant::NarrowTall
            | GemmVariant::Pair
            | GemmVariant::Mid
            | GemmVariant::Direct
            | GemmVariant::PingPong
            | GemmVariant::PingPongWide
            | GemmVariant::MidDirect => TILE.m,
            GemmVariant::Skinny
            | GemmVariant::Narrow
            | GemmVariant::NarrowDeep
            | GemmVariant::NarrowSliced
            | GemmVariant::Short => SKINNY_ROWS,
        }
    }

    /// The tile of the plans it computes.
    pub fn tile(self) -> TileShape {
        match self {
            GemmVariant::Main | GemmVariant::Skinny | GemmVariant::Pair | GemmVariant::Direct => {
                TILE
            }
            GemmVariant::Narrow
            | GemmVariant::NarrowTall
            | GemmVariant::NarrowDeep
            | GemmVariant::NarrowSliced => NARROW_TILE,
            GemmVariant::Mid | GemmVariant::PingPong | GemmVariant::MidDirect => MID_TILE,
            GemmVariant::Short => SHORT_TILE,
            GemmVariant::PingPongWide => WIDE_TILE,
        }
    }

    /// Blocks per cluster of its launches (1: no clusters).
    pub fn cluster(self) -> u32 {
        match self {
            GemmVariant::Pair => PAIR,
            _ => 1,
        }
    }

    fn smem_bytes(self) -> u32 {
        match self {
            GemmVariant::Main | GemmVariant::Pair => SMEM_BYTES,
            GemmVariant::Skinny => SKINNY_SMEM_BYTES,
            GemmVariant::Narrow => NARROW_SMEM_BYTES,
            GemmVariant::NarrowTall => NARROW_TALL_SMEM_BYTES,
            GemmVariant::NarrowDeep => NARROW_DEEP_SMEM_BYTES,
            GemmVariant::NarrowSliced => NARROW_SLICED_SMEM_BYTES,
            GemmVariant::Mid => MID_SMEM_BYTES,
            GemmVariant::Direct => DIRECT_SMEM_BYTES,
            GemmVariant::PingPong | GemmVariant::MidDirect => PING_PONG_SMEM_BYTES,
            GemmVariant::Short => SHORT_SMEM_BYTES,
            GemmVariant::PingPongWide => PING_PONG_WIDE_SMEM_BYTES,
        }
    }

    /// Its entry points' prefix in gemm.cu (`gemm_`, `gemm_skinny_`, …): an entry is named
    /// `<prefix><input>_<B layout>_<output>`.
    pub fn prefix(self) -> &'static str {
        match self {
            GemmVariant::Main => "gemm_",
            GemmVariant::Skinny => "gemm_skinny_",
            GemmVariant::Narrow => "gemm_narrow_",
            GemmVariant::NarrowTall => "gemm_narrow_tall_",
            GemmVariant::NarrowDeep => "gemm_narrow_deep_",
            GemmVariant::NarrowSliced => "gemm_narrow_sliced_",
            GemmVariant::Pair => "gemm_pair_",
            GemmVariant::Mid => "gemm_mid_",
            GemmVariant::Direct => "gemm_direct_",
            GemmVariant::PingPong => "gemm_ping_pong_",
            GemmVariant::MidDirect => "gemm_mid_direct_",
            GemmVariant::Short => "gemm_short_",
            GemmVariant::PingPongWide => "gemm_ping_pong_wide_",
        }
    }

    /// Most K parts a tile of the split tail is cut into. The skinny build is bound by the
    /// loads' latency, not by the tensor cores, and there each further part costs more (part 0
    /// waits for its helpers and adds their partials) than its share of the K loop saves: at
    /// 16 and 64 × 8192 × 3584 on one H200, 1, 2, 3 and 4 parts took 32.3, 28.0, 29.3 and
    /// 31.7 µs (16 rows) and 34.3, 31.2, 32.5 and 35.6 µs (64 rows). The narrow builds are
    /// bound the same way and take the same limit, and so does the short build, whose one
    /// consumer warpgroup is theirs on a wider tile. The main build's tail of
    /// up to four parts measured best where it was designed for (GEMM-NOTES.md, v3: a last,
    /// partial wave after whole ones); where the whole product is one partial wave (`one_wave`:
    /// fewer tiles than SMs, a small M) three parts were faster than four: 40.0 against 41.5 µs
    /// at 128 × 8192 × 3584 (and 33.6 against 35.7 at 16 rows). The pair build has no split
    /// tail: both blocks of a cluster must run the same K range of every unit, nor the ping-pong
    /// build, whose warpgroups each hold a whole tile (the tail's partials are laid out as two
    /// warpgroups' halves). The mid and the
    /// direct build are the main build on narrower tiles or with another epilogue and take its
    /// limits.
    pub fn max_parts(self, one_wave: bool) -> usize {
        match self {
            GemmVariant::Main | GemmVariant::Mid | GemmVariant::Direct if one_wave => 3,
            // (its one partial wave whole: cut in two at 128 × 8192 × 3584, its 64 tiles ran
            // 5 % behind the ping-pong build's whole ones)
            GemmVariant::MidDirect if one_wave => 1,
            GemmVariant::Main | GemmVariant::Mid | GemmVariant::Direct | GemmVariant::MidDirect => {
                MAX_PARTS
            }
            GemmVariant::Skinny
            | GemmVariant::Narrow
            | GemmVariant::NarrowTall
            | GemmVariant::NarrowDeep
            | GemmVariant::NarrowSliced
            | GemmVariant::Short => 2,
            GemmVariant::Pair | GemmVariant::PingPong | GemmVariant::PingPongWide => 1,
        }
    }

    /// How this build shares out its tail under `choice` ([`TailChoice`]): its
    /// [`GemmVariant::max_parts`] either way; stream-K only where it cuts at all (not the
    /// pair build, whose two blocks of a cluster run the same K range of every unit, nor the
    /// ping-pong build).
    pub fn tail_mode(self, choice: TailChoice, one_wave: bool) -> TailMode {
        let max_parts = self.max_parts(one_wave);
        match choice {
            TailChoice::StreamK if max_parts > 1 => TailMode::StreamK { max_parts },
            _ => TailMode::Cut { max_parts },
        }
    }

    /// `main`, `skinny`, `narrow`, `narrow-tall`, `pair`, `mid`, `direct`, `narrow-deep`,
    /// `narrow-sliced`, `ping-pong`, `mid-direct`, `short` or `ping-pong-wide`.
    pub fn name(self) -> &'static str {
        match self {
            GemmVariant::Main => "main",
            GemmVariant::Skinny => "skinny",
            GemmVariant::Narrow => "narrow",
            GemmVariant::NarrowTall => "narrow-tall",
            GemmVariant::Pair => "pair",
            GemmVariant::Mid => "mid",
            GemmVariant::Direct => "direct",
            GemmVariant::NarrowDeep => "narrow-deep",
            GemmVariant::NarrowSliced => "narrow-sliced",
            GemmVariant::PingPong => "ping-pong",
            GemmVariant::MidDirect => "mid-direct",
            GemmVariant::Short => "short",
            GemmVariant::PingPongWide => "ping-pong-wide",
        }
    }

    /// Whether the build also has plain entries (`<entry>_plain`, 16-bit outputs): the same
    /// kernel with every option but alpha compiled out, which [`PreparedGemm`] launches for
    /// the calls that ask for none ([`entry_for`]). The builds whose consumers store their
    /// tiles themselves, which `auto` runs for plain GEMMs.
    pub fn has_plain_entries(self) -> bool {
        self.stores_directly()
    }

    /// Whether the build also has plain entries that keep the split tail
    /// (`<entry>_plain_tail`), for the calls that [`entry_for`] would send to a plain entry
    /// but for their tail: the direct build, whose large products' last wave is cut along K,
    /// and the narrow, narrow-deep and narrow-tall builds, whose few tiles (decode sizes of N up
    /// to about 4096, whole bands where [`narrow_bands_pay`]) are cut along K where they are
    /// at most half of the SMs, and the short build, whose few-tile products are cut the same
    /// way.
    pub fn has_plain_tail_entries(self) -> bool {
        matches!(
            self,
            GemmVariant::Direct
                | GemmVariant::Narrow
                | GemmVariant::NarrowDeep
                | GemmVariant::NarrowTall
                | GemmVariant::Short
        )
    }

    /// Whether the build also has routed entries (`<entry>_routed`, output type = input
    /// type): the general entry with the options of the other operators compiled out (the
    /// all-gather's band waits and local rows, β·C, D +=), for GEMM + reduce-scatter's routed
    /// calls and plain calls with a bias ([`entry_for`]). The direct build, whose consumers
    /// store routed tiles themselves: through its general entry such a call re-derived its
    /// stages' addresses in every k-block under register pressure. And the wide ping-pong
    /// build, which takes routes through them only ([`GemmVariant::general_entry_takes_routes`])
    /// and runs its plain calls with a bias through its general entry.
    pub fn has_routed_entries(self) -> bool {
        matches!(self, GemmVariant::Direct | GemmVariant::PingPongWide)
    }

    /// Whether its general entry stores tiles along routes too: not the wide ping-pong
    /// build's, whose general entries compiled with the routes' stores and folds spilled
    /// (its routed entries take them: output of the input's type, no β·C, no D +=).
    pub(crate) fn general_entry_takes_routes(self) -> bool {
        self != GemmVariant::PingPongWide
    }

    /// The name of its general entry for these input and output types and B layout in
    /// gemm.cu: `<prefix><input>_<B layout>_<output>` (the plain ones add a suffix).
    fn entry_name(self, input: DType, layout: BLayout, output: DType) -> String {
        let layout = match layout {
            BLayout::NK => "nk",
            BLayout::KN => "kn",
        };
        format!(
            "{}{}_{layout}_{}",
            self.prefix(),
            type_name(input),
            type_name(output)
        )
    }

    /// Every entry point of the build for `input` that gemm.cu's part of it holds
    /// ([`gemm_part`]) and [`GemmKernels`] loads: the general entries of both B layouts and
    /// the three output types, for 16-bit outputs its plain ones
    /// ([`GemmVariant::has_plain_entries`], [`GemmVariant::has_plain_tail_entries`]) and for
    /// the input's type its routed ones ([`GemmVariant::has_routed_entries`]).
    pub fn entry_names(self, input: DType) -> Vec<String> {
        let mut names = Vec::new();
        for layout in [BLayout::NK, BLayout::KN] {
            for output in [DType::BF16, DType::F16, DType::F32] {
                let name = self.entry_name(input, layout, output);
                for (has, suffix) in [
                    (self.has_plain_entries(), PLAIN_SUFFIX),
                    (self.has_plain_tail_entries(), PLAIN_TAIL_SUFFIX),
                ] {
                    if has && output.size() == 2 {
                        names.push(format!("{name}{suffix}"));
                    }
                }
                if self.has_routed_entries() && output == input {
                    names.push(format!("{name}{ROUTED_SUFFIX}"));
                }
                names.push(name);
            }
        }
        names
    }

    /// Whether it takes tiles with routes although its consumers store tiles themselves: the
    /// direct and the mid-direct build, whose warpgroups share each tile, and the wide
    /// ping-pong build, whose warpgroups take whole tiles in turns (see `tile_dst` and
    /// `raise_routed_flags` in gemm.cu). Their stores go by boxes where [`box_routes`] gives
    /// the routes a map, else from registers; each tile's flag goes up once every warpgroup's
    /// stores of it have been waited for.
    fn routes_by_consumers(self) -> bool {
        matches!(
            self,
            GemmVariant::Direct | GemmVariant::MidDirect | GemmVariant::PingPongWide
        )
    }

    /// Whether its consumers store tiles themselves (into D through a tensor map of D where
    /// [`d_map_fits`], or along routes: [`GemmVariant::routes_by_consumers`]).
    fn stores_directly(self) -> bool {
        matches!(
            self,
            GemmVariant::Direct
                | GemmVariant::PingPong
                | GemmVariant::PingPongWide
                | GemmVariant::MidDirect
                | GemmVariant::Narrow
                | GemmVariant::NarrowTall
                | GemmVariant::NarrowDeep
                | GemmVariant::Short
        )
    }
}

/// Which build GEMMs prepared from a [`GemmKernels`] use ([`GemmKernels::set_choice`]); the
/// environment variable [`VARIANT_ENV`] sets it when the kernels are loaded. A plan's tile
/// decides between the two families ([`TILE`]: main and skinny; [`NARROW_TILE`]: narrow and
/// narrow-tall), so the choice also says which tile to plan with ([`VariantChoice::tile_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VariantChoice {
    /// [`SHORT_TILE`]s where [`short_tiles_pay`] says so (the short build), else narrow
    /// tiles where [`narrow_pays`] (unless [`mid_tiles_pay_over_narrow`]) or
    /// [`narrow_bands_pay`] says so,
    /// [`MID_TILE`]s where [`mid_tiles_pay`] does, else [`TILE`]s; the 64-row build of the
    /// plan's tile wherever every tile has at most [`SKINNY_ROWS`] rows (narrow-deep up to
    /// [`NARROW_DEEP_ROWS`]), else the 128-row one: for [`TILE`]s the direct build, for
    /// [`MID_TILE`]s the ping-pong build ([`ping_pong_pays`]) or else the mid-direct one; the
    /// fused operators' GEMMs with routes trade the direct builds for the main and the mid one
    /// (which fold partials through their stages)
    Auto,
    /// [`TILE`]s; always the 128-row build (main, or narrow-tall for a plan of narrow tiles)
    Main,
    /// [`TILE`]s; the 64-row build wherever it can compute the plan (every tile at most
    /// [`SKINNY_ROWS`] rows), the 128-row one elsewhere
    Skinny,
    /// [`NARROW_TILE`]s wherever M fits one band of them (M ≤ 128), else [`TILE`]s; the
    /// 64-row build wherever it can compute the plan, the 128-row one elsewhere
    Narrow,
    /// [`TILE`]s; the pair build wherever a tile has more than [`SKINNY_ROWS`] rows, the
    /// skinny one elsewhere (a plan of [`NARROW_TILE`]s: as [`VariantChoice::Main`]); the
    /// fused operators' GEMMs (with routes or a gather) keep the main build
    Pair,
    /// [`MID_TILE`]s, always (the mid build)
    Mid,
    /// [`TILE`]s; the direct build wherever a tile has more than [`SKINNY_ROWS`] rows, the
    /// skinny one elsewhere (as [`VariantChoice::Pair`]); the fused operators' GEMMs too
    /// (their consumers store the tiles along the routes)
    Direct,
    /// As [`VariantChoice::Narrow`] with the narrow-deep build in the narrow build's place
    NarrowDeep,
    /// As [`VariantChoice::Narrow`] with the narrow-sliced build in the narrow build's place
    NarrowSliced,
    /// [`MID_TILE`]s, always, on the ping-pong build (the fused operators' GEMMs on the mid
    /// build)
    PingPong,
    /// [`MID_TILE`]s, always, on the mid-direct build (the GEMMs with routes on the mid build)
    MidDirect,
    /// [`SHORT_TILE`]s, always, on the short build (which refuses routes: the fused operators
    /// plan [`TILE`]s of their own)
    Short,
    /// [`WIDE_TILE`]s, always, on the wide ping-pong build (the fused operators plan
    /// [`TILE`]s of their own; the bench's one-GPU rank plans wide tiles under this choice)
    PingPongWide,
}

/// `COMMFUSE_GEMM_VARIANT=main|skinny|narrow|narrow-deep|narrow-sliced|pair|mid|direct|ping-pong|mid-direct|short|ping-pong-wide|auto`
/// (default `auto`): the [`VariantChoice`] of
/// kernels loaded in this process.
pub const VARIANT_ENV: &str = "COMMFUSE_GEMM_VARIANT";

/// Turns of the wide ping-pong build a block must run at least (its tiles per SM) before `auto`
/// takes it ([`wide_tiles_pay`]).
pub const WIDE_MIN_TURNS: usize = 8;

/// Whether `auto` plans `p` with [`WIDE_TILE`]s (the wide ping-pong build) on `sms` SMs: a
/// 16-bit output, at least [`WIDE_MIN_TURNS`] wide tiles a block, and their turns no more work
/// for the busiest block than the direct build's [`TILE`]s (a wide tile is three quarters of
/// one). One H100 (GEMM-NOTES.md, "The wide ping-pong build"), in the same rounds: 3.8 % less
/// time than the direct build at 8192 × 8192 × 3584 with B [N, K] (21 turns a block, 16
/// waves of wide tiles), 4–12 % with B [K, N], 5.4 % at 16384 rows, 2.6 % at 8192 × 8192 ×
/// 14336, level with cuBLASLt or ahead; 9 and 10 % more at 2048 and 1024 rows (5.2 and 2.6
/// turns a block, the last partly idle), where the direct build stays. The epilogue (β·C and D
/// += keep the direct build) is the caller's to check ([`VariantChoice::tile_for_epilogue`]).
pub fn wide_tiles_pay(p: &GemmProblem, sms: usize) -> bool {
    let (wide_rows, wide_cols) = commfuse_core::gemm::tiles(p, WIDE_TILE);
    let (rows, cols) = commfuse_core::gemm::tiles(p, TILE);
    let wide = wide_rows * wide_cols;
    p.output.size() == 2
        && sms > 0
        && wide >= WIDE_MIN_TURNS * sms
        && 3 * wide.div_ceil(sms) <= 4 * (rows * cols).div_ceil(sms)
}

/// Whether `auto` plans `p` with [`SHORT_TILE`]s on `sms` SMs: at least [`SHORT_MIN_ROWS`]
/// rows, its [`TILE`]s would give at most half of the SMs a tile, and its short tiles make
/// one wave of at least [`SHORT_MIN_TILES`], each with its whole K loop where they are more
/// than half as many as the SMs (cut in two along K where they are at most half).
/// With the plain entries on one H100 (GEMM-NOTES.md, "The short build"), two passes, both B
/// layouts, the short build took 15–19 % less time than the ping-pong build at 192 × 4096 ×
/// 4096 and 35–36 % at 192 × 2048 × 4096, 4–14 % less than the narrow-tall build at 256 ×
/// 4096 × 4096 and 8192 and at 384 and 512 × 2048 × 4096, 2–8 % at 256 × 2048 × 4096 and
/// 128 × 4096 × 4096, 1–4 % at 128 × 8192 × 3584 (and −2 to +0.4 % at 96 rows, one pass),
/// and 9–10 % less than the direct build's cut at 256 × 4096 × 14336 [N, K] (1 % more
/// [K, N]); where its tiles make more than a wave (320 and 384 × 4096 × 4096: 160 and 192) it
/// took 13–28 % more than the ping-pong build.
pub fn short_tiles_pay(p: &GemmProblem, sms: usize) -> bool {
    let (rows, cols) = commfuse_core::gemm::tiles(p, TILE);
    let (short_rows, short_cols) = commfuse_core::gemm::tiles(p, SHORT_TILE);
    let short = short_rows * short_cols;
    p.m >= SHORT_MIN_ROWS && 2 * rows * cols <= sms && (SHORT_MIN_TILES..=sms).contains(&short)
}

/// The fewest rows for which `auto` takes short tiles ([`short_tiles_pay`]): the fewest
/// measured, level with the narrow-tall build (96 × 8192 × 3584). Between 65 and 95 rows the
/// second band of short tiles is mostly empty and reads its B columns again; not measured.
pub const SHORT_MIN_ROWS: usize = 96;

/// The fewest short tiles for which `auto` takes them ([`short_tiles_pay`]): the fewest
/// measured ahead (48 at 192 × 2048 × 4096, cut in two along K).
pub const SHORT_MIN_TILES: usize = 48;

/// Whether `auto` plans `p` with [`NARROW_TILE`]s on `sms` SMs: M fits one band of tiles
/// (M ≤ 128) and its [`TILE`]s would give at most half of the SMs a tile. Such a product is
/// bound by how fast the SMs that hold a tile load B (the weights): 16 to 128 × 8192 × 3584
/// make 32 tiles of 128 × 256 for 132 SMs, which even cut along K keep at most 96 SMs
/// loading; narrow tiles give 128 SMs a whole K loop each. On one H200 (GEMM-NOTES.md, "The
/// narrow builds") the narrow builds took 25.8, 23.1, 23.7 and 27.6 µs at 32, 48, 64 and 128
/// rows against the wide tiles' best of 28.6, 29.9, 31.1 and 39.5; at 16 rows the narrow-deep
/// build ([`NARROW_DEEP_ROWS`]) took 27.8 µs against the skinny build's 33.6 on an H100 and
/// 25.2 against 26.2 on an H200. Where the wide tiles already fill more of the SMs (128 ×
/// 28672 × 8192: 112 tiles) the narrow-tall build measured slower (146.8 against 131.8 µs).
pub fn narrow_pays(p: &GemmProblem, sms: usize) -> bool {
    let (rows, cols) = commfuse_core::gemm::tiles(p, TILE);
    rows == 1 && 2 * cols <= sms
}

/// Rows up to which `auto` runs a plan of narrow tiles on the narrow-deep build (twelve
/// stages) instead of the narrow one (eight): ahead by 7–11 % at 16 × 8192 × 3584 on an H100
/// and an H200, within 2 % at 32 and 64 rows (GEMM-NOTES.md, "The narrow-deep build").
pub const NARROW_DEEP_ROWS: usize = 16;

/// Whether `auto` plans `p` with [`MID_TILE`]s on `sms` SMs, which it runs on the ping-pong
/// build where a plain entry serves the plan ([`ping_pong_pays`]), else on the mid-direct
/// one: more than one band of rows (where whole bands' narrow tiles do not serve,
/// [`narrow_bands_pay`]), its [`TILE`]s would give at most half of the SMs a tile (so the
/// direct build cuts them along K), and its mid tiles make at most one wave, each whole, and
/// either give more than half of the SMs one, or at least [`MIN_FEW_TILES`] of them have at
/// most [`MID_MAX_K`] to run through. With the plain entries on one H100 (GEMM-NOTES.md,
/// "Plain entries"), the ping-pong build ran 15–27 % ahead of the direct build's cut tiles at
/// 192 and 256 × 4096 × 4096, 256 × 2048 × 4096 and 384 × 2048 × 4096 (32 to 64 mid tiles)
/// and 6 % at 256 × 4096 × 8192, but 9 % behind it at 256 × 4096 × 14336, where each of its
/// 64 tiles runs its whole K loop on an SM of its own while the cut spreads three K parts
/// over all of them; where a block runs many tiles their k-blocks are slower than the wide
/// builds'.
pub fn mid_tiles_pay(p: &GemmProblem, sms: usize) -> bool {
    let (rows, cols) = commfuse_core::gemm::tiles(p, TILE);
    let (mid_rows, mid_cols) = commfuse_core::gemm::tiles(p, MID_TILE);
    let mid = mid_rows * mid_cols;
    let few = mid >= MIN_FEW_TILES && p.k <= MID_MAX_K;
    p.m > TILE.m && 2 * rows * cols <= sms && mid <= sms && (2 * mid > sms || few)
}

/// The longest K at which `auto` runs tiles whose whole K loops each take an SM while more
/// than half of the SMs stay idle ([`mid_tiles_pay`]), or its narrow tiles of whole bands
/// ([`narrow_bands_pay`]), instead of the direct build's wide tiles cut along K: 8192
/// measured ahead, 14336 behind (for the mid and the narrow tiles alike).
pub const MID_MAX_K: usize = 8192;

/// The fewest tiles for which `auto` takes the mid tiles that leave more than half of the SMs
/// idle ([`mid_tiles_pay`]), and the narrow tiles of whole bands ([`narrow_bands_pay`]) (the
/// short tiles have their own, [`SHORT_MIN_TILES`]): the
/// fewest measured ahead of the direct build's cut (32 mid tiles at 256 × 2048 × 4096; 64
/// narrow ones there). Fewer tiles, each running its whole K loop, are not measured.
pub const MIN_FEW_TILES: usize = 32;

/// Whether `auto` plans `p` with [`NARROW_TILE`]s of several bands (the narrow-tall build):
/// every band whole (M a multiple of 128, more than one band), its [`TILE`]s would give at
/// most half of the SMs a tile, its narrow tiles make at most one wave of at least
/// [`MIN_FEW_TILES`], and K is at most [`MID_MAX_K`]. With the plain entries on one H100
/// (GEMM-NOTES.md, "Plain entries") the narrow-tall build ran 2–5 % ahead of the ping-pong
/// build's mid tiles at 256 × 4096 × 4096 and 8192 and at 384 and 512 × 2048 × 4096, and 20 %
/// at 256 × 2048 × 4096 (its 64 tiles cut in two along K); at 192 rows (a band of 64) it ran
/// 17 % behind, and at 256 × 4096 × 14336 5 % behind the direct build's cut.
pub fn narrow_bands_pay(p: &GemmProblem, sms: usize) -> bool {
    let (rows, cols) = commfuse_core::gemm::tiles(p, TILE);
    let (narrow_rows, narrow_cols) = commfuse_core::gemm::tiles(p, NARROW_TILE);
    let narrow = narrow_rows * narrow_cols;
    p.m > TILE.m
        && p.m.is_multiple_of(TILE.m)
        && 2 * rows * cols <= sms
        && (MIN_FEW_TILES..=sms).contains(&narrow)
        && p.k <= MID_MAX_K
}

/// Whether `auto` plans `p`, which narrow tiles would serve ([`narrow_pays`]), with
/// [`MID_TILE`]s instead (the mid-direct build, one partial wave whole): one band of more than
/// [`SKINNY_ROWS`] rows (where the narrow-tall build computes all 128 rows of its tiles, as
/// the mid tiles' builds do) whose narrow tiles would make more than one wave and whose mid
/// tiles make one. With the plain entries on one H100 (GEMM-NOTES.md, "Plain entries"), the
/// narrow-tall build's one wave ran 3–6 % ahead of the mid tiles at 80, 96 and 128 × 8192 ×
/// 3584 (128 narrow tiles, 64 mid ones; both B layouts at 128 rows), and the mid-direct build
/// 1–2 % ahead of the narrow-tall build's two waves at 128 × 16384 × 3584.
pub fn mid_tiles_pay_over_narrow(p: &GemmProblem, sms: usize) -> bool {
    let (mid_rows, mid_cols) = commfuse_core::gemm::tiles(p, MID_TILE);
    let (narrow_rows, narrow_cols) = commfuse_core::gemm::tiles(p, NARROW_TILE);
    p.m > SKINNY_ROWS
        && mid_rows == 1
        && mid_rows * mid_cols <= sms
        && narrow_rows * narrow_cols > sms
}

/// Whether `auto` runs `plan`, of [`MID_TILE`]s, on the ping-pong build rather than the
/// mid-direct one: where M makes more than one band of rows and the plan's calls can run a
/// plain entry ([`plain_plan`]). With the plain entries on one H100 (GEMM-NOTES.md, "Plain
/// entries") the ping-pong build ran 1–12 % ahead of the mid-direct build at 192 to 1024 rows
/// (one mid tile an SM or fewer; within 1 % at 256 × 8192 × 2048), and within 1 % of it at
/// one band (128 × 8192 and 128 × 16384 × 3584); through their general entries the ping-pong
/// build measured slower (512 × 4096 × 4096: 32.4–34.4 µs against the mid-direct build's
/// 30.4–31.1), so the calls that need them keep the mid-direct build.
pub fn ping_pong_pays(plan: &GemmPlan) -> bool {
    plan.problem.m > MID_TILE.m && plain_plan(plan)
}

/// Whether a plan's calls can run a plain entry as far as the plan decides it ([`entry_for`]
/// decides per call): a 16-bit output, alpha alone in the epilogue, no row bands.
fn plain_plan(plan: &GemmPlan) -> bool {
    let e = &plan.epilogue;
    plan.problem.output.size() == 2
        && !e.bias
        && e.beta == 0.0
        && !e.accumulate
        && plan.bands.is_none()
}

impl VariantChoice {
    /// Every choice, `auto` first.
    pub const ALL: [VariantChoice; 13] = [
        VariantChoice::Auto,
        VariantChoice::Main,
        VariantChoice::Skinny,
        VariantChoice::Narrow,
        VariantChoice::NarrowDeep,
        VariantChoice::NarrowSliced,
        VariantChoice::Pair,
        VariantChoice::Mid,
        VariantChoice::Direct,
        VariantChoice::PingPong,
        VariantChoice::MidDirect,
        VariantChoice::Short,
        VariantChoice::PingPongWide,
    ];

    /// The choice [`VARIANT_ENV`] names (`auto` where it is unset; an unknown value is an
    /// error).
    pub fn from_env() -> Result<VariantChoice, CudaError> {
        match std::env::var(VARIANT_ENV) {
            Ok(v) => VariantChoice::parse(&v),
            Err(_) => Ok(VariantChoice::Auto),
        }
    }

    /// The choice of this [`VariantChoice::name`].
    pub fn parse(name: &str) -> Result<VariantChoice, CudaError> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| {
                unsupported(format!(
                    "{VARIANT_ENV} must be {} or auto, got {name:?}",
                    Self::forced_names()
                ))
            })
    }

    /// The names of every choice but `auto`, as a list for messages ("main, skinny, …").
    pub fn forced_names() -> String {
        let names: Vec<&str> = Self::ALL[1..].iter().map(|c| c.name()).collect();
        names.join(", ")
    }

    /// `main`, `skinny`, `narrow`, `narrow-deep`, `narrow-sliced`, `pair`, `mid`, `direct`,
    /// `ping-pong`, `mid-direct`, `short`, `ping-pong-wide` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            VariantChoice::Auto => "auto",
            VariantChoice::Main => "main",
            VariantChoice::Skinny => "skinny",
            VariantChoice::Narrow => "narrow",
            VariantChoice::Pair => "pair",
            VariantChoice::Mid => "mid",
            VariantChoice::Direct => "direct",
            VariantChoice::NarrowDeep => "narrow-deep",
            VariantChoice::NarrowSliced => "narrow-sliced",
            VariantChoice::PingPong => "ping-pong",
            VariantChoice::MidDirect => "mid-direct",
            VariantChoice::Short => "short",
            VariantChoice::PingPongWide => "ping-pong-wide",
        }
    }

    /// [`VariantChoice::tile_for`] for a GEMM with epilogue `e`: `auto` keeps [`WIDE_TILE`]s
    /// for alpha and a bias (the wide ping-pong build's plain entries, and its general ones,
    /// which spill: with a bias at 8192 × 8192 × 3584 still 3–8 % faster than the direct
    /// build in three calls on one H100) and plans [`TILE`]s where the epilogue reads C (β·C,
    /// D +=), not measured on that build.
    pub fn tile_for_epilogue(self, p: &GemmProblem, e: &Epilogue, sms: usize) -> TileShape {
        let tile = self.tile_for(p, sms);
        let plain = e.beta == 0.0 && !e.accumulate;
        if self == VariantChoice::Auto && tile == WIDE_TILE && !plain {
            TILE
        } else {
            tile
        }
    }

    /// The tile to plan `p` with on `sms` SMs under this choice.
    pub fn tile_for(self, p: &GemmProblem, sms: usize) -> TileShape {
        // (auto plans mid tiles only where mid_tiles_pay: elsewhere, where they beat the main
        // build, between two bands of rows and half a wave of wide tiles, the direct build's
        // wide tiles measured faster still)
        if matches!(
            self,
            VariantChoice::Mid | VariantChoice::PingPong | VariantChoice::MidDirect
        ) {
            return MID_TILE;
        }
        if self == VariantChoice::Short {
            return SHORT_TILE;
        }
        if self == VariantChoice::PingPongWide {
            return WIDE_TILE;
        }
        if self == VariantChoice::Auto {
            if short_tiles_pay(p, sms) {
                return SHORT_TILE;
            }
            if narrow_bands_pay(p, sms) {
                return NARROW_TILE;
            }
            let mid = if narrow_pays(p, sms) {
                mid_tiles_pay_over_narrow(p, sms)
            } else {
                mid_tiles_pay(p, sms)
            };
            if mid {
                return MID_TILE;
            }
            if wide_tiles_pay(p, sms) {
                return WIDE_TILE;
            }
        }
        let narrow = match self {
            VariantChoice::Auto => narrow_pays(p, sms),
            VariantChoice::Narrow | VariantChoice::NarrowDeep | VariantChoice::NarrowSliced => {
                p.m <= NARROW_TILE.m
            }
            VariantChoice::Main
            | VariantChoice::Skinny
            | VariantChoice::Pair
            | VariantChoice::Mid
            | VariantChoice::Direct
            | VariantChoice::PingPong
            | VariantChoice::MidDirect
            | VariantChoice::Short
            | VariantChoice::PingPongWide => false,
        };
        if narrow {
            NARROW_TILE
        } else {
            TILE
        }
    }

    /// The build that runs `plan` (of [`TILE`]s, [`NARROW_TILE`]s, [`MID_TILE`]s or
    /// [`SHORT_TILE`]s, which `PreparedGemm` checks): the 64-row one of its tile only where
    /// every tile has at most [`SKINNY_ROWS`] rows (it computes no more of a tile); each of
    /// [`MID_TILE`]s' builds by the choice, and [`SHORT_TILE`]s the short build whatever it is.
    pub fn variant_for(self, plan: &GemmPlan) -> GemmVariant {
        if plan.tile == SHORT_TILE {
            return GemmVariant::Short;
        }
        if plan.tile == WIDE_TILE {
            return GemmVariant::PingPongWide;
        }
        if plan.tile == MID_TILE {
            // (build() keeps the fused operators' GEMMs on the mid build)
            return match self {
                VariantChoice::PingPong => GemmVariant::PingPong,
                VariantChoice::Auto if ping_pong_pays(plan) => GemmVariant::PingPong,
                VariantChoice::MidDirect | VariantChoice::Auto => GemmVariant::MidDirect,
                _ => GemmVariant::Mid,
            };
        }
        let fits = tallest_band(plan) <= SKINNY_ROWS && self != VariantChoice::Main;
        match (plan.tile == NARROW_TILE, fits) {
            (false, false) if self == VariantChoice::Pair => GemmVariant::Pair,
            // plain GEMMs of wide tiles: the direct build (build() keeps the fused operators'
            // GEMMs, with routes or a gather, on the main build)
            (false, false) if matches!(self, VariantChoice::Direct | VariantChoice::Auto) => {
                GemmVariant::Direct
            }
            (false, false) => GemmVariant::Main,
            (false, true) => GemmVariant::Skinny,
            (true, false) => GemmVariant::NarrowTall,
            (true, true) if self == VariantChoice::NarrowDeep => GemmVariant::NarrowDeep,
            (true, true)
                if self == VariantChoice::Auto && tallest_band(plan) <= NARROW_DEEP_ROWS =>
            {
                GemmVariant::NarrowDeep
            }
            (true, true) if self == VariantChoice::NarrowSliced => GemmVariant::NarrowSliced,
            (true, true) => GemmVariant::Narrow,
        }
    }

    /// Its place in [`VariantChoice::ALL`] (how [`GemmKernels`] keeps it in an atomic).
    fn code(self) -> u8 {
        Self::ALL.iter().position(|&c| c == self).unwrap_or(0) as u8
    }

    fn from_code(code: u8) -> VariantChoice {
        Self::ALL
            .get(code as usize)
            .copied()
            .unwrap_or(VariantChoice::Auto)
    }
}

/// Bytes of one helper's partial in the split tail's workspace: the kernel lays every slot out
/// as two consumer warpgroups' f32 accumulators of a tile's width (`split_partials` in
/// gemm.cu: 256 threads), [`TILE`]'s 128 rows, also in the builds of one warpgroup and of
/// [`SHORT_TILE`]s, whose 64 rows fill half of it.
fn workspace_slot_bytes(tile: TileShape) -> usize {
    TILE.m.max(tile.m) * tile.n * 4
}

/// Rows of the plan's tallest row band (a tile has as many rows as its band).
fn tallest_band(plan: &GemmPlan) -> usize {
    match &plan.bands {
        Some(b) => b
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .max()
            .unwrap_or(0),
        None => plan.problem.m.min(plan.tile.m),
    }
}

/// A pipeline wait that lasts this long is a bug, reported instead of hanging the GPU.
const PIPELINE_TIMEOUT_NS: u64 = 5_000_000_000;
/// How long dropping a launched GEMM or consumer waits for its last launch: every device-side
/// wait in it ends within the pipeline timeout, so a launch still running after this is stuck.
const DROP_WAIT: Duration = Duration::from_secs(3 * PIPELINE_TIMEOUT_NS / 1_000_000_000 + 10);

/// Memory that launched kernels use, with what makes them give up early.
pub(crate) trait InUse {
    /// Makes a running kernel stop waiting, where it can be told to.
    fn abort(&self) {}
}

impl InUse for DeviceMemory {}

/// Device memory `held` by kernels launched on a stream, and an event recorded after the last
/// launch. Dropping it stops and waits for that launch (bounded, see [`DROP_WAIT`]) before
/// freeing the memory, and leaks the memory if the launch is still running then: freeing it
/// under a running kernel would let the kernel write into whatever is allocated there next.
/// Launches on several streams are covered by the last one's only (callers use one stream).
pub(crate) struct Launched<T: InUse> {
    last: CallOrder,
    held: ManuallyDrop<T>,
}

impl<T: InUse> Launched<T> {
    pub(crate) fn new(gpu: &Gpu, held: T) -> Result<Self, CudaError> {
        Ok(Launched {
            last: CallOrder::new(gpu)?,
            held: ManuallyDrop::new(held),
        })
    }

    /// Marks the end of the launch just queued on `stream` (see [`CallOrder`] for captures).
    pub(crate) fn launched(&self, stream: &Stream) -> Result<(), CudaError> {
        self.last.record(stream)
    }

    /// Makes `stream` wait for the last launch (on whichever stream it was queued): a call on
    /// another stream than the previous one still comes after it on the device.
    pub(crate) fn order_after_last(&self, stream: &Stream) -> Result<(), CudaError> {
        self.last.after_last(stream)
    }

    /// [`Launched::launched`] for a caller that knows whether `stream` is `capturing`.
    pub(crate) fn launched_if(&self, stream: &Stream, capturing: bool) -> Result<(), CudaError> {
        self.last.record_if(stream, capturing)
    }

    /// [`Launched::order_after_last`] for a caller that knows whether `stream` is `capturing`.
    pub(crate) fn order_after_last_if(
        &self,
        stream: &Stream,
        capturing: bool,
    ) -> Result<(), CudaError> {
        self.last.after_last_if(stream, capturing)
    }

    /// Waits on the host, up to `timeout`, for the last launch to end; whether it did.
    pub(crate) fn wait_last(&self, timeout: std::time::Duration) -> Result<bool, CudaError> {
        crate::sys::host_sync::poll_until(timeout, || self.last.is_done())
    }
}

impl<T: InUse> Drop for Launched<T> {
    fn drop(&mut self) {
        self.held.abort();
        // an error means the context faulted: nothing runs in it any more
        let running = matches!(poll_until(DROP_WAIT, || self.last.is_done()), Ok(false));
        if !running {
            // SAFETY: dropped once, here; the last launch that used it has ended
            unsafe { ManuallyDrop::drop(&mut self.held) };
        }
    }
}

impl<T: InUse> std::ops::Deref for Launched<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.held
    }
}

/// What a [`PreparedGemm`] owns that its kernel reads or writes.
struct GemmMemory {
    error: MappedHost<ErrorRecord>,
    _tables: DeviceMemory,
    /// [`Gather::band_flags`] on the device
    _band_flags: Option<DeviceMemory>,
    _workspace: DeviceMemory,
    _b_padded: Option<DeviceMemory>,
}

impl InUse for GemmMemory {
    /// gemm.cu's flag waits (a fold's partials, a band's rows) give up once it is raised, and
    /// the block then ends without storing more; its pipeline waits end after their timeout.
    fn abort(&self) {
        self.error.raise_abort();
    }
}

#[repr(C, align(128))]
#[derive(Clone, Copy, Zeroable)]
struct TmaDesc([u64; 16]);

/// Where one tile goes (mirrors `TileRoute` in gemm.cu, which documents each field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TileRoute {
    pub dst: u64,
    pub flag: u64,
    pub flag_value: u64,
    pub ld: u32,
    pub flag_op: u32,
    /// Partials added in the epilogue: `fold_count` tiles at `fold_src`, `fold_stride` bytes
    /// apart, leading dimension `fold_ld`, each read once its flag holds the call's epoch
    pub fold_src: u64,
    pub fold_stride: u64,
    pub fold_flag: u64,
    pub fold_count: u32,
    pub fold_ld: u32,
    pub fold_flag_stride: u32,
    /// [`ROUTE_DST_FROM_D`], [`ROUTE_NO_BIAS`], [`ROUTE_FOLD_TMA`]
    pub options: u32,
    /// With [`ROUTE_FOLD_TMA`]: the row of the [`FoldSource`] where the tile's first partial
    /// starts, and the rows from one partial to the next (set by [`PreparedGemm::with_routes`])
    pub fold_row: u32,
    pub fold_row_step: u32,
    /// With [`ROUTE_DST_BOXES`]: the tensor map in device memory that the tile's rows go out
    /// through (0: the call's map of D, with [`ROUTE_DST_FROM_D`]), and the column and row of
    /// the tile's element (0, 0) in it (set by [`PreparedGemm::with_routes`] where it can; see
    /// [`box_routes`])
    pub dst_map: u64,
    pub dst_col: u32,
    pub dst_row: u32,
}

/// `TileRoute::flag_op`: store the call's epoch (the `epoch` of [`PreparedGemm::launch_call`]).
pub const FLAG_SET_EPOCH: u32 = 2;
/// `TileRoute::options`: `dst` is a byte offset from the call's D.
pub const ROUTE_DST_FROM_D: u32 = 1;
/// `TileRoute::options`: the tile does not add the bias (a peer's partial).
pub const ROUTE_NO_BIAS: u32 = 2;
/// `TileRoute::options`: the tile's partials come into the kernel's pipeline by TMA from the
/// [`FoldSource`] (set by [`PreparedGemm::with_routes`] where they can; see [`stage_folds`]).
pub const ROUTE_FOLD_TMA: u32 = 4;
/// `TileRoute::options`: the tile's 16-bit rows go out by the consumers' tensor stores through
/// `dst_map` (the builds that store tiles themselves; set by [`PreparedGemm::with_routes`]
/// where they can, see [`box_routes`]).
pub const ROUTE_DST_BOXES: u32 = 8;
const _: () = assert!(std::mem::size_of::<TileRoute>() == 96);

/// The buffer that the partials of a GEMM's folds lie in: `rows` rows of `ld` elements of the
/// output type from `base` (a rank's receive slots, one after the other). Where a tile's
/// partials lie in it in whole rows at the tile's own columns, the kernel loads them by TMA
/// into its pipeline's stages during the tile's main loop, instead of reading them from global
/// memory after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FoldSource {
    pub base: u64,
    pub rows: usize,
    pub ld: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
struct GemmParams {
    a: TmaDesc,
    b: TmaDesc,
    order: u64,
    routes: u64,
    d: u64,
    c: u64,
    bias: u64,
    err: u64,
    timeout_ns: u64,
    m: u32,
    n: u32,
    k: u32,
    tiles_n: u32,
    tile_count: u32,
    alpha: f32,
    beta: f32,
    accumulate: u32,
    rank: u32,
    full_units: u32,
    unit_count: u32,
    call_options: u32,
    workspace: u64,
    counters: u64,
    tail: u64,
    bands: u64,
    epoch: u64,
    calls: u64,
    routes_alt: u64,
    band_flags: u64,
    local_row0: u32,
    local_rows: u32,
    flag_timeout_ns: u64,
    d_tma: u32,
    fold_tma: u32,
    fold_prefetch: u32,
    next_prefetch: u32,
    a_box_bytes: u32,
    k_phases: u32,
    /// Non-zero in a traced call only: where the blocks stamp their points ([`trace`])
    trace: u64,
    /// Non-zero: the units at odd places of a block's sequence load their k-blocks last to
    /// first ([`PreparedGemm::set_k_serpentine`])
    k_serpentine: u32,
    a_local: TmaDesc,
    d_map: TmaDesc,
    fold_map: TmaDesc,
}
const _: () = assert!(
    std::mem::offset_of!(GemmParams, band_flags) == 416
        && std::mem::offset_of!(GemmParams, flag_timeout_ns) == 432
        && std::mem::offset_of!(GemmParams, d_tma) == 440
        && std::mem::offset_of!(GemmParams, fold_tma) == 444
        && std::mem::offset_of!(GemmParams, fold_prefetch) == 448
        && std::mem::offset_of!(GemmParams, next_prefetch) == 452
        && std::mem::offset_of!(GemmParams, a_box_bytes) == 456
        && std::mem::offset_of!(GemmParams, k_phases) == 460
        && std::mem::offset_of!(GemmParams, trace) == 464
        && std::mem::offset_of!(GemmParams, k_serpentine) == 472
        && std::mem::offset_of!(GemmParams, a_local) == 512
        && std::mem::offset_of!(GemmParams, d_map) == 640
        && std::mem::offset_of!(GemmParams, fold_map) == 768
        && std::mem::size_of::<GemmParams>() == 896
);

/// Rows of A that an all-gather brings in while the GEMM runs ([`PreparedGemm::gathering`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gather {
    /// Per row band of the plan: the address of the flag (on this GPU) that says its rows
    /// have landed in the prepared A, or 0 for rows that need no wait
    pub band_flags: Vec<u64>,
    /// Rows read from the A given per call ([`PreparedGemm::launch_gather_call`]) instead:
    /// the caller's own chunk, whose row 0 is `local.start`. Whole bands only.
    pub local: std::ops::Range<usize>,
    /// How long a band waits for its rows before the call gives up on them (reported by
    /// [`PreparedGemm::stall_report`]); at most half the pipeline's bound, which longer
    /// values are cut to
    pub timeout: std::time::Duration,
}

/// Mirrors `CallCounter` in gemm.cu: a rank's count of its calls in device memory
/// (zeroed when made), which a call that numbers itself on the device reads and advances.
#[repr(C)]
#[derive(Clone, Copy, Default, Pod, Zeroable)]
pub struct CallCounter {
    /// The number of the last call that finished
    pub last: u64,
    finished: u32,
    pad: u32,
}

/// How a [`PreparedGemm::launch_call`] learns its call's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallNumber {
    /// Given by the host (a call that must not be replayed from a CUDA graph)
    Host(u64),
    /// One more than the [`CallCounter`] at `counter` (device memory of this GPU) says, read
    /// and advanced on the device, so that every replay of a captured call is a new call; the
    /// tiles route by the prepared routes in calls of set 0 and by the routes at `routes_alt`
    /// (as many, same form) in calls of set 1
    Device { counter: u64, routes_alt: u64 },
    /// One more than the count of calls (a u64) at `counter`, which later work on the stream
    /// advances once the call has ended (an operator's flag steps numbered on the device,
    /// [`crate::gemm_rs::flag_step::FlagSteps::counter`]): the GEMM reads it and leaves it alone
    Counted { counter: u64 },
}

/// `GemmParams::call_options`: the call counter is read, not advanced (mirrors gemm.cu).
const CALLS_READ_ONLY: u32 = 1;

/// Most K parts a tail tile of the main build is cut into ([`GemmVariant::max_parts`]).
const MAX_PARTS: usize = 4;

/// Mirrors `PAIR_IDLE` in gemm.cu: an order entry of the pair build whose block has no tile
/// of its own; the low bits name its partner's tile, whose B columns it helps load.
pub const PAIR_IDLE: u32 = 0x8000_0000;
/// How far ahead in the order [`pair_order`] looks for a tile's partner.
const PAIR_WINDOW: usize = 16;

/// The pair build's order: `order` (tile indices over a grid `tiles_n` tiles wide) as
/// consecutive pairs of tiles of one column, the two units that the two blocks of a cluster run
/// together. Each tile, in turn, takes as its partner the first tile not yet placed among the
/// next [`PAIR_WINDOW`] of the order that lies in its column (in a grouped order: the tile
/// below it), so that tiles keep about their place; a tile with none is paired with an idle
/// entry (its own index with [`PAIR_IDLE`]).
pub fn pair_order(order: &[usize], tiles_n: usize) -> Vec<u32> {
    let tiles_n = tiles_n.max(1);
    let mut placed = vec![false; order.len()];
    let mut paired = Vec::with_capacity(order.len() + order.len() % 2);
    for i in 0..order.len() {
        if placed[i] {
            continue;
        }
        placed[i] = true;
        let t = order[i];
        let end = order.len().min(i + 1 + PAIR_WINDOW);
        let partner = (i + 1..end).find(|&j| !placed[j] && order[j] % tiles_n == t % tiles_n);
        paired.push(t as u32);
        match partner {
            Some(j) => {
                placed[j] = true;
                paired.push(order[j] as u32);
            }
            None => paired.push(t as u32 | PAIR_IDLE),
        }
    }
    paired
}

fn type_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
    }
}

/// The part of gemm.cu ([`nvrtc::compile_parts`]) that holds `variant`'s entry points for
/// `input` (bf16 or f16): `2 · build + input`, the builds in the order of [`GemmVariant::ALL`],
/// as gemm.cu's `#if GEMM_IN_PART` blocks have them.
pub fn gemm_part(variant: GemmVariant, input: DType) -> u32 {
    let build = GemmVariant::ALL
        .iter()
        .position(|&v| v == variant)
        .expect("every build is in ALL") as u32;
    2 * build + u32::from(input == DType::F16)
}

/// The part of gemm.cu that holds the helper kernels (the snapshot of flagged tiles, the SM
/// holder, the paced flags): the last, `GEMM_HELPER_PART` in gemm.cu.
pub const GEMM_HELPER_PART: u32 = 2 * GemmVariant::ALL.len() as u32;

/// The GEMM entry points of gemm.cu loaded on one GPU (every build).
pub struct GemmKernels {
    functions: HashMap<String, Function>,
    /// [`VariantChoice::code`] of the GEMMs prepared from here on
    choice: AtomicU8,
    /// Whether the GEMMs prepared from here on spread their tail by stream-K ([`TailChoice`])
    stream_k: AtomicBool,
    pub(crate) snapshot: Function,
    hold: Function,
    pub(crate) paced_flags: Function,
    _modules: Vec<Module>,
}

impl GemmKernels {
    /// Compiles (or takes from the cache) and loads gemm.cu; the build choice comes from
    /// [`VARIANT_ENV`] (an unknown value is an error).
    pub fn load(gpu: &Gpu) -> Result<GemmKernels, CudaError> {
        let choice = VariantChoice::from_env()?;
        let tail = match std::env::var(TAIL_ENV) {
            Ok(v) => TailChoice::parse(&v)?,
            Err(_) => TailChoice::Cut,
        };
        // the file's parts side by side: one build's entries for one input type each
        let modules = nvrtc::compile_parts(nvrtc::kernel("gemm.cu").expect("embedded"), false)?
            .iter()
            .map(|part| Module::load(gpu, &part.cubin))
            .collect::<Result<Vec<_>, _>>()?;
        let mut functions = HashMap::new();
        for variant in GemmVariant::ALL {
            for input in [DType::BF16, DType::F16] {
                let module = &modules[gemm_part(variant, input) as usize];
                for name in variant.entry_names(input) {
                    let f = module.function(&name)?;
                    f.allow_dynamic_smem(variant.smem_bytes())?;
                    functions.insert(name, f);
                }
            }
        }
        let helpers = &modules[GEMM_HELPER_PART as usize];
        let hold = helpers.function("hold_sms")?;
        let paced_flags = helpers.function("raise_flags_paced")?;
        hold.allow_dynamic_smem(HOLD_SMEM_BYTES)?;
        Ok(GemmKernels {
            functions,
            choice: AtomicU8::new(choice.code()),
            stream_k: AtomicBool::new(tail == TailChoice::StreamK),
            snapshot: helpers.function("tile_snapshot")?,
            hold,
            paced_flags,
            _modules: modules,
        })
    }

    /// Which build the GEMMs prepared from now on use (what a bench sets to time both).
    pub fn set_choice(&self, choice: VariantChoice) {
        self.choice.store(choice.code(), Ordering::Relaxed);
    }

    /// `f` with `choice` in force for the GEMMs it prepares, and the choice before restored
    /// (also where `f` fails): how a bench prepares a build beside the one chosen.
    pub fn with_choice<R>(&self, choice: VariantChoice, f: impl FnOnce() -> R) -> R {
        let before = self.choice();
        self.set_choice(choice);
        let result = f();
        self.set_choice(before);
        result
    }

    /// The build choice in force.
    pub fn choice(&self) -> VariantChoice {
        VariantChoice::from_code(self.choice.load(Ordering::Relaxed))
    }

    /// How the GEMMs prepared from now on share out their tail (what a bench sets to time
    /// both).
    pub fn set_tail(&self, tail: TailChoice) {
        self.stream_k
            .store(tail == TailChoice::StreamK, Ordering::Relaxed);
    }

    /// The tail choice in force.
    pub fn tail(&self) -> TailChoice {
        if self.stream_k.load(Ordering::Relaxed) {
            TailChoice::StreamK
        } else {
            TailChoice::Cut
        }
    }

    /// The tile to plan `p` with under the choice in force, on `sms` SMs (the grid's cap, or
    /// the GPU's SM count), for a GEMM with epilogue `e`
    /// ([`VariantChoice::tile_for_epilogue`]).
    pub fn tile_for(&self, p: &GemmProblem, e: &Epilogue, sms: usize) -> TileShape {
        self.choice().tile_for_epilogue(p, e, sms)
    }

    /// The build's plain, plain-tail or routed entry for the plan's types and layout
    /// (`suffix`: [`PLAIN_SUFFIX`], [`PLAIN_TAIL_SUFFIX`] or [`ROUTED_SUFFIX`]), where it has
    /// one.
    fn suffixed_entry(
        &self,
        plan: &GemmPlan,
        variant: GemmVariant,
        suffix: &str,
    ) -> Option<Function> {
        let name = self.entry_name(plan, variant);
        self.functions.get(&format!("{name}{suffix}")).cloned()
    }

    fn entry(&self, plan: &GemmPlan, variant: GemmVariant) -> Result<Function, CudaError> {
        let name = self.entry_name(plan, variant);
        self.functions
            .get(&name)
            .cloned()
            .ok_or_else(|| CudaError::Unavailable(format!("no GEMM kernel for {name}")))
    }

    fn entry_name(&self, plan: &GemmPlan, variant: GemmVariant) -> String {
        let p = &plan.problem;
        variant.entry_name(p.input, p.b_layout, p.output)
    }
}

/// One call's operands: device addresses on the GPU that runs the GEMM. C and bias have the
/// output type; C is [M, N] row-major.
#[derive(Debug, Clone, Copy)]
pub struct GemmOperands {
    pub a: u64,
    pub b: u64,
    pub c: Option<u64>,
    pub bias: Option<u64>,
    /// The local output, row-major with ld = N (tiles without a destination table go here)
    pub d: u64,
}

impl GemmOperands {
    /// A and B into D, without C or bias.
    pub fn plain(a: u64, b: u64, d: u64) -> GemmOperands {
        GemmOperands {
            a,
            b,
            c: None,
            bias: None,
            d,
        }
    }
}

/// Where the plan's destination ranks keep their output buffers and flags, as addresses this
/// GPU can store to.
pub struct RouteTargets<'a> {
    pub outputs: &'a [u64],
    pub flag: &'a dyn Fn(usize, Slot) -> u64,
}

/// The suffix of a build's plain entries' names ([`GemmVariant::has_plain_entries`]).
pub const PLAIN_SUFFIX: &str = "_plain";
/// The suffix of the plain entries that keep the split tail
/// ([`GemmVariant::has_plain_tail_entries`]).
pub const PLAIN_TAIL_SUFFIX: &str = "_plain_tail";
/// The suffix of a build's routed entries ([`GemmVariant::has_routed_entries`]).
pub const ROUTED_SUFFIX: &str = "_routed";

/// Which of its build's entries a GEMM call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmEntry {
    /// Every option of every operator compiled in, each tested at run time
    General,
    /// The options compiled out ([`GemmVariant::has_plain_entries`])
    Plain,
    /// The same with the split tail kept ([`GemmVariant::has_plain_tail_entries`])
    PlainTail,
    /// Routes, flags, folds, row bands, the bias and the split tail kept, the other
    /// operators' options compiled out ([`GemmVariant::has_routed_entries`])
    Routed,
}

impl GemmEntry {
    /// `general`, `plain`, `plain-tail` or `routed`.
    pub fn name(self) -> &'static str {
        match self {
            GemmEntry::General => "general",
            GemmEntry::Plain => "plain",
            GemmEntry::PlainTail => "plain-tail",
            GemmEntry::Routed => "routed",
        }
    }
}

/// Which entry a call with these parameters can run: a plain one where it asks for nothing
/// that the plain entries compile out (routes, flags, folds, row bands, a gather, the bias,
/// β·C, accumulation into D) and its tiles go out by the boxes' tensor stores (`d_tma`: a
/// 16-bit D), the one without the split tail where it has none. Alpha, the call counter, the
/// trace and the load options (`next_prefetch`, `k_phases`, `k_serpentine`) stay in the plain
/// entries. Else a routed one where it asks for none of the other operators' options (the
/// all-gather's band waits and local rows, β·C, accumulation into D).
fn entry_for(p: &GemmParams) -> GemmEntry {
    if !plain_options(p) {
        if routed_options(p) {
            GemmEntry::Routed
        } else {
            GemmEntry::General
        }
    } else if p.full_units == p.unit_count {
        GemmEntry::Plain
    } else {
        GemmEntry::PlainTail
    }
}

/// The plain entries' options: the routed entries' ([`routed_options`]) less routes, flags,
/// folds, row bands and the bias, and D by the boxes' tensor stores.
fn plain_options(p: &GemmParams) -> bool {
    routed_options(p)
        && p.d_tma != 0
        && p.routes == 0
        && p.routes_alt == 0
        && p.bands == 0
        && p.fold_tma == 0
        && p.fold_prefetch == 0
        && p.bias == 0
}

/// The routed entries' options: none of the other operators' (the all-gather's band waits and
/// local rows, β·C, accumulation into D).
fn routed_options(p: &GemmParams) -> bool {
    p.band_flags == 0 && p.local_rows == 0 && (p.c == 0 || p.beta == 0.0) && p.accumulate == 0
}

/// A GEMM call ready to launch any number of times.
pub struct PreparedGemm {
    function: Function,
    /// The build's plain entries ([`GemmVariant::has_plain_entries`]: without and with the
    /// split tail), launched instead of `function` for the calls that [`entry_for`] sends to
    /// them; `None` where the build or the output type has none, or where turned off
    /// ([`PreparedGemm::use_general_entry`])
    plain: Option<Function>,
    plain_tail: Option<Function>,
    /// The build's routed entry ([`GemmVariant::has_routed_entries`]), `None` where it has
    /// none for these types or where turned off
    routed_entry: Option<Function>,
    params: GemmParams,
    grid: u32,
    /// The build it runs, and so the rows of its A boxes (per-call A maps) and its shared memory
    variant: GemmVariant,
    /// Launched cooperatively: a tail tile's owner waits for its helpers, which must
    /// therefore be resident beside it even when another stream's kernels hold SMs
    cooperative: bool,
    /// How the tiles beyond the last whole wave are shared out ([`TailPlan::describe`])
    tail: String,
    problem: GemmProblem,
    /// B was copied to a padded pitch at preparation: its address cannot change per call
    b_padded: bool,
    /// Built from caller routes: the bias is per call (routes say which tiles add it)
    routed: bool,
    /// Tiles whose partials come into the pipeline by TMA ([`stage_folds`])
    staged_folds: usize,
    /// The rows of the map of D of the builds that store tiles themselves (M, or for a routed
    /// GEMM those that its routes into D reach: [`box_routes`])
    d_rows: usize,
    memory: Launched<GemmMemory>,
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unavailable(msg)
}

/// The largest M, N or K the kernel takes: its TMA coordinates and its row and column
/// arithmetic are signed 32-bit.
pub const MAX_DIM: usize = i32::MAX as usize;
/// The most output tiles the kernel takes: tile numbers, work units (a split tail adds at most
/// three per SM), its grid-stride loop indices and the byte strides of a tile's flags
/// (8 bytes per tile) are 32-bit.
pub const MAX_TILES: usize = 1 << 28;

/// Whether `tile` is the kernel's: the fused operators' schedules must be cut in the tiles it
/// computes.
pub fn check_tile(tile: TileShape) -> Result<(), CudaError> {
    if tile == TILE {
        return Ok(());
    }
    Err(CudaError::Unavailable(format!(
        "the GPU GEMM computes {}×{} tiles, the configuration asks for {}×{}",
        TILE.m, TILE.n, tile.m, tile.n
    )))
}

/// Whether the kernel's 32-bit parameters and index arithmetic hold `p`: M, N and K at most
/// [`MAX_DIM`], at most [`MAX_TILES`] output tiles of [`TILE`]. The error names the value and
/// the limit.
pub fn check_problem(p: &GemmProblem) -> Result<(), CudaError> {
    check_problem_tiles(p, TILE)
}

/// [`check_problem`] for tiles of `tile`.
pub(crate) fn check_problem_tiles(p: &GemmProblem, tile: TileShape) -> Result<(), CudaError> {
    for (name, value) in [("M", p.m), ("N", p.n), ("K", p.k)] {
        if value > MAX_DIM {
            return Err(unsupported(format!(
                "GEMM {name} = {value} exceeds the kernel's limit of {MAX_DIM}"
            )));
        }
    }
    let (rows, cols) = commfuse_core::gemm::tiles(p, tile);
    let count = rows.saturating_mul(cols);
    if count > MAX_TILES {
        return Err(unsupported(format!(
            "GEMM {}×{} has {count} output tiles of {}×{}, more than the kernel's limit of {MAX_TILES}",
            p.m, p.n, tile.m, tile.n
        )));
    }
    Ok(())
}

/// What the kernel needs of a plan and its operands: a tile of one of its builds, dimensions
/// and a tile count
/// within [`check_problem`]'s limits, a valid order and tables for `world` ranks, 16-byte
/// aligned operands.
fn check_plan(plan: &GemmPlan, ops: &GemmOperands, world: usize) -> Result<(), CudaError> {
    let p = &plan.problem;
    if !GemmVariant::ALL.iter().any(|v| v.tile() == plan.tile) {
        let mut names: Vec<String> = Vec::new();
        for v in GemmVariant::ALL {
            let name = format!("{}×{}", v.tile().m, v.tile().n);
            if !names.contains(&name) {
                names.push(name);
            }
        }
        return Err(unsupported(format!(
            "the GPU GEMM computes {} tiles, the plan has {}×{}",
            names.join(", "),
            plan.tile.m,
            plan.tile.n
        )));
    }
    check_problem_tiles(p, plan.tile)?;
    plan.validate(world)
        .map_err(|e| unsupported(e.to_string()))?;
    for (name, addr) in [("A", ops.a), ("B", ops.b), ("D", ops.d)] {
        if !addr.is_multiple_of(16) {
            return Err(unsupported(format!(
                "{name} must start on a 16-byte boundary (TMA), got {addr:#x}"
            )));
        }
    }
    Ok(())
}

impl PreparedGemm {
    /// Checks the plan against the kernel, builds descriptors and tables. `sm_cap` = 0 uses
    /// every SM; the grid never exceeds the tile count.
    pub fn new(
        gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        targets: Option<&RouteTargets<'_>>,
        sm_cap: u32,
        rank: usize,
    ) -> Result<PreparedGemm, CudaError> {
        let world = targets.map_or(rank + 1, |t| t.outputs.len());
        check_plan(plan, ops, world)?;
        let routes = routes(plan, ops, targets, rank)?.map(|r| (r, None));
        PreparedGemm::build(gpu, kernels, plan, ops, routes, None, sm_cap, rank)
    }

    /// [`PreparedGemm::new`] with the route of every tile given as is (tile order of the plan's
    /// tile numbers): what a fused operator builds when its routes need more than a plan says
    /// (partials folded into the epilogue, destinations relative to the call's D, epoch flags).
    /// `world`: the ranks the plan's destinations may name. `folds`: the buffer the folds'
    /// partials lie in, if they all lie in one (their tiles then load them by TMA where they
    /// can, [`stage_folds`]); a GEMM that takes other routes in alternate calls
    /// ([`CallNumber::Device`]) must find theirs in the same buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn with_routes(
        gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        routes: Vec<TileRoute>,
        folds: Option<FoldSource>,
        world: usize,
        sm_cap: u32,
        rank: usize,
    ) -> Result<PreparedGemm, CudaError> {
        check_plan(plan, ops, world)?;
        if plan.epilogue.alpha != 1.0 && routes.iter().any(|r| r.fold_count != 0) {
            return Err(unsupported(
                "partials are folded into the accumulators: the GEMM's alpha must be 1".into(),
            ));
        }
        if routes.len() != plan.tile_count() {
            return Err(unsupported(format!(
                "{} routes for {} tiles",
                routes.len(),
                plan.tile_count()
            )));
        }
        let mut gemm = PreparedGemm::build(
            gpu,
            kernels,
            plan,
            ops,
            Some((routes, folds)),
            None,
            sm_cap,
            rank,
        )?;
        gemm.routed = true;
        Ok(gemm)
    }

    /// [`PreparedGemm::new`] for an all-gather + GEMM: `ops.a` is the gather buffer (all M rows
    /// of A), band i's tiles load their rows only once the flag at `gather.band_flags[i]` holds
    /// the call's number, and the rows `gather.local` come from the A of each call
    /// ([`PreparedGemm::launch_gather_call`]). Output to the local D; the plan's bands must
    /// start at `gather.local`'s ends.
    pub fn gathering(
        gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        gather: &Gather,
        sm_cap: u32,
        rank: usize,
    ) -> Result<PreparedGemm, CudaError> {
        check_plan(plan, ops, rank + 1)?;
        let bands = plan.tile_grid().0;
        if gather.band_flags.len() != bands {
            return Err(unsupported(format!(
                "{} band flags for {bands} row bands",
                gather.band_flags.len()
            )));
        }
        let starts: Vec<usize> = match &plan.bands {
            Some(b) => b.clone(),
            None => (0..=bands)
                .map(|i| (i * plan.tile.m).min(plan.problem.m))
                .collect(),
        };
        let (l0, l1) = (gather.local.start, gather.local.end);
        if l0 < l1 && (!starts.contains(&l0) || !starts.contains(&l1)) {
            return Err(unsupported(format!(
                "the local rows {l0}..{l1} must be whole row bands of the plan"
            )));
        }
        PreparedGemm::build(gpu, kernels, plan, ops, None, Some(gather), sm_cap, rank)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        routes: Option<(Vec<TileRoute>, Option<FoldSource>)>,
        gather: Option<&Gather>,
        sm_cap: u32,
        rank: usize,
    ) -> Result<PreparedGemm, CudaError> {
        let p = &plan.problem;
        let (mut routes, folds) = routes.unzip();
        let folds = folds.flatten();
        let mut variant = kernels.choice().variant_for(plan);
        // The pair build runs plain GEMMs: a fused operator's tiles wait for flags (a fold's
        // partials, a band's rows), and a wait of one block of a pair holds its partner's
        // stages too; unmeasured, so the main build serves them. The direct and the mid-direct
        // build serve gathers (whose waits are the producer's, as in the main build) and,
        // where chosen by name, routes: their consumers store each tile along its route and
        // its flag goes up once those stores are performed (the direct build folds partials
        // through its stages as the main one does, the mid-direct one reads them from global
        // memory); `auto` keeps routes on the main and the mid build until the direct ones
        // are measured against them. The 128 × 128 ping-pong build's plans are plain GEMMs';
        // the wide one takes routes through its routed entries only (below). The narrow and
        // the short builds' plans are plain GEMMs' too: they store their tiles directly and
        // have no staged build beside them, so routes take the fused operators' tile.
        let named = kernels.choice() != VariantChoice::Auto;
        let serves = match variant {
            GemmVariant::Pair | GemmVariant::PingPong => routes.is_none() && gather.is_none(),
            GemmVariant::Direct | GemmVariant::MidDirect => routes.is_none() || named,
            GemmVariant::Narrow
            | GemmVariant::NarrowTall
            | GemmVariant::NarrowDeep
            | GemmVariant::Short
                if routes.is_some() =>
            {
                return Err(unsupported(format!(
                    "tiles with routes are {}×{} (the {} build's {}×{} tiles store into D only)",
                    TILE.m,
                    TILE.n,
                    variant.name(),
                    plan.tile.m,
                    plan.tile.n
                )));
            }
            GemmVariant::PingPongWide if gather.is_some() => {
                return Err(unsupported(format!(
                    "the {} build takes no rows gathered",
                    variant.name()
                )));
            }
            // (its routed entries: see general_entry_takes_routes)
            GemmVariant::PingPongWide
                if routes.is_some()
                    && (p.output != p.input
                        || plan.epilogue.beta != 0.0
                        || plan.epilogue.accumulate) =>
            {
                return Err(unsupported(format!(
                    "the {} build takes tiles with routes of an output of the input's type \
                     (here {} from {}), without β·C or D +=",
                    variant.name(),
                    p.output,
                    p.input
                )));
            }
            _ => true,
        };
        if !serves {
            variant = match variant {
                GemmVariant::PingPong | GemmVariant::MidDirect => GemmVariant::Mid,
                _ => GemmVariant::Main,
            };
        }
        let function = kernels.entry(plan, variant)?;
        let plain = kernels.suffixed_entry(plan, variant, PLAIN_SUFFIX);
        let plain_tail = kernels.suffixed_entry(plan, variant, PLAIN_TAIL_SUFFIX);
        // (the wide build's plain calls with a bias keep its general entry, which spills less)
        let routed_entry = match variant.general_entry_takes_routes() || routes.is_some() {
            true => kernels.suffixed_entry(plan, variant, ROUTED_SUFFIX),
            false => None,
        };
        let a = a_map(ops.a, p.input, p.k, p.m, a_box_rows(p.m, variant))?;
        let mut b_padded = None;
        let mut b_addr = ops.b;
        if p.b_layout == BLayout::KN && !p.n.is_multiple_of(8) {
            // TMA's rows are multiples of 16 bytes: B [K, N] goes to a copy with N padded to 8
            let ld = p.n.next_multiple_of(8);
            let padded = DeviceMemory::zeroed(gpu, 2 * ld * p.k)?;
            // SAFETY: both regions hold K rows of the given pitches on this GPU
            unsafe { copy_2d(gpu, padded.addr(), 2 * ld, ops.b, 2 * p.n, 2 * p.n, p.k)? };
            b_addr = padded.addr();
            b_padded = Some(padded);
        }
        let b = b_map(b_addr, p, variant)?;
        // the folds that the build can take through its pipeline, and the map they load from
        let (staged_folds, fold_map) = match (routes.as_mut(), folds) {
            (Some(r), Some(source)) => match stage_folds(r, plan, variant, &source) {
                0 => (0, None),
                staged => (staged, Some(fold_map(&source, p.output, variant)?)),
            },
            _ => (0, None),
        };
        // The wide build's routed entries fold by the map alone (their consumers' boxes, not
        // the stages): loads of partials from global memory, compiled in beside it, made them
        // spill in their k-loop. So every folding route must take the map.
        if variant == GemmVariant::PingPongWide {
            if let Some(t) = routes.as_ref().and_then(|r| {
                r.iter()
                    .position(|r| r.fold_count != 0 && r.options & ROUTE_FOLD_TMA == 0)
            }) {
                return Err(unsupported(format!(
                    "the {} build folds partials by a tensor map: tile {t}'s partials must \
                     start at its column of a buffer whose rows are 16-byte multiples \
                     with the output's leading dimension",
                    variant.name()
                )));
            }
        }
        let staged_folds = match variant {
            GemmVariant::PingPongWide => 0,
            _ => staged_folds,
        };
        // the routes the consumers store by boxes, and their maps
        let boxed = match routes.as_mut() {
            Some(r) => box_routes(r, plan, variant),
            None => BoxRoutes::default(),
        };
        let route_bytes = routes
            .as_ref()
            .map_or(0, |r| std::mem::size_of_val(r.as_slice()))
            .next_multiple_of(64);
        let bands: Option<Vec<u32>> = plan
            .bands
            .as_ref()
            .map(|b| b.iter().map(|&r| r as u32).collect());
        let band_bytes = bands.as_ref().map_or(0, |b| 4 * b.len());
        let order: Vec<u32> = if variant == GemmVariant::Pair {
            pair_order(&plan.order, plan.tile_grid().1)
        } else {
            plan.order.iter().map(|&t| t as u32).collect()
        };
        let cap = if sm_cap == 0 {
            gpu.sm_count
        } else {
            sm_cap.min(gpu.sm_count)
        };
        // split against the SMs there are, not against the tiles: fewer tiles than SMs (a
        // small M) are one partial wave, cut along K so that the idle SMs share the work
        let one_wave = plan.tile_count() < cap as usize;
        let mode = variant.tail_mode(kernels.tail(), one_wave);
        // the pair build's grid is whole clusters that fit on the GPU at once
        let cap = match variant.cluster() {
            1 => cap,
            c => {
                let clusters = function.max_active_clusters(THREADS, variant.smem_bytes(), c)?;
                (cap / c).min(clusters).max(1) * c
            }
        };
        let tail = plan_tail(&order, cap as usize, p.k.div_ceil(BK), mode);
        // one table: the order (u32), then, 64-byte aligned, the routes, then the row bands
        // (u32), then the tail's units
        let order_bytes = (4 * order.len()).next_multiple_of(64);
        let tail_bytes = std::mem::size_of_val(tail.units.as_slice());
        let tail_at = order_bytes + route_bytes + band_bytes;
        // then, 128-byte aligned, the routes' tensor maps (the TMA engine reads them there)
        let maps_at = (tail_at + tail_bytes).next_multiple_of(128);
        let map_bytes = std::mem::size_of::<TmaDesc>();
        let total = maps_at + boxed.tile_maps.len() * map_bytes;
        let tables = DeviceMemory::zeroed(gpu, total)?;
        let mut bytes = vec![0u8; total];
        if let Some(b) = &bands {
            bytes[order_bytes + route_bytes..tail_at].copy_from_slice(bytemuck::cast_slice(b));
        }
        bytes[tail_at..tail_at + tail_bytes].copy_from_slice(bytemuck::cast_slice(&tail.units));
        for (j, &(t, addr, cols, rows, ld)) in boxed.tile_maps.iter().enumerate() {
            let at = maps_at + j * map_bytes;
            let map = box_map(addr, p.output, cols as u64, rows as u64, ld as u64)?;
            bytes[at..at + map_bytes].copy_from_slice(bytemuck::cast_slice(&map));
            if let Some(r) = routes.as_mut() {
                r[t].dst_map = tables.addr() + at as u64;
            }
        }
        // SAFETY: plain-old-data views of the two tables
        unsafe {
            std::ptr::copy_nonoverlapping(
                order.as_ptr() as *const u8,
                bytes.as_mut_ptr(),
                4 * order.len(),
            );
            if let Some(r) = &routes {
                std::ptr::copy_nonoverlapping(
                    r.as_ptr() as *const u8,
                    bytes.as_mut_ptr().add(order_bytes),
                    std::mem::size_of_val(r.as_slice()),
                );
            }
        }
        tables.upload(gpu, &bytes)?;
        let error = MappedHost::new(gpu, ErrorRecord::default())?;
        let e = &plan.epilogue;
        let tiles = plan.tile_count();
        // the helpers' partial tiles and one counter per tile with helpers
        let partial_bytes = tail.slots * workspace_slot_bytes(plan.tile);
        let workspace = DeviceMemory::zeroed(gpu, partial_bytes + 4 * tail.splits)?;
        let band_flags = match gather {
            Some(g) => {
                let table = DeviceMemory::zeroed(gpu, 8 * g.band_flags.len())?;
                table.upload(gpu, bytemuck::cast_slice::<u64, u8>(&g.band_flags))?;
                Some(table)
            }
            None => None,
        };
        let local = gather.map_or(0..0, |g| g.local.clone());
        let mut params = GemmParams {
            a: TmaDesc(a),
            b: TmaDesc(b),
            order: tables.addr(),
            routes: if routes.is_some() {
                tables.addr() + order_bytes as u64
            } else {
                0
            },
            d: ops.d,
            c: if e.beta != 0.0 {
                ops.c
                    .ok_or_else(|| unsupported("beta != 0 needs C".into()))?
            } else {
                0
            },
            bias: if e.bias {
                ops.bias.ok_or_else(|| {
                    unsupported("the epilogue adds a bias row but none was given".into())
                })?
            } else {
                0
            },
            err: error.device_addr(),
            timeout_ns: PIPELINE_TIMEOUT_NS,
            m: p.m as u32,
            n: p.n as u32,
            k: p.k as u32,
            tiles_n: plan.tile_grid().1 as u32,
            tile_count: tiles as u32,
            alpha: e.alpha,
            beta: e.beta,
            accumulate: e.accumulate as u32,
            rank: rank as u32,
            full_units: tail.full_units as u32,
            unit_count: tail.unit_count() as u32,
            call_options: 0,
            workspace: workspace.addr(),
            counters: workspace.addr() + partial_bytes as u64,
            tail: tables.addr() + tail_at as u64,
            bands: if bands.is_some() {
                tables.addr() + (order_bytes + route_bytes) as u64
            } else {
                0
            },
            epoch: 1,
            calls: 0,
            routes_alt: 0,
            band_flags: band_flags.as_ref().map_or(0, DeviceMemory::addr),
            local_row0: local.start as u32,
            local_rows: local.len() as u32,
            flag_timeout_ns: gather.map_or(0, |g| {
                (g.timeout.as_nanos() as u64).clamp(1, PIPELINE_TIMEOUT_NS / 2)
            }),
            d_tma: 0,
            fold_tma: fold_map.is_some() as u32,
            fold_prefetch: 0,
            next_prefetch: 0,
            a_box_bytes: (a_box_rows(p.m, variant) * 128) as u32,
            k_phases: 0,
            trace: 0,
            k_serpentine: 0,
            a_local: TmaDesc([0; 16]),
            d_map: TmaDesc([0; 16]),
            fold_map: TmaDesc(fold_map.unwrap_or([0; 16])),
        };
        // a routed GEMM's D holds the rows its routes into D reach
        let d_rows = if routes.is_some() { boxed.d_rows } else { p.m };
        if variant.stores_directly() {
            set_d_map(&mut params, p.output, d_rows)?;
        }
        Ok(PreparedGemm {
            d_rows,
            function,
            plain,
            plain_tail,
            routed_entry,
            params,
            grid: tail.grid as u32,
            variant,
            cooperative: tail.waits(),
            tail: tail.describe(),
            problem: *p,
            b_padded: b_padded.is_some(),
            routed: false,
            staged_folds,
            memory: Launched::new(
                gpu,
                GemmMemory {
                    error,
                    _tables: tables,
                    _band_flags: band_flags,
                    _workspace: workspace,
                    _b_padded: b_padded,
                },
            )?,
        })
    }

    /// The build of the kernel this GEMM runs (chosen when it was prepared).
    pub fn variant(&self) -> GemmVariant {
        self.variant
    }

    /// How the tiles beyond the last whole wave are shared out: `none`, `cut P×T` (T tiles
    /// in P parts each) or `stream-k T/W` (T tiles over W blocks).
    pub fn tail(&self) -> &str {
        &self.tail
    }

    /// The producer asks L2 for a unit's partials once it has issued the loads of the
    /// `k_blocks`-th k-block from the end of the unit's main loop (`k_blocks` − 1 loads left;
    /// of its first k-block where the unit has at most `k_blocks`, as a tail's unit may; 0:
    /// never), ahead of loading them into the stages (tiles of
    /// [`PreparedGemm::staged_folds`] only): so that the partials' reads from HBM spread over
    /// those k-blocks instead of coming from every SM at once at the end of a wave. Off unless
    /// set: measured halfway through the loop, it helps one partial only at K ≥ 14336 and
    /// slows the fold elsewhere, the partials taking L2 room the operands need (GEMM-NOTES.md,
    /// "The prefetch, measured").
    pub fn set_fold_prefetch(&mut self, k_blocks: u32) {
        self.params.fold_prefetch = k_blocks;
    }

    /// [`PreparedGemm::set_fold_prefetch`]'s k-blocks.
    pub fn fold_prefetch(&self) -> u32 {
        self.params.fold_prefetch
    }

    /// How many of each unit's first k-blocks the producer asks L2 for while it loads the
    /// block's unit before (0: none, the default), once as many k-blocks of that unit are
    /// left to load: the next tile's first loads then find L2 warm instead of waiting on HBM
    /// after the consumers free their stages. Not in the pair build or a GEMM with a gather.
    pub fn set_next_prefetch(&mut self, k_blocks: u32) {
        self.params.next_prefetch = k_blocks;
    }

    /// How many places in K the blocks start their units' loads at (0 or 1: all at the
    /// unit's first k-block, the default): block b starts (b mod phases) / phases of the way
    /// into each unit's K range and wraps around, so that blocks sharing A's rows (at decode
    /// sizes, every block) ask L2 for that many different k-blocks at a time instead of all
    /// for the same one. The sums then run in another order (within the same bound).
    pub fn set_k_phases(&mut self, phases: u32) {
        self.params.k_phases = phases;
    }

    /// Whether a block loads the k-blocks of the units at odd places of its sequence (its
    /// second, fourth, ... wave) from the last to the first (0: no, the default; else yes):
    /// each such unit then starts on the K slices the wave before read last, which L2 may
    /// still hold where a wave's operands do not all fit in it. The sums run in another order
    /// (within the same bound). Measured, it changes nothing beyond the bench's spread
    /// (GEMM-NOTES.md, "Every other wave's K loop reversed"), so it stays off. The next
    /// unit's prefetch ([`PreparedGemm::set_next_prefetch`]) still asks for a unit's first
    /// k-blocks, where a reversed unit starts at its last.
    pub fn set_k_serpentine(&mut self, on: u32) {
        self.params.k_serpentine = u32::from(on != 0);
    }

    /// Whether the units at odd places of a block's sequence load their k-blocks last to
    /// first ([`PreparedGemm::set_k_serpentine`]).
    pub fn k_serpentine(&self) -> bool {
        self.params.k_serpentine != 0
    }

    /// Every call from now on runs the build's general entry, also where a plain one would
    /// serve it (by default a call that asks for no option runs a plain entry where the build
    /// has one, and a routed call a routed entry): what a bench's row beside the plain or
    /// routed one times.
    /// A build whose general entry takes no routes keeps its routed entry for routed calls.
    pub fn use_general_entry(&mut self) {
        self.plain = None;
        self.plain_tail = None;
        if self.variant.general_entry_takes_routes() || !self.routed {
            self.routed_entry = None;
        }
    }

    /// Which entry [`PreparedGemm::launch`] runs.
    pub fn entry(&self) -> GemmEntry {
        self.entry_of(&self.params).0
    }

    /// The entry a call with `params` runs, and its function.
    fn entry_of(&self, params: &GemmParams) -> (GemmEntry, &Function) {
        let other = match entry_for(params) {
            GemmEntry::General => None,
            GemmEntry::Plain => self.plain.as_ref().map(|f| (GemmEntry::Plain, f)),
            GemmEntry::PlainTail => self.plain_tail.as_ref().map(|f| (GemmEntry::PlainTail, f)),
            GemmEntry::Routed => self.routed_entry.as_ref().map(|f| (GemmEntry::Routed, f)),
        };
        other.unwrap_or((GemmEntry::General, &self.function))
    }

    /// Tiles whose partials the kernel loads into its pipeline's stages by TMA; the other
    /// folding tiles read theirs from global memory after their main loop.
    pub fn staged_folds(&self) -> usize {
        self.staged_folds
    }

    /// Blocks of its persistent grid (at most the SMs, or the cap; whole clusters of the pair
    /// build that fit at once).
    pub fn grid(&self) -> u32 {
        self.grid
    }

    /// Where this GEMM's tile order is on the device: u32 tile numbers, the order the blocks
    /// take them in (the pair build's: paired, with [`PAIR_IDLE`] entries).
    pub fn order_addr(&self) -> u64 {
        self.params.order
    }

    /// Where this GEMM's tile routes are on the device (0 for none): what a GEMM of the other
    /// set takes as [`CallNumber::Device`]'s `routes_alt`.
    pub fn routes_addr(&self) -> u64 {
        self.params.routes
    }

    /// Queues the GEMM on `stream`.
    ///
    /// # Safety
    /// The operands and destinations given to [`PreparedGemm::new`] must still be valid and
    /// not in use by anything else until the launch completes.
    pub unsafe fn launch(&self, stream: &Stream) -> Result<(), CudaError> {
        self.queue(stream, &self.params)
    }

    /// Queues the GEMM on its prepared operands as call number `epoch` (the value epoch flags
    /// store and folds wait for; [`PreparedGemm::launch`] is call 1).
    ///
    /// # Safety
    /// As [`PreparedGemm::launch`].
    pub unsafe fn launch_numbered(&self, stream: &Stream, epoch: u64) -> Result<(), CudaError> {
        let params = GemmParams {
            epoch,
            ..self.params
        };
        self.queue(stream, &params)
    }

    /// Queues the GEMM on `stream` with this call's A, B and bias (the shapes prepared; the
    /// tables unchanged), D (for routes relative to it; `None` keeps the prepared one) and
    /// call number (the value epoch flags store and folds wait for): the TMA descriptors are encoded
    /// again on the host, a few microseconds, no device work and no synchronisation. How an
    /// operator runs on the caller's buffers.
    ///
    /// # Safety
    /// `a` and `b` must hold the prepared problem's operands (and `bias` N elements of the
    /// output type) on this GPU, `d` what the routes write there, and they and the prepared
    /// destinations must stay valid until the launch completes.
    pub unsafe fn launch_call(
        &self,
        stream: &Stream,
        a: u64,
        b: u64,
        bias: Option<u64>,
        d: Option<u64>,
        call: CallNumber,
    ) -> Result<(), CudaError> {
        let p = &self.problem;
        let mut params = self.call_params(b, bias, d, call)?;
        let box_rows = a_box_rows(p.m, self.variant);
        params.a = TmaDesc(a_map(a, p.input, p.k, p.m, box_rows)?);
        self.queue(stream, &params)
    }

    /// [`PreparedGemm::launch_call`] for a GEMM prepared by [`PreparedGemm::gathering`]:
    /// `a_local` holds this call's own rows ([`Gather::local`], K each), the other rows come
    /// from the prepared gather buffer as their flags allow.
    ///
    /// # Safety
    /// As [`PreparedGemm::launch_call`]; the flags and the gather buffer must stay valid too.
    pub unsafe fn launch_gather_call(
        &self,
        stream: &Stream,
        a_local: u64,
        b: u64,
        bias: Option<u64>,
        d: u64,
        call: CallNumber,
    ) -> Result<(), CudaError> {
        let p = &self.problem;
        if self.params.band_flags == 0 {
            return Err(unsupported(
                "this GEMM was not prepared to gather its A".into(),
            ));
        }
        let mut params = self.call_params(b, bias, Some(d), call)?;
        if params.local_rows != 0 {
            params.a_local = TmaDesc(a_map(
                a_local,
                p.input,
                p.k,
                params.local_rows as usize,
                a_box_rows(p.m, self.variant),
            )?);
        }
        self.queue(stream, &params)
    }

    /// Queues the kernel with `params` and records the launch. A tail tile's owner waits for
    /// its helpers ([`TailPlan`]), so every block must be resident at once: such a grid is a
    /// cooperative launch, which the driver starts only once all of it fits (it waits for SMs
    /// that other streams' kernels hold instead of starting part of the grid, whose owners
    /// could then wait for helpers that never get an SM). Other grids have no block that waits
    /// for another and launch as usual.
    ///
    /// # Safety
    /// As [`PreparedGemm::launch_call`], for the addresses in `params`.
    unsafe fn queue(&self, stream: &Stream, params: &GemmParams) -> Result<(), CudaError> {
        let (_, function) = self.entry_of(params);
        if self.variant.cluster() > 1 {
            function.launch_cluster_with_smem(
                self.grid,
                THREADS,
                self.variant.smem_bytes(),
                self.variant.cluster(),
                stream,
                params,
            )?;
        } else if self.cooperative {
            function.launch_cooperative_with_smem(
                self.grid,
                THREADS,
                self.variant.smem_bytes(),
                stream,
                params,
            )?;
        } else {
            function.launch_with_smem(
                self.grid,
                THREADS,
                self.variant.smem_bytes(),
                stream,
                params,
            )?;
        }
        self.memory.launched(stream)
    }

    /// The prepared parameters with this call's B, bias, D and number (A as prepared).
    fn call_params(
        &self,
        b: u64,
        bias: Option<u64>,
        d: Option<u64>,
        call: CallNumber,
    ) -> Result<GemmParams, CudaError> {
        let p = &self.problem;
        if self.b_padded {
            return Err(unsupported(format!(
                "B as [K, N] needs N to be a multiple of 8 to change per call, got N={}",
                p.n
            )));
        }
        if !self.routed && (self.params.bias != 0) != bias.is_some() {
            return Err(unsupported(
                "the bias must be given exactly when the GEMM was prepared with one".into(),
            ));
        }
        if !b.is_multiple_of(16) {
            return Err(unsupported(format!(
                "B must start on a 16-byte boundary (TMA), got {b:#x}"
            )));
        }
        let mut params = self.params;
        params.b = TmaDesc(b_map(b, p, self.variant)?);
        params.bias = bias.unwrap_or(0);
        if let Some(d) = d.filter(|&d| d != params.d) {
            params.d = d;
            if self.variant.stores_directly() {
                set_d_map(&mut params, p.output, self.d_rows)?;
            }
        }
        match call {
            CallNumber::Host(epoch) => params.epoch = epoch,
            CallNumber::Device {
                counter,
                routes_alt,
            } => {
                if params.routes == 0 && routes_alt != 0 {
                    return Err(unsupported(
                        "a GEMM without routes cannot take other routes in alternate calls".into(),
                    ));
                }
                params.calls = counter;
                params.routes_alt = routes_alt;
            }
            CallNumber::Counted { counter } => {
                params.calls = counter;
                params.call_options = CALLS_READ_ONLY;
            }
        }
        Ok(params)
    }

    /// The bound of every pipeline wait of later launches (by default 5 s); flag waits keep
    /// the bound they were prepared with ([`Gather::timeout`] or half the default), so one
    /// below theirs makes a long flag wait end as a pipeline stall.
    pub fn set_pipeline_timeout(&mut self, timeout: Duration) {
        self.params.timeout_ns = (timeout.as_nanos() as u64).max(1);
    }

    /// After the launches so far were waited for: the stall report of a wait that gave up in
    /// any of them, as an error. A kernel whose wait gave up ends on its own without storing
    /// the tiles it had left (the synchronisation itself succeeds), so every caller checks.
    pub fn check(&self) -> Result<(), CudaError> {
        match self.stall_report() {
            Some(report) => Err(CudaError::Stalled(report)),
            None => Ok(()),
        }
    }

    /// What the kernel recorded when a wait of one of its launches gave up, if one did.
    pub fn stall_report(&self) -> Option<String> {
        let e = self.memory.error.read();
        (e.flag != 0).then(|| {
            let what = [
                "an empty stage",
                "a full stage",
                "the staging buffer",
                "a staged tile",
                "the partial tiles of a split tile",
                "a peer's partial of a tile it folds in (its flag)",
                "the rows of A a peer copies in (their flag)",
                "the other consumer warpgroup's turn (the ping-pong build)",
                "a box of a partial it folds (the wide ping-pong build)",
            ]
                .get(e.slot as usize)
                .copied()
                .unwrap_or("?");
            if e.slot == 5 || e.slot == 6 {
                return format!(
                    "GEMM on rank {}: block {} waited for {what} at tile {}: the flag held call {}, this is call {}",
                    e.rank, e.lane, e.step, e.seen, e.expected
                );
            }
            format!(
                "GEMM pipeline stalled on rank {}: block {} (thread {}) waited for {what} (parity {}) at tile {}",
                e.rank, e.lane, e.seen, e.expected, e.step
            )
        })
    }
}

/// Mirrors `SnapshotParams` in gemm.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct SnapshotParams {
    order: u64,
    src: u64,
    snap: u64,
    flags: u64,
    expected: u64,
    err: u64,
    timeout_ns: u64,
    m: u32,
    n: u32,
    tiles_n: u32,
    tile_count: u32,
    elem_bytes: u32,
    rank: u32,
}

/// A consumer of flagged tiles on the destination GPU, for testing the flag protocol: it waits
/// for each tile's flag (one u64 per tile at `flags`, ready at >= `expected`) in the plan's
/// order and copies the tile from `src` ([M, N] row-major) to `snap` the moment it is ready.
pub struct TileSnapshot {
    params: SnapshotParams,
    function: Function,
    order: Launched<DeviceMemory>,
}

impl TileSnapshot {
    pub fn new(
        gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        src: u64,
        snap: u64,
        flags: u64,
        error: &MappedHost<ErrorRecord>,
    ) -> Result<TileSnapshot, CudaError> {
        let p = &plan.problem;
        if plan.tile != TILE {
            return Err(unsupported(format!(
                "the tile snapshot takes {}×{} tiles",
                TILE.m, TILE.n
            )));
        }
        check_problem(p)?;
        let order: Vec<u32> = plan.order.iter().map(|&t| t as u32).collect();
        let table = DeviceMemory::zeroed(gpu, 4 * order.len())?;
        table.upload(gpu, &order)?;
        Ok(TileSnapshot {
            params: SnapshotParams {
                order: table.addr(),
                src,
                snap,
                flags,
                expected: 0,
                err: error.device_addr(),
                timeout_ns: PIPELINE_TIMEOUT_NS,
                m: p.m as u32,
                n: p.n as u32,
                tiles_n: commfuse_core::gemm::tiles(p, TILE).1 as u32,
                tile_count: order.len() as u32,
                elem_bytes: p.output.size() as u32,
                rank: 1,
            },
            function: kernels.snapshot.clone(),
            order: Launched::new(gpu, table)?,
        })
    }

    /// Queues the consumer; it returns once every tile's flag reached `expected`.
    ///
    /// # Safety
    /// The buffers given to [`TileSnapshot::new`] must be valid until the launch completes.
    pub unsafe fn launch(
        &mut self,
        stream: &Stream,
        expected: u64,
        blocks: u32,
    ) -> Result<(), CudaError> {
        self.params.expected = expected;
        self.function.launch(blocks, 256, stream, &self.params)?;
        self.order.launched(stream)
    }
}

/// Dynamic shared memory of one `hold_sms` block: more than half an SM's 228 KiB, so that
/// one block holds a whole SM (neither a second holder nor a GEMM block fits beside it).
const HOLD_SMEM_BYTES: u32 = 120 * 1024;

/// Mirrors `HoldParams` in gemm.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct HoldParams {
    arrived: u64,
    timed_out: u64,
    release: u64,
    timeout_ns: u64,
}

/// The holder's counters, in host-mapped memory.
struct HoldMemory {
    arrived: MappedHost<u32>,
    timed_out: MappedHost<u32>,
    release: MappedHost<u32>,
}

impl InUse for HoldMemory {
    /// Releases every block.
    fn abort(&self) {
        self.release.write(1);
    }
}

/// A kernel that keeps SMs busy until the host releases it, for testing a GEMM launched while
/// another stream's kernel holds most of the GPU: each of its blocks takes a whole SM and
/// spins (thread 0 of 32) until [`SmHolder::release`] or its bound.
pub struct SmHolder {
    function: Function,
    memory: Launched<HoldMemory>,
}

impl SmHolder {
    pub fn new(gpu: &Gpu, kernels: &GemmKernels) -> Result<SmHolder, CudaError> {
        Ok(SmHolder {
            function: kernels.hold.clone(),
            memory: Launched::new(
                gpu,
                HoldMemory {
                    arrived: MappedHost::new(gpu, 0)?,
                    timed_out: MappedHost::new(gpu, 0)?,
                    release: MappedHost::new(gpu, 0)?,
                },
            )?,
        })
    }

    /// Queues `blocks` holding blocks on `stream` (at most one per SM), each ending once
    /// released or after `timeout`. The previous launch must have ended.
    pub fn launch(&self, stream: &Stream, blocks: u32, timeout: Duration) -> Result<(), CudaError> {
        let m = &*self.memory;
        m.arrived.write(0);
        m.timed_out.write(0);
        m.release.write(0);
        let params = HoldParams {
            arrived: m.arrived.device_addr(),
            timed_out: m.timed_out.device_addr(),
            release: m.release.device_addr(),
            timeout_ns: (timeout.as_nanos() as u64).max(1),
        };
        // SAFETY: the counters live as long as `memory`, whose drop releases the blocks and
        // waits for them to end
        unsafe {
            self.function
                .launch_with_smem(blocks, 32, HOLD_SMEM_BYTES, stream, &params)?
        };
        self.memory.launched(stream)
    }

    /// Waits on the host, up to `timeout`, until `blocks` blocks have started; whether they did.
    pub fn wait_resident(&self, blocks: u32, timeout: Duration) -> Result<bool, CudaError> {
        poll_until(timeout, || Ok(self.memory.arrived.read() >= blocks))
    }

    /// Lets every block of the launch end.
    pub fn release(&self) {
        self.memory.release.write(1);
    }

    /// Blocks of the last launch that ended at their bound instead of being released.
    pub fn timed_out(&self) -> u32 {
        self.memory.timed_out.read()
    }
}

/// The route table, or None when every tile goes to the local D without a flag.
fn routes(
    plan: &GemmPlan,
    ops: &GemmOperands,
    targets: Option<&RouteTargets<'_>>,
    rank: usize,
) -> Result<Option<Vec<TileRoute>>, CudaError> {
    if plan.destinations.is_none() && plan.flags.is_none() {
        return Ok(None);
    }
    let size = plan.problem.output.size() as u64;
    let mut out = Vec::with_capacity(plan.tile_count());
    for t in 0..plan.tile_count() {
        let dest = plan.destination(t, rank);
        let base = if plan.destinations.is_some() {
            let targets = targets.ok_or_else(|| {
                unsupported("a destination table needs the destination ranks' buffers".into())
            })?;
            targets.outputs[dest.rank]
        } else {
            ops.d
        };
        let mut route = TileRoute {
            dst: base + dest.offset as u64 * size,
            ld: u32::try_from(dest.ld).map_err(|_| {
                unsupported(format!("tile {t}: leading dimension {} too large", dest.ld))
            })?,
            ..TileRoute::default()
        };
        if let Some(flags) = &plan.flags {
            let targets = targets.ok_or_else(|| {
                unsupported("tile flags need the destination ranks' signal pads".into())
            })?;
            let f = flags[t];
            route.flag = (targets.flag)(dest.rank, f.slot);
            route.flag_value = f.value;
            route.flag_op = match f.op {
                NotifyOp::Set => 0,
                NotifyOp::Add => 1,
            };
        }
        out.push(route);
    }
    Ok(Some(out))
}

/// The tensor map of D (dense [`rows`, N], ld N: M rows for a plain GEMM, those the routes into
/// D reach for a routed one, see [`box_routes`]) of the builds whose consumers store tiles
/// themselves ([`GemmVariant::stores_directly`]), where their tensor stores can write it: a
/// 16-bit D on a 16-byte boundary, rows a multiple of 16 bytes, and a GEMM that replaces D
/// rather than adding to it; elsewhere its consumers store from registers (`d_tma` 0).
fn set_d_map(params: &mut GemmParams, output: DType, rows: usize) -> Result<(), CudaError> {
    params.d_tma = (d_map_fits(params, output) && rows > 0) as u32;
    if params.d_tma != 0 {
        params.d_map = TmaDesc(box_map(
            params.d,
            output,
            params.n as u64,
            rows as u64,
            params.n as u64,
        )?);
    }
    Ok(())
}

/// A tensor map of the consumers' boxes (64 rows × 128 bytes, 128-byte swizzle) over `rows` ×
/// `cols` elements of `output` at `addr`, rows `ld` elements apart.
fn box_map(
    addr: u64,
    output: DType,
    cols: u64,
    rows: u64,
    ld: u64,
) -> Result<[u64; 16], CudaError> {
    tensor_map_2d(
        addr,
        output,
        (cols, rows),
        ld * output.size() as u64,
        ((DIRECT_BOX.1 / output.size()) as u32, DIRECT_BOX.0 as u32),
    )
}

/// Whether the direct and the ping-pong build's tensor stores can write the D of `params`
/// ([`set_d_map`]).
fn d_map_fits(params: &GemmParams, output: DType) -> bool {
    let row_bytes = params.n as u64 * output.size() as u64;
    output.size() == 2
        && params.d != 0
        && params.d.is_multiple_of(16)
        && row_bytes.is_multiple_of(16)
        && params.accumulate == 0
}

/// The routes that a build whose consumers store by boxes ([`GemmVariant::routes_by_consumers`])
/// sends by its tensor stores ([`box_routes`]).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct BoxRoutes {
    /// A map each for the tiles into another buffer than D: (route, address of the tile's
    /// element (0, 0), its columns, its rows, the destination's leading dimension). The map
    /// ends where the tile does, so that a box's rows or columns past it write nothing.
    pub tile_maps: Vec<(usize, u64, usize, usize, usize)>,
    /// The rows of D that the routes into D reach: the rows of the call's map of D (0: none)
    pub d_rows: usize,
}

/// Marks the routes whose 16-bit tiles the build `variant` can store by its consumers' tensor
/// stores (`ROUTE_DST_BOXES`) and says which maps they need; clears the mark elsewhere. A
/// tile into another buffer (a peer's receive slot) qualifies when its address and rows lie
/// on 16-byte boundaries: it gets a map of its own rows and columns. A tile into D
/// (`ROUTE_DST_FROM_D`, D's ld N) goes through the call's map of D at its row and column
/// there, which ends at the last row that such routes reach; it qualifies where its rows are
/// whole boxes of 64 or end at that last row, so that no box writes rows of D past the tile
/// (another tile's). The others keep the consumers' stores from registers.
pub(crate) fn box_routes(
    routes: &mut [TileRoute],
    plan: &GemmPlan,
    variant: GemmVariant,
) -> BoxRoutes {
    let p = &plan.problem;
    let eb = p.output.size() as u64;
    let row_bytes = p.n as u64 * eb;
    let mut out = BoxRoutes::default();
    // (a box replaces what it covers: D += stores from registers)
    let usable = variant.routes_by_consumers()
        && eb == 2
        && plan.tile == variant.tile()
        && !plan.epilogue.accumulate;
    // (tile, its rows, and its row and column in D) of the routes into D that can go by boxes
    let mut into_d = Vec::new();
    for (t, r) in routes.iter_mut().enumerate() {
        r.options &= !ROUTE_DST_BOXES;
        (r.dst_map, r.dst_col, r.dst_row) = (0, 0, 0);
        if !usable {
            continue;
        }
        let (rows, cols) = plan.tile_bounds(t);
        let ld_bytes = r.ld as u64 * eb;
        if r.options & ROUTE_DST_FROM_D != 0 {
            let (row, col) = (r.dst / row_bytes, r.dst % row_bytes);
            if r.ld as usize == p.n && col == cols.start as u64 * eb && row_bytes.is_multiple_of(16)
            {
                into_d.push((t, rows.len(), row as usize, cols.start));
                out.d_rows = out.d_rows.max(row as usize + rows.len());
            }
        } else if r.dst.is_multiple_of(16)
            && ld_bytes.is_multiple_of(16)
            && r.ld as usize >= cols.len()
        {
            r.options |= ROUTE_DST_BOXES;
            out.tile_maps
                .push((t, r.dst, cols.len(), rows.len(), r.ld as usize));
        }
    }
    for (t, rows, row, col) in into_d {
        if rows.is_multiple_of(DIRECT_BOX.0) || row + rows == out.d_rows {
            let r = &mut routes[t];
            r.options |= ROUTE_DST_BOXES;
            (r.dst_col, r.dst_row) = (col as u32, row as u32);
        }
    }
    out
}

/// Marks the routes whose partials the kernel build `variant` can load by TMA from `source`
/// (`ROUTE_FOLD_TMA`, with their rows in it) and clears the mark elsewhere; how many have
/// it. A tile's partials qualify when the build stages folds (the main and the direct build,
/// whose B stages hold two boxes of the tile's rows × 128 bytes, and the skinny build, whose
/// B stages hold four of its 64 rows; see `FoldBoxes` in gemm.cu),
/// each partial starts at
/// the tile's first column in a row of `source`, with the routes' leading dimension, one
/// whole number of rows from the next, and all of the tile's rows of every partial lie in
/// it; the tensor map needs `base` and the rows on 16-byte boundaries. Others keep the
/// consumers' loads from global memory.
pub(crate) fn stage_folds(
    routes: &mut [TileRoute],
    plan: &GemmPlan,
    variant: GemmVariant,
    source: &FoldSource,
) -> usize {
    let eb = plan.problem.output.size() as u64;
    let row_bytes = source.ld as u64 * eb;
    let map_ok = (matches!(
        variant,
        GemmVariant::Main | GemmVariant::Direct | GemmVariant::Skinny
    ) && plan.tile == TILE
        || variant == GemmVariant::PingPongWide && plan.tile == WIDE_TILE)
        && source.base.is_multiple_of(16)
        && row_bytes.is_multiple_of(16)
        && source.rows > 0;
    let mut staged = 0;
    for (t, r) in routes.iter_mut().enumerate() {
        r.options &= !ROUTE_FOLD_TMA;
        (r.fold_row, r.fold_row_step) = (0, 0);
        if !map_ok || r.fold_count == 0 || r.fold_ld as usize != source.ld {
            continue;
        }
        let (rows, cols) = plan.tile_bounds(t);
        let Some(offset) = r.fold_src.checked_sub(source.base) else {
            continue;
        };
        let (row, col) = (offset / row_bytes, offset % row_bytes);
        let step = r.fold_stride / row_bytes;
        let last = row + (r.fold_count as u64 - 1) * step + rows.len() as u64;
        if col != cols.start as u64 * eb
            || !r.fold_stride.is_multiple_of(row_bytes)
            || last > source.rows as u64
            || last > i32::MAX as u64
        {
            continue;
        }
        r.options |= ROUTE_FOLD_TMA;
        (r.fold_row, r.fold_row_step) = (row as u32, step as u32);
        staged += 1;
    }
    staged
}

/// The tensor map the kernel loads staged partials with ([`stage_folds`]): `source` as a
/// [rows, ld] matrix of the output type, in boxes of the build's rows × 128 bytes (the wide
/// ping-pong build: 64 rows, one of its consumers' box buffers).
fn fold_map(
    source: &FoldSource,
    output: DType,
    variant: GemmVariant,
) -> Result<[u64; 16], CudaError> {
    tensor_map_2d(
        source.base,
        output,
        (source.ld as u64, source.rows as u64),
        (source.ld * output.size()) as u64,
        (
            (128 / output.size()) as u32,
            match variant {
                GemmVariant::PingPongWide => DIRECT_BOX.0 as u32,
                _ => variant.rows() as u32,
            },
        ),
    )
}

/// B's tensor map: [N, K] in boxes of BK × the tile's columns (half of them in a block of a
/// pair, which loads half of the tile's rows of B), [K, N] (rows padded to a multiple of 8
/// elements: `b` is then the padded copy) in boxes of 64 columns × BK.
fn b_map(b: u64, p: &GemmProblem, variant: GemmVariant) -> Result<[u64; 16], CudaError> {
    match p.b_layout {
        BLayout::NK => tensor_map_2d(
            b,
            p.input,
            (p.k as u64, p.n as u64),
            2 * p.k as u64,
            (BK as u32, variant.tile().n as u32 / variant.cluster()),
        ),
        BLayout::KN => tensor_map_2d(
            b,
            p.input,
            (p.n as u64, p.k as u64),
            2 * p.n.next_multiple_of(8) as u64,
            (64, BK as u32),
        ),
    }
}

/// Rows of A's box for the build `variant` on a product of `m` rows: as many as the build
/// computes of a tile, or M rounded up to the 8-row swizzle atom where that is fewer. The rows
/// of a stage past the box keep whatever they held, which reaches only accumulator rows past M
/// that nothing stores. A box's rows past M are zero-filled, yet at 16 rows Nsight Compute
/// counted nearly as many L2 sectors as at 64 (GEMM-NOTES.md, "The activations' box").
fn a_box_rows(m: usize, variant: GemmVariant) -> usize {
    variant.rows().min(m.next_multiple_of(8))
}

/// The TMA map of an A of `rows` × `k` elements (16-byte aligned) at `a`, in boxes of
/// `box_rows` ([`a_box_rows`]) × BK.
fn a_map(
    a: u64,
    input: DType,
    k: usize,
    rows: usize,
    box_rows: usize,
) -> Result<[u64; 16], CudaError> {
    if !a.is_multiple_of(16) {
        return Err(unsupported(format!(
            "A must start on a 16-byte boundary (TMA), got {a:#x}"
        )));
    }
    tensor_map_2d(
        a,
        input,
        (k as u64, rows as u64),
        2 * k as u64,
        (BK as u32, box_rows as u32),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_box_has_the_builds_rows_or_m_rounded_up_to_the_swizzle_atom() {
        use GemmVariant::*;
        for (m, variant, rows) in [
            (1, NarrowDeep, 8),
            (16, NarrowDeep, 16),
            (17, Skinny, 24),
            (64, Narrow, 64),
            (65, NarrowTall, 72),
            (100, Direct, 104),
            (128, Main, 128),
            (8192, PingPong, 128),
        ] {
            assert_eq!(a_box_rows(m, variant), rows, "{m} {variant:?}");
        }
    }

    #[test]
    fn only_calls_without_options_take_a_plain_entry_and_routed_ones_a_routed_entry() {
        // a plain GEMM as prepared: D by tensor stores, whole tiles only
        let plain = GemmParams {
            d_tma: 1,
            unit_count: 128,
            full_units: 128,
            alpha: 2.0,
            beta: 1.0,
            c: 0,
            next_prefetch: 2,
            k_phases: 4,
            k_serpentine: 1,
            trace: 0x1000,
            calls: 0x2000,
            ..GemmParams::zeroed()
        };
        assert_eq!(entry_for(&plain), GemmEntry::Plain);
        let no_c = GemmParams {
            c: 0x100,
            beta: 0.0,
            ..plain
        };
        assert_eq!(entry_for(&no_c), GemmEntry::Plain);
        // a split tail: the plain entry that keeps it
        let tail = GemmParams {
            full_units: 120,
            ..plain
        };
        assert_eq!(entry_for(&tail), GemmEntry::PlainTail);
        // the options of GEMM + reduce-scatter (and a bias) take the routed entry, the other
        // operators' the general one
        let options: [(&str, GemmEntry, GemmParams); 12] = [
            (
                "no tensor stores of D",
                GemmEntry::Routed,
                GemmParams { d_tma: 0, ..plain },
            ),
            (
                "routes",
                GemmEntry::Routed,
                GemmParams {
                    routes: 0x100,
                    ..plain
                },
            ),
            (
                "other routes in alternate calls",
                GemmEntry::Routed,
                GemmParams {
                    routes_alt: 0x100,
                    ..plain
                },
            ),
            (
                "row bands",
                GemmEntry::Routed,
                GemmParams {
                    bands: 0x100,
                    ..plain
                },
            ),
            (
                "a gather's flags",
                GemmEntry::General,
                GemmParams {
                    band_flags: 0x100,
                    ..plain
                },
            ),
            (
                "rows of A read from the caller's",
                GemmEntry::General,
                GemmParams {
                    local_rows: 64,
                    ..plain
                },
            ),
            (
                "folds by TMA",
                GemmEntry::Routed,
                GemmParams {
                    fold_tma: 1,
                    ..plain
                },
            ),
            (
                "the folds' prefetch",
                GemmEntry::Routed,
                GemmParams {
                    fold_prefetch: 1,
                    ..plain
                },
            ),
            (
                "the bias",
                GemmEntry::Routed,
                GemmParams {
                    bias: 0x100,
                    ..plain
                },
            ),
            (
                "beta times C",
                GemmEntry::General,
                GemmParams { c: 0x100, ..plain },
            ),
            (
                "accumulation into D",
                GemmEntry::General,
                GemmParams {
                    accumulate: 1,
                    ..plain
                },
            ),
            (
                "all of them",
                GemmEntry::General,
                GemmParams {
                    bias: 0x100,
                    routes: 0x100,
                    accumulate: 1,
                    ..tail
                },
            ),
        ];
        for (what, entry, params) in options {
            assert_eq!(entry_for(&params), entry, "{what}");
            let tail = GemmParams {
                full_units: 120,
                ..params
            };
            assert_eq!(entry_for(&tail), entry, "{what}, a split tail");
        }
    }

    #[test]
    fn a_plan_must_be_cut_in_the_tile_of_one_of_the_builds() {
        let ops = GemmOperands::plain(0, 0, 0);
        for v in GemmVariant::ALL {
            check_plan(&banded_plan(256, v.tile(), None), &ops, 1).unwrap();
        }
        let plan = banded_plan(256, TileShape { m: 16, n: 32 }, None);
        let err = check_plan(&plan, &ops, 1).unwrap_err().to_string();
        assert!(
            err.contains(
                "the GPU GEMM computes 128×256, 128×64, 128×128, 64×128, 128×192 tiles, the plan has 16×32"
            ),
            "{err}"
        );
    }

    #[test]
    fn fused_schedules_must_be_cut_in_the_kernels_tile() {
        assert!(check_tile(TILE).is_ok());
        let err = check_tile(TileShape { m: 16, n: 32 })
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the GPU GEMM computes 128×256 tiles, the configuration asks for 16×32"
        );
    }

    #[test]
    fn auto_plans_wide_tiles_where_blocks_run_many_turns_of_no_more_work() {
        let problem = |m, n, k, out| GemmProblem::new(m, n, k, BLayout::NK, DType::BF16, out);
        let auto =
            |m, n, k| VariantChoice::Auto.tile_for(&problem(m, n, k, DType::BF16).unwrap(), 132);
        // measured faster than the direct build (GEMM-NOTES.md, "The wide ping-pong build")
        for (m, n, k) in [(8192, 8192, 3584), (16384, 8192, 3584), (8192, 8192, 14336)] {
            assert_eq!(auto(m, n, k), WIDE_TILE, "{m} × {n} × {k}");
        }
        // measured slower (2048, 1024 rows); too few turns a block (1024 × 12288: 3.9, the
        // same work as the direct build's 2.9 waves; 128 rows); more work for the busiest
        // block than the direct build's (4096 × 8192: 11 turns against 8 waves)
        for (m, n) in [
            (2048, 8192),
            (1024, 8192),
            (1024, 12288),
            (128, 28672),
            (4096, 8192),
        ] {
            assert_ne!(auto(m, n, 3584), WIDE_TILE, "{m} × {n}");
        }
        assert!(wide_tiles_pay(
            &problem(8192, 8192, 3584, DType::BF16).unwrap(),
            132
        ));
        assert!(!wide_tiles_pay(
            &problem(8192, 8192, 3584, DType::F32).unwrap(),
            132
        ));
        // an epilogue that reads C keeps the direct build's tiles; a bias does not
        let p = problem(8192, 8192, 3584, DType::BF16).unwrap();
        let bias = Epilogue {
            bias: true,
            ..Epilogue::default()
        };
        assert_eq!(
            VariantChoice::Auto.tile_for_epilogue(&p, &bias, 132),
            WIDE_TILE
        );
        for e in [
            Epilogue {
                beta: 1.0,
                ..Epilogue::default()
            },
            Epilogue {
                accumulate: true,
                ..Epilogue::default()
            },
        ] {
            assert_eq!(
                VariantChoice::Auto.tile_for_epilogue(&p, &e, 132),
                TILE,
                "{e:?}"
            );
        }
        assert_eq!(
            VariantChoice::Auto.tile_for_epilogue(&p, &Epilogue::default(), 132),
            WIDE_TILE
        );
        let forced = VariantChoice::PingPongWide.tile_for_epilogue(&p, &bias, 132);
        assert_eq!(forced, WIDE_TILE);
        assert_eq!(
            VariantChoice::PingPongWide.variant_for(&GemmPlan::local(p, WIDE_TILE, bias)),
            GemmVariant::PingPongWide
        );
    }

    #[test]
    fn stream_k_serves_every_build_that_cuts_its_tail_but_the_pair_and_the_ping_pong() {
        for v in GemmVariant::ALL {
            for one_wave in [false, true] {
                let cut = v.tail_mode(TailChoice::Cut, one_wave);
                let spread = v.tail_mode(TailChoice::StreamK, one_wave);
                let max_parts = v.max_parts(one_wave);
                assert_eq!(cut, TailMode::Cut { max_parts });
                let want = match v {
                    GemmVariant::Pair | GemmVariant::PingPong | GemmVariant::PingPongWide => {
                        TailMode::Cut { max_parts: 1 }
                    }
                    // (one partial wave whole)
                    GemmVariant::MidDirect if one_wave => TailMode::Cut { max_parts: 1 },
                    _ => TailMode::StreamK { max_parts },
                };
                assert_eq!(spread, want, "{v:?}");
            }
        }
    }

    #[test]
    fn tables_match_the_kernel_layout() {
        // the same figures are static_asserts in gemm.cu
        assert_eq!(std::mem::size_of::<TileRoute>(), 96);
        assert_eq!(std::mem::offset_of!(TileRoute, fold_src), 32);
        assert_eq!(std::mem::offset_of!(TileRoute, options), 68);
        assert_eq!(std::mem::offset_of!(TileRoute, fold_row), 72);
        assert_eq!(std::mem::offset_of!(TileRoute, dst_map), 80);
        assert_eq!(std::mem::offset_of!(TileRoute, dst_row), 92);
        assert_eq!(std::mem::offset_of!(GemmParams, order), 256);
        assert_eq!(std::mem::offset_of!(GemmParams, m), 312);
        assert_eq!(std::mem::offset_of!(GemmParams, rank), 344);
        assert_eq!(std::mem::offset_of!(GemmParams, workspace), 360);
        assert_eq!(std::mem::offset_of!(GemmParams, counters), 368);
        assert_eq!(std::mem::offset_of!(GemmParams, tail), 376);
        assert_eq!(std::mem::size_of::<TailUnit>(), 24);
        assert_eq!(std::mem::offset_of!(GemmParams, bands), 384);
        assert_eq!(std::mem::offset_of!(GemmParams, epoch), 392);
        assert_eq!(std::mem::offset_of!(GemmParams, calls), 400);
        assert_eq!(std::mem::offset_of!(GemmParams, routes_alt), 408);
        assert_eq!(std::mem::size_of::<CallCounter>(), 16);
        const { assert!(SMEM_BYTES <= DYNAMIC_SMEM_LIMIT) };
        // SkinnyCfg, NarrowCfg and NarrowTallCfg::SMEM_BYTES, static_asserts in gemm.cu
        assert_eq!(SKINNY_SMEM_BYTES, 197712);
        assert_eq!(NARROW_SMEM_BYTES, 147600);
        assert_eq!(NARROW_DEEP_SMEM_BYTES, 213200);
        assert_eq!(NARROW_SLICED_SMEM_BYTES, 222416);
        // PingPongCfg::SMEM_BYTES; a seventh stage would not fit
        assert_eq!(PING_PONG_SMEM_BYTES, 229488);
        const { assert!(PING_PONG_SMEM_BYTES + 32 * 1024 > DYNAMIC_SMEM_LIMIT) };
        const {
            assert!(
                direct_smem_bytes(SKINNY_ROWS, NARROW_TILE.n, NARROW_DEEP_STAGES + 2)
                    > DYNAMIC_SMEM_LIMIT
            )
        };
        assert_eq!(NARROW_TALL_SMEM_BYTES, 229520);
        const { assert!(NARROW_TALL_SMEM_BYTES <= DYNAMIC_SMEM_LIMIT) };
        // MidCfg::SMEM_BYTES; a sixth stage would not fit
        assert_eq!(MID_SMEM_BYTES, 198752);
        // DirectCfg::SMEM_BYTES: four stages and four boxes fit
        assert_eq!(DIRECT_SMEM_BYTES, 229456);
        const { assert!(DIRECT_SMEM_BYTES <= DYNAMIC_SMEM_LIMIT) };
        const { assert!(smem_bytes(MID_TILE.m, MID_TILE.n, MID_STAGES + 1) > DYNAMIC_SMEM_LIMIT) };
    }

    #[test]
    fn the_direct_build_stores_by_tma_only_where_a_box_can_write_d() {
        let params = |d: u64, n: u32, accumulate: u32, routes: u64| {
            // SAFETY: integers, floats and arrays of them: all zero bits is a value
            let mut p: GemmParams = unsafe { std::mem::zeroed() };
            (p.d, p.n, p.m, p.accumulate, p.routes) = (d, n, 300, accumulate, routes);
            p
        };
        let fits = |p: GemmParams, output| d_map_fits(&p, output);
        assert!(fits(params(0x1000, 1000, 0, 0), DType::BF16));
        assert!(fits(params(0x1000, 8, 0, 0), DType::F16));
        // f32 outputs and D += store from registers; a routed GEMM's tiles into D go by boxes
        // too (the map's rows are those its routes reach: box_routes)
        assert!(!fits(params(0x1000, 1000, 0, 0), DType::F32));
        assert!(!fits(params(0x1000, 1000, 1, 0), DType::BF16));
        assert!(fits(params(0x1000, 1000, 0, 0x2000), DType::BF16));
        // the tensor map's limits: D on 16 bytes, rows a multiple of 16 bytes, a D at all
        assert!(!fits(params(0x1008, 1000, 0, 0), DType::BF16));
        assert!(!fits(params(0x1000, 999, 0, 0), DType::BF16));
        assert!(!fits(params(0x1000, 1004, 0, 0), DType::BF16));
        assert!(!fits(params(0, 1000, 0, 0), DType::BF16));
        // where it does not fit, no tensor map is encoded (no driver call)
        let mut p = params(0x1000, 1000, 1, 0);
        set_d_map(&mut p, DType::BF16, 300).unwrap();
        assert_eq!((p.d_tma, p.d_map.0), (0, [0; 16]));
        // nor where no route goes into D by boxes (no rows)
        let mut p = params(0x1000, 1000, 0, 0x2000);
        set_d_map(&mut p, DType::BF16, 0).unwrap();
        assert_eq!((p.d_tma, p.d_map.0), (0, [0; 16]));
    }

    fn problem(m: usize, n: usize, k: usize) -> GemmProblem {
        GemmProblem::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16).unwrap()
    }

    /// Two partials of every tile of a 300 × 1000 GEMM (bands of 128, 128, 44 rows; tiles
    /// 256, 256, 256 and 232 wide), each partial an [M, N] slot of a buffer at 0x10000.
    /// A 300 × 1000 GEMM's routes (bands of 128, 128, 44 rows; tiles 256, 256, 256 and 232
    /// wide): the first band's tiles into D at row `first`, the second's into a peer's buffer
    /// at 0x10000 (ld 1000), the last band's into D at row `last`.
    fn split_routes(output: DType, first: u64, last: u64) -> (GemmPlan, Vec<TileRoute>) {
        let p = GemmProblem::new(300, 1000, 64, BLayout::NK, DType::BF16, output).unwrap();
        let plan = GemmPlan::local(p, TILE, commfuse_core::gemm::Epilogue::default());
        let eb = output.size() as u64;
        let routes = (0..plan.tile_count())
            .map(|t| {
                let (rows, cols) = plan.tile_bounds(t);
                let col = cols.start as u64;
                match t / 4 {
                    1 => TileRoute {
                        dst: 0x10000 + ((rows.start as u64 - 128) * 1000 + col) * eb,
                        ld: 1000,
                        ..TileRoute::default()
                    },
                    band => TileRoute {
                        dst: ((if band == 0 { first } else { last }) * 1000 + col) * eb,
                        ld: 1000,
                        options: ROUTE_DST_FROM_D,
                        ..TileRoute::default()
                    },
                }
            })
            .collect();
        (plan, routes)
    }

    #[test]
    fn routed_tiles_go_by_boxes_only_where_a_map_ends_with_them() {
        let boxed = |r: &TileRoute| r.options & ROUTE_DST_BOXES != 0;
        let (plan, mut routes) = split_routes(DType::BF16, 0, 128);
        let b = box_routes(&mut routes, &plan, GemmVariant::Direct);
        assert!(routes.iter().all(boxed));
        // D's map ends at the last band's last row there; the peer's tiles have maps of
        // exactly their rows and columns
        assert_eq!(b.d_rows, 172);
        let widths = [256, 256, 256, 232];
        let maps: Vec<_> = (4..8)
            .map(|t| (t, 0x10000 + (t as u64 - 4) * 512, widths[t - 4], 128, 1000))
            .collect();
        assert_eq!(b.tile_maps, maps);
        for (t, r) in routes.iter().enumerate() {
            let col = (t % 4 * 256) as u32;
            let want = match t / 4 {
                0 => (col, 0),
                1 => (0, 0),
                _ => (col, 128),
            };
            assert_eq!((r.dst_col, r.dst_row), want, "tile {t}");
        }
        // the 44-row band in the middle of D (at row 0, the 128 rows after it at 44): its
        // second box would write the next band's rows, so it stores from registers
        let (plan, mut routes) = split_routes(DType::BF16, 44, 0);
        let b = box_routes(&mut routes, &plan, GemmVariant::Direct);
        assert_eq!(b.d_rows, 172);
        let want: Vec<bool> = (0..routes.len()).map(|t| t < 8).collect();
        assert_eq!(routes.iter().map(boxed).collect::<Vec<_>>(), want);
        // a peer's tile off a 16-byte boundary, or rows that are not: from registers
        let (plan, mut routes) = split_routes(DType::BF16, 0, 128);
        routes[5].dst += 2;
        routes[6].ld = 1004;
        let b = box_routes(&mut routes, &plan, GemmVariant::Direct);
        assert_eq!(b.tile_maps.len(), 2);
        assert!(!boxed(&routes[5]) && !boxed(&routes[6]) && boxed(&routes[4]));
        // f32 outputs, D += (a box would replace what it adds to), and the builds that stage
        // their tiles: no boxes, no maps, marks cleared
        for (output, variant, accumulate) in [
            (DType::F32, GemmVariant::Direct, false),
            (DType::BF16, GemmVariant::Direct, true),
            (DType::BF16, GemmVariant::Main, false),
            (DType::BF16, GemmVariant::MidDirect, false),
        ] {
            let (mut plan, mut routes) = split_routes(output, 0, 128);
            plan.epilogue.accumulate = accumulate;
            routes[0].options |= ROUTE_DST_BOXES;
            routes[0].dst_map = 0x40000;
            assert_eq!(
                box_routes(&mut routes, &plan, variant),
                BoxRoutes::default()
            );
            assert!(
                routes.iter().all(|r| !boxed(r) && r.dst_map == 0),
                "{output:?} {variant:?}"
            );
        }
    }

    fn fold_routes(output: DType) -> (GemmPlan, Vec<TileRoute>, FoldSource) {
        fold_routes_of(output, TILE)
    }

    /// Routes of a 300 × 1000 product of `tile`s, each folding two partials from one buffer.
    fn fold_routes_of(output: DType, tile: TileShape) -> (GemmPlan, Vec<TileRoute>, FoldSource) {
        let p = GemmProblem::new(300, 1000, 64, BLayout::NK, DType::BF16, output).unwrap();
        let plan = GemmPlan::local(p, tile, commfuse_core::gemm::Epilogue::default());
        let eb = output.size() as u64;
        let source = FoldSource {
            base: 0x10000,
            rows: 2 * 300,
            ld: 1000,
        };
        let routes = (0..plan.tile_count())
            .map(|t| {
                let (rows, cols) = plan.tile_bounds(t);
                TileRoute {
                    fold_src: source.base + (rows.start as u64 * 1000 + cols.start as u64) * eb,
                    fold_stride: 300 * 1000 * eb,
                    fold_count: 2,
                    fold_ld: 1000,
                    ..TileRoute::default()
                }
            })
            .collect();
        (plan, routes, source)
    }

    #[test]
    fn folds_go_through_the_pipeline_only_where_a_tensor_map_reaches_every_partial() {
        let staged = |r: &TileRoute| r.options & ROUTE_FOLD_TMA != 0;
        for output in [DType::BF16, DType::F16, DType::F32] {
            let (plan, mut routes, source) = fold_routes(output);
            assert_eq!(
                stage_folds(&mut routes, &plan, GemmVariant::Main, &source),
                routes.len()
            );
            for (t, r) in routes.iter().enumerate() {
                let band = plan.tile_bounds(t).0.start as u32;
                assert!(staged(r), "{output:?} tile {t}");
                assert_eq!((r.fold_row, r.fold_row_step), (band, 300));
            }
            // so do the direct build (the same stages' B buffers) and the skinny build (four
            // boxes of its 64 rows a stage)
            for variant in [GemmVariant::Direct, GemmVariant::Skinny] {
                assert_eq!(
                    stage_folds(&mut routes, &plan, variant, &source),
                    routes.len()
                );
            }
            // the other builds read partials from global memory (the wide ping-pong build
            // takes the map only on plans of its own tiles)
            for variant in [
                GemmVariant::Mid,
                GemmVariant::MidDirect,
                GemmVariant::Pair,
                GemmVariant::PingPongWide,
            ] {
                assert_eq!(stage_folds(&mut routes, &plan, variant, &source), 0);
                assert!(routes.iter().all(|r| !staged(r) && r.fold_row == 0));
            }
            // the wide ping-pong build loads its tiles' partials by the map into its
            // consumers' boxes
            let (wide, mut routes, source) = fold_routes_of(output, WIDE_TILE);
            assert_eq!(
                stage_folds(&mut routes, &wide, GemmVariant::PingPongWide, &source),
                routes.len()
            );
            for (t, r) in routes.iter().enumerate() {
                let band = wide.tile_bounds(t).0.start as u32;
                assert!(staged(r), "{output:?} wide tile {t}");
                assert_eq!((r.fold_row, r.fold_row_step), (band, 300));
            }
            assert_eq!(
                stage_folds(&mut routes, &wide, GemmVariant::Main, &source),
                0
            );
        }
        let (plan, routes, source) = fold_routes(DType::BF16);
        let marked = |routes: &mut Vec<TileRoute>, source: FoldSource| {
            stage_folds(routes, &plan, GemmVariant::Main, &source);
            routes.iter().map(staged).collect::<Vec<_>>()
        };
        // one tile whose partial starts a column off, one whose partials are not whole rows
        // apart, one that folds nothing, one of another leading dimension: only they read
        // from global memory
        let mut r = routes.clone();
        r[1].fold_src += 2;
        r[2].fold_stride += 16;
        r[3].fold_count = 0;
        r[3].options = ROUTE_FOLD_TMA;
        r[4].fold_ld = 1008;
        let mut want = vec![true; routes.len()];
        want[1..5].fill(false);
        assert_eq!(marked(&mut r, source), want);
        // the last band's second partial ends one row past the buffer: those tiles are left out
        let short = FoldSource {
            rows: 599,
            ..source
        };
        let mut r = routes.clone();
        let last_band: Vec<bool> = (0..r.len()).map(|t| t < 8).collect();
        assert_eq!(marked(&mut r, short), last_band);
        // a buffer or rows that are not on 16-byte boundaries: no tensor map at all
        for bad in [
            FoldSource {
                base: 0x10008,
                ..source
            },
            FoldSource { ld: 1004, ..source },
        ] {
            let mut r = routes.clone();
            if bad.ld == 1004 {
                r.iter_mut().for_each(|x| x.fold_ld = 1004);
            }
            assert_eq!(marked(&mut r, bad), vec![false; routes.len()]);
        }
    }

    #[test]
    fn problems_beyond_the_kernels_32_bit_arithmetic_are_refused() {
        // the largest dimensions, in few tiles
        check_problem(&problem(MAX_DIM, 256, 8)).unwrap();
        check_problem(&problem(128, MAX_DIM, 8)).unwrap();
        check_problem(&problem(128, 256, MAX_DIM - 7)).unwrap();
        for (name, p) in [
            ("M", problem(MAX_DIM + 1, 256, 64)),
            ("N", problem(128, MAX_DIM + 1, 64)),
            ("K", problem(128, 256, MAX_DIM + 1)),
        ] {
            let e = check_problem(&p).unwrap_err().to_string();
            assert_eq!(
                e,
                format!("GEMM {name} = 2147483648 exceeds the kernel's limit of 2147483647"),
                "{e}"
            );
        }
        // exactly the most tiles, then one row of tiles more
        check_problem(&problem(128 << 14, 256 << 14, 64)).unwrap();
        let e = check_problem(&problem(128 << 14, (256 << 14) + 1, 64))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("268451840 output tiles") && e.contains(&format!("limit of {MAX_TILES}")),
            "{e}"
        );
        // dimensions each within bounds whose tile count a u32 would not even hold
        let e = check_problem(&problem(1 << 30, 1 << 30, 64))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("{} output tiles", 1u64 << 45)), "{e}");
    }

    /// A local plan of M × 1000 × 64 in tiles of `tile`, with the row `bands` given.
    fn banded_plan(m: usize, tile: TileShape, bands: Option<Vec<usize>>) -> GemmPlan {
        let mut plan = GemmPlan::local(problem(m, 1000, 64), tile, Default::default());
        plan.bands = bands;
        plan
    }

    #[test]
    fn the_skinny_build_runs_exactly_the_plans_whose_bands_fit_it() {
        use GemmVariant::{Main, Skinny};
        let plan = |m: usize, bands: Option<Vec<usize>>| banded_plan(m, TILE, bands);
        for (plan, fits) in [
            (plan(1, None), true),
            (plan(64, None), true),
            (plan(65, None), false),
            (plan(4096, None), false),
            // bands of 40, 60 and 30 rows; then one of 65
            (plan(130, Some(vec![0, 40, 100, 130])), true),
            (plan(130, Some(vec![0, 65, 130])), false),
            (plan(128, Some(vec![0, 64, 128])), true),
        ] {
            let want = if fits { Skinny } else { Main };
            let bands = &plan.bands;
            let direct = if fits { Skinny } else { GemmVariant::Direct };
            assert_eq!(VariantChoice::Auto.variant_for(&plan), direct, "{bands:?}");
            assert_eq!(VariantChoice::Skinny.variant_for(&plan), want, "{bands:?}");
            assert_eq!(VariantChoice::Main.variant_for(&plan), Main, "{bands:?}");
            let pair = if fits { Skinny } else { GemmVariant::Pair };
            assert_eq!(VariantChoice::Pair.variant_for(&plan), pair, "{bands:?}");
        }
        for (name, choice) in [
            ("auto", VariantChoice::Auto),
            ("main", VariantChoice::Main),
            ("skinny", VariantChoice::Skinny),
            ("narrow", VariantChoice::Narrow),
            ("pair", VariantChoice::Pair),
            ("mid", VariantChoice::Mid),
            ("direct", VariantChoice::Direct),
            ("narrow-deep", VariantChoice::NarrowDeep),
            ("narrow-sliced", VariantChoice::NarrowSliced),
            ("ping-pong", VariantChoice::PingPong),
            ("mid-direct", VariantChoice::MidDirect),
            ("short", VariantChoice::Short),
            ("ping-pong-wide", VariantChoice::PingPongWide),
        ] {
            assert_eq!(VariantChoice::parse(name).unwrap(), choice);
            assert_eq!(choice.name(), name);
            assert_eq!(VariantChoice::from_code(choice.code()), choice);
        }
        let e = VariantChoice::parse("Skinny").unwrap_err().to_string();
        assert!(
            e.contains(
                "COMMFUSE_GEMM_VARIANT must be main, skinny, narrow, narrow-deep, narrow-sliced, pair, mid, direct, ping-pong, mid-direct, short, ping-pong-wide or auto, got \"Skinny\""
            ),
            "{e}"
        );
    }

    #[test]
    fn a_plan_of_narrow_tiles_runs_on_a_narrow_build() {
        use GemmVariant::{Narrow, NarrowTall};
        let plan = |m: usize, bands: Option<Vec<usize>>| banded_plan(m, NARROW_TILE, bands);
        for (plan, fits) in [
            (plan(1, None), true),
            (plan(64, None), true),
            (plan(65, None), false),
            (plan(128, None), false),
            (plan(4096, None), false),
            (plan(130, Some(vec![0, 40, 100, 130])), true),
            (plan(130, Some(vec![0, 65, 130])), false),
        ] {
            let want = if fits { Narrow } else { NarrowTall };
            let bands = &plan.bands;
            for choice in [VariantChoice::Skinny, VariantChoice::Narrow] {
                assert_eq!(choice.variant_for(&plan), want, "{choice:?} {bands:?}");
            }
            // auto: narrow-deep where no band has more than NARROW_DEEP_ROWS rows
            let deep = tallest_band(&plan) <= NARROW_DEEP_ROWS;
            let auto = if deep { GemmVariant::NarrowDeep } else { want };
            assert_eq!(VariantChoice::Auto.variant_for(&plan), auto, "{bands:?}");
            assert_eq!(
                VariantChoice::Main.variant_for(&plan),
                NarrowTall,
                "{bands:?}"
            );
            let pair = if fits { Narrow } else { NarrowTall };
            assert_eq!(VariantChoice::Pair.variant_for(&plan), pair, "{bands:?}");
            for (choice, build) in [
                (VariantChoice::NarrowDeep, GemmVariant::NarrowDeep),
                (VariantChoice::NarrowSliced, GemmVariant::NarrowSliced),
            ] {
                let want = if fits { build } else { NarrowTall };
                assert_eq!(choice.variant_for(&plan), want, "{choice:?} {bands:?}");
            }
        }
        for v in GemmVariant::ALL {
            let rows = match v {
                Narrow
                | GemmVariant::Skinny
                | GemmVariant::NarrowDeep
                | GemmVariant::NarrowSliced
                | GemmVariant::Short => 64,
                _ => 128,
            };
            assert_eq!(v.rows(), rows, "{v:?}");
            assert!(v.smem_bytes() <= DYNAMIC_SMEM_LIMIT, "{v:?}");
        }
    }

    #[test]
    fn a_workspace_slot_holds_two_warpgroups_accumulators_of_every_tile() {
        // split_partials: (ACC / 4) float4 per thread, 256 threads, ACC = BN / 2
        for tile in [TILE, MID_TILE, NARROW_TILE, SHORT_TILE] {
            let kernel_slot = (tile.n / 2 / 4) * 256 * 16;
            assert_eq!(workspace_slot_bytes(tile), kernel_slot, "{tile:?}");
        }
    }

    #[test]
    fn a_plan_of_short_tiles_runs_on_the_short_build_and_only_the_short_choice_plans_them() {
        for (m, bands) in [
            (1, None),
            (64, None),
            (65, None),
            (256, None),
            (4096, None),
            (130, Some(vec![0, 40, 100, 130])),
        ] {
            let plan = banded_plan(m, SHORT_TILE, bands);
            for choice in VariantChoice::ALL {
                assert_eq!(
                    choice.variant_for(&plan),
                    GemmVariant::Short,
                    "{choice:?} {m}"
                );
            }
        }
        assert_eq!(GemmVariant::Short.tile(), SHORT_TILE);
        assert_eq!(GemmVariant::Short.rows(), SHORT_TILE.m);
        // forced, only the short choice plans short tiles; auto where short_tiles_pay
        for m in [16, 192, 256, 8192] {
            let p = problem(m, 4096, 4096);
            for choice in VariantChoice::ALL {
                let short = choice.tile_for(&p, 132) == SHORT_TILE;
                let want = choice == VariantChoice::Short
                    || (choice == VariantChoice::Auto && short_tiles_pay(&p, 132));
                assert_eq!(short, want, "{choice:?} {m}");
            }
        }
        // auto: at least SHORT_MIN_ROWS rows, wide tiles for at most half of the SMs, one
        // wave of at least SHORT_MIN_TILES short tiles
        for (m, n, k) in [
            (192, 4096, 4096),
            (256, 4096, 4096),
            (192, 2048, 4096),
            (256, 2048, 4096),
            (128, 4096, 4096),
            (384, 2048, 4096),
            (512, 2048, 4096),
            (256, 4096, 8192),
            (256, 4096, 14336),
            (96, 8192, 3584),
            (128, 8192, 3584),
        ] {
            let p = problem(m, n, k);
            assert!(short_tiles_pay(&p, 132), "{m} × {n} × {k}");
            assert_eq!(VariantChoice::Auto.tile_for(&p, 132), SHORT_TILE);
        }
        for (m, n, k, sms) in [
            // 64 rows: the narrow builds'
            (64, 8192, 3584, 132),
            // 160, 192 and 256 short tiles
            (320, 4096, 4096, 132),
            (384, 4096, 4096, 132),
            (256, 8192, 4096, 132),
            (128, 16384, 3584, 132),
            (256, 4096, 4096, 100),
            // 112 wide tiles
            (128, 28672, 8192, 132),
            (8192, 8192, 3584, 132),
            // 8 and 32 short tiles (fewer than SHORT_MIN_TILES)
            (100, 512, 4096, 132),
            (128, 2048, 4096, 132),
            // fewer than SHORT_MIN_ROWS
            (80, 8192, 3584, 132),
        ] {
            let p = problem(m, n, k);
            assert!(!short_tiles_pay(&p, sms), "{m} × {n} × {k} on {sms}");
            assert_ne!(VariantChoice::Auto.tile_for(&p, sms), SHORT_TILE);
        }
    }

    #[test]
    fn a_plan_of_mid_tiles_runs_on_the_mid_build_unless_mid_direct_auto_or_ping_pong_is_chosen() {
        for (m, bands) in [
            (1, None),
            (64, None),
            (4096, None),
            (130, Some(vec![0, 40, 130])),
        ] {
            let plan = banded_plan(m, MID_TILE, bands);
            for choice in [
                VariantChoice::Main,
                VariantChoice::Skinny,
                VariantChoice::Narrow,
                VariantChoice::Pair,
                VariantChoice::Mid,
            ] {
                assert_eq!(
                    choice.variant_for(&plan),
                    GemmVariant::Mid,
                    "{choice:?} {m}"
                );
            }
            let build = VariantChoice::PingPong.variant_for(&plan);
            assert_eq!(build, GemmVariant::PingPong, "{m}");
            let build = VariantChoice::MidDirect.variant_for(&plan);
            assert_eq!(build, GemmVariant::MidDirect, "{m}");
            // auto: the ping-pong build from two bands of rows (where its calls can run a plain
            // entry: not the banded plan), the mid-direct one at one
            let auto = if m > 128 && plan.bands.is_none() {
                GemmVariant::PingPong
            } else {
                GemmVariant::MidDirect
            };
            assert_eq!(VariantChoice::Auto.variant_for(&plan), auto, "{m}");
            // a plan whose calls need the general entry: the mid-direct build
            for epilogue in [
                Epilogue {
                    bias: true,
                    ..Epilogue::default()
                },
                Epilogue {
                    beta: 0.5,
                    ..Epilogue::default()
                },
                Epilogue {
                    accumulate: true,
                    ..Epilogue::default()
                },
            ] {
                let plan = GemmPlan {
                    epilogue,
                    ..plan.clone()
                };
                let build = VariantChoice::Auto.variant_for(&plan);
                assert_eq!(build, GemmVariant::MidDirect, "{m} {epilogue:?}");
            }
        }
        assert_eq!(GemmVariant::Mid.tile(), MID_TILE);
        assert_eq!(GemmVariant::PingPong.tile(), MID_TILE);
        // forced, mid and ping-pong plan every product with mid tiles; no other forced choice does
        for m in [16, 512, 8192] {
            let p = problem(m, 8192, 3584);
            assert_eq!(VariantChoice::Mid.tile_for(&p, 132), MID_TILE);
            assert_eq!(VariantChoice::PingPong.tile_for(&p, 132), MID_TILE);
            assert_eq!(VariantChoice::MidDirect.tile_for(&p, 132), MID_TILE);
            for choice in [VariantChoice::Main, VariantChoice::Pair] {
                assert_ne!(choice.tile_for(&p, 132), MID_TILE, "{choice:?} {m}");
            }
        }
        // auto plans mid tiles (for the ping-pong build) where wide ones would give at most
        // half of the SMs a tile and mid ones make one wave at most, from two bands of rows:
        // 64 wide tiles and 128 mid ones at 512 × 4096, 96 mid ones at 384 × 4096, 64 at
        // 192 × 4096 (a band of 64 rows), 32 at 192 × 2048 (MIN_FEW_TILES); not where narrow
        // tiles fit (128 rows × 4096), where mid tiles would make more than a wave (768 ×
        // 4096: 96 wide, 192 mid), nor 2 or 30 mid tiles (129 × 128, 192 × 1920)
        // (192 × 4096 and 192 × 2048 run short tiles, which come first: short_tiles_pay)
        let auto = |m: usize, n: usize| VariantChoice::Auto.tile_for(&problem(m, n, 4096), 132);
        for (m, n) in [
            (512, 4096),
            (256, 8192),
            (384, 4096),
            (192, 4096),
            (192, 2048),
        ] {
            let short = short_tiles_pay(&problem(m, n, 4096), 132);
            let want = if short { SHORT_TILE } else { MID_TILE };
            assert_eq!(auto(m, n), want, "{m} × {n}");
            assert_eq!(short, m == 192, "{m} × {n}");
            assert!(mid_tiles_pay(&problem(m, n, 4096), 132), "{m} × {n}");
        }
        for (m, n) in [
            (128, 4096),
            (768, 4096),
            (8192, 8192),
            (1024, 8192),
            (129, 128),
            (192, 1920),
        ] {
            assert_ne!(auto(m, n), MID_TILE, "{m} × {n}");
        }
        // mid tiles that leave more than half of the SMs idle only up to MID_MAX_K: 64 at
        // 192 × 4096 (at 256 × 4096 the narrow tiles take them, narrow_bands_pay)
        for (k, mid) in [(8192, true), (8200, false), (14336, false)] {
            assert_eq!(mid_tiles_pay(&problem(192, 4096, k), 132), mid, "{k}");
        }
        assert!(mid_tiles_pay(&problem(512, 4096, 14336), 132));
        // narrow tiles of whole bands in one wave: 128 of them at 256 × 4096 and 512 × 2048,
        // 64 at 256 × 2048 (cut along K); not at 192 rows (a band of 64), 384 × 4096 (192
        // narrow tiles), K past MID_MAX_K, where wide tiles fill more than half of the SMs,
        // nor fewer than MIN_FEW_TILES (256 × 512: 16)
        for (m, n, k) in [
            (256, 4096, 4096),
            (512, 2048, 4096),
            (256, 2048, 8192),
            (384, 2048, 1024),
        ] {
            // (short tiles come first: short_tiles_pay)
            assert_eq!(
                VariantChoice::Auto.tile_for(&problem(m, n, k), 132),
                SHORT_TILE,
                "{m} × {n} × {k}"
            );
            assert!(narrow_bands_pay(&problem(m, n, k), 132));
        }
        for (m, n, k) in [
            (192, 4096, 4096),
            (384, 4096, 4096),
            (256, 4096, 14336),
            (1024, 8192, 4096),
            (128, 4096, 4096),
            (256, 512, 4096),
        ] {
            assert!(!narrow_bands_pay(&problem(m, n, k), 132), "{m} × {n} × {k}");
        }
        assert_eq!(
            VariantChoice::Auto.tile_for(&problem(256, 4096, 14336), 132),
            SHORT_TILE
        );
        // where narrow tiles would serve one band of 65 to 128 rows, mid tiles instead where
        // the narrow ones make more than a wave and the mid ones one: 100 and 128 × 16384
        // (256 narrow tiles, 128 mid ones); not at 64 rows (the narrow build's), at 128 × 8192
        // (one wave of 128 narrow tiles), nor with 136 mid tiles on 132 SMs
        for (m, n) in [(100, 16384), (128, 16384)] {
            assert_eq!(auto(m, n), MID_TILE, "{m} × {n}");
            assert!(mid_tiles_pay_over_narrow(&problem(m, n, 4096), 132));
        }
        for (m, n) in [
            (64, 16384),
            (65, 8192),
            (128, 8192),
            (128, 4096),
            (128, 136 * 128),
        ] {
            assert!(
                !mid_tiles_pay_over_narrow(&problem(m, n, 4096), 132),
                "{m} × {n}"
            );
        }
        assert_eq!(auto(64, 8192), NARROW_TILE);
        // (where short tiles make one wave they come first: short_tiles_pay)
        assert_eq!(auto(128, 8192), SHORT_TILE);
        assert_eq!(auto(128, 4096), SHORT_TILE);
        // on fewer SMs the same product makes more than a wave of mid tiles
        assert!(!mid_tiles_pay(&problem(512, 4096, 4096), 100));
    }

    #[test]
    fn auto_plans_narrow_tiles_where_wide_ones_leave_most_sms_idle() {
        let tile =
            |choice: VariantChoice, m: usize, n: usize| choice.tile_for(&problem(m, n, 3584), 132);
        // the decode sizes: 32 wide tiles for 132 SMs, 128 narrow ones (at 128 rows as many
        // short ones, which auto takes: short_tiles_pay)
        for m in [1, 16, 17, 32, 64, 128] {
            let auto = if m > 64 { SHORT_TILE } else { NARROW_TILE };
            assert_eq!(tile(VariantChoice::Auto, m, 8192), auto, "{m}");
            assert_eq!(tile(VariantChoice::Narrow, m, 8192), NARROW_TILE, "{m}");
            assert_eq!(tile(VariantChoice::Main, m, 8192), TILE, "{m}");
            assert_eq!(tile(VariantChoice::Skinny, m, 8192), TILE, "{m}");
        }
        // two bands of tiles, the second of one row (mid tiles: 128 of them); 112 wide tiles
        // (more than half of the SMs); exactly half
        assert_eq!(tile(VariantChoice::Auto, 129, 8192), MID_TILE);
        assert_eq!(tile(VariantChoice::Narrow, 129, 8192), TILE);
        assert_eq!(tile(VariantChoice::Auto, 64, 28672), TILE);
        assert_eq!(tile(VariantChoice::Narrow, 64, 28672), NARROW_TILE);
        assert_eq!(tile(VariantChoice::NarrowDeep, 64, 8192), NARROW_TILE);
        assert_eq!(tile(VariantChoice::NarrowDeep, 129, 8192), TILE);
        assert_eq!(tile(VariantChoice::NarrowSliced, 64, 8192), NARROW_TILE);
        assert_eq!(tile(VariantChoice::NarrowSliced, 129, 8192), TILE);
        assert_eq!(tile(VariantChoice::Auto, 64, 66 * 256), NARROW_TILE);
        assert_eq!(tile(VariantChoice::Auto, 64, 66 * 256 + 1), TILE);
    }

    /// Checks that `paired` is a pairing of `order` over a grid `tiles_n` wide: consecutive
    /// pairs of one column, every tile of the order once, idle entries only second in a pair
    /// and naming their partner; returns the count of idle entries.
    fn check_pairing(order: &[usize], paired: &[u32], tiles_n: usize) -> usize {
        assert_eq!(paired.len() % 2, 0, "{paired:?}");
        let mut seen = vec![0; order.iter().max().map_or(0, |&t| t + 1)];
        let mut idle = 0;
        for pair in paired.chunks(2) {
            let (first, second) = (pair[0], pair[1]);
            assert_eq!(first & PAIR_IDLE, 0, "{pair:?}: an idle entry first");
            seen[first as usize] += 1;
            if second & PAIR_IDLE != 0 {
                idle += 1;
                assert_eq!(
                    second & !PAIR_IDLE,
                    first,
                    "{pair:?}: idle names another tile"
                );
            } else {
                seen[second as usize] += 1;
                assert_eq!(
                    first as usize % tiles_n,
                    second as usize % tiles_n,
                    "{pair:?}: tiles of two columns"
                );
            }
        }
        for &t in order {
            assert_eq!(seen[t], 1, "tile {t} placed {} times", seen[t]);
        }
        assert_eq!(seen.iter().sum::<usize>(), order.len());
        idle
    }

    #[test]
    fn the_pair_build_runs_tiles_of_one_column_side_by_side() {
        use commfuse_core::gemm::grouped_order_of_grid;
        // grouped orders (bands of 8 tile rows walked column by column): every tile finds the
        // one below it, except in an odd last band
        for (tm, tn, idle) in [
            (32, 32, 0),
            (16, 32, 0),
            (8, 4, 0),
            (3, 5, 5),
            (11, 7, 7),
            (1, 9, 9),
        ] {
            let order = grouped_order_of_grid(tm, tn, 8);
            let paired = pair_order(&order, tn);
            assert_eq!(check_pairing(&order, &paired, tn), idle, "{tm}×{tn}");
            if idle == 0 {
                // the pairs are the order's own neighbours, in the order's sequence
                let flat: Vec<usize> = paired.iter().map(|&t| t as usize).collect();
                assert_eq!(flat, order, "{tm}×{tn}");
            }
        }
        // any order: a shuffled one, one column, one row, a single tile
        let mut order: Vec<usize> = (0..60).collect();
        let mut x = 12345u64;
        for i in (1..order.len()).rev() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(i, (x >> 33) as usize % (i + 1));
        }
        for tn in [1, 4, 7, 60] {
            check_pairing(&order, &pair_order(&order, tn), tn);
        }
        assert_eq!(pair_order(&[0], 1), vec![0, PAIR_IDLE]);
        // a partner at the window's end is taken, one beyond it is not pulled forward
        let order: Vec<usize> = (0..2 * PAIR_WINDOW + 2).collect();
        let far = pair_order(&order, PAIR_WINDOW);
        assert_eq!(
            &far[..4],
            &[0, PAIR_WINDOW as u32, 1, PAIR_WINDOW as u32 + 1]
        );
        assert_eq!(check_pairing(&order, &far, PAIR_WINDOW), 2);
        let beyond = pair_order(&order, PAIR_WINDOW + 1);
        assert_eq!(&beyond[..2], &[0, PAIR_IDLE]);
        assert_eq!(check_pairing(&order, &beyond, PAIR_WINDOW + 1), order.len());
        // no split tail, clusters of two, the main build's tiles and memory
        assert_eq!(GemmVariant::Pair.max_parts(true), 1);
        assert_eq!(GemmVariant::Pair.max_parts(false), 1);
        assert_eq!(GemmVariant::Pair.cluster(), PAIR);
        assert_eq!(GemmVariant::Main.cluster(), 1);
        assert_eq!(GemmVariant::Pair.tile(), TILE);
        assert_eq!(GemmVariant::Pair.smem_bytes(), SMEM_BYTES);
    }

    #[test]
    fn only_a_partial_last_wave_is_split() {
        // 512 tiles on 116 SMs: 48 left over, cut in two
        assert_eq!(tail_split(512, 116, 56, MAX_PARTS), (2, 48));
        // 1536 on 116: 28 left over, four parts
        assert_eq!(tail_split(1536, 116, 384, MAX_PARTS), (4, 28));
        // whole waves, too many leftovers, too little K
        assert_eq!(tail_split(264, 132, 56, MAX_PARTS), (1, 0));
        assert_eq!(tail_split(512, 132, 56, MAX_PARTS), (1, 0));
        assert_eq!(tail_split(4, 3, 1, MAX_PARTS), (1, 0));
        assert_eq!(tail_split(4, 3, 3, MAX_PARTS), (3, 1));
        // fewer tiles than SMs: one partial wave (512 rows × 4096 columns on 131 SMs)
        assert_eq!(tail_split(32, 131, 32, MAX_PARTS), (4, 32));
        // the skinny build's decode sizes: 32 tiles of 16 rows on 132 SMs, two parts each
        let skinny = GemmVariant::Skinny.max_parts(true);
        assert_eq!(tail_split(32, 132, 56, skinny), (2, 32));
        // the narrow build's: 128 tiles on 132 SMs, none split
        let narrow = GemmVariant::Narrow.max_parts(true);
        assert_eq!(tail_split(128, 132, 56, narrow), (1, 0));
        // the main build: three parts in a single partial wave, four after whole waves
        let main = |one_wave| GemmVariant::Main.max_parts(one_wave);
        assert_eq!(tail_split(32, 132, 56, main(true)), (3, 32));
        assert_eq!(tail_split(1536, 116, 384, main(false)), (4, 28));
    }

    #[test]
    fn every_build_and_input_has_a_part_of_its_own_before_the_helpers() {
        let mut parts: Vec<u32> = GemmVariant::ALL
            .iter()
            .flat_map(|&v| [gemm_part(v, DType::BF16), gemm_part(v, DType::F16)])
            .collect();
        parts.sort();
        // 0, 1, … without a gap or a repeat, then the helpers' part, the file's last
        let expected: Vec<u32> = (0..GEMM_HELPER_PART).collect();
        assert_eq!(parts, expected);
        let gemm = nvrtc::kernel("gemm.cu").unwrap();
        assert_eq!(nvrtc::parts_of(gemm), GEMM_HELPER_PART + 1);
        assert_eq!(nvrtc::parts_of(nvrtc::kernel("plan.cu").unwrap()), 1);
        // gemm.cu's own number for the helpers' part
        assert!(gemm
            .text
            .contains(&format!("#define GEMM_HELPER_PART {GEMM_HELPER_PART}\n")));
    }
}
