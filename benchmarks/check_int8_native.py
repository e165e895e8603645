"""Checks the cpu's AVX-512 int8 encoders against the contract's bucket-table count for every float32.

``optirs.backends.cpu.int8_native`` finds an int8 code by lookups of byte planes in registers (the
default where the cpu has AVX-512 VBMI), by gathers of packed words or by a binary search over the
midpoints held in AVX-512 registers; this script compares the codes of each (``--forms``) with
``optirs.backends.common.int8_buckets.quantize_table`` for all 2**32 float32 bit patterns (as the
scaled value ``y``: ``pre = inv = 1``) of the signed and the unsigned map, and the register and
gathered decoders (and the byte planes' where the cpu has VBMI) with ``q[code] * scale`` for all
256 codes at a few scales. Needs a cpu with AVX-512F; takes some minutes a map (the numpy reference
is the slow side; ``--stride 64`` checks a 64th of the patterns for a quick run).

    PYTHONPATH=. python benchmarks/check_int8_native.py [--step 24] [--stride 1] [--forms planes,gathers,search]
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
    ap.add_argument("--stride", type=int, default=1, help="check every stride-th batch only (a quick run)")
    ap.add_argument("--forms", default="planes,gathers,search", help="the encoders to check, comma-separated")
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
        keys = N.encoder_keys(mid, tbl)
        forms = {"planes": (N.encode_block_planes, keys["planes"]), "gathers": (N.encode_block_gathers, keys["gathers"]),
                 "search": (N.encode_block_registers, keys["search"])}
        forms = {f: forms[f] for f in args.forms.split(",") if f != "planes" or N.VBMI}
        got = {f: np.zeros(n, np.uint8) for f in forms}
        codes = np.arange(256, dtype=np.uint8)
        for s in (np.float32(1), np.float32(3.7e-3), np.float32(2.0**-140), np.float32(np.inf), np.float32(np.nan)):
            for decode in (N.decode_block_registers, N.decode_block_gathers) + ((N.decode_block_planes,) if N.VBMI
                                                                                  else ()):
                out = np.zeros(256, np.float32)
                decode(codes, N.decoder_table(q), s, 0, 256, out)
                if not np.array_equal(out.view(np.uint32), (q * s).view(np.uint32)):
                    print(f"{decode.__name__} differs: signed={signed} scale={s!r}")
                    return 1
        ix = np.zeros(256, np.uint32)
        one = np.float32(1)
        for start in range(0, 1 << 32, n * args.stride):
            y = np.arange(start, start + n, dtype=np.uint64).astype(np.uint32).view(np.float32)
            for form, (encode, table) in forms.items():
                encode(y, n, one, one, table, mid, tbl, got[form], 0, ix)
            want = quantize_table(y, mid, tbl)
            for form, codes_of in got.items():
                if not np.array_equal(codes_of, want):
                    bad = int(np.flatnonzero(codes_of != want)[0])
                    print(f"signed={signed}, {form}: y bits 0x{start + bad:08x} coded {codes_of[bad]}, expected "
                          f"{want[bad]}")
                    return 1
        share = "all 2**32" if args.stride == 1 else f"1/{args.stride} of the"
        print(f"signed={signed}: {share} float32 equal for {', '.join(forms)} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
