//! `commfuse run`: one checked call of a collective (`run <op>`), or back-to-back checked calls
//! of the fused operators (`run gemm-rs`, `run ag-gemm`), on the simulator or on GPUs.

use super::common::{
    algo_label, ensure_offered, list, ArgsOr, FusedWhere, GemmShapeArgs, What, Where,
};
use crate::args::{elements, groups, pieces, seed};
use crate::backends;
use crate::driver;
use crate::verify;
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use commfuse_core::topology::LinkModel;
use commfuse_core::{Algo, Implementation};
use std::path::PathBuf;

/// `run <op> [flags]` runs a collective, `run gemm-rs` / `run ag-gemm [flags]` a fused operator.
pub type RunCmd = ArgsOr<RunArgs, RunSub>;

#[derive(Subcommand, Debug)]
pub enum RunSub {
    /// GEMM + reduce-scatter (rank r holds A_r [M, K] and B_r; rank r's output is chunk r of the
    /// rows of Σ_r A_r·B_r + bias): two back-to-back calls, M then about M/2, every output
    /// element of every rank checked against the float64 reference
    #[command(name = "gemm-rs")]
    GemmRs(RunGemmRsArgs),
    /// All-gather + GEMM (rank r holds chunk r of the rows of A and its own B_r; every rank's
    /// output is AllGather(A)·B_r + bias, and the gathered A): two back-to-back calls, M then
    /// about M/2, every output element and the gathered A of every rank checked
    #[command(name = "ag-gemm")]
    AgGemm(RunAgGemmArgs),
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub what: What,
    #[command(flatten)]
    pub place: Where,
    /// Element count: per rank for all-reduce and broadcast; of each rank's input for
    /// reduce-scatter and all-to-all; of the gathered output for all-gather; ignored by barrier
    #[arg(long, short = 'n', default_value_t = 1 << 20, allow_negative_numbers = true, value_parser = elements())]
    pub size: usize,
    /// Seed of the random inputs (default: fresh each run)
    #[arg(long, allow_negative_numbers = true, value_parser = seed())]
    pub seed: Option<u64>,
    /// Write rank{r}_input.npy and rank{r}_output.npy into this folder
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Also write the call and its result as JSON to this file (op, algo, ranks, backend,
    /// count, dtype, reduce, seed, time_us, calls, checked, max_error, wrong, ok)
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct RunGemmRsArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    #[command(flatten)]
    pub place: FusedWhere,
    /// Which path: auto (the cost model's pick for the shape), fused (the tile schedule of our
    /// GEMM), overlapped (the ring of library GEMMs; --pieces cuts each step) or unfused (the
    /// whole GEMM, then a reduce-scatter)
    #[arg(long, default_value = "auto")]
    pub path: String,
    /// Row pieces per ring step, 1 to 16, with --path overlapped only (default: what auto
    /// would take for the shape)
    #[arg(long, allow_negative_numbers = true, value_parser = pieces())]
    pub pieces: Option<usize>,
    /// NUMA groups of consecutive ranks for the overlapped path's ring (1: one flat ring; more:
    /// the 2D ring, which crosses groups once per group); not with --path fused or unfused,
    /// which have no ring
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = groups())]
    pub numa_groups: usize,
    /// Seed of the random inputs (default: fresh each run)
    #[arg(long, allow_negative_numbers = true, value_parser = seed())]
    pub seed: Option<u64>,
}

#[derive(Args, Debug)]
pub struct RunAgGemmArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    #[command(flatten)]
    pub place: FusedWhere,
    /// Which path: auto (the overlapped one, measured the faster), overlapped (a library GEMM
    /// per piece as it lands) or fused (one GEMM of our own per call whose loads of a piece's
    /// rows wait for its flag)
    #[arg(long, default_value = "auto")]
    pub path: String,
    /// Row pieces each rank's chunk is handed on in, 1 to 16: a GEMM per piece on the overlapped
    /// path, a wait per piece before the tiles that read its rows on the fused one (default:
    /// what auto takes, whole chunks)
    #[arg(long, allow_negative_numbers = true, value_parser = pieces())]
    pub pieces: Option<usize>,
    /// The same as --path fused (the name it had first)
    #[arg(long, conflicts_with = "path")]
    pub fused: bool,
    /// Seed of the random inputs (default: fresh each run)
    #[arg(long, allow_negative_numbers = true, value_parser = seed())]
    pub seed: Option<u64>,
}

pub(super) fn run(a: RunArgs) -> Result<i32> {
    let seed = a.seed.unwrap_or_else(driver::fresh_seed);
    let backend = backends::open(&a.place.placement()?)?;
    let (which, auto) = a
        .what
        .resolve(a.size, backend.world_size(), LinkModel::default())?;
    ensure_offered(backend.as_ref(), a.what.op, which)?;
    let out = match which {
        Implementation::Plan(algo) => {
            let req = a.what.request(algo, a.size, seed);
            driver::run(backend.as_ref(), &req, verify::CALLS, a.dump.as_deref())?
        }
        _ => {
            // the request's plan is not used: the implementation is prepared by name
            let plan = Algo::for_op(a.what.op)[0];
            let req = a.what.request(plan, a.size, seed);
            driver::run_named(
                backend.as_ref(),
                which,
                &req,
                verify::CALLS,
                a.dump.as_deref(),
            )?
        }
    };
    let req = &a.what;
    println!(
        "{} {} on {} ranks ({}), {} × {}, reduce {}, seed {seed}",
        req.op,
        algo_label(which, auto),
        backend.world_size(),
        backend.name(),
        a.size,
        req.dtype,
        req.reduce
    );
    match (&out.card, which) {
        (Some(card), _) => println!("{card}"),
        (None, Implementation::Protocol(p)) => println!("{p}: {}", p.describe()),
        (None, Implementation::Baseline(b)) => println!("{b}: {}", b.describe()),
        (None, Implementation::Plan(_)) => {}
    }
    println!(
        "measured: {:.1} µs (slowest rank, the first call); {} calls checked (the first alone, the rest queued back to back); {} elements each, max error {:.2e}",
        out.timing.slowest().as_secs_f64() * 1e6,
        out.calls,
        out.comparison.checked,
        out.comparison.max_error
    );
    if let Some(path) = &a.json {
        let record = serde_json::json!({
            "op": req.op.to_string(),
            "algo": which.to_string(),
            "auto": auto,
            "ranks": backend.world_size(),
            "backend": backend.name(),
            "count": a.size,
            "dtype": req.dtype.to_string(),
            "reduce": req.reduce.to_string(),
            "seed": seed,
            "time_us": out.timing.slowest().as_secs_f64() * 1e6,
            "calls": out.calls,
            "checked": out.comparison.checked,
            "max_error": out.comparison.max_error,
            "wrong": out.comparison.wrong,
            "ok": out.comparison.ok(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&record)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if out.comparison.ok() {
        println!("OK");
        Ok(0)
    } else {
        println!(
            "MISMATCH in call {}: {} wrong elements; first ones:",
            out.call, out.comparison.wrong
        );
        for m in &out.comparison.mismatches {
            println!(
                "  rank {} output[{}] = {} (expected {})",
                m.rank, m.index, m.got, m.expected
            );
        }
        Ok(1)
    }
}

/// The path `--path` and `--pieces` name for `shape` ("auto" resolved for it).
fn parse_gemm_rs_path(
    path: &str,
    pieces: Option<usize>,
    shape: &commfuse_core::fused::gemm_rs::GemmRsShape,
) -> Result<commfuse_core::fused::gemm_rs::GemmRsPath> {
    use commfuse_core::fused::gemm_rs::{choose_path, parse_path, PathNameError};
    match parse_path(path, pieces, shape) {
        Ok(named) => Ok(named.unwrap_or_else(|| choose_path(shape))),
        Err(PathNameError::PiecesWithoutOverlapped) => {
            bail!("--pieces goes with --path overlapped")
        }
        Err(e) => bail!("{e}"),
    }
}

pub(super) fn run_gemm_rs_cmd(a: RunGemmRsArgs) -> Result<i32> {
    use commfuse_core::fused::gemm_rs::{GemmRsConfig, PathChoice};
    let place = a.place.placement()?;
    let config = GemmRsConfig {
        bias: a.shape.bias,
        numa_groups: a.numa_groups,
        timeout: place.timeout,
        ..a.shape.fused_config(GemmRsConfig::new)?
    };
    let output = config.output;
    // validates the shape and types before anything runs
    let shape = config.shape(place.ranks, a.shape.m)?;
    let path = parse_gemm_rs_path(&a.path, a.pieces, &shape)?;
    if a.numa_groups != 1 && matches!(a.path.as_str(), "fused" | "unfused") {
        bail!(
            "--numa-groups {} shapes the overlapped path's ring; --path {} has none: drop --numa-groups, or take --path overlapped",
            a.numa_groups,
            a.path
        );
    }
    // the groups shape only the overlapped path's ring, but are checked whatever the path
    let ring = commfuse_core::fused::ring_rs::RingSchedule::within(shape, a.shape.m, 1);
    let two_d = ring.in_groups(a.numa_groups)?.groups > 1
        && matches!(
            path,
            commfuse_core::fused::gemm_rs::GemmRsPath::Overlapped { .. }
        );
    let seed = a.seed.unwrap_or_else(driver::fresh_seed);
    let ms = [a.shape.m, a.shape.m.div_ceil(2)];
    let (calls, paths, on) = match &place.devices {
        None => {
            let config = GemmRsConfig {
                path: PathChoice::Always(path),
                ..config
            };
            let calls = crate::gemm_rs::run_sim(place.ranks, config, &ms, seed)?;
            (
                calls,
                vec![path; ms.len()],
                format!("{} ranks (sim)", place.ranks),
            )
        }
        Some(devices) => {
            // `auto` on GPUs: the operator's pick per call, as a caller's would be
            let config = GemmRsConfig {
                path: match a.path.as_str() {
                    "auto" => PathChoice::Auto,
                    _ => PathChoice::Always(path),
                },
                ..config
            };
            let (calls, paths) = crate::gemm_rs::run_cuda(devices, config, &ms, seed)?;
            (calls, paths, format!("GPUs {} (cuda)", list(devices)))
        }
    };
    println!(
        "gemm-rs {}×{}×{} (M×N×K, K per rank), B {}, {} → {}, {}, on {on}, {path}{}{}, seed {seed}",
        a.shape.m,
        a.shape.n,
        a.shape.k,
        a.shape.b_layout,
        a.shape.dtype,
        output,
        if a.shape.bias { "bias" } else { "no bias" },
        if a.path == "auto" { " (auto)" } else { "" },
        if two_d {
            format!(", 2D ring over {} NUMA groups", a.numa_groups)
        } else {
            String::new()
        }
    );
    if paths.iter().any(|&p| p != path) {
        let taken: Vec<String> = paths.iter().map(|p| p.to_string()).collect();
        println!("paths taken per call: {}", taken.join(", "));
    }
    report_calls(&calls)
}

pub(super) fn run_ag_gemm_cmd(a: RunAgGemmArgs) -> Result<i32> {
    use commfuse_core::fused::ag_gemm::{parse_path, AgGemmConfig};
    let place = a.place.placement()?;
    let path = if a.fused { "fused" } else { a.path.as_str() };
    let (fused, pieces) = parse_path(path, a.pieces).map_err(|e| anyhow::anyhow!("{e}"))?;
    let config = AgGemmConfig {
        bias: a.shape.bias,
        pieces,
        fused,
        timeout: place.timeout,
        ..a.shape.fused_config(AgGemmConfig::new)?
    };
    let output = config.output;
    // validates the shape and types before anything runs
    config.shape(place.ranks, a.shape.m)?;
    let seed = a.seed.unwrap_or_else(driver::fresh_seed);
    let ms = [a.shape.m, a.shape.m.div_ceil(2)];
    let (calls, on) = match &place.devices {
        None => (
            crate::ag_gemm::run_sim(place.ranks, config, &ms, seed)?,
            format!("{} ranks (sim)", place.ranks),
        ),
        Some(devices) => (
            crate::ag_gemm::run_cuda(devices, config, &ms, seed)?,
            format!("GPUs {} (cuda)", list(devices)),
        ),
    };
    println!(
        "ag-gemm {}×{}×{} (M×N×K, M gathered), B {}, {} → {}, {}, on {on}, {}{} piece{} per chunk, seed {seed}",
        a.shape.m,
        a.shape.n,
        a.shape.k,
        a.shape.b_layout,
        a.shape.dtype,
        output,
        if a.shape.bias { "bias" } else { "no bias" },
        if fused { "fused, " } else { "" },
        pieces,
        if pieces == 1 { "" } else { "s" }
    );
    report_calls(&calls)
}

/// Prints each checked call and OK (exit 0), or the mismatches (exit 1).
fn report_calls(calls: &[crate::gemm_rs::CallCheck]) -> Result<i32> {
    let mut ok = true;
    for (c, call) in calls.iter().enumerate() {
        let total = call.total();
        println!(
            "call {c}: M={}: checked {} elements, worst error {:.3} × the bound",
            call.m, total.checked, total.worst_ratio
        );
        for (r, check) in call.ranks.iter().enumerate() {
            if !check.passed() {
                ok = false;
                println!("  MISMATCH rank {r}: {check}");
            }
        }
    }
    if ok {
        println!("OK");
        Ok(0)
    } else {
        Ok(1)
    }
}
