//! The `commfuse` command line: run, plan, bench, verify, kernels, calibrate, completions. This
//! module is the clap top level ([`Cli`], [`Command`]) and [`execute`], which hands each command
//! to the module of the same name (`run`, `plan`, `bench`, `verify`, `kernels`, `calibrate`,
//! `completions`); the flags several commands share are `common`'s.

mod bench;
mod calibrate;
mod common;
mod completions;
mod kernels;
mod plan;
mod run;
mod verify;

pub use bench::{
    BenchAgGemmArgs, BenchArgs, BenchCmd, BenchGemmArgs, BenchGemmRsArgs, BenchSub, ModelArgs,
};
pub use calibrate::CalibrateArgs;
pub use common::{AlgoArg, ArgsOr, GemmShapeArgs, What, Where};
pub use completions::CompletionsArgs;
pub use kernels::KernelsArgs;
pub use plan::PlanArgs;
pub use run::{RunAgGemmArgs, RunArgs, RunCmd, RunGemmRsArgs, RunSub};
pub use verify::VerifyArgs;

use anyhow::Result;
use clap::{Parser, Subcommand};

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
    /// Run one call of a collective (`run <op>`), or back-to-back calls of a fused operator
    /// (`run gemm-rs`, `run ag-gemm`), check against the float64 reference, print OK
    Run(RunCmd),
    /// Print a plan's per-rank steps, the checker's verdict and the cost card
    Plan(PlanArgs),
    /// Measure a collective's size sweep in the nccl-tests format (`bench <op>`), or our GEMM
    /// beside cuBLASLt (`bench gemm`)
    Bench(BenchCmd),
    /// Run the whole correctness matrix: every collective and fused operator, every path, against float64
    Verify(VerifyArgs),
    /// Compile every kernel (or the files named) with NVRTC for sm_90a (no GPU needed)
    Kernels(KernelsArgs),
    /// Fit the cost model's link figures to measured bench tables (bench --json files)
    Calibrate(CalibrateArgs),
    /// Print the completion script of a shell (bash, zsh, fish, elvish, powershell)
    Completions(CompletionsArgs),
}

/// Runs the parsed command; returns the process exit code.
pub fn execute(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Run(ArgsOr::Args(a)) => run::run(a),
        Command::Run(ArgsOr::Sub(RunSub::GemmRs(a))) => run::run_gemm_rs_cmd(a),
        Command::Run(ArgsOr::Sub(RunSub::AgGemm(a))) => run::run_ag_gemm_cmd(a),
        Command::Plan(a) => plan::plan(a),
        Command::Bench(ArgsOr::Args(a)) => bench::bench_cmd(a),
        Command::Bench(ArgsOr::Sub(BenchSub::Gemm(a))) => bench::bench_gemm_cmd(a),
        Command::Bench(ArgsOr::Sub(BenchSub::GemmRs(a))) => bench::bench_gemm_rs_cmd(a),
        Command::Bench(ArgsOr::Sub(BenchSub::AgGemm(a))) => bench::bench_ag_gemm_cmd(a),
        Command::Verify(a) => verify::verify_cmd(a),
        Command::Kernels(a) => kernels::kernels_cmd(a),
        Command::Calibrate(a) => calibrate::calibrate_cmd(a),
        Command::Completions(a) => completions::completions_cmd(a),
    }
}
