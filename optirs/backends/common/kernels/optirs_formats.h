/* The step formats' element encodings in OpenCL C, written once (docs/formats.md is the contract;
 * optirs/backends/common/formats.py is the same math for numba).
 *
 * Everything works on 8 lanes at a time (float8 / uint8), the width a work-item of the format
 * kernels moves (one 16-byte load of eight 16-bit parameters). Integer arithmetic is on uint with
 * wrap-around, as the contract says; every function is pure, so lanes a tail does not use may hold
 * anything.
 */
#ifndef OPTIRS_FORMATS_H
#define OPTIRS_FORMATS_H

#include "optirs_half.h"

/* ---------------------------------------------------------------- 16-bit decodings (exact) */

/* A shift alone, without the NaN quieting of the numba decode (4 instructions of about 130 per
 * element on a GPU). The same bits are stored: a value so widened meets float arithmetic, min /
 * max or comparisons before anything is stored, and a NaN result of arithmetic is a NaN whatever
 * payload went in, or it meets an encoder that writes NaN as its own quiet NaN with the sign
 * kept (bfloat16 nearest and stochastic, float16), as the quieting does. */
float8 optirs_bf16_decode8(ushort8 h)
{
    return as_float8(convert_uint8(h) << 16);
}

/* ---------------------------------------------------------------- 16-bit encodings */

/* The float32 bits u with each NaN replaced by 0x7FC00000 | its sign, whose rounding to bfloat16,
 * nearest or stochastic, is the contract's NaN 0x7FC0 | sign (its low 16 bits are 0 and either
 * increment adds less than 0x10000: nothing carries); other values are kept. Selecting before the
 * rounding takes an AND-OR, a NaN test and a select an element, where building the 16-bit NaN and
 * selecting after took two more. */
uint8 optirs_bf16_nan_apart8(uint8 u)
{
    return select(u, (u & 0x80000000u) | 0x7FC00000u, isnan(as_float8(u)));
}

/* Nearest even; NaN -> 0x7FC0 | sign (as ml_dtypes and optirs_bf16_encode). */
ushort8 optirs_bf16_rne8(uint8 u)
{
    const uint8 v = optirs_bf16_nan_apart8(u);
    return convert_ushort8((v + 0x7FFFu + ((v >> 16) & 1u)) >> 16);
}

/* ---------------------------------------------------------------- float16 by the hardware

 * float16 words are converted where they are read and written, by the device's own conversion:
 * vload_half / vstore_half_rte (core OpenCL, no cl_khr_fp16 needed), one cvt.f32.f16 /
 * cvt.rn.f16.f32 an element on NVIDIA's driver where the integer forms took some 10 (decode) and
 * 20-30 with a branch per lane (optirs_f16_encode) per element; the CUDA kernels' conversion
 * (docs/formats.md). Both are exact IEEE: the decode for every half, the encode rounding to nearest
 * even with subnormals and overflow to inf as numpy's cast; only NaN differs (the hardware's NaN),
 * so a NaN is encoded apart to numpy's bits (its top 10 payload bits, never 0: that would be inf).
 * A decoded NaN stays a NaN of some payload: it meets arithmetic before anything is stored (the
 * shift-widened bfloat16's reasoning). nv lanes valid (8: all); aligned: p is 8-element aligned. */
float8 optirs_f16_load8(__global const ushort *p, int nv, int aligned)
{
    __global const half *h = (__global const half *)p;
    if (nv >= 8)
        return aligned ? vloada_half8(0, h) : vload_half8(0, h);
    float a[8];
    for (int j = 0; j < 8; ++j)
        a[j] = j < nv ? vload_half(j, h) : 0.0f;
    return vload8(0, a);
}

/* numpy's float16 NaN for float32 bits u (a NaN): sign, 0x7C00 and u's top 10 payload bits (1 if 0). */
ushort optirs_f16_nan1(uint u)
{
    const uint payload = (u >> 13) & 0x3FFu;
    return (ushort)(((u >> 16) & 0x8000u) | 0x7C00u | (payload ? payload : 1u));
}

void optirs_f16_store8(float8 x, __global ushort *p, int nv, int aligned)
{
    __global half *h = (__global half *)p;
    float a[8];
    if (nv >= 8) {
        if (aligned)
            vstorea_half8_rte(x, 0, h);
        else
            vstore_half8_rte(x, 0, h);
    } else {
        vstore8(x, 0, a);
        for (int j = 0; j < nv; ++j)
            vstore_half_rte(a[j], j, h);
    }
    if (any(isnan(x))) { /* rare: the lanes that are NaN rewritten with numpy's bits */
        vstore8(x, 0, a);
        for (int j = 0; j < min(nv, 8); ++j)
            if (isnan(a[j]))
                p[j] = optirs_f16_nan1(as_uint(a[j]));
    }
}

/* ---------------------------------------------------------------- random bits (counter based) */

#define OPTIRS_FMIX32(h)                                                                         \
    do {                                                                                         \
        h ^= h >> 16;                                                                            \
        h *= 0x85EBCA6Bu;                                                                        \
        h ^= h >> 13;                                                                            \
        h *= 0xC2B2AE35u;                                                                        \
        h ^= h >> 16;                                                                            \
    } while (0)

/* key(seed, step, stream) = fmix32(seed ^ fmix32(step * 4 + stream)): one per launch and stream. */
uint optirs_rand_key(uint seed, uint step, uint stream)
{
    uint h = step * 4u + stream;
    OPTIRS_FMIX32(h);
    h ^= seed;
    OPTIRS_FMIX32(h);
    return h;
}

/* rand(key, i) = fmix32(key ^ (i * 0x9E3779B1)), i the elements' flat layout indices (low 32 bits). */
uint8 optirs_rand8(uint key, uint8 i)
{
    uint8 h = key ^ (i * 0x9E3779B1u);
    OPTIRS_FMIX32(h);
    return h;
}

/* State slot k's random stream: slots 0 and 1 share stream 1, slot 2 takes stream 2. */
#define OPTIRS_STATE_STREAM(k) (1u + ((uint)(k) >> 1))

/* Slot k's 16 random bits from its stream's words r: the low half for even k, the high half for
 * odd k, so slots 0 and 1 (Adam's two moments) are rounded by one hash per element. */
uint8 optirs_slot_bits8(uint8 r, int k)
{
    return (k & 1) ? r >> 16 : r & 0xFFFFu;
}

/* bfloat16, stochastic: finite x adds the low 16 random bits before truncating (unbiased);
 * NaN and inf round to nearest. Only a NaN is set apart: inf's low 16 bits are 0, so the sum
 * carries nothing and is inf's nearest already (the numba bf16_stochastic's reasoning; half the
 * instructions of selecting the whole nearest rounding). */
ushort8 optirs_bf16_sr8(uint8 u, uint8 r)
{
    return convert_ushort8((optirs_bf16_nan_apart8(u) + (r & 0xFFFFu)) >> 16);
}

/* ---------------------------------------------------------------- master remainders */

/* remainder16: hi = the master rounded to nearest (ties away from zero), rem = the low 16 bits
 * as int16 (negative when they rounded hi up); join undoes it exactly. */
void optirs_r16_split8(uint8 u, ushort8 *hi, short8 *rem)
{
    const uint8 lo = u & 0xFFFFu;
    *hi = convert_ushort8((u >> 16) + select((uint8)0u, (uint8)1u, lo >= 0x8000u));
    *rem = as_short8(convert_ushort8(lo));
}

uint8 optirs_r16_join8(ushort8 hi, short8 rem)
{
    const uint8 h = convert_uint8(hi) - select((uint8)0u, (uint8)1u, convert_int8(rem) < 0);
    return (h << 16) | convert_uint8(as_ushort8(rem));
}

/* round24: the top 24 bits, nearest even on the 8 dropped ones; a non-finite value keeps its top
 * 24 bits. Returns u24 (the 24 kept bits in the low bits). */
uint8 optirs_round24_8(uint8 u)
{
    const uint8 r = (u + 0x7Fu + ((u >> 8) & 1u)) >> 8;
    return select(r, u >> 8, (u & 0x7F800000u) == 0x7F800000u);
}

/* remainder8: split u24 into the bfloat16 hi (rounded to nearest, ties away) and an int8 rem. */
void optirs_r8_split8(uint8 u24, ushort8 *hi, char8 *rem)
{
    const uint8 lo = u24 & 0xFFu;
    *hi = convert_ushort8((u24 >> 8) + select((uint8)0u, (uint8)1u, lo >= 0x80u));
    *rem = as_char8(convert_uchar8(lo));
}

uint8 optirs_r8_join8(ushort8 hi, char8 rem)
{
    const uint8 h = convert_uint8(hi) - select((uint8)0u, (uint8)1u, convert_int8(rem) < 0);
    return ((h << 8) | convert_uint8(as_uchar8(rem))) << 8;
}

/* ---------------------------------------------------------------- int8 blockwise state */

/* The bucket table of optirs/backends/common/int8_buckets.py (the host checks these constants):
 * a bucket is the top 16 bits of y, magnitudes clamped to [2^-23, 1.0078125), positive buckets
 * then negative ones; table[b] = the number of midpoints below the bucket, and a bucket holds at
 * most one midpoint. */
#define OPTIRS_QT_LO 0x3400u
#define OPTIRS_QT_HI 0x3F80u
#define OPTIRS_QT_WIDTH (OPTIRS_QT_HI - OPTIRS_QT_LO + 3u)
#define OPTIRS_QT_SIZE (2u * OPTIRS_QT_WIDTH)

/* The code of y: the number of k in 0..254 with mid[k] < y (nearest code, ties to the lower one).
 * mid holds 256 entries, mid[255] = +inf; one table lookup and one compare (the 8-step binary
 * search's dependent local-memory reads were the int8 formats' bottleneck); NaN gets code 0. */
uchar optirs_quantize1(float y, __local const float *mid, __local const uchar *table)
{
    const uint u = as_uint(y);
    const uint a = clamp((u >> 16) & 0x7FFFu, OPTIRS_QT_LO - 1u, OPTIRS_QT_HI + 1u) - (OPTIRS_QT_LO - 1u);
    const uint c = table[a + (u >> 31) * OPTIRS_QT_WIDTH];
    const uint code = c + (mid[c] < y ? 1u : 0u);
    return (uchar)(isnan(y) ? 0u : code);
}

/* A block's quantize factors (pre, inv): its values are coded as y = (x * pre) * inv, one
 * reciprocal per block instead of a division per element. pre is 2^64 for a subnormal scale
 * (exact: the scale and the block's values are scaled alike, and the reciprocal stays finite),
 * else 1; inv = 1 / (scale * pre) rounded to float32 (correctly rounded: the programs are built
 * with -cl-fp32-correctly-rounded-divide-sqrt), 0 for a zero scale. */
float2 optirs_quantize_factors(float scale)
{
    if (scale > 0.0f && scale < 0x1p-126f)
        return (float2)(0x1p64f, 1.0f / (scale * 0x1p64f));
    if (scale == 0.0f)
        return (float2)(1.0f, 0.0f);
    return (float2)(1.0f, 1.0f / scale);
}

/* optirs_quantize1 for a block of finite scale, whose scaled values are never NaN and at most
 * 1 + 2^-23 in magnitude (|x| <= scale, inv its correctly rounded reciprocal): no NaN test and no
 * upper clamp, the same code (the numba quantize_finite). */
uchar optirs_quantize1_finite(float y, __local const float *mid, __local const uchar *table)
{
    const uint u = as_uint(y);
    const uint a = max((u >> 16) & 0x7FFFu, OPTIRS_QT_LO - 1u) - (OPTIRS_QT_LO - 1u);
    const uint c = table[a + (u >> 31) * OPTIRS_QT_WIDTH];
    return (uchar)(c + (mid[c] < y ? 1u : 0u));
}

#define OPTIRS_QUANTIZE8(q, y, mid, table)                                                       \
    (uchar8)(q(y.s0, mid, table), q(y.s1, mid, table), q(y.s2, mid, table), q(y.s3, mid, table), \
             q(y.s4, mid, table), q(y.s5, mid, table), q(y.s6, mid, table), q(y.s7, mid, table))

/* quantize(x): y = (x * pre) * inv with the block's optirs_quantize_factors f = (pre, inv), then
 * its code. ``finite``: the block's scale is finite and every |x| at most it (a block's own new
 * values: the usual case), so the shorter bucket applies. */
uchar8 optirs_quantize8(float8 x, float2 f, int finite, __local const float *mid, __local const uchar *table)
{
    const float8 y = (x * f.s0) * f.s1;
    if (finite)
        return OPTIRS_QUANTIZE8(optirs_quantize1_finite, y, mid, table);
    return OPTIRS_QUANTIZE8(optirs_quantize1, y, mid, table);
}

/* dequantize(code, scale) = q[code] * scale. */
float8 optirs_dequantize8(uchar8 c, float scale, __local const float *q)
{
    return (float8)(q[c.s0], q[c.s1], q[c.s2], q[c.s3], q[c.s4], q[c.s5], q[c.s6], q[c.s7]) * scale;
}

#endif
