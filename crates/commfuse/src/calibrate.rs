//! `commfuse calibrate`: fits the cost model's link bandwidth, signal latency and launch cost
//! to measured bench tables (our algorithms' rows), then reports the model's error per row.
//! The plans are rebuilt from each row (op, algorithm, ranks, count), so the fit uses exactly
//! the steps the backend ran.

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
}

/// Our algorithms' rows of `reports` with at least `min_bytes`.
pub fn samples(reports: &[BenchReport], min_bytes: u64) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for report in reports {
        for row in report
            .rows
            .iter()
            .filter(|r| !r.baseline && r.bytes >= min_bytes)
        {
            let Ok(algo) = row.algo.parse::<Algo>() else {
                continue;
            };
            let mut req = Request::new(report.op, algo, row.count, report.dtype);
            req.reduce = report.reduce;
            let (plan, topology) = driver::plan(&req, report.ranks)?;
            out.push(Sample {
                label: format!("{} {}", report.op, row.algo),
                bytes: row.bytes,
                measured_us: row.time_us,
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
    Ok(out)
}

fn loss(samples: &[Sample], model: LinkModel) -> f64 {
    samples
        .iter()
        .map(|s| (s.predict(model) / s.measured_us).ln().powi(2))
        .sum()
}

/// Least squares on log relative error, by a grid search refined three times around the best.
pub fn fit(samples: &[Sample]) -> LinkModel {
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

/// The per-row report: measured, predicted, error.
pub fn report(samples: &[Sample], model: LinkModel) -> (String, f64) {
    let mut out = format!(
        "# {:>8} {:<26} {:>12} {:>12} {:>8}",
        "size", "op algo", "measured µs", "model µs", "error"
    );
    let mut worst: f64 = 0.0;
    for s in samples {
        let p = s.predict(model);
        let err = (p - s.measured_us) / s.measured_us;
        worst = worst.max(err.abs());
        out.push_str(&format!(
            "\n  {:>8} {:<26} {:>12.2} {:>12.2} {:>7.1}%",
            format_size(s.bytes),
            s.label,
            s.measured_us,
            p,
            100.0 * err
        ));
    }
    (out, worst)
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
        let (_, worst) = super::report(&s, fitted);
        assert!(worst < 0.02, "worst error {worst}");
        assert!((fitted.link_gbps - 300.0).abs() < 15.0, "{fitted:?}");
    }
}
