#!/usr/bin/env python3
"""The PM sampling timelines of one kernel, from Nsight Compute's raw page as CSV with every
metric instance (`ncu --section PmSampling -o REP ...`, then `ncu -i REP --page raw --csv
--print-metric-instances values > FILE`; FILE may be gzipped).

Prints, sample by sample over the kernel's span, the SMs' active cycles beside their tensor
pipes' active cycles (one row per sampling interval of the SM group), then the DRAM read
throughput and the L2 throughput (their own intervals): where a kernel's SMs are resident
but compute nothing (its start and end) and how steady its rates are in between.

    python3 scripts/ncu-pm-sampling.py FILE.csv[.gz] [...]
"""
import csv
import gzip
import re
import sys


def series(path):
    """{metric: [value per sample]} of the PM sampling metrics in the file's first kernel."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header, values = rows[0], rows[2]
    out = {}
    for name, value in zip(header, values):
        if "Triage" not in name:
            continue
        inner = re.search(r"\((.*)\)", value)
        if not inner:
            continue
        samples = []
        for x in inner.group(1).split(";"):
            x = x.strip().replace(",", "")
            samples.append(float(x) if x not in ("", "n/a") else 0.0)
        out[name.split(".", 2)[-1]] = samples
    return out


def span(xs):
    """The first and last sample with a value, one either side."""
    busy = [i for i, x in enumerate(xs) if x]
    return (max(busy[0] - 1, 0), busy[-1] + 2) if busy else (0, 0)


def main():
    for path in sys.argv[1:]:
        s = series(path)
        sm = s["sm__cycles_active.avg"]
        tensor = s["sm__pipe_tensor_op_hmma_cycles_active_realtime.avg"]
        print(f"{path}\n  sample  SM active cycles  tensor active cycles")
        lo, hi = span(sm)
        for i in range(lo, hi):
            print(f"  {i:6d}  {sm[i]:16.0f}  {tensor[i] if i < len(tensor) else 0:20.0f}")
        for name in ("dramc__read_throughput.avg.pct_of_peak_sustained_elapsed",
                     "lts__throughput.avg.pct_of_peak_sustained_elapsed"):
            xs = s[name]
            lo, hi = span(xs)
            print(f"  {name} (% per sample): " + " ".join(f"{x:.0f}" for x in xs[lo:hi]))


if __name__ == "__main__":
    main()
