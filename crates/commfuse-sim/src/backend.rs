//! The simulator as a [`Backend`].

use crate::buffer::SymmetricBuffer;
use crate::executor::{run_rank, CallBuffers};
use crate::memory::Footprint;
use crate::world::{World, WorldConfig};
use commfuse_core::backend::{
    check_queued_inputs, ensure_fits, Backend, BackendError, CallTiming, HostBuffer, HostSlice,
    HostSliceMut, PadCapacity, PreparedCall,
};
use commfuse_core::{CheckedPlan, DType, Element, OpKind, OpSpec, ReduceOp};
use commfuse_core::{Implementation, Protocol};
use half::{bf16, f16};
use std::time::Instant;

pub struct SimBackend {
    world: World,
}

impl SimBackend {
    pub fn new(ranks: usize, config: WorldConfig) -> Result<Self, BackendError> {
        Ok(SimBackend {
            world: World::new(ranks, config)?,
        })
    }

    pub fn world(&self) -> &World {
        &self.world
    }
}

/// What `prepare` of `plan` allocates: every rank's input, output and scratch.
fn plan_memory(plan: &CheckedPlan, dtype: DType) -> Footprint {
    let p = plan.plan();
    let b = &p.buffers;
    let what = format!(
        "{} of {} {dtype} elements on {} ranks (sim)",
        p.spec.kind,
        p.spec.count,
        p.world()
    );
    Footprint::new(what)
        .item(&[p.world(), b.input, dtype.size()])
        .item(&[p.world(), b.output, dtype.size()])
        .item(&[p.world(), b.scratch, dtype.size()])
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn world_size(&self) -> usize {
        self.world.size()
    }

    fn prepare(
        &self,
        plan: &CheckedPlan,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        let pad = PadCapacity::Shape {
            rows: self.world.plan_rows(),
            cols: self.world.pad(0).cols(),
        };
        ensure_fits(plan, self.world.size(), pad)?;
        plan_memory(plan, dtype).check()?;
        Ok(match dtype {
            DType::F32 => Box::new(SimCall::<f32>::new(self, plan, reduce)?),
            DType::BF16 => Box::new(SimCall::<bf16>::new(self, plan, reduce)?),
            DType::F16 => Box::new(SimCall::<f16>::new(self, plan, reduce)?),
        })
    }

    fn host_bytes(&self, plan: &CheckedPlan, dtype: DType) -> Option<u64> {
        plan_memory(plan, dtype).bytes()
    }

    fn baseline_host_bytes(
        &self,
        which: Implementation,
        spec: &OpSpec,
        dtype: DType,
    ) -> Option<u64> {
        if which == Implementation::Protocol(Protocol::Ll) {
            crate::ll::SimLlCall::memory(self.world.size(), spec, dtype).bytes()
        } else {
            Some(0)
        }
    }

    fn protocols(&self, op: OpKind) -> Vec<Protocol> {
        // the simulator's twin of the LL kernels; LL16 and the copy engine are GPU-only
        match op {
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather => vec![Protocol::Ll],
            _ => Vec::new(),
        }
    }

    fn prepare_baseline(
        &self,
        which: Implementation,
        spec: &OpSpec,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        if which != Implementation::Protocol(Protocol::Ll) {
            return Err(BackendError::Unavailable(format!(
                "the sim backend has no baseline '{which}'"
            )));
        }
        Ok(Box::new(crate::ll::SimLlCall::new(
            &self.world,
            spec,
            dtype,
            reduce,
        )?))
    }
}

struct SimCall<'a, T: Element> {
    world: &'a World,
    plan: CheckedPlan,
    reduce: ReduceOp,
    bufs: CallBuffers<T>,
}

impl<'a, T: Element> SimCall<'a, T> {
    fn new(
        backend: &'a SimBackend,
        plan: &CheckedPlan,
        reduce: ReduceOp,
    ) -> Result<Self, BackendError> {
        let world = &backend.world;
        let b = plan.plan().buffers;
        Ok(SimCall {
            world,
            plan: plan.clone(),
            reduce,
            bufs: CallBuffers {
                input: SymmetricBuffer::new(world.size(), b.input)?,
                output: SymmetricBuffer::new(world.size(), b.output)?,
                scratch: SymmetricBuffer::new(world.size(), b.scratch)?,
            },
        })
    }
}

impl<T: Element> PreparedCall for SimCall<'_, T> {
    fn input_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
        T::host_mut(self.bufs.input.local_mut(rank))
    }

    fn output_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
        T::host_mut(self.bufs.output.local_mut(rank))
    }

    fn upload(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn run(&mut self) -> Result<CallTiming, BackendError> {
        let gate = std::sync::Barrier::new(self.world.size());
        let (plan, bufs, reduce) = (&self.plan, &self.bufs, self.reduce);
        let per_rank = self.world.run(|ctx| {
            gate.wait();
            let start = Instant::now();
            run_rank(ctx, plan, bufs, reduce)?;
            Ok(start.elapsed())
        })?;
        Ok(CallTiming { per_rank })
    }

    fn run_queued(
        &mut self,
        inputs: &[Vec<HostBuffer>],
    ) -> Result<Vec<Vec<HostBuffer>>, BackendError> {
        let b = self.plan.plan().buffers;
        check_queued_inputs(inputs, self.world.size(), T::DTYPE, b.input)?;
        let (plan, bufs, reduce) = (&self.plan, &self.bufs, self.reduce);
        // every rank thread runs all its calls without waiting for the others in between, as a
        // GPU stream would: only the plan's own signals order one rank against another
        let per_rank: Vec<Vec<Vec<T>>> = self.world.run(|ctx| {
            let r = ctx.rank();
            let mut outputs = Vec::with_capacity(inputs.len());
            for call in inputs {
                let input = T::from_host(call[r].as_slice()).expect("dtype checked");
                let mut output = vec![T::poison(); b.output];
                // SAFETY: rank r's own input and output, written and read by rank r between its
                // calls; the checked plan orders every peer access to them after r enters the
                // call that uses them and before r leaves it (the checker models these host
                // accesses at every call boundary)
                unsafe {
                    bufs.input.store(r, 0, input);
                    bufs.output.store(r, 0, &output);
                }
                run_rank(ctx, plan, bufs, reduce)?;
                // SAFETY: as above
                unsafe { bufs.output.load(r, 0, &mut output) };
                outputs.push(output);
            }
            Ok(outputs)
        })?;
        Ok(transpose_calls(per_rank))
    }

    fn download(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn input(&self, rank: usize) -> HostSlice<'_> {
        T::host(self.bufs.input.view(rank))
    }

    fn output(&self, rank: usize) -> HostSlice<'_> {
        T::host(self.bufs.output.view(rank))
    }
}

/// `per_rank[rank][call]` → `[call][rank]`, as host buffers.
fn transpose_calls<T: Element>(per_rank: Vec<Vec<Vec<T>>>) -> Vec<Vec<HostBuffer>> {
    let calls = per_rank.first().map_or(0, Vec::len);
    let mut by_call: Vec<Vec<HostBuffer>> = (0..calls).map(|_| Vec::new()).collect();
    for outputs in per_rank {
        for (c, out) in outputs.into_iter().enumerate() {
            by_call[c].push(T::into_host_buffer(out));
        }
    }
    by_call
}
