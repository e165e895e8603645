"""The cpu int8 state's block loops one by one: one thread, a working set in cache, CPU time.

Times each form of the decode (``q[code] * scale``) and the encode (the code of ``(x * pre) * inv``)
in :mod:`optirs.backends.cpu.int8_native` over blocks of 256 values, in alternation, and checks
that every form writes the same bits. The int8 rows of ``bench_cpu_formats.py`` spend, per
parameter and moment, about one decode, one absmax and one encode beside the float32-state step.

    PYTHONPATH=. python benchmarks/bench_int8_parts.py [--values 8192] [--reps 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from numba import njit

    import optirs.backends.cpu.int8_native as N
    from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints
    from optirs.backends.cpu.formats_kernels import _block_absmax
    from optirs.core.formats import dynamic_map

    decoders = {"tables": N.decode_block_tables}
    encoders = {"tables": N.encode_block_tables}
    if N.NATIVE:
        decoders.update(registers=N.decode_block_registers, gathers=N.decode_block_gathers)
        encoders.update(search=N.encode_block_registers, gathers=N.encode_block_gathers)
    if N.VBMI:
        decoders.update(planes=N.decode_block_planes)
        encoders.update(planes=N.encode_block_planes)

    def decode_loop(f):
        @njit
        def run(w, q, s, buf, reps):
            for _ in range(reps):
                for b in range(0, w.shape[0], 256):
                    f(w, q, s, b, 256, buf[b : b + 256])
        return run

    def encode_loop(f, kind):
        @njit
        def run(blk, pre, inv, key, mid, tbl, w, ix, reps):
            # pre = inv = 1 on values scaled already: the forms that overwrite their input with
            # the scaled values (tables, words) leave it as it was
            for _ in range(reps):
                for b in range(0, w.shape[0], 256):
                    if kind == 0:
                        f(blk, 256, pre, inv, mid, tbl, w, b, ix)
                    else:
                        f(blk, 256, pre, inv, key, mid, tbl, w, b, ix)
        return run

    @njit
    def absmax_loop(x, reps):
        t = np.float32(0)
        for _ in range(reps):
            for b in range(0, x.shape[0], 256):
                t += _block_absmax(x[b : b + 256], 256)
        return t

    rng = np.random.default_rng(3)
    n = args.values
    results = {}
    from llvmlite import binding

    print(f"{binding.get_host_cpu_name()}, AVX-512F forms: {N.NATIVE}, {n} values, one thread, CPU ns a value "
          f"(load average {os.getloadavg()[0]:.1f})")
    for signed in (True, False):
        mid, tbl, q = padded_midpoints(signed), bucket_table(signed), np.asarray(dynamic_map(signed), np.float32)
        keys = N.encoder_keys(mid, tbl)
        tree = keys["search"]
        x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        if not signed:
            x = x * x
        scale = np.float32(np.abs(x).max())
        qt = N.decoder_table(q)  # what the decoders read: q, then its byte planes
        inv = np.float32(1) / scale
        codes = rng.integers(0, 256, n, dtype=np.uint8)
        runs = {}
        outs = {}
        for name, f in decoders.items():
            run, buf = decode_loop(f), np.zeros(n, np.float32)
            run(codes, qt, scale, buf, 1)
            outs[name] = buf.copy()
            runs["decode " + name] = (run, (codes, qt, scale, buf))
        for name, f in encoders.items():
            kind = 0 if name == "tables" else 2
            run, w = encode_loop(f, kind), np.zeros(n, np.uint8)
            a = (x[:256] * inv, np.float32(1), np.float32(1), keys.get(name, tree), mid, tbl, w,
                 np.zeros(256, np.uint32))
            run(*a, 1)
            outs["enc " + name] = w.copy()
            runs["encode " + name] = (run, a)
        runs["absmax"] = (absmax_loop, (x,))
        absmax_loop(x, 1)
        ref = outs.pop("tables")
        for k, v in outs.items():
            want = ref if not k.startswith("enc") else outs["enc tables"]
            if not np.array_equal(np.asarray(v).view(np.uint8), np.asarray(want).view(np.uint8)):
                print(f"signed={signed}: {k} differs")
                return 1
        times = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, (run, a) in runs.items():
                t = time.thread_time()
                run(*a, args.reps)
                times[k].append((time.thread_time() - t) * 1e9 / args.reps / n)
        for k, v in times.items():
            print(f"  {'signed' if signed else 'unsigned'} {k:18s} " + " ".join(f"{t:.3f}" for t in v), flush=True)
        results["signed" if signed else "unsigned"] = {k: [round(t, 4) for t in v] for k, v in times.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(native=N.NATIVE, values=n, load_average=os.getloadavg()[0], results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
