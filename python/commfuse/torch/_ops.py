"""commfuse.torch's operators as dispatcher ops in the ``commfuse`` namespace (defined by
``_library``): what ``torch.compile`` traces (fake kernels give exact shapes, dtypes and
strides without running anything), what autograd differentiates, and what runs: commfuse's kernels, its
simulator or torch.distributed, by what serves the group on the tensors' device.

The group travels as its name (``group.group_name``), as in PyTorch's functional collectives.

Autograd follows the adjoints of tensor parallelism: the backward of a GEMM + reduce-scatter is
an all-gather + GEMM (dA = AG(dY)·Bᵀ, which also returns the gathered dY for dB = Aᵀ·AG(dY));
the backward of an all-gather + GEMM is a GEMM + reduce-scatter (dA = RS(dZ·Bᵀ)) and a local
GEMM on the gathered A kept from the forward (dB = AG(A)ᵀ·dZ); all-gather and reduce-scatter
are each other's adjoints, all-reduce (a sum) and all-to-all their own.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _fallback, _gpu, _native, _prepared, _sim
from ._common import GemmOperands, chunk_rows, chunk_start
from ._groups import KERNELS, SIMULATOR, by_name
from ._library import op

ops = torch.ops.commfuse


# ---------------------------------------------------------------------------------------------
# what runs


def _same_call(group, what: str, fields: tuple, own=None) -> list:
    """Every rank's ``own`` (what may differ between ranks, such as its rows), in rank order,
    once every rank is known to call ``what`` with the same ``fields`` (``(name, value)`` pairs:
    M, N, K, types, options): both exchanged at the first call of each (see
    ``Group.requests``), else a ValueError on every rank naming each rank's value of the first
    field that differs (and nothing remembered, so that every rank exchanges again). The
    exchange comes before anything is built or run, so that a rank whose call differs fails with
    the others instead of entering a collective alone."""
    request = (fields, own)
    every, first = group.requests(what, request)
    if not first:
        # a request kept from an earlier call was compared then (a refused one is not kept)
        return [e[1] for e in every]
    for i, (name, _) in enumerate(fields):
        seen = [e[0][i][1] for e in every]
        if len(set(seen)) > 1:
            group.forget(what, request)
            got = " and ".join(f"{name} = {v} on rank {r}" for r, v in enumerate(seen))
            raise ValueError(f"{what}: every rank must pass the same {name}, got {got}")
    return [e[1] for e in every]


def _gemm_fields(g: GemmOperands, m: int, *options) -> tuple:
    return (("M", m), ("N", g.n), ("K", g.k), ("the layout of b", g.layout), ("dtype", g.dtype),
            ("out_dtype", g.out_name), ("bias (given)", g.bias is not None)) + options


def gemm_rs_impl(a, b, bias, group_name: str, out_dtype, path: str, pieces, numa_groups: int,
                 out: Optional[Tensor] = None) -> Tensor:
    """GEMM + reduce-scatter, eagerly, by what serves the group (into ``out`` when given)."""
    g = GemmOperands(a, b, bias, out_dtype)
    group = by_name(group_name)
    _same_call(group, "gemm_reduce_scatter",
               _gemm_fields(g, g.a.shape[0], ("path", path), ("pieces", pieces),
                            ("numa_groups", numa_groups)))
    served = group.served_by_gemm(g.a.device, g.k)
    if served == KERNELS:
        return _gpu.gemm_reduce_scatter(g, group.process_group, path, pieces, numa_groups, out)
    if served == SIMULATOR:
        sim = _sim.group_of(group.process_group, group.name, group.rank, group.world)
        y = _sim.gemm_reduce_scatter(sim, g, path, pieces)
    else:
        y = _fallback.gemm_reduce_scatter(g, group.process_group, group.rank, group.world)
    return _into(out, y, "out")


def ag_gemm_impl(a, b, bias, group_name: str, m: Optional[int], out_dtype,
                 pieces: Optional[int], path: str, return_a: bool, out: Optional[Tensor] = None,
                 gathered: Optional[Tensor] = None):
    """All-gather + GEMM, eagerly: ``(out, gathered)``, gathered None unless asked for."""
    g = GemmOperands(a, b, bias, out_dtype)
    group = by_name(group_name)
    total = m if m is not None else g.a.shape[0] * group.world
    # every rank's rows are checked on every rank, so that all fail together
    fields = _gemm_fields(g, total, ("pieces", pieces), ("path", path))
    held_by = _same_call(group, "all_gather_gemm", fields, g.a.shape[0])
    for r, held in enumerate(held_by):
        rows = chunk_rows(total, group.world, r)
        if held != rows:
            group.forget("all_gather_gemm", (fields, g.a.shape[0]))
            who = "this rank" if r == group.rank else f"rank {r}"
            raise ValueError(
                f"{who} holds {held} rows of A, but its chunk of M = {total} has {rows}"
                " (pass m= the total rows when chunks differ)"
            )
    served = group.served_by_gemm(g.a.device, g.k)
    return_a = return_a or gathered is not None
    if served == KERNELS:
        return _gpu.all_gather_gemm(g, group.process_group, total, pieces, path, return_a, out,
                                    gathered)
    if served == SIMULATOR:
        sim = _sim.group_of(group.process_group, group.name, group.rank, group.world)
        y, x = _sim.all_gather_gemm(sim, g, total, pieces, path, return_a)
    else:
        y, x = _fallback.all_gather_gemm(g, group.process_group, group.world, total, return_a)
    return _into(out, y, "out"), (None if x is None else _into(gathered, x, "gathered"))


def _into(out: Optional[Tensor], y: Tensor, what: str) -> Tensor:
    if out is None:
        return y
    if not isinstance(out, Tensor) or out.shape != y.shape or out.dtype != y.dtype \
            or out.device != y.device:
        got = (tuple(out.shape), out.dtype, str(out.device)) if isinstance(out, Tensor) \
            else type(out).__name__
        raise ValueError(f"{what} must be a {list(y.shape)} tensor of {y.dtype} on {y.device},"
                         f" got {got}")
    return out.copy_(y)


def collective_impl(kind: str, output: Tensor, input: Tensor, reduce: str, group_name: str,
                    path: str) -> None:
    """Collective ``kind`` from ``input`` into ``output`` (flat semantics), eagerly."""
    group = by_name(group_name)
    what = kind.replace("-", "_")
    if not output.is_contiguous():
        raise ValueError("output must be contiguous")
    input = input.contiguous()
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"{what}: input and output must have one dtype and device")
    # ranks whose counts or dtypes differ would build operators for different messages (or
    # meet in torch.distributed with different sizes): compared before anything is built or
    # run, once per signature, so that every rank fails together instead of one hanging
    count = output.numel() if kind == "all-gather" else input.numel()
    fields = (("element count", count), ("dtype", input.dtype), ("path", path))
    if kind in ("all-reduce", "reduce-scatter"):
        fields += (("op", reduce),)
    _same_call(group, what, fields)
    served = group.served_by(input.device)

    def by_torch():
        _fallback.collective_into(kind, output, input, group.process_group, group.rank,
                                  group.world, reduce)

    if served == KERNELS:
        _gpu.collective_into(kind, output, input, group.process_group, reduce, path, by_torch)
    elif served == SIMULATOR:
        sim = _sim.group_of(group.process_group, group.name, group.rank, group.world)
        _sim.collective_into(sim, kind, output, input, reduce)
    else:
        by_torch()


# ---------------------------------------------------------------------------------------------
# the fused GEMMs


@op(mutates_args=(), native=_native.GEMM_RS)
def gemm_reduce_scatter(a: Tensor, b: Tensor, bias: Optional[Tensor], group_name: str,
                        out_dtype: Optional[torch.dtype], path: str, pieces: Optional[int],
                        numa_groups: int) -> Tensor:
    """This rank's rows of Σ_ranks a·b (+ bias): see ``commfuse.torch.gemm_reduce_scatter``."""
    return _prepared.gemm_reduce_scatter(
        a, b, bias, group_name, out_dtype, path, pieces, numa_groups,
        lambda: gemm_rs_impl(a, b, bias, group_name, out_dtype, path, pieces, numa_groups))


@gemm_reduce_scatter.register_fake
def _(a, b, bias, group_name, out_dtype, path, pieces, numa_groups):
    g = by_name(group_name)
    return a.new_empty((chunk_rows(a.shape[0], g.world, g.rank), b.shape[1]),
                       dtype=out_dtype or a.dtype)


def _gemm_rs_setup(ctx, inputs, output):
    a, b, bias, group_name, _out_dtype, path, pieces, _numa = inputs
    ctx.save_for_backward(a, b)
    ctx.group_name, ctx.path, ctx.pieces = group_name, path, pieces
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_rs_backward(ctx, dy):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = db = dbias = None
    if need_bias:
        dbias = dy.sum(0).to(ctx.bias_dtype)
    if need_a or need_b:
        dy16 = dy.to(a.dtype).contiguous()
        if need_a:
            # dA = AG(dY)·Bᵀ: an all-gather + GEMM that hands back the gathered dY for dB
            da, gathered = ops.all_gather_gemm(dy16, b.t(), None, ctx.group_name, a.shape[0],
                                               None, 1, "overlapped", need_b)
        else:
            gathered = ops.all_gather(dy16, a.shape[0], ctx.group_name, "auto")
        if need_b:
            db = torch.matmul(a.t(), gathered)
    return da, db, dbias, None, None, None, None, None


gemm_reduce_scatter.register_autograd(_gemm_rs_backward, setup_context=_gemm_rs_setup)


@op(mutates_args=(), native=_native.AG_GEMM)
def all_gather_gemm(a: Tensor, b: Tensor, bias: Optional[Tensor], group_name: str, m: int,
                    out_dtype: Optional[torch.dtype], pieces: Optional[int], path: str,
                    return_a: bool) -> Tuple[Tensor, Tensor]:
    """(AG(a)·b (+ bias), AG(a) or an empty [0, K]): see ``commfuse.torch.all_gather_gemm``."""
    out, gathered = _prepared.all_gather_gemm(
        a, b, bias, group_name, m, out_dtype, pieces, path, return_a,
        lambda: ag_gemm_impl(a, b, bias, group_name, m, out_dtype, pieces, path, return_a))
    if gathered is None:
        gathered = a.new_empty((0, a.shape[1]))
    return out, gathered


@all_gather_gemm.register_fake
def _(a, b, bias, group_name, m, out_dtype, pieces, path, return_a):
    return (a.new_empty((m, b.shape[1]), dtype=out_dtype or a.dtype),
            a.new_empty((m if return_a else 0, a.shape[1])))


def _ag_gemm_setup(ctx, inputs, output):
    a, b, bias, group_name, m, _out_dtype, _pieces, _path, return_a = inputs
    # dB needs the gathered A: the forward's when it returned it, else A to gather again
    ctx.save_for_backward(b, output[1] if return_a else a)
    ctx.group_name, ctx.m, ctx.return_a = group_name, m, return_a
    ctx.bias_dtype = None if bias is None else bias.dtype


def _ag_gemm_backward(ctx, dz, dgathered):
    b, x = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = db = dbias = None
    if need_bias:
        dbias = dz.sum(0).to(ctx.bias_dtype)
    dz16 = dz.to(b.dtype).contiguous()
    if need_a:
        # dA = RS(dZ·Bᵀ): a GEMM + reduce-scatter
        da = ops.gemm_reduce_scatter(dz16, b.t(), None, ctx.group_name, None, "auto", None, 1)
        if ctx.return_a and dgathered is not None and dgathered.numel():
            da = da + ops.reduce_scatter(dgathered.contiguous(), "sum", ctx.group_name, "auto")
    if need_b:
        gathered = x if ctx.return_a else ops.all_gather(x.contiguous(), ctx.m, ctx.group_name,
                                                          "auto")
        db = torch.matmul(gathered.t(), dz16)
    return da, db, dbias, None, None, None, None, None, None


all_gather_gemm.register_autograd(_ag_gemm_backward, setup_context=_ag_gemm_setup)


# ---------------------------------------------------------------------------------------------
# collectives that return a new tensor (differentiable), rows of dim 0 split over the group


def _shape(x) -> tuple:
    """``x``'s shape, or () for what is not a tensor (its general path says what is wrong)."""
    return tuple(x.shape) if isinstance(x, Tensor) else ()


def _flat_rows_agree(rows: int, inner: int, world: int) -> bool:
    """Whether splitting ``rows`` × ``inner`` elements as a flat vector gives every rank whole
    rows (what the flat collectives can then do for a split along dim 0)."""
    return inner == 1 or rows % world == 0


@op(mutates_args=(), native=_native.COLLECTIVE)
def all_reduce(x: Tensor, op: str, group_name: str, path: str) -> Tensor:
    """The element-wise ``op`` of every rank's ``x``, as a new tensor."""
    def general():
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        collective_impl("all-reduce", out, x, op, group_name, path)
        return out

    return _prepared.collective("all_reduce", "all-reduce", x, op, group_name, path,
                                _shape(x), (), general)


@all_reduce.register_fake
def _(x, op, group_name, path):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx, inputs, output):
    ctx.op, ctx.group_name, ctx.path = inputs[1], inputs[2], inputs[3]


def _all_reduce_backward(ctx, dy):
    if ctx.op != "sum":
        raise RuntimeError(f"commfuse.torch: the gradient of an all-reduce by {ctx.op} is not"
                           " defined here (only sum's is)")
    return ops.all_reduce(dy.contiguous(), "sum", ctx.group_name, ctx.path), None, None, None


all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


@op(mutates_args=(), native=_native.COLLECTIVE)
def reduce_scatter(x: Tensor, op: str, group_name: str, path: str) -> Tensor:
    """This rank's rows (dim 0 split as ``torch.tensor_split`` splits it) of the element-wise
    ``op`` of every rank's ``x``."""
    g = by_name(group_name)
    rows, inner = x.shape[0], math.prod(x.shape[1:])
    mine = chunk_rows(rows, g.world, g.rank)
    if not _flat_rows_agree(rows, inner, g.world):
        total = all_reduce(x, op, group_name, path)
        start = chunk_start(rows, g.world, g.rank)
        return total[start:start + mine].clone()
    shape = (mine,) + tuple(x.shape[1:])

    def general():
        out = x.new_empty(shape)
        collective_impl("reduce-scatter", out, x, op, group_name, path)
        return out

    return _prepared.collective("reduce_scatter", "reduce-scatter", x, op, group_name, path,
                                shape, (), general)


@reduce_scatter.register_fake
def _(x, op, group_name, path):
    g = by_name(group_name)
    return x.new_empty((chunk_rows(x.shape[0], g.world, g.rank),) + tuple(x.shape[1:]))


def _reduce_scatter_setup(ctx, inputs, output):
    ctx.op, ctx.group_name, ctx.path = inputs[1], inputs[2], inputs[3]
    ctx.rows = inputs[0].shape[0]


def _reduce_scatter_backward(ctx, dy):
    if ctx.op != "sum":
        raise RuntimeError(f"commfuse.torch: the gradient of a reduce-scatter by {ctx.op} is not"
                           " defined here (only sum's is)")
    return ops.all_gather(dy.contiguous(), ctx.rows, ctx.group_name, ctx.path), None, None, None


reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)


@op(mutates_args=(), native=_native.COLLECTIVE)
def all_gather(x: Tensor, rows: int, group_name: str, path: str) -> Tensor:
    """Every rank's ``x`` concatenated along dim 0 into ``rows`` rows (rank r holds its chunk
    of them, as ``torch.tensor_split`` splits them)."""
    g = by_name(group_name)
    inner = math.prod(x.shape[1:])
    if chunk_rows(rows, g.world, g.rank) != x.shape[0]:
        raise ValueError(f"all_gather: this rank holds {x.shape[0]} rows, its chunk of {rows}"
                         f" has {chunk_rows(rows, g.world, g.rank)}")
    shape = (rows,) + tuple(x.shape[1:])
    if _flat_rows_agree(rows, inner, g.world):
        def general():
            out = x.new_empty(shape)
            collective_impl("all-gather", out, x, "sum", group_name, path)
            return out

        return _prepared.collective("all_gather", "all-gather", x, "sum", group_name, path,
                                    shape, (rows,), general)
    # whole rows of unequal chunks: this rank's rows in place, zeros elsewhere, summed
    out = x.new_zeros(shape)
    start = chunk_start(rows, g.world, g.rank)
    out[start:start + x.shape[0]] = x
    return all_reduce(out, "sum", group_name, path)


@all_gather.register_fake
def _(x, rows, group_name, path):
    return x.new_empty((rows,) + tuple(x.shape[1:]))


def _all_gather_setup(ctx, inputs, output):
    ctx.group_name, ctx.path = inputs[2], inputs[3]


def _all_gather_backward(ctx, dy):
    return ops.reduce_scatter(dy.contiguous(), "sum", ctx.group_name, ctx.path), None, None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


@op(mutates_args=(), native=_native.COLLECTIVE)
def all_to_all(x: Tensor, group_name: str, path: str) -> Tensor:
    """Chunk j of this rank's flattened ``x`` to rank j; the result (shaped as ``x``) holds
    chunk r of every rank's, rank by rank. ``x`` splits into equal chunks."""
    world = by_name(group_name).world
    if x.numel() % world:
        raise ValueError(f"all_to_all_single: {x.numel()} elements do not split into"
                         f" {world} equal chunks (commfuse.torch.all_to_all takes unequal ones)")

    def general():
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        collective_impl("all-to-all", out, x, "sum", group_name, path)
        return out

    return _prepared.collective("all_to_all", "all-to-all", x, "sum", group_name, path,
                                _shape(x), (), general)


@all_to_all.register_fake
def _(x, group_name, path):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_to_all_setup(ctx, inputs, output):
    ctx.group_name, ctx.path = inputs[1], inputs[2]


def _all_to_all_backward(ctx, dy):
    return ops.all_to_all(dy.contiguous(), ctx.group_name, ctx.path), None, None


all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)


# ---------------------------------------------------------------------------------------------
# collectives in place or into a given output (torch.distributed's forms), mutation declared


@op(mutates_args=("tensor",), native=_native.ALL_REDUCE_INPLACE)
def all_reduce_(tensor: Tensor, op: str, group_name: str, path: str) -> None:
    """``dist.all_reduce``: ``tensor`` becomes the element-wise ``op`` of every rank's."""
    if tensor.is_contiguous():
        _prepared.all_reduce(
            tensor, op, group_name, path,
            lambda: collective_impl("all-reduce", tensor, tensor, op, group_name, path))
        return
    t = tensor.contiguous()
    collective_impl("all-reduce", t, t, op, group_name, path)
    tensor.copy_(t)


@all_reduce_.register_fake
def _(tensor, op, group_name, path):
    return None


@op(mutates_args=("output",), native=_native.COLLECTIVE_INTO)
def reduce_scatter_into(output: Tensor, input: Tensor, op: str, group_name: str,
                        path: str) -> None:
    """``dist.reduce_scatter_tensor`` with flat chunks: see ``commfuse.torch.reduce_scatter``."""
    _prepared.collective_into(
        "reduce_scatter_into", "reduce-scatter", output, input, op, group_name, path,
        lambda: collective_impl("reduce-scatter", output, input, op, group_name, path))


@reduce_scatter_into.register_fake
def _(output, input, op, group_name, path):
    return None


@op(mutates_args=("output",), native=_native.COLLECTIVE_INTO)
def all_gather_into(output: Tensor, input: Tensor, group_name: str, path: str) -> None:
    """``dist.all_gather_into_tensor`` with flat chunks: see ``commfuse.torch.all_gather``."""
    _prepared.collective_into(
        "all_gather_into", "all-gather", output, input, "sum", group_name, path,
        lambda: collective_impl("all-gather", output, input, "sum", group_name, path))


@all_gather_into.register_fake
def _(output, input, group_name, path):
    return None


@op(mutates_args=("output",), native=_native.COLLECTIVE_INTO)
def all_to_all_into(output: Tensor, input: Tensor, group_name: str, path: str) -> None:
    """``dist.all_to_all_single`` with equal splits: see ``commfuse.torch.all_to_all``."""
    _prepared.collective_into(
        "all_to_all_into", "all-to-all", output, input, "sum", group_name, path,
        lambda: collective_impl("all-to-all", output, input, "sum", group_name, path))


@all_to_all_into.register_fake
def _(output, input, group_name, path):
    return None
