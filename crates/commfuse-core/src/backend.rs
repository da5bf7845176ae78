//! The interface every backend implements: allocate a plan's symmetric buffers once, then run
//! the plan as many times as needed. Host data crosses the interface as typed slices (the views
//! of [`crate::dtype`], re-exported here).

use crate::checker::CheckedPlan;
use crate::dtype::DType;
pub use crate::dtype::{HostBuffer, HostSlice, HostSliceMut};
pub use crate::error::BackendError;
use crate::implementation::{Baseline, Implementation, Protocol};
use crate::op::{OpKind, OpSpec};
use crate::reduce::ReduceOp;
use std::time::Duration;

/// Checks that `inputs[call][rank]` holds one buffer of `len` elements of `dtype` per rank;
/// backends call it before queueing calls.
pub fn check_queued_inputs(
    inputs: &[Vec<HostBuffer>],
    world: usize,
    dtype: DType,
    len: usize,
) -> Result<(), BackendError> {
    for (c, per_rank) in inputs.iter().enumerate() {
        if per_rank.len() != world {
            return Err(BackendError::Unavailable(format!(
                "queued call {c} has inputs for {} ranks, the call has {world}",
                per_rank.len()
            )));
        }
        for (r, buf) in per_rank.iter().enumerate() {
            if buf.dtype() != dtype || buf.len() != len {
                return Err(BackendError::Unavailable(format!(
                    "queued call {c}, rank {r}: input of {} {} elements, the call takes {len} {dtype}",
                    buf.len(),
                    buf.dtype()
                )));
            }
        }
    }
    Ok(())
}

/// Wall-clock time of one call on each rank, from a common start.
#[derive(Debug, Clone, PartialEq)]
pub struct CallTiming {
    pub per_rank: Vec<Duration>,
}

impl CallTiming {
    /// The call takes as long as its slowest rank.
    pub fn slowest(&self) -> Duration {
        self.per_rank.iter().copied().max().unwrap_or_default()
    }
}

/// A plan bound to a backend's memory: symmetric buffers allocated, signal bases tracked.
pub trait PreparedCall {
    /// Host view of rank `rank`'s input, to fill before [`PreparedCall::upload`].
    fn input_mut(&mut self, rank: usize) -> HostSliceMut<'_>;
    /// Host view of rank `rank`'s output, to poison before [`PreparedCall::upload`].
    fn output_mut(&mut self, rank: usize) -> HostSliceMut<'_>;
    /// Makes the host views the device's contents.
    fn upload(&mut self) -> Result<(), BackendError>;
    /// Runs one call of the plan on every rank.
    fn run(&mut self) -> Result<CallTiming, BackendError>;
    /// Runs `iters` calls back to back and times each (a backend may queue them all before
    /// waiting, as nccl-tests does, so that launch gaps do not count).
    fn run_many(&mut self, iters: usize) -> Result<Vec<CallTiming>, BackendError> {
        (0..iters).map(|_| self.run()).collect()
    }
    /// Like `run_many`, but through a captured graph where the backend has them (every call
    /// then gets the batch's mean time): launch overhead is left out the same way for us and
    /// for the baselines.
    fn run_graph(&mut self, iters: usize) -> Result<Vec<CallTiming>, BackendError> {
        self.run_many(iters)
    }
    /// Runs `inputs.len()` calls queued back to back, as a training or serving step issues
    /// them: before call `c` each rank's own stream (or thread) replaces its input with
    /// `inputs[c][rank]` and poisons its output; after the call it copies the output aside.
    /// Nothing waits for the other ranks between calls (no host synchronisation, no barrier),
    /// so a plan that lets a peer still read an input being replaced, or write an output its
    /// owner has not finished with, gives wrong results. Returns `outputs[c][rank]`.
    fn run_queued(
        &mut self,
        inputs: &[Vec<HostBuffer>],
    ) -> Result<Vec<Vec<HostBuffer>>, BackendError>;
    /// Whether [`PreparedCall::run_graph`] replays captured graphs (otherwise it launches call
    /// by call, and a table must say so beside graph-timed rows).
    fn replays_graphs(&self) -> bool {
        false
    }
    /// Makes the device's contents visible through the host views.
    fn download(&mut self) -> Result<(), BackendError>;
    fn input(&self, rank: usize) -> HostSlice<'_>;
    fn output(&self, rank: usize) -> HostSlice<'_>;
}

/// How many signal slots a backend's pad offers each rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadCapacity {
    /// A rows × cols grid, addressed as the plan addresses it (the simulator).
    Shape { rows: u32, cols: u32 },
    /// Flat slots, the plan's grid laid out row by row (the GPU lanes).
    Slots(usize),
}

/// Refuses a plan made for another world size or needing more signal slots than the pad has.
pub fn ensure_fits(plan: &CheckedPlan, world: usize, pad: PadCapacity) -> Result<(), BackendError> {
    let p = plan.plan();
    if p.world() != world {
        return Err(BackendError::Unavailable(format!(
            "the plan is for {} ranks, the backend has {world}",
            p.world()
        )));
    }
    let (fits, has) = match pad {
        PadCapacity::Shape { rows, cols } => (
            p.pad_rows <= rows && p.pad_cols <= cols,
            format!("{rows}×{cols}"),
        ),
        PadCapacity::Slots(n) => (
            p.pad_rows as usize * p.pad_cols as usize <= n,
            format!("{n} slots"),
        ),
    };
    if !fits {
        return Err(BackendError::Unavailable(format!(
            "the plan needs a {}×{} signal pad, the backend has {has}",
            p.pad_rows, p.pad_cols
        )));
    }
    Ok(())
}

pub trait Backend {
    fn name(&self) -> &'static str;
    fn world_size(&self) -> usize;
    /// Allocates what `plan` needs for elements of `dtype` reduced with `reduce`.
    fn prepare(
        &self,
        plan: &CheckedPlan,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError>;
    /// Bytes of host memory [`Backend::prepare`] of `plan` allocates (the simulator's buffers
    /// live there; a GPU backend's on its devices), or None where the count overflows: what a
    /// harness adds to its own to know whether a run fits before it starts.
    fn host_bytes(&self, _plan: &CheckedPlan, _dtype: DType) -> Option<u64> {
        Some(0)
    }
    /// [`Backend::host_bytes`] of [`Backend::prepare_baseline`] of `which` for `spec`.
    fn baseline_host_bytes(
        &self,
        _which: Implementation,
        _spec: &OpSpec,
        _dtype: DType,
    ) -> Option<u64> {
        Some(0)
    }
    /// Other implementations of the same op that this backend can run for comparison (NCCL,
    /// the copy engine).
    fn baselines(&self, _op: OpKind) -> Vec<Baseline> {
        Vec::new()
    }
    /// commfuse's own implementations of `op` beyond the plans (the LL protocol): prepared like
    /// baselines, with [`Backend::prepare_baseline`], and benched as ours.
    fn protocols(&self, _op: OpKind) -> Vec<Protocol> {
        Vec::new()
    }
    /// The protocol (one of [`Backend::protocols`]) this backend's operators run for `spec`
    /// when the caller leaves the choice to `auto`, instead of the cost model's plan; None where
    /// they run the plan.
    fn auto_protocol(&self, _spec: &OpSpec, _elem_bytes: usize) -> Option<Protocol> {
        None
    }
    /// Whether this backend runs `which` for `op`: every plan of the op, and the protocols and
    /// baselines it lists.
    fn offers(&self, op: OpKind, which: Implementation) -> bool {
        match which {
            Implementation::Plan(algo) => crate::Algo::for_op(op).contains(&algo),
            Implementation::Protocol(p) => self.protocols(op).contains(&p),
            Implementation::Baseline(b) => self.baselines(op).contains(&b),
        }
    }
    /// Prepares baseline (or protocol, see [`Backend::protocols`]) `which` for `spec`; its
    /// inputs and outputs follow the op's definition, so the same reference checks it. A plan
    /// is prepared from its checked plan, with [`Backend::prepare`], not here.
    fn prepare_baseline(
        &self,
        which: Implementation,
        _spec: &OpSpec,
        _dtype: DType,
        _reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        Err(BackendError::Unavailable(format!(
            "the {} backend has no baseline '{which}'",
            self.name()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{build_plan, check, Algo, OpKind, OpSpec, Topology};

    #[test]
    fn plans_that_do_not_fit_are_refused() {
        let spec = OpSpec::new(OpKind::AllReduce, 4, 100, 0).unwrap();
        let plan =
            check(build_plan(spec, Algo::Ring, &Topology::new(4, 1).unwrap()).unwrap()).unwrap();
        let (rows, cols) = (plan.plan().pad_rows, plan.plan().pad_cols);
        ensure_fits(&plan, 4, PadCapacity::Shape { rows, cols }).unwrap();
        ensure_fits(&plan, 4, PadCapacity::Slots((rows * cols) as usize)).unwrap();
        let err = ensure_fits(&plan, 2, PadCapacity::Slots(1 << 20)).unwrap_err();
        assert!(err
            .to_string()
            .contains("the plan is for 4 ranks, the backend has 2"));
        let err = ensure_fits(
            &plan,
            4,
            PadCapacity::Shape {
                rows,
                cols: cols - 1,
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("signal pad"), "{err}");
        assert!(ensure_fits(&plan, 4, PadCapacity::Slots((rows * cols) as usize - 1)).is_err());
    }

    #[test]
    fn queued_inputs_of_the_wrong_shape_are_refused() {
        let ok = vec![vec![HostBuffer::zeroed(DType::BF16, 5); 3]; 2];
        check_queued_inputs(&ok, 3, DType::BF16, 5).unwrap();
        let err = check_queued_inputs(&ok, 4, DType::BF16, 5).unwrap_err();
        assert!(err.to_string().contains("inputs for 3 ranks"), "{err}");
        let err = check_queued_inputs(&ok, 3, DType::F32, 5).unwrap_err();
        assert!(err.to_string().contains("call 0, rank 0"), "{err}");
        let err = check_queued_inputs(&ok, 3, DType::BF16, 6).unwrap_err();
        assert!(err.to_string().contains("5 bf16 elements"), "{err}");
    }
}
