"""The cpu backend's Adafactor loop (numba; imported on the first Adafactor step).

Every reduction Adafactor needs is per tensor (RMS of p, the row and column means of g^2, the
mean of the row means, RMS of the update), so one parallel loop over the tensors does each
tensor's whole step: its sums in a fixed order (float64, so a run is reproducible bit for bit),
the per-element math from optirs.backends.common.elementwise in float32.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from optirs.backends.common.elementwise import (adafactor_apply, adafactor_direction, adafactor_factored_direction,
                                                adafactor_grad, adafactor_running_mean)
from optirs.core.compile_cache import cached_njit
from optirs.core.factored import BATCH, COL_OFF, COLS, FACTORED, ROW_OFF, ROWS, SIZE, VAR_OFF

_jit = cached_njit(error_model="numpy")


@_jit
def adafactor_step_size(p_sumsq, u_sumsq, n, sc):
    """alpha / clip of one tensor, in float64: max(eps2, RMS(p)) * rho / max(1, RMS(u) / d)."""
    alpha = max(np.float64(sc.eps2), np.sqrt(p_sumsq / n)) * np.float64(sc.rho)
    return alpha / max(1.0, np.sqrt(u_sumsq / n) / np.float64(sc.d))


@_jit
def _sum_squares(x):
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i] * x[i])
    return total


@_jit
def _factored(p, g, row_var, col_var, n, batches, rows, cols, sc):
    """One 2+ dim tensor: row/col running means, then the update and its RMS, then p."""
    p_sumsq = _sum_squares(p)
    row_mean = np.empty(batches, np.float32)
    col_sum = np.empty(cols, np.float64)
    for b in range(batches):
        col_sum[:] = 0.0
        for r in range(rows):
            base = (b * rows + r) * cols
            row_sum = 0.0
            for c in range(cols):
                x = adafactor_grad(g[base + c], sc)
                sq = np.float64(x * x)
                row_sum += sq
                col_sum[c] += sq
            k = b * rows + r
            row_var[k] = adafactor_running_mean(row_var[k], np.float32(row_sum / cols), sc)
        for c in range(cols):
            k = b * cols + c
            col_var[k] = adafactor_running_mean(col_var[k], np.float32(col_sum[c] / rows), sc)
        total = 0.0
        for r in range(rows):
            total += np.float64(row_var[b * rows + r])
        row_mean[b] = np.float32(total / rows)
    u_sumsq = 0.0
    for b in range(batches):
        for r in range(rows):
            base = (b * rows + r) * cols
            for c in range(cols):
                u = adafactor_factored_direction(adafactor_grad(g[base + c], sc), row_var[b * rows + r],
                                                 col_var[b * cols + c], row_mean[b], sc)
                u_sumsq += np.float64(u * u)
    step = np.float32(adafactor_step_size(p_sumsq, u_sumsq, n, sc))
    for b in range(batches):
        for r in range(rows):
            base = (b * rows + r) * cols
            for c in range(cols):
                u = adafactor_factored_direction(adafactor_grad(g[base + c], sc), row_var[b * rows + r],
                                                 col_var[b * cols + c], row_mean[b], sc)
                p[base + c] = adafactor_apply(p[base + c], u, step, sc)


@_jit
def _unfactored(p, g, variance, n, sc):
    """One 0-1 dim tensor: the full running mean of g^2, the update and its RMS, then p."""
    p_sumsq = _sum_squares(p)
    u_sumsq = 0.0
    for i in range(n):
        x = adafactor_grad(g[i], sc)
        variance[i] = adafactor_running_mean(variance[i], x * x, sc)
        u = adafactor_direction(x, variance[i], sc)
        u_sumsq += np.float64(u * u)
    step = np.float32(adafactor_step_size(p_sumsq, u_sumsq, n, sc))
    for i in range(n):
        p[i] = adafactor_apply(p[i], adafactor_direction(adafactor_grad(g[i], sc), variance[i], sc), step, sc)


@cached_njit(parallel=True, error_model="numpy")
def adafactor(ps, gs, row_var, col_var, variance, table, sc):
    """Every tensor of the model (typed lists of 1-D views), one parallel loop over tensors."""
    for k in prange(table.shape[0]):
        t = np.int64(k)  # prange counts in uint64; typed lists are indexed by int64
        n = table[t, SIZE]
        if n == 0:
            continue
        if table[t, FACTORED] == 1:
            b, r, c = table[t, BATCH], table[t, ROWS], table[t, COLS]
            ro, co = table[t, ROW_OFF], table[t, COL_OFF]
            _factored(ps[t], gs[t], row_var[ro : ro + b * r], col_var[co : co + b * c], n, b, r, c, sc)
        else:
            vo = table[t, VAR_OFF]
            _unfactored(ps[t], gs[t], variance[vo : vo + n], n, sc)
