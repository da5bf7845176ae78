"""What each rank checks in the PyTorch tests (run by ``test_torch_cpu.py`` in P processes,
CPU tensors on a gloo group): every op's output and every gradient against float64 computed by
PyTorch's autograd on the whole group's operands, which every rank builds from shared seeds."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist

import commfuse.torch as cf
import commfuse.torch.functional as cff
from torch_ranks import check, operands, rows_of


#: where the ops under test run (the references always on the CPU): set by the runner
DEVICE = torch.device("cpu")


@contextlib.contextmanager
def counted_exchanges():
    """A list that gains an entry for every exchange of requests between ranks
    (``dist.all_gather_object``) made inside the block."""
    counted = []
    exchange = dist.all_gather_object

    def counting(*args, **kwargs):
        counted.append(1)
        return exchange(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        yield counted
    finally:
        dist.all_gather_object = exchange


def _on(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.detach().to(device=DEVICE, dtype=dtype)


def _leaf(x: torch.Tensor, dtype) -> torch.Tensor:
    return _on(x, dtype).requires_grad_()


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A float64 leaf of its own (the operands stay untouched)."""
    return x.detach().clone().requires_grad_()


def _weight_view(b: torch.Tensor, layout: str) -> torch.Tensor:
    """``b`` [K, N] as the op gets it: row-major ("kn") or the transpose of a row-major
    [N, K] weight ("nk")."""
    return b if layout == "kn" else b.t().contiguous().t()


def gemm_reduce_scatter_grads(rank, world, dtype, seed):
    """Y_r = (Σ_s A_s B_s)[rows_r] + bias and its gradients in A, B and the bias, against
    float64 autograd on every rank's operands (and on their magnitudes, for the bound)."""
    n, k = 24, 16
    for case, (layout, with_bias, out_dtype, m, path) in enumerate([
        ("kn", False, None, 3 * world + 2, "auto"),
        ("nk", True, None, 2 * world + 1, "fused"),
        ("nk", True, torch.float32, 5 * world, "overlapped"),
        ("kn", True, torch.float32, world + 1, "unfused"),
    ]):
        s = seed + 100 * case
        a = operands(s, [(m, k)] * world)
        b = operands(s + 1, [(k, n)] * world)
        # the bias is replicated (the op adds it once); each rank's copy gets its rows' part
        # of the gradient
        bias = operands(s + 2, [(n,)]) * world
        rows = rows_of(m, world)
        grads = operands(s + 3, [(len(rows[r]), n) for r in range(world)])

        def reference(a, b, bias, grads, abs_values: bool):
            f = (lambda t: t.abs()) if abs_values else (lambda t: t)
            a, b, bias = ([_fresh(f(x)) for x in t] for t in (a, b, bias))
            total = sum(x @ y for x, y in zip(a, b))
            ys = [total[rows[r]] + (bias[r] if with_bias else 0) for r in range(world)]
            sum((y * f(g)).sum() for y, g in zip(ys, grads)).backward()
            return ys[rank].detach(), a[rank].grad, b[rank].grad, bias[rank].grad

        want = reference(a, b, bias, grads, False)
        scale = reference(a, b, bias, grads, True)
        ra, rb = _leaf(a[rank], dtype), _leaf(b[rank], dtype)
        rbias = _leaf(bias[rank], out_dtype or dtype) if with_bias else None
        y = cf.gemm_reduce_scatter(ra, _weight_view(rb, layout), bias=rbias, out_dtype=out_dtype,
                                   path=path)
        out_t = out_dtype or dtype
        assert y.dtype == out_t, (y.dtype, out_t)
        name = (f"gemm_reduce_scatter {path} {layout} bias={with_bias} out={out_t} M={m}"
                f" rank {rank}")
        check(name, y, want[0], scale[0], out_t)
        y.backward(_on(grads[rank], out_t))
        check(name + " dA", ra.grad, want[1], scale[1], dtype)
        check(name + " dB", rb.grad, want[2], scale[2], dtype)
        if with_bias:
            check(name + " dbias", rbias.grad, want[3], scale[3], out_t)


def all_gather_gemm_grads(rank, world, dtype, seed):
    """Z_s = AG(X)·B_s + bias_s and its gradients, ragged chunks of X, the gathered A returned
    (and its gradient taken) or not, kept for the backward or gathered again."""
    n, k = 24, 16
    for case, (layout, with_bias, return_a, save, m) in enumerate([
        ("kn", True, False, True, 3 * world + 1),
        ("nk", False, True, True, 2 * world + 3),
        ("nk", True, False, False, 4 * world),
    ]):
        s = seed + 100 * case
        rows = rows_of(m, world)
        x = operands(s, [(m, k)])[0]
        b = operands(s + 1, [(k, n)] * world)
        bias = operands(s + 2, [(n,)] * world)
        grads = operands(s + 3, [(m, n)] * world)
        ggrads = operands(s + 4, [(m, k)] * world)

        def reference(abs_values: bool):
            f = (lambda t: t.abs()) if abs_values else (lambda t: t)
            xs = [_fresh(f(x[r])) for r in rows]
            bs, biases = ([_fresh(f(t)) for t in ts] for ts in (b, bias))
            gathered = torch.cat(xs)
            zs = [gathered @ bs[r] + (biases[r] if with_bias else 0) for r in range(world)]
            loss = sum((z * f(g)).sum() for z, g in zip(zs, grads))
            if return_a:
                loss = loss + sum((gathered * f(g)).sum() for g in ggrads)
            loss.backward()
            return zs[rank].detach(), xs[rank].grad, bs[rank].grad, biases[rank].grad

        want, scale = reference(False), reference(True)
        ra, rb = _leaf(x[rows[rank]], dtype), _leaf(b[rank], dtype)
        rbias = _leaf(bias[rank], dtype) if with_bias else None
        got = cf.all_gather_gemm(ra, _weight_view(rb, layout), bias=rbias, m=m,
                                 return_a=return_a, save_gathered=save)
        name = f"all_gather_gemm {layout} bias={with_bias} return_a={return_a} M={m} rank {rank}"
        if return_a:
            z, gathered = got
            assert torch.equal(gathered.double().cpu(), x), name + ": gathered A"
            torch.autograd.backward([z, gathered], [_on(grads[rank], dtype),
                                                    _on(ggrads[rank], dtype)])
        else:
            z = got
            z.backward(_on(grads[rank], dtype))
        check(name, z, want[0], scale[0], dtype)
        check(name + " dA", ra.grad, want[1], scale[1], dtype)
        check(name + " dB", rb.grad, want[2], scale[2], dtype)
        if with_bias:
            check(name + " dbias", rbias.grad, want[3], scale[3], dtype)


def functional_collective_grads(rank, world, dtype, seed):
    """The functional collectives and their adjoints, ragged rows with and without inner
    dimensions."""
    for case, (rows, inner) in enumerate([(3 * world + 1, ()), (2 * world + 1, (3,)),
                                          (2 * world, (2, 2))]):
        s = seed + 100 * case
        xs = operands(s, [(rows,) + inner] * world)
        parts = rows_of(rows, world)
        name = f"{rows}x{inner} rank {rank}"

        def leaf():
            return _leaf(xs[rank], dtype)

        # all-reduce: every rank's sum; its gradient the sum of every rank's upstream gradient
        g = operands(s + 1, [(rows,) + inner] * world)
        x = leaf()
        y = cff.all_reduce(x)
        check("all_reduce " + name, y, sum(xs), sum(t.abs() for t in xs), dtype)
        y.backward(_on(g[rank], dtype))
        check("all_reduce grad " + name, x.grad, sum(g), sum(t.abs() for t in g), dtype)
        # reduce-scatter: this rank's rows; its gradient the gathered upstream gradients
        gs = operands(s + 2, [(len(parts[r]),) + inner for r in range(world)])
        x = leaf()
        y = cff.reduce_scatter_tensor(x)
        total = sum(xs)
        check("reduce_scatter " + name, y, total[parts[rank]],
              sum(t.abs() for t in xs)[parts[rank]], dtype)
        y.backward(_on(gs[rank], dtype))
        assert torch.equal(x.grad.double().cpu(), torch.cat(gs)), "reduce_scatter grad " + name
        # all-gather: the rows of every rank; its gradient this rank's rows of the summed
        # upstream gradients
        mine = _leaf(xs[0][parts[rank]], dtype)
        y = cff.all_gather_tensor(mine, rows=rows)
        assert torch.equal(y.double().cpu(), xs[0]), "all_gather " + name
        y.backward(_on(g[rank], dtype))
        check("all_gather grad " + name, mine.grad, sum(g)[parts[rank]],
              sum(t.abs() for t in g)[parts[rank]], dtype)
        # all-to-all (equal chunks): chunk j of rank i to rank j; its own adjoint
        if xs[0].numel() % world == 0:
            flat = [t.reshape(-1) for t in xs]
            size = flat[0].numel() // world
            x = leaf()
            y = cff.all_to_all_single(x)
            want = torch.cat([f[rank * size:(rank + 1) * size] for f in flat]).reshape(x.shape)
            assert torch.equal(y.double().cpu(), want), "all_to_all " + name
            y.backward(_on(g[rank], dtype))
            gflat = [t.reshape(-1) for t in g]
            back = torch.cat([gj[rank * size:(rank + 1) * size] for gj in gflat])
            assert torch.equal(x.grad.double().cpu().reshape(-1), back), "all_to_all grad " + name


def in_place_collectives(rank, world, dtype, seed):
    """torch.distributed's forms (in place, into a given output), flat ragged chunks, outputs
    poisoned, calls back to back with changing inputs."""
    for call, n in enumerate([5 * world + 3, 7, 1]):
        xs = operands(seed + call, [(n,)] * world)
        chunks = rows_of(n, world)
        t = _on(xs[rank], dtype)
        cf.all_reduce(t)
        check(f"all_reduce n={n}", t, sum(xs), sum(x.abs() for x in xs), dtype)
        out = torch.full((len(chunks[rank]),), float("nan"), dtype=dtype, device=DEVICE)
        cf.reduce_scatter(out, _on(xs[rank], dtype))
        check(f"reduce_scatter n={n}", out, sum(xs)[chunks[rank]],
              sum(x.abs() for x in xs)[chunks[rank]], dtype)
        out = torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)
        cf.all_gather(out, _on(xs[0][chunks[rank]], dtype))
        assert torch.equal(out.double().cpu(), xs[0]), f"all_gather n={n}"
        out = torch.full((world * len(chunks[rank]),), float("nan"), dtype=dtype, device=DEVICE)
        cf.all_to_all(out, _on(xs[rank], dtype))
        assert torch.equal(out.double().cpu(), torch.cat([x[chunks[rank]] for x in xs])), \
            f"all_to_all n={n}"
        mx = _on(xs[rank], dtype)
        cf.all_reduce(mx, op="max")
        assert torch.equal(mx.double().cpu(), torch.stack(xs).max(0).values), \
            f"all_reduce max n={n}"
    cf.barrier(device=DEVICE)


def eager_calls_back_to_back(rank, world, dtype, seed):
    """Calls without gradients (the prepared path on GPUs once a signature was seen), the same
    shapes four times in a row with new inputs each time, nothing synchronised between them,
    every output against float64."""
    n, k, m = 32, 16, 3 * world + 1
    rows = rows_of(m, world)
    outs = []
    for call in range(4):
        s = seed + call
        a = operands(s, [(m, k)] * world)
        b = operands(s + 1, [(n, k)] * world)  # weights [N, K], passed as w.t()
        bias = operands(s + 2, [(n,)])[0]
        y = cf.gemm_reduce_scatter(_on(a[rank], dtype), _on(b[rank], dtype).t(),
                                   bias=_on(bias, dtype))
        z, gathered = cf.all_gather_gemm(_on(a[0][rows[rank]], dtype), _on(b[rank], dtype).t(),
                                         m=m, return_a=True)
        t = _on(a[rank][0], torch.float32)
        cf.all_reduce(t)
        total = sum(x @ w.t() for x, w in zip(a, b))
        outs.append((y, z, gathered, t, total, a, b, bias))
    for call, (y, z, gathered, t, total, a, b, bias) in enumerate(outs):
        scale = sum(x.abs() @ w.abs().t() for x, w in zip(a, b))
        check(f"eager gemm_reduce_scatter call {call}", y, (total + bias)[rows[rank]],
              (scale + bias.abs())[rows[rank]], dtype)
        check(f"eager all_gather_gemm call {call}", z, a[0] @ b[rank].t(),
              a[0].abs() @ b[rank].abs().t(), dtype)
        assert torch.equal(gathered.double().cpu(), a[0]), f"eager gathered A call {call}"
        check(f"eager all_reduce call {call}", t, sum(x[0] for x in a),
              sum(x[0].abs() for x in a), torch.float32)


def op_calls_back_to_back(rank, world, dtype, seed):
    """The ``torch.ops.commfuse`` ops without gradients (what compiled models call; on CUDA
    with the C++ dispatcher kernels, their prepared calls): the two GEMMs and every collective
    in each of its forms (in place, into a new tensor, into a given one), each signature called
    twice to build and prepare it, then four times in a row with new inputs and nothing
    synchronised between them, every output against float64. With the C++ kernels on CUDA,
    those four rounds are served by their table alone, and clearing the cache empties it."""
    from commfuse.torch import _native

    ops, name = torch.ops.commfuse, dist.group.WORLD.group_name
    n, k, m = 32, 16, 3 * world + 1
    rows = rows_of(m, world)
    # the collectives' messages: 2·world rows of 8 (every rank's chunk whole rows)
    c_rows, c_inner = 2 * world, 8
    mine = slice(2 * rank, 2 * rank + 2)
    # and a reduce-scatter of rows that do not split evenly (on more than one rank its own
    # path, an all-reduce of which it keeps its rows: never bound to the all-reduce's operator)
    u_rows = 2 * world + 1
    u_mine = rows_of(u_rows, world)[rank]
    per_round = 11
    native = DEVICE.type == "cuda" and _native.loaded
    # (where torch.distributed serves the group, every signature stays with Python)
    prepared = native and cf.served_by(DEVICE) == "commfuse"

    def calls(s):
        a = operands(s, [(m, k)] * world)
        b = operands(s + 1, [(n, k)] * world)
        bias = operands(s + 2, [(n,)])[0]
        y = ops.gemm_reduce_scatter(_on(a[rank], dtype), _on(b[rank], dtype).t(),
                                    _on(bias, dtype), name, None, "fused", None, 1)
        z, gathered = ops.all_gather_gemm(_on(a[0][rows[rank]], dtype), _on(b[rank], dtype).t(),
                                          None, name, m, None, 1, "overlapped", True)
        t = _on(a[rank][0], torch.float32)
        ops.all_reduce_(t, "sum", name, "commfuse")
        xs = operands(s + 3, [(c_rows, c_inner)] * world)
        x = _on(xs[rank], dtype)
        coll = {
            "all_reduce": ops.all_reduce(x, "sum", name, "commfuse"),
            "reduce_scatter": ops.reduce_scatter(x, "sum", name, "commfuse"),
            "all_gather": ops.all_gather(x[mine], c_rows, name, "commfuse"),
            "all_to_all": ops.all_to_all(x, name, "commfuse"),
        }
        us = operands(s + 4, [(u_rows, c_inner)] * world)
        coll["uneven"] = (ops.reduce_scatter(_on(us[rank], dtype), "sum", name, "commfuse"), us)
        into = {kind: torch.full_like(want_like, float("nan"))
                for kind, want_like in (("reduce_scatter_into", x[mine]), ("all_gather_into", x),
                                        ("all_to_all_into", x))}
        ops.reduce_scatter_into(into["reduce_scatter_into"], x, "sum", name, "commfuse")
        ops.all_gather_into(into["all_gather_into"], x[mine], name, "commfuse")
        ops.all_to_all_into(into["all_to_all_into"], x, name, "commfuse")
        return y, z, gathered, t, a, b, bias, xs, coll, into

    def check_collectives(call, xs, coll, into):
        total, scale = sum(xs), sum(v.abs() for v in xs)
        # all-to-all: chunk r of every rank's flattened x, rank by rank
        swapped = torch.cat([v.flatten().chunk(world)[rank] for v in xs]).view(c_rows, c_inner)
        gathered = torch.cat([v[2 * r:2 * r + 2] for r, v in enumerate(xs)])
        check(f"op all_reduce call {call}", coll["all_reduce"], total, scale, dtype)
        got, us = coll["uneven"]
        check(f"op reduce_scatter of uneven rows call {call}", got, sum(us)[u_mine],
              sum(v.abs() for v in us)[u_mine], dtype)
        for kind in ("reduce_scatter", "reduce_scatter_into"):
            got = coll.get(kind, into.get(kind))
            check(f"op {kind} call {call}", got, total[mine], scale[mine], dtype)
        for kind, want in (("all_gather", gathered), ("all_gather_into", gathered),
                           ("all_to_all", swapped), ("all_to_all_into", swapped)):
            got = coll.get(kind, into.get(kind))
            assert torch.equal(got.double().cpu(), want), f"op {kind} call {call}"

    for warm in range(2):
        calls(seed - 1 - warm)
    before = _native.counts()
    outs = [calls(seed + 5 * call) for call in range(4)]
    after = _native.counts()
    for call, (y, z, gathered, t, a, b, bias, xs, coll, into) in enumerate(outs):
        check_collectives(call, xs, coll, into)
        total = sum(x @ w.t() for x, w in zip(a, b))
        scale = sum(x.abs() @ w.abs().t() for x, w in zip(a, b))
        check(f"op gemm_reduce_scatter call {call}", y, (total + bias)[rows[rank]],
              (scale + bias.abs())[rows[rank]], dtype)
        check(f"op all_gather_gemm call {call}", z, a[0] @ b[rank].t(),
              a[0].abs() @ b[rank].abs().t(), dtype)
        assert torch.equal(gathered.double().cpu(), a[0]), f"op gathered A call {call}"
        check(f"op all_reduce_ call {call}", t, sum(x[0] for x in a),
              sum(x[0].abs() for x in a), torch.float32)
    hits, misses = after[1] - before[1], after[2] - before[2]
    calls_made = 4 * per_round
    # the uneven reduce-scatter's calls go to Python on more than one rank
    unprepared = 4 if world > 1 else 0
    if native and not prepared:
        assert (hits, misses) == (0, calls_made), \
            f"the C++ kernels served {hits} of {calls_made} calls that torch.distributed serves"
    if prepared:
        assert (hits, misses) == (calls_made - unprepared, unprepared), \
            f"the C++ kernels served {hits} of {calls_made} calls ({misses} went to Python," \
            f" {unprepared} should)"
        assert after[0] >= per_round, \
            f"the C++ table holds {after[0]} prepared calls, not {per_round}"
        # (every rank's calls done before any frees the buffers its peers read)
        torch.cuda.synchronize()
        dist.barrier()
        cf.clear_cache()
        assert _native.counts()[0] == 0, "clear_cache left prepared calls in the C++ table"


def every_op_from_python(rank, world, dtype_name):
    """Every op, gradient and the compiled block with the C++ dispatcher kernels unloaded
    (``COMMFUSE_TORCH_NATIVE=0``): the same ops defined from Python alone."""
    from commfuse.torch import _native

    assert not _native.loaded, "COMMFUSE_TORCH_NATIVE=0 but the C++ kernels were loaded"
    assert "dispatch.cpp" not in torch._C._dispatch_dump("commfuse::gemm_reduce_scatter")
    every_op(rank, world, dtype_name)
    compiled_block_matches_eager(rank, world)


def every_op(rank, world, dtype_name, seed=1):
    dtype = getattr(torch, dtype_name)
    gemm_reduce_scatter_grads(rank, world, dtype, seed)
    all_gather_gemm_grads(rank, world, dtype, seed + 7)
    functional_collective_grads(rank, world, dtype, seed + 13)
    in_place_collectives(rank, world, dtype if dtype != torch.float16 else torch.float32,
                         seed + 17)
    with torch.no_grad():
        eager_calls_back_to_back(rank, world, dtype, seed + 19)
    op_calls_back_to_back(rank, world, dtype, seed + 23)
    if os.environ.get("COMMFUSE_PEER_ACCESS") == "0":
        want = "torch.distributed"
    else:
        want = "commfuse-sim" if DEVICE.type == "cpu" else "commfuse"
    assert cf.served_by(DEVICE) == want, (cf.served_by(DEVICE), want)
    dist.barrier()


class _Mlp(torch.nn.Module):
    """A tensor-parallel MLP block: column-parallel fc1, GELU, row-parallel fc2."""

    def __init__(self, fc1, fc2, sequence_parallel, group=None):
        super().__init__()
        from commfuse.torch.nn import ColumnParallelLinear, RowParallelLinear

        self.fc1 = ColumnParallelLinear.from_linear(fc1, group,
                                                    sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear.from_linear(fc2, group, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _reference_mlp(hidden, ffn, seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)


def layers_match_one_device(rank, world, seed=5):
    """Both layers built from nn.Linear (float32 parameters, bfloat16 compute), sequence
    parallel and not: outputs and every gradient against the same block on one device in
    float64, within bfloat16's rounding of the block (norm-wise)."""
    hidden, ffn, s, b = 32, 48, 2 * world, 3
    fc1, fc2 = _reference_mlp(hidden, ffn, seed)
    x = operands(seed + 1, [(s, b, hidden)])[0].float()
    g = operands(seed + 2, [(s, b, hidden)])[0].float()
    # the reference: float64 on one device
    r1, r2 = [torch.nn.Linear(l.in_features, l.out_features).double() for l in (fc1, fc2)]
    r1.load_state_dict(fc1.state_dict())
    r2.load_state_dict(fc2.state_dict())
    xr = x.double().requires_grad_()
    yr = r2(torch.nn.functional.gelu(r1(xr)))
    yr.backward(g.double())
    for sp in (False, True):
        mlp = _Mlp(copy.deepcopy(fc1).to(DEVICE), copy.deepcopy(fc2).to(DEVICE), sp)
        assert "rank" in repr(mlp.fc1) and f"sequence_parallel={sp}" in repr(mlp.fc2)
        start = rows_of(s, world)[rank][0] if sp else 0
        length = len(rows_of(s, world)[rank]) if sp else s
        xi = x[start:start + length].clone().to(DEVICE).requires_grad_()
        y = mlp(xi)
        want = yr.detach()[start:start + length] if sp else yr.detach()
        assert y.shape == want.shape and y.dtype == torch.float32, (y.shape, y.dtype)
        y.backward((g[start:start + length] if sp else g).to(DEVICE))
        out_rows = rows_of(ffn, world)[rank]
        in_rows = out_rows
        pairs = [
            ("y", y, want),
            ("dx", xi.grad, xr.grad[start:start + length]),
            ("fc1.weight", mlp.fc1.weight.grad, r1.weight.grad[out_rows]),
            ("fc1.bias", mlp.fc1.bias.grad, r1.bias.grad[out_rows]),
            ("fc2.weight", mlp.fc2.weight.grad, r2.weight.grad[:, in_rows]),
            ("fc2.bias", mlp.fc2.bias.grad, r2.bias.grad),
        ]
        for what, got, ref in pairs:
            err = (got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)
            assert err < 2e-2, f"sequence_parallel={sp} {what}: relative error {err:.3g}"
        # the same layers built from sizes hold this rank's shard and, given its weights,
        # compute what the ones built from nn.Linear do, to the bit
        from commfuse.torch.nn import ColumnParallelLinear, RowParallelLinear

        c = ColumnParallelLinear(hidden, ffn, sequence_parallel=sp, device=DEVICE)
        r = RowParallelLinear(ffn, hidden, sequence_parallel=sp, device=DEVICE)
        assert c.weight.shape == (len(out_rows), hidden), c.weight.shape
        assert r.weight.shape == (hidden, len(in_rows)) and r.bias.shape == (hidden,)
        c.load_state_dict(mlp.fc1.state_dict())
        r.load_state_dict(mlp.fc2.state_dict())
        with torch.no_grad():
            xs = x[start:start + length].to(DEVICE)
            assert torch.equal(r(torch.nn.functional.gelu(c(xs))), mlp(xs)), \
                f"sequence_parallel={sp}: layers from sizes"


def compiled_block_matches_eager(rank, world, backend="aot_eager", seed=9):
    """A tensor-parallel MLP compiled with fullgraph=True, sequence parallel (all-gather + GEMM,
    GELU, GEMM + reduce-scatter) and not (GEMM, GELU, GEMM, all-reduce): no graph break,
    forward and gradients equal to eager's; and each collective alone."""
    for sp in (True, False):
        _compiled_mlp_matches_eager(rank, world, backend, seed, sp)
    _compiled_collectives_match_eager(rank, world, backend, seed)


def _compiled_mlp_matches_eager(rank, world, backend, seed, sp):
    import torch._dynamo

    hidden, ffn, rows = 32, 64, 4 * world
    fc1, fc2 = _reference_mlp(hidden, ffn, seed)
    x = operands(seed + 1, [(rows, hidden)])[0].float()
    x = (x[rows_of(rows, world)[rank]] if sp else x).to(DEVICE)
    mlp = _Mlp(fc1.to(DEVICE), fc2.to(DEVICE), sp)
    explain = torch._dynamo.explain(mlp)(x)
    assert explain.graph_break_count == 0, (sp, explain.break_reasons)
    assert explain.graph_count == 1, (sp, explain.graph_count)
    compiled = torch.compile(mlp, fullgraph=True, backend=backend)
    for call in range(2):
        xi = (x * (call + 1)).requires_grad_()
        xe = xi.detach().clone().requires_grad_()
        yc, ye = compiled(xi), mlp(xe)
        torch.testing.assert_close(yc, ye, rtol=1e-2, atol=1e-2)
        yc.sum().backward()
        grads_c = [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad()
        ye.sum().backward()
        for gc, p in zip(grads_c, mlp.parameters()):
            torch.testing.assert_close(gc, p.grad, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(xi.grad, xe.grad, rtol=1e-2, atol=1e-2)
        mlp.zero_grad()


def _compiled_collectives_match_eager(rank, world, backend, seed):
    import torch._dynamo

    x = operands(seed + 3, [(4 * world, 32)])[0].float()[rows_of(4 * world, world)[rank]]
    x = x.to(DEVICE)
    # the collectives compile too, each without a break
    for fn, arg in [(lambda t: cff.all_reduce(t) * 2, x),
                    (lambda t: cff.all_gather_tensor(t) + 1, x),
                    (lambda t: cff.reduce_scatter_tensor(t.repeat(world, 1)) - 1, x),
                    (lambda t: cff.all_to_all_single(t) * 3, x)]:
        explain = torch._dynamo.explain(fn)(arg)
        assert explain.graph_break_count == 0, explain.break_reasons
        torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend=backend)(arg),
                                   fn(arg))


def _op_samples(name, dtype):
    """One call of every op (both weight layouts, with and without a bias, every form of the
    collectives) on DEVICE, for a group of one."""
    g = torch.Generator().manual_seed(3)

    def rand(*shape, dt=dtype, grad=True):
        x = (torch.randint(-8, 9, shape, generator=g) / 8).to(device=DEVICE, dtype=dt)
        return x.requires_grad_(grad)

    ops = torch.ops.commfuse
    return [
        (ops.gemm_reduce_scatter, (rand(6, 8), rand(8, 16), None, name, None, "auto", None, 1)),
        (ops.gemm_reduce_scatter, (rand(6, 8), rand(16, 8).t(), rand(16, dt=torch.float32), name,
                                   torch.float32, "fused", None, 1)),
        (ops.all_gather_gemm, (rand(7, 8), rand(8, 16), rand(16), name, 7, None, 1, "overlapped",
                               True)),
        (ops.all_gather_gemm, (rand(7, 8), rand(16, 8).t(), None, name, 7, None, 1, "overlapped",
                               False)),
        (ops.all_reduce, (rand(9), "sum", name, "auto")),
        (ops.reduce_scatter, (rand(5, 3), "sum", name, "auto")),
        (ops.all_gather, (rand(5, 3), 5, name, "auto")),
        (ops.all_to_all, (rand(6), name, "auto")),
        (ops.all_reduce_, (rand(9, grad=False), "max", name, "auto")),
        (ops.reduce_scatter_into, (rand(9, grad=False), rand(9, grad=False), "sum", name,
                                   "auto")),
        (ops.all_gather_into, (rand(9, grad=False), rand(9, grad=False), name, "auto")),
        (ops.all_to_all_into, (rand(9, grad=False), rand(9, grad=False), name, "auto")),
    ]


def opcheck_every_op(name, dtype):
    """``torch.library.opcheck`` (schema, fake kernel, autograd registration, aliasing) of
    every op on DEVICE, in a group of one; on CUDA with the C++ dispatcher kernels, theirs."""
    for op, args in _op_samples(name, dtype):
        torch.library.opcheck(op, args)


def fallback_serves_the_same(rank, world, seed=11):
    """With peer access forbidden, torch.distributed serves the ops, said once in a warning,
    with the same results."""
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert cf.served_by("cpu") == "torch.distributed"
        assert cf.operator_path(8, torch.zeros(4, 4, dtype=torch.bfloat16)) == \
            "torch.distributed"
        gemm_reduce_scatter_grads(rank, world, torch.bfloat16, seed)
        all_gather_gemm_grads(rank, world, torch.bfloat16, seed + 1)
        functional_collective_grads(rank, world, torch.float32, seed + 2)
        in_place_collectives(rank, world, torch.float32, seed + 3)
    ours = [w for w in said if "served by torch.distributed" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in said]
    assert "COMMFUSE_PEER_ACCESS=0" in str(ours[0].message)


def unequal_calls_fail_on_every_rank(rank, world, seed=17):
    """A GEMM op whose M or N differs between ranks, or whose rows of A do not make the agreed
    M's chunks, ends in a ValueError on every rank that names each rank's value (the calls are
    compared before anything is built or run, so no rank waits in a collective alone); equal
    calls run correctly after, and a signature seen before exchanges nothing."""
    import pytest

    dtype, n, k = torch.bfloat16, 16, 8

    def each(name, value_of):
        return " and ".join(f"{name} = {value_of(r)} on rank {r}" for r in range(world))

    def fails(call, says):
        with pytest.raises(ValueError) as raised:
            call()
        assert says in str(raised.value), (str(raised.value), says)

    w = _on(operands(seed, [(k, n)])[0], dtype)
    a = _on(operands(seed + 1, [(4 + rank, k)])[0], dtype)
    fails(lambda: cf.gemm_reduce_scatter(a, w),
          "gemm_reduce_scatter: every rank must pass the same M, got "
          + each("M", lambda r: 4 + r))
    # the same failure again, exchanged again on every rank (a refused call is not remembered,
    # so rank 1's later M = 5 is new to it too)
    fails(lambda: cf.gemm_reduce_scatter(a, w), "every rank must pass the same M")
    # (a request new on every rank: one repeated on some ranks is not exchanged there)
    wide = _on(operands(seed + 2, [(k, n + 8 + 8 * rank)])[0], dtype)
    fails(lambda: cf.gemm_reduce_scatter(a[:4], wide),
          "every rank must pass the same N, got " + each("N", lambda r: n + 8 + 8 * r))
    # M defaults to P × this rank's rows: rows that differ make Ms that differ
    fails(lambda: cf.all_gather_gemm(_on(operands(seed + 3, [(2 + rank, k)])[0], dtype), w),
          "all_gather_gemm: every rank must pass the same M, got "
          + each("M", lambda r: (2 + r) * world))
    # M given, the last rank holding a row too many: every rank says which
    last = world - 1
    held = 4 if rank == last else 3
    chunk = _on(operands(seed + 4, [(held, k)])[0], dtype)
    who = "this rank" if rank == last else f"rank {last}"
    fails(lambda: cf.all_gather_gemm(chunk, w, m=3 * world),
          f"{who} holds 4 rows of A, but its chunk of M = {3 * world} has 3")

    # equal calls serve as before; a signature's first call exchanges once, later ones never
    with counted_exchanges() as counted:
        m = 2 * world + 1
        rows = rows_of(m, world)
        every_a = operands(seed + 5, [(m, k)] * world)
        every_b = operands(seed + 6, [(k, n)] * world)
        total = sum(x @ y for x, y in zip(every_a, every_b))
        scale = sum(x.abs() @ y.abs() for x, y in zip(every_a, every_b))
        def exchanges(call, first):
            if call == 0:
                assert len(counted) > first or world == 1, "a first call exchanges its request"
                return len(counted)
            assert len(counted) == first, f"call {call} of a signature seen before exchanged"
            return first

        first = 0
        for call in range(3):
            y = cf.gemm_reduce_scatter(_on(every_a[rank], dtype), _on(every_b[rank], dtype))
            check(f"gemm_reduce_scatter after unequal calls, call {call}", y, total[rows[rank]],
                  scale[rows[rank]], dtype)
            first = exchanges(call, first)
        for call in range(3):
            z = cf.all_gather_gemm(_on(every_a[0][rows[rank]], dtype),
                                   _on(every_b[rank], dtype), m=m)
            check(f"all_gather_gemm after unequal calls, call {call}", z,
                  every_a[0] @ every_b[rank], every_a[0].abs() @ every_b[rank].abs(), dtype)
            first = exchanges(call, first)


def unequal_collectives_fail_on_every_rank(rank, world, seed=19):
    """A collective whose element count, dtype or reduction differs between ranks ends in a
    one-line ValueError on every rank that names each rank's value (compared before anything is
    built or run, so no rank waits in a collective alone); equal calls then give the float64
    reference, and a signature seen before exchanges nothing."""
    import pytest

    def each(name, value_of):
        return " and ".join(f"{name} = {value_of(r)} on rank {r}" for r in range(world))

    def fails(call, says):
        with pytest.raises(ValueError) as raised:
            call()
        text = str(raised.value)
        assert says in text and "\n" not in text, (text, says)

    def chunk(total, r):
        return len(rows_of(total, world)[r])

    dtype = torch.float32
    x = _on(operands(seed, [(8 + rank,)])[0], dtype)
    fails(lambda: cf.all_reduce(x),
          "all_reduce: every rank must pass the same element count, got "
          + each("element count", lambda r: 8 + r))
    # the same refusal again: a refused call is not remembered, so every rank exchanges again
    fails(lambda: cf.all_reduce(x), "all_reduce: every rank must pass the same element count")
    fails(lambda: cf.all_reduce(_on(operands(seed, [(8,)])[0],
                                    torch.float32 if rank == 0 else torch.bfloat16)),
          "all_reduce: every rank must pass the same dtype, got "
          + each("dtype", lambda r: torch.float32 if r == 0 else torch.bfloat16))
    fails(lambda: cf.all_reduce(_on(operands(seed, [(10,)])[0], dtype),
                                op="sum" if rank == 0 else "max"),
          "all_reduce: every rank must pass the same op, got "
          + each("op", lambda r: "sum" if r == 0 else "max"))
    total = 3 * world + rank
    fails(lambda: cf.reduce_scatter(torch.empty(chunk(total, rank), dtype=dtype, device=DEVICE),
                                    _on(operands(seed, [(total,)])[0], dtype)),
          "reduce_scatter: every rank must pass the same element count, got "
          + each("element count", lambda r: 3 * world + r))
    total = 4 * world + rank
    fails(lambda: cf.all_gather(torch.empty(total, dtype=dtype, device=DEVICE),
                                _on(operands(seed, [(chunk(total, rank),)])[0], dtype)),
          "all_gather: every rank must pass the same element count, got "
          + each("element count", lambda r: 4 * world + r))
    fails(lambda: cf.all_to_all(torch.empty(world * (2 + rank), dtype=dtype, device=DEVICE),
                                _on(operands(seed, [(world * (2 + rank),)])[0], dtype)),
          "all_to_all: every rank must pass the same element count, got "
          + each("element count", lambda r: world * (2 + r)))
    # the functional (dispatcher) ops are compared alike
    fails(lambda: cff.reduce_scatter_tensor(_on(operands(seed, [(world * (5 + rank), 2)])[0],
                                                dtype), "sum", None),
          "reduce_scatter: every rank must pass the same element count, got "
          + each("element count", lambda r: world * (5 + r) * 2))

    # equal calls serve as before; a signature's first call exchanges once, later ones never
    with counted_exchanges() as counted:
        n = 3 * world + 1
        every = operands(seed + 1, [(n,)] * world)
        total, scale = sum(every), sum(e.abs() for e in every)
        rows = rows_of(n, world)
        first = None
        for call in range(3):
            y = cf.all_reduce(_on(every[rank], dtype))
            check(f"all_reduce after unequal calls, call {call}", y, total, scale, dtype)
            out = torch.empty(len(rows[rank]), dtype=dtype, device=DEVICE)
            cf.reduce_scatter(out, _on(every[rank], dtype))
            check(f"reduce_scatter after unequal calls, call {call}", out, total[rows[rank]],
                  scale[rows[rank]], dtype)
            gathered = torch.empty(n, dtype=dtype, device=DEVICE)
            cf.all_gather(gathered, _on(every[0][rows[rank]], dtype))
            check(f"all_gather after unequal calls, call {call}", gathered, every[0],
                  every[0].abs(), dtype)
            if call == 0:
                assert counted or world == 1, "a first call exchanges its request"
                first = len(counted)
            assert len(counted) == first, f"call {call} of a signature seen before exchanged"


def graphs_replay_new_inputs(rank, world, seed=13):
    """The tensor-parallel block compiled with ``mode="reduce-overhead"`` (CUDA graphs): every
    replay with new inputs equals eager."""
    hidden, ffn, rows = 64, 128, 8 * world
    fc1, fc2 = _reference_mlp(hidden, ffn, seed)
    mlp = _Mlp(fc1.to(DEVICE), fc2.to(DEVICE), True)
    compiled = torch.compile(mlp, fullgraph=True, mode="reduce-overhead")
    base = operands(seed + 1, [(rows, hidden)])[0].float()[rows_of(rows, world)[rank]]
    with torch.no_grad():
        for call in range(6):
            x = (base * (call + 1) / 4).to(DEVICE)
            torch.testing.assert_close(compiled(x).clone(), mlp(x), rtol=1e-2, atol=1e-2)
