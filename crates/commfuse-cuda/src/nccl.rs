//! Baselines measured in the same run as our kernels, on the same GPUs: NCCL (single-process
//! communicators over all ranks, one host thread per GPU) and the copy engine
//! (`cuMemcpyPeerAsync`). Both are `PreparedCall`s, so the same reference checks them.
//!
//! NCCL runs as its environment configures it (`NCCL_*` variables); [`configuration`] says how,
//! for a bench's header. The `commfuse` binary defaults `NCCL_NVLS_ENABLE` to 0 (no NVLink
//! multicast) where the environment leaves it unset.

use crate::backend::{boxed_call, CudaBackend, Launcher, Rank, RankBuffers};
use crate::error::CudaError;
use commfuse_core::backend::{BackendError, CallTiming, PreparedCall};
use commfuse_core::op::chunk_range;
use commfuse_core::{DType, OpKind, OpSpec, ReduceOp};
use cudarc::driver::result as drv;
use cudarc::nccl::{result, sys};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether NCCL may start here: libnccl on the library path.
pub(crate) fn usable() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen libnccl
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "NCCL (libnccl.so) is not on the library path".into(),
        ));
    }
    Ok(())
}

/// How NCCL is configured in this process, as one line for a bench's header: its version (or
/// why it cannot run) and every `NCCL_*` variable set, in name order.
pub fn configuration() -> String {
    let version = match usable() {
        Err(e) => format!("not usable: {e}"),
        Ok(()) => match result::get_nccl_version() {
            Ok(v) => format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100),
            Err(e) => format!("version unknown: {e:?}"),
        },
    };
    let mut vars: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NCCL_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    vars.sort();
    let vars = if vars.is_empty() {
        "no NCCL_* variables set".to_string()
    } else {
        vars.join(" ")
    };
    format!("NCCL {version}; {vars}")
}

/// `ncclReduceScatter` (sum) of `count` elements per rank from `send` (P·count) into `recv` on
/// communicator `comm`, queued on `stream`.
///
/// # Safety
/// `comm` must be a live communicator; both buffers device memory of its GPU of those sizes,
/// valid until the call completes on `stream`.
pub(crate) unsafe fn reduce_scatter_on(
    comm: sys::ncclComm_t,
    (send, recv, count): (u64, u64, usize),
    dtype: DType,
    stream: &crate::driver::Stream,
) -> Result<(), CudaError> {
    result::reduce_scatter(
        send as *const c_void,
        recv as *mut c_void,
        count,
        nccl_type(dtype),
        nccl_op(ReduceOp::Sum),
        comm,
        stream.raw() as sys::cudaStream_t,
    )
    .map(|_| ())
    .map_err(|e| CudaError::Nccl {
        call: "ncclReduceScatter",
        message: format!("{e:?}"),
    })
}

/// One NCCL communicator per rank.
pub struct Comms {
    comms: Vec<sys::ncclComm_t>,
    /// `ncclCommAbort` freed them: never use or destroy them again
    aborted: AtomicBool,
}

// SAFETY: each communicator is used by one thread at a time (its GPU's thread).
unsafe impl Send for Comms {}
unsafe impl Sync for Comms {}

impl Comms {
    fn new(backend: &CudaBackend) -> Result<Comms, CudaError> {
        let devs: Vec<i32> = backend.ranks.iter().map(|r| r.gpu.ordinal as i32).collect();
        if backend.sharing() > 1 {
            return Err(CudaError::Unavailable(format!(
                "NCCL takes one rank per GPU, and these ranks share GPUs (devices {devs:?})"
            )));
        }
        Comms::for_devices(&devs)
    }

    /// One communicator per GPU of `devs` (rank r on `devs[r]`), in this process.
    pub(crate) fn for_devices(devs: &[i32]) -> Result<Comms, CudaError> {
        usable()?;
        let mut comms = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: out-array of ndev communicators, device list of ndev ordinals
        unsafe { result::comm_init_all(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
            .map_err(|e| CudaError::Nccl {
                call: "ncclCommInitAll",
                message: format!("{e:?}"),
            })?;
        Ok(Comms {
            comms,
            aborted: AtomicBool::new(false),
        })
    }

    /// The communicator of rank `r`, unless they were aborted.
    fn comm(&self, r: usize) -> Result<sys::ncclComm_t, BackendError> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(BackendError::Unavailable(
                "the NCCL communicators were aborted after a failed call: reopen the backend"
                    .into(),
            ));
        }
        Ok(self.comms[r])
    }

    /// `ncclReduceScatter` of `count` elements per rank from `send` (P·count) into `recv` on
    /// rank `r`'s `stream`.
    ///
    /// # Safety
    /// Both buffers must be device memory of rank r's GPU of those sizes, valid until the
    /// call completes on `stream`.
    pub(crate) unsafe fn reduce_scatter_raw(
        &self,
        r: usize,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: &crate::driver::Stream,
    ) -> Result<(), CudaError> {
        let comm = self
            .comm(r)
            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
        reduce_scatter_on(comm, (send, recv, count), dtype, stream)
    }

    /// `ncclAllGather` of `count` elements per rank from `send` into `recv` (P·count) on rank
    /// `r`'s `stream`.
    ///
    /// # Safety
    /// Both buffers must be device memory of rank r's GPU of those sizes, valid until the
    /// call completes on `stream`.
    pub(crate) unsafe fn all_gather_raw(
        &self,
        r: usize,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: &crate::driver::Stream,
    ) -> Result<(), CudaError> {
        let comm = self
            .comm(r)
            .map_err(|e| CudaError::Unavailable(e.to_string()))?;
        result::all_gather(
            send as *const c_void,
            recv as *mut c_void,
            count,
            nccl_type(dtype),
            comm,
            stream.raw() as sys::cudaStream_t,
        )
        .map(|_| ())
        .map_err(|e| CudaError::Nccl {
            call: "ncclAllGather",
            message: format!("{e:?}"),
        })
    }

    /// Aborts every communicator (once): NCCL kernels waiting for a rank that failed give up,
    /// which our error record cannot make them do. Called only with no host thread inside an
    /// NCCL call (after a batch's threads have ended).
    pub(crate) fn abort(&self) {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        for c in &self.comms {
            // SAFETY: live communicators, no NCCL call in flight on the host; freed by this
            unsafe {
                let _ = result::comm_abort(*c);
            }
        }
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if *self.aborted.get_mut() {
            return;
        }
        for c in &self.comms {
            // SAFETY: communicators from ncclCommInitAll, idle
            unsafe {
                let _ = result::comm_destroy(*c);
            }
        }
    }
}

/// The baselines an op has.
pub fn baselines(op: OpKind) -> Vec<&'static str> {
    match op {
        OpKind::AllReduce | OpKind::ReduceScatter => vec!["nccl"],
        OpKind::AllGather | OpKind::Broadcast | OpKind::AllToAll => vec!["nccl", "copy-engine"],
        OpKind::Barrier => vec![],
    }
}

pub(crate) fn prepare<'a>(
    backend: &'a CudaBackend,
    name: &str,
    spec: &OpSpec,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Box<dyn PreparedCall + 'a>, BackendError> {
    let kind = match name {
        "nccl" => Kind::Nccl,
        "copy-engine" => Kind::CopyEngine,
        _ => return Err(BackendError::Unavailable(format!("no baseline '{name}'"))),
    };
    if !baselines(spec.kind).contains(&name) {
        return Err(BackendError::Unavailable(format!(
            "{} has no {name} baseline",
            spec.kind
        )));
    }
    let p = spec.world;
    if matches!(spec.kind, OpKind::ReduceScatter | OpKind::AllGather)
        && kind == Kind::Nccl
        && !spec.count.is_multiple_of(p)
    {
        return Err(BackendError::Unavailable(format!(
            "NCCL's {} needs a count divisible by {p}",
            spec.kind
        )));
    }
    if kind == Kind::Nccl {
        let comms = backend
            .nccl
            .get_or_init(|| Comms::new(backend).map_err(|e| e.to_string()));
        if let Err(e) = comms {
            return Err(BackendError::Unavailable(e.clone()));
        }
    }
    let sizes = (spec.input_capacity(), spec.output_capacity(), 0);
    let launcher = |_: &[RankBuffers]| {
        Ok(BaselineLauncher {
            backend,
            kind,
            spec: *spec,
            dtype,
            reduce,
        })
    };
    boxed_call(backend, dtype, sizes, launcher)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Nccl,
    CopyEngine,
}

/// A baseline enqueued on every GPU.
struct BaselineLauncher<'a> {
    backend: &'a CudaBackend,
    kind: Kind,
    spec: OpSpec,
    dtype: DType,
    reduce: ReduceOp,
}

fn nccl_type(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

fn nccl_op(r: ReduceOp) -> sys::ncclRedOp_t {
    match r {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
    }
}

fn nccl_err(call: &'static str) -> impl Fn(result::NcclError) -> BackendError {
    move |e| BackendError::Unavailable(format!("NCCL call {call} failed: {e:?}"))
}

impl BaselineLauncher<'_> {
    /// Issues one call on rank `r`'s stream.
    fn issue(&self, bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        let eb = self.dtype.size();
        let (spec, p) = (&self.spec, self.spec.world);
        let b = &bufs[r];
        let (input, output) = (b.input.addr(), b.output.addr());
        let stream = rank.stream.raw();
        let dt = nccl_type(self.dtype);
        match self.kind {
            Kind::Nccl => {
                let comm = self
                    .backend
                    .nccl
                    .get()
                    .and_then(|c| c.as_ref().ok())
                    .ok_or_else(|| BackendError::Unavailable("NCCL was not initialised".into()))?
                    .comm(r)?;
                let nstream = stream as sys::cudaStream_t;
                let send = input as *const c_void;
                let recv = output as *mut c_void;
                // SAFETY: buffers sized from the spec on this rank's GPU; comm belongs to it
                unsafe {
                    match spec.kind {
                        OpKind::AllReduce => {
                            result::all_reduce(
                                send,
                                recv,
                                spec.count,
                                dt,
                                nccl_op(self.reduce),
                                comm,
                                nstream,
                            )
                            .map_err(nccl_err("ncclAllReduce"))?;
                        }
                        OpKind::ReduceScatter => {
                            result::reduce_scatter(
                                send,
                                recv,
                                spec.count / p,
                                dt,
                                nccl_op(self.reduce),
                                comm,
                                nstream,
                            )
                            .map_err(nccl_err("ncclReduceScatter"))?;
                        }
                        OpKind::AllGather => {
                            result::all_gather(send, recv, spec.count / p, dt, comm, nstream)
                                .map_err(nccl_err("ncclAllGather"))?;
                        }
                        OpKind::Broadcast => {
                            result::broadcast(
                                send,
                                recv,
                                spec.count,
                                dt,
                                spec.root as i32,
                                comm,
                                nstream,
                            )
                            .map_err(nccl_err("ncclBroadcast"))?;
                        }
                        OpKind::AllToAll => {
                            result::group_start().map_err(nccl_err("ncclGroupStart"))?;
                            let mine = chunk_range(spec.count, p, r).len();
                            for q in 0..p {
                                let c = chunk_range(spec.count, p, q);
                                result::send(
                                    (input + (c.start * eb) as u64) as *const c_void,
                                    c.len(),
                                    dt,
                                    q as i32,
                                    comm,
                                    nstream,
                                )
                                .map_err(nccl_err("ncclSend"))?;
                                result::recv(
                                    (output + (q * mine * eb) as u64) as *mut c_void,
                                    mine,
                                    dt,
                                    q as i32,
                                    comm,
                                    nstream,
                                )
                                .map_err(nccl_err("ncclRecv"))?;
                            }
                            result::group_end().map_err(nccl_err("ncclGroupEnd"))?;
                        }
                        OpKind::Barrier => unreachable!("no NCCL barrier baseline"),
                    }
                }
            }
            Kind::CopyEngine => {
                // every transfer is pushed by its source rank
                let copy = |dst: u64,
                            dst_rank: usize,
                            src: u64,
                            bytes: usize|
                 -> Result<(), BackendError> {
                    if bytes == 0 {
                        return Ok(());
                    }
                    let dctx = self.backend.ranks[dst_rank].gpu.raw_ctx();
                    // SAFETY: both ranges lie inside buffers allocated for this spec
                    unsafe {
                        drv::memcpy_peer_async(dctx, dst, rank.gpu.raw_ctx(), src, bytes, stream)
                    }
                    .map_err(|e| {
                        BackendError::Unavailable(format!("cuMemcpyPeerAsync failed: {e:?}"))
                    })
                };
                match spec.kind {
                    OpKind::AllGather => {
                        let c = chunk_range(spec.count, p, r);
                        for (q, to) in bufs.iter().enumerate() {
                            copy(
                                to.output.addr() + (c.start * eb) as u64,
                                q,
                                input,
                                c.len() * eb,
                            )?;
                        }
                    }
                    OpKind::Broadcast if r == spec.root => {
                        for (q, to) in bufs.iter().enumerate() {
                            copy(to.output.addr(), q, input, spec.count * eb)?;
                        }
                    }
                    OpKind::Broadcast => {}
                    OpKind::AllToAll => {
                        for (q, to) in bufs.iter().enumerate() {
                            let c = chunk_range(spec.count, p, q);
                            let at = r * c.len() * eb;
                            copy(
                                to.output.addr() + at as u64,
                                q,
                                input + (c.start * eb) as u64,
                                c.len() * eb,
                            )?;
                        }
                    }
                    _ => unreachable!("copy-engine baseline only for data movement ops"),
                }
            }
        }
        Ok(())
    }
}

impl Launcher for BaselineLauncher<'_> {
    fn launch(&self, bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        self.issue(bufs, r, rank)
    }

    /// Peer copies between two contexts cannot be captured into one stream's graph.
    fn capturable(&self) -> bool {
        self.kind != Kind::CopyEngine
    }

    fn after(
        &self,
        backend: &CudaBackend,
        result: Result<Vec<CallTiming>, BackendError>,
    ) -> Result<Vec<CallTiming>, BackendError> {
        if self.kind == Kind::CopyEngine && result.is_ok() {
            // pushes into a peer finish on the pusher's stream: wait for all before reading
            // (bounded; an error path has already stopped every stream)
            backend.wait_streams()?;
        }
        result
    }
}

#[cfg(test)]
mod configuration_tests {
    #[test]
    fn the_configuration_line_names_the_version_or_why_not_and_every_nccl_variable() {
        std::env::set_var("NCCL_COMMFUSE_CONFIGURATION_TEST", "7");
        let line = super::configuration();
        assert!(line.starts_with("NCCL "), "{line}");
        assert!(
            line.contains("NCCL_COMMFUSE_CONFIGURATION_TEST=7"),
            "{line}"
        );
        assert!(!line.contains('\n'), "one line: {line}");
        // SAFETY: only tries to dlopen libnccl
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            assert!(line.contains("not usable"), "{line}");
        }
    }
}
