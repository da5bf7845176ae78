//! What each collective computes, independent of how: buffer lengths per rank and, for every
//! output element, the set of ranks whose input element it reduces (or copies).
//!
//! Sizes follow NCCL where NCCL is defined and extend it to counts that do not divide by the
//! world size: chunks are split as evenly as possible, the first `n % P` chunks one longer.

use crate::error::Error;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    AllToAll,
    Barrier,
}

impl OpKind {
    pub const ALL: [OpKind; 6] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Barrier,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all-reduce",
            OpKind::ReduceScatter => "reduce-scatter",
            OpKind::AllGather => "all-gather",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all-to-all",
            OpKind::Barrier => "barrier",
        }
    }

    /// Whether the op combines inputs with a reduce operator (otherwise it only moves them).
    pub fn reduces(self) -> bool {
        matches!(self, OpKind::AllReduce | OpKind::ReduceScatter)
    }

    /// The nccl-tests bus-bandwidth factor: busbw = algbw × factor.
    pub fn busbw_factor(self, world: usize) -> f64 {
        let p = world as f64;
        match self {
            OpKind::AllReduce => 2.0 * (p - 1.0) / p,
            OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => (p - 1.0) / p,
            OpKind::Broadcast => 1.0,
            OpKind::Barrier => 0.0,
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OpKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        OpKind::ALL
            .into_iter()
            .find(|k| k.name() == s || k.name().replace('-', "_") == s)
            .ok_or_else(|| {
                let names: Vec<_> = OpKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown op '{s}' (choose one of: {})", names.join(", "))
            })
    }
}

/// The element range of chunk `i` when `n` elements are split into `parts` chunks as evenly as
/// possible (the first `n % parts` chunks hold one element more).
pub fn chunk_range(n: usize, parts: usize, i: usize) -> Range<usize> {
    debug_assert!(i < parts);
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start..start + len
}

/// One collective call: which op, over how many ranks, with how many elements.
///
/// `count` means: all-reduce and broadcast — elements per rank; reduce-scatter — elements of each
/// rank's input (rank r receives chunk r); all-gather — elements of the gathered output (rank r
/// contributes chunk r); all-to-all — elements of each rank's input (the block for rank q is
/// chunk q); barrier — ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct OpSpec {
    pub kind: OpKind,
    pub world: usize,
    pub count: usize,
    pub root: usize,
}

/// A run of output elements `out[start..start+len]` equal to the reduction, over the ranks in
/// `mask`, of input elements `elem..elem+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub start: usize,
    pub len: usize,
    pub mask: u64,
    pub elem: usize,
}

pub fn all_ranks_mask(world: usize) -> u64 {
    if world >= 64 {
        u64::MAX
    } else {
        (1u64 << world) - 1
    }
}

impl OpSpec {
    pub fn new(kind: OpKind, world: usize, count: usize, root: usize) -> Result<Self, Error> {
        if world == 0 || world > crate::MAX_WORLD_SIZE {
            return Err(Error::WorldSize {
                got: world,
                max: crate::MAX_WORLD_SIZE,
            });
        }
        if root >= world {
            return Err(Error::Unsupported(format!(
                "root {root} is not a rank of a world of {world}"
            )));
        }
        let count = if kind == OpKind::Barrier { 0 } else { count };
        // every plan sizes buffers of a few times P·count elements of at most 4 bytes: refuse
        // counts whose products would overflow before any plan multiplies them
        if count
            .checked_mul(world)
            .and_then(|x| x.checked_mul(16))
            .is_none()
        {
            return Err(Error::SizeOverflow(format!(
                "{count} elements on {world} ranks do not fit in memory addresses"
            )));
        }
        Ok(OpSpec {
            kind,
            world,
            count,
            root,
        })
    }

    fn chunk(&self, i: usize) -> Range<usize> {
        chunk_range(self.count, self.world, i)
    }

    /// Elements of rank `rank`'s input that the op reads.
    pub fn input_len(&self, rank: usize) -> usize {
        match self.kind {
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllToAll => self.count,
            OpKind::AllGather => self.chunk(rank).len(),
            OpKind::Broadcast if rank == self.root => self.count,
            OpKind::Broadcast | OpKind::Barrier => 0,
        }
    }

    /// Elements of rank `rank`'s output that the op defines.
    pub fn output_len(&self, rank: usize) -> usize {
        match self.kind {
            OpKind::AllReduce | OpKind::AllGather | OpKind::Broadcast => self.count,
            OpKind::ReduceScatter => self.chunk(rank).len(),
            OpKind::AllToAll => self.world * self.chunk(rank).len(),
            OpKind::Barrier => 0,
        }
    }

    /// Symmetric allocation sizes: the largest input and output over all ranks.
    pub fn input_capacity(&self) -> usize {
        (0..self.world)
            .map(|r| self.input_len(r))
            .max()
            .unwrap_or(0)
    }

    pub fn output_capacity(&self) -> usize {
        (0..self.world)
            .map(|r| self.output_len(r))
            .max()
            .unwrap_or(0)
    }

    /// The definition of rank `rank`'s output, as pieces covering `0..output_len(rank)`.
    pub fn expected_pieces(&self, rank: usize) -> Vec<Piece> {
        let all = all_ranks_mask(self.world);
        let mut pieces = Vec::new();
        let mut push = |start: usize, len: usize, mask: u64, elem: usize| {
            if len > 0 {
                pieces.push(Piece {
                    start,
                    len,
                    mask,
                    elem,
                });
            }
        };
        match self.kind {
            OpKind::AllReduce => push(0, self.count, all, 0),
            OpKind::ReduceScatter => {
                let c = self.chunk(rank);
                push(0, c.len(), all, c.start)
            }
            OpKind::AllGather => {
                for q in 0..self.world {
                    let c = self.chunk(q);
                    // rank q's input holds its chunk from element 0
                    push(c.start, c.len(), 1 << q, 0);
                }
            }
            OpKind::Broadcast => push(0, self.count, 1 << self.root, 0),
            OpKind::AllToAll => {
                let c = self.chunk(rank);
                for q in 0..self.world {
                    push(q * c.len(), c.len(), 1 << q, c.start);
                }
            }
            OpKind::Barrier => {}
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_evenly() {
        for n in 0..40 {
            for p in 1..10 {
                let mut next = 0;
                for i in 0..p {
                    let c = chunk_range(n, p, i);
                    assert_eq!(c.start, next);
                    assert!(c.len() == n / p || c.len() == n / p + 1);
                    next = c.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn pieces_cover_outputs() {
        for kind in OpKind::ALL {
            for p in 1..6 {
                for n in [0, 1, 7, 12] {
                    let spec = OpSpec::new(kind, p, n, p - 1).unwrap();
                    for r in 0..p {
                        let total: usize = spec.expected_pieces(r).iter().map(|x| x.len).sum();
                        assert_eq!(total, spec.output_len(r), "{kind} p={p} n={n}");
                    }
                }
            }
        }
    }
}
