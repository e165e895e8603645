"""Whether a one-thread cpu format step's time follows its core or its arrays' placement.

Each child process is pinned to one cpu (``taskset``), runs one numba thread, and times
``--allocations`` fresh problems of one format (AdamW, bench_cpu_formats.py's ``Problem``); for each
it prints the median ns a parameter with the batches' spread, the large arrays' offsets modulo
4 KB and how much of their mappings is in transparent huge pages (``AnonHugePages`` of
/proc/self/smaps). Where the time differs under the same core and placement, something outside
the process decides it (a GPU host's Xeon: docs/benchmarks.md, 2026-12-05 18:58 UTC).

    PYTHONPATH=. python benchmarks/diag_cpu_placement.py --format "remainder8, int8 sqrt" --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def huge_kb(addrs: Dict[str, int]) -> Dict[str, int]:
    """AnonHugePages (kB) of the mapping that holds each address."""
    out: Dict[str, int] = {}
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                span = (lo, hi)
            elif parts and parts[0] == "AnonHugePages:" and span:
                out.update({name: int(parts[1]) for name, a in addrs.items() if span[0] <= a < span[1]})
    return out


def _child(args) -> int:
    import numpy as np

    import bench_cpu_formats as bcf

    spec = bcf.select(args.format)[0]
    per = args.size // 4
    res = []
    for _ in range(args.allocations):
        p = bcf.Problem(spec, [(per,)] * 4, "adamw")
        arrays = {f"p{i}": a for i, a in enumerate(p.params)}
        arrays.update({f"g{i}": a for i, a in enumerate(p.grads)})
        arrays.update({k: a for k, a in p.state.items() if isinstance(a, np.ndarray) and a.nbytes > 65536})
        addrs = {k: a.ctypes.data for k, a in arrays.items()}
        times = bcf.step_ns(p, args.steps, args.batches)
        res.append(dict(ns=statistics.median(times), low=min(times), high=max(times),
                        mod4k=sorted({a % 4096 for a in addrs.values()}), huge_mb=sum(huge_kb(addrs).values()) // 1024,
                        arrays=len(arrays)))
        del p
    print(json.dumps(res), flush=True)
    return 0


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="remainder8, int8 sqrt", help="a bench_cpu_formats.py label (or part of one)")
    ap.add_argument("--cpus", default="", help="comma-separated cpus to pin to in turn (default: all this process may use)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the cpus")
    ap.add_argument("--allocations", type=int, default=3, help="fresh problems a child times")
    ap.add_argument("--size", type=int, default=1 << 22, help="parameters in all (4 tensors)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    import bench_cpu_formats as bcf

    if not bcf.select(args.format):
        ap.error(f"--format {args.format!r} matches no format of bench_cpu_formats.py")
    try:
        cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    except ValueError:
        ap.error(f"--cpus {args.cpus!r}: expected comma-separated integers")
    if shutil.which("taskset") is None:
        ap.error("taskset (util-linux) is needed to pin the children")
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--format", args.format, "--size", str(args.size),
           "--steps", str(args.steps), "--batches", str(args.batches), "--allocations", str(args.allocations)]
    rows = []
    for rnd in range(args.rounds):
        for c in cpus:
            r = subprocess.run(["taskset", "-c", str(c)] + cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"round {rnd} cpu {c}: FAILED\n{r.stderr[-1500:]}", flush=True)
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(dict(round=rnd, cpu=c, problems=res))
            print(f"round {rnd} cpu {c:3d}: " + "  ".join(
                f"{x['ns']:.3f} ({x['low']:.3f}-{x['high']:.3f}) mod 4K {x['mod4k'][:4]}... huge {x['huge_mb']} MB"
                for x in res), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(format=args.format, size=args.size, rows=rows), f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
