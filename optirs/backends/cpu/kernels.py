"""The CPU backend's compiled loops (imported when the backend opens: this imports numba).

Each kernel runs one parallel loop over the chunk table (tensor, start, stop). A chunk takes
plain slices of its tensor and of the flat state buffers and runs a simple counted loop that
calls the per-element function from :mod:`optirs.backends.common.elementwise`; written this way (flags
tested outside the loop, IEEE division via ``error_model="numpy"``) LLVM vectorizes it.
``pointwise`` serves every elementwise optimizer (its element step is chosen by the scalars'
type when it compiles, and cached on disk per optimizer family); LAMB has passes of its own.
Parameters and gradients are numba typed lists of 1-D views.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, prange, types
from numba.extending import intrinsic
from numba.typed import List

from optirs.backends.cpu.claims import claim, counter, loops
from optirs.backends.common.elementwise import (element_update, lamb_direction, lamb_grad_scale, lamb_moments,
                                               lamb_trust_ratio)
from optirs.core.compile_cache import cached_njit

jit = cached_njit(parallel=True, error_model="numpy")


@intrinsic
def _data_pointer(typingctx, address, like):
    """``address`` as a pointer to elements of ``like``'s dtype."""
    sig = types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@cached_njit()
def _views_list(addresses, sizes, like):
    out = List()
    for i in range(addresses.shape[0]):
        out.append(carray(_data_pointer(addresses[i], like), (sizes[i],)))
    return out


def typed_list(arrays):
    """A numba typed list of 1-D contiguous ``arrays`` (all of one dtype), built in compiled code:
    numba's own ``List.append`` from Python compiles its helpers in every process (about a
    second), this builder is cached on disk with the kernels."""
    if not arrays:
        return List.empty_list(types.float32[::1])
    first = arrays[0]
    addresses = np.fromiter((a.ctypes.data for a in arrays), np.int64, len(arrays))
    sizes = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
    for a in arrays:
        if a.dtype != first.dtype or a.ndim != 1 or not a.flags.c_contiguous:
            raise TypeError(f"typed_list takes 1-D contiguous arrays of one dtype, got {a.dtype} {a.shape}")
    out = _views_list(addresses, sizes, first[:1] if first.size else np.empty(1, first.dtype))
    out.borrowed = arrays  # the views borrow these arrays' memory: they live as long as the list
    return out


@njit(error_model="numpy")  # compiled into pointwise (and cached with it): its loops inline and vectorize
def _pointwise_chunk(ps, gs, s0, s1, s2, used, offsets, t, s, e, sc):
    """:func:`pointwise`'s elements ``s`` to ``e`` of tensor ``t`` (one chunk)."""
    zero = np.float32(0.0)
    o = offsets[t] + s
    n = e - s
    p, g = ps[t][s:e], gs[t][s:e]
    if used == 7:
        a, b, x = s0[o : o + n], s1[o : o + n], s2[o : o + n]
        for i in range(n):
            p[i], a[i], b[i], x[i] = element_update(p[i], g[i], a[i], b[i], x[i], sc)
    elif used == 3:
        a, b = s0[o : o + n], s1[o : o + n]
        for i in range(n):
            p[i], a[i], b[i], _ = element_update(p[i], g[i], a[i], b[i], zero, sc)
    elif used == 5:
        a, x = s0[o : o + n], s2[o : o + n]
        for i in range(n):
            p[i], a[i], _, x[i] = element_update(p[i], g[i], a[i], zero, x[i], sc)
    elif used == 1:
        a = s0[o : o + n]
        for i in range(n):
            p[i], a[i], _, _ = element_update(p[i], g[i], a[i], zero, zero, sc)
    elif used == 6:
        b, x = s1[o : o + n], s2[o : o + n]
        for i in range(n):
            p[i], _, b[i], x[i] = element_update(p[i], g[i], zero, b[i], x[i], sc)
    elif used == 2:
        b = s1[o : o + n]
        for i in range(n):
            p[i], _, b[i], _ = element_update(p[i], g[i], zero, b[i], zero, sc)
    elif used == 4:
        x = s2[o : o + n]
        for i in range(n):
            p[i], _, _, x[i] = element_update(p[i], g[i], zero, zero, x[i], sc)
    else:
        for i in range(n):
            p[i], _, _, _ = element_update(p[i], g[i], zero, zero, zero, sc)


@jit
def pointwise(ps, gs, s0, s1, s2, used, offsets, chunk_tensor, chunk_start, chunk_stop, sc):
    """Every elementwise optimizer: the element step of ``sc``'s family over the chunk table.

    Bit k of ``used`` says state slot k exists. Each combination has its own inner loop, so
    the flags are tested once per chunk and LLVM vectorizes a plain counted loop; a missing
    slot is read as 0 and never written. Each thread claims the next chunk until none is left
    (:mod:`optirs.backends.cpu.claims`).
    """
    nchunks = chunk_tensor.shape[0]
    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            _pointwise_chunk(ps, gs, s0, s1, s2, used, offsets, chunk_tensor[c], chunk_start[c], chunk_stop[c], sc)
            c = claim(next_chunk)


@intrinsic
def _sum_add(typingctx, a, b):
    """``a + b`` (float64) with LLVM's ``reassoc`` flag on this addition alone: a loop's running sum
    of them becomes one sum per vector lane, added up after the loop (a sum in order is a chain of
    dependent additions that does not vectorize; the values summed keep their IEEE operations)."""
    if a != types.float64 or b != types.float64:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1], flags=("reassoc",))

    return types.float64(types.float64, types.float64), codegen


@cached_njit(error_model="numpy")
def _sum_squares(x):
    """The float64 sum of the squares of ``x`` by vector lanes (LAMB's and the clipping's norms).
    Each value is widened before it is squared: a float32 square overflows from |x| ~ 1.8e19 on,
    where the norm itself is still finite."""
    total = 0.0
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        total = _sum_add(total, xi * xi)
    return total


@cached_njit(error_model="numpy")
def _moments_and_directions(p, g, m, v, u, grad_scale, sc):
    """LAMB's pass 1 for a chunk: the new moments, written, and each element's direction into ``u``
    (float32 scratch, summed apart: a float64 sum in this loop would hold it to 4 vector lanes)."""
    for i in range(p.shape[0]):
        mi, vi = lamb_moments(g[i], m[i], v[i], grad_scale, sc)
        m[i], v[i] = mi, vi
        u[i] = lamb_direction(p[i], mi, vi, sc)


@jit
def _global_grad_norm(gs, chunk_tensor, chunk_start, chunk_stop):
    partial = np.zeros(chunk_tensor.shape[0], dtype=np.float64)
    next_chunk = counter()
    for _loop in prange(loops(chunk_tensor.shape[0])):
        c = claim(next_chunk)
        while c < chunk_tensor.shape[0]:
            partial[c] = _sum_squares(gs[chunk_tensor[c]][chunk_start[c] : chunk_stop[c]])
            c = claim(next_chunk)
    return np.sqrt(partial.sum())


@cached_njit(error_model="numpy")
def chunk_trust_ratios(p_sq, u_sq, chunk_tensor, ntensors, max_trust_ratio):
    """LAMB's per-tensor trust ratios (float32) from the chunks' float64 sums of p^2 and u^2, summed
    per tensor in chunk order (the float32 step and the formats step share it)."""
    pn = np.zeros(ntensors, dtype=np.float64)
    un = np.zeros(ntensors, dtype=np.float64)
    for c in range(chunk_tensor.shape[0]):
        pn[chunk_tensor[c]] += p_sq[c]
        un[chunk_tensor[c]] += u_sq[c]
    ratio = np.empty(ntensors, dtype=np.float32)
    for t in range(ntensors):
        ratio[t] = np.float32(lamb_trust_ratio(np.sqrt(pn[t]), np.sqrt(un[t]), np.float64(max_trust_ratio)))
    return ratio


@jit
def lamb(ps, gs, m, v, offsets, chunk_tensor, chunk_start, chunk_stop, ntensors, sc):
    nchunks = chunk_tensor.shape[0]
    norm = 0.0
    if sc.max_grad_norm > 0:
        norm = _global_grad_norm(gs, chunk_tensor, chunk_start, chunk_stop)
    grad_scale = lamb_grad_scale(norm, sc)
    # Pass 1: moments and directions, then the chunk's sums of p^2 and u^2 (float64) while it is in cache.
    p_sq = np.zeros(nchunks, dtype=np.float64)
    u_sq = np.zeros(nchunks, dtype=np.float64)
    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
            o = offsets[t] + s
            p, g, mc, vc = ps[t][s:e], gs[t][s:e], m[o : o + e - s], v[o : o + e - s]
            u = np.empty(e - s, dtype=np.float32)
            _moments_and_directions(p, g, mc, vc, u, grad_scale, sc)
            p_sq[c] = _sum_squares(p)
            u_sq[c] = _sum_squares(u)
            c = claim(next_chunk)
    ratio = chunk_trust_ratios(p_sq, u_sq, chunk_tensor, ntensors, sc.max_trust_ratio)
    # Pass 2: apply; u is recomputed from the same float32 inputs, so it is the same value.
    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            t, s, e = chunk_tensor[c], chunk_start[c], chunk_stop[c]
            o = offsets[t] + s
            p, mc, vc = ps[t][s:e], m[o : o + e - s], v[o : o + e - s]
            step = sc.lr * ratio[t]
            for i in range(e - s):
                p[i] = p[i] - step * lamb_direction(p[i], mc[i], vc[i], sc)
            c = claim(next_chunk)
