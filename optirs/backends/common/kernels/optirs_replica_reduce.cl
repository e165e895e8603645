/* optirs replica reduction: dst += a + b + c (the first `count` of them), then / divisor.
 * Each launch folds up to three replicas into dst, in the same left-to-right float order as the
 * cpu and cuda kernels, so N replicas cost about (N + 1) * 4 / 3 passes over memory.
 * Offsets are in elements, so views into a larger buffer reduce in place. */

__kernel void replica_reduce3(__global float *dst, long dst_off,
                              __global const float *a, long a_off,
                              __global const float *b, long b_off,
                              __global const float *c, long c_off,
                              long n, int count, float divisor, int average) {
    for (long i = get_global_id(0); i < n; i += get_global_size(0)) {
        float acc = dst[dst_off + i];
        if (count > 0) acc += a[a_off + i];
        if (count > 1) acc += b[b_off + i];
        if (count > 2) acc += c[c_off + i];
        if (average) acc = acc / divisor;
        dst[dst_off + i] = acc;
    }
}
