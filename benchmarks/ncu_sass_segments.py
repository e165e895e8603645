"""Where a kernel's instructions and stalls go, per element: an Nsight Compute source page read back.

The input is ncu's per-SASS-instruction page of one profiled kernel (``SourceCounters``), as CSV:

    ncu --profile-from-start off --clock-control none --kernel-name regex:formats --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o r8 python benchmarks/ncu_formats.py 124m r8_sqrt
    ncu -i r8.ncu-rep --page source --csv --print-source sass > r8-sass.csv
    python benchmarks/ncu_sass_segments.py r8-sass.csv --elements 124439808

Printed: executed instructions per element (warp instructions x 32 / elements), the opcodes' share,
the warp stall reasons' share, and the heaviest segments: runs of consecutive instructions that
executed the same number of times (a basic block, or several), each with its instructions per
element, its share of the stall samples and its first instruction. A formats kernel's round shows
as the segments executed once a group (elements / 256 times).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from typing import Dict, List, Tuple

_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def _int(text: str) -> int:
    return int(text.replace(",", "") or 0)


def read(path: str) -> Tuple[List[Tuple[str, str, int, int]], Dict[str, int]]:
    """(address, instruction, executions, stall samples) per SASS line, and the stall reasons' sums."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # the page starts with the kernel's name on a line of its own, then the header
    head = next((i for i, r in enumerate(rows) if "Instructions Executed" in r), None)
    if head is None:
        raise ValueError(f"{path}: no 'Instructions Executed' column (expected ncu --page source --csv "
                         "--print-source sass of a SourceCounters profile)")
    hdr = rows[head]
    ia, isrc, iadr = hdr.index("Instructions Executed"), hdr.index("Source"), hdr.index("Address")
    ist = hdr.index("Warp Stall Sampling (All Samples)") if "Warp Stall Sampling (All Samples)" in hdr else None
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    lines, stalls = [], collections.Counter()
    for r in rows[head + 1:]:
        if len(r) <= max(ia, isrc, iadr):
            continue
        try:
            n = _int(r[ia])
        except ValueError:
            continue
        lines.append((r[iadr], r[isrc].strip(), n, _int(r[ist]) if ist is not None else 0))
        for i, name in reasons:
            if i < len(r):
                stalls[name] += _int(r[i])
    return lines, dict(stalls)


def segments(lines) -> List[List]:
    """Runs of consecutive instructions with the same execution count: [address, count of
    instructions, executions, stall samples, first instruction]."""
    out: List[List] = []
    for adr, src, n, st in lines:
        if out and out[-1][2] == n:
            out[-1][1] += 1
            out[-1][3] += st
        else:
            out.append([adr, 1, n, st, src])
    return out


def opcode(src: str) -> str:
    return _PREDICATE.sub("", src).split(" ")[0].split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--elements", type=int, required=True, help="elements the kernel stepped")
    ap.add_argument("--top", type=int, default=25, help="segments to list")
    args = ap.parse_args(argv)
    if args.elements <= 0:
        ap.error(f"--elements {args.elements}: expected a positive count")
    try:
        lines, stalls = read(args.csv)
    except (OSError, ValueError) as e:
        print(f"ncu_sass_segments: {e}", file=sys.stderr)
        return 2
    per = 32.0 / args.elements
    total = sum(n for _, _, n, _ in lines)
    samples = sum(st for *_, st in lines) or 1
    print(f"{args.csv}: {len(lines)} instructions in the code, {total * per:.1f} executed an element")
    ops = collections.Counter()
    for _, src, n, _ in lines:
        ops[opcode(src)] += n
    print("opcodes, an element: " + ", ".join(f"{op} {n * per:.2f}" for op, n in ops.most_common(16)))
    s = sum(stalls.values()) or 1
    print("stall reasons: " + ", ".join(f"{k} {100 * v / s:.1f}%" for k, v in
                                         sorted(stalls.items(), key=lambda kv: -kv[1]) if v / s >= 0.01))
    print(f"{'address':>8s} {'instr':>6s} {'executed':>10s} {'an element':>10s} {'stalls':>7s}  first instruction")
    for adr, k, n, st, src in sorted(segments(lines), key=lambda g: -g[1] * g[2])[:args.top]:
        print(f"{adr[-8:]:>8s} {k:6d} {n:10d} {k * n * per:10.2f} {100 * st / samples:6.1f}%  {src[:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
