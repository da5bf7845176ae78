"""commfuse's operators on the CPU simulator, no GPU needed: GEMM + reduce-scatter (a row-parallel
linear layer), all-gather + GEMM (a column-parallel one) and an all-reduce of P simulated ranks,
each output element of each rank checked against NumPy in float64.

    python examples/sim_quickstart.py [--ranks 4] [--m 300 --n 256 --k 128]

Exits non-zero when an element differs from the reference or when commfuse cannot be imported.
"""

import argparse
import sys

import numpy as np


def chunks(m, p):
    """The rows of rank r's chunk: the collectives' split of m rows over p ranks (the first
    m mod p one row longer)."""
    base, extra = divmod(m, p)
    starts = [r * base + min(r, extra) for r in range(p + 1)]
    return [slice(starts[r], starts[r + 1]) for r in range(p)]


def check(what, got, want):
    """Raises naming `what` and the first wrong element unless `got` equals `want` exactly."""
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    wrong = np.argwhere(got != want)
    if len(wrong):
        i = tuple(wrong[0])
        raise AssertionError(f"{what}: {len(wrong)} of {got.size} elements wrong, first {i} = {got[i]} against {want[i]}")
    return got.size


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks (threads)")
    parser.add_argument("--m", type=int, default=300, help="rows of the GEMM")
    parser.add_argument("--n", type=int, default=256, help="columns of the GEMM")
    parser.add_argument("--k", type=int, default=128, help="depth of each rank's GEMM")
    args = parser.parse_args()
    p, m, n, k = args.ranks, args.m, args.n, args.k
    # operands of small integers: every product and sum is exact in f32, so the simulator's
    # results must equal the float64 reference exactly, and a wrong, missing or doubled
    # partial shows as a difference, never as rounding
    if min(p, m, n, k) < 1 or 16 * k * p >= 2**24:
        parser.error("--ranks, --m, --n and --k must be at least 1, and 16·K·P below 2^24")
    try:
        from commfuse import sim
    except ImportError as e:
        print(f"sim_quickstart: cannot import commfuse ({e}); install it with: pip install ./python", file=sys.stderr)
        return 1

    rng = np.random.default_rng(0)

    def ints(*shape):
        return rng.integers(-4, 5, shape).astype(np.float32)

    print(f"commfuse on the simulator: {p} ranks, GEMM {m}×{n}×{k} (M×N×K) bf16 → f32")

    # GEMM + reduce-scatter: rank r holds A_r [M, K] and B_r [K, N] and gets its chunk of the
    # rows of Σ_r A_r·B_r + bias
    a = [ints(m, k) for _ in range(p)]
    b = [ints(k, n) for _ in range(p)]
    bias = ints(n)
    want = sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in zip(a, b)) + bias
    for path in ["fused", "overlapped", "unfused"]:
        out = sim.gemm_reduce_scatter(a, b, bias, b_layout="kn", dtype="bf16", out_dtype="f32", path=path)
        elements = sum(check(f"gemm_reduce_scatter by {path}, rank {r}", out[r], want[rows]) for r, rows in enumerate(chunks(m, p)))
        print(f"gemm_reduce_scatter  {path:<12} {elements} elements exact")

    # all-gather + GEMM: rank r holds its chunk of the rows of A and B_r, and gets concat(A)·B_r
    shards = [ints(rows.stop - rows.start, k) for rows in chunks(m, p)]
    outs, gathered = sim.all_gather_gemm(shards, b, None, b_layout="kn", dtype="bf16", out_dtype="f32", return_a=True)
    full = np.concatenate(shards).astype(np.float64)
    elements = check("the gathered A", gathered, full)
    elements += sum(check(f"all_gather_gemm, rank {r}", outs[r], full @ b[r].astype(np.float64)) for r in range(p))
    print(f"all_gather_gemm      {'':<12} {elements} elements exact (with the gathered A)")

    # an all-reduce (sum) of an uneven length by the algorithm the cost model picks
    xs = [ints(10 * m + 3) for _ in range(p)]
    outs, algo = sim.collective("all-reduce", xs)
    total = sum(x.astype(np.float64) for x in xs)
    elements = sum(check(f"all-reduce by {algo}, rank {r}", outs[r], total) for r in range(p))
    print(f"all-reduce           {algo:<12} {elements} elements exact")
    print("every element matches the float64 reference")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (AssertionError, ValueError) as e:
        print(f"sim_quickstart: {e}", file=sys.stderr)
        sys.exit(1)
