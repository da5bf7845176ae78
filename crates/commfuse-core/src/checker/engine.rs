//! The abstract executor behind the plan checker and the cost model.

use super::segments::{zip_pieces, Access, Conflict, Piece, SegMap, Val, Where};
use crate::error::PlanError;
use crate::plan::{BufferKind, Cmp, Plan, Region, Slot, Step};
use crate::topology::Topology;

/// Predicted finishing time of each rank for the first call, µs (launch cost included).
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    pub per_rank_us: Vec<f64>,
}

impl Timing {
    /// The call ends when its slowest rank does.
    pub fn total_us(&self) -> f64 {
        self.per_rank_us.iter().copied().fold(0.0, f64::max)
    }
}

/// One notify as a waiter observes it: the slot's running total after it, the value it added,
/// the notifier's vector clock, and when it arrives.
struct Notice {
    total: u64,
    value: u64,
    clock: Vec<u32>,
    arrival_us: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Start,
    Steps,
    End,
    Done,
}

struct RankState {
    phase: Phase,
    pc: usize,
    call: usize,
    clock: Vec<u32>,
    now_us: f64,
    /// Slot values at the start of the current call (the epoch base).
    base: Vec<u64>,
    first_call_end_us: f64,
}

pub(crate) struct Engine<'p> {
    plan: &'p Plan,
    increments: &'p [Vec<u64>],
    model: Option<(&'p Topology, usize)>,
    ranks: Vec<RankState>,
    memory: Vec<[SegMap; 3]>,
    pads: Vec<Vec<Vec<Notice>>>,
    totals: Vec<Vec<u64>>,
    /// `ordered_slots[r][s]`: rank r waits on slot s with `Eq`, or on a slot that several
    /// notifies reach in one call. The next call's notifies to such a slot must come after
    /// the wait: an `Eq` waiter could otherwise miss its value, and a waiter on several
    /// notifies could be satisfied by a notify of the next call in place of a missing one of
    /// this call. A slot with one notifier waited on with `>=` needs no such order (its
    /// notifies arrive in the notifier's program order), which is what lets epochs work.
    ordered_slots: Vec<Vec<Option<usize>>>,
    /// `wait_times[r][s][c]`: rank r's clock when its wait on an ordered slot s passed in call c.
    wait_times: Vec<Vec<Vec<u32>>>,
}

enum Progress {
    Advanced,
    Blocked,
}

impl<'p> Engine<'p> {
    pub(crate) fn new(
        plan: &'p Plan,
        increments: &'p [Vec<u64>],
        model: Option<(&'p Topology, usize)>,
    ) -> Self {
        let p = plan.world();
        let slots = plan.pad_rows as usize * plan.pad_cols as usize;
        let launch = model.map_or(0.0, |(t, _)| t.launch_us);
        Engine {
            plan,
            increments,
            model,
            ranks: (0..p)
                .map(|_| RankState {
                    phase: Phase::Start,
                    pc: 0,
                    call: 0,
                    clock: vec![0; p],
                    now_us: launch,
                    base: vec![0; slots],
                    first_call_end_us: 0.0,
                })
                .collect(),
            memory: (0..p)
                .map(|_| BufferKind::ALL.map(|k| SegMap::new(plan.buffers.get(k))))
                .collect(),
            pads: (0..p)
                .map(|_| (0..slots).map(|_| Vec::new()).collect())
                .collect(),
            totals: vec![vec![0; slots]; p],
            ordered_slots: ordered_slots(plan),
            wait_times: vec![vec![Vec::new(); slots]; p],
        }
    }

    /// Runs `calls` consecutive calls to completion.
    pub(crate) fn run(mut self, calls: usize) -> Result<Timing, PlanError> {
        let p = self.plan.world();
        loop {
            let mut advanced = false;
            for r in 0..p {
                advanced |= self.run_rank(r, calls)?;
            }
            if self.ranks.iter().all(|s| s.phase == Phase::Done) {
                break;
            }
            if !advanced {
                return Err(self.deadlock());
            }
        }
        Ok(Timing {
            per_rank_us: self.ranks.iter().map(|s| s.first_call_end_us).collect(),
        })
    }

    fn slot_index(&self, slot: Slot) -> usize {
        slot.row as usize * self.plan.pad_cols as usize + slot.col as usize
    }

    fn deadlock(&self) -> PlanError {
        let mut blocked = Vec::new();
        let mut call = 0;
        for (r, state) in self.ranks.iter().enumerate() {
            if let Some(Step::Wait {
                slot,
                expected,
                cmp,
            }) = self.plan.steps[r].get(state.pc)
            {
                if state.phase == Phase::Steps {
                    let s = self.slot_index(*slot);
                    call = state.call;
                    blocked.push(format!(
                        "rank {r} step {} waits on slot {slot} for {} {expected} but sees {}",
                        state.pc,
                        cmp.symbol(),
                        self.totals[r][s] - state.base[s]
                    ));
                }
            }
        }
        PlanError::Deadlock {
            call,
            blocked: blocked.join("; "),
        }
    }

    /// Advances rank `r` as far as it can; returns whether it moved at all.
    fn run_rank(&mut self, r: usize, calls: usize) -> Result<bool, PlanError> {
        let mut moved = false;
        loop {
            let state = &self.ranks[r];
            match state.phase {
                Phase::Done => return Ok(moved),
                Phase::Start => {
                    if state.call == calls {
                        self.ranks[r].phase = Phase::Done;
                        return Ok(moved);
                    }
                    self.caller_before(r)?;
                    self.ranks[r].phase = Phase::Steps;
                    self.ranks[r].pc = 0;
                }
                Phase::Steps => {
                    if state.pc == self.plan.steps[r].len() {
                        self.ranks[r].phase = Phase::End;
                        continue;
                    }
                    match self.step(r, state.pc)? {
                        Progress::Advanced => self.ranks[r].pc += 1,
                        Progress::Blocked => return Ok(moved),
                    }
                }
                Phase::End => {
                    self.caller_after(r)?;
                    let state = &mut self.ranks[r];
                    if state.call == 0 {
                        state.first_call_end_us = state.now_us;
                    }
                    for (b, inc) in state.base.iter_mut().zip(&self.increments[r]) {
                        *b += inc;
                    }
                    state.call += 1;
                    state.phase = Phase::Start;
                }
            }
            moved = true;
        }
    }

    fn tick(&mut self, r: usize, at: Where) -> Access {
        let state = &mut self.ranks[r];
        state.clock[r] += 1;
        Access {
            rank: r,
            at,
            time: state.clock[r],
        }
    }

    /// Rank r's caller before call `call`, on its stream after the previous call's kernel:
    /// it writes its whole input buffer (this call's data, then whatever lies past it) and
    /// its whole output buffer (poison: a later layer may reuse it). Scratch is the library's.
    fn caller_before(&mut self, r: usize) -> Result<(), PlanError> {
        let call = self.ranks[r].call;
        let access = self.tick(r, Where::CallerBefore(call));
        let (spec, buffers) = (self.plan.spec, self.plan.buffers);
        let input = Val::Sym {
            mask: 1 << r,
            elem: 0,
            call: call as u32,
        };
        let len = spec.input_len(r);
        self.write(
            r,
            Region::new(r, BufferKind::Input, 0..buffers.input),
            &[(len, input), (buffers.input - len, Val::Uninit)],
            access,
        )?;
        self.write(
            r,
            Region::new(r, BufferKind::Output, 0..buffers.output),
            &[(buffers.output, Val::Uninit)],
            access,
        )
    }

    /// Rank r's caller after call `call`: it reads its whole output buffer, which must hold
    /// the op's result where the op defines one.
    fn caller_after(&mut self, r: usize) -> Result<(), PlanError> {
        let call = self.ranks[r].call;
        let access = self.tick(r, Where::CallerAfter(call));
        let spec = self.plan.spec;
        let mut got = self.read(
            r,
            Region::new(r, BufferKind::Output, 0..self.plan.buffers.output),
            access,
        )?;
        truncate_pieces(&mut got, spec.output_len(r));
        let expected: Vec<Piece> = spec
            .expected_pieces(r)
            .into_iter()
            .map(|p| {
                let val = Val::Sym {
                    mask: p.mask,
                    elem: p.elem,
                    call: call as u32,
                };
                (p.len, val, None)
            })
            .collect();
        let mut index = 0;
        let got_with_writer = got.clone();
        zip_pieces(&[got, expected], |len, vals| {
            if vals[0] != vals[1] {
                let writer = writer_at(&got_with_writer, index)
                    .map(|w| format!(" (last written by {w})"))
                    .unwrap_or_default();
                return Err(PlanError::WrongResult {
                    call,
                    rank: r,
                    index,
                    what: format!(
                        "holds {} but should hold {}{writer}",
                        describe(vals[0]),
                        describe(vals[1])
                    ),
                });
            }
            index += len;
            Ok(())
        })
    }

    fn race(
        &self,
        r: usize,
        access: Access,
        region: Region,
        conflict: Conflict,
        verb: &str,
    ) -> PlanError {
        let what = match conflict {
            Conflict::Write(w) => format!(
                "{verb} {region}, last written by {w}, and no notify/wait orders that write before it{}",
                self.hint(w, r, access)
            ),
            Conflict::Read(rd) => format!(
                "overwrites {region} while {rd} may still be reading it: no notify/wait orders that read before this write{}",
                self.hint(rd, r, access)
            ),
        };
        PlanError::Race {
            location: access.to_string(),
            what,
        }
    }

    /// Names the slot through which `earlier` could have told rank `r`, about to access memory
    /// as `now`, that it was done.
    fn hint(&self, earlier: Access, r: usize, now: Access) -> String {
        let Where::Step {
            step: i,
            call: earlier_call,
        } = earlier.at
        else {
            return String::new();
        };
        if let Where::CallerBefore(call) = now.at {
            // the caller waits for nothing: the peer must wait for the rank to say, from
            // its steps of this call, that its caller is done with the buffer
            let q = earlier.rank;
            let candidate = self.plan.steps[r]
                .iter()
                .enumerate()
                .find_map(|(j, s)| match s {
                    Step::Notify { peer, slot, .. } if *peer == q => {
                        Some(format!(", such as its notify at step {j}, slot {slot}"))
                    }
                    _ => None,
                })
                .unwrap_or_default();
            return format!(
                " (rank {q} must first wait for a signal that rank {r} sends in call {call}{candidate})"
            );
        }
        self.plan.steps[earlier.rank]
            .iter()
            .enumerate()
            .skip(i + 1)
            .find_map(|(j, s)| match s {
                Step::Notify { peer, slot, .. } if *peer == r => {
                    let waited = self.plan.steps[r].iter().enumerate().find_map(|(k, w)| match w {
                        Step::Wait { slot: ws, expected, cmp } if ws == slot => {
                            Some((k, cmp.symbol(), *expected))
                        }
                        _ => None,
                    });
                    // a wait of the same call before the access that did not order the notify
                    let before = |k: usize| match now.at {
                        Where::Step { step, call } => call == earlier_call && k < step,
                        Where::CallerAfter(call) => call == earlier_call,
                        Where::CallerBefore(_) => false,
                    };
                    let why = match waited.filter(|w| before(w.0)) {
                        Some((k, cmp, expected)) => format!(
                            "rank {r}'s wait on it at step {k} ({cmp} {expected}) can be satisfied by other notifies without it"
                        ),
                        None => format!("rank {r} does not wait for it first"),
                    };
                    Some(format!(
                        " (rank {} notifies rank {r} at step {j}, slot {slot}, but {why})",
                        earlier.rank
                    ))
                }
                _ => None,
            })
            .unwrap_or_default()
    }

    fn read(&mut self, r: usize, region: Region, access: Access) -> Result<Vec<Piece>, PlanError> {
        let clock = self.ranks[r].clock.clone();
        let ordered = move |a: &Access| a.rank == r || clock[a.rank] >= a.time;
        let mem = &mut self.memory[region.rank][region.buffer.index()];
        match mem.read(region.range(), access, &ordered) {
            Ok(pieces) => Ok(pieces),
            Err(c) => Err(self.race(r, access, region, c, "reads")),
        }
    }

    fn write(
        &mut self,
        r: usize,
        region: Region,
        vals: &[(usize, Val)],
        access: Access,
    ) -> Result<(), PlanError> {
        let clock = self.ranks[r].clock.clone();
        let ordered = move |a: &Access| a.rank == r || clock[a.rank] >= a.time;
        let mem = &mut self.memory[region.rank][region.buffer.index()];
        match mem.write(region.range(), vals, access, &ordered) {
            Ok(()) => Ok(()),
            Err(c) => Err(self.race(r, access, region, c, "writes")),
        }
    }

    fn step(&mut self, r: usize, pc: usize) -> Result<Progress, PlanError> {
        let step = &self.plan.steps[r][pc];
        match step {
            Step::Wait {
                slot,
                expected,
                cmp,
            } => {
                let s = self.slot_index(*slot);
                let target = self.ranks[r].base[s] + expected;
                let notices = &self.pads[r][s];
                let Some(k) = notices.iter().position(|n| cmp.holds(n.total, target)) else {
                    return Ok(Progress::Blocked);
                };
                // This schedule's notices up to k satisfy the wait, but in another order a
                // different subset may: the waiter surely synchronises only with the notifies
                // without which the others cannot reach `expected` (all of them when it waits
                // for the call's total, the usual case).
                let total = self.increments[r][s];
                let state = &mut self.ranks[r];
                for n in &notices[..=k] {
                    if total - n.value < *expected {
                        for (c, o) in state.clock.iter_mut().zip(&n.clock) {
                            *c = (*c).max(*o);
                        }
                    }
                    state.now_us = state.now_us.max(n.arrival_us);
                }
                if self.ordered_slots[r][s].is_some() {
                    let call = state.call;
                    let access = self.tick(r, Where::Step { step: pc, call });
                    self.wait_times[r][s].push(access.time);
                }
                Ok(Progress::Advanced)
            }
            Step::Notify {
                peer, slot, value, ..
            } => {
                let (peer, value) = (*peer, *value);
                let s = self.slot_index(*slot);
                self.check_notify_order(r, pc, peer, *slot)?;
                self.tick(
                    r,
                    Where::Step {
                        step: pc,
                        call: self.ranks[r].call,
                    },
                );
                let latency = match self.model {
                    Some((t, _)) if peer != r => t.latency_us,
                    _ => 0.0,
                };
                self.totals[peer][s] += value;
                let notice = Notice {
                    total: self.totals[peer][s],
                    value,
                    clock: self.ranks[r].clock.clone(),
                    arrival_us: self.ranks[r].now_us + latency,
                };
                self.pads[peer][s].push(notice);
                Ok(Progress::Advanced)
            }
            Step::Copy { .. } | Step::Reduce { .. } => {
                let verb = if matches!(step, Step::Copy { .. }) {
                    "copies"
                } else {
                    "reduces"
                };
                let (srcs, dsts) = step.regions();
                let (srcs, dsts) = (srcs.to_vec(), dsts.to_vec());
                let access = self.tick(
                    r,
                    Where::Step {
                        step: pc,
                        call: self.ranks[r].call,
                    },
                );
                let mut lists = Vec::with_capacity(srcs.len());
                for src in &srcs {
                    lists.push(self.read(r, *src, access)?);
                }
                let vals = self.check_values(r, pc, &srcs, &lists, verb)?;
                for dst in &dsts {
                    self.write(r, *dst, &vals, access)?;
                }
                self.advance_time(r, &srcs, &dsts);
                Ok(Progress::Advanced)
            }
        }
    }

    /// Rejects a notify of call c ≥ 1 to an ordered slot (see `ordered_slots`) that is not
    /// ordered after the owner's wait on that slot in call c − 1.
    fn check_notify_order(
        &self,
        r: usize,
        pc: usize,
        peer: usize,
        slot: Slot,
    ) -> Result<(), PlanError> {
        let s = self.slot_index(slot);
        let call = self.ranks[r].call;
        let Some(wait_step) = self.ordered_slots[peer][s] else {
            return Ok(());
        };
        if call == 0 {
            return Ok(());
        }
        let waited = self.wait_times[peer][s].get(call - 1);
        if waited.is_some_and(|&t| self.ranks[r].clock[peer] >= t) {
            return Ok(());
        }
        let Step::Wait { expected, cmp, .. } = &self.plan.steps[peer][wait_step] else {
            unreachable!("ordered_slots points at waits");
        };
        let why = match cmp {
            Cmp::Eq => format!(
                "the slot may move past the == {expected} that wait looks for before it polls, and it would wait forever"
            ),
            Cmp::Ge => format!(
                "{} notifies reach that slot in one call, so the wait could be satisfied by this one while one of call {} is still missing",
                self.notifies_per_call(peer, s),
                call - 1
            ),
        };
        Err(PlanError::OrderDependent {
            rank: r,
            step: pc,
            what: format!(
                "(call {call}) notifies slot {slot} of rank {peer}, but no notify/wait orders rank {peer}'s wait on it (step {wait_step}, call {}) before this: {why}",
                call - 1
            ),
        })
    }

    fn notifies_per_call(&self, owner: usize, s: usize) -> usize {
        self.plan
            .steps
            .iter()
            .flatten()
            .filter(|step| matches!(step, Step::Notify { peer, slot, .. } if *peer == owner && self.slot_index(*slot) == s))
            .count()
    }

    /// Combines the values read by one step: all must be this call's data of the same elements
    /// from disjoint sets of ranks.
    fn check_values(
        &self,
        r: usize,
        pc: usize,
        srcs: &[Region],
        lists: &[Vec<Piece>],
        verb: &str,
    ) -> Result<Vec<(usize, Val)>, PlanError> {
        let call = self.ranks[r].call as u32;
        let mut out = Vec::new();
        let mut offset = 0;
        let bad = |what: String| PlanError::BadData {
            rank: r,
            step: pc,
            what: format!("(call {call}) {what}"),
        };
        zip_pieces(lists, |len, vals| {
            let mut acc: Option<(u64, usize)> = None;
            for (k, v) in vals.iter().enumerate() {
                let Val::Sym {
                    mask,
                    elem,
                    call: c,
                } = *v
                else {
                    return Err(bad(format!(
                        "{verb} {} at offset {offset}, which nothing has written yet in call {call}: its writer has not signalled it", srcs[k]
                    )));
                };
                if c != call {
                    return Err(bad(format!(
                        "{verb} {} at offset {offset}, which holds stale data of call {c} (this is call {call})", srcs[k]
                    )));
                }
                acc = Some(match acc {
                    None => (mask, elem),
                    Some((m, e)) => {
                        if e != elem {
                            return Err(bad(format!(
                                "{verb} input element {elem} ({}) with input element {e} at offset {offset}", srcs[k]
                            )));
                        }
                        if m & mask != 0 {
                            return Err(bad(format!(
                                "{verb} the contribution of {} twice at offset {offset} ({})",
                                ranks_of(m & mask),
                                srcs[k]
                            )));
                        }
                        (m | mask, e)
                    }
                });
            }
            let (mask, elem) = acc.expect("at least one source");
            out.push((len, Val::Sym { mask, elem, call }));
            offset += len;
            Ok(())
        })?;
        Ok(out)
    }

    fn advance_time(&mut self, r: usize, srcs: &[Region], dsts: &[Region]) {
        let Some((topology, elem_bytes)) = self.model else {
            return;
        };
        // each term is ns: bytes / (GB/s)
        // in f64: a byte count of a huge region must not overflow (a panic in debug builds)
        let cost = |region: &Region| {
            region.len as f64 * elem_bytes as f64 / topology.bandwidth(r, region.rank)
        };
        let (mut local, mut link) = (0.0, 0.0);
        for region in srcs.iter().chain(dsts) {
            if region.rank == r {
                local += cost(region);
            } else {
                link += cost(region);
            }
        }
        // Link and local memory work overlap within a step. Loads and stores share the link:
        // in a symmetric algorithm this rank's loads from a peer travel the same direction as
        // that peer's stores to this rank, so they add (measured: two-phase all-reduce, which
        // loads and stores at once, takes as long as the ring, which only stores).
        self.ranks[r].now_us += f64::max(link, local) / 1000.0;
    }
}

/// For every rank and slot, the step of the rank's wait on it if the next call's notifies must
/// come after that wait (see `Engine::ordered_slots`).
fn ordered_slots(plan: &Plan) -> Vec<Vec<Option<usize>>> {
    let slots = plan.pad_rows as usize * plan.pad_cols as usize;
    let index = |slot: Slot| slot.row as usize * plan.pad_cols as usize + slot.col as usize;
    let mut notifies = vec![vec![0usize; slots]; plan.world()];
    for step in plan.steps.iter().flatten() {
        if let Step::Notify { peer, slot, .. } = step {
            notifies[*peer][index(*slot)] += 1;
        }
    }
    let mut ordered = vec![vec![None; slots]; plan.world()];
    for (r, steps) in plan.steps.iter().enumerate() {
        for (i, step) in steps.iter().enumerate() {
            if let Step::Wait { slot, cmp, .. } = step {
                let s = index(*slot);
                if *cmp == Cmp::Eq || notifies[r][s] > 1 {
                    ordered[r][s] = Some(i);
                }
            }
        }
    }
    ordered
}

/// Cuts a piece list down to its first `len` elements.
fn truncate_pieces(pieces: &mut Vec<Piece>, len: usize) {
    let mut at = 0;
    pieces.retain_mut(|piece| {
        let keep = len.saturating_sub(at).min(piece.0);
        at += piece.0;
        piece.0 = keep;
        keep > 0
    });
}

fn writer_at(pieces: &[Piece], index: usize) -> Option<Access> {
    let mut at = 0;
    for (len, _, writer) in pieces {
        if index < at + len {
            return *writer;
        }
        at += len;
    }
    None
}

fn ranks_of(mask: u64) -> String {
    let ranks: Vec<String> = (0..64)
        .filter(|b| mask >> b & 1 == 1)
        .map(|b| b.to_string())
        .collect();
    format!(
        "rank{} {}",
        if ranks.len() == 1 { "" } else { "s" },
        ranks.join(",")
    )
}

fn describe(v: Val) -> String {
    match v {
        Val::Uninit => "nothing written in this call (poison)".into(),
        Val::Sym { mask, elem, call } => {
            format!(
                "input element {elem} of {} from call {call}",
                ranks_of(mask)
            )
        }
    }
}
