#!/usr/bin/env python3
"""Which launches of one `bench gemm --rs-ranks` process to sample: from Nsight Compute's
metric listing of every launch of one build's entries (`ncu --csv --log-file FILE
--metrics ...,dram__bytes_read.sum`), the last launch of the plain entry without the split
tail (`_plain`: the build alone at these shapes), and among the routed entry's launches the
last of the lower and of the higher DRAM reads: the order row (the rank's tile order and
bands, no routes) and the rank row, whose partials add to its reads.

    python3 scripts/ncu-rank-launches.py LIST.csv TABLE.txt > PICKS.txt

Writes every launch with its metrics to TABLE.txt and prints `plain ID`, `order ID` and
`rank ID` lines (IDs count the listed launches from 0, as `ncu --launch-skip` does under the
same kernel filter); prints no order or rank line where the routed launches' reads are not
two groups apart (a step of at least 1.03 times between their sorted reads, above zero: at two
ranks and 8192 x 8192 x 3584 the partial adds 11 % to the order row's reads), except that where every
routed launch reads at least 1.03 times the plain one (a build whose order row runs its
general entry, as the wide ping-pong build's does) the last of them is the rank row.
"""
import csv
import sys


def launches(path):
    """{launch ID: (kernel name, {metric: value})} from ncu's CSV listing."""
    rows = list(csv.reader(open(path, newline="")))
    header = next(r for r in rows if r and r[0] == "ID")
    col = {name: i for i, name in enumerate(header)}
    out = {}
    for r in rows:
        if len(r) != len(header) or not r[0].isdigit():
            continue
        name, metrics = out.setdefault(int(r[col["ID"]]), (r[col["Kernel Name"]], {}))
        try:
            metrics[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", ""))
        except ValueError:
            pass
    return out


def main():
    listed = launches(sys.argv[1])
    with open(sys.argv[2], "w") as table:
        for i, (name, metrics) in listed.items():
            values = " ".join(f"{m}={v:g}" for m, v in sorted(metrics.items()))
            table.write(f"{i:4d} {name} {values}\n")
    plain = [i for i, (name, _) in listed.items() if name.endswith("_plain")]
    routed = [i for i, (name, _) in listed.items() if "_routed" in name]
    reads = {i: listed[i][1].get("dram__bytes_read.sum", 0.0) for i in routed}
    plain_reads = 0.0
    if plain:
        print("plain", max(plain))
        plain_reads = listed[max(plain)][1].get("dram__bytes_read.sum", 0.0)
    if routed:
        # the widest step between the routed launches' reads, sorted: the partials' reads vary
        # by a few per cent from launch to launch (5 % over eleven launches of the wide build's
        # rank row), so the groups are told apart by a gap, not by the whole spread
        ordered = sorted(reads.values())
        gap = max(range(1, len(ordered)), key=lambda j: ordered[j] / max(ordered[j - 1], 1.0), default=None)
        if gap is not None and ordered[gap - 1] > 0 and ordered[gap] >= 1.03 * ordered[gap - 1]:
            middle = (ordered[gap - 1] + ordered[gap]) / 2
            print("order", max(i for i in routed if reads[i] < middle))
            print("rank", max(i for i in routed if reads[i] >= middle))
        elif plain_reads > 0 and ordered[0] >= 1.03 * plain_reads:
            # (a build whose order row takes its general entry: the routed launches are the
            # rank row's alone, each reading more than the plain entry's)
            print("rank", max(routed))


if __name__ == "__main__":
    main()
