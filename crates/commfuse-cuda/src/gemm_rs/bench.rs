//! `commfuse bench gemm-rs`: GEMM + reduce-scatter on P GPUs (rank r on `devices[r]`, one host
//! thread each), with the baselines in the same run: cuBLASLt alone (the GEMM every path must
//! do), cuBLASLt then NCCL's reduce-scatter (the unfused path), our GEMM alone (on the tiles
//! the fused path plans: the wide ping-pong build's 128 × 192 where `COMMFUSE_GEMM_VARIANT`
//! names it, which the rows' names then say), and ours fused with each reduction width asked
//! for. Rows take turns in interleaved rounds; a call's time is
//! its slowest rank's (CUDA events around each call on every rank's stream); each row's time is
//! the median of its rounds' medians, with the fastest and slowest round beside it. The fused
//! rows are checked on every output element of every rank against a float64 reference computed
//! on the GPUs (gemm/reference_gemm.cu per rank, summed on the host) after the timing.

use crate::error::CudaError;
use crate::gemm::bench::ReferenceGemm;
use crate::gemm::{GemmKernels, GemmOperands, PreparedGemm, VariantChoice, WIDE_TILE};
use crate::gemm_rs::{
    fused_tile, GemmRsConfig, GemmRsPath, GemmRsRank, PathChoice, Reduction, RingParts,
};
use crate::rank_bench::{download, interleaved, row, timed, upload, FusedRow, RankStream};
use crate::sys::cublaslt::Lt;
use crate::sys::driver::{open_group, DeviceMemory, Gpu, Stream};
use crate::sys::nccl::Comms;
use commfuse_core::fused::gemm_rs::{check_elements_on, GemmRsShape, ReferenceElement};
use commfuse_core::gemm::{grouped_order, Epilogue, GemmPlan};
use commfuse_core::reference::input_value;
use commfuse_core::{DType, Element, ReduceOp};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// What to measure.
#[derive(Debug, Clone)]
pub struct GemmRsBenchConfig {
    pub devices: Vec<usize>,
    pub shape: GemmRsShape,
    pub bias: bool,
    /// One fused row each: how the owner sums the partials
    pub reductions: Vec<Reduction>,
    /// One overlapped row each: the row pieces a ring step is cut into
    pub pieces: Vec<usize>,
    /// NUMA groups of the overlapped path's ring (1: the flat ring)
    pub numa_groups: usize,
    /// Rows that time the overlapped path's parts apart (at the pieces `auto` picks)
    pub ablation: bool,
    pub warmup: usize,
    pub iters: usize,
    pub seed: u64,
}

/// One row of the table.
pub type GemmRsRow = FusedRow;

/// One rank's buffers.
struct RankData<'g> {
    gpu: &'g Arc<Gpu>,
    stream: Stream,
    lt: Lt,
    a: DeviceMemory,
    b: DeviceMemory,
    bias: Option<DeviceMemory>,
    /// [M, N]: the GEMM's output for the unfused rows and our GEMM alone
    d: DeviceMemory,
    /// [chunk, N]: the reduce-scatter's output
    out: DeviceMemory,
    gemm_alone: PreparedGemm,
}

impl RankStream for RankData<'_> {
    fn gpu(&self) -> &Gpu {
        self.gpu
    }
    fn stream(&self) -> &Stream {
        &self.stream
    }
}

type Launch<'a, 'g> = crate::rank_bench::Launch<'a, RankData<'g>>;

/// Times every row; returns them in the order cuBLASLt, cuBLASLt + NCCL, our GEMM, fused….
pub fn bench_gemm_rs(cfg: &GemmRsBenchConfig) -> Result<Vec<GemmRsRow>, CudaError> {
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

fn run<T: Element + bytemuck::Pod>(cfg: &GemmRsBenchConfig) -> Result<Vec<GemmRsRow>, CudaError> {
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
    let out_size = s.output.size();
    let chunk_rows = s.chunk_rows_max();
    // the operators' configuration, less the path and the reduction each row sets
    let mut base = GemmRsConfig::new(s.m, s.n, s.k, s.b_layout, s.input, s.output);
    base.bias = cfg.bias;
    base.numa_groups = cfg.numa_groups;
    // our GEMM alone on the tiles (and so the build) the fused rows plan: the wide ping-pong
    // build's where COMMFUSE_GEMM_VARIANT names it and the output fits it
    let tile = fused_tile(&base, VariantChoice::from_env()?)?;
    // (the rows' names say the wide tile where it is the one planned)
    let wide = (tile == WIDE_TILE).then(|| format!("{}×{}", tile.m, tile.n));
    let with_tile = |what: &str| match &wide {
        Some(t) => format!("{what}, {t}"),
        None => what.to_string(),
    };
    let mut plan = GemmPlan::local(problem, tile, Epilogue::default());
    plan.order = grouped_order(&problem, tile, commfuse_core::fused::gemm_rs::ORDER_GROUP);
    let host_a: Vec<Vec<T>> = (0..world)
        .map(|r| random(s.m * s.k, cfg.seed, 2 * r))
        .collect();
    let host_b: Vec<Vec<T>> = (0..world)
        .map(|r| random(s.k * s.n, cfg.seed, 2 * r + 1))
        .collect();
    let mut ranks = Vec::with_capacity(world);
    for (r, gpu) in gpus.iter().enumerate() {
        let a = upload(gpu, &host_a[r])?;
        let b = upload(gpu, &host_b[r])?;
        let bias = match (cfg.bias, s.output) {
            (false, _) => None,
            (true, DType::F32) => Some(upload(gpu, &random::<f32>(s.n, cfg.seed, 99))?),
            (true, DType::BF16) => Some(upload(gpu, &random::<bf16>(s.n, cfg.seed, 99))?),
            (true, DType::F16) => Some(upload(gpu, &random::<f16>(s.n, cfg.seed, 99))?),
        };
        let d = DeviceMemory::zeroed(gpu, s.m * s.n * out_size)?;
        let kernels = GemmKernels::load(gpu)?;
        let gemm_alone = PreparedGemm::new(
            gpu,
            &kernels,
            &plan,
            &GemmOperands::plain(a.addr(), b.addr(), d.addr()),
            None,
            0,
            r,
        )?;
        ranks.push(RankData {
            gpu,
            stream: Stream::new(gpu)?,
            lt: Lt::new(gpu)?,
            out: DeviceMemory::zeroed(gpu, chunk_rows.max(1) * s.n * out_size)?,
            a,
            b,
            bias,
            d,
            gemm_alone,
        });
    }
    // NCCL splits evenly only: its row needs M divisible by P
    let comms = if s.m.is_multiple_of(world) {
        let devs: Vec<i32> = cfg.devices.iter().map(|&d| d as i32).collect();
        Some(Comms::for_devices(&devs))
    } else {
        None
    };
    // one operator per row (the ablation's partial calls leave their ring's flags behind the
    // call count; no other row may share it)
    let group =
        |path: PathChoice, reduction: Reduction| -> Result<Vec<Mutex<GemmRsRank>>, CudaError> {
            let c = GemmRsConfig {
                reduction,
                path,
                ..base
            };
            let ops = GemmRsRank::create_group(&gpus, c)?;
            Ok(ops.into_iter().map(Mutex::new).collect())
        };
    // (name, operators, the parts of an overlapped call to time; None: whole calls, checked)
    type Ops = Vec<Mutex<GemmRsRank>>;
    type Row = (String, Ops, Option<(usize, RingParts)>);
    let mut fused: Vec<Row> = Vec::new();
    for &reduction in &cfg.reductions {
        let name = match reduction {
            Reduction::Fold => format!("commfuse-fused ({})", with_tile("fold")),
            Reduction::Separate { blocks } => {
                format!(
                    "commfuse-fused ({})",
                    with_tile(&format!("separate {blocks}"))
                )
            }
        };
        let ops = group(PathChoice::Always(GemmRsPath::Fused), reduction)?;
        fused.push((name, ops, None));
    }
    for &pieces in &cfg.pieces {
        let path = PathChoice::Always(GemmRsPath::Overlapped { pieces });
        let name = format!("commfuse-overlapped ({pieces})");
        fused.push((name, group(path, Reduction::Fold)?, None));
    }
    match group(PathChoice::Always(GemmRsPath::Unfused), Reduction::Fold) {
        Ok(ops) => fused.push(("commfuse-unfused".into(), ops, None)),
        Err(e) => eprintln!("# commfuse-unfused not run: {e}"),
    }
    let auto = group(PathChoice::Auto, Reduction::Fold)?;
    // what the operator takes (without NCCL it leaves the unfused path out)
    let auto_path = auto[0].lock().unwrap().path_for(s.m)?;
    fused.push((format!("commfuse-auto: {auto_path}"), auto, None));
    if cfg.ablation {
        let pieces = match auto_path {
            GemmRsPath::Overlapped { pieces } => pieces,
            GemmRsPath::Fused | GemmRsPath::Unfused => cfg.pieces.first().copied().unwrap_or(1),
        };
        let only = |gemms, copies, flags| RingParts {
            gemms,
            copies,
            flags,
        };
        for (what, parts) in [
            ("GEMMs alone", only(true, false, false)),
            ("copies alone", only(false, true, false)),
            ("flags alone", only(false, false, true)),
            ("GEMMs+copies", only(true, true, false)),
            ("whole", RingParts::WHOLE),
        ] {
            let path = PathChoice::Always(GemmRsPath::Overlapped { pieces });
            let name = format!("ablation ({pieces}): {what}");
            fused.push((name, group(path, Reduction::Fold)?, Some((pieces, parts))));
        }
    }

    let mut names: Vec<String> = Vec::new();
    let mut launches: Vec<Launch<'_, '_>> = Vec::new();
    let p = &problem;
    // SAFETY (of every use): operands sized from the problem on this rank's GPU
    let lt_gemm = move |d: &RankData<'_>| unsafe {
        d.lt.matmul(
            &d.stream,
            p,
            0,
            d.a.addr(),
            d.b.addr(),
            d.d.addr(),
            1.0,
            0.0,
        )
    };
    names.push("cublaslt".into());
    launches.push(Box::new(move |_, d: &RankData<'_>| lt_gemm(d)));
    let mut skipped = Vec::new();
    match &comms {
        Some(Ok(comms)) => {
            names.push("cublaslt+nccl".into());
            let count = s.m / world * s.n;
            let dt = s.output;
            launches.push(Box::new(move |r, d: &RankData<'_>| {
                lt_gemm(d)?;
                // SAFETY: D and the chunk are sized from the problem on this rank's GPU
                unsafe {
                    comms.reduce_scatter_raw(r, d.d.addr(), d.out.addr(), count, dt, &d.stream)
                }
            }));
        }
        Some(Err(e)) => skipped.push(format!("cublaslt+nccl: {e}")),
        None => skipped.push(format!(
            "cublaslt+nccl: NCCL's reduce-scatter needs M divisible by P ({} by {world})",
            s.m
        )),
    }
    names.push(match &wide {
        Some(t) => format!("commfuse-gemm-alone ({t})"),
        None => "commfuse-gemm-alone".into(),
    });
    launches.push(Box::new(move |_, d: &RankData<'_>| unsafe {
        // SAFETY: prepared on this rank's operands
        d.gemm_alone.launch(&d.stream)
    }));
    // per row: the path whose bound its output is checked against (None: not checked)
    let mut checked: Vec<Option<GemmRsPath>> = vec![None; names.len()];
    for (name, ops, parts) in &fused {
        names.push(name.clone());
        let path = ops[0].lock().unwrap().path_for(s.m)?;
        checked.push(parts.is_none().then_some(path));
        let parts = *parts;
        launches.push(Box::new(move |r, d: &RankData<'_>| {
            let mut op = ops[r].lock().unwrap();
            let bias = d.bias.as_ref().map(|b| b.addr());
            // SAFETY: operands on this rank's GPU, output sized for the largest chunk
            unsafe {
                match parts {
                    None => op.forward(&d.stream, s.m, d.a.addr(), d.b.addr(), bias, d.out.addr()),
                    Some((pieces, parts)) => op.forward_parts(
                        &d.stream,
                        s.m,
                        pieces,
                        (d.a.addr(), d.b.addr(), bias, d.out.addr()),
                        parts,
                    ),
                }
            }
        }));
    }
    for why in &skipped {
        eprintln!("# baseline not run: {why}");
    }

    let round_medians = interleaved(&ranks, &launches, cfg.warmup, cfg.iters)?;
    for (_, ops, _) in &fused {
        for op in ops {
            op.lock().unwrap().check()?;
        }
    }

    // the reference: every rank's product in float64 on its GPU, summed on the host
    let mut value = vec![Vec::new(); world];
    let mut abs = vec![Vec::new(); world];
    for (r, d) in ranks.iter().enumerate() {
        let reference = ReferenceGemm::load(d.gpu)?;
        // SAFETY: A and B hold the problem's operands on this GPU
        let rf = unsafe { reference.compute(d.gpu, &d.stream, p, d.a.addr(), d.b.addr())? };
        value[r] = rf.value;
        abs[r] = rf.abs_products;
    }
    let bias_host: Option<Vec<f64>> = ranks[0]
        .bias
        .as_ref()
        .map(|b| download(ranks[0].gpu, b, s.output, s.n))
        .transpose()?;
    let want: Vec<Vec<ReferenceElement>> = (0..world)
        .map(|o| {
            let rows = s.chunk(o);
            let mut w = Vec::with_capacity(rows.len() * s.n);
            for i in rows {
                for j in 0..s.n {
                    let idx = i * s.n + j;
                    let bias_j = bias_host.as_ref().map_or(0.0, |b| b[j]);
                    let mut e = ReferenceElement {
                        value: bias_j,
                        abs_products: 0.0,
                        abs_partials: 0.0,
                        abs_bias: bias_j.abs(),
                    };
                    for q in 0..world {
                        e.value += value[q][idx];
                        e.abs_products += abs[q][idx] as f64;
                        e.abs_partials += value[q][idx].abs();
                    }
                    w.push(e);
                }
            }
            w
        })
        .collect();
    drop((value, abs));

    let mut rows = Vec::new();
    for (v, name) in names.iter().enumerate() {
        let dims = (s.m, s.n, s.k, world);
        let mut row = row(name, dims, p.flops(), &round_medians[v]);
        if let Some(path) = checked[v] {
            // one more call on a poisoned output, then every element of every rank
            for d in &ranks {
                d.out.fill(d.gpu, 0xff)?;
            }
            timed(&ranks, &launches[v], 0, 1)?;
            for (o, d) in ranks.iter().enumerate() {
                let got = download(d.gpu, &d.out, s.output, s.chunk(o).len() * s.n)?;
                let check = check_elements_on(&s, path, got, &want[o]);
                row.checked += check.checked;
                row.out_of_bound += check.out_of_bound;
                row.worst_ratio = row.worst_ratio.max(check.worst_ratio);
            }
        }
        rows.push(row);
    }
    Ok(rows)
}
