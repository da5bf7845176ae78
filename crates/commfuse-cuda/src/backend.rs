//! The CUDA backend: one rank per GPU, every pair of GPUs peer-enabled, symmetric buffers in
//! plain device memory, and the plan kernel (kernels/plan.cu) launched on every GPU at once by
//! one host thread per GPU.

use crate::driver::{DeviceMemory, Event, Function, Gpu, Graph, MappedHost, Module, Stream};
use crate::error::CudaError;
use crate::nvrtc;
use crate::plan_table::{self, BufferAddrs, ErrorRecord, Lanes, PlanArgs, MAX_RANKS, THREADS};
use commfuse_core::backend::{
    ensure_fits, Backend, BackendError, CallTiming, HostBuffer, HostSlice, HostSliceMut,
    PadCapacity, PreparedCall,
};
use commfuse_core::{CheckedPlan, DType, Element, OpKind, OpSpec, ReduceOp, Slot};
use half::{bf16, f16};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Signal slots per lane on every GPU; plans need rows × cols of them.
const PAD_SLOTS: usize = 1024;
/// Bytes of the longest region a lane aims to handle. Measured on 2 × H200 (docs/perf.md):
/// 64 KiB per lane serves messages from 4 MiB up; 4 KiB per lane for every message made 4–16 MiB
/// calls 10 µs slower; one block per small message was latency-bound (64 KiB took 20 µs).
const LANE_TARGET_BYTES: usize = 64 << 10;
/// Small messages still get this many lanes, down to LANE_MIN_BYTES each.
const LANE_MIN_COUNT: usize = 16;
const LANE_MIN_BYTES: usize = 4 << 10;

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
    // (which owns the contexts) comes last
    pub(crate) nccl: OnceLock<Result<crate::nccl::Comms, String>>,
    error: MappedHost<ErrorRecord>,
    max_lanes: u32,
    timeout: Duration,
    broken: AtomicBool,
    pub(crate) ranks: Vec<Rank>,
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

impl CudaBackend {
    /// Opens the GPUs `devices` (rank r on `devices[r]`), enables peer access between every
    /// pair, compiles (or loads from cache) the kernels and allocates the signal pads.
    pub fn open(devices: &[usize], timeout: Duration) -> Result<CudaBackend, CudaError> {
        if devices.is_empty() || devices.len() > MAX_RANKS {
            return Err(CudaError::Unavailable(format!(
                "the cuda backend takes 1 to {MAX_RANKS} devices, got {}",
                devices.len()
            )));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(CudaError::Unavailable(format!(
                    "device {d} is listed twice"
                )));
            }
        }
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
            for dtype in ["f32", "bf16", "f16"] {
                let mut row = Vec::new();
                for op in ["sum", "max", "min", "prod"] {
                    row.push(module.function(&format!("plan_{dtype}_{op}"))?);
                }
                kernels.push(<[Function; 4]>::try_from(row).ok().unwrap());
            }
            let kernels = <[[Function; 4]; 3]>::try_from(kernels).ok().unwrap();
            // lanes spin on their peers' lanes: all must be resident at once
            let resident = kernels[0][0].max_blocks_per_sm(THREADS)? * gpu.sm_count;
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
            ranks,
            error,
            max_lanes,
            timeout,
            broken: AtomicBool::new(false),
            nccl: OnceLock::new(),
        })
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

    /// Runs one call of `plan` (f32, sum) on the ranks in `which` only. The others never
    /// arrive, so a wait that needs them must end in a timeout naming rank, lane and slot: this
    /// is how the GPU tests exercise the bounded waits. Leaves the backend unusable afterwards.
    pub fn run_partial(
        &self,
        plan: &CheckedPlan,
        which: &[usize],
    ) -> Result<CallTiming, BackendError> {
        if let Some(&bad) = which.iter().find(|&&r| r >= self.ranks.len()) {
            return Err(BackendError::Unavailable(format!(
                "rank {bad} is not part of this backend"
            )));
        }
        let mut call = plan_call::<f32>(self, plan, ReduceOp::Sum)?;
        Ok(call.run_on(which, 1, Issue::Launches)?.remove(0))
    }
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

    fn prepare_baseline(
        &self,
        name: &str,
        spec: &OpSpec,
        dtype: DType,
        reduce: ReduceOp,
    ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
        self.check_usable()?;
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

/// Runs `launch(rank)` `iters` times back to back on the streams of the ranks in `which`, one
/// host thread per GPU starting together; returns per-iteration times of those ranks.
pub(crate) fn timed_iterations(
    ranks: &[Rank],
    which: &[usize],
    iters: usize,
    issue: Issue,
    launch: &(dyn Fn(usize, &Rank) -> Result<(), BackendError> + Sync),
) -> Result<Vec<CallTiming>, BackendError> {
    let start = std::sync::Barrier::new(which.len());
    let per_rank: Vec<Result<Vec<Duration>, BackendError>> = std::thread::scope(|s| {
        let handles: Vec<_> = which
            .iter()
            .map(|&r| (r, &ranks[r]))
            .map(|(r, rank)| {
                let start = &start;
                s.spawn(move || -> Result<Vec<Duration>, BackendError> {
                    rank.gpu.bind()?;
                    match issue {
                        Issue::Launches => {
                            let events: Vec<Event> = (0..=iters)
                                .map(|_| Event::new(&rank.gpu))
                                .collect::<Result<_, _>>()?;
                            start.wait();
                            events[0].record(&rank.stream)?;
                            for event in &events[1..] {
                                launch(r, rank)?;
                                event.record(&rank.stream)?;
                            }
                            rank.stream.synchronize()?;
                            events
                                .windows(2)
                                .map(|w| {
                                    Ok(Duration::from_secs_f64(
                                        w[0].elapsed_ms(&w[1])? as f64 / 1e3,
                                    ))
                                })
                                .collect()
                        }
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
                            let (begin, end) = (Event::new(&rank.gpu)?, Event::new(&rank.gpu)?);
                            start.wait();
                            graph.launch(&rank.stream)?;
                            begin.record(&rank.stream)?;
                            graph.launch(&rank.stream)?;
                            end.record(&rank.stream)?;
                            rank.stream.synchronize()?;
                            let each = begin.elapsed_ms(&end)? as f64 / 1e3 / iters.max(1) as f64;
                            Ok(vec![Duration::from_secs_f64(each); iters])
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BackendError::Unavailable("a GPU thread panicked".into()))
                })
            })
            .collect()
    });
    let per_rank: Vec<Vec<Duration>> = per_rank.into_iter().collect::<Result<_, _>>()?;
    Ok((0..iters)
        .map(|i| CallTiming {
            per_rank: per_rank.iter().map(|t| t[i]).collect(),
        })
        .collect())
}

/// What a prepared call enqueues on each GPU: the plan kernel, or a baseline.
pub(crate) trait Launcher: Sync {
    /// Enqueues one call on `on`'s stream; `bufs` are every rank's buffers of this call.
    fn launch(&self, bufs: &[RankBuffers], rank: usize, on: &Rank) -> Result<(), BackendError>;
    /// Whether the launches may be captured into a graph.
    fn capturable(&self) -> bool {
        true
    }
    /// Runs before a batch.
    fn before(&self, _backend: &CudaBackend) -> Result<(), BackendError> {
        Ok(())
    }
    /// Sees the batch's outcome.
    fn after(
        &self,
        _backend: &CudaBackend,
        result: Result<Vec<CallTiming>, BackendError>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        result
    }
}

/// A call prepared on the GPUs: device buffers, their host mirrors, and what to launch.
pub(crate) struct GpuCall<'a, T: Element, L: Launcher> {
    pub backend: &'a CudaBackend,
    pub bufs: Vec<RankBuffers>,
    pub host: HostMirrors<T>,
    pub launcher: L,
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
            launcher: launcher(&bufs)?,
            backend,
            host: HostMirrors::new(backend.ranks.len(), input, output),
            bufs,
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
        self.launcher.before(self.backend)?;
        let (launcher, bufs) = (&self.launcher, &self.bufs);
        let result = timed_iterations(&self.backend.ranks, which, iters, issue, &|r, rank| {
            launcher.launch(bufs, r, rank)
        });
        self.launcher.after(self.backend, result)
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

/// The plan kernel with its tables on every GPU.
struct PlanLauncher {
    plan: CheckedPlan,
    /// which kernel: [dtype][reduce op]
    dtype_index: usize,
    reduce_index: usize,
    lanes: Lanes,
    /// per rank: steps, regions, slot increments (the kernel reads them through `args`)
    _tables: Vec<(DeviceMemory, DeviceMemory, DeviceMemory)>,
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
    fn new(
        backend: &CudaBackend,
        plan: &CheckedPlan,
        dtype: DType,
        reduce: ReduceOp,
        bufs: &[RankBuffers],
    ) -> Result<Self, BackendError> {
        let p = plan.plan();
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
            let table = plan_table::encode(plan, r, &addrs, eb);
            let steps = DeviceMemory::zeroed(&rank.gpu, std::mem::size_of_val(&table.steps[..]))?;
            steps.upload(&rank.gpu, &table.steps)?;
            let regions =
                DeviceMemory::zeroed(&rank.gpu, std::mem::size_of_val(&table.regions[..]))?;
            regions.upload(&rank.gpu, &table.regions)?;
            let inc = plan.slot_increments(r);
            let increments = DeviceMemory::zeroed(&rank.gpu, std::mem::size_of_val(inc))?;
            increments.upload(&rank.gpu, inc)?;
            args.push(PlanArgs {
                steps: steps.addr(),
                regions: regions.addr(),
                pads,
                bases: rank.bases.addr(),
                increments: increments.addr(),
                error: backend.error.device_addr(),
                lane_len: lanes.len,
                timeout_ns: backend.timeout.as_nanos() as u64,
                nsteps: table.steps.len() as u32,
                rank: r as u32,
                slots: p.pad_rows * p.pad_cols,
                pad: 0,
            });
            tables.push((steps, regions, increments));
        }
        Ok(PlanLauncher {
            plan: plan.clone(),
            dtype_index: dtype_index(dtype),
            reduce_index: match reduce {
                ReduceOp::Sum => 0,
                ReduceOp::Max => 1,
                ReduceOp::Min => 2,
                ReduceOp::Prod => 3,
            },
            lanes,
            _tables: tables,
            args,
        })
    }

    /// The timeout a kernel recorded, if any.
    fn failure(&self, backend: &CudaBackend) -> Option<BackendError> {
        let rec = backend.error.read();
        if rec.flag == 0 {
            return None;
        }
        let cols = self.plan.plan().pad_cols;
        Some(BackendError::DeviceWaitTimeout {
            rank: rec.rank as usize,
            lane: rec.lane,
            slot: Slot::new(rec.slot / cols, rec.slot % cols),
            expected: rec.expected,
            seen: rec.seen,
            timeout_ms: backend.timeout.as_millis() as u64,
        })
    }
}

impl Launcher for PlanLauncher {
    fn launch(&self, _bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        // rank r's kernel lives in rank r's module (its own context)
        let f = rank.kernels[self.dtype_index][self.reduce_index];
        // SAFETY: PlanArgs mirrors the kernel's parameter; every address in it belongs to
        // buffers, tables and pads that outlive the launch (the batch synchronizes)
        unsafe { f.launch(self.lanes.count, THREADS, &rank.stream, &self.args[r]) }
            .map_err(BackendError::from)
    }

    fn before(&self, backend: &CudaBackend) -> Result<(), BackendError> {
        backend.check_usable()?;
        backend.error.write(ErrorRecord::default());
        Ok(())
    }

    fn after(
        &self,
        backend: &CudaBackend,
        result: Result<Vec<CallTiming>, BackendError>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        // a timed-out or failed call leaves the pads mid-protocol
        if let Some(e) = self.failure(backend) {
            backend.mark_broken();
            return Err(e);
        }
        if result.is_err() {
            backend.mark_broken();
        }
        result
    }
}
