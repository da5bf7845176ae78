//! Signal pads: one per rank, `rows × cols` 64-bit counters, and the simulator's waiting policy.

use crate::protocol::{Backoff, Stop};
use crate::shared::Arena;
use commfuse_core::backend::BackendError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One rank's signal counters: in this process's memory, or in a group's shared memory.
pub struct SignalPad {
    rows: u32,
    cols: u32,
    slots: Slots,
}

enum Slots {
    Owned(Vec<AtomicU64>),
    /// rows × cols words inside an [`Arena`] that outlives the pad (its world holds it)
    Shared(*const AtomicU64),
}

// SAFETY: the slots are atomics, owned or in a shared mapping that outlives the pad
unsafe impl Send for SignalPad {}
unsafe impl Sync for SignalPad {}

impl SignalPad {
    pub fn new(rows: u32, cols: u32) -> Self {
        SignalPad {
            rows,
            cols,
            slots: Slots::Owned(
                (0..rows as usize * cols as usize)
                    .map(|_| AtomicU64::new(0))
                    .collect(),
            ),
        }
    }

    /// A zeroed pad carved from `arena` when given (at the same place in every process of the
    /// group), in this process's memory otherwise.
    pub(crate) fn new_in(
        arena: Option<&Arena>,
        rows: u32,
        cols: u32,
    ) -> Result<Self, BackendError> {
        match arena {
            Some(arena) => SignalPad::in_arena(arena, rows, cols),
            None => Ok(SignalPad::new(rows, cols)),
        }
    }

    /// A pad carved from `arena` (zeroed), at the same place in every process of the group.
    fn in_arena(arena: &Arena, rows: u32, cols: u32) -> Result<Self, BackendError> {
        let bytes = rows as usize * cols as usize * std::mem::size_of::<AtomicU64>();
        let ptr = arena.alloc(bytes)?;
        Ok(SignalPad {
            rows,
            cols,
            slots: Slots::Shared(ptr as *const AtomicU64),
        })
    }

    pub fn rows(&self) -> u32 {
        self.rows
    }

    pub fn cols(&self) -> u32 {
        self.cols
    }

    /// The slot at (row, col), or None outside the pad.
    pub fn slot(&self, row: u32, col: u32) -> Option<&AtomicU64> {
        let i = row as usize * self.cols as usize + col as usize;
        (row < self.rows && col < self.cols).then(|| match &self.slots {
            Slots::Owned(v) => &v[i],
            // SAFETY: i < rows × cols, the words the arena gave this pad
            Slots::Shared(p) => unsafe { &*p.add(i) },
        })
    }
}

/// Spin briefly (a peer on another core answers within a microsecond), then yield (more ranks
/// than cores: let the peer run), then sleep in growing steps (a long wait should not burn a
/// core). Gives up at the deadline or when another rank raised the abort flag.
pub struct SimBackoff<'a> {
    polls: u32,
    deadline: Instant,
    abort: &'a AtomicU64,
}

const SPIN_POLLS: u32 = 64;
const YIELD_POLLS: u32 = 1024;

impl<'a> SimBackoff<'a> {
    pub fn new(timeout: Duration, abort: &'a AtomicU64) -> Self {
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
        if self.abort.load(Ordering::Relaxed) != 0 {
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
