//! `commfuse bench`: a size sweep per algorithm in the nccl-tests format (size, count, type,
//! time, algbw, busbw, #wrong), the model's prediction beside it, and JSON for machines.
//! Time per size is the median over iterations of the slowest rank's time.

use crate::driver::{self, Request};
use crate::sizes::format_size;
use anyhow::Result;
use commfuse_core::backend::{Backend, PreparedCall};
use commfuse_core::cost::CostCard;
use commfuse_core::{Algo, DType, OpKind, ReduceOp};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub op: OpKind,
    pub algos: Vec<Algo>,
    /// Baselines of the backend to run beside (NCCL, copy engine)
    pub baselines: Vec<&'static str>,
    pub sizes: Vec<u64>,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub root: usize,
    pub numa_groups: usize,
    pub warmup: usize,
    pub iters: usize,
    /// Stop iterating a size once this much time went into it (at least one iteration runs).
    pub budget: Duration,
    pub check: bool,
    /// Time through captured graphs (launch overhead left out for us and the baselines)
    pub graph: bool,
    /// The cost model's link figures for the model column
    pub model: commfuse_core::topology::LinkModel,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BenchRow {
    pub algo: String,
    pub bytes: u64,
    pub count: usize,
    pub dtype: DType,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub wrong: Option<u64>,
    pub iterations: usize,
    /// The cost model's prediction (our algorithms only)
    pub predicted_us: Option<f64>,
    /// Whether this row is a baseline rather than one of our algorithms
    pub baseline: bool,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BenchReport {
    pub op: OpKind,
    pub backend: String,
    pub ranks: usize,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub rows: Vec<BenchRow>,
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// Warm-up, then timed calls in batches until `iters` are done or the budget is spent;
/// returns the slowest rank's time of each timed call.
fn measure(call: &mut dyn PreparedCall, cfg: &BenchConfig) -> Result<Vec<Duration>> {
    if cfg.warmup > 0 {
        call.run_many(cfg.warmup)?;
    }
    let started = Instant::now();
    let mut times = Vec::with_capacity(cfg.iters);
    while times.len() < cfg.iters.max(1) {
        let batch = (cfg.iters.max(1) - times.len()).min(BATCH);
        let timed = if cfg.graph {
            call.run_graph(batch)?
        } else {
            call.run_many(batch)?
        };
        times.extend(timed.iter().map(|t| t.slowest()));
        if started.elapsed() > cfg.budget {
            break;
        }
    }
    Ok(times)
}

/// Timed calls queued at once (a GPU backend launches a batch back to back).
const BATCH: usize = 50;

/// Runs the sweep; `on_row` sees each row as soon as it is measured.
pub fn run(
    backend: &dyn Backend,
    cfg: &BenchConfig,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<BenchReport> {
    let world = backend.world_size();
    let mut rows = Vec::new();
    for &bytes in &cfg.sizes {
        let count = (bytes / cfg.dtype.size() as u64) as usize;
        let seed = driver::fresh_seed();
        let candidates = cfg
            .algos
            .iter()
            .map(|a| (a.name(), Some(*a)))
            .chain(cfg.baselines.iter().map(|b| (*b, None)));
        for (name, algo) in candidates {
            let mut req = Request::new(
                cfg.op,
                algo.unwrap_or(Algo::for_op(cfg.op)[0]),
                count,
                cfg.dtype,
            );
            req.reduce = cfg.reduce;
            req.root = cfg.root;
            req.numa_groups = cfg.numa_groups;
            req.seed = seed;
            let (checked, topology) = driver::plan(&req, world)?;
            let spec = checked.plan().spec;
            let (mut call, predicted_us) = match algo {
                Some(_) => (
                    backend.prepare(&checked, cfg.dtype, cfg.reduce)?,
                    Some(
                        CostCard::of(&checked, &topology.with_model(cfg.model), cfg.dtype.size())
                            .predicted_us,
                    ),
                ),
                None => match backend.prepare_baseline(name, &spec, cfg.dtype, cfg.reduce) {
                    Ok(call) => (call, None),
                    // a baseline that cannot take this size (NCCL needs counts divisible by P)
                    Err(_) => continue,
                },
            };
            driver::load(call.as_mut(), &spec, cfg.reduce, seed)?;
            let times = measure(call.as_mut(), cfg)?;
            let wrong = if cfg.check {
                Some(driver::compare(call.as_mut(), &spec, cfg.reduce, seed)?.wrong)
            } else {
                None
            };
            drop(call);
            let iterations = times.len();
            let time = median(times).as_secs_f64();
            let algbw = if time > 0.0 {
                bytes as f64 / time / 1e9
            } else {
                0.0
            };
            let row = BenchRow {
                algo: name.into(),
                bytes,
                count,
                dtype: cfg.dtype,
                time_us: time * 1e6,
                algbw_gbps: algbw,
                busbw_gbps: algbw * cfg.op.busbw_factor(world),
                wrong,
                iterations,
                predicted_us,
                baseline: algo.is_none(),
            };
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(BenchReport {
        op: cfg.op,
        backend: backend.name().into(),
        ranks: world,
        dtype: cfg.dtype,
        reduce: cfg.reduce,
        rows,
    })
}

/// Per size: our fastest algorithm (the pick a tuned dispatcher would make from this table)
/// beside the fastest baseline.
pub fn best_table(report: &BenchReport) -> String {
    let mut out = format!(
        "#\n# best per size\n# {:>8} {:>10} {:>11} {:>11} {:>12} {:>11} {:>8}",
        "size", "ours", "time(us)", "busbw", "baseline", "busbw", "speedup"
    );
    let mut sizes: Vec<u64> = report.rows.iter().map(|r| r.bytes).collect();
    sizes.dedup();
    for bytes in sizes {
        let at = |baseline: bool| {
            report
                .rows
                .iter()
                .filter(|r| r.bytes == bytes && r.baseline == baseline && r.wrong.unwrap_or(0) == 0)
                .min_by(|a, b| a.time_us.total_cmp(&b.time_us))
        };
        let Some(ours) = at(false) else { continue };
        let (name, busbw, speedup) = match at(true) {
            Some(b) => (
                b.algo.as_str(),
                format!("{:.2}", b.busbw_gbps),
                format!("{:.2}x", b.time_us / ours.time_us),
            ),
            None => ("-", "-".into(), "-".into()),
        };
        out.push_str(&format!(
            "\n  {:>8} {:>10} {:>11.2} {:>11.2} {:>12} {:>11} {:>8}",
            format_size(bytes),
            ours.algo,
            ours.time_us,
            ours.busbw_gbps,
            name,
            busbw,
            speedup
        ));
    }
    out
}

pub fn header(op: OpKind, backend: &str, ranks: usize, dtype: DType, reduce: ReduceOp) -> String {
    format!(
        "# commfuse bench {op}: backend {backend}, {ranks} ranks, {dtype}, reduce {reduce}\n#\n# {:>8} {:>12} {:>5} {:>11} {:>11} {:>11} {:>11} {:>7} {:>11}",
        "size", "count", "type", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "model(us)"
    )
}

pub fn format_row(row: &BenchRow) -> String {
    format!(
        "  {:>8} {:>12} {:>5} {:>11} {:>11.2} {:>11.2} {:>11.2} {:>7} {:>11}",
        format_size(row.bytes),
        row.count,
        row.dtype.name(),
        row.algo,
        row.time_us,
        row.algbw_gbps,
        row.busbw_gbps,
        row.wrong.map_or("-".into(), |w| w.to_string()),
        row.predicted_us.map_or("-".into(), |p| format!("{p:.2}"))
    )
}
