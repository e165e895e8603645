"""The cpu backend's row-sparse loops (numba.njit parallel), called by :mod:`optirs.backends.cpu.sparse`.

The loops go row by row with the row's gradient fetched once (``row_gradient``), so the column
loop is a plain strided-free loop numba vectorizes (a per-element segment loop there is ~50x
slower). Imported on the first sparse step, so loading the plugin does not import numba.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from optirs.backends.common.elementwise import adam_update, sgd_update
from optirs.backends.common.sparse_rows import row_gradient
from optirs.core.compile_cache import cached_njit


@cached_njit(parallel=True)
def scatter_positions(pos, rows, clear):
    for k in prange(rows.shape[0]):
        pos[rows[k]] = -1 if clear else k


@cached_njit(parallel=True)
def adam_lazy(p, m, v, rows, seg, order, values, sc):
    for k in prange(rows.shape[0]):
        r = rows[k]
        g = row_gradient(values, order, seg[k], seg[k + 1])
        pr, mr, vr = p[r], m[r], v[r]
        for j in range(pr.shape[0]):
            pr[j], mr[j], vr[j], _ = adam_update(pr[j], g[j], mr[j], vr[j], vr[j], sc)


@cached_njit(parallel=True)
def adam_dense(p, m, v, pos, seg, order, values, sc):
    zeros = np.zeros(p.shape[1], np.float32)
    for r in prange(p.shape[0]):
        k = pos[r]
        g = zeros if k < 0 else row_gradient(values, order, seg[k], seg[k + 1])
        pr, mr, vr = p[r], m[r], v[r]
        for j in range(pr.shape[0]):
            pr[j], mr[j], vr[j], _ = adam_update(pr[j], g[j], mr[j], vr[j], vr[j], sc)


@cached_njit(parallel=True)
def sgd_lazy(p, buf, seen, rows, seg, order, values, sc, sc_first):
    # A row's momentum buffer starts at its gradient the first time the row is present
    # (torch's first-step rule, applied per row); the loop marks the row itself.
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


@cached_njit(parallel=True)
def sgd_dense(p, buf, pos, seg, order, values, sc):
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
