//! The copy-engine (CE) all-reduce, reduce-scatter and all-gather for large messages: the bytes
//! cross NVLink by the copy engines (`cuMemcpyPeerAsync` on side streams of each rank), and the
//! SMs only reduce (ce.cu). Why it was built: with both directions of the link loaded,
//! as every collective loads them, the copy engines alone carried 377–387 GB/s per direction at
//! 256 MiB – 1 GiB on 2 × H200, SM stores 345–360, and the two sharing the bytes no more than
//! the copy engines alone (`scripts/link-ceilings.py`, docs/results/hardware/link-ceilings.txt).
//!
//! What it does (CHANGELOG.md, "The copy-engine protocol"): every result right, but **no faster than the
//! plans** — reduce-scatter 246–254 GB/s at 256 MiB where the direct plan reaches 296–307,
//! all-gather 303–326 against 334–353, all-reduce 338 GB/s at 1 GiB, as the ring plan. Its first
//! runs were erratic (see [`REDUCE_BLOCKS`]): that is how the waits' reads of host memory were
//! found to stall the GPU's front end. `auto` never takes it; it stays a protocol of the bench
//! (`Backend::protocols`) for what it shows.
//! `COMMFUSE_CE_STREAMS`, `COMMFUSE_CE_SUB_BYTES` and `COMMFUSE_CE_REDUCE_BLOCKS` set its side
//! streams, sub-chunk size and reduce kernel's blocks.
//!
//! One call of rank r (its `epoch`, counted from 1 on the host, alike on every rank):
//! * reduce-scatter: the side streams (sub-chunks to them in turn) copy r's input chunk of each
//!   peer q, sub-chunk by sub-chunk, into q's receive buffer (the set of this call's parity),
//!   writing q's arrival flag of (r, sub-chunk) after each copy (`cuStreamWriteValue64`, which
//!   fences the copy first); on the caller's stream the reduce kernel folds each sub-chunk in
//!   once every sender's flag of it carries the epoch, so the reduction of one sub-chunk
//!   overlaps the copies of the next;
//! * all-reduce: the same into r's chunk of its output, then the side streams copy that chunk
//!   (a piece each) into every peer's output and raise its "gathered" flags there; the caller's
//!   stream waits (`ce_wait`) for every peer's pieces;
//! * all-gather: the first side stream raises "ready" at every peer and waits for theirs (a peer
//!   may still be reading its previous output, which this call overwrites), then the side streams
//!   copy r's input into every peer's output; the caller's stream copies r's own chunk and waits
//!   for the peers'.
//!
//! Why nothing more is needed between back-to-back calls: a sender's call n + 2 into q's set
//! (n mod 2) comes after its call n + 1 reduced, which needed q's copies of n + 1, which q
//! queues after its own call n's reduction — so q read that set before it is written again. An
//! all-reduce's chunk into q's output in call n + 1 comes after q's copies of n + 1 too, so after
//! q's stream went past whatever read the output of n. The input is read only by this call's
//! copies, which the caller's stream joins before the call ends.
//!
//! Flags carry the host's epochs, so a call cannot be captured into a CUDA graph (a replay would
//! repeat the numbers): the bench runs it eagerly only. It runs as protocol `Protocol::Ce`
//! beside the plans, the LL protocol and NCCL (`Backend::protocols`), on one process's GPUs.

use crate::backend::call::{boxed_call, Launcher, RankBuffers};
use crate::backend::gpus::{CudaBackend, Rank};
use crate::backend::plan_kernel::typed_kernel;
use crate::backend::plan_table::ErrorRecord;
use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Event, Function, Gpu, Module, Stream};
use crate::sys::nvrtc;
use commfuse_core::backend::{BackendError, PreparedCall};
use commfuse_core::op::chunk_range;
use commfuse_core::{DType, OpKind, OpSpec, ReduceOp};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Bytes of a sub-chunk (the unit whose reduction overlaps the next one's copies), unless
/// `COMMFUSE_CE_SUB_BYTES` says otherwise: small enough that the last one's reduction, which
/// nothing hides, is short, large enough that a copy's fixed cost is small beside it.
const SUB_BYTES: usize = 4 << 20;
/// Most sub-chunks of a chunk (flags per sender and set).
const MAX_SUBS: usize = 64;
/// Side streams per rank, unless `COMMFUSE_CE_STREAMS` (1 to 8) says otherwise: sub-chunks go
/// to them in turn, and a gathered chunk is split over them, so that while one stream's copy
/// drains before its flag, another's keeps the link busy.
const STREAMS: usize = 2;
const MAX_STREAMS: usize = 8;
const REDUCE_THREADS: u32 = 512;
/// Most blocks of the reduce kernel, unless `COMMFUSE_CE_REDUCE_BLOCKS` (1 to 1024) says
/// otherwise. Measured (CHANGELOG.md, "The copy-engine protocol"; bf16, 4 MiB sub-chunks, 2 side
/// streams): 264 blocks (two per multiprocessor) made calls erratic — a 1 GiB all-reduce from 4.1
/// to 9.5 ms — until the waits stopped reading the host-mapped abort word every 256 polls
/// (`ABORT_POLL_NS` in sys/common.cuh), after which they ran as steadily as 64 (all-reduce
/// 1 GiB 3.17 ms, 338 GB/s, as fast as the ring plan); 16 and 4 blocks cannot reduce as fast
/// as the bytes arrive. 64 holds fewer multiprocessors for the same time.
const REDUCE_BLOCKS: u32 = 64;
/// `lane` of a timeout recorded by `ce_wait`: the flags were the peers' "ready" (all-gather) or
/// "gathered" (all-reduce, all-gather); a reduce kernel's timeout records its block instead.
const LANE_READY: u32 = u32::MAX - 1;
const LANE_GATHERED: u32 = u32::MAX;

/// Mirrors `CeReduceArgs` in ce.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct CeReduceArgs {
    input: u64,
    scratch: u64,
    output: u64,
    flags: u64,
    err: u64,
    timeout_ns: u64,
    epoch: u64,
    len: u64,
    pitch: u64,
    sub: u64,
    subs: u32,
    world: u32,
    rank: u32,
    vec: u32,
}
const _: () = assert!(std::mem::size_of::<CeReduceArgs>() == 96);
const _: () = assert!(std::mem::offset_of!(CeReduceArgs, subs) == 80);

/// Mirrors `CeWaitArgs` in ce.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct CeWaitArgs {
    flags: u64,
    err: u64,
    timeout_ns: u64,
    epoch: u64,
    world: u32,
    rank: u32,
    lane: u32,
    per_sender: u32,
}
const _: () = assert!(std::mem::size_of::<CeWaitArgs>() == 48);

/// Whether the CE protocol runs `kind` at all.
pub fn runs(kind: OpKind) -> bool {
    matches!(
        kind,
        OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather
    )
}

/// Bytes of a sub-chunk: [`SUB_BYTES`] or `COMMFUSE_CE_SUB_BYTES` (64 KiB to 1 GiB).
fn sub_bytes() -> usize {
    static SUB: OnceLock<usize> = OnceLock::new();
    *SUB.get_or_init(|| {
        let ok = |b: usize| (64 << 10..=1 << 30).contains(&b);
        crate::env_knob("COMMFUSE_CE_SUB_BYTES", ok, SUB_BYTES)
    })
}

/// Most blocks of the reduce kernel: [`REDUCE_BLOCKS`] or `COMMFUSE_CE_REDUCE_BLOCKS` (1 to
/// 1024).
fn reduce_blocks() -> u32 {
    static BLOCKS: OnceLock<u32> = OnceLock::new();
    *BLOCKS.get_or_init(|| {
        let ok = |b: u32| (1..=1024).contains(&b);
        crate::env_knob("COMMFUSE_CE_REDUCE_BLOCKS", ok, REDUCE_BLOCKS)
    })
}

/// Side streams per rank: [`STREAMS`] or `COMMFUSE_CE_STREAMS` (1 to [`MAX_STREAMS`]).
fn streams() -> usize {
    static STREAMS_CELL: OnceLock<usize> = OnceLock::new();
    *STREAMS_CELL.get_or_init(|| {
        let ok = |k: usize| (1..=MAX_STREAMS).contains(&k);
        crate::env_knob("COMMFUSE_CE_STREAMS", ok, STREAMS)
    })
}

/// Where the elements of one call go: every rank's chunk, and the receive buffer's shape.
#[derive(Debug, Clone, PartialEq)]
struct Layout {
    kind: OpKind,
    world: usize,
    elem_bytes: usize,
    /// every rank's chunk of the op's `count` elements
    chunks: Vec<Range<usize>>,
    /// elements per sub-chunk (a whole number of 16-byte vectors)
    sub: usize,
    /// sub-chunks per chunk
    subs: usize,
    /// elements between two senders' copies in a receive buffer set (`subs * sub`)
    pitch: usize,
    /// side streams; a gathered chunk goes in as many pieces
    streams: usize,
}

impl Layout {
    fn new(kind: OpKind, world: usize, count: usize, elem_bytes: usize) -> Layout {
        let chunks: Vec<_> = (0..world).map(|q| chunk_range(count, world, q)).collect();
        let longest = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let vector = 16 / elem_bytes;
        let subs = (longest * elem_bytes)
            .div_ceil(sub_bytes())
            .clamp(1, MAX_SUBS);
        let sub = longest.div_ceil(subs).div_ceil(vector).max(1) * vector;
        Layout {
            kind,
            world,
            elem_bytes,
            chunks,
            sub,
            subs,
            pitch: subs * sub,
            streams: streams(),
        }
    }

    /// Whether this op reduces into a receive buffer (all-reduce, reduce-scatter).
    fn reduces(&self) -> bool {
        self.kind != OpKind::AllGather
    }

    /// Elements [lo, hi) of sub-chunk `s` within a chunk of `len` elements (empty past its end).
    fn sub_range(&self, s: usize, len: usize) -> Range<usize> {
        let lo = (s * self.sub).min(len);
        lo..((s + 1) * self.sub).min(len)
    }

    /// Bytes of one rank's receive buffer: two sets (alternate calls) of a copy per sender.
    fn scratch_bytes(&self) -> usize {
        if self.reduces() {
            2 * self.world * self.pitch * self.elem_bytes
        } else {
            0
        }
    }

    /// 8-byte flags of one rank: arrival [2 sets][world senders][subs], "gathered" [world
    /// senders][streams pieces], then "ready" per sender.
    fn flag_words(&self) -> usize {
        2 * self.world * self.subs + self.world * self.streams + self.world
    }

    /// Elements [lo, hi) of piece `i` (of `streams`) of a chunk of `len` elements, whole
    /// vectors except the last.
    fn piece(&self, i: usize, len: usize) -> Range<usize> {
        let vector = 16 / self.elem_bytes;
        let each = len.div_ceil(self.streams).div_ceil(vector) * vector;
        (i * each).min(len)..((i + 1) * each).min(len)
    }

    /// Index of sender `q`'s arrival flag of sub-chunk `s` in set `set`.
    fn arrival(&self, set: usize, q: usize, s: usize) -> usize {
        (set * self.world + q) * self.subs + s
    }

    /// Index of sender `q`'s "gathered" flag of piece `i`.
    fn gathered(&self, q: usize, i: usize) -> usize {
        2 * self.world * self.subs + q * self.streams + i
    }

    fn ready(&self, q: usize) -> usize {
        2 * self.world * self.subs + self.world * self.streams + q
    }
}

/// One rank's CE collective: its side stream and the events that fork and join it, its kernels,
/// its receive buffer and flags (which its peers write), and its call counter.
pub(crate) struct CeRank {
    /// the side streams, each with the event the caller's stream joins it by
    copies: Vec<(Stream, Event)>,
    fork: Event,
    reduced: Event,
    readied: Event,
    reduce: Function,
    wait: Function,
    /// Written by the peers' copies and flag writes: freed only after the last call
    pub scratch: DeviceMemory,
    pub flags: DeviceMemory,
    epoch: AtomicU64,
}

/// What a rank addresses of a peer: its context (for `cuMemcpyPeerAsync`; a `CUcontext`, kept
/// as an address so that the launcher is `Sync`) and buffers.
#[derive(Clone, Copy)]
pub(crate) struct Peer {
    pub ctx: usize,
    pub scratch: u64,
    pub flags: u64,
    pub output: u64,
}

impl Peer {
    fn ctx(&self) -> cudarc::driver::sys::CUcontext {
        self.ctx as cudarc::driver::sys::CUcontext
    }
}

impl CeRank {
    fn new(gpu: &Gpu, layout: &Layout, dtype: DType, reduce: ReduceOp) -> Result<Self, CudaError> {
        let compiled = nvrtc::compile(nvrtc::kernel("ce.cu").expect("embedded"), false)?;
        let module = Module::load(gpu, &compiled.cubin)?;
        Ok(CeRank {
            copies: (0..layout.streams)
                .map(|_| Ok((Stream::new(gpu)?, Event::new(gpu)?)))
                .collect::<Result<_, CudaError>>()?,
            fork: Event::new(gpu)?,
            reduced: Event::new(gpu)?,
            readied: Event::new(gpu)?,
            reduce: typed_kernel(&module, "ce_reduce", dtype, reduce)?,
            wait: module.function("ce_wait")?,
            scratch: DeviceMemory::zeroed(gpu, layout.scratch_bytes().max(16))?,
            flags: DeviceMemory::zeroed(gpu, 8 * layout.flag_words())?,
            epoch: AtomicU64::new(0),
        })
    }
}

/// Every rank's CE collective for the backend's ranks, and how to reach each rank's memory.
pub(crate) struct CeLauncher {
    layout: Layout,
    ranks: Vec<CeRank>,
    /// every rank as the others address it (the call's buffers are fixed when it is prepared)
    peers: Vec<Peer>,
    err: u64,
    timeout: Duration,
}

/// Prepares the CE collective of `spec` on every rank of `backend` (one process: every GPU
/// reaches its peers' memory directly).
pub(crate) fn prepare<'a>(
    backend: &'a CudaBackend,
    spec: &OpSpec,
    dtype: DType,
    reduce: ReduceOp,
) -> Result<Box<dyn PreparedCall + 'a>, BackendError> {
    if !runs(spec.kind) {
        return Err(BackendError::Unavailable(format!(
            "the copy-engine protocol runs all-reduce, reduce-scatter and all-gather only, not {}",
            spec.kind
        )));
    }
    let layout = Layout::new(spec.kind, spec.world, spec.count, dtype.size());
    let ranks = backend
        .ranks
        .iter()
        .map(|rank| CeRank::new(&rank.gpu, &layout, dtype, reduce))
        .collect::<Result<Vec<_>, _>>()?;
    let launcher = |bufs: &[RankBuffers]| {
        let peers = (backend.ranks.iter().zip(&ranks).zip(bufs))
            .map(|((rank, ce), call)| Peer {
                ctx: rank.gpu.raw_ctx() as usize,
                scratch: ce.scratch.addr(),
                flags: ce.flags.addr(),
                output: call.output.addr(),
            })
            .collect();
        Ok(CeLauncher {
            layout,
            ranks,
            peers,
            err: backend.error_record(),
            timeout: backend.timeout(),
        })
    };
    let sizes = (spec.input_capacity(), spec.output_capacity(), 0);
    boxed_call(backend, dtype, sizes, launcher)
}

impl CeLauncher {
    /// Queues rank `r`'s call on `stream` (its caller's): `input` into `output` (the op's
    /// lengths; `output` is the one its peers know as r's), every peer reached through
    /// `self.peers`.
    ///
    /// # Safety
    /// `stream` is a stream of rank r's GPU, bound; `input`, `output` and every peer's memory
    /// stay valid until the call completes.
    unsafe fn call(
        &self,
        r: usize,
        stream: &Stream,
        (input, output): (u64, u64),
    ) -> Result<(), CudaError> {
        let peers = &self.peers;
        let l = &self.layout;
        let me = &self.ranks[r];
        let eb = l.elem_bytes as u64;
        let epoch = me.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        let set = (epoch % 2) as usize;
        let ctx = peers[r].ctx();
        let others = (1..l.world).map(|d| (r + d) % l.world);
        let side = |i: usize| &me.copies[i % me.copies.len()].0;
        // a copy into a peer, then its flag there, on side stream `on`; the flag is a stream
        // memory operation, not a kernel: a one-thread kernel queued on a side stream did not
        // start while the reduce kernel ran, which then waited for its flag until the timeout
        // (seen on 2 × H200 before the waits' reads of host memory were made rare, `477a737`;
        // not tried since)
        let send =
            |on: &Stream, (dst, src, bytes): (u64, u64, usize), (q, flag): (usize, usize)| {
                on.copy_peer_async((peers[q].ctx(), dst), (ctx, src), bytes)?;
                on.write_value_u64(peers[q].flags + 8 * flag as u64, epoch)
            };
        let wait = |on: &Stream, flags: usize, per_sender: usize, lane: u32| {
            let args = CeWaitArgs {
                flags: me.flags.addr() + 8 * flags as u64,
                err: self.err,
                timeout_ns: self.timeout.as_nanos() as u64,
                epoch,
                world: l.world as u32,
                rank: r as u32,
                lane,
                per_sender: per_sender as u32,
            };
            me.wait.launch(1, 64, on, &args)
        };
        me.fork.record(stream)?;
        for (copy, _) in &me.copies {
            copy.wait_event(&me.fork)?;
        }
        let mine = &l.chunks[r];
        // this rank's chunk into every peer's output, in a piece per side stream (all-reduce:
        // once reduced, all-gather: once the peers are ready), a "gathered" flag after each
        let gather = |src: u64| -> Result<(), CudaError> {
            for q in others.clone() {
                for i in 0..l.streams {
                    let part = l.piece(i, mine.len());
                    let at = (mine.start + part.start) as u64 * eb;
                    let from = src + part.start as u64 * eb;
                    let bytes = part.len() * l.elem_bytes;
                    send(
                        side(i),
                        (peers[q].output + at, from, bytes),
                        (q, l.gathered(r, i)),
                    )?;
                }
            }
            Ok(())
        };
        if l.reduces() {
            // each peer's chunk to it, sub-chunk by sub-chunk, a flag after each
            for s in 0..l.subs {
                for q in others.clone() {
                    let chunk = &l.chunks[q];
                    let part = l.sub_range(s, chunk.len());
                    let dst =
                        peers[q].scratch + ((set * l.world + r) * l.pitch + part.start) as u64 * eb;
                    let src = input + (chunk.start + part.start) as u64 * eb;
                    let bytes = part.len() * l.elem_bytes;
                    send(side(s), (dst, src, bytes), (q, l.arrival(set, r, s)))?;
                }
            }
            let out = match l.kind {
                OpKind::AllReduce => output + mine.start as u64 * eb,
                _ => output,
            };
            let src = input + mine.start as u64 * eb;
            let scratch = me.scratch.addr() + (set * l.world * l.pitch) as u64 * eb;
            let args = CeReduceArgs {
                input: src,
                scratch,
                output: out,
                flags: me.flags.addr() + 8 * l.arrival(set, 0, 0) as u64,
                err: self.err,
                timeout_ns: self.timeout.as_nanos() as u64,
                epoch,
                len: mine.len() as u64,
                pitch: l.pitch as u64,
                sub: l.sub as u64,
                subs: l.subs as u32,
                world: l.world as u32,
                rank: r as u32,
                vec: [src, scratch, out].iter().all(|a| a % 16 == 0) as u32,
            };
            let vector = 16 / l.elem_bytes as u64;
            // blocks never wait for each other, only for copies: any count is safe
            let blocks = (l.sub as u64)
                .div_ceil(vector * REDUCE_THREADS as u64)
                .clamp(1, reduce_blocks() as u64) as u32;
            me.reduce.launch(blocks, REDUCE_THREADS, stream, &args)?;
            if l.kind == OpKind::AllReduce {
                me.reduced.record(stream)?;
                for (copy, _) in &me.copies {
                    copy.wait_event(&me.reduced)?;
                }
                gather(out)?;
                wait(stream, l.gathered(0, 0), l.streams, LANE_GATHERED)?;
            }
        } else {
            // all-gather: the peers' outputs are theirs to read until they call again
            for q in others.clone() {
                me.copies[0]
                    .0
                    .write_value_u64(peers[q].flags + 8 * l.ready(r) as u64, epoch)?;
            }
            wait(&me.copies[0].0, l.ready(0), 1, LANE_READY)?;
            me.readied.record(&me.copies[0].0)?;
            for (copy, _) in &me.copies[1..] {
                copy.wait_event(&me.readied)?;
            }
            gather(input)?;
            stream.copy_async(
                output + mine.start as u64 * eb,
                input,
                mine.len() * l.elem_bytes,
            )?;
            wait(stream, l.gathered(0, 0), l.streams, LANE_GATHERED)?;
        }
        for (copy, joined) in &me.copies {
            joined.record(copy)?;
            stream.wait_event(joined)?;
        }
        Ok(())
    }
}

/// A timeout the CE kernels recorded, in words.
pub(crate) fn describe_timeout(kind: OpKind, rec: &ErrorRecord, timeout: Duration) -> String {
    match rec.lane {
        LANE_READY => format!(
            "{kind} (copy engine): rank {} waited for rank {}'s ready flag to carry call {}, saw {} after {timeout:?}",
            rec.rank, rec.step, rec.expected, rec.seen
        ),
        LANE_GATHERED => format!(
            "{kind} (copy engine): rank {} waited for rank {}'s gathered flag of piece {} to carry call {}, saw {} after {timeout:?}",
            rec.rank, rec.step, rec.slot, rec.expected, rec.seen
        ),
        block => format!(
            "{kind} (copy engine): rank {} (block {block}) waited for rank {}'s copy of sub-chunk {} of call {}, saw {} after {timeout:?}",
            rec.rank, rec.step, rec.slot, rec.expected, rec.seen
        ),
    }
}

impl Launcher for CeLauncher {
    fn launch(&self, bufs: &[RankBuffers], r: usize, rank: &Rank) -> Result<(), BackendError> {
        // SAFETY: the call's buffers, every rank's receive buffer and flags and the error record
        // outlive the launch (the batch synchronises before anything is dropped)
        unsafe {
            self.call(
                r,
                &rank.stream,
                (bufs[r].input.addr(), bufs[r].output.addr()),
            )
        }
        .map_err(BackendError::from)
    }

    fn capturable(&self) -> bool {
        // the flags carry the host's call numbers: a replay would repeat them
        false
    }

    fn records_waits(&self) -> bool {
        true
    }

    fn describe_timeout(&self, _backend: &CudaBackend, rec: &ErrorRecord) -> BackendError {
        CudaError::Stalled(describe_timeout(self.layout.kind, rec, self.timeout)).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_chunks_cover_every_chunk_in_whole_vectors() {
        for (world, count, eb) in [(1, 1, 4), (2, 7, 2), (3, 4_200_011, 2), (9, 100 << 20, 4)] {
            let l = Layout::new(OpKind::ReduceScatter, world, count, eb);
            assert!(l.subs >= 1 && l.subs <= MAX_SUBS);
            assert_eq!(l.sub % (16 / eb), 0, "a sub-chunk is whole vectors");
            assert_eq!(l.pitch, l.subs * l.sub);
            for chunk in &l.chunks {
                let covered: usize = (0..l.subs).map(|s| l.sub_range(s, chunk.len()).len()).sum();
                assert_eq!(covered, chunk.len(), "P={world} n={count}");
                assert!(chunk.len() <= l.pitch);
            }
            assert!(l.sub * eb <= sub_bytes().max(16) || l.subs == MAX_SUBS);
        }
        // pieces of a gathered chunk: whole vectors but the last, covering it
        for len in [0, 1, 7, 4097, 1 << 20] {
            let l = Layout::new(OpKind::AllGather, 2, 2 * len, 2);
            let pieces: Vec<_> = (0..l.streams).map(|i| l.piece(i, len)).collect();
            assert_eq!(pieces.iter().map(|p| p.len()).sum::<usize>(), len);
            assert!(pieces
                .windows(2)
                .all(|w| w[0].end == w[1].start && w[0].start % 8 == 0));
        }
        // 1 GiB of bf16 over 2 ranks: 512 MiB chunks, 64 sub-chunks of 8 MiB
        let l = Layout::new(OpKind::AllReduce, 2, 1 << 29, 2);
        assert_eq!((l.subs, l.sub * 2), (64, 8 << 20));
    }

    #[test]
    fn every_flag_has_its_own_word() {
        let l = Layout::new(OpKind::AllReduce, 3, 1 << 22, 2);
        let mut seen = std::collections::HashSet::new();
        for set in 0..2 {
            for q in 0..3 {
                for s in 0..l.subs {
                    assert!(seen.insert(l.arrival(set, q, s)));
                }
            }
        }
        for q in 0..3 {
            for i in 0..l.streams {
                assert!(seen.insert(l.gathered(q, i)));
            }
            assert!(seen.insert(l.ready(q)));
        }
        assert!(seen.iter().all(|&i| i < l.flag_words()));
        assert_eq!(seen.len(), l.flag_words());
    }
}
