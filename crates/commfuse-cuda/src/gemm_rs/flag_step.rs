//! Ordering library work across GPUs from streams: one-thread kernels (`ring_flag` in
//! gemm_rs.cu) queued between cuBLASLt GEMMs and copy-engine copies, each waiting
//! (acquire, bounded, diagnosed) until a flag of this rank holds a value and/or raising a flag
//! (release, system scope) on any GPU; and the hand-on copy of a buffer into a peer's memory.
//! The overlapped paths of GEMM + reduce-scatter and all-gather + GEMM are built from these.

use crate::backend::plan_table::ErrorRecord;
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Function, Gpu, MappedHost, Module, Stream};
use crate::sys::nvrtc;
use std::time::Duration;

/// Mirrors `RingFlagArgs` in gemm_rs.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FlagArgs {
    wait: u64,
    wait_value: u64,
    raise: u64,
    raise_value: u64,
    err: u64,
    timeout_ns: u64,
    wait_cmp: u32,
    rank: u32,
    step: u32,
    index: u32,
    calls: u64,
}
const _: () = assert!(std::mem::size_of::<FlagArgs>() == 72);
const _: () = assert!(std::mem::offset_of!(FlagArgs, wait_cmp) == 48);
const _: () = assert!(std::mem::offset_of!(FlagArgs, calls) == 64);

/// `FLAG_RAISE_FIRST` in gemm_rs.cu: raise before waiting.
const RAISE_FIRST: u32 = 0x100;
/// `FLAG_ADVANCE` in gemm_rs.cu: the step ends the call (advances the call counter).
const ADVANCE: u32 = 0x200;

/// With steps numbered on the device ([`FlagSteps::numbered_on_device`]), the value that
/// stands for this call's number.
pub const THIS_CALL: u64 = 1;

/// One flag step: wait until a flag of this rank compares true with a value, raise a flag (on
/// any GPU) to a value, or both; with numbered steps, values count from the calls finished.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlagStep {
    /// This GPU's flag, the value, the comparison
    pub wait: Option<(u64, u64, FlagCmp)>,
    /// The flag (any GPU with peer access) and the value
    pub raise: Option<(u64, u64)>,
    /// Raise before waiting (a rank's end-of-call "done", raised on one peer and awaited from
    /// another, in one launch)
    pub raise_first: bool,
    /// The call's last step: with numbered steps it counts the call finished
    pub ends_call: bool,
}

/// How a wait compares (SignalCmp in common.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagCmp {
    Eq = 0,
    Ge = 1,
}

/// What a wait that timed out recorded: which rank, the caller's step and flag index, the value
/// it waited for and the last it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlagTimeout {
    pub rank: u32,
    pub step: u32,
    pub index: u32,
    pub expected: u64,
    pub seen: u64,
}

/// A rank's flag kernel and the host-mapped record its waits write when they time out.
pub struct FlagSteps {
    function: Function,
    error: MappedHost<ErrorRecord>,
    /// The count of calls finished, for steps numbered on the device
    calls: Option<DeviceMemory>,
    timeout: Duration,
    rank: u32,
}

impl FlagSteps {
    /// Loads the kernel on `gpu` for rank `rank`, waits bounded by `timeout`; values are as
    /// the host gives them.
    pub fn new(gpu: &Gpu, rank: usize, timeout: Duration) -> Result<FlagSteps, CudaError> {
        let compiled = nvrtc::compile(nvrtc::kernel("gemm_rs.cu").expect("embedded"), false)?;
        let module = Module::load(gpu, &compiled.cubin)?;
        Ok(FlagSteps {
            function: module.function("ring_flag")?,
            error: MappedHost::new(gpu, ErrorRecord::default())?,
            calls: None,
            timeout,
            rank: rank as u32,
        })
    }

    /// As [`FlagSteps::new`], but the steps number their calls on the device: every value
    /// given is added to the count of calls finished (so [`THIS_CALL`] is this call's number)
    /// and each call's last step ([`FlagStep::ends_call`]) advances that count. Such calls may
    /// be captured into a CUDA graph and replayed, each replay a new call.
    pub fn numbered_on_device(
        gpu: &Gpu,
        rank: usize,
        timeout: Duration,
    ) -> Result<FlagSteps, CudaError> {
        let mut steps = FlagSteps::new(gpu, rank, timeout)?;
        steps.calls = Some(DeviceMemory::zeroed(gpu, 8)?);
        Ok(steps)
    }

    /// Where the steps keep their count of finished calls (a u64 of this GPU), when they
    /// number calls on the device: what other work of the same calls reads its number from
    /// (`gemm::CallNumber::Counted`).
    pub fn counter(&self) -> Option<u64> {
        self.calls.as_ref().map(DeviceMemory::addr)
    }

    /// Queues `step` on `stream`. `step` and `index` of `at` are the caller's words for the
    /// diagnosis of a wait that times out.
    ///
    /// # Safety
    /// The flags must be live 8-byte device words (a raised one on any GPU with peer access)
    /// until the kernel has run.
    pub unsafe fn queue_step(
        &self,
        stream: &Stream,
        step: FlagStep,
        (at_step, index): (usize, usize),
    ) -> Result<(), CudaError> {
        let (wait, wait_value, cmp) = step.wait.unwrap_or((0, 0, FlagCmp::Eq));
        let (raise, raise_value) = step.raise.unwrap_or((0, 0));
        let bits = if step.raise_first { RAISE_FIRST } else { 0 }
            | if step.ends_call { ADVANCE } else { 0 };
        let args = FlagArgs {
            wait,
            wait_value,
            raise,
            raise_value,
            err: self.error.device_addr(),
            timeout_ns: self.timeout.as_nanos() as u64,
            wait_cmp: cmp as u32 | bits,
            rank: self.rank,
            step: at_step as u32,
            index: index as u32,
            calls: self.calls.as_ref().map_or(0, DeviceMemory::addr),
        };
        self.function.launch(1, 32, stream, &args)
    }

    /// Queues on `stream`: wait until the flag at `wait` (this GPU's) compares true with the
    /// value, then (if it did not time out) raise the flag at `raise` to its value.
    ///
    /// # Safety
    /// As [`FlagSteps::queue_step`].
    pub unsafe fn queue(
        &self,
        stream: &Stream,
        wait: Option<(u64, u64, FlagCmp)>,
        raise: Option<(u64, u64)>,
        at: (usize, usize),
    ) -> Result<(), CudaError> {
        let step = FlagStep {
            wait,
            raise,
            ..FlagStep::default()
        };
        self.queue_step(stream, step, at)
    }

    /// The first wait that timed out, if any (read after the stream synchronised).
    pub fn timeout(&self) -> Option<FlagTimeout> {
        let e = self.error.read();
        (e.flag != 0).then_some(FlagTimeout {
            rank: e.rank,
            step: e.step,
            index: e.slot,
            expected: e.expected,
            seen: e.seen,
        })
    }

    /// Makes every wait still spinning give up (an operator being dropped after a failure).
    pub fn abort(&self) {
        self.error.raise_abort();
    }
}

/// Where a peer's memory lives: its address and the raw `CUcontext` of this process it belongs
/// to (0 when it is mapped into this rank's own context, as memory shared between processes is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerMemory {
    pub addr: u64,
    pub context: u64,
}

/// Queues the copy of `bytes` from `from` to `to` on `stream`: a peer copy naming both contexts
/// when they differ (see [`Stream::copy_peer_async`]), a plain copy otherwise.
///
/// # Safety
/// Both ranges must stay valid until the copy completes.
pub unsafe fn hand_on(
    stream: &Stream,
    to: PeerMemory,
    from: PeerMemory,
    bytes: usize,
) -> Result<(), CudaError> {
    if to.context == 0 || from.context == 0 || to.context == from.context {
        return stream.copy_async(to.addr, from.addr, bytes);
    }
    let ctx = |c: u64| c as usize as cudarc::driver::sys::CUcontext;
    stream.copy_peer_async(
        (ctx(to.context), to.addr),
        (ctx(from.context), from.addr),
        bytes,
    )
}
