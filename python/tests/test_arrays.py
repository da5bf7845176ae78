"""How commfuse reads other frameworks' arrays (commfuse._arrays) and what commfuse.cuda
refuses before it builds anything: no GPU needed. NumPy's DLPack capsules stand in for a CUDA
framework's (the capsule's layout is the same whatever the device)."""

import numpy as np
import pytest

from commfuse import _arrays
from commfuse._arrays import DeviceArray, device_array, read_capsule, stream_handle
import commfuse.cuda as cf


class FakeCuda:
    """A NumPy array dressed as a CUDA framework's: DLPack device type 2 (CUDA), device 0."""

    def __init__(self, x, device=0):
        self.x, self.device, self.streams = x, device, []

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.x.__dlpack__()

    def __dlpack_device__(self):
        return (2, self.device)


class FakeCai:
    def __init__(self, **cai):
        self.__cuda_array_interface__ = {"version": 3, "strides": None, **cai}


@pytest.mark.parametrize("dtype, name", [(np.float16, "f16"), (np.float32, "f32")])
def test_a_dlpack_capsule_is_read_in_place(dtype, name):
    x = np.arange(24, dtype=dtype).reshape(4, 6)
    view = x[1:, ::2]  # an offset and strides
    d = read_capsule(view.__dlpack__(), "x")
    assert d.ptr == view.__array_interface__["data"][0]
    assert d.shape == (3, 3) and d.strides == (6, 2) and d.dtype == name
    assert not d.is_contiguous() and d.size == 9
    assert read_capsule(x.__dlpack__(), "x").is_contiguous()


def test_an_array_on_a_cuda_device_comes_through_dlpack_with_the_callers_stream():
    x = np.ones((2, 3), dtype=np.float16)
    fake = FakeCuda(x, device=1)
    d = device_array(fake, "a", stream=1234)
    assert d == DeviceArray(x.ctypes.data, (2, 3), (3, 1), "f16", 1)
    assert fake.streams == [1234]
    device_array(fake, "a")
    assert fake.streams[-1] == 1  # the legacy default stream, as DLPack spells it


def test_host_arrays_and_unsupported_types_are_refused_in_one_line():
    with pytest.raises(ValueError, match="a must be in CUDA device memory, got DLPack device type 1"):
        device_array(np.zeros(4, np.float32), "a")
    with pytest.raises(ValueError, match=r"bfloat16, float16 or float32, got int32 \(DLPack type code 0\)"):
        device_array(FakeCuda(np.zeros(4, np.int32)), "a")
    with pytest.raises(ValueError, match=r"^b must be bfloat16, float16 or float32, got float64 \(DLPack"):
        device_array(FakeCuda(np.zeros((2, 2), np.float64)), "b")
    with pytest.raises(ValueError, match="must be a CUDA array offering DLPack"):
        device_array([1.0, 2.0], "b")


def test_the_cuda_array_interface_gives_element_strides():
    d = device_array(FakeCai(data=(4096, False), shape=(4, 8), typestr="<f4"), "x")
    assert d == DeviceArray(4096, (4, 8), (8, 1), "f32", None) and d.is_contiguous()
    t = device_array(FakeCai(data=(4096, False), shape=(8, 4), typestr="<f2", strides=(2, 16)),
                     "x")
    assert t.strides == (1, 8) and not t.is_contiguous()
    with pytest.raises(ValueError, match="no bfloat16: pass bfloat16 through DLPack"):
        device_array(FakeCai(data=(0, False), shape=(2,), typestr="<V2"), "x")
    with pytest.raises(ValueError, match="masked"):
        device_array(FakeCai(data=(0, False), shape=(2,), typestr="<f4", mask=object()), "x")
    with pytest.raises(ValueError, match="whole elements"):
        device_array(FakeCai(data=(0, False), shape=(2,), typestr="<f4", strides=(6,)), "x")


def test_streams_are_taken_in_every_common_form():
    class Torch:
        cuda_stream = 11

    class Cupy:
        ptr = 12

    class Protocol:
        def __cuda_stream__(self):
            return (0, 13)

    assert [stream_handle(s) for s in (None, 10, Torch(), Cupy(), Protocol())] == [0, 10, 11, 12, 13]
    with pytest.raises(ValueError, match="stream must be a CUDA stream"):
        stream_handle("default")


def cai(shape, typestr="<f2", strides=None, ptr=1 << 20):
    return FakeCai(data=(ptr, False), shape=shape, typestr=typestr, strides=strides)


def test_commfuse_cuda_refuses_calls_that_do_not_fit_before_building_anything():
    group = cf.Group(0, 2, lambda b: [b, b])
    a, b = cai((64, 32)), cai((32, 16))
    out = cai((32, 16))
    cases = [
        ("K mismatch", lambda: cf.gemm_reduce_scatter(a, cai((48, 16)), out, group),
         r"a is \[64, 32\] but b is \[48, 16\]"),
        ("f32 inputs", lambda: cf.gemm_reduce_scatter(cai((64, 32), "<f4"), cai((32, 16), "<f4"),
                                                      out, group), "bf16 or f16"),
        ("mixed types", lambda: cf.gemm_reduce_scatter(a, cai((32, 16), "<f4"), out, group),
         "one dtype"),
        ("b neither layout", lambda: cf.gemm_reduce_scatter(a, cai((32, 16), strides=(64, 4)),
                                                            out, group), "row-major"),
        ("a not contiguous", lambda: cf.gemm_reduce_scatter(cai((64, 32), strides=(2, 128)), b,
                                                            out, group), "a must be contiguous"),
        ("1-D a", lambda: cf.gemm_reduce_scatter(cai((64,)), b, out, group), "2-D"),
        ("bias shape", lambda: cf.gemm_reduce_scatter(a, b, out, group, bias=cai((15,))),
         r"bias must be \[16\]"),
        ("other GPU", lambda: cf.gemm_reduce_scatter(FakeCuda(np.zeros((64, 32), np.float16), 1),
                                                     b, out, group), "on CUDA device 1"),
        ("out's columns", lambda: cf.all_gather_gemm(a, b, cai((64, 8)), group), r"\[M, 16\]"),
        ("gathered shape", lambda: cf.all_gather_gemm(a, b, cai((128, 16)), group,
                                                      gathered=cai((128, 16))), r"\[128, 32\]"),
        ("reduce op", lambda: cf.all_reduce(cai((8,), "<f4"), group, op="avg"), "op must be"),
        ("output type", lambda: cf.all_gather(cai((8,), "<f2"), cai((4,), "<f4"), group),
         "output must be f32"),
    ]
    for what, call, says in cases:
        with pytest.raises(ValueError, match=says):
            call()


def test_a_group_checks_its_rank_and_its_all_gather():
    with pytest.raises(ValueError, match="rank must be 0 to world - 1 = 1"):
        cf.Group(2, 2, lambda b: [b, b])
    with pytest.raises(ValueError, match="callable"):
        cf.Group(0, 2, None)
    with pytest.raises(ValueError, match="the 2 ranks' bytes"):
        cf.Group(0, 2, lambda b: [b])._exchange(b"x")
    assert cf.Group(1, 2, lambda b: [b, b]).device == 1


def test_every_name_of_the_module_is_documented():
    for name in cf.__all__:
        assert getattr(cf, name).__doc__, name
    assert _arrays.__doc__
