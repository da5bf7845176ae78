"""commfuse: communication-computation fused operators for tensor parallelism on NVLink GPUs.

``commfuse.torch`` runs the fused operators on PyTorch tensors, one process per GPU, on a
``torch.distributed`` group (imported on its own: PyTorch is optional); ``commfuse.cuda`` runs
them on any framework's CUDA arrays (DLPack or the CUDA array interface: CuPy, JAX, Numba,
PyTorch) with any all-gather of bytes as the rendezvous. ``commfuse.sim`` runs
them on commfuse's CPU simulator, P ranks in one call, with NumPy arrays in and out: the same
schedules and protocols the GPU kernels run, checked against float64 references.
"""

from ._commfuse import __version__, gemm_rs_path
from . import sim

__all__ = ["__version__", "gemm_rs_path", "sim"]
