//! All-gather + GEMM on GPUs, one object per rank ([`AgGemmRank`]), called on the caller's
//! buffers and stream: the overlapped schedule of [`commfuse_core::fused::ag_gemm`] with
//! cuBLASLt GEMMs on the caller's stream and copy-engine copies on a side stream, ordered across
//! GPUs by the one-thread flag kernels of [`crate::gemm_rs::flag_step`].
//!
//! A call: the side stream (after the caller's earlier work) copies this rank's chunk, piece by
//! piece, into every peer's gather buffer and raises each piece's flag there. Meanwhile the
//! caller's stream computes the rank's own rows from the caller's A, then each peer's piece after a
//! wait for its flag, from the gather buffer, each GEMM writing its rows of the caller's output
//! (and, when asked, copying the gathered rows into the caller's buffer). At the end the rank
//! raises "done" on every peer, and waits for nothing: it is the side stream that waits for a
//! peer's done of the previous call, before its first copy into that peer, so no cross-GPU round
//! trip lies on the caller's stream. Dropping a rank first waits (bounded) for its peers' dones of
//! its last call, the last writes into its memory, and leaks that memory where one has not come.
//! The first call of each M lets cuBLASLt choose its algorithms and runs each piece's GEMM once
//! before queueing anything (after the earlier calls, waited for on the host): a kernel loaded
//! while a flag wait spins can stall the peers (CHANGELOG.md, "GEMM + reduce-scatter's overlapped
//! path").
//!
//! The fused path (`AgGemmConfig::fused`) moves the same pieces with the same flags and
//! dones, but the caller's stream runs one GEMM of our own over all M rows
//! ([`commfuse_core::fused::ag_gemm::AgGemmSchedule::fused_plan`]): the rank's own rows straight
//! from the caller's A (a second TMA map), the peers' from the gather buffer, each row band's
//! loads held back by its producer until the band's piece flag holds the call's number (read
//! from the flag steps' count on the device, so a captured call stays graph-safe). The GEMM
//! leaves one SM free: the side stream's flag kernels must run beside its persistent grid, or
//! a GEMM waiting for a peer's rows would wait for a flag that cannot be raised. (Kernels of
//! other streams may take that SM too; the flags then come late, and a band that waits longer
//! than the operator's timeout gives up, which `check` reports and which ends the operator.)
//!
//! The flag steps number the calls on the device (each call's last step advances the rank's
//! count), so a call captured into a CUDA graph is a new call at every replay; the first call of
//! an M, which waits on the host, must come before the capture. The simulator runs the same
//! protocol (`commfuse_sim::ag_gemm`) for P = 1..9 in CI.
//!
//! Its bench, `commfuse bench ag-gemm`, is [`bench`](mod@bench).

pub mod bench;
pub mod checked;

use crate::backend::plan_table::MAX_RANKS;
use crate::error::CudaError;
use crate::gemm::{
    check_problem, check_tile, CallNumber, Gather, GemmKernels, GemmOperands, InUse, Launched,
    PreparedGemm, TILE,
};
use crate::gemm_rs::flag_step::{hand_on, FlagCmp, FlagStep, FlagSteps, PeerMemory, THIS_CALL};
use crate::sys::cublaslt::Lt;
use crate::sys::driver::{DeviceMemory, Event, Gpu, IpcMapping, Stream};
use crate::sys::ipc::Exported;
pub use commfuse_core::fused::ag_gemm::AgGemmConfig;
use commfuse_core::fused::ag_gemm::{AgGemmSchedule, AgPiece, MAX_PIECES};
use commfuse_core::gemm::{BLayout, GemmProblem};
use std::collections::{HashMap, HashSet};
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

/// What the first call of an M waits for on the host (see [`AgGemmRank::forward`]).
fn warm_up(m: usize) -> String {
    format!("its warm-up GEMMs of M = {m} on the tuning stream")
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unavailable(msg)
}

/// What a rank shares with its peers: its gather buffer and flag words, and the context they
/// belong to (see [`PeerMemory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AgGemmPeer {
    pub gather: u64,
    pub flags: u64,
    pub context: u64,
}

/// The memory of a rank, freed only after its last call has ended.
struct AgMemory {
    /// [max_m, K] of the input type: the peers' chunks land here
    gather: DeviceMemory,
    flags: DeviceMemory,
    steps: FlagSteps,
}

impl InUse for AgMemory {
    fn abort(&self) {
        self.steps.abort();
    }
}

/// A rank's allocations before it knows its peers.
pub struct AgGemmAllocation {
    rank: usize,
    world: usize,
    config: AgGemmConfig,
    memory: AgMemory,
    gpu: Arc<Gpu>,
}

impl AgGemmAllocation {
    pub fn new(
        gpu: Arc<Gpu>,
        rank: usize,
        world: usize,
        config: AgGemmConfig,
    ) -> Result<AgGemmAllocation, CudaError> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(unsupported(format!(
                "rank {rank} of {world}: all-gather + GEMM takes 1 to {MAX_RANKS} ranks"
            )));
        }
        if config.pieces == 0 || config.pieces > MAX_PIECES {
            return Err(unsupported(format!(
                "all-gather + GEMM cuts a chunk into 1 to {MAX_PIECES} pieces, got {}",
                config.pieces
            )));
        }
        if !(config.k * config.input.size()).is_multiple_of(16)
            || !(config.n * config.output.size()).is_multiple_of(16)
        {
            return Err(unsupported(format!(
                "all-gather + GEMM needs rows of A and of the output of whole 16-byte units (K = {}, N = {})",
                config.k, config.n
            )));
        }
        if config.fused && config.b_layout == BLayout::KN && !config.n.is_multiple_of(8) {
            return Err(unsupported(format!(
                "the fused all-gather + GEMM reads B as [K, N] with N a multiple of 8, got N = {}",
                config.n
            )));
        }
        let shape = config.shape(world, config.max_m)?;
        if config.fused {
            check_tile(config.tile)?;
            check_problem(&shape.problem())?;
        }
        let s = AgGemmSchedule::new(shape, 1);
        Ok(AgGemmAllocation {
            memory: AgMemory {
                gather: DeviceMemory::zeroed(&gpu, config.max_m * config.k * config.input.size())?,
                // the flag words, then a 16-byte landing slot per sender for the first copy
                // (see connect), which nothing reads
                flags: DeviceMemory::zeroed(&gpu, 8 * s.flag_words() + 16 * world)?,
                steps: FlagSteps::numbered_on_device(&gpu, rank, config.timeout)?,
            },
            rank,
            world,
            config,
            gpu,
        })
    }

    pub fn peer(&self) -> AgGemmPeer {
        AgGemmPeer {
            gather: self.memory.gather.addr(),
            flags: self.memory.flags.addr(),
            context: self.gpu.raw_ctx() as u64,
        }
    }

    /// What this rank exports for peers in other processes: the IPC handles of its gather
    /// buffer and flags.
    pub fn export(&self) -> Result<Exported, CudaError> {
        Ok(Exported {
            operator: "ag-gemm".into(),
            rank: self.rank,
            world: self.world,
            handles: vec![
                self.memory.gather.ipc_handle(&self.gpu)?,
                self.memory.flags.ipc_handle(&self.gpu)?,
            ],
            extra: self.agreement(),
        })
    }

    /// What every rank must have built alike (see [`crate::sys::ipc::agreement`]): the rows and
    /// the input type and K of the gathered A (peers write their rows into this rank's gather
    /// buffer), and how its pieces are handed on. N, B's layout, the bias and the output are
    /// each rank's own: a column-parallel layer's shards may differ in N.
    fn agreement(&self) -> Vec<u8> {
        let c = &self.config;
        crate::sys::ipc::agreement(&[
            ("max_m", c.max_m.to_string()),
            ("k", c.k.to_string()),
            ("input", c.input.to_string()),
            ("pieces", c.pieces.to_string()),
            ("fused", c.fused.to_string()),
        ])
    }

    /// Finishes the rank from every rank's [`AgGemmAllocation::export`] (rank order, its own
    /// among them) when the peers live in other processes.
    pub fn connect_exported(self, exports: &[Exported]) -> Result<AgGemmRank, CudaError> {
        Exported::check_group(exports, "ag-gemm", self.world, 2)?;
        crate::sys::ipc::check_agreement("ag-gemm", self.rank, &self.agreement(), exports, |e| {
            e.extra.as_slice()
        })?;
        let mut mapped = Vec::new();
        let mut peers = Vec::with_capacity(self.world);
        for (q, e) in exports.iter().enumerate() {
            if q == self.rank {
                peers.push(self.peer());
                continue;
            }
            let gather = IpcMapping::open(&self.gpu, &e.handles[0])?;
            let flags = IpcMapping::open(&self.gpu, &e.handles[1])?;
            // mapped into this process's context: copies to them are plain copies
            peers.push(AgGemmPeer {
                gather: gather.addr(),
                flags: flags.addr(),
                context: 0,
            });
            mapped.extend([gather, flags]);
        }
        let mut rank = self.connect(&peers)?;
        rank.mapped = mapped;
        Ok(rank)
    }

    /// Finishes the rank once every rank's [`AgGemmAllocation::peer`] is known (rank order).
    pub fn connect(self, peers: &[AgGemmPeer]) -> Result<AgGemmRank, CudaError> {
        if peers.len() != self.world || peers[self.rank] != self.peer() {
            return Err(unsupported(format!(
                "rank {} expected the {} ranks' addresses with its own at its place",
                self.rank, self.world
            )));
        }
        let gpu = self.gpu;
        let side = Stream::new(&gpu)?;
        // the first copy between two contexts, made while nothing spins (see gemm_rs::ring),
        // into this rank's landing slot behind the peer's flag words: a peer may already be
        // receiving a call's rows in its gather buffer
        let s = AgGemmSchedule::new(self.config.shape(self.world, self.config.max_m)?, 1);
        for q in (0..self.world).filter(|&q| q != self.rank) {
            let to = PeerMemory {
                addr: peers[q].flags + 8 * s.flag_words() as u64 + 16 * self.rank as u64,
                context: peers[q].context,
            };
            let from = PeerMemory {
                addr: self.memory.gather.addr(),
                context: peers[self.rank].context,
            };
            // SAFETY: both hold at least 16 bytes (K·2 ≥ 16) and outlive the synchronisation
            unsafe { hand_on(&side, to, from, 16)? };
        }
        side.synchronize_within(
            4 * self.config.timeout,
            &format!("all-gather + GEMM rank {}", self.rank),
            "its first copies into the peers' memory",
        )?;
        Ok(AgGemmRank {
            rank: self.rank,
            world: self.world,
            config: self.config,
            peers: peers.to_vec(),
            broken: false,
            lt: Lt::with_alignment(&gpu, 16)?,
            side,
            tune: Stream::new(&gpu)?,
            start: Event::new_untimed(&gpu)?,
            join: Event::new_untimed(&gpu)?,
            tuned: HashSet::new(),
            kernels: if self.config.fused {
                Some(GemmKernels::load(&gpu)?)
            } else {
                None
            },
            fused: HashMap::new(),
            memory: ManuallyDrop::new(Launched::new(&gpu, self.memory)?),
            mapped: Vec::new(),
            gpu,
        })
    }
}

/// One rank's all-gather + GEMM.
pub struct AgGemmRank {
    // dropped first, by `drop` (or leaked there, see it): waits for the last call before
    // anything it uses (cuBLASLt's workspace, the streams, the events, the peers' mappings) goes
    memory: ManuallyDrop<Launched<AgMemory>>,
    rank: usize,
    world: usize,
    config: AgGemmConfig,
    peers: Vec<AgGemmPeer>,
    broken: bool,
    lt: Lt,
    side: Stream,
    tune: Stream,
    start: Event,
    join: Event,
    /// The M whose GEMMs cuBLASLt has chosen algorithms for (or whose fused GEMM is built)
    tuned: HashSet<usize>,
    /// Our GEMM's entry points (the fused path)
    kernels: Option<GemmKernels>,
    /// The fused path's GEMM of each M called
    fused: HashMap<usize, PreparedGemm>,
    /// Peers' buffers opened from other processes (closed after the memory above is released)
    mapped: Vec<IpcMapping>,
    gpu: Arc<Gpu>,
}

impl AgGemmRank {
    /// Builds every rank of a group whose GPUs this process drives (peer access enabled
    /// between them): rank r on `gpus[r]`.
    pub fn create_group(
        gpus: &[Arc<Gpu>],
        config: AgGemmConfig,
    ) -> Result<Vec<AgGemmRank>, CudaError> {
        let parts: Vec<AgGemmAllocation> = gpus
            .iter()
            .enumerate()
            .map(|(r, g)| AgGemmAllocation::new(g.clone(), r, gpus.len(), config))
            .collect::<Result<_, _>>()?;
        let peers: Vec<AgGemmPeer> = parts.iter().map(AgGemmAllocation::peer).collect();
        parts.into_iter().map(|p| p.connect(&peers)).collect()
    }

    /// What the operator was built for.
    pub fn config(&self) -> &AgGemmConfig {
        &self.config
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Who waits, in a bounded host wait's error.
    fn who(&self) -> String {
        format!("all-gather + GEMM rank {}", self.rank)
    }

    /// Rows of the gathered A this rank holds at `m`.
    pub fn chunk(&self, m: usize) -> std::ops::Range<usize> {
        commfuse_core::op::chunk_range(m, self.world, self.rank)
    }

    fn problem(&self, rows: usize) -> GemmProblem {
        let c = &self.config;
        GemmProblem {
            m: rows,
            n: c.n,
            k: c.k,
            b_layout: c.b_layout,
            input: c.input,
            output: c.output,
        }
    }

    /// Where piece `g`'s rows of A are: the caller's chunk for this rank's own rows, the
    /// gather buffer for a peer's.
    fn a_rows(&self, s: &AgGemmSchedule, g: &AgPiece, a: u64) -> u64 {
        let row_bytes = (self.config.k * self.config.input.size()) as u64;
        if g.local {
            a + (g.rows.start - s.shape.chunk(self.rank).start) as u64 * row_bytes
        } else {
            self.memory.gather.addr() + g.rows.start as u64 * row_bytes
        }
    }

    /// Chooses cuBLASLt's algorithms for every GEMM of `m` and runs each once in the call's
    /// own form into `out` (which the call overwrites), after waiting on the host for the
    /// earlier calls; see the module doc.
    ///
    /// # Safety
    /// As [`AgGemmRank::forward`].
    unsafe fn prepare(
        &mut self,
        stream: &Stream,
        capturing: bool,
        s: &AgGemmSchedule,
        (a, b, bias, out): (u64, u64, Option<u64>, u64),
    ) -> Result<(), CudaError> {
        if self.tuned.contains(&s.shape.m) {
            return Ok(());
        }
        if capturing {
            return Err(unsupported(format!(
                "all-gather + GEMM: M = {} was never called outside a CUDA graph capture, and its first call prepares on the host: call it once before capturing",
                s.shape.m
            )));
        }
        let limit = 4 * self.config.timeout;
        if !self.memory.wait_last(limit)? {
            return Err(unsupported(format!(
                "all-gather + GEMM: rank {}'s earlier calls still run after {limit:?}",
                self.rank
            )));
        }
        // and after the caller's earlier work on its stream: the warm-up writes the caller's
        // output, which that work may still use
        self.start.record(stream)?;
        self.tune.wait_event(&self.start)?;
        if self.config.fused {
            let gemm = self.fused_gemm(s)?;
            // once, as call 0: every flag holds at least 0, so nothing waits; the rows read
            // from the gather buffer are stale, and the output is overwritten by the call
            gemm.launch_gather_call(&self.tune, a, b, bias, out, CallNumber::Host(0))?;
            self.tune
                .synchronize_within(limit, &self.who(), &warm_up(s.shape.m))?;
            self.fused.insert(s.shape.m, gemm);
            self.tuned.insert(s.shape.m);
            return Ok(());
        }
        let mut seen = HashSet::new();
        for g in s.gemms_of(self.rank) {
            let problem = self.problem(g.rows.len());
            if seen.insert(g.rows.len()) {
                let operands = (self.a_rows(s, &g, a), b, out);
                self.lt
                    .tune(&self.tune, &problem, 0, bias.is_some(), operands)?;
            }
            let at = (self.a_rows(s, &g, a), b, out, out);
            self.lt
                .matmul_into(&self.tune, &problem, 0, at, bias, 1.0, 0.0)?;
        }
        self.tune
            .synchronize_within(limit, &self.who(), &warm_up(s.shape.m))?;
        self.tuned.insert(s.shape.m);
        Ok(())
    }

    /// The fused path's GEMM for the shape of `s` on this rank: the gather buffer as A, each
    /// band waiting for its piece's flag in this rank's flag words, the rank's own rows from
    /// the caller's A; one SM left to the side stream's flag kernels (see the module doc).
    fn fused_gemm(&self, s: &AgGemmSchedule) -> Result<PreparedGemm, CudaError> {
        let kernels = self.kernels.as_ref().ok_or_else(|| {
            unsupported("this all-gather + GEMM was built without the fused path".into())
        })?;
        let group = commfuse_core::fused::gemm_rs::ORDER_GROUP;
        let plan = s.fused_plan(self.rank, TILE, self.config.bias, group);
        let flags = self.memory.flags.addr();
        let band_flags = s
            .band_waits(self.rank, TILE.m)
            .into_iter()
            .map(|w| {
                w.map_or(0, |(owner, piece)| {
                    flags + 8 * s.flag_index(owner, piece) as u64
                })
            })
            .collect();
        let gather = Gather {
            band_flags,
            local: s.shape.chunk(self.rank),
            timeout: self.config.timeout,
        };
        // B, the bias and D come with each call; the gather buffer stands in for them here
        let buffer = self.memory.gather.addr();
        let ops = GemmOperands {
            a: buffer,
            b: buffer,
            c: None,
            bias: self.config.bias.then_some(buffer),
            d: buffer,
        };
        let sm_cap = self.gpu.sm_count.saturating_sub(1).max(1);
        PreparedGemm::gathering(&self.gpu, kernels, &plan, &ops, &gather, sm_cap, self.rank)
    }

    /// Which path calls take: "fused" or "overlapped (C pieces)".
    pub fn path(&self) -> String {
        if self.config.fused {
            "fused".into()
        } else {
            let c = self.config.pieces;
            format!("overlapped ({c} piece{})", if c == 1 { "" } else { "s" })
        }
    }

    /// Enqueues one call on `stream`: AllGather(A)·B (+ bias) into `out` ([m, N] row-major)
    /// and, when `gathered` is given, the gathered A into it ([m, K]). Returns once queued.
    ///
    /// # Safety
    /// `stream` must be a stream of this rank's GPU; `a` ([chunk rows, K], the rank's rows of
    /// A), `b` ([N, K] or [K, N]), `bias` ([N], output type), `out` and `gathered` must be
    /// device memory of this GPU, 16-byte aligned, valid until the call completes on `stream`;
    /// `out` and `gathered` must not overlap the others.
    pub unsafe fn forward(
        &mut self,
        stream: &Stream,
        m: usize,
        (a, b, bias): (u64, u64, Option<u64>),
        out: u64,
        gathered: Option<u64>,
    ) -> Result<(), CudaError> {
        let c = self.config;
        // a fused GEMM that gave up on a band in an earlier call (its record says so whether or
        // not `check` ran) leaves the protocol's state unknown
        if self.fused.values().any(|g| g.stall_report().is_some()) {
            self.broken = true;
        }
        if self.broken {
            return Err(unsupported(
                "this all-gather + GEMM failed earlier; its peers' state is unknown: build a new one"
                    .into(),
            ));
        }
        if m == 0 || m > c.max_m {
            return Err(unsupported(format!(
                "M must be 1 to {} (the max_m this operator was built for), got {m}",
                c.max_m
            )));
        }
        if bias.is_some() != c.bias {
            return Err(unsupported(format!(
                "this operator was built {} a bias",
                if c.bias { "with" } else { "without" }
            )));
        }
        let pointers = [Some(a), Some(b), bias, Some(out), gathered];
        if pointers.iter().flatten().any(|p| !p.is_multiple_of(16)) {
            return Err(unsupported(
                "A, B, the bias, the output and the gathered A must start on 16-byte boundaries"
                    .into(),
            ));
        }
        self.gpu.bind()?;
        let s = AgGemmSchedule::new(c.shape(self.world, m)?, c.pieces);
        // asked once: each ask is a driver call on every call's path
        let capturing = stream.is_capturing()?;
        // after the previous call even if it went on another stream
        self.memory.order_after_last_if(stream, capturing)?;
        let result = self
            .prepare(stream, capturing, &s, (a, b, bias, out))
            .and_then(|()| self.enqueue(stream, capturing, &s, (a, b, bias), out, gathered));
        if result.is_err() {
            // some ranks may have queued their part: the protocol's state is unknown. What
            // this rank queued stays before the caller's later work and before its memory may
            // be freed; its waits stop spinning
            self.broken = true;
            let _ = self.join.record(&self.side);
            let _ = stream.wait_event(&self.join);
            let _ = self.memory.launched(stream);
            self.memory.steps.abort();
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue(
        &mut self,
        stream: &Stream,
        capturing: bool,
        s: &AgGemmSchedule,
        (a, b, bias): (u64, u64, Option<u64>),
        out: u64,
        gathered: Option<u64>,
    ) -> Result<(), CudaError> {
        let c = self.config;
        // the steps number the call on the device (a CUDA graph may replay it)
        let epoch = THIS_CALL;
        let mem = &*self.memory;
        let (row_in, row_out) = (
            (c.k * c.input.size()) as u64,
            (c.n * c.output.size()) as u64,
        );
        let me = self.peers[self.rank];
        // alone, a rank hands nothing on and waits for no peer: the side stream stays idle, and
        // the call is its GEMMs on the caller's stream (no fork and join to pay on the host)
        let forks = self.world > 1;
        if forks {
            // the side stream hands this rank's pieces on once the caller's A is written
            self.start.record(stream)?;
            self.side.wait_event(&self.start)?;
            // and once each peer has finished reading its gather buffer in the previous call
            self.queue_peers_done(s)?;
        }
        let chunk_start = s.shape.chunk(self.rank).start;
        for g in s.sent_by(self.rank) {
            let from = PeerMemory {
                addr: a + (g.rows.start - chunk_start) as u64 * row_in,
                context: me.context,
            };
            let bytes = g.rows.len() * row_in as usize;
            for q in s.receivers_of(self.rank) {
                let to = PeerMemory {
                    addr: self.peers[q].gather + g.rows.start as u64 * row_in,
                    context: self.peers[q].context,
                };
                hand_on(&self.side, to, from, bytes)?;
                let flag = self.peers[q].flags + 8 * s.flag_index(self.rank, g.piece) as u64;
                let at = (self.rank, s.flag_index(self.rank, g.piece));
                mem.steps.queue(&self.side, None, Some((flag, epoch)), at)?;
            }
        }
        if let Some(gemm) = self.fused.get(&s.shape.m) {
            let counter = mem
                .steps
                .counter()
                .expect("the steps number calls on the device");
            gemm.launch_gather_call(stream, a, b, bias, out, CallNumber::Counted { counter })?;
            if let Some(gathered) = gathered {
                // every piece has landed: the GEMM waited for each one's flag
                let mine = s.shape.chunk(self.rank);
                let m = s.shape.m;
                let at = |row: usize| row as u64 * row_in;
                for rows in [0..mine.start, mine.end..m] {
                    if !rows.is_empty() {
                        let from = mem.gather.addr() + at(rows.start);
                        stream.copy_async(
                            gathered + at(rows.start),
                            from,
                            rows.len() * row_in as usize,
                        )?;
                    }
                }
                if !mine.is_empty() {
                    stream.copy_async(
                        gathered + at(mine.start),
                        a,
                        mine.len() * row_in as usize,
                    )?;
                }
            }
        } else {
            for g in s.gemms_of(self.rank) {
                if !g.local {
                    let index = s.flag_index(g.owner, g.piece);
                    let wait = Some((mem.flags.addr() + 8 * index as u64, epoch, FlagCmp::Eq));
                    mem.steps.queue(stream, wait, None, (g.owner, index))?;
                }
                let rows_a = self.a_rows(s, &g, a);
                if let Some(gathered) = gathered {
                    let to = gathered + g.rows.start as u64 * row_in;
                    stream.copy_async(to, rows_a, g.rows.len() * row_in as usize)?;
                }
                let d = out + g.rows.start as u64 * row_out;
                let problem = self.problem(g.rows.len());
                self.lt
                    .matmul_into(stream, &problem, 0, (rows_a, b, d, d), bias, 1.0, 0.0)?;
            }
        }
        if forks {
            self.join.record(&self.side)?;
            stream.wait_event(&self.join)?;
        }
        // done: this rank has read its gather buffer (the peers' side streams wait for it before
        // they next write there); the last raise ends the call
        let mine = s.done_index(self.rank);
        let others: Vec<usize> = (0..self.world).filter(|&q| q != self.rank).collect();
        for (i, &q) in others.iter().enumerate() {
            let step = FlagStep {
                raise: Some((self.peers[q].flags + 8 * mine as u64, epoch)),
                ends_call: i + 1 == others.len(),
                ..FlagStep::default()
            };
            mem.steps.queue_step(stream, step, (self.world, mine))?;
        }
        self.memory.launched_if(stream, capturing)?;
        Ok(())
    }

    /// Queues on the side stream a wait for every peer's done of the last call finished (the
    /// steps' numbering: value 0 is that call's number; nothing to wait for before a first call).
    ///
    /// # Safety
    /// The flags are this rank's, live until the side stream has run the waits.
    unsafe fn queue_peers_done(&self, s: &AgGemmSchedule) -> Result<(), CudaError> {
        let mem = &*self.memory;
        for q in (0..self.world).filter(|&q| q != self.rank) {
            let index = s.done_index(q);
            let wait = Some((mem.flags.addr() + 8 * index as u64, 0, FlagCmp::Ge));
            mem.steps
                .queue(&self.side, wait, None, (self.world, index))?;
        }
        Ok(())
    }

    /// After the caller's stream was synchronised: the diagnosis of a wait that timed out in
    /// any call so far, if one did. Marks the operator unusable when it reports one.
    pub fn check(&mut self) -> Result<(), CudaError> {
        if let Some(stalled) = self.fused.values().find_map(PreparedGemm::stall_report) {
            self.broken = true;
            return Err(unsupported(format!("all-gather + GEMM (fused): {stalled}")));
        }
        let Some(e) = self.memory.steps.timeout() else {
            return Ok(());
        };
        self.broken = true;
        let what = if e.step as usize == self.world {
            format!("rank {}'s done", e.index as usize - self.world * MAX_PIECES)
        } else {
            format!(
                "piece {} of rank {}'s chunk",
                e.index as usize % MAX_PIECES,
                e.step
            )
        };
        Err(unsupported(format!(
            "all-gather + GEMM: rank {} waited for {what} to reach call {}, saw {} after {:?}",
            e.rank, e.expected, e.seen, self.config.timeout
        )))
    }
}

impl AgGemmRank {
    /// Whether no peer can write into this rank's memory any more: every peer's done of this
    /// rank's last call has arrived (waited for on the side stream, bounded on the device by
    /// the configured timeout and on the host by a second more), or why not.
    fn peers_are_done(&mut self) -> Result<(), String> {
        if self.world == 1 {
            return Ok(());
        }
        if self.broken {
            return Err("it failed earlier, so its peers' state is unknown".into());
        }
        self.gpu.bind().map_err(|e| e.to_string())?;
        let s = self
            .config
            .shape(self.world, self.config.max_m)
            .map_err(|e| e.to_string())?;
        let s = AgGemmSchedule::new(s, 1);
        self.memory
            .order_after_last(&self.side)
            .and_then(|()| {
                // SAFETY: the flags live until the memory is dropped, after this wait
                unsafe { self.queue_peers_done(&s) }
            })
            .and_then(|()| self.join.record(&self.side))
            .map_err(|e| e.to_string())?;
        let limit = self.config.timeout + Duration::from_secs(1);
        match crate::sys::host_sync::poll_until(limit, || self.join.is_done()) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "its wait for the peers' dones of its last call still ran after {limit:?}"
                ))
            }
            Err(e) => return Err(e.to_string()),
        }
        // a device wait that gave up lets the side stream go on without the done it awaited
        match self.memory.steps.timeout() {
            None => Ok(()),
            Some(e) => Err(format!(
                "rank {}'s done of its last call had not come after {:?}",
                e.index as usize - self.world * MAX_PIECES,
                self.config.timeout
            )),
        }
    }
}

impl Drop for AgGemmRank {
    /// Frees the memory only once no peer can write into it: a peer raises its done of this
    /// rank's last call into this rank's flags after its own call, possibly after this rank's
    /// ended, and a done written into freed memory corrupts whatever is allocated there next
    /// (in this process or, through IPC, in the peer's view of it). Where a done has not come
    /// (a peer slow, stuck or dead, or the operator failed earlier), the gather buffer and
    /// flags are leaked on purpose, with one line on stderr saying so.
    fn drop(&mut self) {
        match self.peers_are_done() {
            // SAFETY: dropped once, here; its own drop waits for this rank's last launch
            Ok(()) => unsafe { ManuallyDrop::drop(&mut self.memory) },
            Err(why) => {
                self.memory.steps.abort();
                // this rank's own last launch reads the peers' memory mapped here: closed
                // only once it has ended
                let limit = 4 * self.config.timeout;
                if !matches!(self.memory.wait_last(limit), Ok(true)) {
                    std::mem::forget(std::mem::take(&mut self.mapped));
                }
                let bytes = self.memory.gather.len_bytes() + self.memory.flags.len_bytes();
                eprintln!(
                    "commfuse: all-gather + GEMM rank {} leaves its gather buffer and flags ({bytes} bytes on GPU {}) allocated: {why}, and a late done would write into freed memory",
                    self.rank, self.gpu.ordinal
                );
            }
        }
    }
}
