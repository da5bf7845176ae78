"""Ceilings of the GPU-to-GPU link under the load the large collectives put on it.

The large-message collectives load both directions of a link at once, so the figure that bounds
them is the rate per direction under bidirectional load, which a one-way `cudaMemcpyPeer`
figure does not give; and it tells whether the copy engines moving a share of the bytes beside
the SMs' stores carry more than either alone. For GPUs 0 and 1 and each
size, this script times (median wall time of `--iters` rounds, both GPUs synchronised around
each; GB/s = bytes one GPU sends / time):

* `ce`: the copy engine (`cuMemcpyAsync` between the two GPUs' pointers, on a stream of the
  sender), one way and both ways at once;
* `sm B`: a kernel of B blocks × 512 threads storing 16-byte vectors into the peer's memory
  (peer access on), one way and both ways;
* `ce f + sm B`: both ways, each GPU's copy engine moving the fraction f of its bytes while its
  kernel stores the rest, on two streams.

One process drives both GPUs (driver API through ctypes; the kernel compiled by NVRTC to PTX).
Usage: python3 scripts/link-ceilings.py [--sizes 256,1024] [--iters 7]
"""

import argparse
import ctypes
import statistics
import time

import torch

CUDA = ctypes.CDLL("libcuda.so.1")
CUDA.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

KERNEL = rb"""
extern "C" __global__ void __launch_bounds__(512) push(uint4* __restrict__ dst,
                                                        const uint4* __restrict__ src,
                                                        unsigned long long n) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  // two vectors in flight per thread
  for (; i + stride < n; i += 2 * stride) {
    uint4 a = src[i], b = src[i + stride];
    dst[i] = a;
    dst[i + stride] = b;
  }
  if (i < n) dst[i] = src[i];
}
"""


def check(rc, what):
    assert rc == 0, f"{what} failed with error {rc}"


def compile_ptx():
    """The kernel as PTX for compute_90 (the driver JIT-compiles it for the GPU)."""
    for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            nvrtc = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise OSError("no libnvrtc found (set LD_LIBRARY_PATH to the CUDA libraries)")
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), KERNEL, b"push.cu", 0, None, None),
          "nvrtcCreateProgram")
    opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
    rc = nvrtc.nvrtcCompileProgram(prog, 1, opts)
    if rc != 0:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode())
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    return ptx.raw


class Device:
    """One GPU: its stream pair and the push kernel loaded in its (primary) context."""

    def __init__(self, d, ptx):
        self.d = d
        with torch.cuda.device(d):
            torch.zeros(1, device=f"cuda:{d}")  # the primary context current on this thread
            module = ctypes.c_void_p()
            check(CUDA.cuModuleLoadData(ctypes.byref(module), ptx), "cuModuleLoadData")
            self.fn = ctypes.c_void_p()
            check(CUDA.cuModuleGetFunction(ctypes.byref(self.fn), module, b"push"),
                  "cuModuleGetFunction")
            self.ce_stream = torch.cuda.Stream(device=d)
            self.sm_stream = torch.cuda.Stream(device=d)

    def ce(self, dst, src, nbytes):
        with torch.cuda.device(self.d):
            check(CUDA.cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                     ctypes.c_size_t(nbytes),
                                     ctypes.c_void_p(self.ce_stream.cuda_stream)), "cuMemcpyAsync")

    def sm(self, dst, src, nbytes, blocks):
        n = ctypes.c_uint64(nbytes // 16)
        d, s = ctypes.c_uint64(dst), ctypes.c_uint64(src)
        params = (ctypes.c_void_p * 3)(ctypes.cast(ctypes.byref(d), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(s), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(n), ctypes.c_void_p))
        with torch.cuda.device(self.d):
            check(CUDA.cuLaunchKernel(self.fn, blocks, 1, 1, 512, 1, 1, 0,
                                      ctypes.c_void_p(self.sm_stream.cuda_stream), params, None),
                  "cuLaunchKernel")


def timed(fn, iters):
    """Median wall seconds of fn() over iters rounds, both GPUs synchronised around each."""
    times = []
    for _ in range(iters + 2):
        for d in (0, 1):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        fn()
        for d in (0, 1):
            torch.cuda.synchronize(d)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,1024", help="MiB per direction, comma-separated")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    for d in (0, 1):  # peer access on (torch enables it on its first copy between the two)
        torch.ones(1, device=f"cuda:{d}").to(f"cuda:{1 - d}")
    ptx = compile_ptx()
    dev = [Device(d, ptx) for d in (0, 1)]
    for mib in [int(s) for s in args.sizes.split(",")]:
        n = mib << 20
        src = [torch.ones(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
        dst = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]

        def run(directions, ce_share, blocks):
            for d in directions:
                s, t = src[d].data_ptr(), dst[1 - d].data_ptr()
                ce_bytes = int(n * ce_share) // 4096 * 4096
                if ce_bytes:
                    dev[d].ce(t, s, ce_bytes)
                if ce_bytes < n:
                    dev[d].sm(t + ce_bytes, s + ce_bytes, n - ce_bytes, blocks)

        rows = [("ce", [0], 1.0, 0), ("ce", [0, 1], 1.0, 0)]
        for blocks in (132, 264):
            rows += [(f"sm {blocks}", [0], 0.0, blocks), (f"sm {blocks}", [0, 1], 0.0, blocks)]
        for blocks in (32, 66, 132):
            for share in (0.2, 0.35, 0.5):
                rows.append((f"ce {share} + sm {blocks}", [0, 1], share, blocks))
        for name, directions, share, blocks in rows:
            t = timed(lambda: run(directions, share, blocks), args.iters)
            way = "one way " if len(directions) == 1 else "both ways"
            print(f"{mib:5d} MiB  {way}  {name:18s} {n / t / 1e9:6.1f} GB/s per direction",
                  flush=True)
        del src, dst


if __name__ == "__main__":
    main()
