"""The OpenCL formats kernels' SASS without NVIDIA's OpenCL driver: the host's program text and
defines compiled by clang (OpenCL C 1.2 -> NVPTX, libclc's builtins), then ptxas and cuobjdump.

A proxy for what the driver makes of the C (its compiler is NVVM, an older LLVM, and its own
builtins: libclc lowers ``vload_half`` to scalar loads and emulates the float16 rounding, NVIDIA's
does not), good for comparing the same format before and after a change of the C. ``--hot``
compiles every round as full, aligned and not a small tensor (a measurement build: the tail paths
drop out of the round loop). Prints the step kernel's registers and spills and its round loop
(``ptx_rounds.round_loop``) and, with ``--hot``, a full round's shortest path through it
(``ptx_rounds.round_path``: what a round issues where every fast path holds, the figure to compare
when a change adds a rarely taken path). Needs clang-14, llvm-14 and libclc-14 (Debian: ``apt-get install
clang-14 libclc-14``), ptxas and cuobjdump; skips cleanly without them.

    python benchmarks/ocl_sass_proxy.py P G M S SR [--family adam] [--hot] [--maxreg 64] [-D NAME=VALUE ...]
    python benchmarks/ocl_sass_proxy.py 1 1 3 1 0 --hot            # remainder8 + bf16 state
    python benchmarks/ocl_sass_proxy.py 0 0 0 2 0 --hot -D OPTIRS_NV_WARP=2   # with the warp reduction
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ptx_rounds import round_loop, round_path, sass_functions  # noqa: E402

LIBCLC = "/usr/lib/clc/nvptx64--nvidiacl.bc"


def hot(src: str) -> str:
    """Every round full and aligned, no small int8 tensor (a measurement build only)."""
    out = re.sub(r"const int nv = (?:\(int\))?clamp\([^;]*;", "const int nv = 8;", src)
    out = re.sub(r"const int aligned = \(int\)\(\(row.s6 >> 16\) & 1\);", "const int aligned = 1;", out)
    out = out.replace("sl.is_small = FMT_INT8 && small >= 0;", "sl.is_small = 0;")
    out = out.replace("sl.aligned = aligned;", "sl.aligned = 1;")
    if "const int nv = 8;" not in out or "sl.is_small = 0;" not in out:
        raise SystemExit("the --hot substitutions no longer match optirs_formats.cl: update hot()")
    return out


def _float8_ptx(path: str) -> None:
    """llc-14 writes PTX ISA 7.0 for sm_80; the float8 state's conversions (inline PTX from
    OPTIRS_NV_PTX=3) need 7.8 and sm_89 on, as NVIDIA's driver writes for an H100: the header raised
    to ISA 7.8, sm_90 (the rest of the text is valid there too)."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"^\.version \d+\.\d+", ".version 7.8", text, count=1, flags=re.M)
    text = re.sub(r"^\.target sm_\d+", ".target sm_90", text, count=1, flags=re.M)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("codes", nargs=5, type=int, metavar="P G M S SR", help="FormatCodes (param grad master state sr)")
    ap.add_argument("--family", default="adam")
    ap.add_argument("--used", type=int, default=3, help="OPTIRS_FMT_USED (state slots in use)")
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--maxreg", type=int, default=0, help="ptxas -maxrregcount (the int8 programs: 64)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="an extra define NAME=VALUE")
    ap.add_argument("--bin", help="folder of ptxas and cuobjdump (default: PATH)")
    ap.add_argument("--keep", help="write the .cl, .ptx and .sass here")
    args = ap.parse_args(argv)
    tools = {t: shutil.which(t) for t in ("clang-14", "llvm-link-14", "opt-14", "llc-14")}
    tools.update({t: os.path.join(args.bin, t) if args.bin else shutil.which(t) for t in ("ptxas", "cuobjdump")})
    missing = [t for t, p in tools.items() if not p or not os.path.exists(p)]
    missing += [] if os.path.exists(LIBCLC) else [LIBCLC]
    if missing:
        print(f"skipped: {', '.join(missing)} not found")
        return 0
    from optirs.backends.opencl.formats import format_source

    p, g, m, s, sr = args.codes
    src = format_source(args.family, 128)
    if args.hot:
        src = hot(src)
    defines = ["OPTIRS_WG=128", "OPTIRS_CHUNK=2048", f"OPTIRS_FMT_PARAM={p}", f"OPTIRS_FMT_GRAD={g}",
               f"OPTIRS_FMT_MASTER={m}", f"OPTIRS_FMT_STATE={s}", f"OPTIRS_FMT_SR={sr}", f"OPTIRS_FMT_USED={args.used}",
               "OPTIRS_FMT_SIGNED=1", f"OPTIRS_FMT_LAMB={int(args.family == 'lamb')}",
               "asm=__asm__"] + args.defines  # clang takes inline asm as __asm__ in OpenCL C
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        stem = os.path.join(work, f"{args.family}-{p}_{g}_{m}_{s}_{sr}" + ("-hot" if args.hot else ""))
        with open(stem + ".cl", "w") as f:
            f.write(src)
        steps = [
            [tools["clang-14"], "-x", "cl", "-cl-std=CL1.2", "-target", "nvptx64-nvidia-nvcl", "-Xclang",
             "-finclude-default-header", "-Xclang", "-cl-ext=+cl_khr_fp16", "-O3",
             "-cl-fp32-correctly-rounded-divide-sqrt", "-ffp-contract=off", "-emit-llvm", "-c",
             *[f"-D{d}" for d in defines], stem + ".cl", "-o", stem + ".bc"],
            [tools["llvm-link-14"], stem + ".bc", LIBCLC, "--only-needed", "-o", stem + ".l.bc"],
            [tools["opt-14"], "-O3", stem + ".l.bc", "-o", stem + ".o.bc"],
            [tools["llc-14"], "-mcpu=sm_80", "-mattr=+ptx70", stem + ".o.bc", "-o", stem + ".ptx"],
            [tools["ptxas"], "-arch=sm_90", "-O3", "-v", *([f"-maxrregcount={args.maxreg}"] if args.maxreg else []),
             stem + ".ptx", "-o", stem + ".cubin"],
        ]
        log = ""
        for cmd in steps:
            if cmd[0] == tools["ptxas"] and s == 4:
                _float8_ptx(stem + ".ptx")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                print(f"{os.path.basename(cmd[0])} failed:\n{r.stderr[-3000:]}")
                return 1
            log = r.stderr
        sass = subprocess.run([tools["cuobjdump"], "-sass", stem + ".cubin"], capture_output=True, text=True).stdout
        with open(stem + ".sass", "w") as f:
            f.write(sass)
    kernel = f"{args.family}_fmt" if args.family != "lamb" else "fmt_lamb_apply"
    ins = sass_functions(sass, guards=True).get(kernel, [])
    path = round_path(ins)
    # int8 state: a round ends at its codes' 8-byte stores, after the quantizers
    path8 = round_path(ins, (".128", ".64")) if s in (2, 3, 4) else 0
    ins = [x[:3] for x in ins]
    info = re.search(rf"Function properties for {kernel}\s+(.*?)\n.*?(Used \d+ registers)", log, re.S)
    body = round_loop(ins)
    ops = collections.Counter(o.split(".")[0] for _, o, _ in body)
    print(f"{kernel} {p}_{g}_{m}_{s}_{sr}{' (hot)' if args.hot else ''}: "
          f"{info.group(2) if info else '?'}, {info.group(1) if info else ''}")
    print(f"    round loop {len(body)} instructions, BAR {ops['BAR']}, global accesses "
          f"{sum(n for o, n in ops.items() if o in ('LDG', 'STG'))}: "
          + " ".join(f"{o}:{n}" for o, n in ops.most_common(16)))
    if args.hot:
        print(f"    full round's shortest path {path} instructions ({path / 8:.1f} an element)")
        if path8:
            print(f"    ... to the int8 codes' last store {path8} instructions ({path8 / 8:.1f} an element)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
