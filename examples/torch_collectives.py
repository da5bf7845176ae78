"""commfuse's collectives from PyTorch beside torch.distributed's (NCCL), one process per GPU.

    torchrun --standalone --nproc-per-node 2 examples/torch_collectives.py [--sizes 4K,64K,1M,64M]

What a PyTorch user gets from ``commfuse.torch.all_reduce`` / ``reduce_scatter`` /
``all_gather`` on their own tensors — the copies into and out of commfuse's symmetric buffers
included, where its algorithm needs them — against ``dist.all_reduce`` /
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` on the same tensors. Sizes are bytes of
the all-reduce's tensor, of the reduce-scatter's input and of the all-gather's output, bf16.
Every commfuse result is first compared with NCCL's (sums in bf16 may differ in the last bit:
reported as the largest difference over the largest magnitude); then both are timed with CUDA
events, rows interleaved in rounds, medians of the slowest rank.
"""

import argparse

import torch
import torch.distributed as dist

import commfuse.torch as cf
from tp_mlp import time_blocks


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def ops(world, n, group):
    """(name, commfuse call, NCCL call, inputs maker) for a message of n elements."""
    chunk = n // world

    def ar(lib):
        def make():
            x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            return (lambda: cf.all_reduce(x, group=group)) if lib == "cf" else (
                lambda: dist.all_reduce(x, group=group)), lambda: x
        return make

    def rs(lib):
        def make():
            x = torch.randn(chunk * world, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(chunk, device="cuda", dtype=torch.bfloat16)
            if lib == "cf":
                return (lambda: cf.reduce_scatter(y, x, group=group)), lambda: y
            return (lambda: dist.reduce_scatter_tensor(y, x, group=group)), lambda: y
        return make

    def ag(lib):
        def make():
            x = torch.randn(chunk, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(chunk * world, device="cuda", dtype=torch.bfloat16)
            if lib == "cf":
                return (lambda: cf.all_gather(y, x, group=group)), lambda: y
            return (lambda: dist.all_gather_into_tensor(y, x, group=group)), lambda: y
        return make

    return [("all-reduce", ar), ("reduce-scatter", rs), ("all-gather", ag)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M,64M,256M")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    if rank == 0:
        print(f"# commfuse.torch beside torch.distributed (NCCL), bf16, P = {world}, eager")
        print(f"# {'op':>14} {'size':>6} {'commfuse ms':>12} {'NCCL ms':>10} {'vs NCCL':>8}  check")
    for size in args.sizes.split(","):
        n = parse_size(size) // 2 // world * world
        for name, make in ops(world, n, group):
            torch.manual_seed(1 + rank)
            cf_call, cf_out = make("cf")()
            torch.manual_seed(1 + rank)
            nccl_call, nccl_out = make("nccl")()
            # the same inputs (same seeds): one call each, results compared
            cf_call()
            nccl_call()
            torch.cuda.synchronize()
            a, b = cf_out().float(), nccl_out().float()
            diff = ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).reshape(1)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
            rows = time_blocks({"cf": cf_call, "nccl": nccl_call}, args, group)
            if rank == 0:
                t_cf, t_nccl = rows["cf"][0], rows["nccl"][0]
                print(f"  {name:>14} {size:>6} {t_cf:12.4f} {t_nccl:10.4f} {t_nccl / t_cf:7.2f}x"
                      f"  {'OK' if diff.item() < 2**-6 else 'DIFFERS'} ({diff.item():.2g})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
