//! The CUDA backend: one rank per GPU, every pair of GPUs peer-enabled, symmetric buffers in
//! plain device memory, and the plan kernel (plan.cu, beside this module) launched on every GPU
//! at once by one host thread per GPU.
//!
//! This module is [`CudaBackend`]'s [`Backend`]: checked plans prepared as calls of the plan
//! kernel ([`PlanLauncher`]), the LL and copy-engine protocols ([`crate::collective::ll`],
//! [`crate::collective::ce`]) and the NCCL and copy-engine baselines prepared by name, and the
//! partial and failing runs the GPU tests use. The GPUs and their state are the `gpus` module's,
//! a prepared call and how its batches run the `call` module's, the plan kernel's instances and
//! tables the `plan_kernel` module's, a plan encoded as the tables the kernel reads
//! [`plan_table`]'s, and the baselines the `baselines` module's.

mod baselines;
pub(crate) mod call;
pub(crate) mod gpus;
pub(crate) mod plan_kernel;
pub mod plan_table;

use crate::backend::call::{GpuCall, Issue, Launcher, RankBuffers};
pub use crate::backend::gpus::CudaBackend;
use crate::backend::gpus::Rank;
use crate::backend::plan_kernel::{
    dtype_index, reduce_index, upload_table, DeviceTable, KernelContext, LANE_MIN_BYTES,
    LANE_MIN_COUNT, LANE_TARGET_BYTES, PAD_SLOTS,
};
use crate::backend::plan_table::{BufferAddrs, ErrorRecord, Lanes, PlanArgs, MAX_RANKS, THREADS};
use crate::error::CudaError;
use crate::sys::driver::Stream;
use commfuse_core::backend::{
    ensure_fits, Backend, BackendError, CallTiming, PadCapacity, PreparedCall,
};
use commfuse_core::{
    Baseline, CheckedPlan, DType, Element, Implementation, OpKind, OpSpec, Protocol, ReduceOp,
};
use half::{bf16, f16};
use std::time::Duration;

impl CudaBackend {
    /// Runs one call of `plan` (f32, sum) on the ranks in `which` only. The others never
    /// arrive, so a wait that needs them must end in a timeout naming rank, lane and slot: this
    /// is how the GPU tests exercise the bounded waits. Leaves the backend unusable afterwards.
    pub fn run_partial(
        &self,
        plan: &CheckedPlan,
        which: &[usize],
    ) -> Result<CallTiming, BackendError> {
        self.check_usable()?;
        check_partial(plan, self.ranks.len(), which)?;
        let mut call = plan_call::<f32>(self, plan, ReduceOp::Sum)?;
        Ok(call.run_on(which, 1, Issue::Launches)?.remove(0))
    }
}

impl CudaBackend {
    /// Test support for the error path of a batch: runs one call of `plan` (f32, sum) on every
    /// rank, except that rank `failing` waits `delay` (the others launch meanwhile and wait for
    /// its signals) and then fails its launch. The call must end promptly with that failure:
    /// the abort makes the others' device-side waits give up long before the device timeout,
    /// and every stream drains before anything is freed. Leaves the backend unusable.
    #[doc(hidden)]
    pub fn run_with_failed_launch(
        &self,
        plan: &CheckedPlan,
        failing: usize,
        delay: Duration,
    ) -> Result<CallTiming, BackendError> {
        self.check_usable()?;
        let all: Vec<usize> = (0..self.ranks.len()).collect();
        check_partial(plan, self.ranks.len(), &all)?;
        let b = plan.plan().buffers;
        let mut call = GpuCall::<f32, _>::new(self, (b.input, b.output, b.scratch), |bufs| {
            Ok(FailingLaunch {
                inner: PlanLauncher::new(self, plan, DType::F32, ReduceOp::Sum, bufs)?,
                failing,
                delay,
            })
        })?;
        Ok(call.run_on(&all, 1, Issue::Launches)?.remove(0))
    }
}

/// A plan launcher whose rank `failing` fails instead of launching (after `delay`).
struct FailingLaunch {
    inner: PlanLauncher,
    failing: usize,
    delay: Duration,
}

impl Launcher for FailingLaunch {
    fn launch(&self, bufs: &[RankBuffers], r: usize, on: &Rank) -> Result<(), BackendError> {
        if r == self.failing {
            std::thread::sleep(self.delay);
            return Err(BackendError::Unavailable(format!(
                "rank {r}: launch failed on purpose"
            )));
        }
        self.inner.launch(bufs, r, on)
    }

    fn records_waits(&self) -> bool {
        self.inner.records_waits()
    }

    fn describe_timeout(&self, backend: &CudaBackend, rec: &ErrorRecord) -> BackendError {
        self.inner.describe_timeout(backend, rec)
    }
}

/// What [`CudaBackend::run_partial`] accepts: a plan that [`ensure_fits`] the backend (as
/// `prepare` demands), and a non-empty set of distinct ranks of it.
fn check_partial(plan: &CheckedPlan, world: usize, which: &[usize]) -> Result<(), BackendError> {
    ensure_fits(plan, world, PadCapacity::Slots(PAD_SLOTS))?;
    if which.is_empty() {
        return Err(BackendError::Unavailable(
            "a partial run needs at least one rank".into(),
        ));
    }
    for (i, &r) in which.iter().enumerate() {
        if r >= world {
            return Err(BackendError::Unavailable(format!(
                "rank {r} is not part of this backend ({world} ranks)"
            )));
        }
        if which[..i].contains(&r) {
            return Err(BackendError::Unavailable(format!(
                "rank {r} is listed twice"
            )));
        }
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn world_size(&self) -> usize {
        self.ranks.len()
    }

    fn prepare(
        &self,
        plan: &CheckedPlan,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        self.check_usable()?;
        ensure_fits(plan, self.ranks.len(), PadCapacity::Slots(PAD_SLOTS))?;
        Ok(match dtype {
            DType::F32 => Box::new(plan_call::<f32>(self, plan, reduce)?),
            DType::BF16 => Box::new(plan_call::<bf16>(self, plan, reduce)?),
            DType::F16 => Box::new(plan_call::<f16>(self, plan, reduce)?),
        })
    }

    fn baselines(&self, op: OpKind) -> Vec<Baseline> {
        Baseline::for_op(op)
    }

    fn auto_protocol(&self, spec: &OpSpec, elem_bytes: usize) -> Option<Protocol> {
        // as CollectiveRank does
        commfuse_core::cost::prefers_ll(spec, elem_bytes).then_some(Protocol::Ll)
    }

    fn protocols(&self, op: OpKind) -> Vec<Protocol> {
        let ll = crate::collective::ll::runs(op).then_some([Protocol::Ll, Protocol::Ll16]);
        let ce = crate::collective::ce::runs(op).then_some(Protocol::Ce);
        ll.into_iter().flatten().chain(ce).collect()
    }

    fn prepare_baseline(
        &self,
        which: Implementation,
        spec: &OpSpec,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        self.check_usable()?;
        match which {
            Implementation::Protocol(p) => match crate::collective::ll::Lines::of_protocol(p) {
                Some(lines) => crate::collective::ll::prepare(self, spec, (dtype, reduce), lines),
                None => crate::collective::ce::prepare(self, spec, dtype, reduce),
            },
            Implementation::Baseline(b) => {
                crate::backend::baselines::prepare(self, b, spec, dtype, reduce)
            }
            Implementation::Plan(algo) => Err(BackendError::Unavailable(format!(
                "{algo} is a plan: prepare its checked plan, not a baseline"
            ))),
        }
    }
}

pub(crate) struct PlanLauncher {
    plan: CheckedPlan,
    /// which kernel: [dtype][reduce op]
    dtype_index: usize,
    reduce_index: usize,
    lanes: Lanes,
    /// per rank: its table (the kernel reads it through `args`)
    _tables: Vec<DeviceTable>,
    args: Vec<PlanArgs>,
}

/// Prepares `plan` for elements of `T`.
fn plan_call<'a, T: Element>(
    backend: &'a CudaBackend,
    plan: &CheckedPlan,
    reduce: ReduceOp,
) -> Result<GpuCall<'a, T, PlanLauncher>, BackendError> {
    let b = plan.plan().buffers;
    GpuCall::new(backend, (b.input, b.output, b.scratch), |bufs| {
        PlanLauncher::new(backend, plan, T::DTYPE, reduce, bufs)
    })
}

impl PlanLauncher {
    pub(crate) fn new(
        backend: &CudaBackend,
        plan: &CheckedPlan,
        dtype: DType,
        reduce: ReduceOp,
        bufs: &[RankBuffers],
    ) -> Result<Self, BackendError> {
        let eb = dtype.size();
        let world = backend.ranks.len();
        let addrs: Vec<BufferAddrs> = bufs
            .iter()
            .map(|b| BufferAddrs {
                input: b.input.addr(),
                output: b.output.addr(),
                scratch: b.scratch.addr(),
            })
            .collect();
        let lanes = plan_table::lanes(
            plan,
            eb,
            LANE_TARGET_BYTES,
            LANE_MIN_BYTES,
            LANE_MIN_COUNT,
            backend.max_lanes,
        );
        let mut pads = [0u64; MAX_RANKS];
        for (r, rank) in backend.ranks.iter().enumerate() {
            pads[r] = rank.pads.addr();
        }
        let mut tables = Vec::with_capacity(world);
        let mut args = Vec::with_capacity(world);
        for (r, rank) in backend.ranks.iter().enumerate() {
            let context = KernelContext {
                pads,
                bases: rank.bases.addr(),
                error: backend.error.device_addr(),
                lanes,
                timeout: backend.timeout,
            };
            let (table, a) = upload_table(&rank.gpu, plan, r, &addrs, eb, &context)?;
            tables.push(table);
            args.push(a);
        }
        Ok(PlanLauncher {
            plan: plan.clone(),
            dtype_index: dtype_index(dtype),
            reduce_index: reduce_index(reduce),
            lanes,
            _tables: tables,
            args,
        })
    }

    /// Queues rank `r`'s plan kernel on `stream` (a stream of rank r's GPU).
    ///
    /// # Safety
    /// The buffers the tables were built on must outlive the launch.
    pub(crate) unsafe fn launch_on(
        &self,
        backend: &CudaBackend,
        r: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        let f = &backend.ranks[r].kernels[self.dtype_index][self.reduce_index];
        f.launch(self.lanes.count, THREADS, stream, &self.args[r])
    }

    /// The timeout a kernel recorded, if any.
    pub(crate) fn failure(&self, backend: &CudaBackend) -> Option<BackendError> {
        backend
            .recorded_timeout()
            .map(|rec| self.describe_timeout(backend, &rec))
    }
}

impl Launcher for PlanLauncher {
    fn launch(&self, _bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        // rank r's kernel lives in rank r's module (its own context)
        let f = &rank.kernels[self.dtype_index][self.reduce_index];
        // SAFETY: PlanArgs mirrors the kernel's parameter; every address in it belongs to
        // buffers, tables and pads that outlive the launch (the batch synchronizes)
        unsafe { f.launch(self.lanes.count, THREADS, &rank.stream, &self.args[r]) }
            .map_err(BackendError::from)
    }

    fn records_waits(&self) -> bool {
        true
    }

    fn describe_timeout(&self, backend: &CudaBackend, rec: &ErrorRecord) -> BackendError {
        plan_wait_timeout(&self.plan, rec, backend.timeout)
    }
}

/// A plan kernel's recorded timeout, naming the slot and the rank whose notify was awaited.
fn plan_wait_timeout(plan: &CheckedPlan, rec: &ErrorRecord, timeout: Duration) -> BackendError {
    let (slot, from) = rec.plan_slot(plan);
    crate::backend::gpus::wait_timeout(rec, slot, from, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_core::{build_plan, check, Algo, OpKind, OpSpec, Topology};

    fn barrier_plan(world: usize) -> CheckedPlan {
        let spec = OpSpec::new(OpKind::Barrier, world, 0, 0).unwrap();
        check(build_plan(spec, Algo::AllToAll, &Topology::new(world, 1).unwrap()).unwrap()).unwrap()
    }

    /// The backend offers the baselines the NCCL module implements, no more and no fewer.
    #[test]
    fn the_offered_baselines_are_the_nccl_modules() {
        for op in OpKind::ALL {
            let offered: Vec<&str> = Baseline::for_op(op).iter().map(|b| b.name()).collect();
            assert_eq!(offered, crate::sys::nccl::baselines(op), "{op}");
        }
    }

    #[test]
    fn a_plan_timeout_names_the_rank_whose_notify_was_awaited() {
        // in the all-to-all barrier of two ranks, rank 0 waits on (0, 1) for rank 1's notify
        let rec = ErrorRecord {
            flag: 1,
            rank: 0,
            lane: 0,
            slot: 1,
            expected: 1,
            ..Default::default()
        };
        let e = plan_wait_timeout(&barrier_plan(2), &rec, Duration::from_millis(300));
        assert_eq!(
            e.to_string(),
            "timeout after 300 ms on the GPU: rank 0 (lane 0) waits on slot (row 0, col 1) for >= 1 from rank 1 but sees 0"
        );
        // a slot no rank notifies (only a corrupted record names one) names no rank
        let rec = ErrorRecord { slot: 7, ..rec };
        let e = plan_wait_timeout(&barrier_plan(2), &rec, Duration::from_millis(300));
        assert!(e.to_string().contains("for >= 1 but sees 0"), "{e}");
    }

    #[test]
    fn a_partial_run_checks_the_plan_like_prepare() {
        check_partial(&barrier_plan(2), 2, &[0]).unwrap();
        check_partial(&barrier_plan(2), 2, &[1, 0]).unwrap();
        // a plan for three ranks on two GPUs would index a third pad that does not exist
        let e = check_partial(&barrier_plan(3), 2, &[0, 1]).unwrap_err();
        assert_eq!(
            e.to_string(),
            BackendError::Unavailable("the plan is for 3 ranks, the backend has 2".into())
                .to_string()
        );
        let e = check_partial(&barrier_plan(2), 2, &[2]).unwrap_err();
        assert!(e.to_string().contains("rank 2 is not part"), "{e}");
        let e = check_partial(&barrier_plan(2), 2, &[1, 1]).unwrap_err();
        assert!(e.to_string().contains("rank 1 is listed twice"), "{e}");
        assert!(check_partial(&barrier_plan(2), 2, &[]).is_err());
    }
}
