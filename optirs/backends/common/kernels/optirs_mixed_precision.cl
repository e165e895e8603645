/* Mixed-precision passes of optirs (optirs/backends/opencl/mixed_precision.py).
 * float16 loads go through vload_half (core OpenCL, exact; no cl_khr_fp16 needed); every rounding
 * is integer arithmetic, as in optirs/backends/common/half.py, so results match numpy's float16
 * and ml_dtypes' bfloat16 bit for bit on any device. */

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

__kernel void optirs_mp_unscale(__global const ushort *g, ulong g_off, __global float *out, ulong out_off,
                                uint n, float inv_scale, int bf16, __global int *found_inf) {
    size_t i = get_global_id(0);
    if (i >= n) return;
    float x = bf16 ? as_float(((uint)g[g_off + i]) << 16) : vload_half(g_off + i, (__global const half *)g);
    x *= inv_scale;
    out[out_off + i] = x;
    if (!isfinite(x)) *found_inf = 1;  /* every writer stores the same value */
}

__kernel void optirs_mp_narrow(__global const uint *master, ulong m_off, __global ushort *p, ulong p_off,
                               uint n, int bf16) {
    size_t i = get_global_id(0);
    if (i >= n) return;
    uint u = master[m_off + i];
    p[p_off + i] = bf16 ? optirs_bf16_encode(u) : optirs_f16_encode(u);
}
