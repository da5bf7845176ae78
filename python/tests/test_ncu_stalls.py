"""scripts/ncu-stalls.py, the reader of Nsight Compute's warp-state samples per SASS
instruction, on a small source page written here: the instructions with the most samples,
the samples by reason, and the one-time code's samples split at the main loop."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ncu-stalls.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_imc", "stall_imc (Not Issued)", "stall_wait", "stall_long_sb"]


def page(tmp_path, rows):
    """A source page as `ncu --page source --csv --print-source sass` writes one: a kernel line,
    the header, then (offset, sass, executed, {reason: samples}) rows from 0x1000 on."""
    lines = ['"Kernel Name","gemm_test"', ",".join(f'"{h}"' for h in HEADER)]
    for off, sass, executed, why in rows:
        cells = [hex(0x1000 + off), sass, sum(why.values()), executed, why.get("imc", 0), 0,
                 why.get("wait", 0), why.get("long_sb", 0)]
        lines.append(",".join(f'"{c}"' for c in cells))
    path = tmp_path / "page.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_one_time_code_splits_at_the_main_loop(tmp_path):
    rows = [
        (0x00, "LDC R1, c[0x0][0x28]", 12, {"imc": 5}),           # set-up, all warps
        (0x10, "ULDC UR4, c[0x0][0x3dc]", 4, {"imc": 2, "wait": 1}),
        (0x20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 400, {"wait": 3}),
        (0x30, "@P0 BRA 0x1020", 400, {"long_sb": 40}),            # the main loop's wait
        (0x40, "WARPSYNC.ALL", 4, {"wait": 7}),                   # epilogue
        (0x50, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2", 100, {"long_sb": 9}),  # 1/4 of it
        (0x60, "EXIT", 12, {"wait": 2}),
    ]
    out = run(page(tmp_path, rows)).splitlines()
    assert out[0].endswith(": 69 samples over 7 instructions"), out[0]
    assert any("+0x00030" in line and "long_sb 40" in line for line in out), out
    split = out.index(next(line for line in out if line.startswith("code run at most")))
    assert "+0x00020..+0x00030, exec 400" in out[split], out[split]
    # before the loop: both set-up lines; after it: the epilogue and the exit, not the wait
    # run a quarter as often as the loop
    assert out[split + 1].split() == ["before", "it", "8", "imc", "7,", "wait", "1"], out[split + 1]
    assert out[split + 2].split() == ["after", "it", "9", "wait", "9"], out[split + 2]
