//! `commfuse bench`: a size sweep per algorithm in the nccl-tests format (size, count, type,
//! time, algbw, busbw, #wrong), the model's prediction beside it, and JSON for machines.
//! Time per size is the median over iterations of the slowest rank's time.

use crate::driver::{self, Request};
use crate::sizes::format_size;
use anyhow::Result;
use commfuse_core::backend::Backend;
use commfuse_core::cost::CostCard;
use commfuse_core::{Algo, DType, OpKind, ReduceOp};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub op: OpKind,
    pub algos: Vec<Algo>,
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
}

#[derive(Debug, Clone, serde::Serialize)]
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
    pub predicted_us: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
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

/// Runs the sweep; `on_row` sees each row as soon as it is measured.
pub fn run(
    backend: &dyn Backend,
    cfg: &BenchConfig,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<BenchReport> {
    let world = backend.world_size();
    let mut rows = Vec::new();
    for &bytes in &cfg.sizes {
        for &algo in &cfg.algos {
            let count = (bytes / cfg.dtype.size() as u64) as usize;
            let mut req = Request::new(cfg.op, algo, count, cfg.dtype);
            req.reduce = cfg.reduce;
            req.root = cfg.root;
            req.numa_groups = cfg.numa_groups;
            req.seed = driver::fresh_seed();
            let (checked, topology) = driver::plan(&req, world)?;
            let predicted_us = CostCard::of(&checked, &topology, cfg.dtype.size()).predicted_us;
            let spec = checked.plan().spec;
            let mut call = backend.prepare(&checked, cfg.dtype, cfg.reduce)?;
            driver::load(call.as_mut(), &spec, cfg.reduce, req.seed)?;
            for _ in 0..cfg.warmup {
                call.run()?;
            }
            let started = Instant::now();
            let mut times = Vec::with_capacity(cfg.iters);
            while times.len() < cfg.iters.max(1) {
                times.push(call.run()?.slowest());
                if started.elapsed() > cfg.budget {
                    break;
                }
            }
            let wrong = if cfg.check {
                Some(driver::compare(call.as_mut(), &spec, cfg.reduce, req.seed)?.wrong)
            } else {
                None
            };
            let iterations = times.len();
            let time = median(times).as_secs_f64();
            let algbw = if time > 0.0 {
                bytes as f64 / time / 1e9
            } else {
                0.0
            };
            let row = BenchRow {
                algo: algo.name().into(),
                bytes,
                count,
                dtype: cfg.dtype,
                time_us: time * 1e6,
                algbw_gbps: algbw,
                busbw_gbps: algbw * cfg.op.busbw_factor(world),
                wrong,
                iterations,
                predicted_us,
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

pub fn header(op: OpKind, backend: &str, ranks: usize, dtype: DType, reduce: ReduceOp) -> String {
    format!(
        "# commfuse bench {op}: backend {backend}, {ranks} ranks, {dtype}, reduce {reduce}\n#\n# {:>8} {:>12} {:>5} {:>10} {:>11} {:>11} {:>11} {:>7} {:>11}",
        "size", "count", "type", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "model(us)"
    )
}

pub fn format_row(row: &BenchRow) -> String {
    format!(
        "  {:>8} {:>12} {:>5} {:>10} {:>11.2} {:>11.2} {:>11.2} {:>7} {:>11.2}",
        format_size(row.bytes),
        row.count,
        row.dtype.name(),
        row.algo,
        row.time_us,
        row.algbw_gbps,
        row.busbw_gbps,
        row.wrong.map_or("-".into(), |w| w.to_string()),
        row.predicted_us
    )
}
