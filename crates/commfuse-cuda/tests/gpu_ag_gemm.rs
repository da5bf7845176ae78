//! All-gather + GEMM on GPUs, one rank per GPU, one host thread each: every output element of
//! every rank against the float64 reference and the gathered A exactly, three calls queued back
//! to back with different inputs and M (M < P included), alternately on two streams of each
//! rank, outputs poisoned by the stream before each call (`commfuse_cuda::ag_gemm::checked`); a peer that never arrives ends in a
//! diagnosed error; bad calls are refused. Skips with a printed reason without two GPUs (a
//! failure under COMMFUSE_REQUIRE_GPU=1).

use commfuse_core::gemm::BLayout;
use commfuse_core::{DType, Element};
use commfuse_cuda::ag_gemm::checked::run_checked;
use commfuse_cuda::ag_gemm::{AgGemmConfig, AgGemmRank};
use commfuse_cuda::sys::driver::{DeviceMemory, Gpu, Stream};
use commfuse_cuda::testing::{gpus, random, two_gpus, upload};
use half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs `ms.len()` calls back to back on every rank and checks every element; `(pieces,
/// fused)`: the pieces a chunk is handed on in, and whether our GEMM runs the call (the fused
/// path) instead of cuBLASLt per piece.
#[allow(clippy::too_many_arguments)]
fn run_case<TI: Element + bytemuck::Pod, TO: Element + bytemuck::Pod>(
    gpus: &[Arc<Gpu>],
    (pieces, fused): (usize, bool),
    n: usize,
    k: usize,
    layout: BLayout,
    bias: bool,
    ms: &[usize],
    seed: u64,
) {
    let world = gpus.len();
    let started = Instant::now();
    let max_m = *ms.iter().max().unwrap();
    let mut config = AgGemmConfig::new(max_m, n, k, layout, TI::DTYPE, TO::DTYPE);
    config.bias = bias;
    config.pieces = pieces;
    config.fused = fused;
    let calls = run_checked(gpus, config, ms, seed).unwrap();
    assert_eq!(calls.len(), ms.len());
    for (c, call) in calls.iter().enumerate() {
        assert_eq!(call.m, ms[c]);
        assert_eq!(call.ranks.len(), world);
        for (r, check) in call.ranks.iter().enumerate() {
            assert_eq!(check.checked, call.m * n, "call {c} rank {r}");
            assert_eq!(
                check.out_of_bound, 0,
                "pieces {pieces} fused {fused} call {c} (M={}) rank {r} {n}x{k} {layout:?} {:?}->{:?} bias={bias}: {check:?}",
                call.m,
                TI::DTYPE,
                TO::DTYPE
            );
        }
    }
    // with --nocapture: what each case took (a slow one shows which)
    eprintln!(
        "ok pieces {pieces} fused {fused} P={world} {n}x{k} {layout:?} {:?}->{:?} M={ms:?}: {:?}",
        TI::DTYPE,
        TO::DTYPE,
        started.elapsed()
    );
}

/// One rank on one GPU: nothing to gather from a peer, the same checks (both paths, ragged M,
/// both layouts, f32 output with bias).
#[test]
fn one_rank_on_one_gpu_matches_float64() {
    if gpus(1).is_none() {
        return;
    }
    let g = vec![Arc::new(Gpu::open(0).unwrap())];
    for way in [(1, false), (2, false), (1, true), (2, true)] {
        for layout in [BLayout::NK, BLayout::KN] {
            run_case::<bf16, bf16>(&g, way, 264, 136, layout, false, &[301, 130, 1], 31);
            run_case::<f16, f32>(&g, way, 256, 64, layout, true, &[2, 1, 700], 32);
        }
    }
}

#[test]
fn every_element_of_back_to_back_calls_matches_float64() {
    let Some(g) = two_gpus() else { return };
    for way in [(1, false), (3, false), (1, true), (3, true)] {
        for layout in [BLayout::NK, BLayout::KN] {
            run_case::<bf16, bf16>(&g, way, 264, 136, layout, false, &[301, 130, 1], 1);
            run_case::<f16, f16>(&g, way, 520, 64, layout, true, &[257, 1, 384], 2);
            run_case::<bf16, f32>(&g, way, 600, 72, layout, true, &[300, 7], 3);
        }
        run_case::<bf16, bf16>(&g[..1], way, 264, 64, BLayout::NK, true, &[300, 1], 4);
        run_case::<bf16, bf16>(&g, way, 2048, 512, BLayout::NK, true, &[2048, 1000], 5);
    }
}

/// One call of M = 256 on rank 0 alone (rank 1 never calls), 300 ms waits, `fused` or not:
/// what `check` then says, and whether the operator took a second call. Bounded: no hang.
fn lone_call(g: &[Arc<Gpu>], fused: bool) -> (String, bool) {
    let mut config = AgGemmConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    config.timeout = Duration::from_millis(300);
    config.fused = fused;
    let mut ranks = AgGemmRank::create_group(g, config).unwrap();
    let op = &mut ranks[0];
    assert_eq!(op.path() == "fused", fused);
    let stream = Stream::new(&g[0]).unwrap();
    let a = upload(&g[0], &random::<bf16>(128 * 64, 1, 0));
    let b = upload(&g[0], &random::<bf16>(256 * 64, 1, 1));
    let out = DeviceMemory::zeroed(&g[0], 256 * 256 * 2).unwrap();
    let started = Instant::now();
    // SAFETY: buffers outlive the synchronisation
    unsafe {
        op.forward(&stream, 256, (a.addr(), b.addr(), None), out.addr(), None)
            .unwrap()
    };
    stream.synchronize().unwrap();
    let err = op.check().unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    // SAFETY: refused before anything is queued
    let again = unsafe { op.forward(&stream, 256, (a.addr(), b.addr(), None), out.addr(), None) };
    (err, again.is_ok())
}

/// The fused path with a peer that never calls: the GEMM's producer gives up on the peer's
/// rows (half the pipeline's bound), the kernel ends, and `check` names the wait.
#[test]
fn a_peer_that_never_arrives_is_reported_by_the_fused_gemm() {
    let Some(g) = two_gpus() else { return };
    let (err, again) = lone_call(&g, true);
    assert!(
        err.contains("(fused): GEMM on rank 0")
            && err.contains("the rows of A a peer copies in")
            && err.contains("the flag held call 0, this is call 1"),
        "{err}"
    );
    assert!(!again, "the operator refuses further calls");
}

#[test]
fn a_peer_that_never_arrives_ends_in_a_diagnosed_error() {
    let Some(g) = two_gpus() else { return };
    let (err, again) = lone_call(&g, false);
    assert!(
        err.contains("rank 0 waited for piece 0 of rank 1's chunk to reach call 1, saw 0"),
        "{err}"
    );
    assert!(!again, "the operator refuses further calls");
}

#[test]
fn bad_calls_are_refused_with_one_line() {
    let Some(g) = two_gpus() else { return };
    let config = AgGemmConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    let mut ranks = AgGemmRank::create_group(&g, config).unwrap();
    let stream = Stream::new(&g[0]).unwrap();
    let mem = DeviceMemory::zeroed(&g[0], 1 << 20).unwrap();
    let x = mem.addr();
    // SAFETY: refused before anything is queued
    let e = unsafe { ranks[0].forward(&stream, 257, (x, x, None), x, None) }.unwrap_err();
    assert!(e.to_string().contains("M must be 1 to 256"), "{e}");
    // SAFETY: as above
    let e = unsafe { ranks[0].forward(&stream, 16, (x, x, Some(x)), x, None) }.unwrap_err();
    assert!(e.to_string().contains("without a bias"), "{e}");
    let mut bad = AgGemmConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    bad.pieces = 0;
    let e = AgGemmRank::create_group(&g, bad).err().unwrap();
    assert!(e.to_string().contains("1 to 16 pieces"), "{e}");
    let bad = AgGemmConfig::new(256, 300, 64, BLayout::NK, DType::BF16, DType::BF16);
    let e = AgGemmRank::create_group(&g, bad).err().unwrap();
    assert!(
        e.to_string().contains("16-byte units") && !e.to_string().contains('\n'),
        "{e}"
    );
}

/// Two ranks built by hand (so that the test knows where their gather buffers are), 300 ms
/// waits, and one call of M = 256 on the ranks in `calling` (synchronised, then checked);
/// dropped rank by rank. Whether each gather buffer is still allocated after the drops.
fn gather_allocated_after_drop(g: &[Arc<Gpu>], calling: &[usize]) -> Vec<bool> {
    use commfuse_cuda::ag_gemm::AgGemmAllocation;
    use commfuse_cuda::sys::driver::allocation_of;
    let mut config = AgGemmConfig::new(256, 256, 64, BLayout::NK, DType::BF16, DType::BF16);
    config.timeout = Duration::from_millis(300);
    let parts: Vec<_> = g
        .iter()
        .enumerate()
        .map(|(r, gpu)| AgGemmAllocation::new(gpu.clone(), r, g.len(), config).unwrap())
        .collect();
    let peers: Vec<_> = parts.iter().map(AgGemmAllocation::peer).collect();
    let mut ranks: Vec<_> = parts
        .into_iter()
        .map(|p| p.connect(&peers).unwrap())
        .collect();
    let buffers: Vec<_> = g
        .iter()
        .map(|gpu| {
            (
                Stream::new(gpu).unwrap(),
                upload(gpu, &random::<bf16>(128 * 64, 1, 0)),
                upload(gpu, &random::<bf16>(256 * 64, 1, 1)),
                DeviceMemory::zeroed(gpu, 256 * 256 * 2).unwrap(),
            )
        })
        .collect();
    for &r in calling {
        let (stream, a, b, out) = &buffers[r];
        // SAFETY: buffers outlive the synchronisation below
        unsafe {
            ranks[r]
                .forward(stream, 256, (a.addr(), b.addr(), None), out.addr(), None)
                .unwrap()
        };
    }
    for &r in calling {
        buffers[r].0.synchronize().unwrap();
        let _ = ranks[r].check();
    }
    let started = Instant::now();
    drop(ranks);
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    peers
        .iter()
        .map(|p| allocation_of(p.gather).unwrap().is_some())
        .collect()
}

/// A rank's memory is freed at its drop once every peer's done of its last call has come, and
/// kept (leaked, with a line on stderr) where a peer never called: that peer's done could still
/// come and write into whatever is allocated there next.
#[test]
fn a_rank_dropped_before_a_peers_done_keeps_its_memory() {
    let Some(g) = two_gpus() else { return };
    assert_eq!(
        gather_allocated_after_drop(&g, &[0, 1]),
        [false, false],
        "both called: both freed"
    );
    // rank 0 waited for rank 1's rows and done, which never came; rank 1 has no call that a
    // peer's done could belong to
    assert_eq!(
        gather_allocated_after_drop(&g, &[0]),
        [true, false],
        "rank 1 never called: rank 0's memory stays"
    );
}
