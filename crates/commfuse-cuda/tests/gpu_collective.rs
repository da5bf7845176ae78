//! Collectives as operator objects on GPUs (`CudaCollective`): every op, every algorithm and
//! `auto`, f32 and bf16, three calls queued back to back on each rank's own stream over its own
//! device buffers (outputs poisoned by the stream before each), every output element of every
//! call against the float64 reference; and chains of calls each reading the last one's output.
//! Skips with a printed reason without the two GPUs they need (a failure under
//! COMMFUSE_REQUIRE_GPU=1); with COMMFUSE_SHARE_GPUS=1 the chains and the views run on one GPU,
//! their ranks sharing it (best effort: see `testing::ranks_on_gpus`).

use commfuse_core::backend::BackendError;
use commfuse_core::reference::{compare, fill_input};
use commfuse_core::{Algo, Element, OpKind, ReduceOp};
use commfuse_cuda::backend::CudaBackend;
use commfuse_cuda::collective::CudaCollective;
use commfuse_cuda::sys::driver::{DeviceMemory, Event, Stream};
use commfuse_cuda::sys::host_sync::poll_until;
use commfuse_cuda::testing::{gpus, ranks_on_gpus, skip, upload, SHARE_GPUS};
use half::bf16;
use std::time::Duration;

/// How much later than the others the late ranks of a test queue their calls.
const LATE: Duration = Duration::from_millis(300);

/// Three back-to-back calls, the ranks in `late` queuing theirs `LATE` after the others; the
/// failures.
fn calls<T: Element + bytemuck::Pod>(
    backend: &CudaBackend,
    kind: OpKind,
    count: usize,
    algo: Option<Algo>,
    reduce: ReduceOp,
    late: &[usize],
) -> Vec<String> {
    let options = (algo, reduce, 0, 1);
    let op = match CudaCollective::new(backend, kind, count, T::DTYPE, options) {
        Ok(op) => op,
        // an algorithm that cannot run on this world size says why; any other error fails
        Err(e @ BackendError::NotForWorld(_)) if algo.is_some() => {
            return vec![format!("skip: {e}")]
        }
        Err(e) if algo.is_some() => return vec![format!("{kind} {algo:?} n={count}: {e}")],
        Err(e) => return vec![format!("{kind} auto n={count}: {e}")],
    };
    let spec = *op.spec();
    let p = spec.world;
    let seeds = [21u64, 22, 23];
    let name = format!("{kind} {:?} n={count} {} {reduce:?}", op.algo(), T::DTYPE);
    let outs: Vec<Result<Vec<Vec<T>>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..p)
            .map(|r| {
                let op = &op;
                s.spawn(move || -> Result<Vec<Vec<T>>, String> {
                    let gpu = backend.gpu(r);
                    gpu.bind().map_err(|e| e.to_string())?;
                    let stream = Stream::new(gpu).map_err(|e| e.to_string())?;
                    let inputs: Vec<DeviceMemory> = seeds
                        .iter()
                        .map(|&seed| {
                            let mut x = vec![T::from_f32(0.0); spec.input_len(r).max(1)];
                            fill_input(seed, r, reduce, T::host_mut(&mut x[..spec.input_len(r)]));
                            upload(gpu, &x)
                        })
                        .collect();
                    let out_bytes = spec.output_len(r) * T::DTYPE.size();
                    let outputs: Vec<DeviceMemory> = seeds
                        .iter()
                        .map(|_| DeviceMemory::zeroed(gpu, out_bytes.max(16)).unwrap())
                        .collect();
                    if late.contains(&r) {
                        std::thread::sleep(LATE);
                    }
                    for (input, output) in inputs.iter().zip(&outputs) {
                        // SAFETY: the buffers live until the synchronisation below
                        unsafe {
                            stream.fill_async(output.addr(), 0xff, out_bytes).unwrap();
                            op.forward(r, &stream, input.addr(), output.addr())
                                .map_err(|e| e.to_string())?;
                        }
                    }
                    stream.synchronize().map_err(|e| e.to_string())?;
                    Ok(outputs
                        .iter()
                        .map(|o| {
                            let mut h = vec![T::from_f32(0.0); spec.output_len(r).max(1)];
                            o.download(gpu, &mut h).unwrap();
                            h.truncate(spec.output_len(r));
                            h
                        })
                        .collect())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if let Err(e) = op.check() {
        return vec![format!("{name}: {e}")];
    }
    let outs: Vec<Vec<Vec<T>>> = match outs.into_iter().collect() {
        Ok(o) => o,
        Err(e) => return vec![format!("{name}: {e}")],
    };
    let mut failures = Vec::new();
    for (c, &seed) in seeds.iter().enumerate() {
        let slices: Vec<_> = outs.iter().map(|o| T::host(&o[c])).collect();
        let cmp = compare(&spec, reduce, seed, &slices);
        if !cmp.ok() {
            failures.push(format!(
                "{name} call {c}: {} wrong of {}",
                cmp.wrong, cmp.checked
            ));
        }
    }
    failures
}

#[test]
fn every_op_and_algorithm_matches_the_reference_back_to_back() {
    if gpus(2).is_none() {
        return;
    }
    let backend = CudaBackend::open(&[0, 1], Duration::from_secs(5)).unwrap();
    let mut failures = Vec::new();
    let kinds = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::AllToAll,
    ];
    for kind in kinds {
        for count in [1, 7, 1 << 20] {
            let algos = Algo::for_op(kind).iter().map(|&a| Some(a)).chain([None]);
            for algo in algos {
                let sum = calls::<f32>(&backend, kind, count, algo, ReduceOp::Sum, &[]);
                failures.extend(sum);
                let max = calls::<bf16>(&backend, kind, count, algo, ReduceOp::Max, &[]);
                failures.extend(max);
            }
        }
    }
    // algorithms that cannot run on this world say why (BackendError::NotForWorld)
    for skipped in failures.iter().filter(|f| f.starts_with("skip:")) {
        eprintln!("{skipped}");
    }
    failures.retain(|f| !f.starts_with("skip:"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A rank whose chunk is empty (fewer elements than ranks) sends nothing of its own, yet its
/// peers must still wait for it in every call: the LL protocol keeps two calls' lines apart
/// only because no rank can finish call n + 1 before every peer has begun it. Were the empty
/// rank's line left out, the rank that receives nothing from it could run three calls while it
/// is late, overwrite the buffer half of the first call with the third's lines, and leave the
/// late rank waiting for a number that never comes (the device timeout, 5 s). Here the all-gather
/// of one element over two ranks (rank 1's chunk empty) and the reduce-scatter of two over
/// three (rank 2's), by `auto` (the LL kernel), with the rank that has something to wait for
/// queuing its three calls 300 ms late; every output checked.
#[test]
fn a_rank_with_an_empty_chunk_keeps_its_peers_in_step() {
    let cases = [
        (OpKind::AllGather, 2usize, 1usize, &[1usize][..]),
        (OpKind::ReduceScatter, 3, 2, &[0, 1][..]),
    ];
    let mut failures = Vec::new();
    let mut ran = false;
    for (kind, p, count, late) in cases {
        let Some(devices) = ranks_on_gpus(p) else {
            continue;
        };
        ran = true;
        let backend = CudaBackend::open(&devices, Duration::from_secs(5)).unwrap();
        let options = (None, ReduceOp::Sum, 0, 1);
        let op = CudaCollective::new(&backend, kind, count, commfuse_core::DType::F32, options);
        assert_eq!(op.unwrap().implementation(), "ll", "{kind} n={count} P={p}");
        let got = calls::<f32>(&backend, kind, count, None, ReduceOp::Sum, late);
        failures.extend(
            got.into_iter()
                .map(|e| format!("P={p} on {devices:?}: {e}")),
        );
    }
    if !ran {
        return skip(&format!("needs 2 GPUs, or {SHARE_GPUS}=1"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `calls` all-reduces (f32 sums, `auto`) queued back to back on every rank, each reading what
/// the one before wrote (ping-pong between two buffers, or in place): every rank must end with
/// P^(calls - 1) times the sum of the inputs, exactly (small integers). A call's kernel that read its
/// input, or its call number, before the previous call's kernel had finished — launched
/// programmatically, the LL kernel may start early and must wait for it on the GPU — would see
/// the older values. Runs on the GPUs there are, ranks sharing them if fewer than P; the host
/// does nothing synchronous while kernels run (as the bench's batches), and waits at most 20 s
/// for them.
#[test]
fn chained_all_reduces_read_what_the_call_before_wrote() {
    const CALLS: usize = 6;
    let mut failures = Vec::new();
    let mut ran = false;
    for p in [2usize, 3] {
        let Some(devices) = ranks_on_gpus(p) else {
            continue;
        };
        ran = true;
        let backend = CudaBackend::open(&devices, Duration::from_secs(5)).unwrap();
        'cases: for count in [1usize, 1001, 65_537, 1 << 18] {
            for in_place in [false, true] {
                let what = format!("P={p} n={count} in_place={in_place} on {devices:?}");
                let op = match CudaCollective::new(
                    &backend,
                    OpKind::AllReduce,
                    count,
                    commfuse_core::DType::F32,
                    (None, ReduceOp::Sum, 0, 1),
                ) {
                    Ok(op) => op,
                    // after a failed call the backend refuses new operators: go on to the
                    // next world with a fresh one
                    Err(e) => {
                        failures.push(format!("{what}: {e}"));
                        break 'cases;
                    }
                };
                let name = format!("{} {what}", op.implementation());
                failures.extend(
                    chain(&backend, &op, CALLS, in_place)
                        .into_iter()
                        .map(|e| format!("{name}: {e}")),
                );
            }
        }
    }
    if !ran {
        return skip(&format!("needs 2 GPUs, or {SHARE_GPUS}=1"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Runs `calls` chained calls of the all-reduce `op` (f32 sums) on every rank; what went wrong.
fn chain(backend: &CudaBackend, op: &CudaCollective, calls: usize, in_place: bool) -> Vec<String> {
    let (p, count) = (op.spec().world, op.spec().count);
    // rank r's input: small integers, different on every rank
    let input = |r: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((i * 7 + r * 3) % 7) as f32 - 3.0)
            .collect()
    };
    // everything a rank needs, made before any rank launches
    let ranks: Vec<_> = (0..p)
        .map(|r| {
            let gpu = backend.gpu(r);
            let bufs = [upload(gpu, &input(r)), upload(gpu, &vec![0f32; count])];
            (
                Stream::new(gpu).unwrap(),
                Event::new_untimed(gpu).unwrap(),
                bufs,
            )
        })
        .collect();
    let queued: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, (stream, done, bufs))| {
                s.spawn(move || -> Result<(), String> {
                    backend.gpu(r).bind().map_err(|e| e.to_string())?;
                    for c in 0..calls {
                        let (from, to) = if in_place {
                            (0, 0)
                        } else {
                            (c % 2, (c + 1) % 2)
                        };
                        // SAFETY: both buffers outlive the calls (waited for below)
                        unsafe { op.forward(r, stream, bufs[from].addr(), bufs[to].addr()) }
                            .map_err(|e| e.to_string())?;
                    }
                    done.record(stream).map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (_, done, _)) in ranks.iter().enumerate() {
        let finished = poll_until(Duration::from_secs(20), || done.is_done());
        if !matches!(finished, Ok(true)) {
            // a kernel still runs: leak what it may touch rather than free it under it
            std::mem::forget(ranks);
            panic!("rank {r}'s chained calls did not finish within 20 s: {finished:?}");
        }
    }
    let mut failures: Vec<String> = queued.into_iter().filter_map(Result::err).collect();
    if let Err(e) = op.check() {
        failures.push(e.to_string());
    }
    if !failures.is_empty() {
        return failures;
    }
    // the first call sums the P inputs, every later one multiplies that by P
    let scale = (p as f32).powi(calls as i32 - 1);
    let inputs: Vec<Vec<f32>> = (0..p).map(input).collect();
    let want: Vec<f32> = (0..count)
        .map(|i| scale * inputs.iter().map(|x| x[i]).sum::<f32>())
        .collect();
    let last = if in_place { 0 } else { calls % 2 };
    for (r, (_, _, bufs)) in ranks.iter().enumerate() {
        let mut h = vec![0f32; count];
        bufs[last].download(backend.gpu(r), &mut h).unwrap();
        if let Some(i) = h.iter().zip(&want).position(|(a, b)| a != b) {
            let wrong = h.iter().zip(&want).filter(|(a, b)| a != b).count();
            failures.push(format!(
                "rank {r}: {wrong} of {count} wrong, first at {i}: {} (want {})",
                h[i], want[i]
            ));
        }
    }
    failures
}

/// Tensor views may start one 2-byte element into a 4-byte word (PyTorch's `x[1:]`): a bf16
/// all-reduce that `auto` gives to the LL kernel, on an input and an output both 2 bytes past
/// an allocation's start, must read and write exactly those elements (and not fault on a
/// misaligned word). Ranks share the GPUs where there are fewer than two.
#[test]
fn a_bf16_all_reduce_on_views_one_element_into_a_word() {
    let Some(devices) = ranks_on_gpus(2) else {
        return skip(&format!("needs 2 GPUs, or {SHARE_GPUS}=1"));
    };
    let backend = CudaBackend::open(&devices, Duration::from_secs(5)).unwrap();
    let count = 1001;
    let op = CudaCollective::new(
        &backend,
        OpKind::AllReduce,
        count,
        commfuse_core::DType::BF16,
        (None, ReduceOp::Sum, 0, 1),
    )
    .unwrap();
    assert_eq!(op.implementation(), "ll");
    let input = |r: usize| -> Vec<bf16> {
        (0..=count)
            .map(|i| bf16::from_f32(((i * 5 + r) % 7) as f32 - 3.0))
            .collect()
    };
    // element 0 of each allocation lies outside the view: it must come back unchanged
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let gpu = backend.gpu(r);
            let out = upload(gpu, &vec![bf16::from_f32(99.0); count + 1]);
            (Stream::new(gpu).unwrap(), upload(gpu, &input(r)), out)
        })
        .collect();
    std::thread::scope(|s| {
        for (r, (stream, x, y)) in ranks.iter().enumerate() {
            let (op, backend) = (&op, &backend);
            s.spawn(move || {
                backend.gpu(r).bind().unwrap();
                // SAFETY: both allocations hold count + 1 elements and live past the sync
                unsafe { op.forward(r, stream, x.addr() + 2, y.addr() + 2) }.unwrap();
            });
        }
    });
    for (r, (stream, _, y)) in ranks.iter().enumerate() {
        let done = Event::new_untimed(backend.gpu(r)).unwrap();
        done.record(stream).unwrap();
        let finished = poll_until(Duration::from_secs(60), || done.is_done());
        assert!(matches!(finished, Ok(true)), "rank {r}: {finished:?}");
        op.check().unwrap();
        let mut h = vec![bf16::ZERO; count + 1];
        y.download(backend.gpu(r), &mut h).unwrap();
        assert_eq!(
            h[0].to_f32(),
            99.0,
            "rank {r}: the element before the view was written"
        );
        let (x0, x1) = (input(0), input(1));
        for (i, got) in h.iter().enumerate().skip(1) {
            let want = x0[i].to_f32() + x1[i].to_f32();
            assert_eq!(
                got.to_f32(),
                want,
                "rank {r}, element {} of the view",
                i - 1
            );
        }
    }
}
