"""The cuda backend's row-sparse kernels (numba.cuda), launched by :mod:`optirs.backends.cuda.sparse`.

One thread per (row, column) element: consecutive threads read consecutive columns of a row, so
loads and stores coalesce. The segment sum is the shared numba function of
:mod:`optirs.backends.common.sparse_rows` and the optimizer math
:mod:`optirs.backends.common.elementwise`, called as device functions.

The kernel bodies are module-level functions so numba's CUDA simulator can patch the ``cuda``
global they read; the simulator's arrays cannot enter compiled code, so there the kernels call
the segment sum's Python source instead (``kernels()`` chooses once).
"""

from __future__ import annotations

from numba import cuda, float32

from optirs.backends.common.elementwise import adam_update, sgd_update
from optirs.backends.common.sparse_rows import gathered_grad
from optirs.backends.cuda.kernel_cache import jit as cached_jit
from optirs.core.simulator import cuda_simulator_enabled

# 256 threads is a full-occupancy block size on every sm_70+ GPU for kernels this small.
BLOCK = 256

segment_grad = gathered_grad


def scatter_positions(pos, rows, clear):
    k = cuda.grid(1)
    if k < rows.shape[0]:
        pos[rows[k]] = -1 if clear else k


def mark_seen(seen, rows):
    k = cuda.grid(1)
    if k < rows.shape[0]:
        seen[rows[k]] = 1


def adam_lazy(p, m, v, rows, seg, order, values, sc):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < rows.shape[0] * dim:
        k = i // dim
        j = i - k * dim
        r = rows[k]
        g = segment_grad(values, order, seg[k], seg[k + 1], j)
        p[r, j], m[r, j], v[r, j], _ = adam_update(p[r, j], g, m[r, j], v[r, j], v[r, j], sc)


def adam_dense(p, m, v, pos, seg, order, values, sc):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < p.shape[0] * dim:
        r = i // dim
        j = i - r * dim
        k = pos[r]
        g = float32(0.0)
        if k >= 0:
            g = segment_grad(values, order, seg[k], seg[k + 1], j)
        p[r, j], m[r, j], v[r, j], _ = adam_update(p[r, j], g, m[r, j], v[r, j], v[r, j], sc)


def sgd_lazy(p, buf, seen, rows, seg, order, values, sc, sc_first):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < rows.shape[0] * dim:
        k = i // dim
        j = i - k * dim
        r = rows[k]
        g = segment_grad(values, order, seg[k], seg[k + 1], j)
        if sc.has_momentum:
            # ``seen`` is set by mark_seen after this launch: every thread of the row reads
            # the same value here.
            if seen[r] == 0:
                p[r, j], buf[r, j] = sgd_update(p[r, j], g, buf[r, j], sc_first)
            else:
                p[r, j], buf[r, j] = sgd_update(p[r, j], g, buf[r, j], sc)
        else:
            p[r, j], _ = sgd_update(p[r, j], g, g, sc)


def sgd_dense(p, buf, pos, seg, order, values, sc):
    i = cuda.grid(1)
    dim = p.shape[1]
    if i < p.shape[0] * dim:
        r = i // dim
        j = i - r * dim
        k = pos[r]
        g = float32(0.0)
        if k >= 0:
            g = segment_grad(values, order, seg[k], seg[k + 1], j)
        if sc.has_momentum:
            p[r, j], buf[r, j] = sgd_update(p[r, j], g, buf[r, j], sc)
        else:
            p[r, j], _ = sgd_update(p[r, j], g, g, sc)


KERNELS = (scatter_positions, mark_seen, adam_lazy, adam_dense, sgd_lazy, sgd_dense)
_COMPILED = None


def kernels():
    """The kernels by name, compiled on first use (numba.cuda.jit; the simulator runs the same code)."""
    global _COMPILED, segment_grad
    if _COMPILED is None:
        segment_grad = gathered_grad.py_func if cuda_simulator_enabled() else gathered_grad
        _COMPILED = {fn.__name__: cached_jit(fn, f"sparse.{fn.__name__}") for fn in KERNELS}
    return _COMPILED


def grid(items: int) -> int:
    return max(1, (int(items) + BLOCK - 1) // BLOCK)
