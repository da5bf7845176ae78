"""The dispatcher kernels in C++ (``python/native/dispatch.cpp``, built by
``scripts/build-torch-native.sh`` into ``_dispatch.so`` beside this file): with them, a
steady-state call of ``torch.ops.commfuse.gemm_reduce_scatter``, ``all_gather_gemm`` or of a
collective (``all_reduce_``, ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``
and the ``*_into`` forms) on CUDA tensors goes from the dispatcher to commfuse's operator
without entering Python, and every op's autograd kernel is C++ until a gradient is needed.

The library is loaded when it was built for the PyTorch version that runs (it links against
PyTorch's C++ libraries); otherwise the same ops run from Python (``_library.py`` defines both
ways). ``COMMFUSE_TORCH_NATIVE=0`` keeps it unloaded, ``=1`` makes its absence an ImportError,
and any other value is a path to load it from.

How a prepared call reaches the C++ table: a signature the table has not seen runs Python's
general path (the op's twin's CUDA kernel), which leaves what later calls take in
:data:`last`; :func:`bind` hands that to the table.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from .. import _operators

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The CUDA kernels the library has (``Kind`` in dispatch.cpp): the two GEMMs, the all-reduce
#: in place, a collective into a new tensor, a collective into a given one (output, input)
GEMM_RS, AG_GEMM, ALL_REDUCE_INPLACE, COLLECTIVE, COLLECTIVE_INTO = 0, 1, 2, 3, 4

#: What the last prepared call of this thread resolved to (set by ``_prepared``)
last = None


def _load():
    """(the library, or None; why not, or "")"""
    setting = os.environ.get("COMMFUSE_TORCH_NATIVE", "")
    if setting == "0":
        return None, "COMMFUSE_TORCH_NATIVE=0"
    path = setting if setting not in ("", "1") else os.path.join(_HERE, "_dispatch.so")
    version_file = os.path.splitext(path)[0] + ".torch-version"
    why = ""
    if not os.path.exists(path):
        why = f"{path} is not built (scripts/build-torch-native.sh builds it)"
    else:
        try:
            with open(version_file) as f:
                built_for = f.read().strip()
        except OSError:
            built_for = "an unknown version"
        if built_for != torch.__version__:
            why = f"{path} was built for torch {built_for}, not {torch.__version__}"
    if why:
        if setting:
            raise ImportError(f"commfuse.torch: COMMFUSE_TORCH_NATIVE={setting}, but {why}")
        return None, why
    torch.ops.load_library(path)
    lib = ctypes.CDLL(path)
    lib.commfuse_native_route.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                          ctypes.c_size_t]
    lib.commfuse_native_kernel.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                           ctypes.c_size_t]
    lib.commfuse_native_pending.argtypes = []
    lib.commfuse_native_bind.restype = None
    lib.commfuse_native_bind.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    lib.commfuse_native_clear.restype = None
    lib.commfuse_native_clear.argtypes = []
    lib.commfuse_native_counts.restype = None
    lib.commfuse_native_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 3
    return lib, ""


_lib, why_not = _load()
#: Whether the C++ kernels serve the ops
loaded = _lib is not None


def _checked(fn, *args) -> None:
    error = ctypes.create_string_buffer(512)
    if fn(*args, error, len(error)) != 0:
        raise RuntimeError(f"commfuse.torch: {error.value.decode(errors='replace')}")


def route(op: str, twin: str) -> None:
    """The C++ autograd kernel for ``commfuse::<op>``, calls needing a gradient going to
    ``commfuse::<twin>``."""
    _checked(_lib.commfuse_native_route, op.encode(), twin.encode())


def kernel(op: str, kind: int) -> None:
    """The C++ prepared-call kernel of ``kind`` as ``commfuse::<op>``'s CUDA kernel."""
    _checked(_lib.commfuse_native_kernel, op.encode(), kind)


def _shape(dims) -> tuple:
    dims = tuple(int(d) for d in dims)
    return (ctypes.c_int64 * max(len(dims), 1))(*dims), len(dims)


def bind(entry, op: str) -> None:
    """Tells the C++ table what the signature whose miss this thread is serving, a call of
    ``commfuse::<op>``, takes: the operator of ``entry.native`` (an operator object with
    ``native()``, the output's shape, the gathered A's shape or None, whether the gathered A is
    written, the rows M) where ``entry`` was prepared for a call of that op, or — for anything
    else (no entry, or one that an op this one called on its way left) — Python's general
    path."""
    if _lib is None or not _lib.commfuse_native_pending():
        return
    spec = getattr(entry, "native", None)
    if spec is None or getattr(entry, "op", None) != op:
        empty, _ = _shape(())
        _lib.commfuse_native_bind(None, 0, None, empty, 0, empty, 0, 0, 0)
        return
    op, out_shape, gathered_shape, return_gathered, m = spec
    handle, call, release = op.native()
    out, out_dims = _shape(out_shape)
    gathered, gathered_dims = _shape(gathered_shape or ())
    _lib.commfuse_native_bind(handle, call, release, out, out_dims, gathered, gathered_dims,
                              int(return_gathered), int(m))


def clear() -> None:
    """Forgets every prepared call of the C++ table (releasing its operators)."""
    if _lib is not None:
        _lib.commfuse_native_clear()


def counts() -> tuple:
    """(prepared calls held, calls served by them, calls that went to Python) of the C++
    CUDA kernels so far; zeros without the library."""
    if _lib is None:
        return 0, 0, 0
    held, hits, misses = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    _lib.commfuse_native_counts(ctypes.byref(held), ctypes.byref(hits), ctypes.byref(misses))
    return held.value, hits.value, misses.value


if loaded:
    # what the table holds was prepared against the operator cache as it stood
    _operators.listeners.append(clear)
