//! Baselines measured in the same run as our kernels, on the same GPUs: NCCL (single-process
//! communicators over all ranks, one host thread per GPU) and the copy engine
//! (`cuMemcpyPeerAsync`). Both are `PreparedCall`s, so the same reference checks them.

use crate::backend::call::{boxed_call, Launcher, RankBuffers};
use crate::backend::gpus::{CudaBackend, Rank};
use crate::error::CudaError;
use crate::sys::nccl::{nccl_op, nccl_type, Comms};
use commfuse_core::backend::{BackendError, CallTiming, PreparedCall};
use commfuse_core::op::chunk_range;
use commfuse_core::{Baseline, DType, OpKind, OpSpec, ReduceOp};
use cudarc::driver::result as drv;
use cudarc::nccl::{result, sys};
use std::ffi::c_void;

/// One NCCL communicator per rank of `backend`: refused where ranks share a GPU.
fn comms_of(backend: &CudaBackend) -> Result<Comms, CudaError> {
    let devs: Vec<i32> = backend.ranks.iter().map(|r| r.gpu.ordinal as i32).collect();
    if backend.sharing() > 1 {
        return Err(CudaError::Unavailable(format!(
            "NCCL takes one rank per GPU, and these ranks share GPUs (devices {devs:?})"
        )));
    }
    Comms::for_devices(&devs)
}

pub(crate) fn prepare<'a>(
    backend: &'a CudaBackend,
    which: Baseline,
    spec: &OpSpec,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Box<dyn PreparedCall + 'a>, BackendError> {
    let kind = match which {
        Baseline::Nccl => Kind::Nccl,
        Baseline::CopyEngine => Kind::CopyEngine,
    };
    let name = which.name();
    if !which.implements(spec.kind) {
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
            .get_or_init(|| comms_of(backend).map_err(|e| e.to_string()));
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
