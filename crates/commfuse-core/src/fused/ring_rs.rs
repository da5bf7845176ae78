//! GEMM + reduce-scatter as a pipelined ring of library GEMMs: the overlapped path that needs no
//! GEMM of our own (cuBLASLt on the GPU), for shapes where fusing into our GEMM cannot win.
//!
//! Rank r works through P steps. At step s it computes the partial product of owner
//! o = (r + s + 1) mod P's rows, adding (as the GEMM's C term, beta = 1) the running sum of the
//! earlier steps' partials of those rows, which rank r + 1 computed at step s − 1 and handed on.
//! Its result goes to rank r − 1 (steps 0 .. P − 2) or, at the last step (o = r), into the
//! caller's output with the bias. So each owner's rows travel once around the ring, picking up
//! one partial per rank, and every link carries (P − 1)/P of the output, as in a ring
//! reduce-scatter.
//!
//! Each step is cut into `pieces` row pieces (the same cut of a chunk on every rank): piece j
//! of step s is handed on (a copy into the next rank's receive buffer, then its flag) while
//! piece j + 1 is computed, and the next rank's step s + 1 starts on piece j as soon as piece
//! j's flag is up. Only the transfer of the first piece is exposed at each rank's start.
//!
//! Receive buffers and flags come in two sets, used by alternate calls, and nothing else orders
//! one call after the next: a sender's hand-ons of call n + 2 (into the set call n used) come
//! after its own call n + 1 ended on its stream, and that call's last GEMM added a running sum
//! that carries every rank's partial of call n + 1, the receiver's included, which the receiver
//! computed after it had finished reading call n's set. The checker proves it over four calls
//! (and rejects the ring with one set). That needs every rank to own rows: a call of M < P
//! rows ends with a handshake instead ([`RingSchedule::ends_with_done`]): each rank raises
//! "done" on its sender and waits for its receiver's. Flags hold call numbers (from 1) and are
//! never cleared.
//! When a call ends on a rank every write into its memory for that call has landed (it waited
//! for each one's flag), so its memory may be freed once its stream is past its last call.
//!
//! The 2D (NUMA-aware) ring. With the ranks in G NUMA groups of L consecutive ranks
//! ([`RingSchedule::in_groups`]), rank (g, l) — group g, index l within it — at step s computes
//! owner (g + ⌊s/L⌋ + 1, l + s mod L + 1)'s rows (both mod their count), and hands its running sum
//! on to (g, l − 1) inside its group, except after every L-th step, when it hands it across to
//! (g − 1, l − 1). So each owner's rows pick up the partials of one whole group (L − 1 hops
//! inside it) before they cross to the next group, and every rank sends G − 1 of its P − 1
//! pieces across groups: G − 1 crossings of a chunk per rank per call, spread over all L ranks'
//! links, where a flat ring over the same ranks crosses P − 1 times on each of G links (the
//! ranks at the groups' edges), the rest idle. Each hop still adds one partial as the GEMM's C
//! (no extra reduction pass), and the crossings happen during the call, under later steps'
//! GEMMs, not after them. With G = 1 or G = P it is the flat ring.
//!
//! Rounding: the running sum is rounded to the output type after every step (P − 1 times), where
//! the fused path rounds each partial once; [`super::gemm_rs::element_bound`] covers both.

use super::gemm_rs::GemmRsShape;
use crate::op::chunk_range;
use std::ops::Range;

/// The most pieces a step is cut into.
pub const MAX_PIECES: usize = 16;

/// Flag words ahead of the arrival flags: the done flags of the two [`RingLink`]s.
pub const DONE_FLAGS: usize = 2;

/// Where one piece's result goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RingTarget {
    /// This rank's send buffer for step `step` (rows relative to the owner's chunk); then it
    /// is copied into the receiver's buffer and flagged
    Send { step: usize },
    /// The caller's output (rows relative to this rank's chunk), with the bias
    Output,
}

/// One GEMM of rank r's ring: the rows `rows` of A (absolute), whose product (plus the running
/// sum received in `add`, if any) goes to `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPiece {
    pub step: usize,
    pub piece: usize,
    /// The owner of these rows
    pub owner: usize,
    /// Rows of A and of the product
    pub rows: Range<usize>,
    /// Rows relative to the owner's chunk (where they sit in send and receive buffers)
    pub within: Range<usize>,
    /// The received running sum to add: the receive buffer of step `step − 1`, after its flag
    /// (`flag_index(set, step − 1, piece)`) holds the call's number
    pub add: Option<usize>,
    pub target: RingTarget,
}

/// The ring schedule of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingSchedule {
    pub shape: GemmRsShape,
    /// Row pieces per step
    pub pieces: usize,
    /// Rows of one send or receive buffer (the longest chunk of the largest M the buffers were
    /// made for)
    pub chunk_rows: usize,
    /// NUMA groups of consecutive ranks (1: the flat ring; see the module's 2D ring)
    pub groups: usize,
}

/// The two links a rank's running sums travel on in the 2D ring (the flat ring has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RingLink {
    /// To a rank of the same NUMA group
    Within,
    /// To a rank of the next NUMA group
    Across,
}

impl RingLink {
    /// The link in words, for diagnoses.
    pub fn name(self) -> &'static str {
        match self {
            RingLink::Within => "within its NUMA group",
            RingLink::Across => "across NUMA groups",
        }
    }
}

impl RingSchedule {
    /// The ring of `shape`, each step cut into `pieces` (at least 1), in buffers made for
    /// calls of up to `max_m` rows.
    pub fn within(shape: GemmRsShape, max_m: usize, pieces: usize) -> RingSchedule {
        RingSchedule {
            shape,
            pieces: pieces.clamp(1, MAX_PIECES),
            chunk_rows: max_m.max(shape.m).div_ceil(shape.world),
            groups: 1,
        }
    }

    /// The 2D ring of this schedule over `groups` NUMA groups of consecutive ranks (1: the flat
    /// ring). The world size must be a multiple of `groups`.
    pub fn in_groups(self, groups: usize) -> Result<RingSchedule, crate::error::Error> {
        let p = self.shape.world;
        if groups == 0 || !p.is_multiple_of(groups) {
            return Err(crate::error::Error::Unsupported(format!(
                "the 2D ring needs the world size ({p}) to be a multiple of the NUMA group count ({groups})"
            )));
        }
        Ok(RingSchedule { groups, ..self })
    }

    /// Ranks per NUMA group (L).
    pub fn group_size(&self) -> usize {
        self.shape.world / self.groups
    }

    /// The rank of index `l` in group `g` (both taken modulo their counts).
    fn rank_of(&self, g: usize, l: usize) -> usize {
        let len = self.group_size();
        (g % self.groups) * len + l % len
    }

    /// The link the running sum handed on after `step` travels on.
    pub fn link_after(&self, step: usize) -> RingLink {
        if self.groups > 1 && (step + 1).is_multiple_of(self.group_size()) {
            RingLink::Across
        } else {
            RingLink::Within
        }
    }

    /// The rank to which `rank` hands its running sum on `link`: (g, l − 1) within its
    /// group, (g − 1, l − 1) across (the flat ring's rank − 1).
    pub fn receiver_on(&self, rank: usize, link: RingLink) -> usize {
        let (len, groups) = (self.group_size(), self.groups);
        let (g, l) = (rank / len, rank % len);
        let g = if link == RingLink::Across {
            g + groups - 1
        } else {
            g
        };
        self.rank_of(g, l + len - 1)
    }

    /// The rank whose running sums reach `rank` on `link`: (g, l + 1) within its group,
    /// (g + 1, l + 1) across (the flat ring's rank + 1).
    pub fn sender_on(&self, rank: usize, link: RingLink) -> usize {
        let len = self.group_size();
        let (g, l) = (rank / len, rank % len);
        let g = if link == RingLink::Across { g + 1 } else { g };
        self.rank_of(g, l + 1)
    }

    /// The rank `rank` hands its running sum to after step `step`.
    pub fn receiver(&self, rank: usize, step: usize) -> usize {
        self.receiver_on(rank, self.link_after(step))
    }

    /// The rank whose running sum `rank` adds at step `step` (≥ 1).
    pub fn sender(&self, rank: usize, step: usize) -> usize {
        self.sender_on(rank, self.link_after(step - 1))
    }

    /// The links a rank's hand-ons use, in [`RingLink`] order: within its group when a group
    /// has more than one rank, across groups when there is more than one group (none when
    /// P = 1).
    pub fn links(&self) -> Vec<RingLink> {
        [
            (self.group_size() > 1).then_some(RingLink::Within),
            (self.groups > 1).then_some(RingLink::Across),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// The owner whose rows `rank` computes at `step`: (g + ⌊step/L⌋ + 1, l + step mod L + 1).
    pub fn owner_at(&self, rank: usize, step: usize) -> usize {
        let len = self.group_size();
        let (g, l) = (rank / len, rank % len);
        self.rank_of(g + step / len + 1, l + step % len + 1)
    }

    /// Rows of piece `piece` of `owner`'s chunk, relative to the chunk.
    pub fn piece_rows(&self, owner: usize, piece: usize) -> Range<usize> {
        chunk_range(self.shape.chunk(owner).len(), self.pieces, piece)
    }

    /// Rank `rank`'s GEMMs in order; empty pieces (a chunk shorter than `pieces`) are left out
    /// on every rank alike.
    pub fn pieces_of(&self, rank: usize) -> Vec<RingPiece> {
        let p = self.shape.world;
        let mut out = Vec::with_capacity(p * self.pieces);
        for step in 0..p {
            let owner = self.owner_at(rank, step);
            let start = self.shape.chunk(owner).start;
            for piece in 0..self.pieces {
                let within = self.piece_rows(owner, piece);
                if within.is_empty() {
                    continue;
                }
                out.push(RingPiece {
                    step,
                    piece,
                    owner,
                    rows: start + within.start..start + within.end,
                    within,
                    add: step.checked_sub(1),
                    target: if step + 1 == p {
                        RingTarget::Output
                    } else {
                        RingTarget::Send { step }
                    },
                });
            }
        }
        out
    }

    /// Flags of one set: one per (step, piece) of the P − 1 hand-ons, laid out for
    /// [`MAX_PIECES`] so that every M (whatever its piece count) finds its flags in place.
    pub fn flags_per_set(&self) -> usize {
        (self.shape.world - 1) * MAX_PIECES
    }

    /// The arrival flag of piece `piece` handed on after step `step`, in set `set`.
    pub fn flag_index(&self, set: usize, step: usize, piece: usize) -> usize {
        DONE_FLAGS + set * self.flags_per_set() + step * MAX_PIECES + piece
    }

    /// Whether a call ends with the "done" handshake: where some rank's chunk is empty (M < P)
    /// that rank computes nothing that waits for the others, so the two sets alone do not keep
    /// it from running two calls ahead; then each rank tells its sender on each of its
    /// [`links`](RingSchedule::links) it is done and waits for its receiver's done on each.
    pub fn ends_with_done(&self) -> bool {
        self.shape.world > 1 && self.shape.m < self.shape.world
    }

    /// The flag a receiver on `link` raises on its sender there when it has finished a call
    /// (calls that [`RingSchedule::ends_with_done`]).
    pub fn done_index(&self, link: RingLink) -> usize {
        match link {
            RingLink::Within => 0,
            RingLink::Across => 1,
        }
    }

    /// Flag words a rank needs: the two done flags, then both sets' arrival flags.
    pub fn flag_words(&self) -> usize {
        DONE_FLAGS + 2 * self.flags_per_set()
    }

    /// Elements of one send or receive buffer (one step's chunk).
    pub fn buffer_len(&self) -> usize {
        self.chunk_rows * self.shape.n
    }

    /// Offset (elements) of set `set`'s receive buffer of step `step`: sets of P − 1 buffers.
    pub fn receive_offset(&self, set: usize, step: usize) -> usize {
        (set * (self.shape.world - 1) + step) * self.buffer_len()
    }

    /// Elements of a rank's receive buffers (both sets) and of its send buffers.
    pub fn receive_len(&self) -> usize {
        2 * (self.shape.world - 1) * self.buffer_len()
    }

    pub fn send_len(&self) -> usize {
        (self.shape.world - 1) * self.buffer_len()
    }

    /// The ring as a plan for the checker, as [`super::gemm_rs::GemmRsSchedule::plan`] does for
    /// the fused schedule: a reduce-scatter of the ranks' partial products (rank r's input is its
    /// [M, N] partial). A piece's GEMM is a reduction of the rank's partial rows and the
    /// received running sum (after its flag) into the send buffer or the output; a hand-on is a
    /// copy into the receiver's receive buffer and its flag. One plan holds two calls (set 0,
    /// then set 1), and the checker runs it twice: four calls. The checker's reduce-scatter
    /// splits M·N evenly: M must be a multiple of P.
    pub fn plan(&self) -> Result<crate::plan::Plan, crate::error::Error> {
        self.plan_in_sets(2)
    }

    /// [`RingSchedule::plan`] with `sets` sets of buffers and flags, one call per set (the ring
    /// runs with 2; with 1 the checker shows what the second set is for).
    fn plan_in_sets(&self, sets: usize) -> Result<crate::plan::Plan, crate::error::Error> {
        use crate::op::{OpKind, OpSpec};
        use crate::plan::{BufferKind, PlanBuilder, Region, Slot};
        let (p, n) = (self.shape.world, self.shape.n);
        if !self.shape.m.is_multiple_of(p) {
            return Err(crate::error::Error::Unsupported(format!(
                "the checker sees GEMM + reduce-scatter as a reduce-scatter of M·N elements split evenly: M = {} must be a multiple of P = {p}",
                self.shape.m
            )));
        }
        let spec = OpSpec::new(OpKind::ReduceScatter, p, self.shape.m * n, 0)?;
        let mut b = PlanBuilder::new(spec);
        // per set: a row of arrival flags (step × piece)
        let arrival = b.rows(2);
        let receive = b.scratch(self.receive_len());
        let send = b.scratch(self.send_len());
        for set in 0..sets {
            for rank in 0..p {
                for g in self.pieces_of(rank) {
                    let within = g.within.start * n..g.within.end * n;
                    let rows = g.rows.start * n..g.rows.end * n;
                    let mut srcs = vec![Region::new(rank, BufferKind::Input, rows)];
                    if let Some(prev) = g.add {
                        let col = (prev * self.pieces + g.piece) as u32;
                        b.wait(rank, Slot::new(arrival + set as u32, col), 1);
                        let at = receive + self.receive_offset(set, prev);
                        let region = at + within.start..at + within.end;
                        srcs.push(Region::new(rank, BufferKind::Scratch, region));
                    }
                    match g.target {
                        RingTarget::Output => {
                            let dst = Region::new(rank, BufferKind::Output, within);
                            b.reduce(rank, srcs, dst);
                        }
                        RingTarget::Send { step } => {
                            let at = send + step * self.buffer_len();
                            let mine = at + within.start..at + within.end;
                            let dst = Region::new(rank, BufferKind::Scratch, mine.clone());
                            b.reduce(rank, srcs, dst);
                            let at = receive + self.receive_offset(set, step);
                            let theirs = at + within.start..at + within.end;
                            let receiver = self.receiver(rank, step);
                            b.copy(
                                rank,
                                Region::new(rank, BufferKind::Scratch, mine),
                                Region::new(receiver, BufferKind::Scratch, theirs),
                            );
                            let col = (step * self.pieces + g.piece) as u32;
                            b.signal(rank, receiver, Slot::new(arrival + set as u32, col));
                        }
                    }
                }
            }
        }
        Ok(b.finish("gemm-rs-ring"))
    }

    /// The set call `call` (from 1) uses.
    pub fn set_of(call: u64) -> usize {
        (call % 2) as usize
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::gemm::BLayout;
    use crate::DType;

    fn ring(world: usize, m: usize, pieces: usize) -> RingSchedule {
        ring_2d(world, 1, m, pieces)
    }

    fn ring_2d(world: usize, groups: usize, m: usize, pieces: usize) -> RingSchedule {
        let shape =
            GemmRsShape::new(world, m, 24, 16, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        RingSchedule::within(shape, m, pieces)
            .in_groups(groups)
            .unwrap()
    }

    /// Every (world, groups) with groups dividing the world, P = 1..9 and 16: the worlds the
    /// ring's tests (and the fused ring's) cover.
    pub(crate) fn worlds_and_groups() -> impl Iterator<Item = (usize, usize)> {
        (1..=9)
            .chain([16])
            .flat_map(|p| (1..=p).filter(move |g| p % g == 0).map(move |g| (p, g)))
    }

    #[test]
    fn every_owner_rows_go_once_around_the_ring_and_end_at_their_owner() {
        for (world, groups) in worlds_and_groups() {
            for m in [1, world, 3 * world + 1, 37, 64] {
                for pieces in [1, 2, 3, 5] {
                    let r = ring_2d(world, groups, m, pieces);
                    // (owner, piece) -> the steps at which each rank computes it
                    for owner in 0..world {
                        for piece in 0..pieces {
                            let rows = r.piece_rows(owner, piece);
                            let mut seen = Vec::new();
                            for rank in 0..world {
                                for g in r.pieces_of(rank) {
                                    if g.owner == owner && g.piece == piece {
                                        seen.push((g.step, rank, g.target, g.add));
                                    }
                                }
                            }
                            if rows.is_empty() {
                                assert!(seen.is_empty());
                                continue;
                            }
                            seen.sort();
                            assert_eq!(seen.len(), world, "P={world} M={m} owner {owner}");
                            for (s, &(step, rank, target, add)) in seen.iter().enumerate() {
                                assert_eq!(step, s);
                                assert_eq!(add, s.checked_sub(1));
                                if s + 1 == world {
                                    assert_eq!(rank, owner);
                                    assert_eq!(target, RingTarget::Output);
                                } else {
                                    assert_eq!(target, RingTarget::Send { step: s });
                                    // the next step's rank is the one this rank hands on to
                                    assert_eq!(seen[s + 1].1, r.receiver(rank, s));
                                    assert_eq!(r.sender(seen[s + 1].1, s + 1), rank);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn pieces_tile_each_chunk_and_flags_and_buffers_do_not_overlap() {
        let r = ring(4, 103, 3);
        for o in 0..4 {
            let len = r.shape.chunk(o).len();
            let mut next = 0;
            for j in 0..3 {
                let rows = r.piece_rows(o, j);
                assert_eq!(rows.start, next);
                next = rows.end;
            }
            assert_eq!(next, len);
        }
        let mut flags: Vec<usize> = (0..2)
            .flat_map(|set| (0..3).flat_map(move |s| (0..3).map(move |j| (set, s, j))))
            .map(|(set, s, j)| r.flag_index(set, s, j))
            .collect();
        flags.extend([
            r.done_index(RingLink::Within),
            r.done_index(RingLink::Across),
        ]);
        let count = flags.len();
        flags.sort();
        flags.dedup();
        assert_eq!(flags.len(), count);
        assert!(flags.iter().all(|&f| f < r.flag_words()));
        assert_eq!(r.receive_offset(1, 2) + r.buffer_len(), r.receive_len());
        assert_eq!(RingSchedule::set_of(1), 1);
    }

    /// The 2D ring's traffic: each rank hands G − 1 pieces' worth of steps across groups and
    /// P − G within its group, every hand-on within a group stays in it, and every hand-on
    /// across goes to the next group down; with G = 1 or G = P it is the flat ring (owner
    /// r + s + 1, hand-ons to r − 1).
    #[test]
    fn the_2d_ring_crosses_groups_once_per_group_and_is_flat_at_the_ends() {
        for (world, groups) in worlds_and_groups() {
            let r = ring_2d(world, groups, 4 * world, 1);
            let len = world / groups;
            for rank in 0..world {
                let across = (0..world - 1)
                    .filter(|&s| r.link_after(s) == RingLink::Across)
                    .count();
                assert_eq!(across, if groups == 1 { 0 } else { groups - 1 });
                for s in 0..world - 1 {
                    let to = r.receiver(rank, s);
                    match r.link_after(s) {
                        RingLink::Within => assert_eq!(to / len, rank / len),
                        RingLink::Across => {
                            assert_eq!(to / len, (rank / len + groups - 1) % groups)
                        }
                    }
                    if groups == 1 || groups == world {
                        assert_eq!(to, (rank + world - 1) % world);
                        assert_eq!(r.owner_at(rank, s), (rank + s + 1) % world);
                    }
                }
                // the links named are exactly those the steps use
                let mut used: Vec<RingLink> = (0..world - 1).map(|s| r.link_after(s)).collect();
                used.sort();
                used.dedup();
                assert_eq!(r.links(), used, "P={world} G={groups}");
                // the senders and receivers of one link are each other's
                for link in r.links() {
                    assert_eq!(r.sender_on(r.receiver_on(rank, link), link), rank);
                }
            }
        }
        let shape = GemmRsShape::new(6, 12, 8, 8, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        let e = RingSchedule::within(shape, 12, 1).in_groups(4).unwrap_err();
        assert!(
            e.to_string().contains("multiple of the NUMA group count"),
            "{e}"
        );
        assert!(RingSchedule::within(shape, 12, 1).in_groups(0).is_err());
    }

    /// The plan checker proves of the ring what it proves of the collectives (no deadlock, no
    /// slot used twice in a call, no read before its flag, no buffer overwritten while read,
    /// every output the right sum) for P = 1..9 and 16, every group count that divides P (the
    /// 2D ring), 1–3 pieces, and rejects it broken.
    #[test]
    fn the_checker_accepts_the_ring_and_rejects_it_broken() {
        for (world, groups) in worlds_and_groups() {
            for m in [world, world * 5, world * 8] {
                for pieces in 1..=3 {
                    let r = ring_2d(world, groups, m, pieces);
                    if let Err(e) = crate::check(r.plan().unwrap()) {
                        panic!("P={world} G={groups} M={m} pieces={pieces}: {e}");
                    }
                }
            }
        }
        let r = ring(3, 12, 2);
        // a sender that never raises one arrival flag: its receiver waits forever
        let mut plan = r.plan().unwrap();
        let at = plan.steps[1]
            .iter()
            .position(|st| matches!(st, crate::plan::Step::Notify { .. }))
            .unwrap();
        plan.steps[1].remove(at);
        assert!(crate::check(plan).is_err());
        // a rank that adds its running sums before their flags: a read before the write
        let mut plan = r.plan().unwrap();
        plan.steps[0].retain(|st| !matches!(st, crate::plan::Step::Wait { .. }));
        assert!(crate::check(plan).is_err());
        // one set of buffers for every call: a fast sender's next call overwrites a running
        // sum its receiver has yet to add
        for world in [2, 3] {
            let one = ring(world, 4 * world, 2).plan_in_sets(1).unwrap();
            let e = crate::check(one).unwrap_err().to_string();
            assert!(
                e.contains("overwrites") || e.contains("last written by"),
                "P={world}: {e}"
            );
        }
        let e = ring(3, 13, 2).plan().unwrap_err();
        assert!(e.to_string().contains("multiple of P"), "{e}");
    }

    #[test]
    fn one_rank_writes_its_output_directly() {
        let r = ring(1, 10, 2);
        let g = r.pieces_of(0);
        assert_eq!(g.len(), 2);
        assert!(g
            .iter()
            .all(|g| g.target == RingTarget::Output && g.add.is_none()));
        assert_eq!(r.flags_per_set(), 0);
        assert_eq!(r.flag_words(), DONE_FLAGS);
    }
}
