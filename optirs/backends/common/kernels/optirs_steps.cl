/* optirs step kernels in OpenCL C (built once per context by optirs/backends/opencl/context.py).
 *
 * Three launch shapes share the per-element math of optirs_elementwise.h:
 *   <opt>_flat4   one contiguous range (a single tensor, or a model packed at its layout
 *                 offsets): one work-item per float4, the last work-item does the 0-3 tail.
 *                 Needs every base offset to be a multiple of 4 elements (16-byte aligned).
 *   <opt>_flat1   the same range, one work-item per element (any alignment).
 *   <opt>_chunks  a model of separate buffers, in chunks of OPTIRS_CHUNK elements of one tensor
 *                 (the apex multi_tensor_apply idea). OpenCL 1.2 has no pointer tables, so a
 *                 launch takes OPTIRS_SLOTS parameter and gradient buffers as arguments (as many
 *                 as the device's argument space holds) and the tensor table names each tensor's
 *                 slots and offsets. A launch is a resident grid: each work-group takes chunks
 *                 from a counter until none are left (optirs_chunks.h).
 * LAMB runs as chunked passes: [gradient-norm partials, finish,] moments + per-chunk norm
 * partials, per-tensor trust ratios, apply.
 *
 * The host puts the slot macros in front (OPTIRS_SLOTS, SLOT_PARAMS, PICK:
 * optirs/backends/opencl/slots.py), defines OPTIRS_WG (work-group size, a power of two) and
 * OPTIRS_CHUNK, and appends the elementwise families' kernels and the struct-size check.
 */
#pragma OPENCL FP_CONTRACT OFF /* no a*b+c -> fma contraction: same rounding as the numba backends */

#include "optirs_program.h"
#include "optirs_scalars.h"

#define T float
#define SUFFIX v1
#include "optirs_elementwise.h"
#undef T
#undef SUFFIX

#define T float4
#define SUFFIX v4
#include "optirs_elementwise.h"
#undef T
#undef SUFFIX

/* ---------------------------------------------------------------- buffer slots */

#include "optirs_chunks.h"

/* The chunk work-item 0 takes for the work-group (DEAL_CHUNK). */
typedef struct {
    uint taken;
    int t;
    long start;
    __global float *p;
    __global const float *g;
} chunk_deal;

/* The loop over the chunks the work-group takes: chunk c of tensor t, whose table rows are
 * tens[t] = (param offset, grad offset, state offset, size) and tinfo[t] = (param slot, grad
 * slot, all offsets 16-byte aligned, unused); the chunk covers [start, stop) of the tensor.
 * Declares c, t, p, g, s_off, start, stop, aligned; lid before the loop. The trip count is the
 * same for the whole work-group (barriers inside are reached by all). */
#define CHUNKS_BEGIN(P, G)                                                                       \
    __local chunk_deal deal_;                                                                    \
    const long lid = get_local_id(0);                                                            \
    for (;;) {                                                                                   \
        DEAL_CHUNK(deal_, P, G, tinfo[t].x, tinfo[t].y)                                          \
        if (deal_.taken >= nchunks)                                                              \
            break;                                                                               \
        const uint c = chunk_base + deal_.taken;                                                 \
        const int t = deal_.t;                                                                   \
        const long4 o = tens[t];                                                                 \
        __global float *p = deal_.p + o.x;                                                       \
        __global const float *g = deal_.g + o.y;                                                 \
        const long s_off = o.z;                                                                  \
        const long start = deal_.start;                                                          \
        const long stop = min(start + (long)OPTIRS_CHUNK, o.w);                                  \
        const int aligned = tinfo[t].z;
#define CHUNKS_END }

#define CHUNK_TABLE_PARAMS __global const long4 *tens, __global const int4 *tinfo, DEAL_PARAMS

/* ---------------------------------------------------------------- the elementwise optimizers */

#define STEP_KERNELS(OPT)                                                                        \
__kernel void OPT##_flat4(__global float *P, ulong p_off, __global const float *G, ulong g_off, \
                          __global float *S0, __global float *S1, __global float *S2,            \
                          ulong s_off, ulong n, const OPT##_scalars sc)                          \
{                                                                                                \
    const size_t i = get_global_id(0), nv = n / 4;                                               \
    P += p_off; G += g_off; S0 += s_off; S1 += s_off; S2 += s_off;                               \
    if (i < nv)                                                                                  \
        OPT##_elem_v4((__global float4 *)P, (__global const float4 *)G, (__global float4 *)S0,   \
                      (__global float4 *)S1, (__global float4 *)S2, i, i, &sc);                  \
    else if (i == nv)                                                                            \
        for (size_t k = 4 * nv; k < n; ++k)                                                      \
            OPT##_elem_v1(P, G, S0, S1, S2, k, k, &sc);                                          \
}                                                                                                \
__kernel void OPT##_flat1(__global float *P, ulong p_off, __global const float *G, ulong g_off, \
                          __global float *S0, __global float *S1, __global float *S2,            \
                          ulong s_off, ulong n, const OPT##_scalars sc)                          \
{                                                                                                \
    const size_t i = get_global_id(0);                                                           \
    if (i < n)                                                                                   \
        OPT##_elem_v1(P + p_off, G + g_off, S0 + s_off, S1 + s_off, S2 + s_off, i, i, &sc);      \
}                                                                                                \
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))                                  \
void OPT##_chunks(SLOT_PARAMS(P, float), SLOT_PARAMS(G, const float), __global float *S0,       \
                  __global float *S1, __global float *S2, CHUNK_TABLE_PARAMS,                    \
                  const OPT##_scalars sc)                                                        \
{                                                                                                \
    CHUNKS_BEGIN(P, G)                                                                           \
        __global float *s0 = S0 + s_off, *s1 = S1 + s_off, *s2 = S2 + s_off;                     \
        if (aligned) {                                                                           \
            const long vstop = stop / 4;                                                         \
            for (long k = start / 4 + lid; k < vstop; k += OPTIRS_WG)                            \
                OPT##_elem_v4((__global float4 *)p, (__global const float4 *)g,                  \
                              (__global float4 *)s0, (__global float4 *)s1,                      \
                              (__global float4 *)s2, k, k, &sc);                                 \
            if (lid == 0)                                                                        \
                for (long k = 4 * vstop; k < stop; ++k)                                          \
                    OPT##_elem_v1(p, g, s0, s1, s2, k, k, &sc);                                  \
        } else {                                                                                 \
            for (long k = start + lid; k < stop; k += OPTIRS_WG)                                 \
                OPT##_elem_v1(p, g, s0, s1, s2, k, k, &sc);                                      \
        }                                                                                        \
    CHUNKS_END                                                                                   \
}

/* The host appends STEP_KERNELS(<family>) for every elementwise family of optirs.core.definitions,
 * and optirs_struct_sizes, which reports each family's struct size (see optirs/backends/opencl). */

/* ---------------------------------------------------------------- reductions (group_sum, SQUARE: optirs_program.h) */

acc_t sum_squares4(float4 x)
{
    return (SQUARE(x.s0) + SQUARE(x.s1)) + (SQUARE(x.s2) + SQUARE(x.s3));
}

/* ---------------------------------------------------------------- LAMB */

/* Global gradient clipping, part 1: partial[c] = sum of g^2 over chunk c. */
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
void lamb_grad_sumsq(SLOT_PARAMS(P, float), SLOT_PARAMS(G, const float), CHUNK_TABLE_PARAMS, __global acc_t *partial)
{
    __local acc_t scratch[OPTIRS_WG];
    CHUNKS_BEGIN(P, G)
        acc_t s = 0;
        if (aligned) {
            const long vstop = stop / 4;
            for (long k = start / 4 + lid; k < vstop; k += OPTIRS_WG)
                s += sum_squares4(((__global const float4 *)g)[k]);
            if (lid == 0)
                for (long k = 4 * vstop; k < stop; ++k)
                    s += SQUARE(g[k]);
        } else {
            for (long k = start + lid; k < stop; k += OPTIRS_WG)
                s += SQUARE(g[k]);
        }
        s = group_sum(s, scratch);
        if (lid == 0)
            partial[c] = s;
        (void)p;
    CHUNKS_END
}

/* Part 2 (one work-group): grad_factor * min(1, max_grad_norm / ||grad_factor * g||) from the partial
 * sums of g^2 (the clip is of the factored, e.g. unscaled, gradient; as lamb_grad_scale in numba). */
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
void lamb_grad_scale(__global const acc_t *partial, uint nchunks, float max_grad_norm, float grad_factor,
                     __global float *scale)
{
    __local acc_t scratch[OPTIRS_WG];
    acc_t s = 0;
    for (uint k = get_local_id(0); k < nchunks; k += OPTIRS_WG)
        s += partial[k];
    s = group_sum(s, scratch);
    if (get_local_id(0) == 0) {
        const acc_t factor = (acc_t)grad_factor;
        const acc_t norm = sqrt(s) * fabs(factor), max_norm = (acc_t)max_grad_norm;
        /* as the reference: a NaN norm gives a NaN factor (not 1), an infinite one 0 */
        const acc_t clip = (0 < max_norm && !(norm <= max_norm)) ? max_norm / norm : (acc_t)1;
        scale[0] = (float)(clip * factor);
    }
}

/* Pass 1's work on element k: its moments written back, p^2 and u^2 added to the sums. */
void lamb_moments_at(__global const float *p, __global const float *g, __global float *m, __global float *v, long k,
                     float scale, const lamb_scalars *sc, acc_t *sp, acc_t *su)
{
    float mm = m[k], vv = v[k];
    lamb_moments_v1(g[k], &mm, &vv, scale, sc);
    m[k] = mm;
    v[k] = vv;
    const float u = lamb_direction_v1(p[k], mm, vv, sc);
    *sp += SQUARE(p[k]);
    *su += SQUARE(u);
}

/* Pass 1: moments, and per-chunk sums of p^2 and u^2 (partial[2c], partial[2c+1]). */
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
void lamb_moments(SLOT_PARAMS(P, float), SLOT_PARAMS(G, const float), __global float *M, __global float *V,
                  CHUNK_TABLE_PARAMS, __global const float *grad_scale, int clip,
                  __global acc_t *partial, const lamb_scalars sc)
{
    __local acc_t scratch[OPTIRS_WG];
    CHUNKS_BEGIN(P, G)
        __global float *m = M + s_off, *v = V + s_off;
        const float scale = clip ? grad_scale[0] : sc.grad_factor;
        acc_t sp = 0, su = 0;
        if (aligned) {
            const long vstop = stop / 4;
            __global float4 *m4 = (__global float4 *)m, *v4 = (__global float4 *)v;
            for (long k = start / 4 + lid; k < vstop; k += OPTIRS_WG) {
                const float4 pp = ((__global const float4 *)p)[k];
                float4 mm = m4[k], vv = v4[k];
                lamb_moments_v4(((__global const float4 *)g)[k], &mm, &vv, scale, &sc);
                m4[k] = mm;
                v4[k] = vv;
                sp += sum_squares4(pp);
                su += sum_squares4(lamb_direction_v4(pp, mm, vv, &sc));
            }
            if (lid == 0)
                for (long k = 4 * vstop; k < stop; ++k)
                    lamb_moments_at(p, g, m, v, k, scale, &sc, &sp, &su);
        } else {
            for (long k = start + lid; k < stop; k += OPTIRS_WG)
                lamb_moments_at(p, g, m, v, k, scale, &sc, &sp, &su);
        }
        store_norm_partials(sp, su, scratch, partial, (size_t)c);
    CHUNKS_END
}

/* One work-group per tensor: ||p|| / ||u||, 1 where either is zero, at most max_trust_ratio. */
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
void lamb_trust_ratios(__global const acc_t *partial, __global const int *first_chunk,
                       __global const int *nchunks, float max_trust_ratio, __global float *ratio)
{
    __local acc_t scratch[OPTIRS_WG];
    const uint t = get_group_id(0);
    const int first = first_chunk[t], count = nchunks[t];
    acc_t sp = 0, su = 0;
    for (int k = get_local_id(0); k < count; k += OPTIRS_WG) {
        sp += partial[2 * (size_t)(first + k)];
        su += partial[2 * (size_t)(first + k) + 1];
    }
    sp = group_sum(sp, scratch);
    su = group_sum(su, scratch);
    if (get_local_id(0) == 0) {
        const acc_t pn = sqrt(sp), un = sqrt(su);
        const acc_t r = (pn == 0 || un == 0) ? (acc_t)1 : pn / un;
        /* not fmin, which drops a NaN: a NaN ratio stays NaN, as the reference */
        ratio[t] = (float)(r > (acc_t)max_trust_ratio ? (acc_t)max_trust_ratio : r);
    }
}

/* Pass 2: p -= lr * ratio * u, with u recomputed from the same float32 inputs (same value). */
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
void lamb_apply(SLOT_PARAMS(P, float), SLOT_PARAMS(G, const float), __global const float *M, __global const float *V,
                CHUNK_TABLE_PARAMS, __global const float *ratio, const lamb_scalars sc)
{
    CHUNKS_BEGIN(P, G)
        __global const float *m = M + s_off, *v = V + s_off;
        const float step = sc.lr * ratio[t];
        if (aligned) {
            const long vstop = stop / 4;
            __global float4 *p4 = (__global float4 *)p;
            for (long k = start / 4 + lid; k < vstop; k += OPTIRS_WG) {
                const float4 pp = p4[k];
                p4[k] = pp - step * lamb_direction_v4(pp, ((__global const float4 *)m)[k],
                                                      ((__global const float4 *)v)[k], &sc);
            }
            if (lid == 0)
                for (long k = 4 * vstop; k < stop; ++k)
                    p[k] = p[k] - step * lamb_direction_v1(p[k], m[k], v[k], &sc);
        } else {
            for (long k = start + lid; k < stop; k += OPTIRS_WG)
                p[k] = p[k] - step * lamb_direction_v1(p[k], m[k], v[k], &sc);
        }
        (void)g;
    CHUNKS_END
}

/* ---------------------------------------------------------------- Adafactor */

/* Adafactor: one work-group per tensor (t0 + group id), phases separated by barriers: RMS(p), the
 * row and column means of g^2 (one work-item per row and per column, fixed summation order) and
 * their running means, each batch's mean of the row means (into MEAN), RMS(update), then p.
 * table: optirs.core.factored.FactoredLayout.table, 9 longs per tensor; offs[t]: the tensor's
 * element offsets in P and G; the state slots start at s_off in their buffers. */
#define AF_FACTORED 0
#define AF_SIZE 1
#define AF_BATCH 2
#define AF_ROWS 3
#define AF_COLS 4
#define AF_ROW_OFF 5
#define AF_COL_OFF 6
#define AF_VAR_OFF 7
#define AF_BATCH_OFF 8
#define AF_COLUMNS 9

float adafactor_step_size(acc_t p_sumsq, acc_t u_sumsq, long n, const adafactor_scalars *sc)
{
    const acc_t alpha = fmax((acc_t)sc->eps2, sqrt(p_sumsq / (acc_t)n)) * (acc_t)sc->rho;
    return (float)(alpha / fmax((acc_t)1, sqrt(u_sumsq / (acc_t)n) / (acc_t)sc->d));
}

float adafactor_factored_update(__global const float *g, __global const float *row, __global const float *col,
                                __global const float *mean, long i, long rows, long cols,
                                const adafactor_scalars *sc)
{
    const long plane = rows * cols, b = i / plane, rem = i - b * plane, r = rem / cols, c = rem - r * cols;
    return adafactor_factored_direction_v1(adafactor_grad_v1(g[i], sc), row[b * rows + r], col[b * cols + c],
                                           mean[b], sc);
}

/* Every barrier is reached by the whole work-group: branches hold loops only (PoCL compiles
 * barriers in uniform top-level code). */
__kernel __attribute__((reqd_work_group_size(OPTIRS_WG, 1, 1)))
void adafactor_step(__global float *P, __global const float *G, __global float *ROW, __global float *COL,
                    __global float *VAR, __global float *MEAN, ulong s_off, __global const long *table,
                    __global const long2 *offs, uint t0, const adafactor_scalars sc)
{
    __local acc_t scratch[OPTIRS_WG];
    const uint t = t0 + get_group_id(0);
    const long lid = get_local_id(0);
    __global const long *info = table + (size_t)t * AF_COLUMNS;
    const long n = info[AF_SIZE];
    const int factored = n > 0 && info[AF_FACTORED]; /* an empty tensor keeps its (zero) state */
    const long batches = info[AF_BATCH], rows = info[AF_ROWS], cols = info[AF_COLS];
    __global float *p = P + offs[t].x;
    __global const float *g = G + offs[t].y;
    __global float *row = ROW + s_off + info[AF_ROW_OFF], *col = COL + s_off + info[AF_COL_OFF];
    __global float *var = VAR + s_off + info[AF_VAR_OFF];
    __global float *mean = MEAN + info[AF_BATCH_OFF];

    acc_t s = 0;
    for (long i = lid; i < n; i += OPTIRS_WG)
        s += (acc_t)(p[i] * p[i]);
    const acc_t p_sumsq = group_sum(s, scratch);

    acc_t u_sumsq = 0;
    if (factored) {
        for (long k = lid; k < batches * rows; k += OPTIRS_WG) {
            __global const float *gr = g + k * cols;
            acc_t sum = 0;
            for (long c = 0; c < cols; ++c) {
                const float x = adafactor_grad_v1(gr[c], &sc);
                sum += (acc_t)(x * x);
            }
            row[k] = adafactor_running_mean_v1(row[k], (float)(sum / (acc_t)cols), &sc);
        }
        for (long k = lid; k < batches * cols; k += OPTIRS_WG) {
            const long b = k / cols;
            __global const float *gc = g + b * rows * cols + (k - b * cols);
            acc_t sum = 0;
            for (long r = 0; r < rows; ++r) {
                const float x = adafactor_grad_v1(gc[r * cols], &sc);
                sum += (acc_t)(x * x);
            }
            col[k] = adafactor_running_mean_v1(col[k], (float)(sum / (acc_t)rows), &sc);
        }
    } else {
        for (long i = lid; i < n; i += OPTIRS_WG) { /* each work-item reads back only what it wrote */
            const float x = adafactor_grad_v1(g[i], &sc);
            const float v = adafactor_running_mean_v1(var[i], x * x, &sc);
            var[i] = v;
            const float u = adafactor_direction_v1(x, v, &sc);
            u_sumsq += SQUARE(u);
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (factored)
        for (long k = lid; k < batches; k += OPTIRS_WG) {
            acc_t sum = 0;
            for (long r = 0; r < rows; ++r)
                sum += (acc_t)row[k * rows + r];
            mean[k] = (float)(sum / (acc_t)rows);
        }
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (factored)
        for (long i = lid; i < n; i += OPTIRS_WG) {
            const float u = adafactor_factored_update(g, row, col, mean, i, rows, cols, &sc);
            u_sumsq += SQUARE(u);
        }
    u_sumsq = group_sum(u_sumsq, scratch);
    const float step = n > 0 ? adafactor_step_size(p_sumsq, u_sumsq, n, &sc) : 0.0f;
    if (factored)
        for (long i = lid; i < n; i += OPTIRS_WG)
            p[i] = adafactor_apply_v1(p[i], adafactor_factored_update(g, row, col, mean, i, rows, cols, &sc), step, &sc);
    else
        for (long i = lid; i < n; i += OPTIRS_WG)
            p[i] = adafactor_apply_v1(p[i], adafactor_direction_v1(adafactor_grad_v1(g[i], &sc), var[i], &sc), step, &sc);
}
