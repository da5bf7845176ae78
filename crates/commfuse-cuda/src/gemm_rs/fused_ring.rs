//! The tables of GEMM + reduce-scatter as a ring inside one GEMM per rank
//! ([`commfuse_core::fused::fused_ring`]) for our GEMM: the tile order and one [`TileRoute`]
//! per tile, on the fused path's tile grid ([`GemmRsSchedule`]'s bands, which start at every
//! owner's chunk as the ring's tiles do).
//!
//! A tile of step s ≥ 1 folds one partial, the running sum its sender handed on after step
//! s − 1 (this rank's receive buffer of that step, read once its flag holds the call's
//! number); a tile of steps 0 .. P − 2 goes to its receiver's receive buffer of its step and
//! raises its flag there; the last step's tiles (the rank's own rows) go to the caller's
//! output with the bias. So every tile folds at most one partial wherever it lies in the call,
//! where the fold path's own tiles each fold P − 1 at the end of it.

use super::GemmRsPeer;
use crate::gemm::{FoldSource, TileRoute, FLAG_SET_EPOCH, ROUTE_DST_FROM_D, ROUTE_NO_BIAS};
use commfuse_core::fused::fused_ring::FusedRing;
use commfuse_core::fused::gemm_rs::GemmRsSchedule;
use commfuse_core::fused::ring_rs::RingTarget;

/// The tile of `grid` that covers the ring tile starting at (`row`, `col`): the ring's bands
/// are the grid's ([`GemmRsSchedule::bands`] starts one at every chunk).
fn grid_tile(grid: &GemmRsSchedule, row: usize, col: usize) -> usize {
    let band = grid.bands.partition_point(|&start| start <= row) - 1;
    band * grid.tiles_n + col / grid.tile.n
}

/// Rank `me`'s tile order in `grid`'s tile numbers: step by step, as
/// [`FusedRing::tiles_of`] takes them, each step's owner's tiles in the grid's grouped order
/// ([`GemmRsSchedule::owner_tiles`], the same on every rank, so that each hop's running sums
/// come in the order its receiver adds them). For the flat ring it is the fused path's order.
pub(crate) fn ring_order(grid: &GemmRsSchedule, ring: &FusedRing, me: usize) -> Vec<usize> {
    (0..ring.ring.shape.world)
        .flat_map(|step| {
            grid.owner_tiles[ring.ring.owner_at(me, step)]
                .iter()
                .copied()
        })
        .collect()
}

/// Rank `me`'s route of every tile of `grid` (in its tile numbers) in calls of set `set`:
/// `peers[q]` holds rank q's receive buffers ([`FusedRing`]'s layout,
/// [`commfuse_core::fused::ring_rs::RingSchedule::receive_offset`]) and flag words
/// ([`FusedRing::flag_index`]).
pub(crate) fn ring_tile_routes(
    grid: &GemmRsSchedule,
    ring: &FusedRing,
    me: usize,
    set: usize,
    peers: &[GemmRsPeer],
) -> Vec<TileRoute> {
    let s = &ring.ring;
    let n = s.shape.n;
    let eb = s.shape.output.size() as u64;
    let mut routes = vec![TileRoute::default(); grid.tile_count()];
    for tile in ring.tiles_of(me) {
        // elements from a buffer's first to the tile's element (0, 0)
        let within = (tile.within.start * n + tile.cols.start) as u64;
        let receive = |rank: usize, step: usize| {
            peers[rank].receive + (s.receive_offset(set, step) as u64 + within) * eb
        };
        let flag = |rank: usize, step: usize| {
            peers[rank].flags + 8 * ring.flag_index(set, step, tile.index) as u64
        };
        let mut route = match tile.target {
            RingTarget::Send { step } => {
                let to = s.receiver(me, step);
                TileRoute {
                    dst: receive(to, step),
                    flag: flag(to, step),
                    flag_op: FLAG_SET_EPOCH,
                    options: ROUTE_NO_BIAS,
                    ..TileRoute::default()
                }
            }
            RingTarget::Output => TileRoute {
                dst: within * eb,
                options: ROUTE_DST_FROM_D,
                ..TileRoute::default()
            },
        };
        route.ld = n as u32;
        if let Some(prev) = tile.add {
            route.fold_src = receive(me, prev);
            route.fold_flag = flag(me, prev);
            route.fold_count = 1;
            route.fold_ld = n as u32;
            // one partial: the strides are never stepped, but the staging needs whole rows
            route.fold_stride = s.buffer_len() as u64 * eb;
        }
        routes[grid_tile(grid, tile.rows.start, tile.cols.start)] = route;
    }
    routes
}

/// A rank's receive buffers at `receive` as its ring GEMM's [`FoldSource`]: both sets' P − 1
/// buffers as one matrix of N columns, in which every running sum either set's routes fold in
/// lies.
pub(crate) fn ring_fold_source(receive: u64, ring: &FusedRing) -> FoldSource {
    let s = &ring.ring;
    FoldSource {
        base: receive,
        rows: s.receive_len() / s.shape.n,
        ld: s.shape.n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::{stage_folds, GemmVariant, ROUTE_FOLD_TMA, TILE};
    use crate::gemm_rs::tests::peers;
    use commfuse_core::fused::gemm_rs::GemmRsShape;
    use commfuse_core::fused::ring_rs::RingSchedule;
    use commfuse_core::gemm::{BLayout, GemmPlan};
    use commfuse_core::DType;
    use std::collections::{HashMap, HashSet};

    /// P = 1..9 and 16 (flat, and in every count of NUMA groups that divides P), at a ragged M, M = P + 1,
    /// M = 1 and the largest, in buffers made for M = 300; N = 304 (a ragged last column
    /// tile).
    fn rings() -> impl Iterator<Item = (String, GemmRsSchedule, FusedRing)> {
        (1..=9).chain([16]).flat_map(|world| {
            let groups = (1..=world).filter(move |g| world % g == 0);
            groups.flat_map(move |groups| {
                [1, world + 1, 300, 133].into_iter().map(move |m| {
                    let shape =
                        GemmRsShape::new(world, m, 304, 64, BLayout::NK, DType::BF16, DType::BF16)
                            .unwrap();
                    let grid = GemmRsSchedule::within(shape, 300, TILE);
                    let ring = RingSchedule::within(shape, 300, 1)
                        .in_groups(groups)
                        .unwrap();
                    let name = format!("P={world} G={groups} M={m}");
                    (name, grid, FusedRing::new(ring, TILE))
                })
            })
        })
    }

    fn plan(grid: &GemmRsSchedule, ring: &FusedRing, me: usize) -> GemmPlan {
        GemmPlan {
            order: ring_order(grid, ring, me),
            destinations: None,
            flags: None,
            ..grid.gemm_plan(me, 1)
        }
    }

    /// Every rank's tables, run on the host, leave every output element the sum of all P
    /// ranks' partials of that element, each added once: each tile adds the running sum its
    /// route folds (behind the flag its sender's route raised with that sum) and writes it where the route
    /// says; every byte of a receive buffer is written at most once a set and every flag word
    /// raised at most once, and the two sets share neither. The order is a permutation of the grid's tiles and every fold is
    /// staged through the pipeline's stages.
    #[test]
    fn the_ring_tables_sum_every_element_once() {
        for (name, grid, ring) in rings() {
            let (p, n) = (ring.ring.shape.world, ring.ring.shape.n);
            let peers = peers(p);
            // per set: the receive buffers' bytes and the flag words written
            let mut by_set: Vec<(Vec<u64>, Vec<u64>)> = Vec::new();
            for set in 0..2 {
                // an element's running sum: how often each rank's partial is in it (four bits
                // a rank), and the element it belongs to
                type Sum = (u64, usize, usize);
                let mut memory: HashMap<u64, Sum> = HashMap::new();
                // flag word -> (sender, step, tile index) of the tile that raised it
                let mut flags: HashMap<u64, (usize, usize, usize)> = HashMap::new();
                let mut outputs: HashMap<(usize, usize), u64> = HashMap::new();
                let routes: Vec<Vec<TileRoute>> = (0..p)
                    .map(|me| {
                        let mut routes = ring_tile_routes(&grid, &ring, me, set, &peers);
                        let source = ring_fold_source(peers[me].receive, &ring);
                        let plan = plan(&grid, &ring, me);
                        assert!(plan.validate(p).is_ok(), "{name}");
                        // steps in order
                        let step_of: HashMap<usize, usize> = ring
                            .tiles_of(me)
                            .iter()
                            .map(|t| (grid_tile(&grid, t.rows.start, t.cols.start), t.step))
                            .collect();
                        let steps: Vec<usize> = plan.order.iter().map(|t| step_of[t]).collect();
                        assert!(steps.is_sorted(), "{name}: rank {me}'s steps out of order");
                        let staged = stage_folds(&mut routes, &plan, GemmVariant::Direct, &source);
                        let folds = routes.iter().filter(|r| r.fold_count != 0).count();
                        assert_eq!(staged, folds, "{name}: every fold staged");
                        routes
                    })
                    .collect();
                // step by step over the ranks: a step's running sums all exist before the
                // next step's tiles read them (a rank takes its steps in order)
                for step in 0..p {
                    for (me, routes) in routes.iter().enumerate() {
                        let tiles = ring.tiles_of(me);
                        for tile in tiles.iter().filter(|t| t.step == step) {
                            let t = grid_tile(&grid, tile.rows.start, tile.cols.start);
                            let r = &routes[t];
                            let (rows, cols) = grid.tile_bounds(t);
                            assert_eq!((&rows, &cols), (&tile.rows, &tile.cols), "{name}");
                            if r.fold_count != 0 {
                                assert_eq!(r.options & ROUTE_FOLD_TMA, ROUTE_FOLD_TMA, "{name}");
                                assert_eq!(r.fold_count, 1, "{name}");
                                // the flag its sender raised with this very running sum
                                let from = ring.ring.sender(me, tile.step);
                                assert_eq!(
                                    flags.get(&r.fold_flag),
                                    Some(&(from, tile.step - 1, tile.index)),
                                    "{name}: rank {me} step {} waits on another flag",
                                    tile.step
                                );
                            }
                            for (i, row) in rows.clone().enumerate() {
                                for (j, col) in cols.clone().enumerate() {
                                    let mut v: u64 = 1 << (4 * me);
                                    if r.fold_count != 0 {
                                        let at = r.fold_src
                                            + (i as u64 * r.fold_ld as u64 + j as u64) * 2;
                                        let &(sum, r0, c0) = memory.get(&at).unwrap_or_else(|| {
                                            panic!("{name}: rank {me} folds {at:#x}, never written")
                                        });
                                        assert_eq!((r0, c0), (row, col), "{name}: another element");
                                        v += sum;
                                    }
                                    let at = r.dst + (i as u64 * r.ld as u64 + j as u64) * 2;
                                    if r.options & ROUTE_DST_FROM_D != 0 {
                                        let chunk = ring.ring.shape.chunk(me);
                                        assert!(
                                            chunk.contains(&row),
                                            "{name}: rank {me}, row {row}"
                                        );
                                        assert_eq!(
                                            at,
                                            (((row - chunk.start) * n + col) * 2) as u64
                                        );
                                        assert!(outputs.insert((row, col), v).is_none());
                                    } else {
                                        let inside = (0..p).any(|q| {
                                            let b = peers[q].receive;
                                            at >= b && at < b + (ring.ring.receive_len() * 2) as u64
                                        });
                                        assert!(
                                            inside,
                                            "{name}: a store outside the receive buffers"
                                        );
                                        let before = memory.insert(at, (v, row, col));
                                        assert!(before.is_none(), "{name}: {at:#x} twice");
                                    }
                                }
                            }
                            if r.flag != 0 {
                                assert_eq!(r.flag_op, FLAG_SET_EPOCH);
                                let raised = (me, tile.step, tile.index);
                                let before = flags.insert(r.flag, raised);
                                assert!(before.is_none(), "{name}: a flag twice");
                            }
                        }
                    }
                }
                let every: u64 = (0..p).map(|q| 1u64 << (4 * q)).sum();
                assert_eq!(
                    outputs.len(),
                    ring.ring.shape.m * n,
                    "{name}: elements output"
                );
                assert!(
                    outputs.values().all(|&v| v == every),
                    "{name}: a rank's partial missed or added twice"
                );
                by_set.push((memory.into_keys().collect(), flags.into_keys().collect()));
            }
            // alternate calls touch no byte and no flag of each other's
            let (bytes, words): (HashSet<u64>, HashSet<u64>) = (
                by_set[0].0.iter().copied().collect(),
                by_set[0].1.iter().copied().collect(),
            );
            assert!(
                by_set[1].0.iter().all(|b| !bytes.contains(b)),
                "{name}: a byte in both sets"
            );
            assert!(
                by_set[1].1.iter().all(|w| !words.contains(w)),
                "{name}: a flag in both sets"
            );
        }
    }
}
