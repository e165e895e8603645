"""Where a cpu format loop's time goes: AdamW's format step with one part at a time switched off.

Timing only: with a part off the values are wrong. Each part runs in a process of its own with
an empty numba cache (the loops are variants compiled from templates whose helpers are replaced
before anything compiles, so no loop of another process can load). A part's figure is the time
its removal saved, in ns a parameter, beside the whole step of the same thread count. The same
work has taken 1.4 to 2.6 ns a parameter in different processes on a GPU host's Xeon (one thread),
so every process times ``--allocations`` fresh problems (new arrays), the parts run ``--repeats``
times in rotation, and each figure is the median of all of them (the spread is printed too):

- ``decode``: the int8 codes' decode (the block's values are left as they were);
- ``encode``: the int8 codes' encode (only the block's scale is stored);
- ``master_join`` / ``master_split``: a remainder or float32 master's load and store (the parameter
  word alone, shifted);
- ``grad_nan``: the gradient decode's NaN test (a 16-bit gradient by its shift alone);
- ``divider``: Adam's square root and two divisions (products in their place).

    PYTHONPATH=. python benchmarks/diag_cpu_format_parts.py \
        --formats "remainder8, int8 sqrt;remainder16, int8 sqrt;fp32 params, int8 sqrt" --threads 1,16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PARTS = ("none", "decode", "encode", "master_join", "master_split", "grad_nan", "divider")


def _switch_off(part: str) -> None:
    """Replace the helpers of ``part`` in the cpu format loops' module (before any loop compiles)."""
    import numpy as np
    from numba import njit

    from optirs.backends.common.bits32 import shl32, shr32
    from optirs.backends.common.formats import bits_f32, f32_bits
    from optirs.backends.cpu import formats_kernels as fk
    from optirs.core.formats import F32

    inline = njit(cache=False, error_model="numpy", inline="always")
    if part == "decode":
        @inline
        def no_decode(w, q, s, o, n, buf):
            pass
        fk._decode_block = fk._decode_sqrt = no_decode
    elif part == "encode":
        @inline
        def scale_only(w, scales, lv, blk, o, n, buf, m):
            scales[blk] = m

        @inline
        def scale_only_scaled(w, scales, mid, tbl, tree, blk, o, n, buf, ix, m):
            scales[blk] = m
        fk._encode_sqrt = fk._encode_roots = scale_only
        fk._encode_scaled = scale_only_scaled
    elif part == "master_join":
        @njit(cache=False, error_model="numpy")
        def join(praw, mraw, fc):
            return bits_f32(praw) if fc.param == F32 else bits_f32(shl32(praw, 16))
        fk._load_master_cpu = fk._load_master_num = join
    elif part == "master_split":
        @njit(cache=False, error_model="numpy")
        def split(x, fc, key, i, num):
            u = f32_bits(x)
            return (u, np.uint32(0)) if fc.param == F32 else (shr32(u, 16), shr32(u, 8))
        fk._store_master_cpu = split
    elif part == "grad_nan":
        @njit(cache=False, error_model="numpy")
        def shift(raw, kind):
            return bits_f32(raw) if kind == F32 else bits_f32(shl32(raw, 16))
        fk.decode_value = shift
    elif part == "divider":
        @njit(cache=False, error_model="numpy")
        def adam_products(p, g, m, v, vmax, sc):
            g = g * sc.grad_factor
            p = p * sc.decay_factor
            m = sc.beta1 * m + sc.one_minus_beta1 * g
            v = sc.beta2 * v + sc.one_minus_beta2 * g * g
            return p - (sc.step_size * m) * (v * sc.eps + np.float32(1)), m, v, vmax
        fk.element_update = adam_products


def _child(args) -> int:
    _switch_off(args.child)
    import numba

    import bench_cpu_formats as bcf

    per = args.size // args.tensors
    out = []
    for spec in bcf.select(args.formats):
        if spec[4] == "bfloat16" and args.child in ("decode", "encode"):
            continue  # no int8 codes
        for _ in range(args.allocations):
            p = bcf.Problem(spec, [(per,)] * args.tensors, "adamw")
            out.append(dict(format=spec[0], part=args.child, threads=numba.get_num_threads(),
                            ns_per_param=statistics.median(bcf.step_ns(p, args.steps, args.batches))))
            del p
    print(json.dumps(out), flush=True)
    return 0


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="remainder8, int8 sqrt;remainder16, int8 sqrt;fp32 params, int8 sqrt",
                    help="bench_cpu_formats.py's --formats (';' between labels)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--size", type=int, default=1 << 22, help="parameters in all")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--allocations", type=int, default=2, help="fresh problems (new arrays) a process times")
    ap.add_argument("--repeats", type=int, default=2, help="rotations through the parts")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    import bench_cpu_formats as bcf

    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts {unknown}: expected some of {list(PARTS)}")
    if "none" not in parts:
        parts.insert(0, "none")
    if not bcf.select(args.formats):
        ap.error(f"--formats {args.formats!r} matches no format of bench_cpu_formats.py")
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads {args.threads!r}: expected comma-separated integers")
    rows: List[Dict[str, Any]] = []
    for n, rep, part in itertools.product(threads, range(args.repeats), parts):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache, NUMBA_NUM_THREADS=str(n))
            cmd = [sys.executable, os.path.abspath(__file__), "--child", part, "--formats", args.formats,
                   "--size", str(args.size), "--tensors", str(args.tensors), "--steps", str(args.steps),
                   "--batches", str(args.batches), "--allocations", str(args.allocations)]
            print(f"  {n} threads, rotation {rep + 1} of {args.repeats}, {part} off ...", flush=True)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"  {part}: FAILED\n{r.stderr[-2000:]}", flush=True)
            continue
        rows += json.loads(r.stdout.strip().splitlines()[-1])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(size=args.size, tensors=args.tensors, rows=rows), f, indent=1)
    runs: Dict[tuple, List[float]] = {}
    for r in rows:
        runs.setdefault((r["format"], r["threads"], r["part"]), []).append(r["ns_per_param"])
    print(f"\nAdamW, {args.size} parameters in {args.tensors} tensors; ns a parameter: the whole step (the "
          "lowest and highest run), then what each part's removal saved (medians)")
    print(f"{'format':48s} {'threads':>7s} {'whole':>19s} " + " ".join(f"{p:>12s}" for p in parts if p != "none"))
    for (fmt, n, part), ts in runs.items():
        if part != "none":
            continue
        t = statistics.median(ts)
        saved = {p: t - statistics.median(v) for (f, k, p), v in runs.items() if f == fmt and k == n}
        print(f"{fmt:48s} {n:7d} {t:7.3f} ({min(ts):.3f}-{max(ts):.3f}) "
              + " ".join(f"{saved[p]:12.3f}" if p in saved else f"{'-':>12s}" for p in parts if p != "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
