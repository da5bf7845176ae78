//! One process per GPU (PyTorch's model): GEMM + reduce-scatter (both paths) and all-gather +
//! GEMM with rank 0 in this test's process and rank 1 in a child process of the same binary,
//! the operators' buffers exchanged as IPC handles through files; every output element of two
//! back-to-back calls (all-gather + GEMM with two different M) checked against float64 in each
//! process; then a collective whose rank 1 never calls, whose timeout on rank 0 names rank 1.
//! Skips with a printed reason without two GPUs (a failure under COMMFUSE_REQUIRE_GPU=1).

use commfuse_core::fused::gemm_rs::{check_elements_on, reference, GemmRsPath, GemmRsShape};
use commfuse_core::gemm::{check_elements, reference_gemm, BLayout, Epilogue, GemmProblem};
use commfuse_core::{Algo, DType, OpKind};
use commfuse_cuda::ag_gemm::{AgGemmAllocation, AgGemmConfig};
use commfuse_cuda::collective::rank::{CollectiveAllocation, CollectiveConfig};
use commfuse_cuda::gemm_rs::{GemmRsAllocation, GemmRsConfig, PathChoice};
use commfuse_cuda::sys::driver::{DeviceMemory, Gpu, Stream};
use commfuse_cuda::sys::ipc::Exported;
use commfuse_cuda::testing::{gpus, random, upload};
use half::bf16;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RANK_ENV: &str = "COMMFUSE_TEST_RANK";
const DIR_ENV: &str = "COMMFUSE_TEST_DIR";
const WORLD: usize = 2;
const M: usize = 300;
const N: usize = 264;
const K: usize = 136;

/// Every rank's export of operator `name`, through a directory of the test's.
fn rendezvous(dir: &Path, name: &str, mine: &Exported) -> Vec<Exported> {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    mine.exchange_through_dir(&dir, Duration::from_secs(60))
        .unwrap()
}

/// Rank `r`'s whole part, in whichever process runs it.
fn run_rank(r: usize, dir: &Path) {
    let gpu = Arc::new(Gpu::open(r).unwrap());
    let stream = Stream::new(&gpu).unwrap();
    // the same inputs in both processes: every rank's A and B from fixed seeds
    let a: Vec<Vec<bf16>> = (0..WORLD).map(|q| random(M * K, 5, 2 * q)).collect();
    let b: Vec<Vec<bf16>> = (0..WORLD).map(|q| random(K * N, 5, 2 * q + 1)).collect();
    let (a_dev, b_dev) = (upload(&gpu, &a[r]), upload(&gpu, &b[r]));
    let a_refs: Vec<&[bf16]> = a.iter().map(Vec::as_slice).collect();
    let b_refs: Vec<&[bf16]> = b.iter().map(Vec::as_slice).collect();
    let shape = GemmRsShape::new(WORLD, M, N, K, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let chunk = shape.chunk(r);
    for (name, path) in [
        ("fused", GemmRsPath::Fused),
        ("overlapped", GemmRsPath::Overlapped { pieces: 2 }),
    ] {
        let mut config = GemmRsConfig::new(M, N, K, BLayout::NK, DType::BF16, DType::BF16);
        config.path = PathChoice::Always(path);
        let part = GemmRsAllocation::new(gpu.clone(), r, WORLD, config).unwrap();
        let exports = rendezvous(dir, &format!("gemm-rs-{name}"), &part.export().unwrap());
        let mut op = part.connect_exported(&exports).unwrap();
        let outs: Vec<DeviceMemory> = (0..2)
            .map(|_| DeviceMemory::zeroed(&gpu, chunk.len() * N * 2).unwrap())
            .collect();
        for out in &outs {
            // SAFETY: buffers live until the synchronisation below
            unsafe {
                stream
                    .fill_async(out.addr(), 0xff, chunk.len() * N * 2)
                    .unwrap();
                op.forward(&stream, M, a_dev.addr(), b_dev.addr(), None, out.addr())
                    .unwrap();
            }
        }
        stream.synchronize().unwrap();
        op.check().unwrap();
        let want = reference::<bf16, bf16>(&shape, r, &a_refs, &b_refs, None);
        for (c, out) in outs.iter().enumerate() {
            let mut got = vec![bf16::ZERO; chunk.len() * N];
            out.download(&gpu, &mut got).unwrap();
            let check = check_elements_on(&shape, path, got.iter().map(|x| x.to_f64()), &want);
            assert_eq!(check.out_of_bound, 0, "{name} call {c} rank {r}: {check:?}");
        }
    }
    // all-gather + GEMM: rank r holds its chunk of A's rows
    let config = AgGemmConfig::new(M, N, K, BLayout::NK, DType::BF16, DType::BF16);
    let part = AgGemmAllocation::new(gpu.clone(), r, WORLD, config).unwrap();
    let exports = rendezvous(dir, "ag-gemm", &part.export().unwrap());
    let mut op = part.connect_exported(&exports).unwrap();
    // two calls, M then fewer rows, back to back: the done flags across processes
    let full = &a[0];
    let b_refs_r = &b[r];
    let e = Epilogue::default();
    let mut pending = Vec::new();
    for m in [M, M / 2 + 1] {
        let rows = commfuse_core::op::chunk_range(m, WORLD, r);
        let mine = upload(&gpu, &full[rows.start * K..rows.end * K]);
        let out = DeviceMemory::zeroed(&gpu, m * N * 2).unwrap();
        // SAFETY: buffers live until the synchronisation below
        unsafe {
            stream.fill_async(out.addr(), 0xff, m * N * 2).unwrap();
            op.forward(
                &stream,
                m,
                (mine.addr(), b_dev.addr(), None),
                out.addr(),
                None,
            )
            .unwrap();
        }
        pending.push((m, mine, out));
    }
    stream.synchronize().unwrap();
    op.check().unwrap();
    for (m, _, out) in &pending {
        let problem = GemmProblem::new(*m, N, K, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        let want =
            reference_gemm::<bf16, bf16>(&problem, &e, &full[..m * K], b_refs_r, None, None, None);
        let mut got = vec![bf16::ZERO; m * N];
        out.download(&gpu, &mut got).unwrap();
        let check = check_elements(&problem, &e, got.iter().map(|x| x.to_f64()), &want);
        assert_eq!(check.out_of_bound, 0, "ag-gemm M={m} rank {r}: {check:?}");
    }
    drop(op);
    peer_that_never_calls(r, &gpu, &stream, dir);
}

/// A collective whose rank 1 never calls: rank 0's wait times out and its error names rank 1
/// as the rank whose notify it awaited. Rank 1 keeps its memory until rank 0 has looked.
fn peer_that_never_calls(r: usize, gpu: &Arc<Gpu>, stream: &Stream, dir: &Path) {
    let mut config = CollectiveConfig::new(OpKind::AllReduce, 1024, DType::F32);
    config.algo = Some(Algo::OneShot);
    config.timeout = Duration::from_millis(300);
    let part = CollectiveAllocation::new(gpu.clone(), r, WORLD, config).unwrap();
    let mine = part.export().unwrap();
    let exports = rendezvous(dir, "collective-silent", &mine);
    let mut op = part.connect_exported(&exports).unwrap();
    if r == 0 {
        let bufs: Vec<DeviceMemory> = (0..2)
            .map(|_| DeviceMemory::zeroed(gpu, 1024 * 4).unwrap())
            .collect();
        // SAFETY: buffers of this GPU of the op's sizes, live until the synchronisation below
        unsafe { op.forward(stream, bufs[0].addr(), bufs[1].addr()) }.unwrap();
        stream
            .synchronize_within(
                Duration::from_secs(30),
                "rank 0",
                "its timed-out all-reduce",
            )
            .unwrap();
        let e = op.check().unwrap_err().to_string();
        assert!(e.contains("rank 1's notify of slot"), "{e}");
        assert!(e.starts_with("all-reduce: rank 0 lane "), "{e}");
    }
    // both ranks here once rank 0 has its error: only then may rank 1 free what rank 0 writes
    rendezvous(dir, "collective-silent-done", &mine);
    drop(op);
}

/// Kills the child process if the parent's part fails (no orphan left spinning).
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn operators_across_two_processes_match_float64() {
    if std::env::var_os(RANK_ENV).is_some() {
        return; // the child runs its rank in `child_rank` below
    }
    if gpus(2).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_rank", "--nocapture"])
        .env(RANK_ENV, "1")
        .env(DIR_ENV, dir.path())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(Some(child));
    run_rank(0, dir.path());
    let status = wait_bounded(child.0.take().unwrap(), Duration::from_secs(120));
    assert!(
        status,
        "the child process (rank 1) failed; its output is above"
    );
}

/// Rank 1, in the child process the test above starts; a no-op in an ordinary test run.
#[test]
fn child_rank() {
    let (Some(rank), Some(dir)) = (std::env::var_os(RANK_ENV), std::env::var_os(DIR_ENV)) else {
        return;
    };
    let rank: usize = rank.to_str().unwrap().parse().unwrap();
    run_rank(rank, &PathBuf::from(dir));
}

/// Whether `child` exits successfully within `limit` (killed otherwise).
fn wait_bounded(mut child: std::process::Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
