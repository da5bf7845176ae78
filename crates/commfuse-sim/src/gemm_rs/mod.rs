//! GEMM + reduce-scatter on the simulator: the protocol of [`commfuse_core::fused::gemm_rs`]
//! (and of the GPU kernel, `commfuse-cuda`'s `src/gemm_rs/gemm_rs.cu`) at tile granularity, one
//! call per rank thread.
//!
//! Every rank's GEMM ([`run_gemm`] on the schedule's plan) stores each tile into its owner's
//! receive slot and sets the tile's flag there to the call's number (from 1), as the GPU
//! epilogue does; the owner then, tile by tile in reduction order, waits until all P senders'
//! flags hold at least this call's number, sums the P partials in f32 in rank order, adds the
//! bias, casts and writes its output chunk. Flags are never cleared: a flag of an earlier call
//! holds a smaller number, whatever M that call had. (The GPU's default adds the peers' partials
//! in the epilogue of the owner's own tiles instead of in a separate pass: the same waits and
//! the same sums, in another order.)
//!
//! One addition to the schedule: when M < P some ranks own no rows, and such a rank's call
//! would wait for nobody, run ahead into its next call on the same set and overwrite partials
//! a peer is still summing (the two-set argument needs every call of a rank to depend on every
//! peer's same call). So every sender also sets flag column 0 of its slot on each owner
//! without tiles, after its GEMM, and such an owner waits for those P flags before it ends the
//! call. The tests saw the overwrite without it.
//!
//! One [`SimGemmReduceScatter`] serves all ranks of a world: the receive buffer is one
//! [`SymmetricBuffer`] (a copy per rank, as on GPUs), and the per-call state — how many calls
//! each rank has made — is kept per rank and touched only by that rank's thread. Ranks never
//! synchronise between calls: the two alternating sets make back-to-back calls safe (see the
//! schedule's module doc).

pub mod fused_ring;
pub mod ring;
pub mod unfused;

use crate::buffer::SymmetricBuffer;
use crate::fused::{check_build, check_rs_call, table_heap, unavailable, Calls, InWorld};
pub use crate::fused::{GemmRsConfig, GPU_TILE};
use crate::gemm::{run_gemm, Operands};
use crate::memory::{Footprint, OperatorMemory};
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
pub use commfuse_core::fused::gemm_rs::CallInputs;
use commfuse_core::fused::gemm_rs::{GemmRsPath, GemmRsSchedule};
use commfuse_core::{Cmp, Element, NotifyOp, Slot};
use std::marker::PhantomData;
use std::sync::atomic::Ordering;

/// Signal pad rows the operator uses (rows 0 and 1: one flag row per set).
pub const PAD_ROWS: u32 = 2;

/// Fused GEMM + reduce-scatter for every rank of one simulated world, built once and called
/// many times (each rank thread calls [`forward`](Self::forward) with its own operands).
///
/// It owns rows 0 and 1 of the world's signal pads: a world that runs it should run nothing
/// else that signals there.
pub struct SimGemmReduceScatter<TI: Element, TO: Element> {
    config: InWorld<GemmRsConfig>,
    /// Per rank: 2 sets × P sender slots × `slot_len` elements
    receive: SymmetricBuffer<TO>,
    slot_len: usize,
    flag_stride: usize,
    calls: Calls,
    _input: PhantomData<fn() -> TI>,
}

impl<TI: Element, TO: Element> SimGemmReduceScatter<TI, TO> {
    /// Builds the operator for `world`: checks the configuration against the element types and
    /// the world's signal pads, and allocates the receive buffers. It is the fused path
    /// whatever the configuration's `path` says ([`GemmRsOperator::new`] reads that).
    pub fn new(world: &World, config: GemmRsConfig) -> Result<Self, BackendError> {
        check_build::<TI, TO>("GEMM + reduce-scatter", (config.input, config.output))?;
        let config = InWorld::new(world.size(), config);
        if config.tile.m == 0 || config.tile.n == 0 {
            return Err(unavailable("the tile shape must be positive".into()));
        }
        config.shape(config.max_m)?;
        fused_memory(&config, world.size()).check(world.arena().is_some())?;
        let sched = config.schedule(config.max_m)?;
        let cols = sched.flag_columns();
        let pad = world.pad(0);
        if world.plan_rows() < PAD_ROWS || (pad.cols() as usize) < cols {
            return Err(unavailable(format!(
                "GEMM + reduce-scatter of M up to {}, N {} on {} ranks needs signal pads of at least {PAD_ROWS} free rows × {cols} columns, the world has {} rows ({} free) × {} (raise WorldConfig pad_rows/pad_cols)",
                config.max_m,
                config.n,
                config.world,
                pad.rows(),
                world.plan_rows(),
                pad.cols()
            )));
        }
        // a shared world's pads are fresh from the group's arena, and its peers (other
        // processes) may already be raising flags in them
        let ranks = if world.arena().is_some() {
            0
        } else {
            world.size()
        };
        for rank in 0..ranks {
            for row in 0..PAD_ROWS {
                for col in 0..cols as u32 {
                    let slot = world.pad(rank).slot(row, col).expect("checked above");
                    if slot.load(Ordering::Acquire) != 0 {
                        return Err(unavailable(format!(
                            "signal slot ({row}, {col}) of rank {rank} is already in use: GEMM + reduce-scatter needs rows 0 and 1 of a fresh world's pads"
                        )));
                    }
                }
            }
        }
        let len = (2 * config.world)
            .checked_mul(sched.slot_len)
            .ok_or_else(|| unavailable("the receive buffer's size overflows".into()))?;
        Ok(SimGemmReduceScatter {
            receive: SymmetricBuffer::new_in(world, len)?,
            slot_len: sched.slot_len,
            flag_stride: sched.flag_stride,
            calls: Calls::new(world),
            config,
            _input: PhantomData,
        })
    }

    pub fn config(&self) -> &GemmRsConfig {
        &self.config
    }

    /// Rows of rank `rank`'s output for a call with `m` rows.
    pub fn output_rows(&self, m: usize, rank: usize) -> std::ops::Range<usize> {
        commfuse_core::op::chunk_range(m, self.config.world, rank)
    }

    /// One call on rank `ctx.rank()`: its A [m, K] and B ([K, N] or [N, K]), the bias [N] when
    /// the operator was built with one, and its output chunk [chunk rows, N], row-major (rows
    /// past the chunk are left as they are). Every rank makes the same calls with the same m.
    pub fn forward(
        &self,
        ctx: &RankContext<'_>,
        m: usize,
        a: &[TI],
        b: &[TI],
        bias: Option<&[TO]>,
        out: &mut [TO],
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let rank = ctx.rank();
        check_rs_call(ctx, &self.calls, c, m, (a, b, bias), out)?;
        let sched = c.schedule(m)?;
        debug_assert_eq!(
            (sched.slot_len, sched.flag_stride),
            (self.slot_len, self.flag_stride)
        );
        self.calls.run(rank, |number| {
            self.call(ctx, &sched, number - 1, a, b, bias, out)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        ctx: &RankContext<'_>,
        sched: &GemmRsSchedule,
        call: u64,
        a: &[TI],
        b: &[TI],
        bias: Option<&[TO]>,
        out: &mut [TO],
    ) -> Result<(), BackendError> {
        let (rank, p, n) = (ctx.rank(), self.config.world, self.config.n);
        // flags hold the number (from 1) of the call that last set them, as on GPUs: a wait for
        // "at least this call" needs no clearing and no count of how many tiles each M had
        let expected = call + 1;
        let set = GemmRsSchedule::set_of(expected);
        let plan = sched.gemm_plan(rank, expected);
        let ops = Operands::<TI, TO> {
            a,
            b,
            c: None,
            bias: None,
        };
        run_gemm(ctx, &plan, &ops, &self.receive)?;
        // owners without a tile at this M (M < P): flag column 0 of this sender on them stands
        // for a tile, so that their call, too, waits for every peer to have begun this call
        for (owner, tiles) in sched.owner_tiles.iter().enumerate() {
            if tiles.is_empty() {
                let slot = Slot::new(
                    set as u32,
                    (sched.slot_of(rank, owner) * self.flag_stride) as u32,
                );
                ctx.notify(owner, slot, expected, NotifyOp::Set)?;
            }
        }

        let tiles = &sched.owner_tiles[rank];
        if tiles.is_empty() {
            for sender in 0..p {
                let slot = Slot::new(
                    set as u32,
                    (sched.slot_of(sender, rank) * self.flag_stride) as u32,
                );
                ctx.wait(slot, expected, Cmp::Ge, sender).map_err(|e| match e {
                    BackendError::WaitTimeout {
                        seen, timeout_ms, ..
                    } => unavailable(format!(
                        "timeout after {timeout_ms} ms: GEMM + reduce-scatter rank {rank}, call {call} (set {set}), which owns no rows at M = {}, waits on rank {sender}'s flag {slot} for >= {expected} but sees {seen}",
                        sched.shape.m
                    )),
                    other => other,
                })?;
            }
        }
        let mut acc = Vec::new();
        let mut partial = Vec::new();
        for (index, (rows, cols)) in sched.reduce_tiles(rank).into_iter().enumerate() {
            for sender in 0..p {
                let slot = Slot::new(
                    set as u32,
                    (sched.slot_of(sender, rank) * self.flag_stride + index) as u32,
                );
                ctx.wait(slot, expected, Cmp::Ge, sender).map_err(|e| match e {
                    BackendError::WaitTimeout {
                        seen, timeout_ms, ..
                    } => unavailable(format!(
                        "timeout after {timeout_ms} ms: GEMM + reduce-scatter rank {rank}, call {call} (set {set}), tile {} (rows {rows:?} of its chunk, columns {cols:?}) waits on rank {sender}'s flag {slot} for >= {expected} but sees {seen}",
                        tiles[index]
                    )),
                    other => other,
                })?;
            }
            let width = cols.len();
            for row in rows {
                acc.clear();
                acc.resize(width, 0f32);
                partial.resize(width, TO::from_f32(0.0));
                // rank order, whatever order the flags arrived in: the result is deterministic
                for sender in 0..p {
                    let at = (set * p + sched.slot_of(sender, rank)) * self.slot_len
                        + row * n
                        + cols.start;
                    // SAFETY: sender's stores of this tile happened before its flag, which the
                    // wait above saw with acquire; no sender writes this set again before this
                    // rank finishes the call (the schedule's two-set argument)
                    unsafe { self.receive.load(rank, at, &mut partial) };
                    for (x, v) in acc.iter_mut().zip(&partial) {
                        *x += v.to_f32();
                    }
                }
                let dst = &mut out[row * n + cols.start..row * n + cols.end];
                for (j, (d, x)) in dst.iter_mut().zip(&acc).enumerate() {
                    let v = match bias {
                        Some(bias) => x + bias[cols.start + j].to_f32(),
                        None => *x,
                    };
                    *d = TO::from_f32(v);
                }
            }
        }
        Ok(())
    }
}

/// What the operator of `path` for `config` allocates ([`fused_memory`],
/// [`ring::memory`], [`unfused::memory`]).
pub fn memory(config: &GemmRsConfig, world: usize, path: GemmRsPath) -> OperatorMemory {
    match path {
        GemmRsPath::Fused => fused_memory(config, world),
        GemmRsPath::Overlapped { pieces } => ring::memory(config, world, pieces),
        GemmRsPath::Unfused => unfused::memory(config, world),
    }
}

/// What [`SimGemmReduceScatter`] of `config` allocates: every rank's receive buffers (2 sets ×
/// P sender slots of the longest chunk) and the heap of a call (the schedule's tables on the
/// constructor and on every rank thread, the GEMM's widened tiles).
pub fn fused_memory(config: &GemmRsConfig, world: usize) -> OperatorMemory {
    let c = InWorld::new(world, *config);
    let what = c.describe("GEMM + reduce-scatter (fused)");
    let chunk = c.max_m.div_ceil(c.world.max(1));
    let (tiles, _) = c.tiles();
    let heap = table_heap(Footprint::new(what.clone()), c.world + 1, tiles);
    OperatorMemory {
        buffers: Footprint::new(what).item(&[c.world, 2, c.world, chunk, c.n, c.output.size()]),
        heap: c.gemm_heap(heap, c.max_m),
    }
}

/// GEMM + reduce-scatter by any path: what a caller holds when the path comes from the
/// configuration. The simulator builds one path for all of an operator's calls: the one
/// chosen, or for `auto` the one [`commfuse_core::fused::gemm_rs::choose_path`] picks at
/// `max_m` (the GPU's operator chooses per call's M; callers that want that build an operator
/// per M, as the Python package does).
pub enum GemmRsOperator<TI: Element, TO: Element> {
    Fused(SimGemmReduceScatter<TI, TO>),
    Overlapped(ring::SimRingReduceScatter<TI, TO>),
    Unfused(unfused::SimUnfusedReduceScatter<TI, TO>),
    /// The ring inside one GEMM ([`fused_ring`]): a schedule no path name takes yet (on GPUs it
    /// runs as one rank alone, `bench gemm --rs-ring`), built by [`GemmRsOperator::fused_ring`]
    FusedRing(fused_ring::SimFusedRing<TI, TO>),
}

impl<TI: Element, TO: Element> GemmRsOperator<TI, TO> {
    /// The path the operator of `config` takes on `world` ranks.
    pub fn path(config: &GemmRsConfig, world: usize) -> Result<GemmRsPath, BackendError> {
        let shape = config
            .shape(world, config.max_m)
            .map_err(|e| unavailable(e.to_string()))?;
        Ok(config.path_for(&shape))
    }

    /// The operator of `config` (and of its [`path`](Self::path)) for `world`.
    pub fn new(world: &World, config: GemmRsConfig) -> Result<Self, BackendError> {
        Ok(match Self::path(&config, world.size())? {
            GemmRsPath::Fused => GemmRsOperator::Fused(SimGemmReduceScatter::new(world, config)?),
            GemmRsPath::Overlapped { pieces } => {
                GemmRsOperator::Overlapped(ring::SimRingReduceScatter::new(world, config, pieces)?)
            }
            GemmRsPath::Unfused => {
                GemmRsOperator::Unfused(unfused::SimUnfusedReduceScatter::new(world, config)?)
            }
        })
    }

    /// The fused ring of `config` for `world` (its path in the configuration is not read).
    pub fn fused_ring(world: &World, config: GemmRsConfig) -> Result<Self, BackendError> {
        Ok(GemmRsOperator::FusedRing(fused_ring::SimFusedRing::new(
            world, config,
        )?))
    }

    /// Signal pads of a world of `world` ranks that can run any path for `config` (at least 64
    /// columns), whose waits give up after the configuration's timeout.
    pub fn world_config(
        config: &GemmRsConfig,
        world: usize,
    ) -> Result<crate::WorldConfig, BackendError> {
        let c = InWorld::new(world, *config);
        let cols = c.pad_cols()?.max(64);
        let pad_cols = u32::try_from(cols)
            .map_err(|_| unavailable(format!("{cols} flag columns do not fit a signal pad")))?;
        let ring_rows = ring::SimRingReduceScatter::<TI, TO>::pad_rows(config, world, cols)?.max(
            fused_ring::SimFusedRing::<TI, TO>::pad_rows(config, world, cols)?,
        );
        Ok(crate::WorldConfig {
            timeout: config.timeout,
            pad_rows: 32.max(ring_rows as u32 + 8),
            pad_cols,
        })
    }

    /// One call on rank `ctx.rank()` (see [`SimGemmReduceScatter::forward`]).
    pub fn forward(
        &self,
        ctx: &RankContext<'_>,
        m: usize,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
    ) -> Result<(), BackendError> {
        match self {
            GemmRsOperator::Fused(op) => op.forward(ctx, m, a, b, bias, out),
            GemmRsOperator::Overlapped(op) => op.forward(ctx, m, a, b, bias, out),
            GemmRsOperator::Unfused(op) => op.forward(ctx, m, a, b, bias, out),
            GemmRsOperator::FusedRing(op) => op.forward(ctx, m, a, b, bias, out),
        }
    }
}
