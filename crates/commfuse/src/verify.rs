//! `commfuse verify`: the correctness matrix — every op × algorithm × dtype × reduce op × world
//! size, on uneven and large sizes, [`CALLS`] calls each (one alone, the rest queued back to back
//! with new inputs), against the float64 reference.

use crate::backends::{self, BackendKind, Placement};
use crate::driver::{self, Request};
use anyhow::Result;
use commfuse_core::{Algo, DType, OpKind, ReduceOp};

/// NUMA groups for a world of `p` ranks in the matrix: two when even, the smallest factor when
/// odd and composite, one when prime (a plain inner ring).
pub fn groups_for(p: usize) -> usize {
    if p.is_multiple_of(2) {
        return 2.min(p);
    }
    (3..p).find(|g| p.is_multiple_of(*g)).unwrap_or(1)
}

/// Calls per case: the first alone, the rest queued back to back without host synchronisation,
/// each on fresh inputs, every one checked.
pub const CALLS: usize = 4;

/// Elements per rank in the large counts. On GPUs: 1 MiB of bf16 per chunk, so that every lane
/// of plan.cu (64 KiB each) takes its vectorised paths, two 16-byte vectors per thread. The
/// simulator has no vector paths; its large count only needs several pieces per chunk.
pub fn large_chunk(backend: BackendKind) -> usize {
    match backend {
        BackendKind::Sim => 4096,
        BackendKind::Cuda => 1 << 19,
    }
}

/// Element counts tried at world size `p`: empty, fewer than P, uneven, a larger odd one, and
/// two large ones of about `large` per rank: chunks 16-byte aligned (P·large), and uneven.
pub fn counts_for(p: usize, seed: u64, large: usize) -> Vec<usize> {
    let odd = 1000 + (seed as usize % 997) * 2 + 1;
    vec![
        0,
        p.saturating_sub(1).max(1),
        3 * p + 1,
        odd,
        p * large,
        p * large + 2 * p - 1,
    ]
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct MatrixRow {
    pub op: OpKind,
    pub algo: String,
    pub dtype: DType,
    pub runs: usize,
    pub failures: usize,
    pub max_error: f64,
    pub first_failure: Option<String>,
}

/// The reduce ops the matrix covers for `op`: all of them where it reduces, else one.
fn reduces_for(op: OpKind) -> &'static [ReduceOp] {
    if op.reduces() {
        &ReduceOp::ALL
    } else {
        &[ReduceOp::Sum]
    }
}

/// The checked runs the matrix makes over `worlds` on `backend` (one per op, algorithm, type,
/// world size, reduce op and count): the length of [`run`]'s progress bar.
pub fn cases(worlds: &[usize], seed: u64, backend: BackendKind) -> usize {
    let per_world: usize = worlds
        .iter()
        .map(|&p| counts_for(p, seed ^ p as u64, large_chunk(backend)).len())
        .sum();
    OpKind::ALL
        .iter()
        .map(|&op| Algo::for_op(op).len() * DType::ALL.len() * reduces_for(op).len() * per_world)
        .sum()
}

/// Runs the matrix; `on_row` sees each (op, algo, dtype) row when it is done. A progress bar of
/// the runs made so far is drawn on stderr where that is a terminal; `on_row` runs with the bar
/// lifted, so that what it prints is not torn by it.
pub fn run(
    placement: &Placement,
    worlds: &[usize],
    seed: u64,
    mut on_row: impl FnMut(&MatrixRow),
) -> Result<Vec<MatrixRow>> {
    let total = cases(worlds, seed, placement.backend);
    let bar = crate::progress::bar(total as u64, "verify");
    let mut rows = Vec::new();
    for op in OpKind::ALL {
        for &algo in Algo::for_op(op) {
            for dtype in DType::ALL {
                let mut row = MatrixRow {
                    op,
                    algo: algo.name().into(),
                    dtype,
                    runs: 0,
                    failures: 0,
                    max_error: 0.0,
                    first_failure: None,
                };
                let reduces = reduces_for(op);
                for &p in worlds {
                    let at_p = Placement {
                        ranks: p,
                        devices: placement
                            .devices
                            .as_ref()
                            .map(|d| d[..p.min(d.len())].to_vec()),
                        ..placement.clone()
                    };
                    let mut backend = backends::open(&at_p)?;
                    for &reduce in reduces {
                        for count in counts_for(p, seed ^ p as u64, large_chunk(placement.backend))
                        {
                            let mut req = Request::new(op, algo, count, dtype);
                            req.reduce = reduce;
                            req.root = p / 2;
                            req.numa_groups = groups_for(p);
                            req.seed = seed.wrapping_add(row.runs as u64);
                            row.runs += 1;
                            let failure = match driver::run(backend.as_ref(), &req, CALLS, None) {
                                Ok(out) if out.comparison.ok() => {
                                    row.max_error = row.max_error.max(out.comparison.max_error);
                                    None
                                }
                                Ok(out) => Some(format!(
                                    "P={p} n={count} {reduce} call {}: {} wrong, first {:?}",
                                    out.call,
                                    out.comparison.wrong,
                                    out.comparison.mismatches.first()
                                )),
                                Err(e) => Some(format!("P={p} n={count} {reduce}: {e:#}")),
                            };
                            if let Some(f) = failure {
                                row.failures += 1;
                                row.first_failure.get_or_insert(f);
                                // a failed call leaves signal pads mid-protocol: start afresh
                                backend = backends::open(&at_p)?;
                            }
                            bar.inc(1);
                        }
                    }
                }
                bar.suspend(|| on_row(&row));
                rows.push(row);
            }
        }
    }
    bar.finish_and_clear();
    Ok(rows)
}

pub fn format_row(row: &MatrixRow) -> String {
    format!(
        "  {:<15} {:<11} {:<5} {:>5} {:>7} {:>10.2e}  {}",
        row.op.name(),
        row.algo,
        row.dtype.name(),
        row.runs,
        if row.failures == 0 {
            "OK".to_string()
        } else {
            format!("FAIL {}", row.failures)
        },
        row.max_error,
        row.first_failure.as_deref().unwrap_or("")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_progress_bar_is_as_long_as_the_runs_the_matrix_makes() {
        let placement = Placement {
            backend: BackendKind::Sim,
            ranks: 1,
            devices: None,
            timeout: Duration::from_secs(5),
        };
        let (worlds, seed) = ([1, 2], 7);
        let rows = run(&placement, &worlds, seed, |_| {}).unwrap();
        let runs: usize = rows.iter().map(|r| r.runs).sum();
        assert_eq!(cases(&worlds, seed, BackendKind::Sim), runs);
    }
}
