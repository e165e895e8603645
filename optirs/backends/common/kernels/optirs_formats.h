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
#include "optirs_ptx.h"

/* ---------------------------------------------------------------- wide bfloat16 words

 * The format kernels keep a bfloat16 value in the high half of a 32-bit word ("wide"): unpacked
 * from a pair as w << 16 and w & 0xFFFF0000 (one instruction an element, the value's float32 bits
 * at once, where taking the half out and then shifting it up took two), and encoded by the _wide8
 * forms below, which leave the low half undefined: a pair of them is stored from their high halves
 * by optirs_pack_high16, where shifting each down and packing took three instructions (the CUDA
 * formats kernels' pack_high16 and bf16_*_wide). */

/* The 8 wide words of the 8 bfloat16 values packed in w (element 2i in w's word i's low half). */
uint8 optirs_bf16_wide8(uint4 w)
{
    return (uint8)(w.s0 << 16, w.s0 & 0xFFFF0000u, w.s1 << 16, w.s1 & 0xFFFF0000u, w.s2 << 16, w.s2 & 0xFFFF0000u,
                   w.s3 << 16, w.s3 & 0xFFFF0000u);
}

/* The high halves of a (low) and b (high) as one word: one prmt.b32 with OPTIRS_NV_PTX; the
 * portable form (a shift and a funnel, two instructions through clang + ptxas) elsewhere. */
uint optirs_pack_high16(uint a, uint b)
{
#if OPTIRS_NV_PTX
    uint d;
    asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#else
    return (a >> 16) | (b & 0xFFFF0000u);
#endif
}

uint4 optirs_pack_high16x4(uint8 w)
{
    return (uint4)(optirs_pack_high16(w.s0, w.s1), optirs_pack_high16(w.s2, w.s3), optirs_pack_high16(w.s4, w.s5),
                   optirs_pack_high16(w.s6, w.s7));
}

/* ---------------------------------------------------------------- 16-bit decodings (exact) */

/* A shift alone, without the NaN quieting of the numba decode (4 instructions of about 130 per
 * element on a GPU). The same bits are stored: a value so widened meets float arithmetic, min /
 * max or comparisons before anything is stored, and a NaN result of arithmetic is a NaN whatever
 * payload went in, or it meets an encoder that writes NaN as its own quiet NaN with the sign
 * kept (bfloat16 nearest and stochastic, float16), as the quieting does. The kernels widen their
 * words as they unpack them (optirs_bf16_wide8), the same bits. */
float8 optirs_bf16_decode8(ushort8 h)
{
    return as_float8(convert_uint8(h) << 16);
}

/* ---------------------------------------------------------------- 16-bit encodings */

/* The bfloat16 NaN of float32 bits u (0x7FC0 | u's sign), wide. The roundings compute it and
 * select it for a NaN: an AND-OR, a NaN test and a select an element, no branch. */
uint8 optirs_bf16_nan_wide8(uint8 u)
{
    return (u & 0x80000000u) | 0x7FC00000u;
}

/* Nearest even; NaN -> 0x7FC0 | sign (as ml_dtypes and optirs_bf16_encode), wide. A finite u plus
 * the increment stays below 2^32. */
uint8 optirs_bf16_rne_wide8(uint8 u)
{
    return select(u + 0x7FFFu + ((u >> 16) & 1u), optirs_bf16_nan_wide8(u), isnan(as_float8(u)));
}

ushort8 optirs_bf16_rne8(uint8 u)
{
    return convert_ushort8(optirs_bf16_rne_wide8(u) >> 16);
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

/* rand(key, i) = fmix32(key ^ (i * 0x9E3779B1)), i the elements' flat layout indices (low 32 bits).
 * The finalizer's first step distributed over the xor (a logical shift does: (k ^ t) >> 16 ==
 * (k >> 16) ^ (t >> 16)): key ^ (key >> 16) is the same for every element (hoisted out of the
 * kernels' loops), so an element pays a shift and one three-input xor where the xor with the key,
 * the shift and the second xor took three instructions (the numba rand32). */
uint8 optirs_rand8(uint key, uint8 i)
{
    const uint8 t = i * 0x9E3779B1u;
    uint8 h = (key ^ (key >> 16)) ^ (t ^ (t >> 16));
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
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
 * instructions of selecting the whole nearest rounding). Wide (the result in the high half). */
uint8 optirs_bf16_sr_wide8(uint8 u, uint8 r)
{
    return select(u + (r & 0xFFFFu), optirs_bf16_nan_wide8(u), isnan(as_float8(u)));
}

/* The encoders of a round whose values are known not to be NaN (optirs_formats_step.h's fmt_num;
 * inf included): the rounding alone, where the NaN test and its select took three instructions
 * more (the numba bf16_*_wide_num). Wide, as the encoders above. */
uint8 optirs_bf16_sr_wide8_num(uint8 u, uint8 r)
{
    return u + (r & 0xFFFFu);
}

uint8 optirs_bf16_rne_wide8_num(uint8 u)
{
    return u + 0x7FFFu + ((u >> 16) & 1u);
}

/* The 8 values x, none NaN, rounded to nearest even and packed in pairs (element 2i in word i's low
 * half): with OPTIRS_NV_PTX >= 2 (sm_80 on) one cvt.rn.bf16x2.f32 a pair, the rounding and the
 * packing at once (the hardware's NaN is its own, hence no NaN here), where rounding each (three
 * instructions) and packing took seven; the portable rounding and pack elsewhere. */
#if OPTIRS_NV_PTX >= 2
uint optirs_cvt_bf16x2(float lo, float hi)
{
    uint d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
#endif

uint4 optirs_bf16_rne_pairs_num(float8 x)
{
#if OPTIRS_NV_PTX >= 2
    return (uint4)(optirs_cvt_bf16x2(x.s0, x.s1), optirs_cvt_bf16x2(x.s2, x.s3), optirs_cvt_bf16x2(x.s4, x.s5),
                   optirs_cvt_bf16x2(x.s6, x.s7));
#else
    return optirs_pack_high16x4(optirs_bf16_rne_wide8_num(as_uint8(x)));
#endif
}

ushort8 optirs_bf16_sr8(uint8 u, uint8 r)
{
    return convert_ushort8(optirs_bf16_sr_wide8(u, r) >> 16);
}

/* ---------------------------------------------------------------- master remainders */

/* A new master's NaNs as the quiet NaN of their sign (0x7FC00000 | sign), every other value kept,
 * before a remainder split (the numba quiet_nan_master): a payload with its bit 15 set (NVIDIA's NaN,
 * 0x7FFFFFFF) would carry the rounding up into the sign bit and leave the bfloat16 parameter a zero. */
uint8 optirs_quiet_nan_master8(uint8 u)
{
    return select(u, optirs_bf16_nan_wide8(u), isnan(as_float8(u)));
}

/* remainder16: hi = the master rounded to nearest (ties away from zero), rem = the low 16 bits
 * as int16 (negative when they rounded hi up); join undoes it exactly. The kernels take hi wide:
 * u + 0x8000 (the carry out of the low half is the rounding up), and join hi_w + rem sign-extended
 * (a negative rem borrows the one that rounded hi up): an instruction each, where the 16-bit hi
 * took a compare, a select and an add, then a shift and an OR to join. A joined hi_w's low half is
 * 0 (as the kernels unpack it). */
uint8 optirs_r16_hi_wide8(uint8 u)
{
    return u + 0x8000u;
}

uint8 optirs_r16_join_wide8(uint8 hi_w, short8 rem)
{
    return hi_w + as_uint8(convert_int8(rem));
}

void optirs_r16_split8(uint8 u, ushort8 *hi, short8 *rem)
{
    const uint8 q = optirs_quiet_nan_master8(u); /* a NaN splits as the quiet NaN of its sign */
    *hi = convert_ushort8(optirs_r16_hi_wide8(q) >> 16);
    *rem = as_short8(convert_ushort8(q));
}

uint8 optirs_r16_join8(ushort8 hi, short8 rem)
{
    return optirs_r16_join_wide8(convert_uint8(hi) << 16, rem);
}

/* round24: the top 24 bits, nearest even on the 8 dropped ones; inf keeps its top 24 bits, a NaN is
 * the quiet NaN of its sign. Returns u24 (the 24 kept bits in the low bits). */
uint8 optirs_round24_8(uint8 u)
{
    const uint8 r = (u + 0x7Fu + ((u >> 8) & 1u)) >> 8;
    return select(r, optirs_quiet_nan_master8(u) >> 8, (u & 0x7F800000u) == 0x7F800000u);
}

/* remainder8: split u24 into the bfloat16 hi (rounded to nearest, ties away) and an int8 rem; hi
 * wide is (u24 << 8) + 0x8000 and the join hi_w + (rem sign-extended << 8), as remainder16's. */
uint8 optirs_r8_hi_wide8(uint8 u24)
{
    return (u24 << 8) + 0x8000u;
}

uint8 optirs_r8_join_wide8(uint8 hi_w, char8 rem)
{
    return hi_w + (as_uint8(convert_int8(rem)) << 8);
}

void optirs_r8_split8(uint8 u24, ushort8 *hi, char8 *rem)
{
    *hi = convert_ushort8(optirs_r8_hi_wide8(u24) >> 16);
    *rem = as_char8(convert_uchar8(u24));
}

uint8 optirs_r8_join8(ushort8 hi, char8 rem)
{
    return optirs_r8_join_wide8(convert_uint8(hi) << 16, rem);
}

/* remainder16 as words: the remainders of a loaded uint4 sign-extended (the word hi_w adds: one
 * prmt.b32 each with OPTIRS_NV_PTX, 0x9910 / 0xBB32, where extending took one or two), and the low
 * halves of 8 words packed in pairs (one prmt.b32 0x5410 a pair, where masking, shifting and or-ing
 * took two or three); the numba remainder_word and pack_low16. */
uint optirs_sext_lo16(uint w)
{
#if OPTIRS_NV_PTX
    uint d;
    asm("prmt.b32 %0, %1, 0, 0x9910;" : "=r"(d) : "r"(w));
    return d;
#else
    return (uint)((int)(w << 16) >> 16);
#endif
}

uint optirs_sext_hi16(uint w)
{
#if OPTIRS_NV_PTX
    uint d;
    asm("prmt.b32 %0, %1, 0, 0xBB32;" : "=r"(d) : "r"(w));
    return d;
#else
    return (uint)((int)w >> 16);
#endif
}

uint8 optirs_r16_words8(uint4 w)
{
    return (uint8)(optirs_sext_lo16(w.s0), optirs_sext_hi16(w.s0), optirs_sext_lo16(w.s1), optirs_sext_hi16(w.s1),
                   optirs_sext_lo16(w.s2), optirs_sext_hi16(w.s2), optirs_sext_lo16(w.s3), optirs_sext_hi16(w.s3));
}

uint optirs_pack_low16(uint a, uint b)
{
#if OPTIRS_NV_PTX
    uint d;
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#else
    return (a & 0xFFFFu) | (b << 16);
#endif
}

uint4 optirs_pack_low16x4(uint8 w)
{
    return (uint4)(optirs_pack_low16(w.s0, w.s1), optirs_pack_low16(w.s2, w.s3), optirs_pack_low16(w.s4, w.s5),
                   optirs_pack_low16(w.s6, w.s7));
}

/* remainder8 as words (the numba remainder_word / round24_word / store_master_wide): the remainder
 * byte k of a loaded word, sign-extended and shifted to bits 8 and up (the word hi_w adds), and the
 * store's rounding word t (round24 without the shift down: the kept 24 bits in the top 24), whose
 * hi is t + 0x8000 and whose remainder is its byte 1. One prmt.b32 a remainder with OPTIRS_NV_PTX
 * (its byte sign-replicated), where extending and shifting took two or three, and three a store of
 * four, where shifting down and packing took seven. */
#if OPTIRS_NV_PTX
#define OPTIRS_REM8_BYTE(k, SEL)                                                                 \
    uint optirs_rem8_byte##k(uint w)                                                             \
    {                                                                                            \
        uint d;                                                                                  \
        asm("prmt.b32 %0, %1, 0, " #SEL ";" : "=r"(d) : "r"(w));                                 \
        return d;                                                                                \
    }
#else
#define OPTIRS_REM8_BYTE(k, SEL)                                                                 \
    uint optirs_rem8_byte##k(uint w) { return (uint)(((int)(w << (24 - 8 * k)) >> 24) << 8); }
#endif
OPTIRS_REM8_BYTE(0, 0x8804)
OPTIRS_REM8_BYTE(1, 0x9914)
OPTIRS_REM8_BYTE(2, 0xAA24)
OPTIRS_REM8_BYTE(3, 0xBB34)

uint8 optirs_r8_words8(uint2 w)
{
    return (uint8)(optirs_rem8_byte0(w.s0), optirs_rem8_byte1(w.s0), optirs_rem8_byte2(w.s0), optirs_rem8_byte3(w.s0),
                   optirs_rem8_byte0(w.s1), optirs_rem8_byte1(w.s1), optirs_rem8_byte2(w.s1), optirs_rem8_byte3(w.s1));
}

uint8 optirs_r8_words_of(char8 rem)
{
    return as_uint8(convert_int8(rem) << 8);
}

uint8 optirs_round24_word8(uint8 u)
{
    return select(u + 0x7Fu + ((u >> 8) & 1u), optirs_quiet_nan_master8(u), (u & 0x7F800000u) == 0x7F800000u);
}

/* OPTIRS_PACK_X4(name, pair, portable): ``uint name(a, b, c, d)``, one byte of each of a-d as one word
 * (a's lowest). With OPTIRS_NV_PTX three prmt.b32: ``pair`` (a selector) takes the byte of a and b,
 * then of c and d, into a low half, and 0x5410 joins the halves, where masking, shifting and packing
 * took seven; elsewhere the expression ``portable``. */
#if OPTIRS_NV_PTX
#define OPTIRS_PACK_X4(name, pair, portable)                                                           \
    uint name(uint a, uint b, uint c, uint d)                                                          \
    {                                                                                                  \
        uint x, y, r;                                                                                  \
        asm("prmt.b32 %0, %1, %2, " #pair ";" : "=r"(x) : "r"(a), "r"(b));                             \
        asm("prmt.b32 %0, %1, %2, " #pair ";" : "=r"(y) : "r"(c), "r"(d));                             \
        asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(x), "r"(y));                                \
        return r;                                                                                      \
    }
#else
#define OPTIRS_PACK_X4(name, pair, portable)                                                           \
    uint name(uint a, uint b, uint c, uint d) { return portable; }
#endif

/* The bytes 1 of a-d as one word (a's lowest). */
OPTIRS_PACK_X4(optirs_pack_byte1x4, 0x7351,
               ((a >> 8) & 0xFFu) | (b & 0xFF00u) | ((c << 8) & 0xFF0000u) | ((d << 16) & 0xFF000000u))

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
uint optirs_quantize1(float y, __local const float *mid, __local const uchar *table)
{
    const uint u = as_uint(y);
    const uint a = clamp((u >> 16) & 0x7FFFu, OPTIRS_QT_LO - 1u, OPTIRS_QT_HI + 1u) - (OPTIRS_QT_LO - 1u);
    const uint c = table[a + (u >> 31) * OPTIRS_QT_WIDTH];
    const uint code = c + (mid[c] < y ? 1u : 0u);
    return isnan(y) ? 0u : code;
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

/* 1 where a < b, else 0, for a and b never NaN (a midpoint, +inf, and a finite scaled value). With
 * OPTIRS_NV_PTX the sign of a - b: exact in sign (a == b gives +0), and the shift folds into the add
 * that counts it (FADD and LEA.HI where a compare, a select and an add took three; the numba
 * lt_bit). sub.rn in inline PTX: never fused with the multiply that made b (a fused a - x * inv would
 * compare with the unrounded product). The compare elsewhere. */
uint optirs_lt_bit(float a, float b)
{
#if OPTIRS_NV_PTX
    float d;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return as_uint(d) >> 31;
#else
    return a < b ? 1u : 0u;
#endif
}

/* The lowest value of bucket 0 and of the last bucket (the buckets' clamps as floats). */
#define OPTIRS_PK_LOW as_float((OPTIRS_QT_LO - 1u) << 16)
#define OPTIRS_PK_TOP as_float((OPTIRS_QT_HI + 1u) << 16)

/* optirs_quantize1 for a block of finite scale, whose scaled values are never NaN and at most
 * 1 + 2^-23 in magnitude (|x| <= scale, inv its correctly rounded reciprocal): no NaN test and no
 * upper clamp, the same code (the numba quantize_finite). The magnitude clamped as a float (one max
 * with |y|, the sign a free operand modifier on a GPU), whose top 16 bits are the integer clamp's. */
uint optirs_quantize1_finite(float y, __local const float *mid, __local const uchar *table)
{
    const uint a = (as_uint(fmax(fabs(y), OPTIRS_PK_LOW)) >> 16) - (OPTIRS_QT_LO - 1u);
    const uint c = table[a + (as_uint(y) >> 31) * OPTIRS_QT_WIDTH];
    return c + optirs_lt_bit(mid[c], y);
}

/* The packed bucket words of a map whose midpoints are all positive (the unsigned map; the numba
 * packed_word): one 32-bit word per positive bucket b (index top16(a) - (LO - 1), a = y clamped to
 * [OPTIRS_PK_LOW, OPTIRS_PK_TOP]) holding both lookups: with c the bucket's table entry and thr the
 * low 16 bits of its midpoint mid[c] (in the bucket when their top 16 bits agree),
 * word = ((c - top16) << 16) + (0xFFFF - thr) (+ 0 without a midpoint). word + bits(a) then has c in
 * its top 16 bits, plus one exactly when the low 16 bits of a exceed thr: mid[c] < y (a carry). A
 * value below every bucket (zero, negative, tiny, NaN: fmax drops it) is clamped into bucket 0,
 * which holds no midpoint (code 0); one above (inf, > 1) into the last (code 255). One local load
 * and one add an element, where the bucket arithmetic, two dependent loads and a compare took
 * about 14 instructions. */
uint optirs_packed_word(uint b, uint c, float m)
{
    const uint top = b + (OPTIRS_QT_LO - 1u);
    const uint mu = as_uint(m);
    const uint low = (mu >> 16) == top ? 0xFFFFu - (mu & 0xFFFFu) : 0u;
    return ((c - top) << 16) + low;
}

/* The code of y by the packed words: in the top 16 bits of the word returned (bits 24-31 are 0). */
uint optirs_quantize1_packed(float y, __local const uint *packed)
{
    const uint u = as_uint(fmin(fmax(y, OPTIRS_PK_LOW), OPTIRS_PK_TOP));
    return packed[(u >> 16) - (OPTIRS_QT_LO - 1u)] + u;
}

/* ... for a block of finite scale (optirs_quantize1_finite's reason: no value above the last bucket). */
uint optirs_quantize1_packed_finite(float y, __local const uint *packed)
{
    const uint u = as_uint(fmax(y, OPTIRS_PK_LOW));
    return packed[(u >> 16) - (OPTIRS_QT_LO - 1u)] + u;
}

#define OPTIRS_QUANTIZE8_PACKED(q, y, packed)                                                     \
    (uint8)(q(y.s0, packed), q(y.s1, packed), q(y.s2, packed), q(y.s3, packed), q(y.s4, packed),  \
            q(y.s5, packed), q(y.s6, packed), q(y.s7, packed))

/* A block's reciprocal scale 1 / x for x in [2^-126, 2^126) (bits 0x00800000 to 0x7DFFFFFF:
 * optirs_rcp_in_window, one subtraction and one unsigned compare; normal, with a normal
 * reciprocal), the quotient's bits. With OPTIRS_NV_PTX (or an includer's OPTIRS_RCP_APPROX) the
 * reciprocal's approximation and one Newton step, ptxas's own expansion of div.rn there (the numba
 * rcp_fast): three instructions a block and slot, where the division's checks, branches and slow
 * path took about 20 a round. The division elsewhere. */

int optirs_rcp_in_window(float x)
{
    return as_uint(x) - 0x00800000u <= 0x7DFFFFFFu - 0x00800000u;
}

float optirs_rcp_fast(float x)
{
#ifdef OPTIRS_RCP_APPROX
    const float r = OPTIRS_RCP_APPROX(x);
    const float e = fma(x, r, -1.0f);
    return fma(r, -e, r);
#else
    return 1.0f / x;
#endif
}

#define OPTIRS_QUANTIZE8(q, y, mid, table)                                                       \
    (uint8)(q(y.s0, mid, table), q(y.s1, mid, table), q(y.s2, mid, table), q(y.s3, mid, table), \
             q(y.s4, mid, table), q(y.s5, mid, table), q(y.s6, mid, table), q(y.s7, mid, table))

/* The kernels keep a block's codes one to a 32-bit word (each below 256: code 255 is the most,
 * mid[255] being +inf): unpacked from their 4-byte words as table indices by one shift or AND each
 * and packed back by shifts and adds, where codes as uchar8 were masked again at every conversion
 * (NVIDIA's PTX through clang: 3 instructions for some bytes, 6-7 to pack 4). */
uint8 optirs_codes8(uint2 w)
{
    return (uint8)(w.s0 & 0xFFu, (w.s0 >> 8) & 0xFFu, (w.s0 >> 16) & 0xFFu, w.s0 >> 24, w.s1 & 0xFFu,
                   (w.s1 >> 8) & 0xFFu, (w.s1 >> 16) & 0xFFu, w.s1 >> 24);
}

uint2 optirs_pack_codes8(uint8 c)
{
    return (uint2)(c.s0 + (c.s1 << 8) + (c.s2 << 16) + (c.s3 << 24), c.s4 + (c.s5 << 8) + (c.s6 << 16) + (c.s7 << 24));
}

/* The bytes 2 of a-d as one word (a's lowest): the packed quantizer's codes (bits 24-31 of each are
 * 0). */
OPTIRS_PACK_X4(optirs_pack_byte2x4, 0x7362, (a >> 16) | ((b >> 8) & 0xFF00u) | (c & 0xFF0000u) | ((d << 8) & 0xFF000000u))

uint2 optirs_pack_byte2x8(uint8 w)
{
    return (uint2)(optirs_pack_byte2x4(w.s0, w.s1, w.s2, w.s3), optirs_pack_byte2x4(w.s4, w.s5, w.s6, w.s7));
}

/* quantize(x): y = (x * pre) * inv with the block's optirs_quantize_factors f = (pre, inv), then
 * its code (one to a word). ``finite``: the block's scale is finite and every |x| at most it (a
 * block's own new values: the usual case), so the shorter bucket applies. */
uint8 optirs_quantize_codes8(float8 x, float2 f, int finite, __local const float *mid, __local const uchar *table)
{
    const float8 y = (x * f.s0) * f.s1;
    if (finite)
        return OPTIRS_QUANTIZE8(optirs_quantize1_finite, y, mid, table);
    return OPTIRS_QUANTIZE8(optirs_quantize1, y, mid, table);
}

/* A block's 8 new values x as codes at its scale: the signed map's (by its table and midpoints, each
 * code in its word's low byte) and a positive map's (by its packed words, each code in byte 2).
 * ``full``: all 8 lanes are the block's, every |x| at most the scale. The usual block (a normal scale
 * below 2^126, full lanes) takes the shorter bucket with x * 1 / scale (pre is 1) and the reciprocal
 * by optirs_rcp_fast; the rest the general bucket with optirs_quantize_factors (the same codes for
 * the usual block, so only the speed differs). Past the end the shorter bucket has no upper clamp,
 * and code 0 decodes to -scale in the signed map, which a family's step may turn into a NaN (centered
 * RMSprop: sqrt of a negative), an index past the table: hence ``full``. */
uint8 optirs_quantize_block8(float8 x, float scale, int full, __local const float *mid, __local const uchar *table)
{
    if (full && optirs_rcp_in_window(scale)) {
        const float8 y = x * optirs_rcp_fast(scale);
        return OPTIRS_QUANTIZE8(optirs_quantize1_finite, y, mid, table);
    }
    const float2 f = optirs_quantize_factors(scale);
    const float8 y = (x * f.s0) * f.s1;
    return OPTIRS_QUANTIZE8(optirs_quantize1, y, mid, table);
}

uint8 optirs_quantize_block8_packed(float8 x, float scale, int full, __local const uint *packed)
{
    if (full && optirs_rcp_in_window(scale)) {
        const float8 y = x * optirs_rcp_fast(scale);
        return OPTIRS_QUANTIZE8_PACKED(optirs_quantize1_packed_finite, y, packed);
    }
    const float2 f = optirs_quantize_factors(scale);
    const float8 y = (x * f.s0) * f.s1;
    return OPTIRS_QUANTIZE8_PACKED(optirs_quantize1_packed, y, packed);
}

uchar8 optirs_quantize8(float8 x, float2 f, int finite, __local const float *mid, __local const uchar *table)
{
    return convert_uchar8(optirs_quantize_codes8(x, f, finite, mid, table));
}

/* dequantize(code, scale) = q[code] * scale. */
float8 optirs_dequantize_codes8(uint8 c, float scale, __local const float *q)
{
    return (float8)(q[c.s0], q[c.s1], q[c.s2], q[c.s3], q[c.s4], q[c.s5], q[c.s6], q[c.s7]) * scale;
}

float8 optirs_dequantize8(uchar8 c, float scale, __local const float *q)
{
    return optirs_dequantize_codes8(convert_uint8(c), scale, q);
}

/* ---------------------------------------------------------------- int8 square-root codes

 * state_dtype "int8_sqrt" (docs/formats.md; the numba sqrt_factors, sqrt_code, sqrt_code_fast and
 * sqrt_value of optirs/backends/common/formats.py): the int8 state's blocks, scales and small
 * tensors, but each code is arithmetic, so the kernels read no map and no local memory. A block's
 * factors are taken once a round (8 of its elements) per slot; an element's code is a max, a square
 * root, a product and an add, its value an add and two products. */

/* n, the largest code (127 for a signed slot, 255 for an unsigned one), and n^2. */
#define OPTIRS_SQRT_N(sg) ((sg) ? 127.0f : 255.0f)
#define OPTIRS_SQRT_N2(sg) ((sg) ? 16129.0f : 65025.0f)

/* The windows of optirs/backends/common/fast_paths.py where the GPU's fast division is div.rn, for
 * a block's scale (an absmax: never negative, so its bits order it; 0, tiny, huge, inf and NaN fall
 * outside): as the divisor, [2^-51, 2^49); as the dividend, [2^-72, 2^72). One subtraction and one
 * unsigned compare each. */
int optirs_divisor_in_window(float b)
{
    return as_uint(b) - 0x26000000u <= 0x57FFFFFFu - 0x26000000u;
}

int optirs_dividend_in_window(float a)
{
    return as_uint(a) - 0x1B800000u <= 0x637FFFFFu - 0x1B800000u;
}

/* a / b inside those windows: with OPTIRS_RCP_APPROX (inline PTX on NVIDIA's driver) ptxas's own
 * fast path of div.rn (the numba div_fast: the reciprocal's approximation, one Newton step, the
 * quotient corrected by its exact residual), 7 instructions where div.rn's range check, branch and
 * slow path took about 20; the division elsewhere (correctly rounded: the programs are built with
 * -cl-fp32-correctly-rounded-divide-sqrt). */
float optirs_div_fast(float a, float b)
{
#ifdef OPTIRS_RCP_APPROX
    const float y0 = OPTIRS_RCP_APPROX(b);
    const float y = fma(fma(-b, y0, 1.0f), y0, y0);
    const float q = a * y;
    return fma(fma(-b, q, a), y, q);
#else
    return a / b;
#endif
}

/* The reciprocal square root's approximation (rsqrt.approx.ftz) that optirs_sqrt_fast8 refines, on
 * NVIDIA's driver (a test may put another in its place first, as for OPTIRS_RCP_APPROX). Here, not
 * in optirs_ptx.h: the formats programs alone take it. */
#if OPTIRS_NV_PTX && !defined(OPTIRS_RSQRT_APPROX)
float optirs_rsqrt_approx(float x)
{
    float y;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define OPTIRS_RSQRT_APPROX(x) optirs_rsqrt_approx(x)
#endif

/* sqrt(x) for x in [2^-101, 2^128): with OPTIRS_RSQRT_APPROX (inline PTX on NVIDIA's driver)
 * ptxas's own fast path of sqrt.rn there (the numba sqrt_fast, sqrt.rn for every x of the window):
 * 5 instructions and no branch, where sqrt.rn's range check and slow path took a branch region;
 * the correctly rounded sqrt elsewhere. */
float optirs_sqrt_fast(float x)
{
#ifdef OPTIRS_RSQRT_APPROX
    const float r = OPTIRS_RSQRT_APPROX(x);
    const float s = x * r;
    return fma(fma(-s, s, x), r * 0.5f, s);
#else
    return sqrt(x);
#endif
}

/* optirs_sqrt_fast of 8 values (the approximation is a scalar instruction; elsewhere the vector
 * sqrt). */
float8 optirs_sqrt_fast8(float8 x)
{
#ifdef OPTIRS_RSQRT_APPROX
    return (float8)(optirs_sqrt_fast(x.s0), optirs_sqrt_fast(x.s1), optirs_sqrt_fast(x.s2), optirs_sqrt_fast(x.s3),
                    optirs_sqrt_fast(x.s4), optirs_sqrt_fast(x.s5), optirs_sqrt_fast(x.s6), optirs_sqrt_fast(x.s7));
#else
    return sqrt(x);
#endif
}

/* The codes of 8 values x at their block's k, each in the low byte of its word: the root r of |x|
 * (a signed slot) or of x (an unsigned one), c = rint(r * k) ties to even, -c for a negative x of a
 * signed slot. fast: a block whose scale is in [2^-80, 2^98), where k < 2^48: the root of the
 * radicand raised to 2^-100 by optirs_sqrt_fast8, whose window holds it (a radicand below codes as
 * 0 either way, its root times k being below 1/4; 0, negative and NaN radicands code 0, fmax
 * dropping the NaN), and the product never NaN. Otherwise the IEEE root of the radicand raised to 0
 * and a NaN product (inf times the 0 of an inf scale's block) made 0. The rounding is one add:
 * t + 1.5 * 2^23 (|t| < 2^22) rounds to the integer nearest t, ties to even, and its bits are
 * 0x4B400000 + rint(t), whose low byte is the code's two's complement byte (where rint and a
 * conversion to an integer took two conversion instructions). A signed slot takes x's sign bit onto
 * the product (never negative) by one AND-OR, where copysign took a shift, a compare and a select
 * through clang + ptxas. Lanes past a tensor's end (never stored) may hold any value: the
 * arithmetic then gives some word. */
uint8 optirs_sqrt_words8(float8 x, float k, int is_signed, int fast)
{
    const float8 u = is_signed ? fabs(x) : x;
    const float8 t = fast ? optirs_sqrt_fast8(fmax(u, 0x1p-100f)) * k : fmax(sqrt(fmax(u, 0.0f)) * k, 0.0f);
    const uint8 b = as_uint8(t);
    return as_uint8(as_float8(is_signed ? b | (as_uint8(x) & 0x80000000u) : b) + 0x1.8p23f);
}

/* The codes of a block's 8 new values x under its new scale (their absmax): k = n / sqrt(scale), 0
 * for a zero scale; a usual block's (a scale in [2^-80, 2^98), whose root is in the division's
 * window) by optirs_sqrt_fast and optirs_div_fast, the others' by the IEEE operations. The same
 * codes either way. */
uint8 optirs_sqrt_block8(float8 x, float scale, int is_signed)
{
    const float n = OPTIRS_SQRT_N(is_signed);
    if (scale >= 0x1p-80f && scale < 0x1p98f)
        return optirs_sqrt_words8(x, optirs_div_fast(n, optirs_sqrt_fast(scale)), is_signed, 1);
    return optirs_sqrt_words8(x, scale == 0.0f ? 0.0f : n / sqrt(scale), is_signed, 0);
}

/* Byte k of w as an int, sign-extended (a signed slot's code) or not: one prmt.b32 each with
 * OPTIRS_NV_PTX, a shift or two elsewhere. */
#if OPTIRS_NV_PTX
#define OPTIRS_CODE_BYTE(name, k, SEL)                                                           \
    int optirs_##name##k(uint w)                                                                 \
    {                                                                                            \
        uint d;                                                                                  \
        asm("prmt.b32 %0, %1, 0, " #SEL ";" : "=r"(d) : "r"(w));                                 \
        return (int)d;                                                                           \
    }
#define OPTIRS_SBYTE(k, SEL) OPTIRS_CODE_BYTE(sbyte, k, SEL)
#define OPTIRS_UBYTE(k, SEL) OPTIRS_CODE_BYTE(ubyte, k, SEL)
#else
#define OPTIRS_SBYTE(k, SEL) int optirs_sbyte##k(uint w) { return (int)(w << (24 - 8 * k)) >> 24; }
#define OPTIRS_UBYTE(k, SEL) int optirs_ubyte##k(uint w) { return (int)((w >> (8 * k)) & 0xFFu); }
#endif
OPTIRS_SBYTE(0, 0x8880)
OPTIRS_SBYTE(1, 0x9991)
OPTIRS_SBYTE(2, 0xAAA2)
OPTIRS_SBYTE(3, 0xBBB3)
OPTIRS_UBYTE(0, 0x4440)
OPTIRS_UBYTE(1, 0x4441)
OPTIRS_UBYTE(2, 0x4442)
OPTIRS_UBYTE(3, 0x4443)

/* The values of a block's 8 codes as loaded (raw: 8 bytes, element 4i + j in word i's byte j) at
 * its scale: (c * |c|) * w with w = scale / n^2 (correctly rounded), taken once a round per slot.
 * The usual block (a scale in the division's window, so 2^23 * w is exact and finite) takes w by
 * optirs_div_fast and each value by one fused multiply-add: c^2 + 2^23 is the float whose bits are
 * 0x4B000000 + c^2 (c^2 <= 2^14; one integer multiply-add), and fma(c^2 + 2^23, w, -2^23 * w) is
 * c^2 * w exactly before its one rounding: the contract's c^2 * w, the sign of a signed slot's c put
 * back by one AND-OR (rounding is symmetric). Three instructions an element for an unsigned slot
 * (the byte, the integer multiply-add, the fused one) and four for a signed one, where the byte as a
 * float (a prmt and an add) and the two products took four. The rest (zero, tiny, huge, inf and NaN
 * scales) take the contract's arithmetic itself. */
float8 optirs_sqrt_values8(uint2 raw, int is_signed, float scale)
{
    const int8 c = is_signed ? (int8)(optirs_sbyte0(raw.s0), optirs_sbyte1(raw.s0), optirs_sbyte2(raw.s0),
                                      optirs_sbyte3(raw.s0), optirs_sbyte0(raw.s1), optirs_sbyte1(raw.s1),
                                      optirs_sbyte2(raw.s1), optirs_sbyte3(raw.s1))
                             : (int8)(optirs_ubyte0(raw.s0), optirs_ubyte1(raw.s0), optirs_ubyte2(raw.s0),
                                      optirs_ubyte3(raw.s0), optirs_ubyte0(raw.s1), optirs_ubyte1(raw.s1),
                                      optirs_ubyte2(raw.s1), optirs_ubyte3(raw.s1));
    const float n2 = OPTIRS_SQRT_N2(is_signed);
    if (optirs_dividend_in_window(scale)) {
        const float w = optirs_div_fast(scale, n2);
        const float8 v = fma(as_float8(as_uint8(c * c) + 0x4B000000u), w, -0x1p23f * w);
        return is_signed ? as_float8(as_uint8(v) | (as_uint8(c) & 0x80000000u)) : v;
    }
    const float8 t = convert_float8(c);
    return (t * fabs(t)) * (scale / n2);
}

/* The low bytes of a-d as one word (a's lowest): optirs_sqrt_words8's codes. */
OPTIRS_PACK_X4(optirs_pack_byte0x4, 0x6240, (a & 0xFFu) | ((b & 0xFFu) << 8) | ((c & 0xFFu) << 16) | (d << 24))

uint2 optirs_pack_byte0x8(uint8 w)
{
    return (uint2)(optirs_pack_byte0x4(w.s0, w.s1, w.s2, w.s3), optirs_pack_byte0x4(w.s4, w.s5, w.s6, w.s7));
}

/* ---------------------------------------------------------------- float8 state

 * state_dtype "float8_e4m3fn" (docs/formats.md; the numba fp8_factors, fp8_code and fp8_value of
 * optirs/backends/common/formats.py): the int8 state's blocks, scales and small tensors, every slot
 * coded alike (a float8 value carries its sign). Per block and slot, once a round, the factors
 * k = 448 / (scale * pre) and w = (scale * pre) / 448 (pre = 2^64 below 2^-64). With OPTIRS_NV_FP8
 * (NVIDIA's driver, sm_89 on) the conversions are the hardware's: one cvt.rn.satfinite.e4m3x2.f32
 * codes two values (nearest even, saturated at 448: the contract's codes for every finite value), one
 * cvt.rn.f16x2.e4m3x2 decodes two into half precision (exact) and a cvt.f32.f16 widens each. */
/* (only a float8 program holds the conversions: a driver whose PTX predates them builds the rest) */
#define OPTIRS_NV_FP8 (OPTIRS_NV_PTX >= 3 && OPTIRS_FMT_STATE == 4)

/* pre and post of a block: 2^64 and 2^-64 for a scale in (0, 2^-64), else 1 */
#define OPTIRS_FP8_TINY(scale) ((scale) > 0.0f && (scale) < 0x1p-64f)

/* The codes of y by integer arithmetic, each in the low byte of its word: a normal value's 20
 * dropped bits rounded to nearest even by one add, the exponent rebased from 127 to 7; below 2^-6
 * the subnormal count by one add to 2^14 (whose ulp is their step 2^-9); 448 and above saturated;
 * NaN 0x7F. */
uint8 optirs_fp8_code8(float8 y)
{
    const uint8 u = as_uint8(y);
    const uint8 a = u & 0x7FFFFFFFu;
    const uint8 normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
    const uint8 small = as_uint8(as_float8(a) + 16384.0f) - 0x46800000u;
    uint8 c = select(normal, small, a < 0x3C800000u);
    c = select(c, (uint8)0x7Eu, a >= 0x43E00000u) | ((u >> 24) & 0x80u);
    return select(c, (uint8)0x7Fu, a > 0x7F800000u);
}

/* The float values of 8 codes (each in the low byte of its word; 0x7F and 0xFF: NaN): a normal
 * code's exponent and mantissa moved into a float's and rebased, a subnormal's count (a float by
 * its bits in 2^23's mantissa) times 2^-9, the sign or'ed in. */
float8 optirs_fp8_value8(uint8 b)
{
    const uint8 m = b & 0x7Fu;
    const float8 normal = as_float8((m << 20) + 0x3C000000u);
    const float8 small = (as_float8(m | 0x4B000000u) - 0x1p23f) * 0x1p-9f;
    const float8 v = as_float8(as_uint8(select(normal, small, m < 8u)) | ((b & 0x80u) << 24));
    return select(v, as_float8((uint8)0x7FC00000u), m == 0x7Fu);
}

#if OPTIRS_NV_FP8
/* Four values as one word of codes (x's first in the low byte). */
uint optirs_fp8_code4_nv(float a, float b, float c, float d)
{
    uint w;
    asm("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1; cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;"
        " mov.b32 %0, {lo, hi}; }" : "=r"(w) : "f"(a), "f"(b), "f"(c), "f"(d));
    return w;
}

/* The values of a word's four codes (its low byte first). */
float4 optirs_fp8_value4_nv(uint w)
{
    float a, b, c, d;
    asm("{ .reg .b16 c01, c23, h0, h1, h2, h3; .reg .b32 p01, p23; mov.b32 {c01, c23}, %4;"
        " cvt.rn.f16x2.e4m3x2 p01, c01; cvt.rn.f16x2.e4m3x2 p23, c23; mov.b32 {h0, h1}, p01; mov.b32 {h2, h3}, p23;"
        " cvt.f32.f16 %0, h0; cvt.f32.f16 %1, h1; cvt.f32.f16 %2, h2; cvt.f32.f16 %3, h3; }"
        : "=f"(a), "=f"(b), "=f"(c), "=f"(d) : "r"(w));
    return (float4)(a, b, c, d);
}
#endif

/* The codes of a block's 8 new values x under its new scale (their absmax), packed four to a word as
 * stored (element 4i + j in word i's byte j): y = (x * pre) * k, k by optirs_div_fast in the
 * division's window (448 is in the dividend's), the IEEE division elsewhere, 0 for a zero scale.
 * A block of a finite scale holds finite y alone, which the hardware's conversion codes as the
 * contract does; a NaN or inf scale's block takes the integer form (its NaN codes 0x7F). */
uint2 optirs_fp8_block8(float8 x, float scale)
{
    const int tiny = OPTIRS_FP8_TINY(scale);
    const float sp = tiny ? scale * 0x1p64f : scale;
    const float k = optirs_divisor_in_window(sp) ? optirs_div_fast(448.0f, sp) : (scale == 0.0f ? 0.0f : 448.0f / sp);
    const float8 y = (tiny ? x * 0x1p64f : x) * k;
#if OPTIRS_NV_FP8
    if (isfinite(scale))
        return (uint2)(optirs_fp8_code4_nv(y.s0, y.s1, y.s2, y.s3), optirs_fp8_code4_nv(y.s4, y.s5, y.s6, y.s7));
#endif
    return optirs_pack_byte0x8(optirs_fp8_code8(y));
}

/* The values of a block's 8 codes as loaded (raw: element 4i + j in word i's byte j) under its
 * scale: (v * w) * post, w by optirs_div_fast in the division's window (448 is in the divisor's). */
float8 optirs_fp8_values8(uint2 raw, float scale)
{
    const int tiny = OPTIRS_FP8_TINY(scale);
    const float sp = tiny ? scale * 0x1p64f : scale;
    const float w = optirs_dividend_in_window(sp) ? optirs_div_fast(sp, 448.0f) : sp / 448.0f;
#if OPTIRS_NV_FP8
    const float8 v = (float8)(optirs_fp8_value4_nv(raw.s0), optirs_fp8_value4_nv(raw.s1));
#else
    const float8 v = optirs_fp8_value8(as_uint8((int8)(optirs_ubyte0(raw.s0), optirs_ubyte1(raw.s0),
                                                       optirs_ubyte2(raw.s0), optirs_ubyte3(raw.s0),
                                                       optirs_ubyte0(raw.s1), optirs_ubyte1(raw.s1),
                                                       optirs_ubyte2(raw.s1), optirs_ubyte3(raw.s1))));
#endif
    return tiny ? (v * w) * 0x1p-64f : v * w;
}

#endif
