"""A tensor-parallel MLP block's forward in bf16 with commfuse, one process per GPU.

    torchrun --standalone --nproc-per-node 2 examples/tp_mlp.py [--tokens 2048,8192]

The block of a sequence-parallel transformer layer (Megatron's layout): each rank holds its
chunk of the tokens x [S/P, H], its column shard of the up projection w1 [F/P, H] and its row
shard of the down projection w2 [H, F/P];

    h = gelu(all_gather(x) @ w1.t())          all-gather + GEMM    [S, F/P]
    y = reduce_scatter(h @ w2.t())            GEMM + reduce-scatter [S/P, H]

run three ways in one process: commfuse's fused operators, the same block with NCCL
(``all_gather_into_tensor``, ``torch.matmul``, ``reduce_scatter_tensor``), and PyTorch's
async-TP operators (``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``) where this PyTorch runs them. Each output is checked against
the block computed on one GPU in float32, then the three are timed with CUDA events, rows
interleaved in rounds, medians of the slowest rank.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import commfuse.torch as cf


def commfuse_block(x, w1, w2, group):
    h = F.gelu(cf.all_gather_gemm(x, w1.t(), group))
    return cf.gemm_reduce_scatter(h, w2.t(), group)


def nccl_block(x, w1, w2, group):
    world = dist.get_world_size(group)
    xg = torch.empty((x.shape[0] * world, x.shape[1]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(xg, x, group=group)
    p = F.gelu(xg @ w1.t()) @ w2.t()
    y = torch.empty((p.shape[0] // world, p.shape[1]), dtype=p.dtype, device=p.device)
    dist.reduce_scatter_tensor(y, p, group=group)
    return y


def async_tp_block(x, w1, w2, group):
    name = group.group_name
    _, (h,) = torch.ops.symm_mem.fused_all_gather_matmul(x, [w1.t()], 0, name)
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(F.gelu(h), w2.t(), "sum", 0, name)


def enable_async_tp(group):
    """Whether PyTorch's async-TP operators run here, and why not when they don't."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return None
    except Exception as e:  # any PyTorch without them
        return f"{type(e).__name__}: {e}".splitlines()[0]


def time_blocks(blocks, args, group):
    """Per block, on the slowest rank: the median ms per call, the min and max of the rounds'
    times, and the median host ms per call (the time to queue a round's calls: a loop whose host
    time matches its GPU time is bound by the host, not by the GPU)."""
    for f in blocks.values():
        for _ in range(args.warmup):
            f()
    per_round = {name: [] for name in blocks}
    host = {name: [] for name in blocks}
    for _ in range(args.rounds):
        for name, f in blocks.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier(group=group)
            start.record()
            began = time.perf_counter()
            for _ in range(args.iters):
                f()
            host[name].append((time.perf_counter() - began) * 1e3 / args.iters)
            end.record()
            end.synchronize()
            per_round[name].append(start.elapsed_time(end) / args.iters)
    rows = {}
    for name, times in per_round.items():
        t = torch.tensor([statistics.median(times), min(times), max(times),
                          statistics.median(host[name])], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank
        rows[name] = t.tolist()
    return rows


def timed_run(parser, iters):
    """Adds the timing options (`time_blocks`'s) to `parser`, parses, and joins the process group
    (NCCL, rank r on GPU r): the arguments, rank, world and group."""
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    return args, rank, world, dist.group.WORLD


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,8192", help="S, comma-separated")
    parser.add_argument("--hidden", type=int, default=8192, help="H")
    parser.add_argument("--ffn", type=int, default=28672, help="F (all ranks together)")
    args, rank, world, group = timed_run(parser, 10)
    no_async_tp = enable_async_tp(group)
    H, Fr = args.hidden, args.ffn // world
    g = torch.Generator(device="cuda").manual_seed(0)
    # the whole weights, the same on every rank (a fixed seed), then this rank's shards
    w1_full = torch.randn((args.ffn, H), generator=g, device="cuda", dtype=torch.bfloat16) / H**0.5
    w2_full = torch.randn((H, args.ffn), generator=g, device="cuda", dtype=torch.bfloat16)
    w2_full /= args.ffn**0.5
    w1 = w1_full[rank * Fr:(rank + 1) * Fr].contiguous()
    w2 = w2_full[:, rank * Fr:(rank + 1) * Fr].contiguous()
    if rank == 0:
        print(f"# tensor-parallel MLP forward, bf16, P = {world}, H = {H}, F = {args.ffn}")
        if no_async_tp:
            print(f"# PyTorch async-TP does not run here: {no_async_tp}")
    for S in [int(s) for s in args.tokens.split(",")]:
        x_full = torch.randn((S, H), generator=g, device="cuda", dtype=torch.bfloat16)
        x = torch.tensor_split(x_full, world)[rank].contiguous()
        blocks = {
            "commfuse (AG+GEMM, GEMM+RS)": lambda: commfuse_block(x, w1, w2, group),
            "NCCL + torch.matmul": lambda: nccl_block(x, w1, w2, group),
        }
        if not no_async_tp:
            blocks["PyTorch async-TP (symm_mem)"] = lambda: async_tp_block(x, w1, w2, group)
        # the block on one GPU, in float32: this rank's rows of it
        h32 = F.gelu(x_full.float() @ w1_full.float().t())
        want = torch.tensor_split(h32 @ w2_full.float().t(), world)[rank]
        scale = torch.tensor_split(h32.abs() @ w2_full.float().abs().t(), world)[rank]
        del h32
        checks = {}
        for name, f in list(blocks.items()):
            try:
                got = f().float()
            except Exception as e:
                checks[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                del blocks[name]
                continue
            # bf16 rounding of x·w1, of h and of the output, each relative to |h|·|w2|, per
            # element; and the whole output's relative error, which that bound alone would
            # let a missing part of the reduction pass (|h|·|w2| grows with F, the output only
            # with its square root): rounding gives about 2^-8, a rank's partial missing ~0.3
            excess = ((got - want).abs() - 6 * 2.0**-8 * scale).max()
            relative = (got - want).norm() / want.norm()
            worst = torch.stack([excess, relative])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)  # any rank's
            excess, relative = worst.tolist()
            checks[name] = ("OK" if excess <= 1e-3 and relative <= 2e-2 else
                            f"OUT OF BOUND by {excess:.3g}, relative error {relative:.3g}")
        rows = time_blocks(blocks, args, group)
        if rank == 0:
            base = rows.get("NCCL + torch.matmul", [float("nan")])[0]
            flop = 2 * 2 * S * H * Fr  # two GEMMs per rank
            print(f"\n## S = {S} tokens (each rank: [{S}, {H}] x [{H}, {Fr}] and "
                  f"[{S}, {Fr}] x [{Fr}, {H}])")
            print(f"{'block':>30} {'time(ms)':>10} {'rounds min-max':>16} {'TFLOP/s':>9}"
                  f" {'vs NCCL':>8}  check")
            for name, check in checks.items():
                if name not in rows:
                    print(f"{name:>30} {'-':>10} {'':>16} {'':>9} {'':>8}  {check}")
                    continue
                med, lo, hi, _ = rows[name]
                print(f"{name:>30} {med:10.4f} {lo:7.4f}-{hi:<8.4f} {flop / med / 1e9:9.1f}"
                      f" {base / med:7.2f}x  {check}")
    cf.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
