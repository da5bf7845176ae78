"""commfuse.torch's operators by ``torch.distributed`` and ``torch.matmul``, for groups whose
ranks cannot open each other's memory (ranks on several hosts, GPUs without peer access, ranks
sharing a GPU): the same semantics as commfuse's kernels, split rows and ragged sizes included.
NCCL (or gloo on CPU tensors) carries the traffic."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ._common import DIST_OPS, GemmOperands, chunk_rows, chunk_start


def _nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _matmul(a: torch.Tensor, g: GemmOperands) -> torch.Tensor:
    """a·B in the output type (float32 products for a float32 output)."""
    b = g.b.t() if g.layout == "nk" else g.b
    if g.out_dtype != a.dtype:
        a, b = a.to(g.out_dtype), b.to(g.out_dtype)
    return torch.matmul(a, b)


def _sizes(total: int, world: int) -> List[int]:
    return [chunk_rows(total, world, r) for r in range(world)]


def _reduce_rows(y: torch.Tensor, group, rank: int, world: int, reduce: str = "sum"):
    """This rank's rows of the element-wise ``reduce`` of every rank's ``y``."""
    m = y.shape[0]
    if _nccl(group) and m % world == 0:
        out = y.new_empty((m // world,) + tuple(y.shape[1:]))
        dist.reduce_scatter_tensor(out, y.contiguous(), op=DIST_OPS[reduce], group=group)
        return out
    y = y.contiguous().clone()
    dist.all_reduce(y, op=DIST_OPS[reduce], group=group)
    start = chunk_start(m, world, rank)
    return y[start:start + chunk_rows(m, world, rank)].contiguous()


def _gather_rows(x: torch.Tensor, total: int, group, world: int) -> torch.Tensor:
    """Every rank's rows of ``x`` (``total`` rows in all, split as tensor_split splits them),
    concatenated in rank order."""
    sizes = _sizes(total, world)
    x = x.contiguous()
    if _nccl(group) and len(set(sizes)) == 1:
        out = x.new_empty((total,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    # pad every chunk to the longest: all_gather takes equal tensors on every backend
    longest = max(sizes)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def gemm_reduce_scatter(g: GemmOperands, group, rank: int, world: int) -> torch.Tensor:
    out = _reduce_rows(_matmul(g.a, g), group, rank, world)
    if g.bias is not None:
        out = out + g.bias
    return out


def all_gather_gemm(g: GemmOperands, group, world: int, m: int, return_a: bool):
    gathered = _gather_rows(g.a, m, group, world)
    out = _matmul(gathered, g)
    if g.bias is not None:
        out = out + g.bias
    return out, gathered if return_a else None


def collective_into(kind: str, output: torch.Tensor, input: torch.Tensor, group, rank: int,
                    world: int, reduce: str) -> None:
    """Collective ``kind`` from ``input`` into ``output`` with commfuse's flat semantics (chunks
    split as ``torch.tensor_split`` splits the vector), by torch.distributed: straight into
    ``output`` where torch.distributed's own call has these semantics (an even split on NCCL),
    through a temporary otherwise."""
    flat, into = input.reshape(-1), output.view(-1)
    n = flat.numel()
    even = n % world == 0 if kind != "all-gather" else into.numel() % world == 0
    if kind == "all-reduce":
        if into.data_ptr() != flat.data_ptr():
            into.copy_(flat)
        dist.all_reduce(into, op=DIST_OPS[reduce], group=group)
        return
    if even and _nccl(group) and kind == "reduce-scatter" and into.numel() * world == n:
        dist.reduce_scatter_tensor(into, flat, op=DIST_OPS[reduce], group=group)
        return
    if even and _nccl(group) and kind == "all-gather" and n * world == into.numel():
        dist.all_gather_into_tensor(into, flat, group=group)
        return
    if kind == "reduce-scatter":
        y = _reduce_rows(flat, group, rank, world, reduce)
    elif kind == "all-gather":
        y = _gather_rows(flat, into.numel(), group, world)
    elif kind == "all-to-all":
        if even and into.numel() == n:
            dist.all_to_all_single(into, flat.contiguous(), group=group)
            return
        # chunks of unequal length: every rank's whole input, each taking its chunks
        every = _gather_rows(flat, n * world, group, world).reshape(world, n)
        start, rows = chunk_start(n, world, rank), chunk_rows(n, world, rank)
        y = every[:, start:start + rows].reshape(-1)
    else:
        raise ValueError(f"unknown collective {kind!r}")
    if y.numel() != into.numel():
        raise ValueError(
            f"{kind.replace('-', '_')}: this rank's output must hold {y.numel()} elements,"
            f" got {into.numel()}"
        )
    into.copy_(y)
