//! `commfuse calibrate`: fits the cost model's link bandwidth, signal latency and launch cost
//! to measured bench tables (our algorithms' rows), then reports the model's error per row.
//! The plans are rebuilt from each row with every parameter the bench recorded (op, algorithm,
//! world size, count, dtype, reduce op, root, NUMA groups), so the fit uses exactly the steps
//! the backend ran. The error that counts is on rows the fit did not see: the distinct sizes,
//! in order, alternate between two folds; each fold is predicted by the figures fitted on the
//! other.

use crate::bench::BenchReport;
use crate::driver::{self, Request};
use crate::sizes::format_size;
use anyhow::{bail, Result};
use commfuse_core::topology::LinkModel;
use commfuse_core::{Algo, CheckedPlan, Topology};

/// One measured row with its checked plan.
pub struct Sample {
    pub label: String,
    pub bytes: u64,
    pub measured_us: f64,
    /// 0 or 1: which half of the sizes (even- or odd-indexed) the row belongs to
    pub fold: usize,
    plan: CheckedPlan,
    topology: Topology,
    elem_bytes: usize,
}

impl Sample {
    pub fn predict(&self, model: LinkModel) -> f64 {
        self.plan
            .timing(&self.topology.clone().with_model(model), self.elem_bytes)
            .total_us()
    }

    /// The NUMA groups the row's plan was built for.
    pub fn numa_groups(&self) -> usize {
        self.topology.numa_groups
    }
}

/// Our algorithms' rows of `reports` with at least `min_bytes` (not the `auto` rows: they repeat
/// the row of the algorithm they picked).
pub fn samples(reports: &[BenchReport], min_bytes: u64) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for report in reports {
        for row in report
            .rows
            .iter()
            .filter(|r| !r.baseline && r.picked.is_none() && r.bytes >= min_bytes)
        {
            let Ok(algo) = row.algo.parse::<Algo>() else {
                continue;
            };
            let mut req = Request::new(report.op, algo, row.count, report.dtype);
            req.reduce = report.reduce;
            req.root = report.root;
            req.numa_groups = report.numa_groups;
            let (plan, topology) = driver::plan(&req, report.ranks)?;
            out.push(Sample {
                label: format!("{} {} P={}", report.op, row.algo, report.ranks),
                bytes: row.bytes,
                measured_us: row.time_us,
                fold: 0,
                plan,
                topology,
                elem_bytes: report.dtype.size(),
            });
        }
    }
    if out.is_empty() {
        bail!(
            "no rows of our algorithms at or above {} to calibrate on",
            format_size(min_bytes)
        );
    }
    let mut sizes: Vec<u64> = out.iter().map(|s| s.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for s in &mut out {
        s.fold = sizes.binary_search(&s.bytes).expect("a sample's size") % 2;
    }
    Ok(out)
}

fn loss(samples: &[&Sample], model: LinkModel) -> f64 {
    samples
        .iter()
        .map(|s| (s.predict(model) / s.measured_us).ln().powi(2))
        .sum()
}

/// Least squares on log relative error, by a grid search refined three times around the best.
pub fn fit(samples: &[Sample]) -> LinkModel {
    fit_refs(&samples.iter().collect::<Vec<_>>())
}

fn fit_refs(samples: &[&Sample]) -> LinkModel {
    let mut best = LinkModel::default();
    let mut best_loss = loss(samples, best);
    let (mut bw, mut lat, mut launch) = ((50.0, 800.0), (0.1, 10.0), (0.0, 30.0));
    for _ in 0..4 {
        let steps = 12;
        for i in 0..=steps {
            for j in 0..=steps {
                for k in 0..=steps {
                    let at =
                        |(lo, hi): (f64, f64), t: usize| lo + (hi - lo) * t as f64 / steps as f64;
                    let m = LinkModel {
                        link_gbps: at(bw, i),
                        latency_us: at(lat, j),
                        launch_us: at(launch, k),
                    };
                    let l = loss(samples, m);
                    if l < best_loss {
                        best_loss = l;
                        best = m;
                    }
                }
            }
        }
        let shrink = |(lo, hi): (f64, f64), c: f64, floor: f64| {
            let half = (hi - lo) / 6.0;
            ((c - half).max(floor), c + half)
        };
        bw = shrink(bw, best.link_gbps, 1.0);
        lat = shrink(lat, best.latency_us, 0.0);
        launch = shrink(launch, best.launch_us, 0.0);
    }
    best
}

/// The relative error of `model`'s prediction of `s`.
fn error(s: &Sample, model: LinkModel) -> f64 {
    (s.predict(model) - s.measured_us) / s.measured_us
}

/// Worst relative error of `model` over `samples`.
pub fn worst_error(samples: &[Sample], model: LinkModel) -> f64 {
    samples
        .iter()
        .map(|s| error(s, model).abs())
        .fold(0.0, f64::max)
}

/// The two-fold held-out check: each fold's rows predicted by the figures fitted on the other.
#[derive(Debug, Clone)]
pub struct HeldOut {
    /// The figures fitted on fold 0 (even-indexed sizes) and on fold 1
    pub fitted: [LinkModel; 2],
    /// Per sample: the relative error of the figures fitted without its fold
    pub errors: Vec<f64>,
}

impl HeldOut {
    pub fn worst(&self) -> f64 {
        self.errors.iter().map(|e| e.abs()).fold(0.0, f64::max)
    }

    pub fn mean(&self) -> f64 {
        self.errors.iter().map(|e| e.abs()).sum::<f64>() / self.errors.len() as f64
    }
}

/// Fits on each fold and predicts the other; needs rows at two sizes or more.
pub fn held_out(samples: &[Sample]) -> Result<HeldOut> {
    let fold = |f: usize| -> Vec<&Sample> { samples.iter().filter(|s| s.fold == f).collect() };
    let (even, odd) = (fold(0), fold(1));
    if even.is_empty() || odd.is_empty() {
        bail!("calibrate needs rows at two sizes or more: it fits on every other size and reports the error on the sizes between");
    }
    let fit_on = |part: &[&Sample]| fit_refs(part);
    let fitted = [fit_on(&even), fit_on(&odd)];
    let errors = samples
        .iter()
        .map(|s| error(s, fitted[1 - s.fold]))
        .collect();
    Ok(HeldOut { fitted, errors })
}

/// The per-row report: measured, predicted by `model`, its error, and with `held_out` the
/// error of the figures fitted without the row.
pub fn report(samples: &[Sample], model: LinkModel, held_out: Option<&HeldOut>) -> String {
    let mut out = format!(
        "# {:>8} {:<32} {:>12} {:>12} {:>8} {:>9}",
        "size", "op algo world", "measured µs", "model µs", "error", "held-out"
    );
    for (i, s) in samples.iter().enumerate() {
        out.push_str(&format!(
            "\n  {:>8} {:<32} {:>12.2} {:>12.2} {:>7.1}% {:>9}",
            format_size(s.bytes),
            s.label,
            s.measured_us,
            s.predict(model),
            100.0 * error(s, model),
            held_out.map_or("-".into(), |h| format!("{:.1}%", 100.0 * h.errors[i]))
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::BenchRow;
    use commfuse_core::{DType, OpKind, ReduceOp};

    /// Rows "measured" by the model itself with known figures must give those figures back.
    #[test]
    fn recovers_the_figures_that_made_the_data() {
        let truth = LinkModel {
            link_gbps: 300.0,
            latency_us: 3.0,
            launch_us: 8.0,
        };
        let mut rows = Vec::new();
        for (algo, shift) in [("ring", 0), ("one-shot", 1), ("two-phase", 2)] {
            for mb in [8u64, 64, 512] {
                let bytes = (mb << 20) >> shift;
                let count = (bytes / 2) as usize;
                let req =
                    Request::new(OpKind::AllReduce, algo.parse().unwrap(), count, DType::BF16);
                let (plan, topo) = driver::plan(&req, 4).unwrap();
                let t = plan.timing(&topo.with_model(truth), 2).total_us();
                rows.push(BenchRow {
                    algo: algo.into(),
                    bytes,
                    count,
                    dtype: DType::BF16,
                    time_us: t,
                    min_us: t,
                    max_us: t,
                    rounds: 1,
                    picked: None,
                    graph: false,
                    algbw_gbps: 0.0,
                    busbw_gbps: 0.0,
                    wrong: Some(0),
                    iterations: 1,
                    predicted_us: None,
                    baseline: false,
                });
            }
        }
        let report = BenchReport {
            op: OpKind::AllReduce,
            backend: "test".into(),
            ranks: 4,
            dtype: DType::BF16,
            reduce: ReduceOp::Sum,
            root: 0,
            numa_groups: 1,
            rows,
            skipped: Vec::new(),
        };
        let s = samples(&[report], 1 << 20).unwrap();
        let fitted = fit(&s);
        let worst = worst_error(&s, fitted);
        assert!(worst < 0.02, "worst error {worst}");
        let held = held_out(&s).unwrap();
        assert!(held.worst() < 0.02, "held-out error {}", held.worst());
        assert!((fitted.link_gbps - 300.0).abs() < 15.0, "{fitted:?}");
    }
}
