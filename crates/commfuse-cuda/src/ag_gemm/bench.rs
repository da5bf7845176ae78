//! `commfuse bench ag-gemm`: all-gather + GEMM on P GPUs (rank r on `devices[r]`, one host
//! thread each) with the baselines in the same run: cuBLASLt alone on the gathered A (the GEMM
//! every path must do), our GEMM alone on it (what the fused path's GEMM costs without waiting),
//! NCCL's all-gather then cuBLASLt (the unfused path), and ours overlapped and fused with each
//! piece count asked for. Rows interleaved in rounds, a call's time its slowest
//! rank's ([`crate::rank_bench`]). Our rows are checked on every output element of every rank
//! against a float64 reference computed on the GPUs (gemm/reference_gemm.cu) after timing.

use crate::ag_gemm::{AgGemmConfig, AgGemmRank};
use crate::error::CudaError;
use crate::gemm::bench::ReferenceGemm;
use crate::gemm::{GemmKernels, GemmOperands, PreparedGemm, TILE};
use crate::rank_bench::{download, interleaved, row, timed, upload, FusedRow, RankStream};
use crate::sys::cublaslt::Lt;
use crate::sys::driver::{open_group, DeviceMemory, Gpu, Stream};
use crate::sys::nccl::Comms;
use commfuse_core::fused::ag_gemm::AgGemmShape;
use commfuse_core::gemm::{check_elements, grouped_order, Epilogue, GemmPlan, ReferenceElement};
use commfuse_core::reference::input_value;
use commfuse_core::{DType, Element, ReduceOp};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// What to measure.
#[derive(Debug, Clone)]
pub struct AgGemmBenchConfig {
    pub devices: Vec<usize>,
    pub shape: AgGemmShape,
    pub bias: bool,
    /// One row each: the row pieces a chunk is handed on in
    pub pieces: Vec<usize>,
    pub warmup: usize,
    pub iters: usize,
    pub seed: u64,
}

/// One rank's buffers.
struct RankData {
    gpu: Arc<Gpu>,
    stream: Stream,
    lt: Lt,
    /// This rank's chunk of A
    a: DeviceMemory,
    /// The whole gathered A (for cuBLASLt alone and the reference)
    a_full: DeviceMemory,
    /// Where NCCL's all-gather lands
    gathered: DeviceMemory,
    b: DeviceMemory,
    bias: Option<DeviceMemory>,
    /// [M, N]
    out: DeviceMemory,
}

impl RankStream for RankData {
    fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    fn stream(&self) -> &Stream {
        &self.stream
    }
}

type Launch<'a> = crate::rank_bench::Launch<'a, RankData>;

/// Times every row; returns them in the order cuBLASLt, NCCL + cuBLASLt, ours….
pub fn bench_ag_gemm(cfg: &AgGemmBenchConfig) -> Result<Vec<FusedRow>, CudaError> {
    match cfg.shape.input {
        DType::BF16 => run::<bf16>(cfg),
        DType::F16 => run::<f16>(cfg),
        DType::F32 => Err(CudaError::Unavailable("GEMM inputs are bf16 or f16".into())),
    }
}

fn random<T: Element>(len: usize, seed: u64, stream: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f32(input_value(seed, stream, i, ReduceOp::Sum)))
        .collect()
}

fn run<T: Element + bytemuck::Pod>(cfg: &AgGemmBenchConfig) -> Result<Vec<FusedRow>, CudaError> {
    let s = cfg.shape;
    let world = cfg.devices.len();
    if world != s.world {
        return Err(CudaError::Unavailable(format!(
            "the shape is for {} ranks, {world} devices given",
            s.world
        )));
    }
    let gpus = open_group(&cfg.devices)?;
    let problem = s.problem();
    let full: Vec<T> = random(s.m * s.k, cfg.seed, 0);
    let mut ranks = Vec::with_capacity(world);
    for (r, gpu) in gpus.iter().enumerate() {
        let chunk = s.chunk(r);
        let bias = match (cfg.bias, s.output) {
            (false, _) => None,
            (true, DType::F32) => Some(upload(gpu, &random::<f32>(s.n, cfg.seed, 99))?),
            (true, DType::BF16) => Some(upload(gpu, &random::<bf16>(s.n, cfg.seed, 99))?),
            (true, DType::F16) => Some(upload(gpu, &random::<f16>(s.n, cfg.seed, 99))?),
        };
        ranks.push(RankData {
            stream: Stream::new(gpu)?,
            lt: Lt::new(gpu)?,
            a: upload(gpu, &full[chunk.start * s.k..chunk.end * s.k])?,
            a_full: upload(gpu, &full)?,
            gathered: DeviceMemory::zeroed(gpu, s.m * s.k * s.input.size())?,
            b: upload(gpu, &random::<T>(s.k * s.n, cfg.seed, 1 + r))?,
            bias,
            out: DeviceMemory::zeroed(gpu, s.m * s.n * s.output.size())?,
            gpu: gpu.clone(),
        });
    }
    // NCCL gathers equal chunks only
    let comms = if s.m.is_multiple_of(world) {
        let devs: Vec<i32> = cfg.devices.iter().map(|&d| d as i32).collect();
        Some(Comms::for_devices(&devs))
    } else {
        None
    };
    let mut ours: Vec<(String, Vec<Mutex<AgGemmRank>>)> = Vec::new();
    // the overlapped rows, then the fused ones (our GEMM waiting per row band)
    for fused in [false, true] {
        for &pieces in &cfg.pieces {
            let mut c = AgGemmConfig::new(s.m, s.n, s.k, s.b_layout, s.input, s.output);
            c.bias = cfg.bias;
            c.pieces = pieces;
            c.fused = fused;
            let ops = AgGemmRank::create_group(&gpus, c)?;
            let path = if fused { "fused" } else { "overlapped" };
            let name = format!("commfuse-{path} ({pieces})");
            ours.push((name, ops.into_iter().map(Mutex::new).collect()));
        }
    }

    // our GEMM alone on the gathered A, all SMs but the one the fused path leaves free
    let epilogue = Epilogue {
        bias: cfg.bias,
        ..Epilogue::default()
    };
    let mut plan = GemmPlan::local(problem, TILE, epilogue);
    plan.order = grouped_order(&problem, TILE, commfuse_core::fused::gemm_rs::ORDER_GROUP);
    let our_gemms: Vec<PreparedGemm> = ranks
        .iter()
        .map(|d| {
            let kernels = GemmKernels::load(&d.gpu)?;
            let ops = GemmOperands {
                a: d.a_full.addr(),
                b: d.b.addr(),
                c: None,
                bias: d.bias.as_ref().map(|b| b.addr()),
                d: d.out.addr(),
            };
            let cap = d.gpu.sm_count.saturating_sub(1).max(1);
            PreparedGemm::new(&d.gpu, &kernels, &plan, &ops, None, cap, 0)
        })
        .collect::<Result<_, _>>()?;
    let our_gemms = &our_gemms;
    let p = &problem;
    // SAFETY (of every use): operands sized from the problem on this rank's GPU
    let lt_gemm = move |d: &RankData, a: u64| unsafe {
        let bias = d.bias.as_ref().map(|b| b.addr());
        let operands = (a, d.b.addr(), d.out.addr(), d.out.addr());
        d.lt.matmul_into(&d.stream, p, 0, operands, bias, 1.0, 0.0)
    };
    let mut names: Vec<String> = vec!["cublaslt".into(), "commfuse-gemm".into()];
    let mut launches: Vec<Launch<'_>> = vec![
        Box::new(move |_, d: &RankData| lt_gemm(d, d.a_full.addr())),
        // SAFETY: prepared on this rank's operands, which outlive the bench
        Box::new(move |r, d: &RankData| unsafe { our_gemms[r].launch(&d.stream) }),
    ];
    match &comms {
        Some(Ok(comms)) => {
            names.push("nccl+cublaslt".into());
            let count = s.m / world * s.k;
            let dt = s.input;
            launches.push(Box::new(move |r, d: &RankData| {
                // SAFETY: the chunk and the gathered buffer are sized from the shape
                unsafe { comms.all_gather_raw(r, d.a.addr(), d.gathered.addr(), count, dt, &d.stream)? };
                lt_gemm(d, d.gathered.addr())
            }));
        }
        Some(Err(e)) => eprintln!("# baseline not run: nccl+cublaslt: {e}"),
        None => eprintln!(
            "# baseline not run: nccl+cublaslt: NCCL's all-gather needs M divisible by P ({} by {world})",
            s.m
        ),
    }
    let first_ours = names.len();
    for (name, ops) in &ours {
        names.push(name.clone());
        launches.push(Box::new(move |r, d: &RankData| {
            let mut op = ops[r].lock().unwrap();
            let operands = (d.a.addr(), d.b.addr(), d.bias.as_ref().map(|b| b.addr()));
            // SAFETY: operands on this rank's GPU, the output sized [M, N]
            unsafe { op.forward(&d.stream, s.m, operands, d.out.addr(), None) }
        }));
    }
    let round_medians = interleaved(&ranks, &launches, cfg.warmup, cfg.iters)?;
    for (_, ops) in &ours {
        for op in ops {
            op.lock().unwrap().check()?;
        }
    }

    // the reference: each rank's product of the gathered A on its GPU in float64
    let mut want: Vec<Vec<ReferenceElement>> = Vec::with_capacity(world);
    for d in &ranks {
        let reference = ReferenceGemm::load(&d.gpu)?;
        // SAFETY: the gathered A and B hold the problem's operands on this GPU
        let rf = unsafe { reference.compute(&d.gpu, &d.stream, p, d.a_full.addr(), d.b.addr())? };
        let bias = d
            .bias
            .as_ref()
            .map(|b| download(&d.gpu, b, s.output, s.n))
            .transpose()?;
        want.push(
            rf.value
                .iter()
                .zip(&rf.abs_products)
                .enumerate()
                .map(|(i, (&v, &abs))| {
                    let bias_j = bias.as_ref().map_or(0.0, |b| b[i % s.n]);
                    ReferenceElement {
                        value: v + bias_j,
                        abs_products: abs as f64,
                        abs_terms: v.abs() + bias_j.abs(),
                    }
                })
                .collect(),
        );
    }
    let mut rows = Vec::new();
    for (v, name) in names.iter().enumerate() {
        let mut r = row(name, (s.m, s.n, s.k, world), p.flops(), &round_medians[v]);
        if v >= first_ours {
            // one more call on a poisoned output, then every element of every rank
            for d in &ranks {
                d.out.fill(&d.gpu, 0xff)?;
            }
            timed(&ranks, &launches[v], 0, 1)?;
            for (q, d) in ranks.iter().enumerate() {
                let got = download(&d.gpu, &d.out, s.output, s.m * s.n)?;
                let check = check_elements(p, &epilogue, got, &want[q]);
                r.checked += check.checked;
                r.out_of_bound += check.out_of_bound;
                r.worst_ratio = r.worst_ratio.max(check.worst_ratio);
            }
        }
        rows.push(r);
    }
    Ok(rows)
}
