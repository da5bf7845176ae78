"""What every backend of commfuse.torch shares: the checks of a call's arguments, the layout of
a GEMM's operands, how rows split over a group, and the reduce ops by name."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

# commfuse's reduce ops by name, and torch.distributed's
DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "prod": dist.ReduceOp.PRODUCT}


def dtype_name(dtype: torch.dtype, what: str) -> str:
    """commfuse's name of ``dtype`` ("bf16", "f16", "f32"), or a ValueError naming ``what``."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise ValueError(f"{what} must be bfloat16, float16 or float32, got {dtype}") from None


def input_name(dtype: torch.dtype) -> str:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"a and b must be bfloat16 or float16, got {dtype}")
    return NAMES[dtype]


def tensor(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    return x


def matrix(x, what: str) -> torch.Tensor:
    tensor(x, what)
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(x.shape)}")
    return x


def reduce_name(op) -> str:
    """"sum", "max", "min" or "prod" from a name or a ``dist.ReduceOp``."""
    if isinstance(op, str) and op.lower() in DIST_OPS:
        return op.lower()
    for name, enum in DIST_OPS.items():
        if op == enum:
            return name
    raise ValueError(f"op must be sum, max, min or prod (or the dist.ReduceOp of one), got {op!r}")


def weight(b: torch.Tensor) -> Tuple[torch.Tensor, str]:
    """B [K, N] as the kernels take it: row-major [K, N] ("kn"), or the transpose of a
    row-major [N, K] weight (``w.t()``, "nk") without a copy."""
    if b.is_contiguous():
        return b, "kn"
    if b.t().is_contiguous():
        return b.t(), "nk"
    return b.contiguous(), "kn"


def chunk_rows(m, world: int, rank: int):
    """The rows of rank ``rank`` when ``m`` rows split over ``world`` ranks as
    ``torch.tensor_split`` splits them (the first ``m mod world`` chunks one row longer)."""
    return m // world + (1 if rank < m % world else 0)


def chunk_start(m: int, world: int, rank: int) -> int:
    base, extra = divmod(m, world)
    return rank * base + min(rank, extra)


class GemmOperands:
    """A GEMM's operands checked and laid out as the kernels take them: ``a`` contiguous,
    ``b`` as [K, N] ("kn") or the transpose of [N, K] ("nk"), the bias in the output type."""

    def __init__(self, a, b, bias, out_dtype: Optional[torch.dtype]):
        matrix(a, "a")
        matrix(b, "b")
        self.dtype = input_name(a.dtype)
        if b.dtype != a.dtype:
            raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        if b.device != a.device:
            raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
        self.out_dtype = out_dtype or a.dtype
        self.out_name = dtype_name(self.out_dtype, "out_dtype")
        self.a = a.contiguous()
        self.b, self.layout = weight(b)
        rows, k = self.a.shape
        kb, self.n = (self.b.shape[1], self.b.shape[0]) if self.layout == "nk" else self.b.shape
        self.k = k
        if kb != k:
            raise ValueError(
                f"a is [{rows}, {k}] but b is [{self.b.shape[0]}, {self.b.shape[1]}] ({self.layout})"
            )
        self.bias = bias
        if bias is not None:
            tensor(bias, "bias")
            if tuple(bias.shape) != (self.n,):
                raise ValueError(f"bias must be [{self.n}], got {tuple(bias.shape)}")
            self.bias = bias.to(device=a.device, dtype=self.out_dtype).contiguous()
