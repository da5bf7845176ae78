"""commfuse.torch on GPUs, one process per GPU: runs ``torchrun_ops.py`` under ``torchrun``
on every GPU present (at least two). Skips with the reason where PyTorch, torchrun or two GPUs
are missing, and fails instead when ``COMMFUSE_REQUIRE_GPU=1`` (the GPU machine's script)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def missing():
    """Why the test cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return f"needs two CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    if shutil.which("torchrun") is None:
        return "torchrun is not on PATH"
    return None


def test_every_torch_op_matches_float64_and_pytorch_across_processes():
    reason = missing()
    if reason is not None:
        if os.environ.get("COMMFUSE_REQUIRE_GPU") == "1":
            pytest.fail(f"COMMFUSE_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
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
