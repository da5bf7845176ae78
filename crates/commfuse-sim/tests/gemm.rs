//! The CPU model of the GEMM contract against a float64 reference: ragged shapes, both B
//! layouts, the whole epilogue, arbitrary tile orders, and tiles pushed into a peer's buffer
//! with per-tile flags that a consumer on the peer waits for (it never sees a stale tile).

use commfuse_core::gemm::{
    check_elements, element_bound, reference_gemm, BLayout, Epilogue, GemmPlan, GemmProblem,
    TileShape,
};
use commfuse_core::{Cmp, DType, Element, NotifyOp, Slot};
use commfuse_sim::gemm::{run_gemm, Operands};
use commfuse_sim::{SymmetricBuffer, World, WorldConfig};
use half::bf16;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn cast<T: Element>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn world(p: usize) -> World {
    World::new(p, WorldConfig::default()).unwrap()
}

#[test]
fn local_tiles_match_the_reference_on_ragged_shapes() {
    for (m, n, k, layout, tile) in [
        (37, 53, 40, BLayout::KN, (16, 32)),
        (64, 48, 16, BLayout::NK, (64, 48)),
        (5, 7, 8, BLayout::NK, (4, 4)),
    ] {
        let p = GemmProblem::new(m, n, k, layout, DType::BF16, DType::F32).unwrap();
        let e = Epilogue {
            alpha: 0.5,
            beta: 2.0,
            bias: true,
            accumulate: false,
        };
        let (a, b): (Vec<bf16>, Vec<bf16>) = (cast(&random(m * k, 1)), cast(&random(k * n, 2)));
        let (c, bias) = (random(m * n, 3), random(n, 4));
        let mut plan = GemmPlan::local(
            p,
            TileShape {
                m: tile.0,
                n: tile.1,
            },
            e,
        );
        plan.order.reverse(); // any order gives the same result
        let out = SymmetricBuffer::<f32>::new(1, m * n).unwrap();
        world(1)
            .run(|ctx| {
                let ops = Operands {
                    a: &a,
                    b: &b,
                    c: Some(&c),
                    bias: Some(&bias),
                };
                run_gemm(ctx, &plan, &ops, &out)
            })
            .unwrap();
        let want = reference_gemm(&p, &e, &a, &b, Some(&c), Some(&bias), None);
        let check = check_elements(&p, &e, out.view(0).iter().map(|&x| x as f64), &want);
        assert!(check.passed(), "{m}×{n}×{k} {layout:?}: {check}");
    }
}

#[test]
fn accumulate_adds_to_the_destination() {
    let p = GemmProblem::new(8, 8, 8, BLayout::KN, DType::F16, DType::F32).unwrap();
    let e = Epilogue {
        accumulate: true,
        ..Epilogue::default()
    };
    let (a, b) = (
        cast::<half::f16>(&random(64, 5)),
        cast::<half::f16>(&random(64, 6)),
    );
    let plan = GemmPlan::local(p, TileShape { m: 4, n: 8 }, e);
    let out = SymmetricBuffer::<f32>::new(1, 64).unwrap();
    let ops = Operands::<_, f32> {
        a: &a,
        b: &b,
        c: None,
        bias: None,
    };
    let w = world(1);
    w.run(|ctx| run_gemm(ctx, &plan, &ops, &out)).unwrap();
    let once = out.view(0).to_vec();
    w.run(|ctx| run_gemm(ctx, &plan, &ops, &out)).unwrap();
    for (twice, once) in out.view(0).iter().zip(&once) {
        assert!((twice - 2.0 * once).abs() <= 1e-6 * once.abs().max(1.0));
    }
}

/// At a 16-bit output an accumulating epilogue rounds twice (the tile, then the sum); the
/// element-wise bound allows for both and no more.
#[test]
fn accumulate_at_bf16_stays_within_the_element_bound() {
    let (m, n, k) = (24, 40, 520);
    let p = GemmProblem::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let e = Epilogue {
        alpha: 2.0,
        beta: -0.75,
        bias: true,
        accumulate: true,
    };
    let (a, b): (Vec<bf16>, Vec<bf16>) = (cast(&random(m * k, 9)), cast(&random(k * n, 10)));
    let (c, bias, previous): (Vec<bf16>, Vec<bf16>, Vec<bf16>) = (
        cast(&random(m * n, 11)),
        cast(&random(n, 12)),
        cast(&random(m * n, 13)),
    );
    let plan = GemmPlan::local(p, TileShape { m: 16, n: 16 }, e);
    let mut out = SymmetricBuffer::<bf16>::new(1, m * n).unwrap();
    out.local_mut(0).copy_from_slice(&previous);
    let ops = Operands {
        a: &a,
        b: &b,
        c: Some(&c),
        bias: Some(&bias),
    };
    world(1)
        .run(|ctx| run_gemm(ctx, &plan, &ops, &out))
        .unwrap();
    let want = reference_gemm(&p, &e, &a, &b, Some(&c), Some(&bias), Some(&previous));
    let check = check_elements(&p, &e, out.view(0).iter().map(|x| x.to_f64()), &want);
    assert!(check.passed() && check.worst_ratio < 0.75, "{check}");
}

#[test]
fn tiles_pushed_to_a_peer_are_never_read_before_their_flag() {
    // rank 0 computes D and pushes every tile into rank 1's buffer, remote tiles in a
    // staggered order, raising a per-tile flag; rank 1 waits tile by tile and checks each
    let (m, n, k) = (48, 40, 24);
    let p = GemmProblem::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let tile = TileShape { m: 16, n: 16 };
    let mut plan = GemmPlan::local(p, tile, Epilogue::default());
    let count = plan.tile_count();
    plan.order = (0..count).map(|i| (i * 5) % count).collect();
    plan.route_in_place(|_| 1, Some((1, NotifyOp::Set)));
    let (a, b): (Vec<bf16>, Vec<bf16>) = (cast(&random(m * k, 7)), cast(&random(k * n, 8)));
    let want = reference_gemm::<bf16, f32>(&p, &Epilogue::default(), &a, &b, None, None, None);
    let out = SymmetricBuffer::<bf16>::new(2, m * n).unwrap();
    // poison rank 1's output: a tile read before it arrives shows as NaN
    let mut out = out;
    out.local_mut(1).fill(bf16::NAN);
    let out = out;
    world(2)
        .run(|ctx| {
            if ctx.rank() == 0 {
                let ops = Operands::<bf16, bf16> {
                    a: &a,
                    b: &b,
                    c: None,
                    bias: None,
                };
                return run_gemm(ctx, &plan, &ops, &out);
            }
            for t in 0..count {
                ctx.wait(Slot::new(1, t as u32), 1, Cmp::Ge, 0)?;
                let (rows, cols) = plan.tile_bounds(t);
                for i in rows {
                    let mut row = vec![bf16::ZERO; cols.len()];
                    // SAFETY: the tile's flag was acquired; rank 0 never writes it again
                    unsafe { out.load(1, i * n + cols.start, &mut row) };
                    for (x, j) in row.iter().zip(cols.clone()) {
                        let w = &want[i * n + j];
                        let bound = element_bound(&p, &Epilogue::default(), w);
                        assert!(
                            (x.to_f64() - w.value).abs() <= bound,
                            "tile {t} ({i},{j}): {x} vs {} ± {bound:e}",
                            w.value
                        );
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn a_broken_plan_is_refused_not_run() {
    let p = GemmProblem::new(16, 16, 8, BLayout::KN, DType::BF16, DType::F32).unwrap();
    let mut plan = GemmPlan::local(p, TileShape { m: 8, n: 8 }, Epilogue::default());
    plan.order.pop();
    let (a, b) = (vec![bf16::ONE; 128], vec![bf16::ONE; 128]);
    let out = SymmetricBuffer::<f32>::new(1, 256).unwrap();
    let err = world(1)
        .run(|ctx| {
            let ops = Operands::<bf16, f32> {
                a: &a,
                b: &b,
                c: None,
                bias: None,
            };
            run_gemm(ctx, &plan, &ops, &out)
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("tile order lists 3 tiles"),
        "{err}"
    );
}
