"""commfuse.torch against float64 and against PyTorch, one process per GPU.

Run by ``test_torch_gpu.py`` as ``torchrun --nproc-per-node P python/tests/torchrun_ops.py``.
Every rank builds every rank's operands from shared seeds, so each can compute the float64
reference of its own output. Each case: outputs poisoned with NaN before the call, two calls
back to back on one stream with different inputs and M and no synchronisation between them,
every output element within an element-wise bound, and where PyTorch has the same operation
(``dist.reduce_scatter_tensor`` / ``dist.all_gather_into_tensor`` after ``torch.matmul``)
the result compared with PyTorch's too. Then the same operators captured into CUDA graphs and
replayed on new inputs. Exits non-zero on the first failure.
"""

import os
import sys

import torch
import torch.distributed as dist

import commfuse.torch as cf
from commfuse.torch._common import dtype_name
from commfuse.torch._gpu import _collective

UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}


def operands(seed, shapes, dtype):
    """Random tensors of `shapes` in `dtype` (integers / 8 in [-2, 2], exact in both types)
    from `seed`, on the CPU: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(-16, 17, s, generator=g) / 8).to(dtype) for s in shapes]


def bound(abs_products, hops, out_dtype, k):
    """Element-wise bound: the output rounding and one rounding per partial sum handed on
    (`hops`), each relative to the sum of |products|, plus f32 accumulation over k terms."""
    return (hops + 1) * UNIT[out_dtype] * abs_products + k * 2.0**-24 * abs_products + 1e-6


def compare(name, got, want, limit):
    got = got.double().cpu()
    bad = (got - want).abs() > limit
    bad |= ~torch.isfinite(got)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {got.numel()} elements out of bound, first at {i}:"
            f" got {got[tuple(i)].item()}, want {want[tuple(i)].item()} ± {limit[tuple(i)].item()}"
        )


def check_gemm_rs(rank, world, dtype, out_dtype, layout, with_bias, ms, seed):
    dev = torch.device("cuda", rank)
    n, k = 264, 136  # ragged: neither a multiple of a tile
    calls = []
    for c, m in enumerate(ms):
        a_all = operands(seed + 10 * c, [(m, k)] * world, dtype)
        b_all = operands(seed + 10 * c + 5, [(k, n)] * world, dtype)
        bias = operands(seed + 10 * c + 7, [(n,)], out_dtype)[0] if with_bias else None
        a = a_all[rank].to(dev)
        # "nk": the transpose of a row-major [N, K] weight, taken without a copy
        b = b_all[rank].to(dev) if layout == "kn" else b_all[rank].t().contiguous().to(dev).t()
        start, end = torch.tensor_split(torch.arange(m), world)[rank][[0, -1]].tolist()
        out = torch.full((end - start + 1, n), float("nan"), dtype=out_dtype, device=dev)
        calls.append((m, a_all, b_all, bias, a, b, out, (start, end + 1)))
    # back to back on one stream, nothing synchronised between the calls
    for m, _, _, bias, a, b, out, _ in calls:
        cf.gemm_reduce_scatter(a, b, bias=None if bias is None else bias.to(dev), out=out,
                               out_dtype=out_dtype)
    torch.cuda.synchronize()
    for m, a_all, b_all, bias, a, b, out, (start, end) in calls:
        want = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))[start:end]
        absp = sum(x.double().abs() @ y.double().abs() for x, y in zip(a_all, b_all))[start:end]
        if bias is not None:
            want += bias.double()
            absp += bias.double().abs()
        name = f"gemm_reduce_scatter {dtype}->{out_dtype} {layout} bias={with_bias} M={m}"
        compare(name, out, want, bound(absp, world, out_dtype, k * world))
        if m % world == 0 and bias is None:
            # PyTorch's own: matmul, then reduce_scatter_tensor
            full = torch.matmul(a, b)
            theirs = torch.empty(out.shape, dtype=full.dtype, device=dev)
            dist.reduce_scatter_tensor(theirs, full)
            # PyTorch rounds each partial and each sum to the input type
            compare(name + " vs PyTorch", out, theirs.double().cpu(),
                    bound(absp, world, dtype, k * world) + bound(absp, world, out_dtype, k * world))
    return f"gemm_reduce_scatter {dtype}->{out_dtype} {layout} bias={with_bias} M={ms}"


def check_ag_gemm(rank, world, dtype, out_dtype, layout, with_bias, ms, seed, path="overlapped"):
    dev = torch.device("cuda", rank)
    n, k = 264, 136
    calls = []
    for c, m in enumerate(ms):
        a_full, b = operands(seed + 10 * c, [(m, k), (k, n)], dtype)
        bias = operands(seed + 10 * c + 7, [(n,)], out_dtype)[0] if with_bias else None
        mine = torch.tensor_split(a_full, world)[rank].to(dev)
        b_dev = b.to(dev) if layout == "kn" else b.t().contiguous().to(dev).t()
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device=dev)
        gathered = torch.full((m, k), float("nan"), dtype=dtype, device=dev)
        calls.append((m, a_full, b, bias, mine, b_dev, out, gathered))
    for m, _, _, bias, mine, b_dev, out, gathered in calls:
        cf.all_gather_gemm(mine, b_dev, bias=None if bias is None else bias.to(dev), m=m,
                           out=out, gathered=gathered, out_dtype=out_dtype, path=path)
    torch.cuda.synchronize()
    for m, a_full, b, bias, mine, b_dev, out, gathered in calls:
        name = f"all_gather_gemm {path} {dtype}->{out_dtype} {layout} bias={with_bias} M={m}"
        if not torch.equal(gathered.cpu(), a_full):
            raise AssertionError(f"{name}: the gathered A differs from the ranks' chunks")
        want = a_full.double() @ b.double()
        absp = a_full.double().abs() @ b.double().abs()
        if bias is not None:
            want += bias.double()
            absp += bias.double().abs()
        compare(name, out, want, bound(absp, 0, out_dtype, k))
        if m % world == 0:
            theirs = torch.empty((m, k), dtype=dtype, device=dev)
            dist.all_gather_into_tensor(theirs, mine)
            if not torch.equal(theirs, gathered):
                raise AssertionError(f"{name}: differs from PyTorch's all_gather_into_tensor")
    return f"all_gather_gemm {path} {dtype}->{out_dtype} {layout} bias={with_bias} M={ms}"


def check_collectives(rank, world, dtype, seed):
    """Every collective on small integers (exact in every type, so results must be equal to
    float64's and to PyTorch's bit for bit), counts that do not divide by P, two calls back to
    back with new inputs before any synchronisation."""
    dev = torch.device("cuda", rank)
    lines = []

    def ints(s, n):  # every rank's input from shared seeds
        g = torch.Generator().manual_seed(s)
        return [torch.randint(-8, 9, (n,), generator=g).to(dtype) for _ in range(world)]

    def same(name, got, want):
        if not torch.equal(got.cpu().double(), want.double()):
            bad = (got.cpu().double() != want.double()).nonzero()[0].item()
            raise AssertionError(f"{name}: element {bad}: got {got[bad].item()}, want {want[bad].item()}")

    count = 3 * 4096 + 7
    for op, reduce in [("sum", lambda xs: sum(x.double() for x in xs)),
                       ("max", lambda xs: torch.stack([x.double() for x in xs]).amax(0))]:
        calls = [ints(seed + c, count) for c in range(2)]
        tensors = [xs[rank].to(dev) for xs in calls]
        for t in tensors:
            cf.all_reduce(t, op=op)
        torch.cuda.synchronize()
        for xs, t in zip(calls, tensors):
            same(f"all_reduce {op} {dtype}", t, reduce(xs))
            theirs = xs[rank].to(dev)
            dist.all_reduce(theirs, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            same(f"all_reduce {op} {dtype} vs PyTorch", t, theirs.cpu())
    # auto takes the LL protocol for an all-reduce this small (commfuse_core::cost::prefers_ll),
    # when there is a peer to send to
    runs = _collective("all-reduce", count, tensors[0], dist.group.WORLD).algo()
    if world > 1 and runs != "ll":
        raise AssertionError(f"all_reduce of {count} {dtype} ran {runs}, not the LL protocol")
    lines.append(f"all_reduce sum, max {dtype} ({count} elements, back to back, by {runs})")

    count = world * 1000 + 1  # chunks differ by one
    xs = ints(seed + 5, count)
    mine = torch.tensor_split(torch.arange(count), world)[rank]
    out = torch.full((len(mine),), float("nan"), dtype=dtype, device=dev)
    cf.reduce_scatter(out, xs[rank].to(dev))
    torch.cuda.synchronize()
    same(f"reduce_scatter {dtype}", out, sum(x.double() for x in xs)[mine])
    runs = _collective("reduce-scatter", count, out, dist.group.WORLD).algo()
    if world > 1 and runs != "ll":
        raise AssertionError(f"reduce_scatter of {count} {dtype} ran {runs}, not the LL protocol")
    lines.append(f"reduce_scatter {dtype} ({count} elements, by {runs})")

    full = ints(seed + 6, count)[0]
    out = torch.full((count,), float("nan"), dtype=dtype, device=dev)
    cf.all_gather(out, full[mine].to(dev))
    torch.cuda.synchronize()
    same(f"all_gather {dtype}", out, full)
    runs = _collective("all-gather", count, out, dist.group.WORLD).algo()
    if world > 1 and runs != "ll":
        raise AssertionError(f"all_gather of {count} {dtype} ran {runs}, not the LL protocol")
    lines.append(f"all_gather {dtype} ({count} elements, by {runs})")

    count = world * 96
    xs = ints(seed + 7, count)
    out = torch.full((count,), float("nan"), dtype=dtype, device=dev)
    cf.all_to_all(out, xs[rank].to(dev))
    theirs = torch.empty_like(out)
    dist.all_to_all_single(theirs, xs[rank].to(dev))
    torch.cuda.synchronize()
    want = torch.cat([torch.tensor_split(x, world)[rank] for x in xs])
    same(f"all_to_all {dtype}", out, want)
    same(f"all_to_all {dtype} vs PyTorch", out, theirs.cpu())
    lines.append(f"all_to_all {dtype} ({count} elements)")

    cf.barrier()
    lines.append("barrier")
    return lines


def check_collective_paths(rank, world, dtype, seed):
    """Where the collectives go (``cf.collective_path``): past 4 MiB, ``path="auto"`` hands an even message to
    torch.distributed and builds no commfuse collective for it; a ragged one stays with
    commfuse; ``path="commfuse"`` forces commfuse's; ``path="torch"`` on a ragged message and an
    unknown path are refused. Every result equal to float64's bit for bit."""
    from commfuse import _operators
    from commfuse._commfuse import prefers_commfuse_on_user_buffers

    if world == 1:
        # one rank has no ragged message and nothing to route: the checks below need peers
        return [f"collective paths {dtype}: not checked on one rank"]
    dev = torch.device("cuda", rank)
    name = dtype_name(dtype, "x")
    lines = []

    def past(op):  # the first count divisible by P that commfuse leaves to NCCL
        count = world
        while prefers_commfuse_on_user_buffers(op, world, count, name):
            count += world * 4096
        return count

    def ints(s, n):
        g = torch.Generator().manual_seed(s)
        return [torch.randint(-8, 9, (n,), generator=g).to(dtype) for _ in range(world)]

    def built(kind, count):
        key = (rank, kind, count, name, "sum")
        return _operators.lookup("collective", dist.group.WORLD, key) is not None

    def went(op, count, goes, path):
        kind = op.replace("_", "-")
        if cf.collective_path(kind, count, dtype, None, True, path) != goes or built(kind, count) != (
                goes == "commfuse"):
            raise AssertionError(f"{op} path={path} of {count} {dtype} did not go to {goes}")
        lines.append(f"{op} {dtype} of {count} elements, path={path}: by {goes}")

    big = past("all-reduce")
    for path, goes in [("auto", "torch.distributed"), ("commfuse", "commfuse")]:
        xs = ints(seed + len(path), big)
        t = xs[rank].to(dev)
        cf.all_reduce(t, path=path)
        torch.cuda.synchronize()
        if not torch.equal(t.cpu().double(), sum(x.double() for x in xs)):
            raise AssertionError(f"all_reduce path={path} of {big} {dtype}: wrong sum")
        went("all_reduce", big, goes, path)
    count = past("reduce-scatter")
    for n, goes in [(count, "torch.distributed"), (count + 1, "commfuse")]:  # even, ragged
        xs = ints(seed + n, n)
        mine = torch.tensor_split(torch.arange(n), world)[rank]
        out = torch.full((len(mine),), float("nan"), dtype=dtype, device=dev)
        cf.reduce_scatter(out, xs[rank].to(dev))
        torch.cuda.synchronize()
        if not torch.equal(out.cpu().double(), sum(x.double() for x in xs)[mine]):
            raise AssertionError(f"reduce_scatter of {n} {dtype}: wrong sum")
        if goes == "commfuse":  # a ragged message: torch.distributed cannot split it
            if not built("reduce-scatter", n):
                raise AssertionError(f"reduce_scatter of {n} {dtype} (ragged) left commfuse")
            lines.append(f"reduce_scatter {dtype} of {n} elements (ragged): by commfuse")
        else:
            went("reduce_scatter", n, goes, "auto")
    for what, call in [
        ("ragged path=torch", lambda: cf.reduce_scatter(out, xs[rank].to(dev), path="torch")),
        ("unknown path", lambda: cf.all_gather(out, out, path="nccl")),
    ]:
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"{what} was not refused")
    lines.append("path=torch on a ragged message and an unknown path raise ValueError")
    return lines


def captured(make, warm_up=True):
    """A CUDA graph of `make()`'s calls (after one eager warm-up call of each, on a side stream
    as PyTorch recommends), and what the calls returned (the graph's static outputs)."""
    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            make()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = make()
    return graph, outs


def check_graphs(rank, world):
    """Calls captured into a CUDA graph and replayed three times, each replay on new inputs
    copied into the graph's inputs and with its outputs poisoned, an eager call of the same
    operator on other inputs queued between two replays, nothing synchronised in between:
    every output element against float64. Each graph holds two calls (a ragged M and M < P
    rows, or an even M and a ragged one), so replays go through both sets of buffers and
    flags."""
    dev = torch.device("cuda", rank)
    n, k, dtype = 264, 136, torch.bfloat16
    lines = []

    def rs_want(a_all, b_all, m):
        start, end = torch.tensor_split(torch.arange(m), world)[rank][[0, -1]].tolist() \
            if m >= world or rank < m else (0, -1)
        want = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))[start:end + 1]
        absp = sum(x.double().abs() @ y.double().abs() for x, y in zip(a_all, b_all))
        return want, bound(absp[start:end + 1], world, dtype, k * world)

    for path, ms in [("auto", [2 * world * 37 + 1, 1]), ("fused", [2 * world * 37 + 1, 1]),
                     ("unfused", [2 * world * 40, 2 * world * 37 + 1])]:
        b = torch.empty((k, n), dtype=dtype, device=dev)
        a = [torch.empty((m, k), dtype=dtype, device=dev) for m in ms]

        def load(seed):
            b_all = operands(seed, [(k, n)] * world, dtype)
            b.copy_(b_all[rank])
            a_alls = [operands(seed + 1 + i, [(m, k)] * world, dtype) for i, m in enumerate(ms)]
            for x, a_all in zip(a, a_alls):
                x.copy_(a_all[rank])
            return a_alls, b_all

        load(500)
        graph, outs = captured(lambda: [cf.gemm_reduce_scatter(x, b, path=path) for x in a])
        taken = cf.operator_path(ms[0], b, path=path)
        for replay in range(3):
            a_alls, b_all = load(600 + 10 * replay)
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            if replay == 1:
                # an eager call between replays, on its own inputs
                e_all = operands(700, [(ms[0], k)] * world, dtype)
                eager = cf.gemm_reduce_scatter(e_all[rank].to(dev), b, path=path)
            torch.cuda.synchronize()
            for m, a_all, o in zip(ms, a_alls, outs):
                want, limit = rs_want(a_all, b_all, m)
                compare(f"graph gemm_reduce_scatter path={path} replay {replay} M={m}", o, want,
                        limit)
            if replay == 1:
                want, limit = rs_want(e_all, b_all, ms[0])
                compare(f"eager gemm_reduce_scatter path={path} between replays", eager, want,
                        limit)
        lines.append(f"gemm_reduce_scatter path={path} ({taken}) in a CUDA graph: M={ms},"
                     " 3 replays, an eager call between")

    # all-gather + GEMM: an even M then a ragged one, the gathered A returned (the larger M
    # first: a call of more rows than the cached operator's builds a new one, whose M are new)
    ms = [2 * world * 40, 2 * world * 37 + 1]
    b = torch.empty((k, n), dtype=dtype, device=dev)
    fulls = [torch.empty((m, k), dtype=dtype) for m in ms]
    mine = [torch.empty_like(torch.tensor_split(f, world)[rank], device=dev) for f in fulls]

    def load_ag(seed):
        b.copy_(operands(seed, [(k, n)], dtype)[0])
        for i, (f, x) in enumerate(zip(fulls, mine)):
            f.copy_(operands(seed + 1 + i, [f.shape], dtype)[0])
            x.copy_(torch.tensor_split(f, world)[rank])

    load_ag(800)
    graph, outs = captured(lambda: [cf.all_gather_gemm(x, b, m=m, return_a=True)
                                    for x, m in zip(mine, ms)])
    for replay in range(3):
        load_ag(900 + 10 * replay)
        for out, gathered in outs:
            out.fill_(float("nan"))
            gathered.fill_(float("nan"))
        graph.replay()
        if replay == 1:
            eager = cf.all_gather_gemm(mine[1].clone(), b, m=ms[1])
        torch.cuda.synchronize()
        b_cpu = b.double().cpu()
        for m, f, (out, gathered) in zip(ms, fulls, outs):
            name = f"graph all_gather_gemm replay {replay} M={m}"
            if not torch.equal(gathered.cpu(), f):
                raise AssertionError(f"{name}: the gathered A differs")
            compare(name, out, f.double() @ b_cpu, bound(f.double().abs() @ b_cpu.abs(), 0, dtype, k))
        if replay == 1:
            compare("eager all_gather_gemm between replays", eager, fulls[1].double() @ b_cpu,
                    bound(fulls[1].double().abs() @ b_cpu.abs(), 0, dtype, k))
    lines.append(f"all_gather_gemm in a CUDA graph: M={ms}, return_a, 3 replays, an eager call between")

    # collectives: two all-reduces and an all-gather per replay
    count = 3 * 4096 + 7
    xs = [torch.empty(count, dtype=torch.float32, device=dev) for _ in range(2)]
    part = torch.empty(count // world, dtype=torch.float32, device=dev)
    gathered = torch.empty(count // world * world, dtype=torch.float32, device=dev)

    def ints(seed, size):
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(-8, 9, (size,), generator=g).float() for _ in range(world)]

    def make():
        for x in xs:
            cf.all_reduce(x)
        cf.all_gather(gathered, part)
        return xs + [gathered]

    for x, v in zip(xs, [ints(1000 + i, count) for i in range(2)]):
        x.copy_(v[rank])
    graph, _ = captured(make)
    for replay in range(3):
        inputs = [ints(1100 + 10 * replay + i, count) for i in range(2)]
        parts = ints(1200 + replay, count // world)
        for x, v in zip(xs, inputs):
            x.copy_(v[rank])
        part.copy_(parts[rank])
        gathered.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (x, v) in enumerate(zip(xs, inputs)):
            if not torch.equal(x.cpu().double(), sum(t.double() for t in v)):
                raise AssertionError(f"graph all_reduce {i} replay {replay} differs")
        if not torch.equal(gathered.cpu(), torch.cat(parts)):
            raise AssertionError(f"graph all_gather replay {replay} differs")
    lines.append("all_reduce x2 + all_gather in a CUDA graph: 3 replays")

    # what cannot be captured says so, in one line, and leaves the operator usable
    a = torch.zeros((96, k), dtype=dtype, device=dev)
    a64 = torch.zeros((96, 64), dtype=dtype, device=dev)
    for what, make, warm, says in [
        ("overlapped path", lambda: cf.gemm_reduce_scatter(a, b, path="overlapped"), True,
         "cannot be captured into a CUDA graph"),
        ("an M never called before", lambda: cf.gemm_reduce_scatter(a[:90], b, path="fused"),
         False, "call it once before capturing"),
        ("a shape never called before", lambda: cf.gemm_reduce_scatter(a64, b[:64]),
         False, "call it once before capturing"),
    ]:
        if not warm:
            cf.gemm_reduce_scatter(a, b, path="fused")  # builds the operator, prepares M = 96
        try:
            captured(make, warm_up=warm)
        except (ValueError, RuntimeError) as e:
            if says not in str(e) or "\n" in str(e):
                raise AssertionError(f"graph of the {what}: unexpected error {e!r}")
            lines.append(f"capturing the {what} is refused: {e}")
            continue
        raise AssertionError(f"graph of the {what}: no error")
    return lines


class OnlyDLPack:
    """A tensor seen as a framework other than PyTorch offers it: DLPack only."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class OnlyCai:
    """A tensor offered through the CUDA array interface only (as Numba or older CuPy do)."""

    def __init__(self, t):
        self.t = t  # the array owns its memory, as a framework's array object does
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def check_neutral(rank, world):
    """commfuse.cuda, the framework-neutral face: tensors passed as bare DLPack producers
    (bfloat16) or CUDA-array-interface objects (float16, float32), the rendezvous an all-gather
    of bytes (here torch.distributed's, as mpi4py's would serve), the caller's stream passed
    explicitly; every output element against float64."""
    import commfuse.cuda as cn

    def all_gather(data):
        got = [None] * world
        dist.all_gather_object(got, data)
        return got

    group = cn.Group(rank, world, all_gather)
    stream = torch.cuda.current_stream()
    dev = torch.device("cuda", rank)
    n, k, lines = 264, 136, []
    for dtype, wrap in [(torch.bfloat16, OnlyDLPack), (torch.float16, OnlyCai)]:
        for m in [2 * world * 37 + 1, world * 40]:
            a_all = operands(40 + m, [(m, k)] * world, dtype)
            w_all = operands(41 + m, [(n, k)] * world, dtype)  # row-major [N, K] weights
            bias = operands(42 + m, [(n,)], dtype)[0]
            start, end = torch.tensor_split(torch.arange(m), world)[rank][[0, -1]].tolist()
            out = torch.full((end - start + 1, n), float("nan"), dtype=dtype, device=dev)
            w = w_all[rank].to(dev)
            # B as w.t() (the "nk" layout, through the producer's strides)
            cn.gemm_reduce_scatter(wrap(a_all[rank].to(dev)), wrap(w.t()), wrap(out), group,
                                   bias=wrap(bias.to(dev)), stream=stream)
            torch.cuda.synchronize()
            want = sum(x.double() @ y.double().t() for x, y in zip(a_all, w_all))
            absp = sum(x.double().abs() @ y.double().abs().t() for x, y in zip(a_all, w_all))
            want = want[start:end + 1] + bias.double()
            limit = bound(absp[start:end + 1] + bias.double().abs(), world, dtype, k * world)
            compare(f"commfuse.cuda gemm_reduce_scatter {dtype} M={m}", out, want, limit)

            full = operands(43 + m, [(m, k)], dtype)[0]
            mine = torch.tensor_split(full, world)[rank].to(dev)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
            gathered = torch.full((m, k), float("nan"), dtype=dtype, device=dev)
            path = "fused" if m % 2 else "overlapped"  # the ragged M fused, the even one not
            cn.all_gather_gemm(wrap(mine), wrap(w.t()), wrap(out), group,
                               gathered=wrap(gathered), stream=stream.cuda_stream, path=path)
            torch.cuda.synchronize()
            if not torch.equal(gathered.cpu(), full):
                raise AssertionError(f"commfuse.cuda all_gather_gemm {dtype} M={m}: gathered A")
            w_cpu = w_all[rank].double()
            compare(f"commfuse.cuda all_gather_gemm {dtype} M={m}", out, full.double() @ w_cpu.t(),
                    bound(full.double().abs() @ w_cpu.abs().t(), 0, dtype, k))
        lines.append(f"commfuse.cuda gemm_reduce_scatter, all_gather_gemm {dtype} through"
                     f" {wrap.__name__} (w.t(), bias, gathered A, ragged M fused and even M"
                     f" overlapped)")
    count = 3 * 4096 + 7
    g = torch.Generator().manual_seed(77)
    xs = [torch.randint(-8, 9, (count,), generator=g).float() for _ in range(world)]
    x = xs[rank].to(dev)
    cn.all_reduce(OnlyCai(x), group, stream=stream)
    parts = torch.full((count // world * world,), float("nan"), device=dev)
    cn.all_gather(OnlyCai(parts), OnlyCai(x[: count // world]), group, stream=stream)
    torch.cuda.synchronize()
    total = sum(t.double() for t in xs)
    if not torch.equal(x.cpu().double(), total):
        raise AssertionError("commfuse.cuda all_reduce differs")
    if not torch.equal(parts.cpu().double(), total[: count // world].repeat(world)):
        raise AssertionError("commfuse.cuda all_gather differs")
    lines.append("commfuse.cuda all_reduce, all_gather f32 through OnlyCai")
    return lines


def check_bad_input(rank, world):
    dev = torch.device("cuda", rank)
    a = torch.zeros((64, 32), dtype=torch.bfloat16, device=dev)
    cases = [
        ("mismatched dtypes", lambda: cf.gemm_reduce_scatter(
            a, torch.zeros((32, 16), dtype=torch.float16, device=dev))),
        ("K mismatch", lambda: cf.gemm_reduce_scatter(
            a, torch.zeros((48, 16), dtype=torch.bfloat16, device=dev))),
        # (CPU tensors alone are served, by the simulator: not bad input)
        ("a on the GPU, b on the host", lambda: cf.gemm_reduce_scatter(a, a.cpu().t())),
        ("f32 inputs", lambda: cf.gemm_reduce_scatter(a.float(), a.float().t())),
        ("wrong out", lambda: cf.all_gather_gemm(
            a, torch.zeros((32, 16), dtype=torch.bfloat16, device=dev),
            out=torch.zeros((3, 3), dtype=torch.bfloat16, device=dev))),
        ("chunk mismatch", lambda: cf.all_gather_gemm(
            a, torch.zeros((32, 16), dtype=torch.bfloat16, device=dev), m=64 * world + world)),
        ("unknown all_gather_gemm path", lambda: cf.all_gather_gemm(
            a, torch.zeros((32, 16), dtype=torch.bfloat16, device=dev), path="ring")),
        ("reduce_scatter sizes", lambda: cf.reduce_scatter(
            torch.zeros(5, device=dev), torch.zeros(64, device=dev))),
        ("unknown reduce op", lambda: cf.all_reduce(torch.zeros(8, device=dev), op="avg")),
        ("integer tensor", lambda: cf.all_reduce(torch.zeros(8, dtype=torch.int32, device=dev))),
    ]
    for what, call in cases:
        try:
            call()
        except ValueError as e:
            if "\n" in str(e):
                raise AssertionError(f"{what}: error of more than one line: {e!r}")
            continue
        raise AssertionError(f"{what}: no ValueError raised")
    return f"bad input raises ValueError ({len(cases)} cases)"


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    results = [check_bad_input(rank, world)]
    for dtype in [torch.float32, torch.bfloat16]:
        results.extend(check_collectives(rank, world, dtype, 1000))
        results.extend(check_collective_paths(rank, world, dtype, 2000))
    seed = 1
    for dtype, out_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]:
        for layout in ["nk", "kn"]:
            for with_bias in [False, True]:
                seed += 100
                # a ragged M (not a multiple of P) then an even one, back to back
                ms = [2 * world * 37 + 1, 2 * world * 40]
                results.append(check_gemm_rs(rank, world, dtype, out_dtype, layout, with_bias,
                                             ms, seed))
                results.append(check_ag_gemm(rank, world, dtype, out_dtype, layout, with_bias,
                                             ms, seed))
                results.append(check_ag_gemm(rank, world, dtype, out_dtype, layout, with_bias,
                                             ms, seed + 50, path="fused"))
    # forced paths of GEMM + reduce-scatter, and a larger M than the cached operator's limit
    # (the overlapped path also with one NUMA group per rank: its 2D ring's code, every hand-on
    # across groups)
    for path, groups in [("fused", 1), ("overlapped", 1), ("overlapped", world)]:
        dev = torch.device("cuda", rank)
        a_all = operands(7, [(600, 128)] * world, torch.bfloat16)
        b_all = operands(8, [(128, 256)] * world, torch.bfloat16)
        out = cf.gemm_reduce_scatter(a_all[rank].to(dev), b_all[rank].to(dev), path=path,
                                     numa_groups=groups)
        torch.cuda.synchronize()
        start, end = torch.tensor_split(torch.arange(600), world)[rank][[0, -1]].tolist()
        want = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))[start:end + 1]
        absp = sum(x.double().abs() @ y.double().abs() for x, y in zip(a_all, b_all))
        compare(f"path={path} numa_groups={groups}", out, want,
                bound(absp[start:end + 1], world, torch.bfloat16, 128 * world))
        took = cf.operator_path(600, b_all[rank].to(dev), path=path, numa_groups=groups)
        results.append(f"gemm_reduce_scatter path={path} numa_groups={groups} ({took})")
    results.extend(check_graphs(rank, world))
    results.extend(check_neutral(rank, world))
    dist.barrier()
    if rank == 0:
        for line in results:
            print("ok", line, flush=True)
    cf.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # report which rank failed, then fail the job
        print(f"rank {os.environ.get('RANK')}: FAILED: {e}", file=sys.stderr, flush=True)
        raise
