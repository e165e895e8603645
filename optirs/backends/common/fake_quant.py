"""The per-element integer fake-quant math, written once and compiled by the cpu and cuda backends.

:func:`fq_element` is plain Python over numpy scalars: the CPU backend compiles it with
``numba.njit`` into its parallel loop, the CUDA backend with ``cuda.jit(device=True)`` into its
grid kernel (:mod:`optirs.backends.cpu.fake_quant`, :mod:`optirs.backends.cuda.fake_quant`). The
OpenCL C copy in ``kernels/fake_quant.cl`` performs the same operations in the same order. This
module imports no compiler.

Bit-exactness with torch's CPU kernels (``aten/src/ATen/native/quantized/cpu/kernels``) rests
on keeping every float32 operation and its order:

* ``v = x * inv_scale`` (``inv_scale = 1.0f / scale`` computed once), rounded to float32
  *before* rounding to an integer. NVVM and OpenCL compilers contract ``a * b + c`` into an FMA
  by default, which would skip that rounding: the CUDA kernel multiplies with
  ``libdevice.fmul_rn`` (never contracted) and the OpenCL source turns ``FP_CONTRACT`` off.
* ``nearbyint`` (round half to even), then ``q = zero_point + r`` in float32.
* Per tensor, ``fmax``/``fmin`` against the range (a NaN becomes ``quant_min``). Per channel,
  torch first casts ``q`` to int64; on x86 a NaN, an infinity or a value >= 2**63 becomes
  INT64_MIN, which then clamps to ``quant_min`` (so ``+inf`` gives ``quant_min`` per channel
  but ``quant_max`` per tensor). ``int64_cast`` reproduces that.
* ``out = (q - zero_point) * scale`` in float32; the gradient mask is
  ``quant_min <= q <= quant_max`` on the unclamped ``q``.

Stochastic rounding draws ``u`` in [0, 1) from a counter-based hash of (seed, flat index),
so every backend produces the same bits for the same seed, whatever the launch shape.

The straight-through gradient passes ``g`` inside the range by selection, not by multiplying
with 1: a GPU's multiply returns the canonical NaN, while torch (multiplying on the CPU) keeps a
NaN gradient's bits. Outside, multiplying by 0 keeps torch's ``NaN * 0`` and sign of zero.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32
_U64 = np.uint64

ZERO = _F32(0.0)
ONE = _F32(1.0)
TWO23 = _F32(8388608.0)  # 2**23: float32 values at or above it are integers
TWO63 = _F32(9223372036854775808.0)  # 2**63: first float32 outside int64
TWO_M24 = _F32(1.0 / 16777216.0)
M32 = _U64(0xFFFFFFFF)
S8, S15, S16, S32 = _U64(8), _U64(15), _U64(16), _U64(32)
C1, C2 = _U64(0x7FEB352D), _U64(0x846CA68B)  # lowbias32 multipliers (C. Wellons' hash prospector)
NO_KEY = _U64(0)  # the hash keys passed when rounding is not stochastic (never read)


def fq_element(v, scale, zp, qmin, qmax, int64_cast, stochastic, key_lo, key_hi, index):
    """Fake-quantize one element whose scaled value ``v = x * inv_scale`` is already float32.

    Returns ``(out, inside)``: the dequantized float32 value and whether ``q`` fell inside
    [qmin, qmax] (the straight-through gradient mask). Every argument but ``index`` and the
    keys is float32; there are no float literals, so nothing is promoted to float64.
    """
    # nearbyint, ties to even: adding 2**23 makes the FPU round at the units place.
    a = abs(v)
    if a < TWO23:
        r = (a + TWO23) - TWO23
        if v < ZERO:
            r = -r
    else:
        r = v  # already an integer, or inf / NaN
    if stochastic:
        if r > v:
            r = r - ONE  # floor
        frac = v - r
        # u in [0, 1) from a hash of (seed, index): lowbias32 over each 32-bit half.
        i = _U64(index)
        h = (i & M32) ^ key_lo
        h ^= h >> S16
        h = (h * C1) & M32
        h ^= h >> S15
        h = (h * C2) & M32
        h ^= h >> S16
        h = h ^ (i >> S32) ^ key_hi
        h ^= h >> S16
        h = (h * C1) & M32
        h ^= h >> S15
        h = (h * C2) & M32
        h ^= h >> S16
        u = _F32(h >> S8) * TWO_M24
        if u < frac:
            r = r + ONE
    q = zp + r
    inside = q >= qmin and q <= qmax
    if int64_cast and not (q < TWO63):
        q = qmin  # torch's (int64_t) cast: INT64_MIN on x86, clamped up to quant_min
    if not (q >= qmin):
        q = qmin  # fmax(NaN, qmin) is qmin
    elif q > qmax:
        q = qmax
    return (q - zp) * scale, inside
