//! GPU-only behaviour of the cuda backend: bounded waits end in a diagnosed timeout instead of
//! a hung GPU; a rank that fails stops the others' kernels before anything is freed; bad
//! requests are errors. Skips with a printed reason where there are too few GPUs.

use commfuse_core::backend::BackendError;
use commfuse_core::{build_plan, check, Algo, OpKind, OpSpec, Slot, Topology};
use commfuse_cuda::sys::driver::{DeviceMemory, Gpu};
use commfuse_cuda::{CudaBackend, CudaError};
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
            timeout_ms: 300,
            from: Some(1)
        }
    );
    // the backend refuses further calls on its half-signalled pads
    assert!(backend.run_partial(&plan, &[0, 1]).is_err());
    // a fresh backend runs the same plan on both GPUs
    drop(backend);
    let fresh = CudaBackend::open(&[0, 1], Duration::from_secs(5)).unwrap();
    fresh.run_partial(&plan, &[0, 1]).unwrap();
}

#[test]
fn a_rank_whose_launch_fails_stops_the_others_before_their_device_timeout() {
    if two_gpus().is_none() {
        return;
    }
    // a device timeout far longer than the test may take: only the abort can end rank 0's wait
    let backend = CudaBackend::open(&[0, 1], Duration::from_secs(60)).unwrap();
    let spec = OpSpec::new(OpKind::Barrier, 2, 0, 0).unwrap();
    let plan =
        check(build_plan(spec, Algo::AllToAll, &Topology::new(2, 1).unwrap()).unwrap()).unwrap();
    let started = Instant::now();
    let err = backend
        .run_with_failed_launch(&plan, 1, Duration::from_millis(500))
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(
        err,
        BackendError::Unavailable("rank 1: launch failed on purpose".into())
    );
    assert!(
        took < Duration::from_secs(20),
        "rank 0's kernel was not stopped: the call took {took:?}"
    );
    // the pads are mid-protocol: no further calls; dropping frees normally (nothing runs)
    assert!(backend.run_partial(&plan, &[0, 1]).is_err());
    drop(backend);
    let fresh = CudaBackend::open(&[0, 1], Duration::from_secs(5)).unwrap();
    fresh.run_partial(&plan, &[0, 1]).unwrap();
}

#[test]
fn a_partial_run_refuses_a_plan_for_another_world_size() {
    if two_gpus().is_none() {
        return;
    }
    let backend = CudaBackend::open(&[0, 1], Duration::from_secs(5)).unwrap();
    let spec = OpSpec::new(OpKind::Barrier, 3, 0, 0).unwrap();
    let plan =
        check(build_plan(spec, Algo::AllToAll, &Topology::new(3, 1).unwrap()).unwrap()).unwrap();
    let err = backend.run_partial(&plan, &[0, 1]).unwrap_err();
    assert_eq!(
        err,
        BackendError::Unavailable("the plan is for 3 ranks, the backend has 2".into())
    );
    // refused before anything ran: the backend is still usable
    let spec = OpSpec::new(OpKind::Barrier, 2, 0, 0).unwrap();
    let plan =
        check(build_plan(spec, Algo::AllToAll, &Topology::new(2, 1).unwrap()).unwrap()).unwrap();
    backend.run_partial(&plan, &[0, 1]).unwrap();
}

#[test]
fn a_copy_larger_than_its_allocation_is_an_error_not_a_panic() {
    if commfuse_cuda::testing::gpus(1).is_none() {
        return;
    }
    let gpu = Gpu::open(0).unwrap();
    let mem = DeviceMemory::zeroed(&gpu, 64).unwrap();
    let mut big = vec![0u32; 17];
    assert!(matches!(
        mem.download(&gpu, &mut big),
        Err(CudaError::OutOfBounds(_))
    ));
    assert!(matches!(
        mem.upload(&gpu, &big),
        Err(CudaError::OutOfBounds(_))
    ));
    let mut fits = vec![0u32; 16];
    mem.upload(&gpu, &[7u32; 16]).unwrap();
    mem.download(&gpu, &mut fits).unwrap();
    assert_eq!(fits, vec![7u32; 16]);
}

/// `fill` and `upload` have written when they return: work queued next on one of our
/// (non-blocking) streams comes after them. The driver documents its memset of device memory
/// as asynchronous with respect to the host and ordered on the legacy stream only: were it
/// left unwaited, its last bytes could land after the copy below and erase it.
#[test]
fn fill_and_upload_finish_before_work_queued_on_a_stream() {
    if commfuse_cuda::testing::gpus(1).is_none() {
        return;
    }
    let gpu = Gpu::open(0).unwrap();
    let stream = commfuse_cuda::sys::driver::Stream::new(&gpu).unwrap();
    // large enough that the memset is still running when the copy is queued
    let bytes = 4 << 30;
    let big = DeviceMemory::zeroed(&gpu, bytes).unwrap();
    let pattern = DeviceMemory::zeroed(&gpu, 16).unwrap();
    let seen = DeviceMemory::zeroed(&gpu, 16).unwrap();
    for round in 0..8u8 {
        let value = 0xa0 + round;
        pattern.upload(&gpu, &[value; 16]).unwrap();
        big.fill(&gpu, 0).unwrap();
        let tail = big.addr() + (bytes - 16) as u64;
        // SAFETY: every address is a live allocation of this GPU, 16 bytes long from there
        unsafe {
            stream.copy_async(tail, pattern.addr(), 16).unwrap();
            stream.copy_async(seen.addr(), tail, 16).unwrap();
        }
        stream.synchronize().unwrap();
        let mut got = [0u8; 16];
        seen.download(&gpu, &mut got).unwrap();
        assert_eq!(
            got, [value; 16],
            "round {round}: the copy was overwritten by the fill"
        );
        // and the tail itself, after the stream and the fill have both finished
        let mut whole = vec![0u8; 16];
        // SAFETY: as above
        unsafe { stream.copy_async(seen.addr(), tail, 16).unwrap() };
        stream.synchronize().unwrap();
        seen.download(&gpu, &mut whole).unwrap();
        assert_eq!(
            whole,
            vec![value; 16],
            "round {round}: the fill landed after the copy"
        );
    }
}

/// A stream held by a flag wait that no one raises (2 s, the wait's own bound): a host wait
/// bounded at 200 ms ends in an error naming who waited on what and the limit, instead of
/// waiting the stream out; the stream is idle once the flag wait has given up.
#[test]
fn a_bounded_stream_wait_names_who_waited_on_what() {
    if commfuse_cuda::testing::gpus(1).is_none() {
        return;
    }
    use commfuse_cuda::gemm_rs::flag_step::{FlagCmp, FlagSteps};
    use commfuse_cuda::sys::driver::Stream;
    let gpu = Gpu::open(0).unwrap();
    let stream = Stream::new(&gpu).unwrap();
    let steps = FlagSteps::new(&gpu, 0, Duration::from_secs(2)).unwrap();
    let flag = DeviceMemory::zeroed(&gpu, 8).unwrap();
    // SAFETY: the flag outlives the wait (the stream is idle before it is freed)
    unsafe {
        steps
            .queue(&stream, Some((flag.addr(), 1, FlagCmp::Eq)), None, (0, 0))
            .unwrap()
    };
    let started = Instant::now();
    let err = stream
        .synchronize_within(Duration::from_millis(200), "a test's rank 0", "a flag wait")
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_millis(1500),
        "{waited:?}"
    );
    assert!(matches!(err, CudaError::Stalled(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "a test's rank 0 waited 200ms for a flag wait, which had not finished"
    );
    assert!(
        stream.wait_idle(Duration::from_secs(10)).unwrap(),
        "the flag wait gives up"
    );
    assert!(steps.timeout().is_some(), "and says so");
}

/// What is made in a GPU's context keeps that context alive: made alone and the `Gpu` dropped
/// first, each of device memory, mapped host memory, a stream, an event and a graph leaves the
/// context usable (work queued on its legacy stream completes; the stream, event and graph work)
/// and is then freed without touching a destroyed context (which could crash the process or
/// free memory twice); a GPU opened afterwards works as before.
#[test]
fn objects_made_on_a_gpu_outlive_its_handle_in_any_drop_order() {
    use commfuse_cuda::sys::driver::{Event, Graph, MappedHost, Stream};
    if commfuse_cuda::testing::gpus(1).is_none() {
        return;
    }
    // SAFETY: the legacy stream of the context bound on this thread, used at once
    let context_alive = || unsafe { Stream::borrowed(std::ptr::null_mut()) }.synchronize();
    // each kind of object, made alone on a fresh handle
    type Make = fn(&Gpu) -> Box<dyn std::any::Any>;
    let made: [(&str, Make); 5] = [
        ("device memory", |g| {
            Box::new(DeviceMemory::zeroed(g, 1 << 20).unwrap())
        }),
        ("mapped host memory", |g| {
            Box::new(MappedHost::new(g, 7u64).unwrap())
        }),
        ("a stream", |g| Box::new(Stream::new(g).unwrap())),
        ("an event", |g| Box::new(Event::new(g).unwrap())),
        ("a graph", |g| {
            let stream = Stream::new(g).unwrap();
            Box::new(Graph::capture(&stream, || Ok(())).unwrap())
        }),
    ];
    for (what, make) in made {
        let gpu = Gpu::open(0).unwrap();
        let object = make(&gpu);
        drop(gpu);
        context_alive()
            .unwrap_or_else(|e| panic!("the context went with its Gpu under {what}: {e}"));
        if let Some(stream) = object.downcast_ref::<Stream>() {
            stream.synchronize().unwrap();
            assert!(stream.is_idle().unwrap());
        }
        if let Some(event) = object.downcast_ref::<Event>() {
            // SAFETY: as above
            event
                .record(&unsafe { Stream::borrowed(std::ptr::null_mut()) })
                .unwrap();
            context_alive().unwrap();
            assert!(event.is_done().unwrap());
        }
        if let Some(host) = object.downcast_ref::<MappedHost<u64>>() {
            assert_eq!(host.read(), 7);
        }
        if let Some(graph) = object.downcast_ref::<Graph>() {
            // SAFETY: as above
            let legacy = unsafe { Stream::borrowed(std::ptr::null_mut()) };
            graph.launch(&legacy).unwrap();
            context_alive().unwrap();
        }
        drop(object);
    }
    let gpu = Gpu::open(0).unwrap();
    let fresh = DeviceMemory::zeroed(&gpu, 64).unwrap();
    fresh.upload(&gpu, &[3u32; 16]).unwrap();
    let mut back = [0u32; 16];
    fresh.download(&gpu, &mut back).unwrap();
    assert_eq!(back, [3; 16]);
}
