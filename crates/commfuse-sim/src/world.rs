//! The simulated world: P ranks as scoped threads sharing signal pads.

use crate::memory::{Footprint, OperatorMemory};
use crate::protocol::{self, Backoff, Pads, SignalWord, Stop};
use crate::shared::Arena;
use crate::signal::{SignalPad, SimBackoff};
use commfuse_core::backend::BackendError;
use commfuse_core::error::AbortCause;
use commfuse_core::{Cmp, NotifyOp, Slot, MAX_WORLD_SIZE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct WorldConfig {
    /// How long a wait may take before the run fails with a diagnosis.
    pub timeout: Duration,
    /// Signal pad rows per rank; plans use rows from 0, barriers from the top.
    pub pad_rows: u32,
    /// Signal pad columns per rank (at least the world size).
    pub pad_cols: u32,
}

impl WorldConfig {
    /// What a world of `size` ranks of this configuration allocates: every rank's signal pad
    /// (in the group's arena for a shared world) and the epoch bases of its slots (always in
    /// this process).
    pub fn memory(&self, size: usize) -> OperatorMemory {
        let cols = (self.pad_cols as usize).max(size);
        let what = format!(
            "a simulated world of {size} ranks with {}×{cols} signal pads",
            self.pad_rows
        );
        let slots = [size, self.pad_rows as usize, cols, 8];
        OperatorMemory {
            buffers: Footprint::new(what.clone()).item(&slots),
            heap: Footprint::new(what).item(&slots),
        }
    }
}

impl Default for WorldConfig {
    fn default() -> Self {
        WorldConfig {
            timeout: Duration::from_secs(5),
            pad_rows: 32,
            pad_cols: 64,
        }
    }
}

/// P simulated ranks: all of them threads of this process, or (a shared world) one rank of a
/// group whose other ranks are other processes, its pads and buffers in the group's
/// [`Arena`].
pub struct World {
    size: usize,
    config: WorldConfig,
    pads: Vec<SignalPad>,
    /// Raised when a rank's call failed (a shared world uses its group's flag instead)
    abort: AtomicU64,
    /// The group's shared memory, for a shared world
    arena: Option<Arc<Arena>>,
    /// Set when a call failed: pads may hold half a call's signals, so the world is spent.
    broken: AtomicBool,
    /// Per rank, the epoch base of each slot for plans (see `CheckedPlan::slot_increments`).
    pub(crate) bases: Vec<Mutex<Vec<u64>>>,
    next_barrier_row: Mutex<u32>,
}

impl World {
    pub fn new(size: usize, config: WorldConfig) -> Result<World, BackendError> {
        World::build(size, config, None)
    }

    /// This process's rank of the group `arena` maps, as a world of the group's size: every
    /// rank's signal pads carved from the arena (every process must make its worlds and
    /// operators in the same order); [`World::run`] runs this process's rank only.
    pub fn shared(arena: Arc<Arena>, config: WorldConfig) -> Result<World, BackendError> {
        World::build(arena.world(), config, Some(arena))
    }

    /// A world of `size` ranks whose pads lie in `arena` when given, in this process otherwise.
    fn build(
        size: usize,
        mut config: WorldConfig,
        arena: Option<Arc<Arena>>,
    ) -> Result<World, BackendError> {
        if size == 0 || size > MAX_WORLD_SIZE {
            return Err(BackendError::Unavailable(format!(
                "world size must be between 1 and {MAX_WORLD_SIZE}, got {size}"
            )));
        }
        config.pad_cols = config.pad_cols.max(size as u32);
        config.memory(size).check(arena.is_some())?;
        let (rows, cols) = (config.pad_rows, config.pad_cols);
        let slots = rows as usize * cols as usize;
        let pads = (0..size)
            .map(|_| SignalPad::new_in(arena.as_deref(), rows, cols))
            .collect::<Result<_, _>>()?;
        Ok(World {
            size,
            pads,
            abort: AtomicU64::new(0),
            arena,
            broken: AtomicBool::new(false),
            bases: (0..size).map(|_| Mutex::new(vec![0; slots])).collect(),
            next_barrier_row: Mutex::new(rows),
            config,
        })
    }

    /// The group's shared memory, when this world is one rank of a multi-process group.
    pub fn arena(&self) -> Option<&Arc<Arena>> {
        self.arena.as_ref()
    }

    /// The flag every rank's waits watch.
    fn abort_flag(&self) -> &AtomicU64 {
        match &self.arena {
            Some(arena) => arena.abort_flag(),
            None => &self.abort,
        }
    }

    /// Stops every rank's waits (in every process of a shared world) with `cause`, unless a
    /// rank failed first.
    pub(crate) fn raise_abort(&self, cause: AbortCause) {
        crate::signal::raise_abort(self.abort_flag(), cause);
    }

    /// Why the world was aborted, if it was: the first rank that failed and how.
    pub fn abort_cause(&self) -> Option<AbortCause> {
        crate::signal::abort_cause(self.abort_flag())
    }

    /// The ranks [`World::run`] runs in this process.
    fn local_ranks(&self) -> std::ops::Range<usize> {
        match &self.arena {
            Some(arena) => arena.rank()..arena.rank() + 1,
            None => 0..self.size,
        }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn config(&self) -> &WorldConfig {
        &self.config
    }

    pub fn pad(&self, rank: usize) -> &SignalPad {
        &self.pads[rank]
    }

    /// Reserves `count` rows at the top of every pad (for barriers).
    pub(crate) fn reserve_rows(&self, count: u32) -> Result<u32, BackendError> {
        let mut next = self.next_barrier_row.lock().unwrap();
        if *next < count + self.config.pad_rows / 2 {
            return Err(BackendError::Unavailable(
                "no signal rows left for another barrier".into(),
            ));
        }
        *next -= count;
        Ok(*next)
    }

    /// The rows plans may use: those below every reserved barrier row.
    pub fn plan_rows(&self) -> u32 {
        *self.next_barrier_row.lock().unwrap()
    }

    /// Runs `f` on every rank of this process, each on its own thread (all ranks, or a shared
    /// world's one), and returns their results in rank order. If a rank fails, the others —
    /// in other processes too — are aborted and the first real failure (not an abort caused by
    /// it) is returned.
    pub fn run<R, F>(&self, f: F) -> Result<Vec<R>, BackendError>
    where
        R: Send,
        F: Fn(&RankContext<'_>) -> Result<R, BackendError> + Sync,
    {
        if self.broken.load(Ordering::Acquire) {
            return Err(BackendError::Unavailable(
                "this world is unusable after a failed call".into(),
            ));
        }
        let results: Vec<Result<R, BackendError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .local_ranks()
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let ctx = RankContext { world: self, rank };
                        let out = f(&ctx);
                        if out.is_err() {
                            // a wait that ended raised the flag with its cause already
                            self.raise_abort(AbortCause::Failed { rank });
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(BackendError::Unavailable("a rank thread panicked".into()))
                    })
                })
                .collect()
        });
        if results.iter().any(|r| r.is_err()) {
            self.broken.store(true, Ordering::Release);
            let mut errors: Vec<BackendError> =
                results.into_iter().filter_map(|r| r.err()).collect();
            errors.sort_by_key(|e| matches!(e, BackendError::Aborted { .. }));
            return Err(errors.swap_remove(0));
        }
        Ok(results.into_iter().map(|r| r.ok().unwrap()).collect())
    }
}

impl Pads for World {
    type Word = AtomicU64;
    fn slot(&self, rank: usize, row: u32, col: u32) -> &AtomicU64 {
        self.pads[rank]
            .slot(row, col)
            .expect("barrier rows are reserved inside the pad")
    }
}

/// What one rank's thread sees of the world.
pub struct RankContext<'w> {
    world: &'w World,
    rank: usize,
}

impl<'w> RankContext<'w> {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world.size
    }

    pub fn world(&self) -> &'w World {
        self.world
    }

    fn slot_of(&self, rank: usize, slot: Slot) -> Result<&'w AtomicU64, BackendError> {
        let pad = self.world.pads.get(rank).ok_or_else(|| {
            BackendError::Unavailable(format!(
                "rank {} signals rank {rank}, which does not exist",
                self.rank
            ))
        })?;
        pad.slot(slot.row, slot.col).ok_or_else(|| {
            BackendError::Unavailable(format!(
                "slot {slot} is outside the {}×{} signal pad",
                pad.rows(),
                pad.cols()
            ))
        })
    }

    /// Signals `peer`'s slot with release semantics.
    pub fn notify(
        &self,
        peer: usize,
        slot: Slot,
        value: u64,
        op: NotifyOp,
    ) -> Result<(), BackendError> {
        protocol::notify(self.slot_of(peer, slot)?, value, op);
        Ok(())
    }

    /// Waits, with acquire semantics, until this rank's slot compares true with `expected`, for
    /// the notify of rank `from`; returns the value seen. Times out after the world's timeout
    /// with a diagnosis naming `from`, and in a shared world stops as soon as `from`'s process
    /// has ended.
    pub fn wait(
        &self,
        slot: Slot,
        expected: u64,
        cmp: Cmp,
        from: usize,
    ) -> Result<u64, BackendError> {
        let word = self.slot_of(self.rank, slot)?;
        let mut backoff = self.backoff();
        backoff.waits_for(from);
        protocol::wait(word, expected, cmp, &mut backoff)
            .map_err(|(stop, seen)| self.stuck(stop, slot, cmp, (expected, seen), from))
    }

    /// The current value of this rank's slot.
    pub fn peek(&self, slot: Slot) -> Result<u64, BackendError> {
        Ok(self.slot_of(self.rank, slot)?.load_acquire())
    }

    /// The waiting policy of this rank's waits: the world's timeout and abort flag, and in a
    /// shared world the processes of the ranks waited for.
    pub(crate) fn backoff(&self) -> SimBackoff<'w> {
        SimBackoff::new(self.world.config.timeout, self.world.abort_flag())
            .watching(self.world.arena.as_deref())
    }

    /// The error of a wait on `slot` for `cmp` (expected, seen) that `stop` ended (see
    /// [`RankContext::wait_ended`]).
    pub(crate) fn stuck(
        &self,
        stop: Stop,
        slot: Slot,
        cmp: Cmp,
        (expected, seen): (u64, u64),
        from: usize,
    ) -> BackendError {
        self.wait_ended(stop, from, |timeout_ms| BackendError::WaitTimeout {
            rank: self.rank,
            slot,
            cmp: cmp.symbol(),
            expected,
            seen,
            timeout_ms,
            from,
        })
    }

    /// The error of a wait of this rank for rank `from`'s notify that `stop` ended, `timeout`
    /// making the error of a timeout from the world's timeout in ms. A timeout and a peer's
    /// ended process raise the world's abort flag with that cause (unless another rank failed
    /// first), so that every other rank's waits stop too and name it.
    pub(crate) fn wait_ended(
        &self,
        stop: Stop,
        from: usize,
        timeout: impl FnOnce(u64) -> BackendError,
    ) -> BackendError {
        let rank = self.rank;
        match stop {
            Stop::Aborted => BackendError::Aborted {
                rank,
                from,
                cause: self
                    .world
                    .abort_cause()
                    .unwrap_or(AbortCause::Failed { rank }),
            },
            Stop::Gone { pid } => {
                self.world
                    .raise_abort(AbortCause::PeerGone { rank, gone: from });
                BackendError::PeerGone { rank, from, pid }
            }
            Stop::Timeout => {
                self.world.raise_abort(AbortCause::TimedOut { rank, from });
                timeout(self.world.config.timeout.as_millis() as u64)
            }
        }
    }
}
