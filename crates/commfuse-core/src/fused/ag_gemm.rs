//! All-gather + GEMM, the column-parallel linear layer of tensor parallelism with sequence
//! parallelism (the semantics of Flux's AGKernel and PyTorch's `fused_all_gather_matmul`): rank
//! r holds chunk r of the rows of A ([M_r, K], chunks split as the collectives split M) and its
//! own B_r ([K, N] or [N, K]) with an optional bias [N]; every rank's output is
//! AllGather(A)·B_r (+ bias), [M, N], and optionally the gathered A itself.
//!
//! The overlapped schedule, for every rank r:
//! * At the start of a call r hands its chunk, cut into `pieces` row pieces, to every peer: a
//!   copy into the peer's gather buffer at the chunk's rows, then that piece's flag on the peer
//!   set to the call's number (copies by the copy engine on GPUs, beside the GEMMs).
//! * Its GEMMs take the chunks in the order r, r + 1, …, r + P − 1 (its own first, from the
//!   caller's A, then the peers' in the order their copies were started), one GEMM per piece,
//!   each waiting for its piece's flag, writing the output rows of that piece.
//! * At the end of a call every rank raises its "done" flag on every peer and waits for all the
//!   peers' dones: when a call ends on a rank, every peer has finished reading what the rank
//!   sent and nothing writes into the rank's gather buffer any more, so the next call may
//!   overwrite it and the operator may be dropped. One set of buffers and flags serves every
//!   call; flags hold call numbers (from 1) and are never cleared.
//!
//! Cost card (per rank, per call): (P − 1)·M_r·K input elements sent and (M − M_r)·K received;
//! P·pieces GEMMs; P − 1 + P·pieces flags.

use crate::dtype::DType;
use crate::error::Error;
use crate::gemm::{BLayout, GemmProblem};
use crate::op::chunk_range;
use std::ops::Range;

/// The most pieces a chunk is cut into.
pub const MAX_PIECES: usize = 16;

/// What one all-gather + GEMM call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct AgGemmShape {
    pub world: usize,
    /// Rows of the gathered A (and of every rank's output), split over the ranks
    pub m: usize,
    /// Columns of every rank's B_r and output
    pub n: usize,
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// The input type or f32
    pub output: DType,
}

impl AgGemmShape {
    pub fn new(
        world: usize,
        m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> Result<AgGemmShape, Error> {
        if world == 0 {
            return Err(Error::Unsupported(
                "all-gather + GEMM needs at least one rank".into(),
            ));
        }
        if output != DType::F32 && output != input {
            return Err(Error::Unsupported(format!(
                "the output is {input} (the input type) or f32, got {output}"
            )));
        }
        GemmProblem::new(m, n, k, b_layout, input, output)?;
        Ok(AgGemmShape {
            world,
            m,
            n,
            k,
            b_layout,
            input,
            output,
        })
    }

    /// Rows of A held by rank `owner`.
    pub fn chunk(&self, owner: usize) -> Range<usize> {
        chunk_range(self.m, self.world, owner)
    }

    /// Every rank's whole product: the gathered A [M, K] times its B.
    pub fn problem(&self) -> GemmProblem {
        GemmProblem {
            m: self.m,
            n: self.n,
            k: self.k,
            b_layout: self.b_layout,
            input: self.input,
            output: self.output,
        }
    }
}

/// One GEMM of a rank: rows `rows` of the gathered A (absolute), from chunk `owner`'s piece
/// `piece`; the rank's own chunk (`local`) is read from the caller's A and waits for nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgPiece {
    pub owner: usize,
    pub piece: usize,
    pub rows: Range<usize>,
    pub local: bool,
}

/// The overlapped schedule of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgGemmSchedule {
    pub shape: AgGemmShape,
    /// Row pieces per chunk
    pub pieces: usize,
}

impl AgGemmSchedule {
    pub fn new(shape: AgGemmShape, pieces: usize) -> AgGemmSchedule {
        AgGemmSchedule {
            shape,
            pieces: pieces.clamp(1, MAX_PIECES),
        }
    }

    /// Rows (absolute) of piece `piece` of `owner`'s chunk; the same cut on every rank.
    pub fn piece_rows(&self, owner: usize, piece: usize) -> Range<usize> {
        let chunk = self.shape.chunk(owner);
        let within = chunk_range(chunk.len(), self.pieces, piece);
        chunk.start + within.start..chunk.start + within.end
    }

    /// The pieces rank `rank` hands to its peers (its own chunk's, in order; empty ones left
    /// out on every rank alike).
    pub fn sent_by(&self, rank: usize) -> Vec<AgPiece> {
        (0..self.pieces)
            .map(|piece| AgPiece {
                owner: rank,
                piece,
                rows: self.piece_rows(rank, piece),
                local: false,
            })
            .filter(|g| !g.rows.is_empty())
            .collect()
    }

    /// Rank `rank`'s GEMMs in order: its own chunk, then r + 1, r + 2, ….
    pub fn gemms_of(&self, rank: usize) -> Vec<AgPiece> {
        let p = self.shape.world;
        (0..p)
            .map(|d| (rank + d) % p)
            .flat_map(|owner| (0..self.pieces).map(move |piece| (owner, piece)))
            .map(|(owner, piece)| AgPiece {
                owner,
                piece,
                rows: self.piece_rows(owner, piece),
                local: owner == rank,
            })
            .filter(|g| !g.rows.is_empty())
            .collect()
    }

    /// The flag (on the receiving rank) that piece `piece` of `owner`'s chunk has arrived.
    pub fn flag_index(&self, owner: usize, piece: usize) -> usize {
        owner * MAX_PIECES + piece
    }

    /// The flag `sender` raises on a rank when it has finished a call.
    pub fn done_index(&self, sender: usize) -> usize {
        self.shape.world * MAX_PIECES + sender
    }

    /// Flag words a rank needs.
    pub fn flag_words(&self) -> usize {
        self.shape.world * (MAX_PIECES + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(world: usize, m: usize, pieces: usize) -> AgGemmSchedule {
        let shape =
            AgGemmShape::new(world, m, 24, 16, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        AgGemmSchedule::new(shape, pieces)
    }

    #[test]
    fn every_rank_computes_every_row_once_its_own_first() {
        for world in 1..=9 {
            for m in [1, world, 3 * world + 1, 64] {
                for pieces in [1, 2, 3, 5] {
                    let s = schedule(world, m, pieces);
                    for rank in 0..world {
                        let gemms = s.gemms_of(rank);
                        let mut rows: Vec<usize> =
                            gemms.iter().flat_map(|g| g.rows.clone()).collect();
                        rows.sort();
                        assert_eq!(rows, (0..m).collect::<Vec<_>>(), "P={world} M={m}");
                        // its own chunk first, and only its own is local
                        let own = gemms.iter().take_while(|g| g.owner == rank).count();
                        assert_eq!(own, gemms.iter().filter(|g| g.local).count());
                        assert!(gemms.iter().all(|g| g.local == (g.owner == rank)));
                        // every remote piece it waits for is one its owner sends
                        for g in gemms.iter().filter(|g| !g.local) {
                            assert!(s.sent_by(g.owner).iter().any(|x| x.rows == g.rows));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn flags_do_not_overlap() {
        let s = schedule(4, 50, 3);
        let mut all: Vec<usize> = (0..4)
            .flat_map(|o| (0..MAX_PIECES).map(move |j| (o, j)))
            .map(|(o, j)| s.flag_index(o, j))
            .chain((0..4).map(|q| s.done_index(q)))
            .collect();
        let count = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), count);
        assert!(all.iter().all(|&f| f < s.flag_words()));
    }
}
