//! `commfuse run gemm-rs`: checked back-to-back calls of GEMM + reduce-scatter (by the path
//! asked for, or the one `auto` picks) with fresh random inputs, every output element of every
//! rank against the float64 reference and the path's error bound, on the simulator
//! ([`run_sim`]) or on GPUs ([`run_cuda`]), both built from one [`GemmRsConfig`]; one seed gives
//! both the same operands.

use crate::progress::long_run_warning;
use anyhow::{anyhow, Result};
use commfuse_core::fused::gemm_rs::{check_elements_on, reference, GemmRsPath};
use commfuse_core::{DType, Element};
use commfuse_sim::gemm_rs::{CallInputs, GemmRsConfig, GemmRsOperator};
use commfuse_sim::memory::Footprint;
use commfuse_sim::World;
use half::{bf16, f16};
use std::sync::Mutex;

pub use commfuse_core::fused::CallCheck;

/// What [`run_sim`] holds at its peak, but for the world's signal pads: the operator of `path`
/// (`commfuse_sim::gemm_rs::memory`), every call's inputs (each rank's A and B, the bias) and
/// outputs, and the float64 check of one rank's chunk at a time (the reference elements, the
/// operands widened, the products and the computed values as f64).
pub fn footprint(config: &GemmRsConfig, p: usize, path: GemmRsPath, ms: &[usize]) -> Footprint {
    use commfuse_core::fused::gemm_rs::ReferenceElement;
    let c = config;
    let (n, k) = (c.n, c.k);
    let (si, so) = (c.input.size(), c.output.size());
    let what = format!(
        "run gemm-rs {}×{n}×{k} on {p} ranks by the {path} path",
        c.max_m
    );
    let mut f = Footprint::new(what).and(&commfuse_sim::gemm_rs::memory(c, p, path).total());
    for &m in ms {
        f = f
            .item(&[p, m, k, si])
            .item(&[p, k, n, si])
            .item(&[n * usize::from(c.bias), so])
            .item(&[m, n, so]);
    }
    let chunk = ms.iter().max().map_or(0, |m| m.div_ceil(p.max(1)));
    f.item(&[chunk, n, std::mem::size_of::<ReferenceElement>() + 3 * 8])
        .item(&[2, chunk, k, 8])
        .item(&[2, k, n, 8])
}

/// Runs one call per entry of `ms` back to back on a fresh simulated world of `p` ranks (no
/// barrier between calls) by the configuration's path (for `auto`, the one it picks at
/// `max_m`), inputs drawn from `seed`, and checks each.
pub fn run_sim(p: usize, config: GemmRsConfig, ms: &[usize], seed: u64) -> Result<Vec<CallCheck>> {
    let run = (p, config, ms, seed);
    match (config.input, config.output) {
        (DType::BF16, DType::BF16) => run_typed::<bf16, bf16>(run),
        (DType::BF16, DType::F32) => run_typed::<bf16, f32>(run),
        (DType::F16, DType::F16) => run_typed::<f16, f16>(run),
        (DType::F16, DType::F32) => run_typed::<f16, f32>(run),
        (input, output) => Err(anyhow!(
            "GEMM + reduce-scatter takes bf16 or f16 inputs and outputs in the input type or f32, got {input} → {output}"
        )),
    }
}

/// [`run_sim`] on GPUs `devices` (rank r on `devices[r]`) by the CUDA backend's operator of
/// the same configuration (built for the largest of `ms`), whose `auto` picks a path per
/// call's M, as it does for a caller. Returns the checks and the path each call took.
pub fn run_cuda(
    devices: &[usize],
    config: GemmRsConfig,
    ms: &[usize],
    seed: u64,
) -> Result<(Vec<CallCheck>, Vec<GemmRsPath>)> {
    let config = GemmRsConfig {
        max_m: ms.iter().copied().max().unwrap_or(config.max_m),
        ..config
    };
    let gpus = commfuse_cuda::sys::driver::open_group(devices)?;
    let calls = commfuse_cuda::gemm_rs::checked::run_checked(&gpus, config, ms, seed)?;
    Ok(calls.into_iter().unzip())
}

fn run_typed<TI: Element, TO: Element>(
    (p, config, ms, seed): (usize, GemmRsConfig, &[usize], u64),
) -> Result<Vec<CallCheck>> {
    let n = config.n;
    if p == 0 || p > commfuse_core::MAX_WORLD_SIZE {
        return Err(anyhow!(
            "--ranks must be between 1 and {}, got {p}",
            commfuse_core::MAX_WORLD_SIZE
        ));
    }
    let path = GemmRsOperator::<TI, TO>::path(&config, p)?;
    let footprint = footprint(&config, p, path, ms);
    footprint.check()?;
    let world_config = GemmRsOperator::<TI, TO>::world_config(&config, p)?;
    footprint.and(&world_config.memory(p).total()).check()?;
    let what = format!("gemm-rs {}×{n}×{} on {p} ranks", config.max_m, config.k);
    let ranks_and_cores = (p, crate::progress::cores());
    if let Some(warning) = long_run_warning(&what, (ms, n, config.k), ranks_and_cores) {
        eprintln!("{warning}");
    }
    // a step per rank's call, then one per rank's check of it
    let bar = crate::progress::bar(2 * (p * ms.len()) as u64, &what);
    let world = World::new(p, world_config)?;
    let op = GemmRsOperator::<TI, TO>::new(&world, config)?;
    let CallInputs { a, b, bias } =
        CallInputs::<TI, TO>::random(p, (config.n, config.k), config.bias, ms, seed);
    let outs: Vec<Mutex<Vec<Vec<TO>>>> = (0..p)
        .map(|r| {
            Mutex::new(
                ms.iter()
                    .map(|&m| vec![TO::poison(); commfuse_core::op::chunk_range(m, p, r).len() * n])
                    .collect(),
            )
        })
        .collect();
    world.run(|ctx| {
        let r = ctx.rank();
        let mut outs = outs[r].lock().unwrap();
        for (c, &m) in ms.iter().enumerate() {
            let operands = (a[c][r].as_slice(), b[c][r].as_slice(), bias[c].as_deref());
            op.forward(ctx, m, operands, &mut outs[c])?;
            bar.inc(1);
        }
        Ok(())
    })?;
    let mut checks = Vec::new();
    for (c, &m) in ms.iter().enumerate() {
        let shape = config.shape(p, m)?;
        let a: Vec<&[TI]> = a[c].iter().map(Vec::as_slice).collect();
        let b: Vec<&[TI]> = b[c].iter().map(Vec::as_slice).collect();
        let ranks = outs
            .iter()
            .enumerate()
            .map(|(r, out)| {
                let want = reference(&shape, r, &a, &b, bias[c].as_deref());
                let got = out.lock().unwrap()[c]
                    .iter()
                    .map(|x| x.to_f64())
                    .collect::<Vec<_>>();
                bar.inc(1);
                check_elements_on(&shape, path, got, &want)
            })
            .collect();
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
    fn a_run_counts_its_inputs_outputs_and_float64_checks_beside_the_operator() {
        let (p, m, n, k) = (2, 4096, 4096, 512);
        let config = GemmRsConfig::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16);
        let path = GemmRsPath::Fused;
        let ms = [m, m / 2];
        let op = commfuse_sim::gemm_rs::memory(&config, p, path)
            .total()
            .bytes()
            .unwrap();
        let total = footprint(&config, p, path, &ms).bytes().unwrap();
        // every call's A and B on every rank, and its outputs, in bf16
        let inputs: u64 = ms.iter().map(|&m| (p * (m * k + k * n) * 2) as u64).sum();
        let outputs: u64 = ms.iter().map(|&m| (m * n * 2) as u64).sum();
        // one rank's chunk checked in f64 at a time: at least its reference elements
        let check = (m / p * n * 32) as u64;
        assert!(total >= op + inputs + outputs + check, "{total}");
        // the run measured a 0.64 GB peak
        assert!(total < 800 << 20, "{total}");
        let fits = footprint(&config, p, path, &ms).check_within(Some(1 << 30));
        assert!(fits.is_ok(), "{fits:?}");
    }
}
