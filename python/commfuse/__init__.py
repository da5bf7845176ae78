"""commfuse: communication-computation fused operators for tensor parallelism on NVLink GPUs.

Today the package runs the operators on commfuse's CPU simulator (``commfuse.sim``), P ranks in
one call, with NumPy arrays in and out: the same schedules and protocols the GPU kernels run,
checked here against float64 references. The GPU operators on PyTorch tensors, one process per
GPU, are the next step (issue 11).
"""

from ._commfuse import __version__, gemm_rs_path
from . import sim

__all__ = ["__version__", "gemm_rs_path", "sim"]
