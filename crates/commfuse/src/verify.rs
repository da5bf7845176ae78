//! `commfuse verify`: the correctness matrix — every collective × algorithm × dtype × reduce op
//! × world size, on uneven and large sizes, [`CALLS`] calls each (one alone, the rest queued back
//! to back with new inputs), and every fused operator × path × type pair × world size on ragged
//! M ([`run_fused`]), all against the float64 reference.

use crate::backends::{self, BackendKind, Placement};
use crate::driver::{self, Request};
use anyhow::Result;
use commfuse_core::fused::ag_gemm::AgGemmConfig;
use commfuse_core::fused::gemm_rs::{GemmRsConfig, PathChoice};
use commfuse_core::fused::CallCheck;
use commfuse_core::gemm::BLayout;
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

/// One row of the matrix: an operator (a collective or a fused operator, by its command-line
/// name), its algorithm or path, and its types (the input type, or `input→output`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct MatrixRow {
    pub op: String,
    pub algo: String,
    pub dtype: String,
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
                    op: op.name().into(),
                    algo: algo.name().into(),
                    dtype: dtype.name().into(),
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

/// N and K of the fused operators' rows: neither a multiple of the GEMM's tiles, both
/// multiples of 8 (the GPU kernels' 16-byte row alignment of 16-bit operands).
pub const FUSED_N: usize = 136;
pub const FUSED_K: usize = 88;

/// The M of each of a fused row's back-to-back calls at world size `p`: uneven chunks, a
/// single row (most ranks' chunks empty), and more rows than one tile holds.
pub fn fused_ms(p: usize) -> Vec<usize> {
    vec![7 * p + 3, 1, 130 + p]
}

/// The fused operators' paths the matrix covers: GEMM + reduce-scatter by each path (the ring
/// whole and in two pieces), all-gather + GEMM by the library ring (whole, in two pieces) and
/// fused.
fn fused_cases() -> Vec<FusedCase> {
    use commfuse_core::fused::gemm_rs::GemmRsPath;
    vec![
        FusedCase::GemmRs(GemmRsPath::Fused),
        FusedCase::GemmRs(GemmRsPath::Overlapped { pieces: 1 }),
        FusedCase::GemmRs(GemmRsPath::Overlapped { pieces: 2 }),
        FusedCase::GemmRs(GemmRsPath::Unfused),
        FusedCase::AgGemm {
            pieces: 1,
            fused: false,
        },
        FusedCase::AgGemm {
            pieces: 2,
            fused: false,
        },
        FusedCase::AgGemm {
            pieces: 1,
            fused: true,
        },
    ]
}

/// The input and output types of the fused rows: 16-bit out in the input type, and f32 out.
const FUSED_TYPES: [(DType, DType); 2] = [(DType::BF16, DType::BF16), (DType::F16, DType::F32)];

#[derive(Debug, Clone, Copy)]
enum FusedCase {
    GemmRs(commfuse_core::fused::gemm_rs::GemmRsPath),
    AgGemm { pieces: usize, fused: bool },
}

impl FusedCase {
    fn op(self) -> &'static str {
        match self {
            FusedCase::GemmRs(_) => "gemm-rs",
            FusedCase::AgGemm { .. } => "ag-gemm",
        }
    }

    fn path(self) -> String {
        use commfuse_core::fused::gemm_rs::GemmRsPath;
        match self {
            FusedCase::GemmRs(GemmRsPath::Overlapped { pieces }) => format!("overlap/{pieces}"),
            FusedCase::GemmRs(path) => path.to_string(),
            FusedCase::AgGemm { fused: true, .. } => "fused".into(),
            FusedCase::AgGemm { pieces, .. } => format!("overlap/{pieces}"),
        }
    }

    /// Runs the calls of `ms` back to back at world size `p` on `placement`'s backend; the
    /// checks of every call.
    fn run(
        self,
        placement: &Placement,
        p: usize,
        (input, output): (DType, DType),
        (ms, b_layout, seed): (&[usize], BLayout, u64),
    ) -> Result<Vec<CallCheck>> {
        let max_m = ms.iter().copied().max().unwrap_or(1);
        let rs = GemmRsConfig {
            bias: true,
            timeout: placement.timeout,
            ..GemmRsConfig::new(max_m, FUSED_N, FUSED_K, b_layout, input, output)
        };
        let ag = AgGemmConfig {
            bias: true,
            timeout: placement.timeout,
            ..AgGemmConfig::new(max_m, FUSED_N, FUSED_K, b_layout, input, output)
        };
        let devices = placement
            .devices
            .as_ref()
            .map(|d| d[..p].to_vec())
            .or_else(|| (placement.backend == BackendKind::Cuda).then(|| (0..p).collect()));
        match (self, devices) {
            (FusedCase::GemmRs(path), devices) => {
                let config = GemmRsConfig {
                    path: PathChoice::Always(path),
                    ..rs
                };
                match devices {
                    None => crate::gemm_rs::run_sim(p, config, ms, seed),
                    Some(d) => Ok(crate::gemm_rs::run_cuda(&d, config, ms, seed)?.0),
                }
            }
            (FusedCase::AgGemm { pieces, fused }, devices) => {
                let config = AgGemmConfig {
                    pieces,
                    fused,
                    ..ag
                };
                match devices {
                    None => crate::ag_gemm::run_sim(p, config, ms, seed),
                    Some(d) => crate::ag_gemm::run_cuda(&d, config, ms, seed),
                }
            }
        }
    }
}

/// The fused operators' rows of the matrix (one per operator, path and type pair): at every
/// world size, the calls of [`fused_ms`] back to back with fresh inputs and a bias, B as
/// [N, K] at odd world sizes and [K, N] at even ones, every output element of every rank
/// against the float64 reference. `on_row` as for [`run`].
pub fn run_fused(
    placement: &Placement,
    worlds: &[usize],
    seed: u64,
    mut on_row: impl FnMut(&MatrixRow),
) -> Result<Vec<MatrixRow>> {
    let mut rows = Vec::new();
    for case in fused_cases() {
        for types in FUSED_TYPES {
            let mut row = MatrixRow {
                op: case.op().into(),
                algo: case.path(),
                dtype: format!("{}→{}", types.0.name(), types.1.name()),
                runs: 0,
                failures: 0,
                max_error: 0.0,
                first_failure: None,
            };
            for &p in worlds {
                let ms = fused_ms(p);
                let layout = if p % 2 == 0 { BLayout::KN } else { BLayout::NK };
                let run_seed = seed.wrapping_add(row.runs as u64);
                row.runs += 1;
                let failure = match case.run(placement, p, types, (&ms, layout, run_seed)) {
                    Ok(calls) => {
                        for call in &calls {
                            row.max_error = row.max_error.max(call.total().worst_ratio);
                        }
                        calls.iter().enumerate().find_map(|(c, call)| {
                            let bad = call.ranks.iter().position(|r| !r.passed())?;
                            Some(format!(
                                "P={p} M={} call {c} rank {bad}: {}",
                                call.m, call.ranks[bad]
                            ))
                        })
                    }
                    Err(e) => Some(format!("P={p}: {e:#}")),
                };
                if let Some(f) = failure {
                    row.failures += 1;
                    row.first_failure.get_or_insert(f);
                }
            }
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

pub fn format_row(row: &MatrixRow) -> String {
    format!(
        "  {:<15} {:<11} {:<9} {:>5} {:>7} {:>11.2e}  {}",
        row.op,
        row.algo,
        row.dtype,
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

    /// Every fused operator, path and type pair at P = 1..9 on the simulator: a row each, a
    /// run per world size, every call of every run within its bound.
    #[test]
    fn the_fused_rows_cover_every_path_at_every_world_size() {
        let placement = Placement {
            backend: BackendKind::Sim,
            ranks: 1,
            devices: None,
            timeout: Duration::from_secs(20),
        };
        let worlds: Vec<usize> = (1..=9).collect();
        let rows = run_fused(&placement, &worlds, 3, |_| {}).unwrap();
        assert_eq!(rows.len(), fused_cases().len() * FUSED_TYPES.len());
        for row in &rows {
            assert_eq!(row.runs, worlds.len(), "{row:?}");
            assert_eq!(row.failures, 0, "{row:?}");
            assert!(row.max_error > 0.0 && row.max_error <= 1.0, "{row:?}");
        }
        let paths: Vec<String> = rows
            .iter()
            .map(|r| format!("{} {}", r.op, r.algo))
            .collect();
        for want in [
            "gemm-rs fused",
            "gemm-rs unfused",
            "gemm-rs overlap/2",
            "ag-gemm fused",
        ] {
            assert!(paths.iter().any(|p| p == want), "{paths:?}");
        }
    }
}
