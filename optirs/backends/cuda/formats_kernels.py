"""The cuda backend's formats kernels (imported on the first formats call: imports numba.cuda).

Every kernel covers the whole model in one launch, driven by the tables of
:mod:`optirs.backends.cuda.kernels` (the chunk table ``tensor, start, count, state offset`` and
the pointer table ``param, grad`` addresses) plus the formats' tensor table (``state offset,
first int8 block, small-state offset``, :meth:`optirs.core.formats.FormatState.tensor_table`).

Work is cut in groups of 256 elements, one warp per group and 8 consecutive elements per lane:
8 bfloat16/float16 values are one 16-byte load, 8 int8 codes or remainders one 8-byte load
(:mod:`optirs.backends.cuda.formats_memory`). A group is exactly one int8 block (blocks and chunks
both start at multiples of 256 from the start of their tensor), so a block's absmax is a warp
reduction in registers (``shfl.sync.bfly``), with no shared memory and no barrier. Chunks whose
addresses are not aligned for the vector accesses take scalar loads of the same 8 elements.

The loops are uniform over a thread block (every warp runs the same number of rounds, lanes past
the end carry no elements), because numba's simulator has no warp shuffle: there the butterfly
is emulated through shared memory and ``syncthreads``, which needs every thread of the block.

Per-element format math (encodings, random bits, remainders, the int8 map) is the shared numba
code of :mod:`optirs.backends.common.formats`; the optimizer math is ``element_update`` of
:mod:`optirs.backends.common.elementwise`. The kernels here only move memory and reduce.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from optirs.backends.cuda.formats_memory import (ld_u8, ld_u16, ld_u32, ld_u32x2, ld_u32x4, st_u8, st_u16, st_u32,
                                                 st_u32x2, st_u32x4)
from optirs.backends.cuda.kernels import SIMULATOR, _device, ld, ld4, st, st4

GROUP = 256  # elements per warp and per int8 block
LANE = 8  # elements per lane
_FULL = 0xFFFFFFFF

# Non-finite test on raw bits: every exponent bit set (inf or NaN).
EXP_MASK = {"float32": 0x7F800000, "bfloat16": 0x7F80, "float16": 0x7C00}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------ warp reduction

if SIMULATOR:
    # The simulator has no cuda.shfl_xor_sync: exchange through shared memory (the loops are
    # block-uniform, so every thread reaches both barriers). Lives in the kernels' module, since
    # the simulator gives only this module's ``cuda`` global its per-thread state.
    def _xor_exchange(x, lane_mask):
        buf = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid ^ lane_mask]
        cuda.syncthreads()
        return float32(y)
else:
    @_device
    def _xor_exchange(x, lane_mask):
        return cuda.shfl_xor_sync(_FULL, x, lane_mask)


@_device
def warp_max(x):
    """The largest ``x`` over the 32 lanes of the warp, in every lane (NaN-propagating: a NaN in
    any lane gives NaN everywhere, so a non-finite block is not silently scaled)."""
    for k in (16, 8, 4, 2, 1):
        y = _xor_exchange(x, k)
        if y > x or y != y:
            x = y
    return x


# ------------------------------------------------------------------ the non-finite check


def make_check_kernel(grad_dtype: str):
    """``check(chunks, ptrs, nchunks, (flag,))``: ``*flag`` (an int32 at that address) = 1 when any
    gradient is inf or NaN; reads the gradients only, 16 bytes per lane per load where aligned."""
    size = ITEMSIZE[grad_dtype]
    mask = EXP_MASK[grad_dtype]
    half = size == 2

    def bad_word(w):
        if half:
            return (w & mask) == mask or ((w >> 16) & mask) == mask
        return (w & mask) == mask

    bad_word = _device(bad_word)

    def check(chunks, ptrs, nchunks, extra):
        flag = extra[0]
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        bad = False
        c = cuda.blockIdx.x
        while c < nchunks:
            n = chunks[c, 2]
            ga = ptrs[chunks[c, 0], 1] + chunks[c, 1] * size
            per_vec = 16 // size
            nvec = n // per_vec if (ga & 15) == 0 else 0
            k = tid
            while k < nvec:
                w0, w1, w2, w3 = ld_u32x4(ga + (k << 4))
                if bad_word(w0) or bad_word(w1) or bad_word(w2) or bad_word(w3):
                    bad = True
                k += nthreads
            i = nvec * per_vec + tid
            while i < n:
                w = ld_u16(ga + i * 2) if half else ld_u32(ga + i * 4)
                if (w & mask) == mask:
                    bad = True
                i += nthreads
            c += cuda.gridDim.x
        if bad:
            st_u32(flag, 1)  # every writer stores the same value: no atomic needed

    check.__name__ = check.__qualname__ = f"formats_check_{grad_dtype}"
    return check
