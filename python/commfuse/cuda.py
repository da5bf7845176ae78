"""commfuse's operators on any framework's CUDA arrays, one process per GPU, without PyTorch.

Arrays come in through DLPack (``__dlpack__``, which names bfloat16) or the CUDA array
interface (``__cuda_array_interface__``: float16 and float32), so CuPy, JAX, Numba or PyTorch
arrays all serve and nothing of theirs is imported. The ranks find each other through a
:class:`Group`: this process's rank, the group's size, its GPU, and any all-gather of bytes the
caller already has (``mpi4py``'s ``comm.allgather``, a key-value store, or
``torch.distributed.all_gather_object``)::

    import cupy as cp, commfuse.cuda as cf
    group = cf.Group(rank, world, comm.allgather)           # mpi4py: bytes in, list out
    out = cp.empty((rows, n), cp.float16)
    cf.gemm_reduce_scatter(a, b, out, group)                # a [M, K], b [K, N], float16

The caller passes every output (commfuse allocates nothing of the caller's) and, as
``stream``, the stream the work goes on (a handle, or an object with ``__cuda_stream__``,
``cuda_stream`` or ``ptr``; the legacy default stream when omitted). The semantics are those of
``commfuse.torch`` (operators cached per group and shape, built collectively at a shape's first
call, calls capturable in a CUDA graph once a shape and M ran outside it). Errors are
``ValueError`` (a call that does not fit) or ``RuntimeError`` (CUDA, a peer that never came),
one line each.

The collectives here are always commfuse's. Past a few MiB they copy the caller's arrays into
and out of commfuse's symmetric buffers, and there NCCL on the same arrays is faster (measured
through ``commfuse.torch``, whose ``path="auto"`` hands such messages to NCCL; the size is
``prefers_commfuse_on_user_buffers`` of ``commfuse._commfuse``).
"""

from __future__ import annotations

from typing import Callable, List, Optional

from . import _operators
from ._arrays import DeviceArray, device_array, stream_handle
from ._commfuse import (GpuAllGatherGemm, GpuCollective, GpuGemmReduceScatter,
                        stream_is_capturing)

__all__ = [
    "Group",
    "gemm_reduce_scatter",
    "all_gather_gemm",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "clear_cache",
]


class Group:
    """The ranks of one operator group: this process's ``rank`` of ``world``, its CUDA
    ``device`` (ordinal; the rank's by default), and ``all_gather``, called collectively with
    this rank's bytes and returning every rank's in rank order."""

    def __init__(self, rank: int, world: int, all_gather: Callable[[bytes], List[bytes]],
                 device: Optional[int] = None):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be 0 to world - 1 = {world - 1}, got {rank}")
        if not callable(all_gather):
            raise ValueError("all_gather must be callable: bytes in, every rank's bytes out")
        self.rank, self.world, self.device = rank, world, rank if device is None else device
        self._all_gather = all_gather

    def _exchange(self, data: bytes) -> List[bytes]:
        got = list(self._all_gather(data))
        if len(got) != self.world or not all(isinstance(b, (bytes, bytearray)) for b in got):
            raise ValueError(
                f"all_gather must return the {self.world} ranks' bytes, got"
                f" {len(got)} items of {sorted({type(b).__name__ for b in got})}"
            )
        return got

    def _operator(self, kind: str, m: int, key: tuple, build, stream: int):
        return _operators.cached(kind, self, m, (self.device,) + key, build, self._exchange,
                                 lambda: stream_is_capturing(self.device, stream))


def _on(group: Group, x: DeviceArray, what: str) -> DeviceArray:
    if x.device is not None and x.device != group.device:
        raise ValueError(f"{what} is on CUDA device {x.device}, the group's is {group.device}")
    return x


def _matrix(x, what: str, group: Group, stream: int) -> DeviceArray:
    d = _on(group, device_array(x, what, stream), what)
    if len(d.shape) != 2:
        raise ValueError(f"{what} must be 2-D, got shape {d.shape}")
    return d


def _contiguous(x, what: str, group: Group, stream: int, shape=None, dtype=None) -> DeviceArray:
    d = _on(group, device_array(x, what, stream), what)
    if not d.is_contiguous():
        raise ValueError(f"{what} must be contiguous (row-major), got strides {d.strides}")
    if shape is not None and d.shape != tuple(shape):
        raise ValueError(f"{what} must be {list(shape)}, got {list(d.shape)}")
    if dtype is not None and d.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {d.dtype}")
    return d


def _gemm(a, b, group: Group, stream: int):
    """A and B checked: (A, B, the layout of B, N) with B [K, N] row-major ("kn") or the
    transpose of a row-major [N, K] ("nk")."""
    a = _matrix(a, "a", group, stream)
    b = _matrix(b, "b", group, stream)
    if a.dtype not in ("bf16", "f16"):
        raise ValueError(f"a and b must be bf16 or f16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if not a.is_contiguous():
        raise ValueError(f"a must be contiguous (row-major), got strides {a.strides}")
    (rows, k), (kb, n) = a.shape, b.shape
    if b.is_contiguous():
        layout = "kn"
    elif b.strides == (1, kb) or (n == 1 and b.strides[0] == 1):
        layout = "nk"
    else:
        raise ValueError(f"b must be row-major [K, N] or the transpose of a row-major [N, K],"
                         f" got strides {b.strides}")
    if kb != k:
        raise ValueError(f"a is [{rows}, {k}] but b is [{kb}, {n}]")
    return a, b, layout, n


def gemm_reduce_scatter(a, b, out, group: Group, bias=None, *, stream=None, path: str = "auto",
                        pieces: Optional[int] = None, numa_groups: int = 1):
    """GEMM + reduce-scatter: this rank's chunk of the rows of ``sum over ranks of a @ b``
    (+ ``bias``, added once) into ``out`` ([rows, N], bf16/f16 as the inputs or f32), rows
    split as the collectives split M (the first M mod P chunks one row longer). ``a`` is this
    rank's [M, K], ``b`` its [K, N]; ``path`` "auto", "fused", "overlapped" or "unfused";
    ``numa_groups`` > 1 makes the overlapped path's ring 2D. Returns ``out``."""
    s = stream_handle(stream)
    a_d, b_d, layout, n = _gemm(a, b, group, s)
    m, k = a_d.shape
    out_d = _contiguous(out, "out", group, s)
    bias_d = None if bias is None else _contiguous(bias, "bias", group, s, (n,), out_d.dtype)
    key = (n, k, layout, a_d.dtype, out_d.dtype, bias is not None, path, pieces, numa_groups)

    def build(max_m):
        return GpuGemmReduceScatter(
            group.device, group.rank, group.world, max_m, n, k, b_layout=layout,
            dtype=a_d.dtype, out_dtype=out_d.dtype, bias=bias is not None, path=path,
            pieces=pieces, numa_groups=numa_groups,
        )

    op = group._operator("gemm-rs", m, key, build, s)
    start, end = op.chunk(m)
    if out_d.shape != (end - start, n):
        raise ValueError(f"out must be [{end - start}, {n}] (this rank's rows of M = {m}),"
                         f" got {list(out_d.shape)}")
    op.forward(m, a_d.ptr, b_d.ptr, out_d.ptr, s, bias=None if bias_d is None else bias_d.ptr)
    return out


def all_gather_gemm(a, b, out, group: Group, bias=None, *, gathered=None, stream=None,
                    pieces: Optional[int] = None, path: str = "auto"):
    """All-gather + GEMM: ``all_gather(a) @ b`` (+ ``bias``) into ``out`` ([M, N]) on every
    rank, and the gathered A into ``gathered`` ([M, K]) when given. ``a`` is this rank's chunk
    of the rows of A (chunks split as the collectives split M = ``out``'s rows), ``b`` its
    [K, N]; ``path`` "auto", "overlapped" or "fused" and ``pieces`` as
    ``commfuse.torch.all_gather_gemm`` takes them. Returns ``out``."""
    s = stream_handle(stream)
    a_d, b_d, layout, n = _gemm(a, b, group, s)
    rows, k = a_d.shape
    out_d = _contiguous(out, "out", group, s)
    if len(out_d.shape) != 2 or out_d.shape[1] != n:
        raise ValueError(f"out must be [M, {n}], got {list(out_d.shape)}")
    m = out_d.shape[0]
    bias_d = None if bias is None else _contiguous(bias, "bias", group, s, (n,), out_d.dtype)
    gathered_d = None if gathered is None else _contiguous(gathered, "gathered", group, s,
                                                           (m, k), a_d.dtype)
    key = ((n, k, layout, a_d.dtype, out_d.dtype, bias is not None)
           + _operators.ag_path_key(pieces, path))

    def build(max_m):
        return GpuAllGatherGemm(
            group.device, group.rank, group.world, max_m, n, k, b_layout=layout,
            dtype=a_d.dtype, out_dtype=out_d.dtype, bias=bias is not None, pieces=pieces,
            path=path,
        )

    op = group._operator("ag-gemm", m, key, build, s)
    start, end = op.chunk(m)
    if end - start != rows:
        raise ValueError(f"this rank holds {rows} rows of A, but its chunk of M = {m} has"
                         f" {end - start}")
    op.forward(m, a_d.ptr, b_d.ptr, out_d.ptr, s,
               bias=None if bias_d is None else bias_d.ptr,
               gathered=None if gathered_d is None else gathered_d.ptr)
    return out


_REDUCE_OPS = ("sum", "max", "min", "prod")


def _collective(kind: str, x, out, group: Group, stream, reduce: str = "sum", count=None):
    if reduce not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(_REDUCE_OPS)}, got {reduce!r}")
    s = stream_handle(stream)
    x_d = _contiguous(x, "input", group, s)
    out_d = x_d if out is None else _contiguous(out, "output", group, s, dtype=x_d.dtype)
    count = x_d.size if count is None else count(x_d, out_d)
    key = (kind, count, x_d.dtype, reduce)

    def build(_max_m):
        return GpuCollective(group.device, group.rank, group.world, kind, count,
                             dtype=x_d.dtype, reduce=reduce)

    op = group._operator("collective", 0, key, build, s)
    want_in, want_out = op.lengths()
    if x_d.size != want_in or out_d.size != want_out:
        raise ValueError(f"{kind}: this rank's input must hold {want_in} elements and its output"
                         f" {want_out}, got {x_d.size} and {out_d.size}")
    op.forward(x_d.ptr, out_d.ptr, s)


def all_reduce(x, group: Group, op: str = "sum", *, stream=None):
    """Every rank's ``x`` becomes, in place, the element-wise ``op`` of all ranks'. Returns
    ``x``."""
    _collective("all-reduce", x, None, group, stream, op)
    return x


def reduce_scatter(out, x, group: Group, op: str = "sum", *, stream=None):
    """This rank's chunk of the element-wise ``op`` of every rank's ``x`` into ``out`` (chunks
    split as ``numpy.array_split`` splits ``x``). Returns ``out``."""
    _collective("reduce-scatter", x, out, group, stream, op)
    return out


def all_gather(out, x, group: Group, *, stream=None):
    """Every rank's ``x`` (its chunk of ``out``, split as ``numpy.array_split`` splits it)
    concatenated into ``out``. Returns ``out``."""
    _collective("all-gather", x, out, group, stream, count=lambda _x, o: o.size)
    return out


def all_to_all(out, x, group: Group, *, stream=None):
    """Chunk j of this rank's ``x`` goes to rank j, which places it as chunk ``rank`` of its
    ``out`` (equal chunks). Returns ``out``."""
    _collective("all-to-all", x, out, group, stream)
    return out


def clear_cache() -> None:
    """Drops every cached operator (of ``commfuse.torch`` too); collective: every rank must call
    it at the same point."""
    _operators.clear()
