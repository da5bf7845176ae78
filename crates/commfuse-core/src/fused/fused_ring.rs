//! GEMM + reduce-scatter as a ring inside one GEMM per rank: the overlapped ring of
//! [`super::ring_rs`] with the library GEMMs, send buffers and copies replaced by one GEMM of our
//! own whose epilogue hands each tile's running sum on.
//!
//! Rank r's GEMM takes its tiles step by step. At step s the tiles are those of owner
//! o = `owner_at(r, s)`'s chunk (row bands of the chunk, each band's column tiles in order, the
//! same order on every rank). A tile of step s ≥ 1 waits until the running sum of the same tile
//! has come from `sender(r, s)` (its flag in this rank's receive buffer of step s − 1 holds the
//! call's number), reads that sum as the GEMM's C term (beta = 1) and adds its own partial. Its
//! epilogue stores the result straight into the receiver's receive buffer of step s and raises
//! the tile's flag there (steps 0 .. P − 2), or, at the last step (o = r), adds the bias and
//! writes the caller's output. So a tile waits only for its own running sum, and each hop's
//! transfer leaves the SM in the epilogue while the next tiles' main loops run: no copy engine,
//! no send buffer, one flag per tile and hop.
//!
//! Everything else is the ring's: owners by step (flat or 2D over NUMA groups), two sets of
//! receive buffers and flags used by alternate calls (the argument of [`super::ring_rs`] holds
//! tile by tile), the "done" handshake for calls of M < P, and the rounding (the running sum is
//! rounded to the output type after each of the P − 1 hops, as on the overlapped path, so
//! [`super::gemm_rs::element_bound_on`] of that path bounds it). Flags are numbered by
//! (set, step, tile index within the owner's chunk), laid out for the largest chunk the buffers
//! were made for, so every M finds its flags in place.

use super::ring_rs::{RingSchedule, RingTarget, DONE_FLAGS};
use crate::gemm::TileShape;
use std::ops::Range;

/// One tile of a rank's fused ring GEMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingTile {
    pub step: usize,
    /// The owner of its rows
    pub owner: usize,
    /// Its index among the owner's tiles (the same on every rank; flags are numbered by it)
    pub index: usize,
    /// Rows of A and of the product
    pub rows: Range<usize>,
    /// The same rows relative to the owner's chunk (where they sit in receive buffers and in
    /// the owner's output)
    pub within: Range<usize>,
    pub cols: Range<usize>,
    /// The step whose running sum it adds: this rank's receive buffer of that step, after
    /// the flag `flag_index(set, step, index)` holds the call's number
    pub add: Option<usize>,
    /// `Send { step }`: the receiver's receive buffer of `step`, then its flag there; `Output`:
    /// the caller's output, with the bias
    pub target: RingTarget,
}

/// The fused ring of one shape: a [`RingSchedule`] (whose pieces it does not use) cut in tiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedRing {
    pub ring: RingSchedule,
    pub tile: TileShape,
}

impl FusedRing {
    /// The ring `ring` computed in tiles of `tile` (both extents at least 1).
    pub fn new(ring: RingSchedule, tile: TileShape) -> FusedRing {
        let tile = TileShape {
            m: tile.m.max(1),
            n: tile.n.max(1),
        };
        FusedRing { ring, tile }
    }

    fn tiles_n(&self) -> usize {
        self.ring.shape.n.div_ceil(self.tile.n)
    }

    /// Tiles of the longest chunk of the largest M the buffers were made for: the stride of
    /// the flags of one step.
    pub fn tiles_per_owner_max(&self) -> usize {
        self.ring.chunk_rows.div_ceil(self.tile.m) * self.tiles_n()
    }

    /// Rank `rank`'s tiles in the order its GEMM takes them.
    pub fn tiles_of(&self, rank: usize) -> Vec<RingTile> {
        let s = &self.ring;
        let (p, n) = (s.shape.world, s.shape.n);
        let (tm, tn) = (self.tile.m, self.tile.n);
        let mut out = Vec::new();
        for step in 0..p {
            let owner = s.owner_at(rank, step);
            let chunk = s.shape.chunk(owner);
            let target = if step + 1 == p {
                RingTarget::Output
            } else {
                RingTarget::Send { step }
            };
            for (band, row0) in (0..chunk.len()).step_by(tm).enumerate() {
                let within = row0..(row0 + tm).min(chunk.len());
                for j in 0..self.tiles_n() {
                    out.push(RingTile {
                        step,
                        owner,
                        index: band * self.tiles_n() + j,
                        rows: chunk.start + within.start..chunk.start + within.end,
                        within: within.clone(),
                        cols: j * tn..((j + 1) * tn).min(n),
                        add: step.checked_sub(1),
                        target,
                    });
                }
            }
        }
        out
    }

    /// Flags of one set: one per tile of each of the P − 1 hand-ons.
    pub fn flags_per_set(&self) -> usize {
        (self.ring.shape.world - 1) * self.tiles_per_owner_max()
    }

    /// The arrival flag of tile `index` handed on after step `step`, in set `set` (after the
    /// ring's two done flags).
    pub fn flag_index(&self, set: usize, step: usize, index: usize) -> usize {
        DONE_FLAGS + set * self.flags_per_set() + step * self.tiles_per_owner_max() + index
    }

    /// Flag words a rank needs: the two done flags, then both sets' arrival flags.
    pub fn flag_words(&self) -> usize {
        DONE_FLAGS + 2 * self.flags_per_set()
    }

    /// The fused ring as a plan for the checker, as [`RingSchedule::plan`] does for the ring: a
    /// reduce-scatter of the ranks' partial products (rank r's input is its [M, N] partial).
    /// A tile, row by row, is a reduction of the rank's partial and the received running sum
    /// (after its flag) straight into the receiver's receive buffer, whose flag follows, or into
    /// the output. One plan holds two calls (set 0, then set 1), and the checker runs it twice:
    /// four calls. M must be a multiple of P (the checker's reduce-scatter splits M·N evenly).
    pub fn plan(&self) -> Result<crate::plan::Plan, crate::error::Error> {
        self.plan_in_sets(2)
    }

    fn plan_in_sets(&self, sets: usize) -> Result<crate::plan::Plan, crate::error::Error> {
        use crate::op::{OpKind, OpSpec};
        use crate::plan::{BufferKind, PlanBuilder, Region, Slot};
        let s = &self.ring;
        let (p, n) = (s.shape.world, s.shape.n);
        if !s.shape.m.is_multiple_of(p) {
            return Err(crate::error::Error::Unsupported(format!(
                "the checker sees GEMM + reduce-scatter as a reduce-scatter of M·N elements split evenly: M = {} must be a multiple of P = {p}",
                s.shape.m
            )));
        }
        let spec = OpSpec::new(OpKind::ReduceScatter, p, s.shape.m * n, 0)?;
        let mut b = PlanBuilder::new(spec);
        // per set: a row of arrival flags (step × tile)
        let arrival = b.rows(2);
        let receive = b.scratch(s.receive_len());
        let per_step = self.tiles_per_owner_max();
        for set in 0..sets {
            let flag = |step: usize, index: usize| {
                Slot::new(arrival + set as u32, (step * per_step + index) as u32)
            };
            for rank in 0..p {
                for t in self.tiles_of(rank) {
                    if let Some(prev) = t.add {
                        b.wait(rank, flag(prev, t.index), 1);
                    }
                    let to = match t.target {
                        RingTarget::Output => None,
                        RingTarget::Send { step } => Some((step, s.receiver(rank, step))),
                    };
                    for (row, within) in t.rows.clone().zip(t.within.clone()) {
                        let cols = |base: usize| base + t.cols.start..base + t.cols.end;
                        let mut srcs = vec![Region::new(rank, BufferKind::Input, cols(row * n))];
                        if let Some(prev) = t.add {
                            let at = receive + s.receive_offset(set, prev) + within * n;
                            srcs.push(Region::new(rank, BufferKind::Scratch, cols(at)));
                        }
                        let dst = match to {
                            None => Region::new(rank, BufferKind::Output, cols(within * n)),
                            Some((step, receiver)) => {
                                let at = receive + s.receive_offset(set, step) + within * n;
                                Region::new(receiver, BufferKind::Scratch, cols(at))
                            }
                        };
                        b.reduce(rank, srcs, dst);
                    }
                    if let Some((step, receiver)) = to {
                        b.signal(rank, receiver, flag(step, t.index));
                    }
                }
            }
        }
        Ok(b.finish("gemm-rs-fused-ring"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::gemm_rs::GemmRsShape;
    use crate::fused::ring_rs::tests::worlds_and_groups;
    use crate::gemm::BLayout;
    use crate::DType;

    fn fused_ring(world: usize, groups: usize, m: usize, tile: TileShape) -> FusedRing {
        let shape =
            GemmRsShape::new(world, m, 24, 16, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        let ring = RingSchedule::within(shape, m, 1).in_groups(groups).unwrap();
        FusedRing::new(ring, tile)
    }

    const SMALL: TileShape = TileShape { m: 4, n: 16 };

    #[test]
    fn every_element_goes_once_around_the_ring_and_ends_at_its_owner() {
        for (world, groups) in worlds_and_groups() {
            for m in [1, world, 3 * world + 1, 37] {
                let f = fused_ring(world, groups, m, SMALL);
                let n = f.ring.shape.n;
                // per output element: the ranks that added a partial, in order, and its end
                let mut visits: Vec<Vec<(usize, usize)>> = vec![Vec::new(); m * n];
                for rank in 0..world {
                    let tiles = f.tiles_of(rank);
                    // indices are distinct within a step and below the flags' stride
                    let mut indices: Vec<(usize, usize)> =
                        tiles.iter().map(|t| (t.step, t.index)).collect();
                    indices.sort();
                    indices.dedup();
                    assert_eq!(indices.len(), tiles.len());
                    for t in &tiles {
                        assert!(t.index < f.tiles_per_owner_max());
                        assert_eq!(t.owner, f.ring.owner_at(rank, t.step));
                        // the last step writes the output, with the bias; the others hand on
                        assert_eq!(t.target == RingTarget::Output, t.step + 1 == world);
                        assert_eq!(t.add, t.step.checked_sub(1));
                        for row in t.rows.clone() {
                            for col in t.cols.clone() {
                                visits[row * n + col].push((t.step, rank));
                            }
                        }
                    }
                }
                for (e, v) in visits.iter_mut().enumerate() {
                    v.sort();
                    let owner = (0..world)
                        .find(|&o| f.ring.shape.chunk(o).contains(&(e / n)))
                        .unwrap();
                    let steps: Vec<usize> = v.iter().map(|&(s, _)| s).collect();
                    assert_eq!(
                        steps,
                        (0..world).collect::<Vec<_>>(),
                        "P={world} M={m} e={e}"
                    );
                    let mut ranks: Vec<usize> = v.iter().map(|&(_, r)| r).collect();
                    assert_eq!(ranks.last(), Some(&owner));
                    // each hop goes from the step's rank to the next step's (the receiver)
                    for w in v.windows(2) {
                        assert_eq!(f.ring.receiver(w[0].1, w[0].0), w[1].1);
                    }
                    ranks.sort();
                    assert_eq!(ranks, (0..world).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn a_tiles_flag_is_raised_by_its_sender_and_awaited_by_its_receiver_only() {
        for (world, groups) in worlds_and_groups() {
            let f = fused_ring(world, groups, 5 * world + 3, SMALL);
            // (set 0) each flag word of a rank, (rank, index): who raises it, and whom its
            // rank expects it from, once each
            let mut raised = std::collections::HashMap::new();
            let mut awaited = std::collections::HashMap::new();
            for rank in 0..world {
                for t in f.tiles_of(rank) {
                    if let RingTarget::Send { step } = t.target {
                        let at = (f.ring.receiver(rank, step), f.flag_index(0, step, t.index));
                        assert!(raised.insert(at, rank).is_none(), "raised twice");
                    }
                    if let Some(prev) = t.add {
                        let at = (rank, f.flag_index(0, prev, t.index));
                        let from = f.ring.sender(rank, t.step);
                        assert!(awaited.insert(at, from).is_none(), "awaited twice");
                    }
                }
            }
            assert_eq!(raised, awaited, "P={world} G={groups}");
            for (_, at) in raised.keys() {
                assert!(
                    *at >= DONE_FLAGS && *at < f.flag_index(1, 0, 0),
                    "set 0's flags"
                );
            }
        }
    }

    #[test]
    fn the_checker_accepts_the_fused_ring_and_rejects_it_broken() {
        for (world, groups) in worlds_and_groups() {
            for m in [world, world * 5] {
                for tile in [SMALL, TileShape { m: 2, n: 8 }] {
                    let f = fused_ring(world, groups, m, tile);
                    if let Err(e) = crate::check(f.plan().unwrap()) {
                        panic!("P={world} G={groups} M={m} {tile:?}: {e}");
                    }
                }
            }
        }
        let f = fused_ring(3, 1, 12, SMALL);
        // a sender that never raises one tile's flag: its receiver waits forever
        let mut plan = f.plan().unwrap();
        let at = plan.steps[1]
            .iter()
            .position(|st| matches!(st, crate::plan::Step::Notify { .. }))
            .unwrap();
        plan.steps[1].remove(at);
        assert!(crate::check(plan).is_err());
        // a rank that adds running sums before their flags: a read before the write
        let mut plan = f.plan().unwrap();
        plan.steps[0].retain(|st| !matches!(st, crate::plan::Step::Wait { .. }));
        assert!(crate::check(plan).is_err());
        // one set for every call: a fast sender overwrites a sum its receiver has yet to add
        assert!(crate::check(f.plan_in_sets(1).unwrap()).is_err());
        assert!(fused_ring(3, 1, 13, SMALL).plan().is_err());
    }
}
