//! The overlapped path of GEMM + reduce-scatter: the ring of
//! [`commfuse_core::fused::ring_rs`] run with cuBLASLt GEMMs on the caller's stream and
//! copy-engine copies on a side stream, ordered across GPUs by one-thread flag kernels
//! (`ring_flag` in gemm_rs.cu).
//!
//! Per piece of a step that is handed on: the GEMM writes the running sum into this rank's send
//! buffer, an event lets the side stream copy it into the receiver's receive buffer (the copy
//! engine: no SM is taken from the GEMMs) and raise its flag there. A piece that adds a received
//! running sum is preceded on the caller's stream by a wait for that flag; its GEMM reads the
//! sum as C with beta = 1, so the reduction costs no pass of its own. The caller's stream waits
//! for the side stream at the end of the call (the send buffers are free again). Alternate
//! calls use alternate sets of receive buffers and flags, which is all back-to-back calls need
//! (why: [`commfuse_core::fused::ring_rs`]; a call of M < P rows also ends with a "done"
//! handshake: the rank tells its sender it has read its receive buffers and waits for its
//! receiver to say the same); when a call ends on a rank, every peer's write into
//! its memory for the call has landed, so an operator may be dropped in any order once its
//! stream is past its last call.

use super::{shape, GemmRsConfig};
use crate::error::CudaError;
use crate::gemm::{InUse, Launched};
use crate::gemm_rs::flag_step::{hand_on, FlagCmp, FlagStep, FlagSteps, PeerMemory};
use crate::sys::cublaslt::Lt;
use crate::sys::driver::{DeviceMemory, Event, Gpu, IpcHandle, Stream};
use commfuse_core::fused::ring_rs::{
    RingLink, RingPiece, RingSchedule, RingTarget, DONE_FLAGS, MAX_PIECES,
};
use commfuse_core::gemm::GemmProblem;
use std::collections::HashSet;
use std::sync::Arc;

/// With COMMFUSE_TRACE_RING set: when each rank reaches each stage of a call (to stderr).
fn trace(rank: usize, call: u64, what: &str) {
    static START: std::sync::OnceLock<Option<std::time::Instant>> = std::sync::OnceLock::new();
    let start = START
        .get_or_init(|| std::env::var_os("COMMFUSE_TRACE_RING").map(|_| std::time::Instant::now()));
    if let Some(t) = start {
        eprintln!(
            "ring: {:>10.3} ms rank {rank} call {call} {what}",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// What a rank shares with its peers for the ring: its receive buffers and flag words, and
/// the context they belong to (a raw `CUcontext` of this process; 0 when they are mapped into
/// each peer's own context, as memory shared between processes is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RingPeer {
    pub receive: u64,
    pub flags: u64,
    pub context: u64,
}

impl RingPeer {
    /// `addr` (this rank's memory) as a copy endpoint.
    fn at(&self, addr: u64) -> PeerMemory {
        PeerMemory {
            addr,
            context: self.context,
        }
    }
}

/// The ring's memory, freed only after the last call that used it.
pub(crate) struct RingMemory {
    receive: DeviceMemory,
    send: DeviceMemory,
    flags: DeviceMemory,
    /// The flag kernel and the record of its waits (dropped with the memory: its abort stops
    /// the waits before anything is freed)
    steps: FlagSteps,
}

impl InUse for RingMemory {
    fn abort(&self) {
        self.steps.abort();
    }
}

impl RingMemory {
    /// Receive buffers (two sets), send buffers and flags for calls of up to `max_m` rows.
    pub(crate) fn new(
        gpu: &Gpu,
        rank: usize,
        world: usize,
        config: &GemmRsConfig,
    ) -> Result<RingMemory, CudaError> {
        let s = schedule(config, world, config.max_m, 1)?;
        let eb = config.output.size();
        Ok(RingMemory {
            receive: DeviceMemory::zeroed(gpu, (s.receive_len() * eb).max(16))?,
            // at least one buffer: it is also cuBLASLt's scratch output while choosing
            send: DeviceMemory::zeroed(gpu, s.send_len().max(s.buffer_len()).max(8) * eb)?,
            flags: DeviceMemory::zeroed(gpu, 8 * s.flag_words())?,
            steps: FlagSteps::new(gpu, rank, config.timeout)?,
        })
    }

    pub(crate) fn peer(&self, gpu: &Gpu) -> RingPeer {
        RingPeer {
            receive: self.receive.addr(),
            flags: self.flags.addr(),
            context: gpu.raw_ctx() as u64,
        }
    }

    /// The IPC handles of the receive buffers and the flags, for peers in other processes.
    pub(crate) fn ipc_handles(&self, gpu: &Gpu) -> Result<[IpcHandle; 2], CudaError> {
        Ok([self.receive.ipc_handle(gpu)?, self.flags.ipc_handle(gpu)?])
    }
}

/// Which parts of a ring call run (the ablation of `bench gemm-rs --ablation`; anything but
/// [`RingParts::WHOLE`] computes a wrong result and is for timing only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingParts {
    /// The cuBLASLt GEMMs
    pub gemms: bool,
    /// The copy-engine hand-ons
    pub copies: bool,
    /// The flag waits and raises
    pub flags: bool,
}

impl RingParts {
    pub const WHOLE: RingParts = RingParts {
        gemms: true,
        copies: true,
        flags: true,
    };
}

/// One rank's ring path.
pub(crate) struct RingPath {
    // dropped first (fields drop in order): waits for the last call before anything it uses
    // (cuBLASLt's workspace, the streams, the events) goes
    memory: Launched<RingMemory>,
    rank: usize,
    world: usize,
    config: GemmRsConfig,
    peers: Vec<RingPeer>,
    /// Calls queued on this path (the next call's number is one more)
    calls: u64,
    lt: Lt,
    side: Stream,
    /// Where cuBLASLt's choices are timed ahead of the first call of an M
    tune: Stream,
    /// One per piece of a call: its GEMM has been queued
    piece_done: Vec<Event>,
    join: Event,
    /// (M, pieces) whose GEMMs cuBLASLt has chosen algorithms for
    tuned: HashSet<(usize, usize)>,
    /// Keeps the context alive until everything above is freed
    _gpu: Arc<Gpu>,
}

impl RingPath {
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        rank: usize,
        config: GemmRsConfig,
        memory: RingMemory,
        peers: Vec<RingPeer>,
    ) -> Result<RingPath, CudaError> {
        let world = peers.len();
        let events = (0..world * MAX_PIECES)
            .map(|_| Event::new_untimed(&gpu))
            .collect::<Result<_, _>>()?;
        let side = Stream::new(&gpu)?;
        // The first copy between two GPUs' contexts holds the host until the destination GPU
        // is idle (measured: 5 s stalls, while that GPU spun on a flag this rank had yet to
        // raise). Make that first copy here, while nothing spins, to the receiver on each link:
        // 16 bytes of the send buffer into the start of its receive buffers, not read before a
        // flag.
        let ring = schedule(&config, world, config.max_m, 1)?;
        for link in ring.links() {
            let receiver = peers[ring.receiver_on(rank, link)];
            // SAFETY: both buffers hold at least 16 bytes and outlive the synchronisation
            unsafe {
                hand_on(
                    &side,
                    receiver.at(receiver.receive),
                    peers[rank].at(memory.send.addr()),
                    16,
                )?
            };
        }
        side.synchronize_within(
            4 * config.timeout,
            &format!("GEMM + reduce-scatter (ring) rank {rank}"),
            "its first copies into the peers' memory",
        )?;
        Ok(RingPath {
            rank,
            world,
            config,
            peers,
            calls: 0,
            // the pieces start on row boundaries: 16 bytes is all their pointers promise
            lt: Lt::with_alignment(&gpu, 16)?,
            side,
            tune: Stream::new(&gpu)?,
            piece_done: events,
            join: Event::new_untimed(&gpu)?,
            tuned: HashSet::new(),
            memory: Launched::new(&gpu, memory)?,
            _gpu: gpu,
        })
    }

    fn schedule(&self, m: usize, pieces: usize) -> Result<RingSchedule, CudaError> {
        schedule(&self.config, self.world, m, pieces)
    }

    fn problem(&self, rows: usize) -> GemmProblem {
        GemmProblem {
            m: rows,
            n: self.config.n,
            k: self.config.k,
            b_layout: self.config.b_layout,
            input: self.config.input,
            output: self.config.output,
        }
    }

    /// Lets cuBLASLt choose the algorithm of every GEMM of (M, pieces) before the call queues
    /// anything, timing the candidates on the call's own A and B into the send buffer. It
    /// first waits on the host for this operator's earlier calls (whose GEMMs share cuBLASLt's
    /// workspace and whose copies read the send buffer), and the host waits for the timing. Nothing is allocated: an allocation can wait for the peers' GPUs, which may be
    /// spinning on flags this call has yet to raise.
    ///
    /// # Safety
    /// `a` and `b` as for the call.
    unsafe fn prepare(
        &mut self,
        stream: &Stream,
        s: &RingSchedule,
        a: u64,
        b: u64,
    ) -> Result<(), CudaError> {
        if self.tuned.contains(&(s.shape.m, s.pieces)) {
            return Ok(());
        }
        // The earlier calls first, on the host too: loading a kernel (cuBLASLt does at a
        // first launch) holds this context until the GPU is idle, and a peer's copy into our
        // memory needs this context meanwhile; with a flag wait of ours still spinning, that
        // peer might be the one it waits for. Bounded: every wait of the earlier calls is.
        let limit = 4 * self.config.timeout;
        if !self.memory.wait_last(limit)? {
            return Err(CudaError::Unavailable(format!(
                "GEMM + reduce-scatter (ring): rank {}'s earlier calls still run after {limit:?}",
                self.rank
            )));
        }
        // and after the caller's earlier work on its stream (which may still write A and B)
        self.join.record(stream)?;
        self.tune.wait_event(&self.join)?;
        let scratch = self.memory.send.addr();
        let mut seen = HashSet::new();
        for g in s.pieces_of(self.rank) {
            let bias = self.config.bias && g.target == RingTarget::Output;
            if seen.insert((g.rows.len(), bias)) {
                let problem = self.problem(g.rows.len());
                self.lt
                    .tune(&self.tune, &problem, 0, bias, (a, b, scratch))?;
            }
        }
        // Each piece's GEMM once, in the very form of the call (C read with beta = 1, the bias
        // epilogue), into the scratch: cuBLASLt may load a kernel variant at its first launch,
        // and loading holds the context until the GPU is idle, which it is not while a flag
        // wait of the call spins (measured: 5 s stalls at first calls). Loaded here, nothing
        // spins yet.
        let set = RingSchedule::set_of(self.calls + 1);
        for g in s.pieces_of(self.rank) {
            let bias = (self.config.bias && g.target == RingTarget::Output).then_some(scratch);
            self.piece_gemm(&self.tune, s, &g, set, (a, b, bias, scratch))?;
        }
        self.tune.synchronize_within(
            limit,
            &format!("GEMM + reduce-scatter (ring) rank {}", self.rank),
            &format!(
                "its warm-up GEMMs of M = {} on the tuning stream",
                s.shape.m
            ),
        )?;
        self.tuned.insert((s.shape.m, s.pieces));
        Ok(())
    }

    /// Queues piece `g`'s GEMM of call set `set` into `d` (with `bias`): A's rows of the piece
    /// times B, plus the received running sum when the piece adds one.
    ///
    /// # Safety
    /// `a`, `b`, `bias` as for the call; `d` the piece's rows × N elements.
    unsafe fn piece_gemm(
        &self,
        stream: &Stream,
        s: &RingSchedule,
        g: &RingPiece,
        set: usize,
        (a, b, bias, d): (u64, u64, Option<u64>, u64),
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let (n, eb) = (c.n as u64, c.output.size() as u64);
        let within = g.within.start as u64 * n;
        let add = g.add.map(|prev| {
            self.memory.receive.addr() + (s.receive_offset(set, prev) as u64 + within) * eb
        });
        let a = a + g.rows.start as u64 * c.k as u64 * c.input.size() as u64;
        let beta = if add.is_some() { 1.0 } else { 0.0 };
        let problem = self.problem(g.rows.len());
        self.lt.matmul_into(
            stream,
            &problem,
            0,
            (a, b, add.unwrap_or(d), d),
            bias,
            1.0,
            beta,
        )
    }

    /// Queues one call (see the module doc); the caller has checked the arguments.
    ///
    /// # Safety
    /// As [`super::GemmRsRank::forward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn enqueue(
        &mut self,
        stream: &Stream,
        m: usize,
        pieces: usize,
        operands: (u64, u64, Option<u64>, u64),
        parts: RingParts,
    ) -> Result<(), CudaError> {
        let result = self.enqueue_call(stream, m, pieces, operands, parts);
        if result.is_err() {
            // part of the call may be queued: keep its side-stream work before the caller's
            // later work and before this memory may be freed, and stop its waits spinning
            let _ = self.join.record(&self.side);
            let _ = stream.wait_event(&self.join);
            let _ = self.memory.launched(stream);
            self.memory.steps.abort();
        }
        result
    }

    unsafe fn enqueue_call(
        &mut self,
        stream: &Stream,
        m: usize,
        pieces: usize,
        (a, b, bias, out): (u64, u64, Option<u64>, u64),
        parts: RingParts,
    ) -> Result<(), CudaError> {
        let s = self.schedule(m, pieces)?;
        // after the previous call even if it went on another stream
        self.memory.order_after_last(stream)?;
        trace(self.rank, self.calls + 1, "prepare");
        self.prepare(stream, &s, a, b)?;
        trace(self.rank, self.calls + 1, "enqueue");
        let epoch = self.calls + 1;
        let set = RingSchedule::set_of(epoch);
        let n = self.config.n as u64;
        let eb = self.config.output.size() as u64;
        let mem = &*self.memory;
        for (i, g) in s.pieces_of(self.rank).iter().enumerate() {
            let within = g.within.start as u64 * n;
            if let (Some(prev), true) = (g.add, parts.flags) {
                let index = s.flag_index(set, prev, g.piece);
                let flag = mem.flags.addr() + 8 * index as u64;
                let wait = Some((flag, epoch, FlagCmp::Eq));
                mem.steps.queue(stream, wait, None, (g.step, index))?;
            }
            let (d, bias_here) = match g.target {
                RingTarget::Send { step } => (
                    mem.send.addr() + (step as u64 * s.buffer_len() as u64 + within) * eb,
                    None,
                ),
                RingTarget::Output => (out + within * eb, bias),
            };
            trace(self.rank, epoch, "gemm");
            if parts.gemms {
                self.piece_gemm(stream, &s, g, set, (a, b, bias_here, d))?;
            }
            if let RingTarget::Send { step } = g.target {
                let receiver = self.peers[s.receiver(self.rank, step)];
                trace(self.rank, epoch, "record");
                let done = &self.piece_done[i];
                done.record(stream)?;
                self.side.wait_event(done)?;
                let to = receiver.receive + (s.receive_offset(set, step) as u64 + within) * eb;
                trace(self.rank, epoch, "copy");
                if parts.copies {
                    let bytes = (g.rows.len() as u64 * n * eb) as usize;
                    let from = self.peers[self.rank].at(d);
                    hand_on(&self.side, receiver.at(to), from, bytes)?;
                }
                trace(self.rank, epoch, "raise");
                let index = s.flag_index(set, step, g.piece);
                if parts.flags {
                    let raise = Some((receiver.flags + 8 * index as u64, epoch));
                    mem.steps.queue(&self.side, None, raise, (g.step, index))?;
                }
            }
        }
        trace(self.rank, epoch, "join");
        self.join.record(&self.side)?;
        stream.wait_event(&self.join)?;
        if s.ends_with_done() && parts.flags {
            // per link: tell the sender there, then wait for the receiver there (every rank
            // raises before it waits, link by link in one order, so no wait holds back a raise
            // that another rank waits for)
            let links = s.links();
            for (i, &link) in links.iter().enumerate() {
                let sender = self.peers[s.sender_on(self.rank, link)];
                let index = s.done_index(link);
                let step = FlagStep {
                    wait: Some((mem.flags.addr() + 8 * index as u64, epoch, FlagCmp::Ge)),
                    raise: Some((sender.flags + 8 * index as u64, epoch)),
                    raise_first: true,
                    ends_call: i + 1 == links.len(),
                };
                mem.steps.queue_step(stream, step, (s.shape.world, index))?;
            }
        }
        self.memory.launched(stream)?;
        self.calls = epoch;
        trace(self.rank, epoch, "queued");
        Ok(())
    }

    /// The diagnosis of a flag wait that timed out, if one did (after the stream synchronised).
    pub(crate) fn failure(&self) -> Option<String> {
        let e = self.memory.steps.timeout()?;
        let index = e.index as usize;
        let what = if index < DONE_FLAGS {
            let link = [RingLink::Within, RingLink::Across][index];
            format!(
                "its receiver's done flag (the receiver has finished a call; {})",
                link.name()
            )
        } else {
            let per_set = (self.world - 1) * MAX_PIECES;
            let i = index - DONE_FLAGS;
            format!(
                "the flag of piece {} handed on after step {} (set {})",
                i % MAX_PIECES,
                (i % per_set) / MAX_PIECES,
                i / per_set
            )
        };
        Some(format!(
            "GEMM + reduce-scatter (ring): rank {} at step {} waited for {what} to reach {}, saw {} after {:?}",
            e.rank, e.step, e.expected, e.seen, self.config.timeout
        ))
    }
}

/// The ring of a call of `m` rows (the config's NUMA groups), steps cut into `pieces`.
pub(super) fn schedule(
    config: &GemmRsConfig,
    world: usize,
    m: usize,
    pieces: usize,
) -> Result<RingSchedule, CudaError> {
    RingSchedule::within(shape(config, world, m)?, config.max_m, pieces)
        .in_groups(config.numa_groups)
        .map_err(|e| CudaError::Unavailable(e.to_string()))
}
