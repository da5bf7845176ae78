//! The multi-process simulator from Python: `commfuse.sim.Group` is one rank of a group whose
//! ranks are separate processes (as under `torchrun` or `multiprocessing`), its signal pads and
//! symmetric buffers in the group's POSIX shared memory (`commfuse_sim::shared`). Each call
//! runs this process's rank of the operator on NumPy arrays; operators are built at their first
//! call and cached by what they are, so every rank must make the same calls in the same order.

use crate::args::{matrix, vector, Int, Name};
use crate::{
    ag_path_arg, collective_args, convert, gemm_types, layout_arg, parse_path, path_arg,
    timeout_arg, value_error,
};
use commfuse_core::fused::gemm_rs::{choose_path, GemmRsPath, PathChoice};
use commfuse_core::gemm::BLayout;
use commfuse_core::{Algo, DType, Element, OpKind, ReduceOp};
use commfuse_sim::ag_gemm::{AgGemmConfig, SimAgGemm};
use commfuse_sim::collective::SimCollective;
use commfuse_sim::gemm_rs::{GemmRsConfig, GemmRsOperator};
use commfuse_sim::memory::Footprint;
use commfuse_sim::shared::Arena;
use commfuse_sim::{World, WorldConfig};
use half::{bf16, f16};
use numpy::ndarray::{Array1, Array2};
use numpy::PyUntypedArrayMethods;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// This rank's output, and the gathered A when asked for.
type GatheredOne<'py> = (Bound<'py, PyArray2<f32>>, Option<Bound<'py, PyArray2<f32>>>);

/// An operator and the world (signal pads) it was built on; the world is boxed so that its
/// address, which the operator checks, stays put.
struct Cached {
    op: Box<dyn Any>,
    world: Box<World>,
}

/// One rank of a simulated group across processes.
#[pyclass(unsendable, module = "commfuse._commfuse")]
pub struct SimGroup {
    arena: Arc<Arena>,
    timeout: Duration,
    ops: HashMap<String, Cached>,
}

impl SimGroup {
    /// The cached operator of `key`, built by `build` on a new world of `config` at its first
    /// use.
    fn operator<T: 'static>(
        &mut self,
        key: String,
        config: WorldConfig,
        build: impl FnOnce(&World) -> Result<T, String>,
    ) -> Result<&Cached, String> {
        if !self.ops.contains_key(&key) {
            let built = World::shared(self.arena.clone(), config)
                .map_err(|e| e.to_string())
                .map(Box::new)
                .and_then(|world| Ok((Box::new(build(&world)?) as Box<dyn Any>, world)));
            let (op, world) = built.inspect_err(|_| {
                // the peers may already run this operator: stop their waits
                self.arena.raise_abort();
            })?;
            self.ops.insert(key.clone(), Cached { op, world });
        }
        Ok(&self.ops[&key])
    }

    fn world_config(&self) -> WorldConfig {
        WorldConfig {
            timeout: self.timeout,
            ..WorldConfig::default()
        }
    }
}

fn collective_call<T: Element + 'static>(
    g: &mut SimGroup,
    key: String,
    (kind, count, options): (OpKind, usize, (Option<Algo>, ReduceOp, usize, usize)),
    input: &[f32],
) -> Result<(Vec<f32>, Algo), String> {
    let config = g.world_config();
    let rank = g.arena.rank();
    let cached = g.operator(key, config, |w| {
        SimCollective::<T>::new(w, kind, count, options).map_err(|e| e.to_string())
    })?;
    let op = cached
        .op
        .downcast_ref::<SimCollective<T>>()
        .expect("cached by its key");
    let spec = *op.spec();
    let check = Footprint::new(format!("{kind} of {count} {} elements", T::DTYPE))
        .item(&[input.len(), T::DTYPE.size()])
        .item(&[spec.output_len(rank), T::DTYPE.size() + 4])
        .check();
    if let Err(e) = check {
        g.arena.raise_abort();
        return Err(e.to_string());
    }
    if input.len() != spec.input_len(rank) {
        // the peers may already be in this call: stop their waits
        g.arena.raise_abort();
        return Err(format!(
            "rank {rank}'s input has {} elements, {kind} of {count} gives it {}",
            input.len(),
            spec.input_len(rank)
        ));
    }
    let input: Vec<T> = convert(input);
    // run takes a closure any rank thread may call: the output behind a lock
    let out = Mutex::new(vec![T::poison(); spec.output_len(rank)]);
    cached
        .world
        .run(|ctx| op.forward(ctx, &input, &mut out.lock().unwrap()))
        .map_err(|e| e.to_string())?;
    let out = out.into_inner().unwrap();
    Ok((out.iter().map(|x| x.to_f32()).collect(), op.algo()))
}

/// What a GEMM call of this rank carries: A, B and the bias as f32, and the shape.
struct GemmCall {
    a: Vec<f32>,
    b: Vec<f32>,
    bias: Option<Vec<f32>>,
    rows: usize,
    n: usize,
    k: usize,
    layout: BLayout,
}

/// The operands of a GEMM call of this rank checked ([rows, K], B by `layout`, the bias [N])
/// and copied as f32, once their copies fit in memory.
fn gemm_call(
    a: &PyReadonlyArray2<'_, f32>,
    b: &PyReadonlyArray2<'_, f32>,
    bias: Option<&PyReadonlyArray1<'_, f32>>,
    layout: BLayout,
) -> PyResult<GemmCall> {
    let (rows, k) = (a.shape()[0], a.shape()[1]);
    let (b0, b1) = (b.shape()[0], b.shape()[1]);
    let (n, bk) = match layout {
        BLayout::NK => (b0, b1),
        BLayout::KN => (b1, b0),
    };
    if bk != k {
        return Err(value_error(format!(
            "A is [{rows}, {k}] but B is [{b0}, {b1}] ({layout:?}): K differs"
        )));
    }
    if let Some(bias) = bias {
        if bias.len() != n {
            return Err(value_error(format!(
                "the bias has {} elements, N = {n}",
                bias.len()
            )));
        }
    }
    Footprint::new(format!("copying operands of {rows}×{n}×{k}"))
        .item(&[a.len(), 4])
        .item(&[b.len(), 4])
        .item(&[bias.map_or(0, |x| x.len()), 4])
        .check()
        .map_err(value_error)?;
    let flat = |x: &PyReadonlyArray2<'_, f32>| x.as_array().iter().copied().collect::<Vec<f32>>();
    Ok(GemmCall {
        a: flat(a),
        b: flat(b),
        bias: bias.map(|x| x.as_array().iter().copied().collect()),
        rows,
        n,
        k,
        layout,
    })
}

fn gemm_rs_call<TI: Element + 'static, TO: Element + 'static>(
    g: &mut SimGroup,
    (config, path): (GemmRsConfig, GemmRsPath),
    c: &GemmCall,
) -> Result<Vec<f32>, String> {
    let config = GemmRsConfig {
        path: PathChoice::Always(path),
        timeout: g.timeout,
        ..config
    };
    let key = format!("gemm-rs {config:?}");
    let (p, rank) = (g.arena.world(), g.arena.rank());
    let world_config =
        GemmRsOperator::<TI, TO>::world_config(&config, p).map_err(|e| e.to_string())?;
    // this process's part: the operator's heap and the world's epoch bases (buffers and pads
    // lie in the group's arena), the converted operands, this rank's output
    let rows = commfuse_core::op::chunk_range(config.max_m, p, rank).len();
    let in_process = |m: commfuse_sim::memory::OperatorMemory| m.in_process(true);
    in_process(commfuse_sim::gemm_rs::memory(&config, p, path))
        .and_then(|op| Ok(op.and(&in_process(world_config.memory(p))?)))
        .map(|f| {
            f.item(&[c.a.len(), config.input.size()])
                .item(&[c.b.len(), config.input.size()])
                .item(&[rows, config.n, config.output.size() + 4])
        })
        .and_then(|f| f.check())
        .map_err(|e| {
            g.arena.raise_abort();
            e.to_string()
        })?;
    let cached = g.operator(key, world_config, |w| {
        GemmRsOperator::<TI, TO>::new(w, config).map_err(|e| e.to_string())
    })?;
    let op = cached
        .op
        .downcast_ref::<GemmRsOperator<TI, TO>>()
        .expect("cached by its key");
    let (a, b): (Vec<TI>, Vec<TI>) = (convert(&c.a), convert(&c.b));
    let bias: Option<Vec<TO>> = c.bias.as_deref().map(convert);
    let rows = commfuse_core::op::chunk_range(config.max_m, p, rank).len();
    let out = Mutex::new(vec![TO::poison(); rows * config.n]);
    let operands = (a.as_slice(), b.as_slice(), bias.as_deref());
    cached
        .world
        .run(|ctx| op.forward(ctx, config.max_m, operands, &mut out.lock().unwrap()))
        .map_err(|e| e.to_string())?;
    let out = out.into_inner().unwrap();
    Ok(out.iter().map(|x| x.to_f32()).collect())
}

fn ag_gemm_call<TI: Element + 'static, TO: Element + 'static>(
    g: &mut SimGroup,
    config: AgGemmConfig,
    c: &GemmCall,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let config = AgGemmConfig {
        timeout: g.timeout,
        ..config
    };
    let key = format!("ag-gemm {config:?}");
    let p = g.arena.world();
    let pad_cols = 64;
    let rows = SimAgGemm::<TI, TO>::pad_rows(&config, p, pad_cols).map_err(|e| e.to_string())?;
    let world_config = WorldConfig {
        timeout: g.timeout,
        pad_rows: rows as u32 + 8,
        pad_cols: pad_cols as u32,
    };
    // this process's part: the operator's heap and the world's epoch bases, the converted
    // operands, this rank's [M, N] output and gathered A, both again as f32
    let in_process = |m: commfuse_sim::memory::OperatorMemory| m.in_process(true);
    let (m, n, k) = (config.max_m, config.n, config.k);
    in_process(commfuse_sim::ag_gemm::memory(&config, p))
        .and_then(|op| Ok(op.and(&in_process(world_config.memory(p))?)))
        .map(|f| {
            f.item(&[c.a.len(), config.input.size()])
                .item(&[c.b.len(), config.input.size()])
                .item(&[m, n, config.output.size() + 4])
                .item(&[m, k, config.input.size() + 4])
        })
        .and_then(|f| f.check())
        .map_err(|e| {
            g.arena.raise_abort();
            e.to_string()
        })?;
    let cached = g.operator(key, world_config, |w| {
        SimAgGemm::<TI, TO>::new(w, config).map_err(|e| e.to_string())
    })?;
    let op = cached
        .op
        .downcast_ref::<SimAgGemm<TI, TO>>()
        .expect("cached by its key");
    let (a, b): (Vec<TI>, Vec<TI>) = (convert(&c.a), convert(&c.b));
    let bias: Option<Vec<TO>> = c.bias.as_deref().map(convert);
    let (m, n, k) = (config.max_m, config.n, config.k);
    let results = Mutex::new((vec![TO::poison(); m * n], vec![TI::poison(); m * k]));
    let operands = (a.as_slice(), b.as_slice(), bias.as_deref());
    cached
        .world
        .run(|ctx| {
            let mut guard = results.lock().unwrap();
            let (out, gathered) = &mut *guard;
            op.forward(ctx, m, operands, out, Some(gathered))
        })
        .map_err(|e| e.to_string())?;
    let (out, gathered) = results.into_inner().unwrap();
    Ok((
        out.iter().map(|x| x.to_f32()).collect(),
        gathered.iter().map(|x| x.to_f32()).collect(),
    ))
}

/// Runs `f::<TI, TO>` for the (input, output) pair given.
macro_rules! by_pair {
    ($input:expr, $output:expr, $f:ident, $($arg:expr),*) => {
        match ($input, $output) {
            (DType::BF16, DType::BF16) => $f::<bf16, bf16>($($arg),*),
            (DType::BF16, DType::F32) => $f::<bf16, f32>($($arg),*),
            (DType::F16, DType::F16) => $f::<f16, f16>($($arg),*),
            (DType::F16, DType::F32) => $f::<f16, f32>($($arg),*),
            (i, o) => Err(format!(
                "inputs are bf16 or f16 and outputs the input type or f32, got {i} → {o}"
            )),
        }
    };
}

#[pymethods]
impl SimGroup {
    /// Joins the group `name` as rank `rank` of `world` (rank 0 creates its shared memory of
    /// `arena_mb` MiB; the others wait for it, at most `timeout_ms`). Every wait of every call
    /// is bounded by `timeout_ms` too. `nonce`, a random number every rank got through the
    /// same rendezvous as the name, keeps a segment left or planted under the name out.
    #[new]
    #[pyo3(signature = (name, rank, world, *, arena_mb=Int::new(64), timeout_ms=Int::new(20000), nonce=Int::new(0)))]
    fn new(
        name: Name,
        rank: Int,
        world: Int,
        arena_mb: Int,
        timeout_ms: Int,
        nonce: Int,
    ) -> PyResult<Self> {
        let name = name.text("name", "the group (letters, digits, '-', '_' or '.')")?;
        let max = commfuse_core::MAX_WORLD_SIZE;
        let world = world.within("world", &format!("1 to {max} ranks"), (1, max as i64))?;
        let last = world as i64 - 1;
        let rank = rank.within("rank", &format!("0 to world - 1 = {last}"), (0, last))?;
        let arena_mb = arena_mb.within("arena_mb", "a positive number of MiB", (1, i64::MAX))?;
        let timeout = timeout_arg(&timeout_ms)?;
        let nonce = nonce.within("nonce", "a non-negative 63-bit number", (0, i64::MAX))? as u64;
        let bytes = arena_mb
            .checked_mul(1 << 20)
            .ok_or_else(|| value_error(format!("arena_mb={arena_mb} overflows")))?;
        let arena = Arena::open_with_nonce(name, rank, world, bytes, timeout, nonce)
            .map_err(value_error)?;
        Ok(SimGroup {
            arena: Arc::new(arena),
            timeout,
            ops: HashMap::new(),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.arena.rank()
    }

    #[getter]
    fn world(&self) -> usize {
        self.arena.world()
    }

    /// This rank's part of a collective: `op` ("all-reduce", "reduce-scatter", "all-gather",
    /// "broadcast", "all-to-all", "barrier") of `count` elements (default: this rank's input
    /// length, times P for all-gather) on this rank's 1-D input; returns (output, algorithm).
    #[pyo3(signature = (op, x, *, count=None, algo=None, reduce=Name::new("sum"), dtype=Name::new("f32"), root=Int::new(0)))]
    #[allow(clippy::too_many_arguments)]
    fn collective<'py>(
        &mut self,
        py: Python<'py>,
        op: Name,
        x: Bound<'py, PyAny>,
        count: Option<Int>,
        algo: Option<Name>,
        reduce: Name,
        dtype: Name,
        root: Int,
    ) -> PyResult<(Bound<'py, PyArray1<f32>>, String)> {
        let (kind, algo, reduce, dtype) = collective_args(&op, algo.as_ref(), &reduce, &dtype)?;
        let last = self.arena.world() as i64 - 1;
        let root = root.within("root", &format!("a rank, 0 to {last}"), (0, last))?;
        let count = count
            .map(|c| c.count("count", "a non-negative number of elements"))
            .transpose()?;
        let x = vector(&x, "x")?;
        Footprint::new(format!("copying the input of {} elements", x.len()))
            .item(&[x.len(), 4])
            .check()
            .map_err(value_error)?;
        let input: Vec<f32> = x.as_array().iter().copied().collect();
        let count = count.unwrap_or(match kind {
            OpKind::AllGather => input.len() * self.arena.world(),
            _ => input.len(),
        });
        let key = format!("collective {kind} {count} {dtype} {algo:?} {reduce} {root}");
        let what = (kind, count, (algo, reduce, root, 1));
        let (out, ran) = match dtype {
            DType::F32 => collective_call::<f32>(self, key, what, &input),
            DType::BF16 => collective_call::<bf16>(self, key, what, &input),
            DType::F16 => collective_call::<f16>(self, key, what, &input),
        }
        .map_err(value_error)?;
        Ok((Array1::from_vec(out).into_pyarray(py), ran.to_string()))
    }

    /// Returns once every rank of the group has called it.
    fn barrier(&mut self) -> PyResult<()> {
        let key = "barrier".to_string();
        collective_call::<f32>(
            self,
            key,
            (OpKind::Barrier, 0, (None, ReduceOp::Sum, 0, 1)),
            &[],
        )
        .map_err(value_error)?;
        Ok(())
    }

    /// This rank's chunk of the rows of Σ_r a_r·b_r (+ bias), as `commfuse.sim.gemm_reduce_scatter`
    /// computes it; every rank passes its own A [M, K] (the same M) and B.
    #[pyo3(signature = (a, b, bias=None, *, b_layout=Name::new("nk"), dtype=Name::new("bf16"), out_dtype=None, path=Name::new("auto"), pieces=None))]
    #[allow(clippy::too_many_arguments)]
    fn gemm_reduce_scatter<'py>(
        &mut self,
        py: Python<'py>,
        a: Bound<'py, PyAny>,
        b: Bound<'py, PyAny>,
        bias: Option<Bound<'py, PyAny>>,
        b_layout: Name,
        dtype: Name,
        out_dtype: Option<Name>,
        path: Name,
        pieces: Option<Int>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let layout = layout_arg(&b_layout)?;
        let (input, output) = gemm_types(&dtype, out_dtype.as_ref())?;
        let forced = path_arg(&path, pieces.as_ref())?;
        let (a, b) = (matrix(&a, "a")?, matrix(&b, "b")?);
        let bias = bias.as_ref().map(|x| vector(x, "bias")).transpose()?;
        let c = gemm_call(&a, &b, bias.as_ref(), layout)?;
        let p = self.arena.world();
        let config = GemmRsConfig {
            bias: c.bias.is_some(),
            ..GemmRsConfig::new(c.rows, c.n, c.k, c.layout, input, output)
        };
        let shape = config.shape(p, c.rows).map_err(value_error)?;
        let path = parse_path(&forced.0, forced.1, &shape)?.unwrap_or_else(|| choose_path(&shape));
        let out =
            by_pair!(input, output, gemm_rs_call, self, (config, path), &c).map_err(value_error)?;
        let rows = commfuse_core::op::chunk_range(c.rows, p, self.arena.rank()).len();
        let array = Array2::from_shape_vec((rows, c.n), out).map_err(value_error)?;
        Ok(array.into_pyarray(py))
    }

    /// AllGather(A)·b (+ bias) on this rank, [M, N], and with `return_a` the gathered A: `a`
    /// is this rank's chunk of the rows of A; M is `m` (default: P × this chunk's rows);
    /// `path` "auto", "overlapped" or "fused" and `pieces` as the command line takes them.
    #[pyo3(signature = (a, b, bias=None, *, m=None, b_layout=Name::new("nk"), dtype=Name::new("bf16"), out_dtype=None, pieces=None, path=Name::new("auto"), return_a=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather_gemm<'py>(
        &mut self,
        py: Python<'py>,
        a: Bound<'py, PyAny>,
        b: Bound<'py, PyAny>,
        bias: Option<Bound<'py, PyAny>>,
        m: Option<Int>,
        b_layout: Name,
        dtype: Name,
        out_dtype: Option<Name>,
        pieces: Option<Int>,
        path: Name,
        return_a: bool,
    ) -> PyResult<GatheredOne<'py>> {
        let layout = layout_arg(&b_layout)?;
        let (input, output) = gemm_types(&dtype, out_dtype.as_ref())?;
        let (fused, pieces) = ag_path_arg(&path, pieces.as_ref())?;
        let m = m
            .map(|m| m.count("m", "a non-negative number of rows (of the gathered A)"))
            .transpose()?;
        let (a, b) = (matrix(&a, "a")?, matrix(&b, "b")?);
        let bias = bias.as_ref().map(|x| vector(x, "bias")).transpose()?;
        let (p, rank) = (self.arena.world(), self.arena.rank());
        let rows = a.shape()[0];
        let m = match m {
            Some(m) => m,
            None => rows
                .checked_mul(p)
                .ok_or_else(|| value_error(format!("{rows} rows on each of {p} ranks overflow")))?,
        };
        let mine = commfuse_core::op::chunk_range(m, p, rank).len();
        if mine != rows {
            return Err(value_error(format!(
                "rank {rank} holds {rows} rows of A, its chunk of M = {m} has {mine} (pass m= the total rows)"
            )));
        }
        let c = gemm_call(&a, &b, bias.as_ref(), layout)?;
        let config = AgGemmConfig {
            bias: c.bias.is_some(),
            pieces,
            fused,
            ..AgGemmConfig::new(m, c.n, c.k, c.layout, input, output)
        };
        let (out, gathered) =
            by_pair!(input, output, ag_gemm_call, self, config, &c).map_err(value_error)?;
        let out = Array2::from_shape_vec((m, c.n), out).map_err(value_error)?;
        let gathered = if return_a {
            let g = Array2::from_shape_vec((m, c.k), gathered).map_err(value_error)?;
            Some(g.into_pyarray(py))
        } else {
            None
        };
        Ok((out.into_pyarray(py), gathered))
    }

    /// The same as `all_gather_gemm`, by the name it had first.
    #[pyo3(signature = (*args, **kwargs))]
    fn all_gather_matmul<'py>(
        slf: &Bound<'py, Self>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        slf.call_method("all_gather_gemm", args, kwargs)
    }
}
