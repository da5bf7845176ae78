//! GEMM + reduce-scatter on the simulator against a float64 reference, every path (the fused
//! tile schedule, the overlapped ring, the unfused pair) and the ring inside one GEMM: every output element of every rank, P = 1..9, ragged
//! shapes, both B layouts, bf16 and f16 inputs with 16-bit and f32 outputs, with and without
//! bias; outputs poisoned before each call; three back-to-back calls with fresh inputs and M
//! going down then up past the first (so a flag set sees a larger M after a smaller one), with
//! no barrier between calls.

use commfuse_core::backend::BackendError;
use commfuse_core::fused::gemm_rs::{check_elements_on, reference, GemmRsPath, PathChoice};
use commfuse_core::gemm::{BLayout, TileShape};
use commfuse_core::{DType, Element};
use commfuse_sim::fused::InWorld;
use commfuse_sim::gemm_rs::ring::SimRingReduceScatter;
use commfuse_sim::gemm_rs::{
    CallInputs, GemmRsConfig, GemmRsOperator, SimGemmReduceScatter, GPU_TILE,
};
use commfuse_sim::{World, WorldConfig};
use half::{bf16, f16};
use std::sync::Mutex;
use std::time::Duration;

const SMALL_TILE: TileShape = TileShape { m: 16, n: 32 };

fn world_for(p: usize, config: &GemmRsConfig, timeout: Duration) -> World {
    let cols = InWorld::new(p, *config).pad_cols().unwrap().max(64) as u32;
    World::new(
        p,
        WorldConfig {
            timeout,
            pad_rows: 32,
            pad_cols: cols,
        },
    )
    .unwrap()
}

/// What a case's operator is: the one of a path, or the ring inside one GEMM (which rounds as
/// the overlapped ring does, so that path's bound holds it).
#[derive(Debug, Clone, Copy)]
enum Way {
    Path(GemmRsPath),
    FusedRing,
}

impl From<GemmRsPath> for Way {
    fn from(path: GemmRsPath) -> Way {
        Way::Path(path)
    }
}

impl Way {
    /// The path whose error bound the results are checked against.
    fn bound(self) -> GemmRsPath {
        match self {
            Way::Path(path) => path,
            Way::FusedRing => GemmRsPath::Overlapped { pieces: 1 },
        }
    }
}

impl std::fmt::Display for Way {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Way::Path(path) => write!(f, "{path}"),
            Way::FusedRing => write!(f, "fused ring"),
        }
    }
}

/// Runs `ms.len()` back-to-back calls (max M = the largest) on every rank by `way` and checks
/// every output element of every call; returns the failures, one line each.
fn run_calls<TI: Element, TO: Element>(
    p: usize,
    config: GemmRsConfig,
    way: Way,
    ms: &[usize],
    seed: u64,
) -> Vec<String> {
    let (n, k, path) = (config.n, config.k, way.bound());
    let config = GemmRsConfig {
        path: PathChoice::Always(path),
        timeout: Duration::from_secs(20),
        ..config
    };
    let world_config = GemmRsOperator::<TI, TO>::world_config(&config, p);
    let world = World::new(p, world_config.unwrap()).unwrap();
    let op = match way {
        Way::Path(_) => GemmRsOperator::<TI, TO>::new(&world, config),
        Way::FusedRing => GemmRsOperator::<TI, TO>::fused_ring(&world, config),
    }
    .unwrap();
    let CallInputs { a, b, bias } =
        CallInputs::<TI, TO>::random(p, (config.n, config.k), config.bias, ms, seed);
    // outputs of the largest chunk, poisoned: rows past a call's chunk must stay poisoned
    let out_len = config.max_m.div_ceil(p) * n;
    let outs: Vec<Mutex<Vec<Vec<TO>>>> = (0..p)
        .map(|_| Mutex::new(vec![vec![TO::poison(); out_len]; ms.len()]))
        .collect();
    world
        .run(|ctx| {
            let r = ctx.rank();
            let mut outs = outs[r].lock().unwrap();
            for (c, &m) in ms.iter().enumerate() {
                let operands = (a[c][r].as_slice(), b[c][r].as_slice(), bias[c].as_deref());
                op.forward(ctx, m, operands, &mut outs[c])?;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("P={p} {config:?} M={ms:?}: {e}"));
    let mut failures = Vec::new();
    for (c, &m) in ms.iter().enumerate() {
        let shape = config.shape(p, m).unwrap();
        let a: Vec<&[TI]> = a[c].iter().map(Vec::as_slice).collect();
        let b: Vec<&[TI]> = b[c].iter().map(Vec::as_slice).collect();
        for (r, out) in outs.iter().enumerate() {
            let out = &out.lock().unwrap()[c];
            let want = reference(&shape, r, &a, &b, bias[c].as_deref());
            let got = out[..want.len()].iter().map(|x| x.to_f64());
            let check = check_elements_on(&shape, path, got, &want);
            if !check.passed() {
                failures.push(format!("call {c} (M={m}) rank {r}: {check}"));
            }
            if let Some(i) = out[want.len()..].iter().position(|x| !x.to_f64().is_nan()) {
                failures.push(format!(
                    "call {c} (M={m}) rank {r}: element {} past its chunk was written",
                    want.len() + i
                ));
            }
        }
    }
    failures
        .into_iter()
        .map(|f| {
            format!(
                "{way} P={p} N={n} K={k} {:?} {}→{} bias {} tile {:?}: {f}",
                config.b_layout, config.input, config.output, config.bias, config.tile
            )
        })
        .collect()
}

/// The calls of a case whose largest M is `max_m`: M, then smaller, then larger than the first.
fn call_ms(max_m: usize) -> Vec<usize> {
    vec![(2 * max_m / 3).max(1), (max_m / 3).max(1), max_m]
}

/// Ragged shapes (M, N, K) of world size `p`: M not a multiple of P or the tile.
fn shapes(p: usize) -> [(usize, usize, usize); 4] {
    [
        (1, 72, 136),
        ((p - 1).max(1), 8, 64),
        (3 * p + 1, 300, 8),
        (300, 72, 136),
    ]
}

/// Every (layout, input, output, bias) combination.
fn variants() -> Vec<(BLayout, DType, DType, bool)> {
    let mut v = Vec::new();
    for layout in [BLayout::NK, BLayout::KN] {
        for (input, output) in [
            (DType::BF16, DType::BF16),
            (DType::BF16, DType::F32),
            (DType::F16, DType::F16),
            (DType::F16, DType::F32),
        ] {
            for bias in [false, true] {
                v.push((layout, input, output, bias));
            }
        }
    }
    v
}

fn run_variant(
    p: usize,
    (m, n, k): (usize, usize, usize),
    (layout, input, output, bias): (BLayout, DType, DType, bool),
    tile: TileShape,
    seed: u64,
) -> Vec<String> {
    run_variant_on(
        GemmRsPath::Fused,
        p,
        (m, n, k),
        (layout, input, output, bias),
        tile,
        seed,
    )
}

fn run_variant_on(
    way: impl Into<Way>,
    p: usize,
    shape: (usize, usize, usize),
    variant: (BLayout, DType, DType, bool),
    tile: TileShape,
    seed: u64,
) -> Vec<String> {
    run_variant_in_groups(way, (p, 1), shape, variant, tile, seed)
}

/// [`run_variant_on`] with the ranks in `groups` NUMA groups (the overlapped path's 2D ring).
fn run_variant_in_groups(
    way: impl Into<Way>,
    (p, groups): (usize, usize),
    (m, n, k): (usize, usize, usize),
    (layout, input, output, bias): (BLayout, DType, DType, bool),
    tile: TileShape,
    seed: u64,
) -> Vec<String> {
    let config = GemmRsConfig {
        bias,
        tile,
        numa_groups: groups,
        ..GemmRsConfig::new(m, n, k, layout, input, output)
    };
    let ms = call_ms(m);
    let way = way.into();
    match (input, output) {
        (DType::BF16, DType::BF16) => run_calls::<bf16, bf16>(p, config, way, &ms, seed),
        (DType::BF16, DType::F32) => run_calls::<bf16, f32>(p, config, way, &ms, seed),
        (DType::F16, DType::F16) => run_calls::<f16, f16>(p, config, way, &ms, seed),
        (DType::F16, DType::F32) => run_calls::<f16, f32>(p, config, way, &ms, seed),
        other => unreachable!("no such variant {other:?}"),
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
fn every_variant_matches_the_reference_on_one_to_three_ranks() {
    let mut failures = Vec::new();
    for p in 1..=3 {
        for (s, shape) in shapes(p).into_iter().enumerate() {
            for (v, variant) in variants().into_iter().enumerate() {
                // both tiles: the GPU's (one band per chunk at small M) and a small one (many
                // tiles per owner, so a larger M uses flag columns a smaller one left out)
                let tile = if (s + v) % 2 == 0 {
                    SMALL_TILE
                } else {
                    GPU_TILE
                };
                failures.extend(run_variant(
                    p,
                    shape,
                    variant,
                    tile,
                    (p * 100 + s * 20 + v) as u64,
                ));
            }
        }
    }
    assert_none(failures);
}

#[test]
fn a_sample_of_variants_matches_the_reference_on_four_to_nine_ranks() {
    let variants = variants();
    let mut failures = Vec::new();
    for p in 4..=9 {
        for (s, shape) in shapes(p).into_iter().enumerate() {
            for i in 0..2 {
                let v = (p * 5 + s * 3 + i * 8) % variants.len();
                let tile = if i == 0 { SMALL_TILE } else { GPU_TILE };
                failures.extend(run_variant(
                    p,
                    shape,
                    variants[v],
                    tile,
                    (p * 100 + s * 20 + v) as u64,
                ));
            }
        }
    }
    assert_none(failures);
}

#[test]
fn the_gpu_tile_with_several_bands_per_chunk() {
    // M large enough that chunks take two or three 128-row bands and N two column tiles: the
    // band boundaries inside a chunk and a larger M after a smaller one at the GPU's tile
    let variant = (BLayout::NK, DType::BF16, DType::BF16, true);
    assert_none(run_variant(1, (300, 300, 8), variant, GPU_TILE, 1));
    assert_none(run_variant(2, (600, 300, 8), variant, GPU_TILE, 2));
}

#[test]
fn the_overlapped_ring_matches_the_reference_on_one_to_three_ranks() {
    let mut failures = Vec::new();
    for p in 1..=3 {
        for (s, shape) in shapes(p).into_iter().enumerate() {
            for (v, variant) in variants().into_iter().enumerate() {
                // one piece, two, and more pieces than some chunks have rows
                let pieces = 1 + (s + v) % 3;
                let path = GemmRsPath::Overlapped { pieces };
                let seed = (p * 100 + s * 20 + v) as u64;
                failures.extend(run_variant_on(path, p, shape, variant, SMALL_TILE, seed));
            }
        }
    }
    assert_none(failures);
}

#[test]
fn the_overlapped_ring_matches_the_reference_on_four_to_nine_ranks() {
    let variants = variants();
    let mut failures = Vec::new();
    for p in 4..=9 {
        for (s, shape) in shapes(p).into_iter().enumerate() {
            for i in 0..2 {
                let v = (p * 5 + s * 3 + i * 8) % variants.len();
                let path = GemmRsPath::Overlapped { pieces: 1 + i * 2 };
                let seed = (p * 100 + s * 20 + v) as u64;
                failures.extend(run_variant_on(path, p, shape, variants[v], GPU_TILE, seed));
            }
        }
    }
    assert_none(failures);
}

/// The 2D ring (ranks in NUMA groups) on every group count strictly between 1 and P of P = 4..9
/// and 16: ragged shapes, M < P (the done handshake on both links), 1 and 3 pieces.
#[test]
fn the_2d_ring_matches_the_reference_on_four_to_nine_and_sixteen_ranks() {
    let variants = variants();
    let mut failures = Vec::new();
    for p in [4, 6, 8, 9, 16] {
        for groups in (2..p).filter(|g| p % g == 0) {
            for (s, shape) in shapes(p).into_iter().enumerate() {
                let i = (s + groups) % 2;
                let v = (p * 5 + s * 3 + groups * 7) % variants.len();
                let path = GemmRsPath::Overlapped { pieces: 1 + i * 2 };
                let seed = (p * 100 + s * 20 + groups) as u64;
                let world = (p, groups);
                failures.extend(run_variant_in_groups(
                    path,
                    world,
                    shape,
                    variants[v],
                    SMALL_TILE,
                    seed,
                ));
            }
        }
    }
    assert_none(failures);
}

#[test]
fn the_unfused_path_matches_the_reference_on_one_to_nine_ranks() {
    let variants = variants();
    let mut failures = Vec::new();
    for p in 1..=9 {
        for (s, shape) in shapes(p).into_iter().enumerate() {
            // every variant on up to three ranks, a rotating sample beyond
            let picks: Vec<usize> = if p <= 3 {
                (0..variants.len()).collect()
            } else {
                vec![(p * 5 + s * 3) % variants.len()]
            };
            for v in picks {
                let seed = (p * 100 + s * 20 + v) as u64;
                let path = GemmRsPath::Unfused;
                failures.extend(run_variant_on(
                    path,
                    p,
                    shape,
                    variants[v],
                    SMALL_TILE,
                    seed,
                ));
            }
        }
    }
    assert_none(failures);
}

/// The ring inside one GEMM: every variant on one to three ranks, a rotating sample on four to
/// nine and sixteen, flat and over NUMA groups, ragged shapes (M < P among them: the done
/// handshake), small tiles (several bands and column tiles per chunk) and the GPU's.
#[test]
fn the_fused_ring_matches_the_reference_on_one_to_nine_and_sixteen_ranks() {
    let variants = variants();
    let mut failures = Vec::new();
    for p in (1..=9).chain([16]) {
        for groups in (1..=p).filter(|g| p % g == 0 && (*g == 1 || p >= 4)) {
            for (s, shape) in shapes(p).into_iter().enumerate() {
                let picks: Vec<usize> = if p <= 3 {
                    (0..variants.len()).collect()
                } else {
                    vec![(p * 5 + s * 3 + groups * 7) % variants.len()]
                };
                for v in picks {
                    let tile = if (s + v) % 4 == 3 {
                        GPU_TILE
                    } else {
                        SMALL_TILE
                    };
                    let seed = (p * 100 + s * 20 + v + groups) as u64;
                    failures.extend(run_variant_in_groups(
                        Way::FusedRing,
                        (p, groups),
                        shape,
                        variants[v],
                        tile,
                        seed,
                    ));
                }
            }
        }
    }
    assert_none(failures);
}

#[test]
fn the_overlapped_ring_on_sixteen_ranks() {
    let variant = (BLayout::KN, DType::F16, DType::F32, true);
    let path = GemmRsPath::Overlapped { pieces: 2 };
    assert_none(run_variant_on(
        path,
        16,
        (16 * 3 + 5, 24, 64),
        variant,
        SMALL_TILE,
        16,
    ));
}

#[test]
fn a_peer_that_never_arrives_at_the_ring_ends_in_a_diagnosed_error() {
    let config = bf16_config(10, 16, 8);
    let world = world_for(2, &config, Duration::from_millis(300));
    let op = SimRingReduceScatter::<bf16, bf16>::new(&world, config, 2).unwrap();
    let (a, b) = (vec![bf16::ONE; 10 * 8], vec![bf16::ONE; 16 * 8]);
    let err = world
        .run(|ctx| {
            let mut out = vec![bf16::ZERO; 5 * 16];
            if ctx.rank() == 1 {
                return Ok(()); // rank 1 never calls
            }
            op.forward(ctx, 10, &a, &b, None, &mut out)
        })
        .err()
        .unwrap();
    let text = one_line(err);
    assert!(
        text.contains("(ring) rank 0 waits for the running sum of piece 0 after step 0")
            && text.contains("to reach 1, sees 0"),
        "{text}"
    );
    let refused = SimRingReduceScatter::<bf16, bf16>::new(&world, config, 17).err();
    assert!(one_line(refused.unwrap()).contains("1 to 16 pieces"));
    let three = GemmRsConfig {
        numa_groups: 3,
        ..config
    };
    let refused = SimRingReduceScatter::<bf16, bf16>::new(&world, three, 1).err();
    let text = one_line(refused.unwrap());
    assert!(
        text.contains("multiple of the NUMA group count (3)"),
        "{text}"
    );
}

#[test]
fn a_peer_that_never_arrives_at_the_fused_ring_ends_in_a_diagnosed_error() {
    let config = GemmRsConfig {
        tile: SMALL_TILE,
        ..bf16_config(10, 48, 8)
    };
    let world = world_for(2, &config, Duration::from_millis(300));
    let op = GemmRsOperator::<bf16, bf16>::fused_ring(&world, config).unwrap();
    let (a, b) = (vec![bf16::ONE; 10 * 8], vec![bf16::ONE; 48 * 8]);
    let err = world
        .run(|ctx| {
            let mut out = vec![bf16::ZERO; 5 * 48];
            if ctx.rank() == 1 {
                return Ok(()); // rank 1 never calls
            }
            op.forward(ctx, 10, (&a, &b, None), &mut out)
        })
        .err()
        .unwrap();
    let text = one_line(err);
    assert!(
        text.contains(
            "(fused ring) rank 0 waits for the running sum of tile 0 after step 0 from rank 1"
        ) && text.contains("to reach 1, sees 0"),
        "{text}"
    );
    let zero = GemmRsConfig {
        tile: TileShape { m: 0, n: 32 },
        ..config
    };
    let refused = GemmRsOperator::<bf16, bf16>::fused_ring(&world, zero).err();
    assert!(one_line(refused.unwrap()).contains("positive"));
}

/// In the 2D ring a call of M < P rows ends with the done handshake on both links. P = 4 in two
/// groups, M = 1: owner 0's row travels 3 → 2 → (across) 1 → 0. With rank 0 absent, ranks 3, 2
/// and 1 hand their sums on; then rank 1 waits for rank 0's done within its group and rank 3 for
/// rank 0's done across groups, while rank 2, whose receivers both came, ends its call.
#[test]
fn a_peer_that_never_arrives_at_the_2d_ring_ends_in_a_diagnosed_error() {
    let config = GemmRsConfig {
        numa_groups: 2,
        ..bf16_config(1, 16, 8)
    };
    let world = world_for(4, &config, Duration::from_millis(300));
    let op = SimRingReduceScatter::<bf16, bf16>::new(&world, config, 1).unwrap();
    let (a, b) = (vec![bf16::ONE; 8], vec![bf16::ONE; 16 * 8]);
    let ended = std::sync::Mutex::new(vec![String::new(); 4]);
    let _ = world.run(|ctx| {
        if ctx.rank() == 0 {
            return Ok(()); // rank 0 never calls
        }
        let e = op.forward(ctx, 1, &a, &b, None, &mut []);
        ended.lock().unwrap()[ctx.rank()] = e.map_or_else(one_line, |()| "ok".into());
        Ok(())
    });
    let ended = ended.into_inner().unwrap();
    let done = "waits for its receiver's done of this call";
    // the first of ranks 1 and 3 to time out stops the other, whose error names it
    let timed_out =
        |r: usize, link: &str| ended[r].contains(&format!("rank {r} {done} ({link}) from rank 0"));
    let stopped_by = |r: usize, by: usize| {
        ended[r] == format!("rank {r} aborted its wait for rank 0 because rank {by} timed out waiting for rank 0")
    };
    let (one, three) = (
        timed_out(1, "within its NUMA group"),
        timed_out(3, "across NUMA groups"),
    );
    assert!(
        (one || stopped_by(1, 3)) && (three || stopped_by(3, 1)) && (one || three),
        "{ended:?}"
    );
    assert_eq!(ended[2], "ok");
}

fn bf16_config(max_m: usize, n: usize, k: usize) -> GemmRsConfig {
    GemmRsConfig::new(max_m, n, k, BLayout::NK, DType::BF16, DType::BF16)
}

fn one_line(e: impl std::fmt::Display) -> String {
    let text = e.to_string();
    assert!(!text.is_empty() && !text.contains('\n'), "{text:?}");
    text
}

#[test]
fn bad_configurations_are_refused_in_one_line() {
    let world = World::new(2, WorldConfig::default()).unwrap();
    let build = |c: GemmRsConfig| SimGemmReduceScatter::<bf16, bf16>::new(&world, c).err();
    let k12 = one_line(build(bf16_config(64, 64, 12)).unwrap());
    assert!(k12.contains("multiple of 8"), "{k12}");
    let wrong_type = one_line(
        SimGemmReduceScatter::<f16, bf16>::new(&world, bf16_config(64, 64, 8))
            .err()
            .unwrap(),
    );
    assert!(
        wrong_type.contains("bf16 → bf16") && wrong_type.contains("f16 → bf16"),
        "{wrong_type}"
    );
    let mismatch = GemmRsConfig {
        output: DType::F16,
        ..bf16_config(64, 64, 8)
    };
    assert!(one_line(
        SimGemmReduceScatter::<bf16, f16>::new(&world, mismatch)
            .err()
            .unwrap()
    )
    .contains("(the input type) or f32"));
    assert!(one_line(build(bf16_config(0, 64, 8)).unwrap()).contains("positive"));
    // 2 ranks × 8 bands × 4 column tiles = 64 flag columns fit the default pad, 65+ do not
    assert!(build(bf16_config(2 * 8 * 128, 4 * 256, 8)).is_none());
    let big = one_line(build(bf16_config(2 * 8 * 128 + 1, 4 * 256, 8)).unwrap());
    assert!(
        big.contains("needs signal pads of at least 2 free rows × 72 columns"),
        "{big}"
    );
}

type Op = SimGemmReduceScatter<bf16, bf16>;

/// One call on a fresh world of 2 ranks and an operator for M ≤ 10, N = 16, K = 8 (a refused
/// call ends the world's run, so each case gets its own); returns the error.
fn refused(
    call: impl Fn(&Op, &commfuse_sim::RankContext<'_>) -> Result<(), BackendError> + Sync,
) -> String {
    let config = bf16_config(10, 16, 8);
    let world = world_for(2, &config, Duration::from_secs(5));
    let op = Op::new(&world, config).unwrap();
    one_line(world.run(|ctx| call(&op, ctx)).err().unwrap())
}

#[test]
fn bad_calls_are_refused_in_one_line() {
    let (a, b, bias) = (
        vec![bf16::ZERO; 10 * 8],
        vec![bf16::ZERO; 16 * 8],
        vec![bf16::ZERO; 16],
    );
    let out = || vec![bf16::ZERO; 5 * 16];
    for (want, text) in [
        (
            "M = 11 is outside 1..=10",
            refused(|op, ctx| op.forward(ctx, 11, &a, &b, None, &mut out())),
        ),
        (
            "M = 0 is outside 1..=10",
            refused(|op, ctx| op.forward(ctx, 0, &a[..0], &b, None, &mut out())),
        ),
        (
            "A holds 80 elements, M=9 N=16 K=8 needs 72",
            refused(|op, ctx| op.forward(ctx, 9, &a, &b, None, &mut out())),
        ),
        (
            "B holds 127 elements",
            refused(|op, ctx| op.forward(ctx, 10, &a, &b[1..], None, &mut out())),
        ),
        (
            "the bias holds 16 elements",
            refused(|op, ctx| op.forward(ctx, 10, &a, &b, Some(&bias), &mut out())),
        ),
        (
            "the output holds 79 elements",
            refused(|op, ctx| op.forward(ctx, 10, &a, &b, None, &mut out()[1..])),
        ),
    ] {
        assert!(text.contains(want), "{text} lacks {want}");
    }
    let config = bf16_config(10, 16, 8);
    let (mine, other) = (
        world_for(2, &config, Duration::from_secs(5)),
        world_for(2, &config, Duration::from_secs(5)),
    );
    let op = Op::new(&mine, config).unwrap();
    let text = one_line(
        other
            .run(|ctx| op.forward(ctx, 10, &a, &b, None, &mut out()))
            .err()
            .unwrap(),
    );
    assert!(text.contains("built for another world"), "{text}");
}

#[test]
fn a_peer_that_never_arrives_ends_in_a_diagnosed_error() {
    let config = bf16_config(10, 16, 8);
    let world = world_for(2, &config, Duration::from_millis(300));
    let op = SimGemmReduceScatter::<bf16, bf16>::new(&world, config).unwrap();
    let (a, b) = (vec![bf16::ONE; 10 * 8], vec![bf16::ONE; 16 * 8]);
    let err = world
        .run(|ctx| {
            let mut out = vec![bf16::ZERO; 5 * 16];
            if ctx.rank() == 1 {
                return Ok(()); // rank 1 never calls
            }
            op.forward(ctx, 10, &a, &b, None, &mut out)
        })
        .err()
        .unwrap();
    let text = one_line(err);
    assert!(
        text.contains("rank 0, call 0 (set 0), tile 0")
            && text.contains("waits on rank 1's flag")
            && text.contains(">= 1 but sees 0"),
        "{text}"
    );
}
