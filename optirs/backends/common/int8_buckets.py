"""The bucket table that quantizes to the int8 dynamic map in two lookups (pure numpy, every backend).

``quantize(y)`` is the number of midpoints ``mid[k] < y`` (docs/formats.md). A binary search
over the 255 midpoints takes 8 dependent lookups per element; on a GPU they are shared-memory
reads whose addresses differ per lane (bank conflicts), the cost that kept the int8 formats far
from the memory bandwidth. This table answers with one lookup and one compare instead.

The bucket of ``y`` is its top 16 bits (sign, exponent, 7 mantissa bits: the bfloat16 truncation),
magnitudes clamped to ``[2**-23, 1.0078125)``: bucket 0 holds every ``|y| < 2**-23`` (no midpoint
is that small), bucket ``W + 1`` every larger magnitude, inf and NaN. Each bucket holds at most one
midpoint of the dynamic maps (checked when the table is built: their midpoints are at least
2**-7 of their magnitude apart). ``table[b]`` is the number of midpoints below the bucket's lowest
value, so

    code = c + (mid[c] < y)    with c = table[bucket(y)], mid padded with +inf to 256 entries

counts exactly (the bucket's one midpoint, if any, is ``mid[c]``), ties to the lower code as the
search did; NaN takes code 0 (a NaN compares false with every midpoint). The numba text is
``quantize`` in :mod:`optirs.backends.common.formats`, the OpenCL C ``optirs_quantize8``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from optirs.core.errors import InvalidParameterError

LO = 0x3400  # top 16 bits of 2**-23: smaller magnitudes share bucket 0
HI = 0x3F80  # top 16 bits of 1.0: larger magnitudes share bucket HI - LO + 2
WIDTH = HI - LO + 3  # buckets per sign
SIZE = 2 * WIDTH  # entries of one map's table: positive buckets, then negative ones


def bucket_index(y: np.ndarray) -> np.ndarray:
    """The table index of each float32 ``y`` (the numba and OpenCL C code compute the same)."""
    u = np.asarray(y, np.float32).view(np.uint32)
    a16 = ((u >> 16) & 0x7FFF).astype(np.int64)
    a = np.clip(a16, LO - 1, HI + 1) - (LO - 1)
    return a + (u >> 31).astype(np.int64) * WIDTH


def _bucket_bounds():
    """(lowest, highest) float64 value of every bucket, in table order."""
    a = np.arange(LO, HI + 1, dtype=np.uint32)
    low = (a << 16).view(np.float32).astype(np.float64)
    high = ((a << 16) | 0xFFFF).view(np.float32).astype(np.float64)
    tiny = float(np.uint32(LO << 16).view(np.float32))  # 2**-23
    big = float(np.uint32((HI + 1) << 16).view(np.float32))
    tiny_below = float(np.nextafter(np.float32(tiny), np.float32(0)))
    pos_lo = np.concatenate([[0.0], low, [big]])
    pos_hi = np.concatenate([[tiny_below], high, [np.inf]])
    return np.concatenate([pos_lo, -pos_hi]), np.concatenate([pos_hi, -pos_lo])


def build_table(mid: np.ndarray) -> np.ndarray:
    """The uint8 bucket table of ascending float32 midpoints ``mid`` (255 of them).

    :raises InvalidParameterError: when a bucket holds two midpoints (a map denser than 2**-7 of
        its magnitude, which the dynamic maps are not).
    """
    mid = np.asarray(mid, np.float32)
    if mid.shape != (255,) or np.any(np.diff(mid) < 0):
        raise InvalidParameterError(f"mid has shape {mid.shape}, expected 255 ascending float32 midpoints")
    m = mid.astype(np.float64)
    lo, hi = _bucket_bounds()
    below = np.searchsorted(m, lo, side="left")  # midpoints < the bucket's lowest value
    inside = np.searchsorted(m, hi, side="right") - below
    if inside.max() > 1:
        b = int(np.argmax(inside))
        raise InvalidParameterError(
            f"bucket [{lo[b]!r}, {hi[b]!r}] holds {int(inside[b])} midpoints, expected at most one (the bucket "
            "table needs midpoints at least 2**-7 of their magnitude apart)")
    return below.astype(np.uint8)


@lru_cache(maxsize=2)
def _table(signed: bool) -> np.ndarray:
    from optirs.core.formats import map_midpoints

    t = build_table(map_midpoints(signed))
    t.setflags(write=False)
    return t


def bucket_table(signed: bool) -> np.ndarray:
    """The bucket table of the signed or unsigned dynamic map (read-only, uint8[SIZE])."""
    return _table(bool(signed))


@lru_cache(maxsize=2)
def _padded(signed: bool) -> np.ndarray:
    from optirs.core.formats import map_midpoints

    mid = np.append(map_midpoints(signed), np.float32(np.inf)).astype(np.float32)
    mid.setflags(write=False)
    return mid


def padded_midpoints(signed: bool) -> np.ndarray:
    """The 255 midpoints of a dynamic map and +inf (float32[256]): ``mid[c]`` exists for every table entry."""
    return _padded(bool(signed))


def quantize_table(y: np.ndarray, mid: np.ndarray, table: np.ndarray) -> np.ndarray:
    """numpy text of the two-lookup quantizer (for tests): codes of float32 ``y``."""
    y = np.asarray(y, np.float32)
    c = table[bucket_index(y)].astype(np.int64)
    code = c + (mid[c] < y)
    return np.where(np.isnan(y), 0, code).astype(np.uint8)
