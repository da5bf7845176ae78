//! `commfuse bench`: a collective's size sweep in the nccl-tests format (`bench <op>`), and on
//! GPUs our GEMM beside cuBLASLt (`bench gemm`) and the fused operators beside their unfused
//! baselines (`bench gemm-rs`, `bench ag-gemm`).

use super::common::{ensure_offered, parse_b_layout, AlgoArg, ArgsOr, GemmShapeArgs, What, Where};
use crate::args::{columns, depth, gpu, groups, iters, millis, pieces, rows, warmup, Real, Whole};
use crate::backends::{self, BackendKind};
use crate::bench::{self, BenchConfig, Progress};
use crate::driver;
use crate::sizes::parse_sizes;
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use commfuse_core::gemm::TileOrder;
use commfuse_core::topology::LinkModel;
use commfuse_core::{Algo, DType, Implementation};
use std::path::PathBuf;
use std::time::Duration;

/// `bench <op> [flags]` measures a collective; `bench gemm` the GEMM, `bench gemm-rs` the fused
/// GEMM + reduce-scatter.
pub type BenchCmd = ArgsOr<BenchArgs, BenchSub>;

#[derive(Subcommand, Debug)]
pub enum BenchSub {
    /// Our GEMM beside cuBLASLt on one GPU: all SMs, capped (--sms), and with its epilogue
    /// storing tiles to a peer GPU and raising flags there (--peer)
    Gemm(BenchGemmArgs),
    /// GEMM + reduce-scatter on P GPUs: ours fused beside cuBLASLt alone, cuBLASLt then NCCL's
    /// reduce-scatter, and our GEMM alone
    #[command(name = "gemm-rs")]
    GemmRs(BenchGemmRsArgs),
    /// All-gather + GEMM on P GPUs: ours overlapped beside cuBLASLt alone on the gathered A and
    /// NCCL's all-gather then cuBLASLt
    #[command(name = "ag-gemm")]
    AgGemm(BenchAgGemmArgs),
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub what: What,
    #[command(flatten)]
    pub place: Where,
    /// Sizes in bytes: 64M, 1K..1G (doubling) or 4K,1M
    #[arg(long, default_value = "1K..16M", allow_hyphen_values = true)]
    pub sizes: String,
    /// Untimed calls before the first round (and up to one before each later round)
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = warmup())]
    pub warmup: usize,
    /// Timed calls per size and row, at least 1, spread over 5 interleaved rounds (at least one
    /// per round; a round stops early once its share of --budget-ms is spent)
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = iters())]
    pub iters: usize,
    /// Time budget per size and row, ms
    #[arg(long, default_value_t = 500, allow_negative_numbers = true, value_parser = millis())]
    pub budget_ms: u64,
    /// Skip the correctness check of the last call
    #[arg(long)]
    pub no_check: bool,
    /// Skip the baselines (NCCL, copy engine) the backend offers
    #[arg(long)]
    pub no_baselines: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Time batches replayed from captured CUDA graphs (for small messages: launch overhead
    /// then counts for neither us nor the baselines); cuda backend only
    #[arg(long)]
    pub graph: bool,
    /// Write the results as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw busbw against size, ours beside the baselines, as SVG
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// The cost model's link figures (defaults: what was measured on 2 × H200 over NVLink: SM stores
/// carry about 370 GB/s per direction, a flag takes about 1.2 µs one way).
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Link bandwidth per rank and direction, GB/s
    #[arg(long, default_value_t = 370.0, allow_negative_numbers = true, value_parser = Real::positive("a positive number of GB/s"))]
    pub link_gbps: f64,
    /// One-way signal latency, µs
    #[arg(long, default_value_t = 1.2, allow_negative_numbers = true, value_parser = Real::non_negative("a non-negative number of µs"))]
    pub latency_us: f64,
    /// Launch cost of one call, µs
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true, value_parser = Real::non_negative("a non-negative number of µs"))]
    pub launch_us: f64,
}

impl ModelArgs {
    fn model(&self) -> LinkModel {
        LinkModel {
            link_gbps: self.link_gbps,
            latency_us: self.latency_us,
            launch_us: self.launch_us,
        }
    }
}

#[derive(Args, Debug)]
pub struct BenchGemmArgs {
    #[arg(long, allow_negative_numbers = true, value_parser = rows())]
    pub m: usize,
    #[arg(long, allow_negative_numbers = true, value_parser = columns())]
    pub n: usize,
    #[arg(long, allow_negative_numbers = true, value_parser = depth())]
    pub k: usize,
    /// How B is stored: kn ([K, N]) or nk ([N, K], weights transposed)
    #[arg(long, default_value = "nk")]
    pub b_layout: String,
    /// Input type: bf16 or f16
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// Output type (default: the input type)
    #[arg(long)]
    pub out_dtype: Option<DType>,
    /// SM caps to measure (0 = all SMs)
    #[arg(long, value_delimiter = ',', default_value = "0,116", allow_negative_numbers = true, value_parser = Whole::<u32>::new("a number of SMs (0: all of them)"))]
    pub sms: Vec<u32>,
    /// Backend (the GEMM runs on cuda only)
    #[arg(long, default_value = "cuda")]
    pub backend: BackendKind,
    /// GPU to run on
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = gpu())]
    pub device: usize,
    /// GPU for the rows whose epilogue stores tiles over NVLink and raises flags there: an
    /// index, or "none" (default: the next GPU when the machine has two or more)
    #[arg(long)]
    pub peer: Option<String>,
    /// Rows of our GEMM folding this many partials (1 or 3) into every tile, from local buffers
    /// whose flags are already up (the GEMM + reduce-scatter owner's epilogue on one GPU), each
    /// also with the partials asked of L2 halfway through the tile's main loop (`-prefetch`);
    /// at the first --sms cap
    #[arg(long, value_delimiter = ',')]
    pub fold: Vec<usize>,
    /// With --fold: also each fold row with its flags down at the call, raised by a side
    /// kernel on an SM of its own as the GEMM goes (the flags of each wave's tiles this many
    /// waves after the wave starts, 0 to 4; 1: peers at the GEMM's pace; a wave timed from the
    /// main build's plain GEMM at the same cap); the first --sms cap must leave that SM free
    #[arg(long, requires = "fold")]
    pub fold_paced: Option<f64>,
    /// Rows of the fused GEMM + reduce-scatter's kernel as rank 0 of each of these P alone on
    /// this GPU: the operator's schedule, routes and fold, the tiles of the peers' rows into
    /// local stand-ins of their receive buffers with their flags, its own rows folding the
    /// P − 1 partials already in its receive buffer (flags up); at the first --sms cap. With
    /// --bias its own tiles add the bias (the tiles it sends do not)
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = Whole::<usize>::new("a number of ranks"))]
    pub rs_ranks: Vec<usize>,
    /// Each --rs-ranks row again with the ring inside one GEMM (`commfuse-ringP`): one owner's
    /// rows a step, each tile of steps 1 .. P − 1 folding the one running sum handed on from
    /// the step before (in its receive buffers, flags up), each tile of steps 0 .. P − 2 into
    /// a stand-in of its receiver's buffer of that step with its flag
    #[arg(long, requires = "rs_ranks")]
    pub rs_ring: bool,
    /// Each --rs-ranks row (through the entry `auto` takes) whose folds go through the stages
    /// again for each of these numbers of k-blocks (`-prefetchK`, at least 1), its producer
    /// asking L2 for a folding tile's partials that many k-blocks before the end of the tile's
    /// main loop
    #[arg(long, value_delimiter = ',', requires = "rs_ranks", allow_negative_numbers = true, value_parser = Whole::<u32>::new("a positive number of k-blocks").at_least(1))]
    pub rs_prefetch: Vec<u32>,
    /// The builds of our kernel to force beside the chosen one where they fit: main, skinny,
    /// narrow, narrow-deep, narrow-sliced, pair, mid, direct, ping-pong, mid-direct, short,
    /// ping-pong-wide, or "none"
    /// (default: every build that fits)
    #[arg(long, value_delimiter = ',')]
    pub builds: Vec<String>,
    /// Also a row of the chosen build whose producer asks L2 for each tile's first this many
    /// k-blocks while it still loads the tile before
    #[arg(long, allow_negative_numbers = true, value_parser = Whole::<u32>::new("a number of k-blocks"))]
    pub next_prefetch: Option<u32>,
    /// Also a row of the chosen build whose blocks start their loads at this many places in
    /// K (block b at (b mod N) / N of each tile's K range, wrapping around)
    #[arg(long, allow_negative_numbers = true, value_parser = Whole::<u32>::new("a number of places in K"))]
    pub k_phases: Option<u32>,
    /// Also a row of the chosen build whose blocks load the tiles of their second, fourth, ...
    /// wave from the last k-block to the first (starting on what the wave before read last),
    /// and each --rs-ranks row again with it
    #[arg(long)]
    pub k_serpentine: bool,
    /// Every row adds a bias row (N random values of the output type) in its epilogue,
    /// cuBLASLt's included: D = A·B + bias; a rank row's own tiles too (not with --fold or a
    /// peer)
    #[arg(long, conflicts_with = "fold")]
    pub bias: bool,
    /// Also rows of the main and the direct build prepared as the all-gather + GEMM's GEMM:
    /// every row band but the first waits for a flag that is already up, the first band's
    /// rows come from a copy given per call (the rank's own rows); at the first --sms cap
    #[arg(long)]
    pub gather: bool,
    /// After the timed rows, one more call of each plain row of ours whose blocks stamp when
    /// their roles reach a few points (entry, first load, first stage landed, main loop done,
    /// each role's end): printed as µs after each block's entry, median [min, max] over blocks
    #[arg(long)]
    pub trace: bool,
    /// The order of our rows' tiles over the blocks: grouped (bands of 8 tile rows, M fastest
    /// within a band), rows (N fastest), squares (16 tiles at a time, up to 4 rows × 4
    /// columns), dealt-squares (those squares dealt out in turn, one tile of each)
    #[arg(long, default_value = "grouped", value_parser = tile_order_name)]
    pub order: TileOrder,
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = warmup())]
    pub warmup: usize,
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = iters())]
    pub iters: usize,
    /// Write the rows as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BenchGemmRsArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    /// GPUs, rank r on the r-th
    #[arg(long, value_delimiter = ',', default_value = "0,1", allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Vec<usize>,
    /// Backend (the fused operators are timed on cuda only)
    #[arg(long, default_value = "cuda")]
    pub backend: BackendKind,
    /// One fused row each: 0 folds the partials into the epilogue of the owner's tiles (the
    /// default design), B > 0 sums them in a separate kernel of B blocks beside the GEMM
    #[arg(long, value_delimiter = ',', default_value = "0,16", allow_negative_numbers = true, value_parser = Whole::<u32>::new("a number of blocks (0: folded into the epilogue)"))]
    pub reduce_blocks: Vec<u32>,
    /// One overlapped row each: the row pieces (1 to 16) a ring step of cuBLASLt GEMMs is cut
    /// into
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", allow_negative_numbers = true, value_parser = pieces())]
    pub pieces: Vec<usize>,
    /// NUMA groups of consecutive ranks for the overlapped path's ring (1: one flat ring; more:
    /// the 2D ring, which crosses groups once per group)
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = groups())]
    pub numa_groups: usize,
    /// Also time the overlapped path's parts apart: its GEMMs alone, its copies alone, its flag
    /// waits and raises alone, GEMMs and copies without flags, and the whole call (there is no
    /// clearing to time: flags hold call numbers)
    #[arg(long)]
    pub ablation: bool,
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = warmup())]
    pub warmup: usize,
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = iters())]
    pub iters: usize,
    /// Write the rows as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BenchAgGemmArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    /// GPUs, rank r on the r-th
    #[arg(long, value_delimiter = ',', default_value = "0,1", allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Vec<usize>,
    /// Backend (the fused operators are timed on cuda only)
    #[arg(long, default_value = "cuda")]
    pub backend: BackendKind,
    /// One row each: the row pieces each rank's chunk is handed on in (1 to 16)
    #[arg(long, value_delimiter = ',', default_value = "1,2,4", allow_negative_numbers = true, value_parser = pieces())]
    pub pieces: Vec<usize>,
    #[arg(long, default_value_t = 5, allow_negative_numbers = true, value_parser = warmup())]
    pub warmup: usize,
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = iters())]
    pub iters: usize,
    /// Write the rows as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub(super) fn bench_cmd(a: BenchArgs) -> Result<i32> {
    let placement = a.place.placement()?;
    if a.graph && placement.backend == BackendKind::Sim {
        bail!("--graph times replays of captured CUDA graphs, which the sim backend does not have: drop --graph, or run on --backend cuda");
    }
    let sizes = parse_sizes(&a.sizes).context("--sizes")?;
    let element = a.what.dtype.size() as u64;
    if let Some(small) = sizes.iter().find(|&&s| s < element) {
        bail!(
            "--sizes {}: {small} bytes is less than one {} element ({element} bytes)",
            a.sizes,
            a.what.dtype
        );
    }
    let backend = backends::open(&placement)?;
    let op = a.what.op;
    let baselines = if a.no_baselines {
        Vec::new()
    } else {
        backend.baselines(op)
    };
    // a plan (or auto, or all) is timed beside our protocols and the baselines; a protocol
    // beside the baselines; a baseline alone
    let (algos, auto, protocols, baselines) = match a.what.algo_arg()? {
        AlgoArg::All => (
            Algo::for_op(op).to_vec(),
            true,
            backend.protocols(op),
            baselines,
        ),
        AlgoArg::Auto => (Vec::new(), true, backend.protocols(op), baselines),
        AlgoArg::One(which) => {
            ensure_offered(backend.as_ref(), op, which)?;
            match which {
                Implementation::Plan(algo) => (vec![algo], false, backend.protocols(op), baselines),
                Implementation::Protocol(p) => (Vec::new(), false, vec![p], baselines),
                Implementation::Baseline(b) => {
                    if a.no_baselines {
                        bail!("--algo {b} is a baseline, and --no-baselines skips the baselines: drop one of the two");
                    }
                    (Vec::new(), false, Vec::new(), vec![b])
                }
            }
        }
    };
    let cfg = BenchConfig {
        op,
        auto,
        baselines,
        protocols,
        algos,
        sizes,
        dtype: a.what.dtype,
        reduce: a.what.reduce,
        root: a.what.root,
        numa_groups: a.what.numa_groups,
        warmup: a.warmup,
        iters: a.iters,
        budget: Duration::from_millis(a.budget_ms),
        check: !a.no_check,
        graph: a.graph,
        model: a.model.model(),
    };
    println!(
        "{}",
        bench::header(
            cfg.op,
            backend.name(),
            backend.world_size(),
            cfg.dtype,
            cfg.reduce,
            cfg.graph
        )
    );
    let report = bench::run(backend.as_ref(), &cfg, |progress| match progress {
        Progress::Row(row) => println!("{}", bench::format_row(row, cfg.graph)),
        Progress::Skipped(skip) => println!("{}", bench::format_skipped(skip)),
    })?;
    println!("{}", bench::best_table(&report));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        crate::plot::busbw_svg(&report, path)?;
    }
    let wrong: u64 = report.rows.iter().filter_map(|r| r.wrong).sum();
    Ok(if wrong == 0 { 0 } else { 1 })
}

/// The GEMM benches time GPUs only; `checked_by` says where the simulator's model is checked.
fn timed_on_cuda(bench: &str, backend: BackendKind, checked_by: &str) -> Result<()> {
    if backend != BackendKind::Cuda {
        bail!("bench {bench} runs on the cuda backend ({checked_by}, not timed)");
    }
    Ok(())
}

fn tile_order_name(name: &str) -> Result<TileOrder, String> {
    TileOrder::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = TileOrder::ALL.iter().map(|o| o.name()).collect();
        format!("unknown tile order '{name}': one of {}", names.join(", "))
    })
}

pub(super) fn bench_gemm_cmd(a: BenchGemmArgs) -> Result<i32> {
    use commfuse_core::gemm::{BLayout, GemmProblem};
    timed_on_cuda(
        "gemm",
        a.backend,
        "the simulator's GEMM model is checked by the tests",
    )?;
    let layout = match a.b_layout.as_str() {
        "kn" => BLayout::KN,
        "nk" => BLayout::NK,
        other => bail!("unknown B layout '{other}' (choose kn or nk)"),
    };
    let builds = match a.builds.as_slice() {
        [] => None,
        [none] if none == "none" => Some(Vec::new()),
        names => Some(
            names
                .iter()
                .map(
                    |name| match commfuse_cuda::gemm::VariantChoice::parse(name) {
                        Ok(commfuse_cuda::gemm::VariantChoice::Auto) | Err(_) => bail!(
                            "--builds takes {} or none, got '{name}'",
                            commfuse_cuda::gemm::VariantChoice::forced_names()
                        ),
                        Ok(choice) => Ok(choice),
                    },
                )
                .collect::<anyhow::Result<Vec<_>>>()?,
        ),
    };
    let problem = GemmProblem::new(
        a.m,
        a.n,
        a.k,
        layout,
        a.dtype,
        a.out_dtype.unwrap_or(a.dtype),
    )?;
    let peer = match a.peer.as_deref() {
        Some("none") => None,
        Some(text) => {
            let peer: usize = text
                .parse()
                .map_err(|_| anyhow::anyhow!("--peer takes a GPU index or 'none', got '{text}'"))?;
            if peer == a.device {
                bail!("--peer {peer} is the GPU the GEMM runs on: name another GPU or 'none'");
            }
            Some(peer)
        }
        None => match commfuse_cuda::sys::driver::device_count() {
            Ok(count) if count >= 2 => Some((a.device + 1) % count),
            _ => None,
        },
    };
    let extra = commfuse_cuda::gemm::bench::ExtraRows {
        folds: &a.fold,
        paced: a.fold_paced,
        builds: builds.as_deref(),
        next_prefetch: a.next_prefetch,
        k_phases: a.k_phases,
        k_serpentine: a.k_serpentine,
        bias: a.bias,
        gather: a.gather,
        trace: a.trace,
        order: a.order,
        rs_ranks: &a.rs_ranks,
        rs_ring: a.rs_ring,
        rs_prefetch: &a.rs_prefetch,
    };
    let rows = commfuse_cuda::gemm::bench::bench_gemm(
        a.device,
        peer,
        extra,
        &problem,
        &a.sms,
        a.warmup,
        a.iters,
        driver::fresh_seed(),
    )?;
    println!(
        "# commfuse bench gemm: {}×{}×{} (M×N×K), B {:?}, {} → {}{}, GPU {}",
        a.m,
        a.n,
        a.k,
        layout,
        problem.input,
        problem.output,
        if a.bias { ", D = A·B + bias" } else { "" },
        a.device
    );
    println!(
        "# {:>26} {:>11} {:>5} {:>5} {:>17} {:>10} {:>9} {:>10} {:>10}  check",
        "impl", "build", "sms", "grid", "tail", "time(ms)", "TFLOP/s", "#wrong", "err/bound"
    );
    let mut ok = true;
    for r in &rows {
        let pass = r.out_of_bound == 0;
        ok &= pass;
        println!(
            "  {:>26} {:>11} {:>5} {:>5} {:>17} {:>10.4} {:>9.1} {:>10} {:>10.3}  {}",
            r.implementation,
            r.build.as_deref().unwrap_or("-"),
            if r.sms == 0 {
                "all".to_string()
            } else {
                r.sms.to_string()
            },
            r.grid.map_or("-".to_string(), |g| g.to_string()),
            r.tail.as_deref().unwrap_or("-"),
            r.time_ms,
            r.tflops,
            r.out_of_bound,
            r.worst_ratio,
            if pass { "OK" } else { "WRONG" }
        );
        if let (false, Some((i, j, got, want, bound))) = (pass, r.worst) {
            println!("      worst: D[{i}, {j}] = {got} against {want} (bound {bound:.3e})");
        }
    }
    // what cuBLASLt ran: its configuration attributes (raw values of cuBLASLt's enums)
    for r in rows.iter().filter(|r| r.cublaslt_config.is_some()) {
        let c = r.cublaslt_config.unwrap_or_default();
        let show = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
        println!(
            "# {} at {} SMs: algorithm {} tile {} stages {} split-K {} reduction {} cluster {} swizzle {} custom {}",
            r.implementation,
            if r.sms == 0 { "all".to_string() } else { r.sms.to_string() },
            show(c.id),
            show(c.tile),
            show(c.stages),
            show(c.split_k),
            show(c.reduction),
            show(c.cluster_shape),
            show(c.swizzle),
            show(c.custom)
        );
    }
    for r in &rows {
        if let Some(t) = &r.trace {
            print_trace(r, t);
        }
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(if ok { 0 } else { 1 })
}

/// A traced row's points: µs after each block's own entry (the entries: after the first
/// block's), median [min, max] over the blocks that reached the point.
fn print_trace(r: &commfuse_cuda::gemm::bench::GemmRow, t: &commfuse_cuda::gemm::trace::GemmTrace) {
    println!(
        "# {} ({}): one call traced, {} blocks, SM clock {:.2} GHz, {:.2} µs from the first entry to the last point",
        r.implementation,
        r.build.as_deref().unwrap_or("-"),
        t.blocks,
        t.clock_ghz,
        t.span_us
    );
    for e in &t.events {
        println!(
            "#   {:<17} {:>8.2} µs [{:.2}, {:.2}]  {} blocks",
            e.event, e.median_us, e.min_us, e.max_us, e.blocks
        );
    }
}

pub(super) fn bench_gemm_rs_cmd(a: BenchGemmRsArgs) -> Result<i32> {
    timed_on_cuda(
        "gemm-rs",
        a.backend,
        "the simulator's gemm-rs is checked by run gemm-rs and verify",
    )?;
    use commfuse_core::fused::gemm_rs::GemmRsShape;
    use commfuse_cuda::gemm_rs::bench::{bench_gemm_rs, GemmRsBenchConfig};
    use commfuse_cuda::gemm_rs::Reduction;
    let layout = parse_b_layout(&a.shape.b_layout)?;
    let shape = GemmRsShape::new(
        a.devices.len(),
        a.shape.m,
        a.shape.n,
        a.shape.k,
        layout,
        a.shape.dtype,
        a.shape.output(),
    )?;
    let cfg = GemmRsBenchConfig {
        devices: a.devices.clone(),
        shape,
        bias: a.shape.bias,
        reductions: a
            .reduce_blocks
            .iter()
            .map(|&b| match b {
                0 => Reduction::Fold,
                blocks => Reduction::Separate { blocks },
            })
            .collect(),
        pieces: a.pieces.clone(),
        numa_groups: a.numa_groups,
        ablation: a.ablation,
        warmup: a.warmup,
        iters: a.iters,
        seed: driver::fresh_seed(),
    };
    let rows = bench_gemm_rs(&cfg)?;
    println!(
        "# commfuse bench gemm-rs: {}×{}×{} (M×N×K, K per rank), B {:?}, {} → {}, GPUs {:?}",
        a.shape.m, a.shape.n, a.shape.k, layout, shape.input, shape.output, a.devices
    );
    println!("# {}", commfuse_cuda::sys::nccl::configuration());
    print_fused_rows(&rows, "cublaslt+nccl", a.json.as_deref())
}

pub(super) fn bench_ag_gemm_cmd(a: BenchAgGemmArgs) -> Result<i32> {
    timed_on_cuda(
        "ag-gemm",
        a.backend,
        "the simulator's ag-gemm is checked by run ag-gemm and verify",
    )?;
    use commfuse_core::fused::ag_gemm::AgGemmShape;
    use commfuse_cuda::ag_gemm::bench::{bench_ag_gemm, AgGemmBenchConfig};
    let layout = parse_b_layout(&a.shape.b_layout)?;
    let shape = AgGemmShape::new(
        a.devices.len(),
        a.shape.m,
        a.shape.n,
        a.shape.k,
        layout,
        a.shape.dtype,
        a.shape.output(),
    )?;
    let cfg = AgGemmBenchConfig {
        devices: a.devices.clone(),
        shape,
        bias: a.shape.bias,
        pieces: a.pieces.clone(),
        warmup: a.warmup,
        iters: a.iters,
        seed: driver::fresh_seed(),
    };
    let rows = bench_ag_gemm(&cfg)?;
    println!(
        "# commfuse bench ag-gemm: {}×{}×{} (M×N×K, M gathered), B {:?}, {} → {}, GPUs {:?}",
        a.shape.m, a.shape.n, a.shape.k, layout, shape.input, shape.output, a.devices
    );
    println!("# {}", commfuse_cuda::sys::nccl::configuration());
    print_fused_rows(&rows, "nccl+cublaslt", a.json.as_deref())
}

/// Prints a fused operator's bench rows (time, rounds, TFLOP/s, exposed time over cuBLASLt
/// alone, E against the unfused row `unfused`, speed-up over it, the check) and writes them as
/// JSON; exit 1 when a checked row is wrong.
fn print_fused_rows(
    rows: &[commfuse_cuda::rank_bench::FusedRow],
    unfused: &str,
    json: Option<&std::path::Path>,
) -> Result<i32> {
    let gemm = rows
        .iter()
        .find(|r| r.implementation == "cublaslt")
        .map(|r| r.time_ms);
    let unfused = rows
        .iter()
        .find(|r| r.implementation == unfused)
        .map(|r| r.time_ms);
    println!(
        "# {:>36} {:>10} {:>19} {:>9} {:>10} {:>8} {:>8} {:>11}  check",
        "impl", "time(ms)", "rounds min-max", "TFLOP/s", "exposed", "E", "vs unf.", "err/bound"
    );
    let mut ok = true;
    for r in rows {
        let exposed = gemm.map(|g| r.time_ms - g);
        let e = match (gemm, unfused) {
            (Some(g), Some(u)) if u > g => Some((u - r.time_ms) / (u - g)),
            _ => None,
        };
        let checked = r.checked > 0;
        let pass = r.out_of_bound == 0;
        ok &= pass;
        println!(
            "  {:>36} {:>10.4} {:>9.4}-{:<9.4} {:>9.1} {:>10} {:>8} {:>8} {:>11}  {}",
            r.implementation,
            r.time_ms,
            r.min_ms,
            r.max_ms,
            r.tflops,
            exposed.map_or("-".into(), |x| format!("{x:.4}")),
            e.map_or("-".into(), |x| format!("{x:.2}")),
            unfused.map_or("-".into(), |u| format!("{:.2}x", u / r.time_ms)),
            if checked {
                format!("{:.3}", r.worst_ratio)
            } else {
                "-".into()
            },
            match (checked, pass) {
                (false, _) if r.implementation.starts_with("ablation") => "(part of a call)",
                (false, _) => "(baseline)",
                (true, true) => "OK",
                (true, false) => "WRONG",
            }
        );
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(rows)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(if ok { 0 } else { 1 })
}
