//! `commfuse bench`: a size sweep in the nccl-tests format (size, count, type, time, algbw,
//! busbw, #wrong), the model's prediction beside it, and JSON for machines.
//!
//! At each size every candidate (our algorithms, the cost model's pick, the backend's
//! baselines) is prepared once, then they take turns in [`ROUNDS`] rounds, so that a drift of
//! the machine (clocks, temperature, a neighbour's load) falls on all of them alike. A round
//! times a few calls of one candidate and keeps their median; a row's time is the median of its
//! rounds' medians and its spread their minimum and maximum. A call's time is its slowest
//! rank's.

use crate::driver::{self, Request};
use crate::sizes::format_size;
use anyhow::Result;
use commfuse_core::backend::{Backend, PreparedCall};
use commfuse_core::cost::{choose_algo, CostCard};
use commfuse_core::rounds;
use commfuse_core::{
    Algo, Baseline, CheckedPlan, DType, Implementation, OpKind, OpSpec, Protocol, ReduceOp,
    Topology,
};
use commfuse_sim::memory::{Footprint, REFERENCE_BLOCK_BYTES};
use std::time::{Duration, Instant};

/// Rounds in which the candidates of one size take turns.
pub use commfuse_core::rounds::ROUNDS;

/// What to measure and how.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub op: OpKind,
    /// Our algorithms with a row each
    pub algos: Vec<Algo>,
    /// Add the `auto` row: at each size, the algorithm the cost model (with `model`'s figures)
    /// predicts fastest, which is what `--algo auto` (the default) runs
    pub auto: bool,
    /// Baselines of the backend to run beside (NCCL, copy engine)
    pub baselines: Vec<Baseline>,
    /// Our implementations beyond the plans to time beside them ([`Backend::protocols`])
    pub protocols: Vec<Protocol>,
    pub sizes: Vec<u64>,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub root: usize,
    pub numa_groups: usize,
    /// Untimed calls before the first round (and up to one before each later round)
    pub warmup: usize,
    /// Timed calls per size and candidate, spread over the rounds (at least one per round)
    pub iters: usize,
    /// A round ends early once it took this budget's share (at least one call runs).
    pub budget: Duration,
    pub check: bool,
    /// Time through captured graphs (launch overhead left out for us and the baselines)
    pub graph: bool,
    /// The cost model's link figures for the model column and the `auto` pick
    pub model: commfuse_core::topology::LinkModel,
}

/// One measured row.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BenchRow {
    /// Our algorithm, a baseline's name, or `auto`
    pub algo: String,
    /// For the `auto` row: the algorithm the cost model picked (the row's figures are its)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub picked: Option<String>,
    pub bytes: u64,
    pub count: usize,
    pub dtype: DType,
    /// Median of the rounds' medians, µs
    pub time_us: f64,
    /// The fastest round's median, µs
    pub min_us: f64,
    /// The slowest round's median, µs
    pub max_us: f64,
    pub rounds: usize,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub wrong: Option<u64>,
    /// Timed calls over all rounds
    pub iterations: usize,
    /// The cost model's prediction (our algorithms only)
    pub predicted_us: Option<f64>,
    /// Whether this row is a baseline rather than one of our algorithms
    pub baseline: bool,
    /// Whether the timed calls were replayed from a captured graph (`--graph`, where the
    /// backend can capture this candidate)
    pub graph: bool,
}

/// A baseline that could not run at a size, and why.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Skipped {
    pub baseline: String,
    pub bytes: u64,
    pub reason: String,
}

/// A whole sweep, with every parameter the plans were built from, so that `calibrate` rebuilds
/// exactly the plans that ran.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BenchReport {
    pub op: OpKind,
    pub backend: String,
    /// World size
    pub ranks: usize,
    pub dtype: DType,
    pub reduce: ReduceOp,
    /// Root rank (broadcast)
    pub root: usize,
    /// NUMA groups of consecutive ranks (ring-2d)
    pub numa_groups: usize,
    pub rows: Vec<BenchRow>,
    /// Baselines that did not run, per size
    #[serde(default)]
    pub skipped: Vec<Skipped>,
}

/// What [`run`] reports as it goes.
pub enum Progress<'a> {
    /// A measured row
    Row(&'a BenchRow),
    /// A baseline that could not run at a size
    Skipped(&'a Skipped),
}

/// One prepared candidate of a size and its per-round medians.
struct Candidate<'b> {
    name: String,
    algo: Option<Algo>,
    /// A baseline (not ours)
    baseline: bool,
    call: Box<dyn PreparedCall + 'b>,
    spec: OpSpec,
    predicted_us: Option<f64>,
    round_medians: Vec<Duration>,
    iterations: usize,
}

/// One round of `c`: warm-up, then timed calls in batches until `per_round` are done or the
/// round's budget is spent.
fn measure_round(
    c: &mut Candidate<'_>,
    cfg: &BenchConfig,
    round: usize,
    per_round: usize,
) -> Result<()> {
    let warmup = rounds::warmup_of(round, cfg.warmup);
    if warmup > 0 {
        c.call.run_many(warmup)?;
    }
    let budget = cfg.budget / ROUNDS as u32;
    let started = Instant::now();
    let mut times = Vec::with_capacity(per_round);
    while times.len() < per_round {
        let batch = (per_round - times.len()).min(BATCH);
        let timed = if cfg.graph {
            c.call.run_graph(batch)?
        } else {
            c.call.run_many(batch)?
        };
        times.extend(timed.iter().map(|t| t.slowest()));
        if started.elapsed() > budget {
            break;
        }
    }
    c.iterations += times.len();
    c.round_medians
        .push(rounds::median(&mut times).expect("a round times at least one call"));
    Ok(())
}

/// Timed calls queued at once (a GPU backend launches a batch back to back).
const BATCH: usize = 50;

/// The op at `bytes` on `world` ranks, the cost model's pick (with `auto`), and the checked
/// plans of our algorithms there (those asked for and the pick, measured once even when it
/// also has a row of its own).
#[allow(clippy::type_complexity)]
fn ours_at(
    cfg: &BenchConfig,
    world: usize,
    bytes: u64,
) -> Result<(OpSpec, Option<Algo>, Vec<(Algo, (CheckedPlan, Topology))>)> {
    let count = (bytes / cfg.dtype.size() as u64) as usize;
    let spec = OpSpec::new(cfg.op, world, count, cfg.root)?;
    let picked = if cfg.auto {
        let topology = Topology::new(world, cfg.numa_groups)?.with_model(cfg.model);
        Some(choose_algo(spec, &topology, cfg.dtype.size())?.algo)
    } else {
        None
    };
    let mut ours = cfg.algos.clone();
    if let Some(p) = picked.filter(|p| !ours.contains(p)) {
        ours.push(p);
    }
    let plans = ours
        .into_iter()
        .map(|algo| {
            let mut req = Request::new(cfg.op, algo, count, cfg.dtype);
            req.reduce = cfg.reduce;
            req.root = cfg.root;
            req.numa_groups = cfg.numa_groups;
            Ok((algo, driver::plan(&req, world)?))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((spec, picked, plans))
}

/// What our candidates at `bytes` hold together (all are prepared before any runs), and the
/// reference check's blocks.
fn memory_of(
    backend: &dyn Backend,
    cfg: &BenchConfig,
    world: usize,
    bytes: u64,
    plans: &[(Algo, (CheckedPlan, Topology))],
) -> Footprint {
    let what = format!(
        "bench {} at {} on {world} ranks",
        cfg.op,
        format_size(bytes)
    );
    plans.iter().fold(
        Footprint::new(what).item(&[REFERENCE_BLOCK_BYTES]),
        |f, (_, (checked, _))| f.add_bytes(backend.host_bytes(checked, cfg.dtype)),
    )
}

/// Runs the sweep; `on_progress` sees each row and each skipped baseline as soon as known. A
/// progress bar of the rounds measured (every size's [`ROUNDS`]) is drawn on stderr where that
/// is a terminal, advanced between rounds so that its drawing falls outside every timed call;
/// `on_progress` runs with the bar lifted, so that what it prints is not torn by it.
pub fn run(
    backend: &dyn Backend,
    cfg: &BenchConfig,
    mut on_progress: impl FnMut(Progress<'_>),
) -> Result<BenchReport> {
    let bar = crate::progress::bar(
        (cfg.sizes.len() * ROUNDS) as u64,
        &format!("bench {}", cfg.op),
    );
    let mut on_progress = |progress: Progress<'_>| bar.suspend(|| on_progress(progress));
    let world = backend.world_size();
    let per_round = rounds::calls_per_round(cfg.iters);
    // every size is known to fit before the first is measured
    for &bytes in &cfg.sizes {
        let (_, _, plans) = ours_at(cfg, world, bytes)?;
        memory_of(backend, cfg, world, bytes, &plans).check()?;
    }
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for &bytes in &cfg.sizes {
        let count = (bytes / cfg.dtype.size() as u64) as usize;
        let seed = driver::fresh_seed();
        let (spec, picked, plans) = ours_at(cfg, world, bytes)?;
        let mut memory = memory_of(backend, cfg, world, bytes, &plans);
        let mut candidates = Vec::new();
        for (algo, (checked, topology)) in plans {
            let predicted =
                CostCard::of(&checked, &topology.with_model(cfg.model), cfg.dtype.size())
                    .predicted_us;
            candidates.push(Candidate {
                name: algo.name().into(),
                algo: Some(algo),
                baseline: false,
                call: backend.prepare(&checked, cfg.dtype, cfg.reduce)?,
                spec: checked.plan().spec,
                predicted_us: Some(predicted),
                round_medians: Vec::new(),
                iterations: 0,
            });
        }
        let protocols = cfg.protocols.iter().map(|&p| Implementation::Protocol(p));
        let baselines = cfg.baselines.iter().map(|&b| Implementation::Baseline(b));
        for which in protocols.chain(baselines) {
            let (name, baseline) = (which.name(), matches!(which, Implementation::Baseline(_)));
            let with = memory
                .clone()
                .add_bytes(backend.baseline_host_bytes(which, &spec, cfg.dtype));
            let prepared = with
                .check()
                .and_then(|()| backend.prepare_baseline(which, &spec, cfg.dtype, cfg.reduce));
            if prepared.is_ok() {
                memory = with;
            }
            match prepared {
                Ok(call) => candidates.push(Candidate {
                    name: name.into(),
                    algo: None,
                    baseline,
                    call,
                    spec,
                    predicted_us: None,
                    round_medians: Vec::new(),
                    iterations: 0,
                }),
                Err(e) => {
                    let skip = Skipped {
                        baseline: name.into(),
                        bytes,
                        reason: e.to_string(),
                    };
                    on_progress(Progress::Skipped(&skip));
                    skipped.push(skip);
                }
            }
        }
        for c in &mut candidates {
            driver::load(c.call.as_mut(), &c.spec, cfg.reduce, seed)?;
        }
        // every candidate takes a turn each round, starting one further along each time so
        // that none always follows the same neighbour
        rounds::interleaved(
            candidates.len(),
            |k, round| measure_round(&mut candidates[k], cfg, round, per_round),
            |_| bar.inc(1),
        )?;
        let mut measured = Vec::new();
        for mut c in candidates {
            let wrong = if cfg.check {
                Some(driver::compare(c.call.as_mut(), &c.spec, cfg.reduce, seed)?.wrong)
            } else {
                None
            };
            let (time, fastest, slowest) =
                rounds::summary(&c.round_medians).expect("every candidate ran its rounds");
            let time = time.as_secs_f64();
            let algbw = if time > 0.0 {
                bytes as f64 / time / 1e9
            } else {
                0.0
            };
            let row = BenchRow {
                algo: c.name.clone(),
                picked: None,
                bytes,
                count,
                dtype: cfg.dtype,
                time_us: time * 1e6,
                min_us: fastest.as_secs_f64() * 1e6,
                max_us: slowest.as_secs_f64() * 1e6,
                rounds: c.round_medians.len(),
                algbw_gbps: algbw,
                busbw_gbps: algbw * cfg.op.busbw_factor(world),
                wrong,
                iterations: c.iterations,
                predicted_us: c.predicted_us,
                baseline: c.baseline,
                graph: cfg.graph && c.call.replays_graphs(),
            };
            measured.push((c.algo, row));
        }
        // rows in order: our algorithms, our protocols, auto, baselines
        let mut size_rows: Vec<BenchRow> = measured
            .iter()
            .filter(|(a, r)| {
                a.is_some_and(|a| cfg.algos.contains(&a)) || (a.is_none() && !r.baseline)
            })
            .map(|(_, r)| r.clone())
            .collect();
        if let Some(p) = picked {
            // what the backend's operators run under `auto`: a protocol of ours where they
            // take one (and it ran here), else the cost model's plan
            let protocol = backend
                .auto_protocol(&spec, cfg.dtype.size())
                .map(|p| p.name());
            let of_protocol = measured
                .iter()
                .find(|(a, r)| a.is_none() && !r.baseline && Some(r.algo.as_str()) == protocol);
            let (_, of_pick) = of_protocol.unwrap_or_else(|| {
                measured
                    .iter()
                    .find(|(a, _)| *a == Some(p))
                    .expect("the pick is measured")
            });
            size_rows.push(BenchRow {
                algo: "auto".into(),
                picked: Some(of_pick.algo.clone()),
                ..of_pick.clone()
            });
        }
        size_rows.extend(
            measured
                .into_iter()
                .filter(|(_, r)| r.baseline)
                .map(|(_, r)| r),
        );
        for row in size_rows {
            on_progress(Progress::Row(&row));
            rows.push(row);
        }
    }
    bar.finish_and_clear();
    Ok(BenchReport {
        op: cfg.op,
        backend: backend.name().into(),
        ranks: world,
        dtype: cfg.dtype,
        reduce: cfg.reduce,
        root: cfg.root,
        numa_groups: cfg.numa_groups,
        rows,
        skipped,
    })
}

/// Per size: our fastest algorithm (the pick a tuned dispatcher would make from this table)
/// and the cost model's pick (what `--algo auto` gets), each beside the fastest baseline.
pub fn best_table(report: &BenchReport) -> String {
    let mut out = format!(
        "#\n# best per size (speedup: the baseline's time over ours)\n# {:>8} {:>13} {:>11} {:>11} {:>20} {:>11} {:>12} {:>11} {:>8} {:>8}",
        "size", "ours", "time(us)", "busbw", "auto", "time(us)", "baseline", "busbw", "speedup", "auto"
    );
    let mut sizes: Vec<u64> = report.rows.iter().map(|r| r.bytes).collect();
    sizes.dedup();
    for bytes in sizes {
        let fastest = |keep: &dyn Fn(&BenchRow) -> bool| {
            report
                .rows
                .iter()
                .filter(|r| r.bytes == bytes && r.wrong.unwrap_or(0) == 0 && keep(r))
                .min_by(|a, b| a.time_us.total_cmp(&b.time_us))
        };
        let ours = fastest(&|r| !r.baseline && r.picked.is_none());
        let auto = fastest(&|r| r.picked.is_some());
        let base = fastest(&|r| r.baseline);
        if ours.is_none() && auto.is_none() {
            continue;
        }
        let speedup = |row: Option<&BenchRow>| match (row, base) {
            (Some(o), Some(b)) => format!("{:.2}x", b.time_us / o.time_us),
            _ => "-".into(),
        };
        out.push_str(&format!(
            "\n  {:>8} {:>13} {:>11} {:>11} {:>20} {:>11} {:>12} {:>11} {:>8} {:>8}",
            format_size(bytes),
            ours.map_or("-", |o| o.algo.as_str()),
            ours.map_or("-".into(), |o| format!("{:.2}", o.time_us)),
            ours.map_or("-".into(), |o| format!("{:.2}", o.busbw_gbps)),
            auto.map_or("-".into(), auto_label),
            auto.map_or("-".into(), |o| format!("{:.2}", o.time_us)),
            base.map_or("-", |b| b.algo.as_str()),
            base.map_or("-".into(), |b| format!("{:.2}", b.busbw_gbps)),
            speedup(ours),
            speedup(auto),
        ));
    }
    out
}

/// `auto=ring` for the auto row, the algorithm's name otherwise.
fn auto_label(row: &BenchRow) -> String {
    match &row.picked {
        Some(p) => format!("{}={p}", row.algo),
        None => row.algo.clone(),
    }
}

/// The table's title and column heads; `graph` adds the column saying how each row was timed.
pub fn header(
    op: OpKind,
    backend: &str,
    ranks: usize,
    dtype: DType,
    reduce: ReduceOp,
    graph: bool,
) -> String {
    // the NCCL rows' configuration, beside them
    let nccl = if backend == "cuda" {
        format!("# {}\n", commfuse_cuda::sys::nccl::configuration())
    } else {
        String::new()
    };
    format!(
        "# commfuse bench {op}: backend {backend}, {ranks} ranks, {dtype}, reduce {reduce}\n\
         {nccl}# time: median of {ROUNDS} interleaved rounds' medians; spread: the fastest and slowest round\n\
         # auto: what the operators run when left to choose (the cost model's plan, or a protocol such as ll)\n#\n\
         # {:>8} {:>12} {:>5} {:>20} {:>11} {:>19} {:>11} {:>11} {:>7} {:>11}{}",
        "size",
        "count",
        "type",
        "algo",
        "time(us)",
        "spread(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
        "model(us)",
        if graph { "  timed" } else { "" }
    )
}

/// One row of the table; `graph` adds whether the row was replayed from a graph or launched
/// call by call (the backend could not capture it).
pub fn format_row(row: &BenchRow, graph: bool) -> String {
    format!(
        "  {:>8} {:>12} {:>5} {:>20} {:>11.2} {:>19} {:>11.2} {:>11.2} {:>7} {:>11}{}",
        format_size(row.bytes),
        row.count,
        row.dtype.name(),
        auto_label(row),
        row.time_us,
        format!("{:.2}-{:.2}", row.min_us, row.max_us),
        row.algbw_gbps,
        row.busbw_gbps,
        row.wrong.map_or("-".into(), |w| w.to_string()),
        row.predicted_us.map_or("-".into(), |p| format!("{p:.2}")),
        match (graph, row.graph) {
            (false, _) => "",
            (true, true) => "  graph",
            (true, false) => "  launches (no graph)",
        }
    )
}

/// The line for a baseline that did not run at a size.
pub fn format_skipped(skip: &Skipped) -> String {
    format!(
        "# baseline {} not run at {}: {}",
        skip.baseline,
        format_size(skip.bytes),
        skip.reason
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_core::backend::{BackendError, CallTiming, HostBuffer, HostSlice, HostSliceMut};
    use commfuse_core::{build_plan, check, CheckedPlan};
    use commfuse_sim::{SimBackend, WorldConfig};
    use std::cell::RefCell;

    /// The simulator with two baselines: NCCL, which fails as a library that is not installed
    /// does, and the copy engine, a stand-in (the op's first plan under another name), as is
    /// every protocol but the simulator's own LL. Every timed batch is logged with its
    /// candidate's name.
    struct Logging {
        sim: SimBackend,
        log: RefCell<Vec<String>>,
    }

    struct LoggedCall<'a> {
        name: String,
        inner: Box<dyn PreparedCall + 'a>,
        log: &'a RefCell<Vec<String>>,
    }

    impl PreparedCall for LoggedCall<'_> {
        fn input_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
            self.inner.input_mut(rank)
        }
        fn output_mut(&mut self, rank: usize) -> HostSliceMut<'_> {
            self.inner.output_mut(rank)
        }
        fn upload(&mut self) -> Result<(), BackendError> {
            self.inner.upload()
        }
        fn run(&mut self) -> Result<CallTiming, BackendError> {
            self.inner.run()
        }
        fn run_many(&mut self, iters: usize) -> Result<Vec<CallTiming>, BackendError> {
            self.log.borrow_mut().push(self.name.clone());
            self.inner.run_many(iters)
        }
        fn run_queued(
            &mut self,
            inputs: &[Vec<HostBuffer>],
        ) -> Result<Vec<Vec<HostBuffer>>, BackendError> {
            self.inner.run_queued(inputs)
        }
        fn download(&mut self) -> Result<(), BackendError> {
            self.inner.download()
        }
        fn input(&self, rank: usize) -> HostSlice<'_> {
            self.inner.input(rank)
        }
        fn output(&self, rank: usize) -> HostSlice<'_> {
            self.inner.output(rank)
        }
    }

    impl Backend for Logging {
        fn name(&self) -> &'static str {
            "logging"
        }
        fn world_size(&self) -> usize {
            self.sim.world_size()
        }
        fn prepare(
            &self,
            plan: &CheckedPlan,
            dtype: DType,
            reduce: ReduceOp,
        ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
            Ok(Box::new(LoggedCall {
                name: plan.plan().algo.clone(),
                inner: self.sim.prepare(plan, dtype, reduce)?,
                log: &self.log,
            }))
        }
        fn baselines(&self, _op: OpKind) -> Vec<Baseline> {
            vec![Baseline::Nccl, Baseline::CopyEngine]
        }
        fn auto_protocol(&self, spec: &OpSpec, elem_bytes: usize) -> Option<Protocol> {
            commfuse_core::cost::prefers_ll(spec, elem_bytes).then_some(Protocol::Ll)
        }
        fn prepare_baseline(
            &self,
            which: Implementation,
            spec: &OpSpec,
            dtype: DType,
            reduce: ReduceOp,
        ) -> Result<Box<dyn PreparedCall + '_>, BackendError> {
            let name = which.name();
            if which == Implementation::Baseline(Baseline::Nccl) {
                return Err(BackendError::Unavailable(
                    "libnccl.so.2: cannot open shared object file".into(),
                ));
            }
            let topology = Topology::new(spec.world, 1).unwrap();
            // the op's first algorithm under another name
            let algo = Algo::for_op(spec.kind)[0];
            let plan = check(build_plan(*spec, algo, &topology).unwrap()).unwrap();
            Ok(Box::new(LoggedCall {
                name: name.into(),
                inner: self.sim.prepare(&plan, dtype, reduce)?,
                log: &self.log,
            }))
        }
    }

    fn config() -> BenchConfig {
        BenchConfig {
            op: OpKind::AllGather,
            algos: vec![Algo::Direct, Algo::Ring],
            auto: true,
            baselines: vec![Baseline::Nccl, Baseline::CopyEngine],
            protocols: Vec::new(),
            sizes: vec![4096],
            dtype: DType::F32,
            reduce: ReduceOp::Sum,
            root: 0,
            numa_groups: 1,
            warmup: 0,
            iters: 5,
            budget: Duration::from_secs(10),
            check: true,
            graph: false,
            model: Default::default(),
        }
    }

    #[test]
    fn candidates_take_turns_and_a_failed_baseline_is_reported() {
        let backend = Logging {
            sim: SimBackend::new(3, WorldConfig::default()).unwrap(),
            log: RefCell::new(Vec::new()),
        };
        let mut seen = Vec::new();
        let report = run(&backend, &config(), |p| match p {
            Progress::Row(r) => seen.push(format_row(r, false)),
            Progress::Skipped(s) => seen.push(format_skipped(s)),
        })
        .unwrap();
        // one batch per candidate and round, the candidates in turn (not one block each)
        let log = backend.log.borrow();
        assert_eq!(log.len(), 3 * ROUNDS, "{log:?}");
        for round in log.chunks(3) {
            let mut names = round.to_vec();
            names.sort();
            assert_eq!(names, ["copy-engine", "direct", "ring"], "{log:?}");
        }
        // the missing baseline: one line saying which and why, and in the JSON
        assert!(
            seen[0].contains("baseline nccl not run at 4K: libnccl.so.2"),
            "{seen:?}"
        );
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].baseline, "nccl");
        // rows: ours, auto (the pick, measured once), the baseline that ran
        let names: Vec<&str> = report.rows.iter().map(|r| r.algo.as_str()).collect();
        assert_eq!(names, ["direct", "ring", "auto", "copy-engine"]);
        let auto = &report.rows[2];
        let pick = auto.picked.as_deref().unwrap();
        let of_pick = report.rows.iter().find(|r| r.algo == pick).unwrap();
        assert_eq!(auto.time_us, of_pick.time_us);
        for r in &report.rows {
            assert_eq!(r.rounds, ROUNDS);
            assert!(r.min_us <= r.time_us && r.time_us <= r.max_us, "{r:?}");
            assert_eq!(r.wrong, Some(0));
        }
        assert!(best_table(&report).contains(&format!("auto={pick}")));
    }

    /// A protocol of ours prepared by name (as the LL all-reduce is) is timed beside the plans,
    /// listed with them before auto, and counts as ours in the best-per-size table.
    #[test]
    fn a_protocol_of_ours_is_listed_and_compared_as_ours() {
        let backend = Logging {
            sim: SimBackend::new(2, WorldConfig::default()).unwrap(),
            log: RefCell::new(Vec::new()),
        };
        let cfg = BenchConfig {
            algos: vec![Algo::Ring],
            baselines: vec![Baseline::Nccl],
            protocols: vec![Protocol::Ce],
            ..config()
        };
        let report = run(&backend, &cfg, |_| {}).unwrap();
        let rows: Vec<(&str, bool)> = report
            .rows
            .iter()
            .map(|r| (r.algo.as_str(), r.baseline))
            .collect();
        assert_eq!(rows, [("ring", false), ("ce", false), ("auto", false)]);
        assert_eq!(report.rows[1].wrong, Some(0));
        // no baseline ran: ours is the fastest of ring and ce, with no speedup to show
        let table = best_table(&report);
        let line = table.lines().last().unwrap();
        assert!(line.contains("ring") || line.contains("ce"), "{table}");
        assert!(line.trim_end().ends_with('-'), "{table}");
    }

    /// `auto` is what the backend's operators run: the LL protocol for an all-reduce small
    /// enough (where the backend says so), the cost model's plan above that size.
    #[test]
    fn auto_takes_the_ll_protocol_for_small_all_reduces() {
        let backend = Logging {
            sim: SimBackend::new(2, WorldConfig::default()).unwrap(),
            log: RefCell::new(Vec::new()),
        };
        let cfg = BenchConfig {
            op: OpKind::AllReduce,
            algos: vec![Algo::Ring],
            baselines: Vec::new(),
            protocols: vec![Protocol::Ll],
            sizes: vec![4096, 4 << 20],
            iters: 1,
            ..config()
        };
        let report = run(&backend, &cfg, |_| {}).unwrap();
        let picks: Vec<(u64, &str)> = report
            .rows
            .iter()
            .filter_map(|r| Some((r.bytes, r.picked.as_deref()?)))
            .collect();
        assert_eq!(picks.len(), 2, "{:?}", report.rows);
        assert_eq!(picks[0], (4096, "ll"));
        assert_ne!(picks[1].1, "ll");
    }

    /// Under --graph, a row the backend could not replay from a graph says so.
    #[test]
    fn rows_timed_without_a_graph_are_marked() {
        let backend = Logging {
            sim: SimBackend::new(2, WorldConfig::default()).unwrap(),
            log: RefCell::new(Vec::new()),
        };
        let cfg = BenchConfig {
            graph: true,
            baselines: Vec::new(),
            protocols: Vec::new(),
            ..config()
        };
        let report = run(&backend, &cfg, |_| {}).unwrap();
        let row = format_row(&report.rows[0], true);
        assert!(row.ends_with("launches (no graph)"), "{row}");
        assert!(!format_row(&report.rows[0], false).contains("graph"));
        assert!(header(cfg.op, "sim", 2, cfg.dtype, cfg.reduce, true).ends_with("timed"));
    }
}
