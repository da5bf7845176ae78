"""commfuse's fused operators on PyTorch tensors, one process per GPU.

The semantics are those of PyTorch's symmetric-memory operators
(``torch.ops.symm_mem.fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul``) on a
``torch.distributed`` process group::

    import torch, torch.distributed as dist, commfuse.torch as cf
    dist.init_process_group("nccl")            # torchrun --nproc-per-node P
    torch.cuda.set_device(dist.get_rank())
    y = cf.gemm_reduce_scatter(x, w.t())       # this rank's rows of sum_r x_r @ w_r.t()
    z = cf.all_gather_gemm(x_shard, w.t())     # all_gather(x_shard) @ w.t()

Nothing here links against PyTorch: tensors reach commfuse as device addresses, and the work
goes on the tensors' current CUDA stream. An operator is built the first time a (group, device,
N, K, layout, dtypes, bias) combination is called and cached; building one is collective (every
rank of the group exchanges its buffers' CUDA IPC handles through
``dist.all_gather_object``), so every rank must make the same calls in the same order, as with
any ``torch.distributed`` collective. A call of more rows than the cached operator was built
for builds a larger one (collectively too). The first call of each new M settles on algorithms
on the host; later calls of that M only queue work.

Calls can be captured into a CUDA graph (``torch.cuda.graph``) and replayed: the operators
number their calls on the GPU, so every replay is a new call, and eager calls may come between
replays. As PyTorch asks of any captured work, call each shape and M once before capturing,
the largest M first (building an operator and a new M's first call run on the host, which
raises under capture, and a call of more rows than the cached operator's builds a new one).
Every rank must capture and replay the same calls. GEMM + reduce-scatter's "overlapped" path
cannot be captured (``path="auto"`` takes the fused path instead where it would take it), nor
can ``barrier`` (it waits on the host).

The collectives (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``) take
``path="auto"`` by default: commfuse's where it beats NCCL on the caller's own tensors (small
messages by its LL protocol, the rest up to 4 MiB), ``torch.distributed`` (NCCL on the same
group) past that — commfuse's plans work in symmetric buffers of its own, and copying a large
tensor in and out costs more than they gain; see :func:`collective_path`. ``path="commfuse"``
or ``"torch"`` picks one.

Errors are Python exceptions carrying commfuse's one-line message: ``ValueError`` for a call
that does not fit, ``RuntimeError`` for a CUDA failure or a peer that never arrived.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _operators
from ._commfuse import (
    GpuAllGatherMatmul,
    GpuCollective,
    GpuGemmReduceScatter,
    prefers_commfuse_on_user_buffers,
)

__all__ = [
    "gemm_reduce_scatter",
    "all_gather_gemm",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "barrier",
    "collective_path",
    "operator_path",
    "clear_cache",
]

_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def _name(dtype: torch.dtype, what: str) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"{what} must be bfloat16, float16 or float32, got {dtype}") from None


def _input_name(dtype: torch.dtype) -> str:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"a and b must be bfloat16 or float16, got {dtype}")
    return _NAMES[dtype]


def _cuda_tensor(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_cuda:
        raise ValueError(f"{what} must be on a CUDA device, got {x.device}")


def _matrix(x: torch.Tensor, what: str) -> None:
    _cuda_tensor(x, what)
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(x.shape)}")


def _weight(b: torch.Tensor) -> Tuple[torch.Tensor, str]:
    """B [K, N] as the kernel takes it: row-major [K, N] ("kn"), or the transpose of a
    row-major [N, K] weight (``w.t()``, "nk") without a copy."""
    if b.is_contiguous():
        return b, "kn"
    if b.t().is_contiguous():
        return b.t(), "nk"
    return b.contiguous(), "kn"


class _GemmOperands:
    """A GEMM's operands checked and laid out as the kernels take them: ``a`` contiguous,
    ``b`` as [K, N] ("kn") or the transpose of [N, K] ("nk"), the bias in the output type."""

    def __init__(self, a, b, bias, out_dtype):
        _matrix(a, "a")
        _matrix(b, "b")
        self.dtype = _input_name(a.dtype)
        if b.dtype != a.dtype:
            raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        if b.device != a.device:
            raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
        self.out_dtype = out_dtype or a.dtype
        self.out_name = _name(self.out_dtype, "out_dtype")
        self.a = a.contiguous()
        self.b, self.layout = _weight(b)
        rows, k = self.a.shape
        kb, self.n = (self.b.shape[1], self.b.shape[0]) if self.layout == "nk" else self.b.shape
        if kb != k:
            raise ValueError(
                f"a is [{rows}, {k}] but b is [{self.b.shape[0]}, {self.b.shape[1]}] ({self.layout})"
            )
        self.bias = bias
        if bias is not None:
            if tuple(bias.shape) != (self.n,):
                raise ValueError(f"bias must be [{self.n}], got {tuple(bias.shape)}")
            self.bias = bias.to(device=a.device, dtype=self.out_dtype).contiguous()


def _group(group):
    if group is not None:
        return group  # a group exists only once torch.distributed is initialised
    if not dist.is_initialized():
        raise ValueError("commfuse.torch needs torch.distributed initialised (init_process_group)")
    return dist.group.WORLD


# id(group) -> (the group, its size, {(op, count, dtype): where path="auto" sends it}); the
# group is kept so that its id is not reused while its entry lives (as commfuse._operators does)
_GROUPS: dict = {}


def _group_state(group) -> tuple:
    """What every call asks of its group, asked of torch.distributed once per group."""
    state = _GROUPS.get(id(group))
    if state is None:
        state = _GROUPS[id(group)] = (group, dist.get_world_size(group), {})
    return state


def _world(group) -> int:
    return _group_state(group)[1]


def _operator(kind: str, group, m: int, key: tuple, build):
    """The cached operator of ``key`` for calls of ``m`` rows (``commfuse._operators``), its
    exports carried by ``dist.all_gather_object``."""
    # the group's rank is asked only when an operator is built, off the hot path
    def build_here(max_m: int):
        return build(dist.get_rank(group), _world(group), max_m)

    def all_gather(data: bytes):
        exports = [None] * _world(group)
        dist.all_gather_object(exports, data, group=group)
        return exports

    return _operators.cached(kind, group, m, key, build_here, all_gather,
                             torch.cuda.is_current_stream_capturing)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _output(out: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype, like: torch.Tensor,
            what: str) -> torch.Tensor:
    """The caller's ``out`` checked against what the call writes, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype \
            or out.device != like.device or not out.is_contiguous():
        got = (tuple(out.shape), out.dtype, str(out.device)) if isinstance(out, torch.Tensor) \
            else type(out).__name__
        raise ValueError(
            f"{what} must be a contiguous {list(shape)} tensor of {dtype} on {like.device}, got {got}"
        )
    return out


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group=None,
    bias: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    path: str = "auto",
    pieces: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    numa_groups: int = 1,
) -> torch.Tensor:
    """GEMM + reduce-scatter (a row-parallel linear layer): this rank's chunk of the rows of
    ``sum over ranks of a @ b`` (+ ``bias``, added once).

    ``a`` is this rank's [M, K] (K the rank's shard), ``b`` its [K, N] (a weight's ``w.t()``
    is taken without a copy), both bfloat16 or float16 on this rank's GPU; every rank passes
    the same M. The output is [rows, N] of ``out_dtype`` (the input type by default, or
    float32), rows split as ``torch.tensor_split`` splits M into the group's size (the first
    M mod P chunks one row longer). ``path`` is "auto" (the cost model's choice), "fused" or
    "overlapped" (with ``pieces`` per ring step). ``out``, when given, receives the result.
    ``numa_groups`` > 1 (dividing the group's size) makes the overlapped path's ring 2D: each
    row chunk collects a whole NUMA group's partials (groups of consecutive ranks) before it
    crosses to the next group.
    """
    group = _group(group)
    g = _GemmOperands(a, b, bias, out_dtype)
    a, b, bias, out_dtype = g.a, g.b, g.bias, g.out_dtype
    dtype, out_name, layout, (m, k), n = g.dtype, g.out_name, g.layout, a.shape, g.n
    device = a.device.index
    key = (device, n, k, layout, dtype, out_name, bias is not None, path, pieces, numa_groups)

    def build(rank, world, max_m):
        return GpuGemmReduceScatter(
            device, rank, world, max_m, n, k, b_layout=layout, dtype=dtype,
            out_dtype=out_name, bias=bias is not None, path=path, pieces=pieces,
            numa_groups=numa_groups,
        )

    op = _operator("gemm-rs", group, m, key, build)
    start, end = op.chunk(m)
    out = _output(out, (end - start, n), out_dtype, a, "out")
    op.forward(
        m, a.data_ptr(), b.data_ptr(), out.data_ptr(), _stream(a.device),
        bias=None if bias is None else bias.data_ptr(),
    )
    return out


def all_gather_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group=None,
    bias: Optional[torch.Tensor] = None,
    return_a: bool = False,
    *,
    m: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    pieces: int = 1,
    out: Optional[torch.Tensor] = None,
    gathered: Optional[torch.Tensor] = None,
    path: str = "overlapped",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """All-gather + GEMM (a column-parallel linear layer over sequence-parallel rows):
    ``all_gather(a) @ b`` (+ ``bias``), [M, N], on every rank; with ``return_a`` also the
    gathered A [M, K], as ``(out, gathered)``.

    ``a`` is this rank's chunk of the rows of A, ``b`` its [K, N] (``w.t()`` taken without a
    copy). M is ``m`` when given (chunks split as ``torch.tensor_split`` splits M, so they may
    differ by a row), else the group's size times this chunk's rows (equal chunks, as PyTorch's
    operator requires). ``out`` and ``gathered``, when given, receive the results (giving
    ``gathered`` implies ``return_a``). ``path``: "overlapped" (cuBLASLt per piece as the
    pieces arrive: the faster on 2 × H200) or "fused" (one GEMM of commfuse's own whose loads of
    each row band wait for its rows).
    """
    group = _group(group)
    g = _GemmOperands(a, b, bias, out_dtype)
    a, b, bias, out_dtype = g.a, g.b, g.bias, g.out_dtype
    dtype, out_name, layout, (rows, k), n = g.dtype, g.out_name, g.layout, a.shape, g.n
    world = _world(group)
    total = m if m is not None else rows * world
    device = a.device.index
    key = (device, n, k, layout, dtype, out_name, bias is not None, pieces, path)

    def build(rank, world, max_m):
        return GpuAllGatherMatmul(
            device, rank, world, max_m, n, k, b_layout=layout, dtype=dtype,
            out_dtype=out_name, bias=bias is not None, pieces=pieces, path=path,
        )

    op = _operator("ag-gemm", group, total, key, build)
    start, end = op.chunk(total)
    if end - start != rows:
        raise ValueError(
            f"this rank holds {rows} rows of A, but its chunk of M = {total} has {end - start}"
            " (pass m= the total rows when chunks differ)"
        )
    out = _output(out, (total, n), out_dtype, a, "out")
    return_a = return_a or gathered is not None
    if return_a:
        gathered = _output(gathered, (total, k), a.dtype, a, "gathered")
    op.forward(
        total, a.data_ptr(), b.data_ptr(), out.data_ptr(), _stream(a.device),
        bias=None if bias is None else bias.data_ptr(),
        gathered=None if gathered is None else gathered.data_ptr(),
    )
    return (out, gathered) if return_a else out


# commfuse's reduce ops by name, and torch.distributed's
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "prod": dist.ReduceOp.PRODUCT}


def _reduce_name(op) -> str:
    if isinstance(op, str) and op.lower() in _DIST_OPS:
        return op.lower()
    for name, enum in _DIST_OPS.items():
        if op == enum:
            return name
    raise ValueError(f"op must be sum, max, min or prod (or the dist.ReduceOp of one), got {op!r}")


def _vector(x: torch.Tensor, what: str) -> torch.Tensor:
    _cuda_tensor(x, what)
    _name(x.dtype, what)
    return x


def _collective(kind: str, count: int, like: torch.Tensor, group, reduce: str = "sum"):
    """The cached collective of ``kind`` over ``count`` elements of ``like``'s dtype."""
    device = like.device.index if like is not None else torch.cuda.current_device()
    dtype = _name(like.dtype, "the tensor") if like is not None else "f32"
    key = (device, kind, count, dtype, reduce)

    def build(rank, world, _max_m):
        return GpuCollective(device, rank, world, kind, count, dtype=dtype, reduce=reduce)

    return _operator("collective", group, 0, key, build)


def _run(op, input: Optional[torch.Tensor], output: Optional[torch.Tensor], device) -> None:
    op.forward(
        0 if input is None else input.data_ptr(),
        0 if output is None else output.data_ptr(),
        _stream(device),
    )


def _sizes(op, input: torch.Tensor, output: torch.Tensor, what: str) -> None:
    want_in, want_out = op.lengths()
    if input.numel() != want_in or output.numel() != want_out:
        raise ValueError(
            f"{what}: this rank's input must hold {want_in} elements and its output {want_out},"
            f" got {input.numel()} and {output.numel()}"
        )
    _same_kind(input, output, what)


def _same_kind(input: torch.Tensor, output: torch.Tensor, what: str) -> None:
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"{what}: input and output must have one dtype and device")


def collective_path(op: str, count: int, dtype: torch.dtype, group=None, even: bool = True,
                    path: str = "auto") -> str:
    """Where collective ``op`` ("all-reduce", "reduce-scatter", "all-gather", "all-to-all") of
    ``count`` elements of ``dtype`` goes: "commfuse" or "torch.distributed". ``count`` is what
    commfuse's operators count: the all-reduce's tensor, the reduce-scatter's and all-to-all's
    input, the all-gather's output.

    ``path="auto"`` (every collective's default) takes commfuse's where it beats NCCL on the
    caller's own tensors — its LL protocol, which copies nothing, up to 1 MiB sent; its plans
    up to 4 MiB of ``count`` — and ``torch.distributed`` (NCCL on the group) past that, where copying the tensors into and out of commfuse's symmetric buffers costs more than
    its plans gain (``commfuse_core::cost::prefers_commfuse_on_user_buffers``, measured), when
    the message splits evenly over the group (``even``), which torch.distributed needs.
    ``"commfuse"`` and ``"torch"`` ask for one of them."""
    return _route(op, count, dtype, _group_state(_group(group)), even, path)


def _route(op: str, count: int, dtype: torch.dtype, state: tuple, even: bool, path: str) -> str:
    """:func:`collective_path` for a group already looked up (its ``_group_state``): the
    collectives ask it on every call, so it does no more than a dictionary lookup once a size
    has been routed (a host-bound loop of NCCL-sized calls shows every microsecond)."""
    if path == "auto" and even:
        goes = state[2].get((op, count, dtype))
        if goes is None:
            ours = prefers_commfuse_on_user_buffers(op, state[1], count, _name(dtype, "the tensor"))
            goes = state[2][(op, count, dtype)] = "commfuse" if ours else "torch.distributed"
        return goes
    if path not in ("auto", "commfuse", "torch"):
        raise ValueError(f'path must be "auto", "commfuse" or "torch", got {path!r}')
    if path == "torch" and not even:
        raise ValueError('path="torch": torch.distributed splits a message evenly only, and this '
                         "one does not split evenly over the group")
    return "torch.distributed" if path == "torch" else "commfuse"


def all_reduce(tensor: torch.Tensor, op="sum", group=None, path: str = "auto") -> torch.Tensor:
    """``dist.all_reduce``, in place on the tensor's current stream: every rank's ``tensor``
    becomes the element-wise ``op`` ("sum", "max", "min", "prod") of all ranks'. Returns it.
    ``path``: see :func:`collective_path`."""
    _vector(tensor, "tensor")
    group = _group(group)
    op = _reduce_name(op)
    t = tensor.contiguous()
    if _route("all-reduce", t.numel(), t.dtype, _group_state(group), True, path) == "commfuse":
        coll = _collective("all-reduce", t.numel(), t, group, op)
        _run(coll, t, t, t.device)
    else:
        dist.all_reduce(t, op=_DIST_OPS[op], group=group)
    if t.data_ptr() != tensor.data_ptr():
        tensor.copy_(t.view_as(tensor))
    return tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None,
                   path: str = "auto") -> torch.Tensor:
    """``dist.reduce_scatter_tensor``: this rank's chunk of the element-wise ``op`` of every
    rank's ``input`` into ``output``; chunks split as ``torch.tensor_split`` splits the input
    (so the input need not divide by the group's size). Returns ``output``. ``path``: see
    :func:`collective_path`."""
    _vector(input, "input")
    _vector(output, "output")
    group = _group(group)
    op = _reduce_name(op)
    state = _group_state(group)
    n, world = input.numel(), state[1]
    even = n % world == 0 and output.numel() * world == n
    return _into(("reduce-scatter", n, op), (output, input), (group, state), (even, path),
                 lambda out, inp: dist.reduce_scatter_tensor(out, inp, op=_DIST_OPS[op],
                                                             group=group))


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
               path: str = "auto") -> torch.Tensor:
    """``dist.all_gather_into_tensor``: every rank's ``input`` (its chunk, as
    ``torch.tensor_split`` splits the output) concatenated into ``output``. Returns it.
    ``path``: see :func:`collective_path`."""
    _vector(input, "input")
    _vector(output, "output")
    group = _group(group)
    state = _group_state(group)
    n, world = output.numel(), state[1]
    even = n % world == 0 and input.numel() * world == n
    return _into(("all-gather", n, "sum"), (output, input), (group, state), (even, path),
                 lambda out, inp: dist.all_gather_into_tensor(out, inp, group=group))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
               path: str = "auto") -> torch.Tensor:
    """``dist.all_to_all_single`` with equal splits: chunk j of this rank's ``input`` goes to
    rank j, and ``output`` holds chunk r of every rank's input, rank by rank. Returns it.
    ``path``: see :func:`collective_path`."""
    _vector(input, "input")
    _vector(output, "output")
    group = _group(group)
    state = _group_state(group)
    n = input.numel()
    even = n % state[1] == 0 and output.numel() == n
    return _into(("all-to-all", n, "sum"), (output, input), (group, state), (even, path),
                 lambda out, inp: dist.all_to_all_single(out, inp, group=group))


def _into(what, tensors, group_state, route, by_torch):
    """What the collectives from one tensor into another share: ``what`` = (op, the count
    commfuse counts, reduce op), ``tensors`` = (output, input), ``group_state`` = (the group,
    its ``_group_state``), ``route`` = (whether the message splits evenly, path);
    ``by_torch(output, input)`` runs torch.distributed's."""
    (kind, count, reduce), (output, input), (group, state) = what, tensors, group_state
    if _route(kind, count, input.dtype, state, *route) == "torch.distributed":
        # the checks of _same_kind, by integer device indices (cheaper than torch.device)
        if output.dtype != input.dtype or output.get_device() != input.get_device():
            _same_kind(input, output, kind.replace("-", "_"))
        by_torch(_contiguous_out(output), input.contiguous())
        return output
    name = kind.replace("-", "_")
    coll = _collective(kind, count, input, group, reduce)
    _sizes(coll, input, output, name)
    _run(coll, input.contiguous(), _contiguous_out(output), input.device)
    return output


def barrier(group=None) -> None:
    """``dist.barrier``: returns once every rank of the group has reached it (a device-side
    barrier on the current stream, which this call then waits for)."""
    group = _group(group)
    device = torch.device("cuda", torch.cuda.current_device())
    coll = _collective("barrier", 0, None, group)
    _run(coll, None, None, device)
    torch.cuda.current_stream(device).synchronize()
    coll.check()


def _contiguous_out(output: torch.Tensor) -> torch.Tensor:
    if not output.is_contiguous():
        raise ValueError("output must be contiguous")
    return output


def operator_path(a_rows: int, b: torch.Tensor, group=None, **options) -> Optional[str]:
    """The path the cached GEMM + reduce-scatter operator for ``b`` takes for ``a_rows`` rows
    ("fused" or "overlapped (C pieces)"), or None if no call has built it yet."""
    group = _group(group)
    b, layout = _weight(b)
    n, k = (b.shape[0], b.shape[1]) if layout == "nk" else (b.shape[1], b.shape[0])
    out_dtype = options.get("out_dtype") or b.dtype
    key = (b.device.index, n, k, layout, _name(b.dtype, "b"), _name(out_dtype, "out_dtype"),
           options.get("bias", False), options.get("path", "auto"), options.get("pieces"),
           options.get("numa_groups", 1))
    op = _operators.lookup("gemm-rs", group, key)
    return None if op is None else op.path_for(a_rows)


def clear_cache() -> None:
    """Drops every cached operator (each waits for its last calls before freeing its memory);
    collective: every rank must call it at the same point."""
    _operators.clear()
    _GROUPS.clear()
