//! What the simulator's fused operators share: the configurations they are built for (core's
//! [`GemmRsConfig`] and [`AgGemmConfig`], the ones the CUDA backend takes, read with the world's
//! size as [`InWorld`]), what their constructors and calls check, where their flag words sit on a world's signal pads, and
//! how the heap of their GEMMs and tile tables is counted.

use crate::memory::Footprint;
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
pub use commfuse_core::fused::ag_gemm::AgGemmConfig;
pub use commfuse_core::fused::gemm_rs::GemmRsConfig;
use commfuse_core::fused::gemm_rs::{GemmRsSchedule, GemmRsShape};
use commfuse_core::gemm::TileShape;
use commfuse_core::{DType, Element, Slot};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The GPU kernel's tile, the default of both configurations.
pub use commfuse_core::gemm::KERNEL_TILE as GPU_TILE;

/// The sizes of a fused operator's GEMM that its memory counts read, from either
/// configuration.
pub trait GemmDims {
    /// Rows of the largest call, N, K and the output tile
    fn dims(&self) -> (usize, usize, usize, TileShape);
}

impl GemmDims for GemmRsConfig {
    fn dims(&self) -> (usize, usize, usize, TileShape) {
        (self.max_m, self.n, self.k, self.tile)
    }
}

impl GemmDims for AgGemmConfig {
    fn dims(&self) -> (usize, usize, usize, TileShape) {
        (self.max_m, self.n, self.k, self.tile)
    }
}

/// An operator's configuration with the size of the world it is built for, which is what the
/// simulator's constructors, checks and memory counts read (it reads as the configuration).
#[derive(Debug, Clone, Copy)]
pub struct InWorld<C> {
    pub world: usize,
    pub config: C,
}

impl<C> InWorld<C> {
    pub fn new(world: usize, config: C) -> InWorld<C> {
        InWorld { world, config }
    }
}

impl<C> std::ops::Deref for InWorld<C> {
    type Target = C;
    fn deref(&self) -> &C {
        &self.config
    }
}

impl InWorld<GemmRsConfig> {
    /// The shape of a call with `m` rows (validated).
    pub fn shape(&self, m: usize) -> Result<GemmRsShape, BackendError> {
        self.config
            .shape(self.world, m)
            .map_err(|e| BackendError::Unavailable(e.to_string()))
    }

    /// The schedule of a call with `m` rows in buffers made for `max_m`.
    pub fn schedule(&self, m: usize) -> Result<GemmRsSchedule, BackendError> {
        Ok(GemmRsSchedule::within(
            self.shape(m)?,
            self.max_m,
            self.tile,
        ))
    }

    /// Signal pad columns the operator needs on every rank: P senders × flag stride (the
    /// schedule's `flag_columns`, counted without building it).
    pub fn pad_cols(&self) -> Result<usize, BackendError> {
        self.shape(self.max_m)?;
        let (_, per_owner) = self.tiles();
        per_owner
            .and_then(|t| t.checked_mul(self.world))
            .ok_or_else(|| {
                unavailable(format!(
                    "GEMM + reduce-scatter of M up to {}, N {} on {} ranks needs more flag columns than a signal pad can have",
                    self.max_m, self.n, self.world
                ))
            })
    }
}

impl<C: GemmDims> InWorld<C> {
    /// Tiles of the fused schedule of `max_m` rows, at most (every owner's chunk starts a band,
    /// so there are at most M / tile.m + P bands), and the tiles the longest chunk has (the
    /// schedule's `tiles_per_owner_max`); None where the count overflows.
    pub(crate) fn tiles(&self) -> (Option<usize>, Option<usize>) {
        let (max_m, n, _, tile) = self.config.dims();
        let (tm, tn) = (tile.m.max(1), tile.n.max(1));
        let world = self.world.max(1);
        let tiles_n = n.div_ceil(tn);
        let bands = max_m.div_ceil(tm).checked_add(world);
        let owner_bands = max_m.div_ceil(world).div_ceil(tm);
        (
            bands.and_then(|b| b.checked_mul(tiles_n)),
            owner_bands.checked_mul(tiles_n),
        )
    }

    /// What the operator is, as its memory errors name it.
    pub(crate) fn describe(&self, op: &str) -> String {
        let (max_m, n, k, _) = self.config.dims();
        format!(
            "{op} of M up to {max_m}, N {n}, K {k} on {} ranks",
            self.world
        )
    }

    /// Adds what every rank thread's GEMM holds at once on `rows` rows at most: one tile's
    /// operands widened to f32 (rows of A and columns of B, K each) and its products, and one
    /// output row and its f32 sums.
    pub(crate) fn gemm_heap(&self, heap: Footprint, rows: usize) -> Footprint {
        let (_, n, k, tile) = self.config.dims();
        let (tm, tn) = (tile.m.min(rows), tile.n.min(n));
        heap.item(&[self.world, tm.saturating_add(tn), k, 4])
            .item(&[self.world, tm, tn, 4])
            .item(&[self.world, 2, tn, 8])
    }
}

/// Adds tile tables of `tiles` tiles (None: too many to count) held by `holders` at once.
pub(crate) fn table_heap(heap: Footprint, holders: usize, tiles: Option<usize>) -> Footprint {
    let bytes = tiles
        .and_then(|t| u64::try_from(t).ok())
        .and_then(|t| t.checked_mul(TABLE_BYTES_PER_TILE))
        .and_then(|b| b.checked_mul(holders as u64));
    heap.add_bytes(bytes)
}

/// Bytes of tile tables one holder may keep per tile of a schedule, at most: the schedule's
/// placement, owner lists and grouped order, a GEMM plan's order, destination and flag, and the
/// owner's reduction ranges.
pub(crate) const TABLE_BYTES_PER_TILE: u64 = 160;

pub(crate) fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// What every fused operator keeps of its calls: the world it was built for (its address:
/// calls from another world's ranks are refused), whether a call failed after it began
/// signalling (the counts then no longer match the flags, and every later call is refused),
/// and per rank the calls it has made (only that rank's thread touches its count).
pub(crate) struct Calls {
    world_id: usize,
    broken: AtomicBool,
    made: Vec<AtomicU64>,
}

impl Calls {
    pub(crate) fn new(world: &World) -> Calls {
        Calls {
            world_id: world as *const World as usize,
            broken: AtomicBool::new(false),
            made: (0..world.size()).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Runs call `f(number)` of `rank`, its number counted from 1: counts it when it succeeds,
    /// and marks the operator unusable when it fails.
    pub(crate) fn run(
        &self,
        rank: usize,
        f: impl FnOnce(u64) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let number = self.made[rank].load(Ordering::Relaxed) + 1;
        let result = f(number);
        match result {
            Ok(()) => self.made[rank].store(number, Ordering::Relaxed),
            Err(_) => self.broken.store(true, Ordering::Release),
        }
        result
    }
}

/// What every fused operator's constructor checks: the configuration's types (`input`,
/// `output`) are the buffers' (`TI`, `TO`).
pub(crate) fn check_build<TI: Element, TO: Element>(
    op: &str,
    (input, output): (DType, DType),
) -> Result<(), BackendError> {
    if input != TI::DTYPE || output != TO::DTYPE {
        return Err(unavailable(format!(
            "{op} configured for {input} → {output} but built with {} → {} buffers",
            TI::DTYPE,
            TO::DTYPE
        )));
    }
    Ok(())
}

/// Where an operator's flag words sit on a world's signal pads: word i at row i / columns,
/// column i % columns, from the pads' first row (the rows plans use).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlagWords {
    cols: usize,
}

impl FlagWords {
    /// Pad rows `words` flag words take on pads of `cols` columns.
    pub(crate) fn rows(words: usize, cols: usize) -> usize {
        words.div_ceil(cols.max(1))
    }

    /// The layout of `words` flag words of operator `op` on `world`'s pads, or why they do
    /// not fit.
    pub(crate) fn on(op: &str, world: &World, words: usize) -> Result<FlagWords, BackendError> {
        let cols = world.pad(0).cols() as usize;
        let rows = Self::rows(words, cols);
        if (world.plan_rows() as usize) < rows {
            return Err(unavailable(format!(
                "{op} on {} ranks needs {words} flag words: {rows} free signal pad rows of {cols} columns, the world has {} (raise WorldConfig pad_rows/pad_cols)",
                world.size(),
                world.plan_rows()
            )));
        }
        Ok(FlagWords { cols })
    }

    /// The slot of flag word `index`.
    pub(crate) fn slot(&self, index: usize) -> Slot {
        Slot::new((index / self.cols) as u32, (index % self.cols) as u32)
    }
}

/// [`check_call`] for GEMM + reduce-scatter (both paths): A [m, K], B, the bias, and an
/// output of at least rank's chunk rows × N; returns the chunk.
pub(crate) fn check_rs_call<TI: Element, TO: Element>(
    ctx: &RankContext<'_>,
    calls: &Calls,
    c: &InWorld<GemmRsConfig>,
    m: usize,
    (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
    out: &[TO],
) -> Result<std::ops::Range<usize>, BackendError> {
    let lengths = [
        ("A", a.len(), m * c.k),
        ("B", b.len(), c.k * c.n),
        (
            "the bias",
            bias.map_or(0, <[TO]>::len),
            c.n * c.bias as usize,
        ),
    ];
    check_call("GEMM + reduce-scatter", ctx, calls, &c.config, m, &lengths)?;
    let chunk = commfuse_core::op::chunk_range(m, c.world, ctx.rank());
    if out.len() < chunk.len() * c.n {
        return Err(unavailable(format!(
            "rank {}: the output holds {} elements, its {} rows × N={} need {}",
            ctx.rank(),
            out.len(),
            chunk.len(),
            c.n,
            chunk.len() * c.n
        )));
    }
    Ok(chunk)
}

/// What every fused operator's `forward` checks before anything runs: that the rank belongs to
/// the world the operator `op` was built for, that no earlier call failed (both in `calls`), that
/// M is within 1..=`config.max_m`, and that each operand (what, elements given, elements
/// needed) has its exact length.
pub(crate) fn check_call(
    op: &str,
    ctx: &RankContext<'_>,
    calls: &Calls,
    config: &impl GemmDims,
    m: usize,
    lengths: &[(&str, usize, usize)],
) -> Result<(), BackendError> {
    let (max_m, n, k, _) = config.dims();
    if ctx.world() as *const World as usize != calls.world_id {
        return Err(unavailable(format!(
            "this {op} was built for another world"
        )));
    }
    if calls.broken.load(Ordering::Acquire) {
        return Err(unavailable(format!(
            "this {op} is unusable after a failed call"
        )));
    }
    if m == 0 || m > max_m {
        return Err(unavailable(format!(
            "M = {m} is outside 1..={max_m} (the largest M this operator was built for)"
        )));
    }
    for &(what, got, want) in lengths {
        if got != want {
            return Err(unavailable(format!(
                "rank {}: {what} holds {got} elements, M={m} N={n} K={k} needs {want}",
                ctx.rank(),
            )));
        }
    }
    Ok(())
}
