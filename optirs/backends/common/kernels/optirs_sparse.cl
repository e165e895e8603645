/* Row-sparse Adam and SGD steps in OpenCL C (built once per context by optirs/backends/opencl/sparse.py).
 *
 * One work item per (row, column) element, as the cuda kernels. The gradient is a SparseRows
 * (optirs/plugin/hookspecs.py): the touched rows, segment offsets, an order into the value rows
 * and the values; a segment's rows are summed in the order given (gathered_grad). The dense-decay
 * kernels look a row's segment up in pos (-1: no gradient, zero). The per-element math is
 * optirs_elementwise.h with T = float; the scalar records are the structs of optirs_scalars.h,
 * passed by value.
 */
#pragma OPENCL FP_CONTRACT OFF /* same rounding as the numba kernels */

#include "optirs_scalars.h"

#define FN_PASTE(a, b) a##_##b
#define FN_EXPAND(a, b) FN_PASTE(a, b)
#define FN(name) FN_EXPAND(name, SUFFIX)
#define T float
#define SUFFIX v1
#include "optirs_elementwise.h"
#undef T
#undef SUFFIX

inline float gathered_grad(__global const float *values, __global const long *order,
                           long start, long stop, long dim, long j) {
    float g = values[order[start] * dim + j];
    for (long q = start + 1; q < stop; ++q) g += values[order[q] * dim + j];
    return g;
}

inline void adam_at(__global float *p, __global float *m, __global float *v, long i, float g,
                    const adam_scalars *sc) {
    float pp = p[i], mm = m[i], vv = v[i], vm = vv;
    adam_update_v1(&pp, g, &mm, &vv, &vm, sc);
    p[i] = pp;
    m[i] = mm;
    v[i] = vv;
}

inline void sgd_at(__global float *p, __global float *buf, long i, float g, const sgd_scalars *sc) {
    float pp = p[i], b = sc->has_momentum ? buf[i] : 0.0f;
    sgd_update_v1(&pp, g, &b, sc);
    p[i] = pp;
    if (sc->has_momentum) buf[i] = b;
}

__kernel void scatter_pos(__global long *pos, __global const long *rows, long n, int clear) {
    long k = get_global_id(0);
    if (k < n) pos[rows[k]] = clear ? -1 : k;
}

__kernel void mark_seen(__global uchar *seen, __global const long *rows, long n) {
    long k = get_global_id(0);
    if (k < n) seen[rows[k]] = 1;
}

__kernel void adam_lazy(__global float *p, __global float *m, __global float *v,
                        __global const long *rows, __global const long *seg,
                        __global const long *order, __global const float *values, long n, long dim,
                        const adam_scalars sc) {
    long i = get_global_id(0);
    if (i >= n * dim) return;
    long k = i / dim, j = i - k * dim;
    adam_at(p, m, v, rows[k] * dim + j, gathered_grad(values, order, seg[k], seg[k + 1], dim, j), &sc);
}

__kernel void adam_dense(__global float *p, __global float *m, __global float *v,
                         __global const long *pos, __global const long *seg,
                         __global const long *order, __global const float *values, long num_rows,
                         long dim, const adam_scalars sc) {
    long i = get_global_id(0);
    if (i >= num_rows * dim) return;
    long r = i / dim, j = i - r * dim, k = pos[r];
    adam_at(p, m, v, i, k < 0 ? 0.0f : gathered_grad(values, order, seg[k], seg[k + 1], dim, j), &sc);
}

__kernel void sgd_lazy(__global float *p, __global float *buf, __global const uchar *seen,
                       __global const long *rows, __global const long *seg,
                       __global const long *order, __global const float *values, long n, long dim,
                       const sgd_scalars sc, const sgd_scalars sc_first) {
    long i = get_global_id(0);
    if (i >= n * dim) return;
    long k = i / dim, j = i - k * dim, r = rows[k];
    float g = gathered_grad(values, order, seg[k], seg[k + 1], dim, j);
    /* seen is marked by mark_seen after this launch: every item of a row reads the old flag. */
    sgd_at(p, buf, r * dim + j, g, (sc.has_momentum && seen[r] == 0) ? &sc_first : &sc);
}

__kernel void sgd_dense(__global float *p, __global float *buf, __global const long *pos,
                        __global const long *seg, __global const long *order,
                        __global const float *values, long num_rows, long dim, const sgd_scalars sc) {
    long i = get_global_id(0);
    if (i >= num_rows * dim) return;
    long r = i / dim, j = i - r * dim, k = pos[r];
    sgd_at(p, buf, i, k < 0 ? 0.0f : gathered_grad(values, order, seg[k], seg[k + 1], dim, j), &sc);
}
