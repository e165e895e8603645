"""Integer fake-quant kernels for the ``cpu`` (numba.njit parallel), ``cuda`` (numba.cuda) and
``opencl`` (pyopencl) paths of :mod:`optirs.analysis.quantization`.

Imported on first use of a non-numpy backend (this imports numba). The per-element math is
:func:`fq_element`, written once in Python and compiled twice: with ``njit`` for the CPU loop
and as a CUDA device function for the grid kernel. OpenCL C has its own copy
(:data:`OPENCL_SOURCE`), the same operations in the same order.

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
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

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

BLOCK = 256  # CUDA threads per block; the kernel is one element per thread, memory-bound


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


_fq_cpu = njit(cache=True, inline="always")(fq_element)


# ------------------------------------------------------------------ cpu


# Elements per parallel task. Each task walks its range in runs of one channel, with that
# channel's scalars hoisted: the inner loops are plain loops that LLVM vectorizes.
CPU_BLOCK = 1 << 14


@njit(parallel=True, cache=True)
def fake_quant_cpu(x, out, mask, inv, scale, zp, inner, nch, qmin, qmax, int64_cast, stochastic, key_lo, key_hi):
    """Forward over a flat float32 array; element i belongs to channel (i // inner) % nch."""
    n = x.size
    for b in prange((n + CPU_BLOCK - 1) // CPU_BLOCK):
        i = b * CPU_BLOCK
        stop = min(i + CPU_BLOCK, n)
        while i < stop:
            row = i // inner
            end = min(stop, (row + 1) * inner)
            c = row % nch
            iv, s, z = inv[c], scale[c], zp[c]
            if stochastic:
                for j in range(i, end):
                    out[j], mask[j] = _fq_cpu(x[j] * iv, s, z, qmin, qmax, int64_cast, True, key_lo, key_hi, j)
            elif int64_cast:
                for j in range(i, end):
                    out[j], mask[j] = _fq_cpu(x[j] * iv, s, z, qmin, qmax, True, False, key_lo, key_hi, j)
            else:
                for j in range(i, end):
                    out[j], mask[j] = _fq_cpu(x[j] * iv, s, z, qmin, qmax, False, False, key_lo, key_hi, j)
            i = end


# _pass_gradient_note: inside the range the gradient passes by selection, not by multiplying
# with 1: a GPU's multiply returns the canonical NaN, while torch (multiplying on the CPU) keeps
# a NaN gradient's bits. Outside, multiplying by 0 keeps torch's NaN * 0 and sign of zero.
@njit(parallel=True, cache=True)
def fake_quant_backward_cpu(x, g, gin, inv, scale, zp, inner, nch, qmin, qmax, int64_cast):
    """Straight-through gradient: ``g`` inside the range (bits unchanged), ``g * 0`` outside (as torch)."""
    n = x.size
    for b in prange((n + CPU_BLOCK - 1) // CPU_BLOCK):
        i = b * CPU_BLOCK
        stop = min(i + CPU_BLOCK, n)
        while i < stop:
            row = i // inner
            end = min(stop, (row + 1) * inner)
            c = row % nch
            iv, s, z = inv[c], scale[c], zp[c]
            for j in range(i, end):
                o, m = _fq_cpu(x[j] * iv, s, z, qmin, qmax, int64_cast, False, _U64(0), _U64(0), j)
                gin[j] = g[j] if m else g[j] * ZERO  # see _pass_gradient_note
            i = end


# ------------------------------------------------------------------ cuda


_cuda_kernels = None
cuda = None  # numba.cuda, imported by cuda_kernels(); a module global so the simulator can swap it


def cuda_kernels():
    """(forward, backward) numba.cuda kernels, compiled on first use."""
    global _cuda_kernels, cuda
    if _cuda_kernels is None:
        from numba import cuda as _cuda

        cuda = _cuda

        simulator = bool(getattr(cuda, "simulator_enabled", False))
        try:
            from numba.cuda import config as _config

            simulator = bool(_config.ENABLE_CUDASIM)
        except Exception:  # pragma: no cover
            pass
        fq = cuda.jit(device=True)(fq_element)
        if simulator:
            def mul(a, b):  # numpy scalars under the simulator: overflow to inf is expected here
                with np.errstate(over="ignore", invalid="ignore"):
                    return a * b
        else:
            from numba.cuda import libdevice

            def mul(a, b):
                return libdevice.fmul_rn(a, b)  # never contracted into an FMA
        mul = cuda.jit(device=True)(mul)

        @cuda.jit
        def forward(x, out, mask, inv, scale, zp, inner, nch, qmin, qmax, int64_cast, stochastic, key_lo, key_hi):
            i = cuda.grid(1)
            if i < x.size:
                c = (i // inner) % nch
                o, m = fq(mul(x[i], inv[c]), scale[c], zp[c], qmin, qmax, int64_cast, stochastic, key_lo, key_hi, i)
                out[i] = o
                mask[i] = m

        @cuda.jit
        def backward(x, g, gin, inv, scale, zp, inner, nch, qmin, qmax, int64_cast):
            i = cuda.grid(1)
            if i < x.size:
                c = (i // inner) % nch
                o, m = fq(mul(x[i], inv[c]), scale[c], zp[c], qmin, qmax, int64_cast, False, _U64(0), _U64(0), i)
                gin[i] = g[i] if m else g[i] * ZERO  # see _pass_gradient_note

        _cuda_kernels = (forward, backward)
    return _cuda_kernels


# ------------------------------------------------------------------ opencl

OPENCL_SOURCE = r"""
// Integer fake-quant, the same float32 operations in the same order as fq_element (Python).
#pragma OPENCL FP_CONTRACT OFF

inline ulong lowbias32(ulong h) {
    h ^= h >> 16; h = (h * 0x7feb352dUL) & 0xffffffffUL;
    h ^= h >> 15; h = (h * 0x846ca68bUL) & 0xffffffffUL;
    h ^= h >> 16;
    return h;
}

inline float fq_element(float v, float scale, float zp, float qmin, float qmax, int int64_cast,
                        int stochastic, ulong key_lo, ulong key_hi, ulong index, int *inside) {
    float r = rint(v);  // round half to even
    if (stochastic) {
        if (r > v) r = r - 1.0f;
        float frac = v - r;
        ulong h = lowbias32((index & 0xffffffffUL) ^ key_lo);
        h = lowbias32(h ^ (index >> 32) ^ key_hi);
        float u = (float)(h >> 8) * 5.9604644775390625e-8f;  // 2**-24
        if (u < frac) r = r + 1.0f;
    }
    float q = zp + r;
    *inside = (q >= qmin) && (q <= qmax);
    if (int64_cast && !(q < 9223372036854775808.0f)) q = qmin;
    if (!(q >= qmin)) q = qmin; else if (q > qmax) q = qmax;
    return (q - zp) * scale;
}

__kernel void fake_quant(__global const float *x, __global float *out, __global uchar *mask,
                         __global const float *inv, __global const float *scale, __global const float *zp,
                         const long inner, const long nch, const float qmin, const float qmax,
                         const int int64_cast, const int stochastic, const ulong key_lo, const ulong key_hi,
                         const long n) {
    long i = get_global_id(0);
    if (i >= n) return;
    long c = (i / inner) % nch;
    int inside;
    float v = x[i] * inv[c];
    out[i] = fq_element(v, scale[c], zp[c], qmin, qmax, int64_cast, stochastic, key_lo, key_hi, (ulong)i, &inside);
    mask[i] = (uchar)inside;
}

__kernel void fake_quant_backward(__global const float *x, __global const float *g, __global float *gin,
                                  __global const float *inv, __global const float *scale, __global const float *zp,
                                  const long inner, const long nch, const float qmin, const float qmax,
                                  const int int64_cast, const long n) {
    long i = get_global_id(0);
    if (i >= n) return;
    long c = (i / inner) % nch;
    int inside;
    float v = x[i] * inv[c];
    fq_element(v, scale[c], zp[c], qmin, qmax, int64_cast, 0, 0UL, 0UL, (ulong)i, &inside);
    gin[i] = inside ? g[i] : g[i] * 0.0f;  /* pass the gradient's bits unchanged inside */
}
"""
