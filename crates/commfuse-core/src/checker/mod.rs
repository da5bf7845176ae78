//! The plan checker. It first checks a plan's shape (peers, slots, ranges, slot reuse, waits
//! that ask for more than is ever sent), then runs it abstractly for two consecutive calls:
//!
//! * ranks advance until they block on a wait; if none can advance, that is a deadlock, reported
//!   with every blocked rank, its slot, the value it waits for and the value it sees;
//! * vector clocks, joined at every satisfied wait with the clocks of the notifies it observed,
//!   order accesses; a read or write of memory whose last conflicting access is not ordered
//!   before it is a race (read before the writer signalled, overwrite while a peer may read);
//! * the run follows one schedule, so nothing may depend on the order in which notifies reach a
//!   slot: notifies are positive, an `Eq` wait must wait for the slot's total of the call (a
//!   partial sum of several adds is seen only in some orders, and a polling waiter may miss
//!   it), a wait synchronises only with the notifies it cannot be satisfied without, and the
//!   next call's notifies to a slot waited on with `Eq`, or reached by several notifies, must
//!   come after this call's wait;
//! * memory holds symbolic values (which ranks' inputs, which elements, which call), so a reduce
//!   that counts an input twice or mixes calls is caught where it happens, and every output
//!   element is compared with the op's definition at the end of each call.
//!
//! Running two calls back to back catches plans that are right once but race with the next
//! call (a fast rank overwriting a slow peer's buffers). Calls are queued back to back on each
//! rank's stream with no host synchronisation, and between two calls the caller (that rank's
//! stream, after its kernel of one call and before its kernel of the next) reads its whole
//! output buffer, then writes its whole input buffer (the next call's data) and its whole
//! output buffer (poison: a later layer may reuse it). Those accesses are ordered like any
//! other, through the rank's own steps, so a peer that may still read a rank's input, or may
//! already write its output for the next call, is a race naming both. Scratch is the
//! library's own; the caller never touches it.

mod engine;
pub(crate) mod segments;

use crate::error::PlanError;
use crate::plan::{Cmp, NotifyOp, Plan, Region, Slot, Step};
use crate::topology::Topology;
pub use engine::Timing;
use std::collections::HashMap;

/// A plan that passed the checker, with what backends need to run it repeatedly: how much each
/// slot of each rank's pad advances in one call (the epoch increment).
#[derive(Debug, Clone)]
pub struct CheckedPlan {
    plan: Plan,
    increments: Vec<Vec<u64>>,
    /// `[rank][row * pad_cols + col]`: the lowest rank that notifies that slot of `rank`
    notifiers: Vec<Vec<Option<usize>>>,
}

impl CheckedPlan {
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// `slot_increments(r)[row * pad_cols + col]`: the total that notifies add to rank r's slot
    /// in one call. A backend keeps a per-rank base per slot, adds it to every wait's expected
    /// value and advances it by this increment after each call, so slots never need a reset.
    pub fn slot_increments(&self, rank: usize) -> &[u64] {
        &self.increments[rank]
    }

    /// The rank whose notify a wait of rank `rank` on its `slot` awaits (where several ranks add
    /// to the slot, the lowest of them); None where no rank notifies the slot (a wait there
    /// holds at once) or the slot is outside the plan's pad.
    pub fn notifier(&self, rank: usize, slot: Slot) -> Option<usize> {
        if slot.row >= self.plan.pad_rows || slot.col >= self.plan.pad_cols {
            return None;
        }
        let s = slot.row as usize * self.plan.pad_cols as usize + slot.col as usize;
        self.notifiers.get(rank)?.get(s).copied().flatten()
    }

    /// Runs the plan abstractly under `topology`'s latency–bandwidth model and returns the
    /// predicted per-rank finishing times of one call.
    pub fn timing(&self, topology: &Topology, elem_bytes: usize) -> Timing {
        engine::Engine::new(&self.plan, &self.increments, Some((topology, elem_bytes)))
            .run(1)
            .expect("a checked plan runs")
    }
}

/// Checks `plan`; on success it may be executed by any backend.
pub fn check(plan: Plan) -> Result<CheckedPlan, PlanError> {
    let increments = check_shape(&plan)?;
    check_lane_alignment(&plan)?;
    engine::Engine::new(&plan, &increments, None).run(2)?;
    let notifiers = notifiers(&plan);
    Ok(CheckedPlan {
        plan,
        increments,
        notifiers,
    })
}

/// For every rank and slot of its pad, the lowest rank that notifies it (slots in bounds: the
/// shape was checked).
fn notifiers(plan: &Plan) -> Vec<Vec<Option<usize>>> {
    let slots = plan.pad_rows as usize * plan.pad_cols as usize;
    let mut out = vec![vec![None; slots]; plan.world()];
    for (r, steps) in plan.steps.iter().enumerate() {
        for step in steps {
            if let Step::Notify { peer, slot, .. } = step {
                let s = slot.row as usize * plan.pad_cols as usize + slot.col as usize;
                let first: &mut Option<usize> = &mut out[*peer][s];
                *first = Some(first.map_or(r, |f| f.min(r)));
            }
        }
    }
    out
}

/// Backends may split every data step into lanes by position within its regions (element i of
/// a region goes to lane i / lane_len), each lane signalling on its own slots. That is the same
/// computation only if a lane never needs data another lane produced, which holds when any two
/// regions that overlap, one of them written, start at the same offset.
fn check_lane_alignment(plan: &Plan) -> Result<(), PlanError> {
    struct Use {
        region: Region,
        rank: usize,
        step: usize,
        written: bool,
    }
    // (rank, buffer) -> regions, with the first step that used each and whether any writes it
    let mut by_buffer: HashMap<(usize, usize), Vec<Use>> = HashMap::new();
    for (r, steps) in plan.steps.iter().enumerate() {
        for (i, step) in steps.iter().enumerate() {
            let (srcs, dsts) = step.regions();
            let uses = srcs
                .iter()
                .map(|g| (g, false))
                .chain(dsts.iter().map(|g| (g, true)));
            for (region, written) in uses.filter(|(g, _)| g.len > 0) {
                let list = by_buffer
                    .entry((region.rank, region.buffer.index()))
                    .or_default();
                match list.iter_mut().find(|u| u.region == *region) {
                    Some(u) => u.written |= written,
                    None => list.push(Use {
                        region: *region,
                        rank: r,
                        step: i,
                        written,
                    }),
                }
            }
        }
    }
    for list in by_buffer.values_mut() {
        list.sort_by_key(|u| (u.region.offset, u.region.len));
        for (k, first) in list.iter().enumerate() {
            let (a, ar, ai) = (&first.region, first.rank, first.step);
            for later in &list[k + 1..] {
                let (b, br, bi) = (&later.region, later.rank, later.step);
                if b.offset >= a.offset + a.len {
                    break;
                }
                if b.offset != a.offset && (first.written || later.written) {
                    return Err(PlanError::Misaligned {
                        rank: br,
                        step: bi,
                        region: b.to_string(),
                        other: a.to_string(),
                        other_rank: ar,
                        other_step: ai,
                    });
                }
            }
        }
    }
    Ok(())
}

fn malformed(rank: usize, step: usize, what: String) -> PlanError {
    PlanError::Malformed { rank, step, what }
}

fn check_region(plan: &Plan, rank: usize, step: usize, region: &Region) -> Result<(), PlanError> {
    if region.rank >= plan.world() {
        return Err(malformed(
            rank,
            step,
            format!(
                "accesses rank {} but the world has {} ranks",
                region.rank,
                plan.world()
            ),
        ));
    }
    let cap = plan.buffers.get(region.buffer);
    match region.offset.checked_add(region.len) {
        Some(end) if end <= cap => Ok(()),
        _ => Err(malformed(
            rank,
            step,
            format!(
                "{region} lies outside the {} buffer of {cap} elements",
                region.buffer.name()
            ),
        )),
    }
}

fn check_slot(plan: &Plan, rank: usize, step: usize, slot: Slot) -> Result<usize, PlanError> {
    if slot.row >= plan.pad_rows || slot.col >= plan.pad_cols {
        return Err(malformed(
            rank,
            step,
            format!(
                "slot {slot} is outside the {}×{} signal pad",
                plan.pad_rows, plan.pad_cols
            ),
        ));
    }
    Ok(slot.row as usize * plan.pad_cols as usize + slot.col as usize)
}

/// Static checks; returns the per-call slot increments.
fn check_shape(plan: &Plan) -> Result<Vec<Vec<u64>>, PlanError> {
    let p = plan.world();
    if plan.steps.len() != p {
        return Err(malformed(
            0,
            0,
            format!(
                "the plan has programs for {} ranks, the world has {p}",
                plan.steps.len()
            ),
        ));
    }
    let slots = plan.pad_rows as usize * plan.pad_cols as usize;
    let mut inc = vec![vec![0u64; slots]; p];
    let mut notifies = vec![vec![0usize; slots]; p];
    // (owner, slot index) -> first (rank, step, op) that notified it / waited on it
    let mut notified: HashMap<(usize, usize), (usize, usize, NotifyOp)> = HashMap::new();
    let mut waited: HashMap<(usize, usize), usize> = HashMap::new();
    for (r, steps) in plan.steps.iter().enumerate() {
        for (i, step) in steps.iter().enumerate() {
            match step {
                Step::Wait { slot, .. } => {
                    let s = check_slot(plan, r, i, *slot)?;
                    if let Some(&first) = waited.get(&(r, s)) {
                        return Err(PlanError::SlotReuse {
                            rank: r,
                            step: i,
                            owner: r,
                            slot: *slot,
                            what: "waited on twice in one call".into(),
                            first_rank: r,
                            first_step: first,
                        });
                    }
                    waited.insert((r, s), i);
                }
                Step::Notify {
                    peer,
                    slot,
                    value,
                    op,
                } => {
                    if *peer >= p {
                        return Err(malformed(
                            r,
                            i,
                            format!(
                                "notifies slot {slot} of peer {peer}, but the world has {p} ranks (0..{})",
                                p - 1
                            ),
                        ));
                    }
                    let s = check_slot(plan, r, i, *slot)?;
                    if *value == 0 {
                        // a wait cannot tell whether it has arrived, so whether the waiter
                        // synchronises with it would depend on timing
                        return Err(malformed(
                            r,
                            i,
                            format!("notifies slot {slot} of rank {peer} with value 0, which no wait can observe"),
                        ));
                    }
                    notifies[*peer][s] += 1;
                    if let Some(&(fr, fs, fop)) = notified.get(&(*peer, s)) {
                        if *op == NotifyOp::Set || fop == NotifyOp::Set {
                            let what = if *op == fop {
                                "set twice in one call"
                            } else {
                                "both set and added to in one call"
                            };
                            return Err(PlanError::SlotReuse {
                                rank: r,
                                step: i,
                                owner: *peer,
                                slot: *slot,
                                what: what.into(),
                                first_rank: fr,
                                first_step: fs,
                            });
                        }
                    } else {
                        notified.insert((*peer, s), (r, i, *op));
                    }
                    inc[*peer][s] += value;
                }
                Step::Copy { .. } | Step::Reduce { .. } => {
                    let (srcs, dsts) = step.regions();
                    let copy = matches!(step, Step::Copy { .. });
                    if srcs.is_empty() || dsts.is_empty() {
                        return Err(malformed(
                            r,
                            i,
                            "a data step without source or destination".into(),
                        ));
                    }
                    for (k, dst) in dsts.iter().enumerate() {
                        check_region(plan, r, i, dst)?;
                        if let Some(other) = dsts[..k].iter().find(|o| o.overlaps(dst)) {
                            return Err(malformed(
                                r,
                                i,
                                format!("writes {dst} and the overlapping {other} in one step"),
                            ));
                        }
                        for src in srcs {
                            check_region(plan, r, i, src)?;
                            if src.len != dst.len {
                                return Err(malformed(
                                    r,
                                    i,
                                    format!("moves {src} into {dst} of a different length"),
                                ));
                            }
                            // a reduction may run in place; a copy onto itself is a mistake
                            if src.overlaps(dst) && (copy || src != dst) {
                                return Err(malformed(
                                    r,
                                    i,
                                    format!("reads {src} while writing the overlapping {dst}"),
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    for (r, steps) in plan.steps.iter().enumerate() {
        for (i, step) in steps.iter().enumerate() {
            if let Step::Wait {
                slot,
                expected,
                cmp,
            } = step
            {
                let s = slot.row as usize * plan.pad_cols as usize + slot.col as usize;
                let total = inc[r][s];
                if *expected > total {
                    return Err(PlanError::Unsatisfiable {
                        rank: r,
                        step: i,
                        slot: *slot,
                        cmp: cmp.symbol(),
                        expected: *expected,
                        total,
                    });
                }
                // Notifies are positive, so the slot reaches its call total only after all of
                // them, and then holds it until the next call's notifies (the engine checks
                // those come after this wait). Any smaller value is held only for a while, in
                // some orders of the notifies, and a polling waiter may never see it.
                if *cmp == Cmp::Eq && *expected != total {
                    let why = match notifies[r][s] {
                        0 | 1 => format!(
                            "the slot holds {expected} only until its one notify (of {total}) arrives"
                        ),
                        n => format!(
                            "{expected} is a partial sum of its {n} notifies (total {total}), reached only in some orders of their arrival"
                        ),
                    };
                    return Err(PlanError::OrderDependent {
                        rank: r,
                        step: i,
                        what: format!(
                            "waits on slot {slot} for == {expected}, but {why}, and a polling waiter may miss it; wait for == {total} or use >="
                        ),
                    });
                }
            }
        }
    }
    Ok(inc)
}
