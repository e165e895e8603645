"""What NVIDIA's OpenCL driver made of the formats kernels: registers, spills and the round loop of
each program that ``bench_formats.py --backend opencl --dump-binaries DIR`` wrote.

Each ``DIR/*.ptx`` is assembled with ptxas (``--arch``, the register cap of its ``.key`` when it
has one) and disassembled with cuobjdump; for its step kernel (``<family>_fmt``) it prints the
registers and spills, then the loop that holds the round (the innermost loop with three or more
global loads and a MUFU: the element math): its static instructions, barriers, global accesses by
width, warp reductions (REDUX, SHFL) and float16 conversions (F2F, HADD2.F32). Static counts: the
loop includes the tail and slow-division paths that rarely run, so compare programs of the same
format before and after a change, not formats with each other. ``round_path`` (printed by
ocl_sass_proxy.py for its --hot builds) counts what a full round issues where every fast path holds.

    python benchmarks/ptx_rounds.py DIR [--bin PTXAS_DIR] [--arch sm_90]

Without a CUDA toolkit, PyPI's wheels hold both tools (numba-cuda's NVVM writes PTX 9.5, which
needs ptxas 13.5 or later): ``pip download --no-deps "nvidia-cuda-nvcc==13.5.*"
nvidia-cuda-cuobjdump``, unzip them and pass their ``nvidia/cu13/bin`` as ``--bin``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import heapq
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_functions(text: str, guards: bool = False) -> Dict[str, List[tuple]]:
    """cuobjdump's SASS as {function: [(address, opcode, operands)]}; ``guards``: (address, opcode,
    operands, guard predicate or '')."""
    out: Dict[str, List[tuple]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = _INS.search(line)
        if m and name:
            entry = (int(m.group(1), 16), m.group(3), m.group(4))
            out[name].append(entry + ((m.group(2) or "").strip(),) if guards else entry)
    return out


def round_loop(ins: List[Tuple[int, str, str]]) -> List[Tuple[int, str, str]]:
    """The innermost backward branch's body holding 3+ global loads and 4+ MUFU (the round: a lane's
    elements take a square root or division each; a shorter back edge of the chunk loop, a chunk with
    no round of its own, holds the chunk's loads and at most one)."""
    loads = [a for a, o, _ in ins if o.startswith("LDG")]
    mufu = [a for a, o, _ in ins if o.startswith("MUFU")]
    best = None
    for a, o, r in ins:
        m = re.match(r"\s*(?:!?U?P\d+,\s*)?0x([0-9a-f]+)", r)
        if not (o.startswith("BRA") and m):
            continue
        t = int(m.group(1), 16)
        if t < a and sum(t <= x <= a for x in loads) >= 3 and sum(t <= x <= a for x in mufu) >= 4:
            if best is None or a - t < best[1] - best[0]:
                best = (t, a)
    return [] if best is None else [x for x in ins if best[0] <= x[0] <= best[1]]


def _successors(ins: List[Tuple[int, str, str, str]]):
    """A function of an index ``i`` into ``ins`` (sass_functions(..., guards=True)'s entries): the
    indices that can follow instruction ``i`` statically, the next one unless an unconditional branch
    or exit ends the block, and a branch's target; neither where it is a call (a slow path's
    subroutine)."""
    idx = {a: i for i, (a, _, _, _) in enumerate(ins)}

    def successors(i):
        a, o, r, guard = ins[i]
        nxt = [i + 1] if i + 1 < len(ins) and not ins[i + 1][1].startswith("CALL") else []
        if o.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)\s*$", r)
            t = idx.get(int(m.group(1), 16)) if m else None
            tgt = [t] if t is not None and not ins[t][1].startswith("CALL") else []
            return tgt + (nxt if guard or re.match(r"\s*!?U?P\d", r) else [])
        if o.startswith(("EXIT", "RET")):
            return nxt if guard else []
        return nxt

    return successors


def round_path(ins: List[Tuple[int, str, str, str]], ends: Tuple[str, ...] = (".128",)) -> int:
    """The shortest static path from the first 16-byte global load to the last 16-byte global store
    (``ends``: the widths a last store may have; (".128", ".64") reaches the int8 codes' 8-byte store,
    after the quantizers) in the round loop (one full vector round, each uniform choice at its cheapest, never into a
    called slow path): the instructions a work-item issues for a round where every fast path holds.
    0 where there is none.
    The round loop's count includes the paths that rarely run (tails, slow divisions, a redo). Meant
    for a build whose loop is the full round alone (ocl_sass_proxy.py --hot): where the loop holds
    the tails too, a 16-byte access may sit in one of them and the path is not a round's.
    ``ins``: sass_functions(..., guards=True)'s entries."""
    loop = round_loop([x[:3] for x in ins])
    if not loop:
        return 0
    lo, hi = loop[0][0], loop[-1][0]
    successors = _successors(ins)
    starts = [i for i, (a, o, _, _) in enumerate(ins) if lo <= a <= hi and o.startswith("LDG") and o.endswith(".128")]
    ends = [i for i, (a, o, _, _) in enumerate(ins) if lo <= a <= hi and o.startswith("STG") and o.endswith(ends)]
    if not starts or not ends:
        return 0
    start, end = starts[0], ends[-1]

    dist, queue = {start: 1}, [(1, start)]
    while queue:
        d, i = heapq.heappop(queue)
        if i == end:
            return d
        if d > dist.get(i, 1 << 30):
            continue
        for j in successors(i):
            if d + 1 < dist.get(j, 1 << 30):
                dist[j] = d + 1
                heapq.heappush(queue, (d + 1, j))
    return 0


def round_cycle(ins: List[Tuple[int, str, str, str]]) -> int:
    """The shortest static path once around the round loop, from its first instruction back to it by
    the loop's backward branch (each uniform choice at its cheapest, never into a called slow path):
    what a round issues, its loop control included, where every fast path holds. Unlike
    :func:`round_path` it needs no particular last store (a compiler that duplicated the stores into
    a rarely taken path does not lengthen it). Meant for a build whose loop is the full round alone.
    0 where there is no loop."""
    loop = round_loop([x[:3] for x in ins])
    if not loop:
        return 0
    successors = _successors(ins)
    start = next(i for i, x in enumerate(ins) if x[0] == loop[0][0])

    dist, queue = {}, [(0, start)]
    while queue:
        d, i = heapq.heappop(queue)
        for j in successors(i):
            if j == start:
                return d + 1
            if d + 1 < dist.get(j, 1 << 30):
                dist[j] = d + 1
                heapq.heappush(queue, (d + 1, j))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--bin", help="folder of ptxas and cuobjdump (default: PATH)")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    tool = {t: os.path.join(args.bin, t) if args.bin else shutil.which(t) for t in ("ptxas", "cuobjdump")}
    if not all(tool.values()) or not all(os.path.exists(p) for p in tool.values()):
        print(f"skipped: ptxas and cuobjdump not found ({tool}); pass --bin")
        return 0
    files = sorted(glob.glob(os.path.join(args.dir, "*.ptx")))
    if not files:
        print(f"no .ptx files in {args.dir}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            stem = os.path.basename(path)[:-4]
            key = open(path[:-4] + ".key").read() if os.path.exists(path[:-4] + ".key") else ""
            cap = re.search(r"maxrregcount=(\d+)", key)
            src = os.path.join(tmp, stem + ".ptx")
            with open(path, "rb") as f, open(src, "wb") as g:
                g.write(f.read().rstrip(b"\0"))  # the driver's binary ends in NULs
            cubin = os.path.join(tmp, stem + ".cubin")
            cmd = [tool["ptxas"], f"-arch={args.arch}", "-O3", "-v", src, "-o", cubin]
            if cap:
                cmd.insert(1, f"-maxrregcount={cap.group(1)}")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print(f"{stem}: ptxas failed: {r.stderr.strip()[-300:]}")
                continue
            sass = subprocess.run([tool["cuobjdump"], "-sass", cubin], capture_output=True, text=True).stdout
            for name, ins in sass_functions(sass).items():
                if not name.endswith("_fmt") and not name.startswith("fmt_lamb_apply"):
                    continue
                info = re.search(rf"Function properties for {re.escape(name)}\s+(.*?)\n.*?(Used \d+ registers)",
                                 r.stderr, re.S)
                body = round_loop([x[:3] for x in ins])
                ops = collections.Counter(o for _, o, _ in body)
                base = collections.Counter(o.split(".")[0] for _, o, _ in body)
                access = " ".join(f"{o}:{n}" for o, n in sorted(ops.items()) if o.startswith(("LDG", "STG")))
                print(f"{stem} {name}: {info.group(2) if info else '?'}, {info.group(1) if info else ''}")
                print(f"    round loop {len(body)} instructions, BAR {base['BAR']}, REDUX {base['REDUX']}, "
                      f"SHFL {base['SHFL']}, F2F {base['F2F'] + base['F2FP']}, HADD2 {base['HADD2']}; {access}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
