"""commfuse.sim against NumPy float64 references: every output element of every rank, both GEMM +
reduce-scatter paths and all-gather + GEMM, ragged shapes, both B layouts, bf16/f16 inputs with
16-bit and f32 outputs, with and without bias; and the errors bad arguments raise."""

import numpy as np
import pytest

import commfuse
from commfuse import sim

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "f16": 2.0**-11, "f32": 2.0**-24}


def round_to(x, dtype):
    """float32 values rounded to `dtype` (round to nearest even), as float64."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def chunks(m, p):
    """The collectives' split of m rows over p ranks (the first m mod p one longer)."""
    base, extra = divmod(m, p)
    starts = [r * base + min(r, extra) for r in range(p + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(p)]


def operands(rng, p, rows, n, k, layout):
    a = [rng.uniform(-1, 1, (r, k)).astype(np.float32) for r in rows]
    shape = (n, k) if layout == "nk" else (k, n)
    b = [rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(p)]
    return a, b


def product(a, b, layout, dtype):
    bt = round_to(b, dtype)
    return round_to(a, dtype) @ (bt.T if layout == "nk" else bt)


def assert_within(got, want, scale, out_dtype, what):
    """Every element within a bound that scales with the magnitudes summed (the rounding of the
    partials and the output to out_dtype, f32 accumulation); a missing or doubled partial is far
    outside it."""
    bound = 4 * UNIT_ROUNDOFF[out_dtype] * scale + 1e-5 * (1 + scale)
    err = np.abs(np.asarray(got, dtype=np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{what}: element {worst} off by {err[worst]}, bound {bound[worst]}"


@pytest.mark.parametrize("p", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("path", ["auto", "fused", "overlapped", "overlapped-2d", "unfused"])
@pytest.mark.parametrize(
    "layout,dtype,out_dtype,bias",
    [("nk", "bf16", "bf16", False), ("kn", "f16", "f32", True), ("nk", "f16", "f16", True)],
)
def test_gemm_reduce_scatter_matches_float64(p, path, layout, dtype, out_dtype, bias):
    rng = np.random.default_rng(p * 31 + len(path))
    m, n, k = 3 * p + 2, 24, 16
    a, b = operands(rng, p, [m] * p, n, k, layout)
    bias_v = rng.uniform(-1, 1, n).astype(np.float32) if bias else None
    options = dict(b_layout=layout, dtype=dtype, out_dtype=out_dtype, path=path)
    if path == "overlapped":
        options["pieces"] = 2
    if path == "overlapped-2d":  # the 2D ring: 3 NUMA groups of 2 ranks at P = 6, else P of 1
        options.update(path="overlapped", numa_groups=3 if p == 6 else p)
    outs = sim.gemm_reduce_scatter(a, b, bias_v, **options)
    partials = [product(a[r], b[r], layout, dtype) for r in range(p)]
    want = sum(partials)
    scale = sum(np.abs(x) for x in partials)
    if bias:
        want = want + round_to(bias_v, out_dtype)
        scale = scale + np.abs(round_to(bias_v, out_dtype))
    assert len(outs) == p
    for r, rows in enumerate(chunks(m, p)):
        assert outs[r].shape == (len(rows), n)
        assert outs[r].dtype == np.float32
        assert_within(outs[r], want[rows.start : rows.stop], scale[rows.start : rows.stop], out_dtype, f"rank {r}")


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("pieces", [None, 1, 3])
@pytest.mark.parametrize("path", ["auto", "overlapped", "fused"])
def test_all_gather_gemm_matches_float64(p, pieces, path):
    rng = np.random.default_rng(p * 7 + (pieces or 0))
    m, n, k = 5 * p + 1, 40, 24
    rows = [len(c) for c in chunks(m, p)]
    a, b = operands(rng, p, rows, n, k, "kn")
    bias_v = rng.uniform(-1, 1, n).astype(np.float32)
    outs, gathered = sim.all_gather_gemm(
        a, b, bias_v, b_layout="kn", dtype="bf16", out_dtype="f32", pieces=pieces, path=path,
        return_a=True
    )
    full = np.concatenate(a)
    assert np.array_equal(gathered, round_to(full, "bf16").astype(np.float32))
    for r in range(p):
        prod = product(full, b[r], "kn", "bf16")
        want = prod + bias_v
        scale = np.abs(round_to(full, "bf16")) @ np.abs(round_to(b[r], "bf16")) + np.abs(bias_v)
        assert_within(outs[r], want, scale, "f32", f"rank {r}")
    _, none = sim.all_gather_gemm(a, b, None, b_layout="kn")
    assert none is None


def test_the_all_gather_gemm_keeps_its_first_names():
    from commfuse import cuda

    # one name for the operator everywhere; the names it had first still work
    assert sim.all_gather_matmul is sim.all_gather_gemm
    assert commfuse._commfuse.GpuAllGatherMatmul is commfuse._commfuse.GpuAllGatherGemm
    assert callable(cuda.all_gather_gemm)


def test_the_cost_model_names_its_path():
    assert commfuse.gemm_rs_path(2, 8192, 8192, 3584) == "overlapped (2 pieces)"
    assert commfuse.gemm_rs_path(2, 300, 16384, 64) == "overlapped (1 piece)"
    # a reduce-scatter of under 4 MiB a rank: not worth hiding
    assert commfuse.gemm_rs_path(2, 64, 64, 64) == "unfused"
    # rows of 8190 bf16 are not whole 16-byte units: the fused path
    assert commfuse.gemm_rs_path(2, 8192, 8190, 64) == "fused"


def test_bad_arguments_raise_value_errors_with_one_line():
    rng = np.random.default_rng(0)
    a, b = operands(rng, 2, [8, 8], 16, 16, "nk")
    cases = [
        (lambda: sim.gemm_reduce_scatter(a, b[:1]), "one A and one B per rank"),
        (lambda: sim.gemm_reduce_scatter(a, b, dtype="f64"), "f64"),
        (lambda: sim.gemm_reduce_scatter(a, b, b_layout="mn"), "unknown B layout 'mn'"),
        (lambda: sim.gemm_reduce_scatter(a, b, path="fast"), "unknown path"),
        (lambda: sim.gemm_reduce_scatter(a, b, pieces=2), "pieces goes with"),
        (lambda: sim.gemm_reduce_scatter(a, b, path="overlapped", pieces=17), "1 to 16 pieces"),
        (
            lambda: sim.gemm_reduce_scatter(a, b, path="overlapped", numa_groups=3),
            "multiple of the NUMA group count (3)",
        ),
        (lambda: sim.gemm_reduce_scatter(a, b, out_dtype="f16"), "(the input type) or f32"),
        (lambda: sim.gemm_reduce_scatter(a, [x[:, :12] for x in b]), "rank 0's B is [16, 12]"),
        (
            lambda: sim.gemm_reduce_scatter([x[:, :12] for x in a], [x[:, :12] for x in b]),
            "multiple of 8",
        ),
        (lambda: sim.all_gather_gemm([a[0], a[1][:3]], b), "rank 0's chunk of A has 8 rows"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert says in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("algo", [None, "ring"])
def test_collectives_match_numpy(p, algo):
    rng = np.random.default_rng(p)
    n = 4 * p + 3
    xs = [rng.uniform(-1, 1, n).astype(np.float32) for _ in range(p)]
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    outs, ran = sim.collective("all-reduce", xs, algo=algo)
    assert algo is None or ran == algo
    for o in outs:
        np.testing.assert_allclose(o, total, rtol=1e-5, atol=1e-5)
    outs, _ = sim.collective("reduce-scatter", xs, algo=algo)
    for r, rows in enumerate(chunks(n, p)):
        np.testing.assert_allclose(outs[r], total[rows.start : rows.stop], rtol=1e-5, atol=1e-5)
    pieces = [xs[0][c.start : c.stop] for c in chunks(n, p)]
    outs, _ = sim.collective("all-gather", pieces, algo=algo)
    for o in outs:
        assert np.array_equal(o, xs[0])
    outs, _ = sim.collective("all-reduce", xs, reduce="max", dtype="bf16")
    for o in outs:
        np.testing.assert_array_equal(o, round_to(np.max(xs, axis=0), "bf16").astype(np.float32))


def test_collective_errors_are_one_line_value_errors():
    xs = [np.zeros(8, dtype=np.float32)] * 2
    for call, says in [
        (lambda: sim.collective("all-sum", xs), "all-sum"),
        (lambda: sim.collective("all-reduce", xs, algo="nope"), "nope"),
        (lambda: sim.collective("all-reduce", xs, reduce="avg"), "avg"),
        (lambda: sim.collective("all-reduce", [xs[0], np.zeros(7, dtype=np.float32)]), "rank 1's input has 7"),
        (lambda: sim.collective("all-reduce", []), "one input per rank"),
    ]:
        with pytest.raises(ValueError) as e:
            call()
        assert says in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_all_gather_gemm_refuses_an_unknown_path_before_any_gpu():
    # the binding checks the path for commfuse.torch and commfuse.cuda alike, first of all
    for bad, says in [(dict(path="ring"), 'unknown path "ring": auto, overlapped or fused'),
                      (dict(pieces=17), "pieces must be 1 to 16 pieces, got 17")]:
        with pytest.raises(ValueError) as e:
            commfuse._commfuse.GpuAllGatherGemm(0, 0, 1, 8, 16, 16, **bad)
        assert says in str(e.value)
    with pytest.raises(ValueError) as e:
        sim.all_gather_gemm([np.zeros((8, 16), np.float32)], [np.zeros((16, 16), np.float32)],
                            path="unfused")
    assert 'unknown path "unfused": auto, overlapped or fused' in str(e.value)


def test_type_hints_ship_in_the_package():
    import os

    here = os.path.dirname(commfuse.__file__)
    assert os.path.exists(os.path.join(here, "py.typed"))
    stub = open(os.path.join(here, "_commfuse.pyi")).read()
    for name in ["SimGroup", "GpuGemmReduceScatter", "GpuAllGatherGemm", "GpuCollective"]:
        assert f"class {name}" in stub
        assert getattr(commfuse._commfuse, name).__doc__, f"{name} has no docstring"


def one_line_value_error(call, says):
    """The call raises a ValueError whose message holds `says`, on one line and with no note
    beneath it (PyO3's argument errors were TypeErrors or OverflowErrors with a second line)."""
    with pytest.raises(ValueError) as e:
        call()
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value), str(e.value)
    assert not getattr(e.value, "__notes__", None), e.value.__notes__


def test_arguments_of_the_wrong_kind_name_what_is_accepted():
    rng = np.random.default_rng(0)
    a, b = operands(rng, 2, [8, 8], 16, 16, "nk")
    xs = [np.zeros(8, dtype=np.float32)] * 2
    f32 = "must be a 2-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got"
    cases = [
        (lambda: sim.gemm_reduce_scatter([x.astype(np.float64) for x in a], b),
         f"a[0] {f32} a 2-D float64 array of shape (8, 16)"),
        (lambda: sim.gemm_reduce_scatter(a, [b[0], b[1].astype(np.int32)]),
         f"b[1] {f32} a 2-D int32 array of shape (16, 16)"),
        (lambda: sim.gemm_reduce_scatter([x[0] for x in a], b), f"a[0] {f32} a 1-D float32 array of shape (16,)"),
        (lambda: sim.gemm_reduce_scatter(a, b, np.zeros((1, 16), np.float32)),
         "bias must be a 1-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got a 2-D"),
        (lambda: sim.gemm_reduce_scatter(a, b, dtype=np.float16),
         "dtype must be a string naming the input type, 'bf16' or 'f16', got <class 'numpy.float16'> (type)"),
        (lambda: sim.gemm_reduce_scatter(a, b, out_dtype=np.dtype("float32")),
         "out_dtype must be a string naming the output type, the input type or 'f32', got dtype('float32')"),
        (lambda: sim.gemm_reduce_scatter(a, b, b_layout=0), "b_layout must be a string naming 'nk' or 'kn', got 0 (int)"),
        (lambda: sim.gemm_reduce_scatter(a, b, path=None), "path must be a string naming 'auto', 'fused', 'overlapped' or 'unfused', got None"),
        (lambda: sim.gemm_reduce_scatter(a, b, path="overlapped", pieces=-1), "pieces must be 1 to 16 pieces, got -1"),
        (lambda: sim.gemm_reduce_scatter(a, b, numa_groups=0), "numa_groups must be a positive number of NUMA groups, got 0"),
        (lambda: sim.gemm_reduce_scatter(a, b, timeout_ms=-5), "timeout_ms must be a non-negative number of milliseconds, got -5"),
        (lambda: sim.gemm_reduce_scatter(a, b, timeout_ms=1.5), "timeout_ms must be a non-negative number of milliseconds, got 1.5 (float)"),
        (lambda: sim.all_gather_gemm([x.astype(np.float16) for x in a], b), f"a[0] {f32} a 2-D float16 array"),
        (lambda: sim.all_gather_gemm(a, b, pieces=0), "pieces must be 1 to 16 pieces, got 0"),
        (lambda: sim.all_gather_gemm(a, b, dtype=np.float32), "dtype must be a string naming the input type"),
        (lambda: sim.collective("all-reduce", [x.astype(np.float64) for x in xs]),
         "inputs[0] must be a 1-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got a 1-D float64 array of shape (8,)"),
        (lambda: sim.collective("all-reduce", [np.zeros((2, 4), np.float32)] * 2), "inputs[0] must be a 1-D float32"),
        (lambda: sim.collective("all-reduce", "abc"), "inputs must be a list or tuple with one array per rank, got 'abc' (str)"),
        (lambda: sim.collective("all-reduce", 3), "inputs must be a list or tuple with one array per rank, got 3 (int)"),
        (lambda: sim.gemm_reduce_scatter(a[0], b), "a[0] must be a 2-D float32 NumPy array"),
        (lambda: sim.all_gather_gemm(None, b), "a must be a list or tuple with one array per rank, got None"),
        (lambda: sim.collective(np.sum, xs), "op must be a string naming a collective such as 'all-reduce', got"),
        (lambda: sim.collective("all-reduce", xs, dtype=np.float32), "dtype must be a string naming 'f32', 'bf16' or 'f16', got <class 'numpy.float32'>"),
        (lambda: sim.collective("all-reduce", xs, reduce=max), "reduce must be a string naming 'sum', 'max', 'min' or 'prod', got"),
        (lambda: sim.collective("broadcast", xs, root=-1), "root must be a rank (0 to P - 1), got -1"),
        (lambda: commfuse.gemm_rs_path(2, -1, 8, 8), "m must be a non-negative number of rows, got -1"),
        (lambda: commfuse.gemm_rs_path(100, 8, 8, 8), "world must be 1 to 64 ranks, got 100"),
    ]
    for call, says in cases:
        one_line_value_error(call, says)


def test_calls_too_large_for_memory_are_refused_before_anything_is_copied():
    # broadcast views: arrays of any shape that take no memory of their own
    def zeros(*shape):
        return np.broadcast_to(np.float32(0), shape)

    k = 8
    a = [zeros(1_000_000, k)] * 2
    b = [zeros(1_000_000, k)] * 2
    one_line_value_error(
        lambda: sim.gemm_reduce_scatter(a, b, path="fused"),
        "sim_gemm_reduce_scatter of 1000000×1000000×8 on 2 ranks by the fused path needs",
    )
    one_line_value_error(
        lambda: sim.all_gather_gemm([zeros(500_000, k)] * 2, b),
        "sim_all_gather_gemm of 1000000×1000000×8 on 2 ranks needs",
    )
    one_line_value_error(
        lambda: sim.collective("all-reduce", [zeros(1 << 40)] * 2),
        "sim_collective all-reduce of 1099511627776 f32 elements on 2 ranks needs 32.0 TiB",
    )
    # counts past 64 bits (NumPy's arrays hold at most 2^63 bytes each)
    one_line_value_error(
        lambda: sim.collective("all-gather", [zeros((1 << 61) - 1)] * 9),
        "the inputs hold more elements than 64 bits count",
    )
    one_line_value_error(
        lambda: sim.gemm_reduce_scatter([zeros(1 << 40, k)] * 2, [zeros(1 << 40, k)] * 2),
        "size overflow: GEMM 1099511627776×1099511627776×8",
    )
    one_line_value_error(
        lambda: sim.all_gather_gemm([zeros(1 << 57, k)] * 200, [zeros(8, k)] * 200),
        "the chunks of A have more rows than 64 bits count",
    )
