"""The per-element float16/bfloat16 conversions, written once for numba on the CPU and on CUDA.

numba has no float16 on the CPU and no bfloat16 anywhere, so half arrays are handled as their
uint16 bit patterns. These are plain Python functions over integers and exact float32 products
(an integer < 2048 times a power of two), so the same text compiles both with ``numba.njit``
(:mod:`optirs.backends.cpu.mixed_precision`) and as ``numba.cuda.jit(device=True)`` functions
(:mod:`optirs.backends.cuda.mixed_precision`); each backend compiles them when it first needs
them, so importing this module imports no numba. Rounding is to nearest even, as numpy's
float32 -> float16 cast and ml_dtypes' float32 -> bfloat16 cast; the tests compare bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from optirs.core.errors import InvalidParameterError

__all__ = ["f16_decode", "bf16_decode", "f16_encode", "bf16_encode", "is_bfloat16"]

# _POW2[k] = 2**(k - 134): every scale a binary16 or bfloat16 exponent field needs, exact in float32.
_POW2 = np.array([2.0 ** (k - 134) for k in range(256)], dtype=np.float32)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)


def f16_decode(h):
    """binary16 bits -> float32 value (NaN payloads not kept: only gradients are decoded)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        v = _INF if m == 0 else _NAN
    elif e == 0:
        v = np.float32(m) * _POW2[110]  # m * 2**-24
    else:
        v = np.float32(m | 0x400) * _POW2[e + 109]  # 1.m * 2**(e-15)
    return -v if (h >> 15) & 1 else v


def bf16_decode(h):
    """bfloat16 bits -> float32 value (NaN payloads not kept)."""
    e = (h >> 7) & 0xFF
    m = h & 0x7F
    if e == 0xFF:
        v = _INF if m == 0 else _NAN
    elif e == 0:
        v = np.float32(m) * _POW2[1]  # m * 2**-133
    else:
        v = np.float32(m | 0x80) * _POW2[e]  # 1.m * 2**(e-127)
    return -v if (h >> 15) & 1 else v


def f16_encode(u):
    """float32 bits -> binary16 bits, round to nearest even, as numpy's float32 -> float16 cast."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x7F800000:
        if a == 0x7F800000:
            return sign | 0x7C00
        h = 0x7C00 | ((a >> 13) & 0x3FF)  # NaN: keep the top payload bits, never turn into inf
        if h == 0x7C00:
            h = 0x7C01
        return sign | h
    if a >= 0x477FF000:  # >= 65520 rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:  # normal half (>= 2**-14)
        h = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF)
        rem = a & 0x1FFF
        if rem > 0x1000 or (rem == 0x1000 and (h & 1) == 1):
            h += 1
        return sign | h
    if a <= 0x33000000:  # <= 2**-25 rounds to zero (the tie goes to the even zero)
        return sign
    shift = 126 - (a >> 23)  # 14..24: the value in units of 2**-24 is mant >> shift
    mant = (a & 0x7FFFFF) | 0x800000
    h = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (h & 1) == 1):
        h += 1
    return sign | h


def bf16_encode(u):
    """float32 bits -> bfloat16 bits, round to nearest even, NaN -> quiet NaN (as ml_dtypes)."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0xFFC0 if (u >> 31) & 1 else 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def is_bfloat16(dtype: Any) -> bool:
    """True for bfloat16, False for float16 (names or dtypes); anything else is refused."""
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in ("float16", "bfloat16"):
        raise InvalidParameterError(f"dtype={dtype!r}, expected 'float16' or 'bfloat16'")
    return name == "bfloat16"
