//! The low-latency (LL) all-reduce on GPUs (kernels/ll.cu): each rank stores its input, 4 bytes
//! with the call's number in every 8-byte line, straight into every peer's LL buffer, and
//! reduces the P inputs once their lines carry this call's number — one NVLink trip and no
//! separate signal, two lines per 16-byte store. The protocol is the simulator's (`commfuse_sim::protocol::ll_*`, model
//! checked with loom there); calls number themselves on the device, so they can be replayed
//! from a CUDA graph.
//!
//! It runs as a candidate named [`LL`] beside the plans and NCCL in the collectives' bench
//! (`commfuse bench all-reduce`) and `verify`-style checks, on the backend's ranks and buffers.

use crate::backend::{CudaBackend, GpuCall, Launcher, Rank, RankBuffers};
use crate::driver::{DeviceMemory, Function, Module};
use crate::nvrtc;
use crate::plan_table::MAX_RANKS;
use commfuse_core::backend::{BackendError, CallTiming, PreparedCall};
use commfuse_core::{DType, OpKind, OpSpec, ReduceOp, Slot};
use half::{bf16, f16};

/// The candidate's name in the collectives' bench.
pub const LL: &str = "ll";

/// The largest message (bytes per rank) the LL all-reduce takes: its buffers hold two lines of
/// 8 bytes per 4 bytes of every rank's input, so beyond small messages they cost more memory
/// than the protocol saves time (the plans' protocols take over well before).
pub const LL_MAX_BYTES: usize = 16 << 20;

/// Threads per block of the LL kernel (`__launch_bounds__` in ll.cu).
const THREADS: u32 = 512;
/// Most blocks a call uses: enough words in flight per GPU for the sizes LL serves.
const MAX_BLOCKS: u32 = 64;

/// Mirrors `LlArgs` in kernels/ll.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct LlArgs {
    bufs: [u64; MAX_RANKS],
    input: u64,
    output: u64,
    calls: u64,
    err: u64,
    timeout_ns: u64,
    count: u32,
    words: u32,
    world: u32,
    rank: u32,
}
const _: () = assert!(std::mem::size_of::<LlArgs>() == 8 * MAX_RANKS + 56);
const _: () = assert!(std::mem::offset_of!(LlArgs, timeout_ns) == 8 * MAX_RANKS + 32);

fn type_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
    }
}

fn reduce_name(r: ReduceOp) -> &'static str {
    match r {
        ReduceOp::Sum => "sum",
        ReduceOp::Max => "max",
        ReduceOp::Min => "min",
        ReduceOp::Prod => "prod",
    }
}

/// Every rank's kernel, LL buffer, call counter and arguments for one (count, type, op).
pub(crate) struct LlLauncher {
    functions: Vec<Function>,
    args: Vec<LlArgs>,
    blocks: u32,
    timeout_ms: u64,
    // freed only once every call ended (GpuCall drops the launcher after its batches)
    _buffers: Vec<DeviceMemory>,
    _counters: Vec<DeviceMemory>,
}

/// Prepares the LL all-reduce of `spec` on every rank of `backend`.
pub(crate) fn prepare<'a>(
    backend: &'a CudaBackend,
    spec: &OpSpec,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Box<dyn PreparedCall + 'a>, BackendError> {
    if spec.kind != OpKind::AllReduce {
        return Err(BackendError::Unavailable(format!(
            "the LL protocol runs all-reduce only, not {}",
            spec.kind
        )));
    }
    let bytes = spec.count * dtype.size();
    if bytes > LL_MAX_BYTES {
        return Err(BackendError::Unavailable(format!(
            "the LL all-reduce takes messages up to {} MiB, got {bytes} bytes",
            LL_MAX_BYTES >> 20
        )));
    }
    let world = backend.ranks.len();
    let words = bytes.div_ceil(4);
    let compiled = nvrtc::compile(nvrtc::kernel("ll.cu").expect("embedded"), false)?;
    let name = format!("ll_all_reduce_{}_{}", type_name(dtype), reduce_name(reduce));
    let mut functions = Vec::with_capacity(world);
    let mut buffers = Vec::with_capacity(world);
    let mut counters = Vec::with_capacity(world);
    for rank in backend.ranks.iter() {
        functions.push(Module::load(&rank.gpu, &compiled.cubin)?.function(&name)?);
        // two halves of `world` regions of the words rounded up to even (`pitch` in ll.cu)
        let pitch = words + words % 2;
        buffers.push(DeviceMemory::zeroed(
            &rank.gpu,
            (2 * world * pitch).max(2) * 8,
        )?);
        counters.push(DeviceMemory::zeroed(&rank.gpu, 8 * MAX_BLOCKS as usize)?);
    }
    let mut bufs = [0; MAX_RANKS];
    for (r, b) in buffers.iter().enumerate() {
        bufs[r] = b.addr();
    }
    // two words per thread
    let blocks = (words as u32).div_ceil(2 * THREADS).clamp(1, MAX_BLOCKS);
    let timeout = backend.timeout();
    let launcher = |rank_bufs: &[RankBuffers]| {
        let args = (0..world)
            .map(|r| LlArgs {
                bufs,
                input: rank_bufs[r].input.addr(),
                output: rank_bufs[r].output.addr(),
                calls: counters[r].addr(),
                err: backend.error_record(),
                timeout_ns: timeout.as_nanos() as u64,
                count: spec.count as u32,
                words: words as u32,
                world: world as u32,
                rank: r as u32,
            })
            .collect();
        Ok(LlLauncher {
            functions,
            args,
            blocks,
            timeout_ms: timeout.as_millis() as u64,
            _buffers: buffers,
            _counters: counters,
        })
    };
    let sizes = (spec.input_capacity(), spec.output_capacity(), 0);
    Ok(match dtype {
        DType::F32 => Box::new(GpuCall::<f32, _>::new(backend, sizes, launcher)?),
        DType::BF16 => Box::new(GpuCall::<bf16, _>::new(backend, sizes, launcher)?),
        DType::F16 => Box::new(GpuCall::<f16, _>::new(backend, sizes, launcher)?),
    })
}

impl Launcher for LlLauncher {
    fn launch(&self, _bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        if self.args[r].words == 0 {
            return Ok(());
        }
        // SAFETY: LlArgs mirrors the kernel's parameter; the buffers, counters and the error
        // record outlive the launch (the batch synchronises before anything is dropped)
        unsafe { self.functions[r].launch(self.blocks, THREADS, &rank.stream, &self.args[r]) }
            .map_err(BackendError::from)
    }

    fn before(&self, backend: &CudaBackend) -> Result<(), BackendError> {
        backend.check_usable()?;
        backend.clear_error_record();
        Ok(())
    }

    fn after(
        &self,
        backend: &CudaBackend,
        result: Result<Vec<CallTiming>, BackendError>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        if let Some(rec) = backend.recorded_timeout() {
            // a wait that gave up leaves the counters of the ranks apart
            backend.mark_broken();
            return Err(BackendError::DeviceWaitTimeout {
                rank: rec.rank as usize,
                lane: rec.lane,
                // the sender waited for, and the word
                slot: Slot::new(rec.step, rec.slot),
                expected: rec.expected,
                seen: rec.seen,
                timeout_ms: self.timeout_ms,
            });
        }
        if result.is_err() {
            backend.mark_broken();
        }
        result
    }
}
