//! The crate's errors: bad requests ([`Error`]) and plans the checker rejects ([`PlanError`]).

use crate::signal::Slot;

/// A request that cannot be served: it names the offending value in one line.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    #[error("world size must be between 1 and {max}, got {got}")]
    WorldSize { got: usize, max: usize },
    #[error("{op} has no algorithm '{algo}' (choose one of: {choices})")]
    UnknownAlgo {
        op: String,
        algo: String,
        choices: String,
    },
    #[error("{0}")]
    Unsupported(String),
    /// An algorithm that cannot run on this world size (or this grouping of its ranks), though
    /// it can on others: the message names both.
    #[error("{0}")]
    NotForWorld(String),
    #[error("size overflow: {0}")]
    SizeOverflow(String),
    #[error("invalid plan")]
    Plan(#[from] PlanError),
}

/// Why the plan checker rejected a plan. Every variant names the rank and step where the problem
/// shows, and the signal slot or buffer range involved.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum PlanError {
    /// A step refers to something that does not exist (peer, slot, buffer range).
    #[error("rank {rank} step {step}: {what}")]
    Malformed {
        rank: usize,
        step: usize,
        what: String,
    },
    /// A signal slot is used twice in one call (two waits, two sets, or sets mixed with adds).
    #[error("rank {rank} step {step}: slot {slot} on rank {owner} is {what} (first by rank {first_rank} step {first_step})")]
    SlotReuse {
        rank: usize,
        step: usize,
        owner: usize,
        slot: Slot,
        what: String,
        first_rank: usize,
        first_step: usize,
    },
    /// Two steps touch overlapping memory, at least one writing, through regions that start at
    /// different offsets.
    /// Backends split every step across lanes (GPU blocks) by the offset within its regions,
    /// each lane with its own signal slots, so overlapping regions must start together.
    #[error("rank {rank} step {step}: {region} overlaps {other} (rank {other_rank} step {other_step}) but starts elsewhere, so a lane of one step would depend on another lane of the other")]
    Misaligned {
        rank: usize,
        step: usize,
        region: String,
        other: String,
        other_rank: usize,
        other_step: usize,
    },
    /// A wait asks for more than the plan ever sends to that slot.
    #[error("rank {rank} step {step}: waits on slot {slot} for {cmp} {expected}, but the plan only ever adds {total} to it in one call, so it can never be satisfied")]
    Unsatisfiable {
        rank: usize,
        step: usize,
        slot: Slot,
        cmp: &'static str,
        expected: u64,
        total: u64,
    },
    /// Whether a wait is satisfied, or which notifies it synchronises with, would depend on the
    /// order in which notifies reach its slot, an order the checker's one schedule does not fix:
    /// an `Eq` wait on a partial sum of several adds, or a notify of the next call that may
    /// reach a slot before the waiter of this call has seen it.
    #[error("rank {rank} step {step}: {what}")]
    OrderDependent {
        rank: usize,
        step: usize,
        what: String,
    },
    /// No rank can make progress.
    #[error("deadlock in call {call}: {blocked}")]
    Deadlock { call: usize, blocked: String },
    /// Two accesses to the same memory, at least one a write, not ordered by any notify/wait.
    #[error("{location}: {what}")]
    Race { location: String, what: String },
    /// A step combines values that must not be combined (twice the same input, stale data, ...).
    #[error("rank {rank} step {step}: {what}")]
    BadData {
        rank: usize,
        step: usize,
        what: String,
    },
    /// After the call, an output element is not what the collective defines.
    #[error("call {call}: rank {rank} output[{index}] {what}")]
    WrongResult {
        call: usize,
        rank: usize,
        index: usize,
        what: String,
    },
}

/// A backend failed to run a plan.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum BackendError {
    /// A spin-wait ran past its deadline: which rank waited on which slot for which peer's
    /// notify (`from`), for what, seeing what.
    #[error("timeout after {timeout_ms} ms: rank {rank} waits on slot {slot} for {cmp} {expected} from rank {from} but sees {seen}")]
    WaitTimeout {
        rank: usize,
        slot: Slot,
        cmp: &'static str,
        expected: u64,
        seen: u64,
        timeout_ms: u64,
        from: usize,
    },
    /// A spin-wait inside a GPU kernel ran past its deadline (lane = the block that waited;
    /// `from` = the rank whose notify it awaited, where the plan tells).
    #[error("timeout after {timeout_ms} ms on the GPU: rank {rank} (lane {lane}) waits on slot {slot} for >= {expected}{} but sees {seen}", from_rank(.from))]
    DeviceWaitTimeout {
        rank: usize,
        lane: u32,
        slot: Slot,
        expected: u64,
        seen: u64,
        timeout_ms: u64,
        from: Option<usize>,
    },
    /// This rank stopped waiting for rank `from` because another rank failed first (`cause`).
    #[error("rank {rank} aborted its wait for rank {from} because {cause}")]
    Aborted {
        rank: usize,
        from: usize,
        cause: AbortCause,
    },
    /// The process of rank `from` (pid `pid`) ended while rank `rank` waited for its notify,
    /// which will never come.
    #[error("rank {rank} stopped waiting for rank {from}: the process of rank {from} (pid {pid}) has ended")]
    PeerGone { rank: usize, from: usize, pid: u64 },
    /// The backend cannot run this request (not built, no device, ...).
    #[error("{0}")]
    Unavailable(String),
    /// The algorithm asked for cannot run on this world size ([`Error::NotForWorld`]).
    #[error("{0}")]
    NotForWorld(String),
    /// `what` needs more host memory than a run may take (see [`MEMORY_SHARE_PERCENT`]) of what
    /// the OS says is available, or more bytes than 64 bits count (`needs` None). Checked before
    /// anything is allocated; `available` is None where the OS does not say.
    #[error("{}", too_large(what, *needs, *available))]
    TooLarge {
        what: String,
        needs: Option<u64>,
        available: Option<u64>,
    },
}

/// Why a group's ranks were told to stop: the first rank that failed and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortCause {
    /// Rank `rank` failed otherwise (a bad argument, an operator it could not build, ...).
    Failed { rank: usize },
    /// Rank `rank` waited past its timeout for rank `from`'s notify.
    TimedOut { rank: usize, from: usize },
    /// Rank `rank` saw that the process of rank `gone` has ended.
    PeerGone { rank: usize, gone: usize },
    /// Rank `rank` (the group's maker) waited past its timeout for rank `missing` to join.
    NotJoined { rank: usize, missing: usize },
}

impl std::fmt::Display for AbortCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            AbortCause::Failed { rank } => write!(f, "rank {rank} failed"),
            AbortCause::TimedOut { rank, from } => {
                write!(f, "rank {rank} timed out waiting for rank {from}")
            }
            AbortCause::PeerGone { rank, gone } => {
                write!(
                    f,
                    "the process of rank {gone} has ended (seen by rank {rank})"
                )
            }
            AbortCause::NotJoined { rank, missing } => {
                write!(
                    f,
                    "rank {missing} did not join the group (seen by rank {rank})"
                )
            }
        }
    }
}

impl From<Error> for BackendError {
    /// A request the backend cannot serve: [`BackendError::NotForWorld`] for an algorithm that
    /// does not fit the world size, [`BackendError::Unavailable`] with the message otherwise.
    fn from(e: Error) -> Self {
        match e {
            Error::NotForWorld(why) => BackendError::NotForWorld(why),
            e => BackendError::Unavailable(e.to_string()),
        }
    }
}

/// The share of the memory the OS says is available that one run may take, in percent: the
/// estimates count every large allocation, not the allocator's overhead, thread stacks or the
/// rest of the process.
pub const MEMORY_SHARE_PERCENT: u64 = 90;

/// Bytes in the binary units people read: 512 B, 1.5 KiB, 20.0 GiB, 91.0 PiB.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn too_large(what: &str, needs: Option<u64>, available: Option<u64>) -> String {
    match (needs, available) {
        (Some(needs), Some(available)) => format!(
            "{what} needs {} ({needs} bytes), more than {MEMORY_SHARE_PERCENT} % of the {} ({available} bytes) of memory available",
            human_bytes(needs),
            human_bytes(available)
        ),
        (Some(needs), None) => format!("{what} needs {} ({needs} bytes)", human_bytes(needs)),
        (None, Some(available)) => format!(
            "{what} needs more bytes than 64 bits count (its size overflows); {} ({available} bytes) of memory is available",
            human_bytes(available)
        ),
        (None, None) => {
            format!("{what} needs more bytes than 64 bits count (its size overflows)")
        }
    }
}

/// " from rank N" for a wait whose notifier is known, else nothing.
fn from_rank(from: &Option<usize>) -> String {
    from.map(|r| format!(" from rank {r}")).unwrap_or_default()
}
