//! Requests too large for the machine are refused in one line before anything is allocated:
//! every operator's constructor, the world's signal pads, the LL protocol and the backend count
//! their bytes with checked arithmetic first. Sizes here are far beyond any machine (or beyond
//! 64 bits), so the refusals do not depend on the memory this one has.

use commfuse_core::backend::{Backend, BackendError};
use commfuse_core::fused::gemm_rs::{GemmRsPath, PathChoice};
use commfuse_core::gemm::{BLayout, TileShape};
use commfuse_core::{build_plan, check, Algo, DType, OpKind, OpSpec, ReduceOp, Topology};
use commfuse_sim::ag_gemm::{AgGemmConfig, SimAgGemm};
use commfuse_sim::collective::SimCollective;
use commfuse_sim::fused::InWorld;
use commfuse_sim::gemm_rs::{GemmRsConfig, GemmRsOperator, GPU_TILE};
use commfuse_sim::ll::{LlCollective, LlShots, SimLl};
use commfuse_sim::{SimBackend, World, WorldConfig};
use half::bf16;

/// The message of a `TooLarge` refusal, checked to be one line naming the bytes.
fn too_large<T>(result: Result<T, BackendError>, what: &str) -> String {
    let err = match result {
        Ok(_) => panic!("{what} was built"),
        Err(e) => e,
    };
    assert!(
        matches!(err, BackendError::TooLarge { .. }),
        "{what}: {err:?}"
    );
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    assert!(msg.contains(" needs "), "{msg}");
    if commfuse_sim::memory::available().is_some() {
        assert!(
            msg.contains("of memory available") || msg.contains("overflows"),
            "{msg}"
        );
    }
    msg
}

fn config(m: usize, n: usize) -> GemmRsConfig {
    GemmRsConfig::new(m, n, 8, BLayout::NK, DType::BF16, DType::BF16)
}

#[test]
fn pad_columns_counted_without_the_schedule_are_the_schedules() {
    for tile in [GPU_TILE, TileShape { m: 16, n: 32 }] {
        for p in 1..=9 {
            for m in [1, 2, 5, 15, 16, 17, 127, 128, 129, 1000, 4097] {
                for n in [1, 8, 31, 32, 33, 255, 256, 257, 1000] {
                    let c = InWorld::new(
                        p,
                        GemmRsConfig {
                            tile,
                            ..config(m, n)
                        },
                    );
                    let want = c.schedule(m).unwrap().flag_columns();
                    assert_eq!(c.pad_cols().unwrap(), want, "P={p} M={m} N={n} {tile:?}");
                }
            }
        }
    }
}

#[test]
fn gemm_reduce_scatter_too_large_for_memory_is_refused_before_it_allocates() {
    let world = World::new(2, WorldConfig::default()).unwrap();
    // 10^8 × 10^8 outputs: petabytes, and a tile schedule of 3·10^11 tiles
    let c = config(100_000_000, 100_000_000);
    for path in [
        GemmRsPath::Fused,
        GemmRsPath::Overlapped { pieces: 2 },
        GemmRsPath::Unfused,
    ] {
        let c = GemmRsConfig {
            path: PathChoice::Always(path),
            ..c
        };
        let msg = too_large(
            GemmRsOperator::<bf16, bf16>::new(&world, c),
            &path.to_string(),
        );
        assert!(
            msg.starts_with("GEMM + reduce-scatter (")
                && msg.contains("of M up to 100000000, N 100000000, K 8 on 2 ranks needs"),
            "{msg}"
        );
    }
    let msg = too_large(
        GemmRsOperator::<bf16, bf16>::fused_ring(&world, c),
        "the fused ring",
    );
    assert!(
        msg.starts_with("GEMM + reduce-scatter (fused ring) of M up to 100000000"),
        "{msg}"
    );
    // the world such an operator would need has more flag columns than a pad can have: said,
    // without building the schedule
    let err = GemmRsOperator::<bf16, bf16>::world_config(&c, 2).expect_err("the pads do not fit");
    assert!(err.to_string().contains("flag columns"), "{err}");
}

#[test]
fn all_gather_gemm_too_large_for_memory_is_refused_before_it_allocates() {
    let world = World::new(2, WorldConfig::default()).unwrap();
    let c = AgGemmConfig {
        k: 1 << 20,
        ..AgGemmConfig::new(1 << 24, 64, 8, BLayout::NK, DType::BF16, DType::BF16)
    };
    let msg = too_large(SimAgGemm::<bf16, bf16>::new(&world, c), "all-gather + GEMM");
    assert!(
        msg.starts_with("all-gather + GEMM of M up to 16777216"),
        "{msg}"
    );
    let msg = too_large(
        SimAgGemm::<bf16, bf16>::new(
            &world,
            AgGemmConfig {
                fused: true,
                pieces: 2,
                ..c
            },
        ),
        "fused all-gather + GEMM",
    );
    assert!(msg.starts_with("all-gather + GEMM (fused)"), "{msg}");
}

#[test]
fn collectives_worlds_and_protocols_count_their_bytes_first() {
    let world = World::new(2, WorldConfig::default()).unwrap();
    let options = (Some(Algo::Ring), ReduceOp::Sum, 0, 1);
    let msg = too_large(
        SimCollective::<f32>::new(&world, OpKind::AllReduce, 1 << 50, options),
        "all-reduce",
    );
    assert!(msg.starts_with("all-reduce of 1125899906842624 f32 elements on 2 ranks needs"));
    // pads of 2^64 slots: more bytes than 64 bits count, whatever the machine
    let pads = WorldConfig {
        pad_rows: u32::MAX,
        pad_cols: u32::MAX,
        ..WorldConfig::default()
    };
    let msg = too_large(World::new(2, pads), "the world");
    assert!(msg.contains("overflows"), "{msg}");
    // the LL all-reduce's lines: 2 parities × P senders × n per rank, 8 bytes each
    let ll = SimLl::memory(64, LlCollective::AllReduce(LlShots::One), 1 << 20);
    assert_eq!(ll.bytes(), Some(64 * 2 * 64 * (1 << 20) * 8));
    too_large(ll.check_within(Some(24 << 30)), "the LL all-reduce");
}

#[test]
fn the_backend_counts_what_prepare_allocates() {
    let backend = SimBackend::new(8, WorldConfig::default()).unwrap();
    let spec = OpSpec::new(OpKind::AllReduce, 8, 1000, 0).unwrap();
    let plan = check(build_plan(spec, Algo::Ring, &Topology::new(8, 1).unwrap()).unwrap()).unwrap();
    let b = plan.plan().buffers;
    let want = 8 * (b.input + b.output + b.scratch) as u64 * 2;
    assert_eq!(backend.host_bytes(&plan, DType::BF16), Some(want));
    let huge = OpSpec::new(OpKind::AllReduce, 8, 1 << 56, 0).unwrap();
    let plan = check(build_plan(huge, Algo::Ring, &Topology::new(8, 1).unwrap()).unwrap()).unwrap();
    let msg = too_large(
        backend.prepare(&plan, DType::F32, ReduceOp::Sum),
        "the prepared call",
    );
    assert!(msg.starts_with("all-reduce of 72057594037927936 f32 elements on 8 ranks (sim) needs"));
}
