//! Plans broken on purpose, the way hand-written collectives break, must be rejected with a
//! message that names the rank, the step and the slot or range involved.

use commfuse_core::plan::PlanBuilder;
use commfuse_core::{
    build_plan, check, Algo, BufferKind, Cmp, NotifyOp, OpKind, OpSpec, Plan, PlanError, Region,
    Slot, Step, Topology,
};

#[derive(Clone, Copy, PartialEq, Debug)]
enum Bug {
    None,
    /// left = (r − 1) % P computed in signed arithmetic: −1 at rank 0
    NegativeModulo,
    /// every step's data signal in one slot
    SharedSlot,
    /// step t forwards chunk (r − t + 1) instead of (r − t)
    RotationOffByOne,
    /// "left" taken as (r + 1) % P, which is the left neighbour only when P = 2
    OnlyRightAtP2,
}

/// A hand-written ring all-gather, correct when `bug` is `None`.
fn ring_all_gather(p: usize, n: usize, bug: Bug) -> Plan {
    let spec = OpSpec::new(OpKind::AllGather, p, n, 0).unwrap();
    let mut b = PlanBuilder::new(spec);
    let ready = b.rows(2);
    let data = ready + 1;
    let chunk = |i: usize| commfuse_core::op::chunk_range(n, p, i);
    for r in 0..p {
        let right = (r + 1) % p;
        let left = match bug {
            Bug::NegativeModulo => ((r as i64 - 1) % p as i64) as usize,
            Bug::OnlyRightAtP2 => (r + 1) % p,
            _ => (r + p - 1) % p,
        };
        let mine = chunk(r);
        b.copy(
            r,
            Region::new(r, BufferKind::Input, 0..mine.len()),
            Region::new(r, BufferKind::Output, mine.clone()),
        );
        b.signal(r, left, Slot::new(ready, 0));
        b.wait(r, Slot::new(ready, 0), 1);
        for t in 0..p - 1 {
            let c = match bug {
                Bug::RotationOffByOne if t > 0 => chunk((r + p - t + 1) % p),
                _ => chunk((r + p - t) % p),
            };
            let col = |t: usize| if bug == Bug::SharedSlot { 0 } else { t as u32 };
            if t > 0 {
                b.wait(r, Slot::new(data, col(t - 1)), 1);
            }
            b.copy(
                r,
                Region::new(r, BufferKind::Output, c.clone()),
                Region::new(right, BufferKind::Output, c),
            );
            b.signal(r, right, Slot::new(data, col(t)));
        }
        if p > 1 {
            b.wait(
                r,
                Slot::new(
                    data,
                    if bug == Bug::SharedSlot {
                        0
                    } else {
                        p as u32 - 2
                    },
                ),
                1,
            );
        }
    }
    b.finish("hand-written ring")
}

fn rejected(plan: Plan) -> String {
    match check(plan) {
        Ok(_) => panic!("the broken plan passed the checker"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_correct_hand_written_ring_passes() {
    for p in 1..=9 {
        check(ring_all_gather(p, 10 * p + 3, Bug::None)).unwrap();
    }
}

#[test]
fn negative_modulo_at_rank_zero_is_rejected() {
    let msg = rejected(ring_all_gather(4, 40, Bug::NegativeModulo));
    assert!(msg.starts_with("rank 0 step 1:"), "{msg}");
    assert!(
        msg.contains("slot (row 0, col 0)") && msg.contains("peer 18446744073709551615"),
        "{msg}"
    );
}

#[test]
fn two_rounds_sharing_a_slot_are_rejected() {
    let msg = rejected(ring_all_gather(4, 40, Bug::SharedSlot));
    assert!(
        msg.contains("slot (row 1, col 0)") && msg.contains("twice in one call"),
        "{msg}"
    );
    assert!(msg.contains("step"), "{msg}");
}

#[test]
fn chunk_rotation_off_by_one_is_rejected() {
    let msg = rejected(ring_all_gather(4, 40, Bug::RotationOffByOne));
    // one chunk is forwarded twice and another never: its place stays poisoned
    assert!(
        msg.contains("rank 2 output[30] holds nothing written"),
        "{msg}"
    );
    assert!(
        msg.contains("should hold input element 0 of rank 3"),
        "{msg}"
    );
}

#[test]
fn a_ring_only_correct_at_p2_passes_at_2_and_fails_above() {
    check(ring_all_gather(2, 20, Bug::OnlyRightAtP2)).unwrap();
    for p in [3, 4, 5, 8] {
        let msg = rejected(ring_all_gather(p, 10 * p, Bug::OnlyRightAtP2));
        // the last rank never tells its real left neighbour that its output is free
        assert!(
            msg.contains("rank") && msg.contains("must first wait for a signal that rank"),
            "P={p}: {msg}"
        );
    }
}

/// Removes the steps of `plan` that match `pred`.
fn without(mut plan: Plan, pred: impl Fn(usize, &Step) -> bool) -> Plan {
    for (r, steps) in plan.steps.iter_mut().enumerate() {
        steps.retain(|s| !pred(r, s));
    }
    plan
}

fn real_plan(op: OpKind, algo: Algo, p: usize, n: usize) -> Plan {
    let spec = OpSpec::new(op, p, n, 0).unwrap();
    build_plan(spec, algo, &Topology::new(p, 1).unwrap()).unwrap()
}

#[test]
fn one_shot_without_exit_handshake_races_with_the_next_call() {
    // row 1 is the exit handshake: without it a fast rank rewrites its input for the next call
    // while a slow peer may still be reading it
    let plan = without(
        real_plan(OpKind::AllReduce, Algo::OneShot, 3, 30),
        |_, s| matches!(s, Step::Wait { slot, .. } | Step::Notify { slot, .. } if slot.row == 1),
    );
    // a fast rank 2 rewrites its input for call 1 while rank 0 still reads it in call 0
    let err = check(plan).unwrap_err();
    assert!(matches!(err, PlanError::Race { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("rank 0 step 4 (call 0)"), "{msg}");
    assert!(msg.contains("rank 2's caller before call 1"), "{msg}");
}

#[test]
fn one_shot_without_entry_handshake_reads_before_the_writer_signalled() {
    let plan = without(
        real_plan(OpKind::AllReduce, Algo::OneShot, 3, 30),
        |_, s| matches!(s, Step::Wait { slot, .. } | Step::Notify { slot, .. } if slot.row == 0),
    );
    let err = check(plan).unwrap_err().to_string();
    assert!(
        err.contains("rank 0 step 0") && err.contains("rank 1 input[0..30)"),
        "{err}"
    );
    assert!(err.contains("has not signalled"), "{err}");
}

#[test]
fn ring_without_slot_acks_overwrites_unread_scratch() {
    // row 2 carries the acks that let a rank reuse its right neighbour's receive slot
    let plan = without(
        real_plan(OpKind::AllReduce, Algo::Ring, 5, 50),
        |_, s| matches!(s, Step::Wait { slot, .. } | Step::Notify { slot, .. } if slot.row == 2),
    );
    let err = check(plan).unwrap_err();
    assert!(err.to_string().contains("scratch"), "{err}");
}

#[test]
fn waiting_on_a_slot_nobody_signals_is_rejected_before_running() {
    let spec = OpSpec::new(OpKind::Barrier, 3, 0, 0).unwrap();
    let mut b = PlanBuilder::new(spec);
    let row = b.rows(1);
    b.signal(0, 1, Slot::new(row, 0));
    b.wait(1, Slot::new(row, 0), 2);
    let err = check(b.finish("short")).unwrap_err().to_string();
    assert!(err.contains("only ever adds 1"), "{err}");
    let plan = real_plan(OpKind::Barrier, Algo::Ring, 3, 0);
    let mut plan = plan;
    plan.steps[1].insert(
        0,
        Step::Wait {
            slot: Slot::new(1, 0),
            expected: 1,
            cmp: commfuse_core::Cmp::Ge,
        },
    );
    let err = check(plan).unwrap_err().to_string();
    assert!(
        err.contains("rank 1 step 3") && err.contains("slot (row 1, col 0)"),
        "{err}"
    );
    assert!(err.contains("waited on twice"), "{err}");
}

#[test]
fn a_cycle_of_waits_is_a_deadlock_naming_every_blocked_rank() {
    // both ranks wait for the other before signalling
    let spec = OpSpec::new(OpKind::Barrier, 2, 0, 0).unwrap();
    let mut b = PlanBuilder::new(spec);
    let row = b.rows(1);
    for r in 0..2 {
        b.wait(r, Slot::new(row, 0), 1);
        b.signal(r, 1 - r, Slot::new(row, 0));
    }
    let err = check(b.finish("cycle")).unwrap_err().to_string();
    assert!(err.starts_with("deadlock"), "{err}");
    assert!(
        err.contains("rank 0 step 0 waits on slot (row 0, col 0)"),
        "{err}"
    );
    assert!(
        err.contains("rank 1 step 0 waits on slot (row 0, col 0)"),
        "{err}"
    );
}

#[test]
fn counting_an_input_twice_is_rejected_where_it_happens() {
    let mut plan = real_plan(OpKind::AllReduce, Algo::OneShot, 3, 12);
    for step in &mut plan.steps[2] {
        if let Step::Reduce { srcs, .. } = step {
            srcs[1] = srcs[0];
        }
    }
    let err = check(plan).unwrap_err().to_string();
    assert!(
        err.contains("rank 2 step") && err.contains("twice"),
        "{err}"
    );
}

#[test]
fn a_missing_contribution_is_a_wrong_result() {
    let mut plan = real_plan(OpKind::AllReduce, Algo::OneShot, 3, 12);
    for step in &mut plan.steps[1] {
        if let Step::Reduce { srcs, .. } = step {
            srcs.pop();
        }
    }
    let err = check(plan).unwrap_err().to_string();
    assert!(
        err.contains("rank 1 output[0]") && err.contains("ranks 0,1"),
        "{err}"
    );
}

#[test]
fn overlapping_regions_that_start_apart_are_rejected() {
    // rank 0 writes output[0..8) in one step and rank 1 reads output[4..8) of it: a lane of the
    // reader would need data another lane of the writer produced
    let spec = OpSpec::new(OpKind::AllReduce, 2, 8, 0).unwrap();
    let mut b = PlanBuilder::new(spec);
    let row = b.rows(1);
    b.copy(
        0,
        Region::new(0, BufferKind::Input, 0..8),
        Region::new(0, BufferKind::Output, 0..8),
    );
    b.signal(0, 1, Slot::new(row, 0));
    b.wait(1, Slot::new(row, 0), 1);
    b.copy(
        1,
        Region::new(0, BufferKind::Output, 4..8),
        Region::new(1, BufferKind::Output, 4..8),
    );
    let err = check(b.finish("misaligned")).unwrap_err().to_string();
    assert!(
        err.starts_with(
            "rank 1 step 1: rank 0 output[4..8) overlaps rank 0 output[0..8) (rank 0 step 0)"
        ),
        "{err}"
    );
}

/// A three-rank barrier-like plan: ranks 1 and 2 each add 1 to rank 0's slot (row 0, col 0),
/// rank 0 waits on it with `cmp expected`, then (if `release`) tells both it is done.
fn two_adders(cmp: Cmp, expected: u64, release: bool) -> Plan {
    let spec = OpSpec::new(OpKind::Barrier, 3, 0, 0).unwrap();
    let mut b = PlanBuilder::new(spec);
    let arrive = b.rows(2);
    let done = arrive + 1;
    for r in 1..3 {
        b.push(
            r,
            Step::Notify {
                peer: 0,
                slot: Slot::new(arrive, 0),
                value: 1,
                op: NotifyOp::Add,
            },
        );
    }
    b.push(
        0,
        Step::Wait {
            slot: Slot::new(arrive, 0),
            expected,
            cmp,
        },
    );
    if release {
        for r in 1..3 {
            b.signal(0, r, Slot::new(done, 0));
            b.wait(r, Slot::new(done, 0), 1);
        }
    }
    b.finish("two adders")
}

#[test]
fn an_eq_wait_on_the_total_of_several_adds_passes() {
    check(two_adders(Cmp::Eq, 2, true)).unwrap();
    check(two_adders(Cmp::Ge, 1, true)).unwrap();
}

#[test]
fn an_eq_wait_on_a_partial_sum_of_several_adds_is_rejected() {
    // the slot goes 0 → 1 → 2 in every order, but a waiter polling it may only ever see 0 and 2
    let err = check(two_adders(Cmp::Eq, 1, true)).unwrap_err();
    assert!(matches!(err, PlanError::OrderDependent { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("rank 0 step 0: waits on slot (row 0, col 0) for == 1"),
        "{msg}"
    );
    assert!(
        msg.contains("partial sum of its 2 notifies (total 2)"),
        "{msg}"
    );
}

#[test]
fn an_eq_wait_the_next_call_can_overtake_is_rejected() {
    // without the release, rank 1 may add for call 1 before rank 0 has seen 2 in call 0: the
    // slot goes to 3 and rank 0 waits for == 2 forever
    let err = check(two_adders(Cmp::Eq, 2, false)).unwrap_err();
    assert!(matches!(err, PlanError::OrderDependent { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("rank 1 step 0: (call 1) notifies slot (row 0, col 0) of rank 0"),
        "{msg}"
    );
    assert!(
        msg.contains("rank 0's wait on it (step 0, call 0)"),
        "{msg}"
    );
}

#[test]
fn a_wait_satisfied_by_either_of_two_adds_synchronises_with_neither() {
    // broadcast from rank 1 at P = 3: the root stores into rank 0's output and adds 1 to rank
    // 0's slot; rank 2 pulls from the root, but also adds 1 to that slot as soon as rank 0 lets
    // it go. Rank 0 waits for >= 1, so it may wake on rank 2's add before the root's data is
    // there. The old checker took the adds in its one schedule's order (the root's first) and
    // accepted the plan.
    let n = 4;
    let spec = OpSpec::new(OpKind::Broadcast, 3, n, 1).unwrap();
    let mut b = PlanBuilder::new(spec);
    let row = b.rows(1);
    let (ready, go, arrived, data, done) = (0, 1, 2, 3, 4);
    let slot = |col| Slot::new(row, col);
    let arrive = Step::Notify {
        peer: 0,
        slot: slot(arrived),
        value: 1,
        op: NotifyOp::Add,
    };
    let out = |r| Region::new(r, BufferKind::Output, 0..n);
    b.signal(0, 1, slot(ready));
    b.signal(0, 2, slot(go));
    b.wait(0, slot(arrived), 1);
    b.wait(1, slot(ready), 1);
    b.copy_to(
        1,
        Region::new(1, BufferKind::Input, 0..n),
        vec![out(1), out(0)],
    );
    b.push(1, arrive.clone());
    b.signal(1, 2, slot(data));
    b.wait(1, slot(done), 1);
    b.wait(2, slot(go), 1);
    b.push(2, arrive);
    b.wait(2, slot(data), 1);
    b.copy(2, out(1), out(2));
    b.signal(2, 1, slot(done));
    let err = check(b.finish("either add")).unwrap_err();
    assert!(matches!(err, PlanError::Race { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("rank 0's caller after call 0: reads rank 0 output[0..4), last written by rank 1 step 1 (call 0)"),
        "{msg}"
    );
    assert!(
        msg.contains(
            "rank 0's wait on it at step 2 (>= 1) can be satisfied by other notifies without it"
        ),
        "{msg}"
    );
}

#[test]
fn a_notify_of_zero_is_rejected() {
    // a wait passes with or without it, so whether the waiter synchronises with it is timing
    let mut plan = two_adders(Cmp::Ge, 2, true);
    plan.steps[2].insert(
        0,
        Step::Notify {
            peer: 0,
            slot: Slot::new(0, 0),
            value: 0,
            op: NotifyOp::Add,
        },
    );
    let err = check(plan).unwrap_err().to_string();
    assert_eq!(
        err,
        "rank 2 step 0: notifies slot (row 0, col 0) of rank 0 with value 0, which no wait can observe"
    );
}

/// Broadcast from rank 0 at P = 2 that stages the message in rank 1's input buffer (rank 1 has
/// no input of its own, but the symmetric buffer is there): rank 0 stores into it, rank 1
/// copies it to its output and says when it is done. With `entry`, rank 1 first tells rank 0
/// that its caller is done with that buffer.
fn staged_broadcast(entry: bool) -> Plan {
    let n = 4;
    let spec = OpSpec::new(OpKind::Broadcast, 2, n, 0).unwrap();
    let mut b = PlanBuilder::new(spec);
    let row = b.rows(1);
    let (ready, data, done) = (Slot::new(row, 0), Slot::new(row, 1), Slot::new(row, 2));
    let region = |r, buffer| Region::new(r, buffer, 0..n);
    if entry {
        b.signal(1, 0, ready);
        b.wait(0, ready, 1);
    }
    b.copy_to(
        0,
        region(0, BufferKind::Input),
        vec![region(0, BufferKind::Output), region(1, BufferKind::Input)],
    );
    b.signal(0, 1, data);
    b.wait(0, done, 1);
    b.wait(1, data, 1);
    b.copy(
        1,
        region(1, BufferKind::Input),
        region(1, BufferKind::Output),
    );
    b.signal(1, 0, done);
    b.finish("staged")
}

#[test]
fn writing_a_peers_input_before_its_caller_is_done_with_it_is_a_race() {
    // rank 1's caller writes its whole input buffer before every call (the old checker modelled
    // only the op's input, none at all for a broadcast receiver, and accepted this plan)
    check(staged_broadcast(true)).unwrap();
    let err = check(staged_broadcast(false)).unwrap_err();
    assert!(matches!(err, PlanError::Race { .. }), "{err}");
    let msg = err.to_string();
    assert_eq!(
        msg,
        "rank 1's caller before call 0: writes rank 1 input[0..4), last written by rank 0 step 0 (call 0), and no notify/wait orders that write before it (rank 0 must first wait for a signal that rank 1 sends in call 0, such as its notify at step 2, slot (row 0, col 2))"
    );
}
