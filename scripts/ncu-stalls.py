#!/usr/bin/env python3
"""Warp stall samples of one kernel, from Nsight Compute's source page as CSV
(`ncu -i REP --page source --csv --print-source sass > FILE`).

Prints the instructions with the most samples (offset from the kernel's first instruction,
SASS, times executed by a warp, the leading stall reason), the samples by stall reason, and
the samples of each 4 KiB of code with its largest execution count, which tells the main loop
(executed once per k-block) from the epilogue (once per tile) and the producer.

    python3 scripts/ncu-stalls.py FILE.csv [--top N]

The last part splits the samples of the code run once per block or tile (instructions run at
most an eighth as often as the main loop: the most-run wgmma's count) by where that code lies:
before the main loop's instructions (the set-up up to the first k-block) or after them.
"""
import argparse
import csv


def instructions(path):
    """(offset, sass, samples, executed, {reason: samples}) for every instruction of the file."""
    rows = list(csv.reader(open(path, newline="")))
    header = next(r for r in rows if r and r[0] == "Address")
    start = rows.index(header) + 1
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for r in rows[start:]:
        if len(r) < len(header):
            continue
        count = lambda name: int(r[col[name]] or 0)
        out.append((int(r[col["Address"]], 16), r[col["Source"]].strip(), count("Warp Stall Sampling (All Samples)"),
                    count("Instructions Executed"), {h[len("stall_"):]: count(h) for h in reasons}))
    base = min(i[0] for i in out)
    return [(a - base, *rest) for a, *rest in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    ins = instructions(args.csv)
    total = sum(i[2] for i in ins) or 1
    print(f"{args.csv}: {total} samples over {len(ins)} instructions")
    print("\ninstructions with the most samples:")
    for off, sass, s, ex, why in sorted(ins, key=lambda i: -i[2])[: args.top]:
        lead = max(why, key=why.get)
        print(f"{100 * s / total:5.1f} %  +0x{off:05x}  {sass[:58]:58s} exec {ex:9d}  {lead} {why[lead]}")
    by_reason = {}
    for i in ins:
        for k, v in i[4].items():
            by_reason[k] = by_reason.get(k, 0) + v
    print("\nby reason: " + ", ".join(f"{k} {100 * v / total:.1f} %"
                                      for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v))
    print("\nby 4 KiB of code (at least 0.5 % of the samples): share, largest execution count, leading reasons")
    regions = {}
    for off, sass, s, ex, why in ins:
        r = regions.setdefault(off // 0x1000, [0, 0, 0, {}])
        r[0] += s
        r[1] = max(r[1], ex)
        r[2] += ex
        for k, v in why.items():
            r[3][k] = r[3].get(k, 0) + v
    for key in sorted(regions):
        s, most, executed, why = regions[key]
        if s < 0.005 * total:
            continue
        lead = ", ".join(f"{k} {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])[:4])
        print(f"  +0x{key * 0x1000:05x}  {100 * s / total:5.1f} %  exec {most:9d}  {lead}")
    # the main loop: the instructions run as often as its most-run wgmma
    most = max((i[3] for i in ins if i[1].startswith("HGMMA")), default=max(i[3] for i in ins))
    loop = [i[0] for i in ins if i[3] == most]
    first, last = min(loop), max(loop)
    print(f"\ncode run at most an eighth as often as the main loop (+0x{first:05x}..+0x{last:05x}, "
          f"exec {most}): samples and leading reasons")
    for name, inside in (("before it", lambda o: o < first), ("after it", lambda o: o > last)):
        picked = [i for i in ins if i[3] <= most // 8 and inside(i[0])]
        why = {}
        for i in picked:
            for k, v in i[4].items():
                why[k] = why.get(k, 0) + v
        lead = ", ".join(f"{k} {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])[:6] if v)
        print(f"  {name:9s}  {sum(i[2] for i in picked):6d}  {lead}")


if __name__ == "__main__":
    main()
