//! `commfuse bench gemm`: our GEMM beside cuBLASLt on one GPU (same inputs, same run), at all
//! SMs and capped, plus our GEMM with its epilogue storing every tile to a peer GPU; timed with
//! events (warm-up, median), each row checked against a float64 reference on sampled elements
//! of fresh random inputs with the output poisoned first.

use crate::cublaslt::Lt;
use crate::driver::{DeviceMemory, Event, Gpu, Stream};
use crate::error::CudaError;
use crate::gemm::{GemmKernels, GemmOperands, PreparedGemm, RouteTargets, TILE};
use commfuse_core::gemm::{
    grouped_order, reference_dot, Destination, Epilogue, GemmPlan, GemmProblem, TileFlag,
};
use commfuse_core::plan::{NotifyOp, Slot};
use commfuse_core::{DType, Element};
use half::{bf16, f16};

#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmRow {
    pub implementation: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub sms: u32,
    pub time_ms: f64,
    pub tflops: f64,
    /// Relative Frobenius error over the sampled elements
    pub error: f64,
}

fn random_bits(seed: u64, i: usize) -> f32 {
    let mut x = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

fn upload_random<T: Element>(
    gpu: &Gpu,
    len: usize,
    seed: u64,
) -> Result<(DeviceMemory, Vec<T>), CudaError> {
    let host: Vec<T> = (0..len)
        .map(|i| T::from_f32(random_bits(seed, i)))
        .collect();
    let mem = DeviceMemory::zeroed(gpu, len * std::mem::size_of::<T>())?;
    mem.upload(gpu, &host)?;
    Ok((mem, host))
}

/// Times cuBLASLt and our kernel on `problem` (bf16 or f16 inputs) for each SM cap in `sms`
/// (0 = all SMs), on the same inputs in the same run; with `peer`, also our kernel with every
/// tile stored into a buffer on that GPU and a flag raised there per tile.
pub fn bench_gemm(
    device: usize,
    peer: Option<usize>,
    problem: &GemmProblem,
    sms: &[u32],
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<Vec<GemmRow>, CudaError> {
    match problem.input {
        DType::BF16 => run::<bf16>(device, peer, problem, sms, warmup, iters, seed),
        DType::F16 => run::<f16>(device, peer, problem, sms, warmup, iters, seed),
        DType::F32 => Err(CudaError::Unavailable("GEMM inputs are bf16 or f16".into())),
    }
}

/// Median time of one launch in ms (events around each of `iters` launches after `warmup`).
fn median_ms(
    gpu: &Gpu,
    stream: &Stream,
    warmup: usize,
    iters: usize,
    launch: &mut dyn FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    for _ in 0..warmup.max(1) {
        launch()?;
    }
    let events: Vec<Event> = (0..=iters.max(1))
        .map(|_| Event::new(gpu))
        .collect::<Result<_, _>>()?;
    events[0].record(stream)?;
    for e in &events[1..] {
        launch()?;
        e.record(stream)?;
    }
    stream.synchronize()?;
    let mut times: Vec<f64> = events
        .windows(2)
        .map(|w| w[0].elapsed_ms(&w[1]).map(|t| t as f64))
        .collect::<Result<_, _>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The tile order of every benchmark row of our kernel.
pub const ORDER_GROUP: usize = 8;

#[allow(clippy::too_many_arguments)]
fn run<T: Element>(
    device: usize,
    peer: Option<usize>,
    p: &GemmProblem,
    sms: &[u32],
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<Vec<GemmRow>, CudaError> {
    let gpu = Gpu::open(device)?;
    let stream = Stream::new(&gpu)?;
    let lt = Lt::new(&gpu)?;
    let (a_dev, a) = upload_random::<T>(&gpu, p.m * p.k, seed)?;
    let (b_dev, b) = upload_random::<T>(&gpu, p.k * p.n, seed ^ 1)?;
    let out_bytes = p.m * p.n * p.output.size();
    let d_dev = DeviceMemory::zeroed(&gpu, out_bytes)?;
    let row = |implementation: &str, cap: u32, time_ms: f64, error: f64| GemmRow {
        implementation: implementation.into(),
        m: p.m,
        n: p.n,
        k: p.k,
        sms: cap,
        time_ms,
        tflops: p.flops() / (time_ms * 1e-3) / 1e12,
        error,
    };
    let mut rows = Vec::new();
    for &cap in sms {
        // poison D so that an element the GEMM skipped fails the check
        d_dev.fill(&gpu, 0xff)?;
        let time = median_ms(&gpu, &stream, warmup, iters, &mut || {
            // SAFETY: operands sized from the problem on this GPU
            unsafe {
                lt.matmul(
                    &stream,
                    p,
                    cap,
                    a_dev.addr(),
                    b_dev.addr(),
                    d_dev.addr(),
                    1.0,
                    0.0,
                )
            }
        })?;
        rows.push(row(
            "cublaslt",
            cap,
            time,
            sampled_error(&gpu, p, &a, &b, &d_dev, seed)?,
        ));
    }

    let kernels = GemmKernels::load(&gpu)?;
    let mut plan = GemmPlan::local(*p, TILE, Epilogue::default());
    plan.order = grouped_order(p, TILE, ORDER_GROUP);
    let ops = GemmOperands {
        a: a_dev.addr(),
        b: b_dev.addr(),
        c: None,
        bias: None,
        d: d_dev.addr(),
    };
    for &cap in sms {
        let gemm = PreparedGemm::new(&gpu, &kernels, &plan, &ops, None, cap, 0)?;
        d_dev.fill(&gpu, 0xff)?;
        let time = median_ms(&gpu, &stream, warmup, iters, &mut || {
            // SAFETY: operands sized from the problem on this GPU
            unsafe { gemm.launch(&stream) }
        })
        .map_err(|e| with_stall_report(e, &gemm))?;
        rows.push(row(
            "commfuse",
            cap,
            time,
            sampled_error(&gpu, p, &a, &b, &d_dev, seed)?,
        ));
    }

    if let Some(peer) = peer {
        // every tile into the peer GPU's buffer, then an Add of 1 on its flag there
        let peer_gpu = Gpu::open(peer)?;
        gpu.enable_peer_access(&peer_gpu)?;
        let d_peer = DeviceMemory::zeroed(&peer_gpu, out_bytes)?;
        let flags = DeviceMemory::zeroed(&peer_gpu, 8 * plan.tile_count())?;
        let mut remote = plan.clone();
        remote.destinations = Some(
            (0..plan.tile_count())
                .map(|t| Destination {
                    rank: 1,
                    ..plan.destination(t, 0)
                })
                .collect(),
        );
        remote.flags = Some(
            (0..plan.tile_count())
                .map(|t| TileFlag {
                    slot: Slot::new(0, t as u32),
                    value: 1,
                    op: NotifyOp::Add,
                })
                .collect(),
        );
        let outputs = [d_dev.addr(), d_peer.addr()];
        let flag = |_rank: usize, slot: Slot| flags.addr() + 8 * slot.col as u64;
        let targets = RouteTargets {
            outputs: &outputs,
            flag: &flag,
        };
        let gemm = PreparedGemm::new(&gpu, &kernels, &remote, &ops, Some(&targets), 0, 0)?;
        d_peer.fill(&peer_gpu, 0xff)?;
        let time = median_ms(&gpu, &stream, warmup, iters, &mut || {
            // SAFETY: operands on this GPU, destinations and flags on the peer, peer access on
            unsafe { gemm.launch(&stream) }
        })
        .map_err(|e| with_stall_report(e, &gemm))?;
        let error = sampled_error(&peer_gpu, p, &a, &b, &d_peer, seed)?;
        rows.push(row("commfuse-peer", 0, time, error));
    }
    Ok(rows)
}

fn with_stall_report(e: CudaError, gemm: &PreparedGemm) -> CudaError {
    match gemm.stall_report() {
        Some(report) => CudaError::Unavailable(format!("{e}; {report}")),
        None => e,
    }
}

/// Relative Frobenius error of D against a float64 reference on a few thousand sampled
/// elements (a full reference of a 4096×12288×24576 product would take the CPU minutes).
fn sampled_error<T: Element>(
    gpu: &Gpu,
    p: &GemmProblem,
    a: &[T],
    b: &[T],
    d_dev: &DeviceMemory,
    seed: u64,
) -> Result<f64, CudaError> {
    let d: Vec<f64> = match p.output {
        DType::F32 => {
            let mut h = vec![0f32; p.m * p.n];
            d_dev.download(gpu, &mut h)?;
            h.iter().map(|&x| x as f64).collect()
        }
        DType::BF16 => {
            let mut h = vec![bf16::ZERO; p.m * p.n];
            d_dev.download(gpu, &mut h)?;
            h.iter().map(|x| x.to_f64()).collect()
        }
        DType::F16 => {
            let mut h = vec![f16::ZERO; p.m * p.n];
            d_dev.download(gpu, &mut h)?;
            h.iter().map(|x| x.to_f64()).collect()
        }
    };
    let (mut num, mut den) = (0f64, 0f64);
    let samples = 4096.min(p.m * p.n);
    for s in 0..samples {
        let idx =
            (random_bits(seed ^ 7, s).abs() as f64 * (p.m * p.n) as f64) as usize % (p.m * p.n);
        let acc = reference_dot(p, a, b, idx / p.n, idx % p.n);
        // NaN (an unwritten, poisoned element) makes the error NaN, which never passes
        num += (d[idx] - acc).powi(2);
        den += acc * acc;
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}
