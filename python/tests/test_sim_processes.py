"""The multi-process simulator: P separate processes (P = 1..4), each one rank of a
``commfuse.sim.Group`` whose signal pads and buffers live in POSIX shared memory. Every op on
uneven sizes against float64 NumPy references computed in each process from shared seeds, bad
input raising, a rank that dies ending the others at once in an error naming it, and no shared
memory left behind (test_sim_faults.py kills ranks at random)."""

import multiprocessing as mp
import os
import time
import uuid

import numpy as np
import pytest

from commfuse import sim
from test_sim import assert_within, chunks, one_line_value_error, operands, product, round_to

SHM = "/dev/shm"


def every_op(rank, p, name):
    """Rank `rank`'s part of every op; returns one line per op checked."""
    g = sim.Group(name, rank, p, arena_mb=16, timeout_ms=20000)
    assert (g.rank, g.world) == (rank, p)
    done = []
    rng = np.random.default_rng(1)  # the same inputs on every rank
    n = 5 * p + 3  # uneven chunks
    xs = [rng.uniform(-1, 1, n).astype(np.float32) for _ in range(p)]
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for call in range(2):  # the same op again: the cached operator, nothing cleared
        out, _ = g.collective("all-reduce", xs[rank] * (call + 1))
        np.testing.assert_allclose(out, total * (call + 1), rtol=1e-5, atol=1e-5)
    done.append("all-reduce")
    mine = chunks(n, p)[rank]
    out, _ = g.collective("reduce-scatter", xs[rank], algo="ring")
    np.testing.assert_allclose(out, total[mine.start : mine.stop], rtol=1e-5, atol=1e-5)
    done.append("reduce-scatter")
    out, _ = g.collective("all-gather", xs[0][mine.start : mine.stop], count=n)
    assert np.array_equal(out, xs[0])
    done.append("all-gather")
    out, _ = g.collective("all-to-all", xs[rank])
    want = np.concatenate([x[mine.start : mine.stop] for x in xs])
    assert np.array_equal(out, want)
    done.append("all-to-all")
    root = p - 1
    out, _ = g.collective("broadcast", xs[root] if rank == root else np.zeros(0, np.float32),
                          count=n, root=root)
    assert np.array_equal(out, xs[root])
    done.append("broadcast")
    g.barrier()
    done.append("barrier")

    m, nn, k = 3 * p + 2, 24, 16
    a, b = operands(np.random.default_rng(2), p, [m] * p, nn, k, "nk")
    bias = np.random.default_rng(3).uniform(-1, 1, nn).astype(np.float32)
    partials = [product(a[r], b[r], "nk", "bf16") for r in range(p)]
    want = sum(partials) + round_to(bias, "bf16")
    scale = sum(np.abs(x) for x in partials) + np.abs(round_to(bias, "bf16"))
    for path in ["auto", "overlapped", "fused"]:
        out = g.gemm_reduce_scatter(a[rank], b[rank], bias, path=path)
        rows = chunks(m, p)[rank]
        assert_within(out, want[rows.start : rows.stop], scale[rows.start : rows.stop], "bf16",
                      f"gemm_reduce_scatter {path} rank {rank}")
    done.append("gemm_reduce_scatter")

    m = 4 * p + 1
    full, bs = operands(np.random.default_rng(4), p, [m], 40, 24, "kn")
    rows = chunks(m, p)[rank]
    want = product(full[0], bs[rank], "kn", "bf16")
    scale = np.abs(round_to(full[0], "bf16")) @ np.abs(round_to(bs[rank], "bf16"))
    for path in ["auto", "fused"]:
        out, gathered = g.all_gather_gemm(full[0][rows.start : rows.stop], bs[rank], m=m,
                                          b_layout="kn", out_dtype="f32", path=path,
                                          return_a=True)
        assert np.array_equal(gathered, round_to(full[0], "bf16").astype(np.float32))
        assert_within(out, want, scale, "f32", f"all_gather_gemm {path} rank {rank}")
    # the name the method had first
    out, _ = g.all_gather_matmul(full[0][rows.start : rows.stop], bs[rank], m=m, b_layout="kn",
                                 out_dtype="f32")
    assert_within(out, want, scale, "f32", f"all_gather_matmul rank {rank}")
    done.append("all_gather_gemm")

    for call, says in [
        (lambda: g.collective("all-sum", xs[rank]), "all-sum"),
        (lambda: g.collective("all-reduce", xs[rank], reduce="avg"), "avg"),
        (lambda: g.gemm_reduce_scatter(a[rank], b[rank][:, :8]), "K differs"),
        (lambda: g.all_gather_gemm(full[0][:1], bs[rank], m=m, b_layout="kn"), "pass m="),
        (lambda: g.all_gather_gemm(full[0][rows.start : rows.stop], bs[rank], m=m,
                                   b_layout="kn", path="ring"), 'unknown path "ring"'),
    ]:
        with pytest.raises(ValueError) as e:
            call()
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    done.append("bad input")
    return done


def dies_or_waits(rank, p, name):
    """Rank 1 joins and exits; rank 0's all-reduce must end in an error naming it as soon as
    its process has ended, long before the 20 s timeout."""
    g = sim.Group(name, rank, p, arena_mb=8, timeout_ms=20000)
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        g.collective("all-reduce", np.ones(16, np.float32))
    except ValueError as e:
        assert time.monotonic() - started < 5, f"the wait outlived its peer: {e}"
        return [f"error: {e}"]
    raise AssertionError("an all-reduce whose peer died returned")


def one_rank_errs(rank, p, name):
    """Rank 1's input does not fit the op: it raises, and rank 0, already waiting in the same
    call, ends at once (the group's abort flag) instead of at its 20 s timeout."""
    g = sim.Group(name, rank, p, arena_mb=8, timeout_ms=20000)
    started = time.monotonic()
    try:
        g.collective("all-reduce", np.ones(16 - rank, np.float32), count=16)
    except ValueError as e:
        return [f"{time.monotonic() - started:.1f} s: {e}"]
    raise AssertionError("a call with a misfit input returned")


def _worker(target, rank, p, name, results):
    try:
        results.put((rank, "ok", target(rank, p, name)))
    except BaseException as e:  # reported to the parent, which fails the test
        results.put((rank, "failed", f"{type(e).__name__}: {e}"))


def run_group(target, p, expect):
    name = f"test-{uuid.uuid4().hex[:12]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(target, r, p, name, results)) for r in range(p)]
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in range(expect):
            rank, status, detail = results.get(timeout=120)
            got[rank] = (status, detail)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert not os.path.exists(os.path.join(SHM, f"commfuse-{name}")), "shared memory left behind"
    return got


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_op_across_processes_matches_float64(p):
    got = run_group(every_op, p, p)
    for rank in range(p):
        status, detail = got[rank]
        assert status == "ok", f"rank {rank}: {detail}"
        assert "all_gather_gemm" in detail and "bad input" in detail


def test_a_rank_that_dies_ends_the_others_in_an_error():
    got = run_group(dies_or_waits, 2, 1)
    status, detail = got[0]
    assert status == "ok", detail
    assert "error: rank 0 stopped waiting for rank 1: the process of rank 1 (pid " in detail[0], detail[0]
    assert detail[0].endswith(") has ended"), detail[0]


def test_a_rank_that_fails_stops_the_others_at_once():
    got = run_group(one_rank_errs, 2, 2)
    for rank in range(2):
        status, detail = got[rank]
        assert status == "ok", f"rank {rank}: {detail}"
        seconds = float(detail[0].split(" s:")[0])
        assert seconds < 10, f"rank {rank} waited for its timeout: {detail[0]}"
    assert "input has 15 elements" in got[1][1][0], got[1][1][0]


def test_joining_a_group_that_never_forms_is_an_error():
    with pytest.raises(ValueError) as e:
        sim.Group(f"test-{uuid.uuid4().hex[:12]}", 1, 2, timeout_ms=200)
    assert "waited" in str(e.value)
    with pytest.raises(ValueError) as e:
        sim.Group("bad name/", 0, 1)
    assert "group name" in str(e.value)


def test_a_group_refuses_what_it_cannot_be_at_once_in_one_line():
    name = f"test-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    for call, says in [
        # a world past 64 ranks waited for its 99 peers until the timeout
        (lambda: sim.Group(name, 0, 100), "world must be 1 to 64 ranks, got 100"),
        (lambda: sim.Group(name, 0, 0), "world must be 1 to 64 ranks, got 0"),
        # a negative rank was an OverflowError
        (lambda: sim.Group(name, -1, 2), "rank must be 0 to world - 1 = 1, got -1"),
        (lambda: sim.Group(name, 2, 2), "rank must be 0 to world - 1 = 1, got 2"),
        (lambda: sim.Group(name, "0", 2), "rank must be 0 to world - 1 = 1, got '0' (str)"),
        (lambda: sim.Group(name, 0, 1, arena_mb=0), "arena_mb must be a positive number of MiB, got 0"),
        (lambda: sim.Group(name, 0, 1, arena_mb=1 << 40), f"the shared memory of group {name} needs 1.0 EiB"),
        (lambda: sim.Group(name, 0, 1, timeout_ms=-1), "timeout_ms must be a non-negative number of milliseconds, got -1"),
        (lambda: sim.Group(7, 0, 1), "name must be a string naming the group"),
    ]:
        one_line_value_error(call, says)
    assert time.monotonic() - started < 5, "refused at once, not after a timeout"
    assert not os.path.exists(os.path.join(SHM, f"commfuse-{name}"))


def test_a_ranks_calls_refuse_bad_arrays_names_and_sizes_in_one_line():
    g = sim.Group(f"test-{uuid.uuid4().hex[:12]}", 0, 1, arena_mb=8)
    x = np.ones(4, np.float32)
    a, b = operands(np.random.default_rng(5), 1, [8], 16, 16, "nk")
    f32 = "must be a 2-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got"
    for call, says in [
        (lambda: g.collective("all-reduce", np.zeros(4)),
         "x must be a 1-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got a 1-D float64 array of shape (4,)"),
        (lambda: g.collective("all-reduce", np.zeros((2, 2), np.float32)), "x must be a 1-D float32"),
        (lambda: g.collective("all-reduce", [1.0, 2.0]), "x must be a 1-D float32 NumPy array"),
        (lambda: g.collective("all-reduce", x, dtype=np.float16), "dtype must be a string naming 'f32', 'bf16' or 'f16'"),
        (lambda: g.collective("all-reduce", x, root=-1), "root must be a rank, 0 to 0, got -1"),
        (lambda: g.collective("all-reduce", x, count=-3), "count must be a non-negative number of elements, got -3"),
        (lambda: g.gemm_reduce_scatter(a[0].astype(np.float64), b[0]), f"a {f32} a 2-D float64 array of shape (8, 16)"),
        (lambda: g.gemm_reduce_scatter(a[0], b[0].astype(np.int64)), f"b {f32} a 2-D int64 array"),
        (lambda: g.gemm_reduce_scatter(a[0], b[0], dtype=np.float16), "dtype must be a string naming the input type"),
        (lambda: g.gemm_reduce_scatter(a[0], b[0], path="overlapped", pieces=99), "pieces must be 1 to 16 pieces, got 99"),
        (lambda: g.all_gather_gemm(a[0], b[0], m=-1), "m must be a non-negative number of rows (of the gathered A), got -1"),
        (lambda: g.all_gather_gemm(a[0], b[0], pieces=0), "pieces must be 1 to 16 pieces, got 0"),
        (lambda: g.collective("all-reduce", np.broadcast_to(np.float32(0), (1 << 40,))),
         "copying the input of 1099511627776 elements needs 4.0 TiB"),
    ]:
        one_line_value_error(call, says)
    # none of them touched the group
    out, _ = g.collective("all-reduce", x)
    assert np.array_equal(out, x)
