"""Host time per call of commfuse.torch's ops beside the torch calls they replace, and the GPU
time of the same calls replayed from a CUDA graph, in one run:

    torchrun --nproc-per-node P python/benches/torch_host_time.py [--json FILE]

Host time: a loop of back-to-back calls (the same shape, operators cached, nothing
synchronised inside the loop) divided by the calls, the median of several rounds, the rows
interleaved round by round; beside it each row's host time above the torch call's, the median
over the rounds of the two rows' difference within a round (a drift of the host between rounds
falls on both). GPU time: the same call captured ``--graph-calls`` times into one
CUDA graph, replayed, timed by CUDA events (the slowest rank's median). commfuse's rows: the
public function (which skips the dispatcher when no gradient is needed and nothing is being
compiled) and the ``torch.ops.commfuse`` op itself (what a compiled or differentiated model
calls: for the collectives the form ``torch.distributed``'s call has, in place or into a given
tensor, and beside it the op that returns a new tensor). For the GEMMs, ``aten.mm op`` is
``torch.ops.aten.mm`` called from Python: the same way into the dispatcher that a
``torch.ops.commfuse`` call takes, with torch's own GEMM behind it.
``COMMFUSE_TORCH_NATIVE=0`` measures the op with its kernels in Python instead of the C++
dispatcher kernels (``commfuse/torch/_native.py``); the output says which ran."""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import commfuse.torch as cf
from commfuse.torch import _native


def host_us(fn, calls):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took / calls * 1e6


def graph_us(fn, calls, replays=20):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # operators built, kernels loaded, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        t = torch.tensor([begin.elapsed_time(end) * 1e3 / calls], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--profile", metavar="OP",
                    help="also print where the host time of the public function of OP's first "
                         "row (e.g. all_gather_gemm) goes (cProfile)")
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    ops = torch.ops.commfuse
    name = dist.group.WORLD.group_name
    rows = []
    for m in (16, 128):
        n, k = 8192, 3584
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        chunk = torch.randn(max(m // world, 1), k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m * n, device=dev, dtype=torch.bfloat16)
        # this rank's chunk of x (reduce-scatter's output, all-gather's input), and an output
        # the shape of x (all-to-all's)
        part = torch.randn(m * n // world, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        rows += [
            (f"gemm_reduce_scatter {m}x{n}x{k}", {
                "commfuse": lambda a=a, w=w: cf.gemm_reduce_scatter(a, w.t(), path="fused"),
                "commfuse op": lambda a=a, w=w: ops.gemm_reduce_scatter(
                    a, w.t(), None, name, None, "fused", None, 1),
                "aten.mm op": lambda a=a, w=w: torch.ops.aten.mm(a, w.t()),
                "torch.matmul": lambda a=a, w=w: torch.matmul(a, w.t()),
            }),
            (f"all_gather_gemm {chunk.shape[0] * world}x{n}x{k}", {
                "commfuse": lambda c=chunk, w=w: cf.all_gather_gemm(c, w.t()),
                "commfuse op": lambda c=chunk, w=w: ops.all_gather_gemm(
                    c, w.t(), None, name, c.shape[0] * world, None, 1, "overlapped", False),
                # the op with the arguments the public function passes it by default
                "commfuse op, auto": lambda c=chunk, w=w: ops.all_gather_gemm(
                    c, w.t(), None, name, c.shape[0] * world, None, None, "auto", False),
                "aten.mm op": lambda c=chunk, w=w: torch.ops.aten.mm(c, w.t()),
                "torch.matmul": lambda c=chunk, w=w: torch.matmul(c, w.t()),
            }),
            (f"all_reduce {m * n} bf16", {
                "commfuse": lambda x=x: cf.all_reduce(x),
                "commfuse op": lambda x=x: ops.all_reduce_(x, "sum", name, "auto"),
                "commfuse op, new tensor": lambda x=x: ops.all_reduce(x, "sum", name, "auto"),
                "torch.distributed": lambda x=x: dist.all_reduce(x),
            }),
            (f"reduce_scatter {m * n} bf16", {
                "commfuse": lambda x=x, y=part: cf.reduce_scatter(y, x),
                "commfuse op": lambda x=x, y=part: ops.reduce_scatter_into(
                    y, x, "sum", name, "auto"),
                "commfuse op, new tensor": lambda x=x: ops.reduce_scatter(
                    x, "sum", name, "auto"),
                "torch.distributed": lambda x=x, y=part: dist.reduce_scatter_tensor(y, x),
            }),
            (f"all_gather {m * n} bf16", {
                "commfuse": lambda x=x, y=part: cf.all_gather(x, y),
                "commfuse op": lambda x=x, y=part: ops.all_gather_into(x, y, name, "auto"),
                "commfuse op, new tensor": lambda x=x, y=part: ops.all_gather(
                    y, x.shape[0], name, "auto"),
                "torch.distributed": lambda x=x, y=part: dist.all_gather_into_tensor(x, y),
            }),
            (f"all_to_all {m * n} bf16", {
                "commfuse": lambda x=x, y=out: cf.all_to_all(y, x),
                "commfuse op": lambda x=x, y=out: ops.all_to_all_into(y, x, name, "auto"),
                "commfuse op, new tensor": lambda x=x: ops.all_to_all(x, name, "auto"),
                "torch.distributed": lambda x=x, y=out: dist.all_to_all_single(y, x),
            }),
        ]
    # the rows --profile names, checked before anything is measured
    profiled = [r for r in rows if args.profile and r[0].startswith(args.profile + " ")]
    if args.profile and not profiled:
        ops_named = sorted({r[0].split()[0] for r in rows})
        raise SystemExit(f"--profile: no op {args.profile!r} (one of {', '.join(ops_named)})")
    results = []
    for label, fns in rows:
        for fn in fns.values():
            fn()  # operators built
        host = {key: [] for key in fns}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                host[key].append(host_us(fn, args.calls))
        gpu = {key: graph_us(fn, args.graph_calls) for key, fn in fns.items()}
        # the torch call each row replaces is the row's last
        torch_key = list(fns)[-1]
        for key in fns:
            above = [mine - theirs for mine, theirs in zip(host[key], host[torch_key])]
            results.append({"op": label, "impl": key, "ranks": world,
                            "host_us": statistics.median(host[key]),
                            "host_above_torch_us": statistics.median(above),
                            "gpu_us": gpu[key]})
    if args.profile and dist.get_rank() == 0:
        import cProfile
        import pstats

        label, fns = profiled[0]
        fn = fns["commfuse"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"# where the host time of {label} (commfuse) goes, {args.calls} calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    held, hits, misses = _native.counts()
    if dist.get_rank() == 0:
        kernels = "C++ dispatcher kernels" if _native.loaded else \
            f"kernels in Python ({_native.why_not})"
        print(f"# the ops' kernels: {kernels}; C++ prepared calls: {hits} served, {misses} sent"
              " to Python")
        print(f"{'op':36s} {'impl':24s} {'host us/call':>12s} {'above torch':>12s}"
              f" {'GPU us/call (graph)':>20s}")
        for r in results:
            print(f"{r['op']:36s} {r['impl']:24s} {r['host_us']:12.1f}"
                  f" {r['host_above_torch_us']:+12.1f} {r['gpu_us']:20.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world, "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "native_kernels": _native.loaded,
                           "native_hits": hits, "native_misses": misses, "rows": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
