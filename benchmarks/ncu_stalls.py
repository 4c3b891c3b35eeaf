"""Where a kernel's warps wait: ncu's per-instruction stall samples, summed by stall reason and by opcode.

Input: the source page of an ncu report as CSV (the command in ``profile_kernel.py``, then)

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python benchmarks/ncu_stalls.py source.csv

Output: each stall reason's share of all samples, then the opcodes with the most samples and their top
reasons. ``long_sb`` on an instruction means it waits for a global load's data (its first use of it).
"""

from __future__ import annotations

import argparse
import collections
import csv
import pathlib


def stall_table(path: pathlib.Path, top: int = 10) -> str:
    rows = list(csv.reader(path.open()))
    header = next(r for r in rows if "Source" in r and "Address" in r)
    column = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_reason: collections.Counter = collections.Counter()
    by_opcode: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows[rows.index(header) + 1 :]:
        words = row[column["Source"]].split() if len(row) == len(header) else []
        if not words:
            continue
        opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]  # "@P0 LDG.E" -> LDG
        for reason in reasons:
            samples = int(row[column[reason]] or 0)
            by_reason[reason] += samples
            by_opcode[opcode][reason] += samples
    total = sum(by_reason.values())
    lines = [
        f"{total} samples; by reason: " + ", ".join(f"{r[6:]} {n / total:.1%}" for r, n in by_reason.most_common(8))
    ]
    for opcode, counts in sorted(by_opcode.items(), key=lambda item: -sum(item[1].values()))[:top]:
        reasons_text = ", ".join(f"{r[6:]} {n / total:.1%}" for r, n in counts.most_common(3))
        lines.append(f"{opcode:8s} {sum(counts.values()) / total:6.1%}  ({reasons_text})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=pathlib.Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=10, help="opcodes to list")
    args = parser.parse_args()
    print(stall_table(args.csv, args.top))


if __name__ == "__main__":
    main()
