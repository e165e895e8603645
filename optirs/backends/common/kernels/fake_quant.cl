// Integer fake-quant and its straight-through gradient: the same float32 operations in the same
// order as fq_element in optirs/backends/common/fake_quant.py (see its docstring for why each one).
// FP_CONTRACT OFF: x * inv_scale must be rounded to float32 before rint, never fused into an FMA.
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
