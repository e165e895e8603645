"""Checks the cpu's register int8 encoder against the contract's bucket-table count for every float32.

``optirs.backends.cpu.int8_native`` finds an int8 code by a binary search over the midpoints held
in AVX-512 registers; this script compares its codes with
``optirs.backends.common.int8_buckets.quantize_table`` for all 2**32 float32 bit patterns (as the
scaled value ``y``: ``pre = inv = 1``) of the signed and the unsigned map, and the register decoder
with ``q[code] * scale`` for all 256 codes at a few scales. Needs a cpu with AVX-512F; takes some
minutes (the numpy reference is the slow side).

    PYTHONPATH=. python benchmarks/check_int8_native.py [--step 24]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", type=int, default=24, help="log2 of the patterns per batch")
    args = ap.parse_args()
    from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints, quantize_table
    from optirs.backends.cpu import int8_native as N
    from optirs.core.formats import dynamic_map

    if not N.NATIVE:
        print("this cpu has no AVX-512F: the register forms are not compiled here")
        return 2
    n = 1 << args.step
    t0 = time.time()
    for signed in (True, False):
        mid, tbl = np.asarray(padded_midpoints(signed)), bucket_table(signed)
        q = np.asarray(dynamic_map(signed), np.float32)
        tree = np.zeros(256, np.float32)
        N.eytzinger(mid, tree)
        codes = np.arange(256, dtype=np.uint8)
        for s in (np.float32(1), np.float32(3.7e-3), np.float32(2.0**-140), np.float32(np.inf), np.float32(np.nan)):
            out = np.zeros(256, np.float32)
            N.decode_block_registers(codes, q, s, 0, 256, out)
            if not np.array_equal(out.view(np.uint32), (q * s).view(np.uint32)):
                print(f"decode differs: signed={signed} scale={s!r}")
                return 1
        got = np.zeros(n, np.uint8)
        ix = np.zeros(256, np.uint32)
        one = np.float32(1)
        for start in range(0, 1 << 32, n):
            y = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32).view(np.float32)
            N.encode_block_registers(y, n, one, one, tree, mid, tbl, got, 0, ix)
            want = quantize_table(y, mid, tbl)
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                print(f"signed={signed}: y bits 0x{start + bad:08x} coded {got[bad]}, expected {want[bad]}")
                return 1
        print(f"signed={signed}: all 2**32 float32 equal ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
