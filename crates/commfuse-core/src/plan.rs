//! Plans: for each rank, the ordered steps of one collective call over symmetric buffers and
//! signal pads. Plans are data: the checker verifies them, the simulator interprets them, the
//! CUDA kernels read them as tables.

use crate::op::OpSpec;
pub use crate::signal::{Cmp, NotifyOp, Slot};
use std::fmt;
use std::ops::Range;

/// The three symmetric buffers of a call. Every rank has one of each, of the same size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BufferKind {
    Input,
    Output,
    Scratch,
}

impl BufferKind {
    pub const ALL: [BufferKind; 3] = [BufferKind::Input, BufferKind::Output, BufferKind::Scratch];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Input => "input",
            BufferKind::Output => "output",
            BufferKind::Scratch => "scratch",
        }
    }
}

/// A range of one rank's copy of a symmetric buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Region {
    pub rank: usize,
    pub buffer: BufferKind,
    pub offset: usize,
    pub len: usize,
}

impl Region {
    pub fn new(rank: usize, buffer: BufferKind, range: Range<usize>) -> Self {
        Region {
            rank,
            buffer,
            offset: range.start,
            len: range.len(),
        }
    }

    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    pub fn overlaps(&self, other: &Region) -> bool {
        self.rank == other.rank
            && self.buffer == other.buffer
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} {}[{}..{})",
            self.rank,
            self.buffer.name(),
            self.offset,
            self.offset + self.len
        )
    }
}

/// One step of one rank. Values in `Wait` and `Notify` count from the start of the call:
/// backends add a per-slot epoch base so that repeated calls need no reset (see
/// [`crate::checker::CheckedPlan::slot_increments`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Step {
    /// Block until this rank's own slot compares true with `expected` (acquire).
    Wait { slot: Slot, expected: u64, cmp: Cmp },
    /// Signal `peer`'s slot (release): everything this rank wrote before is visible to a waiter.
    Notify {
        peer: usize,
        slot: Slot,
        value: u64,
        op: NotifyOp,
    },
    /// every dst ← src. Either side may be a peer's buffer (a load or a store over the link);
    /// several destinations are written in one pass over the source (a local copy and a push
    /// to a peer then overlap instead of running one after the other).
    Copy { src: Region, dsts: Vec<Region> },
    /// every dst ← srcs[0] ⊕ srcs[1] ⊕ …, in that order, accumulated in f32 and rounded once.
    /// A dst may be exactly one of the sources (in place), never a partial overlap.
    Reduce {
        srcs: Vec<Region>,
        dsts: Vec<Region>,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Wait {
                slot,
                expected,
                cmp,
            } => write!(f, "wait    slot {slot} {} {expected}", cmp.symbol()),
            Step::Notify {
                peer,
                slot,
                value,
                op,
            } => write!(f, "notify  rank {peer} slot {slot} {op:?} {value}"),
            Step::Copy { src, dsts } => write!(f, "copy    {src} -> {}", list(dsts)),
            Step::Reduce { srcs, dsts } => {
                write!(f, "reduce  ")?;
                for (i, s) in srcs.iter().enumerate() {
                    if i > 0 {
                        write!(f, " + ")?;
                    }
                    write!(f, "{s}")?;
                }
                write!(f, " -> {}", list(dsts))
            }
        }
    }
}

fn list(regions: &[Region]) -> String {
    regions
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Step {
    /// The regions a data step reads and writes (empty for signals).
    pub fn regions(&self) -> (&[Region], &[Region]) {
        match self {
            Step::Copy { src, dsts } => (std::slice::from_ref(src), dsts),
            Step::Reduce { srcs, dsts } => (srcs, dsts),
            Step::Wait { .. } | Step::Notify { .. } => (&[], &[]),
        }
    }
}

/// Lengths (in elements) of the three symmetric buffers, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct BufferSizes {
    pub input: usize,
    pub output: usize,
    pub scratch: usize,
}

impl BufferSizes {
    pub fn get(&self, kind: BufferKind) -> usize {
        match kind {
            BufferKind::Input => self.input,
            BufferKind::Output => self.output,
            BufferKind::Scratch => self.scratch,
        }
    }
}

/// A collective call as data.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    pub spec: OpSpec,
    pub algo: String,
    pub buffers: BufferSizes,
    /// Signal pad shape this plan needs on every rank.
    pub pad_rows: u32,
    pub pad_cols: u32,
    /// `steps[r]` is rank r's program.
    pub steps: Vec<Vec<Step>>,
}

impl Plan {
    pub fn world(&self) -> usize {
        self.spec.world
    }

    /// A human-readable listing of every rank's steps.
    pub fn listing(&self) -> String {
        let mut out = String::new();
        for (r, steps) in self.steps.iter().enumerate() {
            out.push_str(&format!("rank {r}: {} steps\n", steps.len()));
            for (i, s) in steps.iter().enumerate() {
                out.push_str(&format!("  {i:4}  {s}\n"));
            }
        }
        out
    }
}

/// Builds plans: allocates signal rows and scratch ranges so that composed phases never share a
/// slot or a scratch range.
pub struct PlanBuilder {
    spec: OpSpec,
    steps: Vec<Vec<Step>>,
    next_row: u32,
    max_col: u32,
    scratch: usize,
}

impl PlanBuilder {
    pub fn new(spec: OpSpec) -> Self {
        PlanBuilder {
            spec,
            steps: vec![Vec::new(); spec.world],
            next_row: 0,
            max_col: 0,
            scratch: 0,
        }
    }

    pub fn world(&self) -> usize {
        self.spec.world
    }

    pub fn spec(&self) -> OpSpec {
        self.spec
    }

    /// Reserves `count` fresh signal rows and returns the first.
    pub fn rows(&mut self, count: u32) -> u32 {
        let first = self.next_row;
        self.next_row += count;
        first
    }

    /// Reserves `len` elements of scratch (on every rank) and returns the offset.
    pub fn scratch(&mut self, len: usize) -> usize {
        let offset = self.scratch;
        self.scratch += len;
        offset
    }

    pub fn push(&mut self, rank: usize, step: Step) {
        if let Step::Wait { slot, .. } | Step::Notify { slot, .. } = &step {
            self.max_col = self.max_col.max(slot.col + 1);
        }
        self.steps[rank].push(step);
    }

    /// Wait until own slot ≥ `expected`.
    pub fn wait(&mut self, rank: usize, slot: Slot, expected: u64) {
        self.push(
            rank,
            Step::Wait {
                slot,
                expected,
                cmp: Cmp::Ge,
            },
        );
    }

    /// Set peer's slot to 1 (counted from the call's epoch base).
    pub fn signal(&mut self, rank: usize, peer: usize, slot: Slot) {
        self.push(
            rank,
            Step::Notify {
                peer,
                slot,
                value: 1,
                op: NotifyOp::Set,
            },
        );
    }

    /// A copy, skipped when empty or when source and destination are the same range.
    pub fn copy(&mut self, rank: usize, src: Region, dst: Region) {
        self.copy_to(rank, src, vec![dst]);
    }

    /// A copy into several destinations in one pass; destinations equal to the source are
    /// dropped, and nothing is pushed when none is left or the source is empty.
    pub fn copy_to(&mut self, rank: usize, src: Region, mut dsts: Vec<Region>) {
        dsts.retain(|d| *d != src);
        if src.len > 0 && !dsts.is_empty() {
            self.push(rank, Step::Copy { src, dsts });
        }
    }

    /// A reduction, skipped when empty; one source is a copy.
    pub fn reduce(&mut self, rank: usize, srcs: Vec<Region>, dst: Region) {
        self.reduce_to(rank, srcs, vec![dst]);
    }

    /// A reduction into several destinations in one pass; one source is a copy.
    pub fn reduce_to(&mut self, rank: usize, srcs: Vec<Region>, dsts: Vec<Region>) {
        if dsts.first().is_none_or(|d| d.len == 0) {
            return;
        }
        if srcs.len() == 1 {
            self.copy_to(rank, srcs[0], dsts);
        } else {
            self.push(rank, Step::Reduce { srcs, dsts });
        }
    }

    pub fn finish(self, algo: &str) -> Plan {
        Plan {
            spec: self.spec,
            algo: algo.to_string(),
            buffers: BufferSizes {
                input: self.spec.input_capacity(),
                output: self.spec.output_capacity(),
                scratch: self.scratch,
            },
            pad_rows: self.next_row.max(1),
            pad_cols: self.max_col.max(1),
            steps: self.steps,
        }
    }
}
