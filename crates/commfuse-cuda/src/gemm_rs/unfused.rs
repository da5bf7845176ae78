//! The unfused path of GEMM + reduce-scatter: cuBLASLt's GEMM of the rank's whole partial
//! product, then NCCL's reduce-scatter of it, both on the caller's stream — exactly the
//! baseline a user would write, taken where the reduce-scatter is too short to hide
//! profitably (see `commfuse_core::fused::gemm_rs::choose_path`), so that `auto` is never slower
//! than that baseline.
//!
//! The product is laid out as P row blocks of ⌈M/P⌉ rows (block q: owner q's rows), so that
//! NCCL's equal split leaves owner r's rows, summed, at the start of block r; a ragged M gets
//! one GEMM per owner and its short chunks pass through a receive buffer. Rank 0's GEMM adds the
//! bias, so the sum holds it once. The simulator's twin is `commfuse_sim::gemm_rs::unfused`.
//!
//! The communicator is made at the first unfused call (every rank of the group reaches it in
//! the same call), from the NCCL unique id rank 0 drew when it was allocated and shared with its
//! peers' addresses or its export. It is non-blocking ([`crate::sys::nccl::RankComm`]): joining it,
//! queueing the reduce-scatter and freeing it wait at most the operator's host limit, and one
//! that runs out aborts the communicator, which also ends an NCCL kernel still waiting for a
//! peer that died mid-call.
use crate::error::CudaError;
use crate::gemm_rs::GemmRsConfig;
use crate::sys::cublaslt::Lt;
use crate::sys::driver::{DeviceMemory, Gpu, Stream};
use crate::sys::nccl::RankComm;
use commfuse_core::gemm::GemmProblem;
use commfuse_core::op::chunk_range;
use cudarc::nccl::{result, sys};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Bytes of an NCCL unique id.
pub const NCCL_ID_BYTES: usize = 128;

/// A rank-0 NCCL unique id as peers carry it (zero: no NCCL where rank 0 was built).
pub type NcclId = [u8; NCCL_ID_BYTES];

/// A fresh NCCL unique id, or None where NCCL cannot run (no libnccl).
pub(crate) fn draw_nccl_id() -> Option<NcclId> {
    crate::sys::nccl::usable().ok()?;
    let id = result::get_uniqueid().ok()?;
    let mut out = [0u8; NCCL_ID_BYTES];
    for (o, i) in out.iter_mut().zip(id.internal.iter()) {
        *o = *i as u8;
    }
    Some(out)
}

/// The unfused path of one rank.
pub(crate) struct UnfusedPath {
    rank: usize,
    world: usize,
    config: GemmRsConfig,
    id: NcclId,
    comm: Option<RankComm>,
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
    fn communicator(&mut self, limit: Duration) -> Result<&mut RankComm, CudaError> {
        if self.comm.is_none() {
            let mut id = sys::ncclUniqueId {
                internal: [0; NCCL_ID_BYTES],
            };
            for (i, b) in id.internal.iter_mut().zip(self.id) {
                *i = b as _;
            }
            // the communicator is made on the GPU bound to this thread
            self.gpu.bind()?;
            let who = format!("GEMM + reduce-scatter (unfused): rank {}", self.rank);
            let comm = RankComm::join(id, (self.rank, self.world), limit, who)?;
            self.comm = Some(comm);
        }
        Ok(self.comm.as_mut().expect("made above"))
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
        self.communicator(limit)?;
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
        let comm = self.comm.as_mut().expect("joined above");
        comm.reduce_scatter((product, land, rows * n), c.output, stream)?;
        if land != out && mine > 0 {
            stream.copy_async(out, received, mine * n * eb)?;
        }
        Ok(())
    }
}
