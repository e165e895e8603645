"""The cuda backend's Adafactor kernel (imported on the first Adafactor step: imports numba.cuda).

One launch steps the whole model, one block per tensor (grid-stride over the tensor table), in
phases separated by ``syncthreads``: RMS(p) (a block sum), the row and column means of g^2
(one thread per row and per column, each summing in a fixed order) and their running means,
the mean of the row means per batch, RMS(update) (a block sum), then p. Sums are float64 and in
a fixed order per launch size, so a run is reproducible bit for bit; the per-element math is
float32 (optirs.backends.common.elementwise). A block per tensor keeps the reductions free of
atomics and inter-block traffic; it leaves a single large tensor to one SM, which is the price of
that simplicity (Adafactor here aims at exactness before speed).

Memory is reached through raw addresses with the primitives of optirs.backends.cuda.kernels, so
parameters may be separate allocations (pointer table) and the kernel runs unchanged under the
simulator.
"""

from __future__ import annotations

import math

from numba import cuda, float64

from optirs.backends.common.elementwise import (adafactor_apply, adafactor_direction, adafactor_factored_direction,
                                                adafactor_grad, adafactor_running_mean)
from optirs.backends.cuda.kernels import _F32, _device, ld, st
from optirs.core.factored import BATCH, BATCH_OFF, COL_OFF, COLS, FACTORED, ROW_OFF, ROWS, SIZE, VAR_OFF


# Its own copy of the block reduction beside kernels._block_add: a device function that reads
# ``cuda.threadIdx`` must live in the kernel's module, since numba's simulator swaps the ``cuda``
# global of that module only (one shared helper in kernels.py failed every simulated Adafactor step).
@_device
def _block_sum(value):
    """The sum of ``value`` over the block (shared-memory tree, any block size up to 1024), in every thread."""
    partial = cuda.shared.array(1024, float64)
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    partial[tid] = value
    cuda.syncthreads()
    stride = 1
    while stride < n:
        stride <<= 1
    stride >>= 1
    while stride > 0:
        if tid < stride and tid + stride < n:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()
        stride >>= 1
    total = partial[0]
    cuda.syncthreads()  # the array is reused by the next sum
    return total


@_device
def _step_size(p_sumsq, u_sumsq, n, sc):
    """alpha / clip of one tensor (float64, once per tensor): max(eps2, RMS(p)) * rho / max(1, RMS(u) / d)."""
    alpha = max(float64(sc.eps2), math.sqrt(p_sumsq / n)) * float64(sc.rho)
    return _F32(alpha / max(1.0, math.sqrt(u_sumsq / n) / float64(sc.d)))


@_device
def _factored_update(ga, ra, ca, ma, i, rows, cols, sc):
    """The update of element i of a factored tensor, from its row, column and batch row-mean."""
    plane = rows * cols
    b = i // plane
    rem = i - b * plane
    r = rem // cols
    c = rem - r * cols
    return adafactor_factored_direction(adafactor_grad(ld(ga + (i << 2)), sc), ld(ra + ((b * rows + r) << 2)),
                                        ld(ca + ((b * cols + c) << 2)), ld(ma + (b << 2)), sc)


def adafactor_step(table, ptrs, ntensors, row_base, col_base, var_base, mean_base, sc):
    """The whole model's step; ``*_base`` are the state slots' and the row-mean scratch's addresses."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    t = cuda.blockIdx.x
    while t < ntensors:
        n = table[t, SIZE]
        if n > 0:  # the same for the whole block, so the syncthreads below are reached by all
            pa = ptrs[t, 0]
            ga = ptrs[t, 1]
            s = 0.0
            i = tid
            while i < n:
                x = ld(pa + (i << 2))
                s += float64(x * x)
                i += nthreads
            p_sumsq = _block_sum(s)
            if table[t, FACTORED] == 1:
                batches = table[t, BATCH]
                rows = table[t, ROWS]
                cols = table[t, COLS]
                ra = row_base + (table[t, ROW_OFF] << 2)
                ca = col_base + (table[t, COL_OFF] << 2)
                ma = mean_base + (table[t, BATCH_OFF] << 2)
                k = tid
                while k < batches * rows:  # one thread per row: mean of g^2 along the last dim
                    base = ga + ((k * cols) << 2)
                    s = 0.0
                    for c in range(cols):
                        x = adafactor_grad(ld(base + (c << 2)), sc)
                        s += float64(x * x)
                    st(ra + (k << 2), adafactor_running_mean(ld(ra + (k << 2)), _F32(s / cols), sc))
                    k += nthreads
                k = tid
                while k < batches * cols:  # one thread per column: mean of g^2 along dim -2
                    b = k // cols
                    base = ga + ((b * rows * cols + (k - b * cols)) << 2)
                    s = 0.0
                    for r in range(rows):
                        x = adafactor_grad(ld(base + ((r * cols) << 2)), sc)
                        s += float64(x * x)
                    st(ca + (k << 2), adafactor_running_mean(ld(ca + (k << 2)), _F32(s / rows), sc))
                    k += nthreads
                cuda.syncthreads()
                k = tid
                while k < batches:  # the mean of each batch's row means
                    s = 0.0
                    for r in range(rows):
                        s += float64(ld(ra + ((k * rows + r) << 2)))
                    st(ma + (k << 2), _F32(s / rows))
                    k += nthreads
                cuda.syncthreads()
                s = 0.0
                i = tid
                while i < n:
                    u = _factored_update(ga, ra, ca, ma, i, rows, cols, sc)
                    s += float64(u * u)
                    i += nthreads
                step = _step_size(p_sumsq, _block_sum(s), n, sc)
                i = tid
                while i < n:
                    u = _factored_update(ga, ra, ca, ma, i, rows, cols, sc)
                    st(pa + (i << 2), adafactor_apply(ld(pa + (i << 2)), u, step, sc))
                    i += nthreads
            else:
                va = var_base + (table[t, VAR_OFF] << 2)
                s = 0.0
                i = tid
                while i < n:  # each thread writes and later reads only its own elements
                    x = adafactor_grad(ld(ga + (i << 2)), sc)
                    v = adafactor_running_mean(ld(va + (i << 2)), x * x, sc)
                    st(va + (i << 2), v)
                    u = adafactor_direction(x, v, sc)
                    s += float64(u * u)
                    i += nthreads
                step = _step_size(p_sumsq, _block_sum(s), n, sc)
                i = tid
                while i < n:
                    u = adafactor_direction(adafactor_grad(ld(ga + (i << 2)), sc), ld(va + (i << 2)), sc)
                    st(pa + (i << 2), adafactor_apply(ld(pa + (i << 2)), u, step, sc))
                    i += nthreads
        cuda.syncthreads()
        t += cuda.gridDim.x


def argument_types(scalars):
    """The numba types of adafactor_step's arguments for this scalars record."""
    import numba
    from numba import types

    table = types.int64[:, ::1]
    return (table, table, types.int64, types.int64, types.int64, types.int64, types.int64, numba.typeof(scalars))
