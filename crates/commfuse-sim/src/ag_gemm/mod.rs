//! All-gather + GEMM on the simulator: the overlapped schedule of
//! [`commfuse_core::fused::ag_gemm`], one call per rank thread. A rank stores its chunk's pieces
//! into every peer's gather buffer and raises each piece's flag there; its GEMMs (the model of
//! [`crate::gemm`]) take its own chunk first, from its own A, then the peers' pieces as their
//! flags come, each into its rows of the output; at the end of a call it raises "done" on every
//! peer, and it waits for a peer's done of the previous call only before it next stores into
//! that peer (as the GPU path's side stream does).
//!
//! The fused path (`AgGemmConfig::fused`) moves the same pieces with the same flags and runs the
//! fused schedule's one GEMM over all M rows (`AgGemmSchedule::fused_plan`) tile by tile in its
//! order, waiting for a piece's flag before the first tile that reads its rows, as the GPU
//! GEMM's producer does before a band's loads.

use crate::buffer::SymmetricBuffer;
use crate::fused::{check_build, check_call, table_heap, Calls, FlagWords, InWorld};
use crate::gemm::{run_gemm, run_gemm_tiles, Operands};
use crate::memory::{Footprint, OperatorMemory};
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
pub use commfuse_core::fused::ag_gemm::AgCallInputs;
use commfuse_core::fused::ag_gemm::{AgGemmSchedule, AgGemmShape, MAX_PIECES};
use commfuse_core::gemm::{Epilogue, GemmPlan, GemmProblem};
use commfuse_core::{Cmp, Element, NotifyOp, Slot};
use std::marker::PhantomData;

pub use crate::fused::AgGemmConfig;

fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// The shape of a call of `m` gathered rows under `config` on `world` ranks.
pub fn shape(config: &AgGemmConfig, world: usize, m: usize) -> Result<AgGemmShape, BackendError> {
    config
        .shape(world, m)
        .map_err(|e| unavailable(e.to_string()))
}

/// What [`SimAgGemm`] of `config` on `world` ranks allocates: every rank's gather buffer
/// [max_m, K] and product buffer (one chunk's rows, or all M rows on the fused path), and the
/// heap of a call (each rank thread's received piece and product, or on the fused path its
/// whole gathered A and the fused plan's tables, and the GEMM's widened tiles).
pub fn memory(config: &AgGemmConfig, world: usize) -> OperatorMemory {
    let c = InWorld::new(world, *config);
    let fused = c.fused;
    let what = c.describe(if fused {
        "all-gather + GEMM (fused)"
    } else {
        "all-gather + GEMM"
    });
    let (si, so) = (c.input.size(), c.output.size());
    let chunk = c.max_m.div_ceil(c.world.max(1));
    let piece = chunk.div_ceil(c.pieces.max(1));
    let rows = if fused { c.max_m } else { chunk };
    let buffers = Footprint::new(what.clone())
        .item(&[c.world, c.max_m, c.k, si])
        .item(&[c.world, rows, c.n, so]);
    let heap = if fused {
        let tiles = c
            .max_m
            .div_ceil(c.tile.m.max(1))
            .checked_add(c.world)
            .and_then(|b| b.checked_mul(c.n.div_ceil(c.tile.n.max(1))));
        let heap = Footprint::new(what).item(&[c.world, c.max_m, c.k, si]);
        table_heap(heap, c.world, tiles)
    } else {
        Footprint::new(what)
            .item(&[c.world, piece, c.k, si])
            .item(&[c.world, piece, c.n, so])
    };
    OperatorMemory {
        buffers,
        heap: c.gemm_heap(heap, rows),
    }
}

/// All-gather + GEMM for every rank of one simulated world, built once and called many times.
/// It owns the first rows of the world's signal pads that its flags need.
pub struct SimAgGemm<TI: Element, TO: Element> {
    config: InWorld<AgGemmConfig>,
    /// Per rank: the gathered A, [max_m, K]
    gather: SymmetricBuffer<TI>,
    /// Per rank: one piece's product, or (fused) the whole [max_m, N] output
    product: SymmetricBuffer<TO>,
    flags: FlagWords,
    calls: Calls,
    _output: PhantomData<fn() -> TO>,
}

impl<TI: Element, TO: Element> SimAgGemm<TI, TO> {
    /// Signal pad rows its flags need on `world` ranks' pads of `pad_cols` columns.
    pub fn pad_rows(
        config: &AgGemmConfig,
        world: usize,
        pad_cols: usize,
    ) -> Result<usize, BackendError> {
        let s = AgGemmSchedule::new(shape(config, world, config.max_m)?, 1);
        Ok(FlagWords::rows(s.flag_words(), pad_cols))
    }

    /// Builds the operator for `world`: each chunk cut into `config.pieces` row pieces, on the
    /// fused path where `config.fused` (one GEMM per call that waits per piece before the tiles
    /// reading its rows, see the module doc).
    pub fn new(world: &World, config: AgGemmConfig) -> Result<Self, BackendError> {
        check_build::<TI, TO>("all-gather + GEMM", (config.input, config.output))?;
        let pieces = config.pieces;
        if pieces == 0 || pieces > MAX_PIECES {
            return Err(unavailable(format!(
                "all-gather + GEMM cuts a chunk into 1 to {MAX_PIECES} pieces, got {pieces}"
            )));
        }
        let s = shape(&config, world.size(), config.max_m)?;
        memory(&config, world.size()).check(world.arena().is_some())?;
        let words = AgGemmSchedule::new(s, 1).flag_words();
        let flags = FlagWords::on("all-gather + GEMM", world, words)?;
        let rows = if config.fused {
            config.max_m
        } else {
            config.max_m.div_ceil(world.size())
        };
        Ok(SimAgGemm {
            gather: SymmetricBuffer::new_in(world, s.m * s.k)?,
            product: SymmetricBuffer::new_in(world, rows * s.n)?,
            flags,
            calls: Calls::new(world),
            config: InWorld::new(world.size(), config),
            _output: PhantomData,
        })
    }

    /// What it was built for.
    pub fn config(&self) -> &AgGemmConfig {
        &self.config.config
    }

    fn slot(&self, index: usize) -> Slot {
        self.flags.slot(index)
    }

    /// One call on rank `ctx.rank()` with `m` gathered rows: its chunk of A ([chunk rows, K]),
    /// its B ([K, N] or [N, K]), the bias [N] when the operator was built with one; writes
    /// AllGather(A)·B (+ bias) into `out` ([m, N]) and, when given, the gathered A into
    /// `gathered` ([m, K]). Every rank makes the same calls with the same m.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        ctx: &RankContext<'_>,
        m: usize,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
        gathered: Option<&mut [TI]>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let rank = ctx.rank();
        let chunk_rows = commfuse_core::op::chunk_range(m, c.world, rank).len();
        let lengths = [
            ("A", a.len(), chunk_rows * c.k),
            ("B", b.len(), c.k * c.n),
            (
                "the bias",
                bias.map_or(0, <[TO]>::len),
                c.n * c.bias as usize,
            ),
            ("the output", out.len().min(m * c.n), m * c.n),
            (
                "the gathered A",
                gathered.as_ref().map_or(m * c.k, |g| g.len().min(m * c.k)),
                m * c.k,
            ),
        ];
        check_call(
            "all-gather + GEMM",
            ctx,
            &self.calls,
            &c.config,
            m,
            &lengths,
        )?;
        let s = AgGemmSchedule::new(shape(c, c.world, m)?, c.pieces);
        self.calls.run(rank, |call| {
            self.call(ctx, &s, call, (a, b, bias), out, gathered)
        })
    }

    fn wait(
        &self,
        ctx: &RankContext<'_>,
        index: usize,
        (call, cmp): (u64, Cmp),
        (what, from): (String, usize),
    ) -> Result<(), BackendError> {
        let slot = self.slot(index);
        ctx.wait(slot, call, cmp, from).map(|_| ()).map_err(|e| match e {
            BackendError::WaitTimeout {
                seen, timeout_ms, ..
            } => unavailable(format!(
                "timeout after {timeout_ms} ms: all-gather + GEMM rank {} waits for {what} (flag {slot}) to reach {call}, sees {seen}",
                ctx.rank()
            )),
            other => other,
        })
    }

    fn call(
        &self,
        ctx: &RankContext<'_>,
        s: &AgGemmSchedule,
        call: u64,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
        mut gathered: Option<&mut [TI]>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (rank, p, n, k) = (ctx.rank(), c.world, c.n, c.k);
        let start = s.shape.chunk(rank).start;
        // every peer has finished reading its gather buffer in the previous call
        for q in (0..p).filter(|&q| q != rank) {
            let what = format!("rank {q}'s done of the previous call");
            self.wait(ctx, s.done_index(q), (call - 1, Cmp::Ge), (what, q))?;
        }
        // hand this rank's pieces to every peer
        for g in s.sent_by(rank) {
            let rows = &a[(g.rows.start - start) * k..(g.rows.end - start) * k];
            for q in s.receivers_of(rank) {
                // SAFETY: the peer reads these rows only after the flag below, and it had
                // finished reading its gather buffer of the previous call (its done, above)
                unsafe { self.gather.store(q, g.rows.start * k, rows) };
                ctx.notify(
                    q,
                    self.slot(s.flag_index(rank, g.piece)),
                    call,
                    NotifyOp::Set,
                )?;
            }
        }
        if self.config.fused {
            return self.fused_gemm(ctx, s, call, (a, b, bias), out, gathered);
        }
        let mut received = Vec::new();
        let mut product = Vec::new();
        for g in s.gemms_of(rank) {
            let a_rows: &[TI] = if g.local {
                &a[(g.rows.start - start) * k..(g.rows.end - start) * k]
            } else {
                let what = format!("piece {} of rank {}'s chunk", g.piece, g.owner);
                let flag = s.flag_index(g.owner, g.piece);
                self.wait(ctx, flag, (call, Cmp::Eq), (what, g.owner))?;
                received.resize(g.rows.len() * k, TI::from_f32(0.0));
                // SAFETY: the owner stored these rows before the flag the wait saw (acquire)
                unsafe { self.gather.load(rank, g.rows.start * k, &mut received) };
                &received
            };
            if let Some(gathered) = gathered.as_deref_mut() {
                gathered[g.rows.start * k..g.rows.end * k].copy_from_slice(a_rows);
            }
            let problem = GemmProblem {
                m: g.rows.len(),
                ..s.shape.problem()
            };
            let epilogue = Epilogue {
                bias: bias.is_some(),
                ..Epilogue::default()
            };
            let plan = GemmPlan::local(problem, c.tile, epilogue);
            let ops = Operands::<TI, TO> {
                a: a_rows,
                b,
                c: None,
                bias,
            };
            run_gemm(ctx, &plan, &ops, &self.product)?;
            product.resize(g.rows.len() * n, TO::from_f32(0.0));
            // SAFETY: only this rank's thread uses its product buffer
            unsafe { self.product.load(rank, 0, &mut product) };
            out[g.rows.start * n..g.rows.end * n].copy_from_slice(&product);
        }
        self.raise_done(ctx, s, call)
    }

    /// "Done" on every peer: this rank has read its gather buffer for call `call`.
    fn raise_done(
        &self,
        ctx: &RankContext<'_>,
        s: &AgGemmSchedule,
        call: u64,
    ) -> Result<(), BackendError> {
        let rank = ctx.rank();
        for q in (0..s.shape.world).filter(|&q| q != rank) {
            ctx.notify(q, self.slot(s.done_index(rank)), call, NotifyOp::Set)?;
        }
        Ok(())
    }

    /// The fused path's GEMM of a call (after this rank's pieces went out): the plan's tiles
    /// piece by piece, each peer's piece waited for and read from the gather buffer before its
    /// first tile, the rank's own rows from its A; then the output and the gathered A.
    fn fused_gemm(
        &self,
        ctx: &RankContext<'_>,
        s: &AgGemmSchedule,
        call: u64,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
        gathered: Option<&mut [TI]>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (rank, n, k, m) = (ctx.rank(), c.n, c.k, s.shape.m);
        let group = commfuse_core::fused::gemm_rs::ORDER_GROUP;
        let plan = s.fused_plan(rank, c.tile, bias.is_some(), group);
        let bands = plan.bands.clone().expect("the fused plan has row bands");
        let tn = plan.tile_grid().1;
        let mut full = vec![TI::from_f32(0.0); m * k];
        let mut order = plan.order.iter().copied().peekable();
        for g in s.gemms_of(rank) {
            let rows = g.rows.start * k..g.rows.end * k;
            if g.local {
                let start = s.shape.chunk(rank).start * k;
                full[rows.clone()].copy_from_slice(&a[rows.start - start..rows.end - start]);
            } else {
                let what = format!("piece {} of rank {}'s chunk", g.piece, g.owner);
                let flag = s.flag_index(g.owner, g.piece);
                self.wait(ctx, flag, (call, Cmp::Ge), (what, g.owner))?;
                // SAFETY: the owner stored these rows before the flag the wait saw (acquire)
                unsafe { self.gather.load(rank, rows.start, &mut full[rows]) };
            }
            // the order's tiles of this piece: they come next, together
            let mut tiles = Vec::new();
            while let Some(t) = order.next_if(|&t| g.rows.contains(&bands[t / tn])) {
                tiles.push(t);
            }
            let ops = Operands::<TI, TO> {
                a: &full,
                b,
                c: None,
                bias,
            };
            run_gemm_tiles(ctx, &plan, &tiles, &ops, &self.product)?;
        }
        if order.next().is_some() {
            return Err(unavailable(
                "the fused plan's order left tiles outside the pieces".into(),
            ));
        }
        // SAFETY: only this rank's thread uses its product buffer
        unsafe { self.product.load(rank, 0, &mut out[..m * n]) };
        if let Some(gathered) = gathered {
            gathered[..m * k].copy_from_slice(&full);
        }
        self.raise_done(ctx, s, call)
    }
}
