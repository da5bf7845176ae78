"""The worker side of the fault-injection suite (test_sim_faults.py): a long-lived process that
joins ``commfuse.sim.Group``s on its parent's orders and runs one operator in a loop until a
call raises, checking every result against NumPy.

Messages come and go over a ``multiprocessing`` connection as tuples. The worker first says
``("up",)`` (so that a slow start does not eat into a group's time to form). The parent sends
``("loop", job)`` (join the group, answer ``("ready",)``, then call until a call raises and answer
``("raised", message, when, calls)``, ``when`` being ``time.monotonic()`` of the raise, the same
clock across processes, and ``calls`` -1 where the group could not form), ``("once", job)``
(join, make two calls, answer ``("ok", 2)``) and ``None`` (leave). Any other failure of the
worker (a wrong result, an exception other than ValueError) is answered ``("failed", text)``.

A job is a dict: ``name``, ``nonce``, ``rank``, ``world``, ``timeout_ms``, ``op`` (one of
:data:`OPS`), ``algo`` (a collective's algorithm or None), ``root``, ``seed``.
"""

import gc
import time
import traceback

import numpy as np

from commfuse import sim
from test_sim import assert_within, chunks, operands, product, round_to

#: Every operator of the multi-process simulator, GEMM + reduce-scatter once per path.
OPS = [
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "broadcast",
    "all-to-all",
    "barrier",
    "gemm-rs-fused",
    "gemm-rs-overlapped",
    "gemm-rs-unfused",
    "all-gather-gemm",
]

#: The algorithms of each collective (None: the cost model's choice).
ALGOS = {
    "all-reduce": [None, "two-phase", "one-shot", "one-shot-push", "ring"],
    "reduce-scatter": [None, "direct", "push", "push-pipelined", "ring"],
    "all-gather": [None, "direct", "ring"],
    "broadcast": [None, "direct", "ring"],
    "all-to-all": [None, "direct"],
    "barrier": [None, "all-to-all", "ring"],
}


class Call:
    """One operator of one rank: ``run(c)`` makes call c on the group and checks its result
    (the inputs of call c are the job's inputs times 2^(c mod 3), exact in every type, so a
    result left from an earlier call is wrong)."""

    def __init__(self, g, job):
        self.g, self.op, self.algo = g, job["op"], job["algo"]
        p, r = g.world, g.rank
        self.p, self.r = p, r
        rng = np.random.default_rng(job["seed"])  # the same inputs on every rank
        self.root = job["root"] % p
        if self.op in ALGOS:
            n = 5 * p + 3  # uneven chunks
            self.xs = [rng.uniform(-1, 1, n).astype(np.float32) for _ in range(p)]
            self.n = n
        elif self.op.startswith("gemm-rs"):
            m, nn, k = 3 * p + 2, 24, 16
            self.a, self.b = operands(rng, p, [m] * p, nn, k, "nk")
            partials = [product(self.a[q], self.b[q], "nk", "bf16") for q in range(p)]
            rows = chunks(m, p)[r]
            self.want = sum(partials)[rows.start : rows.stop]
            self.scale = sum(np.abs(x) for x in partials)[rows.start : rows.stop]
            self.path = self.op.removeprefix("gemm-rs-")
        else:
            m = 4 * p + 1
            full, self.b = operands(rng, p, [m], 24, 16, "kn")
            self.m, self.full = m, full[0]
            rows = chunks(m, p)[r]
            self.mine = self.full[rows.start : rows.stop]
            self.want = product(self.full, self.b[r], "kn", "bf16")
            self.scale = np.abs(round_to(self.full, "bf16")) @ np.abs(round_to(self.b[r], "bf16"))

    def run(self, c):
        f = np.float32(2 ** (c % 3))
        g, op, p, r = self.g, self.op, self.p, self.r
        if op == "barrier":
            if self.algo is None:
                g.barrier()
            else:
                g.collective("barrier", np.zeros(0, np.float32), algo=self.algo)
            return
        if op in ALGOS:
            xs, mine = self.xs, chunks(self.n, p)[r]
            if op == "all-reduce":
                out, _ = g.collective(op, xs[r] * f, algo=self.algo)
                want = np.sum([x.astype(np.float64) for x in xs], axis=0) * f
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            elif op == "reduce-scatter":
                out, _ = g.collective(op, xs[r] * f, algo=self.algo)
                want = np.sum([x.astype(np.float64) for x in xs], axis=0)[mine.start : mine.stop]
                np.testing.assert_allclose(out, want * f, rtol=1e-5, atol=1e-5)
            elif op == "all-gather":
                out, _ = g.collective(op, xs[0][mine.start : mine.stop] * f, count=self.n,
                                      algo=self.algo)
                assert np.array_equal(out, xs[0] * f), "all-gather: wrong result"
            elif op == "broadcast":
                x = xs[self.root] * f if r == self.root else np.zeros(0, np.float32)
                out, _ = g.collective(op, x, count=self.n, root=self.root, algo=self.algo)
                assert np.array_equal(out, xs[self.root] * f), "broadcast: wrong result"
            else:
                out, _ = g.collective(op, xs[r] * f, algo=self.algo)
                want = np.concatenate([x[mine.start : mine.stop] for x in xs]) * f
                assert np.array_equal(out, want), "all-to-all: wrong result"
            return
        if op.startswith("gemm-rs"):
            out = g.gemm_reduce_scatter(self.a[r] * f, self.b[r], path=self.path)
            assert_within(out, self.want * f, self.scale * f, "bf16", f"{op} rank {r} call {c}")
            return
        out, _ = g.all_gather_gemm(self.mine * f, self.b[r], m=self.m, b_layout="kn",
                                     out_dtype="f32")
        assert_within(out, self.want * f, self.scale * f, "f32", f"{op} rank {r} call {c}")


def join(job):
    return sim.Group(job["name"], job["rank"], job["world"], arena_mb=4,
                     timeout_ms=job["timeout_ms"], nonce=job["nonce"])


def serve(conn):
    """The worker's loop: says ("up",), then takes orders from `conn` until None."""
    conn.send(("up",))
    while True:
        order = conn.recv()
        if order is None:
            return
        kind, job = order
        try:
            try:
                g = join(job)
            except ValueError as e:
                # a group that cannot form: the parent judges the error like a call's
                conn.send(("raised", str(e), time.monotonic(), -1))
                continue
            call = Call(g, job)
            if kind == "once":
                call.run(0)
                call.run(1)
                conn.send(("ok", 2))
                continue
            conn.send(("ready",))
            c = 0
            while True:
                try:
                    call.run(c)
                except ValueError as e:
                    conn.send(("raised", str(e), time.monotonic(), c))
                    break
                c += 1
        except BaseException:  # reported to the parent, which fails the test
            conn.send(("failed", traceback.format_exc(limit=4)))
        finally:
            # the group and its operators go now, not at some later collection
            g = call = None
            gc.collect()
