"""commfuse.torch on CPU tensors: the multi-process simulator (``commfuse.sim.Group``), one rank
per process of a ``torch.distributed`` group (gloo), running the same schedules and protocols
the GPU kernels run. The group's shared memory is named by rank 0 and the name broadcast over
the group when a group's first CPU call comes, so that first call is collective."""

from __future__ import annotations

import os
import secrets
import uuid
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .._commfuse import SimGroup
from ._common import GemmOperands, dtype_name

# the group's name -> its SimGroup
_GROUPS: dict = {}


def _arena_mb() -> int:
    text = os.environ.get("COMMFUSE_SIM_ARENA_MB", "256")
    try:
        mb = int(text)
    except ValueError:
        mb = 0
    if mb <= 0:
        raise ValueError(f"COMMFUSE_SIM_ARENA_MB must be a positive number of MiB, got {text!r}")
    return mb


def _timeout_ms() -> int:
    text = os.environ.get("COMMFUSE_TIMEOUT_MS", "60000")
    if not text.isdigit() or int(text) == 0:
        raise ValueError(f"COMMFUSE_TIMEOUT_MS must be a positive number of ms, got {text!r}")
    return int(text)


def group_of(process_group, name: str, rank: int, world: int) -> SimGroup:
    """The simulator group behind ``process_group`` (built collectively at its first use)."""
    sim = _GROUPS.get(name)
    if sim is None:
        # the segment's name and a nonce, both random, from rank 0 through the group itself
        shared = [(f"torch-{uuid.uuid4().hex}", secrets.randbits(63)) if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(shared, src=dist.get_global_rank(process_group, 0),
                                       group=process_group)
        segment, nonce = shared[0]
        sim = _GROUPS[name] = SimGroup(segment, rank, world, arena_mb=_arena_mb(),
                                       timeout_ms=_timeout_ms(), nonce=nonce)
    return sim


def _array(x: torch.Tensor) -> np.ndarray:
    """``x`` as the simulator takes it: float32 (bf16 and f16 widen exactly)."""
    return x.detach().to(torch.float32).contiguous().numpy()


def _tensor(x: np.ndarray, dtype: torch.dtype, shape=None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)).to(dtype)
    return t if shape is None else t.reshape(shape)


def gemm_reduce_scatter(sim: SimGroup, g: GemmOperands, path: str,
                        pieces: Optional[int]) -> torch.Tensor:
    b = g.b  # [N, K] ("nk") or [K, N] ("kn"), as the simulator takes it
    out = sim.gemm_reduce_scatter(
        _array(g.a), _array(b), None if g.bias is None else _array(g.bias),
        b_layout=g.layout, dtype=g.dtype, out_dtype=g.out_name, path=path, pieces=pieces,
    )
    return _tensor(out, g.out_dtype)


def all_gather_gemm(sim: SimGroup, g: GemmOperands, m: int, pieces: Optional[int], path: str,
                    return_a: bool):
    out, gathered = sim.all_gather_gemm(
        _array(g.a), _array(g.b), None if g.bias is None else _array(g.bias), m=m,
        b_layout=g.layout, dtype=g.dtype, out_dtype=g.out_name, pieces=pieces, path=path,
        return_a=return_a,
    )
    return _tensor(out, g.out_dtype), None if gathered is None else _tensor(gathered, g.a.dtype)


def collective_into(sim: SimGroup, kind: str, output: torch.Tensor, input: torch.Tensor,
                    reduce: str) -> None:
    """Collective ``kind`` from ``input`` into ``output`` (flat, chunks split as
    ``torch.tensor_split`` splits the vector) on the simulator; f32, bf16 and f16 in their own
    type, as the GPU kernels compute them."""
    count = output.numel() if kind == "all-gather" else input.numel()
    out, _ = sim.collective(kind, _array(input).reshape(-1), count=count, reduce=reduce,
                            dtype=dtype_name(input.dtype, "the tensor"))
    if out.size != output.numel():
        raise ValueError(
            f"{kind.replace('-', '_')}: this rank's output must hold {out.size} elements,"
            f" got {output.numel()}"
        )
    output.copy_(_tensor(out, output.dtype, output.shape))


def barrier(sim: SimGroup) -> None:
    sim.barrier()


def clear_cache() -> None:
    _GROUPS.clear()
