//! What several commands share: the op and its algorithm, type, reduce op, root and NUMA groups
//! ([`What`], for `run`, `plan` and `bench`), where to run ([`Where`]: ranks, backend, GPUs,
//! timeout), a fused operator's GEMM ([`GemmShapeArgs`]), and [`ArgsOr`], a command's own
//! arguments or its subcommands (`run <op>` or `run gemm-rs`, `bench <op>` or `bench gemm`).

use crate::args::{columns, depth, gpu, groups, millis, ranks, rows, Whole};
use crate::backends::{BackendKind, Placement};
use crate::driver::Request;
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use commfuse_core::backend::Backend;
use commfuse_core::cost::choose_algo;
use commfuse_core::gemm::BLayout;
use commfuse_core::topology::LinkModel;
use commfuse_core::{Algo, DType, Implementation, OpKind, OpSpec, ReduceOp, Topology};
use std::time::Duration;

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
    pub(super) fn output(&self) -> DType {
        self.out_dtype.unwrap_or(self.dtype)
    }

    /// A fused operator's configuration (either backend takes it) of this shape, for calls of
    /// up to M rows: `new` is its constructor from (max M, N, K, B's layout, input and output
    /// types), `GemmRsConfig::new` or `AgGemmConfig::new`; the caller sets the bias and the rest.
    pub(super) fn fused_config<C>(
        &self,
        new: impl FnOnce(usize, usize, usize, BLayout, DType, DType) -> C,
    ) -> Result<C> {
        let layout = parse_b_layout(&self.b_layout)?;
        Ok(new(
            self.m,
            self.n,
            self.k,
            layout,
            self.dtype,
            self.output(),
        ))
    }
}

pub(super) fn parse_b_layout(text: &str) -> Result<commfuse_core::gemm::BLayout> {
    use commfuse_core::gemm::BLayout;
    match text {
        "kn" => Ok(BLayout::KN),
        "nk" => Ok(BLayout::NK),
        other => bail!("unknown B layout '{other}' (choose kn or nk)"),
    }
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
    pub(super) fn placement(&self) -> Result<Placement> {
        placement(
            (self.ranks, 8),
            self.backend,
            self.devices.as_deref(),
            self.timeout_ms,
        )
    }
}

/// Where a fused operator's `run` goes: ranks, backend, GPUs and the waits' bound, as for the
/// collectives (two ranks unless told).
#[derive(Args, Debug, Clone)]
pub struct FusedWhere {
    /// Number of ranks (simulated threads, or GPUs 0..P with --backend cuda) [default: 2, or
    /// one per GPU of --devices]
    #[arg(long, short = 'p', allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: Option<usize>,
    /// Backend: sim (CPU simulator) or cuda [default: sim, or cuda with --devices]
    #[arg(long)]
    pub backend: Option<BackendKind>,
    /// GPUs to use, rank r on the r-th, each once (implies --backend cuda and --ranks)
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = gpu())]
    pub devices: Option<Vec<usize>>,
    /// How long a wait may take before the call fails with a diagnosis, ms
    #[arg(long, default_value_t = 5000, allow_negative_numbers = true, value_parser = millis())]
    pub timeout_ms: u64,
}

impl FusedWhere {
    /// Where to run, or why the flags disagree; on the cuda backend the GPUs, 0..P unless named.
    pub(super) fn placement(&self) -> Result<Placement> {
        let mut place = placement(
            (self.ranks, 2),
            self.backend,
            self.devices.as_deref(),
            self.timeout_ms,
        )?;
        if place.backend == BackendKind::Cuda && place.devices.is_none() {
            place.devices = Some((0..place.ranks).collect());
        }
        Ok(place)
    }
}

/// Where to run from the flags: `(--ranks, its default)`, `--backend`, `--devices`,
/// `--timeout-ms`; or why they disagree.
fn placement(
    (ranks, default_ranks): (Option<usize>, usize),
    backend: Option<BackendKind>,
    devices: Option<&[usize]>,
    timeout_ms: u64,
) -> Result<Placement> {
    let timeout = Duration::from_millis(timeout_ms);
    let Some(devices) = devices else {
        return Ok(Placement {
            backend: backend.unwrap_or(BackendKind::Sim),
            ranks: ranks.unwrap_or(default_ranks),
            devices: None,
            timeout,
        });
    };
    devices_on_cuda(backend, devices)?;
    if let Some(ranks) = ranks.filter(|&r| r != devices.len()) {
        bail!(
            "--ranks {ranks} disagrees with --devices {} ({} GPUs, one rank each): drop --ranks or name {ranks} GPUs",
            list(devices),
            devices.len()
        );
    }
    Ok(Placement {
        backend: BackendKind::Cuda,
        ranks: devices.len(),
        devices: Some(devices.to_vec()),
        timeout,
    })
}

/// Refuses `--devices` beside `--backend sim`: GPUs on a backend that has none.
pub(super) fn devices_on_cuda(backend: Option<BackendKind>, devices: &[usize]) -> Result<()> {
    if backend == Some(BackendKind::Sim) {
        bail!(
            "--devices {} names GPUs, but --backend sim runs on the CPU: drop one of the two",
            list(devices)
        );
    }
    Ok(())
}

/// `0,1,3`, as the flags take lists.
pub(super) fn list(items: &[usize]) -> String {
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
    #[arg(long, default_value = "auto", help = algo_help())]
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

/// `--algo`'s help: every op's implementations, from the registry.
fn algo_help() -> String {
    let per_op: Vec<String> = OpKind::ALL
        .iter()
        .map(|&op| format!("{op}: {}", Implementation::names_for(op)))
        .collect();
    format!(
        "Algorithm: auto (the one the cost model predicts fastest for this op, size and world), all (bench: every plan as well), or one of the op's implementations (plans, our protocols, baselines; the sim backend runs the plans and ll) — {}",
        per_op.join("; ")
    )
}

/// What `--algo` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlgoArg {
    /// The cost model's pick per size and world
    Auto,
    /// Every algorithm of the op (bench only)
    All,
    /// One named implementation: a plan, a protocol of ours or a baseline
    One(Implementation),
}

impl What {
    /// `--algo` parsed against the op's implementations; the error lists them.
    pub(super) fn algo_arg(&self) -> Result<AlgoArg> {
        match self.algo.as_str() {
            "auto" => Ok(AlgoArg::Auto),
            "all" => Ok(AlgoArg::All),
            name => Implementation::parse_for(self.op, name)
                .map(AlgoArg::One)
                .map_err(|_| {
                    anyhow::anyhow!(
                        "{} has no algorithm '{name}' (choose auto, one of: {}, or all with bench)",
                        self.op,
                        Implementation::names_for(self.op)
                    )
                }),
        }
    }

    /// The implementation to run for `count` elements on `world` ranks: the named one, or for
    /// `auto` the cost model's pick of plan under `model`'s link figures (second value true).
    pub(super) fn resolve(
        &self,
        count: usize,
        world: usize,
        model: LinkModel,
    ) -> Result<(Implementation, bool)> {
        match self.algo_arg()? {
            AlgoArg::One(which) => Ok((which, false)),
            AlgoArg::Auto => {
                let spec = OpSpec::new(self.op, world, count, self.root)?;
                let topology = Topology::new(world, self.numa_groups)?.with_model(model);
                let algo = choose_algo(spec, &topology, self.dtype.size())?.algo;
                Ok((Implementation::Plan(algo), true))
            }
            AlgoArg::All => {
                bail!("--algo all is for bench; this command runs one algorithm (or auto)")
            }
        }
    }

    pub(super) fn request(&self, algo: Algo, count: usize, seed: u64) -> Request {
        let mut req = Request::new(self.op, algo, count, self.dtype);
        req.reduce = self.reduce;
        req.root = self.root;
        req.numa_groups = self.numa_groups;
        req.seed = seed;
        req
    }
}

/// Refuses `which` where `backend` does not run it for `op`, naming what it does run.
pub(super) fn ensure_offered(
    backend: &dyn Backend,
    op: OpKind,
    which: Implementation,
) -> Result<()> {
    if backend.offers(op, which) {
        return Ok(());
    }
    let offered: Vec<&str> = Implementation::for_op(op)
        .into_iter()
        .filter(|&i| backend.offers(op, i))
        .map(Implementation::name)
        .collect();
    bail!(
        "the {} backend has no {which} for {op} (it runs: {}){}",
        backend.name(),
        offered.join(", "),
        if backend.name() == "sim" {
            "; the cuda backend runs it"
        } else {
            ""
        }
    )
}

/// How `run` and `plan` name the algorithm: `ring`, or `ring (auto: the cost model's pick)`.
pub(super) fn algo_label(algo: impl std::fmt::Display, auto: bool) -> String {
    if auto {
        format!("{algo} (auto: the cost model's pick)")
    } else {
        algo.to_string()
    }
}
