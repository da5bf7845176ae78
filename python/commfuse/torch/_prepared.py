"""Prepared calls: the eager calls of commfuse's kernels whose every check was made before.

A call outside compilation and autograd whose group, shapes, strides, dtypes, devices and
options were all seen before needs none of the general path's checks and lookups: the first
such call runs the general path and, where it went to commfuse's kernels straight from the
caller's tensors, keeps a closure that allocates the output and queues the kernel; later calls
with the same signature run the closure. What the closure captured (the operator, the output's
shape) is valid while the operator cache stands still: it is dropped whenever the cache builds
an operator or is cleared (``commfuse._operators.generation``) and whenever what serves a group
changes (``clear``).

The same preparation serves the C++ dispatcher kernels (``_native``): an entry also says which
operator and outputs a call of its signature takes there, and every call leaves its entry in
``_native.last`` for the kernel whose miss it serves to bind.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import _operators
from . import _gpu, _native
from ._common import DIST_OPS, GemmOperands
from ._groups import KERNELS, by_name

_PREPARED: dict = {}
_generation = -1


class Prepared:
    """What the calls of one signature take: ``call(*args)`` (None: the general path) and, for
    the C++ kernels, ``native`` = (operator, output shape, gathered shape or None, whether the
    gathered A is written, rows M), or None where they take Python's path; ``op``: the op
    (``commfuse::<op>``) whose calls it serves, which alone may bind it in the C++ table (an
    op's implementation may run another's on its way)."""

    __slots__ = ("call", "native", "op")

    def __init__(self, call: Optional[Callable], native: Optional[tuple] = None,
                 op: Optional[str] = None):
        self.call, self.native, self.op = call, native, op


# what a signature maps to when its calls cannot skip the general path
_GENERAL = Prepared(None)


def _run(key, args: tuple, general: Callable, prepare: Callable[[], Optional[Prepared]]):
    """The prepared call of `key` on `args` if there is one; else the general path, after which
    ``prepare()`` gives what later calls of `key` take (None: the general path too). The
    general path runs first, so whatever it builds exists when ``prepare`` looks."""
    global _generation
    if _operators.generation != _generation:
        _PREPARED.clear()
        _generation = _operators.generation
    entry = _PREPARED.get(key)
    if entry is None:
        result = general()
        entry = _PREPARED[key] = prepare() or _GENERAL
        _native.last = entry
        return result
    _native.last = entry
    if entry.call is None:
        return general()
    return entry.call(*args)


# A signature holds a's shape and whether it is contiguous rather than its strides (cheaper to
# ask): only a contiguous A is read where it lies (`_direct`), and every other layout of one
# shape takes the general path alike. B's strides tell its layout, so they are kept.


def _bias_signature(bias):
    return None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device)


def _direct(g: GemmOperands, a, b, bias) -> bool:
    """Whether the kernels read the caller's own tensors (no copy or conversion was made)."""
    return g.a is a and g.b.data_ptr() == b.data_ptr() and (bias is None or g.bias is bias)


def _on_kernels(a, b, bias, name, out_dtype):
    """The checked operands and the group where commfuse's kernels read the caller's own
    tensors, else None."""
    group = by_name(name)
    g = GemmOperands(a, b, bias, out_dtype)
    if group.served_by_gemm(a.device, g.k) == KERNELS and _direct(g, a, b, bias):
        return g, group
    return None


def gemm_reduce_scatter(a, b, bias, name, out_dtype, path, pieces, numa_groups, general):
    try:
        key = ("gemm-rs", name, a.shape, a.is_contiguous(), a.dtype, a.device, b.shape, b.stride(),
               b.dtype, _bias_signature(bias), out_dtype, path, pieces, numa_groups)
    except (AttributeError, TypeError):
        return general()  # not tensors: the general path says what is wrong

    def prepare():
        found = _on_kernels(a, b, bias, name, out_dtype)
        if found is None:
            return None
        g, group = found
        op, rows = _gpu.gemm_rs_operator(g, group.process_group, path, pieces, numa_groups)
        forward, m, shape, dtype, device = op.forward, a.shape[0], (rows, g.n), g.out_dtype, \
            a.device
        index, stream_of = device.index, _gpu.stream_of

        def call(a, b, bias):
            out = torch.empty(shape, dtype=dtype, device=device)
            forward(m, a.data_ptr(), b.data_ptr(), out.data_ptr(), stream_of(index),
                    None if bias is None else bias.data_ptr())
            return out

        return Prepared(call, (op, shape, None, False, m), "gemm_reduce_scatter")

    return _run(key, (a, b, bias), general, prepare)


def all_gather_gemm(a, b, bias, name, m, out_dtype, pieces, path, return_a, general):
    """``m``: the rows in all as the caller gave them (None: the group's size times a's)."""
    try:
        key = ("ag-gemm", name, a.shape, a.is_contiguous(), a.dtype, a.device, b.shape, b.stride(),
               b.dtype, _bias_signature(bias), m, out_dtype, pieces, path, return_a)
    except (AttributeError, TypeError):
        return general()  # not tensors: the general path says what is wrong

    def prepare():
        found = _on_kernels(a, b, bias, name, out_dtype)
        if found is None:
            return None
        g, group = found
        rows = a.shape[0] * group.world if m is None else m
        op = _gpu.ag_gemm_operator(g, group.process_group, rows, pieces, path)
        forward, shape, dtype, device = op.forward, (rows, g.n), g.out_dtype, a.device
        gathered_shape = (rows, g.k) if return_a else None
        index, stream_of = device.index, _gpu.stream_of

        def call(a, b, bias):
            out = torch.empty(shape, dtype=dtype, device=device)
            gathered = None if gathered_shape is None else \
                torch.empty(gathered_shape, dtype=a.dtype, device=device)
            forward(rows, a.data_ptr(), b.data_ptr(), out.data_ptr(), stream_of(index),
                    None if bias is None else bias.data_ptr(),
                    None if gathered is None else gathered.data_ptr())
            return out, gathered

        # the op's second output is the gathered A, or [0, K] when not asked for
        return Prepared(call, (op, shape, gathered_shape or (0, g.k), return_a, rows),
                        "all_gather_gemm")

    return _run(key, (a, b, bias), general, prepare)


def all_reduce(tensor, op, name, path, general):
    key = ("all-reduce", name, tensor.numel(), tensor.dtype, tensor.device,
           tensor.is_contiguous(), op, path)

    def prepare():
        group = by_name(name)
        if not (tensor.is_cuda and tensor.is_contiguous()
                and group.served_by(tensor.device) == KERNELS):
            return None
        pg = group.process_group
        goes = _gpu.route("all-reduce", tensor.numel(), tensor.dtype, pg, True, path)
        if goes == "commfuse":
            operator = _gpu._collective("all-reduce", tensor.numel(), tensor, pg, op)
            forward, index, stream_of = operator.forward, tensor.device.index, _gpu.stream_of

            def call(t):
                forward(t.data_ptr(), t.data_ptr(), stream_of(index))

            return Prepared(call, (operator, (), None, False, 0), "all_reduce_")
        reduce = DIST_OPS[op]

        def call(t):
            dist.all_reduce(t, op=reduce, group=pg)

        return Prepared(call)

    _run(key, (tensor,), general, prepare)


def _collective_operator(kind: str, input, out_shape, reduce: str, name: str, path: str):
    """The operator that ``_gpu.collective_into`` runs for ``input`` into a contiguous output
    of ``out_shape`` (input's dtype and device), where commfuse's kernels take it straight from
    the caller's tensors; else None."""
    group = by_name(name)
    if not (input.is_cuda and input.is_contiguous() and group.served_by(input.device) == KERNELS):
        return None
    out_count = 1
    for d in out_shape:
        out_count *= d
    count = out_count if kind == "all-gather" else input.numel()
    pg = group.process_group
    even = _gpu.splits_evenly(kind, input.numel(), out_count, group.world)
    if _gpu.route(kind, count, input.dtype, pg, even, path) != "commfuse":
        return None
    operator = _gpu._collective(kind, count, input, pg, reduce)
    if operator.lengths() != (input.numel(), out_count):
        return None
    return operator


def collective(op: str, kind: str, x, reduce: str, name: str, path: str, out_shape, extra,
               general):
    """``commfuse::<op>``: collective ``kind`` of ``x`` into a new tensor of ``out_shape``
    (computed by the caller from the call's arguments, ``extra`` those of them beyond ``x``,
    the reduction, the group and the path); ``general()`` is the op's whole implementation."""
    try:
        key = (op, name, x.shape, x.dtype, x.device, x.is_contiguous(), reduce, path, extra)
    except AttributeError:
        return general()  # not a tensor: the general path says what is wrong

    def prepare():
        operator = _collective_operator(kind, x, out_shape, reduce, name, path)
        if operator is None:
            return None
        forward, shape, dtype, device = operator.forward, tuple(out_shape), x.dtype, x.device
        index, stream_of = device.index, _gpu.stream_of

        def call(x):
            out = torch.empty(shape, dtype=dtype, device=device)
            forward(x.data_ptr(), out.data_ptr(), stream_of(index))
            return out

        return Prepared(call, (operator, shape, None, False, 0), op)

    return _run(key, (x,), general, prepare)


def collective_into(op: str, kind: str, output, input, reduce: str, name: str, path: str,
                    general):
    """``commfuse::<op>``: collective ``kind`` of ``input`` into ``output``, as
    :func:`collective`."""
    try:
        key = (op, name, output.shape, output.dtype, output.device, output.is_contiguous(),
               input.shape, input.dtype, input.device, input.is_contiguous(), reduce, path)
    except AttributeError:
        return general()

    def prepare():
        if not (output.is_contiguous() and output.dtype == input.dtype
                and output.device == input.device):
            return None
        operator = _collective_operator(kind, input, output.shape, reduce, name, path)
        if operator is None:
            return None
        forward, index, stream_of = operator.forward, input.device.index, _gpu.stream_of

        def call(output, input):
            forward(input.data_ptr(), output.data_ptr(), stream_of(index))

        return Prepared(call, (operator, (), None, False, 0), op)

    return _run(key, (output, input), general, prepare)


def clear() -> None:
    _PREPARED.clear()
    _native.clear()
