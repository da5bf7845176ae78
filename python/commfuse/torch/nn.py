"""Tensor-parallel linear layers on commfuse's fused operators, as Megatron-LM's and
TransformerEngine's users know them: a layer owns its shard of an ``nn.Linear``'s weight and
bias, knows its group, and says in its repr how it is split.

* :class:`ColumnParallelLinear` splits the output features: rank r holds rows
  ``tensor_split(out_features, P)[r]`` of the weight. With ``sequence_parallel=True`` its input
  is this rank's rows of the sequence and the layer is an all-gather + GEMM (the gathered input
  kept for the weight's gradient); with ``False`` the input is replicated on every rank, and
  the backward all-reduces the input's gradient.
* :class:`RowParallelLinear` splits the input features (its input is a column-parallel layer's
  output). With ``sequence_parallel=True`` it is a GEMM + reduce-scatter giving this rank's
  rows of the sequence; with ``False`` a GEMM then an all-reduce, the output replicated.

Inputs are [rows, features] or, for sequence parallelism, sequence-first [s, b, features]
(Megatron's layout: dim 0 is what the ranks split). The GEMMs take bfloat16 or float16; a
layer with float32 parameters (or input) computes in ``compute_dtype`` (bfloat16 unless given)
and returns the input's type, as autocast would. Replicated parameters (a row-parallel bias
under sequence parallelism) get the gradient of every rank's rows, summed over the group, so
that every rank's copy stays the same.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import all_gather_gemm, gemm_reduce_scatter
from ._common import chunk_rows, chunk_start
from ._groups import by_name, name_of

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (an input or parameter
    replicated on every rank, each rank using it for its part)."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.ops.commfuse.all_reduce(dy.contiguous(), "sum", ctx.group_name, "auto"), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward; identity backward (the output is replicated, and so is its
    gradient)."""

    @staticmethod
    def forward(ctx, x, group_name):
        return torch.ops.commfuse.all_reduce(x.contiguous(), "sum", group_name, "auto")

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def _compute_dtype(given: Optional[torch.dtype], weight: torch.Tensor) -> torch.dtype:
    if given is not None:
        if given not in (torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be bfloat16 or float16, got {given}")
        return given
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


class _ParallelLinear(nn.Module):
    """What both layers share: the group, the split, parameters and their initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group,
                 sequence_parallel: bool, compute_dtype, shape, bias_len: int, device, dtype):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"in_features and out_features must be positive, got"
                             f" {in_features} and {out_features}")
        self.group_name = name_of(group)
        g = by_name(self.group_name)
        self.rank, self.world = g.rank, g.world
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(bias_len, device=device, dtype=dtype)) \
            if bias else None
        self.compute_dtype = _compute_dtype(compute_dtype, self.weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, with the whole layer's fan-in."""
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            nn.init.uniform_(self.weight, -bound, bound)
            if self.bias is not None:
                nn.init.uniform_(self.bias, -bound, bound)

    def _operands(self, x: torch.Tensor, features: int):
        if x.shape[-1] != features:
            raise ValueError(f"{type(self).__name__} takes [..., {features}] inputs on this rank,"
                             f" got {tuple(x.shape)}")
        cd = self.compute_dtype
        out_dtype = x.dtype if x.dtype != cd else None
        return x.reshape(-1, features).to(cd), self.weight.to(cd), out_dtype

    def _split(self) -> str:
        return f"rank {self.rank} of {self.world}"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features},"
                f" bias={self.bias is not None}, {self._shard()} ({self._split()}),"
                f" sequence_parallel={self.sequence_parallel}, compute_dtype={self.compute_dtype}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with the output features split over the group: this rank
    computes its ``out_per_rank`` of them. See the module's text for the two modes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, compute_dtype: Optional[torch.dtype] = None,
                 path: str = "auto", pieces: Optional[int] = None, save_gathered: bool = True,
                 device=None, dtype=None):
        name = name_of(group)
        g = by_name(name)
        self.out_per_rank = chunk_rows(out_features, g.world, g.rank)
        super().__init__(in_features, out_features, bias, name, sequence_parallel, compute_dtype,
                         (self.out_per_rank, in_features), self.out_per_rank, device, dtype)
        self.path, self.pieces, self.save_gathered = path, pieces, save_gathered

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **options) -> "ColumnParallelLinear":
        """This rank's shard of ``linear`` (its rows of the weight and its part of the bias,
        copied), on ``linear``'s device and dtype."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, device=linear.weight.device, dtype=linear.weight.dtype,
                    **options)
        start = chunk_start(linear.out_features, layer.world, layer.rank)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[start:start + layer.out_per_rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[start:start + layer.out_per_rank])
        return layer

    def _shard(self) -> str:
        return f"out_per_rank={self.out_per_rank}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, w, out_dtype = self._operands(x, self.in_features)
        if self.sequence_parallel:
            y = all_gather_gemm(a, w.t(), self.group_name, self.bias, m=a.shape[0] * self.world,
                                out_dtype=out_dtype, pieces=self.pieces, path=self.path,
                                save_gathered=self.save_gathered)
            return y.reshape((x.shape[0] * self.world,) + tuple(x.shape[1:-1]) +
                             (self.out_per_rank,))
        a = _CopyToGroup.apply(a, self.group_name)
        y = torch.matmul(a, w.t())
        if out_dtype is not None:
            y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(tuple(x.shape[:-1]) + (self.out_per_rank,))


class RowParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with the input features split over the group: this rank
    holds ``in_per_rank`` of them (its input is a column-parallel layer's output), and the
    ranks' partial products are summed. See the module's text for the two modes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, compute_dtype: Optional[torch.dtype] = None,
                 path: str = "auto", pieces: Optional[int] = None, device=None, dtype=None):
        name = name_of(group)
        g = by_name(name)
        self.in_per_rank = chunk_rows(in_features, g.world, g.rank)
        super().__init__(in_features, out_features, bias, name, sequence_parallel, compute_dtype,
                         (out_features, self.in_per_rank), out_features, device, dtype)
        self.path, self.pieces = path, pieces

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **options) -> "RowParallelLinear":
        """This rank's shard of ``linear`` (its columns of the weight, copied; the bias whole),
        on ``linear``'s device and dtype."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, device=linear.weight.device, dtype=linear.weight.dtype,
                    **options)
        start = chunk_start(linear.in_features, layer.world, layer.rank)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, start:start + layer.in_per_rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def _shard(self) -> str:
        return f"in_per_rank={self.in_per_rank}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, w, out_dtype = self._operands(x, self.in_per_rank)
        if self.sequence_parallel:
            if x.dim() > 2 and x.shape[0] % self.world:
                raise ValueError(f"RowParallelLinear(sequence_parallel=True): dim 0 of the input"
                                 f" ({x.shape[0]}) must divide by the group's size"
                                 f" ({self.world}) for [s, b, h] inputs; pass [rows, h] instead")
            bias = None if self.bias is None else _CopyToGroup.apply(self.bias, self.group_name)
            y = gemm_reduce_scatter(a, w.t(), self.group_name, bias, out_dtype=out_dtype,
                                    path=self.path, pieces=self.pieces)
            if x.dim() > 2:
                return y.reshape((x.shape[0] // self.world,) + tuple(x.shape[1:-1]) +
                                 (self.out_features,))
            return y
        y = _ReduceFromGroup.apply(torch.matmul(a, w.t()), self.group_name)
        if out_dtype is not None:
            y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(tuple(x.shape[:-1]) + (self.out_features,))
