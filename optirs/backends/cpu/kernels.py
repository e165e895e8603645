"""The CPU backend's compiled loops (imported when the backend opens: this imports numba).

Each kernel runs one parallel loop over the chunk table (tensor, start, stop). A chunk takes
plain slices of its tensor and of the flat state buffers and runs a simple counted loop that
calls the per-element function from :mod:`optirs.backends.common.elementwise`; written this way (flags
tested outside the loop, IEEE division via ``error_model="numpy"``) LLVM vectorizes it.
Parameters and gradients are numba typed lists of 1-D views.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.typed import List

from optirs.backends.common.elementwise import (adagrad_update, adam_update, clip_scale, lamb_direction, lamb_moments,
                          lamb_trust_ratio, rmsprop_update, sgd_update)

jit = njit(parallel=True, cache=True, error_model="numpy")


def typed_list(arrays):
    out = List()
    for a in arrays:
        out.append(a)
    return out


@jit
def adam(ps, gs, m, v, vmax, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, g, mc, vc = ps[t][s:e], gs[t][s:e], m[o : o + e - s], v[o : o + e - s]
        if sc.amsgrad:
            xc = vmax[o : o + e - s]
            for i in range(e - s):
                p[i], mc[i], vc[i], xc[i] = adam_update(p[i], g[i], mc[i], vc[i], xc[i], sc)
        else:
            for i in range(e - s):
                p[i], mc[i], vc[i], _ = adam_update(p[i], g[i], mc[i], vc[i], vc[i], sc)


@jit
def sgd(ps, gs, buf, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, g = ps[t][s:e], gs[t][s:e]
        if sc.has_momentum:
            b = buf[o : o + e - s]
            for i in range(e - s):
                p[i], b[i] = sgd_update(p[i], g[i], b[i], sc)
        else:
            for i in range(e - s):
                p[i], _ = sgd_update(p[i], g[i], g[i], sc)


@jit
def rmsprop(ps, gs, square_avg, buf, grad_avg, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, g, sq = ps[t][s:e], gs[t][s:e], square_avg[o : o + e - s]
        # Unused slots alias square_avg and are never written back.
        b = buf[o : o + e - s] if sc.has_momentum else sq
        a = grad_avg[o : o + e - s] if sc.centered else sq
        if sc.has_momentum and sc.centered:
            for i in range(e - s):
                p[i], sq[i], b[i], a[i] = rmsprop_update(p[i], g[i], sq[i], b[i], a[i], sc)
        elif sc.has_momentum:
            for i in range(e - s):
                p[i], sq[i], b[i], _ = rmsprop_update(p[i], g[i], sq[i], b[i], sq[i], sc)
        elif sc.centered:
            for i in range(e - s):
                p[i], sq[i], _, a[i] = rmsprop_update(p[i], g[i], sq[i], sq[i], a[i], sc)
        else:
            for i in range(e - s):
                p[i], sq[i], _, _ = rmsprop_update(p[i], g[i], sq[i], sq[i], sq[i], sc)


@jit
def adagrad(ps, gs, acc, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, g, a = ps[t][s:e], gs[t][s:e], acc[o : o + e - s]
        for i in range(e - s):
            p[i], a[i] = adagrad_update(p[i], g[i], a[i], sc)


# Sums of squares for LAMB's norms, in float64. ``reassoc`` lets LLVM split the sum over vector
# lanes; it applies to this function's additions only (the inlined element math keeps IEEE order).
_sum_jit = njit(cache=True, error_model="numpy", fastmath={"reassoc"})


@_sum_jit
def _sum_squares(x):
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i] * x[i])
    return total


@_sum_jit
def _sum_squared_directions(p, m, v, sc):
    total = 0.0
    for i in range(p.shape[0]):
        u = lamb_direction(p[i], m[i], v[i], sc)
        total += np.float64(u * u)
    return total


@jit
def _global_grad_norm(gs, chunk_tensor, chunk_start, chunk_stop):
    partial = np.zeros(chunk_tensor.shape[0], dtype=np.float64)
    for c in prange(chunk_tensor.shape[0]):
        partial[c] = _sum_squares(gs[chunk_tensor[c]][chunk_start[c] : chunk_stop[c]])
    return np.sqrt(partial.sum())


@jit
def lamb(ps, gs, m, v, offsets, chunk_tensor, chunk_start, chunk_stop, ntensors, sc):
    nchunks = chunk_tensor.shape[0]
    grad_scale = np.float32(1.0)
    if sc.max_grad_norm > 0:
        norm = _global_grad_norm(gs, chunk_tensor, chunk_start, chunk_stop)
        grad_scale = np.float32(clip_scale(norm, np.float64(sc.max_grad_norm)))
    # Pass 1: moments, then the chunk's sums of p^2 and u^2 (float64) while it is in cache.
    p_sq = np.zeros(nchunks, dtype=np.float64)
    u_sq = np.zeros(nchunks, dtype=np.float64)
    for c in prange(nchunks):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, g, mc, vc = ps[t][s:e], gs[t][s:e], m[o : o + e - s], v[o : o + e - s]
        for i in range(e - s):
            mc[i], vc[i] = lamb_moments(g[i], mc[i], vc[i], grad_scale, sc)
        p_sq[c] = _sum_squares(p)
        u_sq[c] = _sum_squared_directions(p, mc, vc, sc)
    # Per-tensor trust ratios.
    pn = np.zeros(ntensors, dtype=np.float64)
    un = np.zeros(ntensors, dtype=np.float64)
    for c in range(nchunks):
        pn[chunk_tensor[c]] += p_sq[c]
        un[chunk_tensor[c]] += u_sq[c]
    ratio = np.empty(ntensors, dtype=np.float32)
    for t in range(ntensors):
        ratio[t] = np.float32(lamb_trust_ratio(np.sqrt(pn[t]), np.sqrt(un[t]), np.float64(sc.max_trust_ratio)))
    # Pass 2: apply; u is recomputed from the same float32 inputs, so it is the same value.
    for c in prange(nchunks):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, mc, vc = ps[t][s:e], m[o : o + e - s], v[o : o + e - s]
        step = sc.lr * ratio[t]
        for i in range(e - s):
            p[i] = p[i] - step * lamb_direction(p[i], mc[i], vc[i], sc)


from optirs.backends.common.elementwise import lion_update  # noqa: E402  (appended optimizer)


@jit
def lion(ps, gs, m, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        o = offsets[t] + s
        p, g, mc = ps[t][s:e], gs[t][s:e], m[o : o + e - s]
        for i in range(e - s):
            p[i], mc[i] = lion_update(p[i], g[i], mc[i], sc)
