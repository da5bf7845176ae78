//! The signalling protocols, written once over a [`SignalWord`] so that the same code runs on
//! std atomics in the simulator and on loom's or shuttle's atomics in the model-checking tests.
//!
//! * `notify` is a release store or a release add: everything the notifier wrote before is
//!   visible to whoever observes the new value with an acquire load.
//! * `wait` polls with acquire loads until the comparison holds; between polls it asks a
//!   [`Backoff`] what to do, which is where timeouts and aborts come from.
//! * Barriers count in epochs: call e sets slots to e and waits for ≥ e. Values only grow, so a
//!   fast rank already in call e+1 never confuses a slow one still in call e, and nothing needs
//!   a reset.

use commfuse_core::algorithms::staggered_peers;
use commfuse_core::{Cmp, NotifyOp};

/// A 64-bit signal counter.
pub trait SignalWord: Sync {
    fn load_acquire(&self) -> u64;
    fn store_release(&self, value: u64);
    fn add_release(&self, value: u64);
}

impl SignalWord for std::sync::atomic::AtomicU64 {
    fn load_acquire(&self) -> u64 {
        self.load(std::sync::atomic::Ordering::Acquire)
    }
    fn store_release(&self, value: u64) {
        self.store(value, std::sync::atomic::Ordering::Release)
    }
    fn add_release(&self, value: u64) {
        self.fetch_add(value, std::sync::atomic::Ordering::Release);
    }
}

/// Why a wait gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Timeout,
    Aborted,
    /// The process of the rank the wait was for (see [`Backoff::waits_for`]) has ended: process
    /// `pid`.
    Gone {
        pid: u64,
    },
}

/// What a waiter does between unsuccessful polls.
pub trait Backoff {
    fn pause(&mut self) -> Result<(), Stop>;
    /// Says which rank's notify the waits from now on are for (a backoff may watch that rank's
    /// process and stop when it ends).
    fn waits_for(&mut self, _rank: usize) {}
}

pub fn notify<W: SignalWord + ?Sized>(word: &W, value: u64, op: NotifyOp) {
    match op {
        NotifyOp::Set => word.store_release(value),
        NotifyOp::Add => word.add_release(value),
    }
}

/// Polls `word` until it compares true with `expected`; returns the value seen, or why it
/// stopped and the last value seen.
pub fn wait<W: SignalWord + ?Sized, B: Backoff + ?Sized>(
    word: &W,
    expected: u64,
    cmp: Cmp,
    backoff: &mut B,
) -> Result<u64, (Stop, u64)> {
    loop {
        let seen = word.load_acquire();
        if cmp.holds(seen, expected) {
            return Ok(seen);
        }
        if let Err(stop) = backoff.pause() {
            return Err((stop, seen));
        }
    }
}

/// Signal slots of every rank, addressed as (rank, row, col).
pub trait Pads {
    type Word: SignalWord + ?Sized;
    fn slot(&self, rank: usize, row: u32, col: u32) -> &Self::Word;
}

/// A barrier wait that failed: the slot of the waiting rank, the peer whose notify it waited
/// for, what it waited for, what it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stuck {
    pub stop: Stop,
    pub row: u32,
    pub col: u32,
    pub peer: usize,
    pub expected: u64,
    pub seen: u64,
}

/// Waits until `rank`'s slot (`row`, `col`) reaches `epoch`, which `peer` notifies.
fn wait_slot<P: Pads, B: Backoff + ?Sized>(
    pads: &P,
    (rank, row, col): (usize, u32, u32),
    peer: usize,
    epoch: u64,
    backoff: &mut B,
) -> Result<(), Stuck> {
    backoff.waits_for(peer);
    wait(pads.slot(rank, row, col), epoch, Cmp::Ge, backoff)
        .map(|_| ())
        .map_err(|(stop, seen)| Stuck {
            stop,
            row,
            col,
            peer,
            expected: epoch,
            seen,
        })
}

/// All-to-all barrier, call `epoch` (≥ 1): rank r sets column r of `row` on every peer to the
/// epoch, then waits for every peer's column to reach it. One latency; P−1 signals per rank.
pub fn all_to_all_barrier<P: Pads, B: Backoff + ?Sized>(
    pads: &P,
    world: usize,
    rank: usize,
    row: u32,
    epoch: u64,
    backoff: &mut B,
) -> Result<(), Stuck> {
    for peer in staggered_peers(rank, world) {
        notify(pads.slot(peer, row, rank as u32), epoch, NotifyOp::Set);
    }
    for peer in staggered_peers(rank, world) {
        wait_slot(pads, (rank, row, peer as u32), peer, epoch, backoff)?;
    }
    Ok(())
}

/// Ring barrier, call `epoch` (≥ 1), on rows `row` (arrival) and `row + 1` (release): rank 0
/// sends an arrival token around the ring; when it comes back everyone has arrived, and a
/// release token follows it. 2P−1 latencies; two signals per rank.
pub fn ring_barrier<P: Pads, B: Backoff + ?Sized>(
    pads: &P,
    world: usize,
    rank: usize,
    row: u32,
    epoch: u64,
    backoff: &mut B,
) -> Result<(), Stuck> {
    if world == 1 {
        return Ok(());
    }
    let (left, right) = ((rank + world - 1) % world, (rank + 1) % world);
    let (arrive, release) = (row, row + 1);
    if rank == 0 {
        notify(pads.slot(right, arrive, 0), epoch, NotifyOp::Set);
        wait_slot(pads, (rank, arrive, 0), left, epoch, backoff)?;
        notify(pads.slot(right, release, 0), epoch, NotifyOp::Set);
    } else {
        wait_slot(pads, (rank, arrive, 0), left, epoch, backoff)?;
        notify(pads.slot(right, arrive, 0), epoch, NotifyOp::Set);
        wait_slot(pads, (rank, release, 0), left, epoch, backoff)?;
        if right != 0 {
            notify(pads.slot(right, release, 0), epoch, NotifyOp::Set);
        }
    }
    Ok(())
}

/// The low-latency protocol (NCCL's LL): a 64-bit line carries 32 bits of data in its low half
/// and the call's 32-bit sequence number in its high half, written by one store, so a reader
/// that sees the sequence number has the data with it — one trip over the link, no separate
/// signal, nothing to clear between calls (the next call's number replaces the flag). Data and
/// flag travel in one word, so no ordering between two stores is needed (GPUs give a single
/// 8-byte store that guarantee).
pub fn ll_line(data: u32, seq: u32) -> u64 {
    (u64::from(seq) << 32) | u64::from(data)
}

/// Stores `data` into `line` for call `seq`.
pub fn ll_store<W: SignalWord + ?Sized>(line: &W, data: u32, seq: u32) {
    line.store_release(ll_line(data, seq));
}

/// Polls `line` until it holds call `seq`'s data and returns the data; or why it stopped and
/// the line last seen.
pub fn ll_load<W: SignalWord + ?Sized, B: Backoff + ?Sized>(
    line: &W,
    seq: u32,
    backoff: &mut B,
) -> Result<u32, (Stop, u64)> {
    loop {
        let seen = line.load_acquire();
        if (seen >> 32) as u32 == seq {
            return Ok(seen as u32);
        }
        if let Err(stop) = backoff.pause() {
            return Err((stop, seen));
        }
    }
}

/// Lines of every rank's LL buffers, addressed as (rank, line).
pub trait LlLines {
    type Word: SignalWord + ?Sized;
    fn line(&self, rank: usize, index: usize) -> &Self::Word;
}

/// Where sender `sender`'s line `i` of call parity `parity` lies in a receiver's LL buffer of
/// `world` senders × `len` lines × 2 parities.
pub fn ll_index(world: usize, len: usize, parity: usize, sender: usize, i: usize) -> usize {
    (parity * world + sender) * len + i
}

/// An LL wait that failed: which sender's line, what it waited for, what it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlStuck {
    pub stop: Stop,
    pub sender: usize,
    pub line: usize,
    pub seq: u32,
    pub seen: u64,
}

/// [`ll_load`] of rank `rank`'s line `at`, a failure reported as sender `sender`'s line `line`.
pub(crate) fn ll_receive<L: LlLines, B: Backoff + ?Sized>(
    lines: &L,
    (rank, at, seq): (usize, usize, u32),
    (sender, line): (usize, usize),
    backoff: &mut B,
) -> Result<f32, LlStuck> {
    backoff.waits_for(sender);
    ll_load(lines.line(rank, at), seq, backoff)
        .map(f32::from_bits)
        .map_err(|(stop, seen)| LlStuck {
            stop,
            sender,
            line,
            seq,
            seen,
        })
}

/// One-shot LL all-reduce (sum), call `seq` (≥ 1) of rank `rank`: its input goes as LL lines
/// into every rank's buffer (its own included), then it reads every sender's lines, each as its
/// flag arrives, and sums them in rank order (the same order, so the same bits, on every rank).
/// Two buffers alternate by the call's parity: a rank writes call c + 2's lines into a peer
/// only after finishing call c + 1, which needed that peer's call c + 1 lines, which the peer
/// wrote after finishing reading call c's — so no line is overwritten before it is read.
pub fn ll_one_shot_all_reduce<L: LlLines, B: Backoff + ?Sized>(
    lines: &L,
    (world, rank, seq): (usize, usize, u32),
    input: &[f32],
    output: &mut [f32],
    backoff: &mut B,
) -> Result<(), LlStuck> {
    let (len, parity) = (input.len(), (seq % 2) as usize);
    for peer in std::iter::once(rank).chain(staggered_peers(rank, world)) {
        for (i, x) in input.iter().enumerate() {
            let at = ll_index(world, len, parity, rank, i);
            ll_store(lines.line(peer, at), x.to_bits(), seq);
        }
    }
    for (i, out) in output.iter_mut().enumerate().take(len) {
        let mut sum = 0.0f32;
        for sender in 0..world {
            let at = ll_index(world, len, parity, sender, i);
            sum += ll_receive(lines, (rank, at, seq), (sender, i), backoff)?;
        }
        *out = sum;
    }
    Ok(())
}

/// Two-shot LL all-reduce (sum), call `seq` (≥ 1) of rank `rank`, for larger small messages:
/// rank q owns chunk q (`chunk_range` of the input); each rank sends chunk q of its input as LL
/// lines to q, each owner sums its chunk's P senders in rank order and sends the sum as LL
/// lines to every rank. Each rank's buffer holds P senders × the longest chunk for the first
/// phase and every owner's chunk (the whole vector) for the second: [`ll_two_shot_lines`]
/// lines. Two trips, but each rank sends 2·len lines instead of P·len.
///
/// One buffer suffices here, unlike the one-shot protocol: a sender writes call c + 1's
/// first-phase lines into an owner only after its own call c ended, which needed that owner's
/// call c sums, which the owner sent only after reading all its call c lines; and an owner
/// writes call c + 1's sums into a rank only after that rank's call c + 1 lines reached it,
/// which the rank sent after reading every call c sum. (loom checks it, `tests/model_check.rs`.)
pub fn ll_two_shot_all_reduce<L: LlLines, B: Backoff + ?Sized>(
    lines: &L,
    (world, rank, seq): (usize, usize, u32),
    input: &[f32],
    output: &mut [f32],
    backoff: &mut B,
) -> Result<(), LlStuck> {
    let len = input.len();
    let longest = len.div_ceil(world);
    let chunk = |q: usize| commfuse_core::op::chunk_range(len, world, q);
    // first-phase lines: [sender][longest]; second-phase lines after them: [len]
    let scatter = |sender: usize, i: usize| sender * longest + i;
    let gather = |i: usize| world * longest + i;
    for owner in std::iter::once(rank).chain(staggered_peers(rank, world)) {
        for (i, x) in input[chunk(owner)].iter().enumerate() {
            ll_store(lines.line(owner, scatter(rank, i)), x.to_bits(), seq);
        }
    }
    let mine = chunk(rank);
    let mut sums = vec![0.0f32; mine.len()];
    for (i, sum) in sums.iter_mut().enumerate() {
        for sender in 0..world {
            let at = scatter(sender, i);
            *sum += ll_receive(lines, (rank, at, seq), (sender, mine.start + i), backoff)?;
        }
    }
    for peer in std::iter::once(rank).chain(staggered_peers(rank, world)) {
        for (i, s) in sums.iter().enumerate() {
            ll_store(lines.line(peer, gather(mine.start + i)), s.to_bits(), seq);
        }
    }
    for owner in 0..world {
        for i in chunk(owner) {
            output[i] = ll_receive(lines, (rank, gather(i), seq), (owner, i), backoff)?;
        }
    }
    Ok(())
}

/// Lines of one rank's buffer for [`ll_two_shot_all_reduce`] of `len` elements over `world`.
pub fn ll_two_shot_lines(world: usize, len: usize) -> usize {
    world * len.div_ceil(world) + len
}
