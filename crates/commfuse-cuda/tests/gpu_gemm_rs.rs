//! GEMM + reduce-scatter on GPUs, one rank per GPU, one host thread each: every output element
//! of every rank against the float64 reference, three calls queued back to back with different
//! inputs and M (M < P included), alternately on two streams of each rank, outputs poisoned
//! before each call by the stream itself (`commfuse_cuda::gemm_rs::checked`); a peer that never arrives ends in a diagnosed error,
//! not a hang. Skips with a printed reason without two GPUs (one for the unfused path's test
//! on one GPU; a failure under COMMFUSE_REQUIRE_GPU=1).

use commfuse_core::gemm::BLayout;
use commfuse_core::{DType, Element};
use commfuse_cuda::gemm::WIDE_TILE;
use commfuse_cuda::gemm_rs::checked::run_checked;
use commfuse_cuda::gemm_rs::{GemmRsConfig, GemmRsPath, GemmRsRank, PathChoice, Reduction};
use commfuse_cuda::sys::driver::{DeviceMemory, Gpu, Stream};
use commfuse_cuda::testing::{gpus, random, skip, two_gpus, upload};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which path a case runs.
#[derive(Debug, Clone, Copy)]
enum Way {
    Fused(Reduction),
    /// The fused path on the wide ping-pong build's 128 × 192 tiles
    FusedWide(Reduction),
    Overlapped(usize),
    /// The overlapped path's ring over NUMA groups: (pieces, groups)
    OverlappedInGroups(usize, usize),
    Unfused,
}

/// Whether NCCL can run here (libnccl on the library path): the unfused path, and `auto`'s
/// choice of it, need it. Where it cannot, the tests of the unfused path skip with the reason
/// (and fail under COMMFUSE_REQUIRE_GPU=1).
fn nccl_allowed() -> bool {
    // SAFETY: only tries to dlopen libnccl
    let present = unsafe { cudarc::nccl::sys::is_culib_present() };
    if !present {
        skip("NCCL (libnccl.so) is not on the library path: the unfused path is not tested");
    }
    present
}

/// Runs `ms.len()` calls back to back on every rank and checks every output element.
#[allow(clippy::too_many_arguments)]
fn run_case<TI: Element + bytemuck::Pod, TO: Element + bytemuck::Pod>(
    gpus: &[Arc<Gpu>],
    way: Way,
    n: usize,
    k: usize,
    layout: BLayout,
    bias: bool,
    ms: &[usize],
    seed: u64,
) {
    let max_m = *ms.iter().max().unwrap();
    let mut config = GemmRsConfig::new(max_m, n, k, layout, TI::DTYPE, TO::DTYPE);
    config.bias = bias;
    match way {
        Way::Fused(reduction) => {
            config.reduction = reduction;
            config.path = PathChoice::Always(GemmRsPath::Fused);
        }
        Way::FusedWide(reduction) => {
            config.reduction = reduction;
            config.path = PathChoice::Always(GemmRsPath::Fused);
            config.tile = WIDE_TILE;
        }
        Way::Overlapped(pieces) => {
            config.path = PathChoice::Always(GemmRsPath::Overlapped { pieces })
        }
        Way::OverlappedInGroups(pieces, groups) => {
            config.path = PathChoice::Always(GemmRsPath::Overlapped { pieces });
            config.numa_groups = groups;
        }
        Way::Unfused => config.path = PathChoice::Always(GemmRsPath::Unfused),
    }
    let path = match way {
        Way::Fused(_) | Way::FusedWide(_) => GemmRsPath::Fused,
        Way::Overlapped(pieces) | Way::OverlappedInGroups(pieces, _) => {
            GemmRsPath::Overlapped { pieces }
        }
        Way::Unfused => GemmRsPath::Unfused,
    };
    let calls = run_checked(gpus, config, ms, seed).unwrap();
    assert_eq!(calls.len(), ms.len());
    for (c, (call, took)) in calls.iter().enumerate() {
        assert_eq!(*took, path, "{way:?} call {c} (M={})", call.m);
        assert_eq!(call.ranks.len(), gpus.len());
        for (r, check) in call.ranks.iter().enumerate() {
            assert_eq!(check.checked, chunk_len(gpus.len(), call.m, r) * n);
            assert_eq!(
                check.out_of_bound,
                0,
                "{way:?} call {c} (M={}) rank {r} {n}x{k} {layout:?} {:?}->{:?} bias={bias}: {check:?}",
                call.m,
                TI::DTYPE,
                TO::DTYPE
            );
        }
    }
}

/// Rows of rank r's chunk of M rows on P ranks.
fn chunk_len(p: usize, m: usize, r: usize) -> usize {
    commfuse_core::op::chunk_range(m, p, r).len()
}

#[test]
fn every_element_of_back_to_back_calls_matches_float64() {
    let Some(g) = two_gpus() else { return };
    // ragged M (not a multiple of P or of the 128-row tile), a smaller M, then M < P
    let ms = [301, 130, 1];
    let ways = [
        Way::Fused(Reduction::Fold),
        Way::Fused(Reduction::Separate { blocks: 3 }),
        Way::Overlapped(1),
        Way::Overlapped(3),
    ];
    if nccl_allowed() {
        // the unfused path: cuBLASLt and NCCL's own, so a sample (ragged M, short chunks
        // through the receive buffer, both layouts, f32 output, bias, one GPU) is enough
        for layout in [BLayout::NK, BLayout::KN] {
            run_case::<bf16, bf16>(&g, Way::Unfused, 264, 136, layout, false, &ms, 11);
            run_case::<f16, f32>(&g, Way::Unfused, 256, 64, layout, true, &[2, 1, 700], 12);
        }
        run_case::<bf16, bf16>(&g, Way::Unfused, 300, 64, BLayout::NK, true, &[300, 7], 13);
        run_case::<bf16, bf16>(
            &g[..1],
            Way::Unfused,
            264,
            64,
            BLayout::NK,
            true,
            &[300, 1],
            14,
        );
    }
    for red in ways {
        for layout in [BLayout::NK, BLayout::KN] {
            run_case::<bf16, bf16>(&g, red, 264, 136, layout, false, &ms, 1);
            run_case::<bf16, bf16>(&g, red, 520, 64, layout, true, &[257, 1, 384], 2);
            run_case::<f16, f16>(&g, red, 264, 200, layout, true, &ms, 3);
            run_case::<bf16, f32>(&g, red, 600, 72, layout, true, &ms, 4);
            run_case::<f16, f32>(&g, red, 256, 64, layout, false, &[2, 1, 700], 5);
        }
        // N not a multiple of the 256-column tile nor of 8 (B as [N, K] only: [K, N] rows need
        // 16 bytes; the fused path only: the overlapped one needs rows of whole 16 bytes)
        if let Way::Fused(_) = red {
            run_case::<bf16, bf16>(&g, red, 300, 64, BLayout::NK, true, &[300, 7], 6);
        }
        // one GPU: the whole chunk is local
        run_case::<bf16, bf16>(&g[..1], red, 264, 64, BLayout::NK, true, &[300, 1], 7);
        // a larger problem: several waves, every SM busy
        run_case::<bf16, bf16>(&g, red, 2048, 512, BLayout::NK, true, &[2048, 1000], 8);
    }
}

/// The fused path on the wide ping-pong build's tiles (its routed entries, the fold by TMA
/// boxes of the fold map): ragged M and N, both reductions and layouts, a bias, one GPU, and
/// several waves. Its tiles take 16-bit outputs of whole 16-byte rows only (N a multiple of 8).
#[test]
fn wide_tiles_match_float64() {
    let Some(g) = two_gpus() else { return };
    let ms = [301, 130, 1];
    for red in [Reduction::Fold, Reduction::Separate { blocks: 3 }] {
        let way = Way::FusedWide(red);
        for layout in [BLayout::NK, BLayout::KN] {
            run_case::<bf16, bf16>(&g, way, 264, 136, layout, false, &ms, 21);
            run_case::<f16, f16>(&g, way, 520, 200, layout, true, &[257, 1, 384], 22);
        }
        run_case::<bf16, bf16>(&g[..1], way, 392, 64, BLayout::NK, true, &[300, 1], 23);
        run_case::<bf16, bf16>(&g, way, 2048, 512, BLayout::NK, true, &[2048, 1000], 24);
    }
}

/// The unfused path on one GPU: its non-blocking NCCL communicator of one rank is joined at the
/// first call, takes back-to-back reduce-scatters and is freed when the operator is dropped
/// (run_case's end), every element checked.
#[test]
fn the_unfused_path_runs_on_one_gpu_over_a_non_blocking_communicator() {
    if gpus(1).is_none() || !nccl_allowed() {
        return;
    }
    let g = vec![Arc::new(Gpu::open(0).unwrap())];
    run_case::<bf16, bf16>(
        &g,
        Way::Unfused,
        264,
        64,
        BLayout::NK,
        true,
        &[300, 1, 77],
        15,
    );
}

/// One rank on one GPU by the fused and the overlapped paths (the whole chunk local, nothing
/// sent): every element checked, ragged M, both layouts, f32 output with bias.
#[test]
fn one_rank_on_one_gpu_matches_float64() {
    if gpus(1).is_none() {
        return;
    }
    let g = vec![Arc::new(Gpu::open(0).unwrap())];
    for way in [
        Way::Fused(Reduction::Fold),
        Way::Fused(Reduction::Separate { blocks: 3 }),
        Way::Overlapped(1),
        Way::Overlapped(3),
    ] {
        for layout in [BLayout::NK, BLayout::KN] {
            run_case::<bf16, bf16>(&g, way, 264, 136, layout, false, &[301, 130, 1], 41);
            run_case::<f16, f32>(&g, way, 256, 64, layout, true, &[2, 1, 700], 42);
        }
    }
}

/// The 2D ring's code on two GPUs: one NUMA group per GPU is the flat ring with every hand-on
/// across groups (its own done flag when M < P); the simulator checks the 2D ring of P = 4..16.
#[test]
fn the_ring_over_numa_groups_matches_float64() {
    let Some(g) = two_gpus() else { return };
    for layout in [BLayout::NK, BLayout::KN] {
        let way = Way::OverlappedInGroups(2, 2);
        run_case::<bf16, bf16>(&g, way, 264, 136, layout, true, &[301, 130, 1], 21);
        run_case::<f16, f32>(&g, way, 256, 64, layout, false, &[2, 1, 700], 22);
    }
}

/// One call on rank 0 alone (rank 1 never calls), synchronised: what `check` then says, how
/// long the call took, and whether the operator takes another call.
fn lone_call(g: &[Arc<Gpu>], config: GemmRsConfig) -> (String, Duration, bool) {
    let mut ranks = GemmRsRank::create_group(g, config).unwrap();
    let op = &mut ranks[0];
    let stream = Stream::new(&g[0]).unwrap();
    let a = upload(&g[0], &random::<bf16>(256 * 64, 1, 0));
    let b = upload(&g[0], &random::<bf16>(256 * 64, 1, 1));
    let out = DeviceMemory::zeroed(&g[0], 128 * 256 * 2).unwrap();
    let started = Instant::now();
    // SAFETY: buffers outlive the synchronisation
    unsafe {
        op.forward(&stream, 256, a.addr(), b.addr(), None, out.addr())
            .unwrap()
    };
    stream.synchronize().unwrap();
    let err = op.check().unwrap_err().to_string();
    let elapsed = started.elapsed();
    // SAFETY: as above
    let again = unsafe { op.forward(&stream, 256, a.addr(), b.addr(), None, out.addr()) };
    (err, elapsed, again.is_ok())
}

#[test]
fn a_peer_that_never_arrives_ends_in_a_diagnosed_error() {
    let Some(g) = two_gpus() else { return };
    let mut config = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    config.timeout = Duration::from_millis(300);
    config.reduction = Reduction::Separate { blocks: 2 };
    config.path = PathChoice::Always(GemmRsPath::Fused);
    let (err, elapsed, again) = lone_call(&g, config);
    assert!(elapsed < Duration::from_secs(10), "no hang");
    assert!(
        err.contains("rank 0's reduction") && err.contains("sender 1") && err.contains("saw 0"),
        "{err}"
    );
    assert!(!again, "the operator refuses further calls");
}

#[test]
fn a_peer_that_never_arrives_is_reported_by_the_folding_epilogue() {
    let Some(g) = two_gpus() else { return };
    let mut config = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    config.path = PathChoice::Always(GemmRsPath::Fused);
    let (err, elapsed, again) = lone_call(&g, config);
    // the GEMM's fold waits give up at half its 5 s pipeline bound, and the kernel ends
    assert!(elapsed < Duration::from_secs(15), "no hang");
    assert!(
        err.contains("rank 0") && err.contains("a peer's partial") && err.contains("held call 0"),
        "{err}"
    );
    assert!(!again, "the operator refuses further calls");
}

#[test]
fn a_peer_that_never_arrives_is_reported_by_the_ring() {
    let Some(g) = two_gpus() else { return };
    let mut config = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    config.timeout = Duration::from_millis(300);
    config.path = PathChoice::Always(GemmRsPath::Overlapped { pieces: 2 });
    let (err, elapsed, again) = lone_call(&g, config);
    assert!(elapsed < Duration::from_secs(10), "no hang");
    // rank 0's own rows wait for rank 1's running sum of their first piece
    assert!(
        err.contains("(ring): rank 0 at step 1")
            && err.contains("piece 0 handed on after step 0 (set 1)")
            && err.contains("saw 0"),
        "{err}"
    );
    assert!(!again, "the operator refuses further calls");
}

#[test]
fn the_operator_says_which_path_it_took() {
    let Some(g) = two_gpus() else { return };
    let config = GemmRsConfig::new(4096, 8192, 64, BLayout::NK, DType::BF16, DType::BF16);
    let ranks = GemmRsRank::create_group(&g, config).unwrap();
    // 32 MiB sent per rank: the ring, two pieces a step
    assert_eq!(
        ranks[0].path_for(4096).unwrap(),
        GemmRsPath::Overlapped { pieces: 2 }
    );
    // 16 KiB: too little to hide, the unfused path where NCCL runs, else one piece a step
    let small = if nccl_allowed() {
        GemmRsPath::Unfused
    } else {
        GemmRsPath::Overlapped { pieces: 1 }
    };
    assert_eq!(ranks[0].path_for(1).unwrap(), small);
    assert!(ranks[0].last_path().is_none());
    // rows of 300 bf16 are not whole 16-byte units: the fused path where unfused cannot run
    let config = GemmRsConfig::new(64, 300, 64, BLayout::NK, DType::BF16, DType::BF16);
    let ranks = GemmRsRank::create_group(&g, config).unwrap();
    let small = if nccl_allowed() {
        GemmRsPath::Unfused
    } else {
        GemmRsPath::Fused
    };
    assert_eq!(ranks[1].path_for(64).unwrap(), small);
}

#[test]
fn a_peer_that_never_joins_the_unfused_path_ends_in_a_diagnosed_error() {
    let Some(g) = two_gpus() else { return };
    if !nccl_allowed() {
        return;
    }
    let mut config = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    config.timeout = Duration::from_millis(300);
    config.path = PathChoice::Always(GemmRsPath::Unfused);
    let mut ranks = GemmRsRank::create_group(&g, config).unwrap();
    let stream = Stream::new(&g[0]).unwrap();
    let mem = DeviceMemory::zeroed(&g[0], 1 << 20).unwrap();
    let x = mem.addr();
    let started = Instant::now();
    // SAFETY: buffers outlive the call; rank 1 never calls, so nothing is queued
    let err = unsafe { ranks[0].forward(&stream, 256, x, x, None, x) }.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    let err = err.to_string();
    assert!(
        err.contains("rank 0 waited") && err.contains("NCCL communicator"),
        "{err}"
    );
}

#[test]
fn bad_calls_are_refused_with_one_line() {
    let Some(g) = two_gpus() else { return };
    let config = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    let mut ranks = GemmRsRank::create_group(&g, config).unwrap();
    let stream = Stream::new(&g[0]).unwrap();
    let mem = DeviceMemory::zeroed(&g[0], 1 << 20).unwrap();
    let x = mem.addr();
    // SAFETY: refused before anything is queued
    let e = unsafe { ranks[0].forward(&stream, 257, x, x, None, x) }.unwrap_err();
    assert!(e.to_string().contains("M must be 1 to 256"), "{e}");
    // SAFETY: as above
    let e = unsafe { ranks[0].forward(&stream, 16, x, x, Some(x), x) }.unwrap_err();
    assert!(e.to_string().contains("without a bias"), "{e}");
    let bad = GemmRsConfig::new(256, 256, 12, BLayout::NK, DType::BF16, DType::BF16);
    let e = GemmRsRank::create_group(&g, bad).err().unwrap();
    assert!(e.to_string().contains("multiple of 8"), "{e}");
    let bad = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::F16);
    assert!(GemmRsRank::create_group(&g, bad).is_err());
    assert!(!e.to_string().contains('\n'));
    // the wide build's tiles for f32 partials
    let mut bad = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::F32);
    bad.tile = WIDE_TILE;
    let e = GemmRsRank::create_group(&g, bad).err().unwrap();
    assert!(e.to_string().contains("16-bit type"), "{e}");
    // NUMA groups that do not divide the world, whatever the path
    let mut bad = GemmRsConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    bad.numa_groups = 3;
    bad.path = PathChoice::Always(GemmRsPath::Fused);
    let e = GemmRsRank::create_group(&g, bad).err().unwrap();
    assert!(
        e.to_string()
            .contains("multiple of the NUMA group count (3)"),
        "{e}"
    );
}
