//! The unfused path of GEMM + reduce-scatter: cuBLASLt's GEMM of the rank's whole partial
//! product, then NCCL's reduce-scatter of it, both on the caller's stream — exactly the
//! baseline a user would write, taken where the reduce-scatter is too short to hide
//! profitably (see `commfuse_core::fused::gemm_rs::choose_path`), so that `auto` is never slower
//! than that baseline.
//!
//! The product is laid out as P row blocks of ⌈M/P⌉ rows (block q: owner q's rows), so that
//! NCCL's equal split leaves owner r's rows, summed, at the start of block r; a ragged M gets
//! one GEMM per owner and its short chunks pass through a receive buffer. Rank 0's GEMM adds the
//! bias, so the sum holds it once. The simulator's twin is `commfuse_sim::unfused_rs`.
//!
//! The communicator is made at the first unfused call (every rank of the group reaches it in
//! the same call), from the NCCL unique id rank 0 drew when it was allocated and shared with its
//! peers' addresses or its export; that wait is bounded. NCCL's own waits inside its kernels are
//! not: a peer that dies mid-call leaves this rank's NCCL kernel waiting, as with any NCCL call.

use crate::cublaslt::Lt;
use crate::driver::{DeviceMemory, Gpu, Stream};
use crate::error::CudaError;
use crate::gemm_rs::GemmRsConfig;
use commfuse_core::gemm::GemmProblem;
use commfuse_core::op::chunk_range;
use cudarc::nccl::{result, sys};
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;

/// A rank-0 NCCL unique id as peers carry it (zero: no NCCL where rank 0 was built).
pub type NcclId = [u8; NCCL_ID_BYTES];

/// A fresh NCCL unique id, or None where NCCL cannot run (no libnccl).
pub(crate) fn draw_nccl_id() -> Option<NcclId> {
    crate::nccl::usable().ok()?;
    let id = result::get_uniqueid().ok()?;
    let mut out = [0u8; NCCL_ID_BYTES];
    for (o, i) in out.iter_mut().zip(id.internal.iter()) {
        *o = *i as u8;
    }
    Some(out)
}

/// One rank's NCCL communicator.
struct Comm(sys::ncclComm_t);

// SAFETY: a communicator is used by one thread at a time (the operator's owner)
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitRank; the operator's last call has ended (the owner
        // waits for it before dropping)
        unsafe {
            let _ = result::comm_destroy(self.0);
        }
    }
}

/// The unfused path of one rank.
pub(crate) struct UnfusedPath {
    rank: usize,
    world: usize,
    config: GemmRsConfig,
    id: NcclId,
    comm: Option<Comm>,
    /// cuBLASLt per operand alignment (bytes): its heuristic's candidates depend on it, and
    /// whole allocations (256) get faster ones than row pieces
    lts: HashMap<u32, Lt>,
    /// P blocks of ⌈max_m/P⌉ rows × N (output type), made at the first call
    product: Option<DeviceMemory>,
    /// ⌈max_m/P⌉ rows × N: a short chunk's landing place
    received: Option<DeviceMemory>,
    gpu: Arc<Gpu>,
}

impl UnfusedPath {
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        rank: usize,
        world: usize,
        config: GemmRsConfig,
        id: NcclId,
    ) -> Result<UnfusedPath, CudaError> {
        Ok(UnfusedPath {
            rank,
            world,
            config,
            id,
            comm: None,
            lts: HashMap::new(),
            product: None,
            received: None,
            gpu,
        })
    }

    /// Joins the group's communicator (at the first call, on every rank), waiting at most
    /// `limit` for the peers.
    fn communicator(&mut self, limit: Duration) -> Result<sys::ncclComm_t, CudaError> {
        if let Some(c) = &self.comm {
            return Ok(c.0);
        }
        let mut id = sys::ncclUniqueId {
            internal: [0; NCCL_ID_BYTES],
        };
        for (i, b) in id.internal.iter_mut().zip(self.id) {
            *i = b as _;
        }
        let (world, rank, gpu) = (self.world as i32, self.rank as i32, self.gpu.clone());
        let (send, receive) = mpsc::channel();
        // on a thread of its own: ncclCommInitRank blocks until every rank has joined, and a
        // peer that never joins must not hang this one
        std::thread::spawn(move || {
            let made = gpu.bind().and_then(|()| {
                let mut comm = std::ptr::null_mut();
                // SAFETY: out-pointer to a communicator; id is rank 0's
                unsafe { result::comm_init_rank(&mut comm, world, id, rank) }
                    .map(|_| comm as usize)
                    .map_err(|e| CudaError::Nccl {
                        call: "ncclCommInitRank",
                        message: format!("{e:?}"),
                    })
            });
            let _ = send.send(made);
        });
        let comm = match receive.recv_timeout(limit) {
            Ok(made) => made? as sys::ncclComm_t,
            Err(_) => {
                return Err(CudaError::Stalled(format!(
                    "GEMM + reduce-scatter (unfused): rank {} waited {limit:?} for its {} peers to join the NCCL communicator",
                    self.rank,
                    self.world - 1
                )))
            }
        };
        self.comm = Some(Comm(comm));
        Ok(comm)
    }

    /// Queues one call on `stream` (the operator checked the call and orders it after its
    /// previous one). The first call waits on the host: for the communicator, and for cuBLASLt
    /// to choose each GEMM's algorithm.
    ///
    /// # Safety
    /// As `GemmRsRank::forward`.
    pub(crate) unsafe fn enqueue(
        &mut self,
        stream: &Stream,
        m: usize,
        (a, b, bias, out): (u64, u64, Option<u64>, u64),
        limit: Duration,
    ) -> Result<(), CudaError> {
        let capturing = stream.is_capturing()?;
        let c = self.config;
        let (p, n, k) = (self.world, c.n, c.k);
        let eb = c.output.size();
        let block_rows = c.max_m.div_ceil(p);
        if self.product.is_none() {
            self.product = Some(DeviceMemory::zeroed(&self.gpu, p * block_rows * n * eb)?);
            self.received = Some(DeviceMemory::zeroed(&self.gpu, block_rows * n * eb)?);
        }
        let comm = self.communicator(limit)?;
        let product = self.product.as_ref().expect("made above").addr();
        let rows = m.div_ceil(p);
        let bias = if self.rank == 0 { bias } else { None };
        let (gpu, lts) = (&self.gpu, &mut self.lts);
        let mut gemm = |first: usize, len: usize, dst: u64| -> Result<(), CudaError> {
            let problem = GemmProblem::new(len, n, k, c.b_layout, c.input, c.output)
                .map_err(|e| CudaError::Unavailable(e.to_string()))?;
            let a = a + (first * k * c.input.size()) as u64;
            // the largest power of two (up to 256) every operand's address is a multiple of
            let all = a | b | dst | bias.unwrap_or(0) | 256;
            let alignment = 1u32 << all.trailing_zeros();
            let tuned = lts
                .get(&alignment)
                .is_some_and(|lt| lt.is_tuned(&problem, 0, bias.is_some()));
            if capturing && !tuned {
                // choosing an algorithm times candidates and synchronises: not in a capture
                return Err(CudaError::Unavailable(format!(
                    "GEMM + reduce-scatter (unfused): no call outside a CUDA graph capture had {len} rows with operands aligned to {alignment} bytes, so cuBLASLt's algorithm is not chosen: call it once so before capturing"
                )));
            }
            let lt = match lts.entry(alignment) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(Lt::with_alignment(gpu, alignment)?)
                }
            };
            lt.matmul_into(stream, &problem, 0, (a, b, dst, dst), bias, 1.0, 0.0)
        };
        if m.is_multiple_of(p) {
            gemm(0, m, product)?;
        } else {
            for q in 0..p {
                let owned = chunk_range(m, p, q);
                if !owned.is_empty() {
                    gemm(
                        owned.start,
                        owned.len(),
                        product + (q * rows * n * eb) as u64,
                    )?;
                }
            }
        }
        let mine = chunk_range(m, p, self.rank).len();
        let received = self.received.as_ref().expect("made above").addr();
        let land = if mine == rows { out } else { received };
        crate::nccl::reduce_scatter_on(comm, (product, land, rows * n), c.output, stream)?;
        if land != out && mine > 0 {
            stream.copy_async(out, received, mine * n * eb)?;
        }
        Ok(())
    }
}
