//! The collective suite, written once and stamped per backend (as candle stamps `_cpu` and
//! `_cuda`): every algorithm × dtype × reduce op at P ∈ {1, 2, 3, 4, 5, 7, 8} on uneven and large
//! sizes, four calls each (fresh inputs, poisoned outputs; the last three queued back to back
//! without host synchronisation), against the float64 reference.

use commfuse::backends::{self, BackendKind, Placement};
use commfuse::driver::{self, Request};
use commfuse::verify::{counts_for, groups_for, large_chunk, CALLS};
use commfuse_core::{Algo, DType, Implementation, OpKind, Protocol, ReduceOp};
use std::time::Duration;

const WORLDS: [usize; 7] = [1, 2, 3, 4, 5, 7, 8];

/// P ranks of `kind` with waits bounded at 20 s: on cuda the first P GPUs, or where there are
/// fewer (only under COMMFUSE_SHARE_GPUS=1, see `gpu_worlds`), the GPUs there are
/// round-robin, ranks sharing them.
fn suite_placement(kind: BackendKind, p: usize) -> Placement {
    let devices = match kind {
        BackendKind::Cuda => commfuse_cuda::sys::driver::device_count()
            .ok()
            .filter(|&n| n > 0 && n < p)
            .map(|n| (0..p).map(|r| r % n).collect()),
        BackendKind::Sim => None,
    };
    Placement {
        backend: kind,
        ranks: p,
        devices,
        timeout: Duration::from_secs(20),
    }
}

/// Runs every algorithm of `op` in the matrix on `kind` for the world sizes `worlds`; panics
/// with every failure listed.
fn matrix(kind: BackendKind, op: OpKind, worlds: &[usize]) {
    let mut failures = Vec::new();
    let mut runs = 0;
    let seed = driver::fresh_seed();
    for &p in worlds {
        let placement = suite_placement(kind, p);
        let mut backend = backends::open(&placement).expect("backend opens");
        for &algo in Algo::for_op(op) {
            for dtype in DType::ALL {
                let reduces: &[ReduceOp] = if op.reduces() {
                    &ReduceOp::ALL
                } else {
                    &[ReduceOp::Sum]
                };
                for &reduce in reduces {
                    for count in counts_for(p, seed ^ runs, large_chunk(kind)) {
                        runs += 1;
                        let mut req = Request::new(op, algo, count, dtype);
                        req.reduce = reduce;
                        req.root = (p - 1) / 2;
                        req.numa_groups = groups_for(p);
                        req.seed = seed.wrapping_add(runs);
                        let what = format!(
                            "{op} {algo} {dtype} {reduce} P={p} n={count} seed={}",
                            req.seed
                        );
                        match driver::run(backend.as_ref(), &req, CALLS, None) {
                            Ok(out) if out.comparison.ok() => {
                                // every defined output element of every rank was compared
                                let spec =
                                    commfuse_core::OpSpec::new(op, p, count, req.root).unwrap();
                                let defined: usize = (0..p).map(|r| spec.output_len(r)).sum();
                                assert_eq!(out.comparison.checked as usize, defined, "{what}");
                            }
                            Ok(out) => failures.push(format!(
                                "{what} call {}: {:?}",
                                out.call, out.comparison.mismatches
                            )),
                            Err(e) => {
                                failures.push(format!("{what}: {e:#}"));
                                backend = backends::open(&placement).unwrap();
                            }
                        }
                    }
                }
            }
        }
    }
    assert_none_failed(&failures, runs);
}

/// Panics with every failure listed, if any of the `runs` failed.
fn assert_none_failed(failures: &[String], runs: u64) {
    assert!(
        failures.is_empty(),
        "{} of {runs} runs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Stamps one test per op for a backend; `$worlds` gives the world sizes it can run here, or
/// why it cannot (printed, then the test passes as skipped).
macro_rules! backend_suite {
    ($suffix:ident, $kind:expr, $worlds:expr) => {
        mod $suffix {
            use super::*;

            fn run(op: OpKind) {
                let worlds: Result<Vec<usize>, String> = $worlds;
                match worlds {
                    Ok(worlds) => matrix($kind, op, &worlds),
                    Err(why) => commfuse_cuda::testing::skip(&format!(
                        "{} backend: {why}",
                        stringify!($suffix)
                    )),
                }
            }

            #[test]
            fn all_reduce() {
                run(OpKind::AllReduce)
            }
            #[test]
            fn reduce_scatter() {
                run(OpKind::ReduceScatter)
            }
            #[test]
            fn all_gather() {
                run(OpKind::AllGather)
            }
            #[test]
            fn broadcast() {
                run(OpKind::Broadcast)
            }
            #[test]
            fn all_to_all() {
                run(OpKind::AllToAll)
            }
            #[test]
            fn barrier() {
                run(OpKind::Barrier)
            }
        }
    };
}

backend_suite!(sim, BackendKind::Sim, Ok(WORLDS.to_vec()));

/// On a machine with GPUs: every world size up to the number of GPUs (at most 8), and up to 3
/// where ranks may share GPUs (`COMMFUSE_SHARE_GPUS=1`, see `commfuse_cuda::testing`).
fn gpu_worlds() -> Result<Vec<usize>, String> {
    let share = commfuse_cuda::testing::sharing_gpus();
    match commfuse_cuda::sys::driver::device_count() {
        Ok(0) => Err("no GPU on this machine".into()),
        Ok(n) if share => Ok((1..=n.clamp(3, 8)).collect()),
        Ok(n) => Ok((1..=n.min(8)).collect()),
        Err(e) => Err(e.to_string()),
    }
}

backend_suite!(cuda, BackendKind::Cuda, gpu_worlds());

/// Checks protocol `name` (`Backend::protocols`: LL, the copy engines) of backend `kind` for
/// `ops` on `worlds`, for every type and reduce op in `cases` (a reduce-scatter's chunks may
/// start inside a 4-byte word), for `counts` (odd counts of 2-byte types pad LL's last word):
/// four calls each, the last three queued back to back without host synchronisation, every
/// element against float64.
fn protocol_matrix(
    kind: BackendKind,
    protocol: Protocol,
    (ops, worlds): (&[OpKind], &[usize]),
    cases: &[(DType, ReduceOp)],
    counts: &[usize],
) {
    let mut failures = Vec::new();
    let seed = driver::fresh_seed();
    let mut runs = 0;
    for &p in worlds {
        let placement = suite_placement(kind, p);
        let mut backend = backends::open(&placement).expect("backend opens");
        for (&op, &(dtype, reduce)) in ops.iter().flat_map(|o| cases.iter().map(move |c| (o, c))) {
            for &count in counts {
                runs += 1;
                let mut req = Request::new(op, Algo::Ring, count, dtype);
                req.reduce = reduce;
                req.seed = seed.wrapping_add(runs);
                let what = format!(
                    "{protocol} {op} {dtype} {reduce} P={p} n={count} seed={}",
                    req.seed
                );
                match driver::run_named(
                    backend.as_ref(),
                    Implementation::Protocol(protocol),
                    &req,
                    CALLS,
                    None,
                ) {
                    Ok(out) if out.comparison.ok() => {
                        let c = out.comparison;
                        // every defined output element of every rank was compared
                        let spec = commfuse_core::OpSpec::new(op, p, count, 0).unwrap();
                        let defined: usize = (0..p).map(|r| spec.output_len(r)).sum();
                        assert_eq!(c.checked as usize, defined, "{what}")
                    }
                    Ok(out) => failures.push(format!(
                        "{what} call {}: {:?}",
                        out.call, out.comparison.mismatches
                    )),
                    Err(e) => {
                        failures.push(format!("{what}: {e:#}"));
                        backend = backends::open(&placement).unwrap();
                    }
                }
            }
        }
    }
    assert_none_failed(&failures, runs);
}

/// The GPU kernels (`commfuse_cuda::collective::ll`) in both line formats, LL and LL16:
/// all-reduce and reduce-scatter for every type and op, all-gather for every type (its chunks
/// too may start inside a word, or inside a 16-byte unit), on every world size the GPUs allow
/// (and up to P = 3 with ranks sharing GPUs under COMMFUSE_SHARE_GPUS=1).
#[test]
fn ll_all_reduce_on_gpus() {
    let worlds = match gpu_worlds() {
        Ok(w) => w,
        Err(why) => return commfuse_cuda::testing::skip(&format!("cuda backend: {why}")),
    };
    let cases: Vec<(DType, ReduceOp)> = DType::ALL
        .into_iter()
        .flat_map(|d| ReduceOp::ALL.into_iter().map(move |r| (d, r)))
        .collect();
    let counts = [1, 7, 1001, 4096, 65_537, 1 << 20];
    let ops = [OpKind::AllReduce, OpKind::ReduceScatter];
    let gathers: Vec<(DType, ReduceOp)> = DType::ALL.map(|d| (d, ReduceOp::Sum)).to_vec();
    for protocol in [Protocol::Ll, Protocol::Ll16] {
        protocol_matrix(
            BackendKind::Cuda,
            protocol,
            (&ops, &worlds),
            &cases,
            &counts,
        );
        protocol_matrix(
            BackendKind::Cuda,
            protocol,
            (&[OpKind::AllGather], &worlds),
            &gathers,
            &counts,
        );
    }
}

/// The copy-engine protocol (`commfuse_cuda::collective::ce`) on every world size the GPUs
/// allow: sums of every type and every op of bf16, from one element (most ranks' chunks empty)
/// to a ragged count whose chunks span two sub-chunks of the default 4 MiB (run with
/// `COMMFUSE_CE_SUB_BYTES=65536` the same counts span up to 64 sub-chunks, the last ones ragged
/// or empty); chunks that do not start on 16 bytes take the kernel's element-by-element path.
#[test]
fn ce_collectives_on_gpus() {
    let worlds = match gpu_worlds() {
        Ok(w) => w,
        Err(why) => return commfuse_cuda::testing::skip(&format!("cuda backend: {why}")),
    };
    let mut cases: Vec<(DType, ReduceOp)> = DType::ALL.map(|d| (d, ReduceOp::Sum)).to_vec();
    cases.extend([ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod].map(|r| (DType::BF16, r)));
    let counts = [1, 7, 1001, 65_537, 4_200_011];
    let ops = [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather];
    protocol_matrix(
        BackendKind::Cuda,
        Protocol::Ce,
        (&ops, &worlds),
        &cases,
        &counts,
    );
}

/// The simulator's twin (f32, `commfuse_sim::ll`: the all-reduce, and the reduce-scatter and
/// all-gather as the GPU kernel runs them) through the same checks at P = 1..9: counts below P
/// leave chunks empty, whose ranks must still keep their peers in step over the back-to-back
/// calls.
#[test]
fn ll_all_reduce_on_the_simulator() {
    let worlds: Vec<usize> = (1..=9).collect();
    protocol_matrix(
        BackendKind::Sim,
        Protocol::Ll,
        (
            &[OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather],
            &worlds,
        ),
        &[(DType::F32, ReduceOp::Sum)],
        &[1, 2, 7, 1001, 4099],
    );
}

/// The simulator's twin refuses what it does not compute, in one line.
#[test]
fn the_simulators_ll_refuses_other_types_and_ops() {
    let backend = backends::open(&Placement::sim(2, Duration::from_secs(5))).unwrap();
    let spec = commfuse_core::OpSpec::new(OpKind::AllReduce, 2, 16, 0).unwrap();
    for (dtype, reduce) in [(DType::BF16, ReduceOp::Sum), (DType::F32, ReduceOp::Max)] {
        let e = backend
            .prepare_baseline(Implementation::Protocol(Protocol::Ll), &spec, dtype, reduce)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("computes f32 sums"), "{e}");
    }
}

#[test]
fn a_corrupted_output_is_caught_by_the_reference() {
    // the comparison itself must be able to fail: flip one element after a correct run
    use commfuse_core::backend::HostSliceMut;
    let backend = backends::open(&Placement::sim(3, Duration::from_secs(5))).unwrap();
    let req = Request::new(OpKind::AllReduce, Algo::Ring, 100, DType::BF16);
    let (checked, _) = driver::plan(&req, 3).unwrap();
    let spec = checked.plan().spec;
    let mut call = backend.prepare(&checked, req.dtype, req.reduce).unwrap();
    driver::load(call.as_mut(), &spec, req.reduce, 7).unwrap();
    call.run().unwrap();
    assert!(driver::compare(call.as_mut(), &spec, req.reduce, 7)
        .unwrap()
        .ok());
    if let HostSliceMut::BF16(out) = call.output_mut(2) {
        out[17] = half::bf16::from_f32(out[17].to_f32() + 0.25);
    }
    let cmp = driver::compare(call.as_mut(), &spec, req.reduce, 7).unwrap();
    assert_eq!(cmp.wrong, 1);
    assert_eq!((cmp.mismatches[0].rank, cmp.mismatches[0].index), (2, 17));
}
