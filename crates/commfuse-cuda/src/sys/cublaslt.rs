//! The cuBLASLt baseline at its best: a small wrapper that builds descriptors and layouts once
//! per shape, asks the heuristic for up to [`CANDIDATES`] algorithms, times each on the real
//! operands and keeps the fastest (the heuristic's first pick is not always it, and baselines
//! are to be taken at their best), caching the choice per shape and SM cap (cudarc's safe layer
//! redoes descriptors and heuristic per call and takes the first pick). It can cap the SMs
//! cuBLASLt uses (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`, to leave SMs to communication kernels).
//!
//! Row-major D[M,N] = A[M,K]·B is computed as the column-major Dᵀ[N,M] = Bᵀ·Aᵀ: B goes first.

use crate::error::CudaError;
use crate::sys::driver::{DeviceMemory, Event, Gpu, Stream};
use commfuse_core::gemm::{BLayout, GemmProblem};
use commfuse_core::DType;
use cudarc::cublaslt::{result, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The workspace every candidate may use (the heuristic only offers algorithms that fit).
const WORKSPACE_BYTES: usize = 64 << 20;
/// Algorithms asked of the heuristic per shape.
pub const CANDIDATES: usize = 16;
/// Untimed then timed calls per candidate when choosing.
const TUNE_WARMUP: usize = 2;
const TUNE_RUNS: usize = 5;
/// How long choosing an algorithm waits for one candidate's timed runs: they take
/// milliseconds, so a wait this long means the GPU is stuck (or held by a kernel that is).
const TUNE_WAIT: Duration = Duration::from_secs(60);
// cublasOperation_t (cudarc's cublasLt bindings do not carry the enum)
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

fn lt<T>(call: &'static str, r: Result<T, result::CublasError>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    })
}

fn data_type(d: DType) -> sys::cudaDataType {
    match d {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    problem: GemmProblem,
    sms: u32,
    /// Whether the epilogue adds a bias vector (a different descriptor and algorithm set)
    bias: bool,
}

/// What cuBLASLt says of one of its algorithms through the algorithm configuration attributes
/// (`cublasLtMatmulAlgoConfigGetAttribute`), each the raw value of its enum in cuBLASLt's
/// headers, or none where this cuBLASLt does not answer. The Hopper kernels (`nvjet_*`) report
/// their tile and cluster through `tile` and `cluster_shape` where they report them at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct AlgoConfig {
    /// `CUBLASLT_ALGO_CONFIG_ID`: the algorithm's number
    pub id: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_TILE_ID` (`cublasLtMatmulTile_t`)
    pub tile: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_STAGES_ID` (`cublasLtMatmulStages_t`)
    pub stages: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_SPLITK_NUM`: K parts (1: none)
    pub split_k: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME` (`cublasLtReductionScheme_t`) of the K parts
    pub reduction: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING`
    pub swizzle: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION`
    pub custom: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID` (`cublasLtMatmulInnerShape_t`)
    pub inner_shape: Option<i64>,
    /// `CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID` (`cublasLtClusterShape_t`)
    pub cluster_shape: Option<i64>,
}

impl AlgoConfig {
    /// Reads every attribute of `algo`.
    fn of(algo: &sys::cublasLtMatmulAlgo_t) -> AlgoConfig {
        use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
        // each attribute's size in bytes (signed: the ID only), per cuBLASLt's headers
        let read = |attr: A, bytes: usize, signed: bool| -> Option<i64> {
            let mut buf = [0u8; 8];
            let mut written = 0usize;
            // SAFETY: a live algorithm; the buffer holds `bytes` ≤ 8 bytes
            let status = unsafe {
                sys::cublasLtMatmulAlgoConfigGetAttribute(
                    algo,
                    attr,
                    buf.as_mut_ptr() as *mut c_void,
                    bytes,
                    &mut written,
                )
            };
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || written != bytes {
                return None;
            }
            Some(raw_value(&buf[..bytes], signed))
        };
        AlgoConfig {
            id: read(A::CUBLASLT_ALGO_CONFIG_ID, 4, true),
            tile: read(A::CUBLASLT_ALGO_CONFIG_TILE_ID, 4, false),
            stages: read(A::CUBLASLT_ALGO_CONFIG_STAGES_ID, 4, false),
            split_k: read(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4, false),
            reduction: read(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 4, false),
            swizzle: read(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4, false),
            custom: read(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 4, false),
            inner_shape: read(A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, 2, false),
            cluster_shape: read(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2, false),
        }
    }
}

/// A little-endian integer of 2 or 4 bytes, sign-extended where `signed`.
fn raw_value(bytes: &[u8], signed: bool) -> i64 {
    match (bytes.len(), signed) {
        (2, false) => i64::from(u16::from_le_bytes([bytes[0], bytes[1]])),
        (2, true) => i64::from(i16::from_le_bytes([bytes[0], bytes[1]])),
        (4, false) => i64::from(u32::from_le_bytes(bytes.try_into().unwrap())),
        (4, true) => i64::from(i32::from_le_bytes(bytes.try_into().unwrap())),
        _ => unreachable!("cuBLASLt's configuration attributes are 2 or 4 bytes"),
    }
}

/// Which heuristic candidate a shape runs with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Its place in the heuristic's list (0: the heuristic's own first pick).
    pub index: usize,
    /// How many candidates the heuristic offered (and were timed).
    pub candidates: usize,
    /// Its mean time per call while choosing, in ms.
    pub time_ms: f32,
    /// The host's time to queue one of its calls while choosing, in µs.
    pub host_us: f32,
    /// What the algorithm is (tile, stages, split-K, cluster, ...)
    pub config: AlgoConfig,
}

/// One candidate's times while choosing.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CandidateTime {
    /// Its place in the heuristic's list
    pub index: usize,
    /// The mean GPU time per call, in ms
    pub time_ms: f32,
    /// The host's mean time to queue one call, in µs
    pub host_us: f32,
    /// What the algorithm is
    pub config: AlgoConfig,
}

/// How much slower on the GPU than the fastest a candidate may be and still be chosen for
/// costing the host less per call. Candidates differ in how many kernels a call queues (a
/// split-K reduction, a workspace clear): at decode sizes, where the GPU's times of the best
/// few agree within noise, their host times differ by microseconds.
pub const HOST_TIE: f32 = 0.01;

/// The candidate to run: the fastest on the GPU, unless one within [`HOST_TIE`] of it costs
/// the host less (then the cheapest of those).
pub fn pick(times: &[CandidateTime]) -> Option<CandidateTime> {
    let fastest = times.iter().map(|t| t.time_ms).min_by(f32::total_cmp)?;
    times
        .iter()
        .filter(|t| t.time_ms <= fastest * (1.0 + HOST_TIE))
        .min_by(|a, b| a.host_us.total_cmp(&b.host_us))
        .copied()
}

/// A matmul descriptor and the three matrix layouts of one shape, destroyed on drop.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    /// B, A, D in cuBLASLt's (column-major) view
    layouts: [sys::cublasLtMatrixLayout_t; 3],
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created by this wrapper, no launch in flight (callers synchronise)
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                if !l.is_null() {
                    let _ = result::destroy_matrix_layout(l);
                }
            }
        }
    }
}

struct Prepared {
    descriptors: Descriptors,
    algo: sys::cublasLtMatmulAlgo_t,
    choice: Choice,
    /// Every candidate's times while choosing
    times: Vec<CandidateTime>,
}

/// One cuBLASLt handle on one GPU, with its workspace and per-shape cache.
pub struct Lt {
    gpu: Arc<Gpu>,
    /// The alignment, in bytes, every operand pointer is promised to have (the heuristic
    /// offers only algorithms that work with it)
    alignment: u32,
    handle: sys::cublasLtHandle_t,
    workspace: DeviceMemory,
    cache: Mutex<HashMap<Key, Prepared>>,
}

// SAFETY: the handle is used from one thread at a time (the cache's lock serialises setup;
// launches go to one stream per GPU).
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Lt {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Lt, CudaError> {
        Lt::with_alignment(gpu, 256)
    }

    /// An Lt whose operands may start on any `alignment`-byte boundary (a power of two; 256,
    /// cuBLASLt's default, for whole buffers from the allocator). Calls on row pieces of a
    /// matrix need 16: the heuristic's default assumes 256 and may pick algorithms that fail on
    /// less.
    pub fn with_alignment(gpu: &Arc<Gpu>, alignment: u32) -> Result<Lt, CudaError> {
        // SAFETY: only tries to dlopen libcublasLt
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "cuBLASLt (libcublasLt.so) is not on the library path".into(),
            ));
        }
        gpu.bind()?;
        Ok(Lt {
            gpu: gpu.clone(),
            alignment,
            handle: lt("cublasLtCreate", result::create_handle())?,
            workspace: DeviceMemory::zeroed(gpu, WORKSPACE_BYTES)?,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The candidate chosen for `problem` at `sms`, with or without a bias (after its first
    /// call).
    pub fn choice(&self, problem: &GemmProblem, sms: u32, bias: bool) -> Option<Choice> {
        let key = Key {
            problem: *problem,
            sms,
            bias,
        };
        self.cache.lock().unwrap().get(&key).map(|p| p.choice)
    }

    /// Every candidate's times for `problem` at `sms`, with or without a bias, while choosing
    /// (after its first call; empty before).
    pub fn candidate_times(
        &self,
        problem: &GemmProblem,
        sms: u32,
        bias: bool,
    ) -> Vec<CandidateTime> {
        let key = Key {
            problem: *problem,
            sms,
            bias,
        };
        let cache = self.cache.lock().unwrap();
        cache.get(&key).map_or(vec![], |p| p.times.clone())
    }

    fn descriptors(&self, key: &Key) -> Result<Descriptors, CudaError> {
        let p = &key.problem;
        let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
        let mut d = Descriptors {
            desc: lt(
                "cublasLtMatmulDescCreate",
                result::create_matmul_desc(
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cudaDataType::CUDA_R_32F,
                ),
            )?,
            layouts: [std::ptr::null_mut(); 3],
        };
        // first operand: B as column-major; [K,N] row-major is (N×K, ld N); [N,K] row-major is
        // (K×N, ld K) transposed
        let (b_rows, b_cols, b_ld, trans) = match p.b_layout {
            BLayout::KN => (n, k, n as i64, CUBLAS_OP_N),
            BLayout::NK => (k, n, k as i64, CUBLAS_OP_T),
        };
        // SAFETY: live descriptor, attribute buffers of the documented types
        unsafe {
            lt(
                "cublasLtMatmulDescSetAttribute(TRANSA)",
                result::set_matmul_desc_attribute(
                    d.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    &trans as *const _ as *const c_void,
                    std::mem::size_of_val(&trans),
                ),
            )?;
            if key.bias {
                let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                lt(
                    "cublasLtMatmulDescSetAttribute(EPILOGUE)",
                    result::set_matmul_desc_attribute(
                        d.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                        &epilogue as *const _ as *const c_void,
                        std::mem::size_of_val(&epilogue),
                    ),
                )?;
                // the bias is of the output type (cuBLASLt's default for 16-bit outputs; said
                // outright so that an f32 output reads an f32 bias)
                let dtype = data_type(p.output);
                lt(
                    "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)",
                    result::set_matmul_desc_attribute(
                        d.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                        &dtype as *const _ as *const c_void,
                        std::mem::size_of_val(&dtype),
                    ),
                )?;
            }
            if key.sms > 0 {
                let sms = key.sms as i32;
                lt(
                    "cublasLtMatmulDescSetAttribute(SM_COUNT_TARGET)",
                    result::set_matmul_desc_attribute(
                        d.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                        &sms as *const _ as *const c_void,
                        std::mem::size_of_val(&sms),
                    ),
                )?;
            }
        }
        let shapes = [
            (data_type(p.input), b_rows, b_cols, b_ld),
            (data_type(p.input), k, m, k as i64),
            (data_type(p.output), n, m, n as i64),
        ];
        for (layout, (dtype, rows, cols, ld)) in d.layouts.iter_mut().zip(shapes) {
            *layout = lt(
                "cublasLtMatrixLayoutCreate",
                result::create_matrix_layout(dtype, rows, cols, ld),
            )?;
        }
        Ok(d)
    }

    /// Up to [`CANDIDATES`] algorithms for the shape, the heuristic's order, each fitting the
    /// workspace and reducing split-K partials in f32 (never in the output type, which would
    /// hold cuBLASLt to a weaker accuracy contract than ours).
    fn candidates(&self, d: &Descriptors) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, CudaError> {
        let pref = lt(
            "cublasLtMatmulPreferenceCreate",
            result::create_matmul_pref(),
        )?;
        let ws = WORKSPACE_BYTES as u64;
        let reductions = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_INPLACE as u32
            | sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        // SAFETY: zeroed plain-data results; live handles; attribute buffers of the documented
        // types; the preference is destroyed on every path
        unsafe {
            let mut results: [sys::cublasLtMatmulHeuristicResult_t; CANDIDATES] =
                std::mem::zeroed();
            let mut count = 0;
            let asked = lt(
                "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
                result::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const _ as *const c_void,
                    std::mem::size_of_val(&ws),
                ),
            )
            .and_then(|()| {
                lt(
                    "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)",
                    result::set_matmul_pref_attribute(
                        pref,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                        &reductions as *const _ as *const c_void,
                        std::mem::size_of_val(&reductions),
                    ),
                )
            })
            .and_then(|()| {
                use sys::cublasLtMatmulPreferenceAttributes_t as A;
                [
                    A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    A::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ]
                .into_iter()
                .try_for_each(|attr| {
                    lt(
                        "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)",
                        result::set_matmul_pref_attribute(
                            pref,
                            attr,
                            &self.alignment as *const u32 as *const c_void,
                            std::mem::size_of::<u32>(),
                        ),
                    )
                })
            })
            .and_then(|()| {
                lt(
                    "cublasLtMatmulAlgoGetHeuristic",
                    sys::cublasLtMatmulAlgoGetHeuristic(
                        self.handle,
                        d.desc,
                        d.layouts[0],
                        d.layouts[1],
                        d.layouts[2],
                        d.layouts[2],
                        pref,
                        CANDIDATES as i32,
                        results.as_mut_ptr(),
                        &mut count,
                    )
                    .result(),
                )
            });
            let _ = result::destroy_matmul_pref(pref);
            asked?;
            let algos: Vec<_> = results[..(count.max(0) as usize).min(CANDIDATES)]
                .iter()
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo)
                .collect();
            if algos.is_empty() {
                return Err(CudaError::Unavailable(
                    "cuBLASLt's heuristic offers no algorithm for this GEMM".into(),
                ));
            }
            Ok(algos)
        }
    }

    /// Times every candidate on `a` and `b` into a scratch output (the caller's D is never
    /// touched: with beta ≠ 0 it is an input) and keeps the fastest.
    fn prepare(
        &self,
        key: Key,
        stream: &Stream,
        a: u64,
        b: u64,
        scratch: Option<u64>,
    ) -> Result<(), CudaError> {
        let mut cache = self.cache.lock().unwrap();
        if cache.contains_key(&key) {
            return Ok(());
        }
        let descriptors = self.descriptors(&key)?;
        let algos = self.candidates(&descriptors)?;
        let p = &key.problem;
        // the caller's scratch, or one of our own (allocating can synchronise the device and
        // its peers: a caller amid a protocol with other GPUs passes its own)
        let own = match scratch {
            Some(_) => None,
            None => Some(DeviceMemory::zeroed(
                &self.gpu,
                p.m * p.n * p.output.size(),
            )?),
        };
        let scratch_addr = scratch.unwrap_or_else(|| own.as_ref().map_or(0, DeviceMemory::addr));
        // a bias while choosing: the scratch itself (N elements of the output type)
        let who = format!("cuBLASLt's tuning on GPU {}", self.gpu.ordinal);
        let mut stuck = false;
        let mut time = || -> Result<Vec<CandidateTime>, CudaError> {
            let mut times = vec![];
            for (index, algo) in algos.iter().enumerate() {
                let call = || {
                    // SAFETY: operands as the caller promised, scratch sized for D, live
                    // descriptors
                    unsafe {
                        let d = scratch_addr;
                        let bias = key.bias.then_some(d);
                        self.launch(&descriptors, algo, stream, (a, b, d, d), bias, 1.0, 0.0)
                    }
                };
                let (start, end) = (Event::new(&self.gpu)?, Event::new(&self.gpu)?);
                // a candidate cuBLASLt refuses at launch (its status, returned before anything
                // is enqueued) is skipped
                let mut queued = Duration::ZERO;
                let timed = (0..TUNE_WARMUP).try_for_each(|_| call()).and_then(|()| {
                    start.record(stream)?;
                    let host = Instant::now();
                    (0..TUNE_RUNS).try_for_each(|_| call())?;
                    queued = host.elapsed();
                    end.record(stream)
                });
                if timed.is_err() {
                    continue;
                }
                let what = format!(
                    "the timed runs of candidate {index} of {} for the {}×{}×{} GEMM",
                    algos.len(),
                    p.m,
                    p.n,
                    p.k
                );
                if let Err(e) = stream.synchronize_within(TUNE_WAIT, &who, &what) {
                    stuck = true;
                    return Err(e);
                }
                times.push(CandidateTime {
                    index,
                    time_ms: start.elapsed_ms(&end)? / TUNE_RUNS as f32,
                    host_us: queued.as_secs_f32() * 1e6 / TUNE_RUNS as f32,
                    config: AlgoConfig::of(algo),
                });
            }
            Ok(times)
        };
        let times = time();
        // on every path the timed calls must have ended before the scratch output is freed:
        // one still running after the bound keeps it (leaked) rather than write into whatever
        // is allocated there next
        if stuck || !matches!(stream.wait_idle(TUNE_WAIT), Ok(true)) {
            std::mem::forget(own);
        }
        let times = times?;
        let best = pick(&times).ok_or_else(|| {
            CudaError::Unavailable(format!(
                "none of cuBLASLt's {} candidate algorithms ran",
                algos.len()
            ))
        })?;
        cache.insert(
            key,
            Prepared {
                descriptors,
                algo: algos[best.index],
                choice: Choice {
                    index: best.index,
                    candidates: algos.len(),
                    time_ms: best.time_ms,
                    host_us: best.host_us,
                    config: best.config,
                },
                times,
            },
        );
        Ok(())
    }

    /// # Safety
    /// `a`, `b`, `c`, `d` as for [`Lt::matmul_into`]; `d` may be any buffer of D's size. The
    /// descriptor must have been built with a bias exactly when `bias` is given.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        descriptors: &Descriptors,
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: &Stream,
        (a, b, c, d): (u64, u64, u64, u64),
        bias: Option<u64>,
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        if let Some(bias) = bias {
            // read when the call is enqueued: each call may name its own bias
            lt(
                "cublasLtMatmulDescSetAttribute(BIAS_POINTER)",
                result::set_matmul_desc_attribute(
                    descriptors.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const u64 as *const c_void,
                    std::mem::size_of::<u64>(),
                ),
            )?;
        }
        lt(
            "cublasLtMatmul",
            result::matmul(
                self.handle,
                descriptors.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                descriptors.layouts[0],
                a as *const c_void,
                descriptors.layouts[1],
                c as *const c_void,
                descriptors.layouts[2],
                d as *mut c_void,
                descriptors.layouts[2],
                algo,
                self.workspace.addr() as *mut c_void,
                WORKSPACE_BYTES,
                stream.raw() as sys::cudaStream_t,
            ),
        )
    }

    /// D = alpha·A·B + beta·D on `stream`; `sms` > 0 caps the SMs used. The first call per
    /// shape and cap chooses among the heuristic's candidates by timing them (see
    /// [`Lt::choice`]).
    ///
    /// # Safety
    /// `a`, `b` and `d` must be device addresses on this GPU holding the problem's operands.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        stream: &Stream,
        problem: &GemmProblem,
        sms: u32,
        a: u64,
        b: u64,
        d: u64,
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        self.matmul_into(stream, problem, sms, (a, b, d, d), None, alpha, beta)
    }

    /// D = alpha·A·B + beta·C (+ bias, one element per column of D) on `stream`, C and D
    /// row-major with leading dimension N; C may be D. As [`Lt::matmul`] otherwise: the first
    /// call per shape, cap and bias-or-not synchronises `stream` to choose the algorithm
    /// ([`Lt::tune`] does it ahead).
    ///
    /// # Safety
    /// `a`, `b`, `c`, `d` (and `bias`, N elements of the output type) must be device addresses
    /// on this GPU (`d` and `c` may be a peer's) holding the problem's operands, valid until the
    /// call completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_into(
        &self,
        stream: &Stream,
        problem: &GemmProblem,
        sms: u32,
        (a, b, c, d): (u64, u64, u64, u64),
        bias: Option<u64>,
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        let key = Key {
            problem: *problem,
            sms,
            bias: bias.is_some(),
        };
        self.prepare(key, stream, a, b, None)?;
        let cache = self.cache.lock().unwrap();
        let p = &cache[&key];
        self.launch(
            &p.descriptors,
            &p.algo,
            stream,
            (a, b, c, d),
            bias,
            alpha,
            beta,
        )
    }

    /// Whether `problem` (with or without a bias, on `sms` SMs) has its algorithm chosen, so
    /// that its calls synchronise nothing (what a call captured into a CUDA graph needs).
    pub fn is_tuned(&self, problem: &GemmProblem, sms: u32, bias: bool) -> bool {
        let key = Key {
            problem: *problem,
            sms,
            bias,
        };
        self.cache.lock().unwrap().contains_key(&key)
    }

    /// Chooses the algorithm of `problem` (with or without a bias) ahead of its first call, by
    /// timing the candidates on `a` and `b` into `scratch` on `stream` (which it
    /// synchronises); allocates nothing.
    ///
    /// # Safety
    /// `a` and `b` must hold at least the problem's operands' sizes of device memory on this
    /// GPU (their values only steer the timing), `scratch` M×N elements of the output type
    /// that nothing else uses meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tune(
        &self,
        stream: &Stream,
        problem: &GemmProblem,
        sms: u32,
        bias: bool,
        (a, b, scratch): (u64, u64, u64),
    ) -> Result<(), CudaError> {
        let key = Key {
            problem: *problem,
            sms,
            bias,
        };
        self.prepare(key, stream, a, b, Some(scratch))
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // the descriptors go first (they do not need the handle), then the handle
        self.cache.get_mut().unwrap().clear();
        // SAFETY: created here, no launch in flight (callers synchronise)
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{pick, CandidateTime, HOST_TIE};

    fn t(index: usize, time_ms: f32, host_us: f32) -> CandidateTime {
        CandidateTime {
            index,
            time_ms,
            host_us,
            config: Default::default(),
        }
    }

    #[test]
    fn the_fastest_on_the_gpu_is_picked_when_no_other_is_close() {
        let times = [
            t(0, 1.0, 9.0),
            t(1, 1.0 + 2.0 * HOST_TIE, 3.0),
            t(2, 2.0, 1.0),
        ];
        assert_eq!(pick(&times).unwrap().index, 0);
    }

    #[test]
    fn a_candidate_as_fast_within_the_tie_that_costs_the_host_less_is_picked() {
        let times = [
            t(0, 0.0171, 8.0),
            t(1, 0.0170, 9.0),
            t(2, 0.0170 * (1.0 + HOST_TIE / 2.0), 4.0),
            t(3, 0.0180, 2.0),
        ];
        assert_eq!(pick(&times).unwrap().index, 2);
    }

    #[test]
    fn nothing_is_picked_from_no_candidates() {
        assert!(pick(&[]).is_none());
    }

    #[test]
    fn configuration_values_are_read_little_endian_at_their_width() {
        use super::raw_value;
        assert_eq!(raw_value(&[0x34, 0x12], false), 0x1234);
        assert_eq!(raw_value(&[0xff, 0xff], false), 0xffff);
        assert_eq!(raw_value(&[0xff, 0xff], true), -1);
        assert_eq!(raw_value(&[0x78, 0x56, 0x34, 0x12], false), 0x1234_5678);
        assert_eq!(raw_value(&[0xfe, 0xff, 0xff, 0xff], true), -2);
        assert_eq!(raw_value(&[0xfe, 0xff, 0xff, 0xff], false), 0xffff_fffe);
    }
}
