//! Collectives as operator objects on GPUs: built once on a [`CudaBackend`] for (op, element
//! count, algorithm or `auto`, element type, reduce op), then called by each rank on the
//! caller's device buffers and stream — the form NCCL's calls and `torch.distributed`'s
//! collectives have, over the same checked plans and plan kernel the harness runs.
//!
//! A rank's call queues on the caller's stream: a copy of the caller's input into the rank's
//! symmetric input buffer, the rank's plan kernel, a copy of the rank's symmetric output into
//! the caller's output — or, where `auto` takes the LL protocol (small all-reduces,
//! reduce-scatters and all-gathers, `commfuse_core::cost::prefers_ll`), one LL kernel straight
//! from the caller's input into its output. Nothing synchronises the host; the plan kernel advances its epoch bases
//! itself, so calls go back to back with nothing cleared. Every rank must make the same calls
//! in the same order (as with NCCL), and one backend's operators share its signal pads, so
//! they too must be called in one agreed order.
//!
//! Its GPU test is `tests/gpu_collective.rs`; the simulator's twin
//! (`commfuse_sim::collective::SimCollective`) is checked in CI.
//!
//! Beside it: [`rank`], one rank's collective for groups of one process per GPU, over the same
//! plans and plan kernel; [`ll`] (`ll.cu`), the LL protocol both take for small messages; and
//! [`ce`] (`ce.cu`), the copy-engine protocol, which the backend runs beside the plans and NCCL
//! in the collectives' bench.

pub mod ce;
pub mod ll;
pub mod rank;

use crate::backend::call::RankBuffers;
use crate::backend::{CudaBackend, PlanLauncher};
use crate::collective::ll::LlRank;
use crate::error::CudaError;
use crate::sys::driver::{Event, Stream};
use commfuse_core::backend::BackendError;
use commfuse_core::cost::{choose_algo, prefers_ll};
use commfuse_core::{
    build_plan, check, Algo, CheckedPlan, DType, OpKind, OpSpec, ReduceOp, Topology,
};
use std::mem::ManuallyDrop;
use std::time::Duration;

/// How long dropping an operator waits for its last calls before it leaks their memory.
const DROP_WAIT: Duration = Duration::from_secs(30);

/// The algorithm and checked plan of `spec`: `algo`'s, or what `auto` chooses. An algorithm
/// that cannot run on this world size fails with [`BackendError::NotForWorld`], anything else
/// with [`BackendError::Unavailable`].
fn plan_for(
    spec: OpSpec,
    algo: Option<Algo>,
    topology: &Topology,
    dtype: DType,
) -> Result<(Algo, CheckedPlan), BackendError> {
    match algo {
        Some(algo) => {
            let plan = build_plan(spec, algo, topology)?;
            let checked = check(plan).map_err(|e| BackendError::Unavailable(e.to_string()))?;
            Ok((algo, checked))
        }
        None => {
            let choice = choose_algo(spec, topology, dtype.size())?;
            Ok((choice.algo, choice.plan))
        }
    }
}

/// One collective for every rank of a backend.
pub struct CudaCollective<'b> {
    backend: &'b CudaBackend,
    spec: OpSpec,
    algo: Algo,
    dtype: DType,
    /// After each rank's last call (so that dropping waits for it)
    last: Vec<Event>,
    // freed by hand in Drop, once the last calls have ended
    launcher: ManuallyDrop<PlanLauncher>,
    bufs: ManuallyDrop<Vec<RankBuffers>>,
    /// Every rank's LL kernel and buffers, where `auto` took the LL protocol
    ll: ManuallyDrop<Option<Vec<LlRank>>>,
}

impl<'b> CudaCollective<'b> {
    /// `kind` of `count` elements of `dtype` (as [`OpSpec`] counts them) on every GPU of
    /// `backend`, by `algo` or, with `None`, the algorithm the cost model picks; `root` for
    /// broadcast, `numa_groups` for the topology the plan is built on.
    pub fn new(
        backend: &'b CudaBackend,
        kind: OpKind,
        count: usize,
        dtype: DType,
        (algo, reduce, root, numa_groups): (Option<Algo>, ReduceOp, usize, usize),
    ) -> Result<CudaCollective<'b>, BackendError> {
        backend.check_usable()?;
        let p = backend.ranks.len();
        let spec = OpSpec::new(kind, p, count, root)?;
        let topology = Topology::new(p, numa_groups)?;
        let algo_asked = algo;
        let (algo, plan) = plan_for(spec, algo, &topology, dtype)?;
        crate::backend::gpus::ensure_plan_fits(backend, &plan)?;
        let b = plan.plan().buffers;
        let eb = dtype.size();
        let bufs = backend
            .ranks
            .iter()
            .map(|rank| RankBuffers::new(&rank.gpu, b.input * eb, b.output * eb, b.scratch * eb))
            .collect::<Result<Vec<_>, _>>()?;
        let launcher = PlanLauncher::new(backend, &plan, dtype, reduce, &bufs)?;
        // the plan stays built where LL runs: it is what `algo()` reports, and it is small
        let ll = if algo_asked.is_none() && prefers_ll(&spec, eb) {
            let lines = crate::collective::ll::Lines::Eight;
            Some(crate::collective::ll::ranks(
                backend,
                &spec,
                (dtype, reduce),
                lines,
            )?)
        } else {
            None
        };
        let last = backend
            .ranks
            .iter()
            .map(|rank| Event::new_untimed(&rank.gpu))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CudaCollective {
            backend,
            spec,
            algo,
            dtype,
            last,
            launcher: ManuallyDrop::new(launcher),
            bufs: ManuallyDrop::new(bufs),
            ll: ManuallyDrop::new(ll),
        })
    }

    /// The algorithm of the plan the operator is built on (what `auto` picked, when it did).
    pub fn algo(&self) -> Algo {
        self.algo
    }

    /// What runs: "ll" where `auto` took the LL protocol, else the plan's algorithm.
    pub fn implementation(&self) -> String {
        if self.ll.is_some() {
            commfuse_core::Protocol::Ll.name().into()
        } else {
            self.algo.to_string()
        }
    }

    /// What the operator computes.
    pub fn spec(&self) -> &OpSpec {
        &self.spec
    }

    /// Queues rank `r`'s call on `stream`: `input` (`spec().input_len(r)` elements of the
    /// operator's type) into `output` (`spec().output_len(r)` elements). Returns once queued.
    ///
    /// # Safety
    /// `stream` must be a stream of rank r's GPU; `input` and `output` device memory of that GPU
    /// of those sizes, valid until the call completes on `stream`.
    pub unsafe fn forward(
        &self,
        r: usize,
        stream: &Stream,
        input: u64,
        output: u64,
    ) -> Result<(), BackendError> {
        let p = self.backend.ranks.len();
        if r >= p {
            return Err(BackendError::Unavailable(format!(
                "rank {r} is not part of this {}-rank operator",
                p
            )));
        }
        self.backend.check_usable()?;
        let rank = &self.backend.ranks[r];
        rank.gpu.bind()?;
        let eb = self.dtype.size();
        let bufs = &self.bufs[r];
        let queued = (|| -> Result<(), CudaError> {
            // after this rank's previous call, even one on another stream
            stream.wait_event(&self.last[r])?;
            if let Some(ll) = self.ll.as_ref() {
                // straight from the caller's input into its output
                return ll[r].launch(stream, input, output);
            }
            stream.copy_async(bufs.input.addr(), input, self.spec.input_len(r) * eb)?;
            self.launcher.launch_on(self.backend, r, stream)?;
            stream.copy_async(output, bufs.output.addr(), self.spec.output_len(r) * eb)
        })();
        // recorded in any case: dropping waits for whatever was queued
        let recorded = self.last[r].record(stream);
        if queued.is_err() || recorded.is_err() {
            // this rank's epoch bases may now differ from its peers': nothing on this backend
            // can run consistently any more
            self.backend.mark_broken();
        }
        queued?;
        recorded?;
        Ok(())
    }

    /// After the callers' streams were synchronised: the diagnosis of a wait that timed out in
    /// any call so far (which rank, lane and slot, what it expected and saw), if one did. The
    /// backend is unusable after one.
    pub fn check(&self) -> Result<(), BackendError> {
        let failure = match self.ll.as_ref() {
            Some(ll) => self.backend.recorded_timeout().map(|rec| {
                BackendError::Unavailable(crate::collective::ll::describe_timeout(
                    self.spec.kind,
                    ll[0].lines(),
                    &rec,
                    self.backend.timeout(),
                ))
            }),
            None => self.launcher.failure(self.backend),
        };
        match failure {
            Some(e) => {
                self.backend.mark_broken();
                Err(e)
            }
            None => Ok(()),
        }
    }
}

impl Drop for CudaCollective<'_> {
    fn drop(&mut self) {
        // every rank's last call must have ended before its buffers and tables are freed
        let ended = self.last.iter().all(|e| {
            matches!(
                crate::sys::host_sync::poll_until(DROP_WAIT, || e.is_done()),
                Ok(true)
            )
        });
        if ended {
            // SAFETY: dropped once, here; no call that uses them is running
            unsafe {
                ManuallyDrop::drop(&mut self.launcher);
                ManuallyDrop::drop(&mut self.bufs);
                ManuallyDrop::drop(&mut self.ll);
            }
        } else {
            // leaked: freeing memory a running kernel writes would corrupt what is allocated
            // there next; and the backend must not free its pads and contexts under it either
            self.backend.mark_wedged();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_algorithm_that_does_not_fit_the_world_says_so_by_its_type() {
        let spec = OpSpec::new(OpKind::AllReduce, 3, 100, 0).unwrap();
        let groups = Topology::new(3, 2).unwrap();
        let e = plan_for(spec, Some(Algo::Ring2d), &groups, DType::F32).unwrap_err();
        assert!(
            matches!(&e, BackendError::NotForWorld(why) if why.contains("(3)")),
            "{e:?}"
        );
        // the same algorithm where it fits, and auto, which leaves out what does not
        let flat = Topology::new(3, 1).unwrap();
        let (algo, _) = plan_for(spec, Some(Algo::Ring2d), &flat, DType::F32).unwrap();
        assert_eq!(algo, Algo::Ring2d);
        plan_for(spec, None, &groups, DType::F32).unwrap();
        // an algorithm of another op is a plain failure, not a skip
        let e = plan_for(spec, Some(Algo::AllToAll), &flat, DType::F32).unwrap_err();
        assert!(matches!(e, BackendError::Unavailable(_)), "{e:?}");
    }
}
