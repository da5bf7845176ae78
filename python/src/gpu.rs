//! The GPU operators for one process per GPU (PyTorch's model): one object per rank, built for
//! (rank, world, shape limits, types), its buffers exported as bytes that the caller's own
//! rendezvous (`torch.distributed.all_gather_object`) carries to every rank, then called with
//! raw device pointers and the caller's CUDA stream. `commfuse/torch/` is the face users see;
//! these classes take addresses so that no PyTorch library is linked (any framework whose
//! tensors give a device pointer and a stream can call them).

use crate::args::{Int, Name};
use crate::{ag_path_arg, parse_dtype, parse_layout, parse_path, value_error};
use commfuse_core::fused::gemm_rs::{GemmRsPath, GemmRsShape};
use commfuse_core::{Algo, OpKind, ReduceOp};
use commfuse_cuda::ag_gemm::{AgGemmAllocation, AgGemmConfig, AgGemmRank};
use commfuse_cuda::collective::rank::{CollectiveAllocation, CollectiveConfig, CollectiveRank};
use commfuse_cuda::error::CudaError;
use commfuse_cuda::gemm_rs::{GemmRsAllocation, GemmRsConfig, GemmRsRank, PathChoice};
use commfuse_cuda::sys::driver::{Gpu, Stream};
use commfuse_cuda::sys::ipc::Exported;
use commfuse_cuda::sys::spans::CheckedSpans;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Why a call of an operator did not run: a call that does not fit the operator (a
/// `ValueError` in Python), or a CUDA failure or a peer that never arrived (a `RuntimeError`).
/// Kept apart from `PyErr` because the dispatcher's native kernels ([`crate::native`]) call the
/// operators without Python and hand the message on themselves.
#[derive(Debug)]
pub(crate) enum Failure {
    Value(String),
    Runtime(String),
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        match f {
            Failure::Value(m) => PyValueError::new_err(m),
            Failure::Runtime(m) => PyRuntimeError::new_err(m),
        }
    }
}

fn cuda_error(e: CudaError) -> Failure {
    match e {
        CudaError::Unavailable(_) | CudaError::OutOfBounds(_) => Failure::Value(e.to_string()),
        _ => Failure::Runtime(e.to_string()),
    }
}

/// An operator's life: allocated and exported, then connected to its peers.
///
/// The operator classes hold it behind a mutex ([`Shared`]), so they may be called from any
/// thread — autograd runs a CUDA tensor's backward on a thread of its own, and the
/// dispatcher's native kernels call without Python — and every call binds the operator's GPU
/// context first.
enum Stage<A, R> {
    Allocated(A),
    Connected(R),
    /// Between the two, or after a connection failed
    Gone,
}

impl<A, R> Stage<A, R> {
    fn allocated(&self) -> Result<&A, Failure> {
        match self {
            Stage::Allocated(a) => Ok(a),
            _ => Err(Failure::Value(
                "this operator is already connected (export comes before connect)".into(),
            )),
        }
    }

    fn connected(&mut self) -> Result<&mut R, Failure> {
        match self {
            Stage::Connected(r) => Ok(r),
            Stage::Allocated(_) => Err(Failure::Value(
                "connect the operator to its peers' exports before calling it".into(),
            )),
            Stage::Gone => Err(Failure::Value(
                "this operator failed to connect; build a new one".into(),
            )),
        }
    }

    /// Connects with every rank's exported bytes (rank order, this rank's own among them).
    fn connect(
        &mut self,
        exports: Vec<Vec<u8>>,
        finish: impl FnOnce(A, &[Exported]) -> Result<R, CudaError>,
    ) -> PyResult<()> {
        self.allocated()?;
        let exports = exports
            .iter()
            .map(|b| Exported::from_bytes(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(cuda_error)?;
        let Stage::Allocated(a) = std::mem::replace(self, Stage::Gone) else {
            unreachable!("checked above");
        };
        *self = Stage::Connected(finish(a, &exports).map_err(cuda_error)?);
        Ok(())
    }
}

/// What an operator's allocation does before it knows its peers (export its buffers, connect
/// to theirs), and what the connected rank reports after its calls: the one life every GPU
/// operator class has.
pub(crate) trait Allocation: Sized {
    type Rank;
    fn export(&self) -> Result<Exported, CudaError>;
    fn connect(self, exports: &[Exported]) -> Result<Self::Rank, CudaError>;
    /// The diagnosis of a wait that timed out in an earlier call, once its stream was
    /// synchronised
    fn check(rank: &mut Self::Rank) -> Result<(), CudaError>;
}

macro_rules! allocation {
    ($allocation:ty, $rank:ty) => {
        impl Allocation for $allocation {
            type Rank = $rank;
            fn export(&self) -> Result<Exported, CudaError> {
                <$allocation>::export(self)
            }
            fn connect(self, exports: &[Exported]) -> Result<$rank, CudaError> {
                self.connect_exported(exports)
            }
            fn check(rank: &mut $rank) -> Result<(), CudaError> {
                rank.check()
            }
        }
    };
}
allocation!(GemmRsAllocation, GemmRsRank);
allocation!(AgGemmAllocation, AgGemmRank);
allocation!(CollectiveAllocation, CollectiveRank);

/// A GPU operator class's state: its [`Stage`] and the checked spans of the `SPANS` device
/// addresses its calls take (each checked at the first call that passes it).
pub(crate) struct Staged<A: Allocation, const SPANS: usize> {
    stage: Stage<A, A::Rank>,
    spans: CheckedSpans<SPANS>,
}

/// A [`Staged`] as the operator classes hold it: shared with the dispatcher's native kernels
/// (which keep a reference while a prepared call of theirs uses it) and locked for each use.
/// The lock is never held while the GIL is being acquired: a call that releases the GIL takes
/// the lock after releasing it and drops it before taking it back.
pub(crate) type Shared<T> = Arc<Mutex<T>>;

/// The state behind `shared`; a thread that panicked while holding it left nothing half-done
/// that the next call could trip on (every call checks the stage afresh), so a poisoned lock
/// is taken as it is.
pub(crate) fn lock<T>(shared: &Mutex<T>) -> MutexGuard<'_, T> {
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<A: Allocation, const SPANS: usize> Staged<A, SPANS> {
    fn new(allocation: A, device: usize) -> Shared<Self> {
        Arc::new(Mutex::new(Staged {
            stage: Stage::Allocated(allocation),
            spans: CheckedSpans::new(device),
        }))
    }

    /// This rank's buffers as bytes for the other processes (CUDA IPC handles).
    fn export<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.stage.allocated()?.export().map_err(cuda_error)?;
        Ok(PyBytes::new(py, &bytes.to_bytes()))
    }

    /// Opens every rank's export (rank order, this rank's own among them).
    fn connect(&mut self, exports: Vec<Vec<u8>>) -> PyResult<()> {
        self.stage.connect(exports, A::connect)
    }

    /// The connected rank.
    fn rank(&mut self) -> Result<&mut A::Rank, Failure> {
        self.stage.connected()
    }

    /// The connected rank and the spans, for a call: fails first if an earlier call's wait
    /// timed out on the device.
    fn ready(&mut self) -> Result<(&mut A::Rank, &mut CheckedSpans<SPANS>), Failure> {
        let rank = self.stage.connected()?;
        A::check(rank).map_err(earlier_failure)?;
        Ok((rank, &mut self.spans))
    }

    /// After the stream was synchronised: raises the diagnosis of a wait that timed out.
    fn check(&mut self) -> PyResult<()> {
        Ok(A::check(self.rank()?).map_err(earlier_failure)?)
    }
}

/// The state of each operator class: its spans are A, B, the bias and the output, then (the
/// all-gather + GEMM's) the gathered A; a collective's are its input and output.
pub(crate) type GemmRsState = Staged<GemmRsAllocation, 4>;
pub(crate) type AgGemmState = Staged<AgGemmAllocation, 5>;
pub(crate) type CollectiveState = Staged<CollectiveAllocation, 2>;

/// One call of a GEMM operator: the rows M (all of them, for the all-gather + GEMM), the device
/// addresses of its operands and the stream it is queued on.
pub(crate) struct GemmCall {
    pub m: usize,
    pub a: u64,
    pub b: u64,
    pub bias: Option<u64>,
    pub out: u64,
    /// the all-gather + GEMM's gathered A, when asked for
    pub gathered: Option<u64>,
    pub stream: u64,
}

/// Queues one GEMM + reduce-scatter call; the caller has released the GIL (or never held it).
pub(crate) fn gemm_rs_forward(state: &mut GemmRsState, call: &GemmCall) -> Result<(), Failure> {
    let (op, spans) = state.ready()?;
    let c = op.config();
    let m = call.m;
    // an M out of range is the operator's to refuse, with its own message
    if (1..=c.max_m).contains(&m) {
        let shape = (m, op.chunk(m).len(), c.k, c.n);
        let sizes = (c.input.size(), c.output.size());
        check_gemm_spans(spans, shape, sizes, (call.a, call.b, call.bias, call.out))?;
    }
    let stream = borrowed_stream(call.stream);
    // SAFETY: the callers pass tensors of this GPU that they keep alive on `stream`; every
    // address was checked to hold the bytes the call touches on this GPU
    unsafe { op.forward(&stream, m, call.a, call.b, call.bias, call.out) }.map_err(cuda_error)
}

/// Queues one all-gather + GEMM call (M the gathered rows).
pub(crate) fn ag_gemm_forward(state: &mut AgGemmState, call: &GemmCall) -> Result<(), Failure> {
    let (op, spans) = state.ready()?;
    let c = *op.config();
    let m = call.m;
    if (1..=c.max_m).contains(&m) {
        let input = c.input.size();
        let shape = (op.chunk(m).len(), m, c.k, c.n);
        let sizes = (input, c.output.size());
        check_gemm_spans(spans, shape, sizes, (call.a, call.b, call.bias, call.out))?;
        if let Some(gathered) = call.gathered {
            spans
                .check(4, "gathered", gathered, bytes(&[m, c.k, input]))
                .map_err(cuda_error)?;
        }
    }
    let stream = borrowed_stream(call.stream);
    // SAFETY: as in gemm_rs_forward
    unsafe {
        op.forward(
            &stream,
            m,
            (call.a, call.b, call.bias),
            call.out,
            call.gathered,
        )
    }
    .map_err(cuda_error)
}

/// Queues one collective call: `input` into `output` (device addresses of the operator's
/// lengths).
pub(crate) fn collective_forward(
    state: &mut CollectiveState,
    input: u64,
    output: u64,
    stream: u64,
) -> Result<(), Failure> {
    let (op, spans) = state.ready()?;
    let (n_in, n_out) = op.lengths();
    let element = op.config().dtype.size();
    spans
        .check(0, "input", input, bytes(&[n_in, element]))
        .map_err(cuda_error)?;
    spans
        .check(1, "output", output, bytes(&[n_out, element]))
        .map_err(cuda_error)?;
    let stream = borrowed_stream(stream);
    // SAFETY: as in gemm_rs_forward
    unsafe { op.forward(&stream, input, output) }.map_err(cuda_error)
}

fn open_gpu(device: usize) -> PyResult<Arc<Gpu>> {
    Ok(Arc::new(Gpu::open(device).map_err(cuda_error)?))
}

/// A stream of the caller's (PyTorch's `torch.cuda.current_stream().cuda_stream`), borrowed for
/// one call.
fn borrowed_stream(stream: u64) -> Stream {
    // SAFETY: the caller passes a live stream of the operator's GPU; a borrowed stream is never
    // destroyed by us
    unsafe { Stream::borrowed(stream as _) }
}

/// Whether `stream` (a `CUstream` handle, 0 the legacy default stream) of CUDA device `device`
/// is being captured into a CUDA graph: what `commfuse.cuda` asks before building an operator,
/// which a capture cannot hold.
#[pyfunction]
pub fn stream_is_capturing(device: usize, stream: u64) -> PyResult<bool> {
    let gpu = Gpu::open(device).map_err(cuda_error)?;
    gpu.bind().map_err(cuda_error)?;
    Ok(borrowed_stream(stream).is_capturing().map_err(cuda_error)?)
}

/// The bytes of an array of these extents (the last one the element size); saturating, so
/// that a product past memory fails the span check instead of wrapping.
fn bytes(extents: &[usize]) -> usize {
    extents.iter().fold(1, |p, &e| p.saturating_mul(e))
}

/// The GEMM operators' operand checks (spans 0..4: A, B, the bias, the output): A of
/// `a_rows` × K and the output of `out_rows` × N, B K × N of the input type, the bias N of the
/// output type; `(input, output)` are the types' sizes in bytes.
fn check_gemm_spans<const ARGS: usize>(
    spans: &mut CheckedSpans<ARGS>,
    (a_rows, out_rows, k, n): (usize, usize, usize, usize),
    (input, output): (usize, usize),
    (a, b, bias, out): (u64, u64, Option<u64>, u64),
) -> Result<(), Failure> {
    spans
        .check(0, "a", a, bytes(&[a_rows, k, input]))
        .map_err(cuda_error)?;
    spans
        .check(1, "b", b, bytes(&[k, n, input]))
        .map_err(cuda_error)?;
    if let Some(bias) = bias {
        spans
            .check(2, "bias", bias, bytes(&[n, output]))
            .map_err(cuda_error)?;
    }
    spans
        .check(3, "out", out, bytes(&[out_rows, n, output]))
        .map_err(cuda_error)
}

/// After the previous calls ended on the device: the diagnosis of a wait that timed out in one
/// of them, as a `RuntimeError`.
fn earlier_failure(e: CudaError) -> Failure {
    Failure::Runtime(e.to_string())
}

/// GEMM + reduce-scatter of one rank on its GPU: rank r's output is its chunk of the rows of
/// Σ_r A_r·B_r (+ bias, added once). Build on every rank, pass every rank's `export()` to
/// `connect`, then call `forward`.
#[pyclass(module = "commfuse._commfuse")]
pub struct GpuGemmReduceScatter {
    op: Shared<GemmRsState>,
}

#[pymethods]
impl GpuGemmReduceScatter {
    /// Allocates rank `rank`'s buffers on CUDA device `device` for calls of up to `max_m` rows,
    /// N columns, K per rank; `path` is "auto", "fused" or "overlapped" (with `pieces`);
    /// `numa_groups` > 1 makes the overlapped path's ring 2D over that many groups of
    /// consecutive ranks.
    #[new]
    #[pyo3(signature = (device, rank, world, max_m, n, k, *, b_layout="nk", dtype="bf16", out_dtype=None, bias=false, path="auto", pieces=None, numa_groups=1, timeout_ms=5000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        rank: usize,
        world: usize,
        max_m: usize,
        n: usize,
        k: usize,
        b_layout: &str,
        dtype: &str,
        out_dtype: Option<&str>,
        bias: bool,
        path: &str,
        pieces: Option<usize>,
        numa_groups: usize,
        timeout_ms: u64,
    ) -> PyResult<Self> {
        let input = parse_dtype(dtype)?;
        let output = out_dtype.map_or(Ok(input), parse_dtype)?;
        let layout = parse_layout(b_layout)?;
        let mut config = GemmRsConfig::new(max_m, n, k, layout, input, output);
        config.bias = bias;
        // an overlapped path without pieces takes what auto would for the largest calls
        let largest =
            GemmRsShape::new(world, max_m, n, k, layout, input, output).map_err(value_error)?;
        config.path =
            parse_path(path, pieces, &largest)?.map_or(PathChoice::Auto, PathChoice::Always);
        config.numa_groups = numa_groups;
        config.timeout = Duration::from_millis(timeout_ms);
        let gpu = open_gpu(device)?;
        let allocation = GemmRsAllocation::new(gpu, rank, world, config).map_err(cuda_error)?;
        Ok(GpuGemmReduceScatter {
            op: Staged::new(allocation, device),
        })
    }

    /// This rank's buffers as bytes for the other processes (CUDA IPC handles).
    fn export<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        lock(&self.op).export(py)
    }

    /// Opens every rank's export (rank order, this rank's own among them).
    fn connect(&self, exports: Vec<Vec<u8>>) -> PyResult<()> {
        lock(&self.op).connect(exports)
    }

    /// The rows of the output this rank owns for M rows: (start, end).
    fn chunk(&self, m: usize) -> PyResult<(usize, usize)> {
        let r = lock(&self.op).rank()?.chunk(m);
        Ok((r.start, r.end))
    }

    /// The path a call of M rows takes: "fused" or "overlapped (C pieces)".
    fn path_for(&self, m: usize) -> PyResult<String> {
        let mut state = lock(&self.op);
        Ok(state.rank()?.path_for(m).map_err(cuda_error)?.to_string())
    }

    /// The path the last call took, if any.
    fn last_path(&self) -> PyResult<Option<String>> {
        Ok(lock(&self.op)
            .rank()?
            .last_path()
            .map(|p: GemmRsPath| p.to_string()))
    }

    /// Queues one call on `stream`: A [m, K] at `a`, B at `b`, the optional bias [N] at `bias`,
    /// this rank's chunk [chunk rows, N] into `out`. Raises first if an earlier call's wait
    /// timed out on the device.
    /// ValueError where an address is not device memory of this GPU holding what the call
    /// touches there (each address checked at the first call that passes it).
    #[pyo3(signature = (m, a, b, out, stream, bias=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        m: usize,
        a: u64,
        b: u64,
        out: u64,
        stream: u64,
        bias: Option<u64>,
    ) -> PyResult<()> {
        let call = GemmCall {
            m,
            a,
            b,
            bias,
            out,
            gathered: None,
            stream,
        };
        Ok(py.detach(|| gemm_rs_forward(&mut lock(&self.op), &call))?)
    }

    /// What the dispatcher's native kernels call this operator by: (a reference to its state,
    /// the C function that queues a call, the C function that drops the reference); see
    /// `commfuse/torch/_native.py`.
    fn native(&self) -> (usize, usize, usize) {
        crate::native::gemm_rs(&self.op)
    }

    /// After the stream was synchronised: raises the diagnosis of a wait that timed out.
    fn check(&self) -> PyResult<()> {
        lock(&self.op).check()
    }
}

/// All-gather + GEMM of one rank on its GPU: every rank's output is AllGather(A)·B_r (+ bias).
/// Build on every rank, pass every rank's `export()` to `connect`, then call `forward`.
/// (`GpuAllGatherMatmul` is the same class by the name it had first.)
#[pyclass(module = "commfuse._commfuse")]
pub struct GpuAllGatherGemm {
    op: Shared<AgGemmState>,
}

#[pymethods]
impl GpuAllGatherGemm {
    /// Allocates rank `rank`'s gather buffer for up to `max_m` gathered rows on CUDA device
    /// `device`; each rank's chunk is handed on in `pieces` row pieces; `path` "overlapped"
    /// (cuBLASLt per piece), "fused" (one GEMM of commfuse's own per call, waiting per row
    /// band) or "auto" (the overlapped path; without `pieces`, in whole chunks).
    #[new]
    #[pyo3(signature = (device, rank, world, max_m, n, k, *, b_layout="nk", dtype="bf16", out_dtype=None, bias=false, pieces=None, path=Name::new("auto"), timeout_ms=5000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        rank: usize,
        world: usize,
        max_m: usize,
        n: usize,
        k: usize,
        b_layout: &str,
        dtype: &str,
        out_dtype: Option<&str>,
        bias: bool,
        pieces: Option<Int>,
        path: Name,
        timeout_ms: u64,
    ) -> PyResult<Self> {
        let input = parse_dtype(dtype)?;
        let output = out_dtype.map_or(Ok(input), parse_dtype)?;
        let mut config = AgGemmConfig::new(max_m, n, k, parse_layout(b_layout)?, input, output);
        config.bias = bias;
        (config.fused, config.pieces) = ag_path_arg(&path, pieces.as_ref())?;
        config.timeout = Duration::from_millis(timeout_ms);
        let gpu = open_gpu(device)?;
        let allocation = AgGemmAllocation::new(gpu, rank, world, config).map_err(cuda_error)?;
        Ok(GpuAllGatherGemm {
            op: Staged::new(allocation, device),
        })
    }

    /// This rank's buffers as bytes for the other processes (CUDA IPC handles).
    fn export<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        lock(&self.op).export(py)
    }

    /// Opens every rank's export (rank order, this rank's own among them).
    fn connect(&self, exports: Vec<Vec<u8>>) -> PyResult<()> {
        lock(&self.op).connect(exports)
    }

    /// This rank's rows of A for M gathered rows: (start, end).
    fn chunk(&self, m: usize) -> PyResult<(usize, usize)> {
        let r = lock(&self.op).rank()?.chunk(m);
        Ok((r.start, r.end))
    }

    /// Queues one call on `stream`: this rank's rows of A at `a`, B at `b`, the optional bias
    /// [N], the output [m, N] into `out` and, when given, the gathered A [m, K] into
    /// `gathered`. Raises first if an earlier call's wait timed out on the device.
    /// ValueError where an address is not device memory of this GPU holding what the call
    /// touches there (each address checked at the first call that passes it).
    #[pyo3(signature = (m, a, b, out, stream, bias=None, gathered=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        m: usize,
        a: u64,
        b: u64,
        out: u64,
        stream: u64,
        bias: Option<u64>,
        gathered: Option<u64>,
    ) -> PyResult<()> {
        let call = GemmCall {
            m,
            a,
            b,
            bias,
            out,
            gathered,
            stream,
        };
        Ok(py.detach(|| ag_gemm_forward(&mut lock(&self.op), &call))?)
    }

    /// What the dispatcher's native kernels call this operator by (see
    /// `GpuGemmReduceScatter.native`).
    fn native(&self) -> (usize, usize, usize) {
        crate::native::ag_gemm(&self.op)
    }

    /// After the stream was synchronised: raises the diagnosis of a wait that timed out.
    fn check(&self) -> PyResult<()> {
        lock(&self.op).check()
    }
}

/// One rank of a collective (`op`: "all-reduce", "reduce-scatter", "all-gather", "broadcast",
/// "all-to-all", "barrier") of `count` elements of `dtype` on its GPU, by `algo` or the cost
/// model's pick. Build on every rank, pass every rank's `export()` to `connect`, then call
/// `forward`.
#[pyclass(module = "commfuse._commfuse")]
pub struct GpuCollective {
    op: Shared<CollectiveState>,
}

#[pymethods]
impl GpuCollective {
    #[new]
    #[pyo3(signature = (device, rank, world, op, count, *, dtype="f32", reduce="sum", algo=None, root=0, timeout_ms=5000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        rank: usize,
        world: usize,
        op: &str,
        count: usize,
        dtype: &str,
        reduce: &str,
        algo: Option<&str>,
        root: usize,
        timeout_ms: u64,
    ) -> PyResult<Self> {
        let kind: OpKind = op.parse().map_err(value_error)?;
        let mut config = CollectiveConfig::new(kind, count, parse_dtype(dtype)?);
        config.reduce = reduce.parse::<ReduceOp>().map_err(value_error)?;
        config.algo = algo
            .map(str::parse::<Algo>)
            .transpose()
            .map_err(value_error)?;
        config.root = root;
        config.timeout = Duration::from_millis(timeout_ms);
        let gpu = open_gpu(device)?;
        let allocation = CollectiveAllocation::new(gpu, rank, world, config).map_err(cuda_error)?;
        Ok(GpuCollective {
            op: Staged::new(allocation, device),
        })
    }

    /// This rank's pads and buffers as bytes for the other processes (CUDA IPC handles).
    fn export<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        lock(&self.op).export(py)
    }

    /// Opens every rank's export (rank order, this rank's own among them).
    fn connect(&self, exports: Vec<Vec<u8>>) -> PyResult<()> {
        lock(&self.op).connect(exports)
    }

    /// Elements of this rank's input and output.
    fn lengths(&self) -> PyResult<(usize, usize)> {
        Ok(lock(&self.op).rank()?.lengths())
    }

    /// What runs: "ll" (the low-latency protocol, for small all-reduces) or the plan's
    /// algorithm.
    fn algo(&self) -> PyResult<String> {
        Ok(lock(&self.op).rank()?.implementation())
    }

    /// Queues one call on `stream`: `input` into `output` (device addresses of `lengths()`
    /// elements). Raises first if an earlier call's wait timed out on the device.
    /// ValueError where an address is not device memory of this GPU holding what the call
    /// touches there (each address checked at the first call that passes it).
    fn forward(&self, py: Python<'_>, input: u64, output: u64, stream: u64) -> PyResult<()> {
        Ok(py.detach(|| collective_forward(&mut lock(&self.op), input, output, stream))?)
    }

    /// What the dispatcher's native kernels call this operator by (see
    /// `GpuGemmReduceScatter.native`).
    fn native(&self) -> (usize, usize, usize) {
        crate::native::collective(&self.op)
    }

    /// After the stream was synchronised: raises the diagnosis of a wait that timed out.
    fn check(&self) -> PyResult<()> {
        lock(&self.op).check()
    }
}
