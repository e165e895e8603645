/* Mixed-precision passes of optirs (optirs/backends/opencl/mixed_precision.py).
 * float16 loads go through vload_half (core OpenCL, exact; no cl_khr_fp16 needed); the encoders
 * (optirs_half.h) are integer arithmetic, bit for bit numpy's float16 and ml_dtypes' bfloat16. */

#include "optirs_half.h"

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
