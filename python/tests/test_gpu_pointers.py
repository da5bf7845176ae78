"""The GPU operators check the raw device addresses they are called with: the bytes a call
reads or writes from each must lie in one allocation of the operator's GPU, else a one-line
ValueError naming the argument (and its GPU, or the bytes needed and what its allocation
holds). One process, groups of one rank; skips with the reason without PyTorch or a CUDA GPU,
and fails instead when ``COMMFUSE_REQUIRE_GPU=1`` (the GPU machine's script)."""

import numpy as np
import pytest

from commfuse import _commfuse
from test_torch_gpu import cuda_missing, skip_for


@pytest.fixture
def torch():
    skip_for(cuda_missing(1))
    import torch

    torch.cuda.set_device(0)
    return torch


def _connected(op):
    op.connect([op.export()])
    return op


def _stream(torch):
    return torch.cuda.current_stream().cuda_stream


_KEEP = []  # the tensors whose blocks `_near_end` pointed into


def _near_end(torch, need: int, short: int) -> int:
    """An address `short` bytes short of `need` before the end of an allocation of the driver's
    (PyTorch's caching allocator hands out parts of blocks: the block is what is checked)."""
    big = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    p = big.data_ptr()
    for s in torch.cuda.memory_snapshot():
        if s["address"] <= p < s["address"] + s["total_size"]:
            end = s["address"] + s["total_size"]
            # the block must stay allocated while the test uses the address
            _KEEP.append(big)
            return end - (need - short)
    raise AssertionError("the tensor's block is not in PyTorch's memory snapshot")



def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_a_collective_refuses_an_input_that_runs_past_its_allocation(torch):
    op = _connected(_commfuse.GpuCollective(0, 0, 1, "all-reduce", 1024, dtype="f32"))
    out = torch.empty(1024, device="cuda")
    with pytest.raises(ValueError) as e:
        op.forward(_near_end(torch, 4096, 16), out.data_ptr(), _stream(torch))
    text = _one_line(e)
    assert text.startswith("input (0x"), text
    assert "needs 4096 bytes" in text and "holds 4080 from there" in text, text
    # nothing was queued: the operator still serves a right call, which is checked once
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    for _ in range(2):
        op.forward(x.data_ptr(), out.data_ptr(), _stream(torch))
    torch.cuda.synchronize()
    op.check()
    assert torch.equal(out, x)


def test_a_collective_refuses_an_output_of_another_size(torch):
    op = _connected(_commfuse.GpuCollective(0, 0, 1, "all-reduce", 1024, dtype="f32"))
    x = torch.ones(1024, device="cuda")
    with pytest.raises(ValueError) as e:
        op.forward(x.data_ptr(), _near_end(torch, 4096, 2048), _stream(torch))
    text = _one_line(e)
    assert text.startswith("output (0x") and "needs 4096 bytes" in text, text


def test_a_collective_refuses_host_memory(torch):
    op = _connected(_commfuse.GpuCollective(0, 0, 1, "all-reduce", 16, dtype="f32"))
    host = np.zeros(16, dtype=np.float32)
    out = torch.empty(16, device="cuda")
    with pytest.raises(ValueError) as e:
        op.forward(host.ctypes.data, out.data_ptr(), _stream(torch))
    assert "input" in _one_line(e) and "is not device memory" in str(e.value)


def test_gemm_reduce_scatter_refuses_a_b_past_its_allocation(torch):
    m, n, k = 64, 128, 64
    op = _connected(_commfuse.GpuGemmReduceScatter(0, 0, 1, m, n, k, path="auto"))
    a = torch.ones(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    need = n * k * 2
    with pytest.raises(ValueError) as e:
        op.forward(m, a.data_ptr(), _near_end(torch, need, 16), out.data_ptr(), _stream(torch))
    text = _one_line(e)
    assert text.startswith("b (0x") and f"needs {need} bytes" in text, text


def test_all_gather_gemm_refuses_an_out_past_its_allocation(torch):
    m, n, k = 64, 128, 64
    op = _connected(_commfuse.GpuAllGatherGemm(0, 0, 1, m, n, k))
    a = torch.ones(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.ones(n, k, dtype=torch.bfloat16, device="cuda")
    need = m * n * 2
    with pytest.raises(ValueError) as e:
        op.forward(m, a.data_ptr(), b.data_ptr(), _near_end(torch, need, 64), _stream(torch))
    text = _one_line(e)
    assert text.startswith("out (0x") and f"needs {need} bytes" in text, text
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError) as e:
        op.forward(m, a.data_ptr(), b.data_ptr(), out.data_ptr(), _stream(torch),
                   gathered=_near_end(torch, m * k * 2, 16))
    assert _one_line(e).startswith("gathered (0x")


class _Cai:
    """A CUDA array through the CUDA array interface alone (it names no device)."""

    def __init__(self, t):
        self._t = t
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": "<f4", "data": (t.data_ptr(), False),
            "version": 3, "strides": None,
        }


def test_an_array_of_another_gpu_through_the_cuda_array_interface_is_refused(torch):
    skip_for(cuda_missing(2))
    import commfuse.cuda as cc

    group = cc.Group(0, 1, lambda b: [b], device=0)
    on_gpu1 = torch.ones(256, device="cuda:1")
    with pytest.raises(ValueError) as e:
        cc.all_reduce(_Cai(on_gpu1), group)
    text = _one_line(e)
    assert "is memory of GPU 1, and this operator runs on GPU 0" in text, text
    on_gpu0 = torch.ones(256, device="cuda:0")
    cc.all_reduce(_Cai(on_gpu0), group)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu0, torch.ones(256, device="cuda:0"))
    cc.clear_cache()

