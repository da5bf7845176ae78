"""commfuse.torch on GPUs, one process per GPU: ``torch_cuda.py`` (every op and gradient,
the layers, torch.compile and CUDA graphs) on every GPU present, and ``torchrun_ops.py``
(against PyTorch's own fused operators) on every GPU present when there are at least two. Skips with the reason where PyTorch, torchrun or two GPUs
are missing, and fails instead when ``COMMFUSE_REQUIRE_GPU=1`` (the GPU machine's script)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def cuda_missing(gpus: int):
    """Why a test on `gpus` CUDA GPUs through PyTorch cannot run on this machine, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < gpus:
        return f"needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}, found {found}"
    return None


def missing(gpus=2):
    """Why the test (on `gpus` GPUs, under torchrun) cannot run on this machine, or None."""
    reason = cuda_missing(gpus)
    if reason is None and shutil.which("torchrun") is None:
        return "torchrun is not on PATH"
    return reason


def skip_for(reason):
    """Skips the calling test for ``reason`` (printed), or fails it under
    ``COMMFUSE_REQUIRE_GPU=1``; nothing when ``reason`` is None."""
    if reason is not None:
        if os.environ.get("COMMFUSE_REQUIRE_GPU") == "1":
            pytest.fail(f"COMMFUSE_REQUIRE_GPU=1 but {reason}")
        print(f"skipped: {reason}")
        pytest.skip(reason)


def _need(gpus):
    skip_for(missing(gpus))


def _torch_cuda(env=None):
    import torch

    run = subprocess.run(
        ["torchrun", "--standalone", f"--nproc-per-node={torch.cuda.device_count()}",
         str(HERE / "torch_cuda.py")],
        capture_output=True, text=True, timeout=600, cwd=HERE, env={**os.environ, **(env or {})},
    )
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr[-8000:])
    assert run.returncode == 0, f"torchrun exited with {run.returncode}"
    return run.stdout


def test_ops_gradients_layers_compile_and_graphs_on_every_gpu():
    _need(1)
    out = _torch_cuda()
    for check in ["every_op bfloat16", "every_op float16", "layers", "compile inductor",
                  "cuda graphs"]:
        assert f"ok {check}" in out, f"{check} did not report"


def test_peer_access_forbidden_serves_the_same_by_torch_distributed():
    _need(1)
    out = _torch_cuda({"COMMFUSE_PEER_ACCESS": "0"})
    for check in ["every_op bfloat16", "every_op float16", "layers"]:
        assert f"ok {check}" in out, f"{check} did not report"


def test_every_torch_op_matches_float64_and_pytorch_across_processes():
    _need(2)
    import torch

    world = torch.cuda.device_count()
    run = subprocess.run(
        ["torchrun", "--standalone", f"--nproc-per-node={world}", str(HERE / "torchrun_ops.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr[-8000:])
    assert run.returncode == 0, f"torchrun exited with {run.returncode}"
    for op in ["gemm_reduce_scatter", "all_gather_gemm", "all_reduce", "reduce_scatter",
               "all_gather", "all_to_all", "barrier"]:
        assert f"ok {op}" in run.stdout, f"{op} did not report"
