"""Kernels of the sparse optimizers (:mod:`optirs.optim.sparse`) for cpu, cuda and opencl.

A row-sparse gradient reaches a kernel as four arrays:

- ``rows``: the touched table rows, sorted and unique (int64, ``n``);
- ``seg``: ``n + 1`` offsets; the k-th touched row receives the sum of the gradient rows
  ``values[order[seg[k]]], ..., values[order[seg[k + 1] - 1]]`` (duplicates summed in the order
  they were given);
- ``order``: indices into ``values``' rows (int64, ``nnz``);
- ``values``: the gradient rows, float32 ``(nnz, dim)``.

The lazy kernels run over the ``n * dim`` touched elements only. The dense-decay kernels run over
the whole table and look a row's gradient up in ``pos`` (``pos[row] = k``, or -1 for a row with
no gradient, whose gradient is zero); ``pos`` is scattered before and cleared after the step, so
it costs O(n), not O(num_rows).

The per-element optimizer math is the shared numba code of :mod:`optirs.backends.common.elementwise`
(CPU and CUDA); the OpenCL C below is its one OpenCL transcription for these kernels.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, njit, prange

from optirs.backends.common.elementwise import adam_update, sgd_update


@njit(cache=True)
def gathered_grad(values, order, start, stop, j):
    """Column ``j`` of the summed gradient rows ``order[start:stop]`` (a non-empty segment)."""
    g = values[order[start], j]
    for q in range(start + 1, stop):
        g += values[order[q], j]
    return g


# ---------------------------------------------------------------- cpu (numba.njit parallel)


@njit(cache=True)
def row_gradient(values, order, start, stop):
    """The summed gradient row of one segment: a view when it has one contribution (the common
    case), else a new row summed in the given order (the same order as gathered_grad)."""
    g = values[order[start]]
    if stop - start == 1:
        return g
    acc = g.copy()
    for q in range(start + 1, stop):
        acc += values[order[q]]
    return acc


# The loops go row by row with the row's gradient fetched once, so the column loop is a plain
# strided-free loop numba vectorizes (a per-element segment loop there is ~50x slower).


@njit(parallel=True, cache=True)
def cpu_scatter_pos(pos, rows, clear):
    for k in prange(rows.shape[0]):
        pos[rows[k]] = -1 if clear else k


@njit(parallel=True, cache=True)
def cpu_adam_lazy(p, m, v, rows, seg, order, values, sc):
    for k in prange(rows.shape[0]):
        r = rows[k]
        g = row_gradient(values, order, seg[k], seg[k + 1])
        pr, mr, vr = p[r], m[r], v[r]
        for j in range(pr.shape[0]):
            pr[j], mr[j], vr[j], _ = adam_update(pr[j], g[j], mr[j], vr[j], vr[j], sc)


@njit(parallel=True, cache=True)
def cpu_adam_dense(p, m, v, pos, seg, order, values, sc):
    zeros = np.zeros(p.shape[1], np.float32)
    for r in prange(p.shape[0]):
        k = pos[r]
        g = zeros if k < 0 else row_gradient(values, order, seg[k], seg[k + 1])
        pr, mr, vr = p[r], m[r], v[r]
        for j in range(pr.shape[0]):
            pr[j], mr[j], vr[j], _ = adam_update(pr[j], g[j], mr[j], vr[j], vr[j], sc)


@njit(parallel=True, cache=True)
def cpu_sgd_lazy(p, buf, seen, rows, seg, order, values, sc, sc_first):
    # A row's momentum buffer starts at its gradient the first time the row is present
    # (torch's first-step rule, applied per row).
    for k in prange(rows.shape[0]):
        r = rows[k]
        g = row_gradient(values, order, seg[k], seg[k + 1])
        pr = p[r]
        if sc.has_momentum:
            rsc = sc_first if seen[r] == 0 else sc
            br = buf[r]
            for j in range(pr.shape[0]):
                pr[j], br[j] = sgd_update(pr[j], g[j], br[j], rsc)
            seen[r] = 1
        else:
            for j in range(pr.shape[0]):
                pr[j], _ = sgd_update(pr[j], g[j], g[j], sc)


@njit(parallel=True, cache=True)
def cpu_sgd_dense(p, buf, pos, seg, order, values, sc):
    zeros = np.zeros(p.shape[1], np.float32)
    for r in prange(p.shape[0]):
        k = pos[r]
        g = zeros if k < 0 else row_gradient(values, order, seg[k], seg[k + 1])
        pr = p[r]
        if sc.has_momentum:
            br = buf[r]
            for j in range(pr.shape[0]):
                pr[j], br[j] = sgd_update(pr[j], g[j], br[j], sc)
        else:
            for j in range(pr.shape[0]):
                pr[j], _ = sgd_update(pr[j], g[j], g[j], sc)


CPU = {
    "scatter_pos": cpu_scatter_pos,
    "adam_lazy": cpu_adam_lazy,
    "adam_dense": cpu_adam_dense,
    "sgd_lazy": cpu_sgd_lazy,
    "sgd_dense": cpu_sgd_dense,
}


# ---------------------------------------------------------------- cuda (numba.cuda)

_CUDA = None

# One thread per (row, column) element: consecutive threads read consecutive columns of a row,
# so loads and stores coalesce; 256 threads is a full-occupancy block size on every sm_70+ GPU
# for kernels this small.
CUDA_BLOCK = 256


# The kernel bodies are module-level functions so numba's CUDA simulator can patch the ``cuda``
# global they read. They call the njit helper as a device function; the simulator's arrays cannot
# enter compiled code, so there it calls the helper's Python source instead.
cuda_gathered_grad = gathered_grad


def cuda_scatter_pos(pos, rows, clear):
    k = cuda.grid(1)
    if k < rows.shape[0]:
        pos[rows[k]] = -1 if clear else k


def cuda_adam_lazy(p, m, v, rows, seg, order, values, sc):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < rows.shape[0] * dim:
        k = i // dim
        j = i - k * dim
        r = rows[k]
        g = cuda_gathered_grad(values, order, seg[k], seg[k + 1], j)
        p[r, j], m[r, j], v[r, j], _ = adam_update(p[r, j], g, m[r, j], v[r, j], v[r, j], sc)


def cuda_adam_dense(p, m, v, pos, seg, order, values, sc):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < p.shape[0] * dim:
        r = i // dim
        j = i - r * dim
        k = pos[r]
        g = float32(0.0)
        if k >= 0:
            g = cuda_gathered_grad(values, order, seg[k], seg[k + 1], j)
        p[r, j], m[r, j], v[r, j], _ = adam_update(p[r, j], g, m[r, j], v[r, j], v[r, j], sc)


def cuda_sgd_lazy(p, buf, seen, rows, seg, order, values, sc, sc_first):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < rows.shape[0] * dim:
        k = i // dim
        j = i - k * dim
        r = rows[k]
        g = cuda_gathered_grad(values, order, seg[k], seg[k + 1], j)
        if sc.has_momentum:
            # ``seen`` is set by mark_seen after this launch: every thread of the row reads
            # the same value here.
            if seen[r] == 0:
                p[r, j], buf[r, j] = sgd_update(p[r, j], g, buf[r, j], sc_first)
            else:
                p[r, j], buf[r, j] = sgd_update(p[r, j], g, buf[r, j], sc)
        else:
            p[r, j], _ = sgd_update(p[r, j], g, g, sc)


def cuda_mark_seen(seen, rows):
    k = cuda.grid(1)
    if k < rows.shape[0]:
        seen[rows[k]] = 1


def cuda_sgd_dense(p, buf, pos, seg, order, values, sc):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < p.shape[0] * dim:
        r = i // dim
        j = i - r * dim
        k = pos[r]
        g = float32(0.0)
        if k >= 0:
            g = cuda_gathered_grad(values, order, seg[k], seg[k + 1], j)
        if sc.has_momentum:
            p[r, j], buf[r, j] = sgd_update(p[r, j], g, buf[r, j], sc)
        else:
            p[r, j], _ = sgd_update(p[r, j], g, g, sc)


def cuda_kernels():
    """The CUDA kernels, compiled on first use (numba.cuda.jit; the simulator runs the same code)."""
    global _CUDA, cuda_gathered_grad
    if _CUDA is None:
        from numba.core import config

        cuda_gathered_grad = gathered_grad.py_func if config.ENABLE_CUDASIM else gathered_grad
        kernels = (cuda_scatter_pos, cuda_adam_lazy, cuda_adam_dense, cuda_sgd_lazy, cuda_mark_seen, cuda_sgd_dense)
        _CUDA = {fn.__name__[len("cuda_"):]: cuda.jit(fn) for fn in kernels}
    return _CUDA


def cuda_grid(items: int) -> int:
    return max(1, (int(items) + CUDA_BLOCK - 1) // CUDA_BLOCK)


# ---------------------------------------------------------------- opencl (OpenCL C)

# One work item per (row, column) element, as on CUDA. The per-element math is the opencl
# backend's header (optirs/backends/common/kernels/optirs_elementwise.h, the OpenCL transcription of
# optirs.backends.common.elementwise), included here with T = float; the scalar records are its structs,
# passed by value.
OPENCL_KERNELS = r"""
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
"""


def opencl_source() -> str:
    """The sparse kernels with the shared scalar structs and per-element math inlined."""
    import importlib.resources

    root = importlib.resources.files("optirs.backends.common") / "kernels"
    header = (root / "optirs_scalars.h").read_text(encoding="utf-8")
    elementwise = (root / "optirs_elementwise.h").read_text(encoding="utf-8")
    return "\n".join([
        "#pragma OPENCL FP_CONTRACT OFF /* same rounding as the numba kernels */",
        header,
        "#define FN_PASTE(a, b) a##_##b",
        "#define FN_EXPAND(a, b) FN_PASTE(a, b)",
        "#define FN(name) FN_EXPAND(name, SUFFIX)",
        "#define T float",
        "#define SUFFIX v1",
        elementwise,
        "#undef T",
        "#undef SUFFIX",
        OPENCL_KERNELS,
    ])


def opencl_record(scalars) -> np.ndarray:
    """An optirs.core.scalars record as the numpy struct matching optirs_scalars.h (float32 -> f4, bool -> i4)."""
    dtype = np.dtype([(name, "<i4" if isinstance(value, (bool, np.bool_)) else "<f4")
                      for name, value in zip(scalars._fields, scalars)])
    return np.array(tuple(scalars), dtype)
