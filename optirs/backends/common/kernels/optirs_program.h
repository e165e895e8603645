/* What every optirs step program shares: the build's sizes (the host defines them), the norms'
 * accumulator type and its work-group sum, and FN(name), the suffixed name of a function of
 * optirs_elementwise.h. */
#ifndef OPTIRS_PROGRAM_H
#define OPTIRS_PROGRAM_H

#ifndef OPTIRS_WG
#define OPTIRS_WG 256
#endif
#ifndef OPTIRS_CHUNK
#define OPTIRS_CHUNK 8192
#endif

#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double acc_t; /* norms accumulate squares in float64, like the CPU backend */
#else
typedef float acc_t;
#endif

#define FN_PASTE(a, b) a##_##b
#define FN_EXPAND(a, b) FN_PASTE(a, b)
#define FN(name) FN_EXPAND(name, SUFFIX)

/* Sum of x over the work-group, returned to every work-item. */
acc_t group_sum(acc_t x, __local acc_t *scratch)
{
    const uint lid = get_local_id(0);
    scratch[lid] = x;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint width = OPTIRS_WG / 2; width > 0; width /= 2) {
        if (lid < width)
            scratch[lid] += scratch[lid + width];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const acc_t total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE); /* scratch may be reused right after */
    return total;
}

/* LAMB's pass 1 (float32 and formats programs): a chunk's sums of p^2 and u^2 over the work-group,
 * stored as partial[2c] and partial[2c + 1]. Called by the whole work-group (barriers). */
void store_norm_partials(acc_t sp, acc_t su, __local acc_t *scratch, __global acc_t *partial, size_t c)
{
    sp = group_sum(sp, scratch);
    su = group_sum(su, scratch);
    if (get_local_id(0) == 0) {
        partial[2 * c] = sp;
        partial[2 * c + 1] = su;
    }
}

/* x^2 in the accumulator's type: widened before squaring (as the CPU and CUDA backends), so
 * |x| >= 1.8e19, whose float32 square overflows, still gives a finite norm. */
#define SQUARE(x) ((acc_t)(x) * (acc_t)(x))

#endif
