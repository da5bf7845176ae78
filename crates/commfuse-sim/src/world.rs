//! The simulated world: P ranks as scoped threads sharing signal pads.

use crate::protocol::{self, Pads, SignalWord, Stop};
use crate::signal::{SignalPad, SimBackoff};
use commfuse_core::backend::BackendError;
use commfuse_core::{Cmp, NotifyOp, Slot, MAX_WORLD_SIZE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
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

impl Default for WorldConfig {
    fn default() -> Self {
        WorldConfig {
            timeout: Duration::from_secs(5),
            pad_rows: 32,
            pad_cols: 64,
        }
    }
}

/// P simulated ranks.
pub struct World {
    size: usize,
    config: WorldConfig,
    pads: Vec<SignalPad>,
    abort: AtomicBool,
    /// Set when a call failed: pads may hold half a call's signals, so the world is spent.
    broken: AtomicBool,
    /// Per rank, the epoch base of each slot for plans (see `CheckedPlan::slot_increments`).
    pub(crate) bases: Vec<Mutex<Vec<u64>>>,
    next_barrier_row: Mutex<u32>,
}

impl World {
    pub fn new(size: usize, mut config: WorldConfig) -> Result<World, BackendError> {
        if size == 0 || size > MAX_WORLD_SIZE {
            return Err(BackendError::Unavailable(format!(
                "world size must be between 1 and {MAX_WORLD_SIZE}, got {size}"
            )));
        }
        config.pad_cols = config.pad_cols.max(size as u32);
        let slots = config.pad_rows as usize * config.pad_cols as usize;
        Ok(World {
            size,
            pads: (0..size)
                .map(|_| SignalPad::new(config.pad_rows, config.pad_cols))
                .collect(),
            abort: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            bases: (0..size).map(|_| Mutex::new(vec![0; slots])).collect(),
            next_barrier_row: Mutex::new(config.pad_rows),
            config,
        })
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

    /// Runs `f` on every rank, each on its own thread, and returns the ranks' results in rank
    /// order. If a rank fails, the others are aborted and the first real failure (not an abort
    /// caused by it) is returned.
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
            let handles: Vec<_> = (0..self.size)
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let ctx = RankContext { world: self, rank };
                        let out = f(&ctx);
                        if out.is_err() {
                            self.abort.store(true, Ordering::Relaxed);
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

    /// Waits, with acquire semantics, until this rank's slot compares true with `expected`;
    /// returns the value seen. Times out after the world's timeout with a diagnosis.
    pub fn wait(&self, slot: Slot, expected: u64, cmp: Cmp) -> Result<u64, BackendError> {
        let word = self.slot_of(self.rank, slot)?;
        let mut backoff = self.backoff();
        protocol::wait(word, expected, cmp, &mut backoff)
            .map_err(|(stop, seen)| self.stuck(stop, slot, cmp, expected, seen))
    }

    /// The current value of this rank's slot.
    pub fn peek(&self, slot: Slot) -> Result<u64, BackendError> {
        Ok(self.slot_of(self.rank, slot)?.load_acquire())
    }

    pub(crate) fn backoff(&self) -> SimBackoff<'w> {
        SimBackoff::new(self.world.config.timeout, &self.world.abort)
    }

    pub(crate) fn stuck(
        &self,
        stop: Stop,
        slot: Slot,
        cmp: Cmp,
        expected: u64,
        seen: u64,
    ) -> BackendError {
        match stop {
            Stop::Aborted => BackendError::Aborted { rank: self.rank },
            Stop::Timeout => BackendError::WaitTimeout {
                rank: self.rank,
                slot,
                cmp: cmp.symbol(),
                expected,
                seen,
                timeout_ms: self.world.config.timeout.as_millis() as u64,
            },
        }
    }
}
