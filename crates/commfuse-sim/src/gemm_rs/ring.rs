//! The overlapped path of GEMM + reduce-scatter on the simulator: the ring of
//! [`commfuse_core::fused::ring_rs`] with the GPU path's protocol (`commfuse_cuda`'s
//! `gemm_rs::ring`), one call per rank thread.
//!
//! Per piece: wait until the running sum's flag holds this call's number (when the piece adds
//! one), compute the piece's GEMM with the model of [`crate::gemm`] (f32 accumulation, the
//! running sum as C with beta = 1, the bias at the last step) into this rank's send buffer,
//! then hand it on (a store into the receiver's receive buffer, then its flag) or copy it into
//! the output. Alternate calls use alternate sets of receive buffers and flags, and nothing else
//! orders one call after the next (why that suffices: [`commfuse_core::fused::ring_rs`]) but
//! where M < P, whose calls end with the "done" handshake. Flags
//! live on the world's signal pads (one word per flag of the schedule's layout, row-major over
//! the pad's columns) and hold call numbers.

use crate::buffer::SymmetricBuffer;
use crate::fused::{
    check_build, check_rs_call, table_heap, Calls, FlagWords, GemmRsConfig, InWorld,
};
use crate::gemm::{run_gemm, Operands};
use crate::memory::{Footprint, OperatorMemory};
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
use commfuse_core::fused::gemm_rs::GemmRsShape;
use commfuse_core::fused::ring_rs::{RingSchedule, RingTarget};
use commfuse_core::gemm::{Epilogue, GemmPlan};
use commfuse_core::{Cmp, Element, NotifyOp, Slot};
use std::marker::PhantomData;

fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// The overlapped GEMM + reduce-scatter for every rank of one simulated world, built once and
/// called many times (each rank thread calls [`forward`](Self::forward)). It owns the first
/// rows of the world's signal pads that its flags need ([`SimRingReduceScatter::pad_rows`]).
pub struct SimRingReduceScatter<TI: Element, TO: Element> {
    config: InWorld<GemmRsConfig>,
    pieces: usize,
    /// Per rank: 2 sets × (P − 1) buffers of the longest chunk
    receive: SymmetricBuffer<TO>,
    /// Per rank: one piece's product before it is handed on
    send: SymmetricBuffer<TO>,
    flags: FlagWords,
    /// Per rank, calls it has made (only that rank's thread touches it)
    calls: Calls,
    _input: PhantomData<fn() -> TI>,
}

impl<TI: Element, TO: Element> SimRingReduceScatter<TI, TO> {
    /// Signal pad rows the flags of `config` on `world` ranks need on a pad of `pad_cols`
    /// columns.
    pub fn pad_rows(
        config: &GemmRsConfig,
        world: usize,
        pad_cols: usize,
    ) -> Result<usize, BackendError> {
        let c = InWorld::new(world, *config);
        let s = schedule(&c, c.shape(c.max_m)?, 1)?;
        Ok(FlagWords::rows(s.flag_words(), pad_cols))
    }

    /// Builds the operator for `world`, each ring step cut into `pieces` row pieces (the
    /// overlapped path whatever the configuration's `path` says; [`super::GemmRsOperator::new`]
    /// takes the pieces from there).
    pub fn new(world: &World, config: GemmRsConfig, pieces: usize) -> Result<Self, BackendError> {
        check_build::<TI, TO>("GEMM + reduce-scatter", (config.input, config.output))?;
        let config = InWorld::new(world.size(), config);
        let max = commfuse_core::fused::ring_rs::MAX_PIECES;
        if pieces == 0 || pieces > max {
            return Err(unavailable(format!(
                "the overlapped path cuts a step into 1 to {max} pieces, got {pieces}"
            )));
        }
        config.shape(config.max_m)?;
        memory(&config, world.size(), pieces).check(world.arena().is_some())?;
        let s = schedule(&config, config.shape(config.max_m)?, pieces)?;
        let flags = FlagWords::on(
            "the overlapped GEMM + reduce-scatter",
            world,
            s.flag_words(),
        )?;
        Ok(SimRingReduceScatter {
            receive: SymmetricBuffer::new_in(world, s.receive_len())?,
            send: SymmetricBuffer::new_in(world, s.buffer_len())?,
            flags,
            pieces,
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
        let rank = ctx.rank();
        check_rs_call(ctx, &self.calls, c, m, (a, b, bias), out)?;
        let s = schedule(c, c.shape(m)?, self.pieces)?;
        self.calls
            .run(rank, |call| self.call(ctx, &s, call, (a, b, bias), out))
    }

    fn wait(
        &self,
        ctx: &RankContext<'_>,
        index: usize,
        expected: (u64, Cmp),
        from: (&str, usize),
    ) -> Result<(), BackendError> {
        wait_flag("ring", &self.flags, ctx, index, expected, from)
    }

    fn call(
        &self,
        ctx: &RankContext<'_>,
        s: &RingSchedule,
        call: u64,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (rank, n, k) = (ctx.rank(), c.n, c.k);
        let set = RingSchedule::set_of(call);
        let mut sum = Vec::new();
        let mut product = Vec::new();
        for g in s.pieces_of(rank) {
            let len = g.rows.len() * n;
            let within = g.within.start * n;
            // the running sum handed on by the sender, once its flag holds this call
            if let Some(prev) = g.add {
                let index = s.flag_index(set, prev, g.piece);
                let what = format!("the running sum of piece {} after step {prev}", g.piece);
                let from = s.sender(rank, g.step);
                self.wait(ctx, index, (call, Cmp::Eq), (&what, from))?;
                sum.resize(len, TO::from_f32(0.0));
                // SAFETY: the sender stored these rows before the flag the wait saw (acquire),
                // and stores into this set again only in its call after next, which starts
                // after its next call took in this rank's partial of that call, computed after
                // this call (the two sets)
                unsafe {
                    self.receive
                        .load(rank, s.receive_offset(set, prev) + within, &mut sum)
                };
            }
            let output = g.target == RingTarget::Output;
            let epilogue = Epilogue {
                beta: if g.add.is_some() { 1.0 } else { 0.0 },
                bias: output && bias.is_some(),
                ..Epilogue::default()
            };
            let problem = commfuse_core::gemm::GemmProblem {
                m: g.rows.len(),
                ..s.shape.problem()
            };
            let plan = GemmPlan::local(problem, c.tile, epilogue);
            let ops = Operands::<TI, TO> {
                a: &a[g.rows.start * k..g.rows.end * k],
                b,
                c: g.add.map(|_| sum.as_slice()),
                bias: if output { bias } else { None },
            };
            run_gemm(ctx, &plan, &ops, &self.send)?;
            product.resize(len, TO::from_f32(0.0));
            // SAFETY: only this rank's thread writes or reads its send buffer
            unsafe { self.send.load(rank, 0, &mut product) };
            match g.target {
                RingTarget::Output => out[within..within + len].copy_from_slice(&product),
                RingTarget::Send { step } => {
                    let receiver = s.receiver(rank, step);
                    // SAFETY: the receiver reads these rows only after the flag below, and it
                    // finished its call before last, which read this set, before computing its
                    // partial of the previous call, which this rank's previous call took in
                    unsafe {
                        self.receive
                            .store(receiver, s.receive_offset(set, step) + within, &product)
                    };
                    let flag = self.slot(s.flag_index(set, step, g.piece));
                    ctx.notify(receiver, flag, call, NotifyOp::Set)?;
                }
            }
        }
        end_with_done("ring", &self.flags, ctx, s, call)
    }
}

/// Waits until flag word `index` of this rank's `flags` compares with `expected` as asked; a
/// timeout says that GEMM + reduce-scatter's `path` ("ring", "fused ring") rank waited for
/// `what` from rank `from`, which flag, and what it saw.
pub(super) fn wait_flag(
    path: &str,
    flags: &FlagWords,
    ctx: &RankContext<'_>,
    index: usize,
    (expected, cmp): (u64, Cmp),
    (what, from): (&str, usize),
) -> Result<(), BackendError> {
    let slot = flags.slot(index);
    ctx.wait(slot, expected, cmp, from).map(|_| ()).map_err(|e| match e {
        BackendError::WaitTimeout {
            seen, timeout_ms, ..
        } => unavailable(format!(
            "timeout after {timeout_ms} ms: GEMM + reduce-scatter ({path}) rank {} waits for {what} from rank {from} (flag {slot}) to reach {expected}, sees {seen}",
            ctx.rank()
        )),
        other => other,
    })
}

/// The end of call `call` of the ring `s` (flat or 2D, in `path`'s flag words): where some
/// rank owns no rows (M < P), each rank raises its done on its sender on every link and waits
/// for its receiver's (see [`RingSchedule::ends_with_done`]); else nothing.
pub(super) fn end_with_done(
    path: &str,
    flags: &FlagWords,
    ctx: &RankContext<'_>,
    s: &RingSchedule,
    call: u64,
) -> Result<(), BackendError> {
    if !s.ends_with_done() {
        return Ok(());
    }
    let (rank, links) = (ctx.rank(), s.links());
    for &link in &links {
        let done = flags.slot(s.done_index(link));
        ctx.notify(s.sender_on(rank, link), done, call, NotifyOp::Set)?;
    }
    for link in links {
        let what = format!("its receiver's done of this call ({})", link.name());
        let from = s.receiver_on(rank, link);
        wait_flag(
            path,
            flags,
            ctx,
            s.done_index(link),
            (call, Cmp::Ge),
            (&what, from),
        )?;
    }
    Ok(())
}

/// What [`SimRingReduceScatter`] of `config` allocates: every rank's receive buffers (2 sets ×
/// P − 1 buffers of the longest chunk) and send buffer, and the heap of a call (each rank
/// thread's running sum and product of a piece, the piece's GEMM plan and widened tiles).
pub fn memory(config: &GemmRsConfig, world: usize, pieces: usize) -> OperatorMemory {
    let c = InWorld::new(world, *config);
    let what = c.describe("GEMM + reduce-scatter (overlapped)");
    let chunk = c.max_m.div_ceil(c.world.max(1));
    let piece = chunk.div_ceil(pieces.max(1));
    let so = c.output.size();
    let buffers = Footprint::new(what.clone())
        .item(&[c.world, 2, c.world.saturating_sub(1), chunk, c.n, so])
        .item(&[c.world, chunk, c.n, so]);
    let heap = Footprint::new(what).item(&[c.world, 2, piece, c.n, so]);
    let piece_tiles = piece
        .div_ceil(c.tile.m.max(1))
        .checked_mul(c.n.div_ceil(c.tile.n.max(1)));
    let heap = table_heap(heap, c.world, piece_tiles);
    OperatorMemory {
        buffers,
        heap: c.gemm_heap(heap, piece),
    }
}

/// The ring of `shape` (the config's NUMA groups), steps cut into `pieces`.
fn schedule(
    config: &GemmRsConfig,
    shape: GemmRsShape,
    pieces: usize,
) -> Result<RingSchedule, BackendError> {
    RingSchedule::within(shape, config.max_m, pieces)
        .in_groups(config.numa_groups)
        .map_err(|e| unavailable(e.to_string()))
}
