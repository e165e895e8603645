"""Chunks claimed one at a time by numba's threads, instead of a static share each.

A ``prange`` over the chunk table gives each of numba's threads a fixed, contiguous share (the omp
and workqueue layers split statically; ``numba.set_parallel_chunksize`` does not change that
there). A step then lasts as long as its slowest thread, and a thread that the scheduler takes off
its core for a time slice (the offload's step runs beside the thread that drives the GPU, torch's
threads and the copies) holds up the whole step by its share. Here each thread runs a loop that
claims the next chunk from a shared counter (one atomic add a chunk of 32K elements): a thread that
is held up delays the step by at most the chunk it holds, and the others take the rest.

    next_chunk = counter()
    for _loop in prange(loops(nchunks)):
        c = claim(next_chunk)
        while c < nchunks:
            ...  # chunk c
            c = claim(next_chunk)

The ``prange`` runs :data:`LOOPS` claiming loops (or one a chunk, if fewer), split statically over
the threads as before: a thread's first loop claims chunks until none is left, its others find
none. So no thread count is read in compiled code (numba's ``get_num_threads`` is a dynamic global,
and a loop that calls it cannot be cached on disk), and a machine with up to LOOPS threads uses
them all.

Which thread steps which chunk changes from run to run; what a chunk computes does not (every
chunk is stepped exactly once, by one thread), so results stay bit-for-bit the same.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from optirs.core.compile_cache import cached_njit


@intrinsic
def claim(typingctx, counter):
    """``counter[0]`` before adding 1 to it, atomically (int64[1]): the next unclaimed chunk."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


LOOPS = 256  # claiming loops a parallel step starts (each thread runs its static share of them)


@cached_njit()
def counter():
    """A chunk counter at 0. Made here, not by ``np.zeros`` in the parallel function: there numba's
    parfor pass turns ``np.zeros`` into a fill loop that it then drops as dead (it does not see
    :func:`claim` read the array), and the count started from whatever the memory held."""
    return np.zeros(1, np.int64)


@cached_njit()
def loops(nchunks):
    """How many claiming loops to start for ``nchunks`` chunks: LOOPS, or one a chunk if fewer."""
    return max(1, min(LOOPS, nchunks))


__all__ = ["LOOPS", "claim", "counter", "loops"]
