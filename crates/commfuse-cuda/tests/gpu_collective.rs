//! Collectives as operator objects on GPUs (`CudaCollective`): every op, every algorithm and
//! `auto`, f32 and bf16, three calls queued back to back on each rank's own stream over its own
//! device buffers (outputs poisoned by the stream before each), every output element of every
//! call against the float64 reference. Skips with a printed reason without two GPUs (a failure
//! under COMMFUSE_REQUIRE_GPU=1).

use commfuse_core::reference::{compare, fill_input};
use commfuse_core::{Algo, Element, OpKind, ReduceOp};
use commfuse_cuda::backend::CudaBackend;
use commfuse_cuda::collective::CudaCollective;
use commfuse_cuda::driver::{DeviceMemory, Stream};
use commfuse_cuda::testing::{gpus, upload};
use half::bf16;
use std::time::Duration;

/// Three back-to-back calls; the failures.
fn calls<T: Element + bytemuck::Pod>(
    backend: &CudaBackend,
    kind: OpKind,
    count: usize,
    algo: Option<Algo>,
    reduce: ReduceOp,
) -> Vec<String> {
    let options = (algo, reduce, 0, 1);
    let op = match CudaCollective::new(backend, kind, count, T::DTYPE, options) {
        Ok(op) => op,
        Err(e) if algo.is_some() => return vec![format!("skip: {e}")],
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
                failures.extend(calls::<f32>(&backend, kind, count, algo, ReduceOp::Sum));
                failures.extend(calls::<bf16>(&backend, kind, count, algo, ReduceOp::Max));
            }
        }
    }
    // algorithms that cannot run on this world say why (e.g. a 2D ring needs its groups)
    for skipped in failures.iter().filter(|f| f.starts_with("skip:")) {
        eprintln!("{skipped}");
    }
    failures.retain(|f| !f.starts_with("skip:"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
