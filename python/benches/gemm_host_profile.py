"""Where the host time of one GEMM call goes, on one GPU: the public functions of
commfuse.torch, the Rust ``forward`` they call (an output allocated ahead), the pieces of torch
every call also pays (``torch.empty``, the current stream) and the driver calls a ``forward``
makes, beside ``torch.matmul`` with and without its output allocated:

    torchrun --nproc-per-node 1 python/benches/gemm_host_profile.py [--json FILE]

Each row is a loop of back-to-back calls (the same shape, operators built and tuned outside
the loops, nothing synchronised inside) divided by the calls; the median of ``--rounds``
rounds, the rows interleaved round by round. The difference between a public function and
its ``forward`` is the Python above the binding; between ``forward`` and ``torch.matmul`` with
``out=`` it is the binding, commfuse's own bookkeeping and the kernel launch.
"""

import argparse
import ctypes
import json
import statistics
import time

import torch
import torch.distributed as dist

import commfuse.torch as cf
from commfuse.torch import _gpu
from commfuse.torch._common import GemmOperands

N, K = 8192, 3584


def host_us(fn, calls):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took / calls * 1e6


def driver_calls():
    """Rows timing single driver calls on torch's current stream (what a forward adds beside
    its launch), or none where libcuda cannot be loaded by name."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {}
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    event = ctypes.c_void_p()
    # CU_EVENT_DISABLE_TIMING, as the operators' call-order events
    assert cuda.cuEventCreate(ctypes.byref(event), 2) == 0
    status = ctypes.c_int()
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return {
        "cuEventRecord": lambda: cuda.cuEventRecord(event, stream),
        "cuStreamWaitEvent": lambda: cuda.cuStreamWaitEvent(stream, event, 0),
        "cuStreamIsCapturing": lambda: cuda.cuStreamIsCapturing(stream, ctypes.byref(status)),
        "cuCtxSetCurrent": lambda: cuda.cuCtxSetCurrent(ctx),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    pg = dist.group.WORLD
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for m in (16, 128):
        a = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        g = GemmOperands(a, w.t(), None, None)
        agg = _gpu.ag_gemm_operator(g, pg, m, 1, "overlapped")
        agg_fused = _gpu.ag_gemm_operator(g, pg, m, 1, "fused")
        grs, _ = _gpu.gemm_rs_operator(g, pg, "fused", None, 1)
        stream = _gpu.stream_of(0)
        ptrs = (a.data_ptr(), w.data_ptr(), out.data_ptr())
        calls = {
            "torch.empty": lambda: torch.empty((m, N), dtype=torch.bfloat16, device="cuda"),
            "stream_of": lambda: _gpu.stream_of(0),
            "torch.matmul": lambda: torch.matmul(a, w.t()),
            "torch.matmul out=": lambda: torch.matmul(a, w.t(), out=out),
            "all_gather_gemm": lambda: cf.all_gather_gemm(a, w.t()),
            "all_gather_gemm forward": lambda: agg.forward(m, *ptrs, stream, None, None),
            "all_gather_gemm fused": lambda: cf.all_gather_gemm(a, w.t(), path="fused"),
            "all_gather_gemm fused forward":
                lambda: agg_fused.forward(m, *ptrs, stream, None, None),
            "gemm_reduce_scatter fused": lambda: cf.gemm_reduce_scatter(a, w.t(), path="fused"),
            "gemm_reduce_scatter fused forward": lambda: grs.forward(m, *ptrs, stream, None),
        }
        if m == 16:
            calls.update(driver_calls())
        for fn in calls.values():
            fn()
            fn()  # built, tuned and loaded outside the timed loops
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(host_us(fn, args.calls))
        for name, ts in times.items():
            rows[f"m={m} {name}"] = statistics.median(ts)
            print(f"m={m:<4} {name:36s} {statistics.median(ts):7.2f} us/call "
                  f"(rounds {min(ts):.2f}..{max(ts):.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "n": N, "k": K, "calls": args.calls, "rounds": args.rounds,
                       "host_us": rows}, f, indent=1)
    cf.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
