"""Arrays of any framework as commfuse takes them: a device address, a shape, strides and a
type, read through DLPack (``__dlpack__``) or the CUDA array interface
(``__cuda_array_interface__``), so that nothing of the framework is imported or linked.

DLPack is read first (it names bfloat16 and the device); the CUDA array interface, which has no
bfloat16, serves frameworks without DLPack. The capsule is read in place and left to its
producer's destructor: the caller keeps the array alive for the call, as with any CUDA
library.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional, Tuple

# DLDeviceType codes (dlpack.h)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
# DLDataTypeCode codes: float, bfloat
_DL_FLOAT, _DL_BFLOAT = 2, 4
_DL_NAMES = {(_DL_FLOAT, 16): "f16", (_DL_FLOAT, 32): "f32", (_DL_BFLOAT, 16): "bf16"}
# every DLDataTypeCode by the name its types take (int32, float64, ...), for error messages
_DL_KINDS = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool"}
# the CUDA array interface's type strings (little-endian; it has none for bfloat16)
_CAI_NAMES = {"<f2": "f16", "<f4": "f32"}
_SIZES = {"bf16": 2, "f16": 2, "f32": 4}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# DLManagedTensor begins with its DLTensor, which is all that is read here
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DeviceArray(NamedTuple):
    """An array's device memory as the kernels see it: ``ptr`` its first element's address,
    ``shape`` and ``strides`` in elements, ``dtype`` "bf16", "f16" or "f32", ``device`` the
    CUDA device ordinal where the producer names it (None through the CUDA array interface)."""

    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: str
    device: Optional[int]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        """Row-major without gaps (dimensions of one element may have any stride)."""
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True


def _row_major(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def read_capsule(capsule, what: str) -> DeviceArray:
    """The array a DLPack capsule ("dltensor", as ``__dlpack__`` returns it) describes, its
    device the DLPack device id; read in place (the capsule stays its producer's)."""
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    key = (t.dtype.code, t.dtype.bits)
    if key not in _DL_NAMES or t.dtype.lanes != 1:
        kind = _DL_KINDS.get(t.dtype.code, "type")
        lanes = "" if t.dtype.lanes == 1 else f" x {t.dtype.lanes} lanes"
        raise ValueError(
            f"{what} must be bfloat16, float16 or float32, got {kind}{t.dtype.bits}{lanes}"
            f" (DLPack type code {t.dtype.code})"
        )
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else _row_major(shape)
    return DeviceArray((t.data or 0) + t.byte_offset, shape, strides, _DL_NAMES[key],
                       int(t.device.device_id))


def _from_dlpack(x, what: str, stream: Optional[int]) -> DeviceArray:
    device_type, device_id = x.__dlpack_device__()
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise ValueError(
            f"{what} must be in CUDA device memory, got DLPack device type {int(device_type)}"
        )
    # the producer orders its pending writes before `stream` (DLPack's contract); 1 stands
    # for the legacy default stream, whose handle 0 DLPack reserves
    capsule = x.__dlpack__(stream=1 if not stream else stream)
    return read_capsule(capsule, what)._replace(device=int(device_id))


def _from_cai(x, what: str) -> DeviceArray:
    cai = x.__cuda_array_interface__
    typestr = cai["typestr"]
    if typestr not in _CAI_NAMES:
        raise ValueError(
            f"{what} must be float16 or float32 (the CUDA array interface has no bfloat16:"
            f" pass bfloat16 through DLPack), got type {typestr!r}"
        )
    if cai.get("mask") is not None:
        raise ValueError(f"{what}: masked arrays are not supported")
    dtype = _CAI_NAMES[typestr]
    shape = tuple(int(s) for s in cai["shape"])
    if cai.get("strides") is None:
        strides = _row_major(shape)
    else:
        size = _SIZES[dtype]
        if any(s % size for s in cai["strides"]):
            raise ValueError(f"{what}: strides must be whole elements, got {cai['strides']}")
        strides = tuple(int(s) // size for s in cai["strides"])
    ptr, _readonly = cai["data"]
    return DeviceArray(int(ptr or 0), shape, strides, dtype, None)


def device_array(x, what: str, stream: Optional[int] = None) -> DeviceArray:
    """``x`` read through DLPack or, failing that, the CUDA array interface; a one-line
    ``ValueError`` naming ``what`` when it offers neither, or not on a CUDA device."""
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _from_dlpack(x, what, stream)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cai(x, what)
    raise ValueError(
        f"{what} must be a CUDA array offering DLPack or the CUDA array interface, got"
        f" {type(x).__name__}"
    )


def stream_handle(stream) -> int:
    """A CUDA stream as its handle: an int, an object with ``__cuda_stream__`` (returning
    (version, handle)), ``cuda_stream`` (PyTorch) or ``ptr`` (CuPy); None is the legacy
    default stream (0)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise ValueError(f"stream must be a CUDA stream or its handle, got {type(stream).__name__}")
