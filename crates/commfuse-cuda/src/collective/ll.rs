//! The low-latency (LL) all-reduce, reduce-scatter and all-gather on GPUs (ll.cu): each
//! rank stores its input (a reduce-scatter: each peer's chunk of it; an all-gather: its chunk),
//! its words with the call's number in every line, straight into every peer's LL buffer, and
//! reduces the P inputs (or copies the P chunks out) once their lines carry this call's number
//! — one NVLink trip and no separate signal, one 16-byte store per thread at a time. The protocol
//! is the simulator's (`commfuse_sim::protocol::ll_one_shot_all_reduce`, model checked with loom
//! there; `commfuse_sim::ll_chunks` for the reduce-scatter and all-gather, with shuttle: every
//! sender sends every receiver at least one line, an empty chunk too, which is what keeps two
//! buffer halves enough); calls number themselves on the device, so they can be replayed from a
//! CUDA graph.
//!
//! Two line formats ([`Lines`]): LL's 8-byte lines (4 data bytes and the number each) and
//! LL16's 16-byte lines (12 data bytes and the number), which put a third fewer bytes on the
//! link for the same message.
//!
//! They run as protocols `Protocol::Ll` and `Protocol::Ll16` beside the plans and NCCL in the
//! collectives' bench and checks (`Backend::protocols`); LL also inside
//! [`crate::collective::rank`] and [`crate::collective`] where `auto` takes it.

use crate::backend::call::{boxed_call, Launcher, RankBuffers};
use crate::backend::gpus::{CudaBackend, Rank};
use crate::backend::plan_kernel::typed_kernel;
use crate::backend::plan_table::{ErrorRecord, MAX_RANKS};
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Function, Gpu, Module, Stream};
use crate::sys::nvrtc;
use commfuse_core::backend::{BackendError, PreparedCall};
use commfuse_core::{DType, OpKind, OpSpec, Protocol, ReduceOp};
use std::time::Duration;

/// How the LL kernels pack data and the call's number into the 16 bytes a thread stores at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lines {
    /// Two 8-byte lines of one 4-byte word and the number each (LL): an 8-byte store is seen
    /// whole, so each line stands alone; half the bytes moved are data.
    Eight,
    /// One 16-byte line of three words and the number (LL16), moved by one 128-bit store and
    /// load: three quarters of the bytes moved are data.
    Sixteen,
}

impl Lines {
    /// The line format of `protocol` (LL or LL16; None for the others).
    pub fn of_protocol(protocol: Protocol) -> Option<Lines> {
        match protocol {
            Protocol::Ll => Some(Lines::Eight),
            Protocol::Ll16 => Some(Lines::Sixteen),
            Protocol::Ce => None,
        }
    }

    /// Data words in each 16-byte unit (the kernels' template parameter K).
    pub fn words_per_unit(self) -> usize {
        match self {
            Lines::Eight => 2,
            Lines::Sixteen => 3,
        }
    }

    /// The kernel's entry points' prefix (`<prefix>_<type>_<op>`).
    fn entry(self) -> &'static str {
        match self {
            Lines::Eight => "ll_all_reduce",
            Lines::Sixteen => "ll16_all_reduce",
        }
    }

    /// The protocol of this line format.
    pub fn protocol(self) -> Protocol {
        match self {
            Lines::Eight => Protocol::Ll,
            Lines::Sixteen => Protocol::Ll16,
        }
    }
}

/// The largest message (bytes per rank) the LL protocols take: their buffers hold two halves of
/// 16 bytes per 8 (LL) or 12 (LL16) bytes of every rank's input, so beyond small messages they
/// cost more memory than the protocol saves time (the plans' protocols take over well before).
pub const LL_MAX_BYTES: usize = 16 << 20;

/// Threads per block of the LL kernel by default (at most `__launch_bounds__` in ll.cu, 512).
const THREADS: u32 = 512;
/// Most blocks a call uses by default: enough words in flight per GPU for the sizes LL serves
/// (measured on 2 × H200 at `52399ec`, CHANGELOG.md "LL launch shape": 128 blocks of 512 threads take a 1 MiB all-reduce
/// in 10.4 µs under graph replay where 64 took 11.3; at 256 KiB and below, which use at most
/// 64, other shapes — 256 × 128, 256 × 132, 128 × 256 — changed nothing)
const MAX_BLOCKS: u32 = 128;
/// Call counters allocated per rank: one per block, for the most blocks [`geometry`] allows.
const COUNTERS: usize = 256;

/// The LL kernel's threads per block and most blocks: the defaults above, or for measuring
/// other launch shapes `COMMFUSE_LL_THREADS` (64 to 512, a multiple of 32) and
/// `COMMFUSE_LL_MAX_BLOCKS` (1 to 256); other values are ignored.
fn geometry() -> (u32, u32) {
    static GEOMETRY: std::sync::OnceLock<(u32, u32)> = std::sync::OnceLock::new();
    *GEOMETRY.get_or_init(|| {
        (
            crate::env_knob(
                "COMMFUSE_LL_THREADS",
                |t: u32| (64..=512).contains(&t) && t.is_multiple_of(32),
                THREADS,
            ),
            crate::env_knob(
                "COMMFUSE_LL_MAX_BLOCKS",
                |b: u32| (1..=COUNTERS as u32).contains(&b),
                MAX_BLOCKS,
            ),
        )
    })
}

/// Whether LL kernels are launched programmatically (programmatic dependent launch: a call's
/// kernel is scheduled while the kernel before it on the stream finishes, and waits for it on
/// the GPU — `wait_for_prior_grid` in ll.cu), which takes the launch's latency off small
/// calls; `COMMFUSE_PDL=0` launches them the ordinary way, for measuring the difference.
fn programmatic() -> bool {
    static PROGRAMMATIC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROGRAMMATIC.get_or_init(|| crate::env_knob("COMMFUSE_PDL", |v: u32| v <= 1, 1) == 1)
}

/// Mirrors `LlArgs` in ll.cu.
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
    mode: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<LlArgs>() == 8 * MAX_RANKS + 64);
const _: () = assert!(std::mem::offset_of!(LlArgs, timeout_ns) == 8 * MAX_RANKS + 32);

/// `LL_ALL_REDUCE` … in ll.cu: what a call of the kernel does.
fn mode(kind: OpKind) -> Option<u32> {
    match kind {
        OpKind::AllReduce => Some(0),
        OpKind::ReduceScatter => Some(1),
        OpKind::AllGather => Some(2),
        _ => None,
    }
}

/// Whether the LL protocol runs `kind` at all.
pub fn runs(kind: OpKind) -> bool {
    mode(kind).is_some()
}

/// Whether the LL protocol takes `kind` of `bytes` (the op's `count` elements).
pub fn takes(kind: OpKind, bytes: usize) -> Result<(), String> {
    if !runs(kind) {
        return Err(format!(
            "the LL protocol runs all-reduce, reduce-scatter and all-gather only, not {kind}"
        ));
    }
    if bytes > LL_MAX_BYTES {
        return Err(format!(
            "the LL protocol takes messages up to {} MiB, got {bytes} bytes",
            LL_MAX_BYTES >> 20
        ));
    }
    Ok(())
}

/// One rank's LL all-reduce, reduce-scatter or all-gather of `count` elements (as `OpSpec`
/// counts them): its kernel (in its GPU's context), its LL buffer (which its peers store into),
/// its call counters, and the kernel's arguments once the peers' buffers are known.
pub(crate) struct LlRank {
    function: Function,
    /// Read by the peers' kernels: exported to them, freed only after the last call
    pub buffer: DeviceMemory,
    counters: DeviceMemory,
    args: LlArgs,
    blocks: u32,
    threads: u32,
    lines: Lines,
}

impl LlRank {
    /// Rank `rank` of `world` on `gpu`: loads the kernel and allocates the buffer and
    /// counters; [`LlRank::connect`] then names every rank's buffer. `sharing` ranks' kernels
    /// run on this GPU at once (1 but where ranks share a GPU, `CudaBackend::open`).
    pub fn new(
        gpu: &Gpu,
        (rank, world): (usize, usize),
        (kind, count, dtype, reduce): (OpKind, usize, DType, ReduceOp),
        err: u64,
        timeout: Duration,
        (lines, sharing): (Lines, u32),
    ) -> Result<LlRank, CudaError> {
        takes(kind, count * dtype.size()).map_err(CudaError::Unavailable)?;
        // what one sender sends at most: its input, or for an all-gather the longest chunk
        let sent = match kind {
            OpKind::AllGather => count.div_ceil(world),
            _ => count,
        };
        let words = (sent * dtype.size()).div_ceil(4);
        let (threads, max_blocks) = geometry();
        let compiled = nvrtc::compile(nvrtc::kernel("ll.cu").expect("embedded"), false)?;
        // two halves of `world` regions of 16-byte units (`pitch` in ll.cu)
        let units = words.div_ceil(lines.words_per_unit());
        let function = typed_kernel(
            &Module::load(gpu, &compiled.cubin)?,
            lines.entry(),
            dtype,
            reduce,
        )?;
        // a call's blocks wait for the other ranks' kernels, and (launched programmatically)
        // the next call's may already sit beside them: two grids of every rank on this GPU
        // must be resident at once
        let resident = function.max_blocks_per_sm(threads)? * gpu.sm_count;
        let max_blocks = max_blocks.min(resident / (2 * sharing.max(1))).max(1);
        Ok(LlRank {
            function,
            buffer: DeviceMemory::zeroed(gpu, (2 * world * units).max(1) * 16)?,
            counters: DeviceMemory::zeroed(gpu, 8 * COUNTERS)?,
            args: LlArgs {
                bufs: [0; MAX_RANKS],
                input: 0,
                output: 0,
                calls: 0,
                err,
                timeout_ns: timeout.as_nanos() as u64,
                count: count as u32,
                words: words as u32,
                world: world as u32,
                rank: rank as u32,
                mode: mode(kind).expect("takes checked it"),
                pad: 0,
            },
            // one unit per thread
            blocks: (units as u32).div_ceil(threads).clamp(1, max_blocks),
            threads,
            lines,
        })
    }

    /// The line format it moves.
    pub fn lines(&self) -> Lines {
        self.lines
    }

    /// Names every rank's LL buffer as this GPU addresses it (rank order, its own among them).
    pub fn connect(&mut self, buffers: &[u64]) {
        self.args.bufs[..buffers.len()].copy_from_slice(buffers);
        self.args.calls = self.counters.addr();
    }

    /// Queues one call on `stream`: `input` into `output`, of the op's lengths (`OpSpec`'s
    /// `input_len` and `output_len`: an all-reduce's `count` elements each, and its output may
    /// be `input`; a reduce-scatter's output and an all-gather's input this rank's chunk).
    ///
    /// # Safety
    /// `stream` must be a stream of this rank's GPU; `input` and `output` device memory of it
    /// holding those lengths, valid until the call completes; every rank's buffer named in
    /// `connect` must stay valid until then.
    pub unsafe fn launch(&self, stream: &Stream, input: u64, output: u64) -> Result<(), CudaError> {
        if self.args.words == 0 {
            return Ok(());
        }
        let args = LlArgs {
            input,
            output,
            ..self.args
        };
        if programmatic() {
            self.function
                .launch_programmatic(self.blocks, self.threads, stream, &args)
        } else {
            self.function
                .launch(self.blocks, self.threads, stream, &args)
        }
    }
}

/// A timeout the LL kernel of `kind` recorded, in words: who waited for which sender's line
/// of which word, the call's number expected and the number seen.
pub(crate) fn describe_timeout(
    kind: OpKind,
    lines: Lines,
    rec: &ErrorRecord,
    timeout: Duration,
) -> String {
    format!(
        "{kind} ({}): rank {} (block {}) waited for sender {}'s line of word {} to carry call {}, saw call {} after {timeout:?}",
        lines.protocol().name().to_uppercase(),
        rec.rank, rec.lane, rec.step, rec.slot, rec.expected, rec.seen
    )
}

/// Every rank's LL collective for the backend's ranks.
pub(crate) struct LlLauncher {
    ranks: Vec<LlRank>,
    kind: OpKind,
}

/// Prepares the LL collective of `spec` on every rank of `backend`.
pub(crate) fn prepare<'a>(
    backend: &'a CudaBackend,
    spec: &OpSpec,
    (dtype, reduce): (DType, ReduceOp),
    lines: Lines,
) -> Result<Box<dyn PreparedCall + 'a>, BackendError> {
    let ranks = ranks(backend, spec, (dtype, reduce), lines)?;
    let kind = spec.kind;
    let launcher = |_: &[RankBuffers]| Ok(LlLauncher { ranks, kind });
    let sizes = (spec.input_capacity(), spec.output_capacity(), 0);
    boxed_call(backend, dtype, sizes, launcher)
}

/// The LL collective of `spec` for every rank of `backend`, each connected to the others'
/// buffers.
pub(crate) fn ranks(
    backend: &CudaBackend,
    spec: &OpSpec,
    (dtype, reduce): (DType, ReduceOp),
    lines: Lines,
) -> Result<Vec<LlRank>, BackendError> {
    takes(spec.kind, spec.count * dtype.size()).map_err(BackendError::Unavailable)?;
    let world = backend.ranks.len();
    let timeout = backend.timeout();
    let mut ranks = backend
        .ranks
        .iter()
        .enumerate()
        .map(|(r, rank)| {
            LlRank::new(
                &rank.gpu,
                (r, world),
                (spec.kind, spec.count, dtype, reduce),
                backend.error_record(),
                timeout,
                (lines, backend.sharing()),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    // one process: every GPU addresses its peers' memory directly (peer access is enabled)
    let buffers: Vec<u64> = ranks.iter().map(|r| r.buffer.addr()).collect();
    for r in &mut ranks {
        r.connect(&buffers);
    }
    Ok(ranks)
}

impl Launcher for LlLauncher {
    fn launch(&self, bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        let (input, output) = (bufs[r].input.addr(), bufs[r].output.addr());
        // SAFETY: the call's buffers, the LL buffers and counters and the error record outlive
        // the launch (the batch synchronises before anything is dropped)
        unsafe { self.ranks[r].launch(&rank.stream, input, output) }.map_err(BackendError::from)
    }

    fn records_waits(&self) -> bool {
        true
    }

    fn describe_timeout(&self, backend: &CudaBackend, rec: &ErrorRecord) -> BackendError {
        // as the per-process LL collective says it: the sender waited for, the word, the calls
        BackendError::Unavailable(describe_timeout(
            self.kind,
            self.ranks[0].lines(),
            rec,
            backend.timeout(),
        ))
    }
}
