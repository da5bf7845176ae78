"""commfuse's collectives from PyTorch beside torch.distributed's (NCCL), one process per GPU.

    torchrun --standalone --nproc-per-node 2 examples/torch_collectives.py [--sizes 4K,64K,1M,64M]

What a PyTorch user gets from ``commfuse.torch.all_reduce`` / ``reduce_scatter`` /
``all_gather`` on their own tensors — by default (``path="auto"``: commfuse's collective up to
the size where it beats NCCL on such tensors, torch.distributed above it) and with
``path="commfuse"`` (commfuse's at every size: its copies into and out of its symmetric buffers
included, where its algorithm needs them) — against ``dist.all_reduce`` /
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` on the same tensors. Sizes are bytes of
the all-reduce's tensor, of the reduce-scatter's input and of the all-gather's output, bf16.
Every commfuse result is first compared with NCCL's (reported as the largest difference over
the largest magnitude); then the three are timed with CUDA events, rows interleaved in rounds,
medians of the slowest rank.
"""

import argparse
import os
import re
import subprocess

import torch
import torch.distributed as dist

import commfuse.torch as cf
from tp_mlp import time_blocks, timed_run


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def makers(world, n, group):
    """Per op: (name, maker, the message's bytes); maker(path) gives a call on fresh inputs
    (path "nccl": torch.distributed's) and a function returning its output."""
    chunk = n // world

    def ar(path):
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        if path == "nccl":
            return (lambda: dist.all_reduce(x, group=group)), lambda: x
        return (lambda: cf.all_reduce(x, group=group, path=path)), lambda: x

    def rs(path):
        x = torch.randn(chunk * world, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(chunk, device="cuda", dtype=torch.bfloat16)
        if path == "nccl":
            return (lambda: dist.reduce_scatter_tensor(y, x, group=group)), lambda: y
        return (lambda: cf.reduce_scatter(y, x, group=group, path=path)), lambda: y

    def ag(path):
        x = torch.randn(chunk, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(chunk * world, device="cuda", dtype=torch.bfloat16)
        if path == "nccl":
            return (lambda: dist.all_gather_into_tensor(y, x, group=group)), lambda: y
        return (lambda: cf.all_gather(y, x, group=group, path=path)), lambda: y

    return [("all-reduce", ar), ("reduce-scatter", rs), ("all-gather", ag)]


def nvlink_bytes(device):
    """The NVLink data counters of GPU `device` (`nvidia-smi nvlink -gt d`), summed over its
    links: (sent, received) bytes, or None where nvidia-smi does not print them."""
    try:
        text = subprocess.run(["nvidia-smi", "nvlink", "-gt", "d", "-i", str(device)],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sums = {"tx": 0, "rx": 0}
    for way, value, unit in re.findall(r"Data (Tx|Rx):\s*([0-9]+)\s*(KiB|MiB|GiB|B)", text):
        sums[way.lower()] += int(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    return (sums["tx"], sums["rx"]) if text and (sums["tx"] or sums["rx"]) else None


def nvlink_per_call(calls, iters, group, device):
    """Per path, the bytes this GPU sent and received over NVLink per call during `iters` calls
    of it (the other rank makes the same calls meanwhile): whether a collective's peer bytes go
    over NVLink at all."""
    out = {}
    for path, call in calls.items():
        dist.barrier(group=group)
        before = nvlink_bytes(device)
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        after = nvlink_bytes(device)
        if before is None or after is None:
            return None
        out[path] = tuple((b - a) / iters for a, b in zip(before, after))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M,64M,256M")
    parser.add_argument("--nvlink", action="store_true",
                        help="also read rank 0's GPU's NVLink counters around each path's calls")
    parser.add_argument("--contexts", action="store_true",
                        help="at the end, list the processes nvidia-smi sees on each GPU beside "
                             "the ranks' pids (a rank's context on another rank's GPU would "
                             "time-slice with that rank's kernels)")
    args, rank, world, group = timed_run(parser, 20)
    if rank == 0:
        print(f"# commfuse.torch beside torch.distributed (NCCL), bf16, P = {world}, eager; ms")
        print(f"# {'op':>14} {'size':>6} {'auto':>9} {'commfuse':>9} {'NCCL':>9}"
              f" {'auto/NCCL':>9} {'cf/NCCL':>8}  check  auto goes to        host ms/call"
              " (auto, commfuse, NCCL)")
    for size in args.sizes.split(","):
        n = parse_size(size) // 2 // world * world
        for name, make in makers(world, n, group):
            calls, outs = {}, {}
            for path in ("auto", "commfuse", "nccl"):
                torch.manual_seed(1 + rank)  # the same inputs for all three
                calls[path], outs[path] = make(path)
            for call in calls.values():
                call()
            torch.cuda.synchronize()
            ref = outs["nccl"]().float()
            diff = max(((outs[p]().float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
                       for p in ("auto", "commfuse"))
            diff = torch.tensor([diff], device="cuda")
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
            rows = time_blocks(calls, args, group)
            links = nvlink_per_call(calls, args.iters, group, rank) if args.nvlink else None
            if rank == 0:
                t = {p: rows[p][0] for p in calls}
                goes = cf.collective_path(name, n, torch.bfloat16)
                print(f"  {name:>14} {size:>6} {t['auto']:9.4f} {t['commfuse']:9.4f} {t['nccl']:9.4f}"
                      f" {t['nccl'] / t['auto']:8.2f}x {t['nccl'] / t['commfuse']:7.2f}x"
                      f"  {'OK' if diff.item() < 2**-6 else 'DIFFERS'}  {goes:<17}"
                      f"  {rows['auto'][3]:.4f} {rows['commfuse'][3]:.4f} {rows['nccl'][3]:.4f}",
                      flush=True)
                if args.nvlink:
                    seen = "not readable" if links is None else "  ".join(
                        f"{p} {tx / 2**20:.2f} / {rx / 2**20:.2f}" for p, (tx, rx) in links.items())
                    print(f"  {'':>14} {'':>6} NVLink MiB sent / received per call: {seen};"
                          " rounds' ms min-max: " + "  ".join(
                              f"{p} {rows[p][1]:.4f}-{rows[p][2]:.4f}" for p in calls),
                          flush=True)
    if args.contexts:
        pids = [None] * world
        dist.all_gather_object(pids, (os.getpid(), torch.cuda.current_device()), group=group)
        if rank == 0:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                                   "--format=csv,noheader"], capture_output=True, text=True,
                                  timeout=20).stdout
            print(f"# ranks' (pid, GPU): {pids}; nvidia-smi's compute processes:")
            print("\n".join(f"#   {line}" for line in apps.splitlines()))
        dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
