//! GEMM + reduce-scatter, the row-parallel linear layer of tensor parallelism (the semantics of
//! Flux's GemmRS and PyTorch's `fused_matmul_reduce_scatter`): rank r holds A_r [M, K] and B_r
//! ([K, N] or [N, K]); rank o's output is chunk o of the rows of Σ_r A_r·B_r (+ bias, added
//! once), chunks split as the collectives split M (the first M mod P chunks one row longer).
//!
//! The schedule, for every rank:
//! * Tiles are 128 × 256 (the GPU kernel's), in row bands that start at every chunk boundary,
//!   so no tile straddles two owners.
//! * Rank r computes its tiles owner by owner, starting with rank r+1's and ending with its own
//!   (staggered: at any time the P ranks store into P different peers), each owner's tiles in
//!   the same grouped order on every sender, which is the order the owner reduces them in.
//! * A tile of owner o's chunk goes into o's receive buffer, slot r (rows relative to the
//!   chunk, ld = N), and then raises flag (r, index of the tile among o's) on o by 1.
//! * The owner waits, tile by tile, for all P flags and sums the P partials in f32 in rank
//!   order (so the result does not depend on arrival order), adds the bias, and writes its
//!   output.
//!
//! Receive buffers and flags come in two sets used by alternate calls: a rank starts storing
//! into a peer's set of call c + 2 only after its own call c + 1 has finished, which needs the
//! peer's partials of call c + 1, which the peer makes only after its call c has finished
//! reading that set. So back-to-back calls need no other synchronisation.
//!
//! Cost card (per rank, per call, E = element size of the output type): (P−1)/P·M·N·E bytes
//! stored to peers and as many received; P·M/P·N·E bytes of partials read by the reduction;
//! one flag per tile per sender.

use crate::dtype::DType;
use crate::error::Error;
use crate::gemm::{
    grouped_order_of_grid, BLayout, Destination, Epilogue, GemmPlan, GemmProblem, TileFlag,
    TileShape,
};
use crate::op::chunk_range;
use crate::plan::{NotifyOp, Slot};
use std::ops::Range;

/// Tile rows the schedule groups together when walking an owner's tiles (L2 reuse of B).
pub const ORDER_GROUP: usize = 8;

/// What one GEMM + reduce-scatter call computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GemmRsShape {
    pub world: usize,
    /// Rows of every rank's A (and of the full product)
    pub m: usize,
    pub n: usize,
    /// K of every rank's A and B (the reduction dimension of one rank's shard)
    pub k: usize,
    pub b_layout: BLayout,
    /// bf16 or f16
    pub input: DType,
    /// The partials' and the output's type: the input type or f32
    pub output: DType,
}

impl GemmRsShape {
    pub fn new(
        world: usize,
        m: usize,
        n: usize,
        k: usize,
        b_layout: BLayout,
        input: DType,
        output: DType,
    ) -> Result<GemmRsShape, Error> {
        if world == 0 {
            return Err(Error::Unsupported(
                "GEMM + reduce-scatter needs at least one rank".into(),
            ));
        }
        if output != DType::F32 && output != input {
            return Err(Error::Unsupported(format!(
                "the output is {input} (the input type) or f32, got {output}"
            )));
        }
        GemmProblem::new(m, n, k, b_layout, input, output)?;
        Ok(GemmRsShape {
            world,
            m,
            n,
            k,
            b_layout,
            input,
            output,
        })
    }

    /// Every rank's GEMM: the full [M, N] partial product.
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

    /// Rows of the product owned by rank `owner`.
    pub fn chunk(&self, owner: usize) -> Range<usize> {
        chunk_range(self.m, self.world, owner)
    }

    /// Rows of the longest chunk (the first one).
    pub fn chunk_rows_max(&self) -> usize {
        self.m.div_ceil(self.world)
    }
}

/// The tile grid, orders, destinations and flags of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmRsSchedule {
    pub shape: GemmRsShape,
    pub tile: TileShape,
    /// Band starts, then M: every chunk starts a band, bands hold at most `tile.m` rows.
    pub bands: Vec<usize>,
    /// Column tiles per band.
    pub tiles_n: usize,
    /// Per owner: its tiles in the order every sender computes them and the owner reduces them.
    pub owner_tiles: Vec<Vec<usize>>,
    /// Per tile: its owner and its index in the owner's list (the flag's column).
    pub placement: Vec<(usize, usize)>,
    /// Elements of one receive slot (one sender's partial of the longest chunk of the largest
    /// M the buffers were made for).
    pub slot_len: usize,
    /// Flag columns per sender (the most tiles an owner has at that largest M).
    pub flag_stride: usize,
}

impl GemmRsSchedule {
    /// The schedule of `shape` laid out in buffers made for `shape` itself.
    pub fn new(shape: GemmRsShape, tile: TileShape) -> GemmRsSchedule {
        GemmRsSchedule::within(shape, shape.m, tile)
    }

    /// The schedule of `shape` laid out in receive buffers and flag rows made for `max_m` rows
    /// (`max_m` ≥ M): calls of any M up to it share one set of buffers and flag slots.
    pub fn within(shape: GemmRsShape, max_m: usize, tile: TileShape) -> GemmRsSchedule {
        let largest = GemmRsShape {
            m: max_m.max(shape.m),
            ..shape
        };
        let mut sched = GemmRsSchedule::grid(shape, tile);
        let layout = GemmRsSchedule::grid(largest, tile);
        sched.slot_len = largest.chunk_rows_max() * shape.n;
        sched.flag_stride = layout.tiles_per_owner_max();
        sched
    }

    fn grid(shape: GemmRsShape, tile: TileShape) -> GemmRsSchedule {
        let mut bands = Vec::new();
        let mut band_owner = Vec::new();
        for owner in 0..shape.world {
            let rows = shape.chunk(owner);
            let mut start = rows.start;
            while start < rows.end {
                bands.push(start);
                band_owner.push(owner);
                start = (start + tile.m).min(rows.end);
            }
        }
        bands.push(shape.m);
        let tiles_n = shape.n.div_ceil(tile.n);
        let mut owner_tiles = vec![Vec::new(); shape.world];
        let mut placement = vec![(0, 0); band_owner.len() * tiles_n];
        for (owner, tiles) in owner_tiles.iter_mut().enumerate() {
            let first = band_owner.iter().position(|&o| o == owner);
            let count = band_owner.iter().filter(|&&o| o == owner).count();
            if let Some(first) = first {
                for local in grouped_order_of_grid(count, tiles_n, ORDER_GROUP) {
                    let t = first * tiles_n + local;
                    placement[t] = (owner, tiles.len());
                    tiles.push(t);
                }
            }
        }
        GemmRsSchedule {
            slot_len: shape.chunk_rows_max() * shape.n,
            flag_stride: 0,
            shape,
            tile,
            bands,
            tiles_n,
            owner_tiles,
            placement,
        }
    }

    pub fn tile_count(&self) -> usize {
        self.placement.len()
    }

    /// Rows and columns of tile `t` in the product.
    pub fn tile_bounds(&self, t: usize) -> (Range<usize>, Range<usize>) {
        let (band, col) = (t / self.tiles_n, t % self.tiles_n);
        let cols = col * self.tile.n..((col + 1) * self.tile.n).min(self.shape.n);
        (self.bands[band]..self.bands[band + 1], cols)
    }

    /// The most tiles any owner has.
    pub fn tiles_per_owner_max(&self) -> usize {
        self.owner_tiles.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Flag slots of one set on every rank: one row of `world · flag_stride` columns.
    pub fn flag_columns(&self) -> usize {
        self.shape.world * self.flag_stride
    }

    /// Owner `owner`'s tiles as (rows relative to its chunk, columns), in reduction order.
    pub fn reduce_tiles(&self, owner: usize) -> Vec<(Range<usize>, Range<usize>)> {
        let start = self.shape.chunk(owner).start;
        self.owner_tiles[owner]
            .iter()
            .map(|&t| {
                let (rows, cols) = self.tile_bounds(t);
                (rows.start - start..rows.end - start, cols)
            })
            .collect()
    }

    /// Rank `rank`'s tile order: rank + 1's tiles, rank + 2's, ..., its own last.
    pub fn order(&self, rank: usize) -> Vec<usize> {
        let p = self.shape.world;
        (1..=p)
            .flat_map(|s| self.owner_tiles[(rank + s) % p].iter().copied())
            .collect()
    }

    /// Where rank `sender`'s tile `t` goes: its owner's receive buffer, slot `sender` of set
    /// `set` (0 or 1, alternate calls), rows relative to the owner's chunk, ld = N.
    pub fn destination(&self, sender: usize, t: usize, set: usize) -> Destination {
        let (owner, _) = self.placement[t];
        let (rows, cols) = self.tile_bounds(t);
        let row = rows.start - self.shape.chunk(owner).start;
        Destination {
            rank: owner,
            offset: (set * self.shape.world + sender) * self.slot_len
                + row * self.shape.n
                + cols.start,
            ld: self.shape.n,
        }
    }

    /// The flag rank `sender` raises on the owner of tile `t` in set `set`: row `set`, column
    /// sender · flag_stride + the tile's index among the owner's tiles, Add 1. Columns an
    /// owner has no tile for at this M are raised by the owner itself after its reduction, so
    /// that every slot counts calls whatever M each call had.
    pub fn flag(&self, sender: usize, t: usize, set: usize) -> TileFlag {
        let (_, index) = self.placement[t];
        TileFlag {
            slot: Slot::new(set as u32, (sender * self.flag_stride + index) as u32),
            value: 1,
            op: NotifyOp::Add,
        }
    }

    /// Rank `rank`'s GEMM for set `set`: the whole partial product, every tile routed to its
    /// owner's receive slot with its flag.
    pub fn gemm_plan(&self, rank: usize, set: usize) -> GemmPlan {
        let count = self.tile_count();
        GemmPlan {
            problem: self.shape.problem(),
            tile: self.tile,
            order: self.order(rank),
            destinations: Some((0..count).map(|t| self.destination(rank, t, set)).collect()),
            flags: Some((0..count).map(|t| self.flag(rank, t, set)).collect()),
            epilogue: Epilogue::default(),
            bands: Some(self.bands.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(world: usize, m: usize, n: usize) -> GemmRsShape {
        GemmRsShape::new(world, m, n, 64, BLayout::NK, DType::BF16, DType::BF16).unwrap()
    }

    const TILE: TileShape = TileShape { m: 128, n: 256 };

    #[test]
    fn no_tile_straddles_two_owners_and_every_element_is_covered_once() {
        for world in 1..=9 {
            for m in [1, 7, 128, 129, 1000, 1031, 4096] {
                let s = shape(world, m, 300);
                let sched = GemmRsSchedule::new(s, TILE);
                let mut covered = vec![0u8; m * 300];
                for t in 0..sched.tile_count() {
                    let (owner, _) = sched.placement[t];
                    let (rows, cols) = sched.tile_bounds(t);
                    assert!(rows.len() <= 128 && !rows.is_empty());
                    let chunk = s.chunk(owner);
                    assert!(
                        chunk.start <= rows.start && rows.end <= chunk.end,
                        "P={world} M={m} t={t}"
                    );
                    for i in rows.clone() {
                        for j in cols.clone() {
                            covered[i * 300 + j] += 1;
                        }
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "P={world} M={m}");
                let plan = sched.gemm_plan(world - 1, 1);
                plan.validate(world).unwrap();
            }
        }
    }

    #[test]
    fn every_rank_starts_with_a_different_peer_and_ends_with_its_own_tiles() {
        let s = shape(4, 4 * 512, 1024);
        let sched = GemmRsSchedule::new(s, TILE);
        let firsts: Vec<usize> = (0..4)
            .map(|r| sched.placement[sched.order(r)[0]].0)
            .collect();
        assert_eq!(firsts, vec![1, 2, 3, 0]);
        for r in 0..4 {
            let order = sched.order(r);
            let last = *order.last().unwrap();
            assert_eq!(sched.placement[last].0, r);
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..sched.tile_count()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn destinations_and_flags_of_different_senders_or_sets_never_meet() {
        let s = shape(3, 1000, 700);
        let sched = GemmRsSchedule::new(s, TILE);
        let mut seen_flags = std::collections::HashSet::new();
        let mut written: Vec<Vec<u8>> = vec![vec![0; 2 * 3 * sched.slot_len]; 3];
        for set in 0..2 {
            for sender in 0..3 {
                for t in 0..sched.tile_count() {
                    let d = sched.destination(sender, t, set);
                    let f = sched.flag(sender, t, set);
                    assert!(seen_flags.insert((d.rank, f.slot)), "flag used twice");
                    let (rows, cols) = sched.tile_bounds(t);
                    for i in 0..rows.len() {
                        for j in 0..cols.len() {
                            written[d.rank][d.offset + i * d.ld + j] += 1;
                        }
                    }
                }
            }
        }
        assert!(written.iter().flatten().all(|&w| w <= 1));
    }

    #[test]
    fn a_smaller_m_fits_the_buffers_and_flag_rows_of_the_largest() {
        for world in 1..=9 {
            let max = GemmRsSchedule::new(shape(world, 3000, 600), TILE);
            for m in [1, world, 129, 1000, 2999, 3000] {
                let s = GemmRsSchedule::within(shape(world, m, 600), 3000, TILE);
                assert_eq!((s.slot_len, s.flag_stride), (max.slot_len, max.flag_stride));
                for t in 0..s.tile_count() {
                    for sender in 0..world {
                        let d = s.destination(sender, t, 1);
                        let (rows, cols) = s.tile_bounds(t);
                        let end = d.offset + (rows.len() - 1) * d.ld + cols.len();
                        assert!(end <= 2 * world * s.slot_len, "P={world} M={m}");
                        assert!((s.flag(sender, t, 1).slot.col as usize) < s.flag_columns());
                    }
                }
            }
        }
    }
}
