"""commfuse.torch's GPU implementations: commfuse's kernels on CUDA tensors, one process per
GPU, operators cached per (group, shape, types) and built collectively at a shape's first call
(every rank exchanges its buffers' CUDA IPC handles through ``dist.all_gather_object``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _operators
from .._commfuse import (
    GpuAllGatherGemm,
    GpuCollective,
    GpuGemmReduceScatter,
    prefers_commfuse_on_user_buffers,
)
from ._common import GemmOperands, dtype_name

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


try:  # the current stream's handle without a Stream object (what inductor's code calls)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older or CPU-only builds
    _raw_stream = None


def _stream(device: torch.device) -> int:
    return stream_of(device.index)


def stream_of(index: int) -> int:
    """The current stream's handle on CUDA device ``index``."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


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


def gemm_rs_operator(g: GemmOperands, group, path: str, pieces: Optional[int],
                     numa_groups: int):
    """The cached GEMM + reduce-scatter operator for checked operands (built collectively when
    absent or too small for their M) and this rank's rows of the output."""
    a, bias = g.a, g.bias
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
    return op, end - start


def gemm_reduce_scatter(g: GemmOperands, group, path: str, pieces: Optional[int],
                        numa_groups: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GEMM + reduce-scatter of checked operands on commfuse's kernels (see
    ``commfuse.torch.gemm_reduce_scatter``), into ``out`` when given."""
    op, rows = gemm_rs_operator(g, group, path, pieces, numa_groups)
    a, b, bias = g.a, g.b, g.bias
    out = _output(out, (rows, g.n), g.out_dtype, a, "out")
    op.forward(
        a.shape[0], a.data_ptr(), b.data_ptr(), out.data_ptr(), _stream(a.device),
        bias=None if bias is None else bias.data_ptr(),
    )
    return out


def ag_gemm_operator(g: GemmOperands, group, m: int, pieces: Optional[int], path: str):
    """The cached all-gather + GEMM operator for checked operands and ``m`` rows in all (built
    collectively when absent or too small)."""
    a, bias = g.a, g.bias
    dtype, out_name, layout, (rows, k), n = g.dtype, g.out_name, g.layout, a.shape, g.n
    device = a.device.index
    key = ((device, n, k, layout, dtype, out_name, bias is not None)
           + _operators.ag_path_key(pieces, path))

    def build(rank, world, max_m):
        return GpuAllGatherGemm(
            device, rank, world, max_m, n, k, b_layout=layout, dtype=dtype,
            out_dtype=out_name, bias=bias is not None, pieces=pieces, path=path,
        )

    op = _operator("ag-gemm", group, m, key, build)
    start, end = op.chunk(m)
    if end - start != rows:
        raise ValueError(
            f"this rank holds {rows} rows of A, but its chunk of M = {m} has {end - start}"
            " (pass m= the total rows when chunks differ)"
        )
    return op


def all_gather_gemm(g: GemmOperands, group, m: int, pieces: Optional[int], path: str,
                    return_a: bool, out: Optional[torch.Tensor] = None,
                    gathered: Optional[torch.Tensor] = None):
    """All-gather + GEMM of checked operands on commfuse's kernels (see
    ``commfuse.torch.all_gather_gemm``): ``(out, gathered)``, gathered None unless asked for."""
    op = ag_gemm_operator(g, group, m, pieces, path)
    a, b, bias = g.a, g.b, g.bias
    out = _output(out, (m, g.n), g.out_dtype, a, "out")
    return_a = return_a or gathered is not None
    if return_a:
        gathered = _output(gathered, (m, g.k), a.dtype, a, "gathered")
    op.forward(
        m, a.data_ptr(), b.data_ptr(), out.data_ptr(), _stream(a.device),
        bias=None if bias is None else bias.data_ptr(),
        gathered=None if gathered is None else gathered.data_ptr(),
    )
    return out, gathered


def _collective(kind: str, count: int, like: Optional[torch.Tensor], group, reduce: str = "sum"):
    """The cached collective of ``kind`` over ``count`` elements of ``like``'s dtype."""
    device = like.device.index if like is not None else torch.cuda.current_device()
    dtype = dtype_name(like.dtype, "the tensor") if like is not None else "f32"
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


def route(op: str, count: int, dtype: torch.dtype, group, even: bool, path: str) -> str:
    """Where collective ``op`` of ``count`` elements goes on CUDA tensors: "commfuse" or
    "torch.distributed" (see ``commfuse.torch.collective_path``). The collectives ask it on
    every call, so it does no more than a dictionary lookup once a size has been routed (a
    host-bound loop of NCCL-sized calls shows every microsecond)."""
    state = _group_state(group)
    if path == "auto" and even:
        goes = state[2].get((op, count, dtype))
        if goes is None:
            ours = prefers_commfuse_on_user_buffers(op, state[1], count,
                                                    dtype_name(dtype, "the tensor"))
            goes = state[2][(op, count, dtype)] = "commfuse" if ours else "torch.distributed"
        return goes
    if path not in ("auto", "commfuse", "torch"):
        raise ValueError(f'path must be "auto", "commfuse" or "torch", got {path!r}')
    if path == "torch" and not even:
        raise ValueError('path="torch": torch.distributed splits a message evenly only, and this '
                         "one does not split evenly over the group")
    return "torch.distributed" if path == "torch" else "commfuse"


def splits_evenly(kind: str, in_count: int, out_count: int, world: int) -> bool:
    """Whether collective ``kind`` from ``in_count`` elements a rank into ``out_count`` splits
    evenly over ``world`` ranks (what ``route`` asks: torch.distributed splits evenly only)."""
    count = out_count if kind == "all-gather" else in_count
    if kind == "all-reduce":
        return True
    if kind == "all-to-all":
        return count % world == 0 and out_count == count
    small = in_count if kind == "all-gather" else out_count
    return count % world == 0 and small * world == count


def collective_into(kind: str, output: Optional[torch.Tensor], input: torch.Tensor, group,
                    reduce: str, path: str, by_torch) -> None:
    """Collective ``kind`` ("all-reduce": ``input`` is ``output``, "reduce-scatter",
    "all-gather", "all-to-all") from ``input`` into ``output``, both contiguous, by commfuse's
    kernels or, where ``route`` sends it, by ``by_torch()`` (torch.distributed)."""
    count = output.numel() if kind == "all-gather" else input.numel()
    even = splits_evenly(kind, input.numel(), output.numel(), _world(group))
    if route(kind, count, input.dtype, group, even, path) == "torch.distributed":
        by_torch()
        return
    coll = _collective(kind, count, input, group, reduce)
    want_in, want_out = coll.lengths()
    if input.numel() != want_in or output.numel() != want_out:
        raise ValueError(
            f"{kind.replace('-', '_')}: this rank's input must hold {want_in} elements and its"
            f" output {want_out}, got {input.numel()} and {output.numel()}"
        )
    _run(coll, input, output, input.device)


def barrier(group) -> None:
    """A device-side barrier on the current stream, which this call then waits for."""
    device = torch.device("cuda", torch.cuda.current_device())
    coll = _collective("barrier", 0, None, group)
    _run(coll, None, None, device)
    torch.cuda.current_stream(device).synchronize()
    coll.check()


def operator_path(a_rows: int, key: tuple, group) -> Optional[str]:
    """The path the cached GEMM + reduce-scatter operator of ``key`` takes for ``a_rows`` rows,
    or None if no call has built it yet."""
    op = _operators.lookup("gemm-rs", group, key)
    return None if op is None else op.path_for(a_rows)


def clear_cache() -> None:
    _operators.clear()
    _GROUPS.clear()
