"""commfuse.torch on GPUs, one process per GPU (``torchrun --nproc-per-node P``): the checks of
``torch_checks`` on CUDA tensors (commfuse's kernels), compiled with inductor, and replayed
from CUDA graphs. Prints ``ok <check>`` for each; exits non-zero on the first failure."""

import os

import torch
import torch.distributed as dist

import commfuse.torch as cf
import torch_checks


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch_checks.DEVICE = torch.device("cuda", torch.cuda.current_device())
    checks = [
        ("every_op bfloat16", lambda: torch_checks.every_op(rank, world, "bfloat16")),
        ("every_op float16", lambda: torch_checks.every_op(rank, world, "float16", seed=3)),
        ("layers", lambda: torch_checks.layers_match_one_device(rank, world)),
        ("compile inductor",
         lambda: torch_checks.compiled_block_matches_eager(rank, world, backend="inductor")),
        ("cuda graphs", lambda: torch_checks.graphs_replay_new_inputs(rank, world)),
    ]
    if os.environ.get("COMMFUSE_PEER_ACCESS") == "0":
        # torch.distributed and torch.matmul serve every op: the same semantics, checked the
        # same way (compiling and capturing them is PyTorch's own business)
        checks = checks[:3]
    if world == 1:
        # every op's schema, fake kernel, autograd and aliasing on CUDA tensors (the C++
        # dispatcher kernels where they are loaded); the samples are of a group of one
        group_name = dist.group.WORLD.group_name
        checks.append(("opcheck", lambda: [torch_checks.opcheck_every_op(group_name, dtype)
                                           for dtype in (torch.bfloat16, torch.float16)]))
    for name, run in checks:
        run()
        torch.cuda.synchronize()
        if rank == 0:
            print(f"ok {name} ({world} ranks)", flush=True)
    cf.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
