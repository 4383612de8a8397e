#!/usr/bin/env python3
"""Sums ncu's per-instruction warp samples (tools/gpu_check.sh stalls: stalls_source.csv) by the
regions between a kernel's trace points (Mark: each reads SR_CLOCKLO), so a trace phase's
time can be read as instructions per warp times cycles per instruction.

  python3 tools/stall_regions.py stalls_source.csv [KERNEL_INDEX [TOP]]

KERNEL_INDEX: which profiled launch (default 0); TOP: also list each region's TOP instructions
by samples. Regions are in address order: with several instances of a loop (templates) the
later ones follow the kernel's last trace point; a region's instruction count is executed
warp instructions over the launch's warps (blocks x warps per block, from the most executed
instruction of the kernel's first region).
"""
import collections
import csv
import sys


def kernels(path):
    found, current = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                current = {"name": row[1], "rows": []}
                found.append(current)
            elif row[0] == "Address":
                current["header"] = row
            elif current is not None:
                current["rows"].append(row)
    return found


def main():
    path = sys.argv[1]
    which = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    kernel = kernels(path)[which]
    col = {name: i for i, name in enumerate(kernel["header"])}
    reasons = [n for n in kernel["header"] if n.startswith("stall_") and "Not Issued" not in n]

    def number(row, name):
        return int(row[col[name]] or 0)

    regions = [{"start": "kernel start", "rows": []}]
    for row in kernel["rows"]:
        if "SR_CLOCKLO" in row[col["Source"]]:
            regions.append({"start": row[0][-5:] + " " + row[col["Source"]].strip(), "rows": []})
        regions[-1]["rows"].append(row)
    warps = max(number(r, "Instructions Executed") for r in regions[0]["rows"]) or 1
    total = sum(number(r, "# Samples") for r in kernel["rows"]) or 1
    print(f"{kernel['name'][:100]}\n{total} samples, {warps} warps")
    for i, region in enumerate(regions):
        samples = sum(number(r, "# Samples") for r in region["rows"])
        executed = sum(number(r, "Instructions Executed") for r in region["rows"])
        if executed == 0:
            continue
        stalls = collections.Counter()
        for r in region["rows"]:
            for name in reasons:
                stalls[name[6:]] += number(r, name)
        common = ", ".join(f"{k} {v}" for k, v in stalls.most_common(4) if v)
        print(f"region {i:2} from {region['start'][:40]:40} {executed / warps:6.0f} instr/warp "
              f"{samples:6} samples ({100 * samples / total:4.1f} %)  {common}")
        by_samples = sorted(region["rows"], key=lambda r: -number(r, "# Samples"))
        for r in by_samples[:top]:
            print(f"    {r[0][-5:]} {r[col['Source']].strip()[:60]:60} {number(r, '# Samples')}")


if __name__ == "__main__":
    main()
