"""The cpu backend's format loops (imported on the first format step: this imports numba).

One ``prange`` over the chunk table per pass. Chunks start at multiples of the chunk size inside
each tensor, a multiple of the int8 block (256), so every block lies in one chunk: a chunk walks
its blocks, decodes each block's state slots into float32 scratch, runs the shared format element
step (:func:`optirs.backends.common.formats.format_element`) on every element, and encodes the
block back (an int8 block's scale is the absmax of its new values). Every word array is passed
with the dtype it has (float32 buffers as uint32 views); numba compiles one loop per combination
and caches it on disk. The format codes ``fc`` are uniform over the launch.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from optirs.backends.common.elementwise import lamb_grad_scale, lamb_trust_ratio
from optirs.backends.common.formats import (absmax_update, decode_state, decode_value, encode_state, format_element,
                                            lamb_format_element, quantize, store_master, stream_key)
from optirs.core.formats import BLOCK, STATE_INT8

_jit = njit(cache=True, error_model="numpy")
_pjit = njit(parallel=True, cache=True, error_model="numpy")


@_jit
def _load_block(w, scales, small, q, kind, blk, so, o, n, buf):
    """Decode ``n`` state values of one block (flat word offset ``o``) into ``buf``.
    int8: ``blk`` the block's scale index, or ``so`` >= 0 for a small tensor's float32 range."""
    if kind == STATE_INT8:
        if so >= 0:
            for i in range(n):
                buf[i] = small[so + i]
        else:
            s = scales[blk]
            for i in range(n):
                buf[i] = q[w[o + i]] * s
    else:
        for i in range(n):
            buf[i] = decode_state(w[o + i], kind)


@_jit
def _store_block(w, scales, small, mid, kind, blk, so, o, n, buf, key):
    """Encode ``buf`` back (the inverse of :func:`_load_block`); bfloat16 words round with ``key``."""
    if kind == STATE_INT8:
        if so >= 0:
            for i in range(n):
                small[so + i] = buf[i]
        else:
            m = np.float32(0)
            for i in range(n):
                m = absmax_update(m, buf[i])
            scales[blk] = m
            for i in range(n):
                w[o + i] = quantize(buf[i], m, mid)
    else:
        for i in range(n):
            w[o + i] = encode_state(buf[i], kind, key, o + i)


@_jit
def _master_word(mbuf, idx, has_master):
    return np.uint32(np.int64(mbuf[idx]) & 0xFFFFFFFF) if has_master else np.uint32(0)


@_pjit
def pointwise(ps, gs, mbuf, w0, c0, m0, w1, c1, m1, w2, c2, m2, q0, d0, q1, d1, q2, d2, used, table,
              chunk_tensor, chunk_start, chunk_stop, sc, fc, fresh, seed, step):
    """A pointwise family's format step over the chunk table.

    ``ps``/``gs``: typed lists of each tensor's parameter / gradient words (uint32 views of
    float32, or uint16). ``mbuf``: the master buffer (uint32 view of float32, int16 or int8
    remainders; empty without masters). Slot k: words ``wk`` (uint32 view, uint16 bfloat16 bits
    or uint8 codes), int8 scales ``ck`` and small-tensor values ``mk``, its map ``qk`` and
    midpoints ``dk``; bit k of ``used`` says it exists. ``table``: FormatState.tensor_table().
    """
    has_master = mbuf.shape[0] > 0
    kind = fc.state
    keyp = stream_key(seed, step, 0)
    k0, k1, k2 = stream_key(seed, step, 1), stream_key(seed, step, 2), stream_key(seed, step, 3)
    for c in prange(chunk_tensor.shape[0]):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        p, g = ps[t], gs[t]
        off, blk0, so = table[t, 0], table[t, 1], table[t, 2]
        a0 = np.zeros(BLOCK, np.float32)
        a1 = np.zeros(BLOCK, np.float32)
        a2 = np.zeros(BLOCK, np.float32)
        for b in range(s, e, BLOCK):
            n = min(BLOCK, e - b)
            blk = blk0 + b // BLOCK
            sob = so + b if so >= 0 else so
            o = off + b
            if used & 1:
                _load_block(w0, c0, m0, q0, kind, blk, sob, o, n, a0)
            if used & 2:
                _load_block(w1, c1, m1, q1, kind, blk, sob, o, n, a1)
            if used & 4:
                _load_block(w2, c2, m2, q2, kind, blk, sob, o, n, a2)
            for i in range(n):
                idx = o + i
                pw, mw, x0, x1, x2 = format_element(np.uint32(p[b + i]), _master_word(mbuf, idx, has_master),
                                                    np.uint32(g[b + i]), a0[i], a1[i], a2[i], sc, fc, fresh, keyp, idx)
                p[b + i] = pw
                if has_master:
                    mbuf[idx] = mw
                if used & 1:
                    a0[i] = x0
                if used & 2:
                    a1[i] = x1
                if used & 4:
                    a2[i] = x2
            if used & 1:
                _store_block(w0, c0, m0, d0, kind, blk, sob, o, n, a0, k0)
            if used & 2:
                _store_block(w1, c1, m1, d1, kind, blk, sob, o, n, a1, k1)
            if used & 4:
                _store_block(w2, c2, m2, d2, kind, blk, sob, o, n, a2, k2)


@_jit
def _grad_sum_squares(g, s, e, kind):
    total = 0.0
    for i in range(s, e):
        x = np.float64(decode_value(np.uint32(g[i]), kind))
        total += x * x
    return total


@_pjit
def lamb(ps, gs, mbuf, w0, c0, m0, w1, c1, m1, q0, d0, q1, d1, table, chunk_tensor, chunk_start, chunk_stop,
         ntensors, sc, fc, fresh, seed, step):
    """LAMB's format step: the global gradient norm (with max_grad_norm), pass 1 (the per-tensor
    float64 sums of p^2 and u^2, nothing written), the trust ratios, pass 2 (the same values
    recomputed; parameter, master and moments written). Slots as :func:`pointwise` (exp_avg, exp_avg_sq)."""
    nchunks = chunk_tensor.shape[0]
    has_master = mbuf.shape[0] > 0
    kind = fc.state
    norm = 0.0  # unused without clipping: the scale is then the gradient factor alone
    if sc.max_grad_norm > 0:
        partial = np.zeros(nchunks, dtype=np.float64)
        for c in prange(nchunks):
            partial[c] = _grad_sum_squares(gs[chunk_tensor[c]], chunk_start[c], chunk_stop[c], fc.grad)
        norm = np.sqrt(partial.sum())
    grad_scale = lamb_grad_scale(norm, sc)  # the gradient factor times the clip of the factored norm
    p_sq = np.zeros(nchunks, dtype=np.float64)
    u_sq = np.zeros(nchunks, dtype=np.float64)
    for c in prange(nchunks):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        p, g = ps[t], gs[t]
        off, blk0, so = table[t, 0], table[t, 1], table[t, 2]
        a0 = np.zeros(BLOCK, np.float32)
        a1 = np.zeros(BLOCK, np.float32)
        ps_c, us_c = 0.0, 0.0
        for b in range(s, e, BLOCK):
            n = min(BLOCK, e - b)
            blk = blk0 + b // BLOCK
            sob = so + b if so >= 0 else so
            o = off + b
            _load_block(w0, c0, m0, q0, kind, blk, sob, o, n, a0)
            _load_block(w1, c1, m1, q1, kind, blk, sob, o, n, a1)
            for i in range(n):
                x, _, _, u = lamb_format_element(np.uint32(p[b + i]), _master_word(mbuf, o + i, has_master),
                                                 np.uint32(g[b + i]), a0[i], a1[i], grad_scale, sc, fc, fresh)
                ps_c += np.float64(x) * np.float64(x)
                us_c += np.float64(u) * np.float64(u)
        p_sq[c], u_sq[c] = ps_c, us_c
    pn = np.zeros(ntensors, dtype=np.float64)
    un = np.zeros(ntensors, dtype=np.float64)
    for c in range(nchunks):
        pn[chunk_tensor[c]] += p_sq[c]
        un[chunk_tensor[c]] += u_sq[c]
    ratio = np.empty(ntensors, dtype=np.float32)
    for t in range(ntensors):
        ratio[t] = np.float32(lamb_trust_ratio(np.sqrt(pn[t]), np.sqrt(un[t]), np.float64(sc.max_trust_ratio)))
    keyp = stream_key(seed, step, 0)
    k0, k1 = stream_key(seed, step, 1), stream_key(seed, step, 2)
    for c in prange(nchunks):
        t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
        p, g = ps[t], gs[t]
        off, blk0, so = table[t, 0], table[t, 1], table[t, 2]
        a0 = np.zeros(BLOCK, np.float32)
        a1 = np.zeros(BLOCK, np.float32)
        lr_t = sc.lr * ratio[t]
        for b in range(s, e, BLOCK):
            n = min(BLOCK, e - b)
            blk = blk0 + b // BLOCK
            sob = so + b if so >= 0 else so
            o = off + b
            _load_block(w0, c0, m0, q0, kind, blk, sob, o, n, a0)
            _load_block(w1, c1, m1, q1, kind, blk, sob, o, n, a1)
            for i in range(n):
                idx = o + i
                x, mn, vn, u = lamb_format_element(np.uint32(p[b + i]), _master_word(mbuf, idx, has_master),
                                                   np.uint32(g[b + i]), a0[i], a1[i], grad_scale, sc, fc, fresh)
                pw, mw = store_master(x - lr_t * u, fc, keyp, idx)
                p[b + i] = pw
                if has_master:
                    mbuf[idx] = mw
                a0[i], a1[i] = mn, vn
            _store_block(w0, c0, m0, d0, kind, blk, sob, o, n, a0, k0)
            _store_block(w1, c1, m1, d1, kind, blk, sob, o, n, a1, k1)


@_pjit
def check(gs, chunk_tensor, chunk_start, chunk_stop, kind, flags):
    """flags[c] = 1 where chunk c holds a gradient that is not finite."""
    for c in prange(chunk_tensor.shape[0]):
        g = gs[chunk_tensor[c]]
        bad = 0
        for i in range(chunk_start[c], chunk_stop[c]):
            if not math.isfinite(decode_value(np.uint32(g[i]), kind)):
                bad = 1
        flags[c] = bad
