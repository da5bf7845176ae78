//! Signal pads: one per rank, `rows × cols` 64-bit counters, and the simulator's waiting policy.

use crate::protocol::{Backoff, Stop};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One rank's signal counters.
pub struct SignalPad {
    rows: u32,
    cols: u32,
    slots: Vec<AtomicU64>,
}

impl SignalPad {
    pub fn new(rows: u32, cols: u32) -> Self {
        SignalPad {
            rows,
            cols,
            slots: (0..rows as usize * cols as usize)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    pub fn rows(&self) -> u32 {
        self.rows
    }

    pub fn cols(&self) -> u32 {
        self.cols
    }

    /// The slot at (row, col), or None outside the pad.
    pub fn slot(&self, row: u32, col: u32) -> Option<&AtomicU64> {
        (row < self.rows && col < self.cols)
            .then(|| &self.slots[row as usize * self.cols as usize + col as usize])
    }
}

/// Spin briefly (a peer on another core answers within a microsecond), then yield (more ranks
/// than cores: let the peer run), then sleep in growing steps (a long wait should not burn a
/// core). Gives up at the deadline or when another rank raised the abort flag.
pub struct SimBackoff<'a> {
    polls: u32,
    deadline: Instant,
    abort: &'a AtomicBool,
}

const SPIN_POLLS: u32 = 64;
const YIELD_POLLS: u32 = 1024;

impl<'a> SimBackoff<'a> {
    pub fn new(timeout: Duration, abort: &'a AtomicBool) -> Self {
        SimBackoff {
            polls: 0,
            deadline: Instant::now() + timeout,
            abort,
        }
    }
}

impl Backoff for SimBackoff<'_> {
    fn pause(&mut self) -> Result<(), Stop> {
        self.polls = self.polls.saturating_add(1);
        if self.polls < SPIN_POLLS {
            std::hint::spin_loop();
            return Ok(());
        }
        if self.abort.load(Ordering::Relaxed) {
            return Err(Stop::Aborted);
        }
        if Instant::now() >= self.deadline {
            return Err(Stop::Timeout);
        }
        if self.polls < YIELD_POLLS {
            std::thread::yield_now();
        } else {
            let extra = (self.polls - YIELD_POLLS).min(100) as u64;
            std::thread::sleep(Duration::from_micros(10 + 10 * extra));
        }
        Ok(())
    }
}
