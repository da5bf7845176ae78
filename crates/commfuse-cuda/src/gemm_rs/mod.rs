//! GEMM + reduce-scatter on GPUs, one object per rank ([`GemmRsRank`]), called on the caller's
//! buffers and stream: the schedule of [`commfuse_core::fused::gemm_rs`] run by our GEMM
//! (gemm/gemm.cu): every tile of a peer's rows goes into that peer's receive buffer over
//! NVLink, then its flag is set to the call's number. The owner's partials are summed one of two
//! ways ([`Reduction`]):
//!
//! * **Fold** (the default): the owner computes its own tiles last, and each of them, before its
//!   epilogue, waits for the peers' flags of the tile (in practice long set) and adds their
//!   partials from its own receive buffer, then the bias, and writes the caller's output. One
//!   kernel on all SMs; nothing but the GEMM's own stores and P − 1 local reads per element.
//! * **Separate**: the owner's tiles too go into its receive buffer, and a few blocks of the
//!   reducing kernel (gemm_rs.cu) on a second stream, forked from and joined to the
//!   caller's by events, sum the P partials per tile as their flags come in. The GEMM is capped at
//!   `SMs − blocks` so that both are always resident together (the reduction waits for tiles the
//!   GEMM makes). Measured slower (CHANGELOG.md, "GEMM + reduce-scatter, fused into our GEMM"): kept to compare, and for what it shows.
//!
//! Nothing synchronises the host. Alternate calls use alternate sets of receive buffers and flag
//! rows (the schedule's module doc says why that makes back-to-back calls safe), and flags hold
//! call numbers, so nothing is cleared between calls. Folding calls number themselves on the
//! device: the GEMM reads the rank's call counter when it starts, picks the set's routes by the
//! number, and its last block to finish advances the counter; so a call captured into a CUDA
//! graph is a new call at every replay, and eager calls may come between replays
//! ([`GemmRsRank::path_to_capture`] says which paths a capture may take). The first call of each
//! M prepares that M's tables with synchronous uploads ([`GemmRsRank::prepare`] does it ahead),
//! so it must not be the captured one. When M < P, ranks without rows join a small handshake
//! kernel (see gemm_rs.cu). All ranks must make the same calls in the same order with the same M.
//!
//! The other paths are `ring.rs` (overlapped) and `unfused.rs`. [`flag_step`] holds the
//! one-thread flag kernels of gemm_rs.cu that order library calls across GPUs, for the ring and
//! for all-gather + GEMM's overlapped path ([`crate::ag_gemm`]); `commfuse bench gemm-rs` is
//! [`bench`](mod@bench), its checked back-to-back calls (`commfuse run gemm-rs` on GPUs)
//! [`checked`]; its kernel as one rank alone on one GPU (`bench gemm --rs-ranks`), [`one_gpu`].

pub mod bench;
pub mod checked;
pub mod flag_step;
pub(crate) mod fused_ring;
pub mod one_gpu;
mod ring;
mod unfused;

use ring::{RingMemory, RingPath};
pub use ring::{RingParts, RingPeer};
use unfused::{draw_nccl_id, UnfusedPath};
pub use unfused::{NcclId, NCCL_ID_BYTES};

use crate::backend::plan_table::{ErrorRecord, MAX_RANKS};
use crate::error::CudaError;
use crate::gemm::{
    check_problem_tiles, wide_routes_fit, CallCounter, CallNumber, FoldSource, GemmKernels,
    GemmOperands, InUse, Launched, PreparedGemm, TileRoute, VariantChoice, FLAG_SET_EPOCH,
    ROUTE_DST_FROM_D, ROUTE_NO_BIAS, TILE, WIDE_TILE,
};
use crate::sys::driver::{
    DeviceMemory, Event, Function, Gpu, IpcMapping, MappedHost, Module, Stream,
};
use crate::sys::ipc::Exported;
use crate::sys::nvrtc;
use bytemuck::{Pod, Zeroable};
use commfuse_core::fused::gemm_rs::{
    choose_overlapping_path, choose_path, GemmRsSchedule, GemmRsShape,
};
pub use commfuse_core::fused::gemm_rs::{GemmRsConfig, GemmRsPath, PathChoice, Reduction};
use commfuse_core::fused::ring_rs::MAX_PIECES;
use commfuse_core::gemm::TileShape;
use commfuse_core::DType;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Threads of a reduction block (`REDUCE_THREADS` in gemm_rs.cu).
const REDUCE_THREADS: u32 = 512;

/// One tile of a rank's chunk for the reduction (mirrors `ReduceTile` in gemm_rs.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
struct ReduceTile {
    row0: u32,
    rows: u32,
    col0: u32,
    cols: u32,
}

/// Mirrors `GemmRsReduceArgs` in gemm_rs.cu (whose static_asserts check the same offsets).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmRsReduceArgs {
    partials: [u64; MAX_RANKS],
    peer_flags: [u64; MAX_RANKS],
    out: u64,
    bias: u64,
    tiles: u64,
    flags: u64,
    err: u64,
    timeout_ns: u64,
    epoch: u64,
    world: u32,
    tile_count: u32,
    stride: u32,
    n: u32,
    out_ld: u32,
    rank: u32,
    owners_with_rows: u32,
    rowless: u32,
    calls: u64,
    set_words: u64,
}
const _: () = assert!(std::mem::size_of::<GemmRsReduceArgs>() == 16 * MAX_RANKS + 104);
const _: () = assert!(std::mem::offset_of!(GemmRsReduceArgs, calls) == 16 * MAX_RANKS + 88);
const _: () = assert!(std::mem::offset_of!(GemmRsReduceArgs, epoch) == 16 * MAX_RANKS + 48);
const _: () = assert!(std::mem::offset_of!(GemmRsReduceArgs, rank) == 16 * MAX_RANKS + 76);

/// What one rank shares with its peers: addresses of its receive buffer and of its two flag
/// rows (as every rank in the group addresses them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmRsPeer {
    pub receive: u64,
    pub flags: u64,
    /// The overlapped path's buffers (zero when the rank was built without that path)
    pub ring: RingPeer,
    /// The NCCL unique id rank 0 drew for the unfused path (zero on other ranks, and where
    /// NCCL cannot run: the unfused path is then left out)
    pub nccl_id: NcclId,
}

/// The memory the kernels of a call use: freed only once the last call has ended.
struct RsMemory {
    receive: DeviceMemory,
    flags: DeviceMemory,
    /// The fused path's [`CallCounter`] (calls that fold number themselves on the device)
    calls: DeviceMemory,
    error: MappedHost<ErrorRecord>,
}

impl InUse for RsMemory {
    fn abort(&self) {
        self.error.raise_abort();
    }
}

/// The GEMMs and reduction table of one M.
struct PerM {
    schedule: GemmRsSchedule,
    gemm: [PreparedGemm; 2],
    tiles: DeviceMemory,
}

/// One rank's GEMM + reduce-scatter: its GPU, its receive buffers and flags, its peers'
/// addresses, its side stream, per-set call counts, and the prepared GEMMs of each M seen.
pub struct GemmRsRank {
    rank: usize,
    world: usize,
    config: GemmRsConfig,
    peers: Vec<GemmRsPeer>,
    per_m: HashMap<usize, PerM>,
    /// Fused calls queued so far: a separate reduction's next call is numbered one more (a
    /// folding call numbers itself on the device)
    calls: u64,
    /// Flag columns per sender slot (fixed by `max_m`, the same for every M)
    flag_stride: usize,
    broken: bool,
    kernels: GemmKernels,
    reduce: Function,
    side: Stream,
    fork: Event,
    join: Event,
    /// The overlapped path, when the configuration allows it
    ring: Option<RingPath>,
    /// The path the last call took
    last_path: Option<GemmRsPath>,
    // dropped after every prepared GEMM (fields drop in order) and before the context
    memory: Launched<RsMemory>,
    /// The unfused path, where NCCL runs (dropped after `memory`, which waits for the last
    /// call, so its buffers and communicator outlive every call that uses them)
    unfused: Option<UnfusedPath>,
    /// The M of every unfused call so far (the first of each waits on the host)
    unfused_ms: HashSet<usize>,
    /// Peers' buffers opened from other processes (closed once the memory above is released,
    /// i.e. after the last call that wrote into them)
    mapped: Vec<IpcMapping>,
    gpu: Arc<Gpu>,
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unavailable(msg)
}

/// A rank's allocations before it knows its peers.
pub struct GemmRsAllocation {
    rank: usize,
    world: usize,
    config: GemmRsConfig,
    /// Flag columns per sender slot (fixed by `max_m`)
    flag_stride: usize,
    memory: RsMemory,
    ring: Option<RingMemory>,
    /// Rank 0's NCCL unique id for the unfused path (zero elsewhere, or without it)
    nccl_id: NcclId,
    gpu: Arc<Gpu>,
}

impl GemmRsAllocation {
    /// Allocates rank `rank`'s receive buffers and flag rows on `gpu` for a group of `world`.
    pub fn new(
        gpu: Arc<Gpu>,
        rank: usize,
        world: usize,
        mut config: GemmRsConfig,
    ) -> Result<GemmRsAllocation, CudaError> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(unsupported(format!(
                "rank {rank} of {world}: GEMM + reduce-scatter takes 1 to {MAX_RANKS} ranks"
            )));
        }
        if let Reduction::Separate { blocks } = config.reduction {
            if blocks == 0 || blocks >= gpu.sm_count {
                return Err(unsupported(format!(
                    "a separate reduction takes 1 to {} blocks on this GPU, got {blocks}",
                    gpu.sm_count - 1
                )));
            }
        }
        let shape = shape(&config, world, config.max_m)?;
        // the groups shape only the ring, but are checked whatever the path
        ring::schedule(&config, world, config.max_m, 1)?;
        // only the paths the configuration may take get buffers
        let whole_rows = (config.n * config.output.size()).is_multiple_of(16);
        let (fused, overlapped) = match config.path {
            // choose_path takes the ring only for rows of whole 16-byte units
            PathChoice::Auto => (true, whole_rows),
            PathChoice::Always(GemmRsPath::Fused) => (true, false),
            PathChoice::Always(GemmRsPath::Overlapped { pieces }) => {
                if pieces == 0 || pieces > MAX_PIECES {
                    return Err(unsupported(format!(
                        "the overlapped path cuts a step into 1 to {MAX_PIECES} pieces, got {pieces}"
                    )));
                }
                (false, true)
            }
            PathChoice::Always(GemmRsPath::Unfused) => (false, false),
        };
        if overlapped && !whole_rows {
            return Err(unsupported(format!(
                "the overlapped path needs rows of a multiple of 16 bytes (N = {} of {})",
                config.n, config.output
            )));
        }
        // the fused path's tile, kept in the configuration from here on (what the ranks
        // agree on and every schedule is laid out with)
        config.tile = match fused {
            true => fused_tile(&config, VariantChoice::from_env()?)?,
            false => TILE,
        };
        if fused {
            check_problem_tiles(&shape.problem(), config.tile)?;
        }
        let layout = GemmRsSchedule::new(shape, config.tile);
        let may_unfuse = matches!(
            config.path,
            PathChoice::Auto | PathChoice::Always(GemmRsPath::Unfused)
        );
        let nccl_id = match (rank, may_unfuse) {
            (0, true) => draw_nccl_id(),
            _ => None,
        };
        if config.path == PathChoice::Always(GemmRsPath::Unfused) && rank == 0 && nccl_id.is_none()
        {
            return Err(unsupported(
                "the unfused path needs NCCL (libnccl.so on the library path)".into(),
            ));
        }
        let receive_bytes = if fused {
            2 * world * layout.slot_len * config.output.size()
        } else {
            16
        };
        let flag_bytes = 2 * layout.flag_columns() * 8;
        Ok(GemmRsAllocation {
            memory: RsMemory {
                receive: DeviceMemory::zeroed(&gpu, receive_bytes)?,
                flags: DeviceMemory::zeroed(&gpu, flag_bytes)?,
                calls: DeviceMemory::zeroed(&gpu, std::mem::size_of::<CallCounter>())?,
                error: MappedHost::new(&gpu, ErrorRecord::default())?,
            },
            ring: if overlapped {
                Some(RingMemory::new(&gpu, rank, world, &config)?)
            } else {
                None
            },
            rank,
            world,
            config,
            flag_stride: layout.flag_stride,
            nccl_id: nccl_id.unwrap_or([0; NCCL_ID_BYTES]),
            gpu,
        })
    }

    /// What this rank's peers need to know of it.
    pub fn peer(&self) -> GemmRsPeer {
        GemmRsPeer {
            receive: self.memory.receive.addr(),
            flags: self.memory.flags.addr(),
            ring: self
                .ring
                .as_ref()
                .map(|r| r.peer(&self.gpu))
                .unwrap_or_default(),
            nccl_id: self.nccl_id,
        }
    }

    /// What this rank exports for peers in other processes (one process per GPU): the IPC
    /// handles of its receive buffer and flags, and of the overlapped path's when it has one.
    /// Every rank passes every rank's export to [`GemmRsAllocation::connect_exported`].
    pub fn export(&self) -> Result<Exported, CudaError> {
        let mut handles = vec![
            self.memory.receive.ipc_handle(&self.gpu)?,
            self.memory.flags.ipc_handle(&self.gpu)?,
        ];
        if let Some(ring) = &self.ring {
            handles.extend(ring.ipc_handles(&self.gpu)?);
        }
        Ok(Exported {
            operator: "gemm-rs".into(),
            rank: self.rank,
            world: self.world,
            handles,
            extra: [self.nccl_id.as_slice(), &self.agreement()].concat(),
        })
    }

    /// What every rank must have built alike (see [`agreement`] and
    /// [`crate::sys::ipc::agreement`]).
    fn agreement(&self) -> Vec<u8> {
        agreement(&self.config)
    }

    /// Finishes the rank from every rank's [`GemmRsAllocation::export`] (rank order, its own
    /// among them) when the peers live in other processes: their buffers are opened into this
    /// process and closed when the rank is dropped.
    pub fn connect_exported(self, exports: &[Exported]) -> Result<GemmRsRank, CudaError> {
        let has_ring = self.ring.is_some();
        Exported::check_group(exports, "gemm-rs", self.world, 2 + 2 * has_ring as usize)?;
        crate::sys::ipc::check_agreement("gemm-rs", self.rank, &self.agreement(), exports, |e| {
            e.extra.get(NCCL_ID_BYTES..).unwrap_or_default()
        })?;
        let mut mapped = Vec::new();
        let mut peers = Vec::with_capacity(self.world);
        for (q, e) in exports.iter().enumerate() {
            if q == self.rank {
                peers.push(self.peer());
                continue;
            }
            let mut open = |i: usize| -> Result<u64, CudaError> {
                let m = IpcMapping::open(&self.gpu, &e.handles[i])?;
                let addr = m.addr();
                mapped.push(m);
                Ok(addr)
            };
            let (receive, flags) = (open(0)?, open(1)?);
            // mapped into this process's context: copies to them are plain copies
            let ring = if has_ring {
                RingPeer {
                    receive: open(2)?,
                    flags: open(3)?,
                    context: 0,
                }
            } else {
                RingPeer::default()
            };
            let id = e.extra.get(..NCCL_ID_BYTES).unwrap_or_default();
            let nccl_id = NcclId::try_from(id).map_err(|_| {
                unsupported(format!(
                    "gemm-rs: export {q} carries {} extra bytes, expected an NCCL id of {NCCL_ID_BYTES}",
                    e.extra.len()
                ))
            })?;
            peers.push(GemmRsPeer {
                receive,
                flags,
                ring,
                nccl_id,
            });
        }
        let mut rank = self.connect(&peers)?;
        rank.mapped = mapped;
        Ok(rank)
    }

    /// Finishes the rank once every rank's [`GemmRsAllocation::peer`] is known (in rank order).
    pub fn connect(self, peers: &[GemmRsPeer]) -> Result<GemmRsRank, CudaError> {
        if peers.len() != self.world || peers[self.rank] != self.peer() {
            return Err(unsupported(format!(
                "rank {} expected the {} ranks' addresses with its own at its place",
                self.rank, self.world
            )));
        }
        let gpu = self.gpu;
        let compiled = nvrtc::compile(nvrtc::kernel("gemm_rs.cu").expect("embedded"), false)?;
        let module = Module::load(&gpu, &compiled.cubin)?;
        let name = match self.config.output {
            DType::F32 => "gemm_rs_reduce_f32",
            DType::BF16 => "gemm_rs_reduce_bf16",
            DType::F16 => "gemm_rs_reduce_f16",
        };
        let reduce = module.function(name)?;
        let ring = match self.ring {
            Some(memory) => {
                let ring_peers = peers.iter().map(|p| p.ring).collect();
                Some(RingPath::new(
                    gpu.clone(),
                    self.rank,
                    self.config,
                    memory,
                    ring_peers,
                )?)
            }
            None => None,
        };
        // the unfused path where rank 0 drew an NCCL id for it
        let unfused = if peers[0].nccl_id != [0; NCCL_ID_BYTES] {
            let id = peers[0].nccl_id;
            Some(UnfusedPath::new(
                gpu.clone(),
                self.rank,
                self.world,
                self.config,
                id,
            )?)
        } else {
            None
        };
        Ok(GemmRsRank {
            rank: self.rank,
            world: self.world,
            config: self.config,
            peers: peers.to_vec(),
            per_m: HashMap::new(),
            calls: 0,
            flag_stride: self.flag_stride,
            broken: false,
            kernels: GemmKernels::load(&gpu)?,
            reduce,
            side: Stream::new(&gpu)?,
            fork: Event::new_untimed(&gpu)?,
            join: Event::new_untimed(&gpu)?,
            ring,
            last_path: None,
            memory: Launched::new(&gpu, self.memory)?,
            unfused,
            unfused_ms: HashSet::new(),
            mapped: Vec::new(),
            gpu,
        })
    }
}

/// Rank `me`'s route of every tile for set `set`, given every rank's buffer addresses (its own
/// among them): a tile of a peer's rows into that peer's receive slot `slot_of(me, owner)` with
/// its flag set to the call's number; with `fold`, this rank's own tiles into the call's output
/// (relative to D) with the peers' partials (slots 0 .. P − 2 of its own receive buffer, one
/// slot apart) and their flags to fold in; without, into its own last slot like the others.
pub(crate) fn tile_routes(
    s: &GemmRsSchedule,
    me: usize,
    set: usize,
    peers: &[GemmRsPeer],
    fold: bool,
) -> Vec<TileRoute> {
    let (p, n) = (s.shape.world, s.shape.n);
    let eb = s.shape.output.size() as u64;
    let columns = s.flag_columns() as u64;
    (0..s.tile_count())
        .map(|t| {
            let (owner, index) = s.placement[t];
            let (rows, cols) = s.tile_bounds(t);
            let row = (rows.start - s.shape.chunk(owner).start) as u64;
            let within = row * n as u64 + cols.start as u64;
            let slot = |sender: usize| ((set * p + s.slot_of(sender, owner)) * s.slot_len) as u64;
            let flag = |sender: usize| {
                8 * (set as u64 * columns
                    + (s.slot_of(sender, owner) * s.flag_stride + index) as u64)
            };
            if fold && owner == me {
                // the peers' partials: slots 0 .. P − 2 of this set, one stride apart
                let first = (1..p).map(|d| (me + d) % p).next();
                TileRoute {
                    dst: within * eb,
                    ld: n as u32,
                    options: ROUTE_DST_FROM_D,
                    fold_src: first.map_or(0, |q| peers[me].receive + (slot(q) + within) * eb),
                    fold_stride: s.slot_len as u64 * eb,
                    fold_flag: first.map_or(0, |q| peers[me].flags + flag(q)),
                    fold_count: (p - 1) as u32,
                    fold_ld: n as u32,
                    fold_flag_stride: 8 * s.flag_stride as u32,
                    ..TileRoute::default()
                }
            } else {
                TileRoute {
                    dst: peers[owner].receive + (slot(me) + within) * eb,
                    ld: n as u32,
                    flag: peers[owner].flags + flag(me),
                    flag_op: FLAG_SET_EPOCH,
                    options: ROUTE_NO_BIAS,
                    ..TileRoute::default()
                }
            }
        })
        .collect()
}

/// A rank's receive buffer at `receive` as its GEMM's [`FoldSource`]: both sets' P slots, one
/// after the other, as one matrix of N columns, in which every partial that either set's
/// routes fold in lies.
pub(crate) fn fold_source(receive: u64, s: &GemmRsSchedule) -> FoldSource {
    FoldSource {
        base: receive,
        rows: 2 * s.shape.world * s.slot_len / s.shape.n,
        ld: s.shape.n,
    }
}

fn shape(config: &GemmRsConfig, world: usize, m: usize) -> Result<GemmRsShape, CudaError> {
    Ok(config.shape(world, m)?)
}

/// The tile the fused path plans `config` with under the build `choice`: [`TILE`] (the main
/// build's, or the direct build's where named), or [`WIDE_TILE`] on the wide ping-pong build's
/// routed entries where `config.tile` asks for it, or where `choice` names that build and
/// `config.tile` is the default. The wide build takes routes of an output of the input's
/// 16-bit type only, and folds by TMA, so rows of whole 16-byte units (N a multiple of 8):
/// asked for by `config.tile` otherwise, it is an error; named by the build choice (which every
/// GEMM of the process follows), the fused path keeps [`TILE`] there.
pub fn fused_tile(config: &GemmRsConfig, choice: VariantChoice) -> Result<TileShape, CudaError> {
    let wide_fits = wide_routes_fit(config.input, config.output, config.n);
    match config.tile {
        WIDE_TILE if wide_fits => Ok(WIDE_TILE),
        WIDE_TILE => Err(unsupported(format!(
            "the fused path's {}×{} tiles (the wide ping-pong build) take an output of the \
             input's 16-bit type in rows of whole 16 bytes, here {} from {} with N = {}",
            WIDE_TILE.m, WIDE_TILE.n, config.output, config.input, config.n
        ))),
        TILE if choice == VariantChoice::PingPongWide && wide_fits => Ok(WIDE_TILE),
        TILE => Ok(TILE),
        t => Err(unsupported(format!(
            "the GPU's fused GEMM + reduce-scatter computes {}×{} or {}×{} tiles, the \
             configuration asks for {}×{}",
            TILE.m, TILE.n, WIDE_TILE.m, WIDE_TILE.n, t.m, t.n
        ))),
    }
}

/// What every rank of a group must have built alike ([`GemmRsAllocation::export`]'s
/// agreement): the calls' rows, the output's columns and type (the partials peers write into
/// this rank's buffers), the bias (added once), the path and its ring, and the fused path's
/// tile (which lays out the receive buffers and flag rows). K, B's layout and the input type
/// are each rank's own: a row-parallel layer's shards may differ in K by one.
fn agreement(c: &GemmRsConfig) -> Vec<u8> {
    crate::sys::ipc::agreement(&[
        ("max_m", c.max_m.to_string()),
        ("n", c.n.to_string()),
        ("output", c.output.to_string()),
        ("bias", c.bias.to_string()),
        ("reduction", format!("{:?}", c.reduction)),
        ("path", format!("{:?}", c.path)),
        ("numa_groups", c.numa_groups.to_string()),
        ("tile", format!("{}x{}", c.tile.m, c.tile.n)),
    ])
}

impl GemmRsRank {
    /// Builds every rank of a group whose GPUs this process drives (peer access enabled
    /// between them): rank r on `gpus[r]`.
    pub fn create_group(
        gpus: &[Arc<Gpu>],
        config: GemmRsConfig,
    ) -> Result<Vec<GemmRsRank>, CudaError> {
        let parts: Vec<GemmRsAllocation> = gpus
            .iter()
            .enumerate()
            .map(|(r, g)| GemmRsAllocation::new(g.clone(), r, gpus.len(), config))
            .collect::<Result<_, _>>()?;
        let peers: Vec<GemmRsPeer> = parts.iter().map(GemmRsAllocation::peer).collect();
        parts.into_iter().map(|p| p.connect(&peers)).collect()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn config(&self) -> &GemmRsConfig {
        &self.config
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Rows of the output this rank owns at `m`.
    pub fn chunk(&self, m: usize) -> std::ops::Range<usize> {
        commfuse_core::op::chunk_range(m, self.world, self.rank)
    }

    /// Queues the parts `parts` of an overlapped call of `pieces` pieces, for timing them apart
    /// (`bench gemm-rs --ablation`): the output is wrong unless `parts` is whole.
    ///
    /// # Safety
    /// As [`GemmRsRank::forward`].
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward_parts(
        &mut self,
        stream: &Stream,
        m: usize,
        pieces: usize,
        (a, b, bias, out): (u64, u64, Option<u64>, u64),
        parts: RingParts,
    ) -> Result<(), CudaError> {
        self.path_for(m)?;
        let ring = self.ring.as_mut().ok_or_else(|| {
            unsupported("this operator was built without the overlapped path".into())
        })?;
        self.gpu.bind()?;
        ring.enqueue(stream, m, pieces, (a, b, bias, out), parts)
    }

    /// The path a call of `m` rows takes (the same on every rank).
    pub fn path_for(&self, m: usize) -> Result<GemmRsPath, CudaError> {
        if m == 0 || m > self.config.max_m {
            return Err(unsupported(format!(
                "M must be 1 to {} (the max_m this operator was built for), got {m}",
                self.config.max_m
            )));
        }
        let shape = shape(&self.config, self.world, m)?;
        Ok(match self.config.path {
            PathChoice::Always(path) => path,
            PathChoice::Auto => match choose_path(&shape) {
                // without NCCL, the better of the paths that overlap
                GemmRsPath::Unfused if self.unfused.is_none() => choose_overlapping_path(&shape),
                path => path,
            },
        })
    }

    /// The path a call of `m` rows takes while its stream is captured into a CUDA graph. A
    /// captured call must be replayable: its numbers and buffers chosen on the device, nothing
    /// prepared on the host. The fused path (partials folded) and the unfused one (cuBLASLt
    /// and NCCL, both capturable) are, once a call of this M has run outside a capture; the
    /// overlapped path is not (its copy-engine copies alternate between two sets of buffers,
    /// chosen on the host), so `auto` takes the fused path instead, which its first call of
    /// the M prepared for this ([`GemmRsRank::prepare_capturable`]).
    pub fn path_to_capture(&self, m: usize) -> Result<GemmRsPath, CudaError> {
        let path = self.path_for(m)?;
        let fused_ready = self.config.reduction == Reduction::Fold && self.per_m.contains_key(&m);
        let warm_up = || {
            unsupported(format!(
                "GEMM + reduce-scatter: M = {m} was never called outside a CUDA graph capture, and its first call prepares on the host: call it once before capturing"
            ))
        };
        match path {
            GemmRsPath::Fused if self.config.reduction != Reduction::Fold => Err(unsupported(
                "a separate reduction's calls are numbered on the host and cannot be captured into a CUDA graph".into(),
            )),
            GemmRsPath::Fused if !fused_ready => Err(warm_up()),
            GemmRsPath::Unfused if !self.unfused_ms.contains(&m) => Err(warm_up()),
            GemmRsPath::Overlapped { .. } if fused_ready && self.config.path == PathChoice::Auto => {
                Ok(GemmRsPath::Fused)
            }
            GemmRsPath::Overlapped { .. } if self.config.path == PathChoice::Auto => Err(warm_up()),
            GemmRsPath::Overlapped { .. } => Err(unsupported(
                "the overlapped path cannot be captured into a CUDA graph (its copies alternate between buffers chosen on the host): build the operator with the fused, unfused or auto path".into(),
            )),
            path => Ok(path),
        }
    }

    /// Before the first overlapped call of an M under `auto`: prepares the fused path for it
    /// too, so that a later capture of this M can take that path (see
    /// [`GemmRsRank::path_to_capture`]).
    fn prepare_capturable(&mut self, m: usize) -> Result<(), CudaError> {
        if self.config.path != PathChoice::Auto
            || self.config.reduction != Reduction::Fold
            || self.per_m.contains_key(&m)
        {
            return Ok(());
        }
        self.settle_before_preparing(false)?;
        self.prepare_fused(m)
    }

    /// The path the last queued call took.
    pub fn last_path(&self) -> Option<GemmRsPath> {
        self.last_path
    }

    /// Prepares what the first call of `m` rows needs on the fused path (its GEMMs and tables,
    /// uploaded synchronously; the first call of an M does it otherwise). The overlapped path
    /// needs nothing ahead: its first call of an M lets cuBLASLt choose its algorithms on that
    /// call's operands, after the calls before it, and waits for that on the host.
    pub fn prepare(&mut self, m: usize) -> Result<(), CudaError> {
        match self.path_for(m)? {
            GemmRsPath::Fused => self.prepare_fused(m),
            GemmRsPath::Overlapped { .. } | GemmRsPath::Unfused => Ok(()),
        }
    }

    /// Before the first call of an M prepares its tables (allocations and uploads, which may
    /// wait for the GPU and its peers to be idle): wait on the host for this operator's earlier
    /// calls, so that none of its kernels is still spinning on a flag a peer has yet to raise
    /// while this thread holds the context (the overlapped path's first calls stalled that way,
    /// CHANGELOG.md, "GEMM + reduce-scatter's overlapped path"). Bounded: every wait of the earlier calls is. Nothing to do when
    /// the M was `prepared` already.
    fn settle_before_preparing(&self, prepared: bool) -> Result<(), CudaError> {
        if prepared {
            return Ok(());
        }
        let limit = self.host_limit();
        if self.memory.wait_last(limit)? {
            Ok(())
        } else {
            Err(unsupported(format!(
                "GEMM + reduce-scatter: rank {}'s earlier calls still run after {limit:?}",
                self.rank
            )))
        }
    }

    /// How long the host waits for this operator's earlier calls or its peers.
    fn host_limit(&self) -> Duration {
        4 * self.config.timeout
    }

    fn prepare_fused(&mut self, m: usize) -> Result<(), CudaError> {
        if self.per_m.contains_key(&m) {
            return Ok(());
        }
        let shape = shape(&self.config, self.world, m)?;
        let schedule = GemmRsSchedule::within(shape, self.config.max_m, self.config.tile);
        // A and B change per call (launch_call); the receive buffer stands in for them here
        let stand_in = self.memory.receive.addr();
        let ops = GemmOperands::plain(stand_in, stand_in, stand_in);
        let cap = match self.config.reduction {
            Reduction::Fold => 0,
            Reduction::Separate { blocks } => self.gpu.sm_count - blocks,
        };
        let folds = (self.config.reduction == Reduction::Fold)
            .then(|| fold_source(self.memory.receive.addr(), &schedule));
        let prepare = |set: usize| {
            PreparedGemm::with_routes(
                &self.gpu,
                &self.kernels,
                // the order and bands of the call's set (the routes replace its flags)
                &schedule.gemm_plan(self.rank, set as u64 + 1),
                &ops,
                self.routes(&schedule, set),
                folds,
                self.world,
                cap,
                self.rank,
            )
        };
        let gemm = [prepare(0)?, prepare(1)?];
        let tiles: Vec<ReduceTile> = schedule
            .reduce_tiles(self.rank)
            .into_iter()
            .map(|(rows, cols)| ReduceTile {
                row0: rows.start as u32,
                rows: rows.len() as u32,
                col0: cols.start as u32,
                cols: cols.len() as u32,
            })
            .collect();
        let table = DeviceMemory::zeroed(&self.gpu, std::mem::size_of_val(tiles.as_slice()))?;
        table.upload(&self.gpu, &tiles)?;
        self.per_m.insert(
            m,
            PerM {
                schedule,
                gemm,
                tiles: table,
            },
        );
        Ok(())
    }

    fn routes(&self, s: &GemmRsSchedule, set: usize) -> Vec<TileRoute> {
        let fold = self.config.reduction == Reduction::Fold;
        tile_routes(s, self.rank, set, &self.peers, fold)
    }

    /// Enqueues one call on `stream`: this rank's output chunk (rows [`GemmRsRank::chunk`] of
    /// Σ_r A_r·B_r + bias, [chunk rows, N] row-major) into `out`. Returns once queued.
    ///
    /// # Safety
    /// `stream` must be a stream of this rank's GPU; `a` ([M, K]), `b` ([N, K] or [K, N]),
    /// `bias` ([N], output type) and `out` ([chunk rows, N], output type) must be device memory
    /// of this GPU, 16-byte aligned, valid until the call completes on `stream`, and `out` must
    /// not overlap the others.
    pub unsafe fn forward(
        &mut self,
        stream: &Stream,
        m: usize,
        a: u64,
        b: u64,
        bias: Option<u64>,
        out: u64,
    ) -> Result<(), CudaError> {
        if self.broken {
            return Err(unsupported(
                "this GEMM + reduce-scatter failed earlier; its peers' state is unknown: build a new one"
                    .into(),
            ));
        }
        if bias.is_some() != self.config.bias {
            return Err(unsupported(format!(
                "this operator was built {} a bias",
                if self.config.bias { "with" } else { "without" }
            )));
        }
        if !out.is_multiple_of(16) || bias.is_some_and(|b| !b.is_multiple_of(16)) {
            return Err(unsupported(
                "the output and the bias must start on 16-byte boundaries".into(),
            ));
        }
        self.gpu.bind()?;
        // asked once: each ask is a driver call on every call's path
        let capturing = stream.is_capturing()?;
        let path = match capturing {
            true => self.path_to_capture(m)?,
            false => self.path_for(m)?,
        };
        let result = match path {
            GemmRsPath::Fused => self
                .settle_before_preparing(self.per_m.contains_key(&m))
                .and_then(|()| self.prepare_fused(m))
                // after the previous call even if it went on another stream
                .and_then(|()| self.memory.order_after_last_if(stream, capturing))
                .and_then(|()| self.enqueue(stream, capturing, m, a, b, bias, out)),
            GemmRsPath::Overlapped { pieces } => self.prepare_capturable(m).and_then(|()| {
                self.ring
                    .as_mut()
                    .expect("path_for offers the ring only when it was built")
                    .enqueue(stream, m, pieces, (a, b, bias, out), RingParts::WHOLE)
            }),
            GemmRsPath::Unfused => self.enqueue_unfused(stream, m, (a, b, bias, out)),
        };
        if result.is_ok() {
            self.last_path = Some(path);
        }
        if result.is_err() {
            // some ranks may have queued their part: the protocol's state is unknown
            self.broken = true;
            self.memory.error.raise_abort();
        }
        result
    }

    /// One unfused call: after this operator's previous calls (the first call of an M waits
    /// for them on the host, as it joins the communicator and tunes cuBLASLt there).
    unsafe fn enqueue_unfused(
        &mut self,
        stream: &Stream,
        m: usize,
        operands: (u64, u64, Option<u64>, u64),
    ) -> Result<(), CudaError> {
        self.settle_before_preparing(self.unfused_ms.contains(&m))?;
        self.memory.order_after_last(stream)?;
        let limit = self.host_limit();
        let path = self.unfused.as_mut().ok_or_else(|| {
            unsupported(
                "the unfused path needs NCCL where rank 0 was built (libnccl.so on its library path)"
                    .into(),
            )
        })?;
        path.enqueue(stream, m, operands, limit)?;
        self.unfused_ms.insert(m);
        self.memory.launched(stream)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue(
        &mut self,
        stream: &Stream,
        capturing: bool,
        m: usize,
        a: u64,
        b: u64,
        bias: Option<u64>,
        out: u64,
    ) -> Result<(), CudaError> {
        let pm = &self.per_m[&m];
        let s = &pm.schedule;
        let eb = self.config.output.size() as u64;
        let columns = s.flag_columns() as u64;
        let mine = s.owner_tiles[self.rank].len();
        // Folding calls number themselves on the device (a CUDA graph may replay them): the
        // GEMM of set 0 is launched with set 1's routes beside its own and picks by the
        // number, and the handshake gets set 0's flag rows. A separate reduction's calls are
        // numbered here (see `path_to_capture`).
        let (epoch, set, call) = match self.config.reduction {
            Reduction::Fold => (
                0,
                0,
                CallNumber::Device {
                    counter: self.memory.calls.addr(),
                    routes_alt: pm.gemm[1].routes_addr(),
                },
            ),
            Reduction::Separate { .. } => {
                let epoch = self.calls + 1;
                let set = GemmRsSchedule::set_of(epoch);
                (epoch, set, CallNumber::Host(epoch))
            }
        };
        let separate = match self.config.reduction {
            Reduction::Fold => None,
            Reduction::Separate { blocks } => Some(blocks),
        };
        let mut args = GemmRsReduceArgs {
            partials: [0; MAX_RANKS],
            peer_flags: [0; MAX_RANKS],
            out,
            bias: bias.unwrap_or(0),
            tiles: pm.tiles.addr(),
            flags: self.memory.flags.addr() + 8 * set as u64 * columns,
            err: self.memory.error.device_addr(),
            timeout_ns: self.config.timeout.as_nanos() as u64,
            epoch,
            world: self.world as u32,
            tile_count: if separate.is_some() { mine as u32 } else { 0 },
            stride: s.flag_stride as u32,
            n: self.config.n as u32,
            out_ld: self.config.n as u32,
            rank: self.rank as u32,
            owners_with_rows: m.min(self.world) as u32,
            rowless: u32::from(mine == 0),
            calls: match call {
                CallNumber::Device { counter, .. } | CallNumber::Counted { counter } => counter,
                CallNumber::Host(_) => 0,
            },
            set_words: columns,
        };
        let receive = self.memory.receive.addr();
        for q in 0..self.world {
            let slot = s.slot_of(q, self.rank);
            args.partials[q] = receive + ((set * self.world + slot) * s.slot_len) as u64 * eb;
            args.peer_flags[q] = self.peers[q].flags + 8 * set as u64 * columns;
        }
        match separate {
            None => {
                // the bias and the output go to the GEMM; its epilogue folds the partials
                pm.gemm[set].launch_call(stream, a, b, bias, Some(out), call)?;
                if m < self.world {
                    // the handshake of ranks without rows (see gemm_rs.cu), after the GEMM
                    self.reduce.launch(1, REDUCE_THREADS, stream, &args)?;
                }
            }
            Some(blocks) => {
                self.fork.record(stream)?;
                self.side.wait_event(&self.fork)?;
                pm.gemm[set].launch_call(stream, a, b, None, None, call)?;
                self.reduce
                    .launch(blocks, REDUCE_THREADS, &self.side, &args)?;
                self.join.record(&self.side)?;
                stream.wait_event(&self.join)?;
            }
        }
        self.memory.launched_if(stream, capturing)?;
        self.calls += 1;
        Ok(())
    }

    /// After the caller's stream was synchronised: the diagnosis of a wait that timed out in
    /// any call so far (the reduction's flag waits, the GEMM's pipeline), if one did. Marks the
    /// operator unusable when it reports one.
    pub fn check(&mut self) -> Result<(), CudaError> {
        if let Some(report) = self.ring.as_ref().and_then(RingPath::failure) {
            self.broken = true;
            return Err(unsupported(report));
        }
        let e = self.memory.error.read();
        if e.flag != 0 {
            self.broken = true;
            // the flag's slot is slot_of(sender, owner) = (sender − owner − 1) mod P
            let sender = (e.slot as usize / self.flag_stride + e.rank as usize + 1) % self.world;
            return Err(unsupported(format!(
                "GEMM + reduce-scatter: rank {}'s reduction (block {}) waited for sender {sender}'s flag of its tile {} to reach call {}, saw {} after {:?}",
                e.rank,
                e.lane,
                e.step,
                e.expected,
                e.seen,
                self.config.timeout
            )));
        }
        for pm in self.per_m.values() {
            for g in &pm.gemm {
                if let Some(report) = g.stall_report() {
                    self.broken = true;
                    return Err(unsupported(report));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::{stage_folds, GemmVariant, ROUTE_FOLD_TMA};
    use commfuse_core::gemm::BLayout;
    use std::collections::HashMap;

    /// Rank q's buffers at made-up addresses far apart (the tables are only arithmetic).
    pub(super) fn peers(world: usize) -> Vec<GemmRsPeer> {
        (0..world)
            .map(|q| GemmRsPeer {
                receive: (q as u64 + 1) << 40,
                flags: ((q as u64 + 1) << 40) | (1 << 39),
                ring: RingPeer::default(),
                nccl_id: [0; NCCL_ID_BYTES],
            })
            .collect()
    }

    /// The schedules the table tests check, with their P and M: P = `worlds`, each at a ragged
    /// M, M = 1, M = P + 1 and the largest M, all in buffers made for M = 300; N columns.
    fn schedules(
        worlds: impl Iterator<Item = usize>,
        n: usize,
        tile: TileShape,
    ) -> impl Iterator<Item = (usize, usize, GemmRsSchedule)> {
        worlds.flat_map(move |world| {
            [(1, 300), (world + 1, 300), (300, 300), (133, 300)]
                .into_iter()
                .map(move |(m, max_m)| {
                    let shape =
                        GemmRsShape::new(world, m, n, 64, BLayout::NK, DType::BF16, DType::BF16)
                            .unwrap();
                    (world, m, GemmRsSchedule::within(shape, max_m, tile))
                })
        })
    }

    /// Every owner tile's partials, in both sets, lie in the receive buffer as the fold source
    /// describes it, in whole rows at the tile's columns: the main build loads all of them into
    /// its stages by TMA, the wide ping-pong build into its warpgroups' boxes (which it must:
    /// its routed entries refuse a folding route the map cannot reach). P = 2..9 and 16, ragged
    /// M, smaller M in buffers made for the largest.
    #[test]
    fn every_fold_goes_through_the_pipeline() {
        for (tile, variant) in [
            (TILE, GemmVariant::Main),
            (WIDE_TILE, GemmVariant::PingPongWide),
        ] {
            every_fold_is_staged(tile, variant);
        }
    }

    fn every_fold_is_staged(tile: TileShape, variant: GemmVariant) {
        for (world, m, s) in schedules((2..=9).chain([16]), 1000, tile) {
            let peers = peers(world);
            for me in 0..world {
                let source = fold_source(peers[me].receive, &s);
                for set in 0..2 {
                    let mut routes = tile_routes(&s, me, set, &peers, true);
                    let plan = s.gemm_plan(me, set as u64 + 1);
                    stage_folds(&mut routes, &plan, variant, &source);
                    for (t, r) in routes.iter().enumerate() {
                        let mine = s.placement[t].0 == me;
                        assert_eq!(
                            r.options & ROUTE_FOLD_TMA != 0,
                            mine,
                            "{variant:?} P={world} M={m} rank {me} set {set} tile {t}"
                        );
                        if mine {
                            let at = |row: u64| source.base + row * 1000 * 2;
                            let col = s.tile_bounds(t).1.start as u64 * 2;
                            assert_eq!(at(r.fold_row as u64) + col, r.fold_src);
                            assert_eq!(at(r.fold_row_step as u64) - source.base, r.fold_stride);
                        }
                    }
                }
            }
        }
    }

    /// The tables every rank builds agree: per set, every byte of a receive buffer is written by
    /// one (sender, tile) and stays inside the buffer, every flag word is set by one (sender,
    /// tile), and what an owner folds in (or a separate reduction reads) is exactly what the
    /// peers wrote there and the flags they set. P = 1..9 and 16, ragged M, smaller M in
    /// buffers made for the largest, the operator's tiles and the wide build's. (The GPU runs
    /// these tables; this checks them without one.)
    #[test]
    fn every_ranks_routes_agree_on_every_byte_and_flag() {
        let schedules = schedules((1..=9).chain([16]), 300, TILE).chain(schedules(
            (1..=9).chain([16]),
            304,
            WIDE_TILE,
        ));
        for (world, m, s) in schedules {
            let peers = peers(world);
            let eb = 2u64;
            let buffer = 2 * world as u64 * s.slot_len as u64 * eb;
            for fold in [true, false] {
                for set in 0..2 {
                    // byte written -> (sender, tile, row, col); flag word -> (sender, tile)
                    let mut written: HashMap<u64, (usize, usize, usize, usize)> = HashMap::new();
                    let mut flags: HashMap<u64, (usize, usize)> = HashMap::new();
                    let routes: Vec<Vec<TileRoute>> = (0..world)
                        .map(|me| tile_routes(&s, me, set, &peers, fold))
                        .collect();
                    for (sender, table) in routes.iter().enumerate() {
                        for (t, r) in table.iter().enumerate() {
                            let (owner, _) = s.placement[t];
                            if r.options & ROUTE_DST_FROM_D != 0 {
                                assert!(fold && owner == sender);
                                continue;
                            }
                            let base = peers[owner].receive;
                            let (rows, cols) = s.tile_bounds(t);
                            for i in 0..rows.len() {
                                for j in 0..cols.len() {
                                    let at = r.dst + (i as u64 * r.ld as u64 + j as u64) * eb;
                                    assert!(at >= base && at + eb <= base + buffer);
                                    let before = written.insert(at, (sender, t, i, j));
                                    assert!(before.is_none(), "P={world} M={m}: {at:#x} twice");
                                }
                            }
                            assert_eq!(r.flag_op, FLAG_SET_EPOCH);
                            assert!(flags.insert(r.flag, (sender, t)).is_none());
                            let row0 =
                                peers[owner].flags + 8 * set as u64 * s.flag_columns() as u64;
                            assert!(r.flag >= row0 && r.flag < row0 + 8 * s.flag_columns() as u64);
                        }
                    }
                    for (me, table) in routes.iter().enumerate() {
                        for (t, r) in table.iter().enumerate() {
                            let (owner, index) = s.placement[t];
                            if owner != me {
                                continue;
                            }
                            let (rows, cols) = s.tile_bounds(t);
                            if fold {
                                assert_eq!(r.fold_count as usize, world - 1);
                                for f in 0..world - 1 {
                                    let q = (me + 1 + f) % world;
                                    let flag = r.fold_flag + f as u64 * r.fold_flag_stride as u64;
                                    assert_eq!(flags.get(&flag), Some(&(q, t)), "P={world}");
                                    for i in 0..rows.len() {
                                        for j in 0..cols.len() {
                                            let at = r.fold_src
                                                + f as u64 * r.fold_stride
                                                + (i as u64 * r.fold_ld as u64 + j as u64) * eb;
                                            assert_eq!(written.get(&at), Some(&(q, t, i, j)));
                                        }
                                    }
                                }
                            } else {
                                // the separate reduction: sender q's partial and flag
                                for q in 0..world {
                                    let slot = s.slot_of(q, me);
                                    let col = slot * s.flag_stride + index;
                                    let flag =
                                        peers[me].flags + 8 * (set * s.flag_columns() + col) as u64;
                                    assert_eq!(flags.get(&flag), Some(&(q, t)));
                                    let start = s.shape.chunk(me).start;
                                    let at = peers[me].receive
                                        + (((set * world + slot) * s.slot_len
                                            + (rows.start - start) * s.shape.n
                                            + cols.start)
                                            as u64)
                                            * eb;
                                    assert_eq!(written.get(&at), Some(&(q, t, 0, 0)));
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fused path's tile: the operator's by default, the wide build's where the tile or the
    /// build choice names it and the output fits it; any other tile refused in one line.
    #[test]
    fn the_fused_tile_is_the_wide_builds_where_named_and_it_fits() {
        let bf16 = GemmRsConfig::new(256, 1000, 64, BLayout::NK, DType::BF16, DType::BF16);
        let auto = VariantChoice::Auto;
        let wide = VariantChoice::PingPongWide;
        assert_eq!(fused_tile(&bf16, auto).unwrap(), TILE);
        assert_eq!(fused_tile(&bf16, VariantChoice::Direct).unwrap(), TILE);
        assert_eq!(fused_tile(&bf16, wide).unwrap(), WIDE_TILE);
        let asked = GemmRsConfig {
            tile: WIDE_TILE,
            ..bf16
        };
        assert_eq!(fused_tile(&asked, auto).unwrap(), WIDE_TILE);
        // f32 partials, and rows of 300 bf16 (600 bytes): the build choice falls back, the
        // configuration's tile is refused
        let f32_out = GemmRsConfig {
            output: DType::F32,
            ..bf16
        };
        let ragged = GemmRsConfig { n: 300, ..bf16 };
        for c in [f32_out, ragged] {
            assert_eq!(fused_tile(&c, wide).unwrap(), TILE);
            let e = fused_tile(
                &GemmRsConfig {
                    tile: WIDE_TILE,
                    ..c
                },
                auto,
            )
            .unwrap_err();
            let line = e.to_string();
            assert!(
                line.contains("16-bit type in rows of whole 16 bytes"),
                "{line}"
            );
            assert!(!line.contains('\n'));
        }
        let other = GemmRsConfig {
            tile: TileShape { m: 64, n: 64 },
            ..bf16
        };
        let e = fused_tile(&other, wide).unwrap_err().to_string();
        assert!(e.contains("asks for 64×64"), "{e}");
    }

    /// Ranks whose fused paths would lay out their buffers with different tiles do not agree
    /// (the export's agreement tells them apart, so `connect_exported` refuses the group).
    #[test]
    fn ranks_of_different_tiles_disagree() {
        let c = GemmRsConfig::new(256, 1000, 64, BLayout::NK, DType::BF16, DType::BF16);
        let wide = GemmRsConfig {
            tile: WIDE_TILE,
            ..c
        };
        assert_eq!(agreement(&c), agreement(&c));
        assert_ne!(agreement(&c), agreement(&wide));
    }
}
