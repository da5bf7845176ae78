//! `commfuse bench gemm`: our GEMM beside cuBLASLt on one GPU (same inputs, same run), at all
//! SMs and capped, plus our GEMM with its epilogue storing every tile to a peer GPU; timed with
//! events (warm-up, the median of interleaved rounds' medians), every element of each row's output checked against a float64
//! reference computed on the device ([`DeviceReference`], reference_gemm.cu) with the
//! element-wise bound of `commfuse_core::gemm::element_bound`, on fresh random inputs with the
//! output poisoned first. The fold rows time the GEMM + reduce-scatter's owner epilogue on one
//! GPU: every tile adds F partials from local buffers whose flags are already up, so what they
//! cost beside the plain row is the fold alone (no NVLink, no waiting for a peer); the paced
//! fold rows' flags are raised during the call by a side kernel, as peers would. The rank
//! rows run the fused GEMM + reduce-scatter's kernel itself as rank 0 of P on one GPU
//! ([`OneGpuRank`]): every element of its chunk and of the slots it sent is checked. The gather
//! rows time the all-gather + GEMM's GEMM on one GPU the same way: its bands wait for flags
//! that are already up, and the first band's rows come from the caller's own A.

use crate::error::CudaError;
use crate::gemm::trace::GemmTrace;
use crate::gemm::{
    wide_routes_fit, CallNumber, FoldSource, Gather, GemmEntry, GemmKernels, GemmOperands,
    GemmVariant, PreparedGemm, RouteTargets, TailChoice, TileRoute, VariantChoice, MID_TILE,
    NARROW_TILE, ROUTE_DST_FROM_D, SHORT_TILE, SKINNY_ROWS, TILE, WIDE_TILE,
};
use crate::gemm_rs::one_gpu::{OneGpuRank, RankSchedule};
use crate::sys::cublaslt::{AlgoConfig, CandidateTime, Lt};
pub use crate::sys::driver::StreamGuard;
use crate::sys::driver::{DeviceMemory, Event, Function, Gpu, Module, Stream};
use crate::sys::nvrtc;
pub use commfuse_core::gemm::TileOrder;
use commfuse_core::gemm::{
    staggered_remote_first, tile_order, tiles, BLayout, ElementCheck, Epilogue, GemmPlan,
    GemmProblem, ReferenceElement,
};
use commfuse_core::plan::{NotifyOp, Slot};
use commfuse_core::reference::input_value;
use commfuse_core::{rounds, DType, Element, ReduceOp};
use half::{bf16, f16};

#[derive(Debug, Clone, serde::Serialize)]
pub struct GemmRow {
    /// `commfuse`, `commfuse-peer`, ... or `cublaslt (best of N, #i)`: the heuristic offered N
    /// algorithms, the i-th (0: its own first pick) ran fastest and was timed
    pub implementation: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// D = A·B + a bias row (every plain row of the run; see [`ExtraRows::bias`])
    pub bias: bool,
    pub sms: u32,
    /// The build of our kernel that ran ([`GemmVariant::name`]; none for cuBLASLt)
    pub build: Option<String>,
    /// Which of its build's entries our kernel ran: `general`, `plain` (every option compiled
    /// out) or `plain-tail` (the same with the split tail; see [`GemmEntry`]); none for
    /// cuBLASLt
    pub entry: Option<String>,
    /// Blocks of our kernel's persistent grid (none for cuBLASLt)
    pub grid: Option<u32>,
    /// How our kernel shares out the tiles beyond its last whole wave (`none`, `cut P×T`,
    /// `stream-k T/W`; none for cuBLASLt)
    pub tail: Option<String>,
    /// Fold rows: tiles whose partials the kernel loads into its stages by TMA (the others
    /// read them from global memory after their main loop)
    pub staged_folds: Option<usize>,
    /// Our rows: whether the blocks load the units of their second, fourth, ... wave from the
    /// last k-block to the first ([`PreparedGemm::k_serpentine`]); none for cuBLASLt
    pub k_serpentine: Option<bool>,
    pub time_ms: f64,
    pub tflops: f64,
    /// Elements checked against the float64 reference
    pub checked: usize,
    /// Checked elements whose error exceeds `commfuse_core::gemm::element_bound`
    pub out_of_bound: usize,
    /// The largest error / bound among the checked elements (below 1: all within bound)
    pub worst_ratio: f64,
    /// The element with the worst ratio: (row, column, value, reference, bound)
    pub worst: Option<(usize, usize, f64, f64, f64)>,
    /// cuBLASLt's rows: what the algorithm that ran is (its configuration attributes)
    pub cublaslt_config: Option<AlgoConfig>,
    /// cuBLASLt's rows: every candidate's GPU and host time while choosing, and what it is
    pub cublaslt_candidates: Vec<CandidateTime>,
    /// Our plain rows with [`ExtraRows::trace`]: where one call's time went, block by block
    pub trace: Option<GemmTrace>,
}

/// Uniform in [-1, 1) from the project's indexable input stream (`stream` 0: A, 1: B).
fn upload_random<T: Element>(
    gpu: &Gpu,
    len: usize,
    seed: u64,
    stream: usize,
) -> Result<DeviceMemory, CudaError> {
    let host: Vec<T> = (0..len)
        .map(|i| T::from_f32(input_value(seed, stream, i, ReduceOp::Sum)))
        .collect();
    let mem = DeviceMemory::zeroed(gpu, len * std::mem::size_of::<T>())?;
    mem.upload(gpu, &host)?;
    Ok(mem)
}

/// The optional rows of [`bench_gemm`] beyond cuBLASLt's and the chosen build's.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExtraRows<'a> {
    /// For each F, a row of our kernel folding F partials into every tile, and one more whose
    /// producer asks L2 for them halfway through each tile's main loop (`-prefetch`, [`FoldRow`])
    pub folds: &'a [usize],
    /// Each fold row again with its flags raised by a side kernel this many waves after each
    /// wave starts (a side kernel on an SM the first cap of `sms` leaves free)
    pub paced: Option<f64>,
    /// The builds forced beside the chosen one, where they fit (`None`: every build that fits)
    pub builds: Option<&'a [VariantChoice]>,
    /// A row of the chosen build whose producer asks L2 for each unit's first this many
    /// k-blocks while it loads the unit before ([`PreparedGemm::set_next_prefetch`])
    pub next_prefetch: Option<u32>,
    /// A row of the chosen build whose blocks start their units' loads at this many places
    /// in K ([`PreparedGemm::set_k_phases`])
    pub k_phases: Option<u32>,
    /// A row of the chosen build whose blocks load the units of their second, fourth, ...
    /// wave from the last k-block to the first ([`PreparedGemm::set_k_serpentine`]), and each
    /// rank row again with it (`-serpentine`)
    pub k_serpentine: bool,
    /// Every plain row (cuBLASLt's, ours, the forced builds) adds a bias row of N random
    /// values of the output type: D = A·B + bias; a rank row's own tiles add it too (the
    /// tiles it sends do not). Not with fold rows or a peer.
    pub bias: bool,
    /// Rows of the main and the direct build prepared as the all-gather + GEMM's GEMM
    /// ([`GatherRow`]), at the first cap of `sms`
    pub gather: bool,
    /// After the timed rounds, one more call of each plain row of ours (the chosen build and
    /// the forced ones) whose blocks stamp the points of [`crate::gemm::trace::EVENTS`]
    pub trace: bool,
    /// The tile order of every row of ours (bands of [`ORDER_GROUP`] rows by default)
    pub order: TileOrder,
    /// For each P, a row of the fused GEMM + reduce-scatter's kernel as rank 0 of P alone on
    /// this GPU ([`OneGpuRank`]), at the first cap of `sms`
    pub rs_ranks: &'a [usize],
    /// Each of those rows again with the ring inside one GEMM ([`RankSchedule::Ring`])
    pub rs_ring: bool,
    /// Each of those rows (through the entry `auto` takes) whose folds go through the stages
    /// again for each of these k-blocks, its producer asking L2 for a tile's partials that
    /// many k-blocks before the end of the tile's main loop ([`PreparedGemm::set_fold_prefetch`])
    pub rs_prefetch: &'a [u32],
}

/// Times cuBLASLt and our kernel on `problem` (bf16 or f16 inputs) for each SM cap in `sms`
/// (0 = all SMs), on the same inputs in the same run, with each other build that fits forced
/// beside ours; with `peer`, also our kernel with every tile stored into a buffer on that GPU
/// and a flag raised there per tile; and the rows `extra` asks for.
#[allow(clippy::too_many_arguments)]
pub fn bench_gemm(
    device: usize,
    peer: Option<usize>,
    extra: ExtraRows<'_>,
    problem: &GemmProblem,
    sms: &[u32],
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<Vec<GemmRow>, CudaError> {
    match problem.input {
        DType::BF16 => run::<bf16>(device, peer, extra, problem, sms, warmup, iters, seed),
        DType::F16 => run::<f16>(device, peer, extra, problem, sms, warmup, iters, seed),
        DType::F32 => Err(CudaError::Unavailable("GEMM inputs are bf16 or f16".into())),
    }
}

/// One timed row: a launch on the bench stream and the output it writes.
struct Variant<'a> {
    name: &'a str,
    cap: u32,
    launch: Box<dyn Fn() -> Result<(), CudaError> + 'a>,
    output: (&'a Gpu, &'a DeviceMemory),
    /// Rows below this many were sent to the peer's buffer (the reduce-scatter pattern)
    peer_rows: Option<(usize, &'a Gpu, &'a DeviceMemory)>,
    gemm: Option<&'a PreparedGemm>,
    /// The partials this row folds into every tile (checked as part of its result)
    folded: Option<&'a FoldRow>,
    /// The fused GEMM + reduce-scatter's rank whose outputs (its chunk and the peers' slots)
    /// this row checks instead of `output` (whose GPU holds them)
    rank: Option<&'a OneGpuRank>,
}

/// The row of one of our plain GEMMs (its operands the bench's, its tiles into `output`).
fn plain_row<'a>(
    name: &'a str,
    cap: u32,
    gemm: &'a PreparedGemm,
    stream: &'a Stream,
    output: (&'a Gpu, &'a DeviceMemory),
) -> Variant<'a> {
    Variant {
        name,
        cap,
        // SAFETY: every plain GEMM of the bench is prepared on its operands, sized from the
        // problem on this GPU, which outlive the rows
        launch: Box::new(move || unsafe { gemm.launch(stream) }),
        output,
        peer_rows: None,
        gemm: Some(gemm),
        folded: None,
        rank: None,
    }
}

/// Each variant's time in ms: the median of its rounds' medians, the variants taking turns in
/// [`rounds::ROUNDS`] interleaved rounds (`commfuse_core::rounds`) so that clock and temperature
/// drift over the run touch all rows alike; a round is `iters / ROUNDS` launches with events
/// around each, after `warmup` untimed launches in the first round (at least one) and one in
/// the others.
fn interleaved_medians(
    gpu: &Gpu,
    stream: &Stream,
    variants: &[Variant<'_>],
    warmup: usize,
    iters: usize,
) -> Result<Vec<f64>, CudaError> {
    let per_round = rounds::calls_per_round(iters);
    let round_medians = rounds::interleaved(
        variants.len(),
        |v, round| {
            let v = &variants[v];
            let warm = rounds::warmup_of(round, warmup.max(1));
            timed_median(gpu, stream, v.gemm, &*v.launch, warm, per_round)
        },
        |_| {},
    )?;
    Ok(round_medians
        .iter()
        .map(|r| rounds::summary(r).expect("every variant ran its rounds").0)
        .collect())
}

/// A [`PreparedGemm`] setter of one of the bench's option rows (`set_next_prefetch`, …).
type SetOption = fn(&mut PreparedGemm, u32);

/// The band of the default tile order of the benchmark rows of our kernel.
pub const ORDER_GROUP: usize = 8;

#[allow(clippy::too_many_arguments)]
fn run<T: Element>(
    device: usize,
    peer: Option<usize>,
    ExtraRows {
        folds,
        paced,
        builds: only,
        next_prefetch,
        k_phases,
        k_serpentine,
        bias,
        gather,
        trace,
        order,
        rs_ranks,
        rs_ring,
        rs_prefetch,
    }: ExtraRows<'_>,
    p: &GemmProblem,
    sms: &[u32],
    warmup: usize,
    iters: usize,
    seed: u64,
) -> Result<Vec<GemmRow>, CudaError> {
    if bias && (peer.is_some() || !folds.is_empty()) {
        return Err(CudaError::Unavailable(
            "bias rows are plain GEMMs or rank rows: not with fold rows or a peer (--peer none)"
                .into(),
        ));
    }
    let gpu = std::sync::Arc::new(Gpu::open(device)?);
    let stream = Stream::new(&gpu)?;
    let lt = Lt::new(&gpu)?;
    let a_dev = upload_random::<T>(&gpu, p.m * p.k, seed, 0)?;
    let b_dev = upload_random::<T>(&gpu, p.k * p.n, seed, 1)?;
    // the float64 reference first, from copies of the operands taken before any timed call:
    // what a timed launch writes (in bounds or not) cannot reach what the rows are checked
    // against, and a launch that wrote into A or B fails its check
    let reference = reference_of(&gpu, &stream, p, (&a_dev, &b_dev))?;
    let out_bytes = p.m * p.n * p.output.size();
    let d_dev = DeviceMemory::zeroed(&gpu, out_bytes)?;
    // the bias row, as uploaded (rounded to the output type), and where it lives
    let bias_row = if bias {
        let values: Vec<f64> = (0..p.n)
            .map(|i| input_value(seed, 2, i, ReduceOp::Sum) as f64)
            .collect();
        Some(upload_output(&gpu, p.output, &values)?)
    } else {
        None
    };
    let bias_addr = bias_row.as_ref().map(|(mem, _)| mem.addr());
    let kernels = GemmKernels::load(&gpu)?;
    let epilogue = Epilogue {
        bias,
        ..Epilogue::default()
    };
    let plan_of = |tile| {
        let mut plan = GemmPlan::local(*p, tile, epilogue);
        let (tm, tn) = tiles(p, tile);
        plan.order = tile_order(tm, tn, order, ORDER_GROUP);
        plan
    };
    // the tile the build choice (COMMFUSE_GEMM_VARIANT, auto by default) plans with; the rows
    // with routes keep the fused operators' tile
    let wide = plan_of(TILE);
    let chosen_plan = plan_of(kernels.tile_for(p, &epilogue, gpu.sm_count as usize));
    let ops = GemmOperands {
        bias: bias_addr,
        ..GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_dev.addr())
    };
    let ours: Vec<PreparedGemm> = sms
        .iter()
        .map(|&cap| PreparedGemm::new(&gpu, &kernels, &chosen_plan, &ops, None, cap, 0))
        .collect::<Result<_, _>>()?;
    // where another build than the main one can compute the product (the skinny one: every
    // tile at most 64 rows; the narrow ones: M fits one band of narrow tiles, and the
    // narrow-tall one also where its tiles of several bands make one wave; the pair build:
    // a tile of more than 64 rows, and the direct build; the mid, both ping-pong builds and
    // the mid-direct one: M above 64; the short build: M above 64 where its tiles make at
    // most two waves), each build forced, side by side with the row of the build chosen
    let mut forced: Vec<(&'static str, u32, PreparedGemm)> = Vec::new();
    let (narrow_rows, narrow_cols) = tiles(p, NARROW_TILE);
    let one_band = p.m <= NARROW_TILE.m;
    let narrow = (one_band || narrow_rows * narrow_cols <= gpu.sm_count as usize)
        .then(|| plan_of(NARROW_TILE));
    let skinny_fits = VariantChoice::Skinny.variant_for(&wide) == GemmVariant::Skinny;
    let pair_fits = VariantChoice::Pair.variant_for(&wide) == GemmVariant::Pair;
    let mid = (p.m > SKINNY_ROWS).then(|| plan_of(MID_TILE));
    let wide_ping_pong = (p.m > SKINNY_ROWS).then(|| plan_of(WIDE_TILE));
    let (short_rows, short_cols) = tiles(p, SHORT_TILE);
    let short = (p.m > SKINNY_ROWS && short_rows * short_cols <= 2 * gpu.sm_count as usize)
        .then(|| plan_of(SHORT_TILE));
    if skinny_fits || narrow.is_some() || pair_fits || mid.is_some() {
        let mut builds = vec![("commfuse-main", VariantChoice::Main, &wide)];
        if skinny_fits {
            builds.push(("commfuse-skinny", VariantChoice::Skinny, &wide));
        }
        if let Some(narrow) = &narrow {
            builds.push(("commfuse-narrow", VariantChoice::Narrow, narrow));
        }
        if let Some(narrow) = narrow.as_ref().filter(|_| one_band) {
            builds.push(("commfuse-narrow-deep", VariantChoice::NarrowDeep, narrow));
            builds.push((
                "commfuse-narrow-sliced",
                VariantChoice::NarrowSliced,
                narrow,
            ));
        }
        if pair_fits {
            builds.push(("commfuse-pair", VariantChoice::Pair, &wide));
            builds.push(("commfuse-direct", VariantChoice::Direct, &wide));
        }
        if let Some(mid) = &mid {
            builds.push(("commfuse-mid", VariantChoice::Mid, mid));
            builds.push(("commfuse-ping-pong", VariantChoice::PingPong, mid));
            builds.push(("commfuse-mid-direct", VariantChoice::MidDirect, mid));
        }
        if let Some(plan) = &wide_ping_pong {
            builds.push(("commfuse-ping-pong-wide", VariantChoice::PingPongWide, plan));
        }
        if let Some(short) = &short {
            builds.push(("commfuse-short", VariantChoice::Short, short));
        }
        for (name, choice, plan) in builds {
            if only.is_some_and(|only| !only.contains(&choice)) {
                continue;
            }
            for &cap in sms {
                let gemm = kernels.with_choice(choice, || {
                    PreparedGemm::new(&gpu, &kernels, plan, &ops, None, cap, 0)
                });
                forced.push((name, cap, gemm?));
            }
        }
    }
    // the chosen build with the other way of sharing out its tail, where the two differ
    let chosen_tail = kernels.tail();
    let (other, name) = match chosen_tail {
        TailChoice::Cut => (TailChoice::StreamK, "commfuse-stream-k"),
        TailChoice::StreamK => (TailChoice::Cut, "commfuse-cut"),
    };
    kernels.set_tail(other);
    for (gemm, &cap) in ours.iter().zip(sms) {
        let g = PreparedGemm::new(&gpu, &kernels, &chosen_plan, &ops, None, cap, 0)?;
        if g.tail() != gemm.tail() {
            forced.push((name, cap, g));
        }
    }
    kernels.set_tail(chosen_tail);
    // the chosen build with one option on: the next unit's first k-blocks asked of L2 ahead,
    // its blocks' loads started at several places in K, every other wave's K loop reversed
    let options: [(&str, Option<u32>, SetOption); 3] = [
        (
            "commfuse-next-prefetch",
            next_prefetch,
            PreparedGemm::set_next_prefetch,
        ),
        ("commfuse-k-phases", k_phases, PreparedGemm::set_k_phases),
        (
            "commfuse-serpentine",
            k_serpentine.then_some(1),
            PreparedGemm::set_k_serpentine,
        ),
    ];
    for (name, value, set) in options {
        let Some(value) = value else { continue };
        for &cap in sms {
            let mut g = PreparedGemm::new(&gpu, &kernels, &chosen_plan, &ops, None, cap, 0)?;
            set(&mut g, value);
            forced.push((name, cap, g));
        }
    }
    // the chosen build through its general entry where a plain one runs: what the options
    // that the plain entries compile out cost a call that asks for none of them
    for (gemm, &cap) in ours.iter().zip(sms) {
        if gemm.entry() != GemmEntry::General {
            let mut g = PreparedGemm::new(&gpu, &kernels, &chosen_plan, &ops, None, cap, 0)?;
            g.use_general_entry();
            forced.push(("commfuse-general", cap, g));
        }
    }

    // the rows with routes: local tiles with flags (what a flag costs), every tile to the peer
    // with and without flags, and the reduce-scatter pattern at two ranks (the peer's half of
    // the rows to the peer, staggered, the last wave local)
    let peer_gpu = peer.map(Gpu::open).transpose()?;
    let routed = match &peer_gpu {
        Some(peer_gpu) => Some(Routed::new(&gpu, peer_gpu, &kernels, &wide, &ops, &d_dev)?),
        None => None,
    };
    // the fold rows run at the first cap of `sms` (a paced row's side kernel needs an SM of
    // its own)
    let fold_cap = sms.first().copied().unwrap_or(0);
    if paced.is_some() && (fold_cap == 0 || fold_cap >= gpu.sm_count) {
        return Err(CudaError::Unavailable(format!(
            "paced fold rows need the GEMM capped below the GPU's {} SMs (the first of --sms): \
             the kernel that raises their flags takes an SM of its own",
            gpu.sm_count
        )));
    }
    // the all-gather + GEMM's GEMM on the builds it can run (at the fold rows' cap)
    let gather_rows = if gather {
        let mut rows = Vec::new();
        for (name, choice) in [
            ("commfuse-gather-main", VariantChoice::Main),
            ("commfuse-gather-direct", VariantChoice::Direct),
        ] {
            let row = kernels.with_choice(choice, || {
                GatherRow::new(&gpu, &stream, &kernels, &wide, &ops, fold_cap)
            });
            rows.push((name, row?));
        }
        rows
    } else {
        Vec::new()
    };
    let kinds: &[FoldFlags] = match paced {
        Some(offset) if !(0.0..=4.0).contains(&offset) => {
            return Err(CudaError::Unavailable(format!(
                "paced fold rows raise their flags 0 to 4 waves after the wave starts, not {offset}"
            )))
        }
        Some(_) => &[
            FoldFlags::Up,
            FoldFlags::UpPrefetched,
            FoldFlags::Paced,
            FoldFlags::PacedPrefetched,
        ],
        None => &[FoldFlags::Up, FoldFlags::UpPrefetched],
    };
    let fold_rows = folds
        .iter()
        .flat_map(|&f| kinds.iter().map(move |&k| (f, k)))
        .map(|(f, flags)| FoldRow::new(&gpu, &kernels, &wide, &ops, (f, flags, fold_cap), seed))
        .collect::<Result<Vec<_>, _>>()?;
    let serpentine: &[bool] = if k_serpentine {
        &[false, true]
    } else {
        &[false]
    };
    // each rank on the build `auto` gives its routes, and again on the direct build (named
    // `-direct`) where that is another; and where a rank runs a routed entry, again through
    // its build's general entry (`-general`: what the routed entry saves)
    let mut rank_rows = Vec::new();
    let schedules: &[RankSchedule] = if rs_ring {
        &[RankSchedule::Fold, RankSchedule::Ring]
    } else {
        &[RankSchedule::Fold]
    };
    for (world, on, kind) in serpentine.iter().flat_map(|&on| {
        rs_ranks
            .iter()
            .flat_map(move |&world| schedules.iter().map(move |&kind| (world, on, kind)))
    }) {
        // the rank under `choice` (named by its build where not `auto`'s), through its
        // general entry where `general`
        let rank = |choice: VariantChoice, general: bool| {
            let operands = (a_dev.addr(), b_dev.addr());
            let mut row = kernels.with_choice(choice, || {
                let bias = bias_row
                    .as_ref()
                    .map(|(mem, values)| (mem.addr(), values.as_slice()));
                OneGpuRank::new(
                    &gpu,
                    &kernels,
                    p,
                    operands,
                    (world, fold_cap),
                    kind,
                    seed,
                    bias,
                )
            })?;
            if choice != VariantChoice::Auto {
                row.name_build();
            }
            if general {
                row.use_general_entry();
            }
            if on {
                row.set_k_serpentine();
            }
            Ok::<_, CudaError>(row)
        };
        // (the wide ping-pong build's routes: outputs of the input's type, the fused path's
        // schedule, rows of whole 16-byte units, which its fold's tensor map needs)
        let wide = (kind == RankSchedule::Fold && wide_routes_fit(p.input, p.output, p.n))
            .then_some(VariantChoice::PingPongWide);
        for choice in [Some(VariantChoice::Auto), Some(VariantChoice::Direct), wide]
            .into_iter()
            .flatten()
        {
            let row = rank(choice, false)?;
            if choice != VariantChoice::Auto {
                let auto = rank_rows.last().map(|r: &OneGpuRank| r.gemm().variant());
                if auto == Some(row.gemm().variant()) {
                    continue;
                }
            }
            let routed = row.gemm().entry() == GemmEntry::Routed;
            let row_variant = row.gemm().variant();
            // (a build whose folds do not go through the stages has nothing to ask L2 for)
            let staged = row.gemm().staged_folds() > 0;
            rank_rows.push(row);
            for &k_blocks in rs_prefetch.iter().filter(|_| staged) {
                let mut row = rank(choice, false)?;
                row.set_fold_prefetch(k_blocks);
                rank_rows.push(row);
            }
            if routed && row_variant.general_entry_takes_routes() {
                rank_rows.push(rank(choice, true)?);
            }
        }
    }
    // each rank row's GEMM as a plain one, in its order and bands, on the build its routes
    // took (the skinny one where every band has at most 64 rows, the direct one in the
    // `-direct` rows, else the main one): what the order costs, apart from the routes, flags
    // and fold
    let rank_orders = rank_rows
        .iter()
        .filter(|row| {
            !row.gemm().k_serpentine() && !row.general_entry() && row.gemm().fold_prefetch() == 0
        })
        .map(|row| {
            let name = format!("{}-order", row.name());
            let plan = row.order_plan();
            let choice = match row.gemm().variant() {
                GemmVariant::Skinny => VariantChoice::Skinny,
                GemmVariant::Direct => VariantChoice::Direct,
                GemmVariant::PingPongWide => VariantChoice::PingPongWide,
                _ => VariantChoice::Main,
            };
            let gemm = kernels.with_choice(choice, || {
                PreparedGemm::new(&gpu, &kernels, &plan, &ops, None, fold_cap, 0)
            })?;
            Ok((name, gemm))
        })
        .collect::<Result<Vec<_>, CudaError>>()?;
    // the paced rows' side stream, drained before their flags are freed
    let side = Stream::new(&gpu)?;
    let _side_drain = StreamGuard::new(&side);
    // declared after every buffer the launches below write (here and on the peer) and before
    // none of them: it drops first, so an error path (a `?` below) waits for the stream before
    // any of that memory is freed
    let _drain = StreamGuard::new(&stream);
    // a paced row's side kernel raises each wave's flags `paced` of a wave after the wave
    // starts, a wave being the peers': the fold rows' build without a fold, at their cap, timed
    // alone (a peer's partial is ready when its own tile is; a wave of the fold row itself
    // would count the owner's fold in the peers' pace)
    let mut pacers = Vec::new();
    if let Some(offset) = paced.filter(|_| !folds.is_empty()) {
        let tiles = wide.tile_count();
        let peer = kernels.with_choice(VariantChoice::Main, || {
            PreparedGemm::new(&gpu, &kernels, &wide, &ops, None, fold_cap, 0)
        })?;
        // SAFETY: the bench's operands, valid for its whole run
        let alone = || unsafe { peer.launch(&stream) };
        let ms = timed_median(&gpu, &stream, Some(&peer), &alone, warmup.max(3), 7)?;
        let wave_ns = ms * 1e6 / tiles.div_ceil(peer.grid() as usize).max(1) as f64;
        for row in fold_rows.iter().filter(|r| r.flags.paced()) {
            pacers.push(Pacer::new(
                (&gpu, &kernels, &side),
                row,
                tiles,
                (wave_ns, offset),
            )?);
        }
    }

    let mut variants = Vec::new();
    let (lt, stream, a_addr, b_addr, d_addr) =
        (&lt, &stream, a_dev.addr(), b_dev.addr(), d_dev.addr());
    for &cap in sms {
        variants.push(Variant {
            name: "cublaslt",
            cap,
            // SAFETY: operands sized from the problem on this GPU
            launch: Box::new(move || unsafe {
                let operands = (a_addr, b_addr, d_addr, d_addr);
                lt.matmul_into(stream, p, cap, operands, bias_addr, 1.0, 0.0)
            }),
            output: (&gpu, &d_dev),
            peer_rows: None,
            gemm: None,
            folded: None,
            rank: None,
        });
    }
    let output = (&*gpu, &d_dev);
    for (gemm, &cap) in ours.iter().zip(sms) {
        variants.push(plain_row("commfuse", cap, gemm, stream, output));
    }
    for (name, cap, gemm) in &forced {
        variants.push(plain_row(name, *cap, gemm, stream, output));
    }
    if let (Some(r), Some(peer_gpu)) = (&routed, &peer_gpu) {
        for (name, gemm, output, peer_rows) in [
            ("commfuse-flags", &r.local_flags, (&*gpu, &d_dev), None),
            (
                "commfuse-peer-noflag",
                &r.peer_noflag,
                (peer_gpu, &r.d_peer),
                None,
            ),
            ("commfuse-peer", &r.peer, (peer_gpu, &r.d_peer), None),
            (
                "commfuse-rs-half",
                &r.rs_half,
                (&*gpu, &d_dev),
                Some((r.rs_rows, peer_gpu, &r.d_peer)),
            ),
        ] {
            variants.push(Variant {
                name,
                cap: 0,
                // SAFETY: operands on this GPU, destinations and flags where the routes say,
                // peer access enabled
                launch: Box::new(move || unsafe { gemm.launch(stream) }),
                output,
                peer_rows,
                gemm: Some(gemm),
                folded: None,
                rank: None,
            });
        }
    }
    for fold in fold_rows.iter().filter(|r| !r.flags.paced()) {
        variants.push(Variant {
            name: fold.name,
            cap: fold_cap,
            // SAFETY: operands, partials and flags on this GPU, sized from the problem
            launch: Box::new(move || unsafe { fold.gemm.launch(stream) }),
            output: (&gpu, &d_dev),
            peer_rows: None,
            gemm: Some(&fold.gemm),
            folded: Some(fold),
            rank: None,
        });
    }
    for (name, gemm) in &rank_orders {
        variants.push(plain_row(name, fold_cap, gemm, stream, output));
    }
    for row in &rank_rows {
        // (its partials, stand-in buffers and flags on this GPU, sized from the row's schedule,
        // live as long as the row)
        variants.push(Variant {
            rank: Some(row),
            ..plain_row(row.name(), fold_cap, row.gemm(), stream, output)
        });
    }
    for (name, row) in &gather_rows {
        variants.push(Variant {
            name,
            cap: fold_cap,
            launch: Box::new(move || row.launch(stream, b_addr, bias_addr, d_addr)),
            output: (&gpu, &d_dev),
            peer_rows: None,
            gemm: Some(&row.gemm),
            folded: None,
            rank: None,
        });
    }
    for pacer in &pacers {
        variants.push(Variant {
            name: pacer.row.name,
            cap: fold_cap,
            launch: Box::new(move || pacer.launch(stream)),
            output: (&gpu, &d_dev),
            peer_rows: None,
            gemm: Some(&pacer.row.gemm),
            folded: Some(pacer.row),
            rank: None,
        });
    }
    let times = interleaved_medians(&gpu, stream, &variants, warmup, iters)?;
    let mut rows = Vec::new();
    for (v, time_ms) in variants.iter().zip(times) {
        // a checked call on a poisoned output: an element the GEMM skipped fails the check
        let (out_gpu, out) = v.output;
        out.fill(out_gpu, 0xff)?;
        if let Some(rank) = v.rank {
            rank.poison(&gpu)?;
        }
        if let Some((_, g, m)) = v.peer_rows {
            m.fill(g, 0xff)?;
        }
        (v.launch)()?;
        stream
            .synchronize()
            .map_err(|e| with_stall_report(e, v.gemm))?;
        v.gemm.map_or(Ok(()), PreparedGemm::check)?;
        let (peer_rows, folded) = (v.peer_rows, v.folded);
        let added = Added {
            folded,
            bias: bias_row.as_ref().map(|(_, values)| values.as_slice()),
        };
        let check = match p.output {
            DType::F32 => check_row::<f32>(p, &reference, v, added)?,
            DType::BF16 => check_row::<bf16>(p, &reference, v, added)?,
            DType::F16 => check_row::<f16>(p, &reference, v, added)?,
        };
        let choice = lt.choice(p, v.cap, bias).filter(|_| v.gemm.is_none());
        let implementation = match choice {
            Some(c) => format!("{} (best of {}, #{})", v.name, c.candidates, c.index),
            None => v.name.into(),
        };
        let cublaslt_candidates = match choice {
            Some(_) => lt.candidate_times(p, v.cap, bias),
            None => vec![],
        };
        // (the plain rows only: the others' calls need more than the GEMM's own launch)
        let plain = v.name == "commfuse" || forced.iter().any(|(name, ..)| *name == v.name);
        let trace = match v.gemm {
            // SAFETY: operands sized from the problem on this GPU, the stream drained above
            Some(g) if trace && plain && folded.is_none() && peer_rows.is_none() => {
                Some(unsafe { g.trace(&gpu, stream, 2)? })
            }
            _ => None,
        };
        rows.push(GemmRow {
            implementation,
            m: p.m,
            n: p.n,
            k: p.k,
            bias,
            sms: v.cap,
            build: v.gemm.map(|g| g.variant().name().to_string()),
            entry: v.gemm.map(|g| g.entry().name().to_string()),
            grid: v.gemm.map(PreparedGemm::grid),
            tail: v.gemm.map(|g| g.tail().to_string()),
            staged_folds: v
                .folded
                .map(|f| &f.gemm)
                .or(v.rank.map(OneGpuRank::gemm))
                .map(PreparedGemm::staged_folds),
            k_serpentine: v.gemm.map(PreparedGemm::k_serpentine),
            time_ms,
            tflops: p.flops() / (time_ms * 1e-3) / 1e12,
            checked: check.checked,
            out_of_bound: check.out_of_bound,
            worst_ratio: check.worst_ratio,
            worst: check
                .worst
                .map(|(i, got, want, bound)| (i / p.n, i % p.n, got, want, bound)),
            cublaslt_config: choice.map(|c| c.config),
            cublaslt_candidates,
            trace,
        });
    }
    Ok(rows)
}

/// The reference of every row (they all compute A·B from the same operands), computed from
/// copies of `a` and `b` made on `stream` and freed before this returns.
fn reference_of(
    gpu: &Gpu,
    stream: &Stream,
    p: &GemmProblem,
    (a, b): (&DeviceMemory, &DeviceMemory),
) -> Result<DeviceReference, CudaError> {
    let (a_bytes, b_bytes) = (p.m * p.k * p.input.size(), p.k * p.n * p.input.size());
    let (a_copy, b_copy) = (
        DeviceMemory::zeroed(gpu, a_bytes)?,
        DeviceMemory::zeroed(gpu, b_bytes)?,
    );
    let _drain = StreamGuard::new(stream);
    // SAFETY: each copy stays within allocations of these sizes on this GPU; `compute`
    // synchronises the stream before the copies are freed (and the guard on error paths)
    unsafe {
        stream.copy_async(a_copy.addr(), a.addr(), a_bytes)?;
        stream.copy_async(b_copy.addr(), b.addr(), b_bytes)?;
        ReferenceGemm::load(gpu)?.compute(gpu, stream, p, a_copy.addr(), b_copy.addr())
    }
}

/// What a row adds to A·B: the partials a fold row folds in, or the bias row (as uploaded).
#[derive(Clone, Copy)]
struct Added<'a> {
    folded: Option<&'a FoldRow>,
    bias: Option<&'a [f64]>,
}

/// Downloads one row's output — the first `rows` rows from the peer's buffer when the
/// reduce-scatter pattern sent them there — and checks every element (A·B, plus what the row
/// adds: a fold row's partials or the bias row).
fn check_output<TO: Element>(
    p: &GemmProblem,
    reference: &DeviceReference,
    (gpu, out): (&Gpu, &DeviceMemory),
    peer_rows: Option<(usize, &Gpu, &DeviceMemory)>,
    Added { folded, bias }: Added<'_>,
) -> Result<ElementCheck, CudaError> {
    let mut d = vec![TO::from_f32(0.0); p.m * p.n];
    out.download(gpu, &mut d)?;
    if let Some((rows, peer_gpu, peer_out)) = peer_rows {
        let rows = rows.min(p.m);
        peer_out.download(peer_gpu, &mut d[..rows * p.n])?;
    }
    Ok(match (folded, bias) {
        (Some(f), _) => reference.check_plus(p, &d, &|i| f.added(i)),
        (None, Some(bias)) => reference.check_plus(p, &d, &|i| {
            let b = bias[i % p.n];
            (b, b.abs())
        }),
        (None, None) => reference.check(p, &d),
    })
}

/// Checks every element of one row's call: a one-GPU rank's flags in its peers' stand-ins
/// ([`OneGpuRank::check_flags`]: a wrong one is an error), its chunk against A·B plus the
/// peers' partials and its other chunks (in the slots of their owners' stand-in buffers)
/// against A·B, every other row's output by [`check_output`].
fn check_row<TO: Element>(
    p: &GemmProblem,
    reference: &DeviceReference,
    v: &Variant<'_>,
    added: Added<'_>,
) -> Result<ElementCheck, CudaError> {
    match v.rank {
        Some(rank) => {
            rank.check_flags(v.output.0)?;
            let d = rank.assemble::<TO>(v.output.0)?;
            Ok(reference.check_plus(p, &d, &|i| rank.added(i)))
        }
        None => check_output::<TO>(p, reference, v.output, v.peer_rows, added),
    }
}

/// `values` in the output type `output` on `gpu` ([`upload_rounded`]).
pub(crate) fn upload_output(
    gpu: &Gpu,
    output: DType,
    values: &[f64],
) -> Result<(DeviceMemory, Vec<f64>), CudaError> {
    match output {
        DType::F32 => upload_rounded::<f32>(gpu, values),
        DType::BF16 => upload_rounded::<bf16>(gpu, values),
        DType::F16 => upload_rounded::<f16>(gpu, values),
    }
}

/// `values` in the element type `T` on `gpu`, and the values as uploaded (rounded to `T`).
fn upload_rounded<T: Element>(
    gpu: &Gpu,
    values: &[f64],
) -> Result<(DeviceMemory, Vec<f64>), CudaError> {
    let host: Vec<T> = values.iter().map(|&v| T::from_f64(v)).collect();
    let mem = DeviceMemory::zeroed(gpu, host.len() * std::mem::size_of::<T>())?;
    mem.upload(gpu, &host)?;
    Ok((mem, host.into_iter().map(T::to_f64).collect()))
}

/// Our GEMM prepared as the all-gather + GEMM's ([`PreparedGemm::gathering`]) on one GPU: A
/// is the gather buffer, every row band but the first waits for a flag that is already up
/// (one look at it, then the fence that orders the loads after it), and the first band's rows
/// come from a copy of them given per call, as a rank's own chunk is
/// ([`PreparedGemm::launch_gather_call`]). What it costs beside the plain row is the gather's
/// bookkeeping alone, with no peer to wait for.
pub(crate) struct GatherRow {
    gemm: PreparedGemm,
    /// the first band's rows of A (the caller's own), and the flag every other band reads
    memory: [DeviceMemory; 2],
}

impl GatherRow {
    fn new(
        gpu: &Gpu,
        stream: &Stream,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        cap: u32,
    ) -> Result<GatherRow, CudaError> {
        let p = &plan.problem;
        let local_rows = p.m.min(plan.tile.m);
        let local_bytes = local_rows * p.k * p.input.size();
        let local = DeviceMemory::zeroed(gpu, local_bytes)?;
        let flag = DeviceMemory::zeroed(gpu, 8)?;
        // up for any call (flags hold at least the call's number)
        flag.upload(gpu, &[u64::MAX])?;
        // SAFETY: both regions hold the first rows of A on this GPU; synchronised below
        unsafe { stream.copy_async(local.addr(), ops.a, local_bytes)? };
        stream.synchronize()?;
        let bands = plan.tile_grid().0;
        let gather = Gather {
            band_flags: (0..bands)
                .map(|b| if b == 0 { 0 } else { flag.addr() })
                .collect(),
            local: 0..local_rows,
            timeout: std::time::Duration::from_secs(1),
        };
        let gemm = PreparedGemm::gathering(gpu, kernels, plan, ops, &gather, cap, 0)?;
        Ok(GatherRow {
            gemm,
            memory: [local, flag],
        })
    }

    fn launch(&self, stream: &Stream, b: u64, bias: Option<u64>, d: u64) -> Result<(), CudaError> {
        let a_local = self.memory[0].addr();
        // SAFETY: the operands, the local rows and the flag live on this GPU as long as the row
        unsafe {
            self.gemm
                .launch_gather_call(stream, a_local, b, bias, d, CallNumber::Host(1))
        }
    }
}

/// Our GEMM whose every tile folds `count` partials of the output type from local buffers
/// (the layout the fused reduce-scatter's owner tiles read: one [M, N] slot per partial, one
/// flag per tile and partial), their flags already up (the owner's epilogue at its cheapest,
/// with no peer to wait for) or raised during the call ([`FoldFlags::Paced`]). Each tile adds `count` partials, so the fold moves count·M·N
/// elements, at least as many as a P-rank call's owner tiles (P − 1 partials of M / P rows)
/// for count = 1 at any P. Partial values lie in ±[1, 2), so an element whose partial was
/// skipped or added twice is off by far more than its bound.
pub(crate) struct FoldRow {
    name: &'static str,
    flags: FoldFlags,
    gemm: PreparedGemm,
    /// the partials as uploaded, [count][M·N], widened
    partials: Vec<Vec<f64>>,
    /// the partials' slots and their flags
    memory: [DeviceMemory; 2],
}

/// How a fold row's flags go up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FoldFlags {
    /// Up before the call (the owner's fold at its cheapest)
    Up,
    /// Up before the call, and the partials asked of L2 halfway through each tile's main loop
    UpPrefetched,
    /// Raised during the call by a side kernel at the GEMM's pace ([`Pacer`])
    Paced,
    /// Paced, and the partials asked of L2 halfway through each tile's main loop (before their
    /// flags are up, where the side kernel has not raised them yet)
    PacedPrefetched,
}

impl FoldFlags {
    fn paced(self) -> bool {
        matches!(self, FoldFlags::Paced | FoldFlags::PacedPrefetched)
    }

    fn prefetched(self) -> bool {
        matches!(self, FoldFlags::UpPrefetched | FoldFlags::PacedPrefetched)
    }
}

/// Mirrors `PacedFlagsParams` in gemm.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PacedFlagsParams {
    flags: u64,
    order: u64,
    tiles: u32,
    count: u32,
    per_wave: u32,
    pad: u32,
    value: u64,
    wave_ns: u64,
    offset_ns: u64,
}
const _: () = assert!(std::mem::size_of::<PacedFlagsParams>() == 56);

/// Launches a paced fold row: the side kernel `raise_flags_paced` (one warp, on a side stream
/// that starts with the GEMM) raises the flags of the tiles of the GEMM's wave w at
/// `(w + offset) · wave_ns` after it starts, and the GEMM, its number one more each call,
/// waits for them: peers that finish each partial while the owner's tile is in its main loop
/// (`offset` < 1) rather than long before.
struct Pacer<'a> {
    row: &'a FoldRow,
    function: Function,
    side: &'a Stream,
    ready: Event,
    calls: std::cell::Cell<u64>,
    params: PacedFlagsParams,
}

impl<'a> Pacer<'a> {
    /// `tiles`: the row's plan's tiles; `wave_ns`: one wave's time; `offset`: when, in waves
    /// after its wave starts, a tile's flags go up.
    fn new(
        (gpu, kernels, side): (&Gpu, &GemmKernels, &'a Stream),
        row: &'a FoldRow,
        tiles: usize,
        (wave_ns, offset): (f64, f64),
    ) -> Result<Pacer<'a>, CudaError> {
        Ok(Pacer {
            row,
            function: kernels.paced_flags.clone(),
            side,
            ready: Event::new_untimed(gpu)?,
            calls: std::cell::Cell::new(0),
            params: PacedFlagsParams {
                flags: row.memory[1].addr(),
                order: row.gemm.order_addr(),
                tiles: tiles as u32,
                count: row.partials.len() as u32,
                per_wave: row.gemm.grid(),
                pad: 0,
                value: 0,
                wave_ns: wave_ns as u64,
                offset_ns: (offset * wave_ns) as u64,
            },
        })
    }

    /// One call: the side kernel after the stream's work so far (so that it starts with the
    /// GEMM), then the GEMM with the next call number.
    fn launch(&self, stream: &Stream) -> Result<(), CudaError> {
        let n = self.calls.get() + 1;
        self.calls.set(n);
        self.ready.record(stream)?;
        self.side.wait_event(&self.ready)?;
        let params = PacedFlagsParams {
            value: n,
            ..self.params
        };
        // SAFETY: the flags and the order live as long as the row, whose drop waits for the
        // side stream (the bench drains it first); the operands are the bench's
        unsafe {
            self.function
                .launch_with_smem(1, 32, 0, self.side, &params)?;
            self.row.gemm.launch_numbered(stream, n)
        }
    }
}

/// The median time in ms of `iters` calls of `launch` on `stream`, each between two events,
/// after `warmup` untimed ones; then `gemm`'s check (a wait that gave up is reported with
/// its stall report).
fn timed_median(
    gpu: &Gpu,
    stream: &Stream,
    gemm: Option<&PreparedGemm>,
    launch: &dyn Fn() -> Result<(), CudaError>,
    warmup: usize,
    iters: usize,
) -> Result<f64, CudaError> {
    let fail = |e| with_stall_report(e, gemm);
    for _ in 0..warmup {
        launch().map_err(fail)?;
    }
    let events: Vec<Event> = (0..=iters)
        .map(|_| Event::new(gpu))
        .collect::<Result<_, _>>()?;
    events[0].record(stream)?;
    for e in &events[1..] {
        launch().map_err(fail)?;
        e.record(stream)?;
    }
    stream.synchronize().map_err(fail)?;
    gemm.map_or(Ok(()), PreparedGemm::check)?;
    let mut times = events
        .windows(2)
        .map(|w| Ok(w[0].elapsed_ms(&w[1])? as f64))
        .collect::<Result<Vec<f64>, CudaError>>()?;
    Ok(rounds::median(&mut times).expect("at least one timed launch"))
}

impl FoldRow {
    fn new(
        gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        (count, flags, cap): (usize, FoldFlags, u32),
        seed: u64,
    ) -> Result<FoldRow, CudaError> {
        let name = match (count, flags) {
            (1, FoldFlags::Up) => "commfuse-fold1",
            (3, FoldFlags::Up) => "commfuse-fold3",
            (1, FoldFlags::UpPrefetched) => "commfuse-fold1-prefetch",
            (3, FoldFlags::UpPrefetched) => "commfuse-fold3-prefetch",
            (1, FoldFlags::Paced) => "commfuse-fold1-paced",
            (3, FoldFlags::Paced) => "commfuse-fold3-paced",
            (1, FoldFlags::PacedPrefetched) => "commfuse-fold1-paced-prefetch",
            (3, FoldFlags::PacedPrefetched) => "commfuse-fold3-paced-prefetch",
            _ => {
                return Err(CudaError::Unavailable(format!(
                    "a fold row takes 1 or 3 partials per tile, not {count}"
                )))
            }
        };
        let p = &plan.problem;
        let (len, eb) = (p.m * p.n, p.output.size() as u64);
        // one [M, N] slot per partial, contiguous, as a rank's receive slots are
        let values: Vec<f64> = (0..count * len)
            .map(|j| {
                let u = input_value(seed, 10 + j / len, j % len, ReduceOp::Sum) as f64;
                u.signum() * (1.0 + u.abs())
            })
            .collect();
        let (memory, rounded) = upload_output(gpu, p.output, &values)?;
        let partials: Vec<Vec<f64>> = rounded.chunks(len).map(<[f64]>::to_vec).collect();
        let tiles = plan.tile_count();
        // every flag already up (all bits set is past any call's number), or, for a paced row,
        // down until its side kernel raises it to the call's number
        let flag_words = DeviceMemory::zeroed(gpu, 8 * tiles * count)?;
        if !flags.paced() {
            flag_words.fill(gpu, 0xff)?;
        }
        let (_, tiles_n) = commfuse_core::gemm::tiles(p, TILE);
        let routes = (0..tiles)
            .map(|t| {
                let (row, col) = ((t / tiles_n) * TILE.m, (t % tiles_n) * TILE.n);
                let within = (row * p.n + col) as u64 * eb;
                TileRoute {
                    dst: within,
                    ld: p.n as u32,
                    options: ROUTE_DST_FROM_D,
                    fold_src: memory.addr() + within,
                    fold_stride: len as u64 * eb,
                    fold_flag: flag_words.addr() + 8 * t as u64,
                    fold_count: count as u32,
                    fold_ld: p.n as u32,
                    fold_flag_stride: 8 * tiles as u32,
                    ..TileRoute::default()
                }
            })
            .collect();
        // the partials' slots as one [count · M, N] matrix, which the kernel loads them from
        let source = FoldSource {
            base: memory.addr(),
            rows: count * p.m,
            ld: p.n,
        };
        let mut gemm = PreparedGemm::with_routes(
            gpu,
            kernels,
            plan,
            ops,
            routes,
            Some(source),
            count + 1,
            cap,
            0,
        )?;
        // halfway through a whole tile's main loop
        let half = if flags.prefetched() {
            p.k.div_ceil(super::BK).div_ceil(2) as u32
        } else {
            0
        };
        gemm.set_fold_prefetch(half);
        Ok(FoldRow {
            name,
            flags,
            gemm,
            partials,
            memory: [memory, flag_words],
        })
    }

    /// What the fold adds to element `index`: the partials' sum and the sum of their magnitudes.
    fn added(&self, index: usize) -> (f64, f64) {
        self.partials.iter().fold((0.0, 0.0), |(s, a), part| {
            (s + part[index], a + part[index].abs())
        })
    }
}

/// Our GEMM with routed epilogues, for the rows that store to the peer or raise flags.
struct Routed {
    local_flags: PreparedGemm,
    peer_noflag: PreparedGemm,
    peer: PreparedGemm,
    rs_half: PreparedGemm,
    /// rows of D the reduce-scatter pattern sends to the peer
    rs_rows: usize,
    d_peer: DeviceMemory,
    _flags: [DeviceMemory; 2],
}

impl Routed {
    fn new(
        gpu: &Gpu,
        peer_gpu: &Gpu,
        kernels: &GemmKernels,
        plan: &GemmPlan,
        ops: &GemmOperands,
        d_dev: &DeviceMemory,
    ) -> Result<Routed, CudaError> {
        gpu.enable_peer_access(peer_gpu)?;
        let p = &plan.problem;
        let tiles = plan.tile_count();
        let d_peer = DeviceMemory::zeroed(peer_gpu, p.m * p.n * p.output.size())?;
        let flags = [
            DeviceMemory::zeroed(gpu, 8 * tiles)?,
            DeviceMemory::zeroed(peer_gpu, 8 * tiles)?,
        ];
        let outputs = [d_dev.addr(), d_peer.addr()];
        let flag = |rank: usize, slot: Slot| flags[rank].addr() + 8 * slot.col as u64;
        let targets = RouteTargets {
            outputs: &outputs,
            flag: &flag,
        };
        // tile t keeps its place in D, on the rank `rank_of` names; Add 1 on its flag there
        let route = |rank_of: &dyn Fn(usize) -> usize, with_flags: bool, order: Vec<usize>| {
            let mut routed = plan.clone();
            routed.order = order;
            routed.route_in_place(rank_of, with_flags.then_some((0, NotifyOp::Add)));
            PreparedGemm::new(gpu, kernels, &routed, ops, Some(&targets), 0, 0)
        };
        let (tiles_m, tiles_n) = commfuse_core::gemm::tiles(p, TILE);
        let peer_tile_rows = tiles_m / 2;
        let is_remote = |t: usize| t / tiles_n < peer_tile_rows;
        let rs_order = staggered_remote_first(&plan.order, is_remote, gpu.sm_count as usize);
        Ok(Routed {
            local_flags: route(&|_| 0, true, plan.order.clone())?,
            peer_noflag: route(&|_| 1, false, plan.order.clone())?,
            peer: route(&|_| 1, true, plan.order.clone())?,
            rs_half: route(&|t| usize::from(is_remote(t)), true, rs_order)?,
            rs_rows: peer_tile_rows * TILE.m,
            d_peer,
            _flags: flags,
        })
    }
}

fn with_stall_report(e: CudaError, gemm: Option<&PreparedGemm>) -> CudaError {
    match gemm.and_then(|g| g.stall_report()) {
        Some(report) => CudaError::Unavailable(format!("{e}; {report}")),
        None => e,
    }
}

/// The parameters of reference_gemm.cu (its `ReferenceParams`).
#[repr(C)]
struct ReferenceParams {
    a: u64,
    b: u64,
    value: u64,
    abs_products: u64,
    m: u32,
    n: u32,
    k: u32,
    tiles_n: u32,
}

/// The tile and block of reference_gemm.cu (`reference::TILE`, `reference::THREADS`).
const REFERENCE_TILE: usize = 64;
const REFERENCE_THREADS: u32 = 256;

/// The reference GEMM of reference_gemm.cu loaded on one GPU: A·B in float64 and
/// Σ|a·b| per element, on CUDA cores (no code shared with the GEMMs it checks).
pub struct ReferenceGemm {
    /// bf16 nk, bf16 kn, f16 nk, f16 kn
    functions: [Function; 4],
    _module: Module,
}

impl ReferenceGemm {
    pub fn load(gpu: &Gpu) -> Result<ReferenceGemm, CudaError> {
        let source = nvrtc::kernel("reference_gemm.cu").expect("embedded");
        let module = Module::load(gpu, &nvrtc::compile(source, false)?.cubin)?;
        let functions = [
            module.function("reference_gemm_bf16_nk")?,
            module.function("reference_gemm_bf16_kn")?,
            module.function("reference_gemm_f16_nk")?,
            module.function("reference_gemm_f16_kn")?,
        ];
        Ok(ReferenceGemm {
            functions,
            _module: module,
        })
    }

    /// Enqueues on `stream`: `value` (f64 [M, N]) = A·B and `abs_products` (f32 [M, N]) =
    /// Σₖ|aᵢₖ·bₖⱼ|.
    ///
    /// # Safety
    /// `a` and `b` must hold the problem's operands and `value` and `abs_products` must have
    /// room for M·N elements, on this GPU, until the stream has run the kernel.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        p: &GemmProblem,
        a: u64,
        b: u64,
        value: u64,
        abs_products: u64,
    ) -> Result<(), CudaError> {
        let dim = |x: usize, name: &str| {
            u32::try_from(x).map_err(|_| {
                CudaError::Unavailable(format!("the reference GEMM takes {name} < 2^32, got {x}"))
            })
        };
        let tiles_n = p.n.div_ceil(REFERENCE_TILE);
        let grid = dim(p.m.div_ceil(REFERENCE_TILE) * tiles_n, "a tile count")?;
        let function = match (p.input, p.b_layout) {
            (DType::BF16, BLayout::NK) => &self.functions[0],
            (DType::BF16, BLayout::KN) => &self.functions[1],
            (DType::F16, BLayout::NK) => &self.functions[2],
            (DType::F16, BLayout::KN) => &self.functions[3],
            (DType::F32, _) => {
                return Err(CudaError::Unavailable("GEMM inputs are bf16 or f16".into()))
            }
        };
        let params = ReferenceParams {
            a,
            b,
            value,
            abs_products,
            m: dim(p.m, "M")?,
            n: dim(p.n, "N")?,
            k: dim(p.k, "K")?,
            tiles_n: dim(tiles_n, "a tile count")?,
        };
        function.launch(grid, REFERENCE_THREADS, stream, &params)
    }

    /// Runs the reference for `p` on `stream`, waits for it and brings it to the host.
    ///
    /// # Safety
    /// `a` and `b` must hold the problem's operands on this GPU.
    pub unsafe fn compute(
        &self,
        gpu: &Gpu,
        stream: &Stream,
        p: &GemmProblem,
        a: u64,
        b: u64,
    ) -> Result<DeviceReference, CudaError> {
        let elements = p.m * p.n;
        let value_dev = DeviceMemory::zeroed(gpu, elements * 8)?;
        let abs_dev = DeviceMemory::zeroed(gpu, elements * 4)?;
        self.launch(stream, p, a, b, value_dev.addr(), abs_dev.addr())?;
        stream.synchronize()?;
        let mut value = vec![0f64; elements];
        let mut abs_products = vec![0f32; elements];
        value_dev.download(gpu, &mut value)?;
        abs_dev.download(gpu, &mut abs_products)?;
        Ok(DeviceReference {
            value,
            abs_products,
        })
    }
}

/// A reference computed on the device, on the host: every element of D with the magnitude
/// its accumulation errors scale with.
pub struct DeviceReference {
    pub value: Vec<f64>,
    pub abs_products: Vec<f32>,
}

impl DeviceReference {
    /// Element `index` of D = A·B (alpha 1, no other epilogue term).
    pub fn element(&self, index: usize) -> ReferenceElement {
        ReferenceElement::product(self.value[index], self.abs_products[index] as f64)
    }

    /// Every element of `got` (D of the plain product A·B) against the reference, with
    /// `commfuse_core::gemm::element_bound`, split over the host's cores.
    pub fn check<TO: Element>(&self, p: &GemmProblem, got: &[TO]) -> ElementCheck {
        self.check_plus(p, got, &|_| (0.0, 0.0))
    }

    /// [`DeviceReference::check`] of D = A·B + X, where `added(i)` gives element i of X and
    /// the sum of the magnitudes of the terms it is made of (partials added in f32 before the
    /// output's cast, bounded like the epilogue's other terms).
    pub fn check_plus<TO: Element>(
        &self,
        p: &GemmProblem,
        got: &[TO],
        added: &(dyn Fn(usize) -> (f64, f64) + Sync),
    ) -> ElementCheck {
        assert_eq!(
            got.len(),
            self.value.len(),
            "one element per reference element"
        );
        let e = Epilogue::default();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunk = got.len().div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            let parts: Vec<_> = got
                .chunks(chunk)
                .enumerate()
                .map(|(c, part)| {
                    scope.spawn(move || {
                        let mut check = ElementCheck::default();
                        for (i, g) in part.iter().enumerate() {
                            let index = c * chunk + i;
                            let mut want = self.element(index);
                            let (value, abs) = added(index);
                            want.value += value;
                            want.abs_terms += abs;
                            check.add(p, &e, index, g.to_f64(), &want);
                        }
                        check
                    })
                })
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().expect("a check thread panicked"))
                .fold(ElementCheck::default(), ElementCheck::merge)
        })
    }
}
