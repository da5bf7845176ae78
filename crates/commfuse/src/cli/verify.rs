//! `commfuse verify`: the correctness matrix over world sizes on the simulator or GPUs, one row
//! per op, algorithm and type.

use super::common::{devices_on_cuda, list};
use crate::args::{gpu, millis, ranks, seed};
use crate::backends::{BackendKind, Placement};
use crate::driver;
use crate::verify;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

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

pub(super) fn verify_cmd(a: VerifyArgs) -> Result<i32> {
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
            let gpus = commfuse_cuda::sys::driver::device_count()?;
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
        "  {:<15} {:<11} {:<9} {:>5} {:>7} {:>11}",
        "op", "algo", "type", "runs", "result", "max error"
    );
    let mut rows = verify::run(&placement, &worlds, seed, |row| {
        println!("{}", verify::format_row(row))
    })?;
    println!(
        "# fused operators: N = {}, K = {}, calls of M = 7P + 3, 1 and 130 + P back to back, a bias, B [K, N] at even P and [N, K] at odd; error as a share of the bound",
        verify::FUSED_N,
        verify::FUSED_K,
    );
    println!(
        "  {:<15} {:<11} {:<9} {:>5} {:>7} {:>11}",
        "op", "path", "types", "runs", "result", "worst/bound"
    );
    rows.extend(verify::run_fused(&placement, &worlds, seed, |row| {
        println!("{}", verify::format_row(row))
    })?);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let failures: usize = rows.iter().map(|r| r.failures).sum();
    let runs: usize = rows.iter().map(|r| r.runs).sum();
    println!("{} passed, {} failed", runs - failures, failures);
    Ok(if failures == 0 { 0 } else { 1 })
}
