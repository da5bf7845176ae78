//! The `commfuse` command line: run, plan, bench, verify.

use crate::args::{
    columns, depth, elements, gpu, groups, iters, millis, pieces, ranks, rows, seed, warmup, Real,
    Whole,
};
use crate::backends::{self, BackendKind, Placement};
use crate::bench::{self, BenchConfig, Progress};
use crate::driver::{self, Request};
use crate::sizes::parse_sizes;
use crate::verify;
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use commfuse_core::cost::{choose_algo, CostCard};
use commfuse_core::topology::LinkModel;
use commfuse_core::{Algo, DType, OpKind, OpSpec, ReduceOp, Topology};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "commfuse",
    version,
    about = "Communication–computation fused operators for tensor parallelism: collectives as checked plans, run on a CPU simulator or NVLink GPUs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one call of a collective (`run <op>`), or back-to-back calls of fused GEMM +
    /// reduce-scatter (`run gemm-rs`), check against the float64 reference, print OK
    Run(RunCmd),
    /// Print a plan's per-rank steps, the checker's verdict and the cost card
    Plan(PlanArgs),
    /// Measure a collective's size sweep in the nccl-tests format (`bench <op>`), or our GEMM
    /// beside cuBLASLt (`bench gemm`)
    Bench(BenchCmd),
    /// Run the whole correctness matrix
    Verify(VerifyArgs),
    /// Compile every kernel with NVRTC for sm_90a (no GPU needed)
    Kernels(KernelsArgs),
    /// Fit the cost model's link figures to measured bench tables (bench --json files)
    Calibrate(CalibrateArgs),
}

/// A command whose positional arguments (`A`: `bench <op> [flags]`, `run <op> [flags]`) give
/// way to subcommands (`S`: `bench gemm`, `run gemm-rs`), so that both show in `--help`.
/// (Written by hand: clap's derive cannot make a flattened argument struct optional when it
/// flattens others itself, and the op is required only without a subcommand.)
#[derive(Debug)]
pub enum ArgsOr<A, S> {
    Args(A),
    Sub(S),
}

impl<A: clap::FromArgMatches, S: clap::FromArgMatches> clap::FromArgMatches for ArgsOr<A, S> {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        match matches.subcommand() {
            Some(_) => Ok(ArgsOr::Sub(S::from_arg_matches(matches)?)),
            None => Ok(ArgsOr::Args(A::from_arg_matches(matches)?)),
        }
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl<A: Args, S: Subcommand> Args for ArgsOr<A, S> {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        S::augment_subcommands(A::augment_args(cmd))
            .args_conflicts_with_subcommands(true)
            .subcommand_negates_reqs(true)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

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
pub struct BenchAgGemmArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    /// GPUs, rank r on the r-th
    #[arg(long, value_delimiter = ',', default_value = "0,1", allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Vec<usize>,
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

/// `run <op> [flags]` runs a collective, `run gemm-rs [flags]` the fused GEMM + reduce-scatter.
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
pub struct RunAgGemmArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    /// Number of ranks (simulated threads)
    #[arg(long, short = 'p', default_value_t = 2, allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: usize,
    /// Row pieces each rank's chunk is handed on in, 1 to 16: a GEMM per piece on the overlapped
    /// path, a wait per piece before the tiles that read its rows on the fused one
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = pieces())]
    pub pieces: usize,
    /// The fused path: one GEMM of our own per call whose loads of a piece's rows wait for its
    /// flag (default: the overlapped path, a library GEMM per piece)
    #[arg(long)]
    pub fused: bool,
    /// Seed of the random inputs (default: fresh each run)
    #[arg(long, allow_negative_numbers = true, value_parser = seed())]
    pub seed: Option<u64>,
    /// How long a wait may take before the call fails with a diagnosis, ms
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true, value_parser = millis())]
    pub timeout_ms: u64,
}

/// The GEMM of a fused operator: M×N×K, types, B's layout, bias.
#[derive(Args, Debug)]
pub struct GemmShapeArgs {
    /// Rows of A: for gemm-rs every rank's A (the output's rows in all, split over the ranks),
    /// for ag-gemm the gathered A (each rank holds its chunk)
    #[arg(long, allow_negative_numbers = true, value_parser = rows())]
    pub m: usize,
    /// Columns of B and of the output
    #[arg(long, allow_negative_numbers = true, value_parser = columns())]
    pub n: usize,
    /// K (a multiple of 8): for gemm-rs each rank's shard
    #[arg(long, allow_negative_numbers = true, value_parser = depth())]
    pub k: usize,
    /// Input type: bf16 or f16
    #[arg(long, default_value = "bf16")]
    pub dtype: DType,
    /// Output type: the input type (default) or f32
    #[arg(long)]
    pub out_dtype: Option<DType>,
    /// How B is stored: kn ([K, N]) or nk ([N, K], weights transposed)
    #[arg(long, default_value = "nk")]
    pub b_layout: String,
    /// Add a bias [N] (once)
    #[arg(long)]
    pub bias: bool,
}

impl GemmShapeArgs {
    fn output(&self) -> DType {
        self.out_dtype.unwrap_or(self.dtype)
    }

    /// The simulator's configuration of a fused operator of this shape on `ranks` ranks, built
    /// for calls of up to M rows.
    fn sim_config(&self, ranks: usize) -> Result<commfuse_sim::gemm_rs::GemmRsConfig> {
        Ok(commfuse_sim::gemm_rs::GemmRsConfig::new(
            ranks,
            self.m,
            self.n,
            self.k,
            parse_b_layout(&self.b_layout)?,
            self.dtype,
            self.output(),
            self.bias,
        ))
    }
}

#[derive(Args, Debug)]
pub struct RunGemmRsArgs {
    #[command(flatten)]
    pub shape: GemmShapeArgs,
    /// Number of ranks (simulated threads)
    #[arg(long, short = 'p', default_value_t = 2, allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: usize,
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
    /// Backend (gemm-rs runs here on sim; on GPUs through `commfuse bench gemm-rs`)
    #[arg(long, default_value = "sim")]
    pub backend: BackendKind,
    /// GPUs (the cuda backend: not run here)
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Option<Vec<usize>>,
    /// How long a wait may take before the call fails with a diagnosis, ms
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true, value_parser = millis())]
    pub timeout_ms: u64,
}

fn parse_b_layout(text: &str) -> Result<commfuse_core::gemm::BLayout> {
    use commfuse_core::gemm::BLayout;
    match text {
        "kn" => Ok(BLayout::KN),
        "nk" => Ok(BLayout::NK),
        other => bail!("unknown B layout '{other}' (choose kn or nk)"),
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
pub struct CalibrateArgs {
    /// bench --json files measured on the machine to model
    #[arg(required = true)]
    pub reports: Vec<PathBuf>,
    /// Fit and judge only rows of at least this many bytes
    #[arg(long, default_value = "8M", allow_hyphen_values = true)]
    pub min_size: String,
    /// Write the fitted figures as JSON (for --link-gbps/--latency-us/--launch-us)
    #[arg(long)]
    pub json: Option<PathBuf>,
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
pub struct KernelsArgs {
    /// Print ptxas's report (registers, shared memory, spills) of every entry point
    #[arg(long)]
    pub report: bool,
}

#[derive(Args, Debug, Clone)]
pub struct Where {
    /// Number of ranks (simulated threads, or GPUs 0..P with --backend cuda) [default: 8, or
    /// one per GPU of --devices]
    #[arg(long, short = 'p', allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: Option<usize>,
    /// Backend: sim (CPU simulator) or cuda [default: sim, or cuda with --devices]
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// GPUs to use, rank r on the r-th (implies --backend cuda and --ranks); a GPU named twice
    /// holds two ranks side by side, for checking protocols on fewer GPUs (no NCCL baseline)
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Option<Vec<usize>>,
    /// How long a wait may take before the call fails with a diagnosis, ms
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true, value_parser = millis())]
    pub timeout_ms: u64,
}

impl Where {
    /// Where to run, or why the flags disagree.
    fn placement(&self) -> Result<Placement> {
        let timeout = Duration::from_millis(self.timeout_ms);
        let Some(devices) = &self.devices else {
            return Ok(Placement {
                backend: self.backend.unwrap_or(BackendKind::Sim),
                ranks: self.ranks.unwrap_or(8),
                devices: None,
                timeout,
            });
        };
        devices_on_cuda(self.backend, devices)?;
        if let Some(ranks) = self.ranks.filter(|&r| r != devices.len()) {
            bail!(
                "--ranks {ranks} disagrees with --devices {} ({} GPUs, one rank each): drop --ranks or name {ranks} GPUs",
                list(devices),
                devices.len()
            );
        }
        Ok(Placement {
            backend: BackendKind::Cuda,
            ranks: devices.len(),
            devices: Some(devices.clone()),
            timeout,
        })
    }
}

/// Refuses `--devices` beside `--backend sim`: GPUs on a backend that has none.
fn devices_on_cuda(backend: Option<BackendKind>, devices: &[usize]) -> Result<()> {
    if backend == Some(BackendKind::Sim) {
        bail!(
            "--devices {} names GPUs, but --backend sim runs on the CPU: drop one of the two",
            list(devices)
        );
    }
    Ok(())
}

/// `0,1,3`, as the flags take lists.
fn list(items: &[usize]) -> String {
    items
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

#[derive(Args, Debug, Clone)]
pub struct What {
    /// all-reduce, reduce-scatter, all-gather, broadcast, all-to-all or barrier
    pub op: OpKind,
    /// Algorithm: auto (the one the cost model predicts fastest for this op, size and world),
    /// one of the op's algorithms (see the table in README.md), or, for bench, all
    #[arg(long, default_value = "auto")]
    pub algo: String,
    /// Element type: f32, bf16 or f16
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// Reduce op: sum, max, min or prod
    #[arg(long, default_value = "sum")]
    pub reduce: ReduceOp,
    /// Root rank (broadcast)
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = Whole::<usize>::new("a rank (0 to P - 1)"))]
    pub root: usize,
    /// NUMA groups of consecutive ranks (ring-2d)
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = groups())]
    pub numa_groups: usize,
}

/// What `--algo` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlgoArg {
    /// The cost model's pick per size and world
    Auto,
    /// Every algorithm of the op (bench only)
    All,
    /// One named algorithm
    One(Algo),
}

impl What {
    fn algo_arg(&self) -> Result<AlgoArg> {
        match self.algo.as_str() {
            "auto" => Ok(AlgoArg::Auto),
            "all" => Ok(AlgoArg::All),
            name => Algo::parse_for(self.op, name)
                .map(AlgoArg::One)
                .map_err(|_| {
                    let names: Vec<_> = Algo::for_op(self.op).iter().map(|a| a.name()).collect();
                    anyhow::anyhow!(
                        "{} has no algorithm '{name}' (choose auto, one of: {}, or all with bench)",
                        self.op,
                        names.join(", ")
                    )
                }),
        }
    }

    /// The algorithm to run for `count` elements on `world` ranks: the named one, or for
    /// `auto` the cost model's pick under `model`'s link figures (second value true).
    fn resolve(&self, count: usize, world: usize, model: LinkModel) -> Result<(Algo, bool)> {
        match self.algo_arg()? {
            AlgoArg::One(algo) => Ok((algo, false)),
            AlgoArg::Auto => {
                let spec = OpSpec::new(self.op, world, count, self.root)?;
                let topology = Topology::new(world, self.numa_groups)?.with_model(model);
                Ok((choose_algo(spec, &topology, self.dtype.size())?.algo, true))
            }
            AlgoArg::All => {
                bail!("--algo all is for bench; this command runs one algorithm (or auto)")
            }
        }
    }

    fn request(&self, algo: Algo, count: usize, seed: u64) -> Request {
        let mut req = Request::new(self.op, algo, count, self.dtype);
        req.reduce = self.reduce;
        req.root = self.root;
        req.numa_groups = self.numa_groups;
        req.seed = seed;
        req
    }
}

/// How `run` and `plan` name the algorithm: `ring`, or `ring (auto: the cost model's pick)`.
fn algo_label(algo: Algo, auto: bool) -> String {
    if auto {
        format!("{algo} (auto: the cost model's pick)")
    } else {
        algo.to_string()
    }
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
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub what: What,
    /// Number of ranks
    #[arg(long, short = 'p', default_value_t = 4, allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: usize,
    /// Element count
    #[arg(long, short = 'n', default_value_t = 1 << 20, allow_negative_numbers = true, value_parser = elements())]
    pub size: usize,
    /// Print the plan as JSON instead of a listing
    #[arg(long)]
    pub json: bool,
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

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Backend: sim or cuda [default: sim, or cuda with --devices]
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// World sizes to cover, each once (cuda: each P uses GPUs 0..P, or the first P of
    /// --devices) [default: 1,2,3,4,5,7,8, or 1 to the number of --devices]
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: Option<Vec<usize>>,
    /// GPUs (implies --backend cuda; world sizes default to 1..=len)
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Option<Vec<usize>>,
    /// Seed (default: fresh)
    #[arg(long, allow_negative_numbers = true, value_parser = seed())]
    pub seed: Option<u64>,
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true, value_parser = millis())]
    pub timeout_ms: u64,
    /// Write the matrix as JSON
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The world sizes `verify` covers unless --ranks or --devices says.
fn default_worlds() -> Vec<usize> {
    vec![1, 2, 3, 4, 5, 7, 8]
}

/// Runs the parsed command; returns the process exit code.
pub fn execute(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Run(ArgsOr::Args(a)) => run(a),
        Command::Run(ArgsOr::Sub(RunSub::GemmRs(a))) => run_gemm_rs_cmd(a),
        Command::Run(ArgsOr::Sub(RunSub::AgGemm(a))) => run_ag_gemm_cmd(a),
        Command::Plan(a) => plan(a),
        Command::Bench(ArgsOr::Args(a)) => bench_cmd(a),
        Command::Bench(ArgsOr::Sub(BenchSub::Gemm(a))) => bench_gemm_cmd(a),
        Command::Bench(ArgsOr::Sub(BenchSub::GemmRs(a))) => bench_gemm_rs_cmd(a),
        Command::Bench(ArgsOr::Sub(BenchSub::AgGemm(a))) => bench_ag_gemm_cmd(a),
        Command::Verify(a) => verify_cmd(a),
        Command::Kernels(a) => kernels_cmd(a),
        Command::Calibrate(a) => calibrate_cmd(a),
    }
}

fn bench_gemm_rs_cmd(a: BenchGemmRsArgs) -> Result<i32> {
    use commfuse_core::fused::gemm_rs::GemmRsShape;
    use commfuse_cuda::gemm_rs::Reduction;
    use commfuse_cuda::gemm_rs_bench::{bench_gemm_rs, GemmRsBenchConfig};
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
    println!("# {}", commfuse_cuda::nccl::configuration());
    print_fused_rows(&rows, "cublaslt+nccl", a.json.as_deref())
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

fn bench_ag_gemm_cmd(a: BenchAgGemmArgs) -> Result<i32> {
    use commfuse_core::fused::ag_gemm::AgGemmShape;
    use commfuse_cuda::ag_gemm_bench::{bench_ag_gemm, AgGemmBenchConfig};
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
    println!("# {}", commfuse_cuda::nccl::configuration());
    print_fused_rows(&rows, "nccl+cublaslt", a.json.as_deref())
}

fn bench_gemm_cmd(a: BenchGemmArgs) -> Result<i32> {
    use commfuse_core::gemm::{BLayout, GemmProblem};
    if a.backend != BackendKind::Cuda {
        bail!("bench gemm runs on the cuda backend (the simulator's GEMM model is checked by the tests, not timed)");
    }
    let layout = match a.b_layout.as_str() {
        "kn" => BLayout::KN,
        "nk" => BLayout::NK,
        other => bail!("unknown B layout '{other}' (choose kn or nk)"),
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
        None => match commfuse_cuda::driver::device_count() {
            Ok(count) if count >= 2 => Some((a.device + 1) % count),
            _ => None,
        },
    };
    let rows = commfuse_cuda::gemm_bench::bench_gemm(
        a.device,
        peer,
        &problem,
        &a.sms,
        a.warmup,
        a.iters,
        driver::fresh_seed(),
    )?;
    println!(
        "# commfuse bench gemm: {}×{}×{} (M×N×K), B {:?}, {} → {}, GPU {}",
        a.m, a.n, a.k, layout, problem.input, problem.output, a.device
    );
    println!(
        "# {:>26} {:>5} {:>10} {:>9} {:>10} {:>10}  check",
        "impl", "sms", "time(ms)", "TFLOP/s", "#wrong", "err/bound"
    );
    let mut ok = true;
    for r in &rows {
        let pass = r.out_of_bound == 0;
        ok &= pass;
        println!(
            "  {:>26} {:>5} {:>10.4} {:>9.1} {:>10} {:>10.3}  {}",
            r.implementation,
            if r.sms == 0 {
                "all".to_string()
            } else {
                r.sms.to_string()
            },
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
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(if ok { 0 } else { 1 })
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

fn run_gemm_rs_cmd(a: RunGemmRsArgs) -> Result<i32> {
    use commfuse_sim::gemm_rs::GemmRsConfig;
    if a.backend == BackendKind::Cuda || a.devices.is_some() {
        bail!("gemm-rs on the cuda backend runs through `commfuse bench gemm-rs`");
    }
    let config = GemmRsConfig {
        numa_groups: a.numa_groups,
        ..a.shape.sim_config(a.ranks)?
    };
    let output = config.output;
    // validates the shape and types before anything runs
    let shape = config.shape(a.shape.m)?;
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
    let timeout = Duration::from_millis(a.timeout_ms);
    let calls = crate::gemm_rs::run_sim(config, path, &ms, seed, timeout)?;
    println!(
        "gemm-rs {}×{}×{} (M×N×K, K per rank), B {}, {} → {}, {}, on {} ranks (sim), {path}{}{}, seed {seed}",
        a.shape.m,
        a.shape.n,
        a.shape.k,
        a.shape.b_layout,
        a.shape.dtype,
        output,
        if a.shape.bias { "bias" } else { "no bias" },
        a.ranks,
        if a.path == "auto" { " (auto)" } else { "" },
        if two_d {
            format!(", 2D ring over {} NUMA groups", a.numa_groups)
        } else {
            String::new()
        }
    );
    report_calls(&calls)
}

fn run_ag_gemm_cmd(a: RunAgGemmArgs) -> Result<i32> {
    use commfuse_sim::ag_gemm::{shape, AgGemmConfig};
    let config: AgGemmConfig = a.shape.sim_config(a.ranks)?;
    let output = config.output;
    // validates the shape and types before anything runs
    shape(&config, a.shape.m)?;
    let seed = a.seed.unwrap_or_else(driver::fresh_seed);
    let ms = [a.shape.m, a.shape.m.div_ceil(2)];
    let timeout = Duration::from_millis(a.timeout_ms);
    let calls = crate::ag_gemm::run_sim(config, (a.pieces, a.fused), &ms, seed, timeout)?;
    println!(
        "ag-gemm {}×{}×{} (M×N×K, M gathered), B {}, {} → {}, {}, on {} ranks (sim), {}{} piece{} per chunk, seed {seed}",
        a.shape.m,
        a.shape.n,
        a.shape.k,
        a.shape.b_layout,
        a.shape.dtype,
        output,
        if a.shape.bias { "bias" } else { "no bias" },
        a.ranks,
        if a.fused { "fused, " } else { "" },
        a.pieces,
        if a.pieces == 1 { "" } else { "s" }
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

fn calibrate_cmd(a: CalibrateArgs) -> Result<i32> {
    let min = crate::sizes::parse_size(&a.min_size).context("--min-size")?;
    let mut reports = Vec::new();
    for path in &a.reports {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        // files from before bench recorded every plan parameter: their plans cannot be rebuilt
        // with certainty, so say so rather than assume the defaults
        if value.get("rows").is_some() && value.get("numa_groups").is_none() {
            bail!(
                "{} does not record the root and NUMA groups its plans were built with (written by an older bench): measure it again",
                path.display()
            );
        }
        let report: crate::bench::BenchReport = serde_json::from_value(value)
            .with_context(|| format!("{} is not a bench --json file", path.display()))?;
        reports.push(report);
    }
    let samples = crate::calibrate::samples(&reports, min)?;
    let before = crate::calibrate::worst_error(&samples, LinkModel::default());
    let held = crate::calibrate::held_out(&samples)?;
    let model = crate::calibrate::fit(&samples);
    let in_sample = crate::calibrate::worst_error(&samples, model);
    println!(
        "fitted on {} rows of at least {}: --link-gbps {:.1} --latency-us {:.2} --launch-us {:.2}",
        samples.len(),
        crate::sizes::format_size(min),
        model.link_gbps,
        model.latency_us,
        model.launch_us
    );
    println!("{}", crate::calibrate::report(&samples, model, Some(&held)));
    println!(
        "held-out error (fitted on every other size, judged on the sizes between, both ways): worst {:.1}%, mean {:.1}%",
        100.0 * held.worst(),
        100.0 * held.mean()
    );
    println!(
        "worst error on the rows fitted: {:.1}% ({:.1}% with the defaults)",
        100.0 * in_sample,
        100.0 * before
    );
    if let Some(path) = &a.json {
        let out = Calibration {
            model,
            rows: samples.len(),
            held_out_worst_error: held.worst(),
            held_out_mean_error: held.mean(),
            in_sample_worst_error: in_sample,
            default_worst_error: before,
            held_out_folds: held.fitted,
        };
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(0)
}

/// `calibrate --json`: the fitted figures (the keys of --link-gbps/--latency-us/--launch-us)
/// and how well they predict.
#[derive(serde::Serialize)]
struct Calibration {
    #[serde(flatten)]
    model: LinkModel,
    rows: usize,
    /// Worst relative error on rows the fit did not see (two folds of alternating sizes)
    held_out_worst_error: f64,
    held_out_mean_error: f64,
    /// Worst relative error of the figures fitted on all rows, on those rows
    in_sample_worst_error: f64,
    /// Worst relative error of the default figures
    default_worst_error: f64,
    /// The figures fitted on the even-indexed sizes and on the odd-indexed ones
    held_out_folds: [LinkModel; 2],
}

fn kernels_cmd(a: KernelsArgs) -> Result<i32> {
    for source in commfuse_cuda::nvrtc::KERNELS {
        let compiled = commfuse_cuda::nvrtc::compile(*source, true)?;
        println!(
            "{}: compiled for {} ({} bytes of cubin)",
            source.name,
            commfuse_cuda::nvrtc::ARCH,
            compiled.cubin.len()
        );
        if a.report {
            println!("{}", compiled.log.trim_end());
        }
    }
    Ok(0)
}

fn run(a: RunArgs) -> Result<i32> {
    let seed = a.seed.unwrap_or_else(driver::fresh_seed);
    let backend = backends::open(&a.place.placement()?)?;
    let (algo, auto) = a
        .what
        .resolve(a.size, backend.world_size(), LinkModel::default())?;
    let req = a.what.request(algo, a.size, seed);
    let out = driver::run(backend.as_ref(), &req, verify::CALLS, a.dump.as_deref())?;
    println!(
        "{} {} on {} ranks ({}), {} × {}, reduce {}, seed {seed}",
        req.op,
        algo_label(algo, auto),
        backend.world_size(),
        backend.name(),
        req.count,
        req.dtype,
        req.reduce
    );
    println!("{}", out.card);
    println!(
        "measured: {:.1} µs (slowest rank, the first call); {} calls checked (the first alone, the rest queued back to back); {} elements each, max error {:.2e}",
        out.timing.slowest().as_secs_f64() * 1e6,
        out.calls,
        out.comparison.checked,
        out.comparison.max_error
    );
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

fn plan(a: PlanArgs) -> Result<i32> {
    let (algo, auto) = a.what.resolve(a.size, a.ranks, LinkModel::default())?;
    let req = a.what.request(algo, a.size, 0);
    if auto && !a.json {
        println!("algorithm: {}", algo_label(algo, auto));
    }
    let (checked, topology) = match driver::plan(&req, a.ranks) {
        Ok(x) => x,
        Err(commfuse_core::Error::Plan(e)) => {
            println!("checker: REJECTED: {e}");
            return Ok(1);
        }
        Err(e) => return Err(e.into()),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(checked.plan())?);
        return Ok(0);
    }
    print!("{}", checked.plan().listing());
    println!("checker: OK (no deadlock, no reused slot, no race, result as defined; two consecutive calls)");
    println!("{}", CostCard::of(&checked, &topology, req.dtype.size()));
    Ok(0)
}

fn bench_cmd(a: BenchArgs) -> Result<i32> {
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
    let (algos, auto) = match a.what.algo_arg()? {
        AlgoArg::All => (Algo::for_op(a.what.op).to_vec(), true),
        AlgoArg::Auto => (Vec::new(), true),
        AlgoArg::One(algo) => (vec![algo], false),
    };
    let cfg = BenchConfig {
        op: a.what.op,
        auto,
        baselines: if a.no_baselines {
            Vec::new()
        } else {
            backend.baselines(a.what.op)
        },
        protocols: backend.protocols(a.what.op),
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

fn verify_cmd(a: VerifyArgs) -> Result<i32> {
    if let Some(ranks) = &a.ranks {
        if ranks.is_empty() || ranks.contains(&0) {
            bail!("--ranks needs world sizes of at least 1");
        }
        if let Some((i, p)) = ranks
            .iter()
            .enumerate()
            .find(|&(i, p)| ranks[..i].contains(p))
        {
            bail!(
                "--ranks {} names world size {p} twice (the second time as item {}): name each once",
                list(ranks),
                i + 1
            );
        }
    }
    let seed = a.seed.unwrap_or_else(driver::fresh_seed);
    let (backend, worlds): (BackendKind, Vec<usize>) = match &a.devices {
        Some(d) => {
            devices_on_cuda(a.backend, d)?;
            match &a.ranks {
                Some(ranks) => {
                    if let Some(p) = ranks.iter().find(|&&p| p > d.len()) {
                        bail!(
                            "--ranks {}: world size {p} needs {p} GPUs, --devices {} names {}",
                            list(ranks),
                            list(d),
                            d.len()
                        );
                    }
                    (BackendKind::Cuda, ranks.clone())
                }
                None => (BackendKind::Cuda, (1..=d.len()).collect()),
            }
        }
        // on GPUs, the world sizes this machine can hold
        None if a.backend == Some(BackendKind::Cuda) => {
            let ranks = a.ranks.clone().unwrap_or_else(default_worlds);
            let gpus = commfuse_cuda::driver::device_count()?;
            let worlds: Vec<usize> = ranks.iter().copied().filter(|&p| p <= gpus).collect();
            if worlds.is_empty() {
                bail!("none of the world sizes {ranks:?} fits on this machine's {gpus} GPU(s)");
            }
            (BackendKind::Cuda, worlds)
        }
        None => (
            BackendKind::Sim,
            a.ranks.clone().unwrap_or_else(default_worlds),
        ),
    };
    let placement = Placement {
        backend,
        ranks: 1,
        devices: a.devices.clone(),
        timeout: Duration::from_millis(a.timeout_ms),
    };
    println!(
        "# commfuse verify: backend {backend}, world sizes {worlds:?}, seed {seed}; each cell: 4 calls per reduce op and size (3 queued back to back)",
    );
    println!(
        "  {:<15} {:<11} {:<5} {:>5} {:>7} {:>10}",
        "op", "algo", "type", "runs", "result", "max error"
    );
    let rows = verify::run(&placement, &worlds, seed, |row| {
        println!("{}", verify::format_row(row))
    })?;
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let failures: usize = rows.iter().map(|r| r.failures).sum();
    let runs: usize = rows.iter().map(|r| r.runs).sum();
    println!("{} passed, {} failed", runs - failures, failures);
    Ok(if failures == 0 { 0 } else { 1 })
}
