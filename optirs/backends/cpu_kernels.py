"""The CPU backend's compiled loops (imported when the backend opens: this imports numba).

Each kernel runs one parallel loop over the chunk table (tensor, start, stop); the body calls the
per-element function from :mod:`optirs.backends.elementwise`. State buffers are flat, indexed at
the tensor's offset; parameters and gradients are numba typed lists of 1-D views.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.typed import List

from .elementwise import (adagrad_update, adam_update, clip_scale, lamb_direction, lamb_moments,
                          lamb_trust_ratio, rmsprop_update, sgd_update)


def typed_list(arrays):
    out = List()
    for a in arrays:
        out.append(a)
    return out


@njit(parallel=True, cache=True)
def adam(ps, gs, m, v, vmax, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t = chunk_tensor[c]
        p, g, off = ps[t], gs[t], offsets[t]
        for i in range(chunk_start[c], chunk_stop[c]):
            j = off + i
            p[i], m[j], v[j], vm = adam_update(p[i], g[i], m[j], v[j], vmax[j], sc)
            if sc.amsgrad:
                vmax[j] = vm


@njit(parallel=True, cache=True)
def sgd(ps, gs, buf, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t = chunk_tensor[c]
        p, g, off = ps[t], gs[t], offsets[t]
        if sc.has_momentum:
            for i in range(chunk_start[c], chunk_stop[c]):
                p[i], buf[off + i] = sgd_update(p[i], g[i], buf[off + i], sc)
        else:
            for i in range(chunk_start[c], chunk_stop[c]):
                p[i], _ = sgd_update(p[i], g[i], g[i], sc)


@njit(parallel=True, cache=True)
def rmsprop(ps, gs, square_avg, buf, grad_avg, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t = chunk_tensor[c]
        p, g, off = ps[t], gs[t], offsets[t]
        for i in range(chunk_start[c], chunk_stop[c]):
            j = off + i
            b = buf[j] if sc.has_momentum else square_avg[j]
            a = grad_avg[j] if sc.centered else square_avg[j]
            p[i], square_avg[j], b, a = rmsprop_update(p[i], g[i], square_avg[j], b, a, sc)
            if sc.has_momentum:
                buf[j] = b
            if sc.centered:
                grad_avg[j] = a


@njit(parallel=True, cache=True)
def adagrad(ps, gs, acc, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    for c in prange(chunk_tensor.shape[0]):
        t = chunk_tensor[c]
        p, g, off = ps[t], gs[t], offsets[t]
        for i in range(chunk_start[c], chunk_stop[c]):
            p[i], acc[off + i] = adagrad_update(p[i], g[i], acc[off + i], sc)


@njit(parallel=True, cache=True)
def _global_grad_norm(gs, chunk_tensor, chunk_start, chunk_stop):
    partial = np.zeros(chunk_tensor.shape[0], dtype=np.float64)
    for c in prange(chunk_tensor.shape[0]):
        g = gs[chunk_tensor[c]]
        s = 0.0
        for i in range(chunk_start[c], chunk_stop[c]):
            s += np.float64(g[i] * g[i])
        partial[c] = s
    return np.sqrt(partial.sum())


@njit(parallel=True, cache=True)
def lamb(ps, gs, m, v, offsets, chunk_tensor, chunk_start, chunk_stop, ntensors, sc):
    nchunks = chunk_tensor.shape[0]
    grad_scale = np.float32(1.0)
    if sc.max_grad_norm > 0:
        norm = _global_grad_norm(gs, chunk_tensor, chunk_start, chunk_stop)
        grad_scale = np.float32(clip_scale(norm, np.float64(sc.max_grad_norm)))
    # Pass 1: moments, and per-chunk sums of p^2 and u^2 (float64 accumulators).
    p_sq = np.zeros(nchunks, dtype=np.float64)
    u_sq = np.zeros(nchunks, dtype=np.float64)
    for c in prange(nchunks):
        t = chunk_tensor[c]
        p, g, off = ps[t], gs[t], offsets[t]
        sp = 0.0
        su = 0.0
        for i in range(chunk_start[c], chunk_stop[c]):
            j = off + i
            m[j], v[j] = lamb_moments(g[i], m[j], v[j], grad_scale, sc)
            u = lamb_direction(p[i], m[j], v[j], sc)
            sp += np.float64(p[i] * p[i])
            su += np.float64(u * u)
        p_sq[c] = sp
        u_sq[c] = su
    # Per-tensor trust ratios (chunks of a tensor are contiguous in the table).
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
        t = chunk_tensor[c]
        p, off = ps[t], offsets[t]
        step = sc.lr * ratio[t]
        for i in range(chunk_start[c], chunk_stop[c]):
            j = off + i
            p[i] = p[i] - step * lamb_direction(p[i], m[j], v[j], sc)
