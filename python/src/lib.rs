//! The Python module `commfuse._commfuse` (PyO3, built by maturin; `python/commfuse` is its
//! Python face). It runs the fused operators on the simulator, with NumPy arrays in and
//! out, for P ranks in one call: GEMM + reduce-scatter by either path, all-gather + GEMM, and the
//! cost model's choice of path. Every error is a `ValueError` carrying the one-line message the
//! Rust side gives.

mod args;
mod gpu;
mod group;
mod native;

use args::{matrix, per_rank, vector, Int, Name};
use commfuse_core::fused::gemm_rs::{
    choose_path, GemmRsPath, GemmRsShape, PathChoice, PathNameError,
};
use commfuse_core::gemm::BLayout;
use commfuse_core::{Algo, OpKind, OpSpec, ReduceOp};
use commfuse_core::{DType, Element};
use commfuse_sim::ag_gemm::{AgGemmConfig, SimAgGemm};
use commfuse_sim::collective::SimCollective;
use commfuse_sim::gemm_rs::{GemmRsConfig, GemmRsOperator};
use commfuse_sim::memory::Footprint;
use commfuse_sim::{World, WorldConfig};
use half::{bf16, f16};
use numpy::ndarray::Array1;
use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Mutex;
use std::time::Duration;

pub(crate) fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

pub(crate) fn parse_dtype(text: &str) -> PyResult<DType> {
    text.parse::<DType>().map_err(value_error)
}

/// The input type of a fused operator (`dtype=`) and its output type (`out_dtype=`, the input
/// type when None), each a name.
pub(crate) fn gemm_types(dtype: &Name, out_dtype: Option<&Name>) -> PyResult<(DType, DType)> {
    let input = dtype.parse("dtype", "the input type, 'bf16' or 'f16'")?;
    let output = match out_dtype {
        Some(name) => name.parse("out_dtype", "the output type, the input type or 'f32'")?,
        None => input,
    };
    Ok((input, output))
}

/// `b_layout=`, a name.
pub(crate) fn layout_arg(name: &Name) -> PyResult<BLayout> {
    parse_layout(name.text("b_layout", "'nk' or 'kn'")?)
}

/// `path=` (a name) and `pieces=` (an integer from 1 to 16, or None), as [`parse_path`] takes
/// them.
pub(crate) fn path_arg(path: &Name, pieces: Option<&Int>) -> PyResult<(String, Option<usize>)> {
    let pieces = pieces
        .map(|p| p.within("pieces", "1 to 16 pieces", (1, 16)))
        .transpose()?;
    let name = path.text("path", "'auto', 'fused', 'overlapped' or 'unfused'")?;
    Ok((name.to_string(), pieces))
}

/// `path=` and `pieces=` of the all-gather + GEMM: whether the path is the fused one, and the
/// pieces ([`commfuse_core::fused::ag_gemm::parse_path`]: "auto" and no pieces, the overlapped
/// path in whole chunks).
pub(crate) fn ag_path_arg(path: &Name, pieces: Option<&Int>) -> PyResult<(bool, usize)> {
    let pieces = pieces
        .map(|p| p.within("pieces", "1 to 16 pieces", (1, 16)))
        .transpose()?;
    let name = path.text("path", "'auto', 'overlapped' or 'fused'")?;
    commfuse_core::fused::ag_gemm::parse_path(name, pieces).map_err(value_error)
}

/// `timeout_ms=` as a duration.
pub(crate) fn timeout_arg(timeout_ms: &Int) -> PyResult<Duration> {
    let ms = timeout_ms.count("timeout_ms", "a non-negative number of milliseconds")?;
    Ok(Duration::from_millis(ms as u64))
}

/// The path `path` and `pieces` name for `shape` (`None`: "auto"), in the command line's
/// vocabulary ([`commfuse_core::fused::gemm_rs::parse_path`]).
pub(crate) fn parse_path(
    path: &str,
    pieces: Option<usize>,
    shape: &GemmRsShape,
) -> PyResult<Option<GemmRsPath>> {
    commfuse_core::fused::gemm_rs::parse_path(path, pieces, shape).map_err(|e| match e {
        PathNameError::PiecesWithoutOverlapped => {
            value_error("pieces goes with path=\"overlapped\"")
        }
        e => value_error(e),
    })
}

pub(crate) fn parse_layout(text: &str) -> PyResult<BLayout> {
    match text {
        "nk" => Ok(BLayout::NK),
        "kn" => Ok(BLayout::KN),
        other => Err(value_error(format!(
            "unknown B layout '{other}' (choose kn or nk)"
        ))),
    }
}

/// The operands of P ranks as plain row-major f32 data with their shapes checked: every A of
/// K columns, every B [N, K] or [K, N], the bias [N].
struct Operands {
    a: Vec<Vec<f32>>,
    b: Vec<Vec<f32>>,
    bias: Option<Vec<f32>>,
}

/// K and N of every rank's A and B ([N, K] or [K, N] by `layout`) and the bias [N], checked.
fn operand_shapes(
    a: &[PyReadonlyArray2<'_, f32>],
    b: &[PyReadonlyArray2<'_, f32>],
    bias: Option<&PyReadonlyArray1<'_, f32>>,
    layout: BLayout,
) -> PyResult<(usize, usize)> {
    if a.is_empty() || a.len() != b.len() {
        return Err(value_error(format!(
            "one A and one B per rank: got {} A and {} B",
            a.len(),
            b.len()
        )));
    }
    let k = a[0].shape()[1];
    let (b0, b1) = (b[0].shape()[0], b[0].shape()[1]);
    let n = match layout {
        BLayout::NK => b0,
        BLayout::KN => b1,
    };
    let want_b = match layout {
        BLayout::NK => [n, k],
        BLayout::KN => [k, n],
    };
    for (r, x) in a.iter().enumerate() {
        if x.shape()[1] != k {
            return Err(value_error(format!(
                "rank {r}'s A has {} columns, rank 0's {k}",
                x.shape()[1]
            )));
        }
    }
    for (r, x) in b.iter().enumerate() {
        if x.shape() != want_b {
            return Err(value_error(format!(
                "rank {r}'s B is {:?}, B as {layout:?} of K = {k} needs {want_b:?}",
                x.shape()
            )));
        }
    }
    if let Some(bias) = bias {
        if bias.len() != n {
            return Err(value_error(format!(
                "the bias has {} elements, N = {n}",
                bias.len()
            )));
        }
    }
    Ok((k, n))
}

/// The operands as plain f32 data, once their shapes and what they take in memory are checked.
fn operands(
    a: &[PyReadonlyArray2<'_, f32>],
    b: &[PyReadonlyArray2<'_, f32>],
    bias: Option<&PyReadonlyArray1<'_, f32>>,
) -> Operands {
    let data = |x: &PyReadonlyArray2<'_, f32>| x.as_array().iter().copied().collect::<Vec<f32>>();
    Operands {
        a: a.iter().map(data).collect(),
        b: b.iter().map(data).collect(),
        bias: bias.map(|x| x.as_array().iter().copied().collect()),
    }
}

/// Adds what a call's operands take on their way in: every rank's A (`a_rows` rows in all) and
/// B as f32 copies and again in the input type, and the bias.
fn operand_memory(
    f: Footprint,
    (a_rows, p, n, k): (&[usize], usize, usize, usize),
    (input, output): (DType, DType),
    bias: bool,
) -> Footprint {
    let si = 4 + input.size();
    let a = a_rows.iter().copied().chain([k, si]).collect::<Vec<_>>();
    f.item(&a)
        .item(&[p, k, n, si])
        .item(&[usize::from(bias), n, 4 + output.size()])
}

pub(crate) fn convert<T: Element>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

/// Runs `run::<TI, TO>` for the (input, output) pair given.
macro_rules! by_types {
    ($input:expr, $output:expr, $run:ident, $($arg:expr),*) => {
        match ($input, $output) {
            (DType::BF16, DType::BF16) => $run::<bf16, bf16>($($arg),*),
            (DType::BF16, DType::F32) => $run::<bf16, f32>($($arg),*),
            (DType::F16, DType::F16) => $run::<f16, f16>($($arg),*),
            (DType::F16, DType::F32) => $run::<f16, f32>($($arg),*),
            (i, o) => Err(format!(
                "inputs are bf16 or f16 and outputs the input type or f32, got {i} → {o}"
            )),
        }
    };
}

fn run_gemm_rs<TI: Element, TO: Element>(
    p: usize,
    config: GemmRsConfig,
    (ops, memory): (&Operands, &Footprint),
) -> Result<Vec<Vec<f32>>, String> {
    let world_config =
        GemmRsOperator::<TI, TO>::world_config(&config, p).map_err(|e| e.to_string())?;
    memory
        .clone()
        .and(&world_config.memory(p).total())
        .check()
        .map_err(|e| e.to_string())?;
    let world = World::new(p, world_config).map_err(|e| e.to_string())?;
    let op = GemmRsOperator::<TI, TO>::new(&world, config).map_err(|e| e.to_string())?;
    let a: Vec<Vec<TI>> = ops.a.iter().map(|x| convert(x)).collect();
    let b: Vec<Vec<TI>> = ops.b.iter().map(|x| convert(x)).collect();
    let bias: Option<Vec<TO>> = ops.bias.as_deref().map(convert);
    let outs: Vec<Mutex<Vec<TO>>> = (0..p)
        .map(|r| {
            let rows = commfuse_core::op::chunk_range(config.max_m, p, r).len();
            Mutex::new(vec![TO::poison(); rows * config.n])
        })
        .collect();
    world
        .run(|ctx| {
            let r = ctx.rank();
            let mut out = outs[r].lock().unwrap();
            op.forward(ctx, config.max_m, (&a[r], &b[r], bias.as_deref()), &mut out)
        })
        .map_err(|e| e.to_string())?;
    Ok(outs
        .into_iter()
        .map(|o| o.into_inner().unwrap().iter().map(|x| x.to_f32()).collect())
        .collect())
}

/// GEMM + reduce-scatter of P simulated ranks: rank r holds `a[r]` [M, K] and `b[r]` ([N, K]
/// for `b_layout="nk"`, [K, N] for "kn"); returns rank r's output chunk of the rows of
/// Σ_r a[r]·b[r] (+ bias), the chunks split as the collectives split M, computed in `dtype`
/// with f32 accumulation and rounded to `out_dtype`, as float32 arrays. `path` is "auto" (the
/// cost model's choice), "fused" or "overlapped" (with `pieces` per ring step); `numa_groups`
/// > 1 makes the overlapped path's ring 2D over that many groups of consecutive ranks.
#[pyfunction]
#[pyo3(signature = (a, b, bias=None, *, b_layout=Name::new("nk"), dtype=Name::new("bf16"), out_dtype=None, path=Name::new("auto"), pieces=None, numa_groups=Int::new(1), timeout_ms=Int::new(20000)))]
#[allow(clippy::too_many_arguments)]
fn sim_gemm_reduce_scatter<'py>(
    py: Python<'py>,
    a: Bound<'py, PyAny>,
    b: Bound<'py, PyAny>,
    bias: Option<Bound<'py, PyAny>>,
    b_layout: Name,
    dtype: Name,
    out_dtype: Option<Name>,
    path: Name,
    pieces: Option<Int>,
    numa_groups: Int,
    timeout_ms: Int,
) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
    let layout = layout_arg(&b_layout)?;
    let (input, output) = gemm_types(&dtype, out_dtype.as_ref())?;
    let forced = path_arg(&path, pieces.as_ref())?;
    let numa_groups = numa_groups.within(
        "numa_groups",
        "a positive number of NUMA groups",
        (1, i64::MAX),
    )?;
    let timeout = timeout_arg(&timeout_ms)?;
    let a = per_rank(&a, "a", matrix)?;
    let b = per_rank(&b, "b", matrix)?;
    let bias = bias.as_ref().map(|x| vector(x, "bias")).transpose()?;
    let (k, n) = operand_shapes(&a, &b, bias.as_ref(), layout)?;
    let (p, m) = (a.len(), a[0].shape()[0]);
    if a.iter().any(|x| x.shape()[0] != m) {
        return Err(value_error("every rank's A must have the same rows M"));
    }
    let config = GemmRsConfig {
        bias: bias.is_some(),
        numa_groups,
        timeout,
        ..GemmRsConfig::new(m, n, k, layout, input, output)
    };
    let shape = config.shape(p, m).map_err(value_error)?;
    let path = parse_path(&forced.0, forced.1, &shape)?.unwrap_or_else(|| choose_path(&shape));
    let config = GemmRsConfig {
        path: PathChoice::Always(path),
        ..config
    };
    // every rank's chunk of the output in the output type, then as f32
    let what = format!("sim_gemm_reduce_scatter of {m}×{n}×{k} on {p} ranks by the {path} path");
    let memory = operand_memory(
        Footprint::new(what),
        (&[p, m], p, n, k),
        (input, output),
        bias.is_some(),
    )
    .and(&commfuse_sim::gemm_rs::memory(&config, p, path).total())
    .item(&[m, n, output.size() + 4]);
    memory.check().map_err(value_error)?;
    let ops = operands(&a, &b, bias.as_ref());
    let run = (&ops, &memory);
    let outs = py
        .detach(|| by_types!(input, output, run_gemm_rs, p, config, run))
        .map_err(value_error)?;
    outs.into_iter()
        .enumerate()
        .map(|(r, o)| {
            let rows = commfuse_core::op::chunk_range(m, p, r).len();
            let array = Array2::from_shape_vec((rows, n), o).map_err(value_error)?;
            Ok(array.into_pyarray(py))
        })
        .collect()
}

fn run_ag_gemm<TI: Element, TO: Element>(
    p: usize,
    config: AgGemmConfig,
    (ops, memory): (&Operands, &Footprint),
) -> Result<(Vec<Vec<f32>>, Vec<f32>), String> {
    let (m, n, k) = (config.max_m, config.n, config.k);
    let pad_cols = 64;
    let rows = SimAgGemm::<TI, TO>::pad_rows(&config, p, pad_cols).map_err(|e| e.to_string())?;
    let world_config = WorldConfig {
        timeout: config.timeout,
        pad_rows: rows as u32 + 8,
        pad_cols: pad_cols as u32,
    };
    memory
        .clone()
        .and(&world_config.memory(p).total())
        .check()
        .map_err(|e| e.to_string())?;
    let world = World::new(p, world_config).map_err(|e| e.to_string())?;
    let op = SimAgGemm::<TI, TO>::new(&world, config).map_err(|e| e.to_string())?;
    let a: Vec<Vec<TI>> = ops.a.iter().map(|x| convert(x)).collect();
    let b: Vec<Vec<TI>> = ops.b.iter().map(|x| convert(x)).collect();
    let bias: Option<Vec<TO>> = ops.bias.as_deref().map(convert);
    let outs: Vec<Mutex<(Vec<TO>, Vec<TI>)>> = (0..p)
        .map(|_| Mutex::new((vec![TO::poison(); m * n], vec![TI::poison(); m * k])))
        .collect();
    world
        .run(|ctx| {
            let r = ctx.rank();
            let mut guard = outs[r].lock().unwrap();
            let (out, gathered) = &mut *guard;
            op.forward(ctx, m, (&a[r], &b[r], bias.as_deref()), out, Some(gathered))
        })
        .map_err(|e| e.to_string())?;
    let mut results = Vec::with_capacity(p);
    let mut gathered0 = Vec::new();
    for (r, o) in outs.into_iter().enumerate() {
        let (out, gathered) = o.into_inner().unwrap();
        if r == 0 {
            gathered0 = gathered.iter().map(|x| x.to_f32()).collect();
        }
        results.push(out.iter().map(|x| x.to_f32()).collect());
    }
    Ok((results, gathered0))
}

/// Every rank's output, and the gathered A when asked for.
type Gathered<'py> = (
    Vec<Bound<'py, PyArray2<f32>>>,
    Option<Bound<'py, PyArray2<f32>>>,
);

/// All-gather + GEMM of P simulated ranks: rank r holds `a[r]`, its chunk of the rows of A
/// ([M_r, K], the chunks in rank order, split as the collectives split M), and `b[r]`; returns
/// every rank's AllGather(a)·b[r] (+ bias) as float32 arrays [M, N] and, with `return_a`, the
/// gathered A (in `dtype`, as float32) too. `path` "auto", "overlapped" or "fused" and
/// `pieces` as the command line takes them.
#[pyfunction]
#[pyo3(signature = (a, b, bias=None, *, b_layout=Name::new("nk"), dtype=Name::new("bf16"), out_dtype=None, pieces=None, path=Name::new("auto"), return_a=false, timeout_ms=Int::new(20000)))]
#[allow(clippy::too_many_arguments)]
fn sim_all_gather_gemm<'py>(
    py: Python<'py>,
    a: Bound<'py, PyAny>,
    b: Bound<'py, PyAny>,
    bias: Option<Bound<'py, PyAny>>,
    b_layout: Name,
    dtype: Name,
    out_dtype: Option<Name>,
    pieces: Option<Int>,
    path: Name,
    return_a: bool,
    timeout_ms: Int,
) -> PyResult<Gathered<'py>> {
    let layout = layout_arg(&b_layout)?;
    let (input, output) = gemm_types(&dtype, out_dtype.as_ref())?;
    let (fused, pieces) = ag_path_arg(&path, pieces.as_ref())?;
    let timeout = timeout_arg(&timeout_ms)?;
    let a = per_rank(&a, "a", matrix)?;
    let b = per_rank(&b, "b", matrix)?;
    let bias = bias.as_ref().map(|x| vector(x, "bias")).transpose()?;
    let (k, n) = operand_shapes(&a, &b, bias.as_ref(), layout)?;
    let p = a.len();
    let m = a
        .iter()
        .try_fold(0usize, |m, x| m.checked_add(x.shape()[0]))
        .ok_or_else(|| value_error("the chunks of A have more rows than 64 bits count"))?;
    for (r, x) in a.iter().enumerate() {
        let want = commfuse_core::op::chunk_range(m, p, r).len();
        if x.shape()[0] != want {
            return Err(value_error(format!(
                "rank {r}'s chunk of A has {} rows; M = {m} over {p} ranks gives it {want}",
                x.shape()[0]
            )));
        }
    }
    let config = AgGemmConfig {
        bias: bias.is_some(),
        pieces,
        fused,
        timeout,
        ..AgGemmConfig::new(m, n, k, layout, input, output)
    };
    commfuse_sim::ag_gemm::shape(&config, p, m).map_err(value_error)?;
    // every rank's [M, N] output and gathered A, the outputs as f32 and rank 0's gathered A
    let what = format!("sim_all_gather_gemm of {m}×{n}×{k} on {p} ranks");
    let memory = operand_memory(
        Footprint::new(what),
        (&[m], p, n, k),
        (input, output),
        bias.is_some(),
    )
    .and(&commfuse_sim::ag_gemm::memory(&config, p).total())
    .item(&[p, m, n, output.size() + 4])
    .item(&[p, m, k, input.size()])
    .item(&[m, k, 4]);
    memory.check().map_err(value_error)?;
    let ops = operands(&a, &b, bias.as_ref());
    let run = (&ops, &memory);
    let (outs, gathered) = py
        .detach(|| by_types!(input, output, run_ag_gemm, p, config, run))
        .map_err(value_error)?;
    let outs = outs
        .into_iter()
        .map(|o| {
            let array = Array2::from_shape_vec((m, n), o).map_err(value_error)?;
            Ok(array.into_pyarray(py))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let gathered = if return_a {
        let array = Array2::from_shape_vec((m, k), gathered).map_err(value_error)?;
        Some(array.into_pyarray(py))
    } else {
        None
    };
    Ok((outs, gathered))
}

/// The path the cost model takes for GEMM + reduce-scatter of this shape: "fused" or
/// "overlapped (C pieces)".
#[pyfunction]
#[pyo3(signature = (world, m, n, k, *, b_layout=Name::new("nk"), dtype=Name::new("bf16"), out_dtype=None))]
fn gemm_rs_path(
    world: Int,
    m: Int,
    n: Int,
    k: Int,
    b_layout: Name,
    dtype: Name,
    out_dtype: Option<Name>,
) -> PyResult<String> {
    let (input, output) = gemm_types(&dtype, out_dtype.as_ref())?;
    let world = world.within("world", "1 to 64 ranks", (1, 64))?;
    let m = m.count("m", "a non-negative number of rows")?;
    let n = n.count("n", "a non-negative number of columns")?;
    let k = k.count("k", "a non-negative number of columns of A")?;
    let shape = GemmRsShape::new(world, m, n, k, layout_arg(&b_layout)?, input, output)
        .map_err(value_error)?;
    Ok(choose_path(&shape).to_string())
}

/// Whether commfuse's collective `op` ("all-reduce", ...) of `count` elements (as its
/// operators count them: an all-gather's output, a reduce-scatter's input) of `dtype` over
/// `world` ranks, on buffers of the caller's own, is expected to beat NCCL's on them: the rule
/// `commfuse.torch`'s collectives follow under `path="auto"`
/// (commfuse_core::cost::prefers_commfuse_on_user_buffers).
#[pyfunction]
fn prefers_commfuse_on_user_buffers(
    op: &str,
    world: usize,
    count: usize,
    dtype: &str,
) -> PyResult<bool> {
    let kind: OpKind = op.parse().map_err(value_error)?;
    let spec = OpSpec::new(kind, world, count, 0).map_err(value_error)?;
    let size = parse_dtype(dtype)?.size();
    Ok(commfuse_core::cost::prefers_commfuse_on_user_buffers(
        &spec, size,
    ))
}

fn run_collective<T: Element>(
    (kind, algo, reduce, root): (OpKind, Option<Algo>, ReduceOp, usize),
    inputs: &[Vec<f32>],
    timeout: Duration,
) -> Result<(Vec<Vec<f32>>, Algo), String> {
    let p = inputs.len();
    let count = collective_count(kind, root, inputs.iter().map(Vec::len))
        .ok_or("the inputs hold more elements than 64 bits count")?;
    let config = WorldConfig {
        timeout,
        ..WorldConfig::default()
    };
    let world = World::new(p, config).map_err(|e| e.to_string())?;
    let op = SimCollective::<T>::new(&world, kind, count, (algo, reduce, root, 1))
        .map_err(|e| e.to_string())?;
    let spec = *op.spec();
    for (r, x) in inputs.iter().enumerate() {
        if x.len() != spec.input_len(r) {
            return Err(format!(
                "rank {r}'s input has {} elements, {kind} of {count} gives it {}",
                x.len(),
                spec.input_len(r)
            ));
        }
    }
    let inputs: Vec<Vec<T>> = inputs.iter().map(|x| convert(x)).collect();
    let outs: Vec<Mutex<Vec<T>>> = (0..p)
        .map(|r| Mutex::new(vec![T::poison(); spec.output_len(r)]))
        .collect();
    world
        .run(|ctx| {
            let r = ctx.rank();
            op.forward(ctx, &inputs[r], &mut outs[r].lock().unwrap())
        })
        .map_err(|e| e.to_string())?;
    let outs = outs
        .into_iter()
        .map(|o| o.into_inner().unwrap().iter().map(|x| x.to_f32()).collect())
        .collect();
    Ok((outs, op.algo()))
}

/// The element count a collective of these inputs has, as `OpSpec` counts it: an all-gather's
/// output (every chunk together), else the root's input (every rank's input, but broadcast's).
fn collective_count(kind: OpKind, root: usize, lens: impl Iterator<Item = usize>) -> Option<usize> {
    let lens: Vec<usize> = lens.collect();
    match kind {
        OpKind::AllGather => lens.iter().try_fold(0usize, |n, &l| n.checked_add(l)),
        _ => Some(
            lens.get(root.min(lens.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0),
        ),
    }
}

/// `op=`, `algo=`, `reduce=` and `dtype=` of a collective, each a name.
pub(crate) fn collective_args(
    op: &Name,
    algo: Option<&Name>,
    reduce: &Name,
    dtype: &Name,
) -> PyResult<(OpKind, Option<Algo>, ReduceOp, DType)> {
    let kind: OpKind = op.parse("op", "a collective such as 'all-reduce'")?;
    let algo: Option<Algo> = algo
        .map(|a| a.parse("algo", "one of the op's algorithms such as 'ring'"))
        .transpose()?;
    let reduce: ReduceOp = reduce.parse("reduce", "'sum', 'max', 'min' or 'prod'")?;
    let dtype: DType = dtype.parse("dtype", "'f32', 'bf16' or 'f16'")?;
    Ok((kind, algo, reduce, dtype))
}

/// One collective of P simulated ranks (`op`: "all-reduce", "reduce-scatter", "all-gather",
/// "broadcast", "all-to-all") on rank r's 1-D input `inputs[r]` (an all-gather's inputs are the
/// chunks of the gathered vector), in `dtype`, by `algo` or the cost model's choice; returns
/// every rank's output (float32) and the algorithm that ran.
#[pyfunction]
#[pyo3(signature = (op, inputs, *, algo=None, reduce=Name::new("sum"), dtype=Name::new("f32"), root=Int::new(0), timeout_ms=Int::new(20000)))]
#[allow(clippy::too_many_arguments)]
fn sim_collective<'py>(
    py: Python<'py>,
    op: Name,
    inputs: Bound<'py, PyAny>,
    algo: Option<Name>,
    reduce: Name,
    dtype: Name,
    root: Int,
    timeout_ms: Int,
) -> PyResult<(Vec<Bound<'py, PyArray1<f32>>>, String)> {
    let (kind, algo, reduce, dtype) = collective_args(&op, algo.as_ref(), &reduce, &dtype)?;
    let root = root.count("root", "a rank (0 to P - 1)")?;
    let timeout = timeout_arg(&timeout_ms)?;
    let inputs = per_rank(&inputs, "inputs", vector)?;
    if inputs.is_empty() {
        return Err(value_error("one input per rank: got none"));
    }
    let p = inputs.len();
    let count = collective_count(kind, root, inputs.iter().map(|x| x.len()))
        .ok_or_else(|| value_error("the inputs hold more elements than 64 bits count"))?;
    let spec = OpSpec::new(kind, p, count, root).map_err(value_error)?;
    // the inputs as f32 and in the type, every output in the type and as f32 (the operator's
    // own buffers it checks itself)
    let what = format!("sim_collective {kind} of {count} {dtype} elements on {p} ranks");
    let size = dtype.size() + 4;
    (0..p)
        .fold(Footprint::new(what), |f, r| {
            f.item(&[inputs[r].len(), size])
                .item(&[spec.output_len(r), size])
        })
        .check()
        .map_err(value_error)?;
    let data: Vec<Vec<f32>> = inputs
        .iter()
        .map(|x| x.as_array().iter().copied().collect())
        .collect();
    let what = (kind, algo, reduce, root);
    let (outs, ran) = py
        .detach(|| match dtype {
            DType::F32 => run_collective::<f32>(what, &data, timeout),
            DType::BF16 => run_collective::<bf16>(what, &data, timeout),
            DType::F16 => run_collective::<f16>(what, &data, timeout),
        })
        .map_err(value_error)?;
    let outs = outs
        .into_iter()
        .map(|o| Array1::from_vec(o).into_pyarray(py))
        .collect();
    Ok((outs, ran.to_string()))
}

#[pymodule]
fn _commfuse(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sim_collective, m)?)?;
    m.add_function(wrap_pyfunction!(sim_gemm_reduce_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(sim_all_gather_gemm, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_rs_path, m)?)?;
    m.add_function(wrap_pyfunction!(prefers_commfuse_on_user_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::stream_is_capturing, m)?)?;
    m.add_class::<gpu::GpuGemmReduceScatter>()?;
    m.add_class::<gpu::GpuAllGatherGemm>()?;
    // the name the class had first
    m.add("GpuAllGatherMatmul", m.getattr("GpuAllGatherGemm")?)?;
    m.add_class::<gpu::GpuCollective>()?;
    m.add_class::<group::SimGroup>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
