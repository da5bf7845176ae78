//! GPU-only behaviour of the cuda backend: bounded waits end in a diagnosed timeout instead of
//! a hung GPU. Skips with a printed reason where there are fewer than two GPUs.

use commfuse_core::backend::BackendError;
use commfuse_core::{build_plan, check, Algo, OpKind, OpSpec, Slot, Topology};
use commfuse_cuda::CudaBackend;
use std::time::{Duration, Instant};

fn two_gpus() -> Option<usize> {
    commfuse_cuda::testing::gpus(2)
}

#[test]
fn a_peer_that_never_arrives_times_out_with_rank_lane_and_slot() {
    if two_gpus().is_none() {
        return;
    }
    let backend = CudaBackend::open(&[0, 1], Duration::from_millis(300)).unwrap();
    let spec = OpSpec::new(OpKind::Barrier, 2, 0, 0).unwrap();
    let plan =
        check(build_plan(spec, Algo::AllToAll, &Topology::new(2, 1).unwrap()).unwrap()).unwrap();
    let started = Instant::now();
    // only rank 0 runs: it signals rank 1 and waits for rank 1's column forever
    let err = backend.run_partial(&plan, &[0]).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    assert_eq!(
        err,
        BackendError::DeviceWaitTimeout {
            rank: 0,
            lane: 0,
            slot: Slot::new(0, 1),
            expected: 1,
            seen: 0,
            timeout_ms: 300
        }
    );
    // the backend refuses further calls on its half-signalled pads
    assert!(backend.run_partial(&plan, &[0, 1]).is_err());
    // a fresh backend runs the same plan on both GPUs
    drop(backend);
    let fresh = CudaBackend::open(&[0, 1], Duration::from_secs(5)).unwrap();
    fresh.run_partial(&plan, &[0, 1]).unwrap();
}
