//! NCCL in this process: whether it can start, how it is configured, one communicator per GPU,
//! the raw reduce-scatter and all-gather that the operators queue on them, and the list of
//! baselines each op has (prepared as calls by the `baselines` module).
//!
//! NCCL runs as its environment configures it (`NCCL_*` variables); [`configuration`] says how,
//! for a bench's header. The `commfuse` binary defaults `NCCL_NVLS_ENABLE` to 0 (no NVLink
//! multicast) where the environment leaves it unset.

use crate::error::CudaError;
use commfuse_core::backend::BackendError;
use commfuse_core::{DType, OpKind, ReduceOp};
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
    pub(crate) fn comm(&self, r: usize) -> Result<sys::ncclComm_t, BackendError> {
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

pub(crate) fn nccl_type(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

pub(crate) fn nccl_op(r: ReduceOp) -> sys::ncclRedOp_t {
    match r {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
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
