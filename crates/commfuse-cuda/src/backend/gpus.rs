//! The GPUs a [`CudaBackend`] runs on: one rank per GPU with its stream, its plan kernels, its
//! signal pads and epoch bases, every pair of GPUs peer-enabled; the host-mapped error record
//! every rank's waits write; the state every call checks first (usable, broken after a failed
//! call, wedged when a kernel could not be stopped); the bounds of the host's waits, and the
//! stop that ends a failed batch.

use crate::backend::plan_kernel::{plan_kernel, PAD_SLOTS};
use crate::backend::plan_table::{ErrorRecord, MAX_RANKS, THREADS};
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Function, Gpu, MappedHost, Module, Stream};
use crate::sys::nvrtc;
use commfuse_core::backend::{ensure_fits, BackendError, CallTiming, PadCapacity};
use commfuse_core::{CheckedPlan, DType, ReduceOp, Slot};
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// What a host wait allows beyond the device-side wait timeout: launch queues, first-call
/// setup, a large message's transfer. A host wait past it means a GPU is stuck.
const HOST_SLACK: Duration = Duration::from_secs(20);

/// One GPU's share of the backend. Fields drop in order, and the context (`gpu`) must outlive
/// everything allocated in it, so it comes last.
pub(crate) struct Rank {
    pub stream: Stream,
    _module: Module,
    /// plan kernels by [dtype][reduce op]
    pub kernels: [[Function; 4]; 3],
    pub pads: DeviceMemory,
    pub bases: DeviceMemory,
    pub gpu: Gpu,
}

pub struct CudaBackend {
    // drop order: NCCL communicators and the mapped record need live contexts, so `ranks`
    // (which owns the contexts) comes last. `error` and `ranks` are dropped by hand (see Drop):
    // while a kernel may still run they are leaked instead.
    pub(crate) nccl: OnceLock<Result<crate::sys::nccl::Comms, String>>,
    pub(crate) error: ManuallyDrop<MappedHost<ErrorRecord>>,
    pub(crate) max_lanes: u32,
    /// The most ranks on one GPU (1 unless `open` was given a device twice)
    sharing: u32,
    pub(crate) timeout: Duration,
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
    pub(crate) fn host_bounds(&self) -> HostBounds {
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
}

/// The bounds of the host's waits in a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostBounds {
    /// How long a rank waits at the start for the others to finish their setup.
    pub start: Duration,
    /// How long one call (or one graph replay per call in it) may take.
    pub call: Duration,
}

/// Whether `plan` fits `backend`'s ranks and signal pads (what `prepare` demands).
pub(crate) fn ensure_plan_fits(
    backend: &CudaBackend,
    plan: &CheckedPlan,
) -> Result<(), BackendError> {
    ensure_fits(plan, backend.ranks.len(), PadCapacity::Slots(PAD_SLOTS))
}

/// The error of a recorded wait that gave up on `slot` after `timeout`, notified by rank
/// `from` where that is known.
pub(crate) fn wait_timeout(
    rec: &ErrorRecord,
    slot: Slot,
    from: Option<usize>,
    timeout: Duration,
) -> BackendError {
    BackendError::DeviceWaitTimeout {
        rank: rec.rank as usize,
        lane: rec.lane,
        slot,
        expected: rec.expected,
        seen: rec.seen,
        timeout_ms: timeout.as_millis() as u64,
        from,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_sharing_a_gpu_are_counted() {
        assert_eq!(ranks_per_gpu(&[0, 1]), 1);
        assert_eq!(ranks_per_gpu(&[0, 0]), 2);
        assert_eq!(ranks_per_gpu(&[1, 0, 1, 1]), 3);
        assert_eq!(ranks_per_gpu(&[]), 1);
    }
}
