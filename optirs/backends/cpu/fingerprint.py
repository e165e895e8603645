"""The ``fingerprint`` capability on the cpu backend: one pass over each array's words.

Parts of 64K elements each sum their words and keep their largest key
(:mod:`optirs.backends.common.fingerprint`, the terms the cuda kernel shares); the parts fold in
order. An array of more than one part is taken by numba's threads in parallel; an array of one
part by the same loop compiled serial, in the calling thread: a parallel launch wakes every
thread, about 100 us on the 2-core machine, many times what a small gradient's words take (a
model's biases and norms are most of its gradients). numba is imported when the loop is first
needed, not when the backend is imported.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import hookimpl

PART = 1 << 16  # elements a thread takes at a time
_KERNEL: list = []  # the compiled loops (parallel, serial), built on first use
# bound by _kernel() before the loop compiles (numba reads them as globals; importing this module
# imports no numba)
prange: Any = range
fingerprint_word: Any = None
fingerprint_key: Any = None


def _fingerprint_words(u, bits):
    """(sum, largest key) of the words ``u`` (uint32 or uint16) of ``bits`` bits."""
    n = u.shape[0]
    parts = (n + PART - 1) // PART
    sums = np.zeros(parts, np.int64)
    keys = np.zeros(parts, np.int64)
    for c in prange(parts):
        total = np.int64(0)
        best = np.int64(0)
        for i in range(c * PART, min(n, (c + 1) * PART)):
            w = np.uint32(u[i])
            total += fingerprint_word(w, bits)
            best = max(best, fingerprint_key(w, bits, i))
        sums[c] = total
        keys[c] = best
    total = np.int64(0)
    best = np.int64(0)
    for c in range(parts):
        total += sums[c]
        best = max(best, keys[c])
    return total, best


def _kernel():
    global prange, fingerprint_word, fingerprint_key
    if not _KERNEL:
        import numba

        from optirs.backends.common import fingerprint as terms
        from optirs.core.compile_cache import cached_njit, prepare_kernel_compilation

        prepare_kernel_compilation()
        prange, fingerprint_word, fingerprint_key = numba.prange, terms.fingerprint_word, terms.fingerprint_key
        _KERNEL.append(cached_njit(parallel=True, error_model="numpy")(_fingerprint_words))
        _KERNEL.append(cached_njit(error_model="numpy")(_fingerprint_words))  # prange runs as range
    return _KERNEL


class CpuFingerprint:
    """Mixin of :class:`optirs.backends.cpu.CpuBackend`: arrays and ``out`` are host numpy arrays."""

    @hookimpl
    def optirs_fingerprint(self, ctx: Any, arrays: Sequence[Any], out: Any, rows: Sequence[int]) -> None:
        from optirs.backends.common.fingerprint import check_request

        for k, a in enumerate(list(arrays) + [out]):
            if not isinstance(a, np.ndarray):
                what = f"arrays[{k}]" if k < len(arrays) else "out"
                raise InvalidParameterError(
                    f"{what} is a {type(a).__module__}.{type(a).__name__}, expected a numpy array on the cpu backend")
        error = check_request([a.itemsize for a in arrays], [a.flags.c_contiguous for a in arrays], out.shape,
                              out.dtype, out.flags.c_contiguous and out.flags.writeable, rows)
        if error is not None:
            raise error
        parallel, serial = _kernel()
        for a, r in zip(arrays, rows):
            words = a.reshape(-1).view(np.uint32 if a.itemsize == 4 else np.uint16)
            loop = parallel if words.shape[0] > PART else serial
            out[int(r)] = loop(words, 32 if a.itemsize == 4 else 16)
