/* float32 -> float16 / bfloat16 bits, round to nearest even, in integer arithmetic (as
 * optirs/backends/common/half.py), so results match numpy's float16 and ml_dtypes' bfloat16 bit
 * for bit on any device. Shared by optirs_mixed_precision.cl and optirs_formats.cl. */
#ifndef OPTIRS_HALF_H
#define OPTIRS_HALF_H

inline ushort optirs_f16_encode(uint u) {
    uint sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu, h;
    if (a >= 0x7F800000u) {
        if (a == 0x7F800000u) return (ushort)(sign | 0x7C00u);
        h = 0x7C00u | ((a >> 13) & 0x3FFu);
        return (ushort)(sign | (h == 0x7C00u ? 0x7C01u : h));
    }
    if (a >= 0x477FF000u) return (ushort)(sign | 0x7C00u);
    if (a >= 0x38800000u) {
        uint rem = a & 0x1FFFu;
        h = (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3FFu);
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1u;
        return (ushort)(sign | h);
    }
    if (a <= 0x33000000u) return (ushort)sign;
    uint shift = 126u - (a >> 23), mant = (a & 0x7FFFFFu) | 0x800000u;
    uint rem = mant & ((1u << shift) - 1u), half_ = 1u << (shift - 1u);
    h = mant >> shift;
    if (rem > half_ || (rem == half_ && (h & 1u))) h += 1u;
    return (ushort)(sign | h);
}

inline ushort optirs_bf16_encode(uint u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 31) ? (ushort)0xFFC0u : (ushort)0x7FC0u;
    return (ushort)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif
