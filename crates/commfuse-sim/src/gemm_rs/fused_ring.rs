//! The ring inside one GEMM on the simulator: the schedule of
//! [`commfuse_core::fused::fused_ring`], one call per rank thread.
//!
//! A rank's GEMM (the model of [`crate::gemm`]) takes its tiles in the schedule's order. A
//! tile of a later step first waits until its running sum's flag holds this call's number,
//! then adds its partial to that sum (the GEMM's C, beta = 1) and stores the result straight
//! into the receiver's receive buffer, raising the tile's flag there; the last step's tiles add
//! the bias and land in the rank's output. Alternate calls use alternate sets of receive
//! buffers and flags, and a call of M < P ends with the ring's "done" handshake, as on the
//! overlapped path ([`super::ring`]), whose flags and buffers it lays out the same way.

use super::ring::{end_with_done, wait_flag};
use crate::buffer::SymmetricBuffer;
use crate::fused::{
    check_build, check_rs_call, table_heap, Calls, FlagWords, GemmRsConfig, InWorld,
};
use crate::gemm::{run_validated_tiles, Operands};
use crate::memory::{Footprint, OperatorMemory};
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
use commfuse_core::fused::fused_ring::FusedRing;
use commfuse_core::fused::ring_rs::{RingSchedule, RingTarget};
use commfuse_core::gemm::{Destination, Epilogue, GemmPlan, GemmProblem, TileFlag};
use commfuse_core::{Cmp, Element, NotifyOp, Slot};
use std::marker::PhantomData;

fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// The fused ring of a call of `m` rows under `c`.
fn schedule(c: &InWorld<GemmRsConfig>, m: usize) -> Result<FusedRing, BackendError> {
    let ring = RingSchedule::within(c.shape(m)?, c.max_m, 1)
        .in_groups(c.numa_groups)
        .map_err(|e| unavailable(e.to_string()))?;
    Ok(FusedRing::new(ring, c.tile))
}

/// What [`SimFusedRing`] of `config` on `world` ranks allocates: every rank's receive buffers
/// (2 sets × P − 1 buffers of the longest chunk) and the buffer its last step's tiles land in,
/// and the heap of a call (each rank thread's received sums of a step, its list of the P
/// steps' tiles and one step's plan, the GEMM's widened tiles).
pub fn memory(config: &GemmRsConfig, world: usize) -> OperatorMemory {
    let c = InWorld::new(world, *config);
    let what = c.describe("GEMM + reduce-scatter (fused ring)");
    let chunk = c.max_m.div_ceil(c.world.max(1));
    let so = c.output.size();
    let buffers = Footprint::new(what.clone())
        .item(&[c.world, 2, c.world.saturating_sub(1), chunk, c.n, so])
        .item(&[c.world, chunk, c.n, so]);
    let heap = Footprint::new(what).item(&[c.world, chunk, c.n, so]);
    let (_, per_owner) = c.tiles();
    // P steps' tiles listed, and one step's plan, per rank thread
    let tables = per_owner.and_then(|t| t.checked_mul(c.world + 1));
    OperatorMemory {
        buffers,
        heap: c.gemm_heap(table_heap(heap, c.world, tables), chunk),
    }
}

/// GEMM + reduce-scatter as a ring inside one GEMM per rank, for every rank of one simulated
/// world, built once and called many times (each rank thread calls
/// [`forward`](Self::forward)). It owns the first rows of the world's signal pads that its
/// flags need ([`SimFusedRing::pad_rows`]).
pub struct SimFusedRing<TI: Element, TO: Element> {
    config: InWorld<GemmRsConfig>,
    /// Per rank: 2 sets × (P − 1) buffers of the longest chunk
    receive: SymmetricBuffer<TO>,
    /// Per rank: its chunk of the output as the last step's tiles store it
    output: SymmetricBuffer<TO>,
    flags: FlagWords,
    calls: Calls,
    _input: PhantomData<fn() -> TI>,
}

impl<TI: Element, TO: Element> SimFusedRing<TI, TO> {
    /// Signal pad rows the flags of `config` on `world` ranks need on a pad of `pad_cols`
    /// columns.
    pub fn pad_rows(
        config: &GemmRsConfig,
        world: usize,
        pad_cols: usize,
    ) -> Result<usize, BackendError> {
        let c = InWorld::new(world, *config);
        Ok(FlagWords::rows(
            schedule(&c, c.max_m)?.flag_words(),
            pad_cols,
        ))
    }

    /// Builds the operator for `world` (the configuration's tile and NUMA groups shape it).
    pub fn new(world: &World, config: GemmRsConfig) -> Result<Self, BackendError> {
        check_build::<TI, TO>("GEMM + reduce-scatter", (config.input, config.output))?;
        let config = InWorld::new(world.size(), config);
        if config.tile.m == 0 || config.tile.n == 0 {
            return Err(unavailable("the tile shape must be positive".into()));
        }
        let s = schedule(&config, config.max_m)?;
        memory(&config, world.size()).check(world.arena().is_some())?;
        let flags = FlagWords::on(
            "the fused ring GEMM + reduce-scatter",
            world,
            s.flag_words(),
        )?;
        Ok(SimFusedRing {
            receive: SymmetricBuffer::new_in(world, s.ring.receive_len())?,
            output: SymmetricBuffer::new_in(world, s.ring.buffer_len())?,
            flags,
            calls: Calls::new(world),
            config,
            _input: PhantomData,
        })
    }

    fn slot(&self, index: usize) -> Slot {
        self.flags.slot(index)
    }

    /// One call on rank `ctx.rank()`, with the operands and output of
    /// [`crate::gemm_rs::SimGemmReduceScatter::forward`].
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
        let chunk = check_rs_call(ctx, &self.calls, c, m, (a, b, bias), out)?;
        let s = schedule(c, m)?;
        let out = &mut out[..chunk.len() * c.n];
        self.calls.run(ctx.rank(), |call| {
            self.call(ctx, &s, call, (a, b, bias), out)
        })
    }

    /// The GEMM plan of step `step` (owner `owner`'s chunk, tiles of the schedule's shape) in
    /// set `set` of call `call`: tiles into the receiver's receive buffer with their flags, or
    /// at the last step into this rank's output buffer with the bias.
    fn step_plan(
        &self,
        s: &FusedRing,
        (rank, step, owner): (usize, usize, usize),
        (set, call): (usize, u64),
        bias: bool,
    ) -> GemmPlan {
        let r = &s.ring;
        let n = r.shape.n;
        let problem = GemmProblem {
            m: r.shape.chunk(owner).len(),
            ..r.shape.problem()
        };
        let last = step + 1 == r.shape.world;
        let epilogue = Epilogue {
            beta: if step > 0 { 1.0 } else { 0.0 },
            bias: last && bias,
            ..Epilogue::default()
        };
        let mut plan = GemmPlan::local(problem, s.tile, epilogue);
        if !last {
            let receiver = r.receiver(rank, step);
            let base = r.receive_offset(set, step);
            let count = plan.tile_count();
            let tiles = (0..count).map(|t| plan.tile_bounds(t)).collect::<Vec<_>>();
            plan.destinations = Some(
                tiles
                    .iter()
                    .map(|(rows, cols)| Destination {
                        rank: receiver,
                        offset: base + rows.start * n + cols.start,
                        ld: n,
                    })
                    .collect(),
            );
            plan.flags = Some(
                (0..count)
                    .map(|t| TileFlag {
                        slot: self.slot(s.flag_index(set, step, t)),
                        value: call,
                        op: NotifyOp::Set,
                    })
                    .collect(),
            );
        }
        plan
    }

    fn call(
        &self,
        ctx: &RankContext<'_>,
        s: &FusedRing,
        call: u64,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
    ) -> Result<(), BackendError> {
        let r = &s.ring;
        let (rank, n, k) = (ctx.rank(), r.shape.n, r.shape.k);
        let set = RingSchedule::set_of(call);
        let tiles = s.tiles_of(rank);
        let mut sum: Vec<TO> = Vec::new();
        let mut row = Vec::new();
        for step_tiles in tiles.chunk_by(|x, y| x.step == y.step) {
            let (step, owner) = (step_tiles[0].step, step_tiles[0].owner);
            let plan = self.step_plan(s, (rank, step, owner), (set, call), bias.is_some());
            plan.validate(ctx.world_size())
                .map_err(|e| unavailable(e.to_string()))?;
            let chunk = r.shape.chunk(owner);
            sum.clear();
            sum.resize(chunk.len() * n, TO::from_f32(0.0));
            let rows_a = &a[chunk.start * k..chunk.end * k];
            let step_bias = if plan.epilogue.bias { bias } else { None };
            let target = if step_tiles[0].target == RingTarget::Output {
                &self.output
            } else {
                &self.receive
            };
            for t in step_tiles {
                // the running sum of this tile, once the sender's flag holds this call
                if let Some(prev) = t.add {
                    let index = s.flag_index(set, prev, t.index);
                    let what = format!("the running sum of tile {} after step {prev}", t.index);
                    let from = r.sender(rank, t.step);
                    wait_flag(
                        "fused ring",
                        &self.flags,
                        ctx,
                        index,
                        (call, Cmp::Eq),
                        (&what, from),
                    )?;
                    row.resize(t.cols.len(), TO::from_f32(0.0));
                    for i in t.within.clone() {
                        let at = i * n + t.cols.start;
                        // SAFETY: the sender stored this tile before the flag the wait saw
                        // (acquire), and stores into this set again only in its call after
                        // next (the ring's two sets)
                        unsafe {
                            self.receive
                                .load(rank, r.receive_offset(set, prev) + at, &mut row)
                        };
                        sum[at..at + row.len()].copy_from_slice(&row);
                    }
                }
                // its epilogue stores into the receiver's buffer and raises its flag there (or
                // writes this rank's output): the receiver reads it only after the flag
                let ops = Operands::<TI, TO> {
                    a: rows_a,
                    b,
                    c: Some(&sum),
                    bias: step_bias,
                };
                run_validated_tiles(ctx, &plan, &[t.index], &ops, target)?;
            }
        }
        if !r.shape.chunk(rank).is_empty() {
            // SAFETY: only this rank's thread writes or reads its output buffer
            unsafe { self.output.load(rank, 0, out) };
        }
        end_with_done("fused ring", &self.flags, ctx, r, call)
    }
}
