//! A call prepared on the backend's GPUs and how its batches run: every rank's device buffers
//! and their host mirrors; the [`Launcher`] of what one call enqueues on each GPU (the plan
//! kernel, a protocol, a baseline); one host thread per GPU running a batch from a common
//! start, every host wait bounded; the stop of every GPU before anything is freed when a batch
//! fails; and calls queued back to back with new inputs each.

use crate::backend::gpus::{CudaBackend, HostBounds, Rank};
use crate::backend::plan_table::ErrorRecord;
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Event, Gpu, Graph};
use crate::sys::host_sync::{poll_until, BarrierError, StartBarrier};
use commfuse_core::backend::{
    check_queued_inputs, BackendError, CallTiming, HostBuffer, HostSlice, HostSliceMut,
    PreparedCall,
};
use commfuse_core::{DType, Element, Slot};
use half::{bf16, f16};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Per-rank device memory of one prepared call.
pub(crate) struct RankBuffers {
    pub input: DeviceMemory,
    pub output: DeviceMemory,
    pub scratch: DeviceMemory,
}

impl RankBuffers {
    pub fn new(gpu: &Gpu, input: usize, output: usize, scratch: usize) -> Result<Self, CudaError> {
        Ok(RankBuffers {
            input: DeviceMemory::zeroed(gpu, input)?,
            output: DeviceMemory::zeroed(gpu, output)?,
            scratch: DeviceMemory::zeroed(gpu, scratch)?,
        })
    }
}

/// Host mirrors of every rank's input and output.
pub(crate) struct HostMirrors<T> {
    pub input: Vec<Vec<T>>,
    pub output: Vec<Vec<T>>,
}

impl<T: Element> HostMirrors<T> {
    pub fn new(world: usize, input: usize, output: usize) -> Self {
        HostMirrors {
            input: (0..world).map(|_| vec![T::from_f32(0.0); input]).collect(),
            output: (0..world).map(|_| vec![T::from_f32(0.0); output]).collect(),
        }
    }

    pub fn upload(&self, ranks: &[Rank], bufs: &[RankBuffers]) -> Result<(), BackendError> {
        for (r, rank) in ranks.iter().enumerate() {
            bufs[r].input.upload(&rank.gpu, &self.input[r])?;
            bufs[r].output.upload(&rank.gpu, &self.output[r])?;
        }
        Ok(())
    }

    pub fn download(&mut self, ranks: &[Rank], bufs: &[RankBuffers]) -> Result<(), BackendError> {
        for (r, rank) in ranks.iter().enumerate() {
            bufs[r].input.download(&rank.gpu, &mut self.input[r])?;
            bufs[r].output.download(&rank.gpu, &mut self.output[r])?;
        }
        Ok(())
    }
}

/// How a batch of calls is issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Issue {
    /// One launch per call from the host, an event between calls.
    Launches,
    /// The whole batch captured into a graph and replayed once (after one warm replay).
    Graph,
}

/// How a GPU thread of a batch failed: by itself, or because another rank failed first.
enum Failure {
    Cause(BackendError),
    Released(BackendError),
}

impl From<BackendError> for Failure {
    fn from(e: BackendError) -> Self {
        Failure::Cause(e)
    }
}

impl From<CudaError> for Failure {
    fn from(e: CudaError) -> Self {
        Failure::Cause(e.into())
    }
}

impl From<BarrierError> for Failure {
    fn from(e: BarrierError) -> Self {
        let secondary = e.is_secondary();
        let e = BackendError::Unavailable(e.to_string());
        if secondary {
            Failure::Released(e)
        } else {
            Failure::Cause(e)
        }
    }
}

/// What a rank sets up before the start barrier.
enum Prepared {
    /// one event before the first call and one after each
    Launches(Vec<Event>),
    /// the captured batch, and events around its timed replay
    Graph(Graph, Event, Event),
}

/// Waits, bounded, for `event`; past the bound the call is stuck.
fn wait_event(event: &Event, bound: Duration, what: &str) -> Result<(), BackendError> {
    if poll_until(bound, || event.is_done())? {
        return Ok(());
    }
    Err(CudaError::Stalled(format!("{what} still running after {bound:?}")).into())
}

/// Runs `launch(rank)` `iters` times back to back on the streams of the ranks in `which`, one
/// host thread per GPU starting together; returns per-iteration times of those ranks.
///
/// Every host wait is bounded by `bounds`. A rank that fails before the start releases the
/// others at the start barrier with its reason; a rank that fails once kernels may be running
/// calls `abort_device` at once, so that the other GPUs' device-side waits for it give up. The
/// error returned is the first cause (by rank), not a rank released because of it. On an error
/// kernels may still be queued or running: the caller must stop them before freeing anything
/// (see [`CudaBackend::stop`]).
pub(crate) fn timed_iterations(
    ranks: &[Rank],
    which: &[usize],
    iters: usize,
    issue: Issue,
    bounds: HostBounds,
    abort_device: &(dyn Fn() + Sync),
    launch: &(dyn Fn(usize, &Rank) -> Result<(), BackendError> + Sync),
) -> Result<Vec<CallTiming>, BackendError> {
    let start = StartBarrier::new(which, bounds.start);
    let setup = |r: usize, rank: &Rank| -> Result<Prepared, BackendError> {
        rank.gpu.bind()?;
        Ok(match issue {
            Issue::Launches => Prepared::Launches(
                (0..=iters)
                    .map(|_| Event::new(&rank.gpu))
                    .collect::<Result<_, _>>()?,
            ),
            Issue::Graph => {
                let mut failed = None;
                let graph = Graph::capture(&rank.stream, || {
                    for _ in 0..iters {
                        if let Err(e) = launch(r, rank) {
                            failed = Some(e);
                            break;
                        }
                    }
                    Ok(())
                })?;
                if let Some(e) = failed {
                    return Err(e);
                }
                Prepared::Graph(graph, Event::new(&rank.gpu)?, Event::new(&rank.gpu)?)
            }
        })
    };
    let run = |r: usize, rank: &Rank, prepared: Prepared| -> Result<Vec<Duration>, BackendError> {
        let gpu = rank.gpu.ordinal;
        match prepared {
            Prepared::Launches(events) => {
                events[0].record(&rank.stream)?;
                for event in &events[1..] {
                    launch(r, rank)?;
                    event.record(&rank.stream)?;
                }
                // call by call: a bound per call, however long the batch
                for (i, event) in events[1..].iter().enumerate() {
                    let what = format!("rank {r} (GPU {gpu}): call {i} of {iters}");
                    wait_event(event, bounds.call, &what)?;
                }
                events
                    .windows(2)
                    .map(|w| {
                        Ok(Duration::from_secs_f64(
                            w[0].elapsed_ms(&w[1])? as f64 / 1e3,
                        ))
                    })
                    .collect()
            }
            Prepared::Graph(graph, begin, end) => {
                // one warm replay, then the timed one
                graph.launch(&rank.stream)?;
                begin.record(&rank.stream)?;
                graph.launch(&rank.stream)?;
                end.record(&rank.stream)?;
                let what = format!("rank {r} (GPU {gpu}): two replays of {iters} calls");
                let replays = u32::try_from(2 * iters.max(1)).unwrap_or(u32::MAX);
                wait_event(&end, bounds.call.saturating_mul(replays), &what)?;
                let each = begin.elapsed_ms(&end)? as f64 / 1e3 / iters.max(1) as f64;
                Ok(vec![Duration::from_secs_f64(each); iters])
            }
        }
    };
    let per_rank: Vec<Result<Vec<Duration>, Failure>> = std::thread::scope(|s| {
        let handles: Vec<_> = which
            .iter()
            .map(|&r| (r, &ranks[r]))
            .map(|(r, rank)| {
                let (start, setup, run) = (&start, &setup, &run);
                s.spawn(move || -> Result<Vec<Duration>, Failure> {
                    let body = || -> Result<Vec<Duration>, Failure> {
                        // nothing of this rank runs yet: a failure only releases the others
                        let prepared = setup(r, rank).inspect_err(|e| start.abort(r, e))?;
                        start.wait(r)?;
                        // from here this rank's kernels may wait for the others' and theirs
                        // for this one's: make every device-side wait give up
                        run(r, rank, prepared).map_err(|e| {
                            abort_device();
                            Failure::Cause(e)
                        })
                    };
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or_else(
                        |_| {
                            // it may have launched, or may never have arrived: both at once
                            abort_device();
                            start.abort(r, "its thread panicked");
                            Err(Failure::Cause(BackendError::Unavailable(format!(
                                "the thread of rank {r} panicked"
                            ))))
                        },
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Failure::Cause(BackendError::Unavailable(
                        "a GPU thread panicked".into(),
                    )))
                })
            })
            .collect()
    });
    first_cause(per_rank).map(|per_rank| {
        (0..iters)
            .map(|i| CallTiming {
                per_rank: per_rank.iter().map(|t| t[i]).collect(),
            })
            .collect()
    })
}

/// Every rank's result, or the first error that is a cause rather than a consequence.
fn first_cause<T>(per_rank: Vec<Result<T, Failure>>) -> Result<Vec<T>, BackendError> {
    let mut released = None;
    let mut ok = Vec::with_capacity(per_rank.len());
    for result in per_rank {
        match result {
            Ok(t) => ok.push(t),
            Err(Failure::Cause(e)) => return Err(e),
            Err(Failure::Released(e)) => {
                released.get_or_insert(e);
            }
        }
    }
    match released {
        Some(e) => Err(e),
        None => Ok(ok),
    }
}

/// What a prepared call enqueues on each GPU: the plan kernel, or a baseline.
pub(crate) trait Launcher: Sync {
    /// Enqueues one call on `on`'s stream; `bufs` are every rank's buffers of this call.
    fn launch(&self, bufs: &[RankBuffers], rank: usize, on: &Rank) -> Result<(), BackendError>;
    /// Whether the launches may be captured into a graph.
    fn capturable(&self) -> bool {
        true
    }
    /// Whether this launcher's kernels record a wait that gave up in the backend's error record
    /// (the plans', LL's, the copy engines'): the record is then cleared before each batch, and
    /// after it a recorded timeout or a failed batch marks the backend broken — the ranks'
    /// protocol state (pads, counters, epochs) is then apart.
    fn records_waits(&self) -> bool {
        false
    }
    /// What a timeout recorded by this launcher's kernels means, in its words; by default the
    /// record's step and slot name the slot waited for.
    fn describe_timeout(&self, backend: &CudaBackend, rec: &ErrorRecord) -> BackendError {
        crate::backend::gpus::wait_timeout(
            rec,
            Slot::new(rec.step, rec.slot),
            None,
            backend.timeout,
        )
    }
    /// Runs before a batch; a backend left unusable by a failed batch refuses it.
    fn before(&self, backend: &CudaBackend) -> Result<(), BackendError> {
        if self.records_waits() {
            backend.before_recorded_batch()
        } else {
            backend.check_usable()
        }
    }
    /// Sees the batch's outcome.
    fn after(
        &self,
        backend: &CudaBackend,
        result: Result<Vec<CallTiming>, BackendError>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        if !self.records_waits() {
            return result;
        }
        let failure = backend
            .recorded_timeout()
            .map(|rec| self.describe_timeout(backend, &rec));
        backend.after_recorded_batch(failure, result)
    }
}

/// Enqueues work around one launch: `(rank index, rank, the launch)`.
pub(crate) type AroundLaunch<'a> = dyn Fn(usize, &Rank, &dyn Fn() -> Result<(), BackendError>) -> Result<(), BackendError>
    + Sync
    + 'a;

/// A call prepared on the GPUs: device buffers, their host mirrors, and what to launch.
/// `bufs` and `launcher` (which owns the kernels' tables) are dropped by hand: if a kernel that
/// uses them could not be stopped (the backend is wedged), they are leaked instead of freed.
pub(crate) struct GpuCall<'a, T: Element, L: Launcher> {
    pub backend: &'a CudaBackend,
    pub bufs: ManuallyDrop<Vec<RankBuffers>>,
    pub host: HostMirrors<T>,
    pub launcher: ManuallyDrop<L>,
}

impl<T: Element, L: Launcher> Drop for GpuCall<'_, T, L> {
    fn drop(&mut self) {
        if self.backend.is_wedged() {
            return;
        }
        // SAFETY: dropped once, here; every batch returned with its kernels finished or stopped
        unsafe {
            ManuallyDrop::drop(&mut self.launcher);
            ManuallyDrop::drop(&mut self.bufs);
        }
    }
}

/// Stops the batch's kernels (see [`CudaBackend::stop`]) unless disarmed: the one way out of a
/// batch that did not finish, also when unwinding.
struct StopGuard<'a> {
    backend: Option<&'a CudaBackend>,
}

impl<'a> StopGuard<'a> {
    fn arm(backend: &'a CudaBackend) -> Self {
        StopGuard {
            backend: Some(backend),
        }
    }

    /// The batch finished: every stream is idle, nothing to stop.
    fn disarm(mut self) {
        self.backend = None;
    }

    /// Stops now; returns `cause`, with the stop's own failure appended if it had one.
    fn stop(mut self, cause: BackendError) -> BackendError {
        match self.backend.take().map(CudaBackend::stop) {
            Some(Err(stuck)) => BackendError::Unavailable(format!("{cause}; then {stuck}")),
            _ => cause,
        }
    }
}

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        if let Some(backend) = self.backend.take() {
            // the outcome is kept in the backend (broken, or wedged)
            let _ = backend.stop();
        }
    }
}

/// A [`GpuCall`] of `dtype` elements, boxed as a [`PreparedCall`]: the one place the element
/// type is chosen for launchers that serve every type (LL, the copy engines, NCCL).
pub(crate) fn boxed_call<'a, L: Launcher + 'a>(
    backend: &'a CudaBackend,
    dtype: DType,
    sizes: (usize, usize, usize),
    launcher: impl FnOnce(&[RankBuffers]) -> Result<L, BackendError>,
) -> Result<Box<dyn PreparedCall + 'a>, BackendError> {
    Ok(match dtype {
        DType::F32 => Box::new(GpuCall::<f32, _>::new(backend, sizes, launcher)?),
        DType::BF16 => Box::new(GpuCall::<bf16, _>::new(backend, sizes, launcher)?),
        DType::F16 => Box::new(GpuCall::<f16, _>::new(backend, sizes, launcher)?),
    })
}

impl<'a, T: Element, L: Launcher> GpuCall<'a, T, L> {
    /// Allocates `input`, `output` and `scratch` elements on every GPU.
    pub fn new(
        backend: &'a CudaBackend,
        (input, output, scratch): (usize, usize, usize),
        launcher: impl FnOnce(&[RankBuffers]) -> Result<L, BackendError>,
    ) -> Result<Self, BackendError> {
        let eb = std::mem::size_of::<T>();
        let bufs = backend
            .ranks
            .iter()
            .map(|r| RankBuffers::new(&r.gpu, input * eb, output * eb, scratch * eb))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GpuCall {
            launcher: ManuallyDrop::new(launcher(&bufs)?),
            backend,
            host: HostMirrors::new(backend.ranks.len(), input, output),
            bufs: ManuallyDrop::new(bufs),
        })
    }

    fn run_issued(&mut self, iters: usize, issue: Issue) -> Result<Vec<CallTiming>, BackendError> {
        let issue = if self.launcher.capturable() {
            issue
        } else {
            Issue::Launches
        };
        let all: Vec<usize> = (0..self.backend.ranks.len()).collect();
        self.run_on(&all, iters, issue)
    }

    /// Runs a batch on the ranks in `which` only.
    pub(crate) fn run_on(
        &mut self,
        which: &[usize],
        iters: usize,
        issue: Issue,
    ) -> Result<Vec<CallTiming>, BackendError> {
        self.run_wrapped(which, iters, issue, &|r, rank, launch| {
            let _ = (r, rank);
            launch()
        })
    }

    /// Runs a batch on the ranks in `which`, each launch enqueued through `around(rank index,
    /// rank, launch)` so that work can be queued before and after it on the same stream (new
    /// inputs, outputs set aside); errors stop every GPU before anything is freed.
    pub(crate) fn run_wrapped(
        &mut self,
        which: &[usize],
        iters: usize,
        issue: Issue,
        around: &AroundLaunch<'_>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        let backend = self.backend;
        self.launcher.before(backend)?;
        let (launcher, bufs): (&L, &[RankBuffers]) = (&self.launcher, &self.bufs);
        let guard = StopGuard::arm(backend);
        let result = timed_iterations(
            &backend.ranks,
            which,
            iters,
            issue,
            backend.host_bounds(),
            &|| backend.error.raise_abort(),
            &|r, rank| around(r, rank, &|| launcher.launch(bufs, r, rank)),
        );
        let result = match result {
            Ok(timings) => {
                guard.disarm();
                Ok(timings)
            }
            Err(cause) => Err(guard.stop(cause)),
        };
        self.launcher.after(backend, result)
    }
}

impl<T: Element, L: Launcher> PreparedCall for GpuCall<'_, T, L> {
    fn input_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
        T::host_mut(&mut self.host.input[rank])
    }

    fn output_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
        T::host_mut(&mut self.host.output[rank])
    }

    fn upload(&mut self) -> Result<(), BackendError> {
        self.host.upload(&self.backend.ranks, &self.bufs)
    }

    fn run(&mut self) -> Result<CallTiming, BackendError> {
        Ok(self.run_many(1)?.remove(0))
    }

    fn run_many(&mut self, iters: usize) -> Result<Vec<CallTiming>, BackendError> {
        self.run_issued(iters, Issue::Launches)
    }

    fn run_graph(&mut self, iters: usize) -> Result<Vec<CallTiming>, BackendError> {
        self.run_issued(iters, Issue::Graph)
    }

    fn run_queued(
        &mut self,
        inputs: &[Vec<HostBuffer>],
    ) -> Result<Vec<Vec<HostBuffer>>, BackendError> {
        run_queued(self, inputs)
    }

    fn replays_graphs(&self) -> bool {
        self.launcher.capturable()
    }

    fn download(&mut self) -> Result<(), BackendError> {
        self.host.download(&self.backend.ranks, &self.bufs)
    }

    fn input(&self, rank: usize) -> HostSlice<'_> {
        T::host(&self.host.input[rank])
    }

    fn output(&self, rank: usize) -> HostSlice<'_> {
        T::host(&self.host.output[rank])
    }
}

/// Byte written over every output before each call: NaN in f32, bf16 and f16 alike.
const POISON_BYTE: u8 = 0xff;

/// Runs `inputs.len()` queued calls of `call` (see `PreparedCall::run_queued`) back to back on
/// every GPU's stream with new inputs each, the way a training step issues them: per call, each
/// stream copies the call's input into place, poisons the output, launches, and copies the
/// output aside — no host synchronisation in between, so only the plan's own signals keep one
/// GPU's call from running into its peers' previous or next one.
pub(crate) fn run_queued<T: Element, L: Launcher>(
    call: &mut GpuCall<'_, T, L>,
    inputs: &[Vec<HostBuffer>],
) -> Result<Vec<Vec<HostBuffer>>, BackendError> {
    let backend = call.backend;
    let ranks = &backend.ranks;
    let (in_len, out_len) = (call.host.input[0].len(), call.host.output[0].len());
    check_queued_inputs(inputs, ranks.len(), T::DTYPE, in_len)?;
    let calls = inputs.len();
    if calls == 0 {
        return Ok(Vec::new());
    }
    let eb = std::mem::size_of::<T>();
    let (in_bytes, out_bytes) = (in_len * eb, out_len * eb);
    // every call's inputs side by side on each GPU, and room for every call's outputs
    let mut staged_in = Vec::with_capacity(ranks.len());
    let mut staged_out = Vec::with_capacity(ranks.len());
    for (r, rank) in ranks.iter().enumerate() {
        let host: Vec<T> = inputs
            .iter()
            .flat_map(|c| T::from_host(c[r].as_slice()).expect("dtype checked").iter())
            .copied()
            .collect();
        let mem = DeviceMemory::zeroed(&rank.gpu, calls * in_bytes)?;
        mem.upload(&rank.gpu, &host)?;
        staged_in.push(mem);
        staged_out.push(DeviceMemory::zeroed(&rank.gpu, calls * out_bytes)?);
    }
    let next_call: Vec<AtomicUsize> = ranks.iter().map(|_| AtomicUsize::new(0)).collect();
    let bufs: Vec<(u64, u64)> = call
        .bufs
        .iter()
        .map(|b| (b.input.addr(), b.output.addr()))
        .collect();
    let all: Vec<usize> = (0..ranks.len()).collect();
    call.run_wrapped(&all, calls, Issue::Launches, &|r, rank, launch| {
        let c = next_call[r].fetch_add(1, Ordering::Relaxed);
        let (input, output) = bufs[r];
        // SAFETY: staging and call buffers are sized above for `calls` calls and outlive the
        // batch (it synchronises every stream, or stops every GPU, before returning)
        unsafe {
            rank.stream
                .copy_async(input, staged_in[r].addr() + (c * in_bytes) as u64, in_bytes)?;
            rank.stream.fill_async(output, POISON_BYTE, out_bytes)?;
        }
        launch()?;
        // SAFETY: as above
        unsafe {
            rank.stream.copy_async(
                staged_out[r].addr() + (c * out_bytes) as u64,
                output,
                out_bytes,
            )?;
        }
        Ok(())
    })?;
    let mut outputs: Vec<Vec<HostBuffer>> = (0..calls).map(|_| Vec::new()).collect();
    for (r, rank) in ranks.iter().enumerate() {
        let mut host = vec![T::from_f32(0.0); calls * out_len];
        staged_out[r].download(&rank.gpu, &mut host)?;
        for (c, out) in outputs.iter_mut().enumerate() {
            out.push(T::into_host_buffer(
                host[c * out_len..(c + 1) * out_len].to_vec(),
            ));
        }
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_reports_its_first_cause_not_the_ranks_it_released() {
        let released = |r: usize| {
            Err(Failure::Released(BackendError::Unavailable(format!(
                "released by {r}"
            ))))
        };
        let cause = Err(Failure::Cause(BackendError::Unavailable("cause".into())));
        let e = first_cause::<()>(vec![released(2), cause, released(2)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            BackendError::Unavailable("cause".into()).to_string()
        );
        // with only released ranks (cannot happen, but must not pass as success)
        assert!(first_cause::<()>(vec![Ok(()), released(0)]).is_err());
        assert_eq!(first_cause(vec![Ok(1), Ok(2)]).unwrap(), vec![1, 2]);
    }
}
