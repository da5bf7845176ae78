//! Collectives as operator objects on the simulator: every op, every algorithm and `auto`,
//! P = 1..5 and 8, f32 and bf16, sum and max; three calls back to back on each rank with fresh
//! inputs (and poisoned outputs) and no barrier between them, every output element of every
//! call against the float64 reference; bad calls refused in one line.

use commfuse_core::reference::{compare, fill_input};
use commfuse_core::{Algo, Element, OpKind, ReduceOp};
use commfuse_sim::collective::SimCollective;
use commfuse_sim::{World, WorldConfig};
use half::bf16;
use std::sync::Mutex;
use std::time::Duration;

fn world(p: usize) -> World {
    let config = WorldConfig {
        timeout: Duration::from_secs(20),
        ..WorldConfig::default()
    };
    World::new(p, config).unwrap()
}

/// Three back-to-back calls of one operator; returns the failures.
fn calls<T: Element>(
    p: usize,
    kind: OpKind,
    count: usize,
    algo: Option<Algo>,
    reduce: ReduceOp,
) -> Vec<String> {
    let w = world(p);
    let root = p / 2;
    let op = match SimCollective::<T>::new(&w, kind, count, (algo, reduce, root, 1)) {
        Ok(op) => op,
        // an algorithm that cannot run this world (e.g. a 2D ring without its groups)
        Err(e) if algo.is_some() => return vec![format!("skip: {e}")],
        Err(e) => return vec![format!("{kind} auto P={p} n={count}: {e}")],
    };
    let spec = *op.spec();
    let seeds = [11u64, 12, 13];
    let outs: Vec<Mutex<Vec<Vec<T>>>> = (0..p)
        .map(|r| Mutex::new(vec![vec![T::poison(); spec.output_len(r)]; seeds.len()]))
        .collect();
    let run = w.run(|ctx| {
        let r = ctx.rank();
        let mut outs = outs[r].lock().unwrap();
        for (c, &seed) in seeds.iter().enumerate() {
            let mut input = vec![T::from_f32(0.0); spec.input_len(r)];
            fill_input(seed, r, reduce, T::host_mut(&mut input));
            op.forward(ctx, &input, &mut outs[c])?;
        }
        Ok(())
    });
    let name = format!(
        "{kind} {:?} P={p} n={count} {} {reduce:?}",
        op.algo(),
        T::DTYPE
    );
    if let Err(e) = run {
        return vec![format!("{name}: {e}")];
    }
    let outs: Vec<Vec<Vec<T>>> = outs.into_iter().map(|o| o.into_inner().unwrap()).collect();
    let mut failures = Vec::new();
    for (c, &seed) in seeds.iter().enumerate() {
        let slices: Vec<_> = outs.iter().map(|o| T::host(&o[c])).collect();
        let cmp = compare(&spec, reduce, seed, &slices);
        if !cmp.ok() {
            failures.push(format!(
                "{name} call {c}: {} wrong of {}",
                cmp.wrong, cmp.checked
            ));
        }
    }
    failures
}

#[test]
fn every_op_and_algorithm_matches_the_reference_back_to_back() {
    let mut failures = Vec::new();
    let kinds = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::AllToAll,
    ];
    for p in [1, 2, 3, 5, 8] {
        for kind in kinds {
            for count in [1, 3 * p + 1, 1000] {
                let algos = Algo::for_op(kind).iter().map(|&a| Some(a)).chain([None]);
                for algo in algos {
                    failures.extend(calls::<f32>(p, kind, count, algo, ReduceOp::Sum));
                    if p <= 3 {
                        failures.extend(calls::<bf16>(p, kind, count, algo, ReduceOp::Max));
                    }
                }
            }
        }
    }
    failures.retain(|f| !f.starts_with("skip:"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn bad_calls_are_refused_in_one_line() {
    let w = world(2);
    let op =
        SimCollective::<f32>::new(&w, OpKind::AllReduce, 10, (None, ReduceOp::Sum, 0, 1)).unwrap();
    let e = w
        .run(|ctx| {
            let mut out = vec![0f32; 10];
            op.forward(ctx, &[1.0; 9], &mut out)
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("takes 10 input and 10 output elements here, got 9 and 10"),
        "{e}"
    );
    assert!(!e.contains('\n'));
    let other = world(2);
    let e = other
        .run(|ctx| op.forward(ctx, &[1.0; 10], &mut [0f32; 10]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("built for another world"), "{e}");
    let e = SimCollective::<f32>::new(
        &w,
        OpKind::AllReduce,
        10,
        (Some(Algo::Direct), ReduceOp::Sum, 0, 1),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("all-reduce"), "{e}");
}
