//! The unfused GEMM + reduce-scatter on the simulator, the twin of the GPU's
//! (`commfuse_cuda::gemm_rs`, path `Unfused`): each rank computes its whole partial product,
//! laid out as P row blocks of ⌈M/P⌉ rows (block q holds owner q's rows, zero-padded), then one
//! reduce-scatter of P·⌈M/P⌉·N elements — here the simulator's own checked collective, on GPUs
//! NCCL's — leaves block r summed on rank r, whose first chunk rows are its output. The bias is
//! added by rank 0's GEMM only, so the sum holds it once.
//!
//! The reduce-scatter of each M is its own [`SimCollective`], built by the first rank to need
//! it (the plan is a pure function of the world and the size, so every rank would build the
//! same). Its plan uses the world's plan rows of the signal pads; a world serving this path
//! serves no other operator at the same time.

use crate::buffer::SymmetricBuffer;
use crate::collective::SimCollective;
use crate::fused::{check_build, check_rs_call, Calls, GemmRsConfig, InWorld};
use crate::gemm::{run_gemm, Operands};
use crate::memory::{Footprint, OperatorMemory};
use crate::world::{RankContext, World};
use commfuse_core::backend::BackendError;
use commfuse_core::gemm::{Epilogue, GemmPlan, GemmProblem};
use commfuse_core::{Element, OpKind, ReduceOp};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// What [`SimUnfusedReduceScatter`] of `config` allocates: every rank's product block, the
/// reduce-scatter of P·⌈M/P⌉·N elements (its input, output and at most as much scratch as
/// input), and the heap of a call (each rank thread's whole partial product, its summed block,
/// the GEMM's widened tiles).
pub fn memory(config: &GemmRsConfig, world: usize) -> OperatorMemory {
    let c = InWorld::new(world, *config);
    let what = c.describe("GEMM + reduce-scatter (unfused)");
    let rows = c.max_m.div_ceil(c.world.max(1));
    let so = c.output.size();
    let buffers = Footprint::new(what.clone())
        .item(&[c.world, rows, c.n, so])
        .item(&[c.world, 2, c.world, rows, c.n, so])
        .item(&[c.world, rows, c.n, so]);
    let heap = Footprint::new(what)
        .item(&[c.world, c.world, rows, c.n, so])
        .item(&[c.world, rows, c.n, so]);
    OperatorMemory {
        buffers,
        heap: c.gemm_heap(heap, rows),
    }
}

/// The unfused GEMM + reduce-scatter for every rank of one simulated world.
pub struct SimUnfusedReduceScatter<TI: Element, TO: Element> {
    config: InWorld<GemmRsConfig>,
    /// Per rank: one owner's block of the product as the GEMM writes it
    product: SymmetricBuffer<TO>,
    /// The reduce-scatter of each M seen
    collectives: Mutex<HashMap<usize, Arc<SimCollective<TO>>>>,
    calls: Calls,
    _input: PhantomData<fn() -> TI>,
}

impl<TI: Element, TO: Element> SimUnfusedReduceScatter<TI, TO> {
    /// Builds the operator for `world` (the unfused path whatever the configuration's `path`
    /// says).
    pub fn new(world: &World, config: GemmRsConfig) -> Result<Self, BackendError> {
        check_build::<TI, TO>("GEMM + reduce-scatter", (config.input, config.output))?;
        let config = InWorld::new(world.size(), config);
        config.shape(config.max_m)?;
        memory(&config, world.size()).check(world.arena().is_some())?;
        let rows = config.max_m.div_ceil(config.world);
        Ok(SimUnfusedReduceScatter {
            product: SymmetricBuffer::new_in(world, rows * config.n)?,
            collectives: Mutex::new(HashMap::new()),
            calls: Calls::new(world),
            config,
            _input: PhantomData,
        })
    }

    fn collective(&self, world: &World, m: usize) -> Result<Arc<SimCollective<TO>>, BackendError> {
        let mut built = self.collectives.lock().unwrap();
        if let Some(c) = built.get(&m) {
            return Ok(c.clone());
        }
        let count = self.config.world * m.div_ceil(self.config.world) * self.config.n;
        let options = (None, ReduceOp::Sum, 0, 1);
        let c = Arc::new(SimCollective::new(
            world,
            OpKind::ReduceScatter,
            count,
            options,
        )?);
        built.insert(m, c.clone());
        Ok(c)
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
        let out = &mut out[..chunk.len() * c.n];
        self.calls
            .run(ctx.rank(), |_| self.call(ctx, m, (a, b, bias), out))
    }

    fn call(
        &self,
        ctx: &RankContext<'_>,
        m: usize,
        (a, b, bias): (&[TI], &[TI], Option<&[TO]>),
        out: &mut [TO],
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (p, n, k) = (c.world, c.n, c.k);
        let rows = m.div_ceil(p);
        // the whole partial product, owner q's rows in block q, padding rows zero
        let mut blocks = vec![TO::from_f32(0.0); p * rows * n];
        let add_bias = ctx.rank() == 0 && bias.is_some();
        for q in 0..p {
            let owned = commfuse_core::op::chunk_range(m, p, q);
            if owned.is_empty() {
                continue;
            }
            let problem = GemmProblem {
                m: owned.len(),
                ..c.shape(m)?.problem()
            };
            let epilogue = Epilogue {
                bias: add_bias,
                ..Epilogue::default()
            };
            let plan = GemmPlan::local(problem, c.tile, epilogue);
            let ops = Operands::<TI, TO> {
                a: &a[owned.start * k..owned.end * k],
                b,
                c: None,
                bias: if add_bias { bias } else { None },
            };
            run_gemm(ctx, &plan, &ops, &self.product)?;
            let block = &mut blocks[q * rows * n..(q * rows + owned.len()) * n];
            // SAFETY: only this rank's thread writes or reads its product buffer
            unsafe { self.product.load(ctx.rank(), 0, block) };
        }
        let mut summed = vec![TO::poison(); rows * n];
        self.collective(ctx.world(), m)?
            .forward(ctx, &blocks, &mut summed)?;
        out.copy_from_slice(&summed[..out.len()]);
        Ok(())
    }
}
