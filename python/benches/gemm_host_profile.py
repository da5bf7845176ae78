"""Host time per call of all-gather + GEMM (both paths), GEMM + reduce-scatter and torch.matmul
at 16 to 8192 rows on one GPU, then a cProfile of 2 000 calls at 128 rows of the first two:

    torchrun --nproc-per-node 1 python/benches/gemm_host_profile.py

"host": a loop of 300 calls divided by the calls; "host+drain": the same loop timed until the
GPU has finished. Where the two agree, the host is the bottleneck or waits for the GPU; where
"host+drain" is far larger, the GPU is behind and "host" is the host's own cost.
"""

import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist

import commfuse.torch as cf
from commfuse.torch import _prepared

N, K = 8192, 3584


def host_us(fn, calls=300):
    """(host µs per call, host µs per call until the GPU has finished)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / calls * 1e6


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    for m in (16, 128, 2048, 8192):
        a = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        calls = [
            ("agg", lambda: cf.all_gather_gemm(a, w.t())),
            ("grs", lambda: cf.gemm_reduce_scatter(a, w.t())),
            ("agg-fused", lambda: cf.all_gather_gemm(a, w.t(), path="fused")),
            ("matmul", lambda: torch.matmul(a, w.t())),
        ]
        for name, fn in calls:
            fn()
            fn()  # operators built and tuned, outside the loops
            host, drained = host_us(fn)
            print(f"m={m} {name:10s} host {host:8.1f} us/call   host+drain {drained:8.1f} us/call")
    # which signatures run prepared (the closure) and which the general path
    print({key[0] + str(key[2]): ("general" if call is _prepared._GENERAL else "prepared")
           for key, call in _prepared._PREPARED.items()})
    a = torch.randn(128, K, device="cuda", dtype=torch.bfloat16)
    for name, fn in [("agg", lambda: cf.all_gather_gemm(a, w.t())),
                     ("grs", lambda: cf.gemm_reduce_scatter(a, w.t()))]:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        report = io.StringIO()
        pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(8)
        print(name, report.getvalue()[:2500])
    cf.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
