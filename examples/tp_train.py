"""Train a tensor-parallel transformer block with commfuse.torch, and check it against the same
block trained on one device.

    torchrun --nproc-per-node 2 examples/tp_train.py --device cpu     # any machine (gloo)
    torchrun --nproc-per-node 2 examples/tp_train.py                  # one GPU per rank (NCCL)

The model: token embedding, one pre-norm transformer block (causal self-attention by
``scaled_dot_product_attention``, then a GELU MLP), a final LayerNorm and an output head. The
block is tensor-parallel: q, k, v and fc1 are ``ColumnParallelLinear`` (heads and the MLP's
hidden features split over the ranks), the attention's output projection and fc2
``RowParallelLinear``, with sequence parallelism by default (every rank holds its rows of the
sequence outside the block's GEMMs: all-gather + GEMM in, GEMM + reduce-scatter out). The
parameters outside the split are replicated, and under sequence parallelism their gradients
are summed over the ranks before each step (as Megatron-LM does).

Every rank also trains the one-device model (the same initial weights, the same batches,
AdamW) and the loss of every step must agree within ``--tolerance`` (relative: the tensor-
parallel block computes its GEMMs in bfloat16). Then it times training steps of the commfuse
block beside the same block served by torch.distributed and torch.matmul, and beside PyTorch's
async-TP: the same layers written with torch's functional collectives (the all-gather before a
GEMM, the reduce-scatter after it) and compiled with ``_micro_pipeline_tp``, the inductor pass
that replaces them by symmetric-memory fused operators (CUDA, sequence parallelism; elsewhere
that row runs the functional collectives eagerly, unfused, and says so). It prints tokens/s of
each, and how many all-gather + GEMM and GEMM + reduce-scatter fused operators the pass put
in the compiled code (none is a failure). The logits of every row's first timed step must lie
within ``--logit-tolerance`` of the one-device model's (the largest error over the largest
logit). ``--compile`` compiles the first two rows too. The last line is OK, or what disagreed
(and the exit status is 1).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

import commfuse.torch as cf
from commfuse.torch.nn import ColumnParallelLinear, RowParallelLinear
from tp_mlp import enable_async_tp

c10d = torch.ops._c10d_functional


class Model(nn.Module):
    """The one-device model."""

    def __init__(self, vocab: int, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.ln1, self.ln2, self.ln_f = (nn.LayerNorm(hidden) for _ in range(3))
        self.q, self.k, self.v, self.proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def attention(self, h, q, k, v, heads):
        """Causal attention over the whole sequence of [s, b, heads·d] projections."""
        s, b = q.shape[0], q.shape[1]

        def split(t):  # [s, b, heads·d] -> [b, heads, s, d]
            return t.reshape(s, b, heads, -1).permute(1, 2, 0, 3)

        o = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)

    def block(self, x, heads):
        h = self.ln1(x)
        x = x + self.proj(self.attention(h, self.q(h), self.k(h), self.v(h), heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, tokens):  # tokens [s, b] -> logits [s, b, vocab]
        return self.head(self.ln_f(self.block(self.embed(tokens), self.heads)))


class _GatherRows(torch.autograd.Function):
    """All-gather of dim 0 by torch's functional collectives (the node async-TP's pass fuses
    with the GEMMs that consume it); the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group_name, world):
        ctx.group_name, ctx.world = group_name, world
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, group_name))

    @staticmethod
    def backward(ctx, dy):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(
            dy.contiguous(), "sum", ctx.world, ctx.group_name)), None, None


class _ScatterRows(torch.autograd.Function):
    """Reduce-scatter of dim 0 (fused by the pass with the GEMM that feeds it); the backward
    all-gathers."""

    @staticmethod
    def forward(ctx, x, group_name, world):
        ctx.group_name, ctx.world = group_name, world
        return c10d.wait_tensor(
            c10d.reduce_scatter_tensor(x.contiguous(), "sum", world, group_name))

    @staticmethod
    def backward(ctx, dy):
        return c10d.wait_tensor(
            c10d.all_gather_into_tensor(dy.contiguous(), ctx.world, ctx.group_name)), None, None


class FuncolColumnLinear(ColumnParallelLinear):
    """The column-parallel layer (the same shard, sequence parallel) as async-TP sees it:
    all-gather, then ``torch.mm``."""

    def forward(self, x):
        a, w, out_dtype = self._operands(x, self.in_features)
        y = torch.mm(_GatherRows.apply(a, self.group_name, self.world), w.t())
        y = y if out_dtype is None else y.to(out_dtype)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y.reshape((x.shape[0] * self.world,) + tuple(x.shape[1:-1]) +
                         (self.out_per_rank,))


class FuncolRowLinear(RowParallelLinear):
    """The row-parallel layer (sequence parallel) as async-TP sees it: ``torch.mm``, then
    reduce-scatter."""

    def forward(self, x):
        a, w, out_dtype = self._operands(x, self.in_per_rank)
        y = _ScatterRows.apply(torch.mm(a, w.t()), self.group_name, self.world)
        y = y if out_dtype is None else y.to(out_dtype)
        if self.bias is not None:
            # replicated: its gradient is summed over the ranks with the other replicated
            # parameters' (TensorParallelModel.replicated)
            y = y + self.bias.to(y.dtype)
        return y.reshape((x.shape[0] // self.world,) + tuple(x.shape[1:-1]) +
                         (self.out_features,))


class TensorParallelModel(nn.Module):
    """The same model with its block split over ``group``: built from the one-device model
    with the layers ``column`` and ``row``."""

    def __init__(self, model: Model, group, sequence_parallel: bool,
                 column=ColumnParallelLinear, row=RowParallelLinear):
        super().__init__()
        self.sp = sequence_parallel
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if model.heads % self.world:
            raise SystemExit(f"{model.heads} heads do not split over {self.world} ranks")
        self.heads = model.heads // self.world
        for name in ("embed", "ln1", "ln2", "ln_f", "head"):
            setattr(self, name, copy.deepcopy(getattr(model, name)))
        opts = dict(group=group, sequence_parallel=sequence_parallel)
        for name in ("q", "k", "v", "fc1"):
            setattr(self, name, column.from_linear(getattr(model, name), **opts))
        for name in ("proj", "fc2"):
            setattr(self, name, row.from_linear(getattr(model, name), **opts))

    attention = Model.attention
    block = Model.block

    def replicated(self):
        """The parameters every rank holds whole, whose gradients ``step`` sums over the ranks
        (commfuse's row-parallel layers sum their bias's in their backward)."""
        whole = [p for n in ("embed", "ln1", "ln2", "ln_f", "head")
                 for p in getattr(self, n).parameters()]
        return whole + [layer.bias for layer in (self.proj, self.fc2)
                        if isinstance(layer, FuncolRowLinear) and layer.bias is not None]

    def forward(self, tokens):  # this rank's rows of the sequence under SP, else all of it
        return self.head(self.ln_f(self.block(self.embed(tokens), self.heads)))


def rows(s: int, world: int, rank: int) -> slice:
    base, extra = divmod(s, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def step(model, optimizer, tokens, targets, group, sp):
    """One training step; returns the loss of the whole batch (the same on every rank) and
    this rank's logits."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    # the mean over every token of the batch: each rank's share of the sum
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    loss = loss / (targets.numel() * (dist.get_world_size(group) if sp else 1))
    loss.backward()
    if sp and group is not None:
        for p in model.replicated():
            dist.all_reduce(p.grad, group=group)
    optimizer.step()
    total = loss.detach().clone()
    if sp and group is not None:
        dist.all_reduce(total, group=group)
    return total.item(), logits.detach()


@dataclasses.dataclass
class Variant:
    """One timed build of the block: its layers, its group, whether it is compiled, whether
    async-TP's pass runs on it."""

    label: str
    group: object
    column: type
    row: type
    compiled: bool
    async_tp: bool = False


def async_tp_variant(device, sp, group):
    """PyTorch's async-TP on ``group`` (symmetric memory enabled for it), and why not where it
    cannot run: then its layers run eagerly and unfused (its fused operators have CUDA kernels
    only), or not at all without sequence parallelism."""
    if not sp:
        return None, "it fuses the collectives of sequence-parallel layers only"
    why_not = enable_async_tp(group) if device.type == "cuda" else \
        "its fused operators need CUDA"
    if why_not is None:
        return Variant("PyTorch async-TP", group, FuncolColumnLinear, FuncolRowLinear, True,
                       True), None
    return (Variant("functional collectives, eager", group, FuncolColumnLinear, FuncolRowLinear,
                    False), f"{why_not}: its layers run eagerly, unfused")


def print_rank0(rank, text):
    if rank == 0:
        print(text, flush=True)


def batch(seed, s, b, vocab, device):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (s + 1, b), generator=g).to(device)
    return t[:-1], t[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--no-sequence-parallel", action="store_true")
    ap.add_argument("--tolerance", type=float, default=0.005)
    ap.add_argument("--logit-tolerance", type=float, default=0.01,
                    help="the timed variants' first logits against one device's: the largest"
                         " error over the largest logit")
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--compile", action="store_true",
                    help="compile the commfuse and torch.distributed blocks too")
    args = ap.parse_args()
    if args.steps < 1 or args.seq < 1 or args.batch < 1:
        raise SystemExit("--steps, --seq and --batch must be positive")

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: pass --device cpu")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(args.device, torch.cuda.current_device()) \
        if args.device == "cuda" else torch.device("cpu")
    sp = not args.no_sequence_parallel
    if sp and args.seq % world:
        raise SystemExit(f"--seq {args.seq} must divide by the {world} ranks under sequence"
                         " parallelism")

    torch.manual_seed(0)
    reference = Model(args.vocab, args.hidden, args.heads, args.ffn).to(device)
    tp = TensorParallelModel(reference, group, sp)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-3)
    mine = rows(args.seq, world, rank)
    bad = None
    for i in range(args.steps):
        tokens, targets = batch(i, args.seq, args.batch, args.vocab, device)
        want, _ = step(reference, opt_ref, tokens, targets, None, False)
        got, _ = step(tp, opt_tp, tokens[mine] if sp else tokens, targets[mine] if sp else targets,
                   group, sp)
        off = abs(got - want) / max(abs(want), 1e-6)
        if rank == 0:
            print(f"step {i}: loss {got:.5f}, one device {want:.5f} (relative {off:.2e})")
        if not math.isfinite(got) or off > args.tolerance:
            bad = bad or f"step {i}: loss {got} against {want} on one device"

    # tokens/s: the commfuse block, the same block served by torch.distributed, and async-TP
    baseline_group = dist.new_group(list(range(world)))
    cf.serve_by_torch_distributed(baseline_group)
    variants = [Variant("commfuse", group, ColumnParallelLinear, RowParallelLinear,
                        args.compile),
                Variant("torch.distributed + torch.matmul", baseline_group, ColumnParallelLinear,
                        RowParallelLinear, args.compile)]
    funcol_group = dist.new_group(list(range(world)))
    async_tp, why_not = async_tp_variant(device, sp, funcol_group)
    if why_not is not None:
        print_rank0(rank, f"# PyTorch async-TP not run: {why_not}")
    if async_tp is not None:
        variants.append(async_tp)
    timed, first = {}, {}
    tokens, targets = batch(1000, args.seq, args.batch, args.vocab, device)
    x, y = (tokens[mine], targets[mine]) if sp else (tokens, targets)
    with torch.no_grad():
        want = reference(tokens)[mine if sp else slice(None)].float()
    for v in variants:
        model = TensorParallelModel(reference, v.group, sp, v.column, v.row)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if v.compiled:
            model.compile(fullgraph=True)
        # the pass runs where the forward and backward graphs are compiled: the first step
        with torch._inductor.config.patch(_micro_pipeline_tp=v.async_tp):
            if not v.async_tp:
                first[v.label] = step(model, opt, x, y, v.group, sp)[1]
            else:
                # the compiled code, to count what the pass fused (this resets dynamo's caches)
                (_, first[v.label]), code = run_and_get_code(step, model, opt, x, y, v.group, sp)
                fused = [sum(c.count(f"torch.ops.symm_mem.{op}.default(") for c in code)
                         for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")]
                print_rank0(rank, f"# {v.label}: {fused[0]} all-gather + GEMM and {fused[1]}"
                                  " GEMM + reduce-scatter fused operators in its compiled"
                                  " forward and backward")
                if not all(fused):
                    bad = bad or f"{v.label}: the pass fused {fused} (all-gather + GEMM," \
                                 " GEMM + reduce-scatter)"
            step(model, opt, x, y, v.group, sp)  # warm-up: operators built, kernels compiled
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.timed_steps):
                step(model, opt, x, y, v.group, sp)
            if device.type == "cuda":
                torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank
        timed[v.label] = args.timed_steps * args.seq * args.batch / took.item()
    # every variant's first logits against the one-device model's (bfloat16 GEMMs)
    for label, logits in first.items():
        off = ((logits.float() - want).abs().max() / want.abs().max()).item()
        print_rank0(rank, f"# {label}: logits within {off:.2e} of one device's (the largest"
                          " error over the largest logit)")
        if not math.isfinite(off) or off > args.logit_tolerance:
            bad = bad or f"{label}: logits {off:.2e} off one device's (rank {rank})"
    if rank == 0:
        served = cf.served_by(device)
        for v in variants:
            label, rate, how = v.label, timed[v.label], "compiled" if v.compiled else "eager"
            print(f"{label:34s} {rate:12.0f} tokens/s  ({world} ranks, {device.type}, {how},"
                  f" sequence_parallel={sp}{', served by ' + served if label == 'commfuse' else ''})")
        print(f"FAILED: {bad}" if bad else
              f"OK: {args.steps} steps within {args.tolerance:.1%} of one device's loss")
    # commfuse's operators and its references to the groups go before the groups do
    cf.clear_cache()
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
