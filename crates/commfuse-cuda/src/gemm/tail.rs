//! How the GEMM's persistent grid shares out the tiles that do not fill a whole wave.
//!
//! The grid runs work units round-robin: unit `i` on block `i % grid`. The order's first
//! [`TailPlan::full_units`] tiles are whole units, a whole number of waves. The remaining tiles
//! (the *tail*) are laid end to end along K, `tiles × k_blocks` k-blocks in all, and that run
//! is cut into one contiguous range per *worker* (a block of the grid). A worker's range
//! crosses tile boundaries where it must, so it holds *segments*: the end of one tile (a
//! *helper* segment, only ever its first), whole tiles, and the start of another. The segment
//! that holds a tile's first k-block is its *owner*: it waits for the tile's helpers to leave
//! their f32 partials in the workspace, adds them, and runs the tile's epilogue.
//!
//! Two ways to cut, both expressed this way:
//! * [`TailMode::Cut`]: only a last, partial wave, each tile in the same number of equal parts
//!   that all run at once (at most `max_parts`, and only where the parts fit in the grid);
//! * [`TailMode::StreamK`]: the last partial wave and the whole wave before it spread evenly
//!   over every block (the hybrid of data-parallel waves and stream-K of Osama et al., 2023),
//!   so that no SM idles through the last tile; a product of less than one wave is cut.
//!   Measured slower than the cut wherever its region is a large share of the work or K is
//!   long (its blocks read A and B at different places in K, so L2 serves them less; see
//!   GEMM-NOTES.md, "The tail"), which is why the cut is the default.
//!
//! Why it cannot deadlock: a worker's only helper segment is its first, and helpers never
//! wait; an owner that waits for helpers is its worker's last segment. So every wait is for
//! the first segment of another worker, which starts without waiting on anything. The launch
//! is cooperative whenever a tile has helpers, so every worker is resident.

use bytemuck::{Pod, Zeroable};

/// Mirrors `NO_SPLIT` in gemm.cu: a tail unit whose tile has no helpers.
pub const NO_SPLIT: u32 = u32::MAX;

/// One unit of the tail (mirrors `TailUnit` in gemm.cu): k-blocks `[kb0, kb1)` of `tile`.
/// An entry with `kb0 == kb1` is empty: its block has no more of the tail.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct TailUnit {
    pub tile: u32,
    pub kb0: u32,
    pub kb1: u32,
    /// The tile's counter (an index among the tiles that have helpers), or [`NO_SPLIT`]
    pub split: u32,
    /// A helper: the workspace slot its partial goes to. An owner: its first helper's slot
    /// (the others follow in order)
    pub slot: u32,
    /// An owner: how many helpers it waits for and adds; 0 for helpers
    pub helpers: u32,
}

impl TailUnit {
    const EMPTY: TailUnit = TailUnit {
        tile: 0,
        kb0: 0,
        kb1: 0,
        split: NO_SPLIT,
        slot: 0,
        helpers: 0,
    };

    /// No work: the block has run out of the tail.
    pub fn is_empty(&self) -> bool {
        self.kb0 == self.kb1
    }

    /// A helper segment (leaves a partial, runs no epilogue).
    pub fn is_helper(&self) -> bool {
        !self.is_empty() && self.kb0 != 0
    }
}

/// How the tiles beyond the last whole wave are shared out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailMode {
    /// Each tile of a last, partial wave cut into at most `max_parts` equal K parts.
    Cut { max_parts: usize },
    /// The last partial wave and the wave before it over every block of the grid; a product
    /// of less than one wave is cut as `Cut { max_parts }`.
    StreamK { max_parts: usize },
}

/// Which [`TailMode`] the GEMMs prepared from a [`super::GemmKernels`] use
/// ([`super::GemmKernels::set_tail`]); the environment variable [`TAIL_ENV`] sets it when the
/// kernels are loaded. `Cut` is the default: stream-K has not been measured on a GPU yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailChoice {
    /// [`TailMode::Cut`]
    Cut,
    /// [`TailMode::StreamK`] for the builds that cut their tail (not the pair build)
    StreamK,
}

/// `COMMFUSE_GEMM_TAIL=cut|stream-k` (default `cut`): the [`TailChoice`] of kernels loaded in
/// this process.
pub const TAIL_ENV: &str = "COMMFUSE_GEMM_TAIL";

impl TailChoice {
    /// `cut` or `stream-k`; anything else is an error naming the variable.
    pub fn parse(name: &str) -> Result<TailChoice, crate::error::CudaError> {
        match name {
            "cut" => Ok(TailChoice::Cut),
            "stream-k" => Ok(TailChoice::StreamK),
            other => Err(crate::error::CudaError::Unavailable(format!(
                "{TAIL_ENV}={other}: expected cut or stream-k"
            ))),
        }
    }

    /// The name [`TailChoice::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            TailChoice::Cut => "cut",
            TailChoice::StreamK => "stream-k",
        }
    }
}

/// The grid and the tail table of one GEMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailPlan {
    /// Blocks of the grid
    pub grid: usize,
    /// Whole tiles run first (a multiple of `grid`, or every tile)
    pub full_units: usize,
    /// The tail's units, `grid` per row: unit `full_units + j · grid + w` is worker `w`'s
    /// segment `j`
    pub units: Vec<TailUnit>,
    /// Tail tiles with helpers (counters)
    pub splits: usize,
    /// Helper segments (partial tiles of f32 in the workspace)
    pub slots: usize,
    /// Tiles of the tail and the workers they are spread over (0, 0 without a tail)
    pub tail_tiles: usize,
    pub workers: usize,
}

impl TailPlan {
    /// Units of the launch.
    pub fn unit_count(&self) -> usize {
        self.full_units + self.units.len()
    }

    /// Whether some block waits for another (the launch must then be cooperative).
    pub fn waits(&self) -> bool {
        self.splits > 0
    }

    /// A short description for benches: `none`, `cut 3×32` (parts × tiles) or
    /// `stream-k 200/132` (tiles over workers).
    pub fn describe(&self) -> String {
        if self.tail_tiles == 0 {
            "none".into()
        } else if self.workers.is_multiple_of(self.tail_tiles) {
            format!("cut {}×{}", self.workers / self.tail_tiles, self.tail_tiles)
        } else {
            format!("stream-k {}/{}", self.tail_tiles, self.workers)
        }
    }
}

/// How the last, partial wave is cut: `(parts, split tiles)`. With `tiles = q · grid + rem`,
/// the last `rem` tiles of the order are cut along K into as many parts as keep the wave
/// within the grid (at most `max_parts`, at most one k-block each); `(1, 0)` when the tiles
/// fill whole waves or no cut fits.
pub fn tail_split(tiles: usize, grid: usize, k_blocks: usize, max_parts: usize) -> (usize, usize) {
    let rem = tiles % grid.max(1);
    if rem == 0 {
        return (1, 0);
    }
    let parts = (grid / rem).min(max_parts).min(k_blocks);
    if parts <= 1 {
        (1, 0)
    } else {
        (parts, rem)
    }
}

/// The grid and tail table for `order` (tile numbers, the order the blocks take them in) on
/// at most `cap` blocks with `k_blocks` k-blocks per tile.
pub fn plan_tail(order: &[u32], cap: usize, k_blocks: usize, mode: TailMode) -> TailPlan {
    let tiles = order.len();
    let cap = cap.max(1);
    let (tail_tiles, workers) = match mode {
        TailMode::StreamK { .. } if tiles > cap && !tiles.is_multiple_of(cap) => {
            let tail = tiles % cap + cap;
            (tail, cap.min(tail * k_blocks))
        }
        TailMode::Cut { max_parts } | TailMode::StreamK { max_parts } => {
            let (parts, split) = tail_split(tiles, cap, k_blocks, max_parts);
            (split, split * parts)
        }
    };
    let full_units = tiles - tail_tiles;
    let grid = cap.min(full_units.max(workers)).max(1);
    spread(&order[full_units..], full_units, grid, workers, k_blocks)
}

/// Lays `tail` (tile numbers) end to end along K and gives each of `workers` blocks an even,
/// contiguous share.
fn spread(
    tail: &[u32],
    full_units: usize,
    grid: usize,
    workers: usize,
    k_blocks: usize,
) -> TailPlan {
    let total = (tail.len() * k_blocks) as u64;
    // worker w's k-blocks of the run: [start(w), start(w + 1))
    let start = |w: usize| (w as u64 * total / workers.max(1) as u64) as usize;
    let mut segments: Vec<Vec<TailUnit>> = vec![Vec::new(); workers];
    let (mut splits, mut slots) = (0usize, 0usize);
    for (w, segs) in segments.iter_mut().enumerate() {
        let (lo, hi) = (start(w), start(w + 1));
        let mut at = lo;
        while at < hi {
            let t = at / k_blocks;
            let end = hi.min((t + 1) * k_blocks);
            segs.push(TailUnit {
                tile: tail[t],
                kb0: (at - t * k_blocks) as u32,
                kb1: (end - t * k_blocks) as u32,
                ..TailUnit::EMPTY
            });
            at = end;
        }
    }
    // a worker's segments are consecutive tiles of the tail from the one its range starts in;
    // a tile's owner is the segment that holds its first k-block
    let mut owner: Vec<(usize, usize)> = vec![(0, 0); tail.len()];
    for (w, segs) in segments.iter().enumerate() {
        for (j, s) in segs.iter().enumerate() {
            if s.kb0 == 0 {
                owner[start(w) / k_blocks + j] = (w, j);
            }
        }
    }
    // helpers (first segments that do not start a tile) take slots in worker order, so that one
    // tile's helpers, consecutive workers, have consecutive slots from the owner's `slot`
    for w in 0..workers {
        if segments[w].first().is_none_or(|s| s.kb0 == 0) {
            continue;
        }
        let (ow, oj) = owner[start(w) / k_blocks];
        let o = &mut segments[ow][oj];
        if o.helpers == 0 {
            o.split = splits as u32;
            o.slot = slots as u32;
            splits += 1;
        }
        o.helpers += 1;
        let split = o.split;
        segments[w][0].split = split;
        segments[w][0].slot = slots as u32;
        slots += 1;
    }
    let rows = segments.iter().map(Vec::len).max().unwrap_or(0);
    let mut units = vec![TailUnit::EMPTY; rows * grid];
    for (w, segs) in segments.iter().enumerate() {
        for (j, s) in segs.iter().enumerate() {
            units[j * grid + w] = *s;
        }
    }
    TailPlan {
        grid,
        full_units,
        units,
        splits,
        slots,
        tail_tiles: tail.len(),
        workers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs one call of a plan's units as the kernel's blocks would (`split_partials` in
    /// gemm.cu), all resident at once: each block takes its units in order; a helper (kb0 > 0)
    /// leaves the k-blocks it computed in its slot and counts itself in at its counter; an
    /// owner with a counter waits until it shows all its helpers, adds their slots and resets
    /// it for the next call (`counters` live across calls, as the workspace's do). Returns,
    /// per tile, how often each k-block reached an epilogue and how many epilogues ran, or the
    /// units the blocks were stuck at.
    fn run(
        plan: &TailPlan,
        order: &[u32],
        k_blocks: usize,
        counters: &mut [u32],
    ) -> Result<Vec<(Vec<u32>, u32)>, String> {
        let tiles = order.len();
        let mut done: Vec<(Vec<u32>, u32)> = vec![(vec![0; k_blocks], 0); tiles];
        let mut slots: Vec<Option<(u32, u32, u32)>> = vec![None; plan.slots];
        let mut next: Vec<usize> = (0..plan.grid).collect();
        loop {
            let mut moved = false;
            for next in next.iter_mut() {
                while *next < plan.unit_count() {
                    let i = *next;
                    let u = if i < plan.full_units {
                        TailUnit {
                            tile: order[i],
                            kb0: 0,
                            kb1: k_blocks as u32,
                            ..TailUnit::EMPTY
                        }
                    } else {
                        plan.units[i - plan.full_units]
                    };
                    if u.is_helper() {
                        let slot = slots
                            .get_mut(u.slot as usize)
                            .ok_or("helper slot out of range")?;
                        if slot.replace((u.tile, u.kb0, u.kb1)).is_some() {
                            return Err(format!("slot {} written twice", u.slot));
                        }
                        *counters
                            .get_mut(u.split as usize)
                            .ok_or("a helper without a counter")? += 1;
                    } else if !u.is_empty() {
                        if u.split != NO_SPLIT {
                            let counter = counters
                                .get_mut(u.split as usize)
                                .ok_or("owner's counter out of range")?;
                            if *counter < u.helpers {
                                break; // waits
                            }
                            *counter = 0;
                        }
                        let tile = u.tile as usize;
                        let mut ranges = vec![(u.tile, u.kb0, u.kb1)];
                        for h in u.slot..u.slot + u.helpers {
                            ranges.push(slots[h as usize].ok_or("owner read an empty slot")?);
                        }
                        for (t, kb0, kb1) in ranges {
                            if t != u.tile {
                                return Err(format!("tile {} added a partial of tile {t}", u.tile));
                            }
                            for kb in kb0..kb1 {
                                done[tile].0[kb as usize] += 1;
                            }
                        }
                        done[tile].1 += 1;
                    }
                    *next += plan.grid;
                    moved = true;
                }
            }
            if next.iter().all(|&i| i >= plan.unit_count()) {
                return Ok(done);
            }
            if !moved {
                return Err(format!("deadlock: blocks stuck at units {next:?}"));
            }
        }
    }

    /// The cut as the kernel computed it before the table: the last `split` tiles of the
    /// order in `parts` equal parts, part `p` of split tile `s` unit `full + s · parts + p`,
    /// k-blocks from `p · K / parts`, slot `s · (parts − 1) + p − 1`, counter `s`, the grid
    /// `min(cap, full + split · parts)`.
    fn cut_by_arithmetic(tiles: usize, cap: usize, k: usize, max_parts: usize) -> TailPlan {
        let (parts, split) = tail_split(tiles, cap, k, max_parts);
        let full = tiles - split;
        let grid = cap.min(full + split * parts).max(1);
        let mut units = Vec::new();
        for s in 0..split {
            for p in 0..parts {
                let helper = p > 0;
                units.push(TailUnit {
                    tile: (full + s) as u32,
                    kb0: (p * k / parts) as u32,
                    kb1: ((p + 1) * k / parts) as u32,
                    split: s as u32,
                    slot: if helper {
                        s * (parts - 1) + p - 1
                    } else {
                        s * (parts - 1)
                    } as u32,
                    helpers: if helper { 0 } else { parts as u32 - 1 },
                });
            }
        }
        // the rows of the table: `grid` units each, empty past the last part
        units.resize((split * parts).div_ceil(grid) * grid, TailUnit::EMPTY);
        TailPlan {
            grid,
            full_units: full,
            units,
            splits: split,
            slots: split * (parts - 1),
            tail_tiles: split,
            workers: split * parts,
        }
    }

    fn check(
        tiles: usize,
        cap: usize,
        k_blocks: usize,
        mode: TailMode,
    ) -> Result<TailPlan, String> {
        // a shuffled order, so that tile numbers and order positions differ
        let order: Vec<u32> = (0..tiles as u32)
            .map(|t| (t + tiles as u32 / 3) % tiles as u32)
            .rev()
            .collect();
        let mut seen = vec![false; tiles];
        for &t in &order {
            seen[t as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "the test's order is a permutation");
        let plan = plan_tail(&order, cap, k_blocks, mode);
        if plan.grid == 0 || plan.grid > cap {
            return Err(format!("grid {} for a cap of {cap}", plan.grid));
        }
        if !plan.units.is_empty() && !plan.full_units.is_multiple_of(plan.grid) {
            return Err(format!(
                "{} whole units on {} blocks",
                plan.full_units, plan.grid
            ));
        }
        // a worker's only helper is its first segment; an owner that waits is its last
        for w in 0..plan.grid {
            let segs: Vec<TailUnit> = plan
                .units
                .iter()
                .skip(w)
                .step_by(plan.grid)
                .copied()
                .collect();
            for (j, s) in segs.iter().enumerate() {
                if s.is_helper() && j != 0 {
                    return Err(format!("worker {w}'s segment {j} is a helper"));
                }
                if s.helpers > 0 && segs[j + 1..].iter().any(|n| !n.is_empty()) {
                    return Err(format!("worker {w} waits at segment {j} before its last"));
                }
            }
        }
        // each counter has one owner, which waits for at least one helper
        let mut owners = vec![0; plan.splits];
        for u in plan
            .units
            .iter()
            .filter(|u| !u.is_helper() && u.split != NO_SPLIT)
        {
            owners[u.split as usize] += 1;
            if u.helpers == 0 {
                return Err(format!("tile {} has a counter and no helpers", u.tile));
            }
        }
        if owners.iter().any(|&n| n != 1) {
            return Err(format!("owners per counter: {owners:?}"));
        }
        // two calls in a row: the first must leave every counter as it found it
        let mut counters = vec![0u32; plan.splits];
        for call in 0..2 {
            let done = run(&plan, &order, k_blocks, &mut counters)?;
            for (t, (kbs, epilogues)) in done.iter().enumerate() {
                if *epilogues != 1 || kbs.iter().any(|&n| n != 1) {
                    return Err(format!(
                        "call {call}, tile {t}: {epilogues} epilogues, k-blocks counted {kbs:?}"
                    ));
                }
            }
            if counters.iter().any(|&c| c != 0) {
                return Err(format!("call {call} left counters {counters:?}"));
            }
        }
        Ok(plan)
    }

    #[test]
    fn cut_is_the_last_waves_tiles_in_equal_parts() {
        // 512 tiles on 116 SMs: 4 whole waves, the last 48 tiles in two halves of 28 k-blocks
        let plan = check(512, 116, 56, TailMode::Cut { max_parts: 4 }).unwrap();
        assert_eq!(
            (plan.full_units, plan.grid, plan.tail_tiles, plan.workers),
            (464, 116, 48, 96)
        );
        assert_eq!((plan.splits, plan.slots), (48, 48));
        assert_eq!(plan.describe(), "cut 2×48");
        // split s's part p is unit full + s · parts + p, its slot s · (parts - 1) + p - 1
        for (v, u) in plan.units.iter().take(96).enumerate() {
            let (s, part) = (v / 2, v % 2);
            assert_eq!((u.kb0, u.kb1), (28 * part as u32, 28 * part as u32 + 28));
            assert_eq!(u.split, s as u32);
            assert_eq!((u.slot, u.helpers), (s as u32, 1 - part as u32));
        }
        assert!(plan.units[96..].iter().all(TailUnit::is_empty));
        // fewer tiles than SMs: one wave of 32 tiles cut in three, the grid just the parts
        let plan = check(32, 132, 56, TailMode::Cut { max_parts: 3 }).unwrap();
        assert_eq!(
            (plan.full_units, plan.grid, plan.describe().as_str()),
            (0, 96, "cut 3×32")
        );
        // a last wave of 68 tiles on 132 SMs has no cut
        let plan = check(2048, 132, 56, TailMode::Cut { max_parts: 4 }).unwrap();
        assert_eq!(
            (plan.full_units, plan.units.len(), plan.describe().as_str()),
            (2048, 0, "none")
        );
    }

    #[test]
    fn stream_k_spreads_the_last_two_waves_over_every_block() {
        // 8192 × 8192 × 3584 in 128 × 256 tiles: 2048 tiles, 15.5 waves on 132 SMs; the last
        // 200 tiles (11 200 k-blocks) go 84 or 85 k-blocks to a block
        let plan = check(2048, 132, 56, TailMode::StreamK { max_parts: 4 }).unwrap();
        assert_eq!(
            (plan.full_units, plan.grid, plan.describe().as_str()),
            (1848, 132, "stream-k 200/132")
        );
        for w in 0..132 {
            let kbs: u32 = plan
                .units
                .iter()
                .skip(w)
                .step_by(132)
                .map(|u| u.kb1 - u.kb0)
                .sum();
            assert!(kbs == 84 || kbs == 85, "worker {w}: {kbs} k-blocks");
        }
        // at most one helper a tile here (a range is longer than a tile)
        assert!(plan.units.iter().all(|u| u.helpers <= 1));
        // whole waves only, or less than one: as the cut
        assert_eq!(
            plan_tail(
                &(0..264).collect::<Vec<_>>(),
                132,
                56,
                TailMode::StreamK { max_parts: 4 }
            )
            .describe(),
            "none"
        );
        let one_wave: Vec<u32> = (0..32).collect();
        assert_eq!(
            plan_tail(&one_wave, 132, 56, TailMode::StreamK { max_parts: 3 }),
            plan_tail(&one_wave, 132, 56, TailMode::Cut { max_parts: 3 })
        );
    }

    #[test]
    fn short_k_spreads_a_tile_over_several_blocks() {
        // 2 k-blocks a tile: 140 tiles on 132 SMs spread 148 tiles' 296 k-blocks over 132
        // blocks, two or three each, so a tile may span two blocks and a block three tiles
        let plan = check(280, 132, 2, TailMode::StreamK { max_parts: 4 }).unwrap();
        assert_eq!(plan.describe(), "stream-k 148/132");
        // one k-block a tile: nothing to cut, whole tiles over the blocks
        check(200, 132, 1, TailMode::StreamK { max_parts: 4 }).unwrap();
    }

    /// The slowest block's work in tiles: whole units plus its tail k-blocks over K.
    fn slowest_block(plan: &TailPlan, k_blocks: usize) -> f64 {
        (0..plan.grid)
            .map(|w| {
                // units w, w + grid, ... below full_units
                let whole = plan.full_units.saturating_sub(w).div_ceil(plan.grid);
                let tail: u32 = plan
                    .units
                    .iter()
                    .skip(w)
                    .step_by(plan.grid)
                    .map(|u| u.kb1 - u.kb0)
                    .sum();
                whole as f64 + tail as f64 / k_blocks as f64
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn the_predictions_in_gemm_notes_are_the_plans() {
        // GEMM-NOTES.md, "The tail": M × N × K in 128 × 256 tiles on 132 SMs, the main build's
        // at most 4 parts; the slowest block's work in tiles, today (cut) and by stream-K
        for (m, n, k, cut, spread) in [
            (8192, 8192, 3584, 16.0, 15.52),
            (2048, 8192, 3584, 4.0, 3.89),
            (16384, 8192, 3584, 31.25, 31.04),
            (8192, 8192, 14336, 16.0, 15.52),
            (4096, 12288, 24576, 12.0, 11.64),
            (4096, 28672, 8192, 27.25, 27.16),
            (1024, 8192, 3584, 2.0, 1.95),
        ] {
            let order: Vec<u32> = (0..(m / 128 * n / 256) as u32).collect();
            let k_blocks = k / 64;
            let plan = |mode| plan_tail(&order, 132, k_blocks, mode);
            let today = slowest_block(&plan(TailMode::Cut { max_parts: 4 }), k_blocks);
            let stream_k = slowest_block(&plan(TailMode::StreamK { max_parts: 4 }), k_blocks);
            assert!((today - cut).abs() < 0.01, "{m}×{n}×{k}: {today}");
            assert!((stream_k - spread).abs() < 0.01, "{m}×{n}×{k}: {stream_k}");
        }
    }

    proptest! {
        #[test]
        fn every_k_block_of_every_tile_reaches_one_epilogue_without_deadlock(
            tiles in 1usize..700,
            cap in 1usize..140,
            k_blocks in 1usize..130,
            max_parts in 1usize..5,
            stream_k in any::<bool>(),
        ) {
            let mode = if stream_k { TailMode::StreamK { max_parts } } else { TailMode::Cut { max_parts } };
            if !stream_k {
                prop_assert_eq!(cut_by_arithmetic(tiles, cap, k_blocks, max_parts),
                    plan_tail(&(0..tiles as u32).collect::<Vec<_>>(), cap, k_blocks, mode));
            }
            if let Err(e) = check(tiles, cap, k_blocks, mode) {
                return Err(TestCaseError::fail(format!("{tiles} tiles, cap {cap}, {k_blocks} k-blocks, {mode:?}: {e}")));
            }
        }
    }
}
