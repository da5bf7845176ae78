//! Where the host time of one GEMM operator call goes on one GPU (a group of one), at the
//! decode shapes M × 8192 × 3584 (bf16, B as [N, K]): the all-gather + GEMM's `forward` (one
//! cuBLASLt call per piece), the GEMM + reduce-scatter's fused `forward` (our own kernel),
//! `Lt::matmul_into` alone (every cuBLASLt candidate's GPU and host time while choosing beside
//! it), `cublasGemmEx` as PyTorch's `torch.matmul` calls it, and the driver calls every
//! operator call makes. Host time: back-to-back calls, 100 per batch with the stream drained
//! between batches, the median of 7 rounds of 10 batches.
//!
//! ```text
//! cargo run --release -p commfuse-cuda --example host_parts [-- M...]   (default: 16 128)
//! ```
//! (on the GPU machine: `LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64`).

use commfuse_core::fused::gemm_rs::{GemmRsPath, PathChoice};
use commfuse_core::gemm::{BLayout, GemmProblem};
use commfuse_core::DType;
use commfuse_cuda::ag_gemm::{AgGemmConfig, AgGemmRank};
use commfuse_cuda::gemm_rs::{GemmRsConfig, GemmRsRank};
use commfuse_cuda::sys::cublaslt::Lt;
use commfuse_cuda::sys::driver::{device_count, DeviceMemory, Event, Gpu, Stream};
use cudarc::cublas::sys as cublas;
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

const N: usize = 8192;
const K: usize = 3584;

/// The median host time per call of `call`, in µs.
fn host_us(stream: &Stream, mut call: impl FnMut()) -> Result<f64, Box<dyn Error>> {
    let mut rounds = vec![];
    for _ in 0..7 {
        let mut took = 0.0;
        for _ in 0..10 {
            stream.synchronize()?;
            let start = Instant::now();
            for _ in 0..100 {
                call();
            }
            took += start.elapsed().as_secs_f64();
        }
        rounds.push(took / 1000.0 * 1e6);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[3])
}

/// The median GPU time per call of `call` queued 20 times back to back, in µs.
fn gpu_us(gpu: &Gpu, stream: &Stream, mut call: impl FnMut()) -> Result<f64, Box<dyn Error>> {
    let (start, end) = (Event::new(gpu)?, Event::new(gpu)?);
    let mut rounds = vec![];
    for _ in 0..9 {
        start.record(stream)?;
        for _ in 0..20 {
            call();
        }
        end.record(stream)?;
        stream.synchronize()?;
        rounds.push(f64::from(start.elapsed_ms(&end)?) * 1e3 / 20.0);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[4])
}

/// cuBLAS's plain GEMM on `stream`: D [m, N] = A [m, K] · B [N, K]ᵀ in bf16, as
/// `torch.matmul(a, w.t())` calls it (the default algorithm, tensor ops).
struct CublasGemm {
    handle: cublas::cublasHandle_t,
    _workspace: DeviceMemory,
}

impl CublasGemm {
    fn new(gpu: &Gpu, stream: &Stream) -> Result<CublasGemm, Box<dyn Error>> {
        let workspace = DeviceMemory::zeroed(gpu, 32 << 20)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-parameter; the stream and workspace outlive the handle's calls
        unsafe {
            ok(cublas::cublasCreate_v2(&mut handle))?;
            ok(cublas::cublasSetStream_v2(handle, stream.raw() as _))?;
            ok(cublas::cublasSetWorkspace_v2(
                handle,
                workspace.addr() as _,
                32 << 20,
            ))?;
        }
        Ok(CublasGemm {
            handle,
            _workspace: workspace,
        })
    }

    /// # Safety
    /// `a`, `b`, `d` hold the operands of an m × N × K product on this GPU.
    unsafe fn call(&self, m: usize, a: u64, b: u64, d: u64) {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = cublas::cudaDataType::CUDA_R_16BF;
        // column-major view: Dᵀ [N, m] = (B [N, K] as K × N)ᵀ · (A as K × m)
        let status = cublas::cublasGemmEx(
            self.handle,
            cublas::cublasOperation_t::CUBLAS_OP_T,
            cublas::cublasOperation_t::CUBLAS_OP_N,
            N as i32,
            m as i32,
            K as i32,
            &alpha as *const f32 as _,
            b as _,
            bf16,
            K as i32,
            a as _,
            bf16,
            K as i32,
            &beta as *const f32 as _,
            d as _,
            bf16,
            N as i32,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        );
        assert_eq!(status, cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
    }
}

impl Drop for CublasGemm {
    fn drop(&mut self) {
        // SAFETY: created here; the caller drained the stream
        unsafe {
            cublas::cublasDestroy_v2(self.handle);
        }
    }
}

fn ok(status: cublas::cublasStatus_t) -> Result<(), Box<dyn Error>> {
    if status == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuBLAS: {status:?}").into())
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let ms: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let ms = if ms.is_empty() { vec![16, 128] } else { ms };
    match device_count() {
        Ok(count) if count >= 1 => {}
        _ => {
            println!("no GPU here: nothing to measure");
            return Ok(());
        }
    }
    let gpu = Arc::new(Gpu::open(0)?);
    let stream = Stream::new(&gpu)?;
    let cublas = CublasGemm::new(&gpu, &stream)?;
    let row = |what: &str, us: f64, unit: &str| println!("{what:44} {us:8.2} µs {unit}");
    for m in ms {
        let a = DeviceMemory::zeroed(&gpu, m * K * 2)?;
        let b = DeviceMemory::zeroed(&gpu, N * K * 2)?;
        let d = DeviceMemory::zeroed(&gpu, m * N * 2)?;
        let (a, b, d) = (a.addr(), b.addr(), d.addr());
        println!("M × N × K = {m} × {N} × {K}");
        let config = AgGemmConfig::new(m, N, K, BLayout::NK, DType::BF16, DType::BF16);
        let mut ag = AgGemmRank::create_group(std::slice::from_ref(&gpu), config)?.remove(0);
        let mut config = GemmRsConfig::new(m, N, K, BLayout::NK, DType::BF16, DType::BF16);
        config.path = PathChoice::Always(GemmRsPath::Fused);
        let mut rs = GemmRsRank::create_group(std::slice::from_ref(&gpu), config)?.remove(0);
        let lt = Lt::new(&gpu)?;
        let problem = GemmProblem {
            m,
            n: N,
            k: K,
            b_layout: BLayout::NK,
            input: DType::BF16,
            output: DType::BF16,
        };
        // SAFETY (every call below): the operands are this GPU's buffers of the shape's sizes,
        // live until the stream is drained at the end of the shape
        let ag_call = || unsafe { ag.forward(&stream, m, (a, b, None), d, None).unwrap() };
        row(
            "all-gather + GEMM forward",
            host_us(&stream, ag_call)?,
            "host",
        );
        let rs_call = || unsafe { rs.forward(&stream, m, a, b, None, d).unwrap() };
        row(
            "GEMM + reduce-scatter forward (fused)",
            host_us(&stream, rs_call)?,
            "host",
        );
        let lt_call = || unsafe {
            lt.matmul_into(&stream, &problem, 0, (a, b, d, d), None, 1.0, 0.0)
                .unwrap()
        };
        row("Lt::matmul_into", host_us(&stream, lt_call)?, "host");
        let gemm_ex = || unsafe { cublas.call(m, a, b, d) };
        row("cublasGemmEx", host_us(&stream, gemm_ex)?, "host");
        row("Lt::matmul_into", gpu_us(&gpu, &stream, lt_call)?, "GPU");
        row("cublasGemmEx", gpu_us(&gpu, &stream, gemm_ex)?, "GPU");
        if let Some(c) = lt.choice(&problem, 0, false) {
            println!(
                "cuBLASLt's candidates while choosing (chosen: {}):",
                c.index
            );
            for t in lt.candidate_times(&problem, 0, false) {
                println!(
                    "  {:2}: {:8.2} µs GPU {:8.2} µs host",
                    t.index,
                    t.time_ms * 1e3,
                    t.host_us
                );
            }
        }
        let event = Event::new_untimed(&gpu)?;
        row(
            "cuCtxSetCurrent",
            host_us(&stream, || gpu.bind().unwrap())?,
            "host",
        );
        let capturing = || {
            stream.is_capturing().unwrap();
        };
        row("cuStreamIsCapturing", host_us(&stream, capturing)?, "host");
        let record = || event.record(&stream).unwrap();
        row("cuEventRecord", host_us(&stream, record)?, "host");
        let wait = || stream.wait_event(&event).unwrap();
        row("cuStreamWaitEvent", host_us(&stream, wait)?, "host");
        stream.synchronize()?;
    }
    Ok(())
}
