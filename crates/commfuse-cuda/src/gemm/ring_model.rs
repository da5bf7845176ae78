//! A model of the GEMM kernel's stage ring (`producer()` and `consumer()` in gemm.cu), run
//! under random interleavings: the producer fills the stages in the order of a block's units,
//! loads land in any order, and the consumer warpgroups wait for, read and let go of the
//! stages as the kernel's code does for each way the builds share the ring — both warpgroups
//! on every stage (the main, mid and narrow-tall builds), each on every other k-block of a
//! unit (the narrow-sliced build, with its hand-over of sums between units), or each on whole
//! units in turn (the ping-pong build, with its turn barriers). An mbarrier's parity wait is
//! modelled as the hardware answers it (passes whenever the barrier's completed phases have
//! the other parity), so a wait that runs a lap ahead of the fills passes on a stale phase,
//! and the model's check that every read finds the fill it expects, untouched until it is let
//! go, fails.

/// How the consumer warpgroups share the ring.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Sharing {
    /// Both read every stage; each stage's empty barrier counts two arrivals
    Both,
    /// Warpgroup w reads the k-blocks w, w + 2, … of each unit and waits for the others too,
    /// letting each go at once (the narrow-sliced build; each stage's empty barrier counts
    /// both warpgroups)
    Slices,
    /// Warpgroup w reads the units at even (w = 0) or odd places (the ping-pong build)
    PingPong,
}

/// An mbarrier: its completed phases and the arrivals of the current one.
#[derive(Debug, Clone, Copy)]
struct Barrier {
    completed: u64,
    arrivals: u32,
    count: u32,
}

impl Barrier {
    fn new(count: u32) -> Self {
        Barrier {
            completed: 0,
            arrivals: 0,
            count,
        }
    }

    /// `mbarrier.try_wait.parity`: true unless the current (incomplete) phase has this parity.
    fn passes(&self, parity: u32) -> bool {
        (self.completed % 2) as u32 != parity
    }

    fn arrive(&mut self) {
        self.arrivals += 1;
        if self.arrivals == self.count {
            self.arrivals = 0;
            self.completed += 1;
        }
    }
}

/// Where a consumer warpgroup's code stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum At {
    /// At the top of unit `unit`'s turn (ping-pong: whose unit it is decided here)
    Unit,
    /// Waiting at the other warpgroup's turn barrier (ping-pong) before stepping over a unit
    Turn,
    /// At k-block `kb` of the unit (waiting for its stage if it is this warpgroup's)
    Block,
    /// The sliced build's hand-over after a unit's main loop
    HandOver,
    /// Past its last unit (the sliced build's second warpgroup takes its last SUMS_FREE here)
    Last,
    Done,
}

#[derive(Debug, Clone)]
struct Consumer {
    w: u32,
    at: At,
    unit: usize,
    kb: u32,
    stage: u32,
    phase: u32,
    turn: u32,
    turn_phase: u32,
    /// The stage and the fill this warpgroup read last and has not let go yet
    held: Option<(u32, u64)>,
    /// The global index of the unit's first k-block (units are filled in order)
    first: u64,
}

struct Ring {
    stages: u32,
    units: Vec<u32>,
    sharing: Sharing,
    full: Vec<Barrier>,
    empty: Vec<Barrier>,
    /// What each stage holds: the global index of the k-block that landed there last
    content: Vec<Option<u64>>,
    /// Loads issued and not landed: (stage, k-block)
    in_flight: Vec<(u32, u64)>,
    /// The producer's next k-block
    next: u64,
    total: u64,
    turn_bars: [Barrier; 2],
    /// Whether the warpgroups keep each other in order: the ping-pong build's turn barriers,
    /// the sliced build's waits for the other slice's k-blocks (false: a kernel without them,
    /// whose warpgroups step over the other's stages unseen, which the model must catch)
    ordered: bool,
    /// The sliced build's named barriers as the arrivals waiting to be met (at most one each)
    sums_free: u32,
    sums_ready: u32,
    consumers: [Consumer; 2],
}

impl Ring {
    fn new(stages: u32, units: Vec<u32>, sharing: Sharing) -> Self {
        let readers = if sharing == Sharing::PingPong { 1 } else { 2 };
        let total = units.iter().map(|&k| k as u64).sum();
        let consumer = |w| Consumer {
            w,
            at: At::Unit,
            unit: 0,
            kb: 0,
            stage: 0,
            phase: 0,
            turn: 0,
            turn_phase: 0,
            held: None,
            first: 0,
        };
        Ring {
            stages,
            units,
            sharing,
            full: vec![Barrier::new(1); stages as usize],
            empty: vec![Barrier::new(readers); stages as usize],
            content: vec![None; stages as usize],
            in_flight: Vec::new(),
            next: 0,
            total,
            turn_bars: [Barrier::new(1); 2],
            ordered: true,
            // the first warpgroup's arrival at SUMS_FREE before its first unit
            sums_free: u32::from(sharing == Sharing::Slices),
            sums_ready: 0,
            consumers: [consumer(0), consumer(1)],
        }
    }

    /// The producer's next load, if its stage's empty barrier lets it: the parity it waits
    /// for is its lap's, flipped (a fresh stage is free).
    fn producer_can_issue(&self) -> bool {
        if self.next == self.total {
            return false;
        }
        let s = (self.next % self.stages as u64) as usize;
        let lap = (self.next / self.stages as u64) as u32;
        self.empty[s].passes((lap & 1) ^ 1)
    }

    fn issue(&mut self) {
        let s = (self.next % self.stages as u64) as u32;
        self.in_flight.push((s, self.next));
        self.next += 1;
    }

    fn land(&mut self, i: usize) {
        let (s, g) = self.in_flight.swap_remove(i);
        self.content[s as usize] = Some(g);
        self.full[s as usize].arrive();
    }

    fn advance(c: &mut Consumer, stages: u32, by: u32) {
        let at = c.stage + by;
        c.phase ^= (at / stages) & 1;
        c.stage = at % stages;
    }

    /// Lets go of the stage this warpgroup holds, checking it still holds the fill it read.
    fn release(&mut self, w: usize) -> Result<(), String> {
        if let Some((s, g)) = self.consumers[w].held.take() {
            if self.content[s as usize] != Some(g) {
                return Err(format!(
                    "warpgroup {w}: stage {s} was refilled ({:?}) before k-block {g} was let go",
                    self.content[s as usize]
                ));
            }
            self.empty[s as usize].arrive();
        }
        Ok(())
    }

    /// One step of consumer `w` if it can take one; Ok(false) when it waits.
    fn step(&mut self, w: usize) -> Result<bool, String> {
        let stages = self.stages;
        let c = self.consumers[w].clone();
        match c.at {
            At::Done => Ok(false),
            At::Last => {
                if self.sharing == Sharing::Slices && w == 1 {
                    if self.sums_free == 0 {
                        return Ok(false);
                    }
                    self.sums_free -= 1;
                }
                self.consumers[w].at = At::Done;
                Ok(true)
            }
            At::Unit => {
                let c = &mut self.consumers[w];
                if c.unit == self.units.len() {
                    c.at = At::Last;
                    return Ok(true);
                }
                if self.sharing == Sharing::PingPong {
                    let mine = c.turn % 2 == c.w;
                    c.turn += 1;
                    if !mine {
                        c.at = At::Turn;
                        return Ok(true);
                    }
                }
                c.at = At::Block;
                c.kb = 0;
                Ok(true)
            }
            At::Turn => {
                let other = 1 - w;
                if self.ordered && !self.turn_bars[other].passes(c.turn_phase) {
                    return Ok(false);
                }
                let kbs = self.units[c.unit];
                let c = &mut self.consumers[w];
                c.turn_phase ^= 1;
                Self::advance(c, stages, kbs);
                c.first += kbs as u64;
                c.unit += 1;
                c.at = At::Unit;
                Ok(true)
            }
            At::Block => {
                let kbs = self.units[c.unit];
                if c.kb == kbs {
                    // past the main loop: the ping-pong build's turn, then the last release
                    if self.sharing == Sharing::PingPong {
                        self.turn_bars[w].arrive();
                    }
                    self.release(w)?;
                    let c = &mut self.consumers[w];
                    c.first += kbs as u64;
                    c.at = if self.sharing == Sharing::Slices {
                        At::HandOver
                    } else {
                        c.unit += 1;
                        At::Unit
                    };
                    return Ok(true);
                }
                let other_slice = self.sharing == Sharing::Slices && c.kb % 2 != c.w;
                if other_slice && !self.ordered {
                    let c = &mut self.consumers[w];
                    Self::advance(c, stages, 1);
                    c.kb += 1;
                    return Ok(true);
                }
                let s = c.stage as usize;
                if !self.full[s].passes(c.phase) {
                    return Ok(false);
                }
                let g = c.first + c.kb as u64;
                if self.content[s] != Some(g) {
                    return Err(format!(
                        "warpgroup {w}: the wait for k-block {g} in stage {s} passed with {:?} there",
                        self.content[s]
                    ));
                }
                if other_slice {
                    // the other slice's k-block: seen, and let go at once
                    self.empty[s].arrive();
                    let c = &mut self.consumers[w];
                    Self::advance(c, stages, 1);
                    c.kb += 1;
                    return Ok(true);
                }
                // the previous k-block's stage goes once this one's wgmmas are issued
                self.release(w)?;
                let c = &mut self.consumers[w];
                c.held = Some((c.stage, g));
                Self::advance(c, stages, 1);
                c.kb += 1;
                Ok(true)
            }
            At::HandOver => {
                // the second warpgroup: SUMS_FREE, write, arrive SUMS_READY; the first: SUMS_READY,
                // read, arrive SUMS_FREE
                let (wait, give) = if w == 1 {
                    (&mut self.sums_free, &mut self.sums_ready)
                } else {
                    (&mut self.sums_ready, &mut self.sums_free)
                };
                if *wait == 0 {
                    return Ok(false);
                }
                *wait -= 1;
                if *give != 0 {
                    return Err(format!(
                        "warpgroup {w}: a hand-over barrier arrived at twice"
                    ));
                }
                *give += 1;
                let c = &mut self.consumers[w];
                c.unit += 1;
                c.at = At::Unit;
                Ok(true)
            }
        }
    }

    /// The same ring without the warpgroups' ordering (see `ordered`): each stage's empty
    /// barrier then counts one arrival in the sliced build too.
    fn unordered(mut self) -> Self {
        self.ordered = false;
        if self.sharing == Sharing::Slices {
            self.empty = vec![Barrier::new(1); self.stages as usize];
        }
        self
    }

    fn finished(&self) -> bool {
        self.next == self.total
            && self.in_flight.is_empty()
            && self.consumers.iter().all(|c| c.at == At::Done)
    }

    /// Runs the ring to its end, `choose` picking each move among those that can be made:
    /// Err with what went wrong (a read of the wrong fill, a stage refilled under a reader, no
    /// one able to move).
    fn run(&mut self, mut choose: impl FnMut(&[Move]) -> usize) -> Result<(), String> {
        for _ in 0..1_000_000 {
            if self.finished() {
                return Ok(());
            }
            let mut moves: Vec<Move> = Vec::new();
            if self.producer_can_issue() {
                moves.push(Move::Issue);
            }
            moves.extend(
                self.in_flight
                    .iter()
                    .enumerate()
                    .map(|(i, &(_, g))| Move::Land(i, g)),
            );
            for w in 0..2 {
                // a consumer's step is taken to see whether it can move, then undone
                let saved = (
                    self.consumers.clone(),
                    self.empty.clone(),
                    self.turn_bars,
                    self.sums_free,
                    self.sums_ready,
                );
                let moved = self.step(w)?;
                (
                    self.consumers,
                    self.empty,
                    self.turn_bars,
                    self.sums_free,
                    self.sums_ready,
                ) = saved;
                if moved {
                    moves.push(Move::Step(w));
                }
            }
            if moves.is_empty() {
                return Err(format!(
                    "no one can move: {:?}",
                    self.consumers
                        .iter()
                        .map(|c| (c.at, c.unit, c.kb))
                        .collect::<Vec<_>>()
                ));
            }
            match moves[choose(&moves)] {
                Move::Issue => self.issue(),
                Move::Land(i, _) => self.land(i),
                Move::Step(w) => {
                    self.step(w)?;
                }
            }
        }
        Err("the ring did not finish".into())
    }
}

/// A move of the ring: the producer's next load, a load in flight landing (its index among
/// them, its k-block), a consumer warpgroup's step.
#[derive(Debug, Clone, Copy)]
enum Move {
    Issue,
    Land(usize, u64),
    Step(usize),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The ring for `units` (their k-block counts) on `stages`, under `sharing` (with or
    /// without the warpgroups' ordering), with the interleaving drawn from `seed`.
    fn run(
        stages: u32,
        units: &[u32],
        sharing: Sharing,
        ordered: bool,
        seed: u64,
    ) -> Result<(), String> {
        let mut state = seed | 1;
        let mut ring = Ring::new(stages, units.to_vec(), sharing);
        if !ordered {
            ring = ring.unordered();
        }
        ring.run(|moves| {
            // xorshift: a cheap, repeatable interleaving
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % moves.len() as u64) as usize
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Every read finds the fill it waited for, untouched until let go, and the ring
        /// ends, for every way of sharing it, any units (1 to 40 k-blocks, up to 8 of them)
        /// and the builds' stage counts.
        #[test]
        fn every_read_finds_its_fill_however_the_warpgroups_share_the_ring(
            stages in prop::sample::select(vec![3u32, 4, 5, 6, 8, 12]),
            units in prop::collection::vec(1u32..40, 1..9),
            sharing in prop::sample::select(vec![Sharing::Both, Sharing::Slices, Sharing::PingPong]),
            seed in any::<u64>(),
        ) {
            for round in 0..4 {
                let r = run(stages, &units, sharing, true, seed.wrapping_add(round));
                prop_assert!(r.is_ok(), "{sharing:?} {stages} stages {units:?}: {}", r.unwrap_err());
            }
        }
    }

    /// Without its turn barriers, a ping-pong warpgroup that steps over the other's unit of six
    /// or more k-blocks waits for its own first stage on the parity of a fill a lap back and
    /// passes before its k-block lands: the model must see it.
    #[test]
    fn ping_pong_without_its_turns_reads_stages_a_lap_early() {
        reads_early_only_unordered(6, &[56, 56, 56], Sharing::PingPong);
    }

    /// The same for the sliced build stepping over the other slice's k-blocks unseen: after
    /// a unit of an odd count of k-blocks, the fill a lap before a warpgroup's next k-block is
    /// the other's, and loads land in any order. On twelve stages after a unit of 13 k-blocks
    /// the second warpgroup's first wait of the next unit (k-block 14, stage 2) passes on the
    /// fresh barrier when k-block 2 (the first warpgroup's) lands after its own; with the
    /// waits, nothing does.
    #[test]
    fn slices_stepping_over_each_other_unseen_read_stages_a_lap_early() {
        reads_early_only_unordered(3, &[4, 31, 18, 36, 4], Sharing::Slices);
        for ordered in [false, true] {
            let mut ring = Ring::new(12, vec![13, 25, 25], Sharing::Slices);
            if !ordered {
                ring = ring.unordered();
            }
            // the consumers first, then any load but k-block 2's, then the producer
            let r = ring.run(|moves| {
                let rank = |m: &Move| match m {
                    Move::Step(_) => 0,
                    Move::Land(_, g) if *g != 2 => 1,
                    Move::Issue => 2,
                    Move::Land(..) => 3,
                };
                (0..moves.len()).min_by_key(|&i| rank(&moves[i])).unwrap()
            });
            match r {
                Ok(()) => assert!(ordered, "the unordered ring read no stage early"),
                Err(e) => {
                    assert!(!ordered, "{e}");
                    assert!(e.contains("k-block 14 in stage 2 passed with None"), "{e}");
                }
            }
        }
    }

    fn reads_early_only_unordered(stages: u32, units: &[u32], sharing: Sharing) {
        let failures: Vec<String> = (0..400)
            .filter_map(|seed| run(stages, units, sharing, false, seed).err())
            .collect();
        assert!(!failures.is_empty(), "no interleaving read a stage early");
        assert!(failures[0].contains("passed with"), "{}", failures[0]);
        for seed in 0..400 {
            run(stages, units, sharing, true, seed).unwrap();
        }
    }
}
