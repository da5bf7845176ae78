//! Collectives as operator objects on the simulator: built once for (world, op, element count,
//! algorithm or `auto`, reduce op), called many times by each rank thread on its own input and
//! output slices — the form users call (NCCL's communicator calls, PyTorch's
//! `torch.distributed` collectives), over the same checked plans the harness runs.
//!
//! A call copies the caller's input into the rank's symmetric input buffer, runs the rank's
//! steps of the plan, and copies the rank's output out. The plan checker models exactly these
//! caller accesses at every call boundary, so back-to-back calls need nothing else; epochs live
//! in the world's per-rank bases, so nothing is cleared between calls. Every rank must make the
//! same calls in the same order (as with NCCL), and operators sharing a world share its signal
//! pads' plan rows, so they must be called in one agreed order too.

use crate::backend::SimBackend;
use crate::buffer::SymmetricBuffer;
use crate::executor::{run_rank, CallBuffers};
use crate::memory::Footprint;
use crate::world::{RankContext, World};
use commfuse_core::backend::{ensure_fits, BackendError, PadCapacity};
use commfuse_core::cost::choose_algo;
use commfuse_core::{
    build_plan, check, Algo, CheckedPlan, Element, OpKind, OpSpec, ReduceOp, Topology,
};

fn unavailable(msg: String) -> BackendError {
    BackendError::Unavailable(msg)
}

/// One collective, for every rank of one simulated world.
pub struct SimCollective<T: Element> {
    spec: OpSpec,
    algo: Algo,
    plan: CheckedPlan,
    reduce: ReduceOp,
    bufs: CallBuffers<T>,
    world_id: usize,
}

impl<T: Element> SimCollective<T> {
    /// `kind` of `count` elements (as [`OpSpec`] counts them) on `world`, by `algo` or, with
    /// `None`, the algorithm the cost model picks for this size on a topology of
    /// `numa_groups` groups; `root` for broadcast. Checks the plan and that it fits the pads.
    pub fn new(
        world: &World,
        kind: OpKind,
        count: usize,
        (algo, reduce, root, numa_groups): (Option<Algo>, ReduceOp, usize, usize),
    ) -> Result<SimCollective<T>, BackendError> {
        let p = world.size();
        let fail = |e: commfuse_core::Error| unavailable(e.to_string());
        let spec = OpSpec::new(kind, p, count, root).map_err(fail)?;
        let topology = Topology::new(p, numa_groups).map_err(fail)?;
        let (algo, plan) = match algo {
            Some(algo) => {
                let plan = build_plan(spec, algo, &topology).map_err(fail)?;
                (algo, check(plan).map_err(|e| unavailable(e.to_string()))?)
            }
            None => {
                let choice = choose_algo(spec, &topology, T::DTYPE.size()).map_err(fail)?;
                (choice.algo, choice.plan)
            }
        };
        let pad = PadCapacity::Shape {
            rows: world.plan_rows(),
            cols: world.pad(0).cols(),
        };
        ensure_fits(&plan, p, pad)?;
        let b = plan.plan().buffers;
        let what = format!("{kind} of {count} {} elements on {p} ranks", T::DTYPE);
        let size = T::DTYPE.size();
        Footprint::new(what)
            .item(&[p, b.input, size])
            .item(&[p, b.output, size])
            .item(&[p, b.scratch, size])
            .check_on(world.arena().is_some())?;
        Ok(SimCollective {
            bufs: CallBuffers {
                input: SymmetricBuffer::new_in(world, b.input)?,
                output: SymmetricBuffer::new_in(world, b.output)?,
                scratch: SymmetricBuffer::new_in(world, b.scratch)?,
            },
            spec,
            algo,
            plan,
            reduce,
            world_id: world as *const World as usize,
        })
    }

    /// The algorithm the operator runs (what `auto` picked, when it did).
    pub fn algo(&self) -> Algo {
        self.algo
    }

    /// What the operator computes.
    pub fn spec(&self) -> &OpSpec {
        &self.spec
    }

    /// One call on rank `ctx.rank()`: its input (`spec().input_len(rank)` elements) into its
    /// output (`spec().output_len(rank)` elements). Every rank makes the same calls in order.
    pub fn forward(
        &self,
        ctx: &RankContext<'_>,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), BackendError> {
        let r = ctx.rank();
        if ctx.world() as *const World as usize != self.world_id {
            return Err(unavailable(format!(
                "this {} was built for another world",
                self.spec.kind
            )));
        }
        let (want_in, want_out) = (self.spec.input_len(r), self.spec.output_len(r));
        if input.len() != want_in || output.len() != want_out {
            return Err(unavailable(format!(
                "rank {r}: {} of {} elements takes {want_in} input and {want_out} output elements here, got {} and {}",
                self.spec.kind,
                self.spec.count,
                input.len(),
                output.len()
            )));
        }
        // SAFETY: rank r's own input and output, written and read by rank r between its
        // calls; the checked plan orders every peer access to them after r enters the call
        // that uses them and before r leaves it (the checker models these caller accesses at
        // every call boundary)
        unsafe { self.bufs.input.store(r, 0, input) };
        run_rank(ctx, &self.plan, &self.bufs, self.reduce)?;
        // SAFETY: as above
        unsafe { self.bufs.output.load(r, 0, output) };
        Ok(())
    }
}

impl SimBackend {
    /// A collective operator object on this backend's world (see [`SimCollective::new`]).
    pub fn collective<T: Element>(
        &self,
        kind: OpKind,
        count: usize,
        options: (Option<Algo>, ReduceOp, usize, usize),
    ) -> Result<SimCollective<T>, BackendError> {
        SimCollective::new(self.world(), kind, count, options)
    }
}
