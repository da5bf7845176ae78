"""commfuse's fused operators on PyTorch tensors, one process per GPU (or per CPU rank).

The semantics are those of PyTorch's symmetric-memory operators
(``torch.ops.symm_mem.fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul``) and of
``torch.distributed``'s collectives, on a ``torch.distributed`` process group::

    import torch, torch.distributed as dist, commfuse.torch as cf
    dist.init_process_group("nccl")            # torchrun --nproc-per-node P
    torch.cuda.set_device(dist.get_rank())
    y = cf.gemm_reduce_scatter(x, w.t())       # this rank's rows of sum_r x_r @ w_r.t()
    z = cf.all_gather_gemm(x_shard, w.t())     # all_gather(x_shard) @ w.t()

What serves a call depends on the tensors and the group:

* CUDA tensors on a group whose ranks are one per GPU on one host: commfuse's kernels (GPUs
  opening each other's memory over NVLink).
* CPU tensors (a gloo group): commfuse's simulator across the processes, the same schedules
  and protocols, so that a model trains on any machine.
* Any other group (ranks on several hosts, ranks sharing a GPU, or ``COMMFUSE_PEER_ACCESS=0``):
  ``torch.distributed`` and ``torch.matmul`` with the same semantics, said once in a warning;
  :func:`operator_path` and :func:`collective_path` report it.

Every op is a ``torch.library`` custom op (``torch.ops.commfuse.*``) with a fake kernel, so
``torch.compile(fullgraph=True)`` traces models that use them, and is differentiable: the
backward of a GEMM + reduce-scatter is an all-gather + GEMM and the other way round (see
``commfuse.torch._ops``). ``commfuse.torch.nn`` has the tensor-parallel layers,
``commfuse.torch.functional`` the collectives that return new tensors.

Nothing here links against PyTorch: tensors reach commfuse as addresses, and the work goes on
the tensors' current CUDA stream. An operator is built the first time a (group, device, N, K,
layout, dtypes, bias) combination is called and cached; building one is collective, so every
rank must make the same calls in the same order, as with any ``torch.distributed`` collective.
Call :func:`clear_cache` before ``dist.destroy_process_group()``: the cache holds the groups,
and a gloo group outliving its destruction until the interpreter's exit can abort it there.

Calls can be captured into a CUDA graph (``torch.cuda.graph``, or ``torch.compile``'s
``mode="reduce-overhead"``) and replayed: the operators number their calls on the GPU, so
every replay is a new call. As PyTorch asks of any captured work, call each shape once before
capturing, the largest M first. GEMM + reduce-scatter's "overlapped" path cannot be captured
(``path="auto"`` takes the fused path instead where it would take it), nor can ``barrier``.

The collectives take ``path="auto"`` by default: commfuse's where it beats NCCL on the caller's
own tensors, ``torch.distributed`` past that; see :func:`collective_path`.

Errors are Python exceptions carrying commfuse's one-line message: ``ValueError`` for a call
that does not fit, ``RuntimeError`` for a CUDA failure or a peer that never arrived.
"""

from __future__ import annotations

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "commfuse.torch needs PyTorch: install it with `pip install torch` (or"
        " `pip install commfuse[torch]`); commfuse.sim and commfuse.cuda work without it"
    ) from e

from typing import Optional, Tuple, Union

from . import _gpu, _groups, _native, _ops, _prepared, _sim
from ._common import dtype_name, reduce_name, tensor, weight
from ._groups import KERNELS, SIMULATOR, name_of

__all__ = [
    "gemm_reduce_scatter",
    "all_gather_gemm",
    "all_gather_matmul",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "barrier",
    "collective_path",
    "operator_path",
    "served_by",
    "serve_by_torch_distributed",
    "clear_cache",
]

_GEMM_RS_PATHS = ("auto", "fused", "overlapped", "unfused")
_AG_GEMM_PATHS = ("auto", "overlapped", "fused")
_COLLECTIVE_PATHS = ("auto", "commfuse", "torch")


def _choice(what: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


_is_compiling = torch.compiler.is_compiling
# With the C++ dispatcher kernels, the op itself is the shortest road for every call (its
# prepared calls never enter Python); without them, an eager call skips the dispatcher
_NATIVE = _native.loaded


def _eager(*tensors) -> bool:
    """Whether a call may skip the dispatcher: nothing is being compiled and no input needs a
    gradient (the result is the op's, without the dispatcher's few microseconds). Every call
    asks, so it is written for speed: a loop rather than a generator, the functions bound."""
    if _is_compiling():
        return False
    if torch.is_grad_enabled():
        for t in tensors:
            # (what is not a tensor is left to the op's checks)
            if getattr(t, "requires_grad", False):
                return False
    return True


def _operands(a, b, bias) -> bool:
    """Whether the GEMM operands are tensors (what is not is named by the general path's
    checks, not by the dispatcher's cast error)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        (bias is None or isinstance(bias, torch.Tensor))


_gemm_rs_op = torch.ops.commfuse.gemm_reduce_scatter.default
_ag_gemm_op = torch.ops.commfuse.all_gather_gemm.default
_all_reduce_op = torch.ops.commfuse.all_reduce_.default
_into_ops = {name: getattr(torch.ops.commfuse, name).default
             for name in ("reduce_scatter_into", "all_gather_into", "all_to_all_into")}


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
    ``sum over ranks of a @ b`` (+ ``bias``, this rank's, added once to its rows).

    ``a`` is this rank's [M, K] (K the rank's shard), ``b`` its [K, N] (a weight's ``w.t()``
    is taken without a copy), both bfloat16 or float16; every rank passes the same M. The
    output is [rows, N] of ``out_dtype`` (the input type by default, or float32), rows split
    as ``torch.tensor_split`` splits M into the group's size (the first M mod P chunks one row
    longer). ``path`` is "auto" (the cost model's choice), "fused", "overlapped" (with
    ``pieces`` per ring step) or "unfused" (the GEMM, then a reduce-scatter). ``out``, when given, receives the result. ``numa_groups`` > 1
    (dividing the group's size) makes the overlapped path's ring 2D. Differentiable in ``a``,
    ``b`` and ``bias``.
    """
    name = name_of(group)
    _choice("path", path, _GEMM_RS_PATHS)
    if _NATIVE and out is None and _operands(a, b, bias):
        return _gemm_rs_op(a, b, bias, name, out_dtype, path, pieces, numa_groups)
    if _eager(a, b, bias):
        if out is None:
            return _prepared.gemm_reduce_scatter(
                a, b, bias, name, out_dtype, path, pieces, numa_groups,
                lambda: _ops.gemm_rs_impl(a, b, bias, name, out_dtype, path, pieces, numa_groups))
        return _ops.gemm_rs_impl(a, b, bias, name, out_dtype, path, pieces, numa_groups, out)
    y = torch.ops.commfuse.gemm_reduce_scatter(a, b, bias, name, out_dtype, path, pieces,
                                               numa_groups)
    return y if out is None else _ops._into(out, y, "out")


def all_gather_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group=None,
    bias: Optional[torch.Tensor] = None,
    return_a: bool = False,
    *,
    m: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    pieces: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    gathered: Optional[torch.Tensor] = None,
    path: str = "auto",
    save_gathered: bool = True,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """All-gather + GEMM (a column-parallel linear layer over sequence-parallel rows):
    ``all_gather(a) @ b`` (+ ``bias``), [M, N], on every rank; with ``return_a`` also the
    gathered A [M, K], as ``(out, gathered)``.

    ``a`` is this rank's chunk of the rows of A, ``b`` its [K, N] (``w.t()`` taken without a
    copy). M is ``m`` when given (chunks split as ``torch.tensor_split`` splits M, so they may
    differ by a row), else the group's size times this chunk's rows. ``out`` and ``gathered``,
    when given, receive the results (giving ``gathered`` implies ``return_a``). ``path``:
    "overlapped" (cuBLASLt per piece as the pieces arrive), "fused" (one GEMM of commfuse's
    own whose loads of each row band wait for its rows) or "auto" (the overlapped path, the
    faster at every shape measured); ``pieces``: the row pieces each rank's chunk is handed on
    in (1 to 16; None: what auto takes, whole chunks).

    Differentiable in ``a``, ``b`` and ``bias``. The gradient of ``b`` needs the gathered A:
    with ``save_gathered`` (the default) the forward keeps it, else the backward gathers A
    again (less memory, one more all-gather).
    """
    name = name_of(group)
    _choice("path", path, _AG_GEMM_PATHS)
    if _NATIVE and out is None and gathered is None and _operands(a, b, bias):
        # with the C++ kernels, the op itself (its prepared calls are the shorter road)
        if m is None:
            m = a.shape[0] * _groups.by_name(name).world
        y, x = _ag_gemm_op(a, b, bias, name, m, out_dtype, pieces, path, return_a or (
            save_gathered and b.requires_grad and torch.is_grad_enabled()))
        return (y, x) if return_a else y
    return_a = return_a or gathered is not None
    eager = _eager(a, b, bias)
    if eager and out is None and gathered is None:
        # the signature (with `m` as given) fixes the rows in all, so a prepared call does
        # not work them out again
        y, x = _prepared.all_gather_gemm(
            a, b, bias, name, m, out_dtype, pieces, path, return_a,
            lambda: _ops.ag_gemm_impl(a, b, bias, name, _rows(a, name, m), out_dtype, pieces,
                                      path, return_a))
        return (y, x) if return_a else y
    m = _rows(a, name, m)
    if eager:
        y, x = _ops.ag_gemm_impl(a, b, bias, name, m, out_dtype, pieces, path, return_a, out,
                                 gathered)
        return (y, x) if return_a else y
    keep = return_a or (save_gathered and b.requires_grad and torch.is_grad_enabled())
    y, x = _ag_gemm_op(a, b, bias, name, m, out_dtype, pieces, path, keep)
    if out is not None:
        y = _ops._into(out, y, "out")
    if not return_a:
        return y
    return y, (x if gathered is None else _ops._into(gathered, x, "gathered"))


def _rows(a, name: str, m: Optional[int]) -> int:
    """All-gather + GEMM's rows in all: ``m`` when given, else the group's size times the
    rows of this rank's chunk."""
    return tensor(a, "a").shape[0] * _groups.by_name(name).world if m is None else m


#: The same operator as :func:`all_gather_gemm` (the name ``commfuse.sim`` used first).
all_gather_matmul = all_gather_gemm


def _vector(x, what: str) -> torch.Tensor:
    tensor(x, what)
    dtype_name(x.dtype, what)
    return x


def all_reduce(tensor: torch.Tensor, op="sum", group=None, path: str = "auto") -> torch.Tensor:
    """``dist.all_reduce``, in place on the tensor's current stream: every rank's ``tensor``
    becomes the element-wise ``op`` ("sum", "max", "min", "prod") of all ranks'. Returns it.
    ``path``: see :func:`collective_path`. (``commfuse.torch.functional.all_reduce`` returns a
    new tensor and is differentiable.)"""
    _vector(tensor, "tensor")
    name, op = name_of(group), reduce_name(op)
    _choice("path", path, _COLLECTIVE_PATHS)
    if _NATIVE:
        _all_reduce_op(tensor, op, name, path)
    elif _eager() and tensor.is_contiguous():
        _prepared.all_reduce(
            tensor, op, name, path,
            lambda: _ops.collective_impl("all-reduce", tensor, tensor, op, name, path))
    else:
        torch.ops.commfuse.all_reduce_(tensor, op, name, path)
    return tensor


def _into_collective(kind: str, op_name: str, output, input, reduce, group, path, *rest):
    _vector(input, "input")
    _vector(output, "output")
    name = name_of(group)
    _choice("path", path, _COLLECTIVE_PATHS)
    if not _eager() or (_NATIVE and _eager(input, output)):
        # compiled, or (with the C++ kernels) the op's C++ prepared call, the shorter road; an
        # input that needs a gradient would send the op to its autograd kernel, which a
        # collective into a given tensor has not
        _into_ops[op_name](output, input, *rest, name, path)
    else:
        # as torch.distributed's own call, also on tensors that need a gradient: the op's
        # prepared call, without the dispatcher
        _prepared.collective_into(
            op_name, kind, output, input, reduce, name, path,
            lambda: _ops.collective_impl(kind, output, input, reduce, name, path))
    return output


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None,
                   path: str = "auto") -> torch.Tensor:
    """``dist.reduce_scatter_tensor``: this rank's chunk of the element-wise ``op`` of every
    rank's ``input`` into ``output``; chunks split as ``torch.tensor_split`` splits the
    flattened input (so it need not divide by the group's size). Returns ``output``."""
    op = reduce_name(op)
    return _into_collective("reduce-scatter", "reduce_scatter_into", output, input, op, group,
                            path, op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
               path: str = "auto") -> torch.Tensor:
    """``dist.all_gather_into_tensor``: every rank's ``input`` (its chunk, as
    ``torch.tensor_split`` splits the flattened output) concatenated into ``output``."""
    return _into_collective("all-gather", "all_gather_into", output, input, "sum", group, path)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
               path: str = "auto") -> torch.Tensor:
    """``dist.all_to_all_single`` with equal splits: chunk j of this rank's ``input`` goes to
    rank j, and ``output`` holds chunk r of every rank's input, rank by rank."""
    return _into_collective("all-to-all", "all_to_all_into", output, input, "sum", group, path)


def barrier(group=None, device: Optional[torch.device] = None) -> None:
    """``dist.barrier``: returns once every rank of the group has reached it (on GPUs a
    device-side barrier on the current stream, which this call then waits for)."""
    g = _groups.by_name(name_of(group))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    served = g.served_by(device)
    if served == KERNELS:
        _gpu.barrier(g.process_group)
    elif served == SIMULATOR:
        _sim.barrier(_sim.group_of(g.process_group, g.name, g.rank, g.world))
    else:
        dist.barrier(group=g.process_group)


def served_by(device: Union[str, torch.device], group=None) -> str:
    """What serves ``group``'s calls on ``device``: "commfuse" (its kernels), "commfuse-sim"
    (its simulator, CPU tensors) or "torch.distributed". Settled collectively at the first
    call on each device type, which this may be."""
    return _groups.by_name(name_of(group)).served_by(torch.device(device))


def serve_by_torch_distributed(group=None) -> None:
    """Serve ``group``'s later calls by torch.distributed and torch.matmul (the semantics stay
    the same): for groups commfuse could serve, to compare the two in one program."""
    _groups.by_name(name_of(group)).serve_by_torch()
    _prepared.clear()


def collective_path(op: str, count: int, dtype: torch.dtype, group=None, even: bool = True,
                    path: str = "auto", device: Union[str, torch.device, None] = None) -> str:
    """Where collective ``op`` ("all-reduce", "reduce-scatter", "all-gather", "all-to-all") of
    ``count`` elements of ``dtype`` goes: "commfuse", "commfuse-sim" or "torch.distributed".
    ``count`` is what commfuse's operators count: the all-reduce's tensor, the reduce-scatter's
    and all-to-all's input, the all-gather's output.

    On GPUs, ``path="auto"`` (every collective's default) takes commfuse's where it beats NCCL
    on the caller's own tensors — its LL protocol, which copies nothing, up to 1 MiB sent; its
    plans up to 4 MiB of ``count`` — and ``torch.distributed`` past that, where copying the
    tensors into and out of commfuse's symmetric buffers costs more than its plans gain, when
    the message splits evenly over the group (``even``), which torch.distributed needs.
    ``"commfuse"`` and ``"torch"`` ask for one of them. ``device`` defaults to the current
    CUDA device."""
    _choice("path", path, _COLLECTIVE_PATHS)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    g = _groups.by_name(name_of(group))
    served = g.served_by(torch.device(device))
    if served != KERNELS:
        return served
    return _gpu.route(op, count, dtype, g.process_group, even, path)


def operator_path(a_rows: int, b: torch.Tensor, group=None, **options) -> Optional[str]:
    """The path GEMM + reduce-scatter takes for ``a_rows`` rows of A against ``b`` ("fused",
    "overlapped (C pieces)", "commfuse-sim" or "torch.distributed"), or None where it runs on
    commfuse's kernels and no call has built its operator yet."""
    g = _groups.by_name(name_of(group))
    b, layout = weight(b)
    n, k = (b.shape[0], b.shape[1]) if layout == "nk" else (b.shape[1], b.shape[0])
    served = g.served_by_gemm(b.device, k)
    if served != KERNELS:
        return served
    out_dtype = options.get("out_dtype") or b.dtype
    key = (b.device.index, n, k, layout, dtype_name(b.dtype, "b"),
           dtype_name(out_dtype, "out_dtype"), options.get("bias", False),
           options.get("path", "auto"), options.get("pieces"), options.get("numa_groups", 1))
    return _gpu.operator_path(a_rows, key, g.process_group)


def clear_cache() -> None:
    """Drops every cached operator (each waits for its last calls before freeing its memory)
    and what was settled for each group; collective: every rank must call it at one point."""
    _gpu.clear_cache()
    _sim.clear_cache()
    _groups.clear()
    _prepared.clear()


from . import functional, nn  # noqa: E402,F401  (submodules; they use the ops above)
