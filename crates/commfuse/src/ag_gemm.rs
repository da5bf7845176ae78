//! `commfuse run ag-gemm`: checked back-to-back calls of all-gather + GEMM with fresh random
//! inputs, every output element of every rank against the float64 reference and the GEMM's
//! error bound, and every element of the gathered A (which must be exact), on the simulator
//! ([`run_sim`]) or on GPUs ([`run_cuda`]); one seed gives both the same operands.

use crate::gemm_rs::CallCheck;
use crate::progress::long_run_warning;
use anyhow::{anyhow, Result};
use commfuse_core::gemm::{check_elements, reference_gemm, Epilogue};
use commfuse_core::{DType, Element};
use commfuse_sim::ag_gemm::{shape, AgCallInputs, AgGemmConfig, SimAgGemm};
use commfuse_sim::memory::Footprint;
use commfuse_sim::{World, WorldConfig};
use half::{bf16, f16};
use std::sync::Mutex;

/// What [`run_sim`] holds at its peak, but for the world's signal pads: the operator
/// (`commfuse_sim::ag_gemm::memory`), every call's inputs (each rank's chunk of A and its B,
/// the bias) and outputs (every rank's [M, N] product and gathered A), and the float64 check
/// of one rank's output at a time (the gathered A, the reference elements, the operands
/// widened and the products).
pub fn footprint(config: &AgGemmConfig, p: usize, ms: &[usize]) -> Footprint {
    use commfuse_core::gemm::ReferenceElement;
    let c = config;
    let (n, k) = (c.n, c.k);
    let (si, so) = (c.input.size(), c.output.size());
    let what = format!("run ag-gemm {}×{n}×{k} on {p} ranks", c.max_m);
    let op = commfuse_sim::ag_gemm::memory(c, p);
    let mut f = Footprint::new(what).and(&op.total());
    for &m in ms {
        f = f
            .item(&[m, k, si])
            .item(&[p, k, n, si])
            .item(&[n * usize::from(c.bias), so])
            .item(&[p, m, n, so])
            .item(&[p, m, k, si]);
    }
    let m = ms.iter().copied().max().unwrap_or(0);
    f.item(&[m, k, si])
        .item(&[m, n, std::mem::size_of::<ReferenceElement>() + 2 * 8])
        .item(&[2, m, k, 8])
        .item(&[2, k, n, 8])
}

/// Runs one call per entry of `ms` back to back on a fresh simulated world of `p` ranks (its
/// chunks in the configuration's pieces, on its path), inputs drawn from `seed`; checks each
/// call's outputs and gathered A.
pub fn run_sim(p: usize, config: AgGemmConfig, ms: &[usize], seed: u64) -> Result<Vec<CallCheck>> {
    let run = (p, config, ms, seed);
    match (config.input, config.output) {
        (DType::BF16, DType::BF16) => run_typed::<bf16, bf16>(run),
        (DType::BF16, DType::F32) => run_typed::<bf16, f32>(run),
        (DType::F16, DType::F16) => run_typed::<f16, f16>(run),
        (DType::F16, DType::F32) => run_typed::<f16, f32>(run),
        (input, output) => Err(anyhow!(
            "all-gather + GEMM takes bf16 or f16 inputs and outputs in the input type or f32, got {input} → {output}"
        )),
    }
}

/// [`run_sim`] on GPUs `devices` (rank r on `devices[r]`) by the CUDA backend's operator of
/// the same configuration (built for the largest of `ms`).
pub fn run_cuda(
    devices: &[usize],
    config: AgGemmConfig,
    ms: &[usize],
    seed: u64,
) -> Result<Vec<CallCheck>> {
    let config = AgGemmConfig {
        max_m: ms.iter().copied().max().unwrap_or(config.max_m),
        ..config
    };
    let gpus = commfuse_cuda::sys::driver::open_group(devices)?;
    Ok(commfuse_cuda::ag_gemm::checked::run_checked(
        &gpus, config, ms, seed,
    )?)
}

/// Per rank, per call: the output and the gathered A.
type Outputs<TO, TI> = Vec<Mutex<Vec<(Vec<TO>, Vec<TI>)>>>;

fn run_typed<TI: Element, TO: Element>(
    (p, config, ms, seed): (usize, AgGemmConfig, &[usize], u64),
) -> Result<Vec<CallCheck>> {
    let (n, k) = (config.n, config.k);
    if p == 0 || p > commfuse_core::MAX_WORLD_SIZE {
        return Err(anyhow!(
            "--ranks must be between 1 and {}, got {p}",
            commfuse_core::MAX_WORLD_SIZE
        ));
    }
    let footprint = footprint(&config, p, ms);
    footprint.check()?;
    let pad_cols = 64;
    let pad_rows = SimAgGemm::<TI, TO>::pad_rows(&config, p, pad_cols)? as u32 + 8;
    let world_config = WorldConfig {
        timeout: config.timeout,
        pad_rows,
        pad_cols: pad_cols as u32,
    };
    footprint.and(&world_config.memory(p).total()).check()?;
    let what = format!("ag-gemm {}×{n}×{k} on {p} ranks", config.max_m);
    let ranks_and_cores = (p, crate::progress::cores());
    if let Some(warning) = long_run_warning(&what, (ms, n, k), ranks_and_cores) {
        eprintln!("{warning}");
    }
    // a step per rank's call, then one per rank's check of it
    let bar = crate::progress::bar(2 * (p * ms.len()) as u64, &what);
    let world = World::new(p, world_config)?;
    let op = SimAgGemm::<TI, TO>::new(&world, config)?;
    let AgCallInputs { a, b, bias } =
        AgCallInputs::<TI, TO>::random(p, (config.n, config.k), config.bias, ms, seed);
    let outs: Outputs<TO, TI> = (0..p)
        .map(|_| {
            let calls = ms
                .iter()
                .map(|&m| (vec![TO::poison(); m * n], vec![TI::poison(); m * k]))
                .collect();
            Mutex::new(calls)
        })
        .collect();
    world.run(|ctx| {
        let r = ctx.rank();
        let mut outs = outs[r].lock().unwrap();
        for (c, &m) in ms.iter().enumerate() {
            let (out, gathered) = &mut outs[c];
            let operands = (a[c][r].as_slice(), b[c][r].as_slice(), bias[c].as_deref());
            op.forward(ctx, m, operands, out, Some(gathered))?;
            bar.inc(1);
        }
        Ok(())
    })?;
    let mut checks = Vec::new();
    for (c, &m) in ms.iter().enumerate() {
        let problem = shape(&config, p, m)?.problem();
        let full: Vec<TI> = a[c].iter().flatten().copied().collect();
        let epilogue = Epilogue {
            bias: config.bias,
            ..Epilogue::default()
        };
        let mut ranks = Vec::new();
        for (r, out) in outs.iter().enumerate() {
            let (out, gathered) = &out.lock().unwrap()[c];
            let want = reference_gemm(
                &problem,
                &epilogue,
                &full,
                &b[c][r],
                None,
                bias[c].as_deref(),
                None,
            );
            let got = out.iter().map(|x| x.to_f64());
            let check = check_elements(&problem, &epilogue, got, &want);
            // the gathered A is a copy: any difference is a wrong element
            if let Some(i) = gathered
                .iter()
                .zip(&full)
                .position(|(g, w)| g.to_f64().to_bits() != w.to_f64().to_bits())
            {
                return Err(anyhow!(
                    "call {c} (M={m}): rank {r}'s gathered A differs at element {i} (row {}, column {})",
                    i / k,
                    i % k
                ));
            }
            ranks.push(check);
            bar.inc(1);
        }
        checks.push(CallCheck { m, ranks });
    }
    bar.finish_and_clear();
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use commfuse_core::gemm::BLayout;

    #[test]
    fn a_run_counts_every_ranks_whole_output_and_the_float64_check() {
        // 50000 × 50000: every rank's output alone is 5 GB in bf16, the float64 check of one
        // rank 100 GB
        let config = AgGemmConfig::new(50_000, 50_000, 8, BLayout::NK, DType::BF16, DType::BF16);
        let total = footprint(&config, 2, &[50_000, 25_000]).bytes().unwrap();
        let outputs = 2 * (50_000u64 * 50_000 + 25_000 * 50_000) * 2;
        let check = 50_000u64 * 50_000 * 40;
        assert!(total >= outputs + check, "{total}");
        let err = footprint(&config, 2, &[50_000, 25_000])
            .check_within(Some(24 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("run ag-gemm 50000×50000×8 on 2 ranks needs 116.4 GiB"),
            "{err}"
        );
    }
}
