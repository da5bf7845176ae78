//! The CUDA backend: one rank per GPU, every pair of GPUs peer-enabled, symmetric buffers in
//! plain device memory, and the plan kernel (kernels/plan.cu) launched on every GPU at once by
//! one host thread per GPU.

use crate::driver::{DeviceMemory, Event, Function, Gpu, Graph, MappedHost, Module, Stream};
use crate::error::CudaError;
use crate::host_sync::{poll_until, BarrierError, StartBarrier};
use crate::nvrtc;
use crate::plan_table::{self, BufferAddrs, ErrorRecord, Lanes, PlanArgs, MAX_RANKS, THREADS};
use commfuse_core::backend::{
    ensure_fits, Backend, BackendError, CallTiming, HostBuffer, HostSlice, HostSliceMut,
    PadCapacity, PreparedCall,
};
use commfuse_core::{CheckedPlan, DType, Element, OpKind, OpSpec, ReduceOp, Slot};
use half::{bf16, f16};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Signal slots per lane on every GPU; plans need rows × cols of them.
pub(crate) const PAD_SLOTS: usize = 1024;
/// Bytes of the longest region a lane aims to handle. Measured on 2 × H200 (CHANGELOG.md, "The cuda backend"):
/// 64 KiB per lane serves messages from 4 MiB up; 4 KiB per lane for every message made 4–16 MiB
/// calls 10 µs slower; one block per small message was latency-bound (64 KiB took 20 µs).
pub(crate) const LANE_TARGET_BYTES: usize = 64 << 10;
/// Small messages still get this many lanes, down to LANE_MIN_BYTES each.
pub(crate) const LANE_MIN_COUNT: usize = 16;
pub(crate) const LANE_MIN_BYTES: usize = 4 << 10;
/// What a host wait allows beyond the device-side wait timeout: launch queues, first-call
/// setup, a large message's transfer. A host wait past it means a GPU is stuck.
const HOST_SLACK: Duration = Duration::from_secs(20);

/// One GPU's share of the backend. Fields drop in order, and the context (`gpu`) must outlive
/// everything allocated in it, so it comes last.
pub(crate) struct Rank {
    pub stream: Stream,
    _module: Module,
    /// plan kernels by [dtype][reduce op]
    kernels: [[Function; 4]; 3],
    pads: DeviceMemory,
    bases: DeviceMemory,
    pub gpu: Gpu,
}

pub struct CudaBackend {
    // drop order: NCCL communicators and the mapped record need live contexts, so `ranks`
    // (which owns the contexts) comes last. `error` and `ranks` are dropped by hand (see Drop):
    // while a kernel may still run they are leaked instead.
    pub(crate) nccl: OnceLock<Result<crate::nccl::Comms, String>>,
    error: ManuallyDrop<MappedHost<ErrorRecord>>,
    max_lanes: u32,
    /// The most ranks on one GPU (1 unless `open` was given a device twice)
    sharing: u32,
    timeout: Duration,
    broken: AtomicBool,
    /// A kernel did not stop within its bound even after the abort: nothing it may touch (its
    /// buffers, pads, tables, the error record, the contexts) may ever be freed.
    wedged: AtomicBool,
    pub(crate) ranks: ManuallyDrop<Vec<Rank>>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.is_wedged() {
            // freeing memory a running kernel writes would corrupt whatever is allocated there
            // next: leak it all (the process should end anyway)
            std::mem::forget(std::mem::take(&mut self.nccl));
            return;
        }
        // SAFETY: dropped once, here, and never used again; every batch ended with its streams
        // idle (or stopped) before returning
        unsafe {
            ManuallyDrop::drop(&mut self.error);
            ManuallyDrop::drop(&mut self.ranks);
        }
    }
}

/// The plan kernel of `reduce` among a dtype's four (`plan_{dtype}_{sum,max,min,prod}`).
pub(crate) fn reduce_index(reduce: ReduceOp) -> usize {
    match reduce {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::Prod => 3,
    }
}

pub(crate) fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

/// The most ranks that `devices` (rank r on `devices[r]`) place on one GPU.
fn ranks_per_gpu(devices: &[usize]) -> u32 {
    devices
        .iter()
        .map(|d| devices.iter().filter(|&e| e == d).count() as u32)
        .max()
        .unwrap_or(1)
}

impl CudaBackend {
    /// Opens the GPUs `devices` (rank r on `devices[r]`), enables peer access between every
    /// pair, compiles (or loads from cache) the kernels and allocates the signal pads.
    ///
    /// A device may be named more than once: those ranks share the GPU (each its own stream
    /// and buffers, their kernels running side by side on its SMs, stores between them local).
    /// That is for checking protocols of P ranks on fewer GPUs, not for speed; NCCL, which
    /// takes one rank per GPU, is then no baseline.
    pub fn open(devices: &[usize], timeout: Duration) -> Result<CudaBackend, CudaError> {
        if devices.is_empty() || devices.len() > MAX_RANKS {
            return Err(CudaError::Unavailable(format!(
                "the cuda backend takes 1 to {MAX_RANKS} devices, got {}",
                devices.len()
            )));
        }
        let sharing = ranks_per_gpu(devices);
        let gpus: Vec<Gpu> = devices
            .iter()
            .map(|&d| Gpu::open(d))
            .collect::<Result<_, _>>()?;
        for a in &gpus {
            for b in &gpus {
                if a.ordinal != b.ordinal {
                    a.enable_peer_access(b)?;
                }
            }
        }
        let compiled = nvrtc::compile(nvrtc::kernel("plan.cu").expect("embedded"), false)?;
        let mut max_lanes = u32::MAX;
        let mut ranks = Vec::new();
        for gpu in gpus {
            let module = Module::load(&gpu, &compiled.cubin)?;
            let mut kernels = Vec::new();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let mut row = Vec::new();
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod] {
                    row.push(plan_kernel(&module, dtype, op)?);
                }
                kernels.push(<[Function; 4]>::try_from(row).ok().unwrap());
            }
            let kernels = <[[Function; 4]; 3]>::try_from(kernels).ok().unwrap();
            // lanes spin on their peers' lanes: all must be resident at once, those of the
            // ranks that share this GPU too
            let resident = kernels[0][0].max_blocks_per_sm(THREADS)? * gpu.sm_count / sharing;
            max_lanes = max_lanes.min(resident).min(4 * gpu.sm_count);
            let pad_bytes = max_lanes.max(4 * gpu.sm_count) as usize * PAD_SLOTS * 8;
            ranks.push(Rank {
                stream: Stream::new(&gpu)?,
                pads: DeviceMemory::zeroed(&gpu, pad_bytes)?,
                bases: DeviceMemory::zeroed(&gpu, pad_bytes)?,
                _module: module,
                kernels,
                gpu,
            });
        }
        let error = MappedHost::new(&ranks[0].gpu, ErrorRecord::default())?;
        Ok(CudaBackend {
            ranks: ManuallyDrop::new(ranks),
            error: ManuallyDrop::new(error),
            max_lanes,
            sharing,
            timeout,
            broken: AtomicBool::new(false),
            wedged: AtomicBool::new(false),
            nccl: OnceLock::new(),
        })
    }

    /// Rank `r`'s GPU.
    pub fn gpu(&self, r: usize) -> &Gpu {
        &self.ranks[r].gpu
    }

    pub fn describe(&self) -> String {
        let names: Vec<String> = self
            .ranks
            .iter()
            .map(|r| {
                format!(
                    "GPU {} ({}, {} SMs)",
                    r.gpu.ordinal, r.gpu.name, r.gpu.sm_count
                )
            })
            .collect();
        format!(
            "{}; up to {} lanes of {THREADS} threads",
            names.join(", "),
            self.max_lanes
        )
    }

    /// The most ranks that share one GPU: 1 unless [`CudaBackend::open`] named a device twice.
    /// Kernels whose blocks wait for other ranks' must fit on a GPU this many times over.
    pub(crate) fn sharing(&self) -> u32 {
        self.sharing
    }

    /// How long a device-side wait lasts before it gives up.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The device address of the host-mapped error record every rank's waits write.
    pub(crate) fn error_record(&self) -> u64 {
        self.error.device_addr()
    }

    /// Clears the error record before a batch.
    pub(crate) fn clear_error_record(&self) {
        self.error.write(ErrorRecord::default());
    }

    /// Before a batch of a kernel that records its timeouts in the error record: the backend
    /// must be usable, and the record is cleared.
    pub(crate) fn before_recorded_batch(&self) -> Result<(), BackendError> {
        self.check_usable()?;
        self.clear_error_record();
        Ok(())
    }

    /// After such a batch: the recorded timeout (`failure`, the launcher's diagnosis of the
    /// record) or the batch's own error leaves the ranks' protocol state apart, so the backend
    /// is marked broken; otherwise the batch's timings.
    pub(crate) fn after_recorded_batch(
        &self,
        failure: Option<BackendError>,
        result: Result<Vec<CallTiming>, BackendError>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        if let Some(e) = failure {
            self.mark_broken();
            return Err(e);
        }
        if result.is_err() {
            self.mark_broken();
        }
        result
    }

    /// The error of a recorded wait that gave up on `slot`.
    pub(crate) fn wait_timeout(&self, rec: &ErrorRecord, slot: Slot) -> BackendError {
        BackendError::DeviceWaitTimeout {
            rank: rec.rank as usize,
            lane: rec.lane,
            slot,
            expected: rec.expected,
            seen: rec.seen,
            timeout_ms: self.timeout.as_millis() as u64,
        }
    }

    /// What a wait that gave up recorded, if one did.
    pub(crate) fn recorded_timeout(&self) -> Option<ErrorRecord> {
        let rec = self.error.read();
        (rec.flag != 0).then_some(rec)
    }

    pub(crate) fn check_usable(&self) -> Result<(), BackendError> {
        if self.broken.load(Ordering::Acquire) {
            return Err(BackendError::Unavailable(
                "the GPUs' signal pads are inconsistent after a failed call: reopen the backend"
                    .into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// Marks that a kernel may still be running that nothing could stop: nothing it may touch
    /// is freed any more (see `wedged`).
    pub(crate) fn mark_wedged(&self) {
        self.wedged.store(true, Ordering::Release);
    }

    /// Whether a kernel may still be running that nothing could stop (see `wedged`).
    pub(crate) fn is_wedged(&self) -> bool {
        self.wedged.load(Ordering::Acquire)
    }

    /// The bounds of the host's waits in a batch.
    fn host_bounds(&self) -> HostBounds {
        HostBounds {
            start: HOST_SLACK,
            call: self.timeout + HOST_SLACK,
        }
    }

    /// Every error path of a batch ends here, before anything is freed: raises the abort word
    /// of the host-mapped error record (every device-side wait gives up), aborts the NCCL
    /// communicators (their kernels do not read our record), then waits, bounded, for every
    /// GPU's stream to drain. A stream that does not drain marks the backend wedged: from then
    /// on its memory is leaked, never freed under a running kernel. Leaves the backend unusable
    /// (pads and communicators are mid-protocol).
    pub(crate) fn stop(&self) -> Result<(), BackendError> {
        self.mark_broken();
        self.error.raise_abort();
        if let Some(Ok(comms)) = self.nccl.get() {
            comms.abort();
        }
        self.wait_streams()
    }

    /// Waits, bounded, until every GPU's stream is idle. A stream still busy after the bound
    /// marks the backend wedged (see [`CudaBackend::stop`]); a stream whose kernel faulted is
    /// idle (the fault is reported where it happened).
    pub(crate) fn wait_streams(&self) -> Result<(), BackendError> {
        let bound = self.host_bounds().call;
        let mut busy = Vec::new();
        for (r, rank) in self.ranks.iter().enumerate() {
            let idle = rank.gpu.bind().and_then(|()| rank.stream.wait_idle(bound));
            if let Ok(false) = idle {
                busy.push(format!("rank {r} (GPU {})", rank.gpu.ordinal));
            }
        }
        if busy.is_empty() {
            return Ok(());
        }
        self.wedged.store(true, Ordering::Release);
        self.mark_broken();
        Err(BackendError::Unavailable(format!(
            "{} still running {bound:?} after the abort; their memory is leaked, reopen the backend in a new process",
            busy.join(", ")
        )))
    }

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

/// Whether `plan` fits `backend`'s ranks and signal pads (what `prepare` demands).
pub(crate) fn ensure_plan_fits(
    backend: &CudaBackend,
    plan: &CheckedPlan,
) -> Result<(), BackendError> {
    ensure_fits(plan, backend.ranks.len(), PadCapacity::Slots(PAD_SLOTS))
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

    fn baselines(&self, op: OpKind) -> Vec<&'static str> {
        crate::nccl::baselines(op)
    }

    fn auto_protocol(&self, spec: &OpSpec, elem_bytes: usize) -> Option<&'static str> {
        // as CollectiveRank does
        commfuse_core::cost::prefers_ll(spec, elem_bytes).then_some(crate::ll::LL)
    }

    fn protocols(&self, op: OpKind) -> Vec<&'static str> {
        let ll = crate::ll::runs(op).then_some([crate::ll::LL, crate::ll::LL16]);
        let ce = crate::ce::runs(op).then_some(crate::ce::CE);
        ll.into_iter().flatten().chain(ce).collect()
    }

    fn prepare_baseline(
        &self,
        name: &str,
        spec: &OpSpec,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        self.check_usable()?;
        if let Some(lines) = crate::ll::Lines::of_protocol(name) {
            return crate::ll::prepare(self, spec, (dtype, reduce), lines);
        }
        if name == crate::ce::CE {
            return crate::ce::prepare(self, spec, dtype, reduce);
        }
        crate::nccl::prepare(self, name, spec, dtype, reduce)
    }
}

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

/// The bounds of the host's waits in a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostBounds {
    /// How long a rank waits at the start for the others to finish their setup.
    pub start: Duration,
    /// How long one call (or one graph replay per call in it) may take.
    pub call: Duration,
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
        backend.wait_timeout(rec, Slot::new(rec.step, rec.slot))
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
    fn run_on(
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
        crate::queued::run_queued(self, inputs)
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

/// The plan kernel of `dtype` and `reduce` in a module of `plan.cu`.
pub(crate) fn plan_kernel(
    module: &Module,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Function, CudaError> {
    typed_kernel(module, "plan", dtype, reduce)
}

/// The entry point `<prefix>_<type>_<op>` of `dtype` and `reduce` in `module`: the names
/// `COMMFUSE_EACH_TYPE_AND_OP` (common.cuh) gives a kernel's instances.
pub(crate) fn typed_kernel(
    module: &Module,
    prefix: &str,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Function, CudaError> {
    let d = ["f32", "bf16", "f16"][dtype_index(dtype)];
    let op = ["sum", "max", "min", "prod"][reduce_index(reduce)];
    module.function(&format!("{prefix}_{d}_{op}"))
}

/// What a rank's plan kernel reads besides its table: every rank's signal pads as this rank
/// addresses them, its epoch bases, its error record, the lanes and the bound of its waits.
pub(crate) struct KernelContext {
    pub pads: [u64; MAX_RANKS],
    pub bases: u64,
    pub error: u64,
    pub lanes: Lanes,
    pub timeout: Duration,
}

/// A rank's table of a plan on its GPU: kept as long as its kernel may read it.
pub(crate) struct DeviceTable {
    _steps: DeviceMemory,
    _regions: DeviceMemory,
    _increments: DeviceMemory,
}

/// Rank `r`'s table of `plan` (steps and regions over every rank's buffers `addrs`, as rank r
/// addresses them; its slot increments) uploaded to `gpu`, and its plan kernel's arguments.
pub(crate) fn upload_table(
    gpu: &Gpu,
    plan: &CheckedPlan,
    r: usize,
    addrs: &[BufferAddrs],
    elem_bytes: usize,
    context: &KernelContext,
) -> Result<(DeviceTable, PlanArgs), CudaError> {
    let table = plan_table::encode(plan, r, addrs, elem_bytes);
    let steps = DeviceMemory::zeroed(gpu, std::mem::size_of_val(&table.steps[..]))?;
    steps.upload(gpu, &table.steps)?;
    let regions = DeviceMemory::zeroed(gpu, std::mem::size_of_val(&table.regions[..]))?;
    regions.upload(gpu, &table.regions)?;
    let inc = plan.slot_increments(r);
    let increments = DeviceMemory::zeroed(gpu, std::mem::size_of_val(inc))?;
    increments.upload(gpu, inc)?;
    let p = plan.plan();
    let args = PlanArgs {
        steps: steps.addr(),
        regions: regions.addr(),
        pads: context.pads,
        bases: context.bases,
        increments: increments.addr(),
        error: context.error,
        lane_len: context.lanes.len,
        timeout_ns: context.timeout.as_nanos() as u64,
        nsteps: table.steps.len() as u32,
        rank: r as u32,
        slots: p.pad_rows * p.pad_cols,
        pad: 0,
    };
    let table = DeviceTable {
        _steps: steps,
        _regions: regions,
        _increments: increments,
    };
    Ok((table, args))
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
        // the plan kernel records its pad slot as one index
        let cols = self.plan.plan().pad_cols;
        backend.wait_timeout(rec, Slot::new(rec.slot / cols, rec.slot % cols))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_core::{build_plan, check, Algo, OpKind, OpSpec, Topology};

    fn barrier_plan(world: usize) -> CheckedPlan {
        let spec = OpSpec::new(OpKind::Barrier, world, 0, 0).unwrap();
        check(build_plan(spec, Algo::AllToAll, &Topology::new(world, 1).unwrap()).unwrap()).unwrap()
    }

    #[test]
    fn ranks_sharing_a_gpu_are_counted() {
        assert_eq!(ranks_per_gpu(&[0, 1]), 1);
        assert_eq!(ranks_per_gpu(&[0, 0]), 2);
        assert_eq!(ranks_per_gpu(&[1, 0, 1, 1]), 3);
        assert_eq!(ranks_per_gpu(&[]), 1);
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
