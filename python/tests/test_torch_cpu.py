"""commfuse.torch on CPU tensors: P = 1..4 processes on a gloo group, served by commfuse's
simulator (or, with peer access forbidden, by torch.distributed). Every op and gradient against
float64, ``torch.library.opcheck`` of every op, ``torch.compile(fullgraph=True)`` of a
tensor-parallel block, the layers against one device, and the training example. Skips where
PyTorch is missing, and fails instead when ``COMMFUSE_REQUIRE_TORCH=1`` (CI sets it)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

try:
    import torch
    import torch.distributed as dist
except ImportError:
    if os.environ.get("COMMFUSE_REQUIRE_TORCH") == "1":
        raise
    pytest.skip("PyTorch is not installed", allow_module_level=True)

import commfuse.torch as cf  # noqa: E402
import torch_checks  # noqa: E402
from torch_ranks import run_ranks  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_and_gradient_matches_float64(world):
    run_ranks(torch_checks.every_op, world, "bfloat16")


def test_every_op_gradient_and_compile_without_the_cpp_kernels(monkeypatch):
    monkeypatch.setenv("COMMFUSE_TORCH_NATIVE", "0")
    run_ranks(torch_checks.every_op_from_python, 2, "bfloat16")


def test_cpp_dispatcher_kernels_serve_the_ops():
    from commfuse.torch import _native

    if not _native.loaded:
        pytest.skip(f"the C++ dispatcher kernels are not loaded: {_native.why_not}")
    # every op: its calls on CUDA tensors are prepared, so its CUDA kernel is C++
    for name in ("gemm_reduce_scatter", "all_gather_gemm", "all_reduce_", "all_gather",
                 "reduce_scatter", "all_reduce", "all_to_all", "reduce_scatter_into",
                 "all_gather_into", "all_to_all_into"):
        lines = torch._C._dispatch_dump(f"commfuse::{name}").splitlines()
        kernel = {line.split(":")[0]: line for line in lines}
        assert "dispatch.cpp" in kernel["Autograd[alias]"], (name, kernel["Autograd[alias]"])
        assert "dispatch.cpp" in kernel["CUDA"], (name, kernel["CUDA"])
        assert "dispatch.cpp" not in kernel["CPU"], (name, kernel["CPU"])
        # calls needing a gradient go to the twin, whose autograd kernel is Python's
        twin = torch._C._dispatch_dump(f"commfuse::{name}_autograd")
        assert "_library.py" in twin.split("Autograd[alias]:")[1].splitlines()[0], twin


def test_cpp_kernels_built_for_another_torch_are_refused(tmp_path):
    from commfuse.torch import _native

    if not _native.loaded:
        pytest.skip(f"the C++ dispatcher kernels are not loaded: {_native.why_not}")
    library = tmp_path / "_dispatch.so"
    library.write_bytes(Path(_native._lib._name).read_bytes())
    (tmp_path / "_dispatch.torch-version").write_text("2.0.0\n")
    run = subprocess.run([sys.executable, "-c", "import commfuse.torch"], capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "COMMFUSE_TORCH_NATIVE": str(library)})
    assert run.returncode != 0 and "was built for torch 2.0.0" in run.stderr, run.stderr[-2000:]


def test_float16_ops_and_gradients():
    run_ranks(torch_checks.every_op, 2, "float16")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layers_match_one_device(world):
    run_ranks(torch_checks.layers_match_one_device, world)


def test_compiled_block_has_no_graph_break_and_matches_eager():
    run_ranks(torch_checks.compiled_block_matches_eager, 2)


def test_peer_access_forbidden_falls_back_to_torch_distributed(monkeypatch):
    monkeypatch.setenv("COMMFUSE_PEER_ACCESS", "0")
    run_ranks(torch_checks.fallback_serves_the_same, 2)


def test_what_keeps_a_group_of_gpus_from_commfuses_kernels():
    """The verdict every rank forms on its CUDA group (then shares): forbidden peer access,
    several hosts, a shared GPU, a peer GPU this process cannot see, and one without peer
    access each send the group to torch.distributed, naming why; else the kernels serve it."""
    from commfuse.torch._groups import cuda_verdict

    gpus = {"GPU-a": 0, "GPU-b": 1, "GPU-c": 2}
    everyone = lambda i, j: True  # noqa: E731
    group = [("h", "GPU-a", False), ("h", "GPU-b", False), ("h", "GPU-c", False)]
    assert [cuda_verdict(group, r, gpus, everyone) for r in range(3)] == [None] * 3
    forbidden = [("h", "GPU-a", False), ("h", "GPU-b", True)]
    assert "COMMFUSE_PEER_ACCESS=0" in cuda_verdict(forbidden, 0, gpus, everyone)
    assert "on 2 hosts" in cuda_verdict([("h", "GPU-a", False), ("g", "GPU-b", False)], 0, gpus,
                                        everyone)
    assert "share a GPU" in cuda_verdict([("h", "GPU-a", False)] * 2, 1, gpus, everyone)
    hidden = {"GPU-a": 0, "GPU-c": 1}
    assert cuda_verdict(group, 0, hidden, everyone) == (
        "rank 1's GPU is not visible to rank 0's process (CUDA_VISIBLE_DEVICES), which must"
        " open its memory")
    # GPU 2 reaches no other; ranks 0 and 1 reach each other
    apart = lambda i, j: 2 not in (i, j)  # noqa: E731
    assert cuda_verdict(group, 0, gpus, apart).startswith(
        "GPU 0 of rank 0 has no peer access to GPU 2 of rank 2")
    assert cuda_verdict(group[:2], 1, gpus, apart) is None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("served_by", ["commfuse-sim", "torch.distributed"])
def test_calls_that_differ_between_ranks_fail_on_every_rank(world, served_by, monkeypatch):
    if served_by == "torch.distributed":
        monkeypatch.setenv("COMMFUSE_PEER_ACCESS", "0")
    run_ranks(torch_checks.unequal_calls_fail_on_every_rank, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("served_by", ["commfuse-sim", "torch.distributed"])
def test_collectives_that_differ_between_ranks_fail_on_every_rank(world, served_by,
                                                                  monkeypatch):
    if served_by == "torch.distributed":
        monkeypatch.setenv("COMMFUSE_PEER_ACCESS", "0")
    run_ranks(torch_checks.unequal_collectives_fail_on_every_rank, world, timeout=300)


@pytest.fixture(scope="module")
def one_rank():
    """This process as a group of one (gloo)."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        yield dist.group.WORLD.group_name
        cf.clear_cache()
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_every_op(one_rank, dtype):
    torch_checks.opcheck_every_op(one_rank, dtype)


def test_the_into_collectives_take_inputs_that_need_a_gradient(one_rank):
    # as dist.all_gather_into_tensor and dist.reduce_scatter_tensor do (the C++ kernels loaded
    # or not): the input is only read
    for call in (cf.all_gather, cf.reduce_scatter, cf.all_to_all):
        x = torch.arange(8, dtype=torch.float32).requires_grad_()
        out = torch.full((8,), float("nan"))
        assert call(out, x, group=one_rank) is out
        assert torch.equal(out, x.detach()), call.__name__


def test_dispatcher_calls_bump_versions_and_refuse_gradients_of_mutating_ops(one_rank):
    ops = torch.ops.commfuse
    t = torch.arange(6, dtype=torch.bfloat16)
    before = t._version
    ops.all_reduce_(t, "sum", one_rank, "auto")
    assert t._version == before + 1, "an in-place op must bump its argument's version"
    out = torch.full((6,), float("nan"), dtype=torch.bfloat16)
    before = out._version
    ops.all_gather_into(out, t, one_rank, "auto")
    assert out._version == before + 1 and torch.equal(out, t)
    leaf = torch.ones(6, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no gradient"):
        ops.all_reduce_(leaf, "sum", one_rank, "auto")
    # a tensor saved for backward and then overwritten in place: autograd notices
    a = torch.ones(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, 8, dtype=torch.bfloat16)
    y = ops.gemm_reduce_scatter(a, w, None, one_rank, None, "auto", None, 1)
    saved = a.detach()
    with torch.no_grad():
        ops.all_reduce_(saved, "sum", one_rank, "auto")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_compile_with_inductor_on_one_rank(one_rank):
    torch_checks.compiled_block_matches_eager(0, 1, backend="inductor")


def test_bad_calls_raise_value_error(one_rank):
    a = torch.ones(4, 8, dtype=torch.bfloat16)
    for call, says in [
        (lambda: cf.gemm_reduce_scatter(a, torch.ones(7, 3, dtype=torch.bfloat16)), "b is"),
        (lambda: cf.gemm_reduce_scatter(a.float(), a.float().t()), "bfloat16 or float16"),
        (lambda: cf.gemm_reduce_scatter(a, a.t(), path="sideways"), "path"),
        (lambda: cf.all_gather_gemm(a, a.t(), m=5), "chunk of M"),
        (lambda: cf.all_reduce(torch.ones(3, dtype=torch.int32)), "bfloat16, float16 or"),
        (lambda: cf.all_reduce(torch.ones(3), op="avg"), "sum, max, min or prod"),
        (lambda: cf.reduce_scatter(torch.ones(2), torch.ones(3)), "output must hold"),
        # what is not a tensor is named as such, not met by an AttributeError
        (lambda: cf.gemm_reduce_scatter([[1.0] * 8], a.t()), "a must be a torch.Tensor"),
        (lambda: cf.all_gather_gemm([[1.0] * 8], a.t()), "a must be a torch.Tensor"),
        (lambda: cf.all_gather_gemm(a, "w", m=4), "b must be a torch.Tensor"),
        (lambda: cf.all_gather_gemm(a, a.t(), bias=3), "bias must be a torch.Tensor"),
    ]:
        with pytest.raises(ValueError, match=says):
            call()


def test_import_without_torch_says_how_to_install():
    code = "import sys; sys.modules['torch'] = None; import commfuse.torch"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    assert run.returncode != 0
    assert "ImportError" in run.stderr and "pip install torch" in run.stderr, run.stderr


@pytest.mark.parametrize("world, flags", [(2, []), (4, ["--no-sequence-parallel"])])
def test_training_example_matches_one_device(world, flags):
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={world}", str(ROOT / "examples" / "tp_train.py"), "--device", "cpu",
         "--steps", "6"] + flags,
        capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir(),
    )
    sys.stdout.write(run.stdout[-4000:])
    sys.stderr.write(run.stderr[-4000:])
    assert run.returncode == 0, f"tp_train.py exited with {run.returncode}"
    assert "OK" in run.stdout.splitlines()[-1]
    # every timed variant (async-TP's layers eagerly on CPU, sequence parallel only) checked
    # against one device, timed
    labels = ["commfuse", "torch.distributed + torch.matmul"]
    if "--no-sequence-parallel" not in flags:
        labels.append("functional collectives, eager")
    for label in labels:
        assert f"# {label}: logits within" in run.stdout, label
        assert any(line.startswith(label) and "tokens/s" in line
                   for line in run.stdout.splitlines()), label
