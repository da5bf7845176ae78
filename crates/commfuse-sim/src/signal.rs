//! Signal pads: one per rank, `rows × cols` 64-bit counters, and the simulator's waiting policy.

use crate::protocol::{Backoff, Stop};
use crate::shared::Arena;
use commfuse_core::backend::BackendError;
use commfuse_core::error::AbortCause;
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

/// Raises the abort flag `flag` with `cause`, unless a cause is there already: the first
/// failure is the one every rank names.
pub(crate) fn raise_abort(flag: &AtomicU64, cause: AbortCause) {
    let (kind, a, b) = match cause {
        AbortCause::Failed { rank } => (1, rank, 0),
        AbortCause::TimedOut { rank, from } => (2, rank, from),
        AbortCause::PeerGone { rank, gone } => (3, rank, gone),
        AbortCause::NotJoined { rank, missing } => (4, rank, missing),
    };
    // ranks are below 2^24 (a world has at most 64), so the fields do not overlap
    let word = kind | (a as u64 & 0xff_ffff) << 8 | (b as u64 & 0xff_ffff) << 32;
    let _ = flag.compare_exchange(0, word, Ordering::AcqRel, Ordering::Relaxed);
}

/// Why the abort flag `flag` was raised (by [`raise_abort`]); None while it is down.
pub(crate) fn abort_cause(flag: &AtomicU64) -> Option<AbortCause> {
    let word = flag.load(Ordering::Acquire);
    let (a, b) = (
        (word >> 8 & 0xff_ffff) as usize,
        (word >> 32 & 0xff_ffff) as usize,
    );
    match word & 0xff {
        0 => None,
        2 => Some(AbortCause::TimedOut { rank: a, from: b }),
        3 => Some(AbortCause::PeerGone { rank: a, gone: b }),
        4 => Some(AbortCause::NotJoined {
            rank: a,
            missing: b,
        }),
        _ => Some(AbortCause::Failed { rank: a }),
    }
}

/// Spin briefly (a peer on another core answers within a microsecond), then yield (more ranks
/// than cores: let the peer run), then sleep in growing steps (a long wait should not burn a
/// core). Gives up at the deadline, when another rank raised the abort flag, or (in a group of
/// processes) when the process of the rank being waited for has ended: that process is looked
/// at every [`LOOK_EVERY`] of a wait, and a wait whose peer ended polls its word once more
/// before it stops, so that a notify the peer made just before it ended still counts.
pub struct SimBackoff<'a> {
    polls: u32,
    deadline: Instant,
    abort: &'a AtomicU64,
    /// The group whose members' processes are watched, with the rank waited for
    watch: Option<(&'a Arena, usize)>,
    next_look: Instant,
    /// The watched rank's process ended (its pid): the next pause stops
    gone: Option<u64>,
}

const SPIN_POLLS: u32 = 64;
const YIELD_POLLS: u32 = 1024;
/// How often a wait looks whether the process of the rank it waits for has ended.
pub const LOOK_EVERY: Duration = Duration::from_millis(5);

impl<'a> SimBackoff<'a> {
    pub fn new(timeout: Duration, abort: &'a AtomicU64) -> Self {
        let now = Instant::now();
        SimBackoff {
            polls: 0,
            deadline: now + timeout,
            abort,
            watch: None,
            next_look: now + LOOK_EVERY,
            gone: None,
        }
    }

    /// Also watches the processes of `arena`'s ranks: a wait for a rank whose process has
    /// ended stops ([`Stop::Gone`]).
    pub(crate) fn watching(mut self, arena: Option<&'a Arena>) -> Self {
        self.watch = arena.map(|a| (a, a.rank()));
        self
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
        if let Some(pid) = self.gone {
            return Err(Stop::Gone { pid });
        }
        let now = Instant::now();
        if let Some((arena, peer)) = self.watch {
            if now >= self.next_look {
                self.next_look = now + LOOK_EVERY;
                if let Some(pid) = arena.ended(peer) {
                    // one more poll first: what the peer notified before it ended counts
                    self.gone = Some(pid);
                    return Ok(());
                }
            }
        }
        if now >= self.deadline {
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

    fn waits_for(&mut self, rank: usize) {
        if let Some((_, peer)) = &mut self.watch {
            if *peer != rank {
                *peer = rank;
                self.gone = None;
            }
        }
    }
}
