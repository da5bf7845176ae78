//! GEMM + reduce-scatter and an all-reduce on the CPU simulator, no GPU needed: P simulated
//! ranks (one thread each) call the library's operators on their own operands, and every
//! output element of every rank is checked against a float64 reference computed here.
//!
//! ```text
//! cargo run --release -p commfuse --example sim_gemm_rs -- [P M N K]
//! ```
//! Rank r holds A_r [M, K] and B_r [N, K] (bf16) and ends with its chunk of the rows of
//! Σ_r A_r·B_rᵀ + bias (f32), by each of the three paths; then an all-reduce of f32 vectors by
//! the algorithm the cost model picks. Exits non-zero when an element is wrong or the example
//! cannot run.

use commfuse::core::fused::gemm_rs::{GemmRsPath, PathChoice};
use commfuse::core::gemm::BLayout;
use commfuse::core::op::chunk_range;
use commfuse::core::{DType, OpKind, ReduceOp, MAX_WORLD_SIZE};
use commfuse::sim::collective::SimCollective;
use commfuse::sim::gemm_rs::{GemmRsConfig, GemmRsOperator};
use commfuse::sim::{World, WorldConfig};
use half::bf16;
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// Operand values: small integers from -4 to 4, so that every product and sum is exact in f32
/// (while 16·K·P stays below 2^24) and the simulator's result must equal the float64 reference
/// exactly: a wrong, missing or doubled partial shows as a difference, never as rounding.
fn value(rank: usize, index: usize, salt: usize) -> f32 {
    let h = (index.wrapping_mul(2_654_435_761) ^ rank.wrapping_mul(40_503) ^ salt) >> 7;
    (h % 9) as f32 - 4.0
}

/// Elements of `got` that differ from `want`; an error naming the first, and how many, if any.
fn compare(what: &str, got: &[f32], want: &[f64]) -> Result<usize> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", got.len(), want.len()).into());
    }
    let wrong: Vec<usize> = (0..got.len())
        .filter(|&i| f64::from(got[i]) != want[i])
        .collect();
    match wrong.first() {
        None => Ok(got.len()),
        Some(&i) => Err(format!(
            "{what}: {} of {} elements wrong, first [{i}] = {} against {}",
            wrong.len(),
            got.len(),
            got[i],
            want[i]
        )
        .into()),
    }
}

/// GEMM + reduce-scatter of calls of `ms` rows on `p` ranks by `path`, each rank's chunk
/// checked; the report's line.
fn gemm_rs(p: usize, ms: &[usize], (n, k): (usize, usize), path: GemmRsPath) -> Result<String> {
    let max_m = ms.iter().copied().max().unwrap_or(1);
    let config = GemmRsConfig {
        bias: true,
        path: PathChoice::Always(path),
        timeout: Duration::from_secs(10),
        ..GemmRsConfig::new(max_m, n, k, BLayout::NK, DType::BF16, DType::F32)
    };
    let world_config = GemmRsOperator::<bf16, f32>::world_config(&config, p)?;
    let world = World::new(p, world_config)?;
    // built once for the world, then called with any M up to max_m
    let op = GemmRsOperator::<bf16, f32>::new(&world, config)?;
    let bias: Vec<f32> = (0..n).map(|j| value(0, j, 3)).collect();
    let mut elements = 0;
    for (call, &m) in ms.iter().enumerate() {
        let salt = call * 101;
        let a: Vec<Vec<f32>> = (0..p)
            .map(|r| (0..m * k).map(|i| value(r, i, salt + 1)).collect())
            .collect();
        let b: Vec<Vec<f32>> = (0..p)
            .map(|r| (0..n * k).map(|i| value(r, i, salt + 2)).collect())
            .collect();
        let to_bf16 = |x: &Vec<f32>| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let (a16, b16): (Vec<_>, Vec<_>) = (
            a.iter().map(to_bf16).collect(),
            b.iter().map(to_bf16).collect(),
        );
        let outs = world.run(|ctx| {
            let r = ctx.rank();
            let mut out = vec![f32::NAN; chunk_range(m, p, r).len() * n];
            op.forward(ctx, m, (&a16[r], &b16[r], Some(&bias)), &mut out)?;
            Ok(out)
        })?;
        for (r, out) in outs.iter().enumerate() {
            // rows chunk(r) of Σ_s A_s·B_sᵀ + bias, in float64
            let rows = chunk_range(m, p, r);
            let mut want = Vec::with_capacity(rows.len() * n);
            for i in rows {
                for j in 0..n {
                    let dot = |s: usize| -> f64 {
                        (0..k)
                            .map(|l| f64::from(a[s][i * k + l]) * f64::from(b[s][j * k + l]))
                            .sum()
                    };
                    want.push((0..p).map(dot).sum::<f64>() + f64::from(bias[j]));
                }
            }
            elements += compare(
                &format!("{path}, call {call} (M = {m}), rank {r}"),
                out,
                &want,
            )?;
        }
    }
    Ok(format!(
        "gemm-rs   {:<22} {} calls, {elements} elements exact",
        path.to_string(),
        ms.len()
    ))
}

/// An all-reduce (sum) of `count` f32 elements on `p` ranks by the cost model's pick; the
/// report's line.
fn all_reduce(p: usize, count: usize) -> Result<String> {
    let world = World::new(p, WorldConfig::default())?;
    let op = SimCollective::<f32>::new(
        &world,
        OpKind::AllReduce,
        count,
        (None, ReduceOp::Sum, 0, 1),
    )?;
    let inputs: Vec<Vec<f32>> = (0..p)
        .map(|r| (0..count).map(|i| value(r, i, 7)).collect())
        .collect();
    let outs = world.run(|ctx| {
        let r = ctx.rank();
        let mut out = vec![f32::NAN; op.spec().output_len(r)];
        op.forward(ctx, &inputs[r], &mut out)?;
        Ok(out)
    })?;
    let want: Vec<f64> = (0..count)
        .map(|i| inputs.iter().map(|x| f64::from(x[i])).sum())
        .collect();
    let mut elements = 0;
    for (r, out) in outs.iter().enumerate() {
        elements += compare(
            &format!("all-reduce by {}, rank {r}", op.algo()),
            out,
            &want,
        )?;
    }
    Ok(format!(
        "all-reduce {:<21} {count} elements on each rank, {elements} exact",
        op.algo().name()
    ))
}

/// The whole example on `p` ranks of an M×N×K GEMM: its report, or why it failed.
fn run(p: usize, m: usize, n: usize, k: usize) -> Result<Vec<String>> {
    if p == 0 || p > MAX_WORLD_SIZE {
        return Err(format!("P must be between 1 and {MAX_WORLD_SIZE}, got {p}").into());
    }
    if m == 0 || n == 0 || k == 0 {
        return Err(format!("M, N and K must be at least 1, got {m}×{n}×{k}").into());
    }
    if 16 * k * p >= 1 << 24 {
        return Err(format!(
            "K·P = {} is too large for sums exact in f32 (16·K·P < 2^24)",
            k * p
        )
        .into());
    }
    // a second call with fewer rows, uneven over the ranks: the operator serves any M up to
    // the one it was built for
    let ms = [m, (m / 2).max(1) + 1].map(|x| x.min(m));
    let mut report = vec![format!(
        "commfuse on the simulator: {p} ranks, GEMM {m}×{n}×{k} (M×N×K) bf16 → f32 with bias"
    )];
    for path in [
        GemmRsPath::Fused,
        GemmRsPath::Overlapped { pieces: 2 },
        GemmRsPath::Unfused,
    ] {
        report.push(gemm_rs(p, &ms, (n, k), path)?);
    }
    report.push(all_reduce(p, 10 * m + 3)?);
    report.push("every element matches the float64 reference".into());
    Ok(report)
}

fn main() -> ExitCode {
    let args: std::result::Result<Vec<usize>, _> =
        std::env::args().skip(1).map(|a| a.parse()).collect();
    let shape = match args.as_deref() {
        Ok([p, m, n, k]) => Ok((*p, *m, *n, *k)),
        Ok([]) => Ok((4, 300, 256, 128)),
        _ => Err("give P M N K (whole numbers), or nothing".into()),
    };
    match shape.and_then(|(p, m, n, k)| run(p, m, n, k)) {
        Ok(report) => {
            for line in report {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sim_gemm_rs: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_runs_and_every_element_matches() {
        let report = run(3, 70, 48, 32).expect("the example passes");
        assert_eq!(report.len(), 6, "{report:?}");
    }

    #[test]
    fn a_wrong_element_fails_the_check() {
        let want = [1.0, 2.0, 3.0];
        assert_eq!(compare("x", &[1.0, 2.0, 3.0], &want).unwrap(), 3);
        let e = compare("x", &[1.0, 2.5, 3.0], &want)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "x: 1 of 3 elements wrong, first [1] = 2.5 against 2");
        assert!(compare("x", &[1.0, 2.0], &want).is_err());
    }

    #[test]
    fn bad_input_is_refused_in_one_line() {
        for (p, m, n, k) in [
            (0, 8, 8, 8),
            (2, 0, 8, 8),
            (1 << 20, 8, 8, 8),
            (2, 8, 8, 1 << 20),
        ] {
            let e = run(p, m, n, k).unwrap_err().to_string();
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
}
