"""The cuda formats kernels' SASS without a GPU: a step kernel compiled to sm_90 PTX by numba-cuda,
assembled by ptxas at the backend's register cap, disassembled by cuobjdump.

For each format it prints the registers and stack (spills), and the round loop's instructions by
opcode (``ptx_rounds.round_loop``: the innermost loop with three or more global loads and a MUFU):
enough to see a change's static effect (a division's fast path, a spill, a conversion on the
narrow pipe) before device time is spent on it. The production loop holds the full-group round, the
general round and a small tensor's float32 state side by side, so no shortest path is printed for
it (a static shortest path crosses between them); ``--hot`` compiles make_step_kernel's
measurement build instead (every round the full one, every tensor coded) and prints the full
round's shortest path once around the loop (``ptx_rounds.round_cycle``): what a round issues where
every fast path holds. A count, not a time: on the H200 a loop of 67 executed instructions an
element with spill reloads on its loads' path took 25% longer than main's 84 (docs/benchmarks.md,
2026-12-06). What a round executes an element comes from the device: ncu's source counters, read
by ncu_sass_segments.py.

    python benchmarks/cuda_sass_rounds.py "remainder8, int8 sqrt" "stochastic rounding, int8" --bin DIR

Format labels as bench_formats.py's (any part of one). ``--bin``: a folder with ptxas 13.5 or later
and cuobjdump (ptx_rounds.py says where PyPI has them). The register cap is the backend's
(``optirs.backends.common.register_cap``); ``--maxreg`` another (0: none); ``--keep DIR`` keeps
each kernel's PTX and SASS; ``--used`` the state slots compiled in (a bit each; default the family's
first example's: AdamW's two, no amsgrad).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types as pytypes
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ptx_rounds import round_cycle, round_loop, round_path, sass_functions  # noqa: E402


def formats(labels: List[str]) -> List[tuple]:
    """bench_formats.py's FORMATS rows whose label holds one of ``labels``."""
    import bench_formats as bf

    return [f for f in bf.FORMATS if any(x in f[0] for x in labels)]


def step_ptx(spec: tuple, family: str, hot: bool = False, used: Optional[int] = None) -> tuple:
    """(PTX, kernel name, register cap) of ``family``'s one-launch step in format ``spec``, for sm_90
    (``hot``: make_step_kernel's measurement build, the full round alone, at the cap of a kernel with
    full rounds)."""
    import numba.cuda.dispatcher as dispatcher

    # numba-cuda compiles the kernel's device helpers for the current device: name sm_90 without one
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
    from numba import cuda

    from optirs.backends.common.register_cap import formats_register_cap
    from optirs.backends.cuda import formats_kernels as fk
    from optirs.core.definitions import DEFINITIONS
    from optirs.core.formats import StepFormat

    _, pdt, master, state, sr = spec
    fmt = StepFormat(pdt, pdt, master if pdt != "float32" else None, state, sr)
    d = DEFINITIONS[family]
    if used is None:  # the slots the family's first example keeps (AdamW: no amsgrad, no third slot)
        used = sum(1 << k for k, s in enumerate(d.slots) if s.needed(d.examples[0]))
    kernel = fk.make_step_kernel(d.kernel, fmt.codes, tuple(s.signed for s in d.slots), used, hot=hot,
                                 approx=fk.approx_steps())
    ptx, _ = cuda.compile_ptx(kernel, fk.step_kernel_signature(d.scalars(d.examples[0], 3)), cc=(9, 0))
    cap = formats_register_cap(fmt, "OPTIRS_CUDA_FORMATS_MAXREG", hot or fk.full_group_rounds(fmt.codes, d.kernel))
    return ptx, kernel.__name__, cap


def report(sass: str, stderr: str, hot: bool = False, coded: bool = False) -> List[str]:
    """The lines printed for one assembled kernel (``hot``: with the full round's shortest path, to the
    codes' 8-byte stores where ``coded``)."""
    out = []
    for name, ins in sass_functions(sass, guards=True).items():
        loop = round_loop([x[:3] for x in ins])
        if not loop:
            continue
        if hot:
            path = round_path(ins, (".128", ".64") if coded else (".128",))
            cycle = round_cycle(ins)
            out.append(f"    full round's shortest path {path} instructions ({path / 8:.1f} an element); once "
                       f"around the loop {cycle} ({cycle / 8:.1f} an element)")
        used = re.search(r"Used (\d+) registers", stderr)
        stack = re.search(r"(\d+) bytes (?:cumulative )?stack", stderr)
        ops = collections.Counter(o.split(".")[0] for _, o, _ in loop)
        out.append(f"    {used.group(1) if used else '?'} registers, stack {stack.group(1) if stack else '?'} B; "
                   f"round loop {len(loop)} instructions (every path of it)")
        out.append("    " + " ".join(f"{o}:{n}" for o, n in ops.most_common(20)))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("formats", nargs="+", help="bench_formats.py labels (or parts of them)")
    ap.add_argument("--family", default="adamw")
    ap.add_argument("--maxreg", type=int, default=None, help="a register cap (0: none; default: the backend's)")
    ap.add_argument("--bin", help="folder of ptxas and cuobjdump (default: PATH)")
    ap.add_argument("--keep", help="write each kernel's .ptx and .sass here")
    ap.add_argument("--used", type=int, default=None,
                    help="the state slots compiled in, a bit each (default: those of the family's first example: "
                         "AdamW's two without amsgrad)")
    ap.add_argument("--hot", action="store_true",
                    help="the measurement build (every round full, every tensor coded): prints the full round's "
                         "shortest path, what a round issues where every fast path holds")
    args = ap.parse_args(argv)
    from optirs.core.formats import INT8_STATES

    specs = formats(args.formats)
    if not specs:
        ap.error(f"{args.formats}: no format of bench_formats.py has one of these in its label")
    from optirs.core.definitions import DEFINITIONS

    if args.family not in DEFINITIONS:
        ap.error(f"--family {args.family!r}: expected one of {sorted(DEFINITIONS)}")
    tool: Dict[str, Any] = {t: os.path.join(args.bin, t) if args.bin else shutil.which(t) for t in ("ptxas", "cuobjdump")}
    if not all(tool.values()) or not all(os.path.exists(p) for p in tool.values()):
        print(f"skipped: ptxas and cuobjdump not found ({tool}); pass --bin (ptx_rounds.py says where to get them)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        for spec in specs:
            ptx, name, cap = step_ptx(spec, args.family, args.hot, args.used)
            cap = cap if args.maxreg is None else args.maxreg
            stem = os.path.join(work, re.sub(r"\W+", "_", spec[0]).strip("_"))
            with open(stem + ".ptx", "w") as f:
                f.write(ptx)
            cmd = [tool["ptxas"], "-arch=sm_90", "-O3", "-v", stem + ".ptx", "-o", stem + ".cubin"]
            if cap:
                cmd.insert(1, f"-maxrregcount={cap}")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                version = re.search(r"\.version (\S+)", ptx)
                print(f"{spec[0]}: ptxas failed on PTX {version.group(1) if version else '?'} (a ptxas that reads "
                      f"it: --bin): {r.stderr.strip()[-300:]}")
                return 1
            sass = subprocess.run([tool["cuobjdump"], "-sass", stem + ".cubin"], capture_output=True, text=True).stdout
            if args.keep:
                with open(stem + ".sass", "w") as f:
                    f.write(sass)
            print(f"{spec[0]} ({args.family}, {name}, cap {cap or 'none'}):")
            for line in report(sass, r.stderr, args.hot, spec[3] in INT8_STATES) or ["    no round loop found"]:
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
