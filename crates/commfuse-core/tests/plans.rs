//! Every algorithm's plan passes the checker for every world size from 1 to 16, on random
//! uneven sizes, and its cost card adds up.

use commfuse_core::cost::CostCard;
use commfuse_core::{build_plan, check, Algo, OpKind, OpSpec, Step, Topology};
use proptest::prelude::*;

fn all_pairs() -> Vec<(OpKind, Algo)> {
    OpKind::ALL
        .iter()
        .flat_map(|&op| Algo::for_op(op).iter().map(move |&a| (op, a)))
        .collect()
}

/// NUMA groups that divide `p` (ring-2d needs it), preferring 2.
fn groups_for(p: usize, algo: Algo, pick: usize) -> usize {
    if algo != Algo::Ring2d {
        return 1;
    }
    let divisors: Vec<usize> = (1..=p).filter(|g| p.is_multiple_of(*g)).collect();
    divisors[pick % divisors.len()]
}

fn check_one(op: OpKind, algo: Algo, p: usize, n: usize, root: usize, groups: usize) {
    let spec = OpSpec::new(op, p, n, root % p).unwrap();
    let topo = Topology::new(p, groups).unwrap();
    let plan = build_plan(spec, algo, &topo).unwrap();
    let checked = check(plan).unwrap_or_else(|e| panic!("{op} {algo} P={p} n={n} G={groups}: {e}"));
    let card = CostCard::of(&checked, &topo, 4);
    let sent: u64 = card.per_rank.iter().map(|c| c.bytes_sent).sum();
    let recv: u64 = card.per_rank.iter().map(|c| c.bytes_received).sum();
    assert!(
        sent <= recv,
        "every byte sent over a link is received once or more"
    );
    assert!(card.predicted_us > 0.0);
    // every wait knows the one rank whose notify it awaits (the peer a timeout names)
    let steps = &checked.plan().steps;
    for (r, mine) in steps.iter().enumerate() {
        for step in mine {
            let Step::Wait { slot, expected, .. } = step else {
                continue;
            };
            let notifiers: Vec<usize> = (0..p)
                .filter(|&q| {
                    steps[q].iter().any(
                        |s| matches!(s, Step::Notify { peer, slot: ns, .. } if *peer == r && ns == slot),
                    )
                })
                .collect();
            let want = if *expected == 0 {
                None
            } else {
                Some(notifiers[0])
            };
            assert!(
                notifiers.len() <= 1,
                "{op} {algo} P={p}: slot {slot} of rank {r} has notifiers {notifiers:?}"
            );
            assert_eq!(
                checked.notifier(r, *slot),
                want,
                "{op} {algo} P={p} n={n}: rank {r} slot {slot}"
            );
        }
    }
}

#[test]
fn every_algorithm_passes_for_p_1_to_16() {
    for (op, algo) in all_pairs() {
        for p in 1..=16usize {
            for n in [0, 1, p.saturating_sub(1), 3 * p + 1, 257] {
                check_one(op, algo, p, n, p / 2, groups_for(p, algo, p));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_uneven_sizes_pass(idx in 0usize..64, p in 1usize..=16, n in 0usize..5000, root in 0usize..16, pick in 0usize..8) {
        let pairs = all_pairs();
        let (op, algo) = pairs[idx % pairs.len()];
        check_one(op, algo, p, n, root, groups_for(p, algo, pick));
    }
}

#[test]
fn ring_2d_rejects_groups_that_do_not_divide() {
    let spec = OpSpec::new(OpKind::AllReduce, 6, 100, 0).unwrap();
    let err = build_plan(spec, Algo::Ring2d, &Topology::new(6, 4).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("multiple of the NUMA group count"),
        "{err}"
    );
    // typed, so that callers tell "not on this world size" from a failure
    assert!(
        matches!(err, commfuse_core::Error::NotForWorld(_)),
        "{err:?}"
    );
    let backend = commfuse_core::backend::BackendError::from(err.clone());
    assert_eq!(
        backend,
        commfuse_core::backend::BackendError::NotForWorld(err.to_string())
    );
    let other = commfuse_core::Error::Unsupported("no".into());
    assert_eq!(
        commfuse_core::backend::BackendError::from(other),
        commfuse_core::backend::BackendError::Unavailable("no".into())
    );
}

#[test]
fn large_plans_check_fast() {
    // the checker works on segments: 16 Mi elements cost what 16 do
    let spec = OpSpec::new(OpKind::AllReduce, 8, 16 << 20, 0).unwrap();
    let plan = build_plan(spec, Algo::Ring, &Topology::new(8, 1).unwrap()).unwrap();
    let t = std::time::Instant::now();
    check(plan).unwrap();
    assert!(t.elapsed().as_secs() < 5);
}

#[test]
fn ring_scratch_is_two_chunks() {
    let spec = OpSpec::new(OpKind::AllReduce, 4, 1000, 0).unwrap();
    let plan = build_plan(spec, Algo::Ring, &Topology::new(4, 1).unwrap()).unwrap();
    assert_eq!(plan.buffers.scratch, 2 * 250);
}

/// The pipelined push reduce-scatter goes in stages: two for any chunk of two grains (64
/// elements) or more, up to eight for large chunks (ragged), each stage one reduction per rank
/// after its own signals; every such plan passes the checker.
#[test]
fn the_pipelined_push_reduces_stage_by_stage() {
    use commfuse_core::algorithms::{PIPELINE_STAGES_MAX, PIPELINE_STAGE_MIN};
    use commfuse_core::Step;
    let cases = [
        (2, 256, 2),
        (3, 3 * 130 + 1, 2),
        (2, 2 * 3 * PIPELINE_STAGE_MIN, 3),
        (3, 3 * 8 * PIPELINE_STAGE_MIN + 5, PIPELINE_STAGES_MAX),
        (8, 8 * 100 * PIPELINE_STAGE_MIN, PIPELINE_STAGES_MAX),
    ];
    for (p, n, stages) in cases {
        let spec = OpSpec::new(OpKind::ReduceScatter, p, n, 0).unwrap();
        let plan = build_plan(spec, Algo::PushPipelined, &Topology::new(p, 1).unwrap()).unwrap();
        for (r, steps) in plan.steps.iter().enumerate() {
            let reduces = steps
                .iter()
                .filter(|s| matches!(s, Step::Reduce { .. }))
                .count();
            assert_eq!(reduces, stages, "P={p} n={n} rank {r}");
        }
        check(plan).unwrap_or_else(|e| panic!("P={p} n={n}: {e}"));
    }
}
