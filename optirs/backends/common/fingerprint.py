"""The per-element terms of an array's fingerprint (``optirs_fingerprint``), shared by the cpu loop
and the cuda kernel (numba compiles these as device functions there).

An element is read as its bit word ``u`` of ``bits`` (16 or 32) bits, held in a uint32. Its
fingerprint terms are the word as a signed integer of its width (summed, wrapping in int64) and
the key ``(o << 31) | (INDEX_MASK - (i & INDEX_MASK))`` (the largest kept), where ``o`` is the word
in floating-point order as 32 bits: larger values have larger ``o`` (the sign bit set where it was
clear, every bit flipped where it was set; a 16-bit word shifted up by 16). The key is below 2**63,
so an int64 maximum starting from 0 keeps it.
"""

from __future__ import annotations

import numpy as np

from optirs.core.compile_cache import cached_njit
from optirs.plugin.hookspecs import FINGERPRINT_INDEX_MASK as INDEX_MASK

_jit = cached_njit(error_model="numpy")


@_jit
def fingerprint_word(u, bits):
    """The word ``u`` (uint32 holding ``bits`` bits) as a signed integer of its width, in int64."""
    w = np.int64(u)
    if bits == 32:
        return w - np.int64(1 << 32) if w >= np.int64(1 << 31) else w
    return w - np.int64(1 << 16) if w >= np.int64(1 << 15) else w


@_jit
def fingerprint_key(u, bits, i):
    """Element ``i``'s key: its word in floating-point order, then its index (the first wins a tie)."""
    w = np.int64(u)
    if bits == 32:
        o = w ^ np.int64(0x80000000) if w < np.int64(0x80000000) else np.int64(0xFFFFFFFF) - w
    else:
        o = (w ^ np.int64(0x8000) if w < np.int64(0x8000) else np.int64(0xFFFF) - w) << np.int64(16)
    return (o << np.int64(31)) | (np.int64(INDEX_MASK) - (np.int64(i) & np.int64(INDEX_MASK)))


@_jit
def fold_word(total, best, w, bits, i):
    """(sum, largest key) with the elements of the 32-bit word ``w`` (uint32) added: one element of 32
    bits at index ``i``, or two of 16 bits at ``i`` and ``i + 1`` (the low half first: little-endian)."""
    if bits == 32:
        return total + fingerprint_word(w, 32), max(best, fingerprint_key(w, 32, i))
    lo = w & np.uint32(0xFFFF)
    hi = w >> np.uint32(16)
    return (total + fingerprint_word(lo, 16) + fingerprint_word(hi, 16),
            max(best, fingerprint_key(lo, 16, i), fingerprint_key(hi, 16, i + 1)))


def check_request(widths, contiguous, out_shape, out_dtype, out_contiguous, rows):
    """The InvalidParameterError of a fingerprint request the hook must refuse, or None: ``widths``
    (bytes an element) and ``contiguous`` describe each array."""
    from optirs.core.errors import InvalidParameterError

    for k, (width, c) in enumerate(zip(widths, contiguous)):
        if width not in (2, 4):
            return InvalidParameterError(f"arrays[{k}] has {width}-byte elements, expected 2 or 4 (bit words of "
                                         "float16 / bfloat16 / float32)")
        if not c:
            return InvalidParameterError(f"arrays[{k}] is not C-contiguous, expected a contiguous array")
    if np.dtype(out_dtype) != np.int64 or len(out_shape) != 2 or out_shape[1] != 2 or not out_contiguous:
        return InvalidParameterError(f"out is {out_dtype} of shape {tuple(out_shape)}, expected C-contiguous "
                                     "int64 of shape (n, 2)")
    if len(rows) != len(widths):
        return InvalidParameterError(f"rows has {len(rows)} entries for {len(widths)} arrays, expected one each")
    for k, r in enumerate(rows):
        if not 0 <= int(r) < out_shape[0]:
            return InvalidParameterError(f"rows[{k}] is {r}, expected a row of out (0 to {out_shape[0] - 1})")
    if len(set(int(r) for r in rows)) != len(rows):
        return InvalidParameterError(f"rows {list(rows)} name a row twice, expected one row per array")
    return None


__all__ = ["INDEX_MASK", "check_request", "fingerprint_key", "fingerprint_word", "fold_word"]
