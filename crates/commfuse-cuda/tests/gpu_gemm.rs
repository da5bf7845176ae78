//! Our GEMM on the GPU against a float64 reference: ragged shapes, both B layouts, every output
//! type, the whole epilogue, caller-chosen tile orders and SM caps, outputs poisoned first; and
//! the flag protocol across NVLink: a consumer on the other GPU that copies each tile the moment
//! its flag is up never sees a stale tile. Skips with a printed reason without GPUs.

use commfuse_core::gemm::TileShape;
use commfuse_core::gemm::{
    check_elements, grouped_order, reference_gemm, BLayout, ElementCheck, Epilogue, GemmPlan,
    GemmProblem, ReferenceElement,
};
use commfuse_core::plan::{NotifyOp, Slot};
use commfuse_core::{DType, Element};
use commfuse_cuda::backend::plan_table::ErrorRecord;
use commfuse_cuda::gemm::bench::{
    bench_gemm, DeviceReference, ExtraRows, GemmRow, ReferenceGemm, StreamGuard, TileOrder,
};
use commfuse_cuda::gemm::{
    CallNumber, FoldSource, Gather, GemmEntry, GemmKernels, GemmOperands, GemmVariant,
    PreparedGemm, RouteTargets, SmHolder, TailChoice, TileRoute, TileSnapshot, VariantChoice,
    MID_TILE, NARROW_DEEP_ROWS, NARROW_TILE, ROUTE_DST_FROM_D, SHORT_TILE, SKINNY_ROWS, TAIL_ENV,
    TILE,
};
use commfuse_cuda::sys::cublaslt::Lt;
use commfuse_cuda::sys::driver::{DeviceMemory, Gpu, MappedHost, Stream};
use half::{bf16, f16};
use std::time::{Duration, Instant};

fn gpus(needed: usize) -> bool {
    commfuse_cuda::testing::gpus(needed).is_some()
}

/// GPU 0 with the GEMM kernels loaded and a stream, or None (with the reason printed).
fn one_gpu() -> Option<(std::sync::Arc<Gpu>, GemmKernels, Stream)> {
    if !gpus(1) {
        return None;
    }
    let gpu = std::sync::Arc::new(Gpu::open(0).unwrap());
    let kernels = GemmKernels::load(&gpu).unwrap();
    let stream = Stream::new(&gpu).unwrap();
    Some((gpu, kernels, stream))
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec<T: Element>(&mut self, len: usize) -> Vec<T> {
        (0..len).map(|_| T::from_f32(self.uniform())).collect()
    }
    fn shuffle(&mut self, v: &mut [usize]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

fn upload<T: bytemuck::NoUninit>(gpu: &Gpu, host: &[T]) -> DeviceMemory {
    let mem = DeviceMemory::zeroed(gpu, std::mem::size_of_val(host)).unwrap();
    mem.upload(gpu, host).unwrap();
    mem
}

/// One call, waited for; a wait that gave up panics with the kernel's own report.
fn run(gemm: &PreparedGemm, stream: &Stream) {
    // SAFETY: the callers keep every operand alive past this synchronisation
    unsafe { gemm.launch(stream).unwrap() };
    if let Err(e) = stream.synchronize() {
        panic!("{e}: {:?}", gemm.stall_report());
    }
    if let Err(e) = gemm.check() {
        panic!("{e}");
    }
}

/// Every element of `got` against the float64 reference, with the element-wise bound.
fn check<TO: Element>(
    p: &GemmProblem,
    e: &Epilogue,
    got: &[TO],
    want: &[ReferenceElement],
) -> ElementCheck {
    check_elements(p, e, got.iter().map(|g| g.to_f64()), want)
}

#[derive(Clone, Copy, Debug)]
enum Case {
    Plain,
    /// alpha, beta·C, bias, a shuffled tile order, 7 SMs
    Full,
    /// D += alpha·A·B, grid capped at 3 SMs
    Accumulate,
    /// alpha alone (−1.5; no C, no bias): the plain epilogue's scaled writes
    Scaled,
    /// the bias alone (alpha 1, no C): the plain epilogue's writes with the bias added, columns
    /// past N reading the bias at N − 1
    Biased,
}

fn check_one<TI: Element, TO: Element>(
    gpu: &Gpu,
    kernels: &GemmKernels,
    stream: &Stream,
    p: GemmProblem,
    case: Case,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let a: Vec<TI> = rng.vec(p.m * p.k);
    let b: Vec<TI> = rng.vec(p.k * p.n);
    let c: Vec<TO> = rng.vec(p.m * p.n);
    let bias: Vec<TO> = rng.vec(p.n);
    let d0: Vec<TO> = rng.vec(p.m * p.n);
    let mut epilogue = Epilogue::default();
    let mut plan = GemmPlan::local(p, TILE, epilogue);
    let mut cap = 0;
    match case {
        Case::Plain => {}
        Case::Full => {
            epilogue = Epilogue {
                alpha: 0.5,
                beta: -0.75,
                bias: true,
                accumulate: false,
            };
            rng.shuffle(&mut plan.order);
            cap = 7;
        }
        Case::Accumulate => {
            epilogue.alpha = 2.0;
            epilogue.accumulate = true;
            plan.order = grouped_order(&p, TILE, 2);
            cap = 3;
        }
        Case::Scaled => epilogue.alpha = -1.5,
        Case::Biased => epilogue.bias = true,
    }
    plan.epilogue = epilogue;
    let (a_dev, b_dev, c_dev, bias_dev) = (
        upload(gpu, &a),
        upload(gpu, &b),
        upload(gpu, &c),
        upload(gpu, &bias),
    );
    let d_dev = DeviceMemory::zeroed(gpu, p.m * p.n * p.output.size()).unwrap();
    let ops = GemmOperands {
        a: a_dev.addr(),
        b: b_dev.addr(),
        c: Some(c_dev.addr()),
        bias: Some(bias_dev.addr()),
        d: d_dev.addr(),
    };
    let gemm = PreparedGemm::new(gpu, kernels, &plan, &ops, None, cap, 0).unwrap();
    let want = reference_gemm(&p, &epilogue, &a, &b, Some(&c), Some(&bias), Some(&d0));
    // two calls, each on a freshly poisoned (or freshly initialised) output
    for call in 0..2 {
        if epilogue.accumulate {
            d_dev.upload(gpu, &d0).unwrap();
        } else {
            d_dev.fill(gpu, 0xff).unwrap();
        }
        run(&gemm, stream);
        let mut got = vec![TO::from_f32(0.0); p.m * p.n];
        d_dev.download(gpu, &mut got).unwrap();
        let check = check(&p, &epilogue, &got, &want);
        assert!(
            check.passed(),
            "{case:?} {}×{}×{} B {:?} {}→{} call {call}: {check}",
            p.m,
            p.n,
            p.k,
            p.b_layout,
            p.input,
            p.output
        );
    }
}

/// The bench's fold rows (and paced ones), every build that fits forced beside the chosen one.
fn folds(folds: &[usize], paced: Option<f64>) -> ExtraRows<'_> {
    ExtraRows {
        folds,
        paced,
        builds: None,
        next_prefetch: None,
        k_phases: None,
        k_serpentine: false,
        bias: false,
        gather: false,
        trace: false,
        order: Default::default(),
        rs_ranks: &[],
        rs_ring: false,
        rs_prefetch: &[],
    }
}

/// The bench's gather rows (the all-gather + GEMM's GEMM on one GPU: bands past the first wait
/// for flags already up, the first band's rows from a copy given per call) on the main and the
/// direct build, each checked element by element against float64: one band (all of it the
/// caller's), three bands with a ragged last one, f32 output from B [K, N] with a bias, and a
/// large shape on all SMs and on 116 (the split tail's helpers and owners in the gather).
#[test]
fn gather_rows_pass_the_check() {
    if !gpus(1) {
        return;
    }
    for (m, n, k, layout, out, bias) in [
        (100, 1000, 136, BLayout::NK, DType::BF16, false),
        (300, 1000, 1544, BLayout::NK, DType::BF16, false),
        (300, 1000, 1544, BLayout::KN, DType::F32, true),
        (2048, 8192, 1024, BLayout::NK, DType::BF16, true),
    ] {
        let p = GemmProblem::new(m, n, k, layout, DType::BF16, out).unwrap();
        let extra = ExtraRows {
            gather: true,
            bias,
            builds: Some(&[]),
            ..folds(&[], None)
        };
        for sms in [0, 116] {
            let rows = bench_gemm(0, None, extra, &p, &[sms], 1, 1, 61 + m as u64).unwrap();
            let gather: Vec<_> = rows
                .iter()
                .filter(|r| r.implementation.starts_with("commfuse-gather"))
                .map(|r| (r.implementation.as_str(), r.build.as_deref()))
                .collect();
            assert_eq!(
                gather,
                [
                    ("commfuse-gather-main", Some("main")),
                    ("commfuse-gather-direct", Some("direct"))
                ],
                "{rows:?}"
            );
            for r in &rows {
                assert_eq!(
                    (r.checked, r.out_of_bound),
                    (m * n, 0),
                    "{m}x{n}x{k} {layout:?} {out:?} bias {bias} sms {sms}: {r:?}"
                );
            }
        }
    }
}

/// The bench's bias rows: every plain row (cuBLASLt's, the chosen build's and every build
/// forced beside it) adds a random bias row, and each is checked element by element against
/// the float64 product plus the bias as uploaded, at decode, ragged and large shapes, in both
/// B layouts and with 16-bit and f32 outputs; a bias beside fold rows is refused.
#[test]
fn bias_rows_pass_the_check() {
    if !gpus(1) {
        return;
    }
    for (m, n, k, layout, out) in [
        (16, 8192, 3584, BLayout::NK, DType::BF16),
        (200, 1000, 136, BLayout::NK, DType::BF16),
        (200, 1000, 136, BLayout::KN, DType::F32),
        (777, 4100, 520, BLayout::KN, DType::BF16),
        (2048, 8192, 1024, BLayout::NK, DType::BF16),
    ] {
        let p = GemmProblem::new(m, n, k, layout, DType::BF16, out).unwrap();
        let extra = ExtraRows {
            bias: true,
            ..folds(&[], None)
        };
        let rows = bench_gemm(0, None, extra, &p, &[0], 1, 1, 21 + m as u64).unwrap();
        assert!(rows.len() >= 3, "{rows:?}");
        assert!(
            rows.iter()
                .any(|r| r.implementation.starts_with("cublaslt")),
            "{rows:?}"
        );
        for r in &rows {
            assert!(r.bias, "{r:?}");
            assert_eq!(
                (r.checked, r.out_of_bound),
                (m * n, 0),
                "{layout:?} {out:?}: {r:?}"
            );
        }
    }
    let p = GemmProblem::new(256, 512, 64, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let extra = ExtraRows {
        bias: true,
        ..folds(&[1], None)
    };
    let refused = bench_gemm(0, None, extra, &p, &[0], 1, 1, 3).unwrap_err();
    assert!(refused.to_string().contains("bias rows"), "{refused}");
}

#[test]
fn gemm_matches_float64_reference_on_ragged_shapes() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let shapes = [
        (128, 256, 64),
        (200, 300, 136),
        (1, 7, 8),
        (257, 513, 72),
        (384, 1000, 520),
    ];
    let mut seed = 1;
    for (m, n, k) in shapes {
        for layout in [BLayout::NK, BLayout::KN] {
            for (input, output) in [
                (DType::BF16, DType::BF16),
                (DType::BF16, DType::F32),
                (DType::BF16, DType::F16),
                (DType::F16, DType::F16),
                (DType::F16, DType::F32),
            ] {
                for case in [
                    Case::Plain,
                    Case::Full,
                    Case::Accumulate,
                    Case::Scaled,
                    Case::Biased,
                ] {
                    let p = GemmProblem::new(m, n, k, layout, input, output).unwrap();
                    seed += 1;
                    match (input, output) {
                        (DType::BF16, DType::BF16) => {
                            check_one::<bf16, bf16>(&gpu, &kernels, &stream, p, case, seed)
                        }
                        (DType::BF16, DType::F32) => {
                            check_one::<bf16, f32>(&gpu, &kernels, &stream, p, case, seed)
                        }
                        (DType::BF16, DType::F16) => {
                            check_one::<bf16, f16>(&gpu, &kernels, &stream, p, case, seed)
                        }
                        (DType::F16, DType::F16) => {
                            check_one::<f16, f16>(&gpu, &kernels, &stream, p, case, seed)
                        }
                        _ => check_one::<f16, f32>(&gpu, &kernels, &stream, p, case, seed),
                    }
                }
            }
        }
    }
}

/// One case of a build for skinny products: the plan's tile ([`TILE`], [`NARROW_TILE`] or
/// [`SHORT_TILE`]), its row bands (`None`: bands of the tile's rows), the grid cap, and
/// the epilogue: [`Case::Plain`], [`Case::Full`] (alpha, beta·C, bias, a shuffled order) or
/// [`Case::Accumulate`] (D += 2·A·B: the storers' per-thread path), at the cap given.
#[derive(Clone, Copy, Debug)]
struct SkinnyCase {
    tile: TileShape,
    bands: Option<&'static [usize]>,
    cap: u32,
    epilogue: Case,
}

/// Prepares `p` under `choice`, checks the build chosen is `want`, runs it twice on a poisoned
/// output and checks every element against float64.
#[allow(clippy::too_many_arguments)]
fn check_variant<TI: Element, TO: Element>(
    gpu: &Gpu,
    kernels: &GemmKernels,
    stream: &Stream,
    p: GemmProblem,
    case: SkinnyCase,
    choice: VariantChoice,
    want_variant: GemmVariant,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let a: Vec<TI> = rng.vec(p.m * p.k);
    let b: Vec<TI> = rng.vec(p.k * p.n);
    let c: Vec<TO> = rng.vec(p.m * p.n);
    let bias: Vec<TO> = rng.vec(p.n);
    let d0: Vec<TO> = rng.vec(p.m * p.n);
    let epilogue = match case.epilogue {
        Case::Plain => Epilogue::default(),
        Case::Full => Epilogue {
            alpha: 0.5,
            beta: -0.75,
            bias: true,
            accumulate: false,
        },
        Case::Accumulate => Epilogue {
            alpha: 2.0,
            accumulate: true,
            ..Epilogue::default()
        },
        Case::Scaled => Epilogue {
            alpha: -1.5,
            ..Epilogue::default()
        },
        Case::Biased => Epilogue {
            bias: true,
            ..Epilogue::default()
        },
    };
    let mut plan = GemmPlan::local(p, case.tile, epilogue);
    if let Some(bands) = case.bands {
        plan.bands = Some(bands.to_vec());
        plan.order = (0..plan.tile_count()).collect();
    }
    if let Case::Full = case.epilogue {
        rng.shuffle(&mut plan.order);
    }
    let (a_dev, b_dev, c_dev, bias_dev) = (
        upload(gpu, &a),
        upload(gpu, &b),
        upload(gpu, &c),
        upload(gpu, &bias),
    );
    let d_dev = DeviceMemory::zeroed(gpu, p.m * p.n * p.output.size()).unwrap();
    let ops = GemmOperands {
        a: a_dev.addr(),
        b: b_dev.addr(),
        c: Some(c_dev.addr()),
        bias: Some(bias_dev.addr()),
        d: d_dev.addr(),
    };
    let gemm = kernels
        .with_choice(choice, || {
            PreparedGemm::new(gpu, kernels, &plan, &ops, None, case.cap, 0)
        })
        .unwrap();
    let what = format!(
        "{case:?} {choice:?} {}×{}×{} B {:?} {}→{}",
        p.m, p.n, p.k, p.b_layout, p.input, p.output
    );
    assert_eq!(gemm.variant(), want_variant, "{what}: the build chosen");
    // a plain entry (every option but alpha compiled out) where the call asks for no other
    // option and its tiles go out by tensor stores (a 16-bit D, rows of whole 16 bytes): the
    // one without the split tail where it has none, the one that keeps it where it has one
    // and the build has such entries
    let plain_options = want_variant.has_plain_entries()
        && p.output.size() == 2
        && p.n.is_multiple_of(8)
        && matches!(case.epilogue, Case::Plain | Case::Scaled)
        && case.bands.is_none();
    // else a routed entry (the other operators' options compiled out) where the call asks
    // for none of them (C, D +=) and the build has one for its types
    let routed_options = want_variant.has_routed_entries()
        && p.output == p.input
        && matches!(case.epilogue, Case::Plain | Case::Scaled | Case::Biased);
    let entry = match (plain_options, gemm.tail() == "none") {
        (true, true) => GemmEntry::Plain,
        (true, false) if want_variant.has_plain_tail_entries() => GemmEntry::PlainTail,
        _ if routed_options => GemmEntry::Routed,
        _ => GemmEntry::General,
    };
    assert_eq!(gemm.entry(), entry, "{what}: the entry run");
    // and then the same GEMM through its general entry, checked the same way
    let general = (entry != GemmEntry::General).then(|| {
        let mut g = kernels
            .with_choice(choice, || {
                PreparedGemm::new(gpu, kernels, &plan, &ops, None, case.cap, 0)
            })
            .unwrap();
        g.use_general_entry();
        assert_eq!(
            g.entry(),
            GemmEntry::General,
            "{what}: the plain and routed entries turned off"
        );
        g
    });
    let want = reference_gemm(&p, &epilogue, &a, &b, Some(&c), Some(&bias), Some(&d0));
    for (entry, g) in
        std::iter::once(("", &gemm)).chain(general.iter().map(|g| (" (general entry)", g)))
    {
        for call in 0..2 {
            if epilogue.accumulate {
                d_dev.upload(gpu, &d0).unwrap();
            } else {
                d_dev.fill(gpu, 0xff).unwrap();
            }
            run(g, stream);
            let mut got = vec![TO::from_f32(0.0); p.m * p.n];
            d_dev.download(gpu, &mut got).unwrap();
            let check = check(&p, &epilogue, &got, &want);
            assert!(check.passed(), "{what}{entry} call {call}: {check}");
        }
    }
    // a call that names another D (the direct build encodes its tensor map of D again) writes
    // that D and leaves the prepared one alone
    if p.b_layout == BLayout::KN && !p.n.is_multiple_of(8) {
        return; // (B is padded when prepared: such a GEMM takes no other operands per call)
    }
    let before = download::<TO>(gpu, &d_dev, p.m * p.n);
    let other = DeviceMemory::zeroed(gpu, p.m * p.n * p.output.size()).unwrap();
    if epilogue.accumulate {
        other.upload(gpu, &d0).unwrap();
    } else {
        other.fill(gpu, 0xff).unwrap();
    }
    let bias = epilogue.bias.then(|| bias_dev.addr());
    // SAFETY: every operand lives past the synchronisation below
    unsafe {
        gemm.launch_call(
            stream,
            a_dev.addr(),
            b_dev.addr(),
            bias,
            Some(other.addr()),
            CallNumber::Host(1),
        )
        .unwrap();
    }
    stream.synchronize().unwrap();
    gemm.check().unwrap();
    let check = check(
        &p,
        &epilogue,
        &download::<TO>(gpu, &other, p.m * p.n),
        &want,
    );
    assert!(check.passed(), "{what}, D named by the call: {check}");
    let after = download::<TO>(gpu, &d_dev, p.m * p.n);
    assert!(
        bytemuck::cast_slice::<TO, u8>(&before) == bytemuck::cast_slice::<TO, u8>(&after),
        "{what}: a call that named another D wrote the prepared one"
    );
}

fn download<T: Element>(gpu: &Gpu, mem: &DeviceMemory, len: usize) -> Vec<T> {
    let mut out = vec![T::from_f32(0.0); len];
    mem.download(gpu, &mut out).unwrap();
    out
}

/// [`check_variant`] in the problem's input and output types.
fn check_variant_of_types(
    gpu: &Gpu,
    kernels: &GemmKernels,
    stream: &Stream,
    p: GemmProblem,
    case: SkinnyCase,
    (choice, want): (VariantChoice, GemmVariant),
    seed: u64,
) {
    match (p.input, p.output) {
        (DType::BF16, DType::BF16) => {
            check_variant::<bf16, bf16>(gpu, kernels, stream, p, case, choice, want, seed)
        }
        (DType::BF16, DType::F32) => {
            check_variant::<bf16, f32>(gpu, kernels, stream, p, case, choice, want, seed)
        }
        (DType::F16, DType::F16) => {
            check_variant::<f16, f16>(gpu, kernels, stream, p, case, choice, want, seed)
        }
        _ => check_variant::<f16, f32>(gpu, kernels, stream, p, case, choice, want, seed),
    }
}

/// The type pairs the builds' tests run: bf16 and f32 outputs from bf16, f32 from f16.
const THREE_TYPES: [(DType, DType); 3] = [
    (DType::BF16, DType::BF16),
    (DType::BF16, DType::F32),
    (DType::F16, DType::F32),
];
/// The grid caps and epilogues the builds' tests run: every SM with a plain and a full
/// epilogue, then 4 and 3 SMs with the full one, 3 with D += 2·A·B, 4 with alpha alone and 5
/// with the bias alone.
const RUNS: [(u32, Case); 7] = [
    (0, Case::Plain),
    (0, Case::Full),
    (4, Case::Full),
    (3, Case::Full),
    (3, Case::Accumulate),
    (4, Case::Scaled),
    (5, Case::Biased),
];

/// The runs of a plain GEMM with rows of whole 16-byte units (N = 1024 of a 16-bit output),
/// which take a build's plain entries: 16 narrow tiles on every SM (cut along K: the plain
/// entry with the split tail where the build has one), on 4 SMs with alpha (four whole waves:
/// the plain entry) and on 3 (five whole waves, the last tile cut in two).
const PLAIN_RUNS: [(u32, Case); 3] = [(0, Case::Plain), (4, Case::Scaled), (3, Case::Plain)];
const BF16_OUT: [(DType, DType); 1] = [(DType::BF16, DType::BF16)];

/// `f` for M × `n` × 1544 (24 k-blocks and a part) in tiles of `tile`, both B layouts, every
/// type pair of `types` and every (cap, epilogue) of `runs`.
fn for_each_case(
    m: usize,
    n: usize,
    tile: TileShape,
    types: &[(DType, DType)],
    runs: &[(u32, Case)],
    mut f: impl FnMut(GemmProblem, SkinnyCase),
) {
    for layout in [BLayout::NK, BLayout::KN] {
        for &(input, output) in types {
            let p = GemmProblem::new(m, n, 1544, layout, input, output).unwrap();
            for &(cap, epilogue) in runs {
                let bands = None;
                f(
                    p,
                    SkinnyCase {
                        tile,
                        bands,
                        cap,
                        epilogue,
                    },
                );
            }
        }
    }
}

/// The skinny build (tiles of at most 64 rows: one consumer warpgroup, 64-row A boxes, four
/// stages), chosen by default wherever it fits, against float64 over every element: M = 1, 16,
/// 33 and 64 with ragged N and K (4 column tiles, 24 k-blocks and a part), both B layouts,
/// bf16 and f32 outputs from bf16 and f16 inputs; on every SM (the 4 tiles cut into 4 K-parts)
/// with a plain and a full epilogue (alpha, beta·C, bias, a shuffled order), on 4 SMs (one
/// whole wave, no cut) with the full one, and on 3 (one whole wave, then the last tile cut
/// into 3 parts) with the full one and D += 2·A·B (the storers' per-thread path); then row
/// bands of at most 64 rows in a taller M (40, 60 and 30 rows: M = 130); and the builds each
/// plan must take: forced main, forced skinny where it fits, and the main build for a 65-row
/// tile or a band of 65 rows even when the skinny one is asked for.
#[test]
fn skinny_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let mut seed = 500;
    let mut each = |p: GemmProblem, case: SkinnyCase, choice, want| {
        seed += 1;
        check_variant_of_types(&gpu, &kernels, &stream, p, case, (choice, want), seed);
    };
    let auto = VariantChoice::Auto;
    for m in [1, 16, 33, SKINNY_ROWS] {
        for_each_case(m, 1000, TILE, &THREE_TYPES, &RUNS, |p, case| {
            each(p, case, auto, GemmVariant::Skinny)
        });
    }
    let banded: &[usize] = &[0, 40, 100, 130];
    for layout in [BLayout::NK, BLayout::KN] {
        let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
        for cap in [0, 5] {
            let case = SkinnyCase {
                tile: TILE,
                bands: Some(banded),
                cap,
                epilogue: Case::Full,
            };
            each(p, case, auto, GemmVariant::Skinny);
            each(p, case, VariantChoice::Main, GemmVariant::Main);
        }
    }
    let p = GemmProblem::new(16, 1000, 1544, BLayout::NK, DType::BF16, DType::F32).unwrap();
    let case = SkinnyCase {
        tile: TILE,
        bands: None,
        cap: 0,
        epilogue: Case::Full,
    };
    each(p, case, VariantChoice::Main, GemmVariant::Main);
    each(p, case, VariantChoice::Skinny, GemmVariant::Skinny);
    // one row too many for the skinny build: a 65-row tile, a 65-row band
    let p = GemmProblem::new(65, 1000, 1544, BLayout::NK, DType::BF16, DType::F32).unwrap();
    each(p, case, VariantChoice::Skinny, GemmVariant::Main);
    let p = GemmProblem::new(130, 1000, 1544, BLayout::KN, DType::BF16, DType::BF16).unwrap();
    let case = SkinnyCase {
        tile: TILE,
        bands: Some(&[0, 65, 130]),
        cap: 0,
        epilogue: Case::Full,
    };
    each(p, case, VariantChoice::Skinny, GemmVariant::Main);
}

/// The narrow builds (128×64 tiles, wgmma m64n64k16, 8 stages: 64 rows on one consumer
/// warpgroup, or all 128 on two), chosen for a plan of narrow tiles, against float64 over every
/// element: M = 1, 16, 33 and 64 (the narrow build) and 65, 100, 128 and 256 (narrow-tall) with N =
/// 1000 (16 column tiles, the last one 40 wide) and K = 1544 (24 k-blocks and a part), both B
/// layouts, bf16 and f32 outputs from bf16 and f16 inputs; on every SM (the 16 tiles cut into 2
/// K-parts) with a plain and a full epilogue (alpha, beta·C, bias, a shuffled order), on 4 SMs
/// (four whole waves) with the full one, and on 3 (five whole waves, then the last tile cut in
/// two) with the full one and D += 2·A·B (the storers' per-thread path); the plain runs at N =
/// 1024 ([`PLAIN_RUNS`]: the plain entries, with and without the split tail); then row bands of at
/// most 64 rows in a taller M (40, 60 and 30 rows: M = 130), on the narrow build by default and
/// on the narrow-tall one forced; and one band of 65 rows, which only the narrow-tall build
/// computes.
#[test]
fn narrow_builds_match_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let mut seed = 900;
    let mut each = |p: GemmProblem, case: SkinnyCase, choice, want| {
        seed += 1;
        check_variant_of_types(&gpu, &kernels, &stream, p, case, (choice, want), seed);
    };
    let auto = VariantChoice::Auto;
    // (256: two whole bands of narrow tiles, as `auto` plans them where narrow_bands_pay)
    for m in [1, 16, 33, SKINNY_ROWS, 65, 100, 128, 256] {
        let want = if m <= NARROW_DEEP_ROWS {
            GemmVariant::NarrowDeep
        } else if m <= SKINNY_ROWS {
            GemmVariant::Narrow
        } else {
            GemmVariant::NarrowTall
        };
        for_each_case(m, 1000, NARROW_TILE, &THREE_TYPES, &RUNS, |p, case| {
            each(p, case, auto, want)
        });
        for_each_case(m, 1024, NARROW_TILE, &BF16_OUT, &PLAIN_RUNS, |p, case| {
            each(p, case, auto, want)
        });
    }
    let banded: &[usize] = &[0, 40, 100, 130];
    for layout in [BLayout::NK, BLayout::KN] {
        let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
        for cap in [0, 5] {
            let case = SkinnyCase {
                tile: NARROW_TILE,
                bands: Some(banded),
                cap,
                epilogue: Case::Full,
            };
            each(p, case, auto, GemmVariant::Narrow);
            each(p, case, VariantChoice::Main, GemmVariant::NarrowTall);
        }
    }
    let p = GemmProblem::new(130, 1000, 1544, BLayout::KN, DType::F16, DType::F16).unwrap();
    let case = SkinnyCase {
        tile: NARROW_TILE,
        bands: Some(&[0, 65, 130]),
        cap: 0,
        epilogue: Case::Full,
    };
    each(p, case, VariantChoice::Narrow, GemmVariant::NarrowTall);
    // narrow tiles store into D only: routes on them are refused, naming the tiles that take them
    for m in [16, 100] {
        let refused = refused_routes(&gpu, &kernels, m, NARROW_TILE);
        assert!(
            refused.contains("narrow") && refused.contains("store into D only"),
            "{refused}"
        );
    }
}

/// The error of a GEMM prepared with routes (a partial folded into each tile) on a plan of
/// `tile`s of M × 1000 × 128, which the builds that store into D only refuse.
fn refused_routes(gpu: &Gpu, kernels: &GemmKernels, m: usize, tile: TileShape) -> String {
    let p = GemmProblem::new(m, 1000, 128, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let PlainBf16 {
        mut plan,
        ops,
        a_dev: _a,
        b_dev: _b,
        d_dev: _d,
        ..
    } = PlainBf16::new(gpu, p, 7);
    plan.tile = tile;
    plan.order = (0..plan.tile_count()).collect();
    let (partial, flags) = (
        DeviceMemory::zeroed(gpu, m * 1000 * 2).unwrap(),
        DeviceMemory::zeroed(gpu, 8 * plan.tile_count()).unwrap(),
    );
    let (routes, _) = fold_one_partial(&plan, &partial, &flags);
    PreparedGemm::with_routes(gpu, kernels, &plan, &ops, routes, None, 1, 0, 0)
        .err()
        .expect("tiles that store into D only, with routes")
        .to_string()
}

/// The short build (64×128 tiles, wgmma m64n128k16 on one consumer warpgroup, 8 stages), which
/// a plan of short tiles takes, against float64 over every element: M = 1, 33, 64, 65, 100,
/// 192 and 256 (one to four bands of 64 rows, the last of 1, 33, 1 or 36 rows where M is not a
/// multiple of 64) with N = 1000 (8 column tiles, the last one 104 wide) and K = 1544 (24
/// k-blocks and a part), both B layouts, bf16 and f32 outputs from bf16 and f16 inputs, every
/// run of [`RUNS`] (every SM with the tiles cut into two K-parts, 4 and 3 SMs: whole waves,
/// then a cut last one; D += 2·A·B; alpha alone; the bias alone); the plain runs at N = 1024
/// ([`PLAIN_RUNS`]: the plain entries, with and without the split tail); row bands of at most
/// 64 rows (40, 60 and 30 rows: M = 130) on every SM and on 5; and routes refused, naming the
/// build.
#[test]
fn short_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let mut seed = 1300;
    let mut each = |p: GemmProblem, case: SkinnyCase| {
        seed += 1;
        let want = (VariantChoice::Short, GemmVariant::Short);
        check_variant_of_types(&gpu, &kernels, &stream, p, case, want, seed);
    };
    for m in [1, 33, 64, 65, 100, 192, 256] {
        for_each_case(m, 1000, SHORT_TILE, &THREE_TYPES, &RUNS, &mut each);
        for_each_case(m, 1024, SHORT_TILE, &BF16_OUT, &PLAIN_RUNS, &mut each);
    }
    let banded: &[usize] = &[0, 40, 100, 130];
    for layout in [BLayout::NK, BLayout::KN] {
        let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
        for cap in [0, 5] {
            let case = SkinnyCase {
                tile: SHORT_TILE,
                bands: Some(banded),
                cap,
                epilogue: Case::Full,
            };
            each(p, case);
        }
    }
    let refused = refused_routes(&gpu, &kernels, 100, SHORT_TILE);
    assert!(
        refused.contains("short build's 64×128 tiles store into D only"),
        "{refused}"
    );
}

/// A build of narrow tiles with at most 64 rows (`build`, which `choice` takes), forced, against
/// float64 over every element: the narrow build's cases (M = 1, 16, 33, 64; N = 1000, K = 1544:
/// 24 k-blocks and a part), every run of them (every SM with two K-parts, 4 and 3 SMs) and their
/// type pairs, and its plain runs at N = 1024 ([`PLAIN_RUNS`]); row bands of at most 64 rows; and, with `short_k`, K of one to three k-blocks
/// (K = 40, 64, 128, 192) at 48 rows on every SM.
fn check_narrow_build(
    (gpu, kernels, stream): (&Gpu, &GemmKernels, &Stream),
    build: (VariantChoice, GemmVariant),
    short_k: bool,
    mut seed: u64,
) {
    let mut each = |p: GemmProblem, case: SkinnyCase| {
        seed += 1;
        check_variant_of_types(gpu, kernels, stream, p, case, build, seed);
    };
    for m in [1, 16, 33, SKINNY_ROWS] {
        for_each_case(m, 1000, NARROW_TILE, &THREE_TYPES, &RUNS, &mut each);
        for_each_case(m, 1024, NARROW_TILE, &BF16_OUT, &PLAIN_RUNS, &mut each);
    }
    let case = |bands, cap| SkinnyCase {
        tile: NARROW_TILE,
        bands,
        cap,
        epilogue: Case::Full,
    };
    for layout in [BLayout::NK, BLayout::KN] {
        let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
        each(p, case(Some(&[0, 40, 100, 130]), 5));
        for k in [40, 64, 128, 192].into_iter().filter(|_| short_k) {
            let p = GemmProblem::new(48, 1000, k, layout, DType::BF16, DType::BF16).unwrap();
            each(p, case(None, 0));
        }
    }
}

/// The narrow-deep build (the narrow build on twelve stages) by [`check_narrow_build`]: K =
/// 1544 goes twice round the twelve stages.
#[test]
fn narrow_deep_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let build = (VariantChoice::NarrowDeep, GemmVariant::NarrowDeep);
    check_narrow_build((&gpu, &kernels, &stream), build, false, 950);
}

/// The narrow-sliced build (the narrow-deep build with each unit's k-blocks taken in turn by
/// two consumer warpgroups, whose sums meet before the epilogue) by [`check_narrow_build`]:
/// K = 1544 is 25 k-blocks, an odd count, so the slices differ by one; two K-parts are each
/// sliced from their own first k-block; with K of one k-block the second warpgroup has none
/// and hands over zeros.
#[test]
fn narrow_sliced_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let build = (VariantChoice::NarrowSliced, GemmVariant::NarrowSliced);
    check_narrow_build((&gpu, &kernels, &stream), build, true, 970);
}

/// Every type pair of the builds that serve plain GEMMs only.
const FOUR_TYPES: [(DType, DType); 4] = [
    (DType::BF16, DType::BF16),
    (DType::BF16, DType::F32),
    (DType::F16, DType::F16),
    (DType::F16, DType::F32),
];

/// A build of 128 × 256 tiles for plain GEMMs (`want`, which `choice` takes), forced, against
/// float64 over every element: M = 65, 300 and 1000 (one, three and eight tile rows) with
/// N = 1000 (a last tile 232 wide) and N = 600 (88 wide), K = 1544 (24 k-blocks and a part),
/// both B layouts, every pair of types, each (SM cap, epilogue) of `runs`; then row bands of 65
/// and 65 rows (the build) and of at most 64 (the skinny build, which the choice takes there).
fn check_plain_wide_build(
    (gpu, kernels, stream): (&Gpu, &GemmKernels, &Stream),
    (choice, want): (VariantChoice, GemmVariant),
    runs: &[(u32, Case)],
    mut seed: u64,
) {
    let mut each = |p: GemmProblem, case: SkinnyCase, want| {
        seed += 1;
        check_variant_of_types(gpu, kernels, stream, p, case, (choice, want), seed);
    };
    for (m, n) in [(65, 1000), (300, 600), (1000, 1000)] {
        for_each_case(m, n, TILE, &FOUR_TYPES, runs, |p, case| each(p, case, want));
    }
    for (bands, want) in [
        (&[0, 65, 130][..], want),
        (&[0, 40, 100, 130][..], GemmVariant::Skinny),
    ] {
        for layout in [BLayout::NK, BLayout::KN] {
            let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
            let case = SkinnyCase {
                tile: TILE,
                bands: Some(bands),
                cap: 0,
                epilogue: Case::Full,
            };
            each(p, case, want);
        }
    }
}

/// The pair build (the main build in clusters of two blocks sharing each k-block of B by TMA
/// multicast), forced, by [`check_plain_wide_build`]: odd tile rows leave a column's last tile
/// with an idle partner, and at N = 600 the second block's half of B lies wholly past N and
/// lands as zeros; on every SM with a plain and a full epilogue (alpha, beta·C, bias, a shuffled
/// order: most tiles then find no partner of their column nearby and pair with an idle entry),
/// on 4 SMs (two clusters, many waves) with the full one, and on 3 (rounded down to one cluster)
/// with D += 2·A·B.
#[test]
fn pair_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let runs = [
        (0, Case::Plain),
        (0, Case::Full),
        (4, Case::Full),
        (3, Case::Accumulate),
        (4, Case::Scaled),
        (5, Case::Biased),
    ];
    let build = (VariantChoice::Pair, GemmVariant::Pair);
    check_plain_wide_build((&gpu, &kernels, &stream), build, &runs, 1300);
}

/// The mid build (128×128 tiles), against float64 over every element: M = 1, 65, 300 and
/// 1000 with N = 1000 (a last tile 104 wide) and N = 600 (88 wide), K = 1544, both B layouts,
/// the three type pairs, on every SM with a plain and a full epilogue, on 4 and 3 SMs (many
/// waves, with a split tail) with the full one and on 3 with D += 2·A·B; then row bands of
/// 40, 60 and 30 rows, planned with mid tiles and run on the mid build.
#[test]
fn mid_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let mut seed = 1500;
    let mut each = |p: GemmProblem, case: SkinnyCase, choice, want| {
        seed += 1;
        check_variant_of_types(&gpu, &kernels, &stream, p, case, (choice, want), seed);
    };
    for (m, n) in [(1, 1000), (65, 600), (300, 1000), (1000, 600)] {
        for_each_case(m, n, MID_TILE, &THREE_TYPES, &RUNS, |p, case| {
            each(p, case, VariantChoice::Mid, GemmVariant::Mid)
        });
    }
    for layout in [BLayout::NK, BLayout::KN] {
        let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
        let case = SkinnyCase {
            tile: MID_TILE,
            bands: Some(&[0, 40, 100, 130]),
            cap: 0,
            epilogue: Case::Full,
        };
        each(p, case, VariantChoice::Mid, GemmVariant::Mid);
    }
}

/// The direct build (the consumers store each tile from their registers; four stages),
/// forced, by [`check_plain_wide_build`] with every SM and a plain and a full epilogue, 4 and 3
/// SMs (split tails) with the full one and 3 with D += 2·A·B; then an odd N (999: the last
/// column of each row stored alone).
#[test]
fn direct_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let build = (VariantChoice::Direct, GemmVariant::Direct);
    check_plain_wide_build((&gpu, &kernels, &stream), build, &RUNS, 1700);
    let mut seed = 1800;
    for_each_case(300, 999, TILE, &THREE_TYPES[..1], &RUNS[..2], |p, case| {
        seed += 1;
        check_variant_of_types(&gpu, &kernels, &stream, p, case, build, seed);
    });
}

/// The ping-pong build (128×128 tiles, each consumer warpgroup on whole tiles of its own, the
/// two taking a block's units in turn), forced, by [`check_direct_mid_tile_build`]: on 4 and 3
/// SMs a block runs many tiles and the warpgroups take turns round the six stages, with no
/// split tail; with K of one to three k-blocks a unit has fewer k-blocks than stages.
#[test]
fn ping_pong_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let build = (VariantChoice::PingPong, GemmVariant::PingPong);
    check_direct_mid_tile_build((&gpu, &kernels, &stream), build, 1900);
}

/// The wide ping-pong build (128×192 tiles, 192 accumulators a thread, each consumer warpgroup
/// on whole tiles of its own in turns, four stages), forced, by [`check_direct_mid_tile_build`]:
/// the ping-pong build's cases on its tile (N = 600, 999 and 1000 end in part of a tile; on 4
/// and 3 SMs a block runs many tiles round the four stages).
#[test]
fn ping_pong_wide_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let build = (VariantChoice::PingPongWide, GemmVariant::PingPongWide);
    check_direct_mid_tile_build((&gpu, &kernels, &stream), build, 2100);
}

/// The mid-direct build (the ping-pong build's 128×128 tiles, six stages and boxes, both
/// consumer warpgroups on each tile), forced, by [`check_direct_mid_tile_build`]: split tails
/// on 4 and 3 SMs, D += 2·A·B on 3, a one-wave product whole (M = 1, 65: one partial wave).
#[test]
fn mid_direct_build_matches_float64_reference() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let build = (VariantChoice::MidDirect, GemmVariant::MidDirect);
    check_direct_mid_tile_build((&gpu, &kernels, &stream), build, 2000);
}

/// A build of 128×128 tiles (or the wide ping-pong build's 128×192) that stores them into D
/// itself (`build`, which its choice takes), forced, against float64 over every element: the
/// mid build's cases (M = 1, 65, 300, 1000;
/// N = 1000 and 600; every SM, and 4 and 3 SMs; D += 2·A·B on 3), B [K, N] with N = 999
/// (padded B, the last column of D stored from registers), K of one to three k-blocks on 3 SMs
/// (K = 40, 64, 136, 192), and row bands of 40, 60 and 30 rows (boxes that would overrun a
/// band: their rows stored from registers).
fn check_direct_mid_tile_build(
    (gpu, kernels, stream): (&Gpu, &GemmKernels, &Stream),
    build: (VariantChoice, GemmVariant),
    mut seed: u64,
) {
    let tile = build.1.tile();
    let mut each = |p: GemmProblem, case: SkinnyCase| {
        seed += 1;
        check_variant_of_types(gpu, kernels, stream, p, case, build, seed);
    };
    for (m, n) in [(1, 1000), (65, 600), (300, 1000), (1000, 600)] {
        for_each_case(m, n, tile, &THREE_TYPES, &RUNS, &mut each);
    }
    for_each_case(300, 999, tile, &THREE_TYPES[..1], &RUNS[..2], &mut each);
    for layout in [BLayout::NK, BLayout::KN] {
        for k in [40, 64, 136, 192] {
            let p = GemmProblem::new(1000, 1000, k, layout, DType::BF16, DType::BF16).unwrap();
            let case = SkinnyCase {
                tile,
                bands: None,
                cap: 3,
                epilogue: Case::Full,
            };
            each(p, case);
        }
        let p = GemmProblem::new(130, 1000, 1544, layout, DType::BF16, DType::BF16).unwrap();
        let case = SkinnyCase {
            tile,
            bands: Some(&[0, 40, 100, 130]),
            cap: 0,
            epilogue: Case::Full,
        };
        each(p, case);
    }
}

/// A plain bf16 GEMM (no epilogue) on fresh random operands: A, B and D on the GPU, its plan
/// of [`TILE`]s, its operands and its float64 reference.
struct PlainBf16 {
    a_dev: DeviceMemory,
    b_dev: DeviceMemory,
    d_dev: DeviceMemory,
    plan: GemmPlan,
    ops: GemmOperands,
    want: Vec<ReferenceElement>,
}

impl PlainBf16 {
    fn new(gpu: &Gpu, p: GemmProblem, seed: u64) -> PlainBf16 {
        let mut rng = Rng(seed);
        let a: Vec<bf16> = rng.vec(p.m * p.k);
        let b: Vec<bf16> = rng.vec(p.k * p.n);
        let (a_dev, b_dev) = (upload(gpu, &a), upload(gpu, &b));
        let d_dev = DeviceMemory::zeroed(gpu, p.m * p.n * 2).unwrap();
        let plan = GemmPlan::local(p, TILE, Epilogue::default());
        let ops = GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_dev.addr());
        let want = reference_gemm::<bf16, bf16>(&p, &Epilogue::default(), &a, &b, None, None, None);
        PlainBf16 {
            a_dev,
            b_dev,
            d_dev,
            plan,
            ops,
            want,
        }
    }
}

/// `plan` prepared with the build `choice` forces, which must be `variant`.
fn forced(
    gpu: &std::sync::Arc<Gpu>,
    kernels: &GemmKernels,
    plan: &GemmPlan,
    ops: &GemmOperands,
    (choice, variant): (VariantChoice, GemmVariant),
) -> PreparedGemm {
    kernels.set_choice(choice);
    let gemm = PreparedGemm::new(gpu, kernels, plan, ops, None, 0, 0);
    kernels.set_choice(VariantChoice::Auto);
    let gemm = gemm.unwrap();
    assert_eq!(gemm.variant(), variant);
    gemm
}

/// Plain GEMMs numbered on the device (a CUDA graph replays the same launch as new calls): the
/// main and the direct build, five calls of 300 × 1000 × 1544 queued back to back with
/// [`CallNumber::Device`], each into D poisoned before, the last checked against float64 over
/// every element; every block counts itself finished, so the counter says five calls.
#[test]
fn plain_gemms_numbered_on_the_device_advance_the_counter() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(300, 1000, 1544, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let PlainBf16 {
        a_dev,
        b_dev,
        d_dev,
        plan,
        ops,
        want,
    } = PlainBf16::new(&gpu, p, 91);
    for (choice, variant) in [
        (VariantChoice::Main, GemmVariant::Main),
        (VariantChoice::Direct, GemmVariant::Direct),
    ] {
        let gemm = forced(&gpu, &kernels, &plan, &ops, (choice, variant));
        // CallCounter: the last call finished (u64), blocks finished of the running one (u32)
        let counter = DeviceMemory::zeroed(&gpu, 16).unwrap();
        let calls = 5;
        for _ in 0..calls {
            let call = CallNumber::Device {
                counter: counter.addr(),
                routes_alt: 0,
            };
            // SAFETY: D and the operands live past the synchronisation below
            unsafe {
                stream
                    .fill_async(d_dev.addr(), 0xff, d_dev.len_bytes())
                    .unwrap();
                gemm.launch_call(&stream, a_dev.addr(), b_dev.addr(), None, None, call)
                    .unwrap()
            };
        }
        stream.synchronize().unwrap();
        gemm.check().unwrap();
        let mut words = [0u64; 2];
        counter.download(&gpu, &mut words).unwrap();
        assert_eq!(
            (words[0], words[1] & 0xffff_ffff),
            (calls, 0),
            "{variant:?}: the counter after {calls} calls (last, blocks finished)"
        );
        let got = download::<bf16>(&gpu, &d_dev, p.m * p.n);
        let check = check(&p, &Epilogue::default(), &got, &want);
        assert!(check.passed(), "{variant:?}: {check}");
    }
}

/// Runs `launch` (a call of `gemm` into the 16-bit `d_dev`, poisoned first) whose wait is to
/// give up: its synchronisation succeeds, it ends within 2 s, it stores nothing, and `check`
/// fails; returns what `check` said.
fn gave_up(
    gpu: &Gpu,
    stream: &Stream,
    gemm: &PreparedGemm,
    d_dev: &DeviceMemory,
    launch: impl FnOnce() -> Result<(), commfuse_cuda::CudaError>,
) -> String {
    d_dev.fill(gpu, 0xff).unwrap();
    let start = Instant::now();
    launch().unwrap();
    let synced = stream.synchronize();
    let took = start.elapsed();
    assert!(
        synced.is_ok(),
        "a wait that gave up ended the kernel in an error: {synced:?}, {:?}",
        gemm.stall_report()
    );
    let e = gemm
        .check()
        .expect_err("the call's wait gave up")
        .to_string();
    assert!(
        took < Duration::from_secs(2),
        "the kernel stopped {took:?} after its launch ({e})"
    );
    let mut got = vec![0u16; d_dev.len_bytes() / 2];
    d_dev.download(gpu, &mut got).unwrap();
    let stored = got.iter().filter(|&&x| x != 0xffff).count();
    assert_eq!(
        stored, 0,
        "{stored} elements stored by blocks that gave up ({e})"
    );
    e
}

/// A wait that gives up ends the kernel without a trap (which would end every kernel of the
/// context, PyTorch's included, and leave the context unusable): the call's synchronisation
/// succeeds, `check` reports the diagnosed wait, no tile is stored, the kernel stops soon after
/// the bound, and a new GEMM on the same GPU is right. An all-gather + GEMM whose band flag
/// never rises, twice: the band's own bound (100 ms) runs out; then a pipeline bound (100 ms)
/// below the band's (2 s), so that the waits for a full stage and a staged tile run out first.
#[test]
fn a_wait_that_gives_up_ends_the_kernel_and_the_context_goes_on() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(256, 512, 128, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let mut rng = Rng(77);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let (a_dev, b_dev) = (upload(&gpu, &a), upload(&gpu, &b));
    let d_dev = DeviceMemory::zeroed(&gpu, p.m * p.n * p.output.size()).unwrap();
    let never_raised = DeviceMemory::zeroed(&gpu, 8).unwrap();
    let plan = GemmPlan::local(p, TILE, Epilogue::default());
    let ops = GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_dev.addr());
    let cases = [
        (
            Duration::from_millis(100),
            None,
            "waited for the rows of A a peer copies in (their flag)",
        ),
        (
            Duration::from_secs(2),
            Some(Duration::from_millis(100)),
            "GEMM pipeline stalled on rank 0",
        ),
    ];
    for (band_bound, pipeline_bound, says) in cases {
        let gather = Gather {
            band_flags: vec![never_raised.addr(); plan.tile_grid().0],
            local: 0..0,
            timeout: band_bound,
        };
        let mut gemm = PreparedGemm::gathering(&gpu, &kernels, &plan, &ops, &gather, 0, 0).unwrap();
        if let Some(bound) = pipeline_bound {
            gemm.set_pipeline_timeout(bound);
        }
        let e = gave_up(&gpu, &stream, &gemm, &d_dev, || {
            // SAFETY: the operands, the flag and the output live past the synchronisation
            unsafe {
                gemm.launch_gather_call(
                    &stream,
                    0,
                    b_dev.addr(),
                    None,
                    d_dev.addr(),
                    CallNumber::Host(1),
                )
            }
        });
        assert!(
            e.contains(says) && e.contains("this is call 1") == pipeline_bound.is_none(),
            "{e}"
        );
    }
    // the context serves the next GEMM
    check_one::<bf16, bf16>(&gpu, &kernels, &stream, p, Case::Full, 78);
}

/// Routes of a local 16-bit GEMM whose every tile folds in one partial: the same tile of
/// `partial` ([M, N], ld N), once its flag (one u64 per tile in `flags`) holds the call's
/// number; and the buffer they lie in, for the fold through the pipeline.
fn fold_one_partial(
    plan: &GemmPlan,
    partial: &DeviceMemory,
    flags: &DeviceMemory,
) -> (Vec<TileRoute>, FoldSource) {
    let p = &plan.problem;
    let routes = (0..plan.tile_count())
        .map(|t| {
            let (rows, cols) = plan.tile_bounds(t);
            let within = ((rows.start * p.n + cols.start) * 2) as u64;
            TileRoute {
                dst: within,
                ld: p.n as u32,
                options: ROUTE_DST_FROM_D,
                fold_src: partial.addr() + within,
                fold_flag: flags.addr() + 8 * t as u64,
                fold_count: 1,
                fold_ld: p.n as u32,
                ..TileRoute::default()
            }
        })
        .collect();
    let source = FoldSource {
        base: partial.addr(),
        rows: p.m,
        ld: p.n,
    };
    (routes, source)
}

/// A fold whose partials never come: the flag wait gives up at its bound (half the pipeline's,
/// 200 ms here), the call's synchronisation succeeds, `check` names the fold's flag and the
/// call, no tile is stored, and the context serves the next GEMM. Both where the producer waits
/// for the flags (partials loaded into the stages) and where the consumers do (partials read
/// from global memory).
#[test]
fn a_fold_whose_partial_never_comes_ends_in_a_diagnosed_error() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(256, 512, 128, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    // A and B stay bound: the GEMM reads them
    let PlainBf16 {
        a_dev: _a,
        b_dev: _b,
        d_dev,
        plan,
        ops,
        ..
    } = PlainBf16::new(&gpu, p, 79);
    let partial = DeviceMemory::zeroed(&gpu, p.m * p.n * 2).unwrap();
    let never_raised = DeviceMemory::zeroed(&gpu, 8 * plan.tile_count()).unwrap();
    let (routes, source) = fold_one_partial(&plan, &partial, &never_raised);
    for (folds, staged) in [(Some(source), plan.tile_count()), (None, 0)] {
        let mut gemm =
            PreparedGemm::with_routes(&gpu, &kernels, &plan, &ops, routes.clone(), folds, 1, 0, 0)
                .unwrap();
        assert_eq!(gemm.staged_folds(), staged);
        gemm.set_pipeline_timeout(Duration::from_millis(400));
        // SAFETY: the operands, partials, flags and output live past the synchronisation
        let e = gave_up(&gpu, &stream, &gemm, &d_dev, || unsafe {
            gemm.launch(&stream)
        });
        assert!(
            e.contains("waited for a peer's partial of a tile it folds in (its flag)")
                && e.contains("the flag held call 0, this is call 1"),
            "staged {staged}: {e}"
        );
    }
    // the context serves the next GEMM
    check_one::<bf16, bf16>(&gpu, &kernels, &stream, p, Case::Full, 80);
}

/// A grid capped so that the last wave is cut along K (2, 3 or 4 parts, many k-blocks each):
/// every part's k-range is summed once, in f32, checked tightly against float64.
#[test]
fn split_tail_tiles_sum_their_k_parts() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    kernels.set_tail(TailChoice::Cut);
    // 16 tiles: cap 5 leaves 1 (4 parts), cap 6 leaves 4 (no cut fits), cap 7 leaves 2 (3 parts)
    let tails = ["cut 4×1", "none", "cut 3×2", "cut 4×1"];
    split_parts_sum(&gpu, &kernels, &stream, (500, TILE), &[5, 6, 7, 15], &tails);
    // a skinny M (one row band of 40 rows, 4 tiles): caps 9 and 16 cut each into 2 parts (the
    // skinny build's most); the second consumer warpgroup has no rows, and the partials carry
    // only 40 rows
    split_parts_sum(
        &gpu,
        &kernels,
        &stream,
        (40, TILE),
        &[9, 16],
        &["cut 2×4", "cut 2×4"],
    );
}

/// The tail spread by stream-K ([`TailChoice::StreamK`]): the last partial wave and the whole
/// one before it over every block, in K ranges that cross tiles (a block finishes one tile's
/// K loop and starts another's), so that most tiles have a helper and some blocks are a
/// helper first and an owner last. On the main, direct, mid, narrow, narrow-tall,
/// narrow-sliced (slicing each K range from its own first k-block, ranges of one k-block
/// among them) and short builds, and on the skinny one (whose second consumer warpgroup has no
/// rows), every k-block is
/// summed once in f32, checked tightly against float64, three calls in a row (each owner
/// resets its counter).
#[test]
fn stream_k_tail_sums_every_k_range_once() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    kernels.set_tail(TailChoice::StreamK);
    // 16 tiles (the mid build's 32) on 3, 5, 6 and 7 SMs: whole waves, then a partial one
    let wide = [
        "stream-k 4/3",
        "stream-k 6/5",
        "stream-k 10/6",
        "stream-k 9/7",
    ];
    let mid = [
        "stream-k 5/3",
        "stream-k 7/5",
        "stream-k 8/6",
        "stream-k 11/7",
    ];
    // 420 rows: the last band's 36 rows leave the second consumer warpgroup of its tiles
    // without rows (their partials carry 36); 40 and 100 rows of narrow tiles (16 of them):
    // the narrow and the narrow-tall build
    for (choice, m, tile, tails) in [
        (VariantChoice::Main, 500, TILE, &wide),
        (VariantChoice::Main, 420, TILE, &wide),
        (VariantChoice::Direct, 500, TILE, &wide),
        (VariantChoice::Mid, 500, MID_TILE, &mid),
        (VariantChoice::Narrow, 40, NARROW_TILE, &wide),
        (VariantChoice::Narrow, 100, NARROW_TILE, &wide),
        (VariantChoice::NarrowSliced, 40, NARROW_TILE, &wide),
        (VariantChoice::Short, 100, SHORT_TILE, &wide),
    ] {
        kernels.set_choice(choice);
        split_parts_sum(&gpu, &kernels, &stream, (m, tile), &[3, 5, 6, 7], tails);
    }
    // 4 tiles of 40 rows on 3 SMs: the skinny build, 4 tiles over 3 blocks
    kernels.set_choice(VariantChoice::Skinny);
    split_parts_sum(&gpu, &kernels, &stream, (40, TILE), &[3], &["stream-k 4/3"]);
    kernels.set_choice(VariantChoice::Auto);
    kernels.set_tail(TailChoice::Cut);
}

/// The tail spread by stream-K under a fused operator's routes: every tile folds a partial
/// through the pipeline (its flag already up), so a tail tile's owner loads it after its own
/// K range and adds it after its helper's partial; 16 tiles on 3, 5, 6 and 7 SMs, three calls
/// in a row each, every element against A·B + partial in float64.
#[test]
fn stream_k_tail_folds_partials_through_the_pipeline() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(500, 1000, 1544, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let mut rng = Rng(2024);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let partial: Vec<bf16> = rng.vec(p.m * p.n);
    let (a_dev, b_dev) = (upload(&gpu, &a), upload(&gpu, &b));
    let partial_dev = upload(&gpu, &partial);
    let d_dev = DeviceMemory::zeroed(&gpu, p.m * p.n * 2).unwrap();
    // a fold adds the partial as beta = 1 adds C
    let folded = Epilogue {
        beta: 1.0,
        ..Epilogue::default()
    };
    let want = reference_gemm::<bf16, bf16>(&p, &folded, &a, &b, Some(&partial), None, None);
    let plan = GemmPlan::local(p, TILE, Epilogue::default());
    let flags = DeviceMemory::zeroed(&gpu, 8 * plan.tile_count()).unwrap();
    flags.fill(&gpu, 0xff).unwrap();
    let (routes, source) = fold_one_partial(&plan, &partial_dev, &flags);
    let ops = GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_dev.addr());
    kernels.set_tail(TailChoice::StreamK);
    let caps = [
        (3, "stream-k 4/3"),
        (5, "stream-k 6/5"),
        (6, "stream-k 10/6"),
        (7, "stream-k 9/7"),
    ];
    for (cap, tail) in caps {
        let gemm = PreparedGemm::with_routes(
            &gpu,
            &kernels,
            &plan,
            &ops,
            routes.clone(),
            Some(source),
            1,
            cap,
            0,
        )
        .unwrap();
        assert_eq!(
            (gemm.tail(), gemm.staged_folds()),
            (tail, plan.tile_count())
        );
        for call in 0..3 {
            d_dev.fill(&gpu, 0xff).unwrap();
            run(&gemm, &stream);
            let got = download::<bf16>(&gpu, &d_dev, p.m * p.n);
            let check = check(&p, &folded, &got, &want);
            assert!(check.passed(), "cap {cap} call {call}: {check}");
        }
    }
    kernels.set_tail(TailChoice::Cut);
}

/// An f32 GEMM of `m` rows × 1000 × 1544 planned in `tile`s (shuffled order) at each cap,
/// whose tail must be shared out as `tails` says, checked three calls in a row.
fn split_parts_sum(
    gpu: &Gpu,
    kernels: &GemmKernels,
    stream: &Stream,
    (m, tile): (usize, TileShape),
    caps: &[u32],
    tails: &[&str],
) {
    assert_eq!(caps.len(), tails.len());
    let p = GemmProblem::new(m, 1000, 1544, BLayout::NK, DType::BF16, DType::F32).unwrap();
    let mut rng = Rng(99);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let (a_dev, b_dev) = (upload(gpu, &a), upload(gpu, &b));
    let d_dev = DeviceMemory::zeroed(gpu, p.m * p.n * 4).unwrap();
    let want = reference_gemm::<bf16, f32>(&p, &Epilogue::default(), &a, &b, None, None, None);
    let mut plan = GemmPlan::local(p, tile, Epilogue::default());
    rng.shuffle(&mut plan.order);
    let ops = GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_dev.addr());
    for (&cap, &tail) in caps.iter().zip(tails) {
        let gemm = PreparedGemm::new(gpu, kernels, &plan, &ops, None, cap, 0).unwrap();
        assert_eq!(gemm.tail(), tail, "M {m} cap {cap}");
        for call in 0..3 {
            d_dev.fill(gpu, 0xff).unwrap();
            run(&gemm, stream);
            let mut got = vec![0f32; p.m * p.n];
            d_dev.download(gpu, &mut got).unwrap();
            let check = check(&p, &Epilogue::default(), &got, &want);
            assert!(check.passed(), "M {m} cap {cap} call {call}: {check}");
        }
    }
}

/// A split tail's part 0 waits for its helper parts, so its grid must be resident at once even
/// while another stream's kernel holds the SMs: a kernel holding every SM but one is running
/// when a GEMM whose 16 tiles are cut into 4 K-parts (64 blocks) is launched, with a pipeline
/// bound of 300 ms. The GEMM must wait for its whole grid to fit rather than start on the free
/// SM (where part 0 of the first tile would wait for helpers that get no SM, and give up at
/// the bound): one second later it has neither finished nor recorded a stall; once the holder
/// is released it runs, and every element is right. Twice, then once more with the SMs free;
/// for the main build and the skinny one (M = 64).
#[test]
fn a_split_tail_beside_a_kernel_holding_the_sms_waits_for_its_grid() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(64, 4096, 1024, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    // (A and B bound too: a field left out of the pattern would be freed here, under the GEMM)
    let PlainBf16 {
        a_dev: _a_dev,
        b_dev: _b_dev,
        d_dev,
        plan,
        ops,
        want,
    } = PlainBf16::new(&gpu, p, 31);
    let holder = SmHolder::new(&gpu, &kernels).unwrap();
    let side = Stream::new(&gpu).unwrap();
    let blocks = gpu.sm_count - 1;
    for (choice, variant) in [
        (VariantChoice::Main, GemmVariant::Main),
        (VariantChoice::Skinny, GemmVariant::Skinny),
    ] {
        let mut gemm = forced(&gpu, &kernels, &plan, &ops, (choice, variant));
        gemm.set_pipeline_timeout(Duration::from_millis(300));
        for call in 0..3 {
            d_dev.fill(&gpu, 0xff).unwrap();
            let held = call < 2;
            if held {
                holder
                    .launch(&side, blocks, Duration::from_secs(30))
                    .unwrap();
                assert!(
                    holder
                        .wait_resident(blocks, Duration::from_secs(10))
                        .unwrap(),
                    "{variant:?} call {call}: the holder's {blocks} blocks did not all start"
                );
            }
            // SAFETY: every operand outlives the waits below
            unsafe { gemm.launch(&stream).unwrap() };
            if held {
                std::thread::sleep(Duration::from_secs(1));
                let report = gemm.stall_report();
                let waiting = !stream.is_idle().unwrap();
                holder.release();
                assert!(
                    side.wait_idle(Duration::from_secs(10)).unwrap(),
                    "the holder did not end once released"
                );
                assert_eq!(
                    report, None,
                    "{variant:?} call {call}: the GEMM started part of its grid"
                );
                assert!(
                    waiting,
                    "{variant:?} call {call}: the GEMM ended while the SMs its grid needs were held"
                );
                assert_eq!(
                    holder.timed_out(),
                    0,
                    "the holder let go before its release"
                );
            }
            assert!(
                stream.wait_idle(Duration::from_secs(20)).unwrap(),
                "{variant:?} call {call}: the GEMM did not end"
            );
            gemm.check().unwrap();
            let mut got = vec![bf16::ZERO; p.m * p.n];
            d_dev.download(&gpu, &mut got).unwrap();
            let check = check(&p, &Epilogue::default(), &got, &want);
            assert!(check.passed(), "{variant:?} call {call}: {check}");
        }
    }
}

/// The bench checks every element of every row (ours and cuBLASLt's, capped or not) against
/// the device reference.
#[test]
fn bench_rows_pass_the_check_of_every_element() {
    if !gpus(1) {
        return;
    }
    for (m, n, k, output) in [
        (2048, 8192, 3584, DType::BF16),
        (1000, 3000, 1032, DType::BF16),
        (1000, 3000, 1032, DType::F32),
        (777, 1500, 520, DType::F16),
        (16, 8192, 3584, DType::BF16),
        (33, 3000, 1032, DType::F32),
    ] {
        for layout in [BLayout::NK, BLayout::KN] {
            // cuBLASLt (a row of the bench) has no bf16 → f16 GEMM: f16 outputs take f16 inputs
            let input = if output == DType::F16 {
                DType::F16
            } else {
                DType::BF16
            };
            let p = GemmProblem::new(m, n, k, layout, input, output).unwrap();
            let rows = bench_gemm(
                0,
                None,
                folds(&[1, 3], None),
                &p,
                &[0, 116],
                1,
                1,
                42 + m as u64,
            )
            .unwrap();
            // cuBLASLt and ours at both caps; each build forced too: where the skinny build
            // fits main, skinny and (M ≤ 128 here) narrow, narrow-deep and narrow-sliced (two
            // rows more), elsewhere main,
            // pair, direct, mid, ping-pong, mid-direct and ping-pong-wide (six rows more); the fold rows (1 and 3 partials, each also prefetched); where the tail spread by stream-K differs
            // from the cut, ours with it (512 tiles: 3.9 waves on 132 SMs, 4.4 on 116; at 16
            // rows `auto` plans 128 narrow tiles, one wave on 132 SMs and more than one on 116;
            // the other shapes are less than one wave, where both cut)
            // (with COMMFUSE_GEMM_TAIL=stream-k, ours spreads and the row beside it cuts)
            let skinny = m <= SKINNY_ROWS;
            let (beside, tails) = if std::env::var(TAIL_ENV).as_deref() == Ok("stream-k") {
                ("commfuse-cut", ["cut", "none"])
            } else {
                ("commfuse-stream-k", ["stream-k", "stream-k"])
            };
            let differs = match (m, n) {
                (2048, _) => 2,
                (16, 8192) => 1,
                _ => 0,
            };
            let narrow_sliced = if m <= 128 { 2 } else { 0 };
            let ping_pong = if m > 64 { 6 } else { 0 };
            // the short build where its 64 × 128 tiles make at most two waves above 64 rows:
            // only 777 × 1500 here (13 × 12 tiles)
            let short = if (m, n) == (777, 1500) { 2 } else { 0 };
            // and where ours runs a plain entry of its build, the same through its general one
            // (at 2048 × 8192 × 3584 with a bf16 D: the direct build, whole waves on every SM,
            // a split tail on 116)
            let plain = rows
                .iter()
                .filter(|r| {
                    r.implementation == "commfuse"
                        && r.entry.as_deref().is_some_and(|e| e != "general")
                })
                .count();
            if (m, output) == (2048, DType::BF16) {
                assert_eq!(plain, 2, "{rows:?}");
            }
            let general = rows
                .iter()
                .filter(|r| r.implementation == "commfuse-general");
            assert!(
                general
                    .clone()
                    .all(|r| r.entry.as_deref() == Some("general")),
                "{rows:?}"
            );
            assert_eq!(general.count(), plain, "{rows:?}");
            assert_eq!(
                rows.len(),
                16 + narrow_sliced + ping_pong + short + differs + plain,
                "{rows:?}"
            );
            let other = rows.iter().filter(|r| r.implementation == beside);
            assert!(other.clone().all(|r| r
                .tail
                .as_deref()
                .is_some_and(|t| tails.iter().any(|w| t.starts_with(w)))));
            assert_eq!(other.count(), differs, "{rows:?}");
            let wide_only = rows
                .iter()
                .filter(|r| {
                    ["commfuse-direct", "commfuse-mid"].contains(&r.implementation.as_str())
                })
                .count();
            assert_eq!(wide_only, if skinny { 0 } else { 4 }, "{rows:?}");
            let forced = rows
                .iter()
                .filter(|r| {
                    r.implementation == "commfuse-main"
                        || r.implementation
                            == if skinny {
                                "commfuse-skinny"
                            } else {
                                "commfuse-pair"
                            }
                })
                .count();
            assert_eq!(forced, 4, "{rows:?}");
            for r in rows {
                assert_eq!((r.checked, r.out_of_bound), (m * n, 0), "{r:?}");
            }
        }
    }
}

/// The fold of GEMM + reduce-scatter with its partials in local buffers whose flags are up:
/// ragged shapes (partial tiles in both directions, rows of N that are not whole 16-byte units),
/// both B layouts, every output type, the main and the skinny build, one and three partials per
/// tile; every element against A·B + Σ partials
/// in float64. The partials lie in ±[1, 2), far above each element's bound: a partial skipped
/// or added twice fails every element it touches. Where rows are whole 16-byte units the main
/// and the skinny build load every tile's partials into their stages by TMA; elsewhere their
/// consumers read them from global memory: both ways are checked.
#[test]
fn fold_adds_every_partial_once() {
    if !gpus(1) {
        return;
    }
    // (M, N, K, input, output, tiles whose partials go through the stages)
    for (m, n, k, input, output, staged) in [
        (1000, 3000, 1032, DType::BF16, DType::BF16, 8 * 12),
        (777, 1500, 520, DType::F16, DType::F16, 0),
        (300, 1000, 264, DType::BF16, DType::F32, 3 * 4),
        (40, 2050, 136, DType::BF16, DType::BF16, 0),
        (40, 2048, 136, DType::BF16, DType::BF16, 8),
        (60, 1000, 72, DType::BF16, DType::F32, 4),
        (129, 1004, 72, DType::BF16, DType::F32, 2 * 4),
    ] {
        for layout in [BLayout::NK, BLayout::KN] {
            let p = GemmProblem::new(m, n, k, layout, input, output).unwrap();
            let rows =
                bench_gemm(0, None, folds(&[1, 3], None), &p, &[0], 1, 1, 7 + m as u64).unwrap();
            let folds: Vec<_> = rows
                .iter()
                .filter(|r| r.implementation.starts_with("commfuse-fold"))
                .collect();
            // 1 and 3 partials, each without and with the partials asked of L2 ahead
            assert_eq!(folds.len(), 4, "{rows:?}");
            let prefetched = folds
                .iter()
                .filter(|r| r.implementation.ends_with("-prefetch"));
            assert_eq!(prefetched.count(), 2, "{rows:?}");
            for r in folds {
                assert_eq!((r.checked, r.out_of_bound), (m * n, 0), "{layout:?}: {r:?}");
                assert_eq!(r.staged_folds, Some(staged), "{layout:?}: {r:?}");
            }
        }
    }
}

/// For each shape of `shapes` (bf16, both B layouts) and each value of `values`, the bench with
/// the row `name` that `extra(value)` asks for beside the chosen build (no build forced), at
/// the caps `sms`: one such row a cap, and every element of every row of ours checked.
fn option_rows_pass_the_check(
    shapes: &[(usize, usize, usize)],
    values: &[u32],
    name: &str,
    extra: impl Fn(u32) -> ExtraRows<'static>,
    sms: &[u32],
    seed: u64,
) {
    for &(m, n, k) in shapes {
        for layout in [BLayout::NK, BLayout::KN] {
            let p = GemmProblem::new(m, n, k, layout, DType::BF16, DType::BF16).unwrap();
            for &value in values {
                let rows =
                    bench_gemm(0, None, extra(value), &p, sms, 1, 1, seed + m as u64).unwrap();
                let named = rows.iter().filter(|r| r.implementation == name);
                assert_eq!(named.count(), sms.len(), "{rows:?}");
                for r in rows.iter().filter(|r| r.build.is_some()) {
                    assert_eq!((r.checked, r.out_of_bound), (m * n, 0), "{layout:?}: {r:?}");
                }
            }
        }
    }
}

/// The chosen build with each unit's first k-blocks asked of L2 while the unit before loads
/// (1, 4 and more k-blocks than a unit has): every element checked, at shapes where a block
/// runs several units (ragged, both B layouts, a split tail), beside the same build without.
#[test]
fn next_unit_prefetch_rows_pass_the_check() {
    if !gpus(1) {
        return;
    }
    let shapes = [(1500, 4100, 1000), (2048, 8192, 520), (8192, 4096, 64)];
    let extra = |k_blocks| ExtraRows {
        builds: Some(&[]),
        next_prefetch: Some(k_blocks),
        ..folds(&[], None)
    };
    let name = "commfuse-next-prefetch";
    option_rows_pass_the_check(&shapes, &[1, 4, 100], name, extra, &[0, 116], 11);
}

/// Our rows under each tile order of the bench (`--order`): every element of the chosen
/// build's and the forced builds' rows checked, at one wave of 128 × 128 tiles, a ragged shape
/// whose blocks run several units with a split tail, and a decode size, both B layouts.
#[test]
fn every_tile_order_passes_the_check() {
    if !gpus(1) {
        return;
    }
    let shapes = [(512, 4096, 1024), (1500, 4100, 1000), (64, 8192, 512)];
    // (the option's value is the order's place in TileOrder::ALL)
    let extra = |o: u32| ExtraRows {
        builds: Some(&[VariantChoice::Mid]),
        order: TileOrder::ALL[o as usize],
        ..folds(&[], None)
    };
    let places: Vec<u32> = (0..TileOrder::ALL.len() as u32).collect();
    option_rows_pass_the_check(&shapes, &places, "commfuse", extra, &[0], 41);
}

/// The chosen build with its blocks' loads started at 2, 8 and more places in K than a unit
/// has k-blocks: every element checked, at a decode size (narrow-deep), ragged shapes where a
/// block runs several units, and a split tail (units of part of K), both B layouts.
#[test]
fn k_phases_rows_pass_the_check() {
    if !gpus(1) {
        return;
    }
    let shapes = [(16, 8192, 3584), (1500, 4100, 1000), (100, 2048, 1000)];
    let extra = |phases| ExtraRows {
        builds: Some(&[]),
        k_phases: Some(phases),
        ..folds(&[], None)
    };
    option_rows_pass_the_check(&shapes, &[2, 8, 100], "commfuse-k-phases", extra, &[0], 31);
}

/// Every other wave's K loop reversed (the units at odd places of each block's sequence load
/// their last k-block first): off in `auto`'s rows, on in the bench's `-serpentine` row of the
/// chosen build, checked on every element, at shapes where a block runs several units (a
/// ragged one with a split tail, whose parts reverse within their K ranges; 16 and 60 units a
/// block) and a decode size of one unit a block (nothing reversed on every SM), both B
/// layouts, on every SM and on 116, beside the chosen build's row with its loads started at
/// three places in K (a row of its own: the bench sets one option a row).
#[test]
fn serpentine_rows_pass_the_check() {
    if !gpus(1) {
        return;
    }
    let shapes = [
        (1500, 4100, 1000),
        (2048, 8192, 520),
        (8192, 4096, 64),
        (64, 8192, 1024),
    ];
    // (the option's value is the phases of the row beside it; 1: no such row)
    let extra = |phases| ExtraRows {
        builds: Some(&[]),
        k_serpentine: true,
        k_phases: Some(phases),
        ..folds(&[], None)
    };
    let name = "commfuse-serpentine";
    option_rows_pass_the_check(&shapes, &[1, 3], name, extra, &[0, 116], 51);
}

/// The bench's traced rows: after the timed rounds, one call of each plain row of ours whose
/// every block stamps its points (trace.rs) — the entry, the producer, its first load, the
/// first stage landed, the main loop done, the consumers', the producer's and the storers'
/// ends — in that order within each role, at a decode size (narrow), one wave of 128 × 128
/// tiles (mid-direct, with the ping-pong build forced beside it) and a shape where blocks run
/// several units with a split tail (beside it the stream-K row); cuBLASLt's rows carry none.
#[test]
fn traced_rows_stamp_every_point_in_order() {
    if !gpus(1) {
        return;
    }
    for (m, n, k, builds) in [
        (64, 8192, 3584, &[][..]),
        (512, 4096, 4096, &[VariantChoice::PingPong][..]),
        (1500, 4100, 1000, &[][..]),
    ] {
        let p = GemmProblem::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        let extra = ExtraRows {
            builds: Some(builds),
            trace: true,
            ..folds(&[], None)
        };
        let rows = bench_gemm(0, None, extra, &p, &[0], 1, 3, 41 + m as u64).unwrap();
        // the chosen build, the forced ones and the other tail's row where it differs: every
        // row of ours is plain here
        let traced = rows.iter().filter(|r| r.trace.is_some()).count();
        assert!(traced > builds.len(), "{m}x{n}x{k}: {rows:?}");
        for r in &rows {
            assert_eq!((r.checked, r.out_of_bound), (m * n, 0), "{r:?}");
            let Some(t) = &r.trace else {
                assert!(!r.implementation.starts_with("commfuse"), "{r:?}");
                continue;
            };
            let grid = r.grid.unwrap() as usize;
            assert_eq!(t.blocks, grid, "{r:?}");
            assert!((0.5..3.0).contains(&t.clock_ghz), "{t:?}");
            let at = |name: &str| t.events.iter().find(|e| e.event == name).unwrap();
            // every block stamps its entry and its roles' ends
            for name in [
                "entry",
                "producer",
                "producer end",
                "consumer end",
                "storer end",
            ] {
                assert_eq!(at(name).blocks, grid, "{name}: {t:?}");
            }
            assert!(at("first stage full").blocks >= 1, "{t:?}");
            assert!(at("entry").min_us == 0.0, "{t:?}");
            // within each block's roles, in order (medians over the blocks)
            for pair in [
                ["producer", "first load"],
                ["first load", "producer end"],
                ["first stage full", "main loop done"],
                ["main loop done", "consumer end"],
            ] {
                let (a, b) = (at(pair[0]), at(pair[1]));
                assert!(a.median_us <= b.median_us, "{pair:?}: {t:?}");
            }
            // the stamps lie within the call: its span is at most a few of its timed calls
            assert!(
                t.span_us > 0.0 && t.span_us < 20.0 * r.time_ms * 1e3,
                "{r:?}"
            );
        }
    }
}

/// Fold rows whose flags are down at the call and raised by a side kernel as the GEMM goes
/// (as each wave ends: peers at the GEMM's pace), with and without the partials asked of L2
/// before their flags are up, on every SM but one: every element of every fold row checked
/// (each partial added once, after its flag), beside the flags-up rows at the same cap; a bench
/// that would leave the side kernel no SM, or raise flags past 4 waves, is refused.
#[test]
fn paced_fold_rows_add_every_partial_once() {
    let Some((gpu, _kernels, _stream)) = one_gpu() else {
        return;
    };
    let cap = gpu.sm_count - 1;
    for (m, n, k) in [(1000, 3000, 1032), (2048, 8192, 3584)] {
        let p = GemmProblem::new(m, n, k, BLayout::NK, DType::BF16, DType::BF16).unwrap();
        let seed = 5 + m as u64;
        // no build forced beside the chosen one
        let extra = ExtraRows {
            builds: Some(&[]),
            ..folds(&[1, 3], Some(1.0))
        };
        let rows = bench_gemm(0, None, extra, &p, &[cap], 1, 3, seed).unwrap();
        let forced = rows.iter().filter(|r| {
            ["main", "pair", "direct", "mid"]
                .iter()
                .any(|b| r.implementation == format!("commfuse-{b}"))
        });
        assert_eq!(forced.count(), 0, "{rows:?}");
        let folds: Vec<_> = rows
            .iter()
            .filter(|r| r.implementation.starts_with("commfuse-fold"))
            .collect();
        // 1 and 3 partials: flags up, paced, each with and without the prefetch
        assert_eq!(folds.len(), 8, "{rows:?}");
        let paced = folds.iter().filter(|r| r.implementation.contains("-paced"));
        assert_eq!(paced.count(), 4, "{rows:?}");
        for r in folds {
            assert_eq!(r.sms, cap, "{r:?}");
            assert_eq!((r.checked, r.out_of_bound), (m * n, 0), "{r:?}");
        }
    }
    let p = GemmProblem::new(256, 512, 64, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let refused = bench_gemm(0, None, folds(&[1], Some(0.5)), &p, &[0], 1, 1, 3).unwrap_err();
    assert!(refused.to_string().contains("capped below"), "{refused}");
    let refused = bench_gemm(0, None, folds(&[1], Some(5.0)), &p, &[cap], 1, 1, 3).unwrap_err();
    assert!(refused.to_string().contains("0 to 4 waves"), "{refused}");
}

/// The rank rows' shapes (M, N, K, B's layout, D's type, a bias): chunks of P = 2, 3 and 5
/// that cut the 128-row bands, both layouts, a 16-bit and an f32 D, chunks of at most 64 rows
/// (the skinny build) and of whole waves. With a bias, the rank's own tiles add it and the
/// tiles it sends must not.
const RANK_SHAPES: [(usize, usize, usize, BLayout, DType, bool); 4] = [
    (300, 1000, 136, BLayout::NK, DType::BF16, true),
    (777, 4096, 520, BLayout::KN, DType::BF16, false),
    (500, 1000, 264, BLayout::NK, DType::F32, true),
    (2048, 8192, 1024, BLayout::NK, DType::BF16, false),
];

/// The bench's rank rows: the fused GEMM + reduce-scatter's kernel as rank 0 of P alone on one
/// GPU (the operator's schedule and routes; the peers' tiles into local stand-ins of their
/// receive buffers, its own rows folding the P − 1 partials in its own), again with the later
/// waves' K loops reversed, and its plain GEMM in its order and bands. Every element of its
/// chunk (A·B plus the partials) and of each slot it sent (A·B) is checked, and every flag
/// word of the peers' stand-ins (the call's number where it sent a tile, else untouched;
/// the bench errs otherwise), at P = 2, 3 and 5,
/// ragged shapes whose chunks cut the 128-row bands, both B layouts, 16-bit and f32 outputs,
/// on all SMs and capped (the split tail under routes and folds); the main build's rows and
/// the skinny build's (chunks of at most 64 rows) fold through the pipeline's stages.
#[test]
fn rank_rows_pass_the_check() {
    let Some((gpu, _kernels, _stream)) = one_gpu() else {
        return;
    };
    for (m, n, k, layout, out, bias) in RANK_SHAPES {
        let p = GemmProblem::new(m, n, k, layout, DType::BF16, out).unwrap();
        let extra = ExtraRows {
            builds: Some(&[]),
            rs_ranks: &[2, 3, 5],
            k_serpentine: true,
            bias,
            ..folds(&[], None)
        };
        for sms in [0, gpu.sm_count - 16] {
            let rows = bench_gemm(0, None, extra, &p, &[sms], 1, 2, 71 + m as u64).unwrap();
            let ranks: Vec<(&str, Option<&str>)> = rows
                .iter()
                .filter(|r| r.implementation.starts_with("commfuse-rs"))
                .map(|r| (r.implementation.as_str(), r.build.as_deref()))
                .collect();
            // the order rows (a plain GEMM in each rank's order, on its build), then the rank
            // rows, then the same with the later waves' K loops reversed; each rank whose
            // routes `auto` runs on the main build again on the direct build (`-direct`), and
            // where that runs its routed entry (a 16-bit D), once more through its general
            // entry (`-direct-general`, no order row of its own); with a D of the input's type,
            // each rank once more on the wide ping-pong build's 128 × 192 tiles
            // (`-ping-pong-wide`, its routed entry: its general entry takes no routes)
            let on_main = |w: usize| {
                let name = format!("commfuse-rs{w}");
                ranks.iter().any(|r| r.0 == name && r.1 == Some("main"))
            };
            let mut want = Vec::new();
            for suffix in ["-order", "", "-serpentine"] {
                for w in [2, 3, 5] {
                    want.push(format!("commfuse-rs{w}{suffix}"));
                    if on_main(w) {
                        want.push(format!("commfuse-rs{w}-direct{suffix}"));
                        if suffix != "-order" && out == DType::BF16 {
                            want.push(format!("commfuse-rs{w}-direct-general{suffix}"));
                        }
                    }
                    if out == DType::BF16 {
                        want.push(format!("commfuse-rs{w}-ping-pong-wide{suffix}"));
                    }
                }
            }
            let names: Vec<&str> = ranks.iter().map(|r| r.0).collect();
            assert_eq!(names, want, "{m}x{n}x{k}");
            // ranks of at least 128 rows a chunk run the main build (and so the direct rows)
            assert_eq!(on_main(2), m / 2 > 64, "{m}x{n}x{k}: {ranks:?}");
            // a rank's rows, its order row among them, all run one build
            let base = |name: &str| {
                ["-order", "-serpentine", "-general"]
                    .iter()
                    .fold(name.to_string(), |n, s| n.replace(s, ""))
            };
            for r in &ranks {
                let order = format!("{}-order", base(r.0));
                let of_order = ranks.iter().find(|o| o.0 == order).map(|o| o.1);
                assert_eq!(of_order, Some(r.1), "{r:?}: {rows:?}");
            }
            for r in &rows {
                assert_eq!(
                    (r.checked, r.out_of_bound),
                    (m * n, 0),
                    "{m}x{n}x{k} {layout:?} {out:?} bias {bias} sms {sms}: {r:?}"
                );
                if r.implementation.starts_with("commfuse-rs") {
                    assert_eq!(r.sms, sms, "{r:?}");
                }
                if r.implementation.starts_with("commfuse-rs")
                    && !r.implementation.ends_with("-order")
                {
                    // on the main and the direct build, rows of whole 16-byte units (N = 1000
                    // of f32 too) fold by TMA through the stages, and so do chunks of at most
                    // 64 rows, which run the skinny build
                    let staged = r.staged_folds.expect("a rank row counts its staged folds");
                    let direct = r.implementation.contains("-direct");
                    // the direct build's routed entry where D has the input's type
                    let entry = match r.build.as_deref() {
                        Some("direct" | "ping-pong-wide") if out == DType::BF16 => "routed",
                        _ => "general",
                    };
                    let entry = if r.implementation.contains("-general") {
                        "general"
                    } else {
                        entry
                    };
                    assert_eq!(r.entry.as_deref(), Some(entry), "{r:?}");
                    match r.build.as_deref() {
                        Some("main") if !direct => assert!(staged > 0, "{r:?}"),
                        Some("skinny") if !direct => assert!(staged > 0, "{r:?}"),
                        Some("direct") if direct => assert!(staged > 0, "{r:?}"),
                        // (not through the stages: its consumers' boxes, by the fold map)
                        Some("ping-pong-wide") if r.implementation.contains("-ping-pong-wide") => {
                            assert_eq!(staged, 0, "{r:?}")
                        }
                        other => panic!("a rank row on the {other:?} build: {r:?}"),
                    }
                }
            }
        }
    }
    let p = GemmProblem::new(4, 512, 64, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let extra = ExtraRows {
        rs_ranks: &[5],
        ..folds(&[], None)
    };
    let refused = bench_gemm(0, None, extra, &p, &[0], 1, 1, 3).unwrap_err();
    assert!(
        refused.to_string().contains("2 to M = 4 ranks"),
        "{refused}"
    );
}

/// The ring inside one GEMM as rank 0 of P on one GPU (`bench gemm --rs-ranks --rs-ring`):
/// every element of its own chunk (the last step, folding the running sum of the step before,
/// and the bias) and of every chunk it handed on (each folding the step before's sum, from the
/// stand-in of its receiver's buffer of that step) is checked against float64, and every flag
/// word of the stand-ins (the bench errs on one wrong), at P = 2, 3 and 5, ragged shapes whose
/// chunks cut the 128-row bands, both B layouts, 16-bit and f32 outputs, all SMs and capped; on
/// the main and the direct build every hop's sum comes through the stages. The rows whose
/// producer asks L2 for the partials eight k-blocks before a tile's end (where the folds go
/// through the stages) are checked alike.
#[test]
fn ring_rank_rows_pass_the_check() {
    let Some((gpu, _kernels, _stream)) = one_gpu() else {
        return;
    };
    for (m, n, k, layout, out, bias) in RANK_SHAPES {
        let p = GemmProblem::new(m, n, k, layout, DType::BF16, out).unwrap();
        let extra = ExtraRows {
            builds: Some(&[]),
            rs_ranks: &[2, 3, 5],
            rs_ring: true,
            rs_prefetch: &[8],
            bias,
            ..folds(&[], None)
        };
        for sms in [0, gpu.sm_count - 16] {
            let rows = bench_gemm(0, None, extra, &p, &[sms], 1, 2, 73 + m as u64).unwrap();
            let rings: Vec<&GemmRow> = rows
                .iter()
                .filter(|r| r.implementation.starts_with("commfuse-ring"))
                .collect();
            for w in [2, 3, 5] {
                for name in [
                    format!("commfuse-ring{w}"),
                    format!("commfuse-ring{w}-order"),
                ] {
                    assert!(
                        rows.iter().any(|r| r.implementation == name),
                        "{m}x{n}x{k}: no {name} among {rows:?}"
                    );
                }
            }
            // each rank row (the fused path's too, not through a general entry) whose folds go
            // through the stages again with its partials asked of L2 eight k-blocks ahead, and
            // no other
            for r in rows.iter().filter(|r| {
                let name = &r.implementation;
                (name.starts_with("commfuse-ring") || name.starts_with("commfuse-rs"))
                    && !["-order", "-general", "-prefetch8"]
                        .iter()
                        .any(|s| name.contains(s))
            }) {
                let twin = format!("{}-prefetch8", r.implementation);
                let staged = r.staged_folds.expect("a rank row counts its staged folds") > 0;
                assert_eq!(
                    rows.iter().any(|t| t.implementation == twin),
                    staged,
                    "{m}x{n}x{k}: {twin} among {rows:?}"
                );
            }
            for r in &rows {
                assert_eq!(
                    (r.checked, r.out_of_bound),
                    (m * n, 0),
                    "{m}x{n}x{k} {layout:?} {out:?} bias {bias} sms {sms}: {r:?}"
                );
            }
            for r in rings
                .iter()
                .filter(|r| !r.implementation.ends_with("-order"))
            {
                assert_eq!(r.sms, sms, "{r:?}");
                let staged = r.staged_folds.expect("a rank row counts its staged folds");
                match r.build.as_deref() {
                    Some("main" | "direct" | "skinny") => assert!(staged > 0, "{r:?}"),
                    other => panic!("a ring row on the {other:?} build: {r:?}"),
                }
            }
        }
    }
}

/// The reference kernel of the bench's check against the float64 CPU reference: ragged shapes
/// (partial tiles and k-slices), both B layouts, both input types; values to within a double
/// sum's rounding, Σ|ab| to within its f32 rounding.
#[test]
fn reference_kernel_matches_float64_on_ragged_shapes() {
    let Some((gpu, _, stream)) = one_gpu() else {
        return;
    };
    let reference = ReferenceGemm::load(&gpu).unwrap();
    let mut seed = 1000;
    for (m, n, k) in [(1, 7, 8), (65, 63, 40), (200, 300, 136), (257, 129, 1032)] {
        for layout in [BLayout::NK, BLayout::KN] {
            for input in [DType::BF16, DType::F16] {
                let p = GemmProblem::new(m, n, k, layout, input, DType::F32).unwrap();
                seed += 1;
                match input {
                    DType::BF16 => check_reference::<bf16>(&gpu, &stream, &reference, p, seed),
                    _ => check_reference::<f16>(&gpu, &stream, &reference, p, seed),
                }
            }
        }
    }
}

fn check_reference<T: Element>(
    gpu: &Gpu,
    stream: &Stream,
    reference: &ReferenceGemm,
    p: GemmProblem,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let a: Vec<T> = rng.vec(p.m * p.k);
    let b: Vec<T> = rng.vec(p.k * p.n);
    let (a_dev, b_dev) = (upload(gpu, &a), upload(gpu, &b));
    // SAFETY: A and B hold the problem's operands
    let got = unsafe {
        reference
            .compute(gpu, stream, &p, a_dev.addr(), b_dev.addr())
            .unwrap()
    };
    let want = reference_gemm::<T, f32>(&p, &Epilogue::default(), &a, &b, None, None, None);
    let double_sum = p.k as f64 * f64::EPSILON;
    let f32_rounding = f64::powi(2.0, -23);
    for (idx, w) in want.iter().enumerate() {
        let (value, abs) = (got.value[idx], got.abs_products[idx] as f64);
        assert!(
            (value - w.value).abs() <= double_sum * w.abs_products
                && (abs - w.abs_products).abs() <= f32_rounding * w.abs_products,
            "{}×{}×{} {:?} {}: element ({}, {}) is {value:e} (Σ|ab| {abs:e}), float64 says {:e} ({:e})",
            p.m,
            p.n,
            p.k,
            p.b_layout,
            p.input,
            idx / p.n,
            idx % p.n,
            w.value,
            w.abs_products
        );
    }
}

/// The bench's error paths drop a `StreamGuard` before its buffers: dropping it returns only
/// once the stream is idle, even with a long kernel still running when the error is returned.
#[test]
fn a_stream_guard_waits_for_the_running_kernel() {
    let Some((gpu, _, stream)) = one_gpu() else {
        return;
    };
    // a reference GEMM of 2·8192·8192·4096 double FMAs: tens of milliseconds
    let p = GemmProblem::new(8192, 8192, 4096, BLayout::NK, DType::BF16, DType::F32).unwrap();
    let a_dev = DeviceMemory::zeroed(&gpu, p.m * p.k * 2).unwrap();
    let b_dev = DeviceMemory::zeroed(&gpu, p.n * p.k * 2).unwrap();
    let value = DeviceMemory::zeroed(&gpu, p.m * p.n * 8).unwrap();
    let abs = DeviceMemory::zeroed(&gpu, p.m * p.n * 4).unwrap();
    let reference = ReferenceGemm::load(&gpu).unwrap();
    let idle = || {
        // SAFETY: a live stream
        let rc = unsafe { cudarc::driver::sys::cuStreamQuery(stream.raw()) };
        assert!(
            matches!(
                rc,
                cudarc::driver::sys::CUresult::CUDA_SUCCESS
                    | cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY
            ),
            "{rc:?}"
        );
        rc == cudarc::driver::sys::CUresult::CUDA_SUCCESS
    };
    let guard = StreamGuard::new(&stream);
    // SAFETY: the buffers are sized for the problem and outlive the guard
    unsafe {
        reference
            .launch(
                &stream,
                &p,
                a_dev.addr(),
                b_dev.addr(),
                value.addr(),
                abs.addr(),
            )
            .unwrap()
    };
    assert!(!idle(), "the kernel finished before the guard was dropped");
    drop(guard);
    assert!(idle(), "the guard returned with the kernel still running");
}

/// A guard whose bound runs out returns with the kernel still running, and the device memory
/// of that context dropped afterwards is left allocated instead of freed (which would wait for
/// the kernel without bound). Run in a process of its own: the context stays marked.
#[test]
fn a_stream_guard_gives_up_after_its_bound_and_frees_nothing_under_the_kernel() {
    if std::env::var_os("COMMFUSE_WEDGE_CHILD").is_none() {
        if one_gpu().is_none() {
            return;
        }
        let me = std::env::current_exe().unwrap();
        let out = std::process::Command::new(me)
            .args([
                "--exact",
                "a_stream_guard_gives_up_after_its_bound_and_frees_nothing_under_the_kernel",
                "--test-threads",
                "1",
                "--nocapture",
            ])
            .env("COMMFUSE_WEDGE_CHILD", "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(text.contains("stays allocated"), "{text}");
        return;
    }
    let (gpu, _, stream) = one_gpu().expect("the parent found a GPU");
    let p = GemmProblem::new(8192, 8192, 4096, BLayout::NK, DType::BF16, DType::F32).unwrap();
    let a_dev = DeviceMemory::zeroed(&gpu, p.m * p.k * 2).unwrap();
    let b_dev = DeviceMemory::zeroed(&gpu, p.n * p.k * 2).unwrap();
    let value = DeviceMemory::zeroed(&gpu, p.m * p.n * 8).unwrap();
    let abs = DeviceMemory::zeroed(&gpu, p.m * p.n * 4).unwrap();
    let reference = ReferenceGemm::load(&gpu).unwrap();
    let guard = StreamGuard::with_limit(&stream, std::time::Duration::from_millis(1));
    // SAFETY: the buffers are sized for the problem; they stay allocated (the test's point)
    unsafe {
        reference
            .launch(
                &stream,
                &p,
                a_dev.addr(),
                b_dev.addr(),
                value.addr(),
                abs.addr(),
            )
            .unwrap()
    };
    drop(guard);
    assert!(!stream.is_idle().unwrap(), "the kernel ended within 1 ms");
    // cuMemFree would wait for the kernel: dropped while it runs, the buffer must not be freed
    drop(value);
    assert!(
        !stream.is_idle().unwrap(),
        "dropping the output waited for the kernel (it was freed)"
    );
    assert!(stream
        .wait_idle(std::time::Duration::from_secs(60))
        .unwrap());
}

/// cuBLASLt is timed over its heuristic's candidates per shape and SM cap; the cap still
/// holds (16 of 132 SMs take several times as long) and both choices compute A·B.
#[test]
fn cublaslt_chooses_among_candidates_and_keeps_the_sm_cap() {
    let Some((gpu, _, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(2048, 8192, 3584, BLayout::KN, DType::BF16, DType::BF16).unwrap();
    let mut rng = Rng(77);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let (a_dev, b_dev) = (upload(&gpu, &a), upload(&gpu, &b));
    let d_dev = DeviceMemory::zeroed(&gpu, p.m * p.n * 2).unwrap();
    let lt = Lt::new(&gpu).unwrap();
    let reference = ReferenceGemm::load(&gpu).unwrap();
    // SAFETY: A and B hold the problem's operands
    let reference = unsafe {
        reference
            .compute(&gpu, &stream, &p, a_dev.addr(), b_dev.addr())
            .unwrap()
    };
    let mut times = Vec::new();
    for sms in [0, 16] {
        assert_eq!(lt.choice(&p, sms, false), None);
        d_dev.fill(&gpu, 0xff).unwrap();
        // SAFETY: operands sized for the problem on this GPU, waited for below
        unsafe {
            lt.matmul(
                &stream,
                &p,
                sms,
                a_dev.addr(),
                b_dev.addr(),
                d_dev.addr(),
                1.0,
                0.0,
            )
            .unwrap()
        };
        stream.synchronize().unwrap();
        let choice = lt.choice(&p, sms, false).unwrap();
        assert!(
            choice.index < choice.candidates && choice.time_ms > 0.0,
            "{choice:?}"
        );
        eprintln!("sms {sms}: {choice:?}");
        times.push(choice.time_ms);
        // the candidates that ran were timed and say what they are; the chosen one is among
        // them (a candidate cuBLASLt refuses at launch is left out)
        let candidates = lt.candidate_times(&p, sms, false);
        assert!(
            !candidates.is_empty() && candidates.len() <= choice.candidates,
            "{candidates:?}"
        );
        assert!(
            candidates
                .iter()
                .all(|c| c.time_ms > 0.0 && c.host_us > 0.0 && c.config.id.is_some()),
            "{candidates:?}"
        );
        let chosen = candidates.iter().find(|c| c.index == choice.index);
        assert_eq!(
            chosen.map(|c| c.config),
            Some(choice.config),
            "{candidates:?}"
        );
        let mut got = vec![bf16::ZERO; p.m * p.n];
        d_dev.download(&gpu, &mut got).unwrap();
        let check = reference.check(&p, &got);
        assert!(check.passed(), "sms {sms}: {check}");
    }
    assert!(times[1] > 3.0 * times[0], "capped at 16 SMs: {times:?} ms");
}

/// The host half of the bench's check (no GPU needed): every element is counted once, in
/// parallel parts, and a wrong element is reported at its own index wherever it lies.
#[test]
fn the_bench_check_counts_every_element_at_its_index() {
    let p = GemmProblem::new(37, 129, 64, BLayout::KN, DType::BF16, DType::F32).unwrap();
    let mut rng = Rng(5);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let want = reference_gemm::<bf16, f32>(&p, &Epilogue::default(), &a, &b, None, None, None);
    let reference = DeviceReference {
        value: want.iter().map(|w| w.value).collect(),
        abs_products: want.iter().map(|w| w.abs_products as f32).collect(),
    };
    let exact: Vec<f32> = want.iter().map(|w| w.value as f32).collect();
    let check = reference.check(&p, &exact);
    assert!(check.passed() && check.checked == p.m * p.n, "{check}");
    for wrong in [0, 1, p.n + 1, p.m * p.n / 2 + 1, p.m * p.n - 1] {
        let mut got = exact.clone();
        got[wrong] += 0.5;
        let check = reference.check(&p, &got);
        assert_eq!(
            (check.checked, check.out_of_bound, check.worst.map(|w| w.0)),
            (p.m * p.n, 1, Some(wrong)),
            "{check}"
        );
    }
}

/// The device check looks at every element: one wrong element in an odd column of a
/// 2048×8192 output is found, and only that one (the bench's former sampled check scaled a
/// 24-bit random value by M·N and drew only even indices, so even columns, at this shape).
#[test]
fn the_device_check_finds_one_wrong_element_in_an_odd_column() {
    let Some((gpu, kernels, stream)) = one_gpu() else {
        return;
    };
    let p = GemmProblem::new(2048, 8192, 3584, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let mut rng = Rng(31);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let (a_dev, b_dev) = (upload(&gpu, &a), upload(&gpu, &b));
    let d_dev = DeviceMemory::zeroed(&gpu, p.m * p.n * 2).unwrap();
    let plan = GemmPlan::local(p, TILE, Epilogue::default());
    let ops = GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_dev.addr());
    let gemm = PreparedGemm::new(&gpu, &kernels, &plan, &ops, None, 0, 0).unwrap();
    d_dev.fill(&gpu, 0xff).unwrap();
    run(&gemm, &stream);
    let mut got = vec![bf16::ZERO; p.m * p.n];
    d_dev.download(&gpu, &mut got).unwrap();
    let reference = ReferenceGemm::load(&gpu).unwrap();
    // SAFETY: A and B hold the problem's operands
    let reference = unsafe {
        reference
            .compute(&gpu, &stream, &p, a_dev.addr(), b_dev.addr())
            .unwrap()
    };
    let check = reference.check(&p, &got);
    assert!(check.passed() && check.checked == p.m * p.n, "{check}");
    let wrong = 1234 * p.n + 4567;
    got[wrong] = bf16::from_f64(got[wrong].to_f64() + 1.0);
    let check = reference.check(&p, &got);
    assert_eq!(
        (check.out_of_bound, check.worst.map(|w| w.0)),
        (1, Some(wrong)),
        "{check}"
    );
}

#[test]
fn a_consumer_on_the_peer_never_reads_a_stale_tile() {
    if !gpus(2) {
        return;
    }
    let (g0, g1) = (Gpu::open(0).unwrap(), Gpu::open(1).unwrap());
    g0.enable_peer_access(&g1).unwrap();
    let (k0, k1) = (
        GemmKernels::load(&g0).unwrap(),
        GemmKernels::load(&g1).unwrap(),
    );
    let (s0, s1) = (Stream::new(&g0).unwrap(), Stream::new(&g1).unwrap());
    let p = GemmProblem::new(1000, 2000, 1024, BLayout::NK, DType::BF16, DType::BF16).unwrap();
    let mut rng = Rng(7);
    let a: Vec<bf16> = rng.vec(p.m * p.k);
    let b: Vec<bf16> = rng.vec(p.k * p.n);
    let (a_dev, b_dev) = (upload(&g0, &a), upload(&g0, &b));
    let d_local = DeviceMemory::zeroed(&g0, 16).unwrap();
    let bytes = p.m * p.n * 2;
    let d_peer = DeviceMemory::zeroed(&g1, bytes).unwrap();
    let snap = DeviceMemory::zeroed(&g1, bytes).unwrap();
    let mut plan = GemmPlan::local(p, TILE, Epilogue::default());
    rng.shuffle(&mut plan.order);
    let flags = DeviceMemory::zeroed(&g1, 8 * plan.tile_count()).unwrap();
    plan.route_in_place(|_| 1, Some((0, NotifyOp::Add)));
    let outputs = [d_local.addr(), d_peer.addr()];
    let flag = |_rank: usize, slot: Slot| flags.addr() + 8 * slot.col as u64;
    let targets = RouteTargets {
        outputs: &outputs,
        flag: &flag,
    };
    let ops = GemmOperands::plain(a_dev.addr(), b_dev.addr(), d_local.addr());
    let gemm = PreparedGemm::new(&g0, &k0, &plan, &ops, Some(&targets), 0, 0).unwrap();
    let error = MappedHost::new(&g1, ErrorRecord::default()).unwrap();
    let mut consumer = TileSnapshot::new(
        &g1,
        &k1,
        &plan,
        d_peer.addr(),
        snap.addr(),
        flags.addr(),
        &error,
    )
    .unwrap();
    let want = reference_gemm::<bf16, bf16>(&p, &Epilogue::default(), &a, &b, None, None, None);
    for call in 1..=6u64 {
        d_peer.fill(&g1, 0xff).unwrap();
        snap.fill(&g1, 0x5a).unwrap();
        // the consumer starts first and spins on the flags while the GEMM makes the tiles
        // SAFETY: all buffers outlive the synchronisations below
        unsafe {
            consumer.launch(&s1, call, 132).unwrap();
            gemm.launch(&s0).unwrap();
        }
        s0.synchronize().unwrap();
        s1.synchronize()
            .unwrap_or_else(|e| panic!("{e}: {:?}", error.read()));
        let (mut got, mut seen) = (vec![bf16::ZERO; p.m * p.n], vec![bf16::ZERO; p.m * p.n]);
        d_peer.download(&g1, &mut got).unwrap();
        snap.download(&g1, &mut seen).unwrap();
        let check = check(&p, &Epilogue::default(), &got, &want);
        assert!(
            check.passed(),
            "call {call}: the tiles on the peer are wrong: {check}"
        );
        let stale = got
            .iter()
            .zip(&seen)
            .position(|(g, s)| g.to_bits() != s.to_bits());
        assert_eq!(
            stale, None,
            "call {call}: the consumer read element {stale:?} before its tile was complete"
        );
    }
}
