"""The ``sparse`` capability of the numpy example backend: row-sparse Adam and SGD in numpy.

A third party implements the three hooks of ``CAPABILITIES["sparse"]``; optirs.optim.sparse
(SparseAdam, SparseSgd) then runs on it. Everything here is host numpy, float32 throughout (the
scalar records are numpy float32, so no arithmetic is promoted).
"""

import numpy as np
from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import Staged, hookimpl


@hookimpl
def optirs_sparse_stage(tables, values):
    for what, arrays in (("params", tables), ("values", values)):
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise InvalidParameterError(f"{what}[{i}] is a {type(a).__name__}, expected a numpy array "
                                            "on the numpy backend")
    return Staged(list(tables), list(values))


def _segment_sums(grad, dim):
    """Each touched row's gradient: its segment's value rows summed in the order given."""
    starts, lengths = grad.segments[:-1], np.diff(grad.segments)
    sums = grad.values[grad.order[starts]].reshape(-1, dim).copy()
    for extra in range(1, int(lengths.max()) if lengths.size else 0):
        more = lengths > extra
        sums[more] += grad.values[grad.order[starts[more] + extra]]
    return sums


def _rows(table, slot):
    return table.state[slot].reshape(table.num_rows, table.dim)


def _adam(p, g, m, v, sc):
    m = sc.beta1 * m + sc.one_minus_beta1 * g
    v = sc.beta2 * v + sc.one_minus_beta2 * g * g
    return p - sc.step_size * m / (np.sqrt(v) / sc.bias_correction2_sqrt + sc.eps), m, v


@hookimpl
def optirs_sparse_adam_step(table, grad, scalars, dense_decay):
    # SparseAdam has no weight decay; row_position (dense decay) is not needed here and stays -1.
    p, m, v = table.param, _rows(table, "exp_avg"), _rows(table, "exp_avg_sq")
    g = _segment_sums(grad, table.dim)
    if dense_decay:
        dense = np.zeros_like(p)
        dense[grad.rows] = g
        p[...], m[...], v[...] = _adam(p, dense, m, v, scalars)
    else:
        r = grad.rows
        p[r], m[r], v[r] = _adam(p[r], g, m[r], v[r], scalars)


def _sgd(p, g, buf, first, sc):
    """p, buf after one SGD step; ``first`` (bool per row, or a scalar) starts the buffer at g."""
    if sc.weight_decay != 0:  # as torch: no decay term without decay
        g = g + sc.weight_decay * p
    if sc.has_momentum:
        buf = np.where(first, g, sc.momentum * buf + sc.dampening_factor * g)
        g = g + sc.momentum * buf if sc.nesterov else buf
    return p - sc.lr * g, buf


@hookimpl
def optirs_sparse_sgd_step(table, grad, scalars, first_scalars, dense_decay):
    p, r = table.param, grad.rows
    g = _segment_sums(grad, table.dim)
    buf = _rows(table, "momentum_buffer") if scalars.has_momentum else None
    if dense_decay:
        dense = np.zeros_like(p)
        dense[r] = g
        new_p, new_buf = _sgd(p, dense, buf, scalars.first_step, scalars)
        p[...] = new_p
        if buf is not None:
            buf[...] = new_buf
        return
    if buf is None:
        p[r], _ = _sgd(p[r], g, None, False, scalars)
        return
    seen = table.state["row_seen"]
    p[r], buf[r] = _sgd(p[r], g, buf[r], (seen[r] == 0)[:, None], scalars)
    seen[r] = 1
