"""The examples that run without a GPU, run as a user runs them (a fresh interpreter, the
installed package): they pass, and they exit non-zero when a result is wrong or commfuse cannot
be imported."""

import pathlib
import subprocess
import sys

QUICKSTART = pathlib.Path(__file__).resolve().parents[2] / "examples" / "sim_quickstart.py"
# small, so that the example takes well under a second; 3 ranks split 50 rows unevenly
SMALL = ["--ranks", "3", "--m", "50", "--n", "40", "--k", "24"]


def run(code_before="", args=SMALL):
    """The quickstart in a fresh interpreter, after `code_before` (which may break what it
    calls)."""
    code = (
        "import runpy, sys\n"
        f"{code_before}\n"
        f"sys.argv = [{str(QUICKSTART)!r}] + {args!r}\n"
        f"runpy.run_path({str(QUICKSTART)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_simulator_quickstart_passes():
    done = run()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "commfuse on the simulator: 3 ranks, GEMM 50×40×24 (M×N×K) bf16 → f32"
    assert lines[-1] == "every element matches the float64 reference"
    # three paths of GEMM + reduce-scatter, all-gather + GEMM, the all-reduce
    assert sum("elements exact" in line for line in lines) == 5, done.stdout
    assert done.stderr == ""


def test_the_quickstart_fails_on_one_wrong_element():
    corrupt = (
        "import commfuse.sim as sim\n"
        "real = sim.gemm_reduce_scatter\n"
        "def wrong(*a, **kw):\n"
        "    out = real(*a, **kw)\n"
        "    out[-1][-1, -1] += 1\n"
        "    return out\n"
        "sim.gemm_reduce_scatter = wrong\n"
    )
    done = run(corrupt)
    assert done.returncode == 1, done.stdout
    assert "gemm_reduce_scatter by fused, rank 2: 1 of 640 elements wrong" in done.stderr, done.stderr


def test_the_quickstart_says_when_it_cannot_run():
    # an import of commfuse that fails, as where the package is not installed
    done = run("sys.modules['commfuse'] = None")
    assert done.returncode == 1
    assert done.stderr.startswith("sim_quickstart: cannot import commfuse"), done.stderr
    assert len(done.stderr.splitlines()) == 1
    bad = run(args=["--ranks", "0"])
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr, bad.stderr
