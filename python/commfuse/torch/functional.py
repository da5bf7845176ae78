"""Collectives that return a new tensor and are differentiable, as
``torch.distributed.nn.functional`` and PyTorch's functional collectives are: each one's
backward is its adjoint (all-gather ↔ reduce-scatter, all-reduce and all-to-all their own), by
commfuse's operators. Tensors split along dim 0 as ``torch.tensor_split`` splits them, so row
counts need not divide by the group's size."""

from __future__ import annotations

from typing import Optional

import torch

from ._common import dtype_name, reduce_name, tensor
from ._groups import by_name, name_of

__all__ = ["all_reduce", "reduce_scatter_tensor", "all_gather_tensor", "all_to_all_single"]

# the ops' overloads, bound once: calling through ``torch.ops.commfuse.<op>`` resolves the
# overload on every call
_all_reduce = torch.ops.commfuse.all_reduce.default
_reduce_scatter = torch.ops.commfuse.reduce_scatter.default
_all_gather = torch.ops.commfuse.all_gather.default
_all_to_all = torch.ops.commfuse.all_to_all.default


def _checked(x, what: str = "x") -> torch.Tensor:
    tensor(x, what)
    dtype_name(x.dtype, what)
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension")
    return x


def all_reduce(x: torch.Tensor, op="sum", group=None, path: str = "auto") -> torch.Tensor:
    """The element-wise ``op`` of every rank's ``x`` (a new tensor); its gradient (of a sum)
    is the all-reduce of the output's."""
    return _all_reduce(_checked(x), reduce_name(op), name_of(group), path)


def reduce_scatter_tensor(x: torch.Tensor, op="sum", group=None,
                          path: str = "auto") -> torch.Tensor:
    """This rank's rows of the element-wise ``op`` of every rank's ``x``; its gradient is the
    all-gather of the output's."""
    return _reduce_scatter(_checked(x), reduce_name(op), name_of(group), path)


def all_gather_tensor(x: torch.Tensor, group=None, rows: Optional[int] = None,
                      path: str = "auto") -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0: ``rows`` rows in all (the group's size
    times this rank's by default); its gradient is the reduce-scatter of the output's."""
    name = name_of(group)
    if rows is None:
        rows = _checked(x).shape[0] * by_name(name).world
    return _all_gather(_checked(x), rows, name, path)


def all_to_all_single(x: torch.Tensor, group=None, path: str = "auto") -> torch.Tensor:
    """Chunk j of this rank's flattened ``x`` goes to rank j; the result, shaped as ``x``,
    holds chunk r of every rank's, rank by rank. Its own adjoint."""
    return _all_to_all(_checked(x), name_of(group), path)
