//! All-gather + GEMM on the simulator against a float64 reference: every output element of
//! every rank and every element of the gathered A, P = 1..9, ragged M, both B layouts, bf16 and
//! f16 inputs with 16-bit and f32 outputs, with and without bias, 1–3 pieces; outputs poisoned
//! before each call; three back-to-back calls with fresh inputs and M going down then up, with
//! no barrier between calls.

use commfuse_core::backend::BackendError;
use commfuse_core::gemm::{check_elements, reference_gemm, BLayout, Epilogue};
use commfuse_core::{DType, Element};
use commfuse_sim::ag_gemm::{shape, AgCallInputs, AgGemmConfig, SimAgGemm};
use commfuse_sim::{World, WorldConfig};
use half::{bf16, f16};
use std::sync::Mutex;
use std::time::Duration;

fn world_for(p: usize, config: &AgGemmConfig, timeout: Duration) -> World {
    let pad_cols = 64;
    let rows = SimAgGemm::<bf16, bf16>::pad_rows(config, p, pad_cols).unwrap() as u32;
    let cfg = WorldConfig {
        timeout,
        pad_rows: rows + 8,
        pad_cols: pad_cols as u32,
    };
    World::new(p, cfg).unwrap()
}

/// Back-to-back calls of M = `ms[c]`; returns the failures, one line each.
fn run_calls<TI: Element, TO: Element>(
    p: usize,
    config: AgGemmConfig,
    ms: &[usize],
    seed: u64,
) -> Vec<String> {
    let (n, k, pieces) = (config.n, config.k, config.pieces);
    let world = world_for(p, &config, Duration::from_secs(20));
    let op = SimAgGemm::<TI, TO>::new(&world, config).unwrap();
    let AgCallInputs { a, b, bias } =
        AgCallInputs::<TI, TO>::random(p, (config.n, config.k), config.bias, ms, seed);
    let max_m = config.max_m;
    // per rank, per call: the output and the gathered A
    type Outs<TO, TI> = Vec<Mutex<Vec<(Vec<TO>, Vec<TI>)>>>;
    let outs: Outs<TO, TI> = (0..p)
        .map(|_| {
            Mutex::new(vec![
                (
                    vec![TO::poison(); max_m * n],
                    vec![TI::poison(); max_m * k]
                );
                ms.len()
            ])
        })
        .collect();
    world
        .run(|ctx| {
            let r = ctx.rank();
            let mut outs = outs[r].lock().unwrap();
            for (c, &m) in ms.iter().enumerate() {
                let (out, gathered) = &mut outs[c];
                let operands = (a[c][r].as_slice(), b[c][r].as_slice(), bias[c].as_deref());
                // every other call returns the gathered A too
                let gathered = (c % 2 == 0).then_some(&mut gathered[..m * k]);
                op.forward(ctx, m, operands, &mut out[..m * n], gathered)?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("P={p} {config:?} M={ms:?}: {e}"));
    let mut failures = Vec::new();
    for (c, &m) in ms.iter().enumerate() {
        let s = shape(&config, p, m).unwrap();
        let full: Vec<TI> = a[c].iter().flatten().copied().collect();
        let epilogue = Epilogue {
            bias: config.bias,
            ..Epilogue::default()
        };
        for (r, out) in outs.iter().enumerate() {
            let (out, gathered) = &out.lock().unwrap()[c];
            let want = reference_gemm(
                &s.problem(),
                &epilogue,
                &full,
                &b[c][r],
                None,
                bias[c].as_deref(),
                None,
            );
            let got = out[..m * n].iter().map(|x| x.to_f64());
            let check = check_elements(&s.problem(), &epilogue, got, &want);
            if !check.passed() {
                failures.push(format!("call {c} (M={m}) rank {r}: {check}"));
            }
            if out[m * n..].iter().any(|x| !x.to_f64().is_nan()) {
                failures.push(format!("call {c} (M={m}) rank {r}: wrote past M rows"));
            }
            if c % 2 == 0 && gathered[..m * k] != full[..] {
                failures.push(format!("call {c} (M={m}) rank {r}: the gathered A differs"));
            }
        }
    }
    failures
        .into_iter()
        .map(|f| {
            format!(
                "P={p} N={n} K={k} {:?} {}→{} bias {} pieces {pieces}: {f}",
                config.b_layout, config.input, config.output, config.bias
            )
        })
        .collect()
}

fn run_variant(p: usize, (m, n, k): (usize, usize, usize), v: usize, pieces: usize) -> Vec<String> {
    run_variant_on(p, (m, n, k), v, (pieces, false))
}

/// [`run_variant`] on the overlapped path or (`fused`) the fused one, whose GEMM then works in
/// 8 × 16 tiles: several row bands per piece, and bands cut short at every piece's end.
fn run_variant_on(
    p: usize,
    (m, n, k): (usize, usize, usize),
    v: usize,
    (pieces, fused): (usize, bool),
) -> Vec<String> {
    let layout = if v.is_multiple_of(2) {
        BLayout::NK
    } else {
        BLayout::KN
    };
    let bias = !v.is_multiple_of(3);
    let (input, output) = [
        (DType::BF16, DType::BF16),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F16),
        (DType::F16, DType::F32),
    ][v % 4];
    let mut config = AgGemmConfig {
        bias,
        pieces,
        fused,
        ..AgGemmConfig::new(m, n, k, layout, input, output)
    };
    if fused {
        config.tile = commfuse_core::gemm::TileShape { m: 8, n: 16 };
    }
    let ms = [(2 * m / 3).max(1), (m / 3).max(1), m];
    let seed = (p * 1000 + m * 10 + v) as u64;
    match (input, output) {
        (DType::BF16, DType::BF16) => run_calls::<bf16, bf16>(p, config, &ms, seed),
        (DType::BF16, DType::F32) => run_calls::<bf16, f32>(p, config, &ms, seed),
        (DType::F16, DType::F16) => run_calls::<f16, f16>(p, config, &ms, seed),
        _ => run_calls::<f16, f32>(p, config, &ms, seed),
    }
}

fn assert_none(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_element_matches_the_reference_on_one_to_nine_ranks() {
    let mut failures = Vec::new();
    for p in 1..=9 {
        for (s, shape) in [(1, 40, 24), (3 * p + 1, 72, 64), (97, 24, 136)]
            .into_iter()
            .enumerate()
        {
            for v in 0..4 {
                let pieces = 1 + (p + s + v) % 3;
                failures.extend(run_variant(p, shape, v + 4 * (s % 2), pieces));
            }
        }
    }
    assert_none(failures);
}

/// The fused path: one GEMM per call, tiles piece by piece, each peer's piece awaited before
/// the tiles that read it; P = 1..9 and 16, ragged M, M < P, 1–3 pieces.
#[test]
fn the_fused_path_matches_the_reference_on_one_to_nine_and_sixteen_ranks() {
    let mut failures = Vec::new();
    for p in (1..=9).chain([16]) {
        for (s, shape) in [(1, 40, 24), (3 * p + 1, 72, 64), (97, 24, 136)]
            .into_iter()
            .enumerate()
        {
            for v in 0..2 {
                let pieces = 1 + (p + s + v) % 3;
                let variant = v + 2 * s;
                failures.extend(run_variant_on(p, shape, variant, (pieces, true)));
            }
        }
    }
    assert_none(failures);
}

#[test]
fn sixteen_ranks() {
    assert_none(run_variant(16, (16 * 3 + 5, 24, 64), 5, 2));
}

#[test]
fn a_peer_that_never_arrives_ends_in_a_diagnosed_error_and_bad_calls_are_refused() {
    let config = AgGemmConfig::new(10, 16, 8, BLayout::NK, DType::BF16, DType::BF16);
    let world = world_for(2, &config, Duration::from_millis(300));
    let op = SimAgGemm::<bf16, bf16>::new(&world, config).unwrap();
    let (a, b) = (vec![bf16::ONE; 5 * 8], vec![bf16::ONE; 16 * 8]);
    let err = world
        .run(|ctx| {
            let mut out = vec![bf16::ZERO; 10 * 16];
            if ctx.rank() == 1 {
                return Ok(()); // rank 1 never calls
            }
            op.forward(ctx, 10, (&a, &b, None), &mut out, None)
        })
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("rank 0 waits for piece 0 of rank 1's chunk")
            && err.contains("to reach 1, sees 0"),
        "{err}"
    );
    assert!(!err.contains('\n'));
    // a refused call ends its world's run: a fresh world and operator each
    let refused = |m: usize, a_len: usize, out_len: usize| -> String {
        let world = world_for(2, &config, Duration::from_secs(5));
        let op = SimAgGemm::<bf16, bf16>::new(&world, config).unwrap();
        let a = vec![bf16::ONE; a_len];
        let e: BackendError = world
            .run(|ctx| {
                let mut out = vec![bf16::ZERO; out_len];
                op.forward(ctx, m, (&a, &b, None), &mut out, None)
            })
            .err()
            .unwrap();
        e.to_string()
    };
    assert!(refused(11, 6 * 8, 11 * 16).contains("M = 11 is outside 1..=10"));
    assert!(refused(10, 4 * 8, 10 * 16).contains("A holds 32 elements"));
    assert!(refused(10, 5 * 8, 9 * 16).contains("the output holds 144 elements"));
    let world = world_for(2, &config, Duration::from_secs(5));
    let wrong = SimAgGemm::<bf16, bf16>::new(
        &world,
        AgGemmConfig {
            pieces: 0,
            ..config
        },
    )
    .err()
    .unwrap();
    assert!(wrong.to_string().contains("1 to 16 pieces"));
}
