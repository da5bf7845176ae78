//! NCCL in this process: whether it can start, how it is configured, one communicator per GPU,
//! the raw reduce-scatter and all-gather that the operators queue on them, one rank's
//! communicator of a group spread over processes ([`RankComm`]: non-blocking, so that every host
//! wait on it is bounded), and the list of baselines each op has (prepared as calls by the
//! backend's `baselines` module).
//!
//! NCCL runs as its environment configures it (`NCCL_*` variables); [`configuration`] says how,
//! for a bench's header. The `commfuse` binary defaults `NCCL_NVLS_ENABLE` to 0 (no NVLink
//! multicast) where the environment leaves it unset.

use crate::error::CudaError;
use commfuse_core::backend::BackendError;
use commfuse_core::{DType, OpKind, ReduceOp};
use cudarc::nccl::{result, sys};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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
    stream: &crate::sys::driver::Stream,
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

/// The configuration of a non-blocking communicator: what `NCCL_CONFIG_INITIALIZER` gives (every
/// field undefined, so that NCCL takes it from its environment as for `ncclCommInitRank`), with
/// `blocking = 0` only.
fn non_blocking_config() -> sys::ncclConfig_t {
    // NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR
    const UNDEF: c_int = c_int::MIN;
    let unset = std::ptr::null();
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 28, 0): the layout of these bindings' struct
        version: 22800,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: unset,
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: unset,
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// One look at a non-blocking communicator's state (what `ncclCommGetAsyncError` or the call
/// itself returned): done, still in progress, or failed (the failure's name).
fn settled(state: sys::ncclResult_t) -> Result<bool, String> {
    match state {
        sys::ncclResult_t::ncclSuccess => Ok(true),
        sys::ncclResult_t::ncclInProgress => Ok(false),
        failed => Err(format!("{failed:?}")),
    }
}

/// Polls `state` ([`settled`]) until the work in progress is done, for at most `limit`: past
/// it, [`CudaError::stalled`] saying that `who` waited on `what`; a failure is an NCCL error of
/// `call` naming both.
fn wait_settled(
    limit: Duration,
    (who, what): (&str, &str),
    call: &'static str,
    mut state: impl FnMut() -> sys::ncclResult_t,
) -> Result<(), CudaError> {
    let done = crate::sys::host_sync::poll_until(limit, || settled(state())).map_err(|failed| {
        CudaError::Nccl {
            call,
            message: format!("{failed} while {who} waited for {what}"),
        }
    })?;
    match done {
        true => Ok(()),
        false => Err(CudaError::stalled(who, what, limit)),
    }
}

/// One rank's communicator of a group whose ranks may be other processes, made non-blocking
/// (`ncclCommInitRankConfig` with `blocking = 0`, NCCL otherwise as its environment configures
/// it): joining it, queueing a collective on it (which in this mode may return "in progress",
/// e.g. while NCCL connects to the peers at a first call) and freeing it are polled
/// (`ncclCommGetAsyncError`) for at most the owner's limit, and a wait that runs out aborts the
/// communicator (`ncclCommAbort`, which also ends its kernels still waiting for a peer) instead
/// of leaving a thread or the caller blocked in NCCL.
pub(crate) struct RankComm {
    raw: sys::ncclComm_t,
    /// `ncclCommAbort` freed it (or it was never made): never use or free it again
    aborted: bool,
    /// The owner and rank, as errors name them
    who: String,
    limit: Duration,
}

// SAFETY: a communicator is used by one thread at a time (its owner's, through &mut)
unsafe impl Send for RankComm {}

impl RankComm {
    /// Joins rank `rank` of `world` to the communicator of rank 0's `id` on the GPU bound to
    /// this thread, waiting at most `limit` for every rank to join; `who` names the owner and
    /// rank in errors.
    pub(crate) fn join(
        id: sys::ncclUniqueId,
        (rank, world): (usize, usize),
        limit: Duration,
        who: String,
    ) -> Result<RankComm, CudaError> {
        usable()?;
        let mut config = non_blocking_config();
        let mut raw = std::ptr::null_mut();
        // SAFETY: an out-pointer to a communicator, rank 0's id, a config laid out as
        // NCCL_CONFIG_INITIALIZER makes it
        let started = unsafe {
            sys::ncclCommInitRankConfig(&mut raw, world as c_int, id, rank as c_int, &mut config)
        };
        let mut comm = RankComm {
            aborted: raw.is_null(),
            raw,
            who,
            limit,
        };
        let peers = world - 1;
        let what = format!(
            "its {peers} peer{} to join the NCCL communicator",
            if peers == 1 { "" } else { "s" }
        );
        comm.settle("ncclCommInitRankConfig", started, &what)?;
        Ok(comm)
    }

    /// After a call on the communicator returned `started`: waits until the communicator has
    /// settled; on a failure or past the limit, aborts it.
    fn settle(
        &mut self,
        call: &'static str,
        started: sys::ncclResult_t,
        what: &str,
    ) -> Result<(), CudaError> {
        let raw = self.raw;
        let mut first = Some(started);
        let result = wait_settled(self.limit, (&self.who, what), call, || {
            // the call's own answer first: a failure or success there needs no poll
            match first.take() {
                Some(state) if state != sys::ncclResult_t::ncclInProgress => state,
                _ if raw.is_null() => sys::ncclResult_t::ncclInvalidUsage,
                _ => {
                    let mut state = sys::ncclResult_t::ncclSuccess;
                    // SAFETY: a live communicator (not aborted: checked by the callers)
                    match unsafe { sys::ncclCommGetAsyncError(raw, &mut state) } {
                        sys::ncclResult_t::ncclSuccess => state,
                        failed => failed,
                    }
                }
            }
        });
        if result.is_err() {
            self.abort();
        }
        result
    }

    /// Frees the communicator at once, ending its kernels (once).
    fn abort(&mut self) {
        if !self.aborted {
            // SAFETY: a live communicator, no NCCL call of ours in flight on it
            unsafe {
                let _ = sys::ncclCommAbort(self.raw);
            }
            self.aborted = true;
        }
    }

    /// `ncclReduceScatter` (sum) of `count` elements per rank from `send` (P·count) into `recv`,
    /// queued on `stream`; waits (bounded) until NCCL has queued it.
    ///
    /// # Safety
    /// Both buffers must be device memory of the communicator's GPU of those sizes, valid
    /// until the call completes on `stream`; the GPU's context bound.
    pub(crate) unsafe fn reduce_scatter(
        &mut self,
        (send, recv, count): (u64, u64, usize),
        dtype: DType,
        stream: &crate::sys::driver::Stream,
    ) -> Result<(), CudaError> {
        if self.aborted {
            return Err(CudaError::Unavailable(format!(
                "{}: its NCCL communicator was aborted after an earlier failure: build a new operator",
                self.who
            )));
        }
        let started = sys::ncclReduceScatter(
            send as *const c_void,
            recv as *mut c_void,
            count,
            nccl_type(dtype),
            nccl_op(ReduceOp::Sum),
            self.raw,
            stream.raw() as sys::cudaStream_t,
        );
        let what = format!("NCCL to queue its reduce-scatter of {count} elements per rank");
        self.settle("ncclReduceScatter", started, &what)
    }
}

impl Drop for RankComm {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        // finalising waits for the communicator's work in flight; a kernel that never ends (a
        // peer gone) must not hang the drop: past the limit, abort
        // SAFETY: a live communicator; the owner's last call has been waited for (bounded)
        let started = unsafe { sys::ncclCommFinalize(self.raw) };
        let what = "its NCCL work in flight to finish before freeing the communicator";
        match self.settle("ncclCommFinalize", started, what) {
            // SAFETY: finalised, not aborted
            Ok(()) => unsafe {
                let _ = sys::ncclCommDestroy(self.raw);
            },
            Err(e) => eprintln!("commfuse: {e}; aborted the communicator"),
        }
    }
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
        stream: &crate::sys::driver::Stream,
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
        stream: &crate::sys::driver::Stream,
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
mod non_blocking_tests {
    use super::*;
    use sys::ncclResult_t::*;

    #[test]
    fn the_config_is_nccls_initializer_with_blocking_off() {
        let c = non_blocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 22800, 0));
        // everything else left to NCCL's environment
        for unset in [
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.splitShare,
            c.trafficClass,
            c.collnetEnable,
            c.CTAPolicy,
            c.shrinkShare,
            c.nvlsCTAs,
            c.nChannelsPerNetPeer,
            c.nvlinkCentricSched,
        ] {
            assert_eq!(unset, c_int::MIN);
        }
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn in_progress_is_polled_until_it_settles() {
        let mut states = vec![ncclSuccess, ncclInProgress, ncclInProgress, ncclInProgress];
        let mut polls = 0;
        wait_settled(Duration::from_secs(30), ("rank 0", "x"), "call", || {
            polls += 1;
            states.pop().unwrap()
        })
        .unwrap();
        assert_eq!(polls, 4);
    }

    #[test]
    fn a_wait_that_never_settles_ends_naming_who_waited_on_what() {
        let limit = Duration::from_millis(50);
        let started = std::time::Instant::now();
        let who = "GEMM + reduce-scatter (unfused) rank 1";
        let e = wait_settled(
            limit,
            (who, "its 3 peers to join the NCCL communicator"),
            "c",
            || ncclInProgress,
        )
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(e, CudaError::Stalled(_)));
        assert_eq!(
            e.to_string(),
            "GEMM + reduce-scatter (unfused) rank 1 waited 50ms for its 3 peers to join the NCCL communicator, which had not finished"
        );
    }

    #[test]
    fn a_failure_while_in_progress_names_the_call_who_and_what() {
        let mut states = vec![ncclRemoteError, ncclInProgress];
        let e = wait_settled(
            Duration::from_secs(30),
            ("rank 2", "NCCL to queue its reduce-scatter"),
            "ncclReduceScatter",
            || states.pop().unwrap(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "NCCL call ncclReduceScatter failed: ncclRemoteError while rank 2 waited for NCCL to queue its reduce-scatter"
        );
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
